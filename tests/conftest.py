"""One intra-op thread per pytest-xdist worker: the workers (one per core, scripts/test.sh)
already share the cores, and torch's default of a thread per core in each of them
oversubscribes them (OpenMP threads spin-waiting for a core)."""

import os

import torch

if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)
