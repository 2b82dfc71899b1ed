"""The torch implementation of R-Drop's row-pair computation (:mod:`.rows` is the contract
it shares with the Triton kernel, :mod:`.rows_triton`): chunked torch ops that run on any
device and dtype, float64 included, and the reference the kernel is tested against.

A chunk of row pairs goes through two passes, each a function here: :func:`chunk_statistics`
(the log-probabilities but for their per-row shift, the probabilities, the target's score,
the sums and the KL row dots) and :func:`chunk_gradient` (the gradient, written over the
chunk's log-probabilities, then into its buffer); :func:`shifted_statistics` adds the
per-row shift once, after the loop. Every op works on both passes at once where it can,
because on a GPU each op is a kernel launch, and nothing chunk-sized is allocated in the
loop.
"""

import math
from collections import namedtuple

import torch

from .rows import FP16_TARGET_MAX, chunk_rows_for, compute_dtype

__all__ = ["rows_torch", "chunk_statistics", "chunk_gradient", "shifted_statistics",
           "scale_for_fp16"]

# One chunk's views. Its inputs: ``scores`` (2, r, V), ``target_ids`` (2, r, 1), ``kept``
# (1, r, 1). Its per-row results (2, r, 1): ``at_target`` (the target's score), ``sums``
# (the rows' sums), ``kl_dots`` (the KL row dots, ``kl_dot_a`` and ``kl_dot_b`` the two
# passes'), ``normalisers`` (the softmax's), and ``inv_scale`` (r,) the fp16 scale's
# inverse (None elsewhere). Its output ``grad`` (2, r, V) or None. Its work buffers:
# ``work`` (2, r, V), the log-probabilities and then the gradient, ``work_a``, ``work_b``
# its passes; ``row_base`` (r, 1), ``P + h`` per row; ``probs`` (2, r, V), the
# probabilities, ``probs_a``, ``probs_b`` its passes.
Chunk = namedtuple("Chunk", "scores target_ids kept at_target sums kl_dots normalisers "
                             "inv_scale grad work work_a work_b row_base probs probs_a probs_b "
                             "kl_dot_a kl_dot_b")


def rows_torch(pairs, target, kept=None, *, from_logits, pcoef, h, eps_i, c1, need_grad=True,
               out=None, stats=None, fp16_target_max=FP16_TARGET_MAX, chunk_rows=0):
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

    Chunks of ``chunk_rows`` pairs (0: :func:`~rdrop_fairseq.ops.rows.chunk_rows_for`'s
    automatic budget); every op works on both passes at once where it can, because on a
    GPU each op is a kernel launch. Rows where ``kept`` (N,) is False (None: every row
    counts) get a gradient of 0 (their stats are left to the caller to mask). Without
    ``need_grad`` the
    gradient is neither computed nor allocated (``grad`` is None). ``out`` is a ``(2, N,
    V)`` buffer the chunks may overwrite (it may be ``pairs`` itself: a chunk is read
    before it is written): the gradient goes there, or, without ``need_grad``, the
    probabilities when it has the compute dtype. A float16 gradient is scaled per row
    pair so that its largest entry is near ``fp16_target_max`` (stats row 4 undoes it).
    ``stats``: a ``(5, N)`` buffer of the compute dtype that receives the statistics. The
    signature is the Triton kernel's (:func:`rdrop_fairseq.ops.impl.run_rows` calls both).
    """
    dtype = compute_dtype(pairs)
    vocab = pairs.size(2)
    device = pairs.device
    if kept is None:
        kept = torch.ones(pairs.size(1), dtype=torch.bool, device=device)
    if not chunk_rows:
        chunk_rows = chunk_rows_for(vocab, pairs, 0.0, need_grad)
    grad = None
    if need_grad:
        grad = out if out is not None else torch.empty(pairs.shape, dtype=pairs.dtype,
                                                       device=device)
    # the probabilities live in a buffer of the compute dtype that the chunk overwrites
    # anyway (the gradient's, or out) when there is one: half a chunk's temporaries
    host = grad if need_grad else out
    hosted = host if host is not None and host.dtype == dtype else None
    scale_fp16 = need_grad and pairs.dtype == torch.float16
    per_row, inv_scale, chunks = _chunks(pairs, target, kept, chunk_rows, grad, hosted,
                                         scale_fp16, dtype)
    # 0-dim operands, made on the device (a torch.tensor of a list would copy from the host)
    minus_eps, base, zero = (torch.full((), value, dtype=dtype, device=device)
                             for value in (-eps_i, pcoef + h, 0.0))
    for chunk in chunks:
        chunk_statistics(chunk, from_logits)
        if chunk.grad is not None:
            chunk_gradient(chunk, from_logits, h=h, pcoef=pcoef, c1=c1, minus_eps=minus_eps,
                           base=base, zero=zero,
                           fp16_target_max=fp16_target_max if scale_fp16 else None)
    result = shifted_statistics(per_row, inv_scale, from_logits, vocab)
    return grad, result if stats is None else stats.copy_(result)


def _chunks(pairs, target, kept, chunk_rows, grad, hosted, scale_fp16, dtype):
    """The per-row buffers (a tuple of the whole ``(4, 2, N, 1)`` and its four parts: the
    target's score, sums, dots, norms), the fp16 scales' inverses, and a :data:`Chunk` per
    ``chunk_rows`` row pairs, whose work buffers are made once, chunk-sized (the last chunk
    views their first rows), in the compute dtype ``dtype``. ``hosted``: a buffer of that
    dtype that holds the probabilities (the gradient's, or out)."""
    n, vocab = pairs.size(1), pairs.size(2)
    device = pairs.device
    index = target.view(1, n, 1).expand(2, n, 1)
    # per-row results are written into buffers made up front, and a chunk's temporaries
    # into chunk-sized ones made once: nothing chunk-sized is allocated in the loop
    per_row = torch.empty((4, 2, n, 1), dtype=dtype, device=device)
    at_target, sums, dots, norms = per_row.unbind(0)
    rows = min(chunk_rows, n)
    work = torch.empty((2, rows, vocab), dtype=dtype, device=device)
    probs = None if hosted is not None else torch.empty((2, rows, vocab), dtype=dtype,
                                                        device=device)
    row_base = torch.empty((rows, 1), dtype=dtype, device=device)  # a chunk's P + h
    # fp16: the factors that undo the gradient's scale, per row pair (1 elsewhere)
    inv_scale = torch.ones(n if scale_fp16 else 1, dtype=dtype, device=device)
    parts = [pairs.split(chunk_rows, 1), index.split(chunk_rows, 1),
             kept.view(1, n, 1).split(chunk_rows, 1), at_target.split(chunk_rows, 1),
             sums.split(chunk_rows, 1), dots.split(chunk_rows, 1), norms.split(chunk_rows, 1)]
    count = len(parts[0])
    parts.append(inv_scale.split(chunk_rows) if scale_fp16 else [None] * count)
    parts.append(grad.split(chunk_rows, 1) if grad is not None else [None] * count)
    parts.append(hosted.split(chunk_rows, 1) if hosted is not None else [None] * count)
    views = {}  # the chunk buffers' first r rows, by r
    chunks = []
    for x, t, k, at, sm, dot, norm, inv, g, held in zip(*parts):
        r = x.size(1)
        if r not in views:
            w = work if r == rows else work[:, :r]
            p = None if hosted is not None else probs if r == rows else probs[:, :r]
            views[r] = (w, *w.unbind(0), row_base[:r], p)
        lp, la, lb, base_r, p = views[r]
        if hosted is not None:
            p = held
        chunks.append(Chunk(x, t, k, at, sm, dot, norm, inv, g, lp, la, lb, base_r, p,
                            *p.unbind(0), *dot.unbind(0)))
    return (per_row, at_target, sums, dots, norms), inv_scale, chunks


def chunk_statistics(c, from_logits):
    """The statistics pass of one chunk: ``c.work`` the log-probabilities but for their
    per-row shift ``log s`` (from logits: ``x - m``, ``m`` the row's max), ``c.probs`` the
    probabilities, the target's score, the row sums, the softmax normaliser and the KL row
    dots ``sum pa d`` and ``sum pb d`` (``d = la - lb``, left in ``c.work_a``; the second
    dot is ``-KL(pb||pa)`` but for the shift)."""
    # the formulas' names: log-probabilities lp = (la, lb), probabilities p = (pa, pb),
    # the KL row dots ka, kb
    lp, la, lb, p, pa, pb = c.work, c.work_a, c.work_b, c.probs, c.probs_a, c.probs_b
    ka, kb = c.kl_dot_a, c.kl_dot_b
    if from_logits:
        m = torch.amax(c.scores, -1, keepdim=True)
        torch.sub(c.scores, m if m.dtype == lp.dtype else m.to(lp.dtype), out=lp)
    else:
        lp.copy_(c.scores)
    torch.gather(lp, -1, c.target_ids, out=c.at_target)
    torch.sum(lp, -1, keepdim=True, out=c.sums)
    torch.exp(lp, out=p)
    if from_logits:  # p = exp(x - m) / s
        torch.sum(p, -1, keepdim=True, out=c.normalisers)
        p.div_(c.normalisers)
    d = la.sub_(lb)  # la's storage now holds d (but for log sa - log sb)
    # the row dots sum pa d and sum pb d, their products in lb's storage, then one
    # pairwise sum each. nansum: 0 log 0 = 0, so a class whose probability is 0 in
    # the pass that weighs it adds nothing (0 * -inf, or -inf - -inf for a class both
    # passes rule out, is nan); one that the other pass rules out adds +inf
    torch.nansum(torch.mul(d, pa, out=lb), -1, keepdim=True, out=ka)
    torch.nansum(torch.mul(d, pb, out=lb), -1, keepdim=True, out=kb)  # = -Kb but for log s
    # a nan input (a diverged model) must not vanish from the KL as a 0 * inf would
    c.kl_dots.masked_fill_(torch.isnan(c.sums).any(0), math.nan)


def chunk_gradient(c, from_logits, *, h, pcoef, c1, minus_eps, base, zero,
                   fp16_target_max=None):
    """The gradient pass of one chunk, after :func:`chunk_statistics`: the gradient in
    ``c.work``'s storage (``log s`` cancels in ``d - Ka`` and ``d + Kb``), scaled per row
    pair where ``fp16_target_max`` is given, then written into ``c.grad`` with excluded rows 0.
    ``minus_eps``, ``base`` (``P + h``) and ``zero``: 0-dim operands on the device."""
    lp, la, lb, p, d = c.work, c.work_a, c.work_b, c.probs, c.work_a
    pa, pb, ka, kb = c.probs_a, c.probs_b, c.kl_dot_a, c.kl_dot_b
    if h != 0:
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
        torch.sub(ka, kb, out=c.row_base)
        torch.addcmul(base, c.row_base, zero, out=c.row_base)
        torch.add(c.row_base, lp, alpha=h, out=lp)
        torch.addcmul(minus_eps, lp, p, out=lp)
    else:
        torch.add(minus_eps, p, alpha=pcoef + h, out=lp)
    if h:  # - h pb, - h pa
        la.sub_(pb, alpha=h)
        lb.sub_(pa, alpha=h)
    if c1:
        lp.scatter_(-1, c.target_ids, -c1, reduce="add")
    if fp16_target_max is not None:
        scale_for_fp16(lp, c.inv_scale, fp16_target_max)
    # excluded rows: 0, whatever they held (where's out must have its compute dtype)
    if c.grad.dtype == lp.dtype:
        torch.where(c.kept, lp, zero, out=c.grad)
    else:
        c.grad.copy_(torch.where(c.kept, lp, zero, out=lp))


def shifted_statistics(per_row, inv_scale, from_logits, vocab):
    """The statistics ``(5, N)`` from the per-row buffers after the loop: from logits the
    log-probabilities are ``lp - log s``, so the target's score and the sums are shifted by
    it, and the dots by ``-+(log sa - log sb)`` (``sum pa (d - log sa + log sb) = dot_a -
    log sa + log sb``, as ``sum pa = 1``): exact opposites, whose rounding cancels in the
    KLs' sum. Then nll and smooth as minus the sums over both passes. ``per_row``: the
    buffer and its parts, as :func:`_chunks` made them."""
    per_row, at_target, sums, dots, norms = per_row
    n = per_row.size(2)
    dots[1].neg_()  # KL(pb||pa) = -sum pb d, but for log s
    if from_logits:
        log_s = norms.log_()
        at_target.sub_(log_s)
        sums.sub_(log_s, alpha=vocab)
        dots.sub_(log_s - log_s.flip(0))
    # nll and smooth: -(the sum over both passes)
    both = per_row[:2].sum(1).neg_()
    return torch.cat([both.view(2, n), dots.view(2, n), inv_scale.expand(1, n)])


def scale_for_fp16(g, inv_scale, target_max=FP16_TARGET_MAX):
    """Scale each row pair of ``g`` (2, r, V) in place by a power of two so that its largest
    entry is near ``target_max``; write the inverse scales into ``inv_scale``."""
    # max |g| as max(max g, -min g): no chunk-sized temporary beyond the chunk budget
    biggest = torch.maximum(g.amax(dim=(0, 2)), g.amin(dim=(0, 2)).neg_())
    biggest.clamp_min_(torch.finfo(torch.float32).tiny)
    exponent = torch.floor(torch.log2(target_max / biggest)).clamp_(-24.0, 24.0)
    g.mul_(torch.exp2(exponent).view(1, -1, 1))
    torch.exp2(-exponent, out=inv_scale)
