"""Let fairseq checkpoints load under torch >= 2.6 without disabling weights-only loading.

torch 2.6 made ``torch.load(weights_only=True)`` the default; fairseq 0.12 calls
``torch.load`` without the argument, and its checkpoints hold a few plain-Python objects
that the weights-only unpickler refuses. We allow exactly those, nothing more:

* ``argparse.Namespace``: ``cfg.model`` of every model trained from the command line;
* numpy arrays, dtypes and scalars: the metric state saved in ``extra_state`` (e.g. the
  BLEU n-gram counts of ``--eval-bleu``) and a numpy ``best`` score
  (``--best-checkpoint-metric bleu``).
"""

import argparse

import numpy as np
import torch


def fairseq_checkpoint_globals():
    """The globals a fairseq 0.12 checkpoint may contain besides tensors."""
    # numpy < 2 pickles these as numpy.core.multiarray.*; numpy 2 moved them to numpy._core
    if int(np.__version__.split(".")[0]) >= 2:
        from numpy._core import multiarray
    else:
        from numpy.core import multiarray
    # unpickling an array or scalar also builds its dtype's class (numpy >= 1.25:
    # numpy.dtypes.Int64DType, ...); fairseq stores only numeric ones
    numeric = ("bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32",
               "uint64", "float16", "float32", "float64")
    dtype_classes = {type(np.dtype(name)) for name in numeric} - {np.dtype}
    return [argparse.Namespace, np.ndarray, np.dtype, multiarray._reconstruct,
            multiarray.scalar, *sorted(dtype_classes, key=lambda c: c.__name__)]


def allow_fairseq_checkpoint_globals():
    """Add :func:`fairseq_checkpoint_globals` to torch's weights-only allow-list."""
    add = getattr(torch.serialization, "add_safe_globals", None)
    if add is not None:  # torch < 2.4 has no weights-only default to work around
        add(fairseq_checkpoint_globals())
