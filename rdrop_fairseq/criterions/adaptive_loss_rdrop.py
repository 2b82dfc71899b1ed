"""R-Drop over fairseq's ``adaptive_loss`` (adaptive-softmax LMs, ``transformer_lm_wiki103``).

The task loss is fairseq's: cross-entropy over the head and the one tail cluster each target
falls in. The KL, however, must compare the two passes' *full* output distributions,
``p(w) = p_head(cluster(w)) * p_tail(w | cluster(w))``: a KL over the head alone would ignore
how the passes spread probability inside the tail clusters (most of the vocabulary). That
distribution is what ``AdaptiveSoftmax.get_log_prob`` computes; it is vocabulary-sized per
position, so we evaluate it a few hundred thousand elements at a time and recompute it in the
backward pass (activation checkpointing) instead of keeping it.
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from fairseq import utils
from fairseq.criterions import register_criterion
from fairseq.criterions.adaptive_loss import AdaptiveLoss, AdaptiveLossConfig
from torch.utils.checkpoint import checkpoint

from ..core import symmetric_kl
from .rdrop import RDropConfig, RDropMixin, dropout_disabled

# Elements of full-vocabulary log-probabilities held at once when computing the KL.
KL_CHUNK_ELEMENTS = 1 << 22


@dataclass
class AdaptiveLossRDropConfig(AdaptiveLossConfig, RDropConfig):
    pass


@register_criterion("adaptive_loss_rdrop", dataclass=AdaptiveLossRDropConfig)
class AdaptiveLossRDrop(RDropMixin, AdaptiveLoss):
    def __init__(self, task, sentence_avg, rdrop_alpha=0.0, rdrop_two_passes=False):
        super().__init__(task, sentence_avg)
        self.init_rdrop(rdrop_alpha, rdrop_two_passes, "adaptive_loss")

    @classmethod
    def build_criterion(cls, cfg: AdaptiveLossRDropConfig, task):
        AdaptiveLoss.build_criterion(cfg, task)  # fairseq's own ddp-backend check
        return cls(task, cfg.sentence_avg, cfg.rdrop_alpha, cfg.rdrop_two_passes)

    def forward(self, model, sample, reduce=True):
        if not self.rdrop_active(model):
            return super().forward(model, sample, reduce=reduce)
        self.check_reduce(reduce)
        adaptive_softmax = getattr(model.decoder, "adaptive_softmax", None)
        if adaptive_softmax is None:
            raise ValueError(
                "adaptive_loss_rdrop needs a model with an adaptive softmax (e.g. "
                "--arch transformer_lm_wiki103, or --adaptive-softmax-cutoff); use "
                "cross_entropy_rdrop for a model with a full softmax"
            )
        pair = self.duplicate_sample(model, sample)
        net_output = model(**pair["net_input"])
        target = model.get_targets(pair, net_output).view(-1)

        # One dropout mask for the adaptive softmax input, shared by the loss and the KL, so
        # that both see the same two sub-models.
        features = net_output[0].reshape(-1, net_output[0].size(-1))
        features = adaptive_softmax.dropout_module(features)
        with dropout_disabled(adaptive_softmax.dropout_module):
            logits, cluster_targets = adaptive_softmax(features, target)
        loss = features.new_zeros((), dtype=torch.float32)
        for logit, cluster_target in zip(logits, cluster_targets):
            if cluster_target is not None:
                loss = loss + F.cross_entropy(
                    logit.float(), cluster_target, ignore_index=self.padding_idx, reduction="sum"
                )
        keep = target[: target.numel() // 2].ne(self.padding_idx)
        kl = full_distribution_kl(adaptive_softmax, features, keep)

        ntokens = utils.strip_pad(sample["target"], self.padding_idx).numel()
        sample_size = sample["target"].size(0) if self.sentence_avg else ntokens
        logging_output = {
            "loss": loss.data / 2,
            "rdrop_kl": kl.data,
            "ntokens": ntokens,
            "nsentences": sample["target"].size(0),
            "sample_size": sample_size,
        }
        return loss + self.rdrop_alpha * kl, sample_size, logging_output

    @classmethod
    def reduce_metrics(cls, logging_outputs) -> None:
        super().reduce_metrics(logging_outputs)
        cls.reduce_rdrop_metrics(logging_outputs)


def full_distribution_kl(adaptive_softmax, features, keep):
    """Symmetric KL of the full adaptive-softmax distributions of the two halves.

    ``features``: ``(2N, d)`` adaptive-softmax inputs, pass 1 then pass 2; ``keep``: ``(N,)``
    non-padding positions.
    """
    n = features.size(0) // 2
    rows = keep.nonzero().squeeze(1)
    chunk = max(1, KL_CHUNK_ELEMENTS // (2 * adaptive_softmax.vocab_size))
    total = features.new_zeros((), dtype=torch.float32)
    for start in range(0, rows.numel(), chunk):
        r = rows[start:start + chunk]
        both = torch.cat([features.index_select(0, r), features.index_select(0, r + n)])
        total = total + checkpoint(_chunk_kl, adaptive_softmax, both, use_reentrant=False)
    return total


def _chunk_kl(adaptive_softmax, both):
    lprobs = adaptive_softmax.get_log_prob(both.unsqueeze(0), None).squeeze(0)
    return symmetric_kl(lprobs)
