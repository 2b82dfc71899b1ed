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
import json
import logging
import multiprocessing
import multiprocessing.connection
import multiprocessing.forkserver
import multiprocessing.reduction
import os
import shutil
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import traceback
from pathlib import Path

from tests.warm_client import receive

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
_bin = None


def _warm_context():
    global _context
    if _context is None:
        _context = multiprocessing.get_context("forkserver")
        _context.set_forkserver_preload(_PRELOAD)
        # The server imports fairseq, which asks torch how many GPUs there are (its
        # distributed defaults): where torch cannot ask NVML, that initialises CUDA, and
        # a process forked from a CUDA-initialised one finds CUDA broken. So the server
        # starts with no GPU visible and never touches CUDA; each command gets its own
        # environment back (CUDA_VISIBLE_DEVICES included) before any of it runs.
        saved = os.environ.get("CUDA_VISIBLE_DEVICES")
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
        try:
            multiprocessing.forkserver.ensure_running()
        finally:
            if saved is None:
                del os.environ["CUDA_VISIBLE_DEVICES"]
            else:
                os.environ["CUDA_VISIBLE_DEVICES"] = saved
    return _context


def warm_module(cmd):
    """The ``fairseq_cli`` module of ``cmd`` if it is a fairseq console script of this
    environment (it can run warm), else None."""
    path = Path(str(cmd[0]))
    if path.parent == Path(sys.executable).parent:
        return FAIRSEQ_TOOLS.get(path.name)
    return None


def _child(module, argv, cwd, env, streams):
    """In the forked process: become the command, then exit with its code. ``streams``:
    its standard input, output and error, each a path or a descriptor passed along
    (``multiprocessing.reduction.DupFd``)."""
    code = 0
    try:
        for target, stream in enumerate(streams):
            if isinstance(stream, str):
                fd = os.open(stream, os.O_RDONLY if target == 0 else os.O_WRONLY)
            else:
                fd = stream.detach()
            if fd != target:
                os.dup2(fd, target)
                os.close(fd)
        # the start method a new interpreter has (a forked child inherits the server's
        # forkserver: a tool's worker pool, e.g. fairseq-preprocess --workers 8, would start
        # a server of its own and import fairseq again in every worker)
        multiprocessing.set_start_method(None, force=True)
        os.chdir(cwd)
        os.environ.clear()
        os.environ.update(env)
        if "OMP_NUM_THREADS" in env:  # OpenMP read the variable when the server imported torch
            import torch

            torch.set_num_threads(int(env["OMP_NUM_THREADS"]))
        # the level fairseq_cli gives the root logger at import, read from this environment
        logging.getLogger().setLevel(env.get("LOGLEVEL", "INFO").upper())
        if env.get("PYTHONUNBUFFERED"):  # read at the server's start, as OMP_NUM_THREADS
            sys.stdout.reconfigure(line_buffering=True)
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
            target=_child, args=(module, argv, str(cwd), dict(env),
                                 (os.devnull, str(out_path), str(err_path))))
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


def fairseq_bin():
    """A directory to give the commands a test runs as FAIRSEQ_BIN (the recipe scripts and
    modules, the experiments): in it, fairseq's tools are stand-ins (tests/warm_client.py)
    that send their command to this worker, which forks it warm and sends back its exit
    code; fairseq's other console scripts are links to the real ones. One directory and
    one listening thread per test worker, made at the first call.

    What differs from a real process besides what ``run_warm`` says: the command is a child
    of the warm server, not of the stand-in (its CPU time is not the stand-in's, and a
    signal reaches it only through the stand-in, which forwards SIGINT, SIGTERM, SIGHUP and
    SIGQUIT; if the stand-in dies, the command is killed). Tests that are about process
    groups or command lines in /proc leave FAIRSEQ_BIN unset."""
    global _bin
    if _bin is None:
        directory = Path(tempfile.mkdtemp(prefix="warm-bin-"))
        atexit.register(shutil.rmtree, directory, True)
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(str(directory / "socket"))
        listener.listen(16)
        threading.Thread(target=_serve, args=(listener,), daemon=True).start()
        client = Path(__file__).with_name("warm_client.py").read_text()
        header = f"#!{sys.executable} -S\nSOCKET = {str(directory / 'socket')!r}\n"
        for real in Path(sys.executable).parent.glob("fairseq-*"):
            stand_in = directory / real.name
            if real.name in FAIRSEQ_TOOLS:
                stand_in.write_text(header + client)
                stand_in.chmod(0o755)
            else:  # e.g. fairseq-score: runs as itself
                stand_in.symlink_to(real)
        _bin = str(directory)
    return _bin


def _serve(listener):
    while True:
        conn, _ = listener.accept()
        threading.Thread(target=_run_for_stand_in, args=(conn,), daemon=True).start()


class _PassedFd:
    """A descriptor that goes to the forked child with the process itself: DupFd, called
    while the process is being pickled for the fork server, sends it along with it."""

    def __init__(self, fd):
        self.fd = fd

    def __reduce__(self):
        return _same, (multiprocessing.reduction.DupFd(self.fd),)


def _same(x):
    return x


def _run_for_stand_in(conn):
    """One stand-in's command: fork it warm with the stand-in's descriptors, send its pid,
    wait for it (or kill it if the stand-in dies first), send its exit code."""
    with conn:
        try:
            header, fds, _, _ = socket.recv_fds(conn, 8, 3)
            size = struct.unpack("!Q", header + receive(conn, 8 - len(header)))[0]
            request = json.loads(receive(conn, size))
        except (EOFError, OSError, ValueError):
            return
        try:
            argv = request["argv"]
            process = _warm_context().Process(
                target=_child, args=(FAIRSEQ_TOOLS[Path(argv[0]).name], argv, request["cwd"],
                                     request["env"],
                                     [_PassedFd(fd) for fd in fds]))
            process.start()
        finally:
            for fd in fds:  # the child has its copies
                os.close(fd)
        try:
            conn.sendall(struct.pack("!i", process.pid))
            # the stand-in sends nothing more: its end readable means it died
            ready = multiprocessing.connection.wait([process.sentinel, conn])
        except OSError:
            ready = [conn]
        if process.sentinel not in ready:
            process.kill()
        process.join()
        try:
            conn.sendall(struct.pack("!i", process.exitcode))
        except OSError:
            pass
