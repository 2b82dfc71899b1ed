"""AttendOut's search, as the task ``sentence_prediction_attendout`` runs it on its batches:
the masks each training batch draws from the generator, the reward of the attacker over
the defender, and the generator's side of a pruning step, in three steps:

1. :meth:`AttendOutPruning.cached_rewards`: the task reward per example of each cached
   batch (the attacker with that batch's masks over the defender), and how many layers
   ran as Eq. 3 for the example;
2. :meth:`AttendOutPruning.update_generator`: REINFORCE with a baseline (Eq. 4) on those
   rewards, which also gathers the interval's decision statistic per layer;
3. :meth:`AttendOutPruning.decide`: the layers whose statistic reached the threshold are
   pruned, and with a budget the price moves.

The task keeps the schedule (when a pruning step runs and what its cache holds), the
defender's copy of the attacker (D <- A) and fairseq's hooks. The generator's own
arithmetic is in :mod:`rdrop_fairseq.models.attendout_generator` and
:mod:`rdrop_fairseq.models.attendout_reinforce`.
"""

import torch
import torch.nn.functional as F
from fairseq import utils

from ..models.attendout_generator import search_option, unpack_mask
from ..models.attendout_reinforce import decide_pruning, reinforce_generator
from .attendout_processes import Processes


class AttendOutPruning:
    """The search's steps for the task configuration ``cfg`` (its ``--attendout-*``
    options), on batches whose padding index is ``pad``. It holds no state of its own:
    the generator's (its optimizers, baseline, price, pruned layers) is the model's, the
    cache is the task's. Under several data-parallel processes each process draws the
    masks of its own batches and caches them, and the pruning step sums over the
    processes what one process sums over its batches (:mod:`.attendout_processes`)."""

    def __init__(self, cfg, pad):
        self.cfg = cfg
        self.pad = pad
        self.processes = Processes()

    @property
    def budget(self):
        """K of --attendout-target-layers (0: no budget)."""
        return search_option(self.cfg, "attendout_target_layers")

    # -- the masks of a training batch -------------------------------------------------
    def drop_logits(self, model, tokens, padding_mask):
        """The generator's drop logits for a batch, from the attacker's embeddings without
        dropout (detached: the generator's input, not a path into the encoder)."""
        h0 = model.encoder.sentence_encoder.embed_without_dropout(tokens).detach()
        return model.generator(h0, padding_mask)

    @torch.no_grad()
    def draw_masks(self, model, tokens):
        """The attacker's masks for a training batch, drawn with the run's next seed (so
        that a resumed run draws the same ones), and the batch's drop rate per layer for the
        training log: ``(drop, drop_rate)``."""
        padding_mask = tokens.eq(self.pad)
        generator = model.generator
        logits = self.drop_logits(model, tokens, padding_mask)
        drop_rate = generator.batch_drop_rate(logits, padding_mask)
        drop = generator.sample(logits, padding_mask, self.next_seed(generator))
        return drop, drop_rate

    def next_seed(self, generator):
        """The seed of the next batch's masks: a function of --seed and of the batch's
        place among the masks drawn so far by all processes (counted in the generator's
        state, which the checkpoint keeps). Each batch counts one per process: the process
        of rank r draws the ``masks_drawn + r + 1``-th masks, those one process draws for
        the batch fairseq deals to rank r (with --update-freq N x processes, one process
        draws them in the same order)."""
        processes = self.processes.world_size
        index = generator.masks_drawn + (self.processes.rank if processes > 1 else 0) + 1
        generator.masks_drawn += processes
        return (self.cfg.seed * 1_000_003 + index) % (2 ** 62)

    # -- the reward --------------------------------------------------------------------
    def rewards(self, model, sample, drop):
        """Per-example reward of the attacker with masks ``drop`` over the defender (positive
        when the attacker wins), ``(B,)``; every example gets its batch's mean with
        ``--attendout-reward-per-batch``."""
        reward = (self.example_scores(model, sample, drop=drop)
                  - self.example_scores(model, sample, role="defender"))
        if self.cfg.attendout_reward_per_batch:
            reward = reward.mean().expand_as(reward)
        return reward

    def step_rewards(self, model, sample, attacker_logits, defender_logits):
        """The step timing's reward per example, from the training forward's outputs (both
        passes' mean under R-Drop, whose batch is doubled)."""
        targets = model.get_targets(sample, [attacker_logits]).view(-1)
        passes = attacker_logits.size(0) // targets.numel()

        def score(logits):
            return self.scores(logits.detach(), targets.repeat(passes)).view(
                passes, -1).mean(0)

        reward = score(attacker_logits) - score(defender_logits)
        if self.cfg.attendout_reward_per_batch:
            reward = reward.mean().expand_as(reward)
        return reward

    def example_scores(self, model, sample, drop=None, role="attacker"):
        """Per-example score of the attacker (masks ``drop``) or the defender, larger =
        better: minus the loss, or correctness with ``--attendout-reward accuracy``."""
        logits, _ = model(**sample["net_input"], features_only=True,
                          classification_head_name=self.cfg.classification_head_name,
                          attendout_drop=drop, attendout_role=role)
        return self.scores(logits, model.get_targets(sample, [logits]).view(-1))

    def scores(self, logits, targets):
        """Per-example scores of a head's outputs: minus the squared error (regression),
        correctness (``--attendout-reward accuracy``) or minus the cross-entropy."""
        if self.cfg.regression_target:
            return -F.mse_loss(logits.view(-1).float(), targets.float(), reduction="none")
        if self.cfg.attendout_reward == "accuracy":
            return logits.argmax(-1).eq(targets).float()
        return -F.cross_entropy(logits.float(), targets, reduction="none")

    # -- the pruning step --------------------------------------------------------------
    def step(self, model, cache, force=False):
        """The generator's side of a pruning step on ``cache``, the batches of the interval
        (``(sample, packed mask, step-timing rewards or None)`` each): reward, update,
        decision, with the model in evaluation mode. Without a cached batch on any process
        (the deadline after a skipped update, say) the decision alone, on the last
        interval's statistic, and the price stays. ``force``: the deadline (fill the
        budget). Returns ``(decision statistic per layer, layers pruned now, cached
        batches of all processes)``."""
        generator = model.generator
        batches = len(cache)
        if self.processes.world_size > 1:  # (a process may have none: fairseq's dummy batches)
            (total,) = self.processes.sum([torch.tensor(float(batches),
                                                        device=generator.drop_bias.device)])
            batches = round(total.item())
        if not batches:
            statistic = generator.gate_prob if generator.decision == "layer" else (
                generator.greedy_all_dropped)
            return statistic, generator.decide(statistic, self.budget, force), 0
        model.eval()
        cache = on_device(cache, generator.drop_bias.device)
        task_rewards, dropped = self.cached_rewards(model, cache)
        statistic = self.update_generator(model, cache, task_rewards, dropped)
        now = self.decide(generator, statistic, force)
        model.train()
        return statistic, now, batches

    @torch.no_grad()
    def cached_rewards(self, model, cache):
        """Step 1: ``(task rewards, layers dropped)``, one ``(m,)`` tensor per cached batch:
        each example's reward (cached with the step timing, else :meth:`rewards` now) and
        the number of layers that ran as Eq. 3 for it."""
        task_rewards, dropped = [], []
        for sample, packed, rewards in cache:
            drop = unpack_mask(*packed)
            task_rewards.append(self.rewards(model, sample, drop) if rewards is None
                                else rewards)
            dropped.append(model.generator.layers_dropped(
                drop, sample["net_input"]["src_tokens"].eq(self.pad)))
        return task_rewards, dropped

    def update_generator(self, model, cache, task_rewards, dropped):
        """Step 2: one REINFORCE update of the generator with its own optimizers, one
        backward per cached batch. Returns the interval's decision statistic per layer."""
        generator = model.generator
        generator.build_optimizer(self.cfg.attendout_generator_lr,
                                  search_option(self.cfg, "attendout_gate_lr"))

        def batch(t):
            # log P(action) is taken under the generator, whose parameters have not
            # changed since the action; its input (the embeddings) may have, slightly
            sample, packed, _ = cache[t]
            tokens = sample["net_input"]["src_tokens"]
            padding_mask = tokens.eq(self.pad)
            return (self.drop_logits(model, tokens, padding_mask), unpack_mask(*packed),
                    padding_mask)

        return reinforce_generator(
            generator, task_rewards, dropped, batch,
            baseline_decay=self.cfg.attendout_baseline_decay,
            leave_one_out=self.cfg.attendout_baseline == "leave_one_out",
            reduce=self.processes.sum)

    def decide(self, generator, statistic, force=False):
        """Step 3: prune the layers whose ``statistic`` reached the threshold (the budget's
        highest first; ``force``: fill it), then move the budget's price. Returns the
        layers pruned now."""
        return decide_pruning(generator, statistic, budget=self.budget,
                              price_step=search_option(self.cfg, "attendout_price_step"),
                              force=force)


def on_device(cache, device):
    """The cached batches' samples and rewards on ``device`` (a restored cache is on the
    CPU); the packed masks stay where they are."""
    return [(utils.apply_to_sample(lambda t: t.to(device), sample), packed,
             None if rewards is None else rewards.to(device))
            for sample, packed, rewards in cache]


def describe_step(generator, statistic, now, *, update, batches, force, finished):
    """The log line of a pruning step: the generator rewarded on ``batches`` cached batches
    (at ``update``, when known), the decision statistic, the price, the layers pruned now
    (``force``: at the deadline) and in all, and what follows (``finished``: the budget is
    filled)."""
    parts = [f"AttendOut pruning step {generator.pruning_steps}"
             + (f" (update {update})" if update is not None else "")
             + f": generator rewarded on {batches} cached batches",
             "decision statistic per layer " + " ".join(f"{p:.3f}" for p in statistic.tolist()),
             f"price {generator.price:.3f}"]
    if now:
        parts.append(f"pruned now {','.join(map(str, now))}" + (" (deadline)" if force else ""))
    parts.append(f"pruned {','.join(map(str, generator.pruned_layers())) or 'none'}")
    parts.append("budget filled: the attacker trains as exported from now on" if finished
                 else "defender <- attacker")
    return "; ".join(parts)
