"""R-Drop over fairseq's ``cross_entropy`` (language models such as ``transformer_lm_gpt``)."""

from dataclasses import dataclass

from fairseq.criterions import register_criterion
from fairseq.criterions.cross_entropy import CrossEntropyCriterion, CrossEntropyCriterionConfig

from .rdrop import RDropConfig, RDropCriterionMixin


@dataclass
class CrossEntropyRDropConfig(CrossEntropyCriterionConfig, RDropConfig):
    pass


@register_criterion("cross_entropy_rdrop", dataclass=CrossEntropyRDropConfig)
class CrossEntropyRDropCriterion(RDropCriterionMixin, CrossEntropyCriterion):
    def __init__(self, cfg: CrossEntropyRDropConfig, task):
        super().__init__(task, cfg.sentence_avg)
        self.init_rdrop_from(cfg, "cross_entropy")

    def rdrop_forward(self, model, sample):
        loss, sample_size, logging_output = self.token_level_forward(model, sample, epsilon=0.0)
        del logging_output["nll_loss"]  # cross_entropy logs the NLL as its loss
        return loss, sample_size, logging_output
