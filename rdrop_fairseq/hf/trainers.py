"""The trainers: :class:`RDropMixin`, which gives a ``transformers.Trainer`` subclass R-Drop's
training loss (:func:`~rdrop_fairseq.hf.loss.rdrop_hf_loss`), :class:`RDropTrainer` and
:class:`RDropSeq2SeqTrainer`; the checks of the arguments and of where it trains (made when
the trainer is made, before the Trainer makes its output_dir); and what the trainers need of
transformers' versions."""

import dataclasses
import inspect
import warnings
from collections.abc import Mapping

import torch
import transformers
from packaging.version import Version
from transformers import Seq2SeqTrainer, Trainer

from ..core import RDropBatchError
from ..ops.impl import check_impl
from ..options import check_every, has_dropout, non_negative, runs_rdrop
from .kind import dropout_in_forward, kinds_read_from_loss, model_kind
from .loss import SPAN_LABELS, batch_labels, labelled_items, rdrop_hf_loss
from .model import IGNORE_INDEX, KINDS, unwrap

__all__ = ["RDropMixin", "RDropTrainer", "RDropSeq2SeqTrainer", "RDropOptions",
           "TRANSFORMERS_RANGE", "check_transformers_version", "declare_loss_scaling",
           "warmup_arguments", "check_parallelism", "check_trl_loss"]

# The transformers versions admitted (setup.py's hf extra says the same; tests check both):
# 4.48.0 accumulates a wrong gradient, and before 4.49 DeepSpeed divides a loss already
# normalised over the accumulated batch by the accumulation steps again
TRANSFORMERS_RANGE = ("4.49.0", "6")

# The training batches on which a stated rdrop_model_kind is checked against the model's
# own loss while they cannot tell (a loss that is not finite, no labelled token)
KIND_CHECKS = 8


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
    from transformers import TrainingArguments

    fields = {field.name for field in dataclasses.fields(TrainingArguments)}
    return ["--warmup_ratio" if "warmup_ratio" in fields else "--warmup_steps", str(fraction)]


@dataclasses.dataclass
class RDropOptions:
    """A trainer's R-Drop options (its ``rdrop_*`` keyword arguments), checked as they are
    made: ``alpha`` a finite number >= 0 (0: both passes, no consistency term); ``impl``
    one of :data:`~rdrop_fairseq.options.IMPLS` that this run can use; ``chunk_mb`` the
    fused path's chunk budget (MiB, 0 automatic); ``model_kind`` ``auto`` or one of
    :data:`~rdrop_fairseq.hf.model.KINDS`; ``every`` R-Drop on one optimizer update in K, a
    whole number >= 1; ``pass_mean`` an R-Drop update's loss the mean of the two passes'
    (:func:`~rdrop_fairseq.hf.loss.rdrop_hf_loss`). ``use_cpu``: the Trainer's, for the
    impl check."""

    alpha: float = 1.0
    impl: str = "auto"
    fused_linear: bool = False
    chunk_mb: float = 0.0
    model_kind: str = "auto"
    use_cpu: dataclasses.InitVar[bool] = False
    every: int = 1
    pass_mean: bool = False

    def __post_init__(self, use_cpu):
        self.alpha = non_negative(self.alpha, "rdrop_alpha", "; use 0 to train on both passes "
                                  "without the consistency term")
        self.impl = check_impl(self.impl, "rdrop_impl", "use_cpu" if use_cpu else None)
        self.fused_linear = bool(self.fused_linear)
        self.chunk_mb = non_negative(self.chunk_mb, "rdrop_chunk_mb", " (MiB; 0 = automatic)")
        self.every = check_every(self.every, "rdrop_every")
        if not isinstance(self.pass_mean, bool):
            raise ValueError(f"rdrop_pass_mean must be True or False, got {self.pass_mean!r}")
        if self.model_kind not in ("auto", *KINDS):
            raise ValueError(f"rdrop_model_kind must be 'auto' or one of {', '.join(KINDS)}, "
                             f"got {self.model_kind!r}")


class LogSums:
    """R-Drop's figures since the last log, summed on the device (no synchronisation per
    step): the cross-entropy and KL of both passes, the labelled items of one pass, the
    correct ones of both passes, the tokens and the entropy."""

    def __init__(self):
        self.sums = None

    def add(self, result, inputs):
        """One step's :data:`~rdrop_fairseq.hf.loss.RDropHFLoss` and its batch."""
        device = result.nll.device
        mask = inputs.get("attention_mask")
        tokens = (mask.sum() if torch.is_tensor(mask)
                  else torch.full((), batch_labels(inputs).numel(), device=device))
        zero = result.nll.new_zeros(())
        correct = zero if result.correct is None else result.correct
        entropy = zero if result.entropy is None else result.entropy
        step = torch.stack([value.to(device).float() for value in
                            (result.nll.detach(), result.kl.detach(), result.items, correct,
                             tokens, entropy)])
        self.sums = step if self.sums is None else self.sums + step

    def take(self, accelerator=None):
        """The sums as floats ``(nll, kl, items, correct, tokens, entropy)``, summed over the
        processes by ``accelerator`` where given; None if nothing was added. Starts anew."""
        if self.sums is None:
            return None
        sums, self.sums = self.sums, None
        if accelerator is not None:
            sums = accelerator.reduce(sums, reduction="sum")
        return sums.tolist()


class UpdateCount:
    """The optimizer updates since the last log that ran R-Drop, counted on the host (each
    update once, however many micro-batches it has; every process counts the same)."""

    def __init__(self):
        self.count, self.last = 0, None

    def add(self, update, two_passes):
        if two_passes and update != self.last:
            self.count += 1
        self.last = update

    def take(self):
        count, self.count = self.count, 0
        return count


class RDropMixin:
    """R-Drop's training loss for a ``transformers.Trainer`` subclass: put it first,
    ``class RDropSFTTrainer(RDropMixin, SFTTrainer): pass``.

    Keyword arguments besides the Trainer's: ``rdrop_alpha`` (default 1.0; a finite number
    >= 0; 0 trains on both passes without the consistency term), ``rdrop_impl``
    (``auto``: the Triton kernel on CUDA when triton imports, else torch; ``torch``;
    ``triton``), ``rdrop_fused_linear`` (language-model heads: the loss from the hidden
    states and the output embedding, a chunk at a time, so that the 2N x V logits are never
    made), ``rdrop_chunk_mb`` (the fused path's chunk budget, MiB; 0 automatic) and
    ``rdrop_model_kind`` (``auto``: read from the model,
    :func:`~rdrop_fairseq.hf.kind.model_kind`; or ``causal``, ``seq2seq``, ``encoder``),
    ``rdrop_every`` (R-Drop on the optimizer updates 0, K, 2K, ... only, the others one
    pass with the model's own loss, :func:`~rdrop_fairseq.hf.loss.plain_hf_loss`; default 1:
    every update), ``rdrop_pass_mean`` (an R-Drop update's loss the mean of the two passes'
    instead of their sum: a one-pass update's scale, for ``rdrop_every`` > 1); they are
    kept, checked, in ``trainer.rdrop`` (:class:`RDropOptions`), and
    ``trainer.rdrop_alpha`` may be changed between steps. Logged at ``logging_steps``
    besides ``loss``: ``rdrop_ce`` (the cross-entropy of one pass per labelled item,
    comparable with ``eval_loss``) and ``rdrop_kl``, over the updates that ran R-Drop, and
    ``rdrop_updates``, how many of the updates since the last log did. Anything it cannot
    train is refused when the trainer is made.
    """

    def __init__(self, *args, rdrop_alpha=1.0, rdrop_impl="auto", rdrop_fused_linear=False,
                 rdrop_chunk_mb=0.0, rdrop_model_kind="auto", rdrop_every=1,
                 rdrop_pass_mean=False, **kwargs):
        check_transformers_version()
        model, training_args = _model_and_args(super().__init__, args, kwargs)
        self.rdrop = RDropOptions(rdrop_alpha, rdrop_impl, rdrop_fused_linear, rdrop_chunk_mb,
                                  rdrop_model_kind, getattr(training_args, "use_cpu", False),
                                  rdrop_every, rdrop_pass_mean)
        self._rdrop_smoothing = float(getattr(training_args, "label_smoothing_factor", 0.0) or 0)
        _check_training_arguments(type(self).__name__, training_args)
        if model is not None:
            self._rdrop_kind = self._rdrop_check_model(model, training_args)
        if kwargs.get("compute_loss_func") is not None:
            raise ValueError(f"{type(self).__name__} computes the training loss itself: leave "
                             "out compute_loss_func (or use the plain Trainer)")
        super().__init__(*args, **kwargs)
        # again on the arguments the Trainer made where none were given
        _check_training_arguments(type(self).__name__, self.args)
        _note_liger(type(self).__name__, self.args, self.rdrop.fused_linear)
        declare_loss_scaling(self, True)
        if self.label_names not in (["labels"], [], list(SPAN_LABELS)):
            raise ValueError(f"{type(self).__name__} reads the labels from inputs['labels'], and "
                             f"this model or TrainingArguments.label_names names {self.label_names}")
        self._first_batch_checked = False
        # a stated kind is checked on the first batch that can tell (KIND_CHECKS at most)
        self._rdrop_kind_checks = KIND_CHECKS if self.rdrop.model_kind != "auto" else 0
        self._rdrop_kind_unread_said = False
        self._rdrop_log = LogSums()
        self._rdrop_updates = UpdateCount()
        # TRL's trainers log their training metrics from _metrics: token accuracy, the tokens
        # seen and, through the logits, the entropy are given to them
        self._rdrop_trl_metrics = isinstance(getattr(self, "_metrics", None), Mapping)

    @property
    def rdrop_alpha(self):
        """The consistency term's weight; may be changed between steps (a schedule)."""
        return self.rdrop.alpha

    @rdrop_alpha.setter
    def rdrop_alpha(self, value):
        self.rdrop.alpha = non_negative(value, "rdrop_alpha")

    def train(self, *args, **kwargs):
        self._rdrop_log = LogSums()  # nothing from an earlier train() in the first log
        self._rdrop_updates = UpdateCount()
        return super().train(*args, **kwargs)

    def call_model_init(self, trial=None):
        """A model built by ``model_init`` gets the checks a ``model`` gets."""
        model = super().call_model_init(trial)
        self._rdrop_kind = self._rdrop_check_model(model, self.args)
        return model

    def _rdrop_check_model(self, model, args):
        try:
            kind = model_kind(model, self.rdrop.model_kind, fused_linear=self.rdrop.fused_linear)
        except ValueError as error:
            raise ValueError(f"{type(self).__name__}: {error}") from None
        config = getattr(unwrap(model), "config", None)
        values = config.to_dict() if hasattr(config, "to_dict") else {}
        applied = dropout_in_forward(model)  # None: no probe batch; then the settings say
        # NEFTune's noise on the input embeddings differs between the halves too
        if self.rdrop.alpha and not getattr(args, "neftune_noise_alpha", None) and not (
                has_dropout(model, config=values) if applied is None else applied):
            warnings.warn(
                f"{type(self).__name__}: rdrop_alpha {self.rdrop.alpha} but every dropout of "
                f"{type(unwrap(model)).__name__} is 0: the two passes are identical and the "
                "KL is always 0. Set a dropout above 0 (hidden, attention, or LoRA's "
                "lora_dropout)", UserWarning, stacklevel=3)
        return kind

    def _rdrop_check_stated_kind(self, model, inputs):
        """A kind given by hand (``rdrop_model_kind``) against what the model's own loss
        does with the first training batch that can tell: one warning where they contradict.
        A batch whose own loss is not finite cannot (no reading matches it): the next is
        read, and an infinite loss where tokens are labelled is said once."""
        read = kinds_read_from_loss(model, inputs)
        if isinstance(read, float):  # this batch cannot tell
            self._rdrop_kind_checks -= 1
            labels = inputs.get("labels")
            if not self._rdrop_kind_unread_said and bool(labels.ne(IGNORE_INDEX).any()):
                self._rdrop_kind_unread_said = True
                warnings.warn(
                    f"{type(self).__name__}: {type(unwrap(model)).__name__}'s own loss on "
                    f"this training batch is {read}, which no reading of its logits is: "
                    f"rdrop_model_kind {self._rdrop_kind!r} is checked on the next training "
                    f"batches instead (up to {KIND_CHECKS})", UserWarning, stacklevel=3)
            return
        self._rdrop_kind_checks = 0
        if read is None or self._rdrop_kind in read:
            return
        stated = (f"{type(self).__name__}: rdrop_model_kind {self._rdrop_kind!r} contradicts "
                  f"{type(unwrap(model)).__name__}'s own loss on a training batch")
        if read:
            says = (f"which lines its logits up with the labels as kind "
                    f"{' or '.join(map(repr, read))}: R-Drop would train on misaligned "
                    "labels. Pass that kind, or 'auto'")
        else:
            says = ("which is neither the shifted nor the unshifted cross-entropy of its "
                    "logits: R-Drop's loss is not what the model computes")
        warnings.warn(f"{stated}, {says}", UserWarning, stacklevel=3)

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
        # the update this micro-batch belongs to: global_step counts the updates made, the
        # same in every micro-batch of one update and on every process, restored on resume
        update = self.state.global_step
        two_passes = runs_rdrop(update, self.rdrop.every)
        if two_passes and self._rdrop_kind_checks > 0:
            self._rdrop_check_stated_kind(model, inputs)
        result = rdrop_hf_loss(
            model, inputs, kind=self._rdrop_kind, alpha=self.rdrop.alpha,
            label_smoothing=self._rdrop_smoothing, num_items_in_batch=num_items_in_batch,
            world_size=world_size, impl=self.rdrop.impl, fused_linear=self.rdrop.fused_linear,
            chunk_mb=self.rdrop.chunk_mb, grad_in_scores=False if return_outputs else "auto",
            check_labels=not self._first_batch_checked, accuracy=self._rdrop_trl_metrics,
            accumulation_steps=accumulation, every=self.rdrop.every, update=update,
            pass_mean=self.rdrop.pass_mean)
        if two_passes:  # the R-Drop figures are those of the updates that ran it
            self._first_batch_checked = True
            self._rdrop_log.add(result, inputs)
        self._rdrop_updates.add(update, two_passes)
        return (result.loss, result.outputs) if return_outputs else result.loss

    def log(self, logs, *args, **kwargs):
        """The Trainer's log, with ``rdrop_ce`` and ``rdrop_kl`` per labelled item of one
        pass since the last log, summed over the processes, where the log has a training
        ``loss``."""
        sums = None
        if "loss" in logs:
            sums = self._rdrop_log.take(self.accelerator if self.args.world_size > 1 else None)
            logs = {**logs, "rdrop_updates": self._rdrop_updates.take()}
        if sums is not None:
            nll, kl, items, correct, tokens, entropy = sums
            logs = {**logs, "rdrop_ce": round(nll / 2 / max(items, 1), 4),
                    "rdrop_kl": round(kl / max(items, 1), 4)}
            if self._rdrop_trl_metrics:  # what TRL's own loss would have logged
                self._total_train_tokens = getattr(self, "_total_train_tokens", 0) + int(tokens)
                self._metrics["train"]["mean_token_accuracy"].append(correct / 2 / max(items, 1))
                self._metrics["train"]["num_tokens"] = [self._total_train_tokens]
                if not self.rdrop.fused_linear:  # (the fused path makes no logits)
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
        labels = [batch_labels(b) for b in batches]
        counts = [labelled_items(each, causal) for each in labels if torch.is_tensor(each)]
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

def _model_and_args(init, args, kwargs):
    """The ``model`` and ``args`` (TrainingArguments) given to the Trainer's ``__init__``
    ``init``, by name or by position (None where not given)."""
    try:
        given = inspect.signature(init).bind_partial(*args, **kwargs).arguments
    except TypeError:  # the Trainer itself says what is wrong with its arguments
        given = kwargs
    return given.get("model"), given.get("args")


def _check_training_arguments(name, args):
    """The TrainingArguments (or TRL config) checks: where it trains, TRL's loss type."""
    check_parallelism(name, args)
    check_trl_loss(name, args)


def _note_liger(name, args, fused_linear):
    """``use_liger_kernel``: the Trainer patches the model in train() (Liger's RoPE, RMSNorm,
    SwiGLU kernels, and a forward whose fused linear cross-entropy needs the labels). R-Drop
    calls the model without labels and computes its own loss, so Liger's fused
    cross-entropy does not run in training: say so where the logits path makes the logits
    that the user asked Liger to avoid."""
    config = getattr(args, "liger_kernel_config", None) or {}
    if (getattr(args, "use_liger_kernel", False) and not fused_linear
            and config.get("fused_linear_cross_entropy", True)):
        warnings.warn(f"{name}: use_liger_kernel: R-Drop's loss replaces Liger's fused linear "
                      "cross-entropy in training, so the 2N x V logits are made (Liger's "
                      "other kernels apply); rdrop_fused_linear=True computes R-Drop's loss "
                      "from the hidden states instead, without them", UserWarning,
                      stacklevel=3)


def check_parallelism(name, args):
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


def check_trl_loss(name, args):
    """TRL's SFTConfig.loss_type: only its plain negative log-likelihood is R-Drop's CE."""
    loss_type = getattr(args, "loss_type", None)
    from_trl = any(cls.__module__.startswith("trl") for cls in type(args).__mro__)
    if from_trl and loss_type not in (None, "nll"):
        raise ValueError(f"{name}: TRL's loss_type {loss_type!r} is not R-Drop's "
                         "cross-entropy, which replaces TRL's loss in training: set "
                         "loss_type='nll'")
