"""One fused Triton kernel for R-Drop's per-row loss terms and their gradient.

``rdrop_rows_triton`` takes the scores of both passes, ``(2, N, V)``, and returns for every
row pair ``i`` (pass 1 row ``x``, pass 2 row ``y``) the four loss terms and the gradient of

    total = c1 * nll + eps_i * smooth + h * (kl_pq + kl_qp)

with respect to ``x`` and ``y`` (logits, or log-probabilities with ``from_logits=False``).
Rows whose ``kept`` is False (padding) are not read beyond their target id: the program
writes zeros (statistics and gradient) and stops.

One program handles one row pair and walks over V in ``BLOCK_V`` chunks, three times:

1. online log-sum-exp of both rows (running max ``m`` and rescaled running sum ``s``, as
   fused cross-entropy kernels do), so any V fits; log-probabilities are then
   ``(x - m) - log s``, which keeps the precision of ``x - m`` whatever the logits' scale;
2. ``kl_pq = sum pa*d``, ``kl_qp = -sum pb*d`` (``d = la - lb``) and ``sum la``, ``sum lb``;
3. the gradient, which needs the complete KLs of its row (the softmax chain rule), hence
   a sweep of its own.

From log-probabilities there is no log-sum-exp and the gradient needs no KL: sweep 2 alone
does it all (except in float16, below). Memory traffic per row pair: each of the two rows
is read 3 times from logits (once from log-probabilities), the gradient is written once in
the input dtype, plus 5 floats of statistics.

A float16 gradient is stored multiplied by a power of two per row pair (returned as its
inverse in the statistics): most entries of a softmax gradient are ~1/V, fp16 subnormals
at V = 32k. Sweep 2 tracks ``max pa |d|`` and ``max pb |d|``, which bound the row's
gradient, and the scale brings that bound near 2**14 (from log-probabilities the gradient
then moves to a third sweep as well). Nothing of size ``(2N, V)`` is allocated but the
gradient, in the dtype of the scores (float32 for float32 scores), and not even that
with ``need_grad=False`` or ``out``; all arithmetic is float32 in registers.

Importing this module does not need triton (``triton_available()`` tells), and importing
``rdrop_fairseq`` does not import this module (the core does so lazily). It imports nothing
of the package either: its tests load it alone, once per interpreter setting. The contract
it shares with the torch implementation is :mod:`rdrop_fairseq.ops.rows`. Triton reads
``TRITON_INTERPRET`` when ``@triton.jit`` runs: for its own library (``tl.sum``...) at the
first ``import triton`` of the process, for the kernel below at the import of this module.
So the interpreter (CPU tensors) must be chosen before both.
"""

import contextlib
import os

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # the torch path works without it
    triton = None

__all__ = ["triton_available", "rdrop_rows_triton", "TritonKernelError"]

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)

# float16 gradients: each row pair's bound on |g| is scaled to about this (see above);
# rdrop_fairseq.ops.rows.FP16_TARGET_MAX, the torch implementation's, is the same
FP16_TARGET_MAX = 2.0 ** 14

# Columns per chunk at most, and columns per warp: 8 values per thread and row. Larger
# vocabularies just loop. ptxas gives 48-91 registers and no spills for every chunk size
# up to 4096 (16 warps; 64 on sm_80, so two such programs share an SM's 64k registers on
# V100/RTX 3090/A100/H100); 16 values per thread took 150-180 registers from log-probs,
# and 8192-column chunks 100-130.
MAX_BLOCK_V = 4096
COLUMNS_PER_WARP = 256


class TritonKernelError(RuntimeError):
    """The kernel failed to compile or launch on this device (its cause chained): a GPU
    below Triton's supported compute capability (8.0; a V100 is 7.0), a broken toolchain
    or driver. impl="auto" falls back to the torch implementation on it."""


def triton_available():
    """True if triton can be imported (the kernel may still need a GPU, see below)."""
    return triton is not None


def _launch(kernel, grid, *args, **kwargs):
    """``kernel[grid](*args, **kwargs)``; any failure but running out of memory becomes a
    TritonKernelError: Triton's compile, ptxas, driver and build errors have no common base
    (its own classes, AssertionError, CalledProcessError, ValueError, OSError)."""
    try:
        kernel[grid](*args, **kwargs)
    except Exception as error:
        if isinstance(error, torch.cuda.OutOfMemoryError) or "out of memory" in str(error):
            raise
        raise TritonKernelError(f"{type(error).__name__}: {error}") from error


def rdrop_rows_triton(pairs, target, kept=None, *, from_logits, pcoef, h, eps_i, c1,
                      need_grad=True, out=None, stats=None, fp16_target_max=FP16_TARGET_MAX,
                      chunk_rows=0):
    """Per-row R-Drop terms and gradient of both passes in one kernel launch.

    Args:
        pairs: ``(2, N, V)`` float16/bfloat16/float32, ``pairs[0]`` pass 1, ``pairs[1]``
            pass 2; rows must be contiguous (``stride(-1) == 1``), the other strides are
            free (a view of a ``(2N, V)`` tensor or a slice along N is read in place).
        target: ``(N,)`` integer class ids, each in ``[0, V)`` where ``kept`` is true (not
            checked: that would synchronise with the device; an id out of range there reads
            out of bounds). Where ``kept`` is false the id is never used.
        kept: optional ``(N,)`` bool, False for rows that count nowhere (padding): their
            statistics and gradient are 0, whatever their scores hold (inf, nan).
        from_logits: True if ``pairs`` are logits (log_softmax is folded in), False if
            they are log-probabilities already.
        pcoef: coefficient of ``p`` in the gradient from the task loss, ``c1 + eps_i * V``
            for label-smoothed NLL from logits (ignored with ``from_logits=False``).
        h: weight of each KL direction (``alpha / 2``).
        eps_i: weight of ``smooth`` (label smoothing per class).
        c1: weight of ``nll``.
        need_grad: False: no gradient is computed nor allocated (``grad`` is None).
        out: a ``(2, N, V)`` tensor of the dtype of ``pairs`` (rows contiguous) for the
            gradient instead of a new one; it may be ``pairs`` itself (each chunk is read
            before its gradient is written).
        stats: a float32 ``(5, N)`` tensor for the statistics instead of a new one (rows
            contiguous, any row stride: a column slice of a larger buffer).
        fp16_target_max: float16 only: where each row pair's bound on ``|g|`` is scaled to
            (a power of two; the fused-linear path multiplies the scaled gradient by the
            weight in float16 and asks for less headroom than the default 2**14).
        chunk_rows: the torch implementation's chunk size, taken and ignored: the kernel
            is one launch. Both implementations share one signature, that of
            ``rdrop_fairseq.ops.impl.run_rows``, the op's one entry point.

    Returns ``(grad, stats)``: ``grad`` is ``(2, N, V)`` contiguous in the dtype of
    ``pairs``, the gradient of ``total`` (unmasked; in float16 multiplied by a power of
    two per row pair); ``stats`` is ``(5, N)`` float32 (contiguous, or the ``stats`` given) with the rows ``nll =
    -(la[t] + lb[t])``, ``smooth = -(sum la + sum lb)``, ``kl_pq = KL(pa||pb)``, ``kl_qp =
    KL(pb||pa)``, and the factor that undoes the gradient's scale (1 but in float16). A class that both passes
    rule out (``la = lb = -inf``) contributes nothing to the KLs nor their gradient; one
    that only pass 1 rules out adds 0 to ``kl_pq`` and +inf to ``kl_qp`` (and vice versa),
    and with ``h != 0`` such a row pair has no gradient: nan in both its rows.

    Only shapes, dtypes and devices are checked: no host-device synchronisation.
    """
    if triton is None:
        raise ImportError("rdrop_rows_triton needs triton (pip install triton)")
    _check_inputs(pairs, target)
    _, n, vocab = pairs.shape
    if kept is None:
        kept = torch.ones(n, dtype=torch.bool, device=pairs.device)
    if kept.shape != (n,) or kept.dtype != torch.bool or kept.device != pairs.device:
        raise ValueError(f"kept must be ({n},) bool on {pairs.device}, got {kept.dtype} "
                         f"{tuple(kept.shape)} on {kept.device}")
    grad = None
    if need_grad:
        grad = out if out is not None else torch.empty(pairs.shape, dtype=pairs.dtype,
                                                       device=pairs.device)
        if grad.shape != pairs.shape or grad.dtype != pairs.dtype or grad.stride(-1) != 1:
            raise ValueError("out must have the shape and dtype of pairs, rows contiguous")
    if stats is None:
        stats = torch.empty((5, n), dtype=torch.float32, device=pairs.device)
    if (stats.shape != (5, n) or stats.dtype != torch.float32 or stats.device != pairs.device
            or (n > 1 and stats.stride(1) != 1)):
        raise ValueError(f"stats must be (5, {n}) float32 on {pairs.device}, rows contiguous")
    if n == 0:
        return grad, stats
    g = grad if need_grad else pairs  # never written without NEED_GRAD
    block_v = min(triton.next_power_of_2(vocab), MAX_BLOCK_V)
    num_warps = max(1, block_v // COLUMNS_PER_WARP)  # 1 to 16
    # Triton launches on the current device, which need not be that of the tensors
    with torch.cuda.device(pairs.device) if pairs.is_cuda else contextlib.nullcontext():
        _launch(
            _rdrop_rows_kernel, (n,),
            pairs, pairs.stride(0), pairs.stride(1), target, target.stride(0),
            kept.view(torch.uint8), kept.stride(0), g, g.stride(0), g.stride(1), stats,
            stats.stride(0), vocab, float(pcoef), float(h), float(eps_i), float(c1),
            float(fp16_target_max),
            FROM_LOGITS=bool(from_logits), ROW_SCALE=pairs.dtype == torch.float16,
            NEED_GRAD=bool(need_grad), BLOCK_V=block_v, num_warps=num_warps,
            enable_fp_fusion=True,  # FMA as in CUDA code; explicit, as Triton 3.9 asks
        )
    return grad, stats


def _check_inputs(pairs, target):
    if not torch.is_tensor(pairs) or pairs.dim() != 3 or pairs.size(0) != 2:
        shape = tuple(pairs.shape) if torch.is_tensor(pairs) else type(pairs).__name__
        raise ValueError(f"pairs must be (2, N, V) with both passes stacked, got {shape}")
    if pairs.dtype not in _DTYPES:
        raise ValueError(
            f"the Triton kernel takes float16, bfloat16 or float32 pairs, got {pairs.dtype}"
            " (use the torch path for float64)"
        )
    _, n, vocab = pairs.shape
    if vocab == 0:
        raise ValueError("pairs has V = 0 classes")
    if pairs.stride(-1) != 1 and vocab > 1:
        raise ValueError(
            f"the rows of pairs must be contiguous (stride(-1) == 1), got strides "
            f"{pairs.stride()}: pass a contiguous copy"
        )
    if not torch.is_tensor(target) or target.dim() != 1 or target.size(0) != n:
        shape = tuple(target.shape) if torch.is_tensor(target) else type(target).__name__
        raise ValueError(f"target must be (N,) = ({n},) class ids, got {shape}")
    if target.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"target must hold int64 (or int32) class ids, got {target.dtype}")
    if target.device != pairs.device:
        raise ValueError(f"target is on {target.device}, pairs on {pairs.device}")
    if _KERNEL_INTERPRETED != _TRITON_INTERPRETED:
        # the kernel would fail deep inside Triton with an obscure message
        raise ValueError(
            f"TRITON_INTERPRET changed between the first import of triton (interpreter: "
            f"{_TRITON_INTERPRETED}) and that of rdrop_fairseq.ops.rows_triton (interpreter: "
            f"{_KERNEL_INTERPRETED}): set it before both, they read it only then"
        )
    if pairs.is_cuda or _KERNEL_INTERPRETED:
        return
    now = os.environ.get("TRITON_INTERPRET", "0") == "1"
    hint = (
        " (TRITON_INTERPRET=1 is set now, but it was not when rdrop_fairseq.ops.rows_triton "
        "was imported, and Triton reads it only then: set it before importing triton)"
        if now else ""
    )
    raise ValueError(
        f"the R-Drop Triton kernel needs CUDA tensors, or TRITON_INTERPRET=1 to run "
        f"Triton's interpreter on CPU; got pairs on {pairs.device}{hint}"
    )


if triton is not None:

    @triton.jit
    def _rdrop_rows_kernel(
        s_ptr, stride_pass, stride_row, t_ptr, stride_t, k_ptr, stride_k, g_ptr,
        g_stride_pass, g_stride_row, stats_ptr, stats_stride, vocab,
        pcoef, h, eps_i, c1, target_max, FROM_LOGITS: tl.constexpr, ROW_SCALE: tl.constexpr,
        NEED_GRAD: tl.constexpr, BLOCK_V: tl.constexpr,
    ):
        # int64 row offsets: N * V can exceed 2**31 (the strides come as int64 then)
        row = tl.program_id(0).to(tl.int64)
        a_ptr = s_ptr + row * stride_row
        b_ptr = a_ptr + stride_pass
        ga_ptr = g_ptr + row * g_stride_row
        gb_ptr = ga_ptr + g_stride_pass
        cols0 = tl.arange(0, BLOCK_V)
        kept = tl.load(k_ptr + row * stride_k) != 0
        # a padding row sweeps nothing (its loops run 0 times) and only writes zeros
        active = tl.where(kept, vocab, 0)
        t = tl.load(t_ptr + row * stride_t)
        # the target's scores, read before any gradient is written (it may overwrite them)
        x_t = tl.load(a_ptr + t, mask=kept, other=0.0).to(tl.float32)
        y_t = tl.load(b_ptr + t, mask=kept, other=0.0).to(tl.float32)

        # sweep 1: online log-sum-exp of both rows. exp() is taken relative to a finite
        # shift (0 while the running max is -inf), so a row or chunk entirely -inf adds 0,
        # and finfo.min-masked rows work; masked columns load as -inf.
        if FROM_LOGITS:
            m_a = tl.full((), float("-inf"), tl.float32)
            m_b = tl.full((), float("-inf"), tl.float32)
            s_a = tl.zeros((), tl.float32)
            s_b = tl.zeros((), tl.float32)
            for start in range(0, active, BLOCK_V):
                cols = start + cols0
                mask = cols < vocab
                x = tl.load(a_ptr + cols, mask=mask, other=float("-inf")).to(tl.float32)
                y = tl.load(b_ptr + cols, mask=mask, other=float("-inf")).to(tl.float32)
                new_a = tl.maximum(m_a, tl.max(x, axis=0))
                new_b = tl.maximum(m_b, tl.max(y, axis=0))
                shift_a = tl.where(new_a == float("-inf"), 0.0, new_a)
                shift_b = tl.where(new_b == float("-inf"), 0.0, new_b)
                s_a = s_a * tl.exp(m_a - shift_a) + tl.sum(tl.exp(x - shift_a), axis=0)
                s_b = s_b * tl.exp(m_b - shift_b) + tl.sum(tl.exp(y - shift_b), axis=0)
                m_a = new_a
                m_b = new_b
            # log-probability = (x - m) - log s: exact x - m, whatever the logits' scale
            m_a = tl.where(m_a == float("-inf"), 0.0, m_a)
            m_b = tl.where(m_b == float("-inf"), 0.0, m_b)
            log_s_a = tl.log(s_a)
            log_s_b = tl.log(s_b)
        else:
            m_a = tl.zeros((), tl.float32)
            m_b = tl.zeros((), tl.float32)
            log_s_a = tl.zeros((), tl.float32)
            log_s_b = tl.zeros((), tl.float32)

        # sweep 2: both KL directions and the sums of the log-probabilities; from
        # log-probabilities also the gradient, which needs no KL there (see sweep 3)
        kl_pq = tl.zeros((), tl.float32)
        kl_qp = tl.zeros((), tl.float32)
        sum_a = tl.zeros((), tl.float32)
        sum_b = tl.zeros((), tl.float32)
        big_a = tl.zeros((), tl.float32)  # max pa |d|, max pb |d|: for the fp16 scale
        big_b = tl.zeros((), tl.float32)
        for start in range(0, active, BLOCK_V):
            cols = start + cols0
            mask = cols < vocab
            la, lb, d, pa, pb = _load_chunk(a_ptr, b_ptr, cols, mask, m_a, log_s_a, m_b,
                                            log_s_b)
            # 0 log(0/q) = 0 for a class ruled out by one pass only (0 * inf would be nan;
            # the other direction is then +inf, as it should)
            kl_pq += tl.sum(tl.where(pa == 0.0, 0.0, pa * d), axis=0)
            kl_qp -= tl.sum(tl.where(pb == 0.0, 0.0, pb * d), axis=0)
            sum_a += tl.sum(tl.where(mask, la, 0.0), axis=0)
            sum_b += tl.sum(tl.where(mask, lb, 0.0), axis=0)
            if ROW_SCALE:
                big_a = tl.maximum(big_a, tl.max(tl.where(pa == 0.0, 0.0, pa * tl.abs(d)), 0))
                big_b = tl.maximum(big_b, tl.max(tl.where(pb == 0.0, 0.0, pb * tl.abs(d)), 0))
            if NEED_GRAD and not FROM_LOGITS and not ROW_SCALE:
                # d/dla KL(p||q) = p (1 + d), d/dla KL(q||p) = -q
                _store_grad(ga_ptr, gb_ptr, cols, mask, t, d, pa, pb, h, 0.0, 0.0, h, eps_i,
                            c1, 1.0)
        la_t = (x_t - m_a) - log_s_a
        lb_t = (y_t - m_b) - log_s_b
        tl.store(stats_ptr + row, tl.where(kept, -(la_t + lb_t), 0.0))
        tl.store(stats_ptr + stats_stride + row, tl.where(kept, -(sum_a + sum_b), 0.0))
        tl.store(stats_ptr + 2 * stats_stride + row, kl_pq)
        tl.store(stats_ptr + 3 * stats_stride + row, kl_qp)

        # sweep 3, from logits: the gradient, through the softmax: d/dx KL(p||q) =
        # p (d - KL(p||q)) needs the row's complete KL; d/dx KL(q||p) = p - q, and the
        # task loss gives pcoef * p. (From log-probabilities: g = p h (1 + d) - h q ...)
        if FROM_LOGITS:
            base = pcoef + h
            kl_a = kl_pq
            kl_b = kl_qp
        else:  # pcoef is ignored
            base = h
            kl_a = 0.0
            kl_b = 0.0
        # a row pair whose KL enters the loss and is not finite (a class one pass rules
        # out, or a nan input) has no gradient: nan in both its rows, through their base
        bad = (h != 0.0) & ~(tl.abs(kl_pq + kl_qp) < float("inf"))
        scale = 1.0
        if ROW_SCALE:
            # |g| <= |base - h kl| p + h p |d| + h q + eps_i + |c1|, with p, q <= 1
            bound = tl.maximum(tl.abs(base - h * kl_a) + h * big_a,
                               tl.abs(base - h * kl_b) + h * big_b)
            bound = tl.maximum(bound + h + eps_i + tl.abs(c1), 1.0e-30)
            exponent = tl.minimum(tl.maximum(tl.floor(tl.log2(target_max / bound)), -24.0), 24.0)
            scale = tl.exp2(exponent)
            tl.store(stats_ptr + 4 * stats_stride + row, tl.where(kept, tl.exp2(-exponent), 1.0))
        else:
            tl.store(stats_ptr + 4 * stats_stride + row, 1.0)
        base = tl.where(bad, float("nan"), base)
        if NEED_GRAD:
            if FROM_LOGITS or ROW_SCALE:
                for start in range(0, active, BLOCK_V):
                    cols = start + cols0
                    mask = cols < vocab
                    la, lb, d, pa, pb = _load_chunk(a_ptr, b_ptr, cols, mask, m_a, log_s_a,
                                                    m_b, log_s_b)
                    _store_grad(ga_ptr, gb_ptr, cols, mask, t, d, pa, pb, base, kl_a, kl_b, h,
                                eps_i, c1, scale)
            else:
                # from log-probabilities sweep 2 wrote the gradient: a bad row's is nan
                for start in range(0, tl.where(bad, active, 0), BLOCK_V):
                    cols = start + cols0
                    mask = cols < vocab
                    nan = tl.full((BLOCK_V,), float("nan"), tl.float32).to(ga_ptr.dtype.element_ty)
                    tl.store(ga_ptr + cols, nan, mask=mask)
                    tl.store(gb_ptr + cols, nan, mask=mask)
            # a padding row's gradient is 0
            for start in range(0, vocab - active, BLOCK_V):
                cols = start + cols0
                mask = cols < vocab
                zero = tl.zeros((BLOCK_V,), tl.float32).to(ga_ptr.dtype.element_ty)
                tl.store(ga_ptr + cols, zero, mask=mask)
                tl.store(gb_ptr + cols, zero, mask=mask)

    @triton.jit
    def _load_chunk(a_ptr, b_ptr, cols, mask, m_a, log_s_a, m_b, log_s_b):
        """la, lb, d = la - lb, pa, pb of one chunk (columns past V: -inf, d = 0)."""
        x = tl.load(a_ptr + cols, mask=mask, other=float("-inf")).to(tl.float32)
        y = tl.load(b_ptr + cols, mask=mask, other=float("-inf")).to(tl.float32)
        la = (x - m_a) - log_s_a
        lb = (y - m_b) - log_s_b
        # -inf - (-inf) would be nan: a class ruled out by both passes counts 0; a nan
        # input still gives nan
        d = tl.where(la == lb, 0.0, la - lb)
        return la, lb, d, tl.exp(la), tl.exp(lb)

    @triton.jit
    def _store_grad(ga_ptr, gb_ptr, cols, mask, t, d, pa, pb, base, kl_a, kl_b, h, eps_i, c1,
                    scale):
        """g_a = pa (base + h (d - kl_a)) - h pb - eps_i - c1 [v == t], g_b = pb (base -
        h (d + kl_b)) - h pa - eps_i - c1 [v == t], times scale. d - kl_a and d + kl_b are
        formed before h scales them: where logits are large, d and the KL are large and
        nearly equal, and their difference is exact. A d that is not finite counts 0:
        where the KLs are finite, both p are 0 there."""
        d = tl.where(tl.abs(d) < float("inf"), d, 0.0)
        common = eps_i + tl.where(cols == t, c1, 0.0)
        g_a = (pa * (base + tl.where(h == 0.0, 0.0, h * (d - kl_a))) - h * pb - common) * scale
        g_b = (pb * (base - tl.where(h == 0.0, 0.0, h * (d + kl_b))) - h * pa - common) * scale
        tl.store(ga_ptr + cols, g_a.to(ga_ptr.dtype.element_ty), mask=mask)
        tl.store(gb_ptr + cols, g_b.to(gb_ptr.dtype.element_ty), mask=mask)

    # what @triton.jit chose: the interpreter or compilation (see the module docstring)
    _KERNEL_INTERPRETED = type(_rdrop_rows_kernel).__name__ == "InterpretedFunction"
    _TRITON_INTERPRETED = type(tl.sum).__name__ == "InterpretedFunction"
