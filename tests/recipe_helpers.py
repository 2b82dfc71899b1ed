"""Helpers shared by the recipe tests (LM, summarization, GLUE)."""

import os
import shlex
import signal
import sys
import warnings
from pathlib import Path

from tests.warm_process import fairseq_bin, machine_env, run_command

REPO = Path(__file__).resolve().parents[1]
DEAD_PROXY = "http://127.0.0.1:9"  # refuses every connection: a download fails at once
OFFLINE = {"http_proxy": DEAD_PROXY, "https_proxy": DEAD_PROXY, "HTTPS_PROXY": DEAD_PROXY,
           "HTTP_PROXY": DEAD_PROXY, "no_proxy": ""}  # env for run(): no network


def terminal_sigint():
    """``preexec_fn`` for a child that a test sends SIGINT: SIGINT as in a terminal's
    foreground job. A suite started as a shell's background job (``cmd &``, as some CI
    runners start it) begins with SIGINT ignored, an ignored signal stays ignored across
    exec, and Python then installs no KeyboardInterrupt handler: the child would never see
    the test's Ctrl-C."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def run(cmd, ok=True, env=None):
    """Run a recipe module, script or fairseq tool on one thread and no GPU with the test
    environment's tools on PATH; ``proc.output`` is stdout + stderr. With ``ok``, a failure fails the test.
    fairseq's tools start warm (tests/warm_process.py): run here, and as the scripts and
    modules run them (FAIRSEQ_BIN; not in a dry run, whose printed commands name the real
    tools, and not where ``env`` sets FAIRSEQ_BIN); so do this repository's modules run as
    ``python -m`` (here, and through the python stand-in first on PATH)."""
    # the test environment's tools first, then the system's (the recipe scripts use coreutils)
    path = os.pathsep.join([str(Path(sys.executable).parent), "/usr/bin", "/bin"])
    # no GPU unless env says so: the scripts would find one (nvidia-smi) and train in fp16,
    # the evaluation modules would move their models to it
    full_env = {**machine_env(), "PATH": path, "OMP_NUM_THREADS": "1",
                "CUDA_VISIBLE_DEVICES": "", "MKL_NUM_THREADS": "1", "HOME": "/tmp",
                "PYTHONUNBUFFERED": "1", **(env or {})}
    if full_env.get("DRY_RUN") != "1" and "FAIRSEQ_BIN" not in full_env:
        full_env["FAIRSEQ_BIN"] = fairseq_bin()
        if not (env or {}).get("PATH"):  # the scripts' python3 -m of our modules, warm too
            full_env["PATH"] = os.pathsep.join([fairseq_bin(), path])
    proc = run_command(cmd, REPO, full_env, 300)  # the root: python -m experiments.*
    proc.output = proc.stdout + proc.stderr
    if ok:
        assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return proc


def script(name, *args, ok=True, **env):
    """Run the recipe script scripts/NAME.sh with ARGS and the environment variables ENV."""
    return run(["bash", REPO / "scripts" / f"{name}.sh", *args], ok=ok,
               env={k: str(v) for k, v in env.items()})


def dry_run(name, *args, ok=True, **env):
    """The commands scripts/NAME.sh prints with DRY_RUN=1, each an argv list; and the run.
    ``proc.inner``: the commands the recipe modules it runs would run (``++ `` lines: the
    evaluate stages' fairseq-generate, fairseq-eval-lm); ``proc.fetches``: the ``(URL,
    file)`` pairs the inputs' downloads would fetch."""
    proc = script(name, *args, ok=ok, DRY_RUN=1, **env)
    lines = proc.stdout.splitlines()
    commands = [shlex.split(line[2:]) for line in lines if line.startswith("+ ")]
    inner = [shlex.split(line[3:]) for line in lines if line.startswith("++ ")]
    # the downloads it would make ("++ fetch URL -> FILE"), apart from the commands
    proc.fetches = [(c[1], c[3]) for c in inner if c[0] == "fetch"]
    proc.inner = [c for c in inner if c[0] not in ("fetch", "make", "(no")]
    return commands, proc


def overrides_of(cmd):
    """``{key: value}`` of a fairseq-hydra-train command's ``key=value`` arguments."""
    return dict(arg.split("=", 1) for arg in cmd if "=" in arg and not arg.startswith("-"))


def composed_config(name, overrides=()):
    """The config fairseq-hydra-train composes from configs/NAME.yaml, this repository's
    plugin loaded and no data; ``overrides`` come after those (e.g. the pre-trained
    checkpoint a fine-tuning config leaves required)."""
    from fairseq.dataclass.initialize import add_defaults, hydra_init
    from hydra import compose, initialize_config_dir

    hydra_init(name)
    with warnings.catch_warnings():  # hydra 1.1 behaviour, as fairseq-hydra-train's
        warnings.simplefilter("ignore")
        with initialize_config_dir(config_dir=str(REPO / "configs"), version_base="1.1"):
            cfg = compose(config_name=name, overrides=[
                f"common.user_dir={REPO / 'rdrop_fairseq'}", "task.data=/nonexistent",
                *overrides])
    add_defaults(cfg)
    return cfg
