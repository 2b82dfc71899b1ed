"""The warm stand-ins for fairseq's tools (tests/warm_process.py's ``fairseq_bin``) that the
recipe and experiment tests run as FAIRSEQ_BIN: a command behaves as a real process would
for its caller: output, exit code, working directory and environment, standard input, and
the signals a caller sends; and it does not outlive a stand-in that was killed. The warm
server itself sees no GPU (a process forked from a CUDA-initialised one cannot use CUDA)."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from tests import warm_process
from tests.warm_process import fairseq_bin

REAL_BIN = Path(sys.executable).parent


def stand_in(name):
    return os.path.join(fairseq_bin(), name)


def test_stand_ins_run_fairseqs_tools_with_the_callers_cwd_env_and_exit_code(tmp_path):
    (tmp_path / "train.txt").write_text("b a b\nc b\n")
    env = {"PATH": f"{REAL_BIN}:/usr/bin:/bin", "LOGLEVEL": "WARNING"}
    proc = subprocess.run([stand_in("fairseq-preprocess"), "--only-source", "--trainpref",
                           "train.txt", "--destdir", "bin", "--workers", "1"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    # LOGLEVEL of the caller's environment: no INFO line anywhere (fairseq's tools log to
    # stdout or stderr, depending on how logging was set up), where INFO logs some
    assert "| INFO |" not in proc.stdout + proc.stderr
    info = subprocess.run([stand_in("fairseq-preprocess"), "--only-source", "--trainpref",
                           "train.txt", "--destdir", "bin-info", "--workers", "1"],
                          cwd=tmp_path, env={**env, "LOGLEVEL": "INFO"}, capture_output=True,
                          text=True, timeout=120)
    assert info.returncode == 0 and "| INFO |" in info.stdout + info.stderr, info.stderr
    # relative paths: the caller's working directory
    assert (tmp_path / "bin" / "dict.txt").read_text().splitlines()[0] == "b 3"
    failed = subprocess.run([stand_in("fairseq-preprocess"), "--only-source", "--trainpref",
                             "missing.txt", "--destdir", "bin2", "--workers", "1"],
                            cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert failed.returncode == 1 and "missing.txt" in failed.stderr
    # fairseq's other tools are the real ones
    assert os.path.realpath(stand_in("fairseq-score")) == str(REAL_BIN / "fairseq-score")


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
    monkeypatch.setitem(warm_process.FAIRSEQ_TOOLS, "probe", __name__)
    proc = warm_process.run_warm([REAL_BIN / "probe"], tmp_path,
                                 {"CUDA_VISIBLE_DEVICES": "1", "PATH": "/usr/bin:/bin"}, 60)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout) == {"command": "1", "server": ""}
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "0"  # the caller's own left as it was


def blocked_preprocess(tmp_path):
    """A stand-in fairseq-preprocess whose training text is a named pipe that nobody
    writes to: it blocks opening it until stopped."""
    os.mkfifo(tmp_path / "train.txt")
    proc = subprocess.Popen([stand_in("fairseq-preprocess"), "--only-source", "--trainpref",
                             "train.txt", "--destdir", "bin", "--workers", "1"], cwd=tmp_path,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env={"PATH": f"{REAL_BIN}:/usr/bin:/bin"})
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
    assert proc.returncode == 1 and "KeyboardInterrupt" in err.decode(), err.decode()[-2000:]
    assert not running_in(tmp_path)


def test_a_killed_stand_in_leaves_no_command_running(tmp_path):
    proc = blocked_preprocess(tmp_path)
    proc.kill()
    proc.wait(timeout=10)
    deadline = time.monotonic() + 30
    while running_in(tmp_path):  # the command, still waiting for its input
        assert time.monotonic() < deadline, "the command still runs 30 s after its stand-in died"
        time.sleep(0.2)
