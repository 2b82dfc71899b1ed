"""RDropTrainer under DDP as users run it: torchrun, 2 CPU processes (gloo), the Trainer's
defaults (find_unused_parameters on, average_tokens_across_devices as the version sets it),
one step of 4 examples. The gradient it applies must be the one a single process computes
on all 4, and its eval_loss one process's: causal LM through the logits and through the
fused head (whose weight DDP's reducer must see used in the forward), with gradient
accumulation, an encoder-decoder model through the fused head, and a classifier. Two of
the examples hold fewer labelled tokens, so a per-rank count fails, and the loss without
its world-size scale (a mutation, run here) must give another gradient."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from tests.hf_ddp_worker import CASES, run  # noqa: E402
from tests.torchrun_launch import child_env, failure, torchrun  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def two_processes(tmp_path_factory):
    folder = tmp_path_factory.mktemp("ddp")
    torchrun("hf_ddp_worker.py", folder, *CASES, env=child_env())
    return folder


def results(folder, case):
    """The gradient, and (eval_loss, the step's logged rdrop_ce, rdrop_kl)."""
    import ast

    return torch.load(folder / f"{case}.pt"), ast.literal_eval((folder / f"{case}.eval")
                                                                .read_text())


@pytest.mark.slow
@pytest.mark.parametrize("case", [c for c in CASES if c not in ("unscaled",
                                                                 "causal-own-counts")])
def test_two_processes_apply_the_gradient_of_the_whole_batch(tmp_path, two_processes, case):
    run(str(tmp_path), case)
    want, want_eval = results(tmp_path, case)
    got, got_eval = results(two_processes, case)
    assert got.keys() == want.keys() and len(want) > 3
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-7,
                                   msg=lambda m, name=name: f"{name}: {m}")
    # eval_loss, and the step's logged cross-entropy and KL (summed over the processes)
    assert got_eval == pytest.approx(want_eval, rel=1e-5, abs=1e-4)


@pytest.mark.slow
def test_the_loss_without_its_world_size_scale_gives_another_gradient(tmp_path, two_processes):
    run(str(tmp_path), "causal")
    want, _ = results(tmp_path, "causal")
    mutant, _ = results(two_processes, "unscaled")
    torch.testing.assert_close(mutant["transformer.wte.weight"] * 2, want["transformer.wte.weight"],
                               rtol=1e-5, atol=1e-7)  # half: DDP's average of unscaled losses


@pytest.mark.slow
@pytest.mark.parametrize("path,checkpointing", [("fused", False), ("fused", True),
                                                 ("logits", True)])
def test_fsdp2_sharded_model_gives_the_gradient_of_the_whole_batch(tmp_path, path,
                                                                  checkpointing):
    """FSDP2 (fully_shard) on 2 CPU processes, through rdrop_hf_loss as a loop of one's own
    would call it: the fused path computes its loss inside the head's call, where FSDP has
    gathered the weight (a DTensor shard outside); the gradient is one process's on all."""
    from tests.hf_fsdp_worker import gradients

    want, _ = gradients(path == "fused", checkpointing)
    torchrun("hf_fsdp_worker.py", tmp_path / "fsdp.pt", path,
             *(["checkpointing"] if checkpointing else []), env=child_env())
    got = torch.load(tmp_path / "fsdp.pt")
    assert got["sharded"]  # the head's weight was a shard outside the forward
    assert got["grads"].keys() == want.keys()
    for name in want:
        torch.testing.assert_close(got["grads"][name], want[name], rtol=1e-5, atol=1e-7,
                                   msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("version", [1, 2])
@pytest.mark.parametrize("path", ["fused", "logits"])
def test_the_trainers_own_fsdp_on_a_gpu_trains_as_without_it(tmp_path, path, version):
    """The Trainer's FSDP, version 1 (deprecated by transformers 5.25, kept while the floor
    admits it) and 2 (full sharding, torchrun, one GPU; FSDP2 is also tested on CPU
    processes in tests/test_hf_sharded.py): its R-Drop step's loss, and the eval_loss after
    one SGD step (which its gradient decides), are the unsharded run's."""
    import json

    if version == 2 and int(transformers.__version__.split(".")[0]) < 5:
        pytest.skip("the Trainer's FSDP2 is transformers 5's")
    env = child_env()
    runs = {}
    for mode in ("plain", f"fsdp{version}"):
        command = ([sys.executable, "-m", "torch.distributed.run", "--standalone",
                    "--nproc_per_node", "1"] if mode != "plain" else [sys.executable])
        proc = subprocess.run([*command, "tests/hf_fsdp_trainer_worker.py",
                               str(tmp_path / mode), path, mode], cwd=REPO, env=env,
                              capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, failure(proc)
        runs[mode] = json.loads((tmp_path / mode).read_text())
    sharded = runs[f"fsdp{version}"]
    assert "FullyShardedDataParallel" in sharded["wrapped"] or \
        sharded["wrapped"].startswith("FSDP"), sharded
    assert sharded["loss"] == pytest.approx(runs["plain"]["loss"], rel=1e-4)
    assert sharded["eval_after"] == pytest.approx(runs["plain"]["eval_after"], rel=1e-4)


@pytest.mark.slow
def test_with_each_process_counting_its_own_items_ddp_averages_their_means(two_processes):
    """average_tokens_across_devices=False: each process divides by its own labelled
    tokens (4 and 10 here), as the Trainer does, and DDP averages: the gradient is the
    mean of the two halves' gradients, each normalised by its own count, computed here."""
    from rdrop_fairseq import hf
    from tests.tiny_hf_models import causal, examples

    torch.manual_seed(0)
    model = causal()
    data = examples("causal")
    model.train()
    for half in (data[:2], data[2:]):
        batch = {key: torch.stack([d[key] for d in half]) for key in half[0]}
        (hf.rdrop_hf_loss(model, batch, kind="causal", alpha=1.0).loss / 2).backward()
    want = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    got, _ = results(two_processes, "causal-own-counts")
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-7,
                                   msg=lambda m, name=name: f"{name}: {m}")
