"""R-Drop over fairseq's ``cross_entropy`` (language models such as ``transformer_lm_gpt``)."""

from dataclasses import dataclass

from fairseq.criterions import register_criterion
from fairseq.criterions.cross_entropy import CrossEntropyCriterion, CrossEntropyCriterionConfig

from .rdrop import RDropConfig, RDropMixin


@dataclass
class CrossEntropyRDropConfig(CrossEntropyCriterionConfig, RDropConfig):
    pass


@register_criterion("cross_entropy_rdrop", dataclass=CrossEntropyRDropConfig)
class CrossEntropyRDropCriterion(RDropMixin, CrossEntropyCriterion):
    def __init__(self, task, sentence_avg, rdrop_alpha=0.0, rdrop_two_passes=False,
                 rdrop_chunk_mb=0.0, rdrop_impl="auto"):
        super().__init__(task, sentence_avg)
        self.init_rdrop("cross_entropy", rdrop_alpha, rdrop_two_passes, rdrop_chunk_mb,
                        rdrop_impl)

    def forward(self, model, sample, reduce=True):
        if not self.rdrop_active(model):
            return super().forward(model, sample, reduce=reduce)
        loss, sample_size, logging_output = self.token_level_forward(
            model, sample, reduce, epsilon=0.0
        )
        del logging_output["nll_loss"]  # cross_entropy logs the NLL as its loss
        return loss, sample_size, logging_output

    @classmethod
    def reduce_metrics(cls, logging_outputs) -> None:
        super().reduce_metrics(logging_outputs)
        cls.reduce_rdrop_metrics(logging_outputs)
