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
own buffer. On CUDA a Triton kernel does the whole row-pair computation in one launch
(:mod:`rdrop_fairseq.triton_kernel`); elsewhere a chunked torch implementation does the
same. docs/design.md has the derivation and the memory accounting.
"""

import math
import os
import warnings
from collections import namedtuple
from collections.abc import Mapping

import torch

__all__ = [
    "RDropBatchError",
    "RDropLoss",
    "duplicate_net_input",
    "split_halves",
    "rdrop_loss",
    "symmetric_kl",
    "mse_consistency",
    "chunk_rows_for",
]

IMPLS = ("auto", "torch", "triton")

# Default bound on one chunk's temporaries (--rdrop-chunk-mb 0). On CPU, a chunk that stays
# in the caches is fastest (measured on CPU: benchmarks/bench_rdrop.py, docs/benchmarks.md).
# The CUDA value is not measured on a GPU yet: large chunks mean few kernel launches.
AUTO_CHUNK_MB = {"cuda": 256.0, "cpu": 16.0}

# fp16 gradients are stored scaled by a power of two per row pair, chosen so that the
# row's largest entry lands near this value: the bulk of a softmax gradient (~1/V) would
# otherwise be fp16 subnormals. The backward undoes the scale exactly.
_FP16_TARGET_MAX = 2.0 ** 14

# grad_fn of scores whose op keeps no copy of its output for its backward (a linear layer:
# it saves its inputs; an added bias, as BART's and Marian's final_logits_bias: it saves
# nothing), and of views, which are followed to their base: the gradient may be written
# into such scores (grad_in_scores="auto"). Anything else keeps a buffer of its own.
_OUTPUT_NOT_SAVED = ("MmBackward0", "AddmmBackward0", "BmmBackward0", "AddBackward0")
_VIEWS = ("ViewBackward0", "UnsafeViewBackward0", "ReshapeAliasBackward0")

# Devices (e.g. "cuda:0") on which impl="auto" gave up the Triton kernel, and why: triton
# is not installed, or the kernel failed to compile or launch there (Triton's support starts
# at compute capability 8.0; a V100 is 7.0). The torch implementation computes the same loss.
_TRITON_GIVEN_UP = {}

# Values in ``net_input`` that configure the forward pass rather than carry examples.
_PASSTHROUGH_TYPES = (type(None), bool, int, float, str)

RDropLoss = namedtuple("RDropLoss", "total loss nll kl")
RDropLoss.__doc__ = """Result of :func:`rdrop_loss`; every field is a sum over kept rows.

``total`` (differentiable) = ``loss + alpha * kl``; ``loss`` = label-smoothed NLL of both
passes, ``nll`` = plain NLL of both passes, ``kl`` = ``1/2 (KL(P1||P2) + KL(P2||P1))``
(these three are detached, for logging)."""


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
            MiB; 0 = automatic (:data:`AUTO_CHUNK_MB`).
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
    kept = _kept_rows(target, ignore_index, keep, n, pairs)
    into_scores = _grad_into_scores(grad_in_scores, scores, pairs)
    if not torch.is_grad_enabled():  # needs_input_grad follows requires_grad, not no_grad
        pairs = pairs.detach()

    def run(impl):
        ids = _target_ids(target, kept, impl) if target is not None else None
        need_grad = torch.is_grad_enabled() and scores.requires_grad
        chunk_rows = chunk_rows_for(vocab, scores, chunk_mb, need_grad) if impl == "torch" else 0
        # fairseq's --amp calls the criterion under autocast, which would run sums in fp16
        with torch.autocast(scores.device.type, enabled=False):
            return RDropLoss(*_FusedRDrop.apply(
                pairs, ids, kept, alpha, float(epsilon), bool(log_probs), impl, chunk_rows,
                into_scores,
            ))

    return _run_with_fallback(impl, scores, run)


def symmetric_kl(scores, keep=None, log_probs=True, **kwargs):
    """``1/2 (KL(P1||P2) + KL(P2||P1))`` summed over positions, differentiable.

    ``scores`` is ``(2B, ..., V)``, pass 1 then pass 2 (log-probabilities by default, or
    logits with ``log_probs=False``); ``keep`` an optional boolean mask over one pass's
    positions ``(B, ...)``. Other keyword arguments go to :func:`rdrop_loss`.
    """
    return rdrop_loss(scores, None, alpha=1.0, keep=keep, log_probs=log_probs, **kwargs).total


def mse_consistency(predictions):
    """Regression consistency: ``sum((y1 - y2)^2)`` between the two halves (>= float32)."""
    y1, y2 = split_halves(predictions.to(_compute_dtype(predictions)))
    return (y1 - y2).pow(2).sum()


def chunk_rows_for(vocab, scores, chunk_mb=0.0, need_grad=True):
    """Row pairs per chunk of the torch implementation for a ``chunk_mb`` MiB budget.

    A chunk of ``r`` row pairs holds the log-probabilities of both passes (``2 r x V`` in
    the compute dtype, float32 or float64) and their probabilities, which live in the
    gradient's buffer where that has the compute dtype (scores in it, with ``need_grad``)
    and take ``2 r x V`` more otherwise (fp16/bf16 scores, or no gradient: under
    ``torch.no_grad``).
    """
    chunk_mb = chunk_budget_mb(chunk_mb, scores)
    in_place = need_grad and scores.dtype == _compute_dtype(scores)
    return max(1, int(chunk_mb * 2**20) // chunk_bytes_per_pair(vocab, scores.dtype, in_place))


def chunk_budget_mb(chunk_mb, tensor):
    """``chunk_mb`` checked (finite, >= 0), or the automatic budget for ``tensor``'s device
    where it is 0."""
    if not chunk_mb >= 0 or math.isinf(chunk_mb):
        raise ValueError(f"chunk_mb must be a finite number >= 0 (0 = automatic), got {chunk_mb}")
    return chunk_mb or AUTO_CHUNK_MB["cuda" if tensor.is_cuda else "cpu"]


def chunk_bytes_per_pair(vocab, dtype, probs_in_place):
    """Bytes of the torch implementation's temporaries per row pair of a chunk: the
    log-probabilities, and the probabilities unless they live in a buffer of the caller's
    (``probs_in_place``), each ``2 x V`` in the compute dtype of ``dtype``."""
    compute = torch.promote_types(dtype, torch.float32)
    return (2 if probs_in_place else 4) * vocab * compute.itemsize


def check_alpha_epsilon(alpha, epsilon):
    """``alpha`` as a float, after checking it (finite, >= 0) and ``epsilon`` (in [0, 1])."""
    alpha = float(alpha)
    if not alpha >= 0 or math.isinf(alpha):
        raise ValueError(f"alpha must be a finite number >= 0, got {alpha}")
    if not 0.0 <= epsilon <= 1.0:
        raise ValueError(f"epsilon (label smoothing) must be in [0, 1], got {epsilon}")
    return alpha


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


def _target_ids(target, kept, impl):
    """``target`` flattened; for the torch implementation, class 0 where a row is excluded
    (its id may be anything, -100 or 1e9, and gather would read it). The Triton kernel
    never reads an excluded row's id: no op for it."""
    target = target.reshape(-1)
    return torch.where(kept, target, 0) if impl == "torch" else target


def _kept_rows(target, ignore_index, keep, n, pairs):
    """True for a position that counts, False for padding / excluded ones: (N,) bool."""
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


def _kernel_device(tensor):
    """Whether impl="auto" would run the Triton kernel on ``tensor``: CUDA, not float64."""
    return tensor.is_cuda and tensor.dtype != torch.float64


def _give_up_triton(device, reason):
    """impl="auto" uses the torch implementation on ``device`` from now on; says so once."""
    if device not in _TRITON_GIVEN_UP:
        _TRITON_GIVEN_UP[device] = reason
        warnings.warn(f"R-Drop: impl='auto' uses the torch implementation on {device} instead "
                      f"of the Triton kernel from now on ({reason}); it computes the same "
                      "loss, with more kernel launches", RuntimeWarning, stacklevel=2)


def _run_with_fallback(impl, tensor, run):
    """``run(impl)`` with ``impl`` resolved for ``tensor``; where ``"auto"`` chose the
    Triton kernel and the kernel fails to compile or launch on this device
    (:class:`~rdrop_fairseq.triton_kernel.TritonKernelError`, raised before it writes
    anything), runs the torch implementation, then and from then on, with one warning.
    Any other error is raised, and so is the kernel's with ``impl="triton"``."""
    resolved = _resolve_impl(impl, tensor)
    if impl != "auto" or resolved != "triton":
        return run(resolved)
    from .triton_kernel import TritonKernelError

    try:
        return run("triton")
    except TritonKernelError as error:
        reason = f"its Triton kernel failed: {error}"
    result = run("torch")
    _give_up_triton(str(tensor.device), reason)
    return result


def _resolve_impl(impl, scores):
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {', '.join(IMPLS)}, got {impl!r}")
    if impl == "torch":
        return impl
    if impl == "auto":
        if not _kernel_device(scores) or str(scores.device) in _TRITON_GIVEN_UP:
            return "torch"
        from .triton_kernel import triton_available

        if not triton_available():
            _give_up_triton(str(scores.device), "triton is not installed: pip install triton")
            return "torch"
        return "triton"
    from .triton_kernel import triton_available

    if not triton_available():
        raise ValueError("impl 'triton' needs the triton package (pip install triton)")
    if not scores.is_cuda and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(
            "impl 'triton' needs CUDA tensors, or TRITON_INTERPRET=1 (set before the "
            "kernel is imported) to run Triton's interpreter on CPU tensors"
        )
    return impl


def _compute_dtype(x):
    return torch.promote_types(x.dtype, torch.float32)


def _coefficients(vocab, epsilon, alpha, has_target, from_logits):
    """Scalars of the per-row gradient formula (see :func:`_rows_torch`)."""
    eps_i = epsilon / (vocab - 1) if vocab > 1 and has_target else 0.0
    c1 = 1.0 - epsilon - eps_i if has_target else 0.0
    pcoef = c1 + eps_i * vocab if from_logits else 0.0
    return {"pcoef": pcoef, "h": 0.5 * alpha, "eps_i": eps_i, "c1": c1}


class _FusedRDrop(torch.autograd.Function):
    """Row-pair statistics and the scores' gradient in the forward; a scale in the backward."""

    @staticmethod
    def forward(ctx, pairs, target, kept, alpha, epsilon, log_probs, impl, chunk_rows,
                into_scores):
        n, vocab = pairs.size(1), pairs.size(2)
        coef = _coefficients(vocab, epsilon, alpha, target is not None, not log_probs)
        # the KL-only case has no target: read class 0
        t = target if target is not None else torch.zeros(n, dtype=torch.long, device=pairs.device)
        need_grad = ctx.needs_input_grad[0]  # False under no_grad (rdrop_loss detaches there)
        out = pairs if need_grad and into_scores else None
        if impl == "triton":
            from .triton_kernel import rdrop_rows_triton

            grad, stats = rdrop_rows_triton(pairs, t, kept, from_logits=not log_probs,
                                            need_grad=need_grad, out=out, **coef)
        else:
            grad, stats = _rows_torch(pairs, t, kept, not log_probs, chunk_rows, need_grad,
                                      out=out, **coef)
        # stats rows: nll, smooth, kl_pq, kl_qp (per row pair), then the gradient's scale
        total, loss, nll, kl = combine_rows(stats, kept, coef, alpha, target is not None, impl)
        ctx.grad = grad
        # fp16 gradients are stored scaled per row pair (0 for an excluded row, whose stored
        # factor may be nan); in other dtypes the factor is 1 and the backward a scalar's
        ctx.row_factor = (torch.where(kept, stats[4], 0)
                          if need_grad and pairs.dtype == torch.float16 else None)
        ctx.mark_non_differentiable(loss, nll, kl)
        ctx.set_materialize_grads(False)  # no zeros made for the logged outputs' gradients
        return total, loss, nll, kl

    @staticmethod
    def backward(ctx, g_total, *unused):
        grad = getattr(ctx, "grad", None)
        if grad is None:
            raise RuntimeError(
                "rdrop_loss supports one backward per forward: its backward scales, in "
                "place, the gradient kept from the forward (no retain_graph reuse)"
            )
        del ctx.grad
        if ctx.row_factor is not None:
            g_total = (g_total * ctx.row_factor).view(1, -1, 1)
        return grad.mul_(g_total), None, None, None, None, None, None, None, None


def _rows_torch(pairs, target, kept, from_logits, chunk_rows, need_grad=True, out=None, *,
                pcoef, h, eps_i, c1, fp16_max=_FP16_TARGET_MAX):
    """Per row pair ``(x, y) = (pairs[0, i], pairs[1, i])``, with ``la, lb`` their
    log-probabilities (log_softmax of logits, or the inputs), ``pa, pb`` the
    probabilities and ``d = la - lb``:

    * stats ``(5, N)``: ``-(la[t] + lb[t])``, ``-(sum la + sum lb)``, ``KL(pa||pb)``,
      ``KL(pb||pa)``, and the factor that undoes the gradient's storage scale;
    * the gradient of ``c1 * nll + eps_i * smooth + h * (KL(pa||pb) + KL(pb||pa))``:

        g_a = pa * (P + h + h (d - Ka)) - h pb - eps_i - c1 [v = t]
        g_b = pb * (P + h - h (d + Kb)) - h pa - eps_i - c1 [v = t]

      with ``P = pcoef, Ka = KL(pa||pb), Kb = KL(pb||pa)`` from logits (the log_softmax
      chain folded in) and ``P = Ka = Kb = 0`` from log-probabilities. ``d - Ka`` and
      ``d + Kb`` are formed before anything scales them: where the logits are large,
      ``d`` and the KL are large and nearly equal, and their difference is then exact
      (Sterbenz), while ``h d`` and ``h Ka`` rounded separately would each carry a
      rounding of their own size into the gradient.

    Every sum over V (the softmax's normaliser ``s``, ``sum la``, the KL row dots
    ``sum pa d``, ``sum pb d``) is a ``torch.sum`` over the last dimension, which adds
    pairwise (a cascade on CPU, a tree on CUDA): its float32 error grows with log V, not
    with V as that of a running sum (``log_softmax``'s normaliser on CPU, a BLAS dot
    product) does. From logits, a chunk holds ``x - m`` (``m`` the row's max: exact for
    fp16/bf16 logits, one rounding relative to ``x - m`` for float32), ``p = exp(x - m) /
    s``, and the log-probabilities ``x - m - log s`` are never formed: ``log s`` is a
    per-row constant, subtracted from the row's statistics after the loop, and it cancels
    in ``d - Ka`` and ``d + Kb``, so the gradient never needs it. One exp per element, and
    per-row scalars in the compute dtype (nothing in float64 for float32 scores).

    Classes ruled out (log-probability -inf): a class both passes rule out adds nothing;
    a class contributes 0 to ``KL(p||q)`` wherever ``p`` is 0 (``0 log 0 = 0``), and +inf
    where ``p > 0`` and ``q`` rules it out. A row pair whose KL is then not finite (+inf,
    or nan from a nan input) has no gradient: with ``h > 0`` its two rows get nan, so
    that the step is seen to fail; every other row is unaffected.

    Chunks of ``chunk_rows`` pairs; every op works on both passes at once where it can,
    because on a GPU each op is a kernel launch. Rows where ``kept`` (N,) is False get a
    gradient of 0 (their stats are left to the caller to mask). Without ``need_grad`` the
    gradient is neither computed nor allocated (``grad`` is None). ``out`` is a ``(2, N,
    V)`` buffer the chunks may overwrite (it may be ``pairs`` itself: a chunk is read
    before it is written): the gradient goes there, or, without ``need_grad``, the
    probabilities when it has the compute dtype. A float16 gradient is scaled per row
    pair so that its largest entry is near ``fp16_max`` (stats row 4 undoes it).
    """
    dtype = _compute_dtype(pairs)
    n, vocab = pairs.size(1), pairs.size(2)
    device = pairs.device
    grad = None
    if need_grad:
        grad = out if out is not None else torch.empty(pairs.shape, dtype=pairs.dtype,
                                                       device=device)
    # the probabilities live in a buffer of the compute dtype that the chunk overwrites
    # anyway (the gradient's, or out) when there is one: half a chunk's temporaries
    host = grad if need_grad else out
    in_place = host is not None and host.dtype == dtype
    scale_fp16 = need_grad and pairs.dtype == torch.float16
    index = target.view(1, n, 1).expand(2, n, 1)
    # per-row results are written into buffers made up front, and a chunk's temporaries
    # into chunk-sized ones made once: nothing chunk-sized is allocated in the loop
    per_row = torch.empty((4, 2, n, 1), dtype=dtype, device=device)
    at_target, sums, dots, norms = per_row.unbind(0)
    rows = min(chunk_rows, n)
    work = torch.empty((2, rows, vocab), dtype=dtype, device=device)
    probs = None if in_place else torch.empty((2, rows, vocab), dtype=dtype, device=device)
    row_base = torch.empty((rows, 1), dtype=dtype, device=device)  # a chunk's P + h, below
    # fp16: the factors that undo the gradient's scale, per row pair (1 elsewhere)
    inv_scale = torch.ones(n if scale_fp16 else 1, dtype=dtype, device=device)
    chunks = [pairs.split(chunk_rows, 1), index.split(chunk_rows, 1),
              kept.view(1, n, 1).split(chunk_rows, 1), at_target.split(chunk_rows, 1),
              sums.split(chunk_rows, 1), dots.split(chunk_rows, 1), norms.split(chunk_rows, 1)]
    count = len(chunks[0])
    chunks.append(inv_scale.split(chunk_rows) if scale_fp16 else [None] * count)
    chunks.append(grad.split(chunk_rows, 1) if need_grad else [None] * count)
    chunks.append(host.split(chunk_rows, 1) if in_place else [None] * count)
    # 0-dim operands, made on the device (a torch.tensor of a list would copy from the host)
    minus_eps, base, zero = (torch.full((), value, dtype=dtype, device=device)
                             for value in (-eps_i, pcoef + h, 0.0))
    kl_grad = need_grad and h != 0
    views = {}  # the chunk buffers' first r rows, by r
    for x, t, k, at, sm, dot, norm, inv, g, hosted in zip(*chunks):
        r = x.size(1)
        if r not in views:
            w = work if r == rows else work[:, :r]
            p = None if in_place else probs if r == rows else probs[:, :r]
            views[r] = (w, *w.unbind(0), row_base[:r], p)
        lp, la, lb, base_r, p = views[r]
        if in_place:
            p = hosted
        pa, pb = p.unbind(0)
        ka, kb = dot.unbind(0)
        # from logits, lp holds x - m (m: the row's max), the log-probabilities but for
        # their per-row shift log s, which is added to the row's results after the loop
        if from_logits:
            m = torch.amax(x, -1, keepdim=True)
            torch.sub(x, m if m.dtype == dtype else m.to(dtype), out=lp)
        else:
            lp.copy_(x)
        torch.gather(lp, -1, t, out=at)
        torch.sum(lp, -1, keepdim=True, out=sm)
        torch.exp(lp, out=p)
        if from_logits:  # p = exp(x - m) / s
            torch.sum(p, -1, keepdim=True, out=norm)
            p.div_(norm)
        d = la.sub_(lb)  # la's storage now holds d (but for log sa - log sb)
        # the row dots sum pa d and sum pb d, their products in lb's storage, then one
        # pairwise sum each. nansum: 0 log 0 = 0, so a class whose probability is 0 in
        # the pass that weighs it adds nothing (0 * -inf, or -inf - -inf for a class both
        # passes rule out, is nan); one that the other pass rules out adds +inf
        torch.nansum(torch.mul(d, pa, out=lb), -1, keepdim=True, out=ka)
        torch.nansum(torch.mul(d, pb, out=lb), -1, keepdim=True, out=kb)  # = -Kb but for log s
        # a nan input (a diverged model) must not vanish from the KL as a 0 * inf would
        dot.masked_fill_(torch.isnan(sm).any(0), math.nan)
        if g is None:
            continue
        # the gradient, in lp's storage (log s cancels in d - Ka and d + Kb)
        if kl_grad:
            # where d is not finite (a class ruled out), both passes' p are 0 in a row pair
            # whose KLs are finite: any finite d serves there (the others get nan below)
            d.nan_to_num_(nan=0.0, posinf=0.0, neginf=0.0)
            # lp = (d - Ka, -(d + Kb)): each difference formed before h scales it
            if from_logits:
                torch.sub(kb, d, out=lb)
                d.sub_(ka)
            else:
                torch.neg(d, out=lb)
            # P + h, but nan for a row pair whose KL is not finite (0 * inf = nan), so
            # that both its rows' gradients are nan
            torch.sub(ka, kb, out=base_r)
            torch.addcmul(base, base_r, zero, out=base_r)
            torch.add(base_r, lp, alpha=h, out=lp)
            torch.addcmul(minus_eps, lp, p, out=lp)
        else:
            torch.add(minus_eps, p, alpha=pcoef + h, out=lp)
        if h:  # - h pb, - h pa
            la.sub_(pb, alpha=h)
            lb.sub_(pa, alpha=h)
        if c1:
            lp.scatter_(-1, t, -c1, reduce="add")
        if scale_fp16:
            _scale_for_fp16(lp, inv, fp16_max)
        # excluded rows: 0, whatever they held (where's out must have its compute dtype)
        if g.dtype == dtype:
            torch.where(k, lp, zero, out=g)
        else:
            g.copy_(torch.where(k, lp, zero, out=lp))
    del work, probs, views
    dots[1].neg_()  # KL(pb||pa) = -sum pb d, but for log s
    if from_logits:
        # the log-probabilities are lp - log s: shift the target's and the sums' by it, and
        # the dots' by -+(log sa - log sb) (sum pa (d - log sa + log sb) = dot_a - log sa +
        # log sb, as sum pa = 1): exact opposites, whose rounding cancels in the KLs' sum
        log_s = norms.log_()
        at_target.sub_(log_s)
        sums.sub_(log_s, alpha=vocab)
        dots.sub_(log_s - log_s.flip(0))
    # nll and smooth: -(the sum over both passes)
    both = per_row[:2].sum(1).neg_()
    return grad, torch.cat([both.view(2, n), dots.view(2, n), inv_scale.expand(1, n)])


def _scale_for_fp16(g, inv_scale, target_max=_FP16_TARGET_MAX):
    """Scale each row pair of ``g`` (2, r, V) in place by a power of two so that its largest
    entry is near ``target_max``; write the inverse scales into ``inv_scale``."""
    # max |g| as max(max g, -min g): no chunk-sized temporary beyond the chunk budget
    biggest = torch.maximum(g.amax(dim=(0, 2)), g.amin(dim=(0, 2)).neg_())
    biggest.clamp_min_(torch.finfo(torch.float32).tiny)
    exponent = torch.floor(torch.log2(target_max / biggest)).clamp_(-24.0, 24.0)
    g.mul_(torch.exp2(exponent).view(1, -1, 1))
    torch.exp2(-exponent, out=inv_scale)
