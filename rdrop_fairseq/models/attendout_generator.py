"""AttendOut's generator (the paper's G-Net): the drop probabilities of the attacker's
attention units and, in layer mode, its layers' gates; the one sampler of its masks
(:func:`sample_drop`), their packed form for the pruning step's cache, the log-probability
of an action, and the checks of the search's options. Its policy-gradient step is
:mod:`.attendout_reinforce`; the layers it masks are :mod:`.attendout_layers`.
docs/attendout.md says which choices are the paper's and which are ours.
"""

import math

import torch
import torch.nn as nn
import torch.nn.functional as F
from fairseq.modules import LayerNorm


DECISIONS = ("layer", "unit")


def check_decision(decision, prune_threshold):
    """The pruning decision's options (``--attendout-decision``,
    ``--attendout-prune-threshold``): a clear error for anything else."""
    if decision not in DECISIONS:
        raise ValueError(f"--attendout-decision must be one of {', '.join(DECISIONS)}, "
                         f"got {decision!r}")
    if not 0.0 < prune_threshold < 1.0:
        raise ValueError(f"--attendout-prune-threshold must be in (0, 1), got {prune_threshold}")


SEARCH_DEFAULTS = {"attendout_drop_price": 0.5, "attendout_price_step": 0.1,
                   "attendout_gate_lr": 1.0, "attendout_deadline": 0.4,
                   "attendout_target_layers": 0}


def search_option(opts, name):
    """``opts.name``, or its default where ``opts`` predates the option (the config of an
    older checkpoint)."""
    value = getattr(opts, name, None)
    return SEARCH_DEFAULTS[name] if value is None else value


def check_search_options(opts, num_layers, max_update):
    """The AttendOut task's search options (``opts``: fairseq's argparse namespace or the
    task's config), checked while ``fairseq-train`` parses its options (and again when
    the task and the model are built, for ``fairseq-hydra-train``): a clear error naming
    the option. ``num_layers`` None: not known yet (the task, before the model)."""
    check_decision(opts.attendout_decision, opts.attendout_prune_threshold)
    for name, what in (("attendout_drop_price", "reward-sd units per layer run as Eq. 3"),
                       ("attendout_price_step", "reward-sd units per pruning step"),
                       ("attendout_gate_lr", "a learning rate")):
        value = search_option(opts, name)
        if not value >= 0:  # NaN too
            raise ValueError(f"--{name.replace('_', '-')} must be >= 0 ({what}), got {value}")
    deadline = search_option(opts, "attendout_deadline")
    if not 0.0 < deadline < 1.0:
        raise ValueError(f"--attendout-deadline must be in (0, 1) (a fraction of "
                         f"--max-update), got {deadline}")
    budget = search_option(opts, "attendout_target_layers")
    if budget == 0:
        return
    top = "layers - 1" if num_layers is None else num_layers - 1
    if budget < 1 or (num_layers is not None and budget > num_layers - 1):
        raise ValueError(f"--attendout-target-layers must be in 1..{top} (0 = no budget)"
                         f", got {budget}")
    if opts.attendout_decision != "layer":
        raise ValueError("--attendout-target-layers needs --attendout-decision layer: the "
                         "budget is filled by the whole-layer gates")
    if not max_update:
        raise ValueError("--attendout-target-layers needs --max-update: the budget's "
                         "deadline is --attendout-deadline x --max-update")


class AttendOutGenerator(nn.Module):
    """The paper's G-Net (sec. 4.1): one single-head self-attention layer without
    feed-forward, applied recurrently, once per encoder layer, with shared parameters;
    its pre-softmax scores ``S_i`` give layer ``i``'s drop logits ``S_i + beta``.

    ``decision``: how a layer comes to be pruned (ours; docs/attendout.md).

    * ``"layer"``: each layer also has a *gate*, logit ``mean(S_i) + gamma + gamma_i`` (the
      masked mean of its scores, ``gamma`` a learnt scalar shared by the layers like
      ``beta``, ``gamma_i`` the layer's own bias), sampled per example; where it fires the
      whole layer is dropped (Eq. 3) for that example. The decision statistic of a layer is
      its gate's mean probability over the examples of the last pruning interval.
    * ``"unit"``: per-unit masks only (the paper's literal reading); the statistic is the
      fraction of the interval's examples whose greedy mask (p > 0.5) drops every unit.

    The decision is made at the pruning step (:meth:`decide`), never in between, and it is
    sticky (buffer ``pruned``): a pruned layer runs as Eq. 3 for every example from then
    on, in training too, so the attacker trains as it is exported, and its terms leave
    ``log P(action)``.

    ``h_0`` is the encoder's embedding output (no gradient flows into the encoder);
    ``h_i = LayerNorm(h_{i-1} + W_O softmax(S_i) W_V h_{i-1})``. ``beta`` and ``gamma``
    start at ``logit(init_drop)``, so the first drop probabilities average about
    ``init_drop``; they vary from unit to unit with the scores (about 0.03 to 0.3 for 0.1).

    The generator is trained by policy gradient with its own optimizers, not by fairseq's:
    its parameters have ``requires_grad=False`` outside the pruning step. Adam at the
    paper's learning rate for the attention layer, ``beta`` and ``gamma``; plain SGD for
    the per-layer biases ``gamma_i`` (:meth:`optimizer_step`). It stays in float32
    whatever the model's dtype (``--fp16`` casts the model with ``half()``).
    Buffers (the last pruning interval's means per layer, written by
    :meth:`finish_statistics`): ``drop_rate`` (a unit's drop probability), ``gate_prob``
    (the gate's probability: the layer mode's statistic), ``greedy_all_dropped`` (the unit
    mode's); ``pruned``. Extra state: both optimizers' state, the REINFORCE baseline, the
    reward's running variance, the current price per dropped layer, the counters.
    """

    def __init__(self, embed_dim, num_layers, init_drop=0.1, decision="unit",
                 prune_threshold=0.5):
        super().__init__()
        if not 0.0 < init_drop < 1.0:
            raise ValueError(f"--attendout-init-drop must be in (0, 1), got {init_drop}")
        self.num_layers = num_layers
        self.configure(decision, prune_threshold)
        self.q_proj = nn.Linear(embed_dim, embed_dim)
        self.k_proj = nn.Linear(embed_dim, embed_dim)
        self.v_proj = nn.Linear(embed_dim, embed_dim)
        self.out_proj = nn.Linear(embed_dim, embed_dim)
        self.layer_norm = LayerNorm(embed_dim)
        self.drop_bias = nn.Parameter(torch.tensor(math.log(init_drop / (1 - init_drop))))
        # the gate's own scalar; it starts so that a layer's gate fires with about init_drop
        self.gate_bias = nn.Parameter(torch.tensor(math.log(init_drop / (1 - init_drop))))
        # each layer's own gate bias: credit for dropping layer i goes to gamma_i, not to
        # weights that every layer's scores share
        self.gate_layer_bias = nn.Parameter(torch.zeros(num_layers))
        self.scaling = embed_dim ** -0.5
        self.register_buffer("drop_rate", torch.full((num_layers,), init_drop))
        self.register_buffer("greedy_all_dropped", torch.zeros(num_layers))
        self.register_buffer("gate_prob", torch.full((num_layers,), init_drop))
        self.register_buffer("pruned", torch.zeros(num_layers, dtype=torch.bool))
        self.requires_grad_(False)
        # policy-gradient state, kept in the checkpoint through get/set_extra_state
        self.optimizer = None
        self.gate_optimizer = None
        self._pending_optimizer_state = None
        self.baseline = None  # moving average of past mean rewards (a 0-dim tensor)
        self.reward_var = None  # moving average of the task reward's variance (0-dim)
        self.price = 0.0  # reward per layer run as Eq. 3, in units of the reward's sd
        self.pruning_steps = 0
        self.masks_drawn = 0
        self.cached_batches = 0  # the task's, at the last save (to tell when it is lost)

    def forward(self, h, padding_mask):
        """Drop logits ``(B, layers, T, T)`` (float32) for inputs ``h`` ``(B, T, C)``."""
        h = h.float()
        bsz, length, dim = h.shape
        key_pad = padding_mask[:, None, :]
        # each projection as F.linear computes it on a contiguous (B, T, C) input (addmm on
        # the flattened input), with its weight transposed once for all the layers that
        # share it: the same numbers, fewer ops and autograd nodes
        q, k, v, out = ((m.bias, m.weight.t())
                        for m in (self.q_proj, self.k_proj, self.v_proj, self.out_proj))

        def project(x, linear):
            return torch.addmm(linear[0], x.reshape(-1, dim), linear[1]).view(bsz, length, dim)

        logits = []
        for i in range(self.num_layers):
            scores = torch.bmm(project(h, q) * self.scaling, project(h, k).transpose(1, 2))
            logits.append(scores + self.drop_bias)
            if i + 1 == self.num_layers:  # nothing reads the last layer's output
                break
            weights = F.softmax(scores.masked_fill(key_pad, float("-inf")), dim=-1)
            h = self.layer_norm(h + project(torch.bmm(weights, project(h, v)), out))
        return torch.stack(logits, dim=1)

    def configure(self, decision, prune_threshold):
        """Set the decision mode and threshold (task options, so set by the task)."""
        check_decision(decision, prune_threshold)
        self.decision = decision
        self.prune_threshold = prune_threshold

    def gate_logits(self, logits, padding_mask):
        """``(B, layers)``: each layer's gate logit, the mean of its scores ``S_i`` over the
        valid units plus ``gate_bias`` and the layer's ``gate_layer_bias`` (``logits`` are
        ``S_i + drop_bias``, from forward)."""
        valid = unit_mask(padding_mask).unsqueeze(1)
        return self._gate_logits(logits, valid, valid.sum((-1, -2)).clamp_min(1))

    def _gate_logits(self, logits, valid, count):
        # valid: (B, 1, T, T) unit_mask; count: (B, 1) its valid units (at least 1)
        scores = (logits - self.drop_bias).masked_fill(~valid, 0.0)
        return scores.sum((-1, -2)) / count + self.gate_bias + self.gate_layer_bias

    @torch.no_grad()
    def sample(self, logits, padding_mask, seed):
        """The attacker's masks ``(B, layers, T, T)``, True = dropped: units where ``U < p``
        (:func:`sample_drop`); in layer mode, then, each layer's gate per example, drawn
        after the units from the same generator, a fired gate dropping all the layer's
        units; pruned layers dropped for every example. Regenerated exactly from the same
        ``seed``."""
        if self.decision != "layer":
            return sample_drop(logits.sigmoid(), seed) | self.pruned[:, None, None]
        gate = self.gate_logits(logits, padding_mask).sigmoid()
        drop, fired = sample_drop(logits.sigmoid(), seed, gate)
        return drop | fired[:, :, None, None] | self.pruned[:, None, None]

    def action_log_prob(self, logits, drop, padding_mask):
        """``log P(drop)`` per example under this generator (:func:`action_log_prob` with
        the gate's terms in layer mode, without the pruned layers' terms)."""
        gate = self.gate_logits(logits, padding_mask) if self.decision == "layer" else None
        return action_log_prob(logits, drop, padding_mask, gate, self.pruned)

    def layers_dropped(self, drop, padding_mask):
        """``(B,)``: how many layers, among those not pruned, ran as Eq. 3 for each example
        (every valid unit dropped: the gate fired, or every unit was drawn)."""
        whole = (drop | ~unit_mask(padding_mask).unsqueeze(1)).all(-1).all(-1)  # (B, L)
        return (whole & ~self.pruned).sum(1)

    def _apply(self, fn, recurse=True):
        super()._apply(fn, recurse)
        for t in list(self.parameters()) + list(self.buffers()):
            if t.is_floating_point() and t.dtype != torch.float32:
                t.data = t.data.float()
        return self

    def build_optimizer(self, lr, gate_lr=0.0):
        """The generator's own optimizers (created on first use, restored from the
        checkpoint): Adam at ``lr`` for all but the per-layer gate biases, plain SGD for
        those (``gate_lr``, scaled in :meth:`optimizer_step`)."""
        if self.optimizer is None:
            shared = [p for name, p in self.named_parameters() if name != "gate_layer_bias"]
            self.optimizer = torch.optim.Adam(shared, lr=lr)
            self.gate_optimizer = torch.optim.SGD([self.gate_layer_bias], lr=gate_lr)
            if self._pending_optimizer_state is not None:
                self.optimizer.load_state_dict(self._pending_optimizer_state)
                self._pending_optimizer_state = None
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.gate_lr = gate_lr
        return self.optimizer

    def zero_grad_optimizers(self):
        self.optimizer.zero_grad()
        self.gate_optimizer.zero_grad()

    def optimizer_step(self, batches):
        """One step of both optimizers after ``batches`` cached batches' backward passes.

        ``log P`` is a mean over the layers and Eq. 4 sums the batches, so a gate bias's
        gradient is ``-(batches / layers)`` times the mean over the interval's examples of
        ``(r - b) d log P_i / d gamma_i``. The SGD step undoes that scale: ``gamma_i``
        moves by ``gate_lr`` times that mean, in reward-sd units per pruning step, whatever
        the interval or the depth."""
        self.optimizer.step()
        for group in self.gate_optimizer.param_groups:
            group["lr"] = self.gate_lr * self.num_layers / max(batches, 1)
        self.gate_optimizer.step()

    def get_extra_state(self):
        optimizer_state = (self.optimizer.state_dict() if self.optimizer is not None
                           else self._pending_optimizer_state)

        def cpu(t):
            return None if t is None else t.detach().cpu()

        return {
            "optimizer": optimizer_state,
            "baseline": cpu(self.baseline),
            "reward_var": cpu(self.reward_var),
            "price": self.price,
            "pruning_steps": self.pruning_steps,
            "masks_drawn": self.masks_drawn,
            "cached_batches": self.cached_batches,
        }

    def set_extra_state(self, state):
        self._pending_optimizer_state = state.get("optimizer")
        self.optimizer = self.gate_optimizer = None
        device = self.drop_bias.device
        baseline, var = state.get("baseline"), state.get("reward_var")
        self.baseline = None if baseline is None else baseline.to(device)
        self.reward_var = None if var is None else var.to(device)
        self.price = float(state.get("price", 0.0))
        self.pruning_steps = int(state.get("pruning_steps", 0))
        self.masks_drawn = int(state.get("masks_drawn", 0))
        self.cached_batches = int(state.get("cached_batches", 0))

    @torch.no_grad()
    def batch_drop_rate(self, logits, padding_mask):
        """``(layers,)``: the batch's mean probability that a unit of each layer is dropped
        (the gate's included; 1 for a pruned layer), for the training log. On the device:
        no host sync."""
        valid = unit_mask(padding_mask).unsqueeze(1)  # (B, 1, T, T)
        count = valid.sum((-1, -2)).clamp_min(1)  # (B, 1)
        rate = (logits.sigmoid() * valid).sum((-1, -2)) / count  # (B, L)
        if self.decision == "layer":
            gate = self._gate_logits(logits, valid, count).sigmoid()
            rate = gate + (1 - gate) * rate
        return rate.mean(0).masked_fill(self.pruned, 1.0)

    @torch.no_grad()
    def accumulate_statistics(self, totals, logits, padding_mask):
        """Add one batch's per-layer sums over its examples to ``totals`` (a dict, empty at
        first): the units' mean drop probability, the gate's probability, whether the
        greedy mask (p > 0.5) drops every valid unit; and the number of examples."""
        valid = unit_mask(padding_mask).unsqueeze(1)
        count = valid.sum((-1, -2)).clamp_min(1)
        batch = {
            "drop_rate": ((logits.sigmoid() * valid).sum((-1, -2)) / count).sum(0),
            "gate_prob": self._gate_logits(logits, valid, count).sigmoid().sum(0),
            "greedy_all_dropped": ((logits > 0) | ~valid).all(-1).all(-1).float().sum(0),
            "examples": torch.tensor(float(logits.size(0)), device=logits.device),
        }
        for key, value in batch.items():
            totals[key] = totals[key] + value if key in totals else value

    @torch.no_grad()
    def finish_statistics(self, totals):
        """Store the interval's means (``totals`` from :meth:`accumulate_statistics`) in
        the buffers; returns the decision statistic per layer."""
        if totals:  # (else no batch was seen: the last interval's stand)
            for key in ("drop_rate", "gate_prob", "greedy_all_dropped"):
                getattr(self, key).copy_(totals[key] / totals["examples"].clamp_min(1))
        return self.gate_prob if self.decision == "layer" else self.greedy_all_dropped

    @torch.no_grad()
    def decide(self, statistic, budget=0, force=False):
        """Prune the layers whose ``statistic`` reached the threshold (sticky; at a pruning
        step, a host sync). With a ``budget`` of K layers: at most K in all, the highest
        statistics first; ``force`` (the deadline) prunes the highest until there are K.
        Returns the layers pruned now."""
        stat = statistic.tolist()
        pruned = self.pruned_layers()
        candidates = sorted((i for i in range(self.num_layers) if i not in pruned),
                            key=lambda i: -stat[i])
        if budget:
            room = max(budget - len(pruned), 0)
            now = candidates[:room] if force else [
                i for i in candidates if stat[i] >= self.prune_threshold][:room]
        else:
            now = [i for i in candidates if stat[i] >= self.prune_threshold]
        for i in now:
            self.pruned[i] = True
        return sorted(now)

    def pruned_layers(self):
        """The pruned layers (a host sync): what validation scores and the export writes."""
        return [i for i, p in enumerate(self.pruned.tolist()) if p]


def unit_mask(padding_mask):
    """``(B, T, T)``: True for attention units between two non-padding positions."""
    keep = ~padding_mask
    return keep[:, :, None] & keep[:, None, :]


def sample_drop(probs, seed, *then):
    """The attacker's masks: unit dropped where ``U < p``, ``U`` from a generator seeded
    with ``seed`` (so that the pruning step can regenerate the same action). ``then``:
    further probabilities (the layers' gates), drawn in order after ``probs`` from the same
    generator; a mask for each is returned after the units' (the units' alone without)."""
    gen = torch.Generator(device=probs.device)
    gen.manual_seed(seed)
    masks = [torch.rand(p.shape, generator=gen, device=p.device) < p for p in (probs, *then)]
    return masks[0] if not then else masks


def pack_mask(mask):
    """A bool tensor as ``(bits, shape)``, 8 values per byte (the pruning step's cache)."""
    flat = mask.reshape(-1)
    flat = F.pad(flat.to(torch.uint8), (0, -flat.numel() % 8)).view(-1, 8)
    weights = torch.tensor([1 << i for i in range(8)], dtype=torch.uint8, device=mask.device)
    return (flat * weights).sum(-1, dtype=torch.uint8), mask.shape


def unpack_mask(bits, shape):
    """The inverse of :func:`pack_mask`."""
    shifts = torch.arange(8, dtype=torch.uint8, device=bits.device)
    flat = ((bits[:, None] >> shifts) & 1).bool().reshape(-1)
    return flat[: math.prod(shape)].view(shape)


def action_log_prob(logits, drop, padding_mask, gate_logits=None, forced=None):
    """``log P(a)`` per example, ``(B,)``: the mean over layers of each layer's term.

    Without a gate a layer's term is the mean log-probability of its valid units, so the
    whole is Eq. 4's ``1/(n l^2)`` average (``l`` the example's own length). With
    ``gate_logits`` ``(B, layers)`` (logit ``z`` of the gate, fired with probability
    ``q``): a layer whose valid units are all dropped has the probability of that event,
    ``log(q + (1 - q) prod_j p_j)`` (the gate fired, or every unit was drawn); any other
    layer has ``log(1 - q)`` plus its units' mean log-probability. Layers in ``forced``
    (``(layers,)`` bool: pruned, dropped whatever the generator says) count 0.
    """
    log_p = F.logsigmoid(torch.where(drop, logits, -logits))
    valid = unit_mask(padding_mask).unsqueeze(1)  # (B, 1, T, T)
    total = (log_p * valid).sum((-1, -2))  # (B, L)
    per_layer = total / valid.sum((-1, -2)).clamp_min(1)
    if gate_logits is not None:
        all_dropped = (drop | ~valid).all(-1).all(-1)  # (B, L)
        kept = F.logsigmoid(-gate_logits)
        per_layer = torch.where(all_dropped,
                                torch.logaddexp(F.logsigmoid(gate_logits), kept + total),
                                kept + per_layer)
    if forced is not None:
        per_layer = per_layer.masked_fill(forced, 0.0)
    return per_layer.mean(1)
