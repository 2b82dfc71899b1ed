"""Run fairseq's command-line tools in a fresh process that starts with torch and fairseq
already imported.

Every fairseq command a test runs would otherwise import torch and fairseq again: 3.4 s of
the interpreter's start here (``python -X importtime -c "import fairseq_cli.train"``; 1.1 s
of it is scikit-learn, imported by fairseq's sentence_prediction criterion), paid hundreds of
times by the suite. Here a server process (multiprocessing's ``forkserver``, one per test
worker) imports them once, and each command is a process forked from it: its own pid,
working directory, environment, ``sys.argv``, standard output and error (files, read back),
exit code and time-out, as with ``subprocess.run``.

What differs from a new interpreter, and so is left to real subprocesses: what the tools
print or do *while being imported* (it happened once, in the server: e.g. fairseq's "Please
install tensorboardX"), and anything about which modules a fresh interpreter imports. The
plugin itself is not preloaded: ``--user-dir`` imports it in each command, as in a real run.
The server imports fairseq_cli.train first, which sets up the root logger before it imports
fairseq (as every fairseq tool does), so the tools log as they would in a new process.
Other commands (``python -m``, scripts) and ``run(..., warm=False)`` in the test helpers
stay real subprocesses.
"""

import atexit
import importlib
import logging
import multiprocessing
import os
import subprocess
import sys
import tempfile
import traceback
from pathlib import Path

# console script -> module with cli_main (fairseq's entry_points.txt)
FAIRSEQ_TOOLS = {
    "fairseq-preprocess": "fairseq_cli.preprocess",
    "fairseq-train": "fairseq_cli.train",
    "fairseq-hydra-train": "fairseq_cli.hydra_train",
    "fairseq-generate": "fairseq_cli.generate",
    "fairseq-interactive": "fairseq_cli.interactive",
    "fairseq-validate": "fairseq_cli.validate",
    "fairseq-eval-lm": "fairseq_cli.eval_lm",
}
# fairseq_cli.train first: its logging.basicConfig must come before fairseq's import (whose
# tasks/text_to_speech.py calls basicConfig too), as in a real `fairseq-train`
_PRELOAD = ["fairseq_cli.train", *FAIRSEQ_TOOLS.values()]
_context = None


def _warm_context():
    global _context
    if _context is None:
        _context = multiprocessing.get_context("forkserver")
        _context.set_forkserver_preload(_PRELOAD)
    return _context


def warm_module(cmd):
    """The ``fairseq_cli`` module of ``cmd`` if it is a fairseq console script of this
    environment (it can run warm), else None."""
    path = Path(str(cmd[0]))
    if path.parent == Path(sys.executable).parent:
        return FAIRSEQ_TOOLS.get(path.name)
    return None


def _child(module, argv, cwd, env, out_path, err_path):
    """In the forked process: become the command, then exit with its code."""
    code = 0
    try:
        out = os.open(out_path, os.O_WRONLY)
        err = os.open(err_path, os.O_WRONLY)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.dup2(out, 1)
        os.dup2(err, 2)
        os.chdir(cwd)
        os.environ.clear()
        os.environ.update(env)
        if "OMP_NUM_THREADS" in env:  # OpenMP read the variable when the server imported torch
            import torch

            torch.set_num_threads(int(env["OMP_NUM_THREADS"]))
        # the level fairseq_cli gives the root logger at import, read from this environment
        logging.getLogger().setLevel(env.get("LOGLEVEL", "INFO").upper())
        sys.argv = argv
        importlib.import_module(module).cli_main()
    except SystemExit as exit_:
        if exit_.code is None:
            code = 0
        elif isinstance(exit_.code, int):
            code = exit_.code
        else:
            print(exit_.code, file=sys.stderr)
            code = 1
    except BaseException:  # noqa: BLE001 - as the interpreter would: traceback, exit 1
        traceback.print_exc()
        code = 1
    try:
        atexit._run_exitfuncs()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def run_warm(cmd, cwd, env, timeout):
    """``subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True,
    timeout=timeout)``, forked from the warm server; ``cmd`` is a fairseq tool
    (``warm_module``)."""
    module = warm_module(cmd)
    argv = [str(c) for c in cmd]
    with tempfile.TemporaryDirectory(prefix="warm-") as tmp:
        out_path, err_path = Path(tmp, "stdout"), Path(tmp, "stderr")
        out_path.touch()
        err_path.touch()
        process = _warm_context().Process(
            target=_child, args=(module, argv, str(cwd), dict(env), str(out_path),
                                 str(err_path)))
        process.start()
        process.join(timeout)
        if process.is_alive():
            process.kill()
            process.join()
            raise subprocess.TimeoutExpired(argv, timeout, out_path.read_text(errors="replace"),
                                            err_path.read_text(errors="replace"))
        return subprocess.CompletedProcess(argv, process.exitcode,
                                           out_path.read_text(errors="replace"),
                                           err_path.read_text(errors="replace"))


def run_command(cmd, cwd, env, timeout, warm=True):
    """A command's CompletedProcess (text, captured): forked warm where it can be, else a
    real subprocess."""
    if warm and warm_module(cmd) is not None:
        return run_warm(cmd, cwd, env, timeout)
    return subprocess.run([str(c) for c in cmd], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=timeout)
