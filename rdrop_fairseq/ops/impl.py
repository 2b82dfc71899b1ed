"""The one door to the row-pair computation: which implementation runs a call
(:func:`check_impl`, :func:`resolve_impl`), the call itself (:func:`run_rows`, one
signature for both implementations) and the fall-back (:func:`run_with_fallback`).

``impl`` is one of :data:`~rdrop_fairseq.options.IMPLS`: ``"torch"`` (the chunked torch
ops, :mod:`.rows_torch`), ``"triton"`` (the kernel, :mod:`.rows_triton`: CUDA tensors, or
CPU tensors under ``TRITON_INTERPRET=1``) or ``"auto"``: the kernel on CUDA where triton
imports, the torch ops elsewhere. Where ``"auto"`` chose the kernel and it fails to compile
or launch on a device (Triton's support starts at compute capability 8.0; a V100 is 7.0),
that device gets the torch implementation, then and from then on, with one warning.
"""

import os
import warnings

import torch

from ..options import IMPLS
from .rows import FP16_TARGET_MAX
from .rows_torch import rows_torch

__all__ = ["check_impl", "resolve_impl", "run_rows", "run_with_fallback"]

# Devices (e.g. "cuda:0") on which impl="auto" gave up the Triton kernel, and why: triton
# is not installed, or the kernel failed to compile or launch there. The torch
# implementation computes the same loss.
_TRITON_GIVEN_UP = {}


def _spelled(option, value):
    """``value`` of ``option`` as its user writes it: ``--rdrop-impl triton`` on a command
    line, ``rdrop_impl 'triton'`` as a keyword."""
    return f"{option} {value}" if option.startswith("--") else f"{option} {value!r}"


def check_impl(impl, option="impl", cpu_option=None, tensor=None):
    """``impl`` if it is one of :data:`IMPLS` and can run here; else a ValueError naming
    ``option`` as its user typed it (``--rdrop-impl``, ``rdrop_impl``, ``impl``) and what
    to use instead. ``triton`` needs the triton package, and a CUDA GPU
    (CUDA tensors, where ``tensor`` says what a call runs on) unless ``TRITON_INTERPRET=1``
    runs Triton's interpreter on the CPU (the tests'). ``cpu_option``: the caller's option
    that put this run on the CPU (``--cpu``, ``use_cpu``), where it is set."""
    if impl not in IMPLS:
        raise ValueError(f"{option} must be one of {', '.join(IMPLS)}, got {impl!r}")
    if impl != "triton":
        return impl
    from .rows_triton import triton_available

    asked = _spelled(option, impl)
    other = " or ".join(_spelled(option, name) for name in ("auto", "torch"))
    if not triton_available():
        raise ValueError(f"{asked} needs the triton package (pip install triton; it ships "
                         f"with torch's CUDA wheels); use {other}")
    if os.environ.get("TRITON_INTERPRET") == "1":
        return impl
    if cpu_option:
        raise ValueError(f"{asked} needs a CUDA GPU, and {cpu_option} trains on the CPU: use "
                         f"{other} (the torch implementation on the CPU), or drop {cpu_option}")
    if tensor is not None and not tensor.is_cuda:
        raise ValueError(f"{asked} needs CUDA tensors, or TRITON_INTERPRET=1 (set before the "
                         "kernel is imported) to run Triton's interpreter on CPU tensors; "
                         f"got a tensor on {tensor.device}")
    if tensor is None and not torch.cuda.is_available():
        raise ValueError(f"{asked} needs a CUDA GPU, and none is available: use {other} "
                         "(the torch implementation on the CPU)")
    return impl


def resolve_impl(impl, tensor):
    """``"torch"`` or ``"triton"``: what ``impl`` means for a call on ``tensor``; a
    ValueError where ``impl`` is unknown, or ``"triton"`` cannot run on ``tensor``."""
    check_impl(impl, tensor=tensor)
    if impl == "auto":
        if not _kernel_device(tensor) or str(tensor.device) in _TRITON_GIVEN_UP:
            return "torch"
        from .rows_triton import triton_available

        if not triton_available():
            _give_up_triton(str(tensor.device), "triton is not installed: pip install triton")
            return "torch"
        return "triton"
    return impl


def run_with_fallback(impl, tensor, run):
    """``run(impl)`` with ``impl`` resolved for ``tensor``; where ``"auto"`` chose the
    Triton kernel and the kernel fails to compile or launch on this device
    (:class:`~rdrop_fairseq.ops.rows_triton.TritonKernelError`, raised before it writes
    anything), runs the torch implementation, then and from then on, with one warning.
    Any other error is raised, and so is the kernel's with ``impl="triton"``."""
    resolved = resolve_impl(impl, tensor)
    if impl != "auto" or resolved != "triton":
        return run(resolved)
    from .rows_triton import TritonKernelError

    try:
        return run("triton")
    except TritonKernelError as error:
        reason = f"its Triton kernel failed: {error}"
    result = run("torch")
    _give_up_triton(str(tensor.device), reason)
    return result


def run_rows(impl, pairs, target, kept=None, *, from_logits, pcoef, h, eps_i, c1,
             need_grad=True, out=None, stats=None, fp16_target_max=FP16_TARGET_MAX,
             chunk_rows=0):
    """``(grad, stats)`` of the row pairs ``pairs`` (2, N, V) by the implementation
    ``impl`` (``"torch"`` or ``"triton"``, as :func:`resolve_impl` gives it): the one
    call of the row op, whose parameters are those of both implementations
    (:func:`~rdrop_fairseq.ops.rows_torch.rows_torch`,
    :func:`~rdrop_fairseq.ops.rows_triton.rdrop_rows_triton`; :mod:`.rows` is their
    contract). ``chunk_rows`` sizes the torch implementation's chunks (0: automatic); the
    kernel, one launch, has none."""
    options = dict(from_logits=from_logits, pcoef=pcoef, h=h, eps_i=eps_i, c1=c1,
                   need_grad=need_grad, out=out, stats=stats,
                   fp16_target_max=fp16_target_max, chunk_rows=chunk_rows)
    if impl == "triton":
        from .rows_triton import rdrop_rows_triton

        return rdrop_rows_triton(pairs, target, kept, **options)
    if impl != "torch":
        raise ValueError(f"run_rows takes impl 'torch' or 'triton' (resolve_impl gives one), "
                         f"got {impl!r}")
    return rows_torch(pairs, target, kept, **options)


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
