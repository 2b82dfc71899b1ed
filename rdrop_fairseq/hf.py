"""R-Drop for Hugging Face models: :class:`RDropTrainer`, a ``transformers.Trainer`` whose
training loss is R-Drop, computed by this project's core (:func:`rdrop_fairseq.core.rdrop_loss`:
the chunked torch implementation, or the Triton kernel on CUDA).

    from rdrop_fairseq.hf import RDropTrainer
    trainer = RDropTrainer(model=model, args=training_args, train_dataset=train, rdrop_alpha=1.0)
    trainer.train()

Each training batch ``x`` goes through the model once as ``[x; x]`` (dropout draws a
different mask for each half), as the fairseq criteria do. The loss of a labelled item is
the one ``sentence_prediction_rdrop`` computes:

* classification (sequence or token heads, masked LM): ``CE(P1) + CE(P2) + alpha * 1/2
  (KL(P1||P2) + KL(P2||P1))``;
* regression (one output): ``(y1 - y)^2 + (y2 - y)^2 + alpha * (y1 - y2)^2``;

summed over the items and divided by the number of labelled items of one pass in the
whole accumulated batch (the Trainer's ``num_items_in_batch``: examples for sequence
heads, tokens not labelled -100 for token and masked-LM heads). So ``alpha`` means what
``--rdrop-alpha`` means in fairseq, and ``gradient_accumulation_steps = k`` gives the
gradient of one batch k times as large. Evaluation and prediction run one pass, with the
model's own loss. Needs the ``hf`` extra (``pip install -e .[hf]``); importing
``rdrop_fairseq`` alone does not import transformers.
"""

import math
import os
from collections.abc import Mapping

import torch
import torch.nn.functional as F
from transformers import Trainer
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from .core import IMPLS, RDropBatchError, duplicate_net_input, mse_consistency, rdrop_loss

__all__ = ["RDropTrainer", "labelled_items"]

IGNORE_INDEX = -100  # Hugging Face's label for "no loss here"


def labelled_items(labels):
    """Labelled items of one pass in ``labels``, as a tensor (no host-device sync):
    examples of a regression batch (float labels), else labels other than -100."""
    if labels.is_floating_point():
        return torch.tensor(labels.size(0), device=labels.device)
    return labels.ne(IGNORE_INDEX).sum()


class RDropTrainer(Trainer):
    """``transformers.Trainer`` with R-Drop's training loss (see the module's docstring).

    Keyword arguments besides the Trainer's: ``rdrop_alpha`` (default 1.0; a finite number
    >= 0; 0 trains on both passes without the consistency term) and ``rdrop_impl``
    (``auto``: the Triton kernel on CUDA when triton imports, else torch; ``torch``;
    ``triton``). For sequence classification and regression, token classification and
    masked-LM heads; a causal or encoder-decoder LM is refused when the trainer is made.
    """

    # compute_loss divides by the labelled items of the whole accumulated batch itself
    loss_is_scaled_for_ga = True

    def __init__(self, *args, rdrop_alpha=1.0, rdrop_impl="auto", **kwargs):
        # refused before the Trainer makes its output_dir
        self.rdrop_alpha = _checked_alpha(rdrop_alpha)
        training_args = kwargs.get("args", args[1] if len(args) > 1 else None)
        self.rdrop_impl = _checked_impl(rdrop_impl, getattr(training_args, "use_cpu", False))
        model = kwargs.get("model", args[0] if args else None)
        if model is not None:
            _check_model(model)
        if training_args is not None and training_args.label_smoothing_factor:
            raise ValueError(
                f"RDropTrainer: label_smoothing_factor {training_args.label_smoothing_factor} "
                "is not supported (R-Drop's cross-entropy is unsmoothed here): set it to 0")
        if kwargs.get("compute_loss_func") is not None:
            raise ValueError("RDropTrainer computes the training loss itself: leave out "
                             "compute_loss_func (or use transformers.Trainer)")
        super().__init__(*args, **kwargs)
        if self.label_names not in (["labels"], []):
            raise ValueError(f"RDropTrainer reads the labels from inputs['labels'], and this "
                             f"model or TrainingArguments.label_names names {self.label_names}")
        self._first_batch_checked = False

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
                "...ForTokenClassification, ...ForMaskedLM)")
            raise RDropBatchError(
                "RDropTrainer: a training batch without 'labels' (its keys: "
                f"{', '.join(sorted(inputs))}): R-Drop's loss needs the labels of every "
                f"training batch (-100 marks the tokens without one){hint}")
        features = {key: value for key, value in inputs.items() if key != "labels"}
        batch = labels.size(0)
        outputs = model(**duplicate_net_input(features, batch, _path="inputs"))
        logits = outputs.get("logits") if isinstance(outputs, Mapping) else None
        if not torch.is_tensor(logits):
            keys = ", ".join(outputs) if isinstance(outputs, Mapping) else type(outputs).__name__
            raise ValueError(
                f"RDropTrainer: the model's output has no 'logits' (it has: {keys}); R-Drop "
                "needs the logits of a classification, token-classification or masked-LM head")
        regression = _check_head(logits, labels, model)
        if not self._first_batch_checked:  # once: reading the labels back waits for them
            if not regression:
                _check_class_indices(labels, logits.size(-1))
            self._first_batch_checked = True
        if regression:
            predictions = logits.view(-1).float()
            target = labels.reshape(-1).float()
            total = (F.mse_loss(predictions, torch.cat([target, target]), reduction="sum")
                     + self.rdrop_alpha * mse_consistency(predictions))
        else:
            _assert_class_indices_async(labels, logits.size(-1))
            # the logits' own buffer may take their gradient, unless the caller reads them
            total = rdrop_loss(logits, labels, alpha=self.rdrop_alpha,
                               ignore_index=IGNORE_INDEX, impl=self.rdrop_impl,
                               grad_in_scores=False if return_outputs else "auto").total
        scale = 1
        if num_items_in_batch is None:  # called outside the training loop: this batch
            num_items_in_batch = labelled_items(labels)
        elif self.args.average_tokens_across_devices and self.args.world_size > 1:
            # the count is over all processes (get_batch_samples), and DDP averages gradients
            scale = self.args.world_size
        loss = total / torch.as_tensor(num_items_in_batch, device=total.device).clamp_min(1)
        if scale != 1:
            loss = loss * scale
        return (loss, outputs) if return_outputs else loss

    def get_batch_samples(self, epoch_iterator, num_batches, device):
        """The next ``num_batches`` batches and their labelled items (:func:`labelled_items`),
        counted here for every model: the Trainer counts only for models whose forward
        takes loss arguments, and R-Drop's loss is normalised by this trainer."""
        batches = []
        for _ in range(num_batches):
            try:
                batches.append(next(epoch_iterator))
            except StopIteration:
                break
        counts = [labelled_items(b["labels"]) for b in batches
                  if torch.is_tensor(b.get("labels"))]
        if not counts:
            return batches, None
        items = torch.stack([c.to(device) for c in counts]).sum()
        if self.args.average_tokens_across_devices and self.args.world_size > 1:
            items = self.accelerator.gather(items).sum()
        return batches, items


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


def _check_model(model):
    """Refuse the heads R-Drop's loss here does not cover, before anything is made."""
    inner = getattr(model, "module", model)  # a DataParallel / DDP wrapper
    config = getattr(inner, "config", None)
    name = type(inner).__name__
    if (name in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values()
            or getattr(config, "is_decoder", False)):
        raise ValueError(
            f"RDropTrainer does not train causal language models ({name}): their labels are "
            "shifted inside the model, which R-Drop's loss here does not do. Supported: "
            "sequence classification and regression, token classification, masked LM")
    if getattr(config, "is_encoder_decoder", False):
        raise ValueError(f"RDropTrainer does not train encoder-decoder models ({name}); for "
                         "translation or summarization use the fairseq criteria")
    if getattr(config, "problem_type", None) == "multi_label_classification":
        raise ValueError(f"RDropTrainer: {name} is set up for multi-label classification "
                         "(problem_type), which R-Drop's loss here does not cover")


def _check_head(logits, labels, model):
    """Whether the head is a regression; a ValueError saying what to change where the labels
    do not fit the logits (shapes and dtypes only: nothing read back from the device)."""
    problem = getattr(getattr(model, "config", None), "problem_type", None)
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
