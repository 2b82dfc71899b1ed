"""Which implementation of the row-pair computation runs a call, and the fall-back.

``impl`` is one of :data:`~rdrop_fairseq.options.IMPLS`: ``"torch"`` (the chunked torch
ops, :mod:`.rows_torch`), ``"triton"`` (the kernel, :mod:`.rows_triton`: CUDA tensors, or
CPU tensors under ``TRITON_INTERPRET=1``) or ``"auto"``: the kernel on CUDA where triton
imports, the torch ops elsewhere. Where ``"auto"`` chose the kernel and it fails to compile
or launch on a device (Triton's support starts at compute capability 8.0; a V100 is 7.0),
that device gets the torch implementation, then and from then on, with one warning.
"""

import warnings

import torch

from ..options import check_impl

__all__ = ["resolve_impl", "run_with_fallback"]

# Devices (e.g. "cuda:0") on which impl="auto" gave up the Triton kernel, and why: triton
# is not installed, or the kernel failed to compile or launch there. The torch
# implementation computes the same loss.
_TRITON_GIVEN_UP = {}


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
