"""What the Hugging Face layer reads off a model and its output, shared by the loss
(:mod:`.loss`), the kind probe (:mod:`.kind`) and the trainers (:mod:`.trainers`), and the
decoder inputs an encoder-decoder model makes from its labels (both the loss and the probe
make them)."""

import inspect
from collections.abc import Mapping

import torch
from transformers.models.auto import modeling_auto as auto

__all__ = ["IGNORE_INDEX", "KINDS", "unwrap", "is_task", "logits_of", "router_loss", "takes",
           "head_module", "logits_bias", "decoder_inputs"]

IGNORE_INDEX = -100  # Hugging Face's label for "no loss here"

# How a model's logits line up with its labels: "causal" (position t scores labels[t + 1]),
# "seq2seq" (decoder logits against labels, decoder inputs the labels shifted right),
# "encoder" (logits against labels as they are: sequence and token heads, masked LMs, and
# decoders whose own loss does not shift)
KINDS = ("causal", "seq2seq", "encoder")


def unwrap(model):
    """The model itself: inside torch.compile's wrapper (``OptimizedModule``), a
    DataParallel / DDP wrapper, in any order, and under a PEFT adapter."""
    while True:
        inner = getattr(model, "_orig_mod", None)  # torch.compile's
        if not isinstance(inner, torch.nn.Module):
            inner = getattr(model, "module", None)  # DataParallel's, DDP's
        if not isinstance(inner, torch.nn.Module):
            break
        model = inner
    get_base = getattr(model, "get_base_model", None)  # peft.PeftModel
    return unwrap(get_base()) if callable(get_base) else model


def is_task(model, task):
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


def logits_of(outputs):
    """The logits of a model's output: its ``logits``, or the first element of a tuple
    (``return_dict=False``); a question-answering head's ``start_logits`` and
    ``end_logits`` stacked, ``(B, 2, L)`` (the start and end positions as two
    classifications over the sequence)."""
    if isinstance(outputs, Mapping):
        logits = outputs.get("logits")
        spans = outputs.get("start_logits"), outputs.get("end_logits")
        if logits is None and all(torch.is_tensor(span) for span in spans):
            return torch.stack(spans, dim=1)  # (B, 2, L): a distribution over each position
    elif isinstance(outputs, (tuple, list)) and outputs:
        logits = outputs[0]
    else:
        logits = None
    if not torch.is_tensor(logits):
        keys = ", ".join(outputs) if isinstance(outputs, Mapping) else type(outputs).__name__
        raise ValueError(
            f"the model's output has no 'logits' (it has: {keys}); R-Drop needs the logits "
            "of a classification, token-classification, question-answering or "
            "language-model head")
    return logits


def router_loss(model, outputs):
    """The router (load-balancing) loss a mixture of experts adds to its own loss when its
    configuration has ``router_aux_loss_coef`` and it returns ``aux_loss``, else 0."""
    aux = outputs.get("aux_loss") if isinstance(outputs, Mapping) else None
    config = getattr(unwrap(model), "config", None)
    coef = getattr(config, "router_aux_loss_coef", None)
    if coef is None and hasattr(config, "get_text_config"):  # a vision-language wrapper's
        coef = getattr(config.get_text_config(), "router_aux_loss_coef", None)
    if not torch.is_tensor(aux) or not coef:
        return 0.0
    return coef * aux


def takes(model, argument):
    """Whether the model's forward names ``argument``."""
    return argument in inspect.signature(unwrap(model).forward).parameters


def head_module(model):
    """The output embedding (the language-model head's projection) that the model calls:
    under PEFT's ``modules_to_save=["lm_head"]``, the active adapter's trainable copy."""
    inner = unwrap(model)
    head = inner.get_output_embeddings() if hasattr(inner, "get_output_embeddings") else None
    copies = getattr(head, "modules_to_save", None)
    if isinstance(copies, torch.nn.ModuleDict):  # peft's ModulesToSaveWrapper
        active = [name for name in getattr(head, "active_adapters", []) if name in copies]
        head = (copies[active[0]] if active and not head.disable_adapters
                else head.original_module)
    return head


def logits_bias(model, head):
    """The bias of the logits: the head's, plus the one the model adds after it (BART's and
    Marian's ``final_logits_bias``), or None."""
    extra = getattr(unwrap(model), "final_logits_bias", None)
    if not torch.is_tensor(extra):
        return head.bias
    extra = extra.view(-1).to(head.weight.dtype)
    return extra if head.bias is None else head.bias + extra


def decoder_inputs(inner, labels):
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
