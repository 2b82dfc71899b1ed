"""R-Drop over fairseq's ``label_smoothed_cross_entropy`` (translation, BART summarization)."""

from dataclasses import dataclass

from fairseq.criterions import register_criterion
from fairseq.criterions.label_smoothed_cross_entropy import (
    LabelSmoothedCrossEntropyCriterion,
    LabelSmoothedCrossEntropyCriterionConfig,
)

from ..core import rdrop_nll_loss
from .rdrop import RDropConfig, RDropMixin


@dataclass
class LabelSmoothedCrossEntropyRDropConfig(LabelSmoothedCrossEntropyCriterionConfig, RDropConfig):
    pass


@register_criterion(
    "label_smoothed_cross_entropy_rdrop", dataclass=LabelSmoothedCrossEntropyRDropConfig
)
class LabelSmoothedCrossEntropyRDropCriterion(RDropMixin, LabelSmoothedCrossEntropyCriterion):
    def __init__(self, task, sentence_avg, label_smoothing, ignore_prefix_size=0,
                 report_accuracy=False, rdrop_alpha=0.0, rdrop_two_passes=False):
        super().__init__(task, sentence_avg, label_smoothing, ignore_prefix_size, report_accuracy)
        self.init_rdrop(rdrop_alpha, rdrop_two_passes, "label_smoothed_cross_entropy")

    def forward(self, model, sample, reduce=True):
        if not self.rdrop_active(model):
            return super().forward(model, sample, reduce=reduce)
        return token_level_rdrop_forward(self, model, sample, reduce, epsilon=self.eps)

    @classmethod
    def reduce_metrics(cls, logging_outputs) -> None:
        super().reduce_metrics(logging_outputs)
        cls.reduce_rdrop_metrics(logging_outputs)


def token_level_rdrop_forward(criterion, model, sample, reduce, epsilon):
    """Two passes over ``[x; x]`` for a criterion with ``get_lprobs_and_target``.

    Returns fairseq's ``(loss, sample_size, logging_output)``: the loss is the task loss
    of both passes plus alpha times the symmetric KL, for the gradient normalised by the
    original sample size; the logged ``loss``/``nll_loss`` are the mean of the two passes
    so that they read like a baseline run's.
    """
    criterion.check_reduce(reduce)
    pair = criterion.duplicate_sample(model, sample)
    net_output = model(**pair["net_input"])
    lprobs, target = criterion.get_lprobs_and_target(model, net_output, pair)
    loss, nll_loss, kl = rdrop_nll_loss(lprobs, target, epsilon, criterion.padding_idx)
    sample_size = sample["target"].size(0) if criterion.sentence_avg else sample["ntokens"]
    logging_output = {
        "loss": loss.data / 2,
        "nll_loss": nll_loss.data / 2,
        "rdrop_kl": kl.data,
        "ntokens": sample["ntokens"],
        "nsentences": sample["target"].size(0),
        "sample_size": sample_size,
    }
    if getattr(criterion, "report_accuracy", False):
        mask = target.ne(criterion.padding_idx)
        n_correct = lprobs.argmax(1).masked_select(mask).eq(target.masked_select(mask)).sum()
        logging_output["n_correct"] = n_correct.item() / 2
        logging_output["total"] = mask.sum().item() / 2
    return loss + criterion.rdrop_alpha * kl, sample_size, logging_output
