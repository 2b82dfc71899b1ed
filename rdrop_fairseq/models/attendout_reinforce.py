"""AttendOut's policy-gradient step (REINFORCE with a baseline, the paper's Eq. 4): the
rewards the generator is trained on, its update with its own optimizers, and the pruning
decision that follows, for the task (:mod:`rdrop_fairseq.tasks.attendout_pruning`) and the
controls alike. The generator is :mod:`.attendout_generator`.
"""

import torch


REWARD_CLIP = 5.0  # task rewards beyond this many noise-sds are clipped to it


def local_sum(tensors):
    """The ``reduce`` of one process: every sum is its own."""
    return list(tensors)


def concatenated(tensors, device):
    """The tensors of a list, flattened one after another (empty for an empty list: a
    process without a cached batch)."""
    if not tensors:
        return torch.zeros(0, device=device)
    return torch.cat([x.reshape(-1) for x in tensors])


def shape_rewards(generator, task_rewards, dropped, decay, reduce=local_sum):
    """The rewards the generator is trained on: each task reward (attacker over defender)
    in units of the task reward's *noise*, clipped to +-``REWARD_CLIP``, plus
    ``generator.price`` for every layer that ran as Eq. 3 for the example (``dropped[t]``,
    ``(m,)`` counts). The noise is the standard deviation of the rewards of the examples
    where no layer ran as Eq. 3 (all examples if fewer than 2 are), a moving average of
    each interval's variance (decay ``decay``; 1 while it is 0). So the price is in units
    of the reward's noise, whatever one very costly layer does to the reward's spread, and
    such a layer's losses cannot swamp the credit of the others.

    ``reduce``: sums over the data-parallel processes (a list of tensors to the list of
    their sums: :meth:`Processes.sum`), so that the variance is the whole interval's, as
    one process computes it on the union of the processes' batches."""
    device = generator.drop_bias.device
    r = concatenated(task_rewards, device).float()
    quiet = (concatenated(dropped, device) == 0).float()
    weights = torch.stack([quiet, torch.ones_like(r)])  # the quiet examples; all examples
    count, total = reduce([weights.sum(1), (weights * r).sum(1)])
    mean = total / count.clamp_min(1)
    (square,) = reduce([((r - mean[:, None]) ** 2 * weights).sum(1)])
    variances = square / count.clamp_min(1)
    var = torch.where(count[0] >= 2, variances[0], variances[1])
    generator.reward_var = (var if generator.reward_var is None
                            else decay * generator.reward_var + (1 - decay) * var)
    sd = torch.where(generator.reward_var > 0, generator.reward_var.sqrt(),
                     torch.ones_like(generator.reward_var))
    return [(x.float() / sd).clamp(-REWARD_CLIP, REWARD_CLIP) + generator.price * n.float()
            for x, n in zip(task_rewards, dropped)]


def reinforce_step(generator, rewards, log_prob, baseline_decay, leave_one_out=False,
                   reduce=local_sum):
    """One policy-gradient update of the generator (Eq. 4) with its own optimizers.

    ``rewards[t]``: ``(m,)`` per example of cached batch ``t``, without a graph;
    ``log_prob(t)``: the log probabilities ``(m,)`` of batch ``t``'s actions, with a graph
    into the generator. The loss is ``-sum_t (1/m) sum_k (r_tk - b_tk) log P(a_tk)``, with
    ``b`` the moving average of past mean rewards (0 before the first step; updated after
    use, whatever the baseline) or, with ``leave_one_out``, the mean reward of the other
    examples of the batch (the moving average for a batch of one). ``b`` is fixed before
    the backward passes, so one backward per batch gives the gradient of the sum while only
    one batch's graph is alive. ``reduce`` (:func:`shape_rewards`'): the gradient, the
    mean reward and the number of batches are the sums over the processes' batches, so
    that every process takes the step one process takes on all of them. Returns the mean
    reward.
    """
    device = generator.drop_bias.device
    flat = concatenated(rewards, device).detach()
    baseline = generator.baseline if generator.baseline is not None else torch.zeros(
        (), device=device)
    generator.zero_grad_optimizers()
    for t, r in enumerate(rewards):
        b = baseline
        if leave_one_out and r.numel() > 1:
            b = (r.sum() - r) / (r.numel() - 1)
        (-((r - b) * log_prob(t)).mean()).backward()
    params = list(generator.parameters())
    grads = [torch.zeros_like(p) if p.grad is None else p.grad for p in params]
    has_grad = torch.tensor([p.grad is not None for p in params], dtype=torch.float32,
                            device=device)
    counts = torch.stack([flat.sum(), torch.tensor(float(flat.numel()), device=device),
                          torch.tensor(float(len(rewards)), device=device)])
    *grads, has_grad, counts = reduce([*grads, has_grad, counts])
    for p, grad, has in zip(params, grads, has_grad.tolist()):
        p.grad = grad if has else None  # (no process gave it a gradient: no step)
    generator.optimizer_step(round(counts[2].item()))
    mean_reward = counts[0] / counts[1]
    generator.baseline = (mean_reward if generator.baseline is None else
                          baseline_decay * generator.baseline + (1 - baseline_decay) * mean_reward)
    return mean_reward


def pruning_update(generator, task_rewards, dropped, batch, *, baseline_decay,
                   leave_one_out=False, budget=0, price_step=0.0, force=False):
    """The generator's side of a pruning step, for the task and the controls alike: its
    update (:func:`reinforce_generator`), then the decision (:func:`decide_pruning`).

    ``task_rewards[t]``, ``dropped[t]``: ``(m,)`` per example of cached batch ``t``;
    ``batch(t)``: ``(drop logits with a graph into the generator, the batch's mask,
    its padding mask)``. Returns ``(decision statistic per layer, layers pruned now)``.
    """
    statistic = reinforce_generator(generator, task_rewards, dropped, batch,
                                    baseline_decay=baseline_decay, leave_one_out=leave_one_out)
    return statistic, decide_pruning(generator, statistic, budget=budget,
                                     price_step=price_step, force=force)


def reinforce_generator(generator, task_rewards, dropped, batch, *, baseline_decay,
                        leave_one_out=False, reduce=local_sum):
    """The generator's update at a pruning step: shape the rewards
    (:func:`shape_rewards`), then one REINFORCE update (:func:`reinforce_step`) that also
    gathers the interval's statistics. Arguments as :func:`pruning_update`'s; ``reduce``
    as :func:`shape_rewards`' (the statistics too are summed over the processes). Returns
    the decision statistic per layer (:meth:`AttendOutGenerator.finish_statistics`)."""
    with torch.no_grad():
        rewards = shape_rewards(generator, task_rewards, dropped, baseline_decay, reduce)
    totals = statistics_totals(generator)

    def log_prob(t):
        logits, drop, padding_mask = batch(t)
        generator.accumulate_statistics(totals, logits.detach(), padding_mask)
        return generator.action_log_prob(logits, drop, padding_mask)

    generator.requires_grad_(True)
    try:
        reinforce_step(generator, rewards, log_prob, baseline_decay,
                       leave_one_out=leave_one_out, reduce=reduce)
    finally:
        generator.requires_grad_(False)
    generator.pruning_steps += 1
    return generator.finish_statistics(dict(zip(totals, reduce(list(totals.values())))))


def statistics_totals(generator):
    """Zero ``totals`` for :meth:`AttendOutGenerator.accumulate_statistics`: the same
    keys on every process, whether it has cached batches or not."""
    zeros = torch.zeros(generator.num_layers, device=generator.drop_bias.device)
    return {"drop_rate": zeros, "gate_prob": zeros.clone(),
            "greedy_all_dropped": zeros.clone(), "examples": zeros.new_zeros(())}


def decide_pruning(generator, statistic, *, budget=0, price_step=0.0, force=False):
    """The decision of a pruning step, after the generator's update
    (:meth:`AttendOutGenerator.decide`), and with a ``budget`` the price's dual ascent:
    ``price += price_step * (budget - layers pruned)``, never below 0. Returns the layers
    pruned now."""
    now = generator.decide(statistic, budget, force)
    if budget:  # dual ascent: dearer while layers are missing from the budget
        missing = budget - int(generator.pruned.sum())
        generator.price = max(0.0, generator.price + price_step * missing)
    return now
