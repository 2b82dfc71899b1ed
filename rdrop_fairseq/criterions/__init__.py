"""fairseq criteria with R-Drop; importing this package registers them."""

from .adaptive_loss_rdrop import AdaptiveLossRDrop
from .cross_entropy_rdrop import CrossEntropyRDropCriterion
from .label_smoothed_cross_entropy_rdrop import LabelSmoothedCrossEntropyRDropCriterion
from .sentence_prediction_rdrop import SentencePredictionRDropCriterion

__all__ = [
    "AdaptiveLossRDrop",
    "CrossEntropyRDropCriterion",
    "LabelSmoothedCrossEntropyRDropCriterion",
    "SentencePredictionRDropCriterion",
]
