"""What the warm server (tests/warm_process.py) imports once, before it forks any command.

It imports every fairseq tool's module, so that the libraries they use (torch, scipy,
scikit-learn, hydra, ...: 2.26 s of the 2.65 s ``import fairseq_cli.train`` takes here) are
loaded, and ``torch._dynamo``, which torch loads while a training builds its optimizer
(1.7 s); then it forgets the modules of fairseq's distribution again and resets the root
logger: each command imports fairseq itself (0.35 s), as a new process does, so that what
fairseq does while being imported (its logging set-up, which differs between the tools,
"Please install tensorboardX", its registries) happens in the command, from the command's
``sys.path``.

The forkserver ignores a preload module that fails to import: this one never raises and
keeps the failure in ``FAILED`` instead, which every command checks before it runs.
"""

import importlib
import json
import logging
import os
import subprocess
import sys
import traceback

from tests.warm_process import FAIRSEQ_TOOLS, fairseq_top_level

START_ENV = dict(os.environ)  # as the server started, before the imports below change it
FAILED = None  # the traceback of a failed preload
FRESH_PATH = None  # sys.path of a new interpreter after its first entry, without PYTHONPATH


def _fresh_path():
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    out = subprocess.run([sys.executable, "-c", "import json, sys; print(json.dumps(sys.path[1:]))"],
                         env=env, capture_output=True, text=True, check=True).stdout
    return json.loads(out)


def _preload():
    for entry in sorted(set(FAIRSEQ_TOOLS.values())):
        importlib.import_module(entry.split(":")[0])
    # torch imports torch._dynamo (and sympy) on the first call of a function it keeps out
    # of compilation, such as torch.optim.Optimizer.add_param_group: 1.7 s of every
    # training command here, loaded once in the server instead (torch's, not fairseq's: a
    # new process would load the same module the same way, only later)
    importlib.import_module("torch._dynamo")
    names = fairseq_top_level()
    for name in [m for m in sys.modules if m.split(".")[0] in names]:
        del sys.modules[name]
    root = logging.getLogger()  # as before any basicConfig
    for handler in root.handlers[:]:
        root.removeHandler(handler)
    root.setLevel(logging.WARNING)


try:
    FRESH_PATH = _fresh_path()
    _preload()
except BaseException:  # noqa: BLE001 - kept for the commands to report
    FAILED = traceback.format_exc()
finally:  # what the imports printed goes out now, not with the first command's output
    sys.stdout.flush()
    sys.stderr.flush()
