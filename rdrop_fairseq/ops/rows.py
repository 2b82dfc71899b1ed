"""The contract of R-Drop's row-pair computation, shared by its two implementations and
their callers.

A *row pair* is one position seen by both passes: row ``i`` of ``pairs[0]`` (pass 1) and of
``pairs[1]`` (pass 2), ``pairs`` being ``(2, N, V)`` scores (logits, or log-probabilities).
An implementation (:func:`~rdrop_fairseq.ops.rows_torch.rows_torch`, chunked torch ops;
:func:`~rdrop_fairseq.ops.rows_triton.rdrop_rows_triton`, one Triton launch), called
through :func:`~rdrop_fairseq.ops.impl.run_rows` with one signature, takes

* the pairs, one class id per position (:func:`target_ids`) and the positions that count
  (:func:`kept_rows`, a ``(N,)`` bool);
* the scalars of the loss (:func:`coefficients`): ``c1`` on the NLL, ``eps_i`` on the
  smoothing sum, ``h = alpha / 2`` on each KL direction, ``pcoef`` on ``p`` in the
  gradient from logits;

and returns the gradient of ``c1 * nll + eps_i * smooth + h * (KL(pa||pb) + KL(pb||pa))``
with respect to the pairs (in their dtype; float16 scaled per row pair so that its largest
entry is near :data:`FP16_TARGET_MAX`) and the statistics ``(5, N)`` in the compute dtype
(:func:`compute_dtype`): rows nll, smooth, KL(pa||pb), KL(pb||pa) per row pair, and the
factor that undoes the gradient's storage scale. :func:`combine_rows` turns those into the
loss; :func:`chunk_rows_for` sizes the torch implementation's chunks.
"""

import torch

from ..options import non_negative

__all__ = ["AUTO_CHUNK_MB", "FP16_TARGET_MAX", "RDropBatchError", "coefficients",
           "compute_dtype", "kept_rows", "target_ids", "combine_rows", "finish_forward",
           "saved_grads", "chunk_rows_for", "chunk_budget_mb", "chunk_bytes_per_pair"]

# Default bound on one chunk's temporaries (--rdrop-chunk-mb 0). On CPU, a chunk that stays
# in the caches is fastest (measured on CPU: benchmarks/bench_rdrop.py, docs/benchmarks.md).
# The CUDA value is not measured on a GPU yet: large chunks mean few kernel launches.
AUTO_CHUNK_MB = {"cuda": 256.0, "cpu": 16.0}

# fp16 gradients are stored scaled by a power of two per row pair, chosen so that the
# row's largest entry lands near this value: the bulk of a softmax gradient (~1/V) would
# otherwise be fp16 subnormals. The backward undoes the scale exactly.
FP16_TARGET_MAX = 2.0 ** 14


class RDropBatchError(ValueError):
    """A batch cannot be duplicated for the two R-Drop passes, or its parts do not fit."""


def compute_dtype(x):
    """The dtype the statistics are computed in: float32, or float64 for float64 inputs."""
    return torch.promote_types(x.dtype, torch.float32)


def coefficients(vocab, epsilon, alpha, has_target, from_logits):
    """The scalars of the per-row gradient formula (:func:`~rdrop_fairseq.ops.rows_torch.
    rows_torch` derives it): fairseq's label smoothing ``epsilon`` spread as ``eps_i`` on
    each class and ``c1`` on the target; ``pcoef`` the coefficient of ``p`` from logits."""
    eps_i = epsilon / (vocab - 1) if vocab > 1 and has_target else 0.0
    c1 = 1.0 - epsilon - eps_i if has_target else 0.0
    pcoef = c1 + eps_i * vocab if from_logits else 0.0
    return {"pcoef": pcoef, "h": 0.5 * alpha, "eps_i": eps_i, "c1": c1}


def kept_rows(target, ignore_index, keep, n, pairs):
    """True for a position that counts, False for padding / excluded ones: (N,) bool on the
    device of ``pairs``. ``target`` and ``keep`` are one pass's (``n`` positions)."""
    if target is not None and target.numel() != n:
        raise RDropBatchError(
            f"target has {target.numel()} positions, but each pass of scores has {n}: pass "
            "the target of one pass (both passes share it)"
        )
    if keep is not None and keep.numel() != n:
        raise RDropBatchError(f"keep has {keep.numel()} positions, expected {n} (one pass)")
    mask = None
    if target is not None and ignore_index is not None:
        mask = target.reshape(-1).ne(ignore_index)
    if keep is not None:
        keep = keep.reshape(-1).bool()
        mask = keep if mask is None else mask & keep
    if mask is None:
        return torch.ones(n, dtype=torch.bool, device=pairs.device)
    return mask


def target_ids(target, kept, impl):
    """``target`` flattened; for the torch implementation, class 0 where a row is excluded
    (its id may be anything, -100 or 1e9, and gather would read it). The Triton kernel
    never reads an excluded row's id: no op for it."""
    target = target.reshape(-1)
    return torch.where(kept, target, 0) if impl == "torch" else target


def combine_rows(stats, kept, coef, alpha, has_target, impl="torch"):
    """``(total, loss, nll, kl)`` from the per-row statistics ``stats`` (rows nll, smooth,
    KL(p||q), KL(q||p)): excluded rows masked out (whatever they hold; the Triton kernel
    writes 0 there already), summed in the stats' dtype; a zero coefficient never meets an
    inf (0 * inf = nan). Few ops: on a GPU each is a launch."""
    sums = stats[:4] if impl == "triton" else torch.where(kept, stats[:4], 0)
    nll, smooth, kl_pq, kl_qp = sums.sum(1).unbind()
    c1, eps_i = coef["c1"], coef["eps_i"]
    if not has_target:
        loss = nll = torch.zeros_like(kl_pq)
    elif c1 and eps_i:
        loss = torch.add(c1 * nll, smooth, alpha=eps_i)
    else:
        loss = c1 * nll if c1 else eps_i * smooth if eps_i else torch.zeros_like(nll)
    kl = torch.add(kl_pq, kl_qp).mul_(0.5)
    total = torch.add(loss, kl, alpha=alpha) if alpha else loss.clone()  # inf KL x 0 = nan
    return total, loss, nll, kl


def finish_forward(ctx, saved, stats, kept, coef, alpha, has_target, impl):
    """The end of a fused loss's forward: ``(total, loss, nll, kl)`` from ``stats``
    (:func:`combine_rows`), ``saved`` (the gradients computed in the forward) kept for the
    one backward (:func:`saved_grads`), and the logged outputs non-differentiable."""
    total, loss, nll, kl = combine_rows(stats, kept, coef, alpha, has_target, impl)
    ctx.saved_grads = saved
    ctx.mark_non_differentiable(loss, nll, kl)
    ctx.set_materialize_grads(False)  # no zeros made for the logged outputs' gradients
    return total, loss, nll, kl


def saved_grads(ctx, what):
    """What :func:`finish_forward` kept, taken once: the backward scales it in place, so a
    second backward through the same graph raises, naming ``what``."""
    saved = getattr(ctx, "saved_grads", None)
    if saved is None:
        raise RuntimeError(f"{what} supports one backward per forward: its backward scales, "
                           "in place, the gradient kept from the forward (no retain_graph "
                           "reuse)")
    del ctx.saved_grads
    return saved


def chunk_rows_for(vocab, scores, chunk_mb=0.0, need_grad=True):
    """Row pairs per chunk of the torch implementation for a ``chunk_mb`` MiB budget.

    A chunk of ``r`` row pairs holds the log-probabilities of both passes (``2 r x V`` in
    the compute dtype, float32 or float64) and their probabilities, which live in the
    gradient's buffer where that has the compute dtype (scores in it, with ``need_grad``)
    and take ``2 r x V`` more otherwise (fp16/bf16 scores, or no gradient: under
    ``torch.no_grad``).
    """
    chunk_mb = chunk_budget_mb(chunk_mb, scores)
    in_place = need_grad and scores.dtype == compute_dtype(scores)
    return max(1, int(chunk_mb * 2**20) // chunk_bytes_per_pair(vocab, scores.dtype, in_place))


def chunk_budget_mb(chunk_mb, tensor):
    """``chunk_mb`` checked (finite, >= 0), or the automatic budget for ``tensor``'s device
    where it is 0."""
    chunk_mb = non_negative(chunk_mb, "chunk_mb", " (0 = automatic)")
    return chunk_mb or AUTO_CHUNK_MB["cuda" if tensor.is_cuda else "cpu"]


def chunk_bytes_per_pair(vocab, dtype, probs_in_place):
    """Bytes of the torch implementation's temporaries per row pair of a chunk: the
    log-probabilities, and the probabilities unless they live in a buffer of the caller's
    (``probs_in_place``), each ``2 x V`` in the compute dtype of ``dtype``."""
    compute = torch.promote_types(dtype, torch.float32)
    return (2 if probs_in_place else 4) * vocab * compute.itemsize
