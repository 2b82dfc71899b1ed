"""R-Drop over fairseq's ``label_smoothed_cross_entropy`` (translation, BART summarization)."""

from dataclasses import dataclass

from fairseq.criterions import register_criterion
from fairseq.criterions.label_smoothed_cross_entropy import (
    LabelSmoothedCrossEntropyCriterion,
    LabelSmoothedCrossEntropyCriterionConfig,
)

from .rdrop import RDropConfig, RDropCriterionMixin


@dataclass
class LabelSmoothedCrossEntropyRDropConfig(LabelSmoothedCrossEntropyCriterionConfig, RDropConfig):
    pass


@register_criterion(
    "label_smoothed_cross_entropy_rdrop", dataclass=LabelSmoothedCrossEntropyRDropConfig
)
class LabelSmoothedCrossEntropyRDropCriterion(RDropCriterionMixin,
                                              LabelSmoothedCrossEntropyCriterion):
    def __init__(self, cfg: LabelSmoothedCrossEntropyRDropConfig, task):
        super().__init__(task, cfg.sentence_avg, cfg.label_smoothing, cfg.ignore_prefix_size,
                         cfg.report_accuracy)
        self.init_rdrop_from(cfg, "label_smoothed_cross_entropy")

    def rdrop_forward(self, model, sample):
        return self.token_level_forward(model, sample, epsilon=self.eps)
