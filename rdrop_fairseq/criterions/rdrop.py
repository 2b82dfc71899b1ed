"""What every R-Drop criterion shares: its two options, when to duplicate, and logging.

The criteria subclass fairseq's own criterion and this mixin; while the model is not
training (validation, ``--eval-bleu``, scoring), or when R-Drop is off, they call the fairseq
parent unchanged.
"""

import logging
import math
from dataclasses import dataclass, field

import torch
from fairseq import utils
from fairseq.dataclass import FairseqDataclass
from fairseq.logging import metrics
from fairseq.modules import FairseqDropout

from ..core import RDropBatchError, duplicate_net_input

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


class RDropMixin:
    """Shared R-Drop behaviour; call :meth:`init_rdrop` from the criterion's ``__init__``."""

    def init_rdrop(self, rdrop_alpha, rdrop_two_passes, parent_name):
        alpha = float(rdrop_alpha)
        if not alpha >= 0 or math.isinf(alpha):  # also rejects NaN
            raise ValueError(
                f"--rdrop-alpha must be a finite number >= 0, got {rdrop_alpha}; use 0 (with "
                "--rdrop-two-passes for the no-KL ablation) to turn the KL term off"
            )
        self.rdrop_alpha = alpha
        self.rdrop_two_passes = bool(rdrop_two_passes)
        self._dropout_checked = False
        if not self.rdrop_enabled:
            logger.warning(
                "R-Drop is off (--rdrop-alpha 0 without --rdrop-two-passes): this criterion "
                f"trains exactly like {parent_name}"
            )

    @property
    def rdrop_enabled(self):
        return self.rdrop_alpha > 0 or self.rdrop_two_passes

    def rdrop_active(self, model):
        """Two passes happen only in training; validation and inference run one pass."""
        return self.rdrop_enabled and model.training

    def duplicate_sample(self, model, sample):
        """A new sample with ``net_input`` and ``target`` repeated as ``[x; x]``."""
        if not self._dropout_checked:
            self._dropout_checked = True
            if self.rdrop_alpha > 0 and not has_stochastic_layers(model):
                logger.warning(
                    f"--rdrop-alpha {self.rdrop_alpha} but every dropout of the model is 0: "
                    "both passes are identical and the R-Drop KL is always 0. Set --dropout "
                    "(and/or --attention-dropout, --activation-dropout) above 0"
                )
        target = sample.get("target")
        if not torch.is_tensor(target):
            raise RDropBatchError(
                "R-Drop needs the sample's 'target' tensor (batch in dim 0) to pair the two "
                f"passes; this task's samples have keys {sorted(sample)}"
            )
        pair = dict(sample)
        pair["net_input"] = duplicate_net_input(sample["net_input"], target.size(0))
        pair["target"] = torch.cat([target, target], dim=0)
        return pair

    @staticmethod
    def check_reduce(reduce):
        if not reduce:
            raise ValueError(
                "R-Drop training needs reduce=True: the consistency term pairs the two "
                "passes and has no per-token value to return unreduced"
            )

    @staticmethod
    def reduce_rdrop_metrics(logging_outputs):
        """Log the consistency term per sample (per token with fairseq's default), base 2."""
        sample_size = sum(log.get("sample_size", 0) for log in logging_outputs)
        for key in CONSISTENCY_KEYS:
            if any(key in log for log in logging_outputs):
                total = utils.item(sum(log.get(key, 0) for log in logging_outputs))
                metrics.log_scalar(
                    key, total / max(sample_size, 1) / math.log(2), sample_size, round=4
                )


def has_stochastic_layers(model):
    """Whether any dropout in ``model`` can make the two halves of ``[x; x]`` differ.

    (LayerDrop cannot: it drops the same layers for the whole batch.)
    """
    dropouts = (torch.nn.modules.dropout._DropoutNd, FairseqDropout)
    return any(isinstance(m, dropouts) and m.p > 0 for m in model.modules())

