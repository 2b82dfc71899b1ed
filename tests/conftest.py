"""One intra-op thread per pytest-xdist worker: the workers (one per core, scripts/test.sh)
already share the cores, and torch's default of a thread per core in each of them
oversubscribes them (OpenMP threads spin-waiting for a core)."""

import os
import sys

import pytest
import torch

if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)

# The files that take longest (summed test durations of a whole run, this machine), run
# first: pytest-xdist hands out whole files (--dist loadfile) in collection order, and a
# long file collected last leaves the other workers idle at the end.
SLOWEST_FIRST = [
    "tests/test_transformers_floor.py",  # the Hugging Face tests again, on 4.49: 70 s alone
    "tests/test_recipe_scripts.py",  # gpu_check.sh's CPU smoke run: 64-72 s (AMD EPYC)
    "tests/test_hf_sharded.py",  # DeepSpeed and FSDP2 on 2 processes: 95 s in a full run
    "tests/test_demo_rerun.py",  # one test of 84 s: it ran last at d5c6e97
    "tests/test_hf_ddp.py",  # torchrun and FSDP2: about 55 s
    "tests/test_hf_kinds.py",  # the kind sweep: 40 s
    "tests/test_attendout_gate.py",
    "experiments/tests/test_attendout_controls.py",  # the noise control and its positive one
    "tests/test_attendout_search.py",
    "tests/test_translation_recipe.py",
    "experiments/tests/test_libreoffice_summaries.py",
    "experiments/tests/test_sotu_glue.py",
    "tests/test_glue_recipe.py",
    "tests/test_glue_bert_recipe.py",  # 18 s: four Python processes of the script
    "tests/test_attendout.py",
    "tests/test_attendout_distributed.py",  # 9 fairseq-train runs (14 processes): 15 s
    "tests/test_criteria.py",
    "tests/test_reliability.py",
    "tests/test_distributed.py",
    "tests/test_lm_recipe.py",
    "tests/test_hot_path.py",
    "experiments/tests/test_sotu.py",
]


def pytest_collection_modifyitems(session, config, items):
    rank = {path: i for i, path in enumerate(SLOWEST_FIRST)}

    def key(item):
        path = item.nodeid.split("::")[0]
        return rank.get(path, len(rank))

    items.sort(key=key)  # stable: the order within a file and of the other files is kept


@pytest.fixture(autouse=True)
def _mixed_precision_stays_in_its_test():
    """transformers 4's TrainingArguments(bf16=True) or (fp16=True) sets
    ACCELERATE_MIXED_PRECISION for the whole process, and accelerate keeps it in a
    process-wide state: every later Trainer of the process would run in that precision."""
    before = os.environ.get("ACCELERATE_MIXED_PRECISION")
    yield
    if os.environ.get("ACCELERATE_MIXED_PRECISION") != before:
        if before is None:
            del os.environ["ACCELERATE_MIXED_PRECISION"]
        else:
            os.environ["ACCELERATE_MIXED_PRECISION"] = before
        if "accelerate.state" in sys.modules:
            sys.modules["accelerate.state"].AcceleratorState._reset_state(reset_partial_state=True)
