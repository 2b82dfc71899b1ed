"""``LiveBytes`` (rdrop_fairseq.opcount): what counts as an allocation. The expected bytes
come from the shapes and dtypes, not from the tool."""

import torch
import torch.nn.functional as F

from rdrop_fairseq.opcount import LiveBytes


def test_a_view_of_a_weight_made_before_is_no_allocation():
    """``F.linear`` transposes its weight (a view) before the product: only the 10 x 1000
    float32 output is new (40,000 bytes), not the 4 MB weight it reads."""
    weight = torch.randn(1000, 1000)  # 4,000,000 bytes, made before the measurement
    x = torch.randn(10, 1000)
    with LiveBytes() as memory:
        y = F.linear(x, weight)
        live_with_y = memory.live
        del y
    assert memory.peak == 10 * 1000 * 4, memory.peak
    assert live_with_y == 10 * 1000 * 4
    assert memory.live == 0


def test_in_place_and_out_writes_into_old_tensors_are_no_allocation():
    """An optimizer-like step writing into tensors made before allocates nothing."""
    p, g = torch.zeros(500, 200), torch.ones(500, 200)
    with LiveBytes() as memory:
        p.add_(g, alpha=-0.1)
        torch.mul(g, 2.0, out=p)
        p.t_()
    assert memory.peak == 0, memory.peak


def test_tensors_made_inside_count_once_with_their_views():
    """A storage made inside counts once, whatever views of it are taken; a copy of an old
    tensor is a new storage of the same size."""
    old = torch.randn(250, 40, dtype=torch.float64)  # 80,000 bytes
    with LiveBytes() as memory:
        a = torch.empty(1000)  # 4,000 bytes
        views = [a.view(10, 100), a[::2], a.view(10, 100).t()]
        a.mul_(2.0)
        copy = old.clone()
        assert memory.live == 4000 + 80_000
    assert memory.peak == 4000 + 80_000, memory.peak
    del a, views, copy
    assert memory.live == 0
