"""R-Drop over fairseq's ``adaptive_loss`` (adaptive-softmax LMs, ``transformer_lm_wiki103``).

The KL must compare the two passes' *full* output distributions,
``p(w) = p_head(cluster(w)) * p_tail(w | cluster(w))``: a KL over the head alone would ignore
how the passes spread probability inside the tail clusters (most of the vocabulary). We
compute that distribution (what ``AdaptiveSoftmax.get_log_prob`` returns, but differentiable:
fairseq's version writes into a log-softmax output in place) for every non-padding position
of both passes, a few hundred thousand elements at a time, and take from it both the task
loss ``-log p(target)`` and the symmetric KL, so that they see the same sub-models. That loss
is fairseq's cluster-wise ``adaptive_loss`` except for one fairseq quirk we do not copy: it
drops the tail term of the word with id ``cutoff[i] + padding_idx`` (docs/design.md). Each chunk is recomputed in the
backward pass (activation checkpointing, same dropout masks) instead of being kept.
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from fairseq import utils
from fairseq.criterions import register_criterion
from fairseq.criterions.adaptive_loss import AdaptiveLoss, AdaptiveLossConfig
from torch.utils.checkpoint import checkpoint

from ..core import rdrop_nll_loss
from .rdrop import RDropConfig, RDropMixin

# Elements of full-vocabulary log-probabilities held at once.
CHUNK_ELEMENTS = 1 << 21


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
        features = net_output[0].reshape(-1, net_output[0].size(-1))
        loss, kl = adaptive_rdrop_loss(adaptive_softmax, features, target, self.padding_idx)

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


def adaptive_rdrop_loss(adaptive_softmax, features, target, padding_idx):
    """NLL of both passes and their symmetric KL over the full adaptive-softmax distribution.

    ``features``: ``(2N, d)`` adaptive-softmax inputs, pass 1 then pass 2; ``target``: ``(2N,)``.
    """
    n = features.size(0) // 2
    rows = target[:n].ne(padding_idx).nonzero().squeeze(1)
    chunk = max(1, CHUNK_ELEMENTS // (2 * adaptive_softmax.vocab_size))
    total = features.new_zeros(2, dtype=torch.float32)
    for start in range(0, rows.numel(), chunk):
        both = torch.cat([rows[start:start + chunk], rows[start:start + chunk] + n])
        total = total + checkpoint(
            _chunk_loss, adaptive_softmax, features.index_select(0, both),
            target.index_select(0, both), use_reentrant=False,
        )
    return total[0], total[1]


def _chunk_loss(adaptive_softmax, features, target):
    loss, _, kl = rdrop_nll_loss(full_log_prob(adaptive_softmax, features), target)
    return torch.stack([loss, kl])


def full_log_prob(adaptive_softmax, x):
    """Log-probabilities over the whole vocabulary, as in training (input dropout included)."""
    x = adaptive_softmax.dropout_module(x)
    head = F.log_softmax(adaptive_softmax.head(x), dim=-1, dtype=torch.float32)
    first = adaptive_softmax.cutoff[0]
    parts = [head[:, :first]]
    for i, tail in enumerate(adaptive_softmax.tail):
        parts.append(F.log_softmax(tail(x), dim=-1, dtype=torch.float32) + head[:, first + i, None])
    return torch.cat(parts, dim=1)
