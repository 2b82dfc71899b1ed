"""Framework-free core of R-Drop: batch duplication and the fused loss.

Only torch is needed here; the fairseq criteria in ``rdrop_fairseq.criterions`` are thin
layers over these functions.

Conventions: a batch of ``B`` examples is duplicated along dim 0 into ``[x; x]`` (``2B``
rows), so after the forward pass rows ``[0, B)`` are pass 1 and rows ``[B, 2B)`` pass 2.
All reductions are sums (fairseq normalises by the sample size afterwards), computed in
float32 at least (float64 inputs stay float64), whatever the dtype of the model.

The fused loss (:func:`rdrop_loss`) is written for GPUs first: no host-device
synchronisation (padding is masked with ``torch.where``, never selected), a number of
chunks that depends on shapes only, and no float32 temporary larger than one chunk: the
logits' gradient is computed during the forward, in the logits' own dtype, and the backward
only scales it. That gradient is the one ``2N x V`` tensor we allocate, in the scores'
dtype: for fp16/bf16 scores nothing ``2N x V`` is float32; for float32 scores the gradient
buffer *is* ``2N x V`` float32, unless ``grad_in_scores`` lets us write it into the scores'
own buffer. On CUDA a Triton kernel does the whole row-pair computation in one launch;
elsewhere a chunked torch implementation does the same; both are called through
:func:`rdrop_fairseq.ops.impl.run_rows` and share the contract :mod:`rdrop_fairseq.ops.rows`.
docs/design.md has the derivation and the memory accounting.
"""

from collections import namedtuple
from collections.abc import Mapping

import torch

from .ops.impl import run_rows, run_with_fallback
from .ops.rows import (RDropBatchError, chunk_rows_for, coefficients, compute_dtype,
                       finish_forward, kept_rows, saved_grads, target_ids)
from .options import non_negative

__all__ = [
    "RDropBatchError",
    "RDropLoss",
    "duplicate_net_input",
    "split_halves",
    "rdrop_loss",
    "symmetric_kl",
    "mse_consistency",
    "chunk_rows_for",
    "check_alpha_epsilon",
]

# grad_fn of scores whose op keeps no copy of its output for its backward (a linear layer:
# it saves its inputs; an added bias, as BART's and Marian's final_logits_bias: it saves
# nothing), and of views, which are followed to their base: the gradient may be written
# into such scores (grad_in_scores="auto"). Anything else keeps a buffer of its own.
_OUTPUT_NOT_SAVED = ("MmBackward0", "AddmmBackward0", "BmmBackward0", "AddBackward0")
_VIEWS = ("ViewBackward0", "UnsafeViewBackward0", "ReshapeAliasBackward0")

# Values in ``net_input`` that configure the forward pass rather than carry examples.
_PASSTHROUGH_TYPES = (type(None), bool, int, float, str)

RDropLoss = namedtuple("RDropLoss", "total loss nll kl")
RDropLoss.__doc__ = """Result of :func:`rdrop_loss`; every field is a sum over kept rows.

``total`` (differentiable) = ``loss + alpha * kl``; ``loss`` = label-smoothed NLL of both
passes, ``nll`` = plain NLL of both passes, ``kl`` = ``1/2 (KL(P1||P2) + KL(P2||P1))``
(these three are detached, for logging)."""


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


def rdrop_loss(scores, target=None, *, alpha=0.0, epsilon=0.0, ignore_index=None, keep=None,
               log_probs=False, chunk_mb=0.0, impl="auto", grad_in_scores=False):
    """Task loss of both passes plus ``alpha`` times their symmetric KL, fused.

    Args:
        scores: ``(2B, ..., V)`` output of the duplicated batch, pass 1 then pass 2 along
            dim 0: logits (the default; the distribution is their softmax) or, with
            ``log_probs=True``, log-probabilities (any normalisation, e.g. an adaptive
            softmax). fp16, bf16, fp32 or fp64.
        target: ``(B, ...)`` class indices of *one* pass (both passes share it), or
            ``None`` for the KL alone.
        alpha: weight of the KL in ``total``, ``>= 0``.
        epsilon: label smoothing in ``[0, 1]``, as fairseq's ``label_smoothed_nll_loss``
            (0 = plain NLL).
        ignore_index: padding index; positions whose target equals it count nowhere. It
            may lie outside ``[0, V)`` (PyTorch's -100).
        keep: optional boolean ``(B, ...)`` mask, False for further excluded positions
            (e.g. an ignored prefix). Excluded rows are masked, not weighted by 0: any
            value there (inf, nan) reaches neither the loss nor the gradient, which is 0.
        chunk_mb: bound on one chunk's float32 temporaries in the torch implementation, in
            MiB; 0 = automatic (:data:`~rdrop_fairseq.ops.rows.AUTO_CHUNK_MB`).
        impl: ``"torch"``, ``"triton"`` (CUDA tensors, or CPU tensors under
            ``TRITON_INTERPRET=1``) or ``"auto"`` (triton on CUDA when importable; where
            it is not, or the kernel fails on that GPU, a warning, once per device, and
            the torch implementation from then on).
        grad_in_scores: write the gradient into the buffer of ``scores`` (overwriting
            them: the caller must not read them afterwards) instead of a buffer of its
            own. ``"auto"``: only where that is safe, i.e. ``scores`` come (through views)
            from a matrix product, which keeps no copy of its output for its backward;
            ``True``: whenever ``scores`` are a non-leaf. The write is an in-place op seen
            by autograd (the version counter moves), so a producer that did save its output
            makes autograd raise rather than return a wrong gradient. Default False.

    Returns :data:`RDropLoss` ``(total, loss, nll, kl)``, float32 (float64 for float64
    scores) scalars, also under autocast (the whole computation runs outside it). A class
    that one pass rules out (-inf) and the other does not makes that row pair's KL +inf:
    ``kl`` and ``total`` are +inf, and with ``alpha > 0`` that row pair's gradient is nan
    (docs/design.md); a class both passes rule out adds nothing.

    Only ``total`` is differentiable, and only once: its backward scales, in place, the
    gradient computed during the forward (so a second backward through the same graph
    raises). Nothing of size ``2B x ... x V`` is allocated but that gradient, in the
    dtype of ``scores`` (so float32 for float32 scores), and not even that when it goes
    into ``scores``; the halves are not compared (the caller built ``[x; x]``).
    """
    alpha = check_alpha_epsilon(alpha, epsilon)
    if scores.dim() < 2 or scores.size(0) % 2:
        raise RDropBatchError(
            "scores must be (2B, ..., V) with both passes stacked along dim 0, got shape "
            f"{tuple(scores.shape)}"
        )
    vocab = scores.size(-1)
    pairs = scores.reshape(2, -1, vocab)  # a view for the usual contiguous model output
    n = pairs.size(1)
    if pairs.stride(-1) != 1:
        pairs = pairs.contiguous()
    kept = kept_rows(target, ignore_index, keep, n, pairs)
    into_scores = _grad_into_scores(grad_in_scores, scores, pairs)
    if not torch.is_grad_enabled():  # needs_input_grad follows requires_grad, not no_grad
        pairs = pairs.detach()

    def run(impl):
        ids = target_ids(target, kept, impl) if target is not None else None
        need_grad = torch.is_grad_enabled() and scores.requires_grad
        chunk_rows = chunk_rows_for(vocab, scores, chunk_mb, need_grad) if impl == "torch" else 0
        # fairseq's --amp calls the criterion under autocast, which would run sums in fp16
        with torch.autocast(scores.device.type, enabled=False):
            return RDropLoss(*_FusedRDrop.apply(
                pairs, ids, kept, alpha, float(epsilon), bool(log_probs), impl, chunk_rows,
                into_scores,
            ))

    return run_with_fallback(impl, scores, run)


def symmetric_kl(scores, keep=None, log_probs=True, **kwargs):
    """``1/2 (KL(P1||P2) + KL(P2||P1))`` summed over positions, differentiable.

    ``scores`` is ``(2B, ..., V)``, pass 1 then pass 2 (log-probabilities by default, or
    logits with ``log_probs=False``); ``keep`` an optional boolean mask over one pass's
    positions ``(B, ...)``. Other keyword arguments go to :func:`rdrop_loss`.
    """
    return rdrop_loss(scores, None, alpha=1.0, keep=keep, log_probs=log_probs, **kwargs).total


def mse_consistency(predictions):
    """Regression consistency: ``sum((y1 - y2)^2)`` between the two halves (>= float32)."""
    y1, y2 = split_halves(predictions.to(compute_dtype(predictions)))
    return (y1 - y2).pow(2).sum()


def check_alpha_epsilon(alpha, epsilon):
    """``alpha`` as a float, after checking it (finite, >= 0) and ``epsilon`` (in [0, 1])."""
    alpha = non_negative(alpha, "alpha")
    if not 0.0 <= epsilon <= 1.0:
        raise ValueError(f"epsilon (label smoothing) must be in [0, 1], got {epsilon}")
    return alpha


def _grad_into_scores(grad_in_scores, scores, pairs):
    """Whether the gradient may go into the buffer of ``scores`` (``pairs`` is a view)."""
    if grad_in_scores not in (False, True, "auto"):
        raise ValueError(f"grad_in_scores must be False, True or 'auto', got {grad_in_scores!r}")
    if not grad_in_scores or scores.grad_fn is None or pairs.data_ptr() != scores.data_ptr():
        return False  # no graph, a leaf, or pairs is a contiguous copy already
    if grad_in_scores is True:
        return True
    fn = scores.grad_fn
    while type(fn).__name__ in _VIEWS:
        fn = fn.next_functions[0][0]
    return type(fn).__name__ in _OUTPUT_NOT_SAVED


class _FusedRDrop(torch.autograd.Function):
    """Row-pair statistics and the scores' gradient in the forward; a scale in the backward."""

    @staticmethod
    def forward(ctx, pairs, target, kept, alpha, epsilon, log_probs, impl, chunk_rows,
                into_scores):
        n, vocab = pairs.size(1), pairs.size(2)
        coef = coefficients(vocab, epsilon, alpha, target is not None, not log_probs)
        # the KL-only case has no target: read class 0
        t = target if target is not None else torch.zeros(n, dtype=torch.long, device=pairs.device)
        need_grad = ctx.needs_input_grad[0]  # False under no_grad (rdrop_loss detaches there)
        out = pairs if need_grad and into_scores else None
        grad, stats = run_rows(impl, pairs, t, kept, from_logits=not log_probs,
                               need_grad=need_grad, out=out, chunk_rows=chunk_rows, **coef)
        # fp16 gradients are stored scaled per row pair (0 for an excluded row, whose stored
        # factor may be nan); in other dtypes the factor is 1 and the backward a scalar's
        ctx.row_factor = (torch.where(kept, stats[4], 0)
                          if need_grad and pairs.dtype == torch.float16 else None)
        # stats rows: nll, smooth, kl_pq, kl_qp (per row pair), then the gradient's scale
        return finish_forward(ctx, grad, stats, kept, coef, alpha, target is not None, impl)

    @staticmethod
    def backward(ctx, g_total, *unused):
        grad = saved_grads(ctx, "rdrop_loss")
        if ctx.row_factor is not None:
            g_total = (g_total * ctx.row_factor).view(1, -1, 1)
        return grad.mul_(g_total), None, None, None, None, None, None, None, None
