"""Framework-free core of R-Drop: batch duplication and the consistency terms.

Only torch is needed here; the fairseq criteria in ``rdrop_fairseq.criterions`` are thin
layers over these functions.

Conventions: a batch of ``B`` examples is duplicated along dim 0 into ``[x; x]`` (``2B``
rows), so after the forward pass rows ``[0, B)`` are pass 1 and rows ``[B, 2B)`` pass 2.
All reductions are sums (fairseq normalises by the sample size afterwards), and every
divergence is computed in float32 at least (float64 inputs stay float64), whatever the
dtype of the model.
"""

from collections.abc import Mapping

import torch

__all__ = [
    "RDropBatchError",
    "duplicate_net_input",
    "split_halves",
    "rdrop_nll_loss",
    "symmetric_kl",
    "mse_consistency",
]

# Elements of one row chunk in the fused loss. Large enough to amortise Python overhead,
# small enough that a chunk's handful of temporaries stays near the CPU caches.
DEFAULT_CHUNK_ELEMENTS = 1 << 17

# Values in ``net_input`` that configure the forward pass rather than carry examples.
_PASSTHROUGH_TYPES = (type(None), bool, int, float, str)


class RDropBatchError(ValueError):
    """A batch cannot be duplicated for the two R-Drop passes."""


def duplicate_net_input(net_input, batch_size, _path="net_input"):
    """Return a new ``net_input`` whose per-example tensors are repeated as ``[x; x]``.

    Every tensor must have ``batch_size`` rows in dim 0. Nested mappings are followed;
    ``None``, booleans, numbers and strings (forward-pass options) are passed through.
    Anything else raises :class:`RDropBatchError` naming the key, because repeating it
    blindly could silently pair the wrong examples. The caller's mapping is not modified.
    """
    if not isinstance(net_input, Mapping):
        raise RDropBatchError(f"{_path} must be a mapping, got {type(net_input).__name__}")
    out = {}
    for key, value in net_input.items():
        path = f"{_path}[{key!r}]"
        if torch.is_tensor(value):
            if value.dim() == 0 or value.size(0) != batch_size:
                shape = tuple(value.shape)
                raise RDropBatchError(
                    f"cannot duplicate {path}: R-Drop repeats every tensor of net_input "
                    f"along dim 0, which must be the batch dimension ({batch_size}), but "
                    f"this tensor has shape {shape}"
                )
            out[key] = torch.cat([value, value], dim=0)
        elif isinstance(value, Mapping):
            out[key] = duplicate_net_input(value, batch_size, _path=path)
        elif isinstance(value, _PASSTHROUGH_TYPES):
            out[key] = value
        else:
            raise RDropBatchError(
                f"cannot duplicate {path} of type {type(value).__name__}: R-Drop only "
                "knows how to repeat tensors (batch in dim 0) and nested dicts of them"
            )
    return out


def split_halves(x):
    """Split a duplicated-batch output ``[y1; y2]`` into ``(y1, y2)`` (views, no copy)."""
    if x.size(0) % 2:
        raise RDropBatchError(
            f"expected an output of a duplicated batch (even dim 0), got shape {tuple(x.shape)}"
        )
    return x.chunk(2, dim=0)


def rdrop_nll_loss(lprobs, target=None, epsilon=0.0, ignore_index=None,
                   chunk_elements=DEFAULT_CHUNK_ELEMENTS):
    """Task loss of both passes and their symmetric KL, fused, from log-probabilities.

    Args:
        lprobs: ``(2N, V)`` log-probabilities, rows ``[0, N)`` pass 1, ``[N, 2N)`` pass 2.
        target: ``(2N,)`` class indices (the same for both halves), or ``None`` for the KL
            alone (then every row is used).
        epsilon: label smoothing, as in fairseq's ``label_smoothed_nll_loss`` (0 = plain NLL).
        ignore_index: padding index; rows whose target equals it are excluded from both the
            task loss and the KL.

    Returns ``(loss, nll_loss, kl)``, float32 scalars summed over rows:
        ``loss`` - label-smoothed NLL of both passes (equals fairseq's on the same rows),
        ``nll_loss`` - plain NLL of both passes,
        ``kl`` - ``1/2 * (KL(P1||P2) + KL(P2||P1))`` summed over the non-padding positions.

    Nothing of size ``2N x V`` is allocated but the gradient itself: rows are processed in
    chunks, padding rows are skipped, and the backward pass recomputes the probabilities
    and uses the closed-form gradient of the symmetric KL (see docs/design.md).
    """
    if lprobs.dim() != 2 or lprobs.size(0) % 2:
        raise RDropBatchError(
            f"lprobs must be (2N, V) with both passes stacked, got shape {tuple(lprobs.shape)}"
        )
    n = lprobs.size(0) // 2
    if target is not None:
        target = target.reshape(-1)
        if target.numel() != 2 * n:
            raise RDropBatchError(
                f"target has {target.numel()} entries, lprobs has {2 * n} rows"
            )
        if not torch.equal(target[:n], target[n:]):
            raise RDropBatchError("the two halves of the target differ: not a duplicated batch")
        keep = target[:n] != ignore_index if ignore_index is not None else None
    else:
        keep = None
    rows = keep.nonzero().squeeze(1) if keep is not None else torch.arange(n, device=lprobs.device)
    chunk_rows = max(1, chunk_elements // max(1, lprobs.size(1)))
    return _RDropNLLLoss.apply(lprobs, target, rows, float(epsilon), chunk_rows)


def symmetric_kl(lprobs, keep=None, chunk_elements=DEFAULT_CHUNK_ELEMENTS):
    """``1/2 * (KL(P1||P2) + KL(P2||P1))`` summed over rows, from stacked log-probabilities.

    ``lprobs`` is ``(2N, ..., V)`` (pass 1 then pass 2 along dim 0); ``keep`` is an optional
    boolean mask over the first half's positions (``(N, ...)``), False for padding.
    """
    if lprobs.size(0) % 2:
        raise RDropBatchError(
            f"lprobs must stack both passes along dim 0, got shape {tuple(lprobs.shape)}"
        )
    flat = lprobs.reshape(-1, lprobs.size(-1))
    n = flat.size(0) // 2
    if keep is None:
        rows = torch.arange(n, device=flat.device)
    else:
        if keep.numel() != n:
            raise RDropBatchError(f"keep mask has {keep.numel()} entries, expected {n}")
        rows = keep.reshape(-1).nonzero().squeeze(1)
    chunk_rows = max(1, chunk_elements // max(1, flat.size(1)))
    return _RDropNLLLoss.apply(flat, None, rows, 0.0, chunk_rows)[2]


def mse_consistency(predictions):
    """Regression consistency: ``sum((y1 - y2)^2)`` between the two halves (>= float32)."""
    y1, y2 = split_halves(predictions.to(_compute_dtype(predictions)))
    return (y1 - y2).pow(2).sum()


def _log_ratio(a, b):
    # -inf - -inf (a class both passes rule out) is nan; its KL contribution is 0
    return (a - b).nan_to_num_(nan=0.0, posinf=float("inf"), neginf=float("-inf"))


def _compute_dtype(x):
    return torch.promote_types(x.dtype, torch.float32)


class _RDropNLLLoss(torch.autograd.Function):
    """Fused label-smoothed NLL of both passes + symmetric KL, chunked over kept rows."""

    @staticmethod
    def forward(ctx, lprobs, target, rows, epsilon, chunk_rows):
        n, vocab = lprobs.size(0) // 2, lprobs.size(1)
        eps_i = epsilon / (vocab - 1) if vocab > 1 else 0.0
        dtype = _compute_dtype(lprobs)
        acc = torch.zeros(3, dtype=torch.float64, device=lprobs.device)  # nll, smooth, kl
        for start in range(0, rows.numel(), chunk_rows):
            r = rows[start:start + chunk_rows]
            a = lprobs.index_select(0, r).to(dtype)
            b = lprobs.index_select(0, r + n).to(dtype)
            if target is not None:
                t = target.index_select(0, r).unsqueeze(1)
                acc[0] -= (a.gather(1, t) + b.gather(1, t)).sum(dtype=torch.float64)
                if epsilon:
                    acc[1] -= a.sum(dtype=torch.float64) + b.sum(dtype=torch.float64)
            diff = _log_ratio(a, b)
            acc[2] += torch.dot(a.exp_().sub_(b.exp_()).view(-1), diff.view(-1)).double()
        nll, smooth, kl = acc.to(dtype).unbind()
        loss = (1.0 - epsilon - eps_i) * nll + eps_i * smooth
        ctx.save_for_backward(lprobs, target, rows)
        ctx.epsilon, ctx.eps_i, ctx.chunk_rows = epsilon, eps_i, chunk_rows
        return loss, nll, 0.5 * kl

    @staticmethod
    def backward(ctx, g_loss, g_nll, g_kl):
        lprobs, target, rows = ctx.saved_tensors
        n = lprobs.size(0) // 2
        dtype = _compute_dtype(lprobs)
        half_kl = 0.5 * g_kl.to(dtype)
        at_target = -((1.0 - ctx.epsilon - ctx.eps_i) * g_loss.to(dtype) + g_nll.to(dtype))
        smooth = ctx.eps_i * g_loss.to(dtype)
        grad = torch.zeros_like(lprobs)
        for start in range(0, rows.numel(), ctx.chunk_rows):
            r = rows[start:start + ctx.chunk_rows]
            a = lprobs.index_select(0, r).to(dtype)
            b = lprobs.index_select(0, r + n).to(dtype)
            # d/d(log p) of 1/2 sum (p - q)(log p - log q) is 1/2 [p (log p - log q) + p - q]
            diff = _log_ratio(a, b)
            pa = a.exp_().mul_(half_kl)
            pb = b.exp_().mul_(half_kl)
            ga = (diff + 1).mul_(pa).sub_(pb)
            gb = diff.neg_().add_(1).mul_(pb).sub_(pa)
            if target is not None:
                if ctx.eps_i:
                    ga -= smooth
                    gb -= smooth
                t = target.index_select(0, r).unsqueeze(1)
                src = at_target.expand(t.shape)
                ga.scatter_add_(1, t, src)
                gb.scatter_add_(1, t, src)
            grad.index_copy_(0, r, ga.to(grad.dtype))
            grad.index_copy_(0, r + n, gb.to(grad.dtype))
        return grad, None, None, None, None
