"""R-Drop's training loss of one batch of a Hugging Face model: everything a batch touches.

:func:`rdrop_hf_loss` doubles the batch (:func:`doubled_batch`; an encoder-decoder model's
decoder inputs made from its labels first, :func:`decoder_inputs`), runs the model once on
``[x; x]`` and computes the loss through the logits (:func:`rdrop_fairseq.core.rdrop_loss`)
or, with ``fused_linear``, inside the output embedding's own call from the hidden states it
receives (:func:`rdrop_fairseq.fused_linear.fused_linear_rdrop_loss`). Labels are checked
against the head (shapes always, values on the first batch, then on the device without
waiting); the sum is divided by the labelled items of one pass (:func:`labelled_items`).
"""

import math
from collections import namedtuple
from collections.abc import Mapping

import torch
import torch.nn.functional as F

from ..core import RDropBatchError, duplicate_net_input, mse_consistency, rdrop_loss
from ..fused_linear import fused_linear_rdrop_loss
from ..options import check_every, runs_rdrop
from .fused_head import fused_call
from .model import (IGNORE_INDEX, decoder_inputs, head_module, logits_bias, logits_of,
                    router_loss, takes, unwrap)

__all__ = ["RDropHFLoss", "rdrop_hf_loss", "plain_hf_loss", "labelled_items", "doubled_batch",
           "decoder_inputs", "batch_labels", "SPAN_LABELS"]

# A question-answering head's labels: the positions where the answer starts and ends
SPAN_LABELS = ("start_positions", "end_positions")

# Batch entries that hold images or videos in the order they appear in the batch (Qwen-VL's
# flattened patches with their grids, LLaVA's images, Idefics' per-example stacks): [x; x]
# shows them again in that order, so they are repeated along dim 0 whatever its size
_VISUAL_PREFIXES = ("pixel_values", "pixel_attention_mask", "image_", "video_",
                    "second_per_grid_ts")

RDropHFLoss = namedtuple("RDropHFLoss", "loss outputs nll kl items correct entropy")
RDropHFLoss.__doc__ = """Result of :func:`rdrop_hf_loss`. ``loss``: what to call
``backward()`` on; ``outputs``: the model's output for ``[x; x]`` (its ``logits`` a stand-in
on the fused path); for logging, detached and not synchronised: ``nll``, the plain
cross-entropy of both passes summed over the labelled items (the squared errors for
regression), ``kl``, the symmetric KL summed over them (regression: the squared difference),
``items``, the labelled items of one pass in this batch, ``correct``, the labelled items
of both passes whose highest logit is the label (with ``accuracy=True``, else None), and
``entropy``, the entropy of the predicted distribution summed over the labelled items of
both passes (with ``accuracy=True`` through the logits; None through the fused path,
which makes no logits)."""

# what a path of the loss returns: the model's outputs, the differentiable sum, and the
# logged figures (see RDropHFLoss)
_Computed = namedtuple("_Computed", "outputs total nll kl correct entropy")


def labelled_items(labels, causal=False):
    """Labelled items of one pass in ``labels`` (:func:`batch_labels`), as a tensor (no
    host-device sync): for float labels every entry (a regression's examples, a
    multi-label head's labels of each example), else labels other than -100 (for a
    causal LM, from the second position on: the model predicts token t+1 at t; for a
    question-answering head, the start and end positions inside the sequence)."""
    if labels.is_floating_point():
        return torch.full((), labels.numel(), device=labels.device)  # a fill: no copy
    if causal:
        labels = labels[..., 1:]
    return labels.ne(IGNORE_INDEX).sum()


def rdrop_hf_loss(model, inputs, *, kind, alpha=1.0, label_smoothing=0.0,
                  num_items_in_batch=None, world_size=1, impl="auto", fused_linear=False,
                  chunk_mb=0.0, grad_in_scores="auto", check_labels=False, accuracy=False,
                  accumulation_steps=1, every=1, update=None, pass_mean=False):
    """R-Drop's training loss of one batch of a Hugging Face model (the trainers' own code),
    for a loop of your own::

        kind = model_kind(model)                      # once, before training
        out = rdrop_hf_loss(model, batch, kind=kind, alpha=1.0)
        out.loss.backward()

    ``inputs``: the batch as the model takes it, with ``labels`` (-100: no loss), or a
    question-answering head's ``start_positions`` and ``end_positions``. ``kind``:
    :func:`~rdrop_fairseq.hf.kind.model_kind`'s answer. ``label_smoothing``: Hugging Face's
    factor (``f / V`` on every class). ``num_items_in_batch``: what the sum is divided by,
    the labelled items of one pass (:func:`labelled_items`) summed over the accumulated
    micro-batches and the processes; None: this batch's. ``world_size``: the processes
    whose gradients DDP averages when the count is over all of them (the loss is multiplied
    by it, so that the average is the whole batch's gradient). ``accumulation_steps``: the
    micro-batches whose gradients add up to one update, when ``num_items_in_batch`` counts
    them all (a mixture of experts' router loss, a mean per micro-batch, is divided by it,
    and not multiplied by ``world_size``: DDP's average of the processes' means is the
    whole batch's). ``impl``, ``fused_linear``, ``chunk_mb``: as the trainers' ``rdrop_*``
    options. ``grad_in_scores``: as :func:`rdrop_fairseq.core.rdrop_loss`; by default the
    logits' buffer may take their gradient, so pass False to read ``outputs.logits``
    afterwards. ``check_labels``: check on the host that the labels are class indices of
    the head (it waits for the device: the first batch's); later batches are checked on the
    device without waiting. ``accuracy``: also count the labelled items whose highest logit
    is the label (``correct``) and, through the logits, sum their entropy (one more pass
    over the logits, a chunk of rows at a time). With every dropout off the two passes are
    the same and the KL is 0.

    ``every``: R-Drop on one optimizer update in K (the updates 0, K, 2K, ...); the others
    are :func:`plain_hf_loss`'s one pass. ``update`` is then required: the number of the
    optimizer update this batch belongs to, counted from 0 (a Trainer's
    ``state.global_step``), the same for every micro-batch of the update and on every
    process, and carried on across a resume. ``pass_mean``: an R-Drop update's loss is the
    mean of the two passes' instead of their sum (halved), so that its gradient has a
    one-pass update's scale; the paper sums."""
    if every != 1:
        every = check_every(every, "every")
        if update is None:
            raise ValueError(f"rdrop_hf_loss: every={every} needs update=, the number of the "
                             "optimizer update this batch belongs to (0, 1, ...; the same for "
                             "every micro-batch of one update and on every process)")
        if not runs_rdrop(update, every):
            return plain_hf_loss(model, inputs, kind=kind, label_smoothing=label_smoothing,
                                 num_items_in_batch=num_items_in_batch, world_size=world_size)
    labels = _checked_labels(inputs)
    doubled = doubled_batch(_model_inputs(model, inputs, labels, kind), labels.size(0))
    # a causal LM predicts token t+1 at position t: the target of t is labels[t + 1]
    target = _shifted(labels) if kind == "causal" else labels
    options = dict(alpha=alpha, smoothing=label_smoothing, impl=impl, accuracy=accuracy,
                   check_labels=check_labels)
    if fused_linear:
        got = _through_fused_head(model, doubled, target, chunk_mb=chunk_mb, **options)
    else:
        got = _through_logits(model, doubled, target, grad_in_scores=grad_in_scores, **options)
    items = labelled_items(labels, causal=kind == "causal")
    count = items if num_items_in_batch is None else num_items_in_batch
    loss = got.total / torch.as_tensor(count, device=got.total.device).clamp_min(1)
    if world_size != 1:
        loss = loss * world_size
    # each pass's router loss, as the model's own loss adds it
    loss = loss + 2 * router_loss(model, got.outputs) / accumulation_steps
    if pass_mean:
        loss = loss * 0.5
    return RDropHFLoss(loss, got.outputs, got.nll, got.kl, items, got.correct, got.entropy)


def plain_hf_loss(model, inputs, *, kind, label_smoothing=0.0, num_items_in_batch=None,
                  world_size=1):
    """An update without R-Drop (:func:`rdrop_hf_loss`'s ``every``): the batch through the
    model once, with its labels, and the model's own loss; with ``label_smoothing``,
    Hugging Face's label smoother over the logits (what the Trainer computes then).

    Normalised as R-Drop's loss is, so that the two kinds of update add up alike under
    gradient accumulation and several processes: the model's mean times this batch's
    labelled items over ``num_items_in_batch`` (if given), times ``world_size``. With one
    process and no accumulation it is the model's own loss, exactly; an R-Drop update
    counts both passes, so at alpha 0 it is twice this. Returns an :data:`RDropHFLoss`
    whose ``nll`` is the one pass's (summed over its labelled items), ``kl`` 0, ``outputs``
    the model's for the batch itself."""
    labels = _checked_labels(inputs)
    features = dict(inputs)
    if takes(model, "use_cache"):
        features.setdefault("use_cache", False)
    outputs = model(**features)
    if label_smoothing:
        from transformers.trainer_pt_utils import LabelSmoother

        mean = LabelSmoother(epsilon=label_smoothing)(outputs, labels,
                                                       shift_labels=kind == "causal")
    else:
        mean = outputs.get("loss") if isinstance(outputs, Mapping) else None
        if mean is None:
            raise RDropBatchError(
                f"{type(unwrap(model)).__name__} returned no loss for a batch with labels: an "
                "update without R-Drop (every > 1) trains on the model's own loss")
    items = labelled_items(labels, causal=kind == "causal")
    loss = mean
    if num_items_in_batch is not None:  # the ratio first: 1.0 exactly for one batch
        loss = mean * (items / torch.as_tensor(num_items_in_batch, device=items.device)
                       .clamp_min(1))
    if world_size != 1:
        loss = loss * world_size
    zero = mean.detach().new_zeros(())
    return RDropHFLoss(loss, outputs, mean.detach() * items, zero, items, None, None)


def batch_labels(inputs):
    """A batch's labels as R-Drop's loss reads them: its ``labels``; for a question-answering
    batch (:data:`SPAN_LABELS`), the start and end positions as ``(B, 2)`` class indices
    over the sequence, as the model's own loss reads them: clamped to ``[0, L]``, ``L``
    (outside the sequence) ignored (-100). None where it has neither."""
    labels = inputs.get("labels")
    if torch.is_tensor(labels) or not any(key in inputs for key in SPAN_LABELS):
        return labels if torch.is_tensor(labels) else None
    start, end = (inputs.get(key) for key in SPAN_LABELS)
    lengths = [inputs[key].size(1) for key in ("input_ids", "inputs_embeds", "attention_mask")
               if torch.is_tensor(inputs.get(key)) and inputs[key].dim() >= 2]
    if not (torch.is_tensor(start) and torch.is_tensor(end) and lengths):
        raise RDropBatchError(
            f"a question-answering batch (its keys: {', '.join(sorted(inputs))}) needs both "
            "start_positions and end_positions, and input_ids, inputs_embeds or "
            "attention_mask for the length of its sequences")
    positions = torch.stack([start.reshape(-1), end.reshape(-1)], dim=1).clamp(0, lengths[0])
    return positions.masked_fill(positions.eq(lengths[0]), IGNORE_INDEX)


def _checked_labels(inputs):
    """The batch's labels (:func:`batch_labels`); a batch R-Drop cannot train on is refused,
    saying what to do."""
    labels = batch_labels(inputs)
    if not torch.is_tensor(labels):
        raise RDropBatchError(
            f"a training batch without 'labels' (its keys: {', '.join(sorted(inputs))}): "
            "R-Drop's loss needs the labels of every training batch (-100 marks the tokens "
            "without one)")
    if any(key.startswith("cu_seq_lens") for key in inputs):
        raise RDropBatchError(
            "a padding-free batch (its sequences packed into one row, cu_seq_lens_*) cannot "
            "go through the model twice as [x; x]: set padding_free=False (TRL: and a "
            "packing strategy other than 'bfd')")
    return labels


def _model_inputs(model, inputs, labels, kind):
    """What the model is given: the batch without its labels (the loss is R-Drop's), no
    key/value cache of the doubled batch, and an encoder-decoder model's decoder inputs
    made from the labels where the batch has none (what the model does with labels)."""
    features = {key: value for key, value in inputs.items()
                if key != "labels" and key not in SPAN_LABELS}
    if takes(model, "use_cache"):
        features.setdefault("use_cache", False)
    if kind == "seq2seq" and features.get("decoder_input_ids") is None:
        features["decoder_input_ids"] = decoder_inputs(unwrap(model), labels)
    return features


def _through_logits(model, doubled, target, *, alpha, smoothing, impl, accuracy,
                    check_labels, grad_in_scores):
    """The loss from the model's logits: R-Drop's fused loss over the classes, or for a
    one-output head the squared errors and their consistency term."""
    outputs = model(**doubled)
    logits = logits_of(outputs)
    head = _check_head(logits, target, model)
    if check_labels and head == "classes":
        _check_class_indices(target, logits.size(-1))
    if head == "regression":
        predictions = logits.view(-1).float()
        y = target.reshape(-1).float()
        nll = F.mse_loss(predictions, torch.cat([y, y]), reduction="sum")
        kl = mse_consistency(predictions)
        return _Computed(outputs, nll + alpha * kl, nll.detach(), kl.detach(), None, None)
    if head == "multi-label":
        nll, kl = _multi_label_terms(logits, target)
        return _Computed(outputs, nll + alpha * kl, nll.detach(), kl.detach(), None, None)
    vocab = logits.size(-1)
    _assert_class_indices_async(target, vocab)
    correct = entropy = None
    if accuracy:  # before the loss: the logits' buffer may then take their gradient
        correct = _correct(logits.detach().argmax(-1).view(2, -1), target)
        entropy = _entropy_sum(logits.detach().view(2, -1, vocab), target)
    # the logits' own buffer may take their gradient, unless the caller reads them
    result = rdrop_loss(logits, target, alpha=alpha, epsilon=_fairseq_epsilon(smoothing, vocab),
                        ignore_index=IGNORE_INDEX, impl=impl, grad_in_scores=grad_in_scores)
    return _Computed(outputs, result.total, result.nll, result.kl, correct, entropy)


def _through_fused_head(model, doubled, target, *, alpha, smoothing, impl, accuracy,
                        check_labels, chunk_mb):
    """The loss computed inside the output embedding's call (:func:`_fused_forward`)."""
    predictions = (torch.empty((2, target.numel()), dtype=torch.long, device=target.device)
                   if accuracy else None)
    outputs, result = _fused_forward(
        model, doubled, target, alpha=alpha, smoothing=smoothing, chunk_mb=chunk_mb,
        impl=impl, check_labels=check_labels, predictions=predictions)
    correct = _correct(predictions, target) if accuracy else None
    return _Computed(outputs, result.total, result.nll, result.kl, correct, None)


def _multi_label_terms(logits, labels):
    """A multi-label head's terms, summed over the label entries: the binary cross-entropy
    of both passes, and 1/2 (KL(p1||p2) + KL(p2||p1)) between the passes' Bernoulli
    distributions, which is 1/2 (p1 - p2)(z1 - z2) for the logits z and p = sigmoid(z)."""
    z = logits.to(torch.promote_types(logits.dtype, torch.float32))
    y = labels.to(z.dtype)
    nll = F.binary_cross_entropy_with_logits(z, torch.cat([y, y]), reduction="sum")
    z1, z2 = z.chunk(2)
    kl = 0.5 * ((torch.sigmoid(z1) - torch.sigmoid(z2)) * (z1 - z2)).sum()
    return nll, kl


def _entropy_sum(pairs, target, rows=1024):
    """The entropy of softmax(logits) summed over the labelled rows of both passes
    (``pairs``: ``(2, n, V)``), in float32 a chunk of ``rows`` at a time (no n x V float32
    copy)."""
    kept = target.reshape(-1).ne(IGNORE_INDEX)
    total = pairs.new_zeros((), dtype=torch.float32)
    for start in range(0, pairs.size(1), rows):
        log_p = torch.log_softmax(pairs[:, start:start + rows].float(), -1)
        per_row = -(log_p.exp() * log_p).sum(-1)
        total = total + per_row.masked_fill(~kept[start:start + rows], 0).sum()
    return total


def _correct(predictions, target):
    """Labelled items of both passes (``predictions``: ``(2, n)`` argmaxes) whose prediction
    is the target."""
    target = target.reshape(1, -1)
    return (predictions.eq(target) & target.ne(IGNORE_INDEX)).sum()


def doubled_batch(features, batch):
    """``[x; x]`` of a batch's features: every per-example tensor repeated along dim 0; the
    images and videos of vision-language batches repeated in their order of appearance
    (:data:`_VISUAL_PREFIXES`); 3-D position ids (Qwen-VL's multimodal rotary positions,
    ``(3, B, L)``) repeated along their batch dimension. Anything else whose dim 0 is not
    the batch is refused, naming it."""
    visual, rest = {}, {}
    for key, value in features.items():
        if torch.is_tensor(value) and key.startswith(_VISUAL_PREFIXES):
            visual[key] = torch.cat([value, value])
        elif key == "position_ids" and torch.is_tensor(value) and value.dim() == 3:
            if value.size(1) != batch:
                raise RDropBatchError(f"cannot duplicate inputs['position_ids'] of shape "
                                      f"{tuple(value.shape)}: expected (sections, {batch}, "
                                      "length)")
            visual[key] = torch.cat([value, value], dim=1)
        else:
            rest[key] = value
    return {**duplicate_net_input(rest, batch, _path="inputs"), **visual}


def _fused_forward(model, inputs, target, *, alpha, smoothing, chunk_mb, impl, check_labels,
                   predictions=None):
    """One forward of ``inputs`` in which the output embedding's own call computes R-Drop's
    loss from the hidden states it receives (:class:`~rdrop_fairseq.hf.fused_head.FusedHead`): its weight is used where
    the model uses it, whole under FSDP and ZeRO-3 (which gather it for the call), and
    reached from the outputs for DDP's search for unused parameters, since the head returns
    the loss as a 1-element stand-in for the logits (whatever the model adds to its logits,
    a bias, broadcasts to a small tensor). Under autocast the products are in autocast's
    dtype, as the head's own would be. Returns the outputs and the :data:`core.RDropLoss`."""
    head = head_module(model)

    def compute(hidden):
        weight, bias = head.weight, logits_bias(model, head)
        dtype = _autocast_dtype(hidden.device.type)
        if dtype is not None:
            hidden, weight = hidden.to(dtype), weight.to(dtype)
            bias = None if bias is None else bias.to(dtype)
        vocab = weight.size(0)
        if check_labels:
            _check_class_indices(target, vocab)
        _assert_class_indices_async(target, vocab)
        result = fused_linear_rdrop_loss(
            hidden, weight, target, bias=bias, alpha=alpha,
            epsilon=_fairseq_epsilon(smoothing, vocab), ignore_index=IGNORE_INDEX,
            chunk_mb=chunk_mb, impl=impl, predictions=predictions)
        call.results.append(result)
        return result.total.view((1,) * hidden.dim())

    with fused_call(head, compute) as call:
        outputs = model(**inputs)
    if len(call.results) != 1:
        raise ValueError(f"rdrop_fused_linear: the model called its output embedding "
                         f"{len(call.results)} times in one forward, not once")
    return outputs, call.results[0]._replace(total=call.returned[0].reshape(()))


def _autocast_dtype(device_type):
    """The dtype autocast runs matrix products in on ``device_type``, or None where it is
    off (the functions taking a device type came with torch 2.4)."""
    if hasattr(torch, "get_autocast_dtype"):
        if torch.is_autocast_enabled(device_type):
            return torch.get_autocast_dtype(device_type)
        return None
    if device_type == "cpu":
        return torch.get_autocast_cpu_dtype() if torch.is_autocast_cpu_enabled() else None
    return torch.get_autocast_gpu_dtype() if torch.is_autocast_enabled() else None


def _shifted(labels):
    """``labels`` moved one position left, -100 at the end: the target of each position of a
    causal LM (what its loss does with ``labels[..., 1:]``, without slicing the logits)."""
    return torch.cat([labels[..., 1:], labels.new_full(labels[..., :1].shape, IGNORE_INDEX)],
                     dim=-1)


def _fairseq_epsilon(smoothing, vocab):
    """Hugging Face's label smoothing ``f`` (``(1 - f)`` on the target plus ``f / V`` on
    every class) as the core's ``epsilon`` (fairseq's: ``1 - eps`` on the target, ``eps /
    (V - 1)`` on each other class): ``eps = f (V - 1) / V``."""
    return smoothing * (vocab - 1) / vocab if smoothing and vocab > 1 else 0.0


def _check_head(logits, labels, model):
    """What the head is: ``"regression"`` (one output), ``"multi-label"`` (float labels, or
    ``problem_type`` multi_label_classification, as the model's own loss decides) or
    ``"classes"``; a ValueError saying what to change where the labels do not fit the
    logits (shapes and dtypes only: nothing read back from the device)."""
    problem = getattr(getattr(unwrap(model), "config", None), "problem_type", None)
    batch = labels.size(0)
    if logits.size(0) != 2 * batch:
        raise ValueError(f"R-Drop: the model returned logits of shape "
                         f"{tuple(logits.shape)} for a doubled batch of {2 * batch} rows")
    if logits.dim() == 2 and logits.size(-1) == 1:
        if not labels.is_floating_point():
            raise ValueError(
                f"R-Drop: the head has one output (regression) but the labels are "
                f"{labels.dtype}: give float labels (e.g. an STS-B score), or a head with "
                "num_labels >= 2 for classes")
        if labels.numel() != batch:
            raise ValueError(f"R-Drop: regression labels must be one number per "
                             f"example, got shape {tuple(labels.shape)}")
        return "regression"
    if logits.dim() == 2 and (problem == "multi_label_classification" or (
            problem is None and labels.is_floating_point())):
        if not labels.is_floating_point() or labels.shape != (batch, logits.size(-1)):
            raise ValueError(
                f"R-Drop: multi-label classification needs float multi-hot labels of shape "
                f"({batch}, {logits.size(-1)}), one 0/1 per label; got {labels.dtype} labels "
                f"of shape {tuple(labels.shape)}")
        return "multi-label"
    if problem == "regression" or labels.is_floating_point():
        raise ValueError(
            f"R-Drop: {labels.dtype} labels with a head of {logits.size(-1)} outputs: "
            "multi-output regression and soft labels are not supported; give class "
            "indices (torch.long), float multi-hot labels for multi-label classification, "
            "or a one-output head for regression")
    one_pass = (batch, *logits.shape[1:-1])  # a label per example, or per token
    if labels.numel() != math.prod(one_pass):
        raise ValueError(f"R-Drop: labels of shape {tuple(labels.shape)} do not fit "
                         f"logits of shape {tuple(logits.shape)} (both passes): expected "
                         f"{one_pass}, one pass's")
    return "classes"


def _bad_class_indices(labels, classes):
    return ~(labels.eq(IGNORE_INDEX) | (labels.ge(0) & labels.lt(classes)))


def _check_class_indices(labels, classes):
    bad = _bad_class_indices(labels, classes)
    if bool(bad.any()):
        values = sorted(set(labels[bad].tolist()))[:10]
        raise ValueError(f"R-Drop: labels {values} are not class indices of a head with "
                         f"{classes} outputs (0 to {classes - 1}, or -100 for none)")


def _assert_class_indices_async(labels, classes):
    """After the first batch: checked without waiting for the device (on CUDA, a device-side
    assert rather than the Triton kernel reading out of bounds)."""
    torch._assert_async(~_bad_class_indices(labels, classes).any(),
                        f"R-Drop: a label is not a class index (0 to {classes - 1}, "
                        "or -100)")
