"""What the experiments share: the command line of a recipe script (scripts/*.sh), options
followed by hydra overrides, a run in a process of its own on one thread, the mean and
standard deviation per mode of a results table, and the Trainer pieces of the Hugging Face
checks."""

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def recipe_script(name, stage, *args, **variables):
    """``env VAR=value ... bash scripts/NAME.sh STAGE ARGS``: a recipe script on the CPU
    (GPUS=0), with this Python and the fairseq CLIs in $FAIRSEQ_BIN if set, else those
    installed beside it."""
    env = {"GPUS": 0, "PYTHON": sys.executable,
           "FAIRSEQ_BIN": os.environ.get("FAIRSEQ_BIN") or Path(sys.executable).parent,
           **variables}
    return ["env", *(f"{k}={v}" for k, v in env.items()),
            "bash", str(REPO / "scripts" / f"{name}.sh"), stage, *map(str, args)]


def parse_with_overrides(parser, argv):
    """``parser.parse_args`` of what comes before ``--``; what follows is kept, as
    fairseq-hydra-train overrides, in ``.overrides``."""
    overrides = []
    if "--" in argv:
        argv, overrides = argv[:argv.index("--")], argv[argv.index("--") + 1:]
    a = parser.parse_args(argv)
    a.overrides = overrides
    return a


ONE_THREAD = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def run_logged(cmd, log_path, append=False):
    """Run ``cmd`` on one thread with its output into ``log_path`` (after what it holds, with
    ``append``): ``(exit code, wall minutes, CPU minutes of it and its children)``."""
    env = {**os.environ, **ONE_THREAD}
    start = time.monotonic()
    with open(log_path, "a" if append else "w") as log:
        log.write("$ " + " ".join(map(str, cmd)) + "\n")
        log.flush()
        proc = subprocess.Popen([str(c) for c in cmd], stdout=log, stderr=subprocess.STDOUT,
                                env=env)
        _, status, usage = os.wait4(proc.pid, 0)  # wait4: the CPU time of this one run
        proc.returncode = os.waitstatus_to_exitcode(status)
    return (proc.returncode, (time.monotonic() - start) / 60,
            (usage.ru_utime + usage.ru_stime) / 60)


def train_in_process(tag, name, run_dir, cmd):
    """Run ``cmd``, one run that writes ``run_dir``/result.json, on one thread with its
    output after what ``run_dir``/train.log holds: the result, with the run's wall and CPU
    minutes; a one-line error when it fails or writes no result."""
    log = run_dir / "train.log"
    print(f"[{tag}] {name}: training (log {log})", flush=True)
    code, wall, cpu = run_logged(cmd, log, append=True)
    if code or not (run_dir / "result.json").is_file():
        sys.exit(f"error: {name} failed; see {log}")
    return {**json.loads((run_dir / "result.json").read_text()),
            "wall_minutes": wall, "cpu_minutes": cpu}


def mean_std(values):
    return (statistics.mean(values), statistics.stdev(values) if len(values) > 1 else 0.0)


def mode_rows(results, modes, columns):
    """A results table's rows of ``| **MODE**, mean ± std of N | ... |``, one per mode with
    runs; ``columns``: ``[(key, digits), ...]``."""
    lines = []
    for mode in modes:
        runs = [r for r in results if r["mode"] == mode]
        if runs:
            cells = [(mean_std([r[k] for r in runs]), digits) for k, digits in columns]
            lines.append(f"| **{mode}**, mean ± std of {len(runs)} | " + " | ".join(
                f"{m:.{d}f} ± {s:.{d}f}" for (m, s), d in cells) + " |")
    return lines


class DecayAll:
    """A Trainer mixin: weight decay on every parameter, as fairseq's Adam (the Trainer
    leaves biases and LayerNorms out)."""

    def get_decay_parameter_names(self, model):
        return [name for name, _ in model.named_parameters()]


def step_timer():
    """A TrainerCallback summing the seconds of each update's forward, backward and
    optimizer step (``.seconds``, ``.updates``)."""
    from transformers import TrainerCallback

    class StepTime(TrainerCallback):
        def __init__(self):
            self.seconds, self.updates, self._start = 0.0, 0, None

        def on_step_begin(self, args, state, control, **kwargs):
            self._start = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            self.seconds += time.perf_counter() - self._start
            self.updates += 1

    return StepTime()
