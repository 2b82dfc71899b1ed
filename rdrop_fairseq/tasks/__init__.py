"""fairseq tasks of the plugin; importing this package registers them."""

from .sentence_prediction_attendout import SentencePredictionAttendOutTask

__all__ = ["SentencePredictionAttendOutTask"]
