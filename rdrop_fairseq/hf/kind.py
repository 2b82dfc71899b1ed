"""How a Hugging Face model's logits line up with its labels (:func:`model_kind`), read from
what the model does rather than from its class name: a probe batch goes through the model
and its own loss is compared with the cross-entropy of its logits read each way. With the
fused path, also whether its head is what that path computes (:func:`check_fused_head`)."""

import contextlib
import math
from collections.abc import Mapping

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from transformers import PretrainedConfig

from .coverage import ENCODER_HEADS, refuse_uncovered
from .fused_head import FusedHead
from .model import (IGNORE_INDEX, KINDS, decoder_inputs, head_module, is_task, logits_bias,
                    logits_of, router_loss, takes, unwrap)

__all__ = ["model_kind", "read_kind", "check_fused_head", "kinds_read_from_loss",
           "random_state_kept", "dropout_in_forward"]

# Model configurations whose head does more than a linear layer after the hidden states,
# which the fused path does not reproduce: attribute, and what it does
_HEAD_EXTRAS = {
    "final_logit_softcapping": "soft-caps the logits",
    "logit_scale": "scales the logits (logit_scale)",
    "logits_scaling": "divides the logits by logits_scaling",
}


def model_kind(model, kind="auto", fused_linear=False):
    """How ``model``'s logits line up with its labels, one of ``"causal"``, ``"seq2seq"``,
    ``"encoder"`` (:func:`read_kind`: read from what the model does with a probe batch, or
    ``kind`` as given), or a ValueError saying why it cannot be trained here.
    ``fused_linear``: also check that its head is what the fused path computes."""
    kind = read_kind(model, kind)
    if fused_linear:
        check_fused_head(model, kind)
    return kind


def read_kind(model, kind="auto"):
    """How ``model``'s logits line up with its labels: one of :data:`KINDS`, or a
    ValueError that says why it cannot be trained here.

    ``kind="auto"`` reads it from what the model does: a probe batch of 12 token ids goes
    through the model (evaluation mode, no gradient) with labels, and its own loss (less a
    mixture of experts' router loss) is compared with the cross-entropy of its logits
    against the labels as they are and shifted by one position; a head with one output per
    example (sequence classification, regression) needs no comparison. A model that takes
    no token ids (an image classifier, say) is a sequence head if transformers lists it as
    a classifier. ``kind`` one of :data:`KINDS` says it instead (still checked against
    what is covered)."""
    inner = unwrap(model)
    name = type(inner).__name__
    refuse_uncovered(inner)
    if kind not in ("auto", *KINDS):
        raise ValueError(f"the model kind must be 'auto' or one of {', '.join(KINDS)}, "
                         f"got {kind!r}")
    by_head = next((what for task, what in ENCODER_HEADS.items() if is_task(inner, task)),
                   None)
    if by_head is not None:  # its logits and labels, as they are, are R-Drop's
        if kind not in ("auto", "encoder"):
            raise ValueError(f"{name} is {by_head}, whose logits line up with its labels as "
                             f"they are: rdrop_model_kind 'encoder' (or 'auto'), not {kind!r}")
        return "encoder"
    return _probed_kind(model) if kind == "auto" else kind


_PROBE = (1, 12)  # examples (one: a decoder classifier needs a pad token for more), tokens


def _probed_kind(model):
    inner = unwrap(model)
    name = type(inner).__name__
    try:
        vocab = inner.get_input_embeddings().num_embeddings
    except Exception:  # none, or not a token embedding (images, audio)
        return _kind_without_tokens(inner)
    is_seq2seq = bool(getattr(inner.config, "is_encoder_decoder", False))
    ids = _probe_tokens(inner, vocab, seed=0)
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad(), random_state_kept(model):
            extra = {"decoder_input_ids": ids} if is_seq2seq else {}
            logits = logits_of(_probe_call(model, name, input_ids=ids, **extra))
            if logits.dim() == 2 and logits.size(0) == _PROBE[0]:
                return "encoder"  # one output per example: nothing to shift
            kinds = ("seq2seq",) if is_seq2seq else ("causal", "encoder")
            return _compare_losses(model, ids, kinds, logits.size(-1))
    finally:
        model.train(was_training)


def _compare_losses(model, ids, kinds, classes):
    """The kind (of ``kinds``) whose cross-entropy of the logits is the model's own loss on
    probe batches; probes whose shifted and unshifted losses agree decide nothing. An
    encoder-decoder model's logits are those of the decoder inputs R-Drop makes."""
    inner = unwrap(model)
    name = type(inner).__name__
    infinite = []
    for seed in range(3):
        g = torch.Generator().manual_seed(seed + 1)
        if kinds == ("seq2seq",):  # target tokens: no special ones
            labels = _probe_tokens(inner, classes, seed + 1)
        else:
            labels = torch.randint(0, classes, _PROBE, generator=g).to(ids.device)
        labels[0, 3] = IGNORE_INDEX
        outputs = _probe_call(model, name, input_ids=ids, labels=labels)
        own, logits = _own_loss(model, outputs)
        if own is None:
            raise ValueError(f"{name} returned no loss for labels, so how its logits line up "
                             "with its labels cannot be read from it: pass rdrop_model_kind "
                             f"({', '.join(KINDS)})")
        if not math.isfinite(own):  # no reading is it, however its tolerance grows
            infinite.append(own)
            continue
        if kinds == ("seq2seq",):
            logits = logits_of(_probe_call(model, name, input_ids=ids,
                                            decoder_input_ids=decoder_inputs(inner, labels)))
        if logits.shape[:2] != labels.shape:
            raise ValueError(f"{name}'s logits {tuple(logits.shape)} do not match a batch of "
                             f"{tuple(labels.shape)} token labels: pass rdrop_model_kind "
                             f"({', '.join(KINDS)})")
        candidates = _cross_entropies(logits, labels)
        aligned, shifted = candidates["encoder"], candidates["causal"]
        tolerance = _tolerance(model, own)
        if abs(aligned - shifted) <= 4 * tolerance and len(kinds) > 1:
            continue  # this probe cannot tell them apart
        best = min(kinds, key=lambda k: abs(candidates[k] - own))
        if abs(candidates[best] - own) <= tolerance:
            return best
        readings = ", ".join(f"{k} {candidates[k]:.6g}" for k in kinds)
        raise ValueError(
            f"{name}'s own loss on a probe batch ({own:.6g}) is not the cross-entropy of its "
            f"logits read as any kind R-Drop covers ({readings}): it adds or computes "
            "something else, which R-Drop's loss would not reproduce")
    if infinite:
        raise ValueError(f"{name}'s own loss on probe batches is {infinite[0]}, which no "
                         "reading of its logits is, so how they line up with its labels "
                         f"cannot be read from it: pass rdrop_model_kind ({', '.join(KINDS)})")
    raise ValueError(f"{name}'s logits on probe batches do not tell whether its loss shifts "
                     f"the labels: pass rdrop_model_kind ({', '.join(KINDS)})")


def _own_loss(model, outputs):
    """The model's own loss in ``outputs``, less a mixture of experts' router loss (a
    float), and its logits; ``(None, None)`` where it returned no loss."""
    if isinstance(outputs, Mapping):
        own, logits = outputs.get("loss"), outputs.get("logits")
        if torch.is_tensor(own):
            logits = logits_of(outputs)
    else:  # return_dict=False: the loss first where there is one
        own, logits = (outputs[0], outputs[1]) if len(outputs) > 1 else (None, None)
    if not torch.is_tensor(own) or own.dim() != 0:
        return None, None
    return float(own.double() - router_loss(model, outputs)), logits


def _cross_entropies(logits, labels):
    """The cross-entropy of token ``logits`` against ``labels`` read as each kind: shifted
    by one position (``causal``) or as they are (``encoder``, ``seq2seq``)."""
    logits, flat = logits.double(), dict(ignore_index=IGNORE_INDEX)
    aligned = float(F.cross_entropy(logits.flatten(0, 1), labels.flatten(), **flat))
    shifted = float(F.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(),
                                    **flat))
    return {"seq2seq": aligned, "encoder": aligned, "causal": shifted}


def _tolerance(model, own):
    """How far a reading of the logits may be from the model's own loss: both are of the
    same logits (its loss upcasts them), so a rounding's worth, more for half precision."""
    half = next(unwrap(model).parameters()).dtype in (torch.float16, torch.bfloat16)
    return (2e-4 if half else 1e-5) * max(1.0, abs(own))


def kinds_read_from_loss(model, inputs):
    """How ``model``'s own loss on ``inputs`` (a training batch with its labels, dropout as
    it is; no gradient, the random state kept) lines its logits up with the labels: the
    kinds that reading agrees with; None where it tells nothing (the model computes no
    loss of its own, the labels are not class indices per example or per token, or the
    shifted and unshifted readings are equal); or, where this batch cannot tell but
    another may, its own loss as a float that is not finite (no reading is an infinite
    loss, however the tolerance grows with it; a batch without a labelled token gives
    NaN)."""
    labels = inputs.get("labels")
    extra = {"use_cache": False} if takes(model, "use_cache") else {}
    with torch.no_grad(), random_state_kept(model):
        outputs = model(**{**extra, **inputs})
    own, logits = _own_loss(model, outputs)
    if own is None or not torch.is_tensor(labels) or labels.is_floating_point():
        return None
    if not math.isfinite(own):
        return own
    if logits.dim() == 2:  # one output per example: a sequence head, nothing shifted
        return ("encoder",) if labels.dim() == 1 else None
    if logits.shape[:2] != labels.shape:
        return None
    candidates, tolerance = _cross_entropies(logits, labels), _tolerance(model, own)
    if abs(candidates["causal"] - candidates["encoder"]) <= 4 * tolerance:
        return None
    aligned = ("seq2seq" if getattr(unwrap(model).config, "is_encoder_decoder", False)
               else "encoder")
    return tuple(k for k in ("causal", aligned) if abs(candidates[k] - own) <= tolerance)


def dropout_in_forward(model):
    """Whether a training forward of ``model`` applies any dropout: a probe batch of token
    ids goes through it in training mode (no gradient, the random state kept) while every
    dropout call is watched (torch's dropout functions with ``p > 0``, and the attention
    dropout given to ``scaled_dot_product_attention``), so that a probability in the
    configuration that no forward uses (GPT-2's ``summary_first_dropout``) does not count.
    None where no probe batch goes through it (no token embedding, or it refuses one)."""
    inner = unwrap(model)
    try:
        ids = _probe_tokens(inner, inner.get_input_embeddings().num_embeddings, seed=0)
    except Exception:  # no token embedding (images, audio)
        return None
    inputs = {"input_ids": ids}
    if getattr(inner.config, "is_encoder_decoder", False):
        inputs["decoder_input_ids"] = ids
    if takes(inner, "use_cache"):
        inputs["use_cache"] = False
    modes = {module: module.training for module in inner.modules()}
    inner.train()
    watch = _DropoutWatch()
    try:
        with torch.no_grad(), random_state_kept(inner), watch:
            inner(**inputs)
    except Exception:  # a model that needs more than token ids (a multiple-choice head)
        return None
    finally:
        for module, training in modes.items():
            module.training = training
    return watch.seen


_DROPOUT_FUNCTIONS = {F.dropout, F.dropout1d, F.dropout2d, F.dropout3d, F.alpha_dropout,
                      F.feature_alpha_dropout, torch.dropout}


class _DropoutWatch(TorchFunctionMode):
    """Whether a dropout with a probability above 0 was applied in training mode."""

    def __init__(self):
        super().__init__()
        self.seen = False

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _DROPOUT_FUNCTIONS:
            p = kwargs.get("p", args[1] if len(args) > 1 else 0.5)
            training = kwargs.get("training", kwargs.get("train",
                                                         args[2] if len(args) > 2 else True))
            self.seen = self.seen or (bool(training) and float(p) > 0)
        elif func is F.scaled_dot_product_attention:
            p = kwargs.get("dropout_p", args[4] if len(args) > 4 else 0.0)
            self.seen = self.seen or float(p) > 0
        return func(*args, **kwargs)


@contextlib.contextmanager
def random_state_kept(model):
    """The global random state (CPU and the model's GPUs) as it was before, whatever the
    model draws meanwhile (dropout; Reformer's LSH attention, even in evaluation mode), so
    that reading a model changes none of its training's random draws."""
    devices = sorted({p.device.index or 0 for p in model.parameters() if p.is_cuda})
    with torch.random.fork_rng(devices=devices):
        yield


def _probe_call(model, name, **inputs):
    if takes(model, "use_cache"):  # no key/value cache (hybrid models' caches refuse a probe)
        inputs["use_cache"] = False
    try:
        return model(**inputs)
    except Exception as error:  # any model's own refusal of a text-only probe batch
        raise ValueError(
            f"{name} could not take a probe batch of token ids, from which R-Drop reads how "
            f"its logits line up with its labels ({type(error).__name__}: {error}); pass "
            f"rdrop_model_kind ({', '.join(KINDS)})") from error


def _probe_tokens(inner, vocab, seed):
    """Random token ids below ``vocab``, none of the configuration's special tokens (an
    image token would make a vision-language model look for an image)."""
    special = set()
    configs = [inner.config, *(getattr(inner.config, key, None) for key in
                               ("text_config", "decoder", "encoder"))]
    for config in filter(None, configs):
        for key, value in (config.to_dict() if hasattr(config, "to_dict") else {}).items():
            if "token" in key and isinstance(value, int) and not isinstance(value, bool):
                special.add(value)
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, _PROBE, generator=g)
    safe = next((t for t in range(vocab) if t not in special), 0)
    for token in special:
        ids[ids.eq(token)] = safe
    return ids.to(next(inner.parameters()).device)


def _kind_without_tokens(inner):
    name = type(inner).__name__
    if any(is_task(inner, task) for task in ("IMAGE_CLASSIFICATION", "AUDIO_CLASSIFICATION",
                                         "VIDEO_CLASSIFICATION", "SEQUENCE_CLASSIFICATION")):
        return "encoder"
    raise ValueError(f"{name} takes no token ids (it has no input embeddings), so R-Drop "
                     "cannot read how its logits line up with its labels: pass "
                     f"rdrop_model_kind ({', '.join(KINDS)})")


def check_fused_head(model, kind):
    """Refuse a head the fused path cannot reproduce exactly, naming what differs: the loss
    is computed from the hidden states the output embedding receives, as ``h W^T + b``."""
    inner = unwrap(model)
    name = type(inner).__name__
    head = head_module(model)
    if kind == "encoder" and not is_task(inner, "MASKED_LM"):
        raise ValueError(f"rdrop_fused_linear: {name} has no language-model head (it is for "
                         "causal, encoder-decoder and masked LMs); leave it False")
    own = vars(head).get("forward")
    if own is not None and not isinstance(own, FusedHead):
        # accelerate's device hook (device_map, offload), say (not R-Drop's own, FusedHead)
        raise ValueError(f"rdrop_fused_linear: {name}'s output embedding carries a forward of "
                         "its own (accelerate's hook of device_map='auto' or offloading, "
                         "say), which the fused path would bypass; leave it False")
    if not isinstance(head, torch.nn.Linear) or type(head).forward is not torch.nn.Linear.forward:
        raise ValueError(f"rdrop_fused_linear: {name}'s output embedding is "
                         f"{type(head).__name__}, not a plain torch.nn.Linear (an adapter on the "
                         "head, say), which the fused path cannot reproduce; leave it False")
    for where, config in _configs(getattr(inner, "config", None)):
        for attribute, what in _HEAD_EXTRAS.items():
            value = getattr(config, attribute, None)
            if value is not None and value != 1 and value is not False:
                raise ValueError(f"rdrop_fused_linear: {name}'s head {what} ({attribute} = "
                                 f"{value}{where}) after its linear layer, which the fused "
                                 "path does not reproduce; leave it False")
    _check_head_is_linear(model, head, kind)


def _check_head_is_linear(model, head, kind):
    """What no configuration says: the logits of a small batch (dropout off) are the hidden
    states the head receives times its weight, plus its bias."""
    device = head.weight.device
    ids = torch.arange(1, 6, device=device).remainder(head.weight.size(0)).view(1, 5)
    inputs = _head_probe_inputs(unwrap(model), ids)
    if kind == "seq2seq":
        inputs["decoder_input_ids"] = ids
    seen = []
    hook = head.register_forward_hook(lambda module, args, output: seen.append(args[0]))
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad(), random_state_kept(model):
            logits = logits_of(_probe_call(model, type(unwrap(model)).__name__, **inputs))
            if len(seen) != 1:
                raise ValueError(f"rdrop_fused_linear: {type(unwrap(model)).__name__} called "
                                 f"its output embedding {len(seen)} times in one forward, "
                                 "not once")
            bias = logits_bias(model, head)
            fused = F.linear(seen[0].float(), head.weight.float(),
                             None if bias is None else bias.float())
            logits = logits.float()
    finally:
        hook.remove()
        model.train(was_training)
    scale = logits.abs().max().clamp_min(1e-6)
    difference = float((logits - fused).abs().max() / scale)
    tolerance = 1e-4 if head.weight.dtype == torch.float32 else 2e-2
    if not difference <= tolerance:
        raise ValueError(
            f"rdrop_fused_linear: {type(unwrap(model)).__name__}'s logits are not its output "
            f"embedding applied to the hidden states it receives (relative difference "
            f"{difference:.2g}): the head does something the fused path does not reproduce "
            "(a scale or a cap after the projection, say); leave rdrop_fused_linear False")


def _head_probe_inputs(inner, ids):
    """A batch of one of the model's main input (its ``main_input_name``): the token ids
    ``ids``, Whisper's log-mel features (``num_mel_bins`` x twice ``max_source_positions``)
    or an image (``num_channels`` x ``image_size``, an encoder's configuration's for an
    encoder-decoder model); a ValueError saying what is missing where none can be made."""
    main = getattr(inner, "main_input_name", "input_ids")
    config = inner.config
    shape = None
    if main == "input_ids":
        return {"input_ids": ids}
    if main == "input_features" and all(hasattr(config, key) for key in
                                        ("num_mel_bins", "max_source_positions")):
        shape = (1, config.num_mel_bins, 2 * config.max_source_positions)
    elif main == "pixel_values":
        vision = getattr(config, "encoder", None) or getattr(config, "vision_config", config)
        size = getattr(vision, "image_size", None)
        if isinstance(size, int):
            shape = (1, getattr(vision, "num_channels", 3), size, size)
    if shape is None:
        raise ValueError(f"rdrop_fused_linear: {type(inner).__name__} takes {main}, of which "
                         "no probe batch is made here to check that its head is a linear "
                         "layer (input_ids, Whisper's input_features or images of a stated "
                         "image_size are); leave it False")
    weight = next(inner.parameters())
    noise = torch.randn(shape, generator=torch.Generator().manual_seed(0))
    return {main: noise.to(device=weight.device, dtype=weight.dtype)}


def _configs(config):
    """``config`` and every configuration nested in it (a multimodal model's text config,
    its ``get_text_config()``, an encoder-decoder's encoder and decoder), each once, with
    where it is (", in its text_config") for a message."""
    found, todo = [], [("", config)]
    while todo:
        where, config = todo.pop(0)
        if config is None or any(config is seen for _, seen in found):
            continue
        found.append((where, config))
        nested = [(f", in its {key}", value) for key, value in vars(config).items()
                  if isinstance(value, PretrainedConfig)]
        if hasattr(config, "get_text_config"):
            nested.append((", in its text config", config.get_text_config()))
        todo += nested
    return found
