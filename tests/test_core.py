"""Tests of the framework-free R-Drop core (``rdrop_fairseq.core``).

Every expected value is computed independently, in float64 with plain torch ops, from the
mathematical definitions:

* label-smoothed NLL of one row: ``-sum_v q_v log p_v`` with the smoothed target
  distribution ``q = (1 - eps - eps_i) * onehot(t) + eps_i``, ``eps_i = eps / (V - 1)``
  (fairseq's ``label_smoothed_nll_loss``), summed over both passes and the non-pad rows;
* ``KL(P||Q) = sum_v P_v (log P_v - log Q_v)``, and the R-Drop term is
  ``1/2 (KL(P1||P2) + KL(P2||P1))`` summed over the non-pad positions.
"""

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from rdrop_fairseq.core import (
    RDropBatchError,
    duplicate_net_input,
    mse_consistency,
    rdrop_nll_loss,
    split_halves,
    symmetric_kl,
)

REPO = Path(__file__).resolve().parents[1]
CORE_PATH = REPO / "rdrop_fairseq" / "core.py"
PAD = 1  # fairseq's usual padding index
HUGE = 1 << 40  # chunk_elements giving one single chunk


# --------------------------------------------------------------------------- helpers


def gen(seed):
    return torch.Generator().manual_seed(seed)


def make_batch(n, v, seed, n_pad=0, dtype=torch.float64, scale=3.0):
    """Random stacked log-probs (2N, V) from distinct logits per pass, and a duplicated
    target (2N,) whose last ``n_pad`` positions are padding (``PAD``)."""
    g = gen(seed)
    logits = torch.randn(2 * n, v, generator=g, dtype=torch.float64) * scale
    lprobs = F.log_softmax(logits, dim=-1).to(dtype)
    t = torch.randint(0, v, (n,), generator=g)
    if v > 2:
        t[t == PAD] = 0  # real targets avoid the pad index (with V = 2 it is a real class)
    if n_pad:
        t[n - n_pad:] = PAD
    return lprobs, torch.cat([t, t])


def ref_terms(lprobs, target=None, epsilon=0.0, ignore_index=None):
    """Float64 reference (loss, nll, kl) straight from the definitions."""
    lp = lprobs.double()
    n, v = lp.size(0) // 2, lp.size(1)
    lp1, lp2 = lp[:n], lp[n:]
    if target is None:
        keep = torch.ones(n, dtype=torch.bool)
    elif ignore_index is None:
        keep = torch.ones(n, dtype=torch.bool)
    else:
        keep = target[:n] != ignore_index
    keep_f = keep.double()

    p1, p2 = lp1.exp(), lp2.exp()
    kl12 = (p1 * (lp1 - lp2)).sum(-1)
    kl21 = (p2 * (lp2 - lp1)).sum(-1)
    kl = 0.5 * ((kl12 + kl21) * keep_f).sum()

    if target is None:
        zero = lp.new_zeros(())
        return zero, zero, kl
    t = target[:n].clamp(0, v - 1)  # pad rows are masked out below anyway
    onehot = F.one_hot(t, v).double()
    eps_i = epsilon / (v - 1)
    q = (1.0 - epsilon - eps_i) * onehot + eps_i
    loss = (-(q * lp1).sum(-1) - (q * lp2).sum(-1)) * keep_f
    nll = (-(onehot * lp1).sum(-1) - (onehot * lp2).sum(-1)) * keep_f
    return loss.sum(), nll.sum(), kl


def ref_sym_kl(lprobs, keep=None):
    lp = lprobs.double()
    n = lp.size(0) // 2
    lp1, lp2 = lp[:n], lp[n:]
    per_pos = 0.5 * ((lp1.exp() * (lp1 - lp2)).sum(-1) + (lp2.exp() * (lp2 - lp1)).sum(-1))
    if keep is not None:
        per_pos = per_pos * keep.double()
    return per_pos.sum()


def close(actual, expected, rtol=1e-10, atol=1e-12):
    torch.testing.assert_close(
        actual.double(), torch.as_tensor(expected).double(), rtol=rtol, atol=atol
    )


def grads_of(fn, lprobs, weights=(1.0, 1.0, 1.0)):
    """Gradient of sum_i weights[i] * fn(lprobs)[i] with respect to lprobs."""
    x = lprobs.detach().clone().requires_grad_(True)
    outs = fn(x)
    total = sum(w * o for w, o in zip(weights, outs))
    (g,) = torch.autograd.grad(total, x)
    return [o.detach() for o in outs], g


# --------------------------------------------------------------------- 1. reference


SIZES = [(1, 2), (3, 2), (4, 7), (6, 50), (2, 300)]


@pytest.mark.parametrize("n,v", SIZES)
@pytest.mark.parametrize("epsilon", [0.0, 0.1])
@pytest.mark.parametrize("n_pad", [0, 1])
def test_matches_reference(n, v, epsilon, n_pad):
    if n_pad and n == 1:
        n_pad = 0  # padding the only row is covered by test_all_padding
    lprobs, target = make_batch(n, v, seed=100 * n + v, n_pad=n_pad)
    loss, nll, kl = rdrop_nll_loss(lprobs, target, epsilon=epsilon, ignore_index=PAD)
    r_loss, r_nll, r_kl = ref_terms(lprobs, target, epsilon, PAD)
    for got in (loss, nll, kl):
        assert got.dtype == torch.float64 and got.dim() == 0
    close(loss, r_loss)
    close(nll, r_nll)
    close(kl, r_kl)


@pytest.mark.parametrize("epsilon", [0.0, 0.1])
def test_matches_reference_float32(epsilon):
    lprobs, target = make_batch(8, 64, seed=7, n_pad=3, dtype=torch.float32)
    out = rdrop_nll_loss(lprobs, target, epsilon=epsilon, ignore_index=PAD)
    for got, want in zip(out, ref_terms(lprobs, target, epsilon, PAD)):
        assert got.dtype == torch.float32
        close(got, want, rtol=1e-5, atol=1e-6)


def test_no_target_gives_kl_over_all_rows():
    lprobs, _ = make_batch(5, 11, seed=3)
    loss, nll, kl = rdrop_nll_loss(lprobs)
    assert loss.item() == 0.0 and nll.item() == 0.0
    close(kl, ref_sym_kl(lprobs))


def test_no_ignore_index_uses_every_row():
    lprobs, target = make_batch(5, 11, seed=4, n_pad=2)  # PAD is then an ordinary class
    out = rdrop_nll_loss(lprobs, target, epsilon=0.1)
    for got, want in zip(out, ref_terms(lprobs, target, 0.1, None)):
        close(got, want)


def test_all_padding():
    lprobs, target = make_batch(3, 9, seed=5, n_pad=3)
    x = lprobs.clone().requires_grad_(True)
    loss, nll, kl = rdrop_nll_loss(x, target, epsilon=0.1, ignore_index=PAD)
    assert loss.item() == 0.0 and nll.item() == 0.0 and kl.item() == 0.0
    (loss + nll + kl).backward()
    assert torch.count_nonzero(x.grad) == 0


@pytest.mark.parametrize("epsilon", [0.0, 0.1])
@pytest.mark.parametrize("n,v,n_pad", [(1, 2, 0), (4, 7, 1), (6, 50, 2)])
def test_matches_fairseq_label_smoothed_nll_loss(epsilon, n, v, n_pad):
    from fairseq.criterions.label_smoothed_cross_entropy import label_smoothed_nll_loss

    lprobs, target = make_batch(n, v, seed=11 * n + v, n_pad=n_pad)
    loss, nll, _ = rdrop_nll_loss(lprobs, target, epsilon=epsilon, ignore_index=PAD)
    fs_loss, fs_nll = label_smoothed_nll_loss(lprobs, target, epsilon, ignore_index=PAD)
    close(loss, fs_loss)
    close(nll, fs_nll)


def test_does_not_modify_lprobs():
    lprobs, target = make_batch(6, 20, seed=6, n_pad=2, dtype=torch.float32)
    x = lprobs.clone().requires_grad_(True)
    loss, nll, kl = rdrop_nll_loss(x, target, epsilon=0.1, ignore_index=PAD, chunk_elements=40)
    (loss + nll + kl).backward()
    assert torch.equal(x.detach(), lprobs)


# ---------------------------------------------------------------------- 2. chunking


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_chunking_does_not_change_results(dtype):
    n, v = 13, 17
    lprobs, target = make_batch(n, v, seed=21, n_pad=4, dtype=dtype)
    weights = (0.7, 0.3, 1.9)

    def run(chunk_elements):
        return grads_of(
            lambda x: rdrop_nll_loss(
                x, target, epsilon=0.1, ignore_index=PAD, chunk_elements=chunk_elements
            ),
            lprobs,
            weights,
        )

    outs_big, g_big = run(HUGE)
    tol = dict(rtol=1e-12, atol=1e-14) if dtype == torch.float64 else dict(rtol=1e-5, atol=1e-6)
    # one row per chunk, and three rows per chunk (9 kept rows: a ragged last chunk)
    for chunk_elements in (1, 3 * v):
        outs, g = run(chunk_elements)
        for a, b in zip(outs, outs_big):
            torch.testing.assert_close(a, b, **tol)
        torch.testing.assert_close(g, g_big, **tol)


def test_symmetric_kl_chunking():
    g = gen(22)
    lprobs = F.log_softmax(torch.randn(6, 5, 13, generator=g, dtype=torch.float64), -1)
    keep = torch.rand(3, 5, generator=g) > 0.3
    a = symmetric_kl(lprobs, keep, chunk_elements=1)
    b = symmetric_kl(lprobs, keep, chunk_elements=HUGE)
    close(a, b, rtol=1e-12, atol=1e-14)


# ---------------------------------------------------------------------- 3. symmetry


@pytest.mark.parametrize("n,v", [(1, 2), (5, 9), (7, 100)])
def test_swapping_halves_keeps_kl(n, v):
    lprobs, target = make_batch(n, v, seed=31 + v, n_pad=1 if n > 1 else 0)
    swapped = torch.cat([lprobs[n:], lprobs[:n]])
    kl = rdrop_nll_loss(lprobs, target, ignore_index=PAD)[2]
    kl_swapped = rdrop_nll_loss(swapped, target, ignore_index=PAD)[2]
    close(kl, kl_swapped, rtol=1e-12)
    assert kl.item() > 0


@pytest.mark.parametrize("seed", range(5))
def test_kl_nonnegative(seed):
    g = gen(seed)
    n, v = 4, 2 + seed * 7
    # near-identical and very different passes
    base = torch.randn(n, v, generator=g, dtype=torch.float64)
    noise = torch.randn(n, v, generator=g, dtype=torch.float64) * (1e-4 if seed % 2 else 5.0)
    lprobs = F.log_softmax(torch.cat([base, base + noise]), -1)
    assert rdrop_nll_loss(lprobs)[2].item() >= 0
    assert symmetric_kl(lprobs).item() >= 0


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_kl_zero_for_equal_halves(dtype):
    g = gen(41)
    half = F.log_softmax(torch.randn(6, 30, generator=g, dtype=torch.float64) * 4, -1)
    lprobs = torch.cat([half, half]).to(dtype)
    target = torch.randint(0, 30, (6,), generator=g).repeat(2)
    kl = rdrop_nll_loss(lprobs, target, epsilon=0.1)[2]
    assert abs(kl.item()) <= 1e-7
    assert abs(symmetric_kl(lprobs).item()) <= 1e-7


def test_kl_positive_when_halves_differ():
    lprobs, _ = make_batch(3, 4, seed=42)
    # one single position differs a little
    lprobs[3:] = lprobs[:3]
    lprobs[4] = F.log_softmax(lprobs[4] + torch.tensor([0.0, 0.1, 0.0, 0.0], dtype=lprobs.dtype), -1)
    kl = rdrop_nll_loss(lprobs)[2]
    assert kl.item() > 0
    close(kl, ref_sym_kl(lprobs))


# ----------------------------------------------------------------------- 4. padding


@pytest.mark.parametrize("pad_value", [1e30, -1e30, 50.0, float("inf"), float("nan")])
@pytest.mark.parametrize("epsilon", [0.0, 0.1])
def test_padding_rows_have_no_effect(pad_value, epsilon):
    n, v, n_pad = 6, 10, 2
    lprobs, target = make_batch(n, v, seed=51, n_pad=n_pad)
    pad_rows = torch.cat([torch.arange(n - n_pad, n), torch.arange(2 * n - n_pad, 2 * n)])
    changed = lprobs.clone()
    changed[pad_rows] = pad_value
    changed[pad_rows[0], 0] = -pad_value  # not even a constant row
    weights = (0.6, 0.4, 2.0)

    def fn(x):
        return rdrop_nll_loss(x, target, epsilon=epsilon, ignore_index=PAD)

    outs, g = grads_of(fn, lprobs, weights)
    outs_changed, g_changed = grads_of(fn, changed, weights)
    for a, b in zip(outs, outs_changed):
        assert torch.equal(a, b)
    assert torch.equal(g, g_changed)
    assert torch.count_nonzero(g_changed[pad_rows]) == 0
    assert torch.count_nonzero(g[pad_rows]) == 0
    # and the values are those of the non-pad rows alone
    for got, want in zip(outs, ref_terms(lprobs, target, epsilon, PAD)):
        close(got, want)


def test_padding_changes_through_log_softmax():
    """Changing a pad row's logits (model output) does not move any non-pad gradient."""
    n, v = 4, 8
    g = gen(52)
    logits = torch.randn(2 * n, v, generator=g, dtype=torch.float64)
    target = torch.tensor([2, 3, PAD, 0]).repeat(2)

    def grad_of_logits(lg):
        lg = lg.clone().requires_grad_(True)
        loss, nll, kl = rdrop_nll_loss(F.log_softmax(lg, -1), target, 0.1, PAD)
        (loss + nll + kl).backward()
        return torch.stack([loss, nll, kl]).detach(), lg.grad

    vals, grad = grad_of_logits(logits)
    other = logits.clone()
    other[[2, 6]] = torch.randn(2, v, generator=g, dtype=torch.float64) * 1e3
    vals2, grad2 = grad_of_logits(other)
    assert torch.equal(vals, vals2)
    assert torch.equal(grad, grad2)
    assert torch.count_nonzero(grad[[2, 6]]) == 0


# --------------------------------------------------------------------- 5. gradients


def test_gradcheck_fused_loss():
    g = gen(61)
    n, v = 4, 5
    logits = torch.randn(2 * n, v, generator=g, dtype=torch.float64, requires_grad=True)
    target = torch.tensor([0, PAD, 4, 2]).repeat(2)

    def weighted(lg):
        loss, nll, kl = rdrop_nll_loss(F.log_softmax(lg, -1), target, 0.1, PAD, chunk_elements=2 * v)
        return 0.7 * loss + 0.2 * nll + 1.7 * kl

    def separate(lg):
        return rdrop_nll_loss(F.log_softmax(lg, -1), target, 0.1, PAD, chunk_elements=2 * v)

    assert torch.autograd.gradcheck(weighted, (logits,))
    assert torch.autograd.gradcheck(separate, (logits,))


@pytest.mark.parametrize("epsilon", [0.0, 0.1])
def test_gradcheck_fused_loss_raw_lprobs(epsilon):
    """The closed-form backward is the exact gradient of the returned function of lprobs."""
    g = gen(62)
    n, v = 3, 4
    lprobs = F.log_softmax(torch.randn(2 * n, v, generator=g, dtype=torch.float64), -1)
    lprobs = (lprobs + 0.05 * torch.randn(2 * n, v, generator=g, dtype=torch.float64))
    lprobs.requires_grad_(True)
    target = torch.tensor([1, 3, 0]).repeat(2)
    assert torch.autograd.gradcheck(
        lambda x: rdrop_nll_loss(x, target, epsilon, ignore_index=3), (lprobs,)
    )


def test_gradcheck_symmetric_kl_with_keep():
    g = gen(63)
    logits = torch.randn(4, 3, 5, generator=g, dtype=torch.float64, requires_grad=True)
    keep = torch.tensor([[True, False, True], [False, True, True]])
    assert torch.autograd.gradcheck(
        lambda lg: symmetric_kl(F.log_softmax(lg, -1), keep, chunk_elements=5), (logits,)
    )


def test_gradcheck_mse_consistency():
    g = gen(64)
    preds = torch.randn(6, 3, generator=g, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(mse_consistency, (preds,))


@pytest.mark.parametrize("dtype,rtol,atol", [(torch.float64, 1e-10, 1e-12), (torch.float32, 1e-4, 1e-6)])
def test_gradient_matches_reference_autograd(dtype, rtol, atol):
    n, v = 24, 300
    lprobs, target = make_batch(n, v, seed=65, n_pad=5, dtype=dtype)
    weights = (0.8, 0.15, 3.0)
    _, got = grads_of(
        lambda x: rdrop_nll_loss(x, target, 0.1, PAD, chunk_elements=7 * v), lprobs, weights
    )
    _, want = grads_of(lambda x: ref_terms(x, target, 0.1, PAD), lprobs.double(), weights)
    assert got.dtype == dtype
    torch.testing.assert_close(got.double(), want, rtol=rtol, atol=atol)


@pytest.mark.parametrize("weights", [(1.0, 0.0, 0.0), (0.0, 1.0, 0.0), (0.0, 0.0, 1.0)])
def test_gradient_of_each_output(weights):
    """Each output's gradient alone (catches a backward that mixes up g_loss/g_nll/g_kl)."""
    lprobs, target = make_batch(5, 12, seed=66, n_pad=1)
    _, got = grads_of(lambda x: rdrop_nll_loss(x, target, 0.2, PAD), lprobs, weights)
    _, want = grads_of(lambda x: ref_terms(x, target, 0.2, PAD), lprobs, weights)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


def test_symmetric_kl_gradient_matches_reference():
    g = gen(67)
    lprobs = F.log_softmax(torch.randn(8, 6, 40, generator=g, dtype=torch.float64) * 2, -1)
    keep = torch.rand(4, 6, generator=g) > 0.4
    x = lprobs.clone().requires_grad_(True)
    symmetric_kl(x, keep).backward()
    y = lprobs.clone().requires_grad_(True)
    ref_sym_kl(y, keep).backward()
    torch.testing.assert_close(x.grad, y.grad, rtol=1e-10, atol=1e-12)


# ------------------------------------------------------------------------ 6. dtypes


@pytest.mark.parametrize(
    "dtype,grad_rtol,grad_atol",
    [(torch.bfloat16, 2e-2, 2e-3), (torch.float16, 2e-3, 2e-4)],
)
def test_half_precision_inputs(dtype, grad_rtol, grad_atol):
    n, v = 16, 500
    lprobs64, target = make_batch(n, v, seed=71, n_pad=3)
    lprobs = lprobs64.to(dtype)
    weights = (1.0, 0.5, 2.0)
    outs, g = grads_of(lambda x: rdrop_nll_loss(x, target, 0.1, PAD), lprobs, weights)
    # the values the function actually saw, in float64
    exact = ref_terms(lprobs.double(), target, 0.1, PAD)
    # the ideal values before rounding the inputs to half precision
    ideal = ref_terms(lprobs64, target, 0.1, PAD)
    for got, want_exact, want_ideal in zip(outs, exact, ideal):
        assert got.dtype == torch.float32
        close(got, want_exact, rtol=1e-5, atol=1e-5)  # float32 arithmetic, not half
        close(got, want_ideal, rtol=2e-2, atol=1e-2)
    assert g.dtype == dtype
    _, want_g = grads_of(lambda x: ref_terms(x, target, 0.1, PAD), lprobs.double(), weights)
    torch.testing.assert_close(g.double(), want_g, rtol=grad_rtol, atol=grad_atol)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_symmetric_kl_and_mse(dtype):
    g = gen(72)
    lprobs = F.log_softmax(torch.randn(4, 3, 50, generator=g, dtype=torch.float64), -1).to(dtype)
    kl = symmetric_kl(lprobs)
    assert kl.dtype == torch.float32
    close(kl, ref_sym_kl(lprobs.double()), rtol=1e-5, atol=1e-6)
    preds = torch.randn(8, 4, generator=g).to(dtype)
    mse = mse_consistency(preds)
    assert mse.dtype == torch.float32
    p = preds.double()
    close(mse, ((p[:4] - p[4:]) ** 2).sum(), rtol=1e-6, atol=1e-6)


# ------------------------------------------------------------- 7. duplicate_net_input


def make_net_input(b=3):
    g = gen(81)
    return {
        "src_tokens": torch.randint(0, 100, (b, 5), generator=g),
        "src_lengths": torch.tensor([5, 4, 2][:b]),
        "prev_output_tokens": torch.randint(0, 100, (b, 4), generator=g),
        "extra": {"feats": torch.randn(b, 2, 3, generator=g), "flag": True},
        "features_only": False,
        "alignment_layer": None,
        "num_steps": 3,
        "scale": 0.5,
        "mode": "train",
    }


def test_duplicate_values_and_shapes():
    net_input = make_net_input()
    out = duplicate_net_input(net_input, 3)
    assert set(out) == set(net_input)
    for key in ("src_tokens", "src_lengths", "prev_output_tokens"):
        x = net_input[key]
        assert out[key].shape == (6,) + tuple(x.shape[1:])
        assert out[key].dtype == x.dtype
        assert torch.equal(out[key][:3], x) and torch.equal(out[key][3:], x)
    feats = net_input["extra"]["feats"]
    assert out["extra"]["feats"].shape == (6, 2, 3)
    assert torch.equal(out["extra"]["feats"], torch.cat([feats, feats]))
    assert out["extra"]["flag"] is True
    assert out["features_only"] is False
    assert out["alignment_layer"] is None
    assert out["num_steps"] == 3 and out["scale"] == 0.5 and out["mode"] == "train"


def test_duplicate_does_not_touch_caller():
    net_input = make_net_input()
    keys = list(net_input)
    objects = {k: v for k, v in net_input.items()}
    nested = net_input["extra"]
    nested_objects = dict(nested)
    snapshot = {k: v.clone() for k, v in net_input.items() if torch.is_tensor(v)}
    feats = nested["feats"].clone()

    out = duplicate_net_input(net_input, 3)
    # mutate the result: the caller's objects must not follow
    out["src_tokens"].fill_(-1)
    out["extra"]["feats"].fill_(-1.0)
    out["extra"]["new"] = 1
    out["mode"] = "changed"

    assert list(net_input) == keys
    assert all(net_input[k] is objects[k] for k in keys)
    assert net_input["extra"] is nested and dict(nested) == nested_objects
    for k, v in snapshot.items():
        assert torch.equal(net_input[k], v)
    assert torch.equal(nested["feats"], feats)
    assert net_input["mode"] == "train"


@pytest.mark.parametrize(
    "net_input,path",
    [
        ({"src_tokens": torch.zeros(3, 4), "src_lengths": torch.zeros(2)}, "net_input['src_lengths']"),
        ({"src_tokens": torch.zeros(3, 4), "src_lengths": torch.zeros(6)}, "net_input['src_lengths']"),
        ({"src_tokens": torch.zeros(3, 4), "temperature": torch.tensor(1.0)}, "net_input['temperature']"),
        ({"src_tokens": torch.zeros(3, 4), "src_lengths": [4, 4, 4]}, "net_input['src_lengths']"),
        ({"src_tokens": torch.zeros(3, 4), "extra": {"mask": torch.zeros(4, 4)}}, "net_input['extra']['mask']"),
        ({"src_tokens": torch.zeros(3, 4), "extra": {"ids": (1, 2, 3)}}, "net_input['extra']['ids']"),
    ],
    ids=["short", "already-doubled", "0-dim", "list", "nested-tensor", "nested-tuple"],
)
def test_duplicate_errors_name_the_key(net_input, path):
    with pytest.raises(RDropBatchError) as info:
        duplicate_net_input(net_input, 3)
    assert path in str(info.value)


@pytest.mark.parametrize("bad", [[torch.zeros(3)], torch.zeros(3, 2), None])
def test_duplicate_rejects_non_mapping(bad):
    with pytest.raises(RDropBatchError, match=r"net_input"):
        duplicate_net_input(bad, 3)


def test_rdrop_batch_error_is_value_error():
    assert issubclass(RDropBatchError, ValueError)


# ----------------------------------------------------------- 8. split and bad batches


def test_split_halves_are_views():
    x = torch.arange(24.0).reshape(6, 4)
    y1, y2 = split_halves(x)
    assert torch.equal(y1, x[:3]) and torch.equal(y2, x[3:])
    assert y1.untyped_storage().data_ptr() == x.untyped_storage().data_ptr()
    assert y2.untyped_storage().data_ptr() == x.untyped_storage().data_ptr()
    y2[0, 0] = -7.0
    assert x[3, 0].item() == -7.0


@pytest.mark.parametrize("shape", [(3, 4), (1,), (5, 2, 2)])
def test_split_halves_odd_raises(shape):
    with pytest.raises(RDropBatchError):
        split_halves(torch.zeros(shape))


def test_odd_rows_raise():
    lprobs = F.log_softmax(torch.randn(5, 4, generator=gen(91)), -1)
    with pytest.raises(RDropBatchError):
        rdrop_nll_loss(lprobs, torch.zeros(5, dtype=torch.long))
    with pytest.raises(RDropBatchError):
        rdrop_nll_loss(lprobs)
    with pytest.raises(RDropBatchError):
        symmetric_kl(lprobs)
    with pytest.raises(RDropBatchError):
        mse_consistency(torch.zeros(5, 2))


def test_differing_target_halves_raise():
    lprobs, target = make_batch(4, 6, seed=92)
    bad = target.clone()
    bad[5] = (bad[1] + 1) % 6
    with pytest.raises(RDropBatchError):
        rdrop_nll_loss(lprobs, bad, ignore_index=PAD)


def test_target_length_mismatch_raises():
    lprobs, target = make_batch(4, 6, seed=93)
    with pytest.raises(RDropBatchError):
        rdrop_nll_loss(lprobs, target[:6])


# ------------------------------------------------------------------ 9. mse / keep


def test_mse_consistency_formula():
    g = gen(101)
    preds = torch.randn(10, 3, generator=g, dtype=torch.float64)
    close(mse_consistency(preds), ((preds[:5] - preds[5:]) ** 2).sum())
    preds32 = torch.randn(8, generator=g)
    p = preds32.double()
    close(mse_consistency(preds32), ((p[:4] - p[4:]) ** 2).sum(), rtol=1e-6)


def test_mse_consistency_zero_for_equal_halves():
    half = torch.randn(4, 7, generator=gen(102))
    assert mse_consistency(torch.cat([half, half])).item() == 0.0


def test_symmetric_kl_with_keep_matches_reference():
    g = gen(103)
    lprobs = F.log_softmax(torch.randn(6, 4, 9, generator=g, dtype=torch.float64) * 2, -1)
    keep = torch.rand(3, 4, generator=g) > 0.5
    close(symmetric_kl(lprobs, keep), ref_sym_kl(lprobs, keep))
    close(symmetric_kl(lprobs), ref_sym_kl(lprobs))
    close(symmetric_kl(lprobs, torch.ones(3, 4, dtype=torch.bool)), ref_sym_kl(lprobs))
    with pytest.raises(RDropBatchError):
        symmetric_kl(lprobs, torch.ones(3, 3, dtype=torch.bool))


def test_symmetric_kl_equals_fused_kl():
    lprobs, target = make_batch(7, 15, seed=104, n_pad=2)
    keep = target[:7] != PAD
    close(symmetric_kl(lprobs, keep), rdrop_nll_loss(lprobs, target, 0.1, PAD)[2], rtol=1e-12)


# ---------------------------------------------------------------- 10. no fairseq


def test_core_imports_without_fairseq():
    code = textwrap.dedent(
        f"""
        import importlib.util, sys
        sys.modules["fairseq"] = None  # any "import fairseq..." now fails

        spec = importlib.util.spec_from_file_location("rdrop_core", {str(CORE_PATH)!r})
        core = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(core)

        import torch
        lprobs = torch.log_softmax(torch.tensor([[0.0, 1.0], [1.0, 0.0]]), -1)
        lprobs.requires_grad_(True)
        loss, nll, kl = core.rdrop_nll_loss(lprobs, torch.tensor([0, 0]), 0.1)
        (loss + kl).backward()
        assert kl.item() > 0 and lprobs.grad is not None
        assert not any(m == "fairseq" or m.startswith("fairseq.") for m in sys.modules
                       if sys.modules[m] is not None)
        print("OK", float(kl))
        """
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=REPO
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("OK")


def test_class_ruled_out_by_both_passes_contributes_nothing():
    """log p = log q = -inf for one class (e.g. a masked token): finite KL, zero gradient there."""
    logits = torch.tensor([[0.0, 1.0, -float("inf")], [1.0, 0.0, -float("inf")]], dtype=torch.float64)
    lprobs = torch.log_softmax(logits, -1).requires_grad_()
    loss, nll, kl = rdrop_nll_loss(lprobs, torch.tensor([0, 0]))
    finite = lprobs.detach()[:, :2]
    p, q = finite[0].exp(), finite[1].exp()
    expected = 0.5 * ((p - q) * (finite[0] - finite[1])).sum()
    torch.testing.assert_close(kl, expected)
    (loss + kl).backward()
    assert torch.isfinite(lprobs.grad).all() and (lprobs.grad[:, 2] == 0).all()
