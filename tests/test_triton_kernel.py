"""Tests of the fused Triton kernel (``rdrop_fairseq.ops.rows_triton``) in Triton's interpreter.

The kernel runs on CPU tensors with ``TRITON_INTERPRET=1``, which Triton reads when
``@triton.jit`` decorates a function: its own library (``tl.sum``...) at the first
``import triton`` of a process, the kernel at the import of the module. Under pytest-xdist
another test file may run first in the same worker and import triton (or the module)
without it, and setting it here would in turn leak the interpreter into later files. So
the kernel runs in a worker subprocess of its own, started once for this file with
``TRITON_INTERPRET=1`` and loading a private copy of the module; this process never imports
triton. Tensors travel both ways through ``torch.save``, exceptions come back as their
type and message.

Every expected value is computed independently in float64 with plain torch ops from the
definitions (log_softmax, gather, sums, ``KL(P||Q) = sum_v P_v (log P_v - log Q_v)`` with
``0 log(0/0) = 0``), and the expected gradient is autograd's, of

    total = c1 * nll + eps_i * smooth + h * (KL(P||Q) + KL(Q||P)),

never the kernel's closed form.
"""

import importlib.util
import io
import os
import struct
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

if importlib.util.find_spec("triton") is None:
    pytest.skip("triton is not installed", allow_module_level=True)

KERNEL_PATH = os.path.normpath(os.path.join(os.path.dirname(__file__), os.pardir,
                                            "rdrop_fairseq", "ops", "rows_triton.py"))

# Imports triton with the TRITON_INTERPRET its parent chose, loads a copy of the module per
# variant on first use ("interpreted": with TRITON_INTERPRET=1, "compiled": without), and
# answers requests (variant, TRITON_INTERPRET during the call, args, kwargs) until stdin
# closes. Tensors keep their strides through torch.save; the reply echoes them as a check.
WORKER = r"""
import contextlib, importlib.util, io, os, struct, sys, warnings
import torch
import triton

# masked columns compute -inf - (-inf) on purpose (the kernel maps the nan to 0); the
# interpreter does that in numpy, which warns
warnings.filterwarnings("ignore", "invalid value encountered")
path, requests, replies = sys.argv[1], sys.stdin.buffer, os.fdopen(os.dup(1), "wb")
os.dup2(2, 1)  # stray prints must not corrupt the replies
modules = {}

@contextlib.contextmanager
def interpret_env(value):
    saved = os.environ.pop("TRITON_INTERPRET", None)
    if value is not None:
        os.environ["TRITON_INTERPRET"] = value
    try:
        yield
    finally:
        os.environ.pop("TRITON_INTERPRET", None)
        if saved is not None:
            os.environ["TRITON_INTERPRET"] = saved

def load(variant):
    if variant not in modules:
        with interpret_env("1" if variant == "interpreted" else None):
            spec = importlib.util.spec_from_file_location("_rdrop_triton_" + variant, path)
            modules[variant] = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(modules[variant])
    return modules[variant]

while head := requests.read(8):
    variant, env, args, kwargs = torch.load(io.BytesIO(requests.read(*struct.unpack("<Q", head))))
    try:
        with interpret_env(env):
            result = load(variant).rdrop_rows_triton(*args, **kwargs)
        reply = ("ok", result, [a.stride() for a in args if torch.is_tensor(a)])
    except Exception as exc:
        reply = ("error", type(exc).__name__, str(exc))
    buf = io.BytesIO()
    torch.save(reply, buf)
    replies.write(struct.pack("<Q", len(buf.getvalue())) + buf.getvalue())
    replies.flush()
"""


class KernelWorker:
    """Runs ``rdrop_rows_triton`` of a module copy in a worker subprocess."""

    def __init__(self, interpret=True):
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        if interpret:
            env["TRITON_INTERPRET"] = "1"
        self.proc = subprocess.Popen([sys.executable, "-c", WORKER, KERNEL_PATH], env=env,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE)

    def __call__(self, *args, variant="interpreted", env="1", **kwargs):
        buf = io.BytesIO()
        torch.save((variant, env, args, kwargs), buf)
        self.proc.stdin.write(struct.pack("<Q", len(buf.getvalue())) + buf.getvalue())
        self.proc.stdin.flush()
        head = self.proc.stdout.read(8)
        if len(head) < 8:
            raise RuntimeError(f"the kernel worker died (exit code {self.proc.wait()})")
        reply = torch.load(io.BytesIO(self.proc.stdout.read(*struct.unpack("<Q", head))))
        if reply[0] == "ok":
            assert reply[2] == [a.stride() for a in args if torch.is_tensor(a)]
            return reply[1]
        exc_type = {"ValueError": ValueError, "ImportError": ImportError}.get(reply[1])
        raise (exc_type or RuntimeError)(reply[2] if exc_type else f"{reply[1]}: {reply[2]}")

    def close(self):
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


@pytest.fixture(scope="module")
def kernel():
    worker = KernelWorker()
    yield worker
    worker.close()


@pytest.fixture(scope="module")
def compiled_kernel():
    """A process where triton and the module were imported without the interpreter."""
    worker = KernelWorker(interpret=False)
    yield worker
    worker.close()


# --------------------------------------------------------------------------- helpers


def gen(seed):
    return torch.Generator().manual_seed(seed)


def make_scores(n, v, seed, from_logits, dtype, noise=1.0):
    """(2, N, V) scores of two "dropout passes" (pass 2 = pass 1 + noise) and a target."""
    g = gen(seed)
    x = torch.randn(n, v, generator=g, dtype=torch.float64) * 3.0
    y = x + noise * torch.randn(n, v, generator=g, dtype=torch.float64)
    s = torch.stack([x, y])
    if not from_logits:
        s = F.log_softmax(s, dim=-1)
    return s.to(dtype), torch.randint(0, v, (n,), generator=g)


def settings(v):
    """name -> (pcoef, h, eps_i, c1), as a caller computes them from alpha and epsilon."""
    eps = 0.1
    eps_i = eps / (v - 1) if v > 1 else 0.0
    c1 = 1.0 - eps - eps_i
    return {
        "label_smoothing": (c1 + eps_i * v, 0.7 / 2, eps_i, c1),  # alpha = 0.7
        "alpha0": (1.0, 0.0, 0.0, 1.0),  # plain cross-entropy, no consistency term
        "kl_only": (0.0, 2.5, 0.0, 0.0),  # alpha = 5
        "weighted": (0.5 + 0.01 * v, 1.5, 0.01, 0.5),  # arbitrary weights, pcoef != 1
    }


def reference(scores, target, from_logits, h, eps_i, c1):
    """Float64 (grad (2, N, V), stats (4, N)) from the definitions and autograd."""
    x = scores[0].detach().double().requires_grad_(True)
    y = scores[1].detach().double().requires_grad_(True)
    la = F.log_softmax(x, dim=-1) if from_logits else x
    lb = F.log_softmax(y, dim=-1) if from_logits else y
    t = target.view(-1, 1)
    nll = -(la.gather(1, t) + lb.gather(1, t)).squeeze(1)
    smooth = -(la.sum(-1) + lb.sum(-1))
    pa, pb, zero = la.exp(), lb.exp(), torch.zeros_like(la)
    # only the classes with P_v > 0 count in KL(P||Q); -inf - (-inf) is replaced before
    # it meets autograd (a nan in an unused torch.where branch still poisons gradients)
    log_ratio = torch.where(torch.isneginf(la) & torch.isneginf(lb), zero, la - lb)
    kl_pq = torch.where(pa > 0, pa * log_ratio, zero).sum(-1)
    kl_qp = torch.where(pb > 0, pb * -log_ratio, zero).sum(-1)
    total = c1 * nll + eps_i * smooth + h * (kl_pq + kl_qp)
    gx, gy = torch.autograd.grad(total.sum(), (x, y))
    return torch.stack([gx, gy]), torch.stack([nll, smooth, kl_pq, kl_qp]).detach()


# Gradients are compared after rounding both to the input dtype: the two roundings of
# nearly equal values differ by at most one unit in the last place (rtol: 2**-10 for
# float16, 2**-7 for bfloat16), plus an atol for results that cancel to near zero, where
# the kernel's float32 error (~1e-7 of the terms) exceeds the tiny value's ulp.
GRAD_TOL = {
    torch.float32: dict(rtol=1e-5, atol=1e-6),
    torch.float16: dict(rtol=2.0 ** -10, atol=1e-6),
    torch.bfloat16: dict(rtol=2.0 ** -7, atol=1e-6),
}
# The statistics are float32 sums over V of the (rounded) inputs in every dtype: relative
# error ~1e-7 of the sum of magnitudes (|smooth| reaches 1e6 at V = 32003).
STATS_TOL = dict(rtol=1e-5, atol=1e-5)


def check(kernel, scores, target, from_logits, pcoef, h, eps_i, c1):
    grad, stats = kernel(scores, target, from_logits=from_logits, pcoef=pcoef, h=h,
                         eps_i=eps_i, c1=c1)
    n, v = scores.shape[1:]
    assert grad.shape == (2, n, v) and grad.dtype == scores.dtype and grad.is_contiguous()
    assert stats.shape == (5, n) and stats.dtype == torch.float32 and stats.is_contiguous()
    ref_grad, ref_stats = reference(scores, target, from_logits, h, eps_i, c1)
    for k, name in enumerate(["nll", "smooth", "kl_pq", "kl_qp"]):
        torch.testing.assert_close(stats[k].double(), ref_stats[k], **STATS_TOL,
                                   msg=lambda m, name=name: f"{name}: {m}")
    # float16 gradients come scaled by a power of two per row pair (stats[4] undoes it)
    inverse = stats[4].double()
    if scores.dtype == torch.float16:
        assert torch.all(inverse == torch.exp2(torch.round(torch.log2(inverse))))
    else:
        assert torch.all(inverse == 1.0)
    scale = (1.0 / inverse).view(1, -1, 1)
    torch.testing.assert_close(grad.double(), (ref_grad * scale).to(scores.dtype).double(),
                               **GRAD_TOL[scores.dtype])
    return grad, stats


# ----------------------------------------------------------------- 1. against autograd


DTYPES = [torch.float32, torch.float16, torch.bfloat16]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("v", [1, 7, 1000, 32003])
@pytest.mark.parametrize("from_logits", [True, False], ids=["logits", "lprobs"])
@pytest.mark.parametrize("setting", ["label_smoothing", "alpha0", "kl_only", "weighted"])
def test_matches_autograd(kernel, dtype, v, from_logits, setting):
    n = 1 if v > 10000 else 3  # the interpreter is slow at a large V
    scores, target = make_scores(n, v, seed=v + 17 * from_logits, from_logits=from_logits,
                                 dtype=dtype)
    pcoef, h, eps_i, c1 = settings(v)[setting]
    if not from_logits:
        pcoef = 123.0  # ignored for log-probabilities (no softmax to chain through)
    check(kernel, scores, target, from_logits, pcoef, h, eps_i, c1)


@pytest.mark.parametrize("from_logits", [True, False], ids=["logits", "lprobs"])
def test_independent_passes(kernel, from_logits):
    """Rows of unrelated distributions: large KLs, large gradients."""
    scores, target = make_scores(4, 300, seed=5, from_logits=from_logits,
                                 dtype=torch.float32, noise=10.0)
    check(kernel, scores, target, from_logits, *settings(300)["label_smoothing"])


def test_identical_passes_give_zero_kl(kernel):
    scores, target = make_scores(3, 50, seed=6, from_logits=True, dtype=torch.float32,
                                 noise=0.0)
    _, stats = check(kernel, scores, target, True, *settings(50)["kl_only"])
    assert torch.all(stats[2:4].abs() < 1e-6)


@pytest.mark.parametrize("from_logits", [True, False], ids=["logits", "lprobs"])
def test_class_ruled_out_by_both_passes(kernel, from_logits):
    """A -inf column in both passes (a masked logit, or log 0) adds nothing to the KLs and
    gets no KL gradient: d = -inf - (-inf) counts as 0, not nan."""
    n, v = 4, 33
    g = gen(8)
    s = torch.randn(2, n, v, generator=g, dtype=torch.float64) * 3.0
    s[:, :, 5] = float("-inf")
    s[:, 1, 20] = float("-inf")  # and one in the middle of a single row
    if not from_logits:
        s = F.log_softmax(s, dim=-1)
    s = s.float()
    target = torch.tensor([0, 4, 32, 6])
    for setting in ["label_smoothing", "kl_only"]:
        pcoef, h, eps_i, c1 = settings(v)[setting]
        grad, stats = check(kernel, s, target, from_logits, pcoef, h, eps_i, c1)
        assert torch.isfinite(grad).all()
        assert torch.isfinite(stats[[0, 2, 3]]).all()  # smooth is +inf: log 0 is summed


def test_class_ruled_out_by_one_pass(kernel):
    """KL(P||Q) stays finite if only P rules a class out, KL(Q||P) is +inf: no nan there.
    Such a row pair has no gradient (its loss is +inf around it): nan in both its rows, from
    logits and from log-probabilities alike; the other rows are finite, as autograd's."""
    n, v = 3, 40
    s = F.log_softmax(torch.randn(2, n, v, generator=gen(14), dtype=torch.float64), -1)
    s[0, :, 7] = float("-inf")  # pass 1 rules class 7 out
    s[1, 2, 9] = float("-inf")  # pass 2 rules class 9 out, in row 2
    s = s.float()
    s[0, 1, 7] = s[1, 1, 7]  # row 1: an ordinary row pair again
    target = torch.tensor([0, 1, 2])
    for from_logits in (False, True):
        grad, stats = kernel(s, target, from_logits=from_logits, pcoef=1.0, h=0.5, eps_i=0.0,
                             c1=1.0)
        ref_grad, ref_stats = reference(s, target, from_logits, 0.5, 0.0, 1.0)
        torch.testing.assert_close(stats[:4].double(), ref_stats, **STATS_TOL)
        assert torch.isfinite(stats[2, :2]).all() and torch.isfinite(stats[3, 1])
        assert torch.isposinf(stats[2, 2]) and torch.isposinf(stats[3, [0, 2]]).all()
        assert torch.isnan(grad[:, [0, 2]]).all()
        torch.testing.assert_close(grad[:, 1].double(), ref_grad[:, 1], **GRAD_TOL[torch.float32])


@pytest.mark.parametrize("from_logits", [True, False], ids=["logits", "lprobs"])
def test_nan_input_propagates(kernel, from_logits):
    """A nan score (a diverged model) must reach its row's loss, for fairseq to see it."""
    scores, target = make_scores(3, 20, seed=15, from_logits=from_logits, dtype=torch.float32)
    scores[1, 1, 4] = float("nan")
    target[1] = 3
    grad, stats = kernel(scores, target, from_logits=from_logits, pcoef=1.0, h=0.5,
                         eps_i=0.0, c1=1.0)
    assert torch.isnan(stats[1:4, 1]).all()  # smooth and both KLs (nll is la[3] + lb[3])
    assert torch.isnan(grad[:, 1]).any()
    keep = [0, 2]
    ref_grad, ref_stats = reference(scores[:, keep], target[keep], from_logits, 0.5, 0.0, 1.0)
    torch.testing.assert_close(stats[:4, keep].double(), ref_stats, **STATS_TOL)
    torch.testing.assert_close(grad[:, keep].double(), ref_grad, **GRAD_TOL[torch.float32])


# ------------------------------------------------------------------------ 2. layouts


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_view_of_stacked_rows(kernel, dtype):
    """(2N, V) logits as the caller gets them, viewed as (2, N, V) without a copy."""
    n, v = 5, 77
    logits = torch.randn(2 * n, v, generator=gen(9)).to(dtype)
    target = torch.randint(0, v, (n,), generator=gen(10))
    check(kernel, logits.view(2, n, v), target, True, *settings(v)["label_smoothing"])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_non_contiguous_rows(kernel, dtype):
    """Row stride != V, a slice along N, and a pass stride smaller than the row stride."""
    n, v = 4, 1000
    base = torch.randn(2, 2 * n + 1, v + 24, generator=gen(11)).to(dtype)
    sliced = base[:, 1::2, 3:3 + v]  # every other row, each inside a longer line
    assert not sliced.is_contiguous() and sliced.stride(-1) == 1
    target = torch.randint(0, v, (2 * n,), generator=gen(12))[::2]  # strided target too
    check(kernel, sliced, target, True, *settings(v)["weighted"])

    # both passes of an example next to each other: (N, 2, V) transposed to (2, N, V)
    pairs = F.log_softmax(torch.randn(n, 2, v, generator=gen(13)), -1).to(dtype)
    pairs = pairs.transpose(0, 1)
    assert pairs.stride() == (v, 2 * v, 1)
    grad, _ = check(kernel, pairs, target, False, *settings(v)["label_smoothing"])
    assert grad.is_contiguous()


def test_empty_batch(kernel):
    grad, stats = call(kernel, torch.zeros(2, 0, 10), torch.zeros(0, dtype=torch.long))
    assert grad.shape == (2, 0, 10) and stats.shape == (5, 0)


# ------------------------------------------------------- edges (issue 19, items 4-7, C)


@pytest.mark.parametrize("offset,spread", [(1e6, 10.0), (-1e7, 30.0), (-1e9, 100.0)])
def test_precision_at_large_logits(kernel, offset, spread):
    """log p = (x - m) - log s keeps the precision of x - m: x - (m + log s) lost it as the
    logits grew (m + log s rounds at the scale of m)."""
    base, target = make_scores(3, 200, seed=30, from_logits=True, dtype=torch.float64)
    scores = (base * spread / 3.0 + offset).float()  # the reference reads the same fp32
    check(kernel, scores, target, True, *settings(200)["label_smoothing"])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_classes_and_rows_masked_with_finfo_min(kernel, dtype):
    """A mask value of finfo(dtype).min (below the old running-max floor): one class per row,
    and one kept row pair entirely (a uniform distribution)."""
    scores, target = make_scores(4, 40, seed=31, from_logits=True, dtype=dtype)
    low = torch.finfo(dtype).min
    scores[:, :, 7] = low
    scores[:, 2] = low
    target[target == 7] = 0
    # no smoothing (cross_entropy_rdrop): the smoothing sum of a row, -2 * finfo.min,
    # overflows float32 (as it would in fairseq), and is not compared
    grad, stats = kernel(scores, target, from_logits=True, pcoef=1.0, h=2.5, eps_i=0.0, c1=1.0)
    ref_grad, ref_stats = reference(scores, target, True, 2.5, 0.0, 1.0)
    for k in (0, 2, 3):
        torch.testing.assert_close(stats[k].double(), ref_stats[k], **STATS_TOL)
    assert torch.isfinite(grad).all()
    torch.testing.assert_close(grad.double(), ref_grad.to(dtype).double(), **GRAD_TOL[dtype])


@pytest.mark.parametrize("from_logits", [True, False], ids=["logits", "lprobs"])
@pytest.mark.parametrize("bad", [float("inf"), -float("inf"), float("nan")])
def test_excluded_rows_are_not_read(kernel, from_logits, bad):
    """keep = False: statistics and gradient 0 whatever the row holds (an entire -inf row,
    an inf, a nan) and whatever its target id (-100, 1e9: never used)."""
    scores, target = make_scores(5, 30, seed=32, from_logits=from_logits, dtype=torch.float32)
    keep = torch.tensor([True, False, True, True, False])
    changed = scores.clone()
    changed[:, 1] = bad
    changed[0, 4, 3] = bad
    target[1], target[4] = -100, 10**9
    coef = dict(zip(["pcoef", "h", "eps_i", "c1"], settings(30)["label_smoothing"]))
    grad, stats = kernel(changed, target, keep, from_logits=from_logits, **coef)
    ref_grad, ref_stats = reference(scores[:, keep], target[keep], from_logits,
                                    coef["h"], coef["eps_i"], coef["c1"])
    torch.testing.assert_close(stats[:4, keep].double(), ref_stats, **STATS_TOL)
    torch.testing.assert_close(grad[:, keep].double(), ref_grad, **GRAD_TOL[torch.float32])
    assert (grad[:, ~keep] == 0).all() and (stats[:4, ~keep] == 0).all()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("from_logits", [True, False], ids=["logits", "lprobs"])
def test_no_gradient_without_need_grad(kernel, dtype, from_logits):
    scores, target = make_scores(3, 50, seed=33, from_logits=from_logits, dtype=dtype)
    coef = dict(zip(["pcoef", "h", "eps_i", "c1"], settings(50)["label_smoothing"]))
    grad, stats = kernel(scores, target, from_logits=from_logits, need_grad=False, **coef)
    _, want = kernel(scores, target, from_logits=from_logits, **coef)
    assert grad is None
    torch.testing.assert_close(stats, want, rtol=0, atol=0)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("from_logits", [True, False], ids=["logits", "lprobs"])
def test_gradient_written_into_the_scores(kernel, dtype, from_logits):
    """out=scores: each chunk (and the target's score) is read before it is overwritten."""
    scores, target = make_scores(3, 5000, seed=34, from_logits=from_logits, dtype=dtype)
    coef = dict(zip(["pcoef", "h", "eps_i", "c1"], settings(5000)["label_smoothing"]))
    want_grad, want_stats = kernel(scores, target, from_logits=from_logits, **coef)
    buffer = scores.clone()
    grad, stats = kernel(buffer, target, from_logits=from_logits, out=buffer, **coef)
    torch.testing.assert_close(stats, want_stats, rtol=0, atol=0)
    torch.testing.assert_close(grad, want_grad, rtol=0, atol=0)


def test_statistics_into_a_slice_and_a_lower_fp16_target(kernel):
    """``stats=`` a column slice of a larger buffer (how the fused-linear path collects its
    chunks' statistics): the same values as a fresh tensor, nothing else written; and the
    float16 scale aimed at ``fp16_target_max`` instead of 2**14: the stored gradient's
    largest entry at most that, and the same gradient once the scale is undone."""
    scores, target = make_scores(3, 700, seed=35, from_logits=True, dtype=torch.float16)
    coef = dict(zip(["pcoef", "h", "eps_i", "c1"], settings(700)["label_smoothing"]))
    want_grad, want_stats = check(kernel, scores, target, True, **coef)
    buffer = torch.full((5, 8), 7.0)
    grad, stats = kernel(scores, target, from_logits=True, stats=buffer[:, 2:5],
                         fp16_target_max=2.0 ** 10, **coef)
    assert stats.stride() == (8, 1)  # the slice itself came back, with its whole storage
    whole = stats.as_strided((5, 8), (8, 1), 0)
    assert (whole[:, :2] == 7).all() and (whole[:, 5:] == 7).all()
    torch.testing.assert_close(stats[:4], want_stats[:4], rtol=0, atol=0)
    assert (grad.abs().amax(dim=(0, 2)).float() <= 2.0 ** 10).all()
    assert (want_grad.abs().amax(dim=(0, 2)).float() > 2.0 ** 10).all()  # the default's
    unscaled = grad.double() * stats[4].double().view(1, -1, 1)
    want = want_grad.double() * want_stats[4].double().view(1, -1, 1)
    torch.testing.assert_close(unscaled, want, **GRAD_TOL[torch.float16])


# ------------------------------------------------------------------------- 3. errors


def call(kernel, scores, target, **options):
    return kernel(scores, target, from_logits=True, pcoef=1.0, h=0.5, eps_i=0.0, c1=1.0,
                  **options)


def test_rejects_float64(kernel):
    scores, target = make_scores(2, 5, seed=1, from_logits=True, dtype=torch.float64)
    with pytest.raises(ValueError, match="float64.*torch path"):
        call(kernel, scores, target)


def test_rejects_non_contiguous_rows(kernel):
    scores = torch.randn(2, 6, 4).transpose(1, 2)  # (2, 4, 6) with stride(-1) == 4
    with pytest.raises(ValueError, match=r"stride\(-1\) == 1"):
        call(kernel, scores, torch.zeros(4, dtype=torch.long))


@pytest.mark.parametrize("shape,n_target,match", [
    ((6, 5), 3, r"\(2, N, V\)"),
    ((3, 2, 5), 2, r"\(2, N, V\)"),
    ((2, 3, 5), 4, r"target must be \(N,\)"),
    ((2, 3, 0), 3, "V = 0"),
])
def test_rejects_bad_shapes(kernel, shape, n_target, match):
    with pytest.raises(ValueError, match=match):
        call(kernel, torch.zeros(shape), torch.zeros(n_target, dtype=torch.long))


def test_rejects_float_target(kernel):
    with pytest.raises(ValueError, match="int64"):
        call(kernel, torch.zeros(2, 3, 5), torch.zeros(3))


def test_cpu_tensors_need_the_interpreter(compiled_kernel):
    scores, target = torch.zeros(2, 3, 5), torch.zeros(3, dtype=torch.long)
    with pytest.raises(ValueError, match="needs CUDA tensors, or TRITON_INTERPRET=1") as err:
        call(compiled_kernel, scores, target, variant="compiled", env=None)
    assert "importing triton" not in str(err.value)
    # set after the import: too late, and the message says so
    with pytest.raises(ValueError, match="it was not when .* imported.*before importing triton"):
        call(compiled_kernel, scores, target, variant="compiled", env="1")


def test_interpreter_chosen_between_the_imports(kernel):
    """triton imported with the interpreter, the module without: refused, not obscure."""
    with pytest.raises(ValueError, match="TRITON_INTERPRET changed between"):
        call(kernel, torch.zeros(2, 3, 5), torch.zeros(3, dtype=torch.long),
             variant="compiled", env="1")


def test_module_imports_without_triton(monkeypatch):
    """Without triton the module still imports, says so, and refuses to run."""
    monkeypatch.setitem(sys.modules, "triton", None)  # makes `import triton` fail
    monkeypatch.setitem(sys.modules, "triton.language", None)
    spec = importlib.util.spec_from_file_location("_rdrop_triton_missing", KERNEL_PATH)
    no_triton = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(no_triton)
    assert not no_triton.triton_available()
    with pytest.raises(ImportError, match="pip install triton"):
        call(no_triton.rdrop_rows_triton, torch.zeros(2, 3, 5), torch.zeros(3, dtype=torch.long))
