"""R-Drop (Regularized Dropout, NeurIPS 2021) as a fairseq plugin.

Use it with ``--user-dir $(python -m rdrop_fairseq)`` and one of the criteria
``label_smoothed_cross_entropy_rdrop``, ``cross_entropy_rdrop``, ``adaptive_loss_rdrop``,
``sentence_prediction_rdrop``; and AttendOut: the model ``roberta_attendout`` and the task
``sentence_prediction_attendout`` (docs/attendout.md). The framework-free core,
:mod:`rdrop_fairseq.core` and :mod:`rdrop_fairseq.fused_linear`, needs only torch:
importing it does not import fairseq, even where fairseq is installed (docs/plain-pytorch.md).

The criteria, models and tasks are registered with fairseq as soon as both this package and
fairseq are imported, in either order: at once if fairseq is loaded already (``--user-dir``,
``common.user_dir``), otherwise when fairseq is first imported. :func:`register` does it
explicitly.
"""

import importlib.abc
import importlib.util
import sys

__version__ = "0.1.0"


def register():
    """Register the plugin's criteria, models and tasks with fairseq (imports fairseq), and
    make fairseq's data-parallel processes work under torch >= 2.6 and with GLUE's metrics:

    * the processes receive the checkpoint that process 0 read and sends them
      (:func:`.checkpoint_compat.trust_broadcasts_within_the_job`);
    * ``sentence_prediction`` gathers the lists of predictions of ``--report-mcc``,
      ``--report-acc-and-f1``, ``--report-pearson-and-spearman`` from the processes
      instead of failing to sum them (:mod:`.tasks.gathered_metrics`).

    Never needed after ``import fairseq`` or under ``--user-dir``; harmless to repeat. It
    also lets fairseq 0.12's data paths run under NumPy 2 (see numpy_compat). (The two
    fairseq 0.12 bugs the summarization recipe hits are fixed by that recipe alone, not
    here: see fairseq_fixes.)
    """
    from . import criterions, models, tasks  # noqa: F401
    from .checkpoint_compat import trust_broadcasts_within_the_job
    from .numpy_compat import repair_fairseq_numpy
    from .tasks.gathered_metrics import gather_sentence_prediction_metrics

    trust_broadcasts_within_the_job()
    gather_sentence_prediction_metrics()
    repair_fairseq_numpy()


class _AfterImport(importlib.abc.MetaPathFinder):
    """Calls ``then()`` once ``import NAME`` has run, then leaves ``sys.meta_path``.

    A lookup alone (``importlib.util.find_spec(NAME)``, as libraries do to test whether a
    package is installed) executes nothing: the hook stays until a module is really executed
    with the spec it returned.
    """

    name = then = None
    _searching = False  # keeps the search below from coming back here

    def find_spec(self, name, path=None, target=None):
        if name != self.name or self._searching:
            return None
        self._searching = True
        try:
            spec = importlib.util.find_spec(name)
        finally:
            self._searching = False
        if spec is not None and spec.loader is not None:
            spec.loader = _Then(spec.loader, self)
        return spec

    def executed(self):
        """The module ran: leave ``sys.meta_path`` (once), then call ``then()``."""
        if self in sys.meta_path:
            sys.meta_path.remove(self)
        self.then()


class _RegisterAfterFairseq(_AfterImport):
    """Calls :func:`register` once ``import fairseq`` has run.

    Needed because fairseq's ``import_user_module`` (``--user-dir``) imports nothing when a
    module of the user dir's name is loaded already: a script that imported ``rdrop_fairseq``
    (for the core, a recipe, ``python -m rdrop_fairseq.fairseq_fixes``) before running
    fairseq in-process would otherwise get no criteria.
    """

    name, then = "fairseq", staticmethod(register)


def _allow_fairseq_checkpoints():
    from .checkpoint_compat import allow_fairseq_checkpoint_globals

    allow_fairseq_checkpoint_globals()


class _AllowListAfterTorch(_AfterImport):
    """Allow-lists fairseq's checkpoint globals once ``import torch`` has run: a recipe module
    that only runs fairseq's tools (``python -m rdrop_fairseq.recipes.evaluate_lm``) never
    imports torch (1.8 s of start-up)."""

    name, then = "torch", staticmethod(_allow_fairseq_checkpoints)


class _Then(importlib.abc.Loader):
    """Loads a module with its own loader, puts that loader back, then tells the hook."""

    def __init__(self, loader, hook):
        self.loader = loader
        self.hook = hook

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module):
        module.__loader__ = module.__spec__.loader = self.loader
        self.loader.exec_module(module)  # if this raises, the hook stays for the next try
        self.hook.executed()


# Importing the plugin (which is what --user-dir does) makes torch >= 2.6 load fairseq
# checkpoints for training resumption, fairseq-generate and fairseq-eval-lm: at once if torch
# is loaded, otherwise when it is first imported. (On several processes, register() makes
# them receive the checkpoint process 0 read.)
if "torch" in sys.modules:
    _allow_fairseq_checkpoints()
elif importlib.util.find_spec("torch") is not None:
    sys.meta_path.insert(0, _AllowListAfterTorch())

if "fairseq" in sys.modules:
    register()
elif importlib.util.find_spec("fairseq") is not None:
    sys.meta_path.insert(0, _RegisterAfterFairseq())
