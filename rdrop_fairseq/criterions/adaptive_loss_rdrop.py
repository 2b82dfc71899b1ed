"""R-Drop over fairseq's ``adaptive_loss`` (adaptive-softmax LMs, ``transformer_lm_wiki103``).

The KL must compare the two passes' *full* output distributions,
``p(w) = p_head(cluster(w)) * p_tail(w | cluster(w))``: a KL over the head alone would ignore
how the passes spread probability inside the tail clusters (most of the vocabulary). We
compute that distribution (what ``AdaptiveSoftmax.get_log_prob`` returns, but differentiable:
fairseq's version writes into a log-softmax output in place) for every position of both
passes, a few thousand rows at a time, and take from it both the task loss
``-log p(target)`` and the symmetric KL, so that they see the same sub-models. That loss is
fairseq's cluster-wise ``adaptive_loss`` except for one fairseq quirk we do not copy: it
drops the tail term of the word with id ``cutoff[i] + padding_idx`` (docs/design.md).

Each chunk is checkpointed (re-entrant: run without a graph, then recomputed with the same
dropout masks and differentiated at once in the backward), so only one chunk's
full-vocabulary tensors exist at a time. The number of chunks depends on shapes only and
padding is masked by weights: nothing waits for the GPU.
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from fairseq.criterions import register_criterion
from fairseq.criterions.adaptive_loss import AdaptiveLoss, AdaptiveLossConfig
from torch.utils.checkpoint import checkpoint

from ..core import rdrop_loss
from ..ops.rows import chunk_budget_mb
from .rdrop import RDropConfig, RDropCriterionMixin


@dataclass
class AdaptiveLossRDropConfig(AdaptiveLossConfig, RDropConfig):
    pass


@register_criterion("adaptive_loss_rdrop", dataclass=AdaptiveLossRDropConfig)
class AdaptiveLossRDrop(RDropCriterionMixin, AdaptiveLoss):
    def __init__(self, cfg: AdaptiveLossRDropConfig, task):
        super().__init__(task, cfg.sentence_avg)
        self.init_rdrop_from(cfg, "adaptive_loss")

    @classmethod
    def build_criterion(cls, cfg: AdaptiveLossRDropConfig, task):
        AdaptiveLoss.build_criterion(cfg, task)  # fairseq's own ddp-backend check
        return cls(cfg, task)

    def rdrop_forward(self, model, sample):
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
        total, loss, kl = adaptive_rdrop_loss(
            adaptive_softmax, features, target, self.padding_idx, self.rdrop_alpha,
            self.rdrop_chunk_mb, self.rdrop_impl,
        )
        sample_size = sample["target"].size(0) if self.sentence_avg else sample["ntokens"]
        logging_output = {
            "loss": loss / 2,
            "rdrop_kl": kl,
            "ntokens": sample["ntokens"],
            "nsentences": sample["target"].size(0),
            "sample_size": sample_size,
        }
        return total, sample_size, logging_output


# float32 (2r, V) tensors that a chunk of r row pairs holds at its peak, in the forward of
# full_log_prob: the log_softmax outputs of head and tails (kept for their backward), the
# tails' sums with their cluster's head log-probability, and their concatenation; the
# fused loss then writes its gradient into the latter and keeps its own temporaries within
# a third of the budget. Measured at V = 20k with --rdrop-chunk-mb 2, 8 and 32: peaks of
# 1.57x (the adaptive softmax's weight gradients dominate at 2 MiB), 1.14x and 1.03x the
# budget (tests/test_criteria.py::test_adaptive_chunk_stays_within_its_budget); 3.0-3.6x
# with one copy counted (and 2.0-2.5x before, when the fused loss had a buffer of its own
# and the automatic chunk size).
CHUNK_COPIES = 3


def adaptive_rdrop_loss(adaptive_softmax, features, target, padding_idx, alpha,
                        chunk_mb=0.0, impl="auto"):
    """``(total, loss, kl)``: NLL of both passes, their symmetric KL over the full
    adaptive-softmax distribution, and ``total = loss + alpha * kl`` (differentiable).

    ``features``: ``(2N, d)`` adaptive-softmax inputs, pass 1 then pass 2; ``target``: ``(2N,)``.
    """
    n = features.size(0) // 2
    pairs = features.view(2, n, -1)
    chunk_mb = chunk_budget_mb(chunk_mb, features)  # 0: the device's automatic budget
    vocab = adaptive_softmax.vocab_size
    rows = max(1, int(chunk_mb * 2**20) // (CHUNK_COPIES * 2 * vocab * 4))
    sums = []
    for x, t in zip(pairs.split(rows, 1), target[:n].split(rows)):
        sums.append(checkpoint(_chunk_loss, adaptive_softmax, x.reshape(-1, x.size(-1)), t,
                               padding_idx, alpha, impl, chunk_mb / CHUNK_COPIES,
                               use_reentrant=True))
    total, loss, kl = torch.stack(sums).sum(0).unbind()
    return total, loss.detach(), kl.detach()


def _chunk_loss(adaptive_softmax, features, target, padding_idx, alpha, impl, chunk_mb):
    # the concatenated log-probabilities are read by nothing else (cat keeps no copy of its
    # output for its backward): the fused loss writes their gradient into them
    out = rdrop_loss(full_log_prob(adaptive_softmax, features), target, alpha=alpha,
                     ignore_index=padding_idx, log_probs=True, chunk_mb=chunk_mb, impl=impl,
                     grad_in_scores=True)
    return torch.stack([out.total, out.loss, out.kl])


def full_log_prob(adaptive_softmax, x):
    """Log-probabilities over the whole vocabulary, as in training (input dropout included)."""
    x = adaptive_softmax.dropout_module(x)
    head = F.log_softmax(adaptive_softmax.head(x), dim=-1, dtype=torch.float32)
    first = adaptive_softmax.cutoff[0]
    parts = [head[:, :first]]
    for i, tail in enumerate(adaptive_softmax.tail):
        parts.append(F.log_softmax(tail(x), dim=-1, dtype=torch.float32) + head[:, first + i, None])
    return torch.cat(parts, dim=1)
