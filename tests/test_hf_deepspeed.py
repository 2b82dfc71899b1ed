"""RDropTrainer under DeepSpeed ZeRO as users run it with the Trainer's ``deepspeed=``
configuration: torchrun, 2 CPU processes (gloo, DeepSpeed's CPU accelerator), one SGD step
of 4 examples. Under ZeRO-3, with every parameter partitioned, the output embedding's
weight is an empty shard outside the forward (checked before the step); the step must
update every parameter as one process without DeepSpeed does on all 4, and report its
training loss and the eval_loss after it: a causal LM through the logits and through the
fused head, each with gradient checkpointing, the fused head with gradient accumulation 2
and for a Marian model (a bias added to its logits), and ZeRO-2 through the fused head.
The loss without its world-size scale (a mutation, run here) must give half the update."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from tests.hf_deepspeed_worker import CASES, reference  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def two_processes(tmp_path_factory):
    folder = tmp_path_factory.mktemp("deepspeed")
    # the CPU processes even where a GPU is visible
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO),
           "DS_ACCELERATOR": "cpu", "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
         "2", "tests/hf_deepspeed_worker.py", str(folder), *CASES], cwd=REPO, env=env,
        capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return folder


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    """The references, one for each model, fused path and checkpointing of the cases."""
    folder, done = tmp_path_factory.mktemp("one-process"), {}

    def get(case):
        key = CASES[case][1:4]
        if key not in done:
            done[key] = reference(str(folder), case)
        return done[key]
    return get


@pytest.mark.slow
@pytest.mark.parametrize("case", [c for c in CASES if c != "zero3-unscaled"])
def test_deepspeed_zero_applies_the_update_of_the_whole_batch(two_processes, one_process,
                                                             case):
    got, want = torch.load(two_processes / f"{case}.pt"), one_process(case)
    assert got["sharded"] is (CASES[case][0] == 3)  # the head's weight, before the step
    assert got["update"].keys() == want["update"].keys() and len(want["update"]) > 3
    assert max(float(u.abs().max()) for u in want["update"].values()) > 0.1  # a real step
    for name, update in want["update"].items():
        torch.testing.assert_close(got["update"][name], update, rtol=1e-4, atol=1e-7,
                                   msg=lambda m, name=name: f"{name}: {m}")
    assert got["loss"] == pytest.approx(want["loss"], rel=1e-5)
    assert got["eval_after"] == pytest.approx(want["eval_after"], rel=1e-5)


@pytest.mark.slow
def test_the_loss_without_its_world_size_scale_gives_half_the_update(two_processes,
                                                                     one_process):
    got, want = torch.load(two_processes / "zero3-unscaled.pt"), one_process("zero3-unscaled")
    for name, update in want["update"].items():
        torch.testing.assert_close(got["update"][name] * 2, update, rtol=1e-4, atol=2e-7,
                                   msg=lambda m, name=name: f"{name}: {m}")
