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
import functools
import io

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


# ---------------------------------------------------------------- several processes
#
# With several data-parallel processes fairseq reads a checkpoint (checkpoint_last.pt,
# --restore-file, --finetune-from-model) on process 0 only and sends what it loaded to the
# others: ``Trainer.load_checkpoint`` -> ``distributed.utils.broadcast_object``, whose
# ``_broadcast_object_slow`` pickles it with ``torch.save`` on process 0 and unpickles it
# with ``torch.load`` on the others. By then ``checkpoint_utils.load_checkpoint_to_cpu`` has
# turned the file's plain ``cfg`` dict into an omegaconf ``DictConfig`` (and
# ``broadcast_object`` has put its own ``_TensorPlaceholder``s in place of the tensors), which
# torch >= 2.6's weights-only default refuses: every process but 0 stopped with
# "Unsupported global: GLOBAL omegaconf.dictconfig.DictConfig".
#
# Those bytes are not a file: process 0 of the same job pickled them a moment ago, from a
# checkpoint it loaded itself with the weights-only allow-list above. So the receiving side
# of that one function unpickles them fully, as torch < 2.6 did; nothing else changes
# (files are still loaded weights-only, with the same allow-list).


def receive_broadcast_objects(src_rank, group, dist_device):
    """The receiving side of fairseq's ``_broadcast_object_slow`` (its wire format: the
    length, then the bytes of ``torch.save``), unpickled fully: the sender is process
    ``src_rank`` of this job."""
    from fairseq.distributed import utils as distributed_utils

    length = torch.LongTensor([0]).to(dist_device)
    distributed_utils.broadcast(length, src=src_rank, group=group)
    buffer = torch.ByteTensor(int(length.item())).to(dist_device)
    distributed_utils.broadcast(buffer, src=src_rank, group=group)
    return torch.load(io.BytesIO(buffer.cpu().numpy()), map_location="cpu",
                      weights_only=False)  # from process src_rank of this job, not a file


def trust_broadcasts_within_the_job():
    """Make fairseq's processes receive what process 0 broadcasts (a loaded checkpoint's
    state, ``broadcast_tensors``' metadata) with :func:`receive_broadcast_objects`; its
    sending side stays fairseq's. Idempotent."""
    from fairseq.distributed import utils as distributed_utils

    send = distributed_utils._broadcast_object_slow  # fairseq 0.12's name
    if getattr(send, "receives_fully", False):
        return

    @functools.wraps(send)
    def broadcast_object_slow(obj, src_rank, group, dist_device):
        if distributed_utils.get_rank(group) == src_rank:
            return send(obj, src_rank, group, dist_device)
        return receive_broadcast_objects(src_rank, group, dist_device)

    broadcast_object_slow.receives_fully = True
    distributed_utils._broadcast_object_slow = broadcast_object_slow
