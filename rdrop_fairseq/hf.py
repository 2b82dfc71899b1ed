"""R-Drop for Hugging Face models: :class:`RDropTrainer` (a ``transformers.Trainer``),
:class:`RDropSeq2SeqTrainer` (a ``Seq2SeqTrainer``), :class:`RDropMixin`, which gives any
Trainer subclass (TRL's ``SFTTrainer``, say) R-Drop's training loss, and
:func:`rdrop_hf_loss`, the same loss for an Accelerate or plain-PyTorch loop. The loss is
computed by this project's core (:func:`rdrop_fairseq.core.rdrop_loss`, or
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

summed over the items and divided by the number of labelled items of one pass in the whole
accumulated batch (examples for sequence heads, tokens not labelled -100 otherwise; for a
model that shifts its labels, the tokens after the first). A mixture of experts adds its
router loss to each pass, as its own loss does. Whether a model shifts its labels is read
from what it does (:func:`model_kind`), not from its class name. So ``alpha`` means what
``--rdrop-alpha`` means in fairseq, ``gradient_accumulation_steps = k`` gives the gradient
of one batch k times as large, and at ``alpha = 0`` with dropout off the loss is twice the
model's own. Evaluation, prediction and generation run one pass, with the model's own
loss. Needs the ``hf`` extra; importing ``rdrop_fairseq`` alone does not import
transformers.
"""

import math
import os
import warnings
from collections import namedtuple
from collections.abc import Mapping

import torch
import torch.nn.functional as F
import transformers
from packaging.version import Version
from transformers import Seq2SeqTrainer, Trainer

from .core import RDropBatchError, duplicate_net_input, mse_consistency, rdrop_loss
from .ops.rows import chunk_budget_mb
from .options import IMPLS
from .fused_linear import fused_linear_rdrop_loss
from .hf_kind import (IGNORE_INDEX, KINDS, _decoder_inputs, _is, _logits_of, _probe_call,
                      _router_loss, _takes, _unwrap, read_kind)

__all__ = ["RDropMixin", "RDropTrainer", "RDropSeq2SeqTrainer", "rdrop_hf_loss", "model_kind",
           "labelled_items", "declare_loss_scaling", "warmup_arguments", "TRANSFORMERS_RANGE"]


# The transformers versions admitted (setup.py's hf extra says the same; tests check both):
# 4.48.0 accumulates a wrong gradient, and before 4.49 DeepSpeed divides a loss already
# normalised over the accumulated batch by the accumulation steps again
TRANSFORMERS_RANGE = ("4.49.0", "6")


# Model configurations whose head does more than a linear layer after the hidden states,
# which the fused path does not reproduce: attribute, and what it does
_HEAD_EXTRAS = {
    "final_logit_softcapping": "soft-caps the logits",
    "logit_scale": "scales the logits (logit_scale)",
    "logits_scaling": "divides the logits by logits_scaling",
}

# Batch entries that hold images or videos in the order they appear in the batch (Qwen-VL's
# flattened patches with their grids, LLaVA's images, Idefics' per-example stacks): [x; x]
# shows them again in that order, so they are repeated along dim 0 whatever its size
_VISUAL_PREFIXES = ("pixel_values", "pixel_attention_mask", "image_", "video_",
                    "second_per_grid_ts")


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
    5.19 and later read ``loss_is_scaled_for_ga``; 4.49 to 5.18 decide from
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


def labelled_items(labels, causal=False):
    """Labelled items of one pass in ``labels``, as a tensor (no host-device sync):
    examples of a regression batch (float labels), else labels other than -100 (for a
    causal LM, from the second position on: the model predicts token t+1 at t)."""
    if labels.is_floating_point():
        return torch.full((), labels.size(0), device=labels.device)  # a fill: no copy
    if causal:
        labels = labels[..., 1:]
    return labels.ne(IGNORE_INDEX).sum()


def rdrop_hf_loss(model, inputs, *, kind, alpha=1.0, label_smoothing=0.0,
                  num_items_in_batch=None, world_size=1, impl="auto", fused_linear=False,
                  chunk_mb=0.0, grad_in_scores="auto", check_labels=False, accuracy=False,
                  accumulation_steps=1):
    """R-Drop's training loss of one batch of a Hugging Face model (the trainers' own code),
    for a loop of your own::

        kind = model_kind(model)                      # once, before training
        out = rdrop_hf_loss(model, batch, kind=kind, alpha=1.0)
        out.loss.backward()

    ``inputs``: the batch as the model takes it, with ``labels`` (-100: no loss). ``kind``:
    :func:`model_kind`'s answer. ``label_smoothing``: Hugging Face's factor (``f / V`` on
    every class). ``num_items_in_batch``: what the sum is divided by, the labelled items of
    one pass (:func:`labelled_items`) summed over the accumulated micro-batches and the
    processes; None: this batch's. ``world_size``: the processes whose gradients DDP
    averages when the count is over all of them (the loss is multiplied by it, so that the
    average is the whole batch's gradient). ``accumulation_steps``: the micro-batches whose
    gradients add up to one update, when ``num_items_in_batch`` counts them all (a mixture
    of experts' router loss, a mean per micro-batch, is divided by it, and not multiplied
    by ``world_size``: DDP's average of the processes' means is the whole batch's).
    ``impl``, ``fused_linear``, ``chunk_mb``: as
    :class:`RDropMixin`'s ``rdrop_*`` options. ``grad_in_scores``: as
    :func:`core.rdrop_loss`; by default the logits' buffer may take their gradient, so
    pass False to read ``outputs.logits`` afterwards. ``check_labels``: check on the host that
    the labels are class indices of the head (it waits for the device: the first batch's);
    later batches are checked on the device without waiting. ``accuracy``: also count the
    labelled items whose highest logit is the label (``correct``) and, through the logits,
    sum their entropy (one more pass over the logits, a chunk of rows at a time). With every dropout off the two passes are the same and the KL is 0."""
    labels = inputs.get("labels")
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
    features = {key: value for key, value in inputs.items() if key != "labels"}
    if _takes(model, "use_cache"):  # no key/value cache of the doubled batch
        features.setdefault("use_cache", False)
    if kind == "seq2seq" and features.get("decoder_input_ids") is None:
        # what the model does with labels and no decoder inputs: labels shifted right
        features["decoder_input_ids"] = _decoder_inputs(_unwrap(model), labels)
    doubled = doubled_batch(features, labels.size(0))
    # a causal LM predicts token t+1 at position t: the target of t is labels[t + 1]
    target = _shifted(labels) if kind == "causal" else labels
    correct = entropy = None
    if fused_linear:
        predictions = (torch.empty((2, target.numel()), dtype=torch.long, device=target.device)
                       if accuracy else None)
        outputs, result = _forward_through_fused_head(
            model, doubled, target, alpha=alpha, smoothing=label_smoothing,
            chunk_mb=chunk_mb, impl=impl, check_labels=check_labels, predictions=predictions)
        total, nll, kl = result.total, result.nll, result.kl
        if accuracy:
            correct = _correct(predictions, target)
    else:
        outputs = model(**doubled)
        logits = _logits_of(outputs)
        regression = _check_head(logits, target, model)
        if check_labels and not regression:
            _check_class_indices(target, logits.size(-1))
        if regression:
            predictions = logits.view(-1).float()
            y = target.reshape(-1).float()
            nll = F.mse_loss(predictions, torch.cat([y, y]), reduction="sum")
            kl = mse_consistency(predictions)
            total = nll + alpha * kl
            nll, kl = nll.detach(), kl.detach()
        else:
            vocab = logits.size(-1)
            _assert_class_indices_async(target, vocab)
            if accuracy:  # before the loss: the logits' buffer may then take their gradient
                correct = _correct(logits.detach().argmax(-1).view(2, -1), target)
                entropy = _entropy_sum(logits.detach().view(2, -1, vocab), target)
            # the logits' own buffer may take their gradient, unless the caller reads them
            result = rdrop_loss(logits, target, alpha=alpha,
                                epsilon=_fairseq_epsilon(label_smoothing, vocab),
                                ignore_index=IGNORE_INDEX, impl=impl,
                                grad_in_scores=grad_in_scores)
            total, nll, kl = result.total, result.nll, result.kl
    items = labelled_items(labels, causal=kind == "causal")
    count = items if num_items_in_batch is None else num_items_in_batch
    loss = total / torch.as_tensor(count, device=total.device).clamp_min(1)
    if world_size != 1:
        loss = loss * world_size
    # each pass's router loss, as the model's own loss adds it
    loss = loss + 2 * _router_loss(model, outputs) / accumulation_steps
    return RDropHFLoss(loss, outputs, nll, kl, items, correct, entropy)


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


def model_kind(model, kind="auto", fused_linear=False):
    """How ``model``'s logits line up with its labels, one of ``"causal"``, ``"seq2seq"``,
    ``"encoder"`` (:func:`rdrop_fairseq.hf_kind.read_kind`: read from what the model does
    with a probe batch, or ``kind`` as given), or a ValueError saying why it cannot be
    trained here. ``fused_linear``: also check that its head is what the fused path
    computes."""
    kind = read_kind(model, kind)
    if fused_linear:
        _check_fused_head(model, kind)
    return kind


# ---------------------------------------------------------------------------- the trainers

class RDropMixin:
    """R-Drop's training loss for a ``transformers.Trainer`` subclass: put it first,
    ``class RDropSFTTrainer(RDropMixin, SFTTrainer): pass``.

    Keyword arguments besides the Trainer's: ``rdrop_alpha`` (default 1.0; a finite number
    >= 0; 0 trains on both passes without the consistency term), ``rdrop_impl``
    (``auto``: the Triton kernel on CUDA when triton imports, else torch; ``torch``;
    ``triton``), ``rdrop_fused_linear`` (language-model heads: the loss from the hidden
    states and the output embedding, a chunk at a time, so that the 2N x V logits are never
    made), ``rdrop_chunk_mb`` (the fused path's chunk budget, MiB; 0 automatic) and
    ``rdrop_model_kind`` (``auto``: read from the model, :func:`model_kind`; or
    ``causal``, ``seq2seq``, ``encoder``). Logged at ``logging_steps`` besides ``loss``:
    ``rdrop_ce`` (the cross-entropy of one pass per labelled item, comparable with
    ``eval_loss``) and ``rdrop_kl``. Anything it cannot train is refused when the trainer
    is made.
    """

    def __init__(self, *args, rdrop_alpha=1.0, rdrop_impl="auto", rdrop_fused_linear=False,
                 rdrop_chunk_mb=0.0, rdrop_model_kind="auto", **kwargs):
        check_transformers_version()
        # refused before the Trainer makes its output_dir
        self.rdrop_alpha = _checked_alpha(rdrop_alpha)
        training_args = kwargs.get("args", args[1] if len(args) > 1 else None)
        self.rdrop_impl = _checked_impl(rdrop_impl, getattr(training_args, "use_cpu", False))
        self.rdrop_fused_linear = bool(rdrop_fused_linear)
        chunk_budget_mb(float(rdrop_chunk_mb), torch.empty(0))  # finite, >= 0
        self.rdrop_chunk_mb = float(rdrop_chunk_mb)
        if rdrop_model_kind not in ("auto", *KINDS):
            raise ValueError(f"rdrop_model_kind must be 'auto' or one of {', '.join(KINDS)}, "
                             f"got {rdrop_model_kind!r}")
        self.rdrop_model_kind = rdrop_model_kind
        self._rdrop_smoothing = float(getattr(training_args, "label_smoothing_factor", 0.0) or 0)
        _check_parallelism(type(self).__name__, training_args)
        _check_trl_loss(type(self).__name__, training_args)
        model = kwargs.get("model", args[0] if args else None)
        if model is not None:
            self._rdrop_kind = self._rdrop_check_model(model)
        if kwargs.get("compute_loss_func") is not None:
            raise ValueError(f"{type(self).__name__} computes the training loss itself: leave "
                             "out compute_loss_func (or use the plain Trainer)")
        super().__init__(*args, **kwargs)
        # again on the arguments the Trainer made where none were given
        _check_parallelism(type(self).__name__, self.args)
        _check_trl_loss(type(self).__name__, self.args)
        declare_loss_scaling(self, True)
        if self.label_names not in (["labels"], []):
            raise ValueError(f"{type(self).__name__} reads the labels from inputs['labels'], and "
                             f"this model or TrainingArguments.label_names names {self.label_names}")
        self._first_batch_checked = False
        self._rdrop_sums = None  # nll, kl, items, correct, tokens, entropy since the last log
        # TRL's trainers log their training metrics from _metrics: token accuracy, the tokens
        # seen and, through the logits, the entropy are given to them
        self._rdrop_trl_metrics = isinstance(getattr(self, "_metrics", None), Mapping)

    def train(self, *args, **kwargs):
        self._rdrop_sums = None  # nothing from an earlier train() in the first log
        return super().train(*args, **kwargs)

    def call_model_init(self, trial=None):
        """A model built by ``model_init`` gets the checks a ``model`` gets."""
        model = super().call_model_init(trial)
        self._rdrop_kind = self._rdrop_check_model(model)
        return model

    def _rdrop_check_model(self, model):
        try:
            kind = model_kind(model, self.rdrop_model_kind, fused_linear=self.rdrop_fused_linear)
        except ValueError as error:
            raise ValueError(f"{type(self).__name__}: {error}") from None
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
            # the model's own mean: no item count passed to it nor multiplied by processes
            # (what the Trainer does for a model that takes no loss arguments)
            self.model_accepts_loss_kwargs = False
            try:
                return super().compute_loss(model, inputs, return_outputs=return_outputs)
            finally:
                declare_loss_scaling(self, True)
        if not torch.is_tensor(inputs.get("labels")) and not self.label_names:
            raise RDropBatchError(
                f"{type(self).__name__}: a training batch without 'labels' (its keys: "
                f"{', '.join(sorted(inputs))}): this model's forward takes no 'labels', so "
                "the Trainer drops them from the batches: use a model with a head "
                "(...ForSequenceClassification, ...ForTokenClassification, ...ForMaskedLM, "
                "...ForCausalLM, ...ForConditionalGeneration)")
        world_size, accumulation = 1, 1
        if num_items_in_batch is not None:  # the count is of the whole accumulated batch
            accumulation = getattr(self, "current_gradient_accumulation_steps",
                                   self.args.gradient_accumulation_steps)
            if self.args.average_tokens_across_devices and self.args.world_size > 1:
                # the count is over all processes (get_batch_samples); DDP averages gradients
                world_size = self.args.world_size
        result = rdrop_hf_loss(
            model, inputs, kind=self._rdrop_kind, alpha=self.rdrop_alpha,
            label_smoothing=self._rdrop_smoothing, num_items_in_batch=num_items_in_batch,
            world_size=world_size, impl=self.rdrop_impl, fused_linear=self.rdrop_fused_linear,
            chunk_mb=self.rdrop_chunk_mb, grad_in_scores=False if return_outputs else "auto",
            check_labels=not self._first_batch_checked, accuracy=self._rdrop_trl_metrics,
            accumulation_steps=accumulation)
        self._first_batch_checked = True
        self._rdrop_add_to_log(result, inputs)
        return (result.loss, result.outputs) if return_outputs else result.loss

    def _rdrop_add_to_log(self, result, inputs):
        """Sums for the next log, kept on the device (no synchronisation per step)."""
        device = result.nll.device
        mask = inputs.get("attention_mask")
        tokens = (mask.sum() if torch.is_tensor(mask)
                  else torch.full((), inputs["labels"].numel(), device=device))
        zero = result.nll.new_zeros(())
        correct = zero if result.correct is None else result.correct
        entropy = zero if result.entropy is None else result.entropy
        step = torch.stack([value.to(device).float() for value in
                            (result.nll.detach(), result.kl.detach(), result.items, correct,
                             tokens, entropy)])
        self._rdrop_sums = step if self._rdrop_sums is None else self._rdrop_sums + step

    def log(self, logs, *args, **kwargs):
        """The Trainer's log, with ``rdrop_ce`` and ``rdrop_kl`` per labelled item of one
        pass since the last log, summed over the processes, where the log has a training
        ``loss``."""
        if "loss" in logs and self._rdrop_sums is not None:
            sums = self._rdrop_sums
            if self.args.world_size > 1:
                sums = self.accelerator.reduce(sums, reduction="sum")
            nll, kl, items, correct, tokens, entropy = sums.tolist()
            logs = {**logs, "rdrop_ce": round(nll / 2 / max(items, 1), 4),
                    "rdrop_kl": round(kl / max(items, 1), 4)}
            self._rdrop_sums = None
            if self._rdrop_trl_metrics:  # what TRL's own loss would have logged
                self._total_train_tokens = getattr(self, "_total_train_tokens", 0) + int(tokens)
                self._metrics["train"]["mean_token_accuracy"].append(correct / 2 / max(items, 1))
                self._metrics["train"]["num_tokens"] = [self._total_train_tokens]
                if not self.rdrop_fused_linear:  # (the fused path makes no logits)
                    self._metrics["train"]["entropy"].append(entropy / 2 / max(items, 1))
        return super().log(logs, *args, **kwargs)

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


# ------------------------------------------------------------------- where it is trained

def _check_parallelism(name, args):
    """Refuse the parallel settings in which [x; x] or the item count would be wrong."""
    if args is None:
        return
    if getattr(args, "n_gpu", 1) > 1:
        # the Trainer wraps the model in nn.DataParallel, which would send x to one GPU and
        # its copy to another with the same dropout masks: the KL would always be 0
        raise ValueError(
            f"{name}: {args.n_gpu} GPUs are visible to one process, so the Trainer would use "
            "nn.DataParallel, which splits [x; x] into its two copies with the same dropout "
            "masks (the KL would be 0). Launch one process per GPU: torchrun "
            "--nproc_per_node N train.py (or accelerate launch), or set CUDA_VISIBLE_DEVICES")
    sizes = {"tp_size": getattr(args, "tp_size", None) or 1}
    config = getattr(args, "parallelism_config", None)
    for field in ("tp_size", "cp_size", "sp_size"):
        sizes[field] = max(sizes.get(field, 1), getattr(config, field, None) or 1)
    used = [f"{field} {size}" for field, size in sizes.items() if size > 1]
    if used:
        raise ValueError(
            f"{name}: tensor, context and sequence parallelism ({', '.join(used)}) are not "
            "supported: their processes share or split one batch, which R-Drop's item count "
            "and its [x; x] do not follow. Use data parallelism (DDP, FSDP or DeepSpeed)")


def _check_trl_loss(name, args):
    """TRL's SFTConfig.loss_type: only its plain negative log-likelihood is R-Drop's CE."""
    loss_type = getattr(args, "loss_type", None)
    from_trl = any(cls.__module__.startswith("trl") for cls in type(args).__mro__)
    if from_trl and loss_type not in (None, "nll"):
        raise ValueError(f"{name}: TRL's loss_type {loss_type!r} is not R-Drop's "
                         "cross-entropy, which replaces TRL's loss in training: set "
                         "loss_type='nll'")


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
        from .ops.rows_triton import triton_available

        if not triton_available():
            raise ValueError("rdrop_impl 'triton' needs the triton package (pip install "
                             "triton); use 'auto' or 'torch'")
        if use_cpu or not torch.cuda.is_available():
            raise ValueError("rdrop_impl 'triton' needs a CUDA GPU, and this run is on the "
                             "CPU: use 'auto' (torch on the CPU) or 'torch'")
    return impl


def _head_module(model):
    """The output embedding (the language-model head's projection) that the model calls:
    under PEFT's ``modules_to_save=["lm_head"]``, the active adapter's trainable copy."""
    inner = _unwrap(model)
    head = inner.get_output_embeddings() if hasattr(inner, "get_output_embeddings") else None
    copies = getattr(head, "modules_to_save", None)
    if isinstance(copies, torch.nn.ModuleDict):  # peft's ModulesToSaveWrapper
        active = [name for name in getattr(head, "active_adapters", []) if name in copies]
        head = (copies[active[0]] if active and not head.disable_adapters
                else head.original_module)
    return head


def _logits_bias(model, head):
    """The bias of the logits: the head's, plus the one the model adds after it (BART's and
    Marian's ``final_logits_bias``), or None."""
    extra = getattr(_unwrap(model), "final_logits_bias", None)
    if not torch.is_tensor(extra):
        return head.bias
    extra = extra.view(-1).to(head.weight.dtype)
    return extra if head.bias is None else head.bias + extra


def _check_fused_head(model, kind):
    """Refuse a head the fused path cannot reproduce exactly, naming what differs: the loss
    is computed from the hidden states the output embedding receives, as ``h W^T + b``."""
    inner = _unwrap(model)
    name = type(inner).__name__
    head = _head_module(model)
    if kind == "encoder" and not _is(inner, "MASKED_LM"):
        raise ValueError(f"rdrop_fused_linear: {name} has no language-model head (it is for "
                         "causal, encoder-decoder and masked LMs); leave it False")
    if "forward" in vars(head):  # accelerate's device hook (device_map, offload), say
        raise ValueError(f"rdrop_fused_linear: {name}'s output embedding carries a forward of "
                         "its own (accelerate's hook of device_map='auto' or offloading, "
                         "say), which the fused path would bypass; leave it False")
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
    _check_head_is_linear(model, head, kind)


def _check_head_is_linear(model, head, kind):
    """What no configuration says: the logits of a small batch (dropout off) are the hidden
    states the head receives times its weight, plus its bias."""
    device = head.weight.device
    ids = torch.arange(1, 6, device=device).remainder(head.weight.size(0)).view(1, 5)
    inputs = {"input_ids": ids}
    if kind == "seq2seq":
        inputs["decoder_input_ids"] = ids
    seen = []
    hook = head.register_forward_hook(lambda module, args, output: seen.append(args[0]))
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            logits = _logits_of(_probe_call(model, type(_unwrap(model)).__name__, **inputs))
            if len(seen) != 1:
                raise ValueError(f"rdrop_fused_linear: {type(_unwrap(model)).__name__} called "
                                 f"its output embedding {len(seen)} times in one forward, "
                                 "not once")
            bias = _logits_bias(model, head)
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
            f"rdrop_fused_linear: {type(_unwrap(model)).__name__}'s logits are not its output "
            f"embedding applied to the hidden states it receives (relative difference "
            f"{difference:.2g}): the head does something the fused path does not reproduce "
            "(a scale or a cap after the projection, say); leave rdrop_fused_linear False")


def _forward_through_fused_head(model, inputs, target, *, alpha, smoothing, chunk_mb, impl,
                                check_labels, predictions=None):
    """One forward of ``inputs`` in which the output embedding's own call computes R-Drop's
    loss from the hidden states it receives: its weight is used where the model uses it,
    whole under FSDP and ZeRO-3 (which gather it for the call), and reached from the
    outputs for DDP's search for unused parameters, since the head returns the loss as a
    1-element stand-in for the logits (whatever the model adds to its logits, a bias,
    broadcasts to a small tensor). Under autocast the products are in autocast's dtype,
    as the head's own would be. Returns the outputs and the :data:`core.RDropLoss`."""
    head = _head_module(model)
    results = []

    def fused(hidden):
        weight, bias = head.weight, _logits_bias(model, head)
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
        results.append(result)
        return result.total.view((1,) * hidden.dim())

    # the head's output as its hooks leave it: DeepSpeed ZeRO-3's turn the stand-in into a
    # tensor whose backward gathers the weight again, so the loss is taken from it
    returned = []
    hook = head.register_forward_hook(lambda module, args, output: returned.append(output))
    previous = vars(head).get("forward")
    head.forward = fused
    try:
        outputs = model(**inputs)
    finally:
        hook.remove()
        if previous is None:
            del head.forward
        else:
            head.forward = previous
    if len(results) != 1:
        raise ValueError(f"rdrop_fused_linear: the model called its output embedding "
                         f"{len(results)} times in one forward, not once")
    return outputs, results[0]._replace(total=returned[0].reshape(()))


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
        return True
    if problem == "regression" or labels.is_floating_point():
        raise ValueError(
            f"R-Drop: {labels.dtype} labels with a head of {logits.size(-1)} outputs: "
            "multi-label classification and multi-output regression are not supported; "
            "give class indices (torch.long), or a one-output head for regression")
    one_pass = (batch, *logits.shape[1:-1])  # a label per example, or per token
    if labels.numel() != math.prod(one_pass):
        raise ValueError(f"R-Drop: labels of shape {tuple(labels.shape)} do not fit "
                         f"logits of shape {tuple(logits.shape)} (both passes): expected "
                         f"{one_pass}, one pass's")
    return False


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
