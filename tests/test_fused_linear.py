"""The fused linear + R-Drop loss (rdrop_fairseq.fused_linear) against the formula.

The reference is the loss written out in float64 from explicit logits (the paper's
definition: label-smoothed NLL of both passes + alpha/2 (KL(P1||P2) + KL(P2||P1)), padding
excluded), differentiated by autograd; tiny chunk budgets force many chunks."""

import math
import re

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from rdrop_fairseq.fused_linear import fused_linear_rdrop_loss
from rdrop_fairseq.opcount import count_ops
from tests.test_cli import check_ok, run, tool, translation_data, user_dir  # noqa: F401
from tests.warm_process import machine_env

B, T, D, V, PAD = 3, 7, 16, 97, 1


def reference(features, weight, bias, target, alpha, eps, keep):
    """The loss from the definition, float64, on explicit logits."""
    vocab = weight.size(0)
    logits = F.linear(features.double(), weight.double(),
                      None if bias is None else bias.double())
    lp = logits.log_softmax(-1)
    la, lb = lp.chunk(2)
    t = target.unsqueeze(-1)
    nll = -(la.gather(-1, t) + lb.gather(-1, t)).squeeze(-1)
    smooth = -(la.sum(-1) + lb.sum(-1))
    eps_i = eps / (vocab - 1)
    loss = (1 - eps - eps_i) * nll + eps_i * smooth
    kl = 0.5 * ((la.exp() * (la - lb)).sum(-1) + (lb.exp() * (lb - la)).sum(-1))
    keep = keep.double()
    return ((loss + alpha * kl) * keep).sum(), (loss * keep).sum(), (kl * keep).sum()


def inputs(dtype=torch.float32, bias=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    features = torch.randn(2 * B, T, D, generator=g).to(dtype).requires_grad_()
    weight = (torch.randn(V, D, generator=g) * 0.3).to(dtype).requires_grad_()
    b = (torch.randn(V, generator=g) * 0.1).to(dtype).requires_grad_() if bias else None
    target = torch.randint(2, V, (B, T), generator=g)
    target[1, 4:] = PAD
    target[2, 6:] = PAD
    return features, weight, b, target


def assert_close(mine, theirs, rel=1e-5, atol=0.0):
    """Relative error of the whole tensor (its norm): 1e-5 is float32's reach for sums over
    hundreds of rows; single entries near 0 can differ more, relative to themselves.
    ``atol``: for gradients that are 0 in exact arithmetic (an attention key's bias) and
    float32 noise in practice."""
    err = (mine.double() - theirs.double()).norm()
    assert err <= rel * theirs.double().norm() + atol, (err.item(), theirs.norm().item())


def grads_of(total, tensors):
    return torch.autograd.grad(total, [t for t in tensors if t is not None])


@pytest.mark.parametrize("chunk_mb", [1e-4, 0.01, 0.0])  # 1 row pair per chunk .. all
@pytest.mark.parametrize("bias", [True, False])
def test_loss_and_every_gradient_equal_the_float64_formula(chunk_mb, bias):
    features, weight, b, target = inputs(bias=bias)
    keep = target.ne(PAD)
    keep[0, :2] = False  # an ignored prefix, as --ignore-prefix-size
    out = fused_linear_rdrop_loss(features, weight, target, bias=b, alpha=5.0, epsilon=0.1,
                                  ignore_index=PAD, keep=keep, chunk_mb=chunk_mb)
    ours = grads_of(out.total, (features, weight, b))
    ref_total, ref_loss, ref_kl = reference(features, weight, b, target, 5.0, 0.1,
                                            keep.reshape(-1).view(B, T))
    refs = grads_of(ref_total, (features, weight, b))
    assert out.total.dtype == torch.float32
    for mine, theirs in [(out.total, ref_total), (out.loss, ref_loss), (out.kl, ref_kl)]:
        assert math.isclose(mine.item(), theirs.item(), rel_tol=1e-5)
    for mine, theirs in zip(ours, refs):
        assert_close(mine, theirs)
    # excluded rows: no gradient at all
    assert not ours[0][:B][~keep].any() and not ours[0][B:][~keep].any()


def test_equals_the_logits_path_of_the_core():
    from rdrop_fairseq.core import rdrop_loss

    features, weight, b, target = inputs()
    predictions = torch.empty(2, B * T, dtype=torch.long)
    fused = fused_linear_rdrop_loss(features, weight, target, bias=b, alpha=1.0, epsilon=0.1,
                                    ignore_index=PAD, chunk_mb=1e-3, predictions=predictions)
    logits = F.linear(features, weight, b)
    plain = rdrop_loss(logits, target, alpha=1.0, epsilon=0.1, ignore_index=PAD)
    for a, c in zip(fused, plain):
        assert math.isclose(a.item(), c.item(), rel_tol=1e-6)
    assert torch.equal(predictions, logits.argmax(-1).reshape(2, -1))
    for a, c in zip(grads_of(fused.total, (features, weight, b)),
                    grads_of(plain.total, (features, weight, b))):
        assert_close(a, c)


@pytest.mark.parametrize("dtype,tol", [(torch.bfloat16, 2e-2), (torch.float16, 2e-3)])
def test_half_precision_models_within_the_measured_tolerance(dtype, tol):
    """bf16 / fp16 features and weight (matmuls in that dtype, sums in float32) against the
    float64 formula on the same rounded inputs: loss within 1e-3 relative; gradients within
    ``tol`` (relative to their largest entry): bf16 ~8e-3, fp16 ~1e-3 measured. At this size
    a bf16 accumulation of grad_W would pass too: the next test tells it apart."""
    features, weight, b, target = inputs(dtype=dtype)
    out = fused_linear_rdrop_loss(features, weight, target, bias=b, alpha=5.0, epsilon=0.1,
                                  ignore_index=PAD, chunk_mb=1e-3)
    ours = grads_of(out.total, (features, weight, b))
    ref_total, _, _ = reference(features, weight, b, target, 5.0, 0.1, target.ne(PAD))
    refs = grads_of(ref_total, (features, weight, b))
    assert out.total.dtype == torch.float32
    assert math.isclose(out.total.item(), ref_total.item(), rel_tol=1e-3)
    for mine, theirs in zip(ours, refs):
        assert mine.dtype == dtype
        err = (mine.double() - theirs).abs().max() / theirs.abs().max()
        assert err < tol, (dtype, err.item())


def test_bf16_weight_gradient_is_accumulated_in_float32():
    """bf16 model, 2048 rows in 512 chunks: grad_W and grad_b within a bound derived for
    float32 accumulation, entry by entry, against float64 on the same bf16 inputs.

    Per row r (``u = 2**-8``, bf16's unit roundoff; alpha = epsilon = 0, so the logits'
    gradient is ``g = p - onehot(t)``): the logits come out of the bf16 matmul rounded,
    ``|dz| <= e_r = u max_v |z_rv|``; a log-softmax moves by at most ``2 e_r``, so ``p``
    by ``2 e_r p``; ``g`` is stored in bf16 (``+ u |g|``); its product with ``x`` (exact
    in float32) and the sum over ``n`` rows in float32 add at most ``n 2**-24 |g x|``; on
    the CPU each chunk's share of the product is rounded to bf16 once before it joins the
    float32 sum (``+ u |share|``, at most ``u sum_r |g_r| |x_r|`` over the chunks); the
    result is rounded to bf16 once (``+ u |grad|``). So, to first order in u::

        |grad_W - ref| <= sum_r (2 e_r p_r + (2 u + n 2**-24) |g_r|) |x_r| + u |ref|

    and likewise for grad_b with ``|x_r|`` = 1. Accumulating in bf16 instead rounds the
    running sum to 8 bits after every chunk: once it is 2**7..2**8 times a chunk's
    share, the shares are lost. Here every row has the same target and ``x`` is mostly
    positive, so every entry is a sum of same-sign shares, and 512 chunks leave a bf16
    sum at a fraction of the true one (measured: ~13x the bound for grad_W, ~60x for
    grad_b; float32 accumulation stays under 0.2x of it)."""
    n, v, d = 1024, 256, 16
    g = torch.Generator().manual_seed(5)
    features = (1 + 0.5 * torch.randn(2 * n, d, generator=g)).bfloat16().requires_grad_()
    weight = (0.1 * torch.randn(v, d, generator=g)).bfloat16().requires_grad_()
    b = (0.1 * torch.randn(v, generator=g)).bfloat16().requires_grad_()
    target = torch.full((n,), 2)
    # two row pairs per chunk: 3 pairs of 4 x V float32 by the budget, 4/5 of that for bf16
    with count_ops() as ops:
        out = fused_linear_rdrop_loss(features, weight, target, bias=b,
                                      chunk_mb=3 * 4 * v * 4 / 2**20)
        grad_w, grad_b = torch.autograd.grad(out.total, (weight, b))
    assert ops.by_op["aten.amax"] == n // 2  # one row max per chunk: the chunks the bound is for
    x, z = features.detach().double(), F.linear(features.double(), weight.double(), b.double())
    p = z.detach().softmax(-1)
    grad_z = p - F.one_hot(torch.full((2 * n,), 2), v).double()
    u = 2.0 ** -8
    per_row = (2 * u * z.detach().abs().amax(-1, keepdim=True) * p
               + (2 * u + 2 * n * 2.0 ** -24) * grad_z.abs())
    for mine, ref, bound in ((grad_w, grad_z.t() @ x, per_row.t() @ x.abs()),
                             (grad_b, grad_z.sum(0), per_row.sum(0))):
        assert mine.dtype == torch.bfloat16
        bound = bound + u * ref.abs()
        worst = ((mine.double() - ref).abs() / bound).max().item()
        assert worst <= 1.0, worst


@pytest.mark.parametrize("dtype,scale,tol", [(torch.float16, 128.0, 1e-2),
                                             (torch.float32, 0.37, 1e-5)])
def test_backward_scales_by_the_incoming_gradient_at_a_realistic_vocabulary(dtype, scale, tol):
    """The backward of ``scale * total`` (fp16 with a loss scale of 128, as fairseq's
    --fp16; float32 with a factor that is no power of two) equals ``scale`` times the
    float64 formula's gradients, at V = 4096 (11 chunks in fp16, 4 in float32). The other
    tests backward ``total`` itself, where ignoring the incoming gradient changes nothing;
    here it leaves an error of 1 - 1/scale. ``tol``, norm-relative: float32's 1e-5 as
    above; fp16 logits are rounded to 11 bits, |dz| <= 2**-11 |z| with |z| up to ~5 here,
    which moves p by up to ~5e-3 (measured: 6.7e-4 .. 1.3e-3 for the three gradients)."""
    b_, t_, d, v = 4, 16, 32, 4096
    g = torch.Generator().manual_seed(6)
    features = torch.randn(2 * b_, t_, d, generator=g).to(dtype).requires_grad_()
    weight = (0.3 * torch.randn(v, d, generator=g)).to(dtype).requires_grad_()
    b = (0.1 * torch.randn(v, generator=g)).to(dtype).requires_grad_()
    target = torch.randint(2, v, (b_, t_), generator=g)
    target[1, 10:] = PAD
    out = fused_linear_rdrop_loss(features, weight, target, bias=b, alpha=5.0, epsilon=0.1,
                                  ignore_index=PAD, chunk_mb=0.5)
    ours = grads_of(scale * out.total, (features, weight, b))
    ref_total, _, _ = reference(features, weight, b, target, 5.0, 0.1, target.ne(PAD))
    refs = grads_of(scale * ref_total, (features, weight, b))
    for mine, theirs in zip(ours, refs):
        assert mine.dtype == dtype
        assert_close(mine, theirs, rel=tol)


def test_tied_weight_gets_the_gradient_of_both_uses():
    """A weight tied with the input embedding: autograd adds the projection's gradient (ours)
    to the embedding's, as with nn.Linear on explicit logits."""
    from rdrop_fairseq.core import rdrop_loss

    torch.manual_seed(0)
    emb = torch.nn.Embedding(V, D)
    tokens = torch.randint(2, V, (2 * B, T))
    target = torch.randint(2, V, (B, T))
    results = []
    for fused in (True, False):
        emb.zero_grad()
        features = torch.tanh(emb(tokens))
        if fused:
            out = fused_linear_rdrop_loss(features, emb.weight, target, alpha=1.0,
                                          chunk_mb=1e-3)
        else:
            out = rdrop_loss(F.linear(features, emb.weight), target, alpha=1.0)
        out.total.backward()
        results.append(emb.weight.grad.clone())
    assert_close(results[0], results[1])


class LargestTensor(TorchDispatchMode):
    """``largest``: the numel of the largest tensor an op allocates. Outputs that share an
    input's storage (views, in-place and ``out=`` results) are not allocations: a view of
    the V x d weight is not a V x d tensor."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        inputs = {t.untyped_storage().data_ptr()
                  for t in tree_leaves((args, kwargs)) if torch.is_tensor(t)}
        for t in tree_leaves(out):
            if torch.is_tensor(t) and t.untyped_storage().data_ptr() not in inputs:
                self.largest = max(self.largest, t.numel())
        return out


def products(ops):
    """The matrix products with the weight (the core's row dots are bmm)."""
    return sum(ops.by_op[name] for name in ("aten.mm", "aten.addmm", "aten.addmm_"))


@pytest.mark.parametrize("features_need_grad", [False, True])
def test_no_grad_does_no_gradient_work_and_gives_the_same_loss(features_need_grad):
    """Validation calls the loss under no_grad with the model's Parameters, which still
    require grad (``needs_input_grad`` says True for them, whatever the grad mode), on
    features that do not (a no_grad forward) or do: no V x d weight gradient is allocated
    and the only matrix products are the logits' (one per chunk; with grad there is one
    more for the weight's gradient, and one for the features' if they need it, which the
    same counters see)."""
    features, weight, b, target = inputs()
    if not features_need_grad:
        features = features.detach()
    chunks = B * T  # chunk_mb 1e-3: one row pair (2 x 97 float32 logits) per chunk
    with torch.no_grad(), LargestTensor() as seen, count_ops() as ops:
        a = fused_linear_rdrop_loss(features, weight, target, bias=b, alpha=1.0, chunk_mb=1e-3)
    assert a.total.grad_fn is None
    assert seen.largest < V * D, seen.largest
    assert products(ops) == chunks, ops.by_op
    with LargestTensor() as seen_grad, count_ops() as ops_grad:
        c = fused_linear_rdrop_loss(features, weight, target, bias=b, alpha=1.0, chunk_mb=1e-3)
    assert seen_grad.largest == V * (D + 1)  # the weight's gradient, the bias's beside it
    assert products(ops_grad) == chunks * (3 if features_need_grad else 2), ops_grad.by_op
    assert a.total.item() == pytest.approx(c.total.item(), rel=1e-6)


class MatrixProducts(TorchDispatchMode):
    """Every matrix product dispatched: its name, the dtypes of its two factors, and the
    shapes of its tensors (factors, accumulator, result)."""

    FACTORS = {"mm": (0, 1), "bmm": (0, 1), "matmul": (0, 1), "mv": (0, 1),
               "addmm": (1, 2), "addmm_": (1, 2), "baddbmm": (1, 2), "addmv": (1, 2)}

    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        if name in self.FACTORS:
            factors = [args[i] for i in self.FACTORS[name]]
            shapes = [tuple(t.shape) for t in tree_leaves((args, kwargs, out))
                      if torch.is_tensor(t)]
            self.seen.append((name, tuple(f.dtype for f in factors), shapes))
        return out


def check_no_float32_product_on_the_weight(products_seen, vocab, dim, dtype):
    """No float32 product has a V x d-shaped tensor (the weight, its gradient, with or
    without the bias's column, either way round), and such products were seen in the
    model's dtype: the logits', the features' gradient's and the weight's gradient's."""
    sizes = {(vocab, dim), (dim, vocab), (vocab, dim + 1), (dim + 1, vocab)}
    on_weight = [p for p in products_seen if sizes & set(p[2])]
    assert [p for p in on_weight if torch.float32 in p[1]] == [], on_weight
    assert len([p for p in on_weight if p[1] == (dtype, dtype)]) >= 3, products_seen


def test_bf16_call_and_backward_run_no_float32_product_on_the_weight():
    """A bf16 model: the logits', the features' and the weight's gradient products are
    bf16 x bf16 (the weight's accumulated in float32 outside the product): no float32 matrix
    product with a V x d-sized operand or result, whose upcast copies and float32 rate a GPU
    would pay."""
    features, weight, b, target = inputs(dtype=torch.bfloat16)
    with MatrixProducts() as seen:
        out = fused_linear_rdrop_loss(features, weight, target, bias=b, alpha=5.0, epsilon=0.1,
                                      ignore_index=PAD, chunk_mb=1e-3)  # torch on CPU
        out.total.backward()
    check_no_float32_product_on_the_weight(seen.seen, V, D, torch.bfloat16)


def test_bf16_transformer_step_with_fused_linear_runs_no_float32_product_on_the_weight():
    """The same through the criterion, for a whole bf16 fairseq transformer's call and
    backward with --rdrop-fused-linear."""
    from tests.test_criteria import VOCAB, translation_case

    case = translation_case()
    torch.manual_seed(0)
    model = case.build_model(dropout=0.1).bfloat16()
    model.train()
    criterion = case.ours(alpha=5.0, rdrop_fused_linear=True, rdrop_chunk_mb=1e-3)
    with MatrixProducts() as seen:
        loss, _, _ = criterion(model, case.make_sample(extra_pad=2))
        loss.backward()
    dim = model.decoder.output_projection.weight.size(1)
    check_no_float32_product_on_the_weight(seen.seen, VOCAB, dim, torch.bfloat16)


# The fused-linear path with impl="triton", in Triton's interpreter on CPU tensors: a
# subprocess with TRITON_INTERPRET=1 from its start (Triton reads it at its first import;
# see tests/test_triton_kernel.py). The inputs and results travel through torch.save.
TRITON_CHILD = """
import sys, torch
from rdrop_fairseq.fused_linear import fused_linear_rdrop_loss
results = []
for features, weight, bias, target, keep, chunk_mb in torch.load(sys.argv[1]):
    leaves = [t.requires_grad_() for t in (features, weight, bias)]
    predictions = torch.empty(2, target.numel(), dtype=torch.long)
    out = fused_linear_rdrop_loss(features, weight, target, bias=bias, alpha=5.0, epsilon=0.1,
                                  ignore_index=1, keep=keep, chunk_mb=chunk_mb,
                                  predictions=predictions, impl="triton")
    grads = torch.autograd.grad(3.0 * out.total, leaves)  # an incoming gradient of 3
    results.append((tuple(out), grads, predictions))
torch.save(results, sys.argv[2])
"""


def test_triton_impl_equals_the_unfused_loss(tmp_path):
    """impl="triton" (the row kernel per chunk, in Triton's interpreter) against the unfused
    loss on explicit logits (core.rdrop_loss, torch implementation): loss, NLL, KL, the
    predictions and the gradients of features, weight and bias, float32 to 1e-5, in 1 to 4
    chunks with padding and an ignored prefix; bf16 and fp16 against the float64 formula on
    the same rounded inputs, to the half-precision tolerances above."""
    pytest.importorskip("triton")
    import os
    import subprocess
    import sys

    from rdrop_fairseq.core import rdrop_loss

    cases = []
    for dtype, chunk_pairs in [(torch.float32, 4), (torch.float32, B * T),
                               (torch.bfloat16, 5), (torch.float16, 5)]:
        features, weight, b, target = inputs(dtype=dtype)
        keep = torch.ones_like(target, dtype=torch.bool)
        keep[0, :2] = False  # an ignored prefix
        chunk_mb = chunk_pairs * 2 * V * features.element_size() / 2**20
        cases.append([t.detach() for t in (features, weight, b)] + [target, keep, chunk_mb])
    torch.save(cases, tmp_path / "in.pt")
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-c", TRITON_CHILD, tmp_path / "in.pt",
                           tmp_path / "out.pt"], capture_output=True, text=True, env=env,
                          cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = torch.load(tmp_path / "out.pt")
    for (features, weight, b, target, keep, _), (out, grads, predictions) in zip(cases, results):
        leaves = [t.clone().requires_grad_() for t in (features, weight, b)]
        if features.dtype == torch.float32:
            logits = F.linear(*leaves)
            plain = rdrop_loss(logits, target, alpha=5.0, epsilon=0.1, ignore_index=PAD,
                               keep=keep, impl="torch")
            assert torch.equal(predictions, logits.detach().argmax(-1).reshape(2, -1))
            for mine, theirs in zip(out, plain):
                assert math.isclose(mine.item(), theirs.item(), rel_tol=1e-6)
            for mine, theirs in zip(grads, torch.autograd.grad(3.0 * plain.total, leaves)):
                assert mine.dtype == torch.float32
                assert_close(mine, theirs)
        else:
            exact = [t.double().requires_grad_() for t in (features, weight, b)]
            total, _, _ = reference(*exact, target, 5.0, 0.1, keep & target.ne(PAD))
            tol = 2e-2 if features.dtype == torch.bfloat16 else 2e-3
            assert math.isclose(out[0].item(), total.item(), rel_tol=1e-3)
            for mine, theirs in zip(grads, torch.autograd.grad(3.0 * total, exact)):
                assert mine.dtype == features.dtype
                err = (mine.double() - theirs).abs().max() / theirs.abs().max()
                assert err < tol, (features.dtype, err.item())


def test_no_tensor_larger_than_a_chunk_or_the_weight_and_no_sync():
    """The point of the fusion: nothing of size 2N x V; no host sync in forward + backward."""
    n_tokens = B * T
    features, weight, b, target = inputs()
    with LargestTensor() as seen, count_ops() as ops:
        out = fused_linear_rdrop_loss(features, weight, target, bias=b, alpha=1.0,
                                      ignore_index=PAD, chunk_mb=2 * 2 * V * 4 / 2**20)
        out.total.backward()
    # the weight's gradient with the bias's as a column
    assert seen.largest <= max(V * (D + 1), 2 * 2 * V, features.numel())
    assert seen.largest < 2 * n_tokens * V
    assert ops.n_syncing == 0, ops.syncing


def test_bad_input_is_refused():
    features, weight, b, target = inputs()
    with pytest.raises(ValueError, match="alpha"):
        fused_linear_rdrop_loss(features, weight, target, alpha=-1.0)
    with pytest.raises(ValueError, match=r"weight must be \(V, 16\)"):
        fused_linear_rdrop_loss(features, weight[:, :3], target)
    with pytest.raises(ValueError, match="both passes"):
        fused_linear_rdrop_loss(features[:5], weight, target)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_cuda_half_precision_equals_the_unfused_loss(dtype):
    from rdrop_fairseq.core import rdrop_loss

    features, weight, b, target = (t.cuda() if t is not None else None for t in inputs())
    features = features.detach().to(dtype).requires_grad_()
    weight = weight.detach().to(dtype).requires_grad_()
    fused = fused_linear_rdrop_loss(features, weight, target, alpha=5.0, epsilon=0.1,
                                    ignore_index=PAD)
    plain = rdrop_loss(F.linear(features, weight), target, alpha=5.0, epsilon=0.1,
                       ignore_index=PAD)
    assert math.isclose(fused.total.item(), plain.total.item(), rel_tol=1e-3)
    for a, c in zip(grads_of(fused.total, (features, weight)),
                    grads_of(plain.total, (features, weight))):
        assert ((a.float() - c.float()).abs().max() / c.float().abs().max()) < 2e-2


# --------------------------------------------------------------------------- the criteria
# --rdrop-fused-linear through the real criteria, against the same criteria unfused.


def criterion_outputs(case, model, fused, **kw):
    torch.manual_seed(3)
    criterion = case.ours(alpha=5.0, rdrop_fused_linear=fused, rdrop_chunk_mb=1e-3, **kw)
    model.zero_grad()
    loss, sample_size, log = criterion(model, case.make_sample(extra_pad=2))
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return loss, sample_size, log, grads


@pytest.mark.parametrize("share", [True, False])
@pytest.mark.parametrize("extra", [{}, {"report_accuracy": True, "ignore_prefix_size": 1}])
def test_label_smoothed_criterion_fused_equals_unfused(share, extra):
    """Loss, logged values and every parameter's gradient (the tied embedding, or the
    untied projection) as the unfused criterion's, for a transformer."""
    from tests.test_criteria import translation_case

    case = translation_case()
    torch.manual_seed(0)
    model = case.build_model(dropout=0.1)  # untied: a projection of its own
    if share:  # as --share-decoder-input-output-embed
        model.decoder.output_projection.weight = model.decoder.embed_tokens.weight
    assert (model.decoder.output_projection.weight is model.decoder.embed_tokens.weight) == share
    model.train()
    fused = criterion_outputs(case, model, True, **extra)
    plain = criterion_outputs(case, model, False, **extra)
    assert fused[1] == plain[1]
    assert math.isclose(fused[0].item(), plain[0].item(), rel_tol=1e-5)
    for key in plain[2]:
        assert math.isclose(float(fused[2][key]), float(plain[2][key]), rel_tol=1e-5,
                            abs_tol=1e-6), key
    assert set(fused[3]) == set(plain[3])
    for name in plain[3]:
        assert_close(fused[3][name], plain[3][name], atol=1e-6)


def test_cross_entropy_criterion_fused_equals_unfused_for_a_language_model():
    from tests.test_criteria import lm_case

    case = lm_case(adaptive=False)
    torch.manual_seed(0)
    model = case.build_model(dropout=0.1)
    model.train()
    fused = criterion_outputs(case, model, True)
    plain = criterion_outputs(case, model, False)
    assert math.isclose(fused[0].item(), plain[0].item(), rel_tol=1e-5)
    for name in plain[3]:
        assert_close(fused[3][name], plain[3][name], atol=1e-6)


def test_fused_linear_is_refused_where_it_cannot_serve():
    from tests.test_criteria import lm_case

    case = lm_case(adaptive=True)
    torch.manual_seed(0)
    model = case.build_model(dropout=0.1)
    model.train()
    from rdrop_fairseq.criterions.output_layer import fused_output_projection

    with pytest.raises(ValueError, match="adaptive softmax"):
        fused_output_projection(model)
    with pytest.raises(ValueError, match="--rdrop-fused-linear is for"):
        case.ours(alpha=1.0, rdrop_fused_linear=True)


@pytest.mark.slow
def test_fairseq_train_with_fused_linear_matches_the_unfused_run(translation_data, user_dir,
                                                                   tmp_path):
    """fairseq-train end to end on tiny data (--update-freq 2, --report-accuracy): the same
    logged losses, update by update, with and without --rdrop-fused-linear, to one unit of
    the last digit fairseq prints (the two paths sum in another order, so a value that lies
    on a rounding boundary, 0.16175001 vs 0.16174999, prints 0.1618 and 0.1617)."""
    logs = []
    for fused in (False, True):
        proc = check_ok(run([tool("fairseq-train"), translation_data, "--user-dir", user_dir,
                             "--cpu", "--task", "translation", "--arch", "transformer_iwslt_de_en",
                             "--encoder-layers", "1", "--decoder-layers", "1",
                             "--encoder-embed-dim", "32", "--decoder-embed-dim", "32",
                             "--encoder-ffn-embed-dim", "64", "--decoder-ffn-embed-dim", "64",
                             "--share-decoder-input-output-embed", "--dropout", "0.1",
                             "--criterion", "label_smoothed_cross_entropy_rdrop",
                             "--label-smoothing", "0.1", "--rdrop-alpha", "5",
                             "--report-accuracy", "--optimizer", "adam", "--lr", "1e-3",
                             "--max-tokens", "500", "--max-update", "6", "--seed", "1",
                             "--no-save", "--log-interval", "1", "--log-format", "simple",
                             "--no-progress-bar", "--num-workers", "0", "--update-freq", "2",
                             *(["--rdrop-fused-linear"] if fused else [])], cwd=tmp_path))
        lines = [dict(re.findall(r"(\w+)=([^,\s]+)", line))
                 for line in proc.stdout.splitlines() if "| train_inner |" in line]
        logs.append([(x["loss"], x["nll_loss"], x["rdrop_kl"], x["accuracy"]) for x in lines])
    assert len(logs[0]) == 6 and len(logs[1]) == 6, logs
    for unfused, fused in zip(*logs):
        for a, b in zip(unfused, fused):
            unit = 10.0 ** -max(len(v.partition(".")[2]) for v in (a, b))
            assert abs(float(a) - float(b)) <= 1.01 * unit, logs


def test_precision_script_compares_both_paths_against_float64():
    """benchmarks/fused_linear_precision.py (docs/benchmarks.md's precision table), at a
    size with 4 chunks of row pairs (256 pairs, 64 per chunk at V = 20,000): one line per
    dtype and path, each gradient's error finite and within the dtype's rounding, the
    fused path's within 2x the unfused one's (the features' gradient is the same product
    in both)."""
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[1]
    proc = subprocess.run([sys.executable, "benchmarks/fused_linear_precision.py", "--cases",
                           "256x20000x16"], cwd=repo, capture_output=True, text=True,
                          timeout=300, env={**machine_env(), "PATH": "/usr/bin:/bin",
                                            "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
                                            "PYTHONPATH": str(repo)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = {}
    for line in proc.stdout.splitlines()[1:]:
        dtype, *_, path, features, weight, bias = line.split()
        rows[dtype, path] = [float(e.split("/")[0]) for e in (features, weight, bias)]
    assert set(rows) == {(d, p) for d in ("bfloat16", "float16")
                         for p in ("fused-linear", "unfused")}, proc.stdout
    for dtype, bound in (("bfloat16", 2e-2), ("float16", 2e-3)):
        fused, unfused = rows[dtype, "fused-linear"], rows[dtype, "unfused"]
        assert all(0 < e < bound for e in fused + unfused), (dtype, fused, unfused)
        assert fused[0] == pytest.approx(unfused[0], rel=0.05), (dtype, fused, unfused)
        assert all(f <= 2 * u for f, u in zip(fused, unfused)), (dtype, fused, unfused)
