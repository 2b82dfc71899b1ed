"""R-Drop over fairseq's ``label_smoothed_cross_entropy`` (translation, BART summarization)."""

from dataclasses import dataclass

from fairseq.criterions import register_criterion
from fairseq.criterions.label_smoothed_cross_entropy import (
    LabelSmoothedCrossEntropyCriterion,
    LabelSmoothedCrossEntropyCriterionConfig,
)

from .rdrop import RDropConfig, RDropMixin


@dataclass
class LabelSmoothedCrossEntropyRDropConfig(LabelSmoothedCrossEntropyCriterionConfig, RDropConfig):
    pass


@register_criterion(
    "label_smoothed_cross_entropy_rdrop", dataclass=LabelSmoothedCrossEntropyRDropConfig
)
class LabelSmoothedCrossEntropyRDropCriterion(RDropMixin, LabelSmoothedCrossEntropyCriterion):
    def __init__(self, task, sentence_avg, label_smoothing, ignore_prefix_size=0,
                 report_accuracy=False, rdrop_alpha=0.0, rdrop_two_passes=False,
                 rdrop_chunk_mb=0.0, rdrop_impl="auto"):
        super().__init__(task, sentence_avg, label_smoothing, ignore_prefix_size, report_accuracy)
        self.init_rdrop("label_smoothed_cross_entropy", rdrop_alpha, rdrop_two_passes,
                        rdrop_chunk_mb, rdrop_impl)

    def forward(self, model, sample, reduce=True):
        if not self.rdrop_active(model):
            return super().forward(model, sample, reduce=reduce)
        return self.token_level_forward(model, sample, reduce, epsilon=self.eps)

    @classmethod
    def reduce_metrics(cls, logging_outputs) -> None:
        super().reduce_metrics(logging_outputs)
        cls.reduce_rdrop_metrics(logging_outputs)
