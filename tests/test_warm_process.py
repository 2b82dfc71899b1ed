"""The warm stand-ins for fairseq's tools (tests/warm_process.py's ``fairseq_bin``) that the
recipe and experiment tests run as FAIRSEQ_BIN: a command behaves as a real process would
for its caller: output, exit code, working directory and environment, standard input, and
the signals a caller sends; and it does not outlive a stand-in that was killed. The warm
server itself sees no GPU (a process forked from a CUDA-initialised one cannot use CUDA)."""

import importlib.util
import io
import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from tests import warm_process
from tests.warm_process import fairseq_bin

REAL_BIN = Path(sys.executable).parent
REPO = Path(__file__).resolve().parents[1]


def stand_in(name):
    return os.path.join(fairseq_bin(), name)


def caller_env(**extra):
    """The test worker's environment with fairseq's tools first on PATH and ``extra``: the
    variables the warm server started with (it can fork these commands), whatever they
    are where the suite runs."""
    return {**os.environ, "PATH": f"{REAL_BIN}:/usr/bin:/bin", **extra}


def preprocess(tool, cwd, *extra, env=None):
    """``tool`` (a fairseq-preprocess) on ``cwd``/train.txt, its output in ``cwd``/bin."""
    env = env or caller_env(LOGLEVEL="WARNING")
    return subprocess.run([tool, "--only-source", "--trainpref", "train.txt", "--destdir",
                           "bin", "--workers", "1", *extra], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=120)


def test_stand_ins_run_fairseqs_tools_with_the_callers_cwd_env_and_exit_code(tmp_path):
    warm_dir, real_dir = tmp_path / "warm", tmp_path / "real"
    for directory in (warm_dir, real_dir):
        directory.mkdir()
        (directory / "train.txt").write_text("b a b\nc b\n")
    assert warm_process.forks_warm([REAL_BIN / "fairseq-preprocess"], caller_env())
    proc = preprocess(stand_in("fairseq-preprocess"), warm_dir)
    real = preprocess(str(REAL_BIN / "fairseq-preprocess"), real_dir)
    assert proc.returncode == real.returncode == 0, proc.stderr + real.stderr
    # what it prints, where: exactly a real process's. fairseq-preprocess logs its INFO
    # lines on stderr in Python's default format whatever LOGLEVEL says (fairseq's import
    # sets logging up before the tool's own basicConfig would read LOGLEVEL)
    assert "INFO:fairseq_cli.preprocess:Wrote preprocessed data to bin" in real.stderr
    assert (proc.stdout, proc.stderr) == (real.stdout, real.stderr)
    # relative paths: the caller's working directory
    assert (warm_dir / "bin" / "dict.txt").read_text().splitlines()[0] == "b 3"
    assert (warm_dir / "bin" / "dict.txt").read_bytes() == (real_dir / "bin" / "dict.txt").read_bytes()
    (tmp_path / "empty").mkdir()
    failed = preprocess(stand_in("fairseq-preprocess"), tmp_path / "empty")
    assert failed.returncode == 1 and "train.txt" in failed.stderr, failed.stderr
    # every console script of fairseq's distribution has its stand-in
    assert sorted(p.name for p in Path(fairseq_bin()).glob("fairseq-*")) == sorted(
        p.name for p in REAL_BIN.glob("fairseq-*"))


def cli_main():
    """A stand-in "tool" for the test below, run in a forked child of the warm server (its
    parent): the GPUs the command and the server were given."""
    with open(f"/proc/{os.getppid()}/environ", "rb") as f:
        server = dict(item.split(b"=", 1) for item in f.read().split(b"\0") if b"=" in item)
    print(json.dumps({"command": os.environ.get("CUDA_VISIBLE_DEVICES"),
                      "server": server.get(b"CUDA_VISIBLE_DEVICES", b"unset").decode()}))


def test_the_warm_server_sees_no_gpu_and_a_command_gets_the_callers_gpus_back(
        tmp_path, monkeypatch):
    """The server imports fairseq, which counts the GPUs; where torch cannot ask NVML that
    initialises CUDA, and every command forked from it would find CUDA unusable. So the
    server starts with CUDA_VISIBLE_DEVICES empty, and each command has its caller's."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    monkeypatch.setitem(warm_process.FAIRSEQ_TOOLS, "probe", f"{__name__}:cli_main")
    proc = warm_process.run_warm([REAL_BIN / "probe"], tmp_path,
                                 {**os.environ, "CUDA_VISIBLE_DEVICES": "1"}, 60)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout) == {"command": "1", "server": ""}
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "0"  # the caller's own left as it was


def test_a_command_whose_start_the_server_cannot_give_runs_as_a_real_process(tmp_path):
    """PYTHONPATH with another copy of a library the server has loaded (a tensorboardX that
    cannot be imported): the real tool runs in the forked child's place and fairseq's
    import asks for tensorboardX, as it does in a real process; without it, it does not
    (scripts/setup.sh installs it), so a check for that message means something."""
    (tmp_path / "train.txt").write_text("b a b\nc b\n")
    shadow = tmp_path / "shadow"
    shadow.mkdir()
    (shadow / "tensorboardX.py").write_text("raise ImportError('shadowed by the test')\n")
    proc = preprocess(stand_in("fairseq-preprocess"), tmp_path,
                      env=caller_env(PYTHONPATH=str(shadow)))
    assert proc.returncode == 0, proc.stderr
    assert "Please install tensorboardX" in proc.stdout + proc.stderr
    clean = preprocess(stand_in("fairseq-preprocess"), tmp_path, "--destdir", "bin2")
    assert clean.returncode == 0 and "Please install tensorboardX" not in clean.stderr


def test_which_environments_a_forked_command_can_take():
    server = {"PATH": "/bin", "PYTHONHASHSEED": "1", "OMP_NUM_THREADS": "2", "HOME": "/a"}
    same = {**server, "HOME": "/b", "PYTHONPATH": "/x", "PYTHONUNBUFFERED": "1",
            "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "0"}  # applied by the child
    assert warm_process.not_warm_because(same, server) is None
    # the recipe scripts' PYTHON (which the experiments set) is no interpreter variable
    assert warm_process.not_warm_because({**same, "PYTHON": "/venv/bin/python3"}, server) is None
    # fairseq's cache, read by fairseq's import, which the command repeats (warm_server.py)
    assert warm_process.not_warm_because({**same, "PYTORCH_FAIRSEQ_CACHE": "/c"}, server) is None
    assert "PYTHONHASHSEED" in warm_process.not_warm_because({**same, "PYTHONHASHSEED": "2"},
                                                             server)
    assert "LD_PRELOAD" in warm_process.not_warm_because({**same, "LD_PRELOAD": "x.so"},
                                                         server)
    assert warm_process.not_warm_because({**same, "MKL_NUM_THREADS": "4"}, server)
    no_threads = {k: v for k, v in same.items() if k != "OMP_NUM_THREADS"}
    assert warm_process.not_warm_because(no_threads, server)  # a real one would use all cores
    # read by torch at its first operator, by oneDNN at its first use, by numpy, dynamo
    # and triton when they are imported (ops/rows_triton.py refuses a kernel built under
    # another TRITON_INTERPRET), by the loader
    for name in ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "NPY_DISABLE_CPU_FEATURES",
                 "TORCHINDUCTOR_CACHE_DIR", "TRITON_INTERPRET", "GLIBC_TUNABLES"):
        assert name in warm_process.not_warm_because({**same, name: "1"}, server)
    path, entries = warm_process.fresh_sys_path("/venv/bin/tool", "/work",
                                                {"PYTHONPATH": "rel::/abs"}, ["/lib", "/abs"])
    assert path == ["/venv/bin", "/work/rel", "/work", "/abs", "/lib"]
    assert entries == ["/work/rel", "/work", "/abs"]


def test_an_environment_a_test_makes_keeps_what_the_machine_sets_for_every_process():
    """Where the suite runs with variables that every process reads at its start (a CI
    machine's ISA cap, hash seed, loader path, thread count), a command's own environment
    made as the tests make them ({**machine_env(), "PATH": ...}) still forks warm, and runs
    with them as a user's process there would; without them it would not fork warm (nor
    run as there). The test's PYTHONPATH, and what no interpreter reads at its start
    (DATA_DIR, PYTHON), are not the suite's to give."""
    suite = {"PATH": "/usr/bin:/bin", "HOME": "/root", "DATA_DIR": "/data", "PYTHON": "/py",
             "PYTHONPATH": "/elsewhere", "PYTHONHASHSEED": "0", "OMP_NUM_THREADS": "2",
             "MKL_ENABLE_INSTRUCTIONS": "AVX2", "ATEN_CPU_CAPABILITY": "avx2",
             "LD_LIBRARY_PATH": "/opt/lib", "MALLOC_ARENA_MAX": "2"}
    kept = warm_process.machine_env(suite)
    assert kept == {k: suite[k] for k in ("PYTHONHASHSEED", "OMP_NUM_THREADS",
                                          "MKL_ENABLE_INSTRUCTIONS", "ATEN_CPU_CAPABILITY",
                                          "LD_LIBRARY_PATH", "MALLOC_ARENA_MAX")}
    own = {"PATH": "/venv/bin:/usr/bin:/bin", "HOME": "/tmp", "PYTHONPATH": "/repo"}
    assert warm_process.not_warm_because({**kept, **own}, suite) is None
    assert warm_process.not_warm_because(own, suite) is not None
    # and the variables of this suite's own run
    assert warm_process.not_warm_because({**warm_process.machine_env(), **own},
                                         dict(os.environ)) is None


def test_another_fairseq_first_on_the_path_is_the_one_a_warm_command_imports(
        tmp_path, monkeypatch):
    """A module that puts another copy of fairseq first on sys.path while it runs imports
    that copy, as a new process does, not the package the warm server kept."""
    from tests import warm_client

    monkeypatch.setattr(warm_client, "WARM_PACKAGES", (*warm_client.WARM_PACKAGES, "tests"))
    other = tmp_path / "other"
    (other / "fairseq").mkdir(parents=True)
    (other / "fairseq" / "__init__.py").write_text("")
    cmd = [sys.executable, "-m", "tests.test_warm_process"]
    env = caller_env(PROBE="other-fairseq", OTHER=str(other), PYTHONPATH=str(REPO))
    warm = warm_process.run_warm(cmd, tmp_path, env, 60)
    assert warm.returncode == 0, warm.stderr
    assert json.loads(warm.stdout) == {"fairseq": str(other / "fairseq" / "__init__.py")}


def test_an_imports_logging_set_up_and_records_are_repeated_in_their_order(monkeypatch):
    """What the warm server records while it imports fairseq, and a command's ``import
    fairseq`` repeats (tests/warm_server.py): a record logged before the import's first
    basicConfig is dropped where the root logger was not set up (a new process's), and
    shown where it was (a tool that set logging up before importing fairseq)."""
    def an_import():
        logging.getLogger("probe").info("before")
        logging.basicConfig(level=logging.INFO, format="%(name)s|%(message)s")
        logging.basicConfig(level=logging.DEBUG, format="ignored: the root has a handler")
        logging.getLogger("probe").debug("not at INFO")
        logging.getLogger("probe").info("after")

    root = logging.getLogger()
    saved = root.level, root.handlers[:]
    try:
        root.handlers[:] = []
        with warm_process.ImportEffects() as recorder:
            an_import()
        assert [kind for kind, *_ in recorder.effects] == [
            "record", "basicConfig", "basicConfig", "record", "record"]
        assert root.handlers == []  # the recorder is gone
        shown = []
        for set_up in (False, True):
            stream = io.StringIO()
            monkeypatch.setattr(sys, "stderr", stream)
            root.handlers[:] = []
            root.setLevel(logging.WARNING)
            if set_up:
                logging.basicConfig(level=logging.INFO, format="tool: %(message)s")
            warm_process.repeat_import_effects(recorder.effects)
            shown.append(stream.getvalue())
        assert shown == ["probe|after\n", "tool: before\ntool: after\n"]
    finally:
        root.setLevel(saved[0])
        root.handlers[:] = saved[1]


def test_a_command_imports_fairseq_anew_where_the_kept_package_would_differ():
    """fairseq's import counts the GPUs into its defaults (distributed_world_size) and reads
    LOCAL_RANK (device_id's): the warm server's import saw no GPU and its own LOCAL_RANK, so
    a command that may see a GPU (a CUDA or ROCm build of torch, CUDA_VISIBLE_DEVICES not
    empty) or has another LOCAL_RANK imports fairseq anew."""
    from types import SimpleNamespace as Version

    cpu_build, cuda_build = Version(cuda=None, hip=None), Version(cuda="12.8", hip=None)
    because = warm_process.fairseq_reimport_because
    assert because(cpu_build, {"CUDA_VISIBLE_DEVICES": "0"}, {}) is None
    assert "GPU" in because(cuda_build, {}, {})
    assert "GPU" in because(cuda_build, {"CUDA_VISIBLE_DEVICES": "0,1"}, {})
    assert "GPU" in because(Version(cuda=None, hip="6.3"), {}, {})
    assert because(cuda_build, {"CUDA_VISIBLE_DEVICES": ""}, {}) is None
    assert "LOCAL_RANK" in because(cpu_build, {"LOCAL_RANK": "1"}, {})
    assert because(cpu_build, {"LOCAL_RANK": "1"}, {"LOCAL_RANK": "1"}) is None


def blocked_preprocess(tmp_path, sigint=signal.SIG_DFL):
    """A stand-in fairseq-preprocess whose training text is a named pipe that nobody
    writes to: it blocks opening it until stopped. SIGINT as a terminal's foreground job
    has it (``sigint``: SIG_IGN, as a non-interactive shell's background job has it),
    whatever the test runner was started with."""
    os.mkfifo(tmp_path / "train.txt")
    # SIGINT set, then the stand-in executed in the same process (not preexec_fn: this
    # worker runs threads)
    with_sigint = ("import os, signal, sys; signal.signal(signal.SIGINT, signal.Handlers("
                   f"{int(sigint)})); os.execv(sys.argv[1], sys.argv[1:])")
    proc = subprocess.Popen([sys.executable, "-S", "-c", with_sigint,
                             stand_in("fairseq-preprocess"), "--only-source", "--trainpref",
                             "train.txt", "--destdir", "bin", "--workers", "1"], cwd=tmp_path,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=caller_env())
    time.sleep(3)
    assert proc.poll() is None, proc.communicate()
    assert len(running_in(tmp_path)) == 2  # the stand-in and the command
    return proc


def running_in(directory):
    """Processes whose working directory is ``directory`` (the command's, not the test's)."""
    found = []
    for cwd in Path("/proc").glob("[0-9]*/cwd"):
        try:
            if os.readlink(cwd) == str(directory):
                found.append(cwd.parent.name)
        except OSError:  # ended meanwhile, or not ours
            pass
    return found


def test_a_signal_to_the_stand_in_reaches_the_command(tmp_path):
    proc = blocked_preprocess(tmp_path)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    # as Python ends on a KeyboardInterrupt nobody caught: its traceback, then death by
    # SIGINT; the stand-in dies of it too
    assert proc.returncode == -signal.SIGINT, (proc.returncode, err.decode()[-2000:])
    assert "KeyboardInterrupt" in err.decode(), err.decode()[-2000:]
    assert not running_in(tmp_path)


def test_a_command_started_with_sigint_ignored_ignores_it_as_a_real_one_would(tmp_path):
    proc = blocked_preprocess(tmp_path, sigint=signal.SIG_IGN)
    command = [int(pid) for pid in running_in(tmp_path) if int(pid) != proc.pid]
    os.kill(command[0], signal.SIGINT)  # to the command itself, which ignores it
    time.sleep(1)
    assert proc.poll() is None and len(running_in(tmp_path)) == 2
    proc.terminate()
    proc.communicate(timeout=60)
    assert proc.returncode == -signal.SIGTERM and not running_in(tmp_path)


def test_a_killed_stand_in_leaves_no_command_running(tmp_path):
    proc = blocked_preprocess(tmp_path)
    proc.kill()
    proc.wait(timeout=10)
    deadline = time.monotonic() + 30
    while running_in(tmp_path):  # the command, still waiting for its input
        assert time.monotonic() < deadline, "the command still runs 30 s after its stand-in died"
        time.sleep(0.2)


def what_a_module_sees():
    """Run as ``python -m tests.test_warm_process`` by the test below: what a module run
    that way sees of its process."""
    import logging

    if os.environ["PROBE"] == "other-fairseq":  # put first on sys.path while running
        sys.path.insert(0, os.environ["OTHER"])
        import fairseq
        print(json.dumps({"fairseq": fairseq.__file__}))
        sys.exit(0)

    import rdrop_fairseq  # noqa: F401 - before fairseq: it registers once fairseq is imported

    looked_up = importlib.util.find_spec("fairseq") is not None  # a lookup imports nothing
    before = "fairseq" in sys.modules
    import fairseq
    from fairseq import criterions, file_utils, trainer
    from fairseq.dataclass.configs import DistributedTrainingConfig

    root = logging.getLogger()
    server = sys.modules.get("tests.warm_server")  # loaded in a warm command only
    print(json.dumps({
        "kept": bool(server) and fairseq is server.KEPT.get("fairseq"),
        "argv": sys.argv, "cwd": os.getcwd(), "path0": sys.path[0], "main": __name__,
        "env": os.environ.get("PROBE"), "executable": sys.executable,
        # what importing fairseq did: the root logger its modules' basicConfig set up, the
        # cache path it read from the environment, the plugin's criteria registered
        "fairseq": [looked_up, before, fairseq.__spec__.origin,
                    type(fairseq.__loader__).__name__, trainer.__name__ in sys.modules],
        "root": [root.level, [(type(h).__name__, h.formatter._fmt) for h in root.handlers]],
        "cache": str(file_utils.PYTORCH_FAIRSEQ_CACHE),
        # the number of GPUs, counted while fairseq is imported (a GPU machine's test)
        "world_size": DistributedTrainingConfig().distributed_world_size,
        "rdrop_criteria": sorted(c for c in criterions.CRITERION_REGISTRY if "rdrop" in c)}))
    sys.exit(3)


def test_python_m_of_this_repositorys_modules_runs_warm_as_a_real_one(tmp_path, monkeypatch):
    """``python -m MODULE``: argv (the module's file first), working directory, sys.path's
    first entry (the working directory), ``__main__``, environment and exit code as in a
    real process; sys.executable is the python stand-in, so that what the module starts
    beside it starts warm. Through the stand-in, any other command line (here ``-c``) is the
    real interpreter, and one of our modules gives what the real one gives."""
    from tests import warm_client

    # this module as a probe: "tests" counts as one of the repository's packages here
    monkeypatch.setattr(warm_client, "WARM_PACKAGES", (*warm_client.WARM_PACKAGES, "tests"))
    cmd = [sys.executable, "-m", "tests.test_warm_process", "a b", "--c"]
    assert warm_process.warm_module(cmd) == warm_process.RUN_MODULE
    env = caller_env(PROBE="1", PYTHONPATH=str(REPO),
                     XDG_CACHE_HOME=str(tmp_path / "cache"))
    warm = warm_process.run_warm(cmd, tmp_path, env, 60)
    real = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=60)
    assert warm.returncode == real.returncode == 3, warm.stderr + real.stderr
    seen, real_seen = json.loads(warm.stdout), json.loads(real.stdout)
    # the package the server kept, where it is what a new process would import (here, on a
    # CPU build of torch); what its import logs, as in the real process
    import torch

    keeps = warm_process.fairseq_reimport_because(torch.version, env,
                                                  warm_process._server_env) is None
    assert seen.pop("kept") is keeps and real_seen.pop("kept") is False
    assert warm.stderr == real.stderr
    assert seen["executable"] == os.path.join(fairseq_bin(), "python3")
    assert real_seen.pop("executable") == sys.executable
    assert {k: v for k, v in seen.items() if k != "executable"} == real_seen
    assert real_seen["argv"] == [str(REPO / "tests" / "test_warm_process.py"), "a b", "--c"]
    assert real_seen["path0"] == str(tmp_path) and real_seen["main"] == "__main__"
    # fairseq's import (set aside in the server, put back by the command's ``import
    # fairseq``) as in the real process: fairseq's first basicConfig set up the root logger
    assert real_seen["fairseq"][:2] == [True, False] and real_seen["fairseq"][-1] is True
    assert real_seen["root"] == [logging.DEBUG,
                                 [["StreamHandler", "%(levelname)s:%(name)s:%(message)s"]]]
    assert real_seen["cache"] == str(tmp_path / "cache" / "torch" / "pytorch_fairseq")
    assert "label_smoothed_cross_entropy_rdrop" in real_seen["rdrop_criteria"]

    path = {"PATH": f"{fairseq_bin()}:{REAL_BIN}:/usr/bin:/bin"}
    other = subprocess.run(["bash", "-c", "python3 -c 'import sys; print(sys.executable)'"],
                           env=caller_env(**path), capture_output=True, text=True, timeout=60)
    assert other.stdout.strip() == sys.executable, other.stderr
    ours = [subprocess.run(["bash", "-c", f"{python} -m rdrop_fairseq.recipes.fetch --list; "
                            f"{python} -m rdrop_fairseq.recipes.fetch --no-such-option"],
                           cwd=REPO, env=caller_env(**path), capture_output=True, text=True,
                           timeout=60)
            for python in ("python3", sys.executable)]
    assert ours[0].returncode == ours[1].returncode == 2, ours[0].stderr
    assert (ours[0].stdout, ours[0].stderr) == (ours[1].stdout, ours[1].stderr)
    assert "wikitext" in ours[0].stdout.lower()


if __name__ == "__main__":
    what_a_module_sees()
