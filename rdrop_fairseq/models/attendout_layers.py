"""AttendOut building blocks: the maskable encoder layer, the encoder, and the generator.

AttendOut (Wu, Zhao, Zhang, "Not All Attention Is All You Need", arXiv 2104.04692) drops
self-attention units ``(i, j)`` (layer ``i``, element ``j`` of the ``l x l`` attention
map) of the attacker copy while it is fine-tuned; a layer whose units are all dropped
becomes, by the paper's Eq. 3, a *mean of V*: every query position gets
``out_proj(v_proj(mean of the non-padding inputs))``, without Q, K or their dot product.
docs/attendout.md says which choices below are the paper's and which are ours.
"""

import math

import torch
import torch.nn as nn
import torch.nn.functional as F
from fairseq.models.transformer import TransformerEncoder
from fairseq.modules import LayerNorm
from fairseq.modules.transformer_layer import TransformerEncoderLayer


class AttendOutEncoderLayer(TransformerEncoderLayer):
    """fairseq's encoder layer, plus two ways to run its self-attention:

    * ``attendout_drop`` (``(B, T, T)`` bool, True = unit dropped; one mask for every head,
      since the generator has one head): attention over the kept keys only (Eq. 2 with a
      mask of -inf); a query row whose non-padding keys are all dropped attends uniformly
      to them instead (Eq. 3), so nothing becomes NaN;
    * ``attendout_pruned``: the layer is pruned, its attention is Eq. 3 computed in
      ``O(T d)`` from the mean of the inputs (the structured pruning used at inference).

    Without either, it is exactly fairseq's layer (``super().forward``).
    """

    def forward(self, x, encoder_padding_mask=None, attn_mask=None, attendout_drop=None,
                attendout_pruned=False):
        if attendout_drop is None and not attendout_pruned:
            return super().forward(x, encoder_padding_mask, attn_mask=attn_mask)
        if attn_mask is not None:
            raise ValueError("AttendOut masks and an attn_mask cannot be combined")
        residual = x
        if self.normalize_before:
            x = self.self_attn_layer_norm(x)
        if attendout_pruned:
            x = mean_of_values(self.self_attn, x, encoder_padding_mask)
        else:
            x = masked_self_attention(self.self_attn, x, encoder_padding_mask, attendout_drop)
        x = self.dropout_module(x)
        x = self.residual_connection(x, residual)
        if not self.normalize_before:
            x = self.self_attn_layer_norm(x)
        # the feed-forward block, as in fairseq's layer
        residual = x
        if self.normalize_before:
            x = self.final_layer_norm(x)
        x = self.activation_fn(self.fc1(x))
        x = self.activation_dropout_module(x)
        x = self.fc2(x)
        x = self.dropout_module(x)
        x = self.residual_connection(x, residual)
        if not self.normalize_before:
            x = self.final_layer_norm(x)
        return x


def mean_of_values(attn, x, padding_mask=None):
    """Eq. 3: uniform attention over the non-padding positions, for every query.

    ``mean_t V_t = v_proj(mean_t x_t)`` because ``v_proj`` is affine, so the layer costs one
    ``d x d`` product per sequence for V and one for the output projection.
    ``x``: ``(T, B, C)``; ``padding_mask``: ``(B, T)``, True at padding.
    """
    if padding_mask is None:
        mean = x.mean(0)
    else:
        keep = (~padding_mask).t().unsqueeze(-1).to(x.dtype)  # (T, B, 1)
        mean = (x * keep).sum(0) / keep.sum(0).clamp_min(1)
    return attn.out_proj(attn.v_proj(mean)).unsqueeze(0).expand_as(x)


def masked_self_attention(attn, x, padding_mask, drop):
    """Multi-head self-attention of fairseq's ``MultiheadAttention`` ``attn`` with the
    AttendOut units ``drop`` (``(B, T, T)``, True = dropped) removed (Eq. 2).

    Dropped and padding keys get probability 0: one fused ``scaled_dot_product_attention``
    with the kept units as its mask (and the attention dropout inside it), no
    ``heads x T x T`` temporaries of ours. A query whose non-padding keys are all dropped
    gets Eq. 3 instead, the mean of V over them, as a pruned layer computes it (without
    attention dropout).
    """
    if attn.bias_k is not None or attn.add_zero_attn:
        raise ValueError("AttendOut does not support attention with bias_k/add_zero_attn")
    tgt_len, bsz, embed_dim = x.shape
    heads, head_dim = attn.num_heads, attn.head_dim

    def split_heads(t):  # (T, B, C) -> (B, H, T, head_dim)
        return t.view(tgt_len, bsz, heads, head_dim).permute(1, 2, 0, 3)

    v = split_heads(attn.v_proj(x))
    if padding_mask is None:
        keys = torch.ones(bsz, 1, tgt_len, dtype=torch.bool, device=x.device)
    else:
        keys = ~padding_mask[:, None, :]  # (B, 1, T)
    kept = keys & ~drop
    empty = ~kept.any(-1, keepdim=True)  # (B, T, 1): rows that lost every key
    dropout = attn.dropout_module
    p = dropout.p if (dropout.training or dropout.apply_during_inference) else 0.0
    out = F.scaled_dot_product_attention(  # (an empty row attends to its keys: replaced)
        split_heads(attn.q_proj(x)), split_heads(attn.k_proj(x)), v,
        attn_mask=torch.where(empty, keys, kept).unsqueeze(1), dropout_p=p,
        scale=attn.scaling)  # (B, H, T, head_dim)
    weights = keys.to(v.dtype).unsqueeze(-1)  # (B, 1, T, 1)
    mean = (v * weights).sum(2, keepdim=True) / weights.sum(2, keepdim=True).clamp_min(1)
    out = torch.where(empty.unsqueeze(1), mean, out)
    out = out.permute(2, 0, 1, 3).reshape(tgt_len, bsz, embed_dim)
    return attn.out_proj(out)


class AttendOutTransformerEncoder(TransformerEncoder):
    """fairseq's ``TransformerEncoder`` with :class:`AttendOutEncoderLayer` layers, a set of
    pruned layers (:attr:`pruned_layers`) and per-layer AttendOut masks."""

    def __init__(self, args, dictionary, embed_tokens, pruned_layers=()):
        super().__init__(args, dictionary, embed_tokens)
        self.pruned_layers = tuple(pruned_layers)

    def build_encoder_layer(self, args):
        if getattr(args, "checkpoint_activations", False):
            raise ValueError("AttendOut does not support --checkpoint-activations yet")
        return AttendOutEncoderLayer(args)

    def forward(self, src_tokens, src_lengths=None, return_all_hiddens=False,
                token_embeddings=None, attendout_drop=None):
        """As fairseq's encoder; ``attendout_drop`` is ``(B, layers, T, T)`` bool or None."""
        padding_mask = src_tokens.eq(self.padding_idx)
        x, encoder_embedding = self.forward_embedding(src_tokens, token_embeddings)
        # as fairseq: zero the padding positions' embeddings (no host sync for "any pad")
        x = x * (1 - padding_mask.unsqueeze(-1).type_as(x))
        x = x.transpose(0, 1)  # B x T x C -> T x B x C
        states = [x] if return_all_hiddens else []
        for i, layer in enumerate(self.layers):
            drop = None if attendout_drop is None else attendout_drop[:, i]
            x = layer(x, encoder_padding_mask=padding_mask, attendout_drop=drop,
                      attendout_pruned=i in self.pruned_layers)
            if return_all_hiddens:
                states.append(x)
        if self.layer_norm is not None:
            x = self.layer_norm(x)
        return {
            "encoder_out": [x],
            "encoder_padding_mask": [padding_mask],
            "encoder_embedding": [encoder_embedding],
            "encoder_states": states,
            "fc_results": [],
            "src_tokens": [],
            "src_lengths": [src_tokens.ne(self.padding_idx).sum(1, dtype=torch.int32)[:, None]],
        }

    def embed_without_dropout(self, src_tokens):
        """The layers' input as in evaluation (token + position embeddings, layer norm)."""
        x = self.embed_scale * self.embed_tokens(src_tokens)
        if self.embed_positions is not None:
            x = x + self.embed_positions(src_tokens)
        if self.layernorm_embedding is not None:
            x = self.layernorm_embedding(x)
        return x


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
        (as :func:`sample_drop`, same seed, same draws); in layer mode, then, each layer's
        gate per example, a fired gate dropping all the layer's units; pruned layers
        dropped for every example. Regenerated exactly from the same ``seed``."""
        gen = torch.Generator(device=logits.device)
        gen.manual_seed(seed)
        drop = torch.rand(logits.shape, generator=gen, device=logits.device) < logits.sigmoid()
        if self.decision == "layer":
            gate = self.gate_logits(logits, padding_mask).sigmoid()
            fired = torch.rand(gate.shape, generator=gen, device=gate.device) < gate
            drop = drop | fired[:, :, None, None]
        return drop | self.pruned[:, None, None]

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


def sample_drop(probs, seed):
    """The attacker's masks: unit dropped where ``U < p``, ``U`` from a generator seeded
    with ``seed`` (so that the pruning step can regenerate the same action)."""
    gen = torch.Generator(device=probs.device)
    gen.manual_seed(seed)
    return torch.rand(probs.shape, generator=gen, device=probs.device) < probs


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
