"""The fairseq machinery that AttendOut's schedule (:mod:`.sentence_prediction_attendout`)
works through: where fairseq's optimizer keeps the fp32 master copies and the per-parameter
state that D <- A copies (:func:`fp32_masters`, :func:`fp32_master_views`,
:func:`copy_optimizer_state`), the data-parallel wrapper's ``no_sync``, and the
classification heads' outputs in a step (:class:`HeadOutputs`).
"""

from contextlib import nullcontext

import torch


def no_sync(model):
    """fairseq's DDP wrapper's ``no_sync`` (gradients kept on each process until a later
    backward reduces them); nothing to hold back for a model on one process."""
    hold = getattr(model, "no_sync", None)
    return hold() if hold is not None else nullcontext()


def fp32_masters(optimizer):
    """Where fairseq's FP16Optimizer keeps the fp32 master copy of each model parameter:
    ``None`` without masters (fp32, --amp, --memory-efficient-fp16); ``("list", {id(model
    parameter): its master})`` (--bf16, which fairseq never flattens, or --fp16 with
    --fp16-no-flatten-grads); ``("flat", flat master, {id(model parameter): its slice})``
    (--fp16: the parameters one after another in one flat tensor).

    A flat master per device (fairseq's pipeline parallelism: one model over several
    devices) raises: AttendOut's model is on one device per process."""
    masters = getattr(optimizer, "fp32_params", None)
    params = getattr(optimizer, "fp16_params", None)
    if masters is None or params is None:
        return None
    if isinstance(masters, list):
        return "list", {id(p): m for p, m in zip(params, masters)}
    if isinstance(masters, dict):
        if len(masters) != 1:
            raise ValueError(
                f"AttendOut needs one flat fp32 master, got {len(masters)} (one per device: "
                "pipeline parallelism); AttendOut's model is on one device per process")
        masters = next(iter(masters.values()))
    slices, offset = {}, 0
    for p in params:
        slices[id(p)] = slice(offset, offset + p.numel())
        offset += p.numel()
    if offset != masters.numel():
        raise ValueError(f"the flat fp32 master holds {masters.numel()} values, the model's "
                         f"parameters {offset}")
    return "flat", masters, slices


def copy_optimizer_state(optimizer, pairs):
    """Copy the per-parameter optimizer state (Adam's moments) of each ``(attacker, defender)``
    parameter pair, wherever fairseq's optimizer keeps it (:func:`fp32_masters`): keyed by
    the model's parameters, by their fp32 master copies, or in slices of one flat master."""
    state = optimizer.optimizer.state
    masters = fp32_masters(optimizer)
    if masters is not None and masters[0] == "flat":
        _, flat, slices = masters
        with torch.no_grad():
            for value in state.get(flat, {}).values():
                if torch.is_tensor(value) and value.numel() == flat.numel():
                    for a, d in pairs:
                        value[slices[id(d)]] = value[slices[id(a)]]
        return
    keys = {} if masters is None else masters[1]
    for a, d in pairs:
        a, d = keys.get(id(a), a), keys.get(id(d), d)
        if a in state:
            state[d] = {k: v.clone() if torch.is_tensor(v) else v for k, v in state[a].items()}


def fp32_master_views(optimizer):
    """``{id(model parameter): its fp32 master copy}`` for fairseq's FP16Optimizer (flat or
    not; :func:`fp32_masters`); None for optimizers without masters (fp32, --amp,
    --memory-efficient-fp16)."""
    masters = fp32_masters(optimizer)
    if masters is None:
        return None
    if masters[0] == "list":
        return {key: m.data for key, m in masters[1].items()}
    _, flat, slices = masters
    params = {id(p): p for p in optimizer.fp16_params}
    return {key: flat.data[s].view_as(params[key]) for key, s in slices.items()}


class HeadOutputs:
    """Within ``with``: the classification head's outputs of the attacker and of the
    defender (forward hooks), as ``outputs``: ``(attacker logits, defender logits)``,
    copied (``B x classes``) before the criterion can reuse their buffer (R-Drop's loss
    writes the logits' gradient into it)."""

    def __init__(self, model, head):
        self.heads = (model.classification_heads[head], model.defender.classification_heads[head])
        self.outputs = [None, None]

    def __enter__(self):
        self.hooks = [head.register_forward_hook(
            lambda module, args, out, i=i: self.outputs.__setitem__(i, out.detach().clone()))
            for i, head in enumerate(self.heads)]
        return self

    def __exit__(self, *exc):
        for hook in self.hooks:
            hook.remove()
