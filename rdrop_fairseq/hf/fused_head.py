"""What the fused path installs on a language-model head: :class:`FusedHead`, which replaces
the output embedding's forward, once, and keeps its own forward hook last among the head's
hooks; and :func:`fused_call`, the context in which that forward computes R-Drop's loss
instead of the logits. The loss itself is :mod:`.loss`'s; the kind probe (:mod:`.kind`)
reads only whether a head carries a :class:`FusedHead`."""

import contextlib
import contextvars

import torch

__all__ = ["FusedHead", "FusedCall", "fused_call"]

# The fused R-Drop forward this thread (this context) is inside: what the output embedding's
# forward computes while it is set (:class:`FusedHead`)
_ACTIVE = contextvars.ContextVar("rdrop_fused_head_call", default=None)


class FusedCall:
    """One fused forward's request and results: the head it is for, what computes R-Drop's
    loss from the hidden states, the results, and the head's output as its hooks leave it."""

    def __init__(self, head, compute):
        self.head, self.compute, self.results, self.returned = head, compute, [], []


class FusedHead:
    """What the fused path installs on an output embedding, once: its instance ``forward``
    and a forward hook kept last among the head's hooks. Called outside a fused R-Drop
    forward, the forward is the head's own; inside one (this thread's :func:`fused_call`), it
    computes R-Drop's loss from the hidden states it receives and returns it as a 1-element
    stand-in for the logits, and the hook takes that stand-in as the other hooks leave it
    (DeepSpeed ZeRO-3's turn it into a tensor whose backward gathers the weight again). So
    no per-call state lives on the module: overlapping calls from other threads, and plain
    calls of the model, see the head's own forward. Both run outside ``torch.compile``'s
    graphs (a graph break at the head), so that a compiled model takes the fused path."""

    def __init__(self, head):
        self.head = head
        self.hook = head.register_forward_hook(self.record)

    @classmethod
    def on(cls, head):
        """The head's :class:`FusedHead`, installed if it has none, its hook made last."""
        installed = vars(head).get("forward")
        if not isinstance(installed, cls):
            installed = cls(head)
            head.forward = installed
        # after the hooks registered since (a DeepSpeed engine made after an earlier step)
        head._forward_hooks.move_to_end(installed.hook.id)
        return installed

    @torch.compiler.disable
    def __call__(self, hidden, *args, **kwargs):
        call = _ACTIVE.get()
        if call is None or call.head is not self.head:
            return type(self.head).forward(self.head, hidden, *args, **kwargs)
        return call.compute(hidden)

    @torch.compiler.disable
    def record(self, module, args, output):
        call = _ACTIVE.get()
        if call is not None and call.head is module:
            call.returned.append(output)


@contextlib.contextmanager
def fused_call(head, compute):
    """Inside it, this thread's calls of ``head`` return ``compute(hidden states)`` (R-Drop's
    loss as a stand-in for the logits); yields the :class:`FusedCall` that collects what
    ``compute`` appends to its ``results`` and the head's output as its hooks leave it."""
    FusedHead.on(head)
    call = FusedCall(head, compute)
    token = _ACTIVE.set(call)
    try:
        yield call
    finally:
        _ACTIVE.reset(token)
