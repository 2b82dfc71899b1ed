"""How a Hugging Face model's logits line up with its labels (:func:`read_kind`), read from
what the model does rather than from its class name, and the small readings of a model and
its output that :mod:`rdrop_fairseq.hf` shares with it."""

import inspect
from collections.abc import Mapping

import torch
import torch.nn.functional as F
from transformers.models.auto import modeling_auto as auto

IGNORE_INDEX = -100  # Hugging Face's label for "no loss here"

# How a model's logits line up with its labels: "causal" (position t scores labels[t + 1]),
# "seq2seq" (decoder logits against labels, decoder inputs the labels shifted right),
# "encoder" (logits against labels as they are: sequence and token heads, masked LMs, and
# decoders whose own loss does not shift)
KINDS = ("causal", "seq2seq", "encoder")


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
    inner = _unwrap(model)
    name = type(inner).__name__
    config = getattr(inner, "config", None)
    if getattr(config, "problem_type", None) == "multi_label_classification":
        raise ValueError(f"{name} is set up for multi-label classification (problem_type), "
                         "which R-Drop's loss here does not cover")
    for task, what in _UNCOVERED.items():
        if _is(inner, task):
            raise ValueError(f"{name} is {what}, which R-Drop's loss here does not cover. "
                             f"{_COVERED}")
    if kind == "auto":
        kind = _probed_kind(model)
    elif kind not in KINDS:
        raise ValueError(f"the model kind must be 'auto' or one of {', '.join(KINDS)}, "
                         f"got {kind!r}")
    return kind


_COVERED = ("Covered: sequence classification and regression, token classification, masked "
            "LM, causal LM (vision-language models included), encoder-decoder LM")
_UNCOVERED = {"QUESTION_ANSWERING": "a question-answering head (start and end positions)",
              "MULTIPLE_CHOICE": "a multiple-choice head",
              "NEXT_SENTENCE_PREDICTION": "a next-sentence-prediction head",
              "": "a bare model, without a head"}
_PROBE = (1, 12)  # examples (one: a decoder classifier needs a pad token for more), tokens


def _probed_kind(model):
    inner = _unwrap(model)
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
        with torch.no_grad():
            extra = {"decoder_input_ids": ids} if is_seq2seq else {}
            logits = _logits_of(_probe_call(model, name, input_ids=ids, **extra))
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
    inner = _unwrap(model)
    name = type(inner).__name__
    half = next(inner.parameters()).dtype in (torch.float16, torch.bfloat16)
    for seed in range(3):
        g = torch.Generator().manual_seed(seed + 1)
        if kinds == ("seq2seq",):  # target tokens: no special ones
            labels = _probe_tokens(inner, classes, seed + 1)
        else:
            labels = torch.randint(0, classes, _PROBE, generator=g).to(ids.device)
        labels[0, 3] = IGNORE_INDEX
        outputs = _probe_call(model, name, input_ids=ids, labels=labels)
        if isinstance(outputs, Mapping):
            own, logits = outputs.get("loss"), _logits_of(outputs)
        else:  # return_dict=False: the loss first where there is one
            own, logits = (outputs[0], outputs[1]) if len(outputs) > 1 else (None, None)
        if not torch.is_tensor(own) or own.dim() != 0:
            raise ValueError(f"{name} returned no loss for labels, so how its logits line up "
                             "with its labels cannot be read from it: pass rdrop_model_kind "
                             f"({', '.join(KINDS)})")
        own = float(own.double() - _router_loss(model, outputs))
        if kinds == ("seq2seq",):
            logits = _logits_of(_probe_call(model, name, input_ids=ids,
                                            decoder_input_ids=_decoder_inputs(inner, labels)))
        logits = logits.double()
        if logits.shape[:2] != labels.shape:
            raise ValueError(f"{name}'s logits {tuple(logits.shape)} do not match a batch of "
                             f"{tuple(labels.shape)} token labels: pass rdrop_model_kind "
                             f"({', '.join(KINDS)})")
        flat = dict(ignore_index=IGNORE_INDEX)
        aligned = float(F.cross_entropy(logits.flatten(0, 1), labels.flatten(), **flat))
        shifted = float(F.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(),
                                        **flat))
        candidates = {"seq2seq": aligned, "encoder": aligned, "causal": shifted}
        # the model's loss and these are of the same logits (its loss upcasts them)
        tolerance = (2e-4 if half else 1e-5) * max(1.0, abs(own))
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
    raise ValueError(f"{name}'s logits on probe batches do not tell whether its loss shifts "
                     f"the labels: pass rdrop_model_kind ({', '.join(KINDS)})")


def _decoder_inputs(inner, labels):
    """The decoder inputs an encoder-decoder model makes from its labels: its own
    ``prepare_decoder_input_ids_from_labels``, else the labels shifted right after the
    decoder's start token, -100 as padding (what transformers' models without that method
    do)."""
    prepare = getattr(inner, "prepare_decoder_input_ids_from_labels", None)
    if callable(prepare):
        return prepare(labels=labels)
    config = inner.config
    decoder = getattr(config, "decoder", None)
    start = getattr(config, "decoder_start_token_id", None)
    pad = getattr(config, "pad_token_id", None)
    if start is None or pad is None:
        start = getattr(decoder, "decoder_start_token_id", start)
        pad = getattr(decoder, "pad_token_id", pad)
    if start is None or pad is None:
        raise ValueError(f"{type(inner).__name__} has no decoder_start_token_id and "
                         "pad_token_id in its configuration, from which the decoder inputs "
                         "are made: set them")
    shifted = torch.cat([labels.new_full(labels[:, :1].shape, start), labels[:, :-1]], dim=1)
    return shifted.masked_fill(shifted.eq(IGNORE_INDEX), pad)


def _probe_call(model, name, **inputs):
    if _takes(model, "use_cache"):  # no key/value cache (hybrid models' caches refuse a probe)
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
    if any(_is(inner, task) for task in ("IMAGE_CLASSIFICATION", "AUDIO_CLASSIFICATION",
                                         "VIDEO_CLASSIFICATION", "SEQUENCE_CLASSIFICATION")):
        return "encoder"
    raise ValueError(f"{name} takes no token ids (it has no input embeddings), so R-Drop "
                     "cannot read how its logits line up with its labels: pass "
                     f"rdrop_model_kind ({', '.join(KINDS)})")



# ------------------------------------------------- readings of a model and its output

def _unwrap(model):
    """The model itself: inside a DataParallel / DDP wrapper, under a PEFT adapter."""
    model = getattr(model, "module", model)
    get_base = getattr(model, "get_base_model", None)  # peft.PeftModel
    return get_base() if callable(get_base) else model


def _is(model, task):
    """Whether ``model``'s class, or one it derives from, is one of transformers' for
    ``task`` (a subclass of GPT2LMHeadModel is a causal LM too)."""
    names = _names(task)
    return any(cls.__name__ in names for cls in type(model).__mro__)


def _names(task):
    """The class names of transformers' auto mapping for ``task`` ("": the bare models)."""
    mapping = getattr(auto, f"MODEL_FOR_{task}_MAPPING_NAMES" if task else "MODEL_MAPPING_NAMES",
                      {})
    names = set()
    for value in mapping.values():
        names.update(value if isinstance(value, (tuple, list)) else (value,))
    return names


def _logits_of(outputs):
    """The logits of a model's output: its ``logits``, or the first element of a tuple
    (``return_dict=False``)."""
    if isinstance(outputs, Mapping):
        logits = outputs.get("logits")
    elif isinstance(outputs, (tuple, list)) and outputs:
        logits = outputs[0]
    else:
        logits = None
    if not torch.is_tensor(logits):
        keys = ", ".join(outputs) if isinstance(outputs, Mapping) else type(outputs).__name__
        raise ValueError(
            f"the model's output has no 'logits' (it has: {keys}); R-Drop needs the logits "
            "of a classification, token-classification or language-model head")
    return logits


def _router_loss(model, outputs):
    """The router (load-balancing) loss a mixture of experts adds to its own loss when its
    configuration has ``router_aux_loss_coef`` and it returns ``aux_loss``, else 0."""
    aux = outputs.get("aux_loss") if isinstance(outputs, Mapping) else None
    config = getattr(_unwrap(model), "config", None)
    coef = getattr(config, "router_aux_loss_coef", None)
    if coef is None and hasattr(config, "get_text_config"):  # a vision-language wrapper's
        coef = getattr(config.get_text_config(), "router_aux_loss_coef", None)
    if not torch.is_tensor(aux) or not coef:
        return 0.0
    return coef * aux


def _takes(model, argument):
    """Whether the model's forward names ``argument``."""
    return argument in inspect.signature(_unwrap(model).forward).parameters
