"""The loss at its edges, in every implementation: the torch and Triton row computations,
each from explicit logits (``core.rdrop_loss``) and through the fused linear path
(``fused_linear.fused_linear_rdrop_loss``, here with an identity projection, so that its
logits are the same numbers).

* Large logits: float32 logits uniform in +-1e4, fp16 in +-65,000, bf16 in +-1e4 and
  +-65,000, alpha 5, label smoothing 0.1. Against float64 autograd of the formula (never
  the closed-form gradient), the loss and the gradient within 1.5e-4 (float32), 2e-3
  (fp16) and 1e-2 (bf16) of the reference's largest entry. Where ``d`` and the KL are both
  of the logits' size, the gradient's ``d - KL`` must be formed before it is scaled.
* A class that one pass rules out (logit -inf in that pass only): KL(p||q) is +inf where q
  rules out a class that p does not, and every implementation says so, with nan in both
  rows of that row pair's gradient (the loss is +inf around it: no gradient) and the
  float64 formula's gradient everywhere else.
* Under ``torch.no_grad`` a chunk's temporaries stay within ``chunk_mb`` (a live-bytes
  count of the whole call).

Triton runs in its interpreter on CPU tensors, in a subprocess started with
``TRITON_INTERPRET=1`` (Triton reads it at its first import; see test_triton_kernel.py), which
computes every implementation's results; the inputs and results travel through torch.save.
"""

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from rdrop_fairseq.core import chunk_rows_for, rdrop_loss
from rdrop_fairseq.fused_linear import chunk_pairs, fused_linear_rdrop_loss
from rdrop_fairseq.opcount import LiveBytes
from tests.test_core import reference

REPO = Path(__file__).resolve().parents[1]
ALPHA, EPS = 5.0, 0.1
TRITON = importlib.util.find_spec("triton") is not None
IMPLS = ("torch", "triton") if TRITON else ("torch",)

# every implementation on each case (x, target, weight): (total, loss, nll, kl) and the
# gradient of total with respect to x. Without a weight, x are the logits, and the fused
# path takes them as features of an identity projection; with one, x are the features and
# the logits path takes their product
CHILD = """
import sys, torch
from rdrop_fairseq.core import rdrop_loss
from rdrop_fairseq.fused_linear import fused_linear_rdrop_loss
cases, impls = torch.load(sys.argv[1])
results = []
for features, target, weight in cases:
    for impl in impls:
        for path in ("logits", "fused"):
            x = features.clone().requires_grad_()
            if path == "logits":
                logits = x if weight is None else torch.nn.functional.linear(x, weight)
                out = rdrop_loss(logits, target, alpha=%(alpha)r, epsilon=%(eps)r, impl=impl)
            else:
                w = torch.eye(x.size(-1), dtype=x.dtype) if weight is None else weight
                out = fused_linear_rdrop_loss(x, w, target, alpha=%(alpha)r, epsilon=%(eps)r,
                                              impl=impl)
            (grad,) = torch.autograd.grad(out.total, x)
            results.append(((impl, path), [float(v) for v in out], grad))
torch.save(results, sys.argv[2])
""" % {"alpha": ALPHA, "eps": EPS}


def every_implementation(tmp_path, cases):
    """For each case ``(features, target, weight or None)``, a dict ``{(impl, path):
    (values, grad)}`` from the interpreter subprocess."""
    torch.save((cases, IMPLS), tmp_path / "in.pt")
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1",
           "PYTHONWARNINGS": "ignore"}  # the interpreter's numpy warns at -inf - -inf
    proc = subprocess.run([sys.executable, "-c", CHILD, tmp_path / "in.pt",
                           tmp_path / "out.pt"], capture_output=True, text=True, env=env,
                          cwd=REPO, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = iter(torch.load(tmp_path / "out.pt"))
    per_case = len(IMPLS) * 2
    return [{key: (values, grad) for key, values, grad in
             (next(results) for _ in range(per_case))} for _ in cases]


def uniform_logits(scale, dtype, seed=0, v=37, n=4):
    """The issue's inputs: ``(2, n, V)`` logits uniform in +-scale, and n targets."""
    gen = torch.Generator().manual_seed(seed)
    target = torch.randint(0, v, (n,), generator=gen)
    x = (torch.rand(2, n, v, generator=gen) * 2 - 1) * scale
    return x.to(dtype).reshape(2 * n, v), target


def exact(scores, target):
    """Float64 (total, loss, nll, kl) and the gradient of total, by autograd."""
    x = scores.double().requires_grad_()
    out = reference(x, target, alpha=ALPHA, epsilon=EPS)
    (grad,) = torch.autograd.grad(out[0], x)
    return [float(v.detach()) for v in out], grad


LARGE = [(torch.float32, 1e4, 1.5e-4), (torch.float16, 65000.0, 2e-3),
         (torch.bfloat16, 1e4, 1e-2), (torch.bfloat16, 65000.0, 1e-2)]


def test_large_logits_match_float64_in_every_implementation(tmp_path):
    """Logits of +-1e4: a row's KL and its d are ~1e4. Formed as ``h p d`` and ``h p Ka``,
    each rounded, and only then subtracted, the float32 gradient was off by 7.9e-4 of its
    largest entry (3.5000 for 3.4972); ``d - Ka`` first is exact there."""
    cases = [uniform_logits(scale, dtype) + (None,) for dtype, scale, _ in LARGE]
    for (dtype, scale, tol), case, got in zip(LARGE, cases, every_implementation(tmp_path, cases)):
        want, want_grad = exact(*case[:2])
        biggest = want_grad.abs().max()
        for key, (values, grad) in got.items():
            assert grad.dtype == dtype
            for name, mine, theirs in zip(("total", "loss", "nll", "kl"), values, want):
                assert abs(mine - theirs) <= tol * abs(theirs), (dtype, scale, key, name,
                                                                 mine, theirs)
            err = float((grad.double() - want_grad).abs().max() / biggest)
            assert err <= tol, (dtype, scale, key, err)


def one_pass_rules_out(dtype):
    """Logits ``(2 x 3, V)``: in row pair 0 pass 1 rules class 4 out (-inf in pass 1 only),
    in row pair 1 both passes rule class 2 out, row pair 2 is ordinary."""
    v = 9
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(2, 3, v, generator=gen)
    x[0, 0, 4] = -float("inf")
    x[:, 1, 2] = -float("inf")
    return x.reshape(6, v).to(dtype), torch.tensor([0, 1, 3])


def overflowing_projection(dtype):
    """Features and a projection whose product overflows to -inf for class 4 in pass 1's
    first row only (a huge feature times a large negative weight), as fp16 logits overflow:
    the fused path's way to a class ruled out by one pass. Elsewhere the logits are those
    of :func:`one_pass_rules_out` (with class 2 of row pair 1 as it was before its -inf)."""
    x, target = one_pass_rules_out(torch.float64)
    # fp16: a moderate weight, as the fused path's fp16 gradient (scaled by up to 2**10)
    # meets the weight in an fp16 product
    big, small = (30000.0, -3.0) if dtype == torch.float16 else (1e30, -1e10)
    features = torch.cat([torch.where(torch.isinf(x), 0.0, x), torch.zeros(6, 1)], 1)
    features[0, 9] = big
    weight = torch.cat([torch.eye(9), torch.zeros(9, 1)], 1).double()
    weight[4, 9] = small
    return features.to(dtype), target, weight.to(dtype)


ORDINARY = torch.tensor([1, 2, 4, 5])  # the rows of row pairs 1 and 2


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_a_class_ruled_out_by_one_pass_gives_one_answer(tmp_path, dtype):
    """KL = +inf, total = +inf (and loss = +inf: the smoothing sums log 0), the same in every
    implementation; the row pair's gradient is nan in both rows, the others are finite and
    the float64 formula's (the class both passes rule out adds nothing). Before, the torch
    path's KL was nan and the Triton kernel's +inf, and their gradients differed."""
    scores, target = one_pass_rules_out(dtype)
    features, _, weight = overflowing_projection(dtype)
    from_logits, projected = every_implementation(
        tmp_path, [(scores, target, None), (features, target, weight)])
    tol = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}[dtype]
    _, want_grad = exact(scores[ORDINARY], target[1:])  # the others' terms are infinite
    x = features[ORDINARY].double().requires_grad_()
    want = reference(torch.nn.functional.linear(x, weight.double()), target[1:], alpha=ALPHA,
                     epsilon=EPS)
    (want_projected,) = torch.autograd.grad(want[0], x)
    # the identity projection of -inf logits is no test of the fused path (-inf * 0 = nan)
    cases = [(key, got, want_grad) for key, got in from_logits.items() if key[1] == "logits"]
    cases += [(key, got, want_projected) for key, got in projected.items()]
    nlls = {}  # by case: the same in every implementation
    for key, (values, grad), expected in cases:
        total, loss, nll, kl = values
        assert total == loss == kl == float("inf"), (key, values)
        assert torch.isnan(grad[[0, 3]]).all(), (key, grad[[0, 3]])
        assert torch.isfinite(grad[ORDINARY]).all(), key
        err = float((grad[ORDINARY].double() - expected).abs().max() / expected.abs().max())
        assert err <= tol, (key, err)
        nlls.setdefault(expected is want_grad, []).append(nll)
    for same in nlls.values():
        assert same == pytest.approx([same[0]] * len(same), rel=tol)


def test_no_grad_chunk_stays_within_its_budget():
    """Under no_grad there is no gradient buffer for the probabilities to live in: a chunk
    holds the log-probabilities and the probabilities (4 x V float32 per row pair), and
    chunk_rows_for counts both (it counted 2: 2 x chunk_mb). The peak of the whole call,
    its small per-row buffers included, is at most chunk_mb."""
    v, n, chunk_mb = 5000, 64, 0.5
    scores = torch.randn(2 * n, v, generator=torch.Generator().manual_seed(3))
    target = torch.randint(0, v, (n,))
    for dtype in (torch.float32, torch.bfloat16):
        x = scores.to(dtype).requires_grad_()
        with torch.no_grad(), LiveBytes() as memory:
            out = rdrop_loss(x, target, alpha=ALPHA, epsilon=EPS, chunk_mb=chunk_mb,
                             impl="torch")
        assert memory.peak <= chunk_mb * 2**20, (dtype, memory.peak)
        want, _ = exact(x.detach(), target)
        assert [float(v) for v in out] == pytest.approx(want, rel=1e-5)
    assert chunk_rows_for(v, scores, chunk_mb, need_grad=False) == 6  # 524,288 // 80,000


def test_fused_linear_chunk_stays_within_its_budget():
    """The fused path's chunk holds its logits and, with the torch implementation, the
    core's temporaries: for a float32 model the probabilities live in the logits' buffer,
    so 4 x V float32 per row pair (it counted the temporaries alone, 2 x V: 2 x chunk_mb).
    Under no_grad the call's peak, the features' pair-ordered copy and per-row buffers
    included, stays within chunk_mb; with grad the chunk fits beside the weight's and the
    features' gradients."""
    n, d, v, chunk_mb = 64, 16, 5000, 0.5
    gen = torch.Generator().manual_seed(4)
    features = torch.randn(2 * n, d, generator=gen)
    weight = torch.randn(v, d, generator=gen) * 0.3
    target = torch.randint(0, v, (n,), generator=gen)
    with torch.no_grad(), LiveBytes() as memory:
        fused_linear_rdrop_loss(features, weight, target, alpha=ALPHA, epsilon=EPS,
                                chunk_mb=chunk_mb, impl="torch")
    assert memory.peak <= chunk_mb * 2**20, memory.peak
    x, w = features.clone().requires_grad_(), weight.clone().requires_grad_()
    with LiveBytes() as memory:
        fused_linear_rdrop_loss(x, w, target, alpha=ALPHA, epsilon=EPS, chunk_mb=chunk_mb,
                                impl="torch").total.backward()
    gradients = (v * d + 2 * n * d) * 4 * 2  # the sums and the returned gradients
    assert memory.peak <= chunk_mb * 2**20 + gradients, memory.peak
    assert chunk_pairs(v, features, chunk_mb) == 6  # 524,288 // (40,000 + 40,000)
