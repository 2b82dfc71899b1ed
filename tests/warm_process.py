"""Run fairseq's command-line tools, and this repository's modules run as ``python -m``, in a
fresh process that starts with the libraries they use already imported.

Every fairseq command a test runs would otherwise import torch, scipy, scikit-learn, hydra
and fairseq again: 2.65 s of the interpreter's start here, on an idle machine (``python -X
importtime -c "import fairseq_cli.train"``), paid hundreds of times by the suite. Here a server process
(multiprocessing's ``forkserver``, one per test worker) imports them once
(tests/warm_server.py), and each command is a process forked from it: its own pid, working
directory, environment, ``sys.argv``, standard input, output and error, exit code and
time-out, as with ``subprocess.run``.

What a command does the way a new process does:

* its ``import fairseq`` is where fairseq's package is imported: the server imported it
  once and set it aside, and that import puts it back and repeats what the import does
  (its ``logging.basicConfig`` calls and log records, "Please install tensorboardX", and the
  cache paths it reads from the environment; tests/warm_server.py), or imports it anew
  where the kept one is not what a new process would import (another copy first on its
  path, a GPU it may see, its LOCAL_RANK: ``fairseq_reimport_because``); the tool's own
  modules (``fairseq_cli``) it imports itself: its logging set-up, which differs between
  the tools (``fairseq-train`` logs to stdout in fairseq's format, ``fairseq-preprocess``
  to stderr in Python's default one), and the plugin through ``--user-dir``;
* ``sys.path`` is a new interpreter's for the console script: the script's directory,
  PYTHONPATH (relative entries from the command's working directory), then the
  interpreter's own (not the test worker's);
* ``sys.stdin``, ``sys.stdout`` and ``sys.stderr`` are new, buffered as PYTHONUNBUFFERED
  says; ``sys.dont_write_bytecode`` follows PYTHONDONTWRITEBYTECODE; torch's threads and
  the loaded BLAS and OpenMP pools follow OMP_NUM_THREADS / MKL_NUM_THREADS (threadpoolctl);
  ``random`` and numpy's global generator are seeded anew; the signals its caller ignores
  it ignores, the others are a new interpreter's; a KeyboardInterrupt it does not catch
  ends it by SIGINT, as in Python; CUDA_VISIBLE_DEVICES and the rest of the environment
  are the command's before any of it runs.

Where that cannot be (a variable read while the interpreter starts or torch loads differs
from the one the server started with: any other ``PYTHON*``, ``OMP_*``, ``MKL_*``,
``GOMP_*``, ``OPENBLAS_*``, ``TORCH_*``, ``PYTORCH_*``, ``MALLOC_*``, LD_PRELOAD,
LD_LIBRARY_PATH; or
PYTHONPATH holds another copy of a library the server loaded), the forked child executes
the real console script instead: a real process, in the same place.

What still differs from a new process: the libraries the server loaded are loaded once, so
what *they* print or warn while being imported happened once, in the server (log records
of fairseq's import excepted, above), and state that fairseq's import leaves in them
(hydra's config store) is the server's import's, then the command's; the warnings fairseq's
import raises (none shown under Python's default filters; PYTHONWARNINGS makes a command
real) and the modules of fairseq's package in ``sys.modules`` after ``import fairseq`` are
the server's import's; the locale (LANG, LC_*: the standard streams' and ``open``'s
default encoding) and TZ are the server's; ``multiprocessing.current_process()`` is a forked
process, not "MainProcess"; the command is a child of the server, not of its caller (see
``fairseq_bin``); a module run as ``python -m`` (``RUN_MODULE``: this repository's,
``rdrop_fairseq.*`` and ``experiments.*``) has the python stand-in as ``sys.executable``.
``run(..., warm=False)`` in the test helpers, and other commands (``python -c``, scripts,
other modules), are real subprocesses.
"""

import atexit
import copy
import importlib
import importlib.machinery
import io
import json
import logging
import multiprocessing
import multiprocessing.connection
import multiprocessing.forkserver
import multiprocessing.reduction
import os
import random
import runpy
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from importlib.metadata import distribution, packages_distributions
from pathlib import Path

from tests.warm_client import FORWARDED, ignored_signals, receive, runs_warm_as_python


def _fairseq_distribution():
    return distribution(packages_distributions()["fairseq"][0])


def fairseq_tools():
    """Console script name -> ``"module:function"``, for every console script of the
    distribution that provides ``fairseq`` (its entry points)."""
    return {ep.name: ep.value for ep in _fairseq_distribution().entry_points
            if ep.group == "console_scripts"}


def fairseq_top_level():
    """The top-level modules of the distribution that provides ``fairseq``."""
    dist = _fairseq_distribution()
    names = (dist.read_text("top_level.txt") or "").split()
    return set(names) or {f.parts[0].split(".")[0] for f in dist.files or ()
                          if f.suffix in (".py", ".so")}


FAIRSEQ_TOOLS = fairseq_tools()
RUN_MODULE = "-m"  # the "entry" of ``python -m MODULE ...`` (tests/warm_client.py)
PYTHON_STAND_INS = ("python", "python3")
_context = None
_server_env = None
_bin = None

# environment variables read while the interpreter starts or torch loads: a command whose
# value differs from the server's runs as a real process, except for those in _APPLIED
# (not KMP_*: Intel's OpenMP, which torch's Linux builds do not load; scikit-learn sets
# KMP_DUPLICATE_LIB_OK while being imported, in the server and in a test worker alike).
# ATEN_CPU_CAPABILITY is read at torch's first operator, oneDNN's ISA cap at its first
# use, NPY_* when numpy is imported, TORCHDYNAMO_*/TORCHINDUCTOR_* and TRITON_INTERPRET
# when torch._dynamo and triton are (the server imports them), GLIBC_TUNABLES by the loader
_READ_AT_START = ("PYTHON", "OMP_", "MKL_", "GOMP_", "OPENBLAS_", "TORCH_", "PYTORCH_",
                  "ATEN_", "ONEDNN_", "DNNL_", "NPY_", "TORCHDYNAMO_", "TORCHINDUCTOR_",
                  "TRITON_", "MALLOC_", "GLIBC_TUNABLES", "LD_PRELOAD", "LD_LIBRARY_PATH")
_APPLIED = {"PYTHONPATH", "PYTHONUNBUFFERED", "PYTHONDONTWRITEBYTECODE", "OMP_NUM_THREADS",
            "MKL_NUM_THREADS"}
# no interpreter reads a variable named PYTHON alone (the recipe scripts' interpreter, set by
# the experiments and the tests): it is not one of the PYTHON* above; fairseq reads
# PYTORCH_FAIRSEQ_CACHE while being imported, which a command does anew (warm_server.py)
_NOT_READ_AT_START = {"PYTHON", "PYTORCH_FAIRSEQ_CACHE"}


def _warm_context():
    global _context, _server_env
    if _context is None:
        _context = multiprocessing.get_context("forkserver")
        _context.set_forkserver_preload(["tests.warm_server"])
        # The server imports fairseq, which asks torch how many GPUs there are (its
        # distributed defaults): where torch cannot ask NVML, that initialises CUDA, and
        # a process forked from a CUDA-initialised one finds CUDA broken. So the server
        # starts with no GPU visible and never touches CUDA; each command gets its own
        # environment back (CUDA_VISIBLE_DEVICES included) before any of it runs.
        saved = os.environ.get("CUDA_VISIBLE_DEVICES")
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
        _server_env = dict(os.environ)
        try:
            multiprocessing.forkserver.ensure_running()
        finally:
            if saved is None:
                del os.environ["CUDA_VISIBLE_DEVICES"]
            else:
                os.environ["CUDA_VISIBLE_DEVICES"] = saved
    return _context


def warm_module(cmd):
    """The ``"module:function"`` of ``cmd`` if it is a fairseq console script of this
    environment, RUN_MODULE if it is this interpreter running a module of this repository
    (``python -m rdrop_fairseq...`` or ``experiments...``): it can run warm; else None."""
    path = Path(str(cmd[0]))
    if path.parent == Path(sys.executable).parent:
        if str(path) == sys.executable and runs_warm_as_python([str(c) for c in cmd]):
            return RUN_MODULE
        return FAIRSEQ_TOOLS.get(path.name)
    return None


def forks_warm(cmd, env):
    """Whether ``cmd`` with environment ``env`` runs forked from this worker's warm server
    (as far as the environment tells: a PYTHONPATH may still hold another copy of a
    library the server loaded)."""
    _warm_context()
    return warm_module(cmd) is not None and not_warm_because(env, _server_env) is None


def machine_env(environ=None):
    """What an environment a test makes for a command keeps of the suite's own (``environ``,
    default os.environ): the variables that a new interpreter, the loader, the C library or
    torch read as they start (LD_LIBRARY_PATH, MALLOC_*, MKL_ENABLE_INSTRUCTIONS,
    OMP_NUM_THREADS, PYTHONHASHSEED, ...), but not PYTHONPATH nor those no interpreter
    reads at start. Tests give their commands environments of their own ({"PATH": ...,
    "HOME": ...}), so that nothing of the caller's (a DATA_DIR, a GPUS) reaches them; what a
    machine sets for every process must, or the command would run differently from a user's
    there, and not warm (the warm server has those variables: not_warm_because). Put it
    first: a variable the test sets wins."""
    environ = os.environ if environ is None else environ
    return {name: value for name, value in environ.items()
            if name.startswith(_READ_AT_START)
            and name not in _NOT_READ_AT_START | {"PYTHONPATH"}}


def not_warm_because(env, server_env):
    """Why a command with environment ``env`` cannot run forked from a server started with
    the environment ``server_env`` (a sentence), or None."""
    for name in sorted(set(env) | set(server_env)):
        if (name.startswith(_READ_AT_START) and name not in _APPLIED | _NOT_READ_AT_START
                and env.get(name) != server_env.get(name)):
            return f"{name} differs from the warm server's"
    omp, mkl = env.get("OMP_NUM_THREADS"), env.get("MKL_NUM_THREADS")
    if omp and mkl and omp != mkl:
        return "OMP_NUM_THREADS and MKL_NUM_THREADS differ"
    if not (omp or mkl) and (server_env.get("OMP_NUM_THREADS")
                             or server_env.get("MKL_NUM_THREADS")):
        return "no thread count, where the warm server had one"
    return None


def fresh_sys_path(script, cwd, env, interpreter_path, module=False):
    """``sys.path`` of a new interpreter running ``script`` from ``cwd`` with ``env``:
    the script's directory (``cwd`` for ``python -m``: ``module``), PYTHONPATH's entries,
    then ``interpreter_path`` (the rest of a new interpreter's path), without repeats."""
    entries = []
    if env.get("PYTHONPATH"):
        entries = [os.path.abspath(os.path.join(cwd, e))
                   for e in env["PYTHONPATH"].split(os.pathsep)]
    path = []
    for entry in [*entries, *interpreter_path]:
        if entry not in path:
            path.append(entry)
    first = os.path.abspath(cwd) if module else os.path.dirname(os.path.realpath(script))
    return [first, *path], entries


def shadowed_module(entries):
    """The name of a module already imported that one of ``entries`` holds another copy
    of (a new process would import that one), or None."""
    server = sys.modules.get("tests.warm_server")
    kept = server.KEPT if server else {}  # fairseq's package, set aside (tests/warm_server.py)
    loaded = {name: module.__file__ for name, module in [*sys.modules.items(), *kept.items()]
              if "." not in name and getattr(module, "__file__", None)}
    for entry in entries:
        try:
            names = {n.split(".")[0] for n in os.listdir(entry)}
        except OSError:
            continue
        for name in sorted(names & set(loaded)):
            spec = importlib.machinery.PathFinder.find_spec(name, [entry])
            if spec and spec.origin and (os.path.realpath(spec.origin)
                                         != os.path.realpath(loaded[name])):
                return name
    return None


class ImportEffects(logging.Handler):
    """``with ImportEffects() as effects: import ...``: ``effects.effects``, what the import
    did to the logging set-up, in order: each ``logging.basicConfig`` call (``("basicConfig",
    args, kwargs)``) and each log record (``("record", record)``), whatever the levels (the
    root passes all records to it meanwhile; a basicConfig call does nothing then, as the
    root has a handler). :func:`repeat_import_effects` repeats them in another process."""

    def __init__(self):
        super().__init__(level=1)
        self.effects = []

    def emit(self, record):
        self.effects.append(("record", record))

    def __enter__(self):
        root = logging.getLogger()
        self.saved = root.level, root.handlers[:], logging.basicConfig
        root.handlers[:] = [self]
        root.setLevel(1)
        real = logging.basicConfig

        def recording(*args, **kwargs):
            self.effects.append(("basicConfig", args, kwargs))
            return real(*args, **kwargs)

        logging.basicConfig = recording
        return self

    def __exit__(self, *exc):
        root = logging.getLogger()
        level, root.handlers[:], logging.basicConfig = self.saved
        root.setLevel(level)  # clears the loggers' cached levels too


def _as_if_now(record):
    """A copy of ``record`` as this process would make it now (its time, process, thread)."""
    record = copy.copy(record)
    record.created = time.time()
    record.msecs = (record.created - int(record.created)) * 1000
    record.relativeCreated = (record.created - logging._startTime) * 1000
    record.process = os.getpid()
    record.processName = multiprocessing.current_process().name
    record.thread, record.threadName = threading.get_ident(), threading.current_thread().name
    return record


def repeat_import_effects(effects):
    """Do what an import recorded by ImportEffects did, here: its basicConfig calls, and the
    records that the loggers, as set up at that point, let through."""
    for kind, *effect in effects:
        if kind == "basicConfig":
            args, kwargs = effect
            logging.basicConfig(*args, **kwargs)
        else:
            (record,) = effect
            logger = logging.getLogger(record.name)
            if logger.isEnabledFor(record.levelno):
                logger.handle(_as_if_now(record))


def may_see_a_gpu(torch_version, env):
    """Whether a command with environment ``env`` and torch's ``torch.version`` may count a
    GPU (without asking torch, which could initialise CUDA)."""
    built = torch_version.cuda or getattr(torch_version, "hip", None)
    return bool(built) and env.get("CUDA_VISIBLE_DEVICES") != ""


# read while fairseq's package is imported (its config defaults), besides the cache paths
# that tests/warm_server.py reads again
FAIRSEQ_IMPORT_READS = ("LOCAL_RANK",)


def fairseq_reimport_because(torch_version, env, server_env):
    """Why a command with environment ``env`` must import fairseq anew rather than get the
    package the warm server imported with ``server_env`` (a sentence), or None."""
    if may_see_a_gpu(torch_version, env):
        return "torch may see a GPU, which fairseq's defaults count"
    for name in FAIRSEQ_IMPORT_READS:
        if env.get(name) != server_env.get(name):
            return f"{name} differs from the warm server's"
    return None


def _new_standard_streams(unbuffered):
    """sys.stdin, stdout and stderr on descriptors 0-2, made as a new interpreter makes
    them (text over a buffer, or over the raw file with PYTHONUNBUFFERED; no newline
    translation; stdout line buffered on a terminal, stderr always unless unbuffered), with
    the server's encodings."""
    def stream(fd, name, mode, old):
        raw = io.FileIO(fd, mode, closefd=False)
        raw.name = name
        writes = mode == "w"
        buffer = raw if unbuffered and writes else (
            io.BufferedWriter(raw) if writes else io.BufferedReader(raw))
        return io.TextIOWrapper(buffer, encoding=old.encoding, errors=old.errors, newline="\n",
                                line_buffering=writes and not unbuffered
                                and (fd == 2 or os.isatty(fd)),
                                write_through=unbuffered and writes)

    sys.stdin = sys.__stdin__ = stream(0, "<stdin>", "r", sys.__stdin__)
    sys.stdout = sys.__stdout__ = stream(1, "<stdout>", "w", sys.__stdout__)
    sys.stderr = sys.__stderr__ = stream(2, "<stderr>", "w", sys.__stderr__)


def _limit_threads(threads):
    """The command's thread count for torch and for the thread pools the server's
    libraries loaded (numpy's and scipy's OpenBLAS read OMP_NUM_THREADS when loaded); False
    where that cannot be done."""
    try:
        from threadpoolctl import threadpool_limits
    except ImportError:
        return False
    import torch

    torch.set_num_threads(threads)
    threadpool_limits(threads)
    return True


def _child(entry, argv, cwd, env, streams, ignored, python=None):
    """In the forked process: become the command ``argv`` (``entry``: its
    ``"module:function"``, or RUN_MODULE for ``python -m MODULE ...``), then exit as it
    does. ``streams``: its standard input, output and error, each a path or a descriptor
    passed along (``multiprocessing.reduction.DupFd``); ``ignored``: the signals its caller
    ignores, which it ignores too (the others as a new interpreter has them). ``python``
    (RUN_MODULE): the python stand-in, the module's ``sys.executable``, so that the
    interpreters and fairseq tools it starts beside it start warm too."""
    code = 0
    for sig in FORWARDED:
        default = signal.default_int_handler if sig == signal.SIGINT else signal.SIG_DFL
        signal.signal(sig, signal.SIG_IGN if sig in ignored else default)
    try:
        for target, stream in enumerate(streams):
            if isinstance(stream, str):
                fd = os.open(stream, os.O_RDONLY if target == 0 else os.O_WRONLY)
            else:
                fd = stream.detach()
            if fd != target:
                os.dup2(fd, target)
                os.close(fd)
        from tests import warm_server  # loaded by the server, with it

        if warm_server.FAILED:
            raise RuntimeError("the warm server's preload failed:\n" + warm_server.FAILED)
        module = entry == RUN_MODULE
        # the real one: the tool beside this interpreter, or the interpreter
        script = sys.executable if module else str(Path(sys.executable).parent
                                                   / Path(argv[0]).name)
        os.chdir(cwd)
        os.environ.clear()
        os.environ.update(env)
        path, entries = fresh_sys_path(script, cwd, env, warm_server.FRESH_PATH, module)
        threads = env.get("OMP_NUM_THREADS") or env.get("MKL_NUM_THREADS")
        if (not_warm_because(env, warm_server.START_ENV) or shadowed_module(path[:1] + entries)
                or (threads and not _limit_threads(int(threads)))):
            os.closerange(3, os.sysconf("SC_OPEN_MAX"))  # the server's, not the command's
            os.execve(script, [script, *argv[1:]], env)  # a real process, in our place
        sys.path[:] = path
        importlib.invalidate_caches()
        sys.dont_write_bytecode = bool(env.get("PYTHONDONTWRITEBYTECODE"))
        _new_standard_streams(bool(env.get("PYTHONUNBUFFERED")))
        # the start method a new interpreter has (a forked child inherits the server's
        # forkserver: a tool's worker pool, e.g. fairseq-preprocess --workers 8, would start
        # a server of its own)
        multiprocessing.set_start_method(None, force=True)
        random.seed()  # seeded when the server imported them: the same in every command
        if "numpy" in sys.modules:
            sys.modules["numpy"].random.seed()
        if module:  # as ``python -m``: argv[0] the module's file (runpy sets it)
            sys.argv = [argv[0], *argv[3:]]
            sys.executable = python
            runpy.run_module(argv[2], run_name="__main__", alter_sys=True)
        else:
            sys.argv = argv
            module, function = entry.split(":")
            getattr(importlib.import_module(module), function)()
    except SystemExit as exit_:
        if exit_.code is None:
            code = 0
        elif isinstance(exit_.code, int):
            code = exit_.code
        else:
            print(exit_.code, file=sys.stderr)
            code = 1
    except KeyboardInterrupt:  # as the interpreter: traceback, then die of SIGINT
        traceback.print_exc()
        code = -signal.SIGINT
    except BaseException:  # noqa: BLE001 - as the interpreter would: traceback, exit 1
        traceback.print_exc()
        code = 1
    try:
        atexit._run_exitfuncs()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        if code < 0:
            signal.signal(-code, signal.SIG_DFL)
            os.kill(os.getpid(), -code)
        os._exit(code)


def run_warm(cmd, cwd, env, timeout):
    """``subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True,
    timeout=timeout)``, forked from the warm server; ``cmd`` is a fairseq tool or a module
    of this repository run by this interpreter (``warm_module``)."""
    entry = warm_module(cmd)
    argv = [str(c) for c in cmd]
    python = os.path.join(fairseq_bin(), "python3") if entry == RUN_MODULE else None
    with tempfile.TemporaryDirectory(prefix="warm-") as tmp:
        out_path, err_path = Path(tmp, "stdout"), Path(tmp, "stderr")
        out_path.touch()
        err_path.touch()
        process = _warm_context().Process(
            target=_child, args=(entry, argv, str(cwd), dict(env),
                                 (os.devnull, str(out_path), str(err_path)),
                                 ignored_signals(), python))
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
    modules, the experiments): in it, each of fairseq's console scripts is a stand-in
    (tests/warm_client.py) that sends its command to this worker, which forks it warm and
    sends back its exit code. One directory and one listening thread per test worker, made
    at the first call. Beside them, ``python`` and ``python3``: ``python -m`` of a module of
    this repository runs warm the same way (as PYTHON, or first on PATH, for the recipe
    scripts), with the stand-in as its ``sys.executable`` (so that what it starts with
    ``sys.executable`` or beside it starts warm too); any other command line runs the real
    interpreter.

    What differs from a real process besides what this module's docstring says: the command is a child
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
        for name in [*FAIRSEQ_TOOLS, *PYTHON_STAND_INS]:
            real = sys.executable if name in PYTHON_STAND_INS else None
            stand_in = directory / name
            stand_in.write_text(header + f"REAL_PYTHON = {real!r}\n" + client)
            stand_in.chmod(0o755)
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
            name = Path(argv[0]).name
            python = argv[0] if name in PYTHON_STAND_INS else None
            process = _warm_context().Process(
                target=_child, args=(RUN_MODULE if python else FAIRSEQ_TOOLS[name], argv,
                                     request["cwd"], request["env"],
                                     [_PassedFd(fd) for fd in fds], request["ignored"],
                                     python))
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
