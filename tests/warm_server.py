"""What the warm server (tests/warm_process.py) imports once, before it forks any command.

It imports every fairseq tool's module, so that the libraries they use (torch, scipy,
scikit-learn, hydra, ...: 2.26 s of the 2.65 s ``import fairseq_cli.train`` takes here) are
loaded, and ``torch._dynamo``, which torch loads while a training builds its optimizer
(1.7 s).

fairseq's package itself (``import fairseq``: 0.35 s of every command here, some 250
commands a suite) is imported first, alone, as a new process imports it, and then set aside
(``KEPT``): out of ``sys.modules``, so that a command's own ``import fairseq`` is still the
moment it happens. There :class:`PutBackFairseq` puts the kept modules back and repeats
what that import does to the process: the ``logging.basicConfig`` calls fairseq's modules
make while being imported (the first one sets the root logger up where nothing has: the
reason ``fairseq-preprocess`` logs to stderr in Python's format), the log records they emit
(none where tensorboardX is installed), in their order, and the cache paths
``fairseq.file_utils`` reads from the environment (HOME, TORCH_HOME, PYTORCH_FAIRSEQ_CACHE).
The command's ``import fairseq`` is a new one instead where the kept package would differ
from what a new process imports: another copy of fairseq first on the command's
``sys.path``; a torch that may see a GPU (a CUDA build, CUDA_VISIBLE_DEVICES not empty:
fairseq's import counts the GPUs into its defaults, ``distributed_world_size``, and the
server, which sees none, counted 0); a LOCAL_RANK other than the server's (the default of
``device_id``).
The modules of fairseq's tools (``fairseq_cli``), and those of the package that only the
tools import (its trainer, ...), are forgotten: each command imports them itself, so their
own logging set-up (which differs between the tools) happens in the command, from the
command's ``sys.path``; the registries (criteria, models, tasks) are the package's as its
import leaves them, and the plugin registers into them in the command.

The forkserver ignores a preload module that fails to import: this one never raises and
keeps the failure in ``FAILED`` instead, which every command checks before it runs.
"""

import copy
import importlib
import importlib.abc
import importlib.machinery
import json
import logging
import os
import subprocess
import sys
import traceback

from tests.warm_process import (FAIRSEQ_TOOLS, ImportEffects, fairseq_top_level,
                                fairseq_reimport_because, repeat_import_effects)

START_ENV = dict(os.environ)  # as the server started, before the imports below change it
FAILED = None  # the traceback of a failed preload
FRESH_PATH = None  # sys.path of a new interpreter after its first entry, without PYTHONPATH
KEPT = {}  # fairseq's modules as ``import fairseq`` leaves them: name -> module
KEPT_SPEC = None  # fairseq's own __spec__
KEPT_EFFECTS = []  # what that import did: ("basicConfig", args, kwargs) or ("record", record)


def _fresh_path():
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    out = subprocess.run([sys.executable, "-c", "import json, sys; print(json.dumps(sys.path[1:]))"],
                         env=env, capture_output=True, text=True, check=True).stdout
    return json.loads(out)


def _import_fairseq_package():
    global KEPT_SPEC
    before = set(sys.modules)
    with ImportEffects() as recorder:
        importlib.import_module("fairseq")
    KEPT_EFFECTS[:] = recorder.effects
    for name in set(sys.modules) - before:
        if name.split(".")[0] == "fairseq":
            KEPT[name] = sys.modules[name]
    KEPT_SPEC = KEPT["fairseq"].__spec__


def _preload():
    _import_fairseq_package()
    for entry in sorted(set(FAIRSEQ_TOOLS.values())):
        importlib.import_module(entry.split(":")[0])
    # torch imports torch._dynamo (and sympy) on the first call of a function it keeps out
    # of compilation, such as torch.optim.Optimizer.add_param_group: 1.7 s of every
    # training command here, loaded once in the server instead (torch's, not fairseq's: a
    # new process would load the same module the same way, only later)
    importlib.import_module("torch._dynamo")
    names = fairseq_top_level()
    for name in [m for m in sys.modules if m.split(".")[0] in names]:
        module = sys.modules.pop(name)
        parent, _, child = name.rpartition(".")
        if name not in KEPT and getattr(KEPT.get(parent), child, None) is module:
            # ``from fairseq import trainer`` in the command imports it anew
            delattr(KEPT[parent], child)
    sys.meta_path.insert(0, PutBackFairseq())
    root = logging.getLogger()  # as before any basicConfig
    for handler in root.handlers[:]:
        root.removeHandler(handler)
    root.setLevel(logging.WARNING)


class PutBackFairseq(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """In a command: its first ``import fairseq`` gets the kept package (a lookup alone,
    ``importlib.util.find_spec``, does nothing), with the effects of its import; a new
    import where the kept one is not what a new process would import (below)."""

    def find_spec(self, name, path=None, target=None):
        if name != "fairseq" or "fairseq" in sys.modules:
            return None
        found = importlib.machinery.PathFinder.find_spec(name, sys.path)
        if (found is None or found.origin != KEPT_SPEC.origin  # another copy first on the path
                or fairseq_reimport_because(sys.modules["torch"].version, os.environ,
                                            START_ENV)):
            return None  # a new import, from the command's sys.path
        spec = copy.copy(KEPT_SPEC)
        spec.loader = self
        return spec

    def create_module(self, spec):
        return KEPT["fairseq"]

    def exec_module(self, module):
        added = [name for name in KEPT if name not in sys.modules]
        try:
            for name in added:
                sys.modules[name] = KEPT[name]
            repeat_import_effects(KEPT_EFFECTS)
            # its cache paths, read from the environment while it is imported: the command's
            importlib.reload(sys.modules["fairseq.file_utils"])
        except BaseException:
            for name in added:  # as a failed import leaves it: not imported
                if name != "fairseq":
                    sys.modules.pop(name, None)
            raise
        # the package as imported from its file, once the import has nothing left to do
        module.__spec__, module.__loader__ = KEPT_SPEC, KEPT_SPEC.loader
        if self in sys.meta_path:
            sys.meta_path.remove(self)

    def __getattr__(self, name):
        # what a lookup's loader offers besides loading (get_data, get_filename, ...)
        return getattr(KEPT_SPEC.loader, name)


try:
    FRESH_PATH = _fresh_path()
    _preload()
except BaseException:  # noqa: BLE001 - kept for the commands to report
    FAILED = traceback.format_exc()
finally:  # what the imports printed goes out now, not with the first command's output
    sys.stdout.flush()
    sys.stderr.flush()
