"""What every front end of R-Drop checks the same way: the fairseq criteria, the Hugging Face
trainers, :func:`rdrop_fairseq.hf.rdrop_hf_loss` and the plain-PyTorch functions.

* :func:`non_negative`: alpha and the chunk budget, finite numbers >= 0;
* :func:`check_impl`: the implementation (:data:`IMPLS`), and whether this run can use it;
* :func:`has_dropout`: whether the model's two passes can differ at all.

Each caller passes the option's name as its user typed it (``--rdrop-impl``, ``rdrop_impl``,
``impl``), so that an error names what to change. Nothing here imports fairseq or
transformers.
"""

import math
import os

import torch

__all__ = ["IMPLS", "non_negative", "check_impl", "has_dropout"]

# the implementations of the fused loss: "auto" is the Triton kernel on CUDA (where triton
# imports and the kernel runs), the chunked torch ops elsewhere
IMPLS = ("auto", "torch", "triton")


def non_negative(value, option=None, advice=""):
    """``value`` as a float; a ValueError ``"{option} must be a finite number >= 0, got
    {value}{advice}"`` where it is not a number (a bool is not), is negative, NaN or
    infinite. Without
    ``option`` the message starts at "must" (argparse names the flag itself)."""
    try:  # a bool is no number here (True would be taken as 1.0)
        number = math.nan if isinstance(value, bool) else float(value)
    except (TypeError, ValueError):
        number = math.nan
    if not number >= 0 or math.isinf(number):
        name = f"{option} " if option else ""
        raise ValueError(f"{name}must be a finite number >= 0, got {value}{advice}")
    return number


def _spelled(option, value):
    """``value`` of ``option`` as its user writes it: ``--rdrop-impl triton`` on a command
    line, ``rdrop_impl 'triton'`` as a keyword."""
    return f"{option} {value}" if option.startswith("--") else f"{option} {value!r}"


def check_impl(impl, option="impl", cpu_option=None, tensor=None):
    """``impl`` if it is one of :data:`IMPLS` and can run here; else a ValueError naming
    ``option`` and what to use instead. ``triton`` needs the triton package, and a CUDA GPU
    (CUDA tensors, where ``tensor`` says what a call runs on) unless ``TRITON_INTERPRET=1``
    runs Triton's interpreter on the CPU (the tests'). ``cpu_option``: the caller's option
    that put this run on the CPU (``--cpu``, ``use_cpu``), where it is set."""
    if impl not in IMPLS:
        raise ValueError(f"{option} must be one of {', '.join(IMPLS)}, got {impl!r}")
    if impl != "triton":
        return impl
    from .ops.rows_triton import triton_available

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


def has_dropout(model, dropout_types=(), config=None):
    """Whether any dropout can make the two halves of ``[x; x]`` differ: a torch dropout
    module, or one of ``dropout_types`` (a framework's own, fairseq's ``FairseqDropout``),
    with ``p > 0``; or a dropout probability > 0 among ``config``'s values (a mapping: a
    model configuration whose attention functions apply their dropout themselves; keys
    holding "dropout" or "pdrop"). LayerDrop cannot: it drops the same layers for the whole
    batch."""
    types = (torch.nn.modules.dropout._DropoutNd, *dropout_types)
    if any(isinstance(m, types) and m.p > 0 for m in model.modules()):
        return True
    return any(("dropout" in key or "pdrop" in key) and isinstance(value, (int, float))
               and not isinstance(value, bool) and value > 0
               for key, value in (config or {}).items())
