"""docs/huggingface.md's loops of one's own, run as the page gives them: the Accelerate
loop on 2 CPU processes (torchrun, gloo; ACCELERATE_USE_CPU, as ``accelerate launch
--cpu`` sets) must update a tiny GPT-2 as the plain loop does in one process on the same
4 examples, whose halves hold different numbers of labelled tokens (so a count of one
process's items, or a loss without the world-size scale, gives another update)."""


import pytest
import torch

pytest.importorskip("transformers")

from tests.tiny_hf_models import causal  # noqa: E402
from tests.torchrun_launch import child_env, torchrun  # noqa: E402
from tests.hf_loop_worker import loops, step  # noqa: E402


def test_the_page_has_the_two_loops():
    plain, accelerated = loops()
    assert "rdrop_hf_loss(model, batch" in plain and "Accelerator()" in accelerated


@pytest.mark.slow
def test_the_accelerate_loop_on_two_processes_is_the_plain_loop_on_the_whole_batch(tmp_path):
    want, _ = step(0)
    torch.manual_seed(0)
    before = dict(causal().named_parameters())
    assert max(float((want[n] - p).abs().max()) for n, p in before.items()) > 0.1  # a step
    torchrun("hf_loop_worker.py", tmp_path / "accelerate.pt", "accelerate",
             env=child_env(ACCELERATE_USE_CPU="true"))
    got = torch.load(tmp_path / "accelerate.pt")
    assert got["processes"] == 2
    assert got["parameters"].keys() == want.keys()
    for name in want:
        torch.testing.assert_close(got["parameters"][name], want[name], rtol=1e-5, atol=1e-7,
                                   msg=lambda m, name=name: f"{name}: {m}")
