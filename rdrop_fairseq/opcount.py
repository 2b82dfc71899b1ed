"""Count the aten ops that code dispatches, and the ones that make a GPU wait for the host.

On CUDA nearly every dispatched op is at least one kernel launch, and a few ops force the
host to wait for the device (a value read back, or an output whose size depends on the
data). Both are visible on CPU through torch's dispatcher, so a training step can be
checked for launches and syncs without a GPU::

    from rdrop_fairseq.opcount import count_ops
    with count_ops() as ops:
        loss, sample_size, log = criterion(model, sample)
        loss.backward()
    print(ops.total, ops.syncing)

:class:`LiveBytes` tracks the bytes of the tensor storages that ops allocate, and their
peak, the same way (what a step allocates, on any device, without the allocator's stats).
"""

import contextlib
import weakref
from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

# Ops that synchronise with the host on CUDA: reading a value back (.item(), bool(), int(),
# float(), Python branching on a tensor), comparing whole tensors, and ops whose output size
# depends on the data.
SYNCING_OPS = frozenset({
    "aten._local_scalar_dense",
    "aten.equal",
    "aten.is_nonzero",
    "aten.nonzero",
    "aten.masked_select",
    "aten.unique_consecutive",
    "aten._unique2",
    "aten._unique",
    "aten.unique_dim",
    "aten.repeat_interleave",
})


class count_ops(TorchDispatchMode):
    """Context manager counting dispatched aten ops (``total``, ``by_op``) and syncing ones
    (``syncing``: a Counter of op names; boolean-mask indexing counts as ``aten.index``)."""

    def __init__(self):
        super().__init__()
        self.by_op = Counter()
        self.syncing = Counter()
        self._inside = 0

    @contextlib.contextmanager
    def as_one(self, name):
        """Count what runs inside as the one op ``name``: a kernel that is one launch on a
        GPU but runs as torch ops here (a Triton kernel in Triton's interpreter)."""
        self.by_op[name] += 1
        self._inside += 1
        try:
            yield
        finally:
            self._inside -= 1

    @property
    def total(self):
        return sum(self.by_op.values())

    @property
    def n_syncing(self):
        return sum(self.syncing.values())

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self._inside:
            return func(*args, **(kwargs or {}))
        name = func.overloadpacket.__qualname__ if hasattr(func, "overloadpacket") else str(func)
        name = "aten." + name.split(".")[-1] if not name.startswith("aten.") else name
        self.by_op[name] += 1
        if name in SYNCING_OPS or (name in ("aten.index", "aten.index_put", "aten.index_put_")
                                   and _has_bool_index(args)):
            self.syncing[name] += 1
        return func(*args, **(kwargs or {}))


def _has_bool_index(args):
    indices = args[1] if len(args) > 1 else ()
    return any(torch.is_tensor(i) and i.dtype in (torch.bool, torch.uint8)
               for i in (indices or ()))


class LiveBytes(TorchDispatchMode):
    """The bytes of the storages that ops allocate while active (``live``), and their
    ``peak``: a storage counts from the op that makes it until it is freed. An output that
    shares an input's storage (a view, an in-place or ``out=`` result) is no allocation: a
    view of a weight made before the measurement (``F.linear`` transposes its weight) does
    not count, nor does an optimizer step writing into the parameters."""

    def __init__(self):
        super().__init__()
        self.live = self.peak = 0
        self.storages = set()

    def _freed(self, key, nbytes):
        self.live -= nbytes
        self.storages.discard(key)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        inputs = {t.untyped_storage().data_ptr()
                  for t in tree_flatten((args, kwargs))[0] if torch.is_tensor(t)}
        for t in tree_flatten(out)[0]:
            if (torch.is_tensor(t) and t.untyped_storage().data_ptr() not in self.storages
                    and t.untyped_storage().data_ptr() not in inputs):
                storage = t.untyped_storage()
                self.storages.add(storage.data_ptr())
                self.live += storage.nbytes()
                self.peak = max(self.peak, self.live)
                weakref.finalize(storage, self._freed, storage.data_ptr(), storage.nbytes())
        return out
