"""What every front end of R-Drop checks the same way: the fairseq criteria, the Hugging Face
trainers, :func:`rdrop_fairseq.hf.rdrop_hf_loss` and the plain-PyTorch functions.

* :func:`non_negative`: alpha and the chunk budget, finite numbers >= 0;
* :data:`IMPLS`: the implementations of the fused loss (whether this run can use one is
  :func:`rdrop_fairseq.ops.impl.check_impl`'s question: the implementations live there);
* :func:`has_dropout`: whether the model's two passes can differ at all;
* :func:`check_every` and :func:`runs_rdrop`: R-Drop on one optimizer update in K.

Each caller passes the option's name as its user typed it (``--rdrop-alpha``,
``rdrop_alpha``, ``alpha``), so that an error names what to change. Nothing here imports
fairseq, transformers, or anything of the package: it is the floor the others stand on.
"""

import math

import torch

__all__ = ["IMPLS", "non_negative", "has_dropout", "check_every", "runs_rdrop"]

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


def check_every(value, option=None):
    """``value``, R-Drop's period in optimizer updates, as an int >= 1; a ValueError
    ``"{option} must be a whole number >= 1 (...), got {value!r}"`` where it is not (a bool,
    2.5, 0). Without ``option`` the message starts at "must" (argparse names the flag)."""
    try:
        whole = not isinstance(value, bool) and float(value) == int(value)
        every = int(value) if whole else None
    except (TypeError, ValueError, OverflowError):
        every = None
    if every is None or every < 1:
        name = f"{option} " if option else ""
        raise ValueError(f"{name}must be a whole number >= 1 (R-Drop on one update in K; 1: "
                         f"every update), got {value!r}")
    return every


def runs_rdrop(update, every):
    """Whether optimizer update number ``update`` (0, 1, ...: the same number for every
    micro-batch of an update and on every process) runs R-Drop when it runs on one update
    in ``every``: the updates 0, K, 2K, ... A Python int: nothing waits for the GPU."""
    return every == 1 or update % every == 0


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
