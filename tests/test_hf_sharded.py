"""RDropTrainer with the model sharded by the Trainer itself, as users configure it:
DeepSpeed ZeRO (``deepspeed=``) and FSDP2 (``fsdp="full_shard"``, version 2), under
torchrun on 2 CPU processes (gloo; DeepSpeed's CPU accelerator), one SGD step of 4 examples
(tests/hf_sharded_worker.py). Under ZeRO-3, every parameter partitioned, the output
embedding's weight is an empty shard outside the forward, and under FSDP2 a DTensor's part
(both checked before the step). The step must update every parameter as one unsharded
process does on all 4, and report its training loss and the eval_loss after it: a causal
LM through the logits and through the fused head under gradient checkpointing, the fused
head with gradient accumulation 2, a Marian model through the fused head (ZeRO-3; a bias
added to its logits), and ZeRO-2 through the fused head; under DeepSpeed's bf16, within
bf16's precision. The loss without its world-size scale (a mutation, run here) must give
half the update."""

import re
import sys
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from tests.torchrun_launch import child_env, torchrun  # noqa: E402
from tests.hf_sharded_worker import CASES, RUNNABLE, SHARDED, reference  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
MUTANTS = [case for case in CASES if case.endswith("unscaled")]


def deepspeed_folder():
    """Where scripts/setup.sh installs DeepSpeed (requirements/deepspeed.txt): a folder
    these processes alone put on their path."""
    pins = (REPO / "requirements" / "deepspeed.txt").read_text()
    version = re.search(r"^deepspeed==(\S+)", pins, re.M)[1]
    folder = Path(sys.prefix) / "share" / "rdrop-fairseq" / f"deepspeed-{version}"
    assert (folder / "deepspeed").is_dir(), f"no DeepSpeed in {folder}: bash scripts/setup.sh"
    return folder


@pytest.fixture(scope="module")
def two_processes(tmp_path_factory):
    folder = tmp_path_factory.mktemp("sharded")
    # DeepSpeed's CPU processes even where a GPU is visible
    torchrun("hf_sharded_worker.py", folder, *RUNNABLE,
             env=child_env(deepspeed_folder(), DS_ACCELERATOR="cpu", CUDA_VISIBLE_DEVICES=""))
    return folder


def runnable(case):
    if case not in RUNNABLE:
        pytest.skip(f"the Trainer's FSDP2 is tested with transformers 5 (here "
                    f"{transformers.__version__}, whose Trainer makes FSDP1)")


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    """The references, one for each model, fused path and checkpointing of the cases."""
    folder, done = tmp_path_factory.mktemp("one-process"), {}

    def get(case):
        c = CASES[case]
        key = (c.make, c.fused, c.checkpointing)
        if key not in done:
            done[key] = reference(str(folder), case)
        return done[key]
    return get


@pytest.mark.slow
@pytest.mark.parametrize("case", [c for c in CASES if c not in MUTANTS and "bf16" not in c])
def test_the_sharded_step_is_the_step_of_one_process_on_the_whole_batch(two_processes,
                                                                         one_process, case):
    runnable(case)
    got, want = torch.load(two_processes / f"{case}.pt"), one_process(case)
    assert got["sharded"] is (CASES[case].sharding in SHARDED)  # the head's weight, before the step
    assert got["update"].keys() == want["update"].keys() and len(want["update"]) > 3
    assert max(float(u.abs().max()) for u in want["update"].values()) > 0.1  # a real step
    for name, update in want["update"].items():
        torch.testing.assert_close(got["update"][name], update, rtol=1e-4, atol=1e-7,
                                   msg=lambda m, name=name: f"{name}: {m}")
    assert got["loss"] == pytest.approx(want["loss"], rel=1e-5)
    assert got["eval_after"] == pytest.approx(want["eval_after"], rel=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("case", MUTANTS)
def test_the_loss_without_its_world_size_scale_gives_half_the_update(two_processes,
                                                                     one_process, case):
    runnable(case)
    got, want = torch.load(two_processes / f"{case}.pt"), one_process(case)
    for name, update in want["update"].items():
        torch.testing.assert_close(got["update"][name] * 2, update, rtol=1e-4, atol=2e-7,
                                   msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.slow
def test_deepspeed_bf16_updates_the_head_as_float32_within_bf16(two_processes, one_process):
    """DeepSpeed's bf16 (its weights in bf16, float32 master weights): the loss, the
    eval_loss after the step and the update of the output embedding (the fused path's
    weight) are float32's within bf16's precision; half the update would be 50 % off."""
    case = "zero3-fused-checkpointing-bf16"
    got, want = torch.load(two_processes / f"{case}.pt"), one_process(case)
    assert got["sharded"]
    assert got["loss"] == pytest.approx(want["loss"], rel=1e-3)
    assert got["eval_after"] == pytest.approx(want["eval_after"], rel=1e-3)
    update = want["update"]["transformer.wte.weight"]
    scale = float(update.abs().max())
    assert scale > 0.1
    torch.testing.assert_close(got["update"]["transformer.wte.weight"], update, rtol=0,
                               atol=0.02 * scale)
