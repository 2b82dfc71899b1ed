"""R-Drop's loss from the decoder's features and output projection, without the logits.

:func:`fused_linear_rdrop_loss` computes what :func:`rdrop_fairseq.core.rdrop_loss`
computes from ``logits = features @ weight.T (+ bias)``, a chunk of row *pairs* at a time
(pass 1 and pass 2 of the same position together, as the KL needs): the chunk's logits,
their row statistics and gradient (:func:`rdrop_fairseq.core._rows_torch`), then at once
the features' gradient and the chunk's share of the weight's and bias's gradient. So the
``2N x V`` logits, their float32 upcast and their gradient never exist: the largest
tensors are one chunk's (``--rdrop-chunk-mb``) and the ``V x d`` weight gradient. As in
the core, everything is computed in the forward and the backward only scales by the
incoming gradient (one backward per forward).

Precision: the matmuls run in the model's dtype (the BLAS); row statistics, the loss and
the weight/bias gradients are accumulated in float32 (float64 for float64 models). For
fp16 the logits' gradient is stored scaled per row pair as in the core; the weight
gradient's product then runs on the unscaled float32 chunk, which costs one float32
chunk-sized temporary.
"""

import torch
import torch.nn.functional as F

from .core import (
    RDropBatchError,
    RDropLoss,
    _coefficients,
    _compute_dtype,
    _kept_rows,
    _rows_torch,
    check_alpha_epsilon,
    chunk_rows_for,
    combine_rows,
)


# With --rdrop-chunk-mb 0 (automatic), at least this many row pairs per chunk: every chunk
# reads the whole V x d weight twice and updates its V x d gradient, so small chunks make
# the path memory-bound (CPU, V = 267,744, d = 128: 8.8 s with 7-pair chunks of 16 MiB,
# 5.5 s with 64-pair chunks, against 8.0 s for plain cross-entropy on the logits). The
# CUDA figure is a guess from the ratio of compute to memory bandwidth, not measured.
MIN_AUTO_PAIRS = {"cpu": 64, "cuda": 256}


def fused_linear_rdrop_loss(features, weight, target, *, bias=None, alpha=0.0, epsilon=0.0,
                            ignore_index=None, keep=None, chunk_mb=0.0, predictions=None):
    """Task loss of both passes plus ``alpha`` times their symmetric KL, from the features.

    Args:
        features: ``(2B, ..., d)``, pass 1 then pass 2 along dim 0 (the decoder's output
            with ``features_only=True``), in the model's dtype.
        weight: ``(V, d)`` output projection (tied with the embedding or not); ``bias``
            ``(V,)`` or None.
        target, epsilon, ignore_index, keep, alpha, chunk_mb: as :func:`core.rdrop_loss`
            (``target`` of one pass, ``(B, ...)``). With ``chunk_mb`` 0, a chunk also has
            at least :data:`MIN_AUTO_PAIRS` row pairs; an explicit budget is kept exactly.
        predictions: optional ``(2, B*...)`` long tensor that receives each row's argmax
            (for ``--report-accuracy``), taken before the logits become the gradient.

    Returns :data:`core.RDropLoss` ``(total, loss, nll, kl)``; ``total`` is differentiable
    with respect to ``features``, ``weight`` and ``bias``.
    """
    alpha = check_alpha_epsilon(alpha, epsilon)
    if features.dim() < 2 or features.size(0) % 2:
        raise RDropBatchError("features must be (2B, ..., d) with both passes stacked along "
                              f"dim 0, got shape {tuple(features.shape)}")
    if weight.dim() != 2 or weight.size(1) != features.size(-1):
        raise ValueError(f"weight must be (V, {features.size(-1)}), got {tuple(weight.shape)}")
    pairs = features.reshape(2, -1, features.size(-1))
    n, vocab = pairs.size(1), weight.size(0)
    kept = _kept_rows(target, ignore_index, keep, n, pairs)
    target = torch.where(kept, target.reshape(-1), 0)  # excluded rows: any id
    # a chunk holds its logits (model dtype, becoming their gradient) + the core's
    # float32 temporaries + (fp16/bf16) the unscaled float32 gradient for the weight's
    logits_like = torch.empty((), dtype=features.dtype, device=features.device)
    rows = chunk_rows_for(vocab, logits_like, chunk_mb)
    if features.dtype != _compute_dtype(features):
        rows = max(1, rows * 4 // 5)
    if not chunk_mb:  # automatic: also amortise the weight's traffic over enough rows
        rows = max(rows, MIN_AUTO_PAIRS["cuda" if features.is_cuda else "cpu"])
    with torch.autocast(features.device.type, enabled=False):
        total, loss, nll, kl = _FusedLinearRDrop.apply(
            pairs, weight, bias, target, kept, alpha, float(epsilon), rows, predictions,
            torch.is_grad_enabled())
    return RDropLoss(total, loss, nll, kl)


class _FusedLinearRDrop(torch.autograd.Function):
    @staticmethod
    def forward(ctx, pairs, weight, bias, target, kept, alpha, epsilon, chunk_rows,
                predictions, grad_enabled):
        n, dim = pairs.size(1), pairs.size(2)
        vocab = weight.size(0)
        coef = _coefficients(vocab, epsilon, alpha, True, True)
        # needs_input_grad follows requires_grad, not the caller's grad mode (forward always
        # runs without grad): under no_grad (validation) a Parameter weight still says True
        need_x, need_w, need_b = (need and grad_enabled for need in ctx.needs_input_grad[:3])
        need_b = need_b and bias is not None
        need_grad = need_x or need_w or need_b
        acc = _compute_dtype(pairs)
        device = pairs.device
        grad_x = torch.empty_like(pairs) if need_x else None
        grad_w = torch.zeros((vocab, dim), dtype=acc, device=device) if need_w else None
        grad_b = torch.zeros(vocab, dtype=acc, device=device) if need_b else None
        stats = torch.empty((5, n), dtype=acc, device=device)
        for start in range(0, n, chunk_rows):
            end = min(n, start + chunk_rows)
            x = pairs[:, start:end]
            logits = F.linear(x, weight, bias)  # (2, r, V), the model's dtype
            if predictions is not None:
                torch.argmax(logits, -1, out=predictions[:, start:end])
            g, chunk_stats = _rows_torch(logits, target[start:end], kept[start:end], True,
                                         end - start, need_grad, out=logits, **coef)
            stats[:, start:end] = chunk_stats
            if not need_grad:
                continue
            # the true gradient is g times the row's storage factor (0 for excluded rows)
            factor = torch.where(kept[start:end], chunk_stats[4], 0).view(1, -1, 1)
            if need_x:
                grad_x[:, start:end] = (torch.matmul(g, weight).to(acc) * factor)
            if need_w or need_b:
                g = g.to(acc).mul_(factor) if g.dtype != acc else g.mul_(factor)
                if need_w:
                    grad_w.addmm_(g.reshape(-1, vocab).t(), x.reshape(-1, dim).to(acc))
                if need_b:
                    grad_b += g.sum((0, 1))
        total, loss, nll, kl = combine_rows(stats, kept, coef, alpha, True)
        ctx.grads = (grad_x, grad_w, grad_b)
        ctx.dtypes = (pairs.dtype, weight.dtype, None if bias is None else bias.dtype)
        ctx.mark_non_differentiable(loss, nll, kl)
        return total, loss, nll, kl

    @staticmethod
    def backward(ctx, g_total, *unused):
        grads = getattr(ctx, "grads", None)
        if grads is None:
            raise RuntimeError("fused_linear_rdrop_loss supports one backward per forward")
        del ctx.grads
        out = []
        for grad, dtype in zip(grads, ctx.dtypes):
            out.append(None if grad is None else grad.mul_(g_total).to(dtype))
        return (*out, None, None, None, None, None, None, None)
