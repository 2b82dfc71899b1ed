"""fairseq models of the plugin; importing this package registers them."""

from .roberta_attendout import RobertaAttendOutModel

__all__ = ["RobertaAttendOutModel"]
