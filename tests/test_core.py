"""Tests of the framework-free R-Drop core (``rdrop_fairseq.core``).

Every expected value is computed independently, in float64 with plain torch ops and
autograd, from the mathematical definitions (never from the closed-form gradient the
implementation uses):

* label-smoothed NLL of one row: ``-sum_v q_v log p_v`` with the smoothed target
  distribution ``q = (1 - eps - eps_i) * onehot(t) + eps_i``, ``eps_i = eps / (V - 1)``
  (fairseq's ``label_smoothed_nll_loss``), summed over both passes and the non-pad rows;
* ``KL(P||Q) = sum_v P_v (log P_v - log Q_v)``, and the R-Drop term is
  ``1/2 (KL(P1||P2) + KL(P2||P1))`` summed over the non-pad positions;
* ``total = loss + alpha * kl``; its gradient is autograd's through ``log_softmax`` (scores
  are logits) or directly (scores are log-probabilities).
"""

import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from rdrop_fairseq.core import (
    RDropBatchError,
    chunk_rows_for,
    duplicate_net_input,
    mse_consistency,
    rdrop_loss,
    split_halves,
    symmetric_kl,
)
from rdrop_fairseq.opcount import count_ops
from tests.test_fused_linear import LargestTensor

REPO = Path(__file__).resolve().parents[1]
PAD = 1  # fairseq's usual padding index
ONE_CHUNK = 1e6  # chunk_mb giving one single chunk
ROW_CHUNK = 1e-9  # chunk_mb giving one row pair per chunk
MODES = ["logits", "log_probs"]


# --------------------------------------------------------------------------- helpers


def gen(seed):
    return torch.Generator().manual_seed(seed)


def make_batch(n, v, seed, n_pad=0, mode="logits", dtype=torch.float64, scale=3.0):
    """Scores (2N, V) of two different passes (logits, or their log_softmax) and one
    pass's target (N,) whose last ``n_pad`` positions are padding (``PAD``)."""
    g = gen(seed)
    scores = torch.randn(2 * n, v, generator=g, dtype=torch.float64) * scale
    if mode == "log_probs":
        scores = F.log_softmax(scores, -1)
    t = torch.randint(0, v, (n,), generator=g)
    if v > 2:
        t[t == PAD] = 0  # real targets avoid the pad index (with V <= 2 it is a real class)
    if n_pad:
        t[n - n_pad:] = PAD
    return scores.to(dtype), t


def reference(scores, target=None, alpha=0.0, epsilon=0.0, ignore_index=None, keep=None,
              mode="logits"):
    """Float64 (total, loss, nll, kl) straight from the definitions (differentiable)."""
    x = scores.double().reshape(2, -1, scores.size(-1))
    lp = F.log_softmax(x, -1) if mode == "logits" else x
    lp1, lp2 = lp[0], lp[1]
    n, v = lp1.shape
    w = torch.ones(n, dtype=torch.float64)
    if target is not None and ignore_index is not None:
        w = w * (target.reshape(-1) != ignore_index).double()
    if keep is not None:
        w = w * keep.reshape(-1).double()
    # a class both passes rule out (log p = log q = -inf) contributes 0 to the KL
    diff = torch.where(torch.isinf(lp1) & torch.isinf(lp2), torch.zeros_like(lp1), lp1 - lp2)
    kl = 0.5 * (((lp1.exp() - lp2.exp()) * diff).sum(-1) * w).sum()
    if target is None:
        zero = kl * 0
        return alpha * kl, zero, zero, kl
    onehot = F.one_hot(target.reshape(-1), v).double()
    eps_i = epsilon / (v - 1) if v > 1 else 0.0
    q = (1.0 - epsilon - eps_i) * onehot + eps_i
    def dot(weights, lp):  # sum_v weights_v lp_v, with 0 * log 0 = 0 (a class ruled out)
        return torch.where(weights == 0, 0.0, weights * lp).sum(-1)

    loss = ((-dot(q, lp1) - dot(q, lp2)) * w).sum()
    nll = ((-dot(onehot, lp1) - dot(onehot, lp2)) * w).sum()
    return loss + alpha * kl, loss, nll, kl


def ours_with_grad(scores, target=None, mode="logits", **kw):
    x = scores.detach().clone().requires_grad_(True)
    out = rdrop_loss(x, target, log_probs=mode == "log_probs", **kw)
    out.total.backward()
    return out, x.grad


def reference_with_grad(scores, target=None, mode="logits", **kw):
    x = scores.detach().double().clone().requires_grad_(True)
    out = reference(x, target, mode=mode, **kw)
    out[0].backward()
    return [o.detach() for o in out], x.grad


def mb_for(rows, v, scores):
    """A chunk_mb that gives ``rows`` row pairs per chunk (the accounting of chunk_rows_for:
    two float rows per pair for scores in the compute dtype, four otherwise)."""
    compute = torch.promote_types(scores.dtype, torch.float32)
    per_pair = (2 if scores.dtype == compute else 4) * v * compute.itemsize
    return rows * per_pair * 1.0001 / 2**20


def close(actual, expected, rtol=1e-10, atol=1e-12):
    torch.testing.assert_close(
        actual.double(), torch.as_tensor(expected).double(), rtol=rtol, atol=atol
    )


# --------------------------------------------------------------------- 1. reference


SIZES = [(1, 1), (1, 2), (3, 2), (4, 7), (6, 50), (2, 300)]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("n,v", SIZES)
@pytest.mark.parametrize("epsilon,alpha", [(0.0, 0.0), (0.1, 5.0), (0.0, 1.0), (0.2, 0.7)])
@pytest.mark.parametrize("n_pad", [0, 1])
def test_values_and_gradient_match_reference(mode, n, v, epsilon, alpha, n_pad):
    if n_pad and n == 1:
        n_pad = 0  # padding the only row is covered by test_all_padding
    scores, target = make_batch(n, v, seed=100 * n + v, n_pad=n_pad, mode=mode)
    kw = dict(alpha=alpha, epsilon=epsilon, ignore_index=PAD)
    out, grad = ours_with_grad(scores, target, mode, **kw)
    want, want_grad = reference_with_grad(scores, target, mode, **kw)
    for got, expected in zip(out, want):
        assert got.dtype == torch.float64 and got.dim() == 0
        close(got, expected)
    assert grad.dtype == torch.float64
    torch.testing.assert_close(grad, want_grad, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("mode", MODES)
def test_gradient_by_finite_differences(mode):
    """The analytic gradient against central differences of the returned total."""
    scores, target = make_batch(3, 5, seed=61, n_pad=1, mode=mode, scale=1.0)
    kw = dict(alpha=2.0, epsilon=0.1, ignore_index=PAD, log_probs=mode == "log_probs")
    _, grad = ours_with_grad(scores, target, mode, **{k: v for k, v in kw.items()
                                                      if k != "log_probs"})
    h = 1e-6
    numeric = torch.zeros_like(scores)
    for i in range(scores.numel()):
        up, down = scores.clone().view(-1), scores.clone().view(-1)
        up[i] += h
        down[i] -= h
        f_up = rdrop_loss(up.view_as(scores), target, **kw).total
        f_down = rdrop_loss(down.view_as(scores), target, **kw).total
        numeric.view(-1)[i] = (f_up - f_down) / (2 * h)
    torch.testing.assert_close(grad, numeric, rtol=1e-6, atol=1e-8)


@pytest.mark.parametrize("epsilon", [0.0, 0.1])
@pytest.mark.parametrize("n,v,n_pad", [(1, 2, 0), (4, 7, 1), (6, 50, 2)])
def test_matches_fairseq_label_smoothed_nll_loss(epsilon, n, v, n_pad):
    from fairseq.criterions.label_smoothed_cross_entropy import label_smoothed_nll_loss

    logits, target = make_batch(n, v, seed=11 * n + v, n_pad=n_pad)
    out = rdrop_loss(logits, target, epsilon=epsilon, ignore_index=PAD)
    lprobs = F.log_softmax(logits, -1)
    fs_loss, fs_nll = label_smoothed_nll_loss(lprobs, target.repeat(2), epsilon, ignore_index=PAD)
    close(out.loss, fs_loss)
    close(out.nll, fs_nll)


def test_float32_scores():
    logits, target = make_batch(8, 64, seed=7, n_pad=3, dtype=torch.float32)
    kw = dict(alpha=5.0, epsilon=0.1, ignore_index=PAD)
    out, grad = ours_with_grad(logits, target, **kw)
    want, want_grad = reference_with_grad(logits, target, **kw)
    for got, expected in zip(out, want):
        assert got.dtype == torch.float32
        close(got, expected, rtol=1e-5, atol=1e-5)
    assert grad.dtype == torch.float32
    torch.testing.assert_close(grad.double(), want_grad, rtol=1e-4, atol=1e-6)


def test_no_target_gives_kl_alone():
    scores, _ = make_batch(5, 11, seed=3)
    kl_ref = reference(scores)[3]
    out, grad = ours_with_grad(scores, None, alpha=1.5)
    assert out.loss.item() == 0.0 and out.nll.item() == 0.0
    close(out.kl, kl_ref)
    close(out.total, 1.5 * kl_ref)
    _, want_grad = reference_with_grad(scores, None, alpha=1.5)
    torch.testing.assert_close(grad, want_grad, rtol=1e-10, atol=1e-12)


def test_no_ignore_index_uses_every_row():
    scores, target = make_batch(5, 11, seed=4, n_pad=2)  # PAD is then an ordinary class
    out = rdrop_loss(scores, target, alpha=1.0, epsilon=0.1)
    for got, want in zip(out, reference(scores, target, 1.0, 0.1)):
        close(got, want)


def test_keep_mask_excludes_positions():
    scores, target = make_batch(6, 9, seed=8, n_pad=1)
    keep = torch.tensor([False, True, True, False, True, True])
    kw = dict(alpha=2.0, epsilon=0.1, ignore_index=PAD, keep=keep)
    out, grad = ours_with_grad(scores, target, **kw)
    want, want_grad = reference_with_grad(scores, target, **kw)
    for got, expected in zip(out, want):
        close(got, expected)
    torch.testing.assert_close(grad, want_grad, rtol=1e-10, atol=1e-12)
    assert torch.count_nonzero(grad[[0, 3, 5, 6, 9, 11]]) == 0


def test_multidimensional_scores_and_target():
    """(2B, T, V) model output with (B, T) targets, as the criteria pass them."""
    g = gen(9)
    logits = torch.randn(4, 5, 13, generator=g, dtype=torch.float64)
    target = torch.randint(2, 13, (2, 5), generator=g)
    target[1, 3:] = PAD
    kw = dict(alpha=3.0, epsilon=0.1, ignore_index=PAD)
    out, grad = ours_with_grad(logits, target, **kw)
    want, want_grad = reference_with_grad(logits.view(-1, 13), target.view(-1), **kw)
    for got, expected in zip(out, want):
        close(got, expected)
    torch.testing.assert_close(grad.view(-1, 13), want_grad, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("mode", MODES)
def test_all_padding(mode):
    scores, target = make_batch(3, 9, seed=5, n_pad=3, mode=mode)
    out, grad = ours_with_grad(scores, target, mode, alpha=5.0, epsilon=0.1, ignore_index=PAD)
    assert all(o.item() == 0.0 for o in out)
    assert torch.count_nonzero(grad) == 0


@pytest.mark.parametrize("mode", MODES)
def test_does_not_modify_scores(mode):
    scores, target = make_batch(6, 20, seed=6, n_pad=2, mode=mode, dtype=torch.float32)
    before = scores.clone()
    ours_with_grad(scores, target, mode, alpha=5.0, epsilon=0.1, ignore_index=PAD,
                   chunk_mb=ROW_CHUNK)
    assert torch.equal(scores, before)


# ---------------------------------------------------------------------- 2. chunking


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.float16])
def test_chunking_does_not_change_results(mode, dtype):
    n, v = 13, 17
    scores, target = make_batch(n, v, seed=21, n_pad=4, mode=mode, dtype=dtype)
    kw = dict(alpha=5.0, epsilon=0.1, ignore_index=PAD)
    big, g_big = ours_with_grad(scores, target, mode, chunk_mb=ONE_CHUNK, **kw)
    # one row pair per chunk, and three per chunk (a ragged last chunk)
    assert chunk_rows_for(v, scores, mb_for(3, v, scores)) == 3
    for chunk_mb in (ROW_CHUNK, mb_for(3, v, scores)):
        small, g_small = ours_with_grad(scores, target, mode, chunk_mb=chunk_mb, **kw)
        for a, b in zip(small, big):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(g_small, g_big, rtol=0, atol=0)


def test_chunk_rows_for_budget():
    logits32 = torch.zeros(2, 1000)
    logits16 = logits32.half()
    # fp32 scores keep their probabilities in the gradient buffer: 2 float32 rows per pair
    assert chunk_rows_for(1000, logits32, 1.0) == 2**20 // (2 * 1000 * 4)
    # fp16 scores need float32 log-probabilities and probabilities: 4 rows per pair
    assert chunk_rows_for(1000, logits16, 1.0) == 2**20 // (4 * 1000 * 4)
    assert chunk_rows_for(10**9, logits32, 1.0) == 1  # at least one row pair
    assert chunk_rows_for(1000, logits32, 0.0) == chunk_rows_for(1000, logits32, 16.0)  # CPU auto
    for bad in (-1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="chunk_mb"):
            chunk_rows_for(1000, logits32, bad)


# ---------------------------------------------------------------------- 3. symmetry


@pytest.mark.parametrize("n,v", [(1, 2), (5, 9), (7, 100)])
def test_swapping_passes_keeps_kl(n, v):
    scores, target = make_batch(n, v, seed=31 + v, n_pad=1 if n > 1 else 0)
    swapped = torch.cat([scores[n:], scores[:n]])
    kl = rdrop_loss(scores, target, ignore_index=PAD).kl
    close(kl, rdrop_loss(swapped, target, ignore_index=PAD).kl, rtol=1e-12)
    assert kl.item() > 0


@pytest.mark.parametrize("seed", range(5))
def test_kl_nonnegative(seed):
    g = gen(seed)
    n, v = 4, 2 + seed * 7
    # near-identical and very different passes
    base = torch.randn(n, v, generator=g, dtype=torch.float64)
    noise = torch.randn(n, v, generator=g, dtype=torch.float64) * (1e-4 if seed % 2 else 5.0)
    logits = torch.cat([base, base + noise])
    assert rdrop_loss(logits).kl.item() >= 0
    assert symmetric_kl(F.log_softmax(logits, -1)).item() >= 0


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16, torch.float16])
def test_kl_zero_and_no_kl_gradient_for_equal_passes(dtype):
    g = gen(41)
    half = (torch.randn(6, 30, generator=g, dtype=torch.float64) * 4).to(dtype)
    logits = torch.cat([half, half])
    target = torch.randint(0, 30, (6,), generator=g)
    with_kl, g_kl = ours_with_grad(logits, target, alpha=5.0, epsilon=0.1)
    without, g_none = ours_with_grad(logits, target, alpha=0.0, epsilon=0.1)
    assert abs(with_kl.kl.item()) <= 1e-6
    torch.testing.assert_close(g_kl.double(), g_none.double(), rtol=1e-3, atol=1e-5)


# ----------------------------------------------------------------------- 4. padding


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("pad_value", [-1e30, 50.0, -50.0])
def test_padding_rows_have_no_effect(mode, pad_value):
    n, v, n_pad = 6, 10, 2
    scores, target = make_batch(n, v, seed=51, n_pad=n_pad, mode=mode)
    pad_rows = torch.cat([torch.arange(n - n_pad, n), torch.arange(2 * n - n_pad, 2 * n)])
    changed = scores.clone()
    changed[pad_rows] = pad_value
    changed[pad_rows[0], 0] = 0.0  # not even a constant row
    kw = dict(alpha=5.0, epsilon=0.1, ignore_index=PAD)
    out, grad = ours_with_grad(scores, target, mode, **kw)
    out2, grad2 = ours_with_grad(changed, target, mode, **kw)
    for a, b in zip(out, out2):
        close(a, b, rtol=1e-12, atol=1e-12)
    assert torch.equal(grad[~torch.isin(torch.arange(2 * n), pad_rows)],
                       grad2[~torch.isin(torch.arange(2 * n), pad_rows)])
    assert torch.count_nonzero(grad2[pad_rows]) == 0 and torch.count_nonzero(grad[pad_rows]) == 0
    for got, want in zip(out, reference(scores, target, mode=mode, **kw)):
        close(got, want)


def test_class_ruled_out_by_both_passes_contributes_nothing():
    """log p = log q = -inf for one class (e.g. a masked token): finite KL, zero gradient there."""
    logits = torch.tensor([[0.0, 1.0, -float("inf")], [1.0, 0.0, -float("inf")]],
                          dtype=torch.float64)
    lprobs = torch.log_softmax(logits, -1)
    out, grad = ours_with_grad(lprobs, torch.tensor([0]), "log_probs", alpha=1.0)
    finite = lprobs[:, :2]
    p, q = finite[0].exp(), finite[1].exp()
    torch.testing.assert_close(out.kl, 0.5 * ((p - q) * (finite[0] - finite[1])).sum())
    assert torch.isfinite(grad).all() and (grad[:, 2] == 0).all()


# --------------------------------------------------------------------- 5. precisions


@pytest.mark.parametrize("dtype,grad_rtol,grad_atol",
                         [(torch.bfloat16, 1e-2, 1e-4), (torch.float16, 2e-3, 2e-6)])
@pytest.mark.parametrize("mode", MODES)
def test_half_precision_scores(dtype, grad_rtol, grad_atol, mode):
    scores64, target = make_batch(16, 500, seed=71, n_pad=3, mode=mode)
    scores = scores64.to(dtype)
    kw = dict(alpha=5.0, epsilon=0.1, ignore_index=PAD)
    out, grad = ours_with_grad(scores, target, mode, **kw)
    # the values the function actually saw, in float64: float32 arithmetic, not half
    exact, want_grad = reference_with_grad(scores, target, mode, **kw)
    for got, want in zip(out, exact):
        assert got.dtype == torch.float32
        close(got, want, rtol=1e-5, atol=1e-4)
    assert grad.dtype == dtype
    torch.testing.assert_close(grad.double(), want_grad, rtol=grad_rtol, atol=grad_atol)


def test_fp16_gradient_keeps_small_entries():
    """At V = 32k most gradient entries are ~1/V: fp16 subnormals if stored unscaled. Each
    row pair's gradient is stored scaled by a power of two, which the backward undoes."""
    g = gen(73)
    n, v = 4, 32000
    logits = (torch.randn(2 * n, v, generator=g) * 0.5).half()
    target = torch.randint(2, v, (n,), generator=g)
    kw = dict(alpha=5.0, epsilon=0.1, ignore_index=PAD)
    x = logits.clone().requires_grad_(True)
    (rdrop_loss(x, target, **kw).total * 128.0).backward()  # 128: a typical fp16 loss scale
    _, want = reference_with_grad(logits, target, **kw)
    want = want * 128.0
    assert torch.count_nonzero(x.grad) == torch.count_nonzero(want.half())
    rel = ((x.grad.double() - want).abs() / want.abs().clamp_min(1e-30)).median()
    assert rel < 1e-3  # fp16 precision (2^-11) on the typical entry, not a subnormal's


def two_passes(n, v, seed, regime, dtype):
    """Logits ``(2n, V)`` of two passes, ~ N(0, 3^2), in ``dtype``, and the first pass's
    argmax as the target (a model that predicts its target: a small nll, whose error
    shows). ``regime``: "independent" passes, "dropout"-like ones (the second = the first
    + N(0, 1)) or "nearly identical" ones (the second = the first + N(0, 1e-3^2))."""
    g = gen(seed)
    first = torch.randn(n, v, generator=g, dtype=torch.float64) * 3
    noise = torch.randn(n, v, generator=g, dtype=torch.float64)
    second = {"independent": noise * 3, "dropout": first + noise,
              "nearly identical": first + 1e-3 * noise}[regime]
    return torch.cat([first, second]).to(dtype), first.argmax(-1)


@pytest.mark.parametrize("regime", ["independent", "nearly identical"])
def test_float32_at_a_large_vocabulary_matches_float64(regime):
    """V = 267,744 (fairseq's WikiText-103 vocabulary), float32 logits: total, loss, nll and
    KL within max(1e-6 |reference|, 1e-7 per row pair) of float64. Every sum over V (the
    log-sum-exp, the KL row dots, the smoothing sums) is a pairwise ``torch.sum``, whose
    error does not grow with V. A sequential float32 sum lost the bound by 40-100x on the
    KL of independent passes (log_softmax's normaliser and the BLAS row dots each off by
    ~1e-5), and by 2-4x on the nll of nearly identical ones."""
    n, v = 2, 267_744
    scores, target = two_passes(n, v, seed=80, regime=regime, dtype=torch.float32)
    kw = dict(alpha=5.0, epsilon=0.1)
    out = rdrop_loss(scores, target, **kw)
    for name, got, want in zip(out._fields, out, reference(scores, target, **kw)):
        bound = max(1e-6 * abs(float(want)), 1e-7 * n)
        assert abs(float(got) - float(want)) <= bound, (name, float(got), float(want), bound)


def dtype_ulp(x, dtype):
    """The spacing of ``dtype`` at ``x`` (float64), subnormals included."""
    info = torch.finfo(dtype)
    exponent = torch.floor(torch.log2(x.abs().clamp_min(info.smallest_normal)))
    return torch.exp2(exponent - {torch.float16: 10, torch.bfloat16: 7}[dtype])


def gradient_terms(scores, target, alpha, epsilon):
    """Per entry, in float64, the sum of the magnitudes of the terms the logits' gradient
    adds up (docs/design.md): ``pa (P + h + h |d| + h |Ka|) + h pb + eps_i + |c1| [v = t]``
    (and likewise for pass 2). It is the gradient's magnitude but where the terms cancel."""
    x = scores.double().reshape(2, -1, scores.size(-1))
    v = x.size(-1)
    lp = F.log_softmax(x, -1)
    p, d = lp.exp(), lp[0] - lp[1]
    kl = torch.stack([(p[0] * d).sum(-1), -(p[1] * d).sum(-1)]).abs().unsqueeze(-1)
    h, eps_i = alpha / 2, epsilon / (v - 1)
    c1 = 1.0 - epsilon - eps_i
    terms = p * (c1 + eps_i * v + h + h * d.abs() + h * kl) + h * p.flip(0) + eps_i
    return (terms + abs(c1) * F.one_hot(target, v).double()).reshape(scores.shape)


@pytest.mark.parametrize("regime", ["dropout", "independent"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_half_precision_gradient_is_the_rounded_float64_one(dtype, regime):
    """An fp16/bf16 gradient at fairseq's loss scales S = 1 to 2^12 is the float64 one
    rounded to the dtype, within one ulp plus 8 float32 roundings: every entry has
    ``|g - round(S g64)| <= ulp(S g64) + 8 * 2^-24 * S |g64|``. V = 32,000, 3 row pairs,
    alpha 5, label smoothing 0.1, passes that differ as dropout makes them or independent
    ones. The row's KL and normaliser enter each of its entries: off by ~1e-5 relative
    (sequential float32 sums), they put 9 to 1,500 entries per scale outside the bound
    here, by up to 8,000 ulps.

    Where the formula's terms cancel, no float32 evaluation meets that bound: an entry
    near the gradient's zero crossing within the row (``p`` near ``eps_i``, or the KL's
    pull balancing ``p``) keeps the rounding of terms 10^4 times its size (the Triton
    kernel's too; here 3 fp16 entries of independent passes, by up to 71 ulps). Entries
    whose terms add up to more than 2^10 times their value (0.05-0.07 % of them here) are
    held to the same bound with ``|g64|`` replaced by the terms' sum
    (:func:`gradient_terms`): 8 float32 roundings of what float32 actually adds up."""
    n, v = 3, 32000
    scores, target = two_passes(n, v, seed=81, regime=regime, dtype=dtype)
    kw = dict(alpha=5.0, epsilon=0.1)
    _, want = reference_with_grad(scores, target, **kw)
    magnitude = torch.maximum(want.abs(), gradient_terms(scores, target, **kw))
    magnitude = torch.where(magnitude <= 2 ** 10 * want.abs(), want.abs(), magnitude)
    for scale in (1.0, 2.0 ** 6, 2.0 ** 12):
        x = scores.clone().requires_grad_(True)
        (rdrop_loss(x, target, **kw).total * scale).backward()
        exact = want * scale
        err = (x.grad.double() - exact.to(dtype).double()).abs()
        bad = err > dtype_ulp(exact, dtype) + 8 * 2.0 ** -24 * scale * magnitude
        assert not bad.any(), (scale, int(bad.sum()), x.grad[bad][:4], exact[bad][:4])


def test_half_precision_symmetric_kl_and_mse():
    g = gen(72)
    for dtype in (torch.bfloat16, torch.float16):
        lprobs = F.log_softmax(torch.randn(4, 3, 50, generator=g, dtype=torch.float64), -1)
        kl = symmetric_kl(lprobs.to(dtype))
        assert kl.dtype == torch.float32
        close(kl, reference(lprobs.to(dtype), mode="log_probs")[3], rtol=1e-5, atol=1e-6)
        preds = torch.randn(8, 4, generator=g).to(dtype)
        mse = mse_consistency(preds)
        assert mse.dtype == torch.float32
        p = preds.double()
        close(mse, ((p[:4] - p[4:]) ** 2).sum(), rtol=1e-6, atol=1e-6)


# ------------------------------------------------------- 6. GPU discipline, seen on CPU


def _dispatch(scores, target, **kw):
    x = scores.clone().requires_grad_(True)
    with count_ops() as ops:
        rdrop_loss(x, target, **kw).total.backward()
    return ops


@pytest.mark.parametrize("mode", MODES)
def test_no_host_sync_and_ops_independent_of_padding(mode):
    """Padding is masked by weights: the same ops run whatever the data, none syncing."""
    scores, target = make_batch(40, 64, seed=74, mode=mode, dtype=torch.float32)
    padded = target.clone()
    padded[::3] = PAD
    kw = dict(alpha=5.0, epsilon=0.1, ignore_index=PAD, log_probs=mode == "log_probs",
              chunk_mb=mb_for(7, 64, scores))
    a = _dispatch(scores, target, **kw)
    b = _dispatch(scores, padded, **kw)
    assert a.n_syncing == 0 and b.n_syncing == 0, (a.syncing, b.syncing)
    assert a.by_op == b.by_op


def test_op_count_grows_with_chunks_only():
    """A 256 MiB chunk at V = 32k and 4096 positions per pass: few chunks, few ops. Counted at
    512 positions with 32 MiB chunks: the same chunks (3 whole, 1 part), so the same ops one
    by one (checked at both sizes: 176 each, 29 per chunk; 4096 positions cost 14 CPU-s,
    512 2.4)."""
    v, n = 32000, 4096
    rows = chunk_rows_for(v, torch.zeros(2, v), 256.0)  # needs the dtype and device only
    assert rows == 256 * 2**20 // (2 * v * 4) == 1048  # 2 float32 rows per pair: 4 chunks
    small, small_rows = 512, chunk_rows_for(v, torch.zeros(2, v), 32.0)
    assert divmod(n, rows)[0] == divmod(small, small_rows)[0] == 3  # 3 whole chunks, 1 part
    assert n % rows and small % small_rows
    logits = torch.zeros(2 * small, v)
    target = torch.randint(2, v, (small,), generator=gen(75))
    ops = _dispatch(logits, target, alpha=5.0, epsilon=0.1, ignore_index=PAD, chunk_mb=32.0)
    per_chunk_and_fixed = ops.total
    assert ops.n_syncing == 0
    assert per_chunk_and_fixed <= 29 * 4 + 62, ops.by_op


def test_no_full_size_float32_temporaries_for_half_scores():
    """From fp16 logits, nothing of 2N x V float32 is ever allocated: only chunks."""
    v, n = 5000, 256
    logits = torch.randn(2 * n, v, generator=gen(76)).half()
    target = torch.randint(2, v, (n,), generator=gen(77))
    budget_mb = 1.0
    largest = {}

    class Largest(count_ops):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = super().__torch_dispatch__(func, types, args, kwargs)
            for t in (out if isinstance(out, (tuple, list)) else [out]):
                if torch.is_tensor(t) and t.dtype == torch.float32:
                    largest[str(func)] = max(largest.get(str(func), 0), t.numel())
            return out

    x = logits.clone().requires_grad_(True)
    with Largest():
        rdrop_loss(x, target, alpha=5.0, epsilon=0.1, ignore_index=PAD, chunk_mb=budget_mb).total.backward()
    assert max(largest.values()) * 4 <= budget_mb * 2**20 / 2, largest


def test_second_backward_raises():
    scores, target = make_batch(3, 5, seed=78)
    x = scores.clone().requires_grad_(True)
    total = rdrop_loss(x, target, alpha=1.0).total
    total.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="one backward per forward"):
        total.backward()


@pytest.mark.parametrize("requires_grad", [False, True])
def test_no_gradient_work_without_grad(requires_grad):
    """Under no_grad (validation; an adaptive softmax chunk's first, checkpointed run) the
    gradient is neither computed nor allocated: no tensor larger than one chunk (4 row
    pairs) is made, let alone the 2N x V gradient buffer, whether the scores come from a
    no_grad forward or are a leaf that requires grad (autograd's needs_input_grad says True
    for it whatever the grad mode); the values are the formula's."""
    n, v, pairs_per_chunk = 64, 300, 4
    scores, target = make_batch(n, v, seed=79, n_pad=5, dtype=torch.float32)
    chunk_mb = pairs_per_chunk * 2 * v * 4 / 2**20  # a pair: 2 x V float32 log-probs
    assert chunk_rows_for(v, scores, chunk_mb) == pairs_per_chunk
    x = scores.clone().requires_grad_(requires_grad)
    with torch.no_grad(), LargestTensor() as seen:
        out = rdrop_loss(x, target, alpha=1.0, epsilon=0.1, ignore_index=PAD, chunk_mb=chunk_mb)
    assert seen.largest <= 2 * pairs_per_chunk * v < 2 * n * v, seen.largest
    assert out.total.grad_fn is None
    for got, want in zip(out, reference(scores, target, 1.0, 0.1, PAD)):
        close(got, want, rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------- 7. bad arguments


def test_bad_arguments_raise_clear_errors():
    scores, target = make_batch(4, 6, seed=93)
    with pytest.raises(RDropBatchError, match="both passes stacked"):
        rdrop_loss(scores[:7], target)
    with pytest.raises(RDropBatchError, match="target of one pass"):
        rdrop_loss(scores, target.repeat(2))
    with pytest.raises(RDropBatchError, match="keep"):
        rdrop_loss(scores, target, keep=torch.ones(3, dtype=torch.bool))
    for alpha in (-1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="alpha"):
            rdrop_loss(scores, target, alpha=alpha)
    for epsilon in (-0.1, 1.01, float("nan")):
        with pytest.raises(ValueError, match="epsilon"):
            rdrop_loss(scores, target, epsilon=epsilon)
    with pytest.raises(ValueError, match="impl"):
        rdrop_loss(scores, target, impl="cuda")
    with pytest.raises(RDropBatchError):
        symmetric_kl(scores[:7])
    with pytest.raises(RDropBatchError):
        mse_consistency(torch.zeros(5, 2))


def test_triton_impl_on_cpu_says_what_to_do(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    scores, target = make_batch(2, 6, seed=94, dtype=torch.float32)
    with pytest.raises(ValueError, match="triton"):
        rdrop_loss(scores, target, impl="triton")
    # auto picks the torch implementation on CPU
    close(rdrop_loss(scores, target, alpha=1.0, impl="auto").total,
          reference(scores, target, 1.0)[0], rtol=1e-5, atol=1e-5)


@pytest.fixture
def auto_takes_cpu_for_cuda(monkeypatch):
    """impl="auto" decides for CPU tensors as for CUDA ones (the kernel would be its choice),
    with no device given up yet, and triton importable."""
    from rdrop_fairseq.ops import impl, rows_triton as triton_kernel

    monkeypatch.setattr(impl, "_kernel_device", lambda tensor: tensor.dtype != torch.float64)
    monkeypatch.setattr(impl, "_TRITON_GIVEN_UP", {})
    monkeypatch.setattr(triton_kernel, "triton_available", lambda: True)
    return triton_kernel


def kernel_failing_with(error, calls):
    def launch(*args, **kwargs):
        calls.append(kwargs.get("from_logits"))
        raise error
    return launch


def fused_linear_call(impl):
    from rdrop_fairseq.fused_linear import fused_linear_rdrop_loss
    from tests.test_fused_linear import inputs

    features, weight, bias, target = inputs(seed=3)
    out = fused_linear_rdrop_loss(features, weight, target, bias=bias, alpha=1.0,
                                  epsilon=0.1, ignore_index=1, impl=impl)
    grads = torch.autograd.grad(out.total, [features, weight, bias])
    return [out.total, out.kl, *grads]


def logits_call(impl):
    scores, target = make_batch(3, 11, seed=95, n_pad=1, dtype=torch.float32)
    scores.requires_grad_()
    out = rdrop_loss(scores, target, alpha=1.0, epsilon=0.1, ignore_index=PAD, impl=impl)
    return [out.total, out.kl, *torch.autograd.grad(out.total, [scores])]


def projected_logits_call(impl):
    """Logits from a projection, the gradient written into their buffer (as in fairseq)."""
    from tests.test_fused_linear import inputs

    features, weight, _, target = inputs(seed=4)
    logits = features @ weight.t()
    out = rdrop_loss(logits, target, alpha=1.0, epsilon=0.1, ignore_index=1, impl=impl,
                     grad_in_scores="auto")
    return [out.total, out.kl, *torch.autograd.grad(out.total, [features, weight])]


CALLS = [logits_call, projected_logits_call, fused_linear_call]
CALL_IDS = ["logits", "logits-gradient-in-place", "fused-linear"]


@pytest.mark.parametrize("call", CALLS, ids=CALL_IDS)
def test_auto_falls_back_to_torch_once_where_the_kernel_fails(auto_takes_cpu_for_cuda,
                                                              monkeypatch, call):
    """Where the Triton kernel does not compile on the GPU (Triton's support starts at
    compute capability 8.0), impl="auto" says so in one warning and gives the torch
    implementation's loss and gradients, then and for the rest of the process on that
    device, without trying the kernel again; impl="triton", asked for by name, raises."""
    calls = []
    error = auto_takes_cpu_for_cuda.TritonKernelError(
        "PTXASError: ptxas fatal : Value 'sm_70' is not defined for option 'gpu-name'")
    monkeypatch.setattr(auto_takes_cpu_for_cuda, "rdrop_rows_triton",
                        kernel_failing_with(error, calls))
    expected = call("torch")
    with pytest.warns(RuntimeWarning) as seen:
        got = call("auto")
    assert len(seen) == 1 and calls == [True], (seen, calls)
    message = str(seen[0].message)
    assert "impl='auto' uses the torch implementation on cpu" in message, message
    assert "its Triton kernel failed: PTXASError: ptxas fatal" in message, message
    for a, b in zip(got, expected):
        assert torch.equal(a, b)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        again = call("auto")
    assert calls == [True] and all(torch.equal(a, b) for a, b in zip(again, expected))
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # impl="triton" on CPU tensors: valid
    with pytest.raises(auto_takes_cpu_for_cuda.TritonKernelError, match="sm_70"):
        call("triton")


@pytest.mark.parametrize("error", [
    ValueError("target must hold int64"),
    torch.cuda.OutOfMemoryError("CUDA out of memory"),
    RuntimeError("Expected all tensors to be on the same device"),
], ids=["our-check", "out-of-memory", "another-runtime-error"])
def test_auto_does_not_hide_errors_that_are_not_the_kernels(auto_takes_cpu_for_cuda,
                                                            monkeypatch, error):
    """Only the kernel's own failure to compile or launch (TritonKernelError) makes "auto"
    fall back: a check of ours, running out of memory or an error elsewhere is raised as it
    is, with no warning, and the kernel stays in use."""
    from rdrop_fairseq.ops import impl

    calls = []
    monkeypatch.setattr(auto_takes_cpu_for_cuda, "rdrop_rows_triton",
                        kernel_failing_with(error, calls))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(type(error), match=str(error)):
            logits_call("auto")
    assert calls == [True] and impl._TRITON_GIVEN_UP == {}


class PTXASError(Exception):
    """Stands for triton's own exception classes (triton.runtime.errors)."""


def fallback_where_the_launch_fails(monkeypatch, device):
    """impl="auto" on ``device`` with the Triton kernel's launch failing as on a GPU that
    Triton does not support (the launch raises, and rows_triton._launch wraps it): one
    warning, then the torch implementation's loss and gradients, logits and fused-linear."""
    from rdrop_fairseq.fused_linear import fused_linear_rdrop_loss
    from rdrop_fairseq.ops import impl, rows_triton as triton_kernel
    from tests.test_fused_linear import inputs

    class Unsupported:  # kernel[grid](*args) fails to launch
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                raise RuntimeError("Triton Error [CUDA]: invalid device function")
            return launch

    monkeypatch.setattr(triton_kernel, "_rdrop_rows_kernel", Unsupported())
    monkeypatch.setattr(impl, "_TRITON_GIVEN_UP", {})
    scores, target = make_batch(64, 3000, seed=97, n_pad=3, dtype=torch.float32)
    features, weight, bias, fl_target = inputs(seed=5)

    def call(impl):
        x = scores.to(device).requires_grad_()
        out = rdrop_loss(x, target.to(device), alpha=1.0, epsilon=0.1, ignore_index=PAD,
                         impl=impl)
        f, w, b = (t.detach().to(device).requires_grad_() for t in (features, weight, bias))
        fused = fused_linear_rdrop_loss(f, w, fl_target.to(device), bias=b, alpha=1.0,
                                        epsilon=0.1, ignore_index=1, impl=impl)
        return [out.total, *torch.autograd.grad(out.total, [x]), fused.total,
                *torch.autograd.grad(fused.total, [f, w, b])]

    expected = call("torch")
    with pytest.warns(RuntimeWarning) as seen:
        got = call("auto")
    assert len(seen) == 1, [str(w.message) for w in seen]
    message = str(seen[0].message)
    assert f"impl='auto' uses the torch implementation on {device}" in message, message
    assert "its Triton kernel failed: RuntimeError: Triton Error [CUDA]: invalid device " \
        "function" in message, message
    for a, b in zip(got, expected):  # the same torch computation (a GPU's may not be bitwise)
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no second warning, no second try
        call("auto")


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_auto_falls_back_on_the_gpu_where_the_kernel_does_not_launch(monkeypatch):
    """The fallback on a real CUDA device (the CPU tests stand a CPU in for it): what a GPU
    that Triton does not support answers to the launch, made to happen on this one."""
    pytest.importorskip("triton")
    fallback_where_the_launch_fails(monkeypatch, "cuda:0")


@pytest.mark.parametrize("error, kind", [
    (PTXASError("ptxas fatal : Value 'sm_70' is not defined"), "PTXASError"),
    (AssertionError("libcuda.so cannot found!"), "AssertionError"),
    (subprocess.CalledProcessError(1, ["gcc", "cuda_utils.c"]), "CalledProcessError"),
    (RuntimeError("Triton Error [CUDA]: invalid device function"), "RuntimeError"),
], ids=["triton", "driver-assert", "build", "driver"])
def test_a_failed_launch_is_a_triton_kernel_error_unless_memory_ran_out(error, kind):
    """What the kernel's launch raises (compile, ptxas, driver and build errors of no common
    base) becomes a TritonKernelError with the error chained; out of memory stays itself."""
    from rdrop_fairseq.ops import rows_triton as triton_kernel

    class Kernel:  # kernel[grid](*args, **kwargs) raises
        def __init__(self, error):
            self.error = error

        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                raise self.error
            return launch

    with pytest.raises(triton_kernel.TritonKernelError, match=f"^{kind}: ") as raised:
        triton_kernel._launch(Kernel(error), (4,), 1, 2, BLOCK_V=8)
    assert raised.value.__cause__ is error
    for memory in (torch.cuda.OutOfMemoryError("CUDA out of memory"),
                   RuntimeError("Triton Error [CUDA]: out of memory")):
        with pytest.raises(type(memory)) as raised:
            triton_kernel._launch(Kernel(memory), (4,), 1, 2, BLOCK_V=8)
        assert raised.value is memory


def test_auto_without_triton_says_so_once_on_a_gpu_and_never_on_the_cpu(auto_takes_cpu_for_cuda,
                                                                        monkeypatch):
    from rdrop_fairseq.ops import impl

    monkeypatch.setattr(auto_takes_cpu_for_cuda, "triton_available", lambda: False)
    expected = logits_call("torch")
    with pytest.warns(RuntimeWarning, match=r"on cpu .*\(triton is not installed: pip "
                                            r"install triton\)") as seen:
        got = logits_call("auto")
    assert len(seen) == 1 and all(torch.equal(a, b) for a, b in zip(got, expected))
    # on the CPU the torch implementation is what "auto" means: nothing to say
    monkeypatch.setattr(impl, "_kernel_device", lambda tensor: False)
    monkeypatch.setattr(impl, "_TRITON_GIVEN_UP", {})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        logits_call("auto")


# ------------------------------------------------------------- 8. duplicate_net_input


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


# ------------------------------------------------------------------------ 9. mse


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


# ---------------------------------------------------------------- 10. no fairseq


def test_core_imports_without_fairseq():
    code = textwrap.dedent(
        """
        import sys, types
        sys.modules["fairseq"] = None  # any "import fairseq..." now fails

        # the package without its __init__ (which registers the plugin with fairseq): the
        # core and the framework-free modules it imports (ops, options), nothing else
        package = types.ModuleType("rdrop_fairseq")
        package.__path__ = [%r]
        sys.modules["rdrop_fairseq"] = package
        import rdrop_fairseq.core as core

        import torch
        logits = torch.tensor([[0.0, 1.0], [1.0, 0.0]], requires_grad=True)
        out = core.rdrop_loss(logits, torch.tensor([0]), alpha=1.0, epsilon=0.1)
        out.total.backward()
        assert out.kl.item() > 0 and logits.grad is not None
        assert not any(m == "fairseq" or m.startswith("fairseq.") for m in sys.modules
                       if sys.modules[m] is not None)
        print("OK", float(out.kl))
        """ % str(REPO / "rdrop_fairseq")
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=REPO
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("OK")


# --------------------------------------------------- 9. edges (issue 19, items 1-4, 7, 8)


@pytest.fixture
def cuda_like_cpu_autocast():
    """CPU autocast with CUDA's fp16 list for matrix-vector products: CUDA autocast runs
    ``mv``/``addmv`` in fp16, CPU autocast leaves them in fp32. Registered for the test only."""
    lib = torch.library.Library("aten", "IMPL")
    keys = torch._C.DispatchKeySet(torch._C.DispatchKey.AutocastCPU)

    def lowered(op):
        def run(*args, **kwargs):
            low = torch.get_autocast_dtype("cpu")
            args = [a.to(low) if torch.is_tensor(a) and a.is_floating_point() else a
                    for a in args]
            with torch._C._ExcludeDispatchKeyGuard(keys):
                return op(*args, **kwargs)
        return run

    lib.impl("mv", lowered(torch.mv), "AutocastCPU")
    lib.impl("addmv", lowered(torch.addmv), "AutocastCPU")
    yield
    lib._destroy()


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("epsilon", [0.0, 0.1])
def test_per_row_sums_are_float32_under_autocast(mode, epsilon, cuda_like_cpu_autocast):
    """fairseq's --amp runs the criterion under autocast: the sums over rows (~1e6 for a
    smoothing sum at V = 32k) must not be taken in fp16 (inf / nan), nor returned in it."""
    n, v = 8, 32000
    scores, target = make_batch(n, v, seed=200, mode=mode, scale=1.0)
    x = (scores * 30).float() if mode == "logits" else scores.float()
    kw = dict(alpha=5.0, epsilon=epsilon, ignore_index=PAD)
    want = reference(x, target, mode=mode, **kw)
    with torch.autocast("cpu", dtype=torch.float16):
        out, grad = ours_with_grad(x, target, mode, **kw)
    for got, expected in zip(out, want):
        assert got.dtype == torch.float32 and torch.isfinite(got), got
        close(got, expected, rtol=1e-5, atol=1e-3)
    assert torch.isfinite(grad).all()


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("impl", ["torch", "auto"])
def test_per_row_sums_are_float32_under_cuda_autocast(impl):
    n, v = 64, 32000
    scores, target = make_batch(n, v, seed=201, scale=30.0)
    x = scores.float().cuda().requires_grad_(True)
    with torch.autocast("cuda", dtype=torch.float16):
        out = rdrop_loss(x, target.cuda(), alpha=5.0, epsilon=0.1, ignore_index=PAD, impl=impl)
    out.total.backward()
    for got, expected in zip(out, reference(scores.float(), target, 5.0, 0.1, PAD)):
        assert got.dtype == torch.float32 and torch.isfinite(got)
        close(got.cpu(), expected, rtol=1e-4, atol=1e-2)
    assert torch.isfinite(x.grad).all()


def masked_class_batch(n=5, v=9, seed=202):
    """Logits of two passes with classes 2 and 5 at -inf in both passes (never targets)."""
    scores, target = make_batch(n, v, seed=seed)
    scores[:, [2, 5]] = -float("inf")
    target[(target == 2) | (target == 5)] = 0
    return scores, target


@pytest.mark.parametrize("mode", MODES)
def test_class_masked_to_minus_inf_in_both_passes(mode):
    """From logits too: no -inf - (-inf) in the KL; the masked classes get gradient 0."""
    logits, target = masked_class_batch()
    scores = logits if mode == "logits" else F.log_softmax(logits, -1)
    kw = dict(alpha=5.0, epsilon=0.0, ignore_index=PAD)
    out, grad = ours_with_grad(scores, target, mode, **kw)
    want, want_grad = reference_with_grad(scores, target, mode, **kw)
    for got, expected in zip(out, want):
        close(got, expected)
    assert torch.isfinite(grad).all() and (grad[:, [2, 5]] == 0).all()
    keep = torch.ones(9, dtype=torch.bool)
    keep[[2, 5]] = False
    close(grad[:, keep], want_grad[:, keep])


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("alpha", [0.0, 1.0])
def test_no_smoothing_with_minus_inf_log_probs_is_finite_like_fairseq(mode, alpha):
    """eps = 0 (cross_entropy, sentence_prediction): a -inf log-prob must not give 0 * inf;
    the loss is what fairseq's cross_entropy / sentence_prediction compute, F.nll_loss."""
    logits, target = masked_class_batch(seed=203)
    scores = logits if mode == "logits" else F.log_softmax(logits, -1)
    out, grad = ours_with_grad(scores, target, mode, alpha=alpha, epsilon=0.0,
                               ignore_index=PAD)
    both = target.repeat(2)
    fairseq_loss = F.nll_loss(F.log_softmax(logits, -1), both, ignore_index=PAD,
                              reduction="sum")
    assert torch.isfinite(fairseq_loss)
    close(out.loss, fairseq_loss)
    close(out.nll, fairseq_loss)
    assert torch.isfinite(out.total) and torch.isfinite(grad).all()


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("bad", [float("inf"), -float("inf"), float("nan")])
def test_non_finite_values_in_excluded_rows_reach_nothing(mode, bad):
    """Padding rows are masked, not weighted by 0: a model that never predicts <pad> may
    give inf there (or a row entirely -inf); kept rows' values and gradient are unchanged,
    the excluded rows' gradient is 0."""
    n, v, n_pad = 6, 10, 2
    scores, target = make_batch(n, v, seed=204, n_pad=n_pad, mode=mode)
    keep = torch.ones(n, dtype=torch.bool)
    keep[0] = False  # excluded by the mask rather than by padding
    pad_rows = torch.tensor([0, n - 2, n - 1, n, 2 * n - 2, 2 * n - 1])
    changed = scores.clone()
    changed[pad_rows[:3], 3] = bad
    changed[pad_rows[3:]] = bad  # entire rows
    kw = dict(alpha=5.0, epsilon=0.1, ignore_index=PAD, keep=keep)
    out, grad = ours_with_grad(changed, target, mode, **kw)
    want, want_grad = reference_with_grad(scores, target, mode, **kw)
    for got, expected in zip(out, want):
        close(got, expected)
    kept = ~torch.isin(torch.arange(2 * n), pad_rows)
    close(grad[kept], want_grad[kept])
    assert (grad[pad_rows] == 0).all()


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("ignore_index", [-100, 10**9])
def test_ignore_index_outside_the_vocabulary(mode, ignore_index):
    """Like F.cross_entropy's default -100: accepted, the rows count nowhere."""
    n, v = 5, 8
    scores, target = make_batch(n, v, seed=205, n_pad=2, mode=mode)
    target[target == PAD] = ignore_index
    kw = dict(alpha=2.0, epsilon=0.1, ignore_index=ignore_index)
    out, grad = ours_with_grad(scores, target, mode, **kw)
    clean = target.clone()
    clean[clean == ignore_index] = 0
    keep = target != ignore_index
    want, want_grad = reference_with_grad(scores, clean, mode, alpha=2.0, epsilon=0.1,
                                          keep=keep)
    for got, expected in zip(out, want):
        close(got, expected)
    close(grad, want_grad)
    lprobs = F.log_softmax(scores, -1) if mode == "logits" else scores
    close(out.nll, F.nll_loss(lprobs, target.repeat(2), ignore_index=ignore_index,
                              reduction="sum"))


@pytest.mark.parametrize("mode", MODES)
def test_label_smoothing_one(mode):
    """epsilon = 1 (fairseq's parent accepts it): the smoothed target puts no mass on t."""
    scores, target = make_batch(4, 7, seed=206, n_pad=1, mode=mode)
    kw = dict(alpha=1.0, epsilon=1.0, ignore_index=PAD)
    out, grad = ours_with_grad(scores, target, mode, **kw)
    want, want_grad = reference_with_grad(scores, target, mode, **kw)
    for got, expected in zip(out, want):
        close(got, expected)
    close(grad, want_grad)


# ------------------------------------------ 10. the gradient written into the logits (D)


def projected_logits(dtype=torch.float32, n=6, v=300, d=16, seed=210, bias=False):
    """Logits made as a decoder's output layer makes them: F.linear on (B, T, d) features."""
    g = gen(seed)
    features = torch.randn(2, n // 2, d, generator=g).to(dtype).requires_grad_(True)
    weight = (torch.randn(v, d, generator=g) * 0.5).to(dtype).requires_grad_(True)
    b = torch.randn(v, generator=g).to(dtype).requires_grad_(True) if bias else None
    target = torch.randint(2, v, (n // 2,), generator=g).view(1, -1)
    target[0, -1] = PAD
    return features, weight, b, target


def grads_through_projection(grad_in_scores, dtype=torch.float32, bias=False, impl="torch",
                             producer=None):
    features, weight, b, target = projected_logits(dtype, bias=bias)
    logits = F.linear(features, weight, b)
    if producer is not None:
        logits = producer(logits)
    before = logits.detach().clone()
    out = rdrop_loss(logits, target, alpha=5.0, epsilon=0.1, ignore_index=PAD,
                     chunk_mb=mb_for(2, 300, logits), impl=impl, grad_in_scores=grad_in_scores)
    overwritten = not torch.equal(logits.detach(), before)
    out.total.backward()
    params = [features, weight] + ([b] if bias else [])
    return out, [p.grad for p in params], overwritten


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("grad_in_scores", ["auto", True])
def test_gradient_into_the_logits_of_a_projection(bias, grad_in_scores):
    """F.linear's output (UnsafeView/View of Mm/Addmm: neither saves its output) takes the
    gradient in place; every parameter's gradient is that of the separate buffer."""
    out, grads, overwritten = grads_through_projection(grad_in_scores, bias=bias)
    want, want_grads, untouched = grads_through_projection(False, bias=bias)
    assert overwritten and not untouched
    for got, expected in zip(list(out) + grads, list(want) + want_grads):
        torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gradient_into_half_logits(dtype):
    """Half logits (fp16: stored scaled per row pair): the same gradients, bit for bit."""
    out, grads, overwritten = grads_through_projection("auto", dtype=dtype)
    want, want_grads, _ = grads_through_projection(False, dtype=dtype)
    assert overwritten
    for got, expected in zip(grads, want_grads):
        torch.testing.assert_close(got, expected, rtol=0, atol=0)


def test_gradient_into_logits_with_an_added_bias():
    """BART's and Marian's logits are the projection plus final_logits_bias: an add, which
    keeps no copy of its output either; the gradients are the separate buffer's."""
    bias = torch.randn(300, generator=gen(212)) * 0.5
    out, grads, overwritten = grads_through_projection("auto", producer=lambda x: x + bias)
    want, want_grads, untouched = grads_through_projection(False, producer=lambda x: x + bias)
    assert overwritten and not untouched
    for got, expected in zip(list(out) + grads, list(want) + want_grads):
        torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("producer", [torch.exp, torch.tanh, lambda x: x * 2.0],
                         ids=["exp", "tanh", "mul"])
def test_producer_outside_the_allow_list_keeps_a_separate_buffer(producer):
    """exp and tanh save their output for their backward: "auto" leaves it alone, and the
    gradients are the float64 reference's."""
    out, grads, overwritten = grads_through_projection("auto", producer=producer)
    assert not overwritten
    features, weight, _, target = projected_logits()
    f64 = features.detach().double().requires_grad_(True)
    w64 = weight.detach().double().requires_grad_(True)
    ref = reference(producer(F.linear(f64, w64)), target, 5.0, 0.1, PAD)
    ref[0].backward()
    close(out.total, ref[0], rtol=1e-5, atol=1e-5)
    close(grads[0], f64.grad, rtol=1e-4, atol=1e-5)
    close(grads[1], w64.grad, rtol=1e-4, atol=1e-5)


def test_forcing_the_gradient_into_a_saved_output_raises_autograds_error():
    """grad_in_scores=True on exp's output, which exp's backward reads: the write is an
    in-place op autograd sees, so the backward raises instead of a wrong gradient."""
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        grads_through_projection(True, producer=torch.exp)


def test_gradient_into_scores_needs_a_graph():
    scores, target = make_batch(3, 7, seed=211, dtype=torch.float32)
    leaf = scores.clone().requires_grad_(True)
    rdrop_loss(leaf, target, alpha=1.0, grad_in_scores=True).total.backward()
    assert torch.equal(leaf.detach(), scores)  # a leaf (a parameter, say) is never written
    with torch.no_grad():
        x = scores.clone()
        rdrop_loss(x, target, alpha=1.0, grad_in_scores=True)
    assert torch.equal(x, scores)
    with pytest.raises(ValueError, match="grad_in_scores"):
        rdrop_loss(scores, target, grad_in_scores="yes")
