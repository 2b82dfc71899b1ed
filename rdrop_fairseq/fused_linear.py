"""R-Drop's loss from the decoder's features and output projection, without the logits.

:func:`fused_linear_rdrop_loss` computes what :func:`rdrop_fairseq.core.rdrop_loss`
computes from ``logits = features @ weight.T (+ bias)``, a chunk of row *pairs* at a time
(pass 1 and pass 2 of the same position together, as the KL needs). Per chunk:

1. the chunk's logits, one matrix product in the model's dtype;
2. their row statistics, and their gradient written over them
   (:func:`rdrop_fairseq.ops.impl.run_rows`: the Triton row kernel, one launch, with
   ``impl="triton"``, the chunked torch ops with ``impl="torch"``);
3. the features' gradient and the chunk's share of the weight's (and bias's) gradient,
   two more products in the model's dtype.

So the ``2N x V`` logits, their float32 upcast and their gradient never exist: the largest
tensors are one chunk's (``--rdrop-chunk-mb``) and the ``V x d`` weight gradient. As in the
core, everything is computed in the forward and the backward only scales by the incoming
gradient (one backward per forward).

Layout: the features are copied once into ``(N, 2, d)`` (pass 1 and pass 2 of a position
side by side, plus a column of ones when the bias needs a gradient: its gradient is then
the last column of the weight's product), so that a chunk is one contiguous ``(2r, d)``
block: each product is one call, and the kernel reads the ``(2, r, V)`` pairs through
strides.

Precision: the products multiply in the model's dtype (tensor cores for fp16/bf16) and
accumulate in float32 inside each product. The weight's and bias's gradients are summed
over the chunks in float32 (float64 for float64 models): on CUDA the product writes into
that float32 sum directly (``out_dtype``); where torch cannot (CPU), each chunk's share is
rounded once to the model's dtype before it is added. For fp16 the logits' gradient is
stored scaled per row pair by a power of two (most entries are ~1/V, fp16 subnormals);
the features' gradient undoes the scale on its small ``r x d`` result, and the weight's
product takes it in the features' rows (times the power of two
:data:`FP16_PRODUCT_TARGET_MAX`, which the product's ``alpha`` removes), so no operand is
upcast.
"""

from collections import namedtuple

import torch

from .core import RDropLoss, check_alpha_epsilon
from .ops.impl import run_rows, run_with_fallback
from .ops.rows import (RDropBatchError, chunk_budget_mb, chunk_bytes_per_pair, chunk_rows_for,
                       coefficients, compute_dtype, finish_forward, kept_rows, saved_grads,
                       target_ids)

# With --rdrop-chunk-mb 0 (automatic), at least this many row pairs per chunk: every chunk
# reads the whole V x d weight twice and updates its V x d gradient, so small chunks make
# the path memory-bound (CPU, V = 267,744, d = 128: 8.8 s with 7-pair chunks of 16 MiB,
# 5.5 s with 64-pair chunks, against 8.0 s for plain cross-entropy on the logits). The
# CUDA figure is a guess from the ratio of compute to memory bandwidth, not measured yet:
# scripts/gpu_check.sh measures a sweep of chunk sizes.
MIN_AUTO_PAIRS = {"cpu": 64, "cuda": 256}

# fp16, this path's own target for the stored gradient's scale: each row pair's gradient
# is scaled so that a bound on its largest entry is near this power of two; less headroom
# than the logits path's 2**14 (rdrop_fairseq.ops.rows.FP16_TARGET_MAX), because here the
# scaled gradient is multiplied by the weight in fp16 (the features' gradient product).
FP16_PRODUCT_TARGET_MAX = 2.0 ** 10

# (op name, device type) for which torch refused out_dtype=float32 (older torch): not tried again
_NO_FLOAT32_OUT = set()


def fused_linear_rdrop_loss(features, weight, target, *, bias=None, alpha=0.0, epsilon=0.0,
                            ignore_index=None, keep=None, chunk_mb=0.0, predictions=None,
                            impl="auto"):
    """Task loss of both passes plus ``alpha`` times their symmetric KL, from the features.

    Args:
        features: ``(2B, ..., d)``, pass 1 then pass 2 along dim 0 (the decoder's output
            with ``features_only=True``), in the model's dtype.
        weight: ``(V, d)`` output projection (tied with the embedding or not); ``bias``
            ``(V,)`` or None.
        target, epsilon, ignore_index, keep, alpha: as :func:`core.rdrop_loss` (``target``
            of one pass, ``(B, ...)``).
        chunk_mb: bound, in MiB, on one chunk: its logits (model dtype) with ``impl``
            triton, also the torch implementation's float32 temporaries with torch; 0 =
            automatic (:data:`rdrop_fairseq.ops.rows.AUTO_CHUNK_MB`, and at least
            :data:`MIN_AUTO_PAIRS` row pairs). An explicit budget is kept exactly.
        predictions: optional ``(2, B*...)`` long tensor that receives each row's argmax
            (for ``--report-accuracy``), taken before the logits become the gradient.
        impl: ``"triton"`` (CUDA tensors, or CPU tensors under ``TRITON_INTERPRET=1``),
            ``"torch"``, or ``"auto"`` (triton on CUDA when importable), as
            :func:`core.rdrop_loss`.

    Returns :data:`core.RDropLoss` ``(total, loss, nll, kl)``; ``total`` is differentiable
    with respect to ``features``, ``weight`` and ``bias``.
    """
    alpha = check_alpha_epsilon(alpha, epsilon)
    if features.dim() < 2 or features.size(0) % 2:
        raise RDropBatchError("features must be (2B, ..., d) with both passes stacked along "
                              f"dim 0, got shape {tuple(features.shape)}")
    if weight.dim() != 2 or weight.size(1) != features.size(-1):
        raise ValueError(f"weight must be (V, {features.size(-1)}), got {tuple(weight.shape)}")
    if bias is not None and bias.shape != (weight.size(0),):
        raise ValueError(f"bias must be ({weight.size(0)},), got {tuple(bias.shape)}")
    pairs = features.reshape(2, -1, features.size(-1))
    n, vocab = pairs.size(1), weight.size(0)
    kept = kept_rows(target, ignore_index, keep, n, pairs)

    def run(impl):
        rows = chunk_pairs(vocab, features, chunk_mb, impl)
        with torch.autocast(features.device.type, enabled=False):
            return RDropLoss(*_FusedLinearRDrop.apply(
                pairs, weight, bias, target_ids(target, kept, impl), kept, alpha,
                float(epsilon), rows, predictions, torch.is_grad_enabled(), impl))

    return run_with_fallback(impl, features, run)


def chunk_pairs(vocab, features, chunk_mb=0.0, impl="torch"):
    """Row pairs per chunk for a ``chunk_mb`` MiB budget (0: automatic, see
    :func:`fused_linear_rdrop_loss`) and features of that dtype and device. A chunk holds
    its logits (``2 r x V`` in the model's dtype), which become their gradient; with the
    torch implementation also the core's temporaries, whose probabilities live in the
    logits' buffer where that has the compute dtype (float32 models)."""
    budget = chunk_budget_mb(chunk_mb, features) * 2**20
    per_pair = 2 * vocab * features.element_size()
    if impl != "triton":
        in_place = features.dtype == compute_dtype(features)
        per_pair += chunk_bytes_per_pair(vocab, features.dtype, in_place)
    rows = max(1, int(budget) // per_pair)
    if not chunk_mb:  # automatic: also amortise the weight's traffic over enough rows
        rows = max(rows, MIN_AUTO_PAIRS["cuda" if features.is_cuda else "cpu"])
    return rows


def _float32_out(op, *args, **kwargs):
    """``op(*args, out_dtype=torch.float32, **kwargs)`` for fp16/bf16 operands: the
    product's float32 accumulation written as float32 (CUDA). None where torch has no such
    kernel (CPU) or refuses it (torch before 2.8 or so), which is then not tried again."""
    device = args[-1].device.type
    if device != "cuda" or (op.__name__, device) in _NO_FLOAT32_OUT:
        return None
    try:
        return op(*args, out_dtype=torch.float32, **kwargs)
    except (RuntimeError, TypeError):
        _NO_FLOAT32_OUT.add((op.__name__, device))
        return None


def _add_product(acc, a, b, alpha, zero):
    """``acc += alpha * (a @ b)``: ``a``, ``b`` in the model's dtype and multiplied in it,
    ``acc`` the float32 (float64) sum; ``zero`` a 0-dim zero of the operands' dtype."""
    if a.dtype == acc.dtype:
        acc.addmm_(a, b, alpha=alpha)
    elif _float32_out(torch.addmm, acc, a, b, alpha=alpha, out=acc) is None:
        # alpha inside the product, before its rounding: a scaled fp16 share can overflow
        acc.add_(torch.addmm(zero, a, b, beta=0, alpha=alpha))


# The buffers of one call: the features' rows (N, 2, width), a chunk's rows one block, with
# a column of ones for the bias where it needs a gradient; the features' gradient (N, 2, d)
# or None; the weight's gradient with the bias's as its last column (V, width, float32) or
# None; the statistics (5, N); a 0-dim zero of the model's dtype; whether the gradient is
# stored scaled (fp16); the torch implementation's own chunk within a block
_Buffers = namedtuple("_Buffers", "rows grad_rows grad_wb stats zero dim scaled need_grad "
                                  "core_rows")


class _FusedLinearRDrop(torch.autograd.Function):
    @staticmethod
    def forward(ctx, pairs, weight, bias, target, kept, alpha, epsilon, chunk_rows,
                predictions, grad_enabled, impl):
        coef = coefficients(weight.size(0), epsilon, alpha, True, True)
        # needs_input_grad follows requires_grad, not the caller's grad mode (forward always
        # runs without grad): under no_grad (validation) a Parameter weight still says True
        need_x, need_w, need_b = (need and grad_enabled for need in ctx.needs_input_grad[:3])
        need_b = need_b and bias is not None
        buf = _buffers(pairs, weight.size(0), need_x, need_w, need_b, chunk_rows)
        weight_t = weight.t()
        for start in range(0, pairs.size(1), chunk_rows):
            end = min(pairs.size(1), start + chunk_rows)
            block = buf.rows[start:end]
            x = block[..., :buf.dim].reshape(2 * (end - start), buf.dim)  # rows of stride width
            logits = torch.mm(x, weight_t) if bias is None else torch.addmm(bias, x, weight_t)
            scores = logits.view(end - start, 2, -1).transpose(0, 1)  # (2, r, V): pass 1, 2
            if predictions is not None:
                torch.argmax(scores, -1, out=predictions[:, start:end])
            # their statistics, and their gradient over them (fp16: scaled per row pair)
            run_rows(impl, scores, target[start:end], kept[start:end], from_logits=True,
                     need_grad=buf.need_grad, out=scores, stats=buf.stats[:, start:end],
                     fp16_target_max=FP16_PRODUCT_TARGET_MAX, chunk_rows=buf.core_rows, **coef)
            if buf.need_grad:  # logits now hold their gradient
                _gradient_products(buf, logits, block, weight, kept, start, end)
        ctx.layout = (need_x, need_w, need_b, buf.dim, pairs.dtype, weight.dtype,
                      None if bias is None else bias.dtype)
        return finish_forward(ctx, (buf.grad_rows, buf.grad_wb), buf.stats, kept, coef,
                              alpha, True, impl)

    @staticmethod
    def backward(ctx, g_total, *unused):
        grad_rows, grad_wb = saved_grads(ctx, "fused_linear_rdrop_loss")
        need_x, need_w, need_b, dim, x_dtype, w_dtype, b_dtype = ctx.layout
        grad_x = _times(grad_rows.transpose(0, 1), g_total, x_dtype) if need_x else None
        grad_w = _times(grad_wb[:, :dim], g_total, w_dtype) if need_w else None
        grad_b = _times(grad_wb[:, dim], g_total, b_dtype) if need_b else None
        return grad_x, grad_w, grad_b, None, None, None, None, None, None, None, None


def _buffers(pairs, vocab, need_x, need_w, need_b, chunk_rows):
    """The call's :data:`_Buffers`, the features copied once into their rows."""
    n, dim = pairs.size(1), pairs.size(2)
    need_grad = need_x or need_w or need_b
    acc, device = compute_dtype(pairs), pairs.device
    # (N, 2, width): a chunk's rows are one block; a column of ones for the bias
    width = dim + need_b
    rows = torch.empty((n, 2, width), dtype=pairs.dtype, device=device)
    rows[..., :dim] = pairs.transpose(0, 1)
    if need_b:
        rows[..., dim] = 1
    grad_rows = torch.empty((n, 2, dim), dtype=pairs.dtype, device=device) if need_x else None
    # the weight's gradient, and the bias's as its last column
    grad_wb = torch.zeros((vocab, width), dtype=acc, device=device) if need_w or need_b else None
    zero = torch.zeros((), dtype=pairs.dtype, device=device)
    stats = torch.empty((5, n), dtype=acc, device=device)
    # the torch implementation's own chunk within a block: a block is sized for the products
    # with the weight (at least MIN_AUTO_PAIRS pairs), the torch ops' ~30 passes over a
    # chunk for the cache
    core_rows = min(chunk_rows, chunk_rows_for(vocab, pairs, 0.0, need_grad))
    scaled = need_grad and pairs.dtype == torch.float16  # the gradient's per-row scale
    return _Buffers(rows, grad_rows, grad_wb, stats, zero, dim, scaled, need_grad, core_rows)


def _gradient_products(buf, g, block, weight, kept, start, end):
    """A chunk's share of the gradients from its logits' gradient ``g`` (2r, V): the
    features' rows (``g @ W``) and the weight's and bias's sums (``g^T @ rows``), in the
    model's dtype; a scaled fp16 ``g`` is unscaled on the small results."""
    r, dim = end - start, buf.dim
    alpha_w = 1.0
    if buf.scaled:  # the true gradient is g times stats[4] per row pair (0: excluded)
        factor = torch.where(kept[start:end], buf.stats[4, start:end], 0).view(r, 1, 1)
    if buf.grad_rows is not None:
        out = buf.grad_rows[start:end]
        if buf.scaled:
            product = _float32_out(torch.mm, g, weight)
            product = torch.mm(g, weight) if product is None else product
            torch.mul(product.view(r, 2, dim), factor, out=out)
        else:
            torch.mm(g, weight, out=out.view(2 * r, dim))
    if buf.grad_wb is not None:
        xs = block.view(2 * r, block.size(-1))
        if buf.scaled:  # the scale goes into the rows, times 2**k that alpha removes
            xs = torch.mul(block, factor * FP16_PRODUCT_TARGET_MAX,
                           out=torch.empty_like(block)).view(2 * r, block.size(-1))
            alpha_w = 1.0 / FP16_PRODUCT_TARGET_MAX
        _add_product(buf.grad_wb, g.t(), xs, alpha_w, buf.zero)


def _times(grad, g_total, dtype):
    """``grad * g_total`` in ``dtype``, contiguous: in place where ``grad`` already is."""
    if grad.dtype == dtype and grad.is_contiguous():
        return grad.mul_(g_total)
    return torch.mul(grad, g_total, out=torch.empty(grad.shape, dtype=dtype, device=grad.device))
