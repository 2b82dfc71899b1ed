"""R-Drop for Hugging Face models: :class:`RDropTrainer` (a ``transformers.Trainer``),
:class:`RDropSeq2SeqTrainer` (a ``Seq2SeqTrainer``) and :class:`RDropMixin`, which gives any
Trainer subclass (TRL's ``SFTTrainer``, say) R-Drop's training loss, computed by this
project's core (:func:`rdrop_fairseq.core.rdrop_loss`, or
:func:`rdrop_fairseq.fused_linear.fused_linear_rdrop_loss` from the hidden states).

    from rdrop_fairseq.hf import RDropTrainer
    trainer = RDropTrainer(model=model, args=training_args, train_dataset=train, rdrop_alpha=1.0)
    trainer.train()

Each training batch ``x`` goes through the model once as ``[x; x]`` (dropout draws a
different mask for each half), as the fairseq criteria do. The loss of a labelled item:

* classification (sequence or token heads, masked LM), and the tokens of a causal LM or of
  an encoder-decoder model's target: ``CE(P1) + CE(P2) + alpha * 1/2 (KL(P1||P2) +
  KL(P2||P1))``, the cross-entropy label-smoothed with ``label_smoothing_factor`` as
  Hugging Face smooths it (``eps / V`` on every class);
* regression (one output): ``(y1 - y)^2 + (y2 - y)^2 + alpha * (y1 - y2)^2``;

summed over the items and divided by the number of labelled items of one pass in the
whole accumulated batch (examples for sequence heads, tokens not labelled -100 otherwise;
for a causal LM, the tokens after the first, as the model shifts its labels). So ``alpha``
means what ``--rdrop-alpha`` means in fairseq, and ``gradient_accumulation_steps = k``
gives the gradient of one batch k times as large. Evaluation, prediction and generation
run one pass, with the model's own loss. Needs the ``hf`` extra; importing
``rdrop_fairseq`` alone does not import transformers.
"""

import math
import os
import warnings
from collections.abc import Mapping

import torch
import torch.nn.functional as F
import transformers
from packaging.version import Version
from transformers import Seq2SeqTrainer, Trainer
from transformers.models.auto import modeling_auto as auto

from .core import (IMPLS, RDropBatchError, chunk_budget_mb, duplicate_net_input,
                   mse_consistency, rdrop_loss)
from .fused_linear import fused_linear_rdrop_loss

__all__ = ["RDropMixin", "RDropTrainer", "RDropSeq2SeqTrainer", "labelled_items",
           "declare_loss_scaling", "warmup_arguments", "TRANSFORMERS_RANGE"]

IGNORE_INDEX = -100  # Hugging Face's label for "no loss here"

# The transformers versions admitted (setup.py's hf extra says the same; tests check both):
# from the oldest the suite has run to the next major release
TRANSFORMERS_RANGE = ("4.48.0", "6")

# Model configurations whose head does more than a linear layer after the hidden states,
# which the fused path does not reproduce: attribute, and what it does
_HEAD_EXTRAS = {
    "final_logit_softcapping": "soft-caps the logits",
    "logit_scale": "scales the logits (logit_scale)",
    "logits_scaling": "divides the logits by logits_scaling",
}


# ------------------------------------------------- the transformers versions, in one place

def check_transformers_version(version=None):
    """A clear error where the installed transformers is outside :data:`TRANSFORMERS_RANGE`."""
    version = Version(version or transformers.__version__)
    low, high = (Version(v) for v in TRANSFORMERS_RANGE)
    if not low <= version < high:
        raise RuntimeError(
            f"rdrop_fairseq.hf supports transformers >= {low}, < {high}; this is {version}: "
            f"pip install 'transformers>={low},<{high}' (before {low} the Trainer's "
            "gradient-accumulation rules differ between patch releases)")


def declare_loss_scaling(trainer, scaled):
    """Tell ``trainer`` whether its ``compute_loss`` returns a loss already divided by the
    labelled items of the whole accumulated batch (``scaled``: the Trainer must not divide
    it by the accumulation steps) or a mean over each micro-batch (it must). transformers
    5.19 and later read ``loss_is_scaled_for_ga``; 4.48 to 5.18 decide from
    ``model_accepts_loss_kwargs`` (and, from 4.53, a ``num_items_in_batch`` that is not
    None, which :meth:`RDropMixin.get_batch_samples` always gives), which also says whether
    the Trainer passes ``num_items_in_batch`` to the model."""
    trainer.loss_is_scaled_for_ga = scaled
    trainer.model_accepts_loss_kwargs = scaled


def warmup_arguments(fraction):
    """TrainingArguments options for a linear warm-up over ``fraction`` of the updates:
    ``--warmup_ratio`` where TrainingArguments has it (transformers 4), ``--warmup_steps``
    with the fraction otherwise (transformers 5 reads a value below 1 as a ratio)."""
    import dataclasses

    from transformers import TrainingArguments

    fields = {field.name for field in dataclasses.fields(TrainingArguments)}
    return ["--warmup_ratio" if "warmup_ratio" in fields else "--warmup_steps", str(fraction)]


# ------------------------------------------------------------------------------ the loss

def labelled_items(labels, causal=False):
    """Labelled items of one pass in ``labels``, as a tensor (no host-device sync):
    examples of a regression batch (float labels), else labels other than -100 (for a
    causal LM, from the second position on: the model predicts token t+1 at t)."""
    if labels.is_floating_point():
        return torch.tensor(labels.size(0), device=labels.device)
    if causal:
        labels = labels[..., 1:]
    return labels.ne(IGNORE_INDEX).sum()


class RDropMixin:
    """R-Drop's training loss for a ``transformers.Trainer`` subclass: put it first,
    ``class RDropSFTTrainer(RDropMixin, SFTTrainer): pass``.

    Keyword arguments besides the Trainer's: ``rdrop_alpha`` (default 1.0; a finite number
    >= 0; 0 trains on both passes without the consistency term), ``rdrop_impl``
    (``auto``: the Triton kernel on CUDA when triton imports, else torch; ``torch``;
    ``triton``), ``rdrop_fused_linear`` (language-model heads: the loss from the hidden
    states and the output embedding, a chunk at a time, so that the 2N x V logits are never
    made) and ``rdrop_chunk_mb`` (the fused path's chunk budget, MiB; 0 automatic).
    Covered: sequence classification and regression, token classification, masked LM,
    causal LM, encoder-decoder LM. Anything else is refused when the trainer is made.
    """

    def __init__(self, *args, rdrop_alpha=1.0, rdrop_impl="auto", rdrop_fused_linear=False,
                 rdrop_chunk_mb=0.0, **kwargs):
        check_transformers_version()
        # refused before the Trainer makes its output_dir
        self.rdrop_alpha = _checked_alpha(rdrop_alpha)
        training_args = kwargs.get("args", args[1] if len(args) > 1 else None)
        self.rdrop_impl = _checked_impl(rdrop_impl, getattr(training_args, "use_cpu", False))
        self.rdrop_fused_linear = bool(rdrop_fused_linear)
        chunk_budget_mb(float(rdrop_chunk_mb), torch.empty(0))  # finite, >= 0
        self.rdrop_chunk_mb = float(rdrop_chunk_mb)
        self._rdrop_smoothing = float(getattr(training_args, "label_smoothing_factor", 0.0) or 0)
        model = kwargs.get("model", args[0] if args else None)
        if model is not None:
            self._rdrop_kind = self._rdrop_check_model(model)
        if kwargs.get("compute_loss_func") is not None:
            raise ValueError(f"{type(self).__name__} computes the training loss itself: leave "
                             "out compute_loss_func (or use the plain Trainer)")
        super().__init__(*args, **kwargs)
        declare_loss_scaling(self, True)
        if self.label_names not in (["labels"], []):
            raise ValueError(f"{type(self).__name__} reads the labels from inputs['labels'], and "
                             f"this model or TrainingArguments.label_names names {self.label_names}")
        self._first_batch_checked = False

    def call_model_init(self, trial=None):
        """A model built by ``model_init`` gets the checks a ``model`` gets."""
        model = super().call_model_init(trial)
        self._rdrop_kind = self._rdrop_check_model(model)
        return model

    def _rdrop_check_model(self, model):
        kind = _model_kind(model)
        if self.rdrop_fused_linear:
            _check_fused_head(model, kind)
        if self.rdrop_alpha and not _has_dropout(model):
            warnings.warn(
                f"{type(self).__name__}: rdrop_alpha {self.rdrop_alpha} but every dropout of "
                f"{type(_unwrap(model)).__name__} is 0: the two passes are identical and the "
                "KL is always 0. Set a dropout above 0 (hidden, attention, or LoRA's "
                "lora_dropout)", UserWarning, stacklevel=3)
        return kind

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        """R-Drop's loss in training; the model's own loss (one pass) in evaluation."""
        if not model.training:
            return super().compute_loss(model, inputs, return_outputs=return_outputs,
                                        num_items_in_batch=num_items_in_batch)
        labels = inputs.get("labels")
        if not torch.is_tensor(labels):
            hint = "" if self.label_names else (
                "; this model's forward takes no 'labels', so the Trainer drops them from "
                "the batches: use a model with a head (...ForSequenceClassification, "
                "...ForTokenClassification, ...ForMaskedLM, ...ForCausalLM, "
                "...ForConditionalGeneration)")
            raise RDropBatchError(
                f"{type(self).__name__}: a training batch without 'labels' (its keys: "
                f"{', '.join(sorted(inputs))}): R-Drop's loss needs the labels of every "
                f"training batch (-100 marks the tokens without one){hint}")
        if any(key.startswith("cu_seq_lens") for key in inputs):
            raise RDropBatchError(
                f"{type(self).__name__}: a padding-free batch (its sequences packed into one "
                "row, cu_seq_lens_*) cannot go through the model twice as [x; x]: set "
                "padding_free=False (TRL: and a packing strategy other than 'bfd')")
        kind = self._rdrop_kind
        features = {key: value for key, value in inputs.items() if key != "labels"}
        if kind in ("causal", "seq2seq"):
            features.setdefault("use_cache", False)  # no key/value cache of the doubled batch
        if kind == "seq2seq" and features.get("decoder_input_ids") is None:
            # what the model does with labels and no decoder inputs: labels shifted right
            features["decoder_input_ids"] = _unwrap(model).prepare_decoder_input_ids_from_labels(
                labels=labels)
        batch = labels.size(0)
        doubled = duplicate_net_input(features, batch, _path="inputs")
        # a causal LM predicts token t+1 at position t: the target of t is labels[t + 1]
        target = _shifted(labels) if kind == "causal" else labels
        smoothing = self._rdrop_smoothing
        if self.rdrop_fused_linear:
            hidden, weight, bias = _hidden_and_head(model, doubled)
            vocab = weight.size(0)
            if not self._first_batch_checked:
                _check_class_indices(target, vocab)
                self._first_batch_checked = True
            _assert_class_indices_async(target, vocab)
            total = fused_linear_rdrop_loss(
                hidden, weight, target, bias=bias, alpha=self.rdrop_alpha,
                epsilon=_fairseq_epsilon(smoothing, vocab), ignore_index=IGNORE_INDEX,
                chunk_mb=self.rdrop_chunk_mb, impl=self.rdrop_impl).total
            outputs = None
        else:
            outputs = model(**doubled)
            logits = _logits_of(outputs)
            regression = _check_head(logits, target, model)
            if not self._first_batch_checked:  # once: reading the labels back waits for them
                if not regression:
                    _check_class_indices(target, logits.size(-1))
                self._first_batch_checked = True
            if regression:
                predictions = logits.view(-1).float()
                y = target.reshape(-1).float()
                total = (F.mse_loss(predictions, torch.cat([y, y]), reduction="sum")
                         + self.rdrop_alpha * mse_consistency(predictions))
            else:
                vocab = logits.size(-1)
                _assert_class_indices_async(target, vocab)
                # the logits' own buffer may take their gradient, unless the caller reads them
                total = rdrop_loss(logits, target, alpha=self.rdrop_alpha,
                                   epsilon=_fairseq_epsilon(smoothing, vocab),
                                   ignore_index=IGNORE_INDEX, impl=self.rdrop_impl,
                                   grad_in_scores=False if return_outputs else "auto").total
        scale = 1
        if num_items_in_batch is None:  # called outside the training loop: this batch
            num_items_in_batch = labelled_items(labels, causal=kind == "causal")
        elif self.args.average_tokens_across_devices and self.args.world_size > 1:
            # the count is over all processes (get_batch_samples), and DDP averages gradients
            scale = self.args.world_size
        loss = total / torch.as_tensor(num_items_in_batch, device=total.device).clamp_min(1)
        if scale != 1:
            loss = loss * scale
        return (loss, outputs) if return_outputs else loss

    def get_batch_samples(self, epoch_iterator, num_batches, device=None):
        """The next ``num_batches`` batches and their labelled items (:func:`labelled_items`),
        counted here for every model: the Trainer counts only for models whose forward
        takes loss arguments, and R-Drop's loss is normalised by this trainer. (``device``:
        transformers 4.50 and later pass it.)"""
        batches = []
        for _ in range(num_batches):
            try:
                batches.append(next(epoch_iterator))
            except StopIteration:
                break
        causal = getattr(self, "_rdrop_kind", None) == "causal"
        counts = [labelled_items(b["labels"], causal) for b in batches
                  if torch.is_tensor(b.get("labels"))]
        if not counts:
            return batches, None
        items = torch.stack([c.to(device or self.args.device) for c in counts]).sum()
        if self.args.average_tokens_across_devices and self.args.world_size > 1:
            items = self.accelerator.gather(items).sum()
        return batches, items


class RDropTrainer(RDropMixin, Trainer):
    """``transformers.Trainer`` with R-Drop's training loss (:class:`RDropMixin`)."""


class RDropSeq2SeqTrainer(RDropMixin, Seq2SeqTrainer):
    """``transformers.Seq2SeqTrainer`` with R-Drop's training loss: evaluation with
    ``predict_with_generate`` generates from one pass, as the Seq2SeqTrainer does."""


# --------------------------------------------------------------------- checks and helpers

def _checked_alpha(alpha):
    try:
        value = float(alpha)
    except (TypeError, ValueError):
        value = math.nan
    if not value >= 0 or math.isinf(value):
        raise ValueError(f"rdrop_alpha must be a finite number >= 0, got {alpha!r}; use 0 to "
                         "train on both passes without the consistency term")
    return value


def _checked_impl(impl, use_cpu=False):
    if impl not in IMPLS:
        raise ValueError(f"rdrop_impl must be one of {', '.join(IMPLS)}, got {impl!r}")
    if impl == "triton" and os.environ.get("TRITON_INTERPRET") != "1":
        from .triton_kernel import triton_available

        if not triton_available():
            raise ValueError("rdrop_impl 'triton' needs the triton package (pip install "
                             "triton); use 'auto' or 'torch'")
        if use_cpu or not torch.cuda.is_available():
            raise ValueError("rdrop_impl 'triton' needs a CUDA GPU, and this run is on the "
                             "CPU: use 'auto' (torch on the CPU) or 'torch'")
    return impl


def _unwrap(model):
    """The model itself: inside a DataParallel / DDP wrapper, under a PEFT adapter."""
    model = getattr(model, "module", model)
    get_base = getattr(model, "get_base_model", None)  # peft.PeftModel
    return get_base() if callable(get_base) else model


def _model_kind(model):
    """``"causal"``, ``"seq2seq"`` or ``"encoder"`` (sequence or token classification,
    regression, masked LM); a ValueError naming what is covered for anything else."""
    inner = _unwrap(model)
    config = getattr(inner, "config", None)
    name = type(inner).__name__
    covered = ("Covered: sequence classification and regression, token classification, "
               "masked LM, causal LM (...ForCausalLM, GPT-2's LMHeadModel), encoder-decoder "
               "LM (...ForConditionalGeneration, MarianMTModel, EncoderDecoderModel)")
    if getattr(config, "problem_type", None) == "multi_label_classification":
        raise ValueError(f"RDropTrainer: {name} is set up for multi-label classification "
                         f"(problem_type), which R-Drop's loss here does not cover. {covered}")
    if getattr(config, "is_encoder_decoder", False):
        if not callable(getattr(inner, "prepare_decoder_input_ids_from_labels", None)):
            raise ValueError(f"RDropTrainer: {name} is an encoder-decoder model without a "
                             f"language-model head (prepare_decoder_input_ids_from_labels). "
                             f"{covered}")
        return "seq2seq"
    if _is(inner, "CAUSAL_LM") or getattr(config, "is_decoder", False):
        if inner.get_output_embeddings() is None:
            raise ValueError(f"RDropTrainer: {name} is a decoder without a language-model "
                             f"head. {covered}")
        return "causal"
    for uncovered in ("QUESTION_ANSWERING", "MULTIPLE_CHOICE", "PRETRAINING",
                      "NEXT_SENTENCE_PREDICTION", ""):
        if _is(inner, uncovered):
            what = uncovered.lower().replace("_", " ") or "a model without a head"
            raise ValueError(f"RDropTrainer does not train {name} ({what}). {covered}")
    return "encoder"


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


def _output_head(model):
    """The output embedding (the LM head's projection) and the bias the model adds after it
    (BART's and Marian's ``final_logits_bias``), or None."""
    inner = _unwrap(model)
    head = inner.get_output_embeddings() if hasattr(inner, "get_output_embeddings") else None
    extra = getattr(inner, "final_logits_bias", None)
    return head, (extra.view(-1) if torch.is_tensor(extra) else None)


def _check_fused_head(model, kind):
    """Refuse a head the fused path cannot reproduce exactly, naming what differs: the loss
    is computed from the hidden states the output embedding receives, as ``h W^T + b``."""
    inner = _unwrap(model)
    name = type(inner).__name__
    head, _ = _output_head(model)
    if kind == "encoder" and not _is(inner, "MASKED_LM"):
        raise ValueError(f"rdrop_fused_linear: {name} has no language-model head (it is for "
                         "causal, encoder-decoder and masked LMs); leave it False")
    if not isinstance(head, torch.nn.Linear) or type(head).forward is not torch.nn.Linear.forward:
        raise ValueError(f"rdrop_fused_linear: {name}'s output embedding is "
                         f"{type(head).__name__}, not a plain torch.nn.Linear (an adapter on the "
                         "head, say), which the fused path cannot reproduce; leave it False")
    config = getattr(inner, "config", None)
    for attribute, what in _HEAD_EXTRAS.items():
        value = getattr(config, attribute, None)
        if value is not None and value != 1 and value is not False:
            raise ValueError(f"rdrop_fused_linear: {name}'s head {what} ({attribute} = "
                             f"{value}) after its linear layer, which the fused path does "
                             "not reproduce; leave it False")
    _check_head_is_linear(model, kind)


def _check_head_is_linear(model, kind):
    """What no configuration says: the logits of a small batch (dropout off) are the hidden
    states the head receives times its weight, plus its bias."""
    inner = _unwrap(model)
    head, extra = _output_head(model)
    device = head.weight.device
    ids = torch.arange(1, 6, device=device).remainder(head.weight.size(0)).view(1, 5)
    inputs = {"input_ids": ids}
    if kind == "seq2seq":
        inputs["decoder_input_ids"] = ids
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            logits = _logits_of(model(**inputs)).float()
            hidden, weight, bias = _hidden_and_head(model, inputs)
            fused = F.linear(hidden.float(), weight.float(),
                             None if bias is None else bias.float())
    finally:
        model.train(was_training)
    scale = logits.abs().max().clamp_min(1e-6)
    difference = float((logits - fused).abs().max() / scale)
    tolerance = 1e-4 if head.weight.dtype == torch.float32 else 2e-2
    if not difference <= tolerance:
        raise ValueError(
            f"rdrop_fused_linear: {type(inner).__name__}'s logits are not its output "
            f"embedding applied to the hidden states it receives (relative difference "
            f"{difference:.2g}): the head does something the fused path does not reproduce "
            "(a scale or a cap after the projection, say); leave rdrop_fused_linear False")


def _hidden_and_head(model, inputs):
    """One forward of ``inputs`` up to the output embedding: the hidden states it receives
    (with their graph), its weight, and the bias of the logits (the head's, plus
    ``final_logits_bias``). The head itself is skipped: it returns a 1-element stand-in,
    which whatever the model adds to its logits (a bias) broadcasts to a small tensor."""
    head, extra = _output_head(model)
    seen = []

    def capture(hidden):
        seen.append(hidden)
        return hidden.new_zeros((1,) * hidden.dim())

    head.forward = capture
    try:
        model(**inputs)
    finally:
        del head.forward
    if len(seen) != 1:
        raise ValueError(f"rdrop_fused_linear: the model called its output embedding "
                         f"{len(seen)} times in one forward, not once")
    bias = head.bias
    if extra is not None:
        bias = extra.to(head.weight.dtype) if bias is None else bias + extra
    return seen[0], head.weight, bias


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
            f"RDropTrainer: the model's output has no 'logits' (it has: {keys}); R-Drop "
            "needs the logits of a classification, token-classification or language-model head")
    return logits


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


def _has_dropout(model):
    """Whether any dropout can make the two halves of ``[x; x]`` differ: a dropout module
    with p > 0 (LoRA's included), or a dropout probability > 0 in the configuration (the
    attention dropout that attention functions apply themselves)."""
    if any(isinstance(m, torch.nn.modules.dropout._DropoutNd) and m.p > 0
           for m in model.modules()):
        return True
    config = getattr(_unwrap(model), "config", None)
    values = config.to_dict() if hasattr(config, "to_dict") else {}
    return any(("dropout" in key or "pdrop" in key) and isinstance(value, (int, float))
               and not isinstance(value, bool) and value > 0 for key, value in values.items())


def _check_head(logits, labels, model):
    """Whether the head is a regression; a ValueError saying what to change where the labels
    do not fit the logits (shapes and dtypes only: nothing read back from the device)."""
    problem = getattr(getattr(_unwrap(model), "config", None), "problem_type", None)
    batch = labels.size(0)
    if logits.size(0) != 2 * batch:
        raise ValueError(f"RDropTrainer: the model returned logits of shape "
                         f"{tuple(logits.shape)} for a doubled batch of {2 * batch} rows")
    if logits.dim() == 2 and logits.size(-1) == 1:
        if not labels.is_floating_point():
            raise ValueError(
                f"RDropTrainer: the head has one output (regression) but the labels are "
                f"{labels.dtype}: give float labels (e.g. an STS-B score), or a head with "
                "num_labels >= 2 for classes")
        if labels.numel() != batch:
            raise ValueError(f"RDropTrainer: regression labels must be one number per "
                             f"example, got shape {tuple(labels.shape)}")
        return True
    if problem == "regression" or labels.is_floating_point():
        raise ValueError(
            f"RDropTrainer: {labels.dtype} labels with a head of {logits.size(-1)} outputs: "
            "multi-label classification and multi-output regression are not supported; "
            "give class indices (torch.long), or a one-output head for regression")
    one_pass = (batch, *logits.shape[1:-1])  # a label per example, or per token
    if labels.numel() != math.prod(one_pass):
        raise ValueError(f"RDropTrainer: labels of shape {tuple(labels.shape)} do not fit "
                         f"logits of shape {tuple(logits.shape)} (both passes): expected "
                         f"{one_pass}, one pass's")
    return False


def _bad_class_indices(labels, classes):
    return ~(labels.eq(IGNORE_INDEX) | (labels.ge(0) & labels.lt(classes)))


def _check_class_indices(labels, classes):
    bad = _bad_class_indices(labels, classes)
    if bool(bad.any()):
        values = sorted(set(labels[bad].tolist()))[:10]
        raise ValueError(f"RDropTrainer: labels {values} are not class indices of a head with "
                         f"{classes} outputs (0 to {classes - 1}, or -100 for none)")


def _assert_class_indices_async(labels, classes):
    """After the first batch: checked without waiting for the device (on CUDA, a device-side
    assert rather than the Triton kernel reading out of bounds)."""
    torch._assert_async(~_bad_class_indices(labels, classes).any(),
                        f"RDropTrainer: a label is not a class index (0 to {classes - 1}, "
                        "or -100)")
