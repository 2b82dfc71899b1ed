"""R-Drop (Regularized Dropout, NeurIPS 2021) as a fairseq plugin.

Use it with ``--user-dir $(python -m rdrop_fairseq)`` and one of the criteria
``label_smoothed_cross_entropy_rdrop``, ``cross_entropy_rdrop``, ``adaptive_loss_rdrop``,
``sentence_prediction_rdrop``; and AttendOut: the model ``roberta_attendout`` and the task
``sentence_prediction_attendout`` (docs/attendout.md). The framework-free core is :mod:`rdrop_fairseq.core`; it
needs only torch.
"""

import importlib.util

from .checkpoint_compat import allow_fairseq_checkpoint_globals

__version__ = "0.1.0"

# Importing the plugin (which is what --user-dir does) makes torch >= 2.6 load fairseq
# checkpoints for training resumption, fairseq-generate and fairseq-eval-lm.
allow_fairseq_checkpoint_globals()

# Without fairseq the core is still usable; with it, the criteria get registered. (The two
# fairseq 0.12 bugs the summarization recipe hits are fixed by that recipe alone, not here:
# see fairseq_fixes.)
if importlib.util.find_spec("fairseq") is not None:
    from . import criterions, models, tasks  # noqa: F401,E402
