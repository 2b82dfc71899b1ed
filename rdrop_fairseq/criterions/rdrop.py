"""What every R-Drop criterion shares: its options, when to duplicate, and logging.

The criteria subclass this mixin and fairseq's own criterion; each is its config (the
parent's plus :class:`RDropConfig`), an ``__init__`` that passes the parent its options and
this mixin the config, and :meth:`RDropCriterionMixin.rdrop_forward`, the few lines that
differ.
The mixin validates the options (once, when the criterion is built), runs the fairseq
parent unchanged while the model is not training (validation, ``--eval-bleu``, scoring) or
when R-Drop is off, and adds the consistency metrics to the parent's. A new option is one
field of :class:`RDropConfig` plus its use here.
"""

import argparse
import functools
import logging
import math
from dataclasses import dataclass, field, fields

import torch
from fairseq import utils
from fairseq.dataclass import ChoiceEnum, FairseqDataclass
from fairseq.logging import metrics
from fairseq.models import BaseFairseqModel
from fairseq.modules import FairseqDropout
from omegaconf import II

from ..core import RDropBatchError, duplicate_net_input, rdrop_loss
from ..fused_linear import fused_linear_rdrop_loss
from ..ops.impl import check_impl
from ..options import IMPLS, check_every, has_dropout, non_negative, runs_rdrop
from .output_layer import fused_output_projection, uses_stock_log_softmax

logger = logging.getLogger(__name__)

# Logged sums of the consistency term (natural log); reduced per sample_size.
CONSISTENCY_KEYS = ("rdrop_kl", "rdrop_mse")


@dataclass
class RDropConfig(FairseqDataclass):
    rdrop_alpha: float = field(
        default=0.0,
        metadata={
            "help": "weight of the R-Drop consistency term, 1/2 (KL(P1||P2) + KL(P2||P1)) "
            "(MSE for regression) between two dropout passes; >= 0. The paper uses 5 for "
            "translation, 1 for language modelling, 0.7 for summarization, 0.5-1 for GLUE"
        },
    )
    rdrop_two_passes: bool = field(
        default=False,
        metadata={
            "help": "duplicate training batches even with --rdrop-alpha 0: the paper's "
            "'two passes without KL' ablation (appendix C.2); implied by --rdrop-alpha > 0"
        },
    )
    rdrop_chunk_mb: float = field(
        default=0.0,
        metadata={
            "help": "bound, in MiB, on the float32 temporaries of one chunk of the fused "
            "R-Drop loss (torch implementation, and adaptive_loss_rdrop's full-vocabulary "
            "chunks); 0 = automatic: 256 on CUDA (not measured on a GPU yet), 16 on CPU"
        },
    )
    rdrop_impl: ChoiceEnum(IMPLS) = field(
        default="auto",
        metadata={
            "help": "fused R-Drop loss implementation: triton (one kernel per step; CUDA, "
            "needs the triton package), torch (chunked torch ops), or auto (triton on CUDA "
            "when importable, else torch; a GPU where the kernel fails gets torch and one "
            "warning)"
        },
    )
    rdrop_fused_linear: bool = field(
        default=False,
        metadata={
            "help": "compute the loss from the decoder's features and output projection, a "
            "chunk at a time, so that the 2N x V logits never exist (label_smoothed_cross_"
            "entropy_rdrop and cross_entropy_rdrop; models with a plain output projection: "
            "transformer, BART, transformer_lm without adaptive softmax)"
        },
    )
    rdrop_keep_logits: bool = field(
        default=False,
        metadata={
            "help": "keep the model's logits intact: the fused loss writes the logits' "
            "gradient into a buffer of its own (2N x V more memory) instead of into the "
            "logits' buffer. For forward hooks, distillation or anything else that reads "
            "the logits after the loss; without it, such a reader sees the gradient"
        },
    )
    rdrop_every: int = field(
        default=1,
        metadata={
            "help": "R-Drop on one optimizer update in K (the paper's k-step R-Drop): updates "
            "0, K, 2K, ... run both passes and the R-Drop loss, the others one pass and the "
            "parent criterion's own loss. Decided per update: every --update-freq batch and "
            "every process agree, and a resumed run keeps the schedule. 1: every update"
        },
    )
    rdrop_pass_mean: bool = field(
        default=False,
        metadata={
            "help": "on an R-Drop update, the mean of the two passes' loss (each pass's task "
            "loss and alpha times the KL, halved) instead of their sum, so that its gradient "
            "has a one-pass update's scale: for --rdrop-every K > 1, where R-Drop and plain "
            "updates alternate. The paper sums (the default)"
        },
    )
    # --cpu (common), to refuse --rdrop-impl triton when the criterion is built
    cpu: bool = II("common.cpu")


# the options checked as fairseq parses them, and what the refusal advises
NON_NEGATIVE = {
    "--rdrop-alpha": "; use 0 (with --rdrop-two-passes for the no-KL ablation) to turn the KL "
                     "term off",
    "--rdrop-chunk-mb": " (a number of MiB; 0 = automatic)",
}


def checked(flag, value):
    """``value`` as a float (:func:`~rdrop_fairseq.options.non_negative`), the error naming
    ``flag`` and saying what to do."""
    return non_negative(value, flag, NON_NEGATIVE[flag])


def checked_while_parsing(flag):
    """An argparse ``type`` for ``flag``: argparse's one-line error, naming the flag, while
    fairseq-train parses its options (before it makes the save dir)."""

    def parse(value):
        if flag == "--rdrop-every":
            check = check_every
        else:
            float(value)  # not a number: argparse's own "invalid float value"
            check = functools.partial(non_negative, advice=NON_NEGATIVE[flag])
        try:  # argparse names the flag itself
            return check(value)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    # what argparse and --help call the type
    parse.__name__ = "int" if flag == "--rdrop-every" else "float"
    return parse


def record_update_numbers():
    """Let the criteria know which update a training step belongs to, for --rdrop-every.

    fairseq's tasks call ``model.set_num_updates(update_num)`` before the criterion in every
    training step (``FairseqTask.train_step``; AttendOut's task too), with the trainer's
    count of optimizer updates: the same for every micro-batch of an update and on every
    process, and restored from the checkpoint on resume. This wraps
    ``BaseFairseqModel.set_num_updates`` to remember it as ``model.rdrop_num_updates``
    (idempotent; nothing else changes)."""
    original = BaseFairseqModel.set_num_updates
    if getattr(original, "rdrop_records", False):
        return

    @functools.wraps(original)
    def set_num_updates(self, num_updates):
        self.rdrop_num_updates = num_updates
        original(self, num_updates)

    set_num_updates.rdrop_records = True
    BaseFairseqModel.set_num_updates = set_num_updates


record_update_numbers()


# the criteria whose loss --rdrop-fused-linear can compute from the features
FUSED_LINEAR_PARENTS = ("label_smoothed_cross_entropy", "cross_entropy")


class RDropCriterionMixin:
    """Shared R-Drop behaviour of the fairseq criteria: call :meth:`init_rdrop_from` (or
    :meth:`init_rdrop`) from the criterion's ``__init__``, and implement
    :meth:`rdrop_forward`. (The Hugging Face trainers' mixin is
    :class:`rdrop_fairseq.hf.RDropMixin`.)"""

    @classmethod
    def add_args(cls, parser):
        """The options of the criterion's config, as fairseq adds them (parse_args_and_arch),
        with --rdrop-alpha and --rdrop-chunk-mb checked as they are parsed."""
        super().add_args(parser)
        for flag in (*NON_NEGATIVE, "--rdrop-every"):
            action = parser._option_string_actions.get(flag)
            if action is not None:
                action.type = checked_while_parsing(flag)

    def init_rdrop_from(self, cfg, parent_name):
        """:meth:`init_rdrop` with every :class:`RDropConfig` field of ``cfg``."""
        options = [f.name for f in fields(RDropConfig) if f.name.startswith("rdrop_")]
        # a config built outside fairseq's (e.g. in a test) holds "${common.cpu}" unresolved
        cpu = getattr(cfg, "cpu", False) is True
        self.init_rdrop(parent_name, cpu=cpu, **{name: getattr(cfg, name) for name in options})

    def init_rdrop(self, parent_name, rdrop_alpha=0.0, rdrop_two_passes=False,
                   rdrop_chunk_mb=0.0, rdrop_impl="auto", rdrop_fused_linear=False,
                   rdrop_keep_logits=False, rdrop_every=1, rdrop_pass_mean=False,
                   cpu=False):
        # checked again here for a config not parsed by fairseq-train (hydra, Python)
        alpha = checked("--rdrop-alpha", rdrop_alpha)
        self.rdrop_every = check_every(rdrop_every, "--rdrop-every")
        self.rdrop_pass_mean = bool(rdrop_pass_mean)
        chunk_mb = checked("--rdrop-chunk-mb", rdrop_chunk_mb)
        # refused here rather than at the first step (which would leave a crash.pt);
        # Triton's interpreter runs the kernel on CPU tensors, for the tests
        impl = check_impl(str(rdrop_impl), "--rdrop-impl", "--cpu" if cpu else None)
        if rdrop_fused_linear and parent_name not in FUSED_LINEAR_PARENTS:
            raise ValueError(
                f"--rdrop-fused-linear is for {' and '.join(p + '_rdrop' for p in FUSED_LINEAR_PARENTS)}"
                f" (token-level losses over a vocabulary), not {parent_name}_rdrop"
            )
        self.rdrop_fused_linear = bool(rdrop_fused_linear)
        # where the fused loss may put the logits' gradient: their own buffer, when safe
        self.grad_in_logits = False if rdrop_keep_logits else "auto"
        self.rdrop_alpha = alpha
        self.rdrop_two_passes = bool(rdrop_two_passes)
        self.rdrop_chunk_mb = chunk_mb
        self.rdrop_impl = impl
        self._dropout_checked = False
        self._fallback_logged = False
        if not self.rdrop_enabled:
            logger.warning(
                "R-Drop is off (--rdrop-alpha 0 without --rdrop-two-passes): this criterion "
                f"trains exactly like {parent_name}"
            )
        elif parent_name in FUSED_LINEAR_PARENTS:  # which loss path runs, in the run's log
            path = ("the fused-linear path (--rdrop-fused-linear: from the decoder's features)"
                    if self.rdrop_fused_linear else "the logits path")
            logger.info(f"R-Drop loss: {path}, --rdrop-impl {impl}")

    def forward(self, model, sample, reduce=True):
        if not self.rdrop_active(model):
            return super().forward(model, sample, reduce=reduce)
        two_passes = self.rdrop_update(model)
        if two_passes:
            self.check_reduce(reduce)
            loss, sample_size, logging_output = self.rdrop_forward(model, sample)
            if self.rdrop_pass_mean:  # the logged figures stay per pass already
                loss = loss * 0.5
        else:  # --rdrop-every: an update without R-Drop, the parent's own loss
            loss, sample_size, logging_output = super().forward(model, sample, reduce=reduce)
        logging_output["rdrop_update"] = int(two_passes)
        return loss, sample_size, logging_output

    def rdrop_update(self, model):
        """Whether this training step's update runs R-Drop: the updates numbered 0, K, 2K,
        ... for --rdrop-every K (fairseq numbers them from 0; a Python int, no GPU sync)."""
        if self.rdrop_every == 1:
            return True
        update = getattr(model, "rdrop_num_updates", None)
        if update is None:
            raise RuntimeError(
                f"--rdrop-every {self.rdrop_every} needs the number of the update being "
                "trained, which fairseq's tasks give the model (model.set_num_updates("
                "update_num)) before the criterion; this step's model was never given it: "
                "call model.set_num_updates(n) before the criterion, or use --rdrop-every 1"
            )
        return runs_rdrop(update, self.rdrop_every)

    def rdrop_forward(self, model, sample):
        """The two-pass training forward: fairseq's ``(loss, sample_size, logging_output)``."""
        raise NotImplementedError

    @classmethod
    def reduce_metrics(cls, logging_outputs) -> None:
        super().reduce_metrics(logging_outputs)
        cls.reduce_rdrop_metrics(logging_outputs)

    @property
    def rdrop_enabled(self):
        return self.rdrop_alpha > 0 or self.rdrop_two_passes

    def rdrop_active(self, model):
        """Two passes happen only in training; validation and inference run one pass."""
        return self.rdrop_enabled and model.training

    def duplicate_sample(self, model, sample, target=True):
        """A new sample with ``net_input`` (and ``target``, unless ``target=False``: a
        criterion that takes the target of one pass saves the copy) repeated as ``[x; x]``."""
        if not self._dropout_checked:
            self._dropout_checked = True
            if self.rdrop_alpha > 0 and not has_dropout(model, (FairseqDropout,)):
                logger.warning(
                    f"--rdrop-alpha {self.rdrop_alpha} but every dropout of the model is 0: "
                    "both passes are identical and the R-Drop KL is always 0. Set --dropout "
                    "(and/or --attention-dropout, --activation-dropout) above 0"
                )
        one_pass = sample.get("target")
        if not torch.is_tensor(one_pass):
            raise RDropBatchError(
                "R-Drop needs the sample's 'target' tensor (batch in dim 0) to pair the two "
                f"passes; this task's samples have keys {sorted(sample)}"
            )
        pair = dict(sample)
        pair["net_input"] = duplicate_net_input(sample["net_input"], one_pass.size(0))
        if target:
            pair["target"] = torch.cat([one_pass, one_pass], dim=0)
        else:
            del pair["target"]  # not the doubled batch's
        return pair

    def rdrop_loss(self, scores, target, **kwargs):
        """:func:`rdrop_fairseq.core.rdrop_loss` with this criterion's alpha, chunk size
        and implementation."""
        return rdrop_loss(scores, target, alpha=self.rdrop_alpha, chunk_mb=self.rdrop_chunk_mb,
                          impl=self.rdrop_impl, **kwargs)

    def token_level_forward(self, model, sample, reduce=True, *, epsilon):
        """Two passes over ``[x; x]`` for a token-level criterion (label-smoothed or plain
        cross-entropy, with this criterion's ``padding_idx``, ``sentence_avg`` and, if set,
        ``ignore_prefix_size`` / ``report_accuracy``).

        Returns fairseq's ``(loss, sample_size, logging_output)``: the loss is the task loss
        of both passes plus alpha times the symmetric KL, for the gradient normalised by the
        original sample size; the logged ``loss``/``nll_loss`` are the mean of the two
        passes so that they read like a baseline run's. Nothing here waits for the GPU.
        """
        self.check_reduce(reduce)
        pair = self.duplicate_sample(model, sample, target=False)
        if self.rdrop_fused_linear:  # the decoder's features: the criterion projects them
            net_output = model(**pair["net_input"], features_only=True)
        else:
            net_output = model(**pair["net_input"])
        # one pass's target: the loss pairs the passes itself (no [t; t] copy)
        target = model.get_targets(sample, net_output)
        keep = self.kept_positions(target)
        logging_output = {}
        report_accuracy = getattr(self, "report_accuracy", False)
        loss_path = self.fused_linear_path if self.rdrop_fused_linear else self.logits_path
        out, predicted = loss_path(model, net_output, target, keep, epsilon, report_accuracy)
        if report_accuracy:
            mask = target.ne(self.padding_idx) if keep is None else target.ne(self.padding_idx) & keep
            predicted = predicted.view(2, *target.shape)
            logging_output["n_correct"] = (predicted.eq(target) & mask).sum() / 2
            logging_output["total"] = mask.sum()
        sample_size = sample["target"].size(0) if self.sentence_avg else sample["ntokens"]
        logging_output.update({
            "loss": out.loss / 2,
            "nll_loss": out.nll / 2,
            "rdrop_kl": out.kl,
            "ntokens": sample["ntokens"],
            "nsentences": sample["target"].size(0),
            "sample_size": sample_size,
        })
        return out.total, sample_size, logging_output

    def kept_positions(self, target):
        """Where ``--ignore-prefix-size`` leaves the target in the loss (None: everywhere),
        masked rather than sliced: slicing would copy the logits."""
        prefix = getattr(self, "ignore_prefix_size", 0)
        if prefix <= 0:
            return None
        keep = torch.ones_like(target, dtype=torch.bool)
        keep[:, :prefix] = False
        return keep

    def fused_linear_path(self, model, net_output, target, keep, epsilon, report_accuracy):
        """``--rdrop-fused-linear``: the loss from the decoder's features and its output
        projection, a chunk at a time, without the logits. ``(loss, predictions)``, the
        predictions of both passes where accuracy is reported."""
        projection = fused_output_projection(model)
        predicted = (torch.empty((2, target.numel()), dtype=torch.long, device=target.device)
                     if report_accuracy else None)
        out = fused_linear_rdrop_loss(
            net_output[0], projection.weight, target, bias=projection.bias,
            alpha=self.rdrop_alpha, epsilon=epsilon, ignore_index=self.padding_idx,
            keep=keep, chunk_mb=self.rdrop_chunk_mb, predictions=predicted,
            impl=self.rdrop_impl)
        return out, predicted

    def logits_path(self, model, net_output, target, keep, epsilon, report_accuracy):
        """The loss from the model's logits (from its log-probabilities where it normalises
        its output itself). ``(loss, predictions)`` as :meth:`fused_linear_path`."""
        if uses_stock_log_softmax(model):
            scores, log_probs = net_output[0], False
        else:
            if not self._fallback_logged:
                self._fallback_logged = True
                logger.info(
                    "R-Drop: this model normalises its output itself, so the fused loss "
                    "starts from its log-probabilities (float32, 2N x V) rather than logits"
                )
            scores, log_probs = model.get_normalized_probs(net_output, log_probs=True), True
        # before the loss, which may write the gradient into the logits' buffer
        predicted = scores.argmax(-1) if report_accuracy else None
        # unless --rdrop-keep-logits, the logits' buffer may take the gradient
        out = self.rdrop_loss(scores, target, epsilon=epsilon, ignore_index=self.padding_idx,
                              keep=keep, log_probs=log_probs, grad_in_scores=self.grad_in_logits)
        return out, predicted

    @staticmethod
    def check_reduce(reduce):
        if not reduce:
            raise ValueError(
                "R-Drop training needs reduce=True: the consistency term pairs the two "
                "passes and has no per-token value to return unreduced"
            )

    @staticmethod
    def reduce_rdrop_metrics(logging_outputs):
        """Log the consistency term per sample (per token with fairseq's default), base 2,
        over the updates that ran R-Drop only, and how many training updates did
        (``rdrop_updates``, a sum over the logged interval or epoch). fairseq reduces the
        logs of one update at a time: its micro-batches and processes all agree."""
        if any("rdrop_update" in log for log in logging_outputs):
            ran = utils.item(sum(log.get("rdrop_update", 0) for log in logging_outputs)) > 0
            metrics.log_scalar_sum("rdrop_updates", int(ran), priority=900, round=0)
        sample_size = sum(log.get("sample_size", 0) for log in logging_outputs)
        for key in CONSISTENCY_KEYS:
            if any(key in log for log in logging_outputs):
                total = utils.item(sum(log.get(key, 0) for log in logging_outputs))
                metrics.log_scalar(
                    key, total / max(sample_size, 1) / math.log(2), sample_size, round=4
                )
