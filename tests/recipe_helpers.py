"""Helpers shared by the recipe tests (LM, summarization, GLUE)."""

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DEAD_PROXY = "http://127.0.0.1:9"  # refuses every connection: a download fails at once
OFFLINE = {"http_proxy": DEAD_PROXY, "https_proxy": DEAD_PROXY, "HTTPS_PROXY": DEAD_PROXY,
           "HTTP_PROXY": DEAD_PROXY, "no_proxy": ""}  # env for run(): no network


def run(cmd, ok=True, env=None):
    """Run a recipe module, script or fairseq tool on one thread with the test environment's tools
    on PATH; ``proc.output`` is stdout + stderr. With ``ok``, a failure fails the test."""
    full_env = {"PATH": str(Path(sys.executable).parent), "OMP_NUM_THREADS": "1",
                "MKL_NUM_THREADS": "1", "HOME": "/tmp", "PYTHONUNBUFFERED": "1", **(env or {})}
    proc = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=300,
                          env=full_env, cwd=REPO)  # the root: python -m experiments.*
    proc.output = proc.stdout + proc.stderr
    if ok:
        assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return proc
