"""Launching a test's worker on 2 processes with torchrun (gloo, CPU), and reading what a
failed launch said. The workers (tests/hf_*_worker.py) are the processes; their tiny
models and examples are in tests/tiny_hf_models.py."""

import os
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def child_env(*folders, **extra):
    """The environment of a torchrun launched by a test: the repository first on the path,
    then ``folders``, then the test's own path (the floor's packages, in
    tests/test_transformers_floor.py)."""
    path = os.pathsep.join([str(REPO), *map(str, folders),
                            *filter(None, [os.environ.get("PYTHONPATH")])])
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": path, **extra}


def torchrun(worker, *args, env):
    """Run ``tests/<worker>`` under torchrun on 2 processes; assert that it succeeded,
    showing what it said otherwise (:func:`failure`)."""
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
         "2", f"tests/{worker}", *map(str, args)], cwd=REPO, env=env, capture_output=True,
        text=True, timeout=300)
    assert proc.returncode == 0, failure(proc)


def failure(proc):
    """What a failed torchrun said: the lines naming an error or a signal first (a parent
    run that shows only its end still shows them), then the ends of its output."""
    lines = (proc.stdout + proc.stderr).splitlines()
    errors = [line for line in lines if re.search(r"Error|error:|terminate|Signal|abort",
                                                  line)]
    return "\n".join([*errors[-20:], proc.stdout[-2000:], proc.stderr[-2000:]])
