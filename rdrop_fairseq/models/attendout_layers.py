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

    Dropped and padding keys get probability 0. A query whose non-padding keys are all
    dropped gets Eq. 3's uniform attention over them instead. Softmax in float32.
    """
    if attn.bias_k is not None or attn.add_zero_attn:
        raise ValueError("AttendOut does not support attention with bias_k/add_zero_attn")
    tgt_len, bsz, embed_dim = x.shape
    heads, head_dim = attn.num_heads, attn.head_dim

    def split_heads(t):  # (T, B, C) -> (B, H, T, head_dim)
        return t.view(tgt_len, bsz, heads, head_dim).permute(1, 2, 0, 3)

    q = split_heads(attn.q_proj(x) * attn.scaling)
    k = split_heads(attn.k_proj(x))
    v = split_heads(attn.v_proj(x))
    scores = torch.matmul(q, k.transpose(-1, -2)).float()  # (B, H, T, T)
    removed = drop
    if padding_mask is not None:
        key_pad = padding_mask[:, None, :]  # (B, 1, T)
        removed = removed | key_pad
        all_removed = removed.all(-1, keepdim=True)  # (B, T, 1)
        # Eq. 3 for those rows: equal scores, padding still excluded
        removed = torch.where(all_removed, key_pad, removed)
    else:
        all_removed = removed.all(-1, keepdim=True)
        removed = removed & ~all_removed
    scores = scores.masked_fill(all_removed.unsqueeze(1), 0.0)
    scores = scores.masked_fill(removed.unsqueeze(1), float("-inf"))
    probs = attn.dropout_module(F.softmax(scores, dim=-1).type_as(q))
    out = torch.matmul(probs, v)  # (B, H, T, head_dim)
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


class AttendOutGenerator(nn.Module):
    """The paper's G-Net (sec. 4.1): one single-head self-attention layer without
    feed-forward, applied recurrently, once per encoder layer, with shared parameters;
    its pre-softmax scores ``S_i`` give layer ``i``'s drop logits ``S_i + beta``.

    ``decision``: how a layer comes to be pruned (ours; docs/attendout.md).

    * ``"layer"``: each layer also has a *gate*, logit ``mean(S_i) + gamma`` (the masked
      mean of its scores, ``gamma`` a learnt scalar shared by the layers like ``beta``),
      sampled per example; where it fires the whole layer is dropped (Eq. 3) for that
      example. A layer is pruned when the moving average of its gate probability reaches
      ``prune_threshold``.
    * ``"unit"``: per-unit masks only (the paper's literal reading); a layer is pruned when
      its greedy mask (p > 0.5) drops every unit for ``prune_threshold`` of the examples
      (moving average).

    Either way the decision is sticky (buffer ``pruned``): a pruned layer is dropped for
    every example from then on, in training too, so the attacker trains as it is exported,
    and its terms leave ``log P(action)``.

    ``h_0`` is the encoder's embedding output (no gradient flows into the encoder);
    ``h_i = LayerNorm(h_{i-1} + W_O softmax(S_i) W_V h_{i-1})``. ``beta`` starts at
    ``logit(init_drop)``, so the first drop probabilities average about ``init_drop``; they
    vary from unit to unit with the scores (about 0.03 to 0.3 for 0.1).

    The generator is trained by policy gradient with its own optimizer, not by fairseq's:
    its parameters have ``requires_grad=False`` outside the pruning step. It stays in
    float32 whatever the model's dtype (``--fp16`` casts the model with ``half()``).
    Buffers: per-layer moving averages (decay ``stats_decay`` per training batch) of the
    mean drop probability, of the fraction of examples whose greedy mask drops every unit
    (the unit mode's decision) and of the gate probability (the layer mode's); ``pruned``.
    """

    def __init__(self, embed_dim, num_layers, init_drop=0.1, stats_decay=0.99,
                 decision="unit", prune_threshold=0.5):
        super().__init__()
        if not 0.0 < init_drop < 1.0:
            raise ValueError(f"--attendout-init-drop must be in (0, 1), got {init_drop}")
        self.num_layers = num_layers
        self.configure(decision, prune_threshold)
        self.stats_decay = stats_decay
        self.q_proj = nn.Linear(embed_dim, embed_dim)
        self.k_proj = nn.Linear(embed_dim, embed_dim)
        self.v_proj = nn.Linear(embed_dim, embed_dim)
        self.out_proj = nn.Linear(embed_dim, embed_dim)
        self.layer_norm = LayerNorm(embed_dim)
        self.drop_bias = nn.Parameter(torch.tensor(math.log(init_drop / (1 - init_drop))))
        # the gate's own scalar; it starts so that a layer's gate fires with about init_drop
        self.gate_bias = nn.Parameter(torch.tensor(math.log(init_drop / (1 - init_drop))))
        self.scaling = embed_dim ** -0.5
        self.register_buffer("drop_rate", torch.full((num_layers,), init_drop))
        self.register_buffer("greedy_all_dropped", torch.zeros(num_layers))
        self.register_buffer("gate_prob", torch.full((num_layers,), init_drop))
        self.register_buffer("pruned", torch.zeros(num_layers, dtype=torch.bool))
        self.requires_grad_(False)
        # policy-gradient state, kept in the checkpoint through get/set_extra_state
        self.optimizer = None
        self._pending_optimizer_state = None
        self.baseline = None  # moving average of past mean rewards (a 0-dim tensor)
        self.pruning_steps = 0
        self.masks_drawn = 0

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
        valid units plus ``gate_bias`` (``logits`` are ``S_i + drop_bias``, from forward)."""
        valid = unit_mask(padding_mask).unsqueeze(1)
        return self._gate_logits(logits, valid, valid.sum((-1, -2)).clamp_min(1))

    def _gate_logits(self, logits, valid, count):
        # valid: (B, 1, T, T) unit_mask; count: (B, 1) its valid units (at least 1)
        scores = (logits - self.drop_bias).masked_fill(~valid, 0.0)
        return scores.sum((-1, -2)) / count + self.gate_bias

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

    def _apply(self, fn, recurse=True):
        super()._apply(fn, recurse)
        for t in list(self.parameters()) + list(self.buffers()):
            if t.is_floating_point() and t.dtype != torch.float32:
                t.data = t.data.float()
        return self

    def build_optimizer(self, lr):
        """The generator's own Adam (created on first use, restored from the checkpoint)."""
        if self.optimizer is None:
            self.optimizer = torch.optim.Adam(self.parameters(), lr=lr)
            if self._pending_optimizer_state is not None:
                self.optimizer.load_state_dict(self._pending_optimizer_state)
                self._pending_optimizer_state = None
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        return self.optimizer

    def get_extra_state(self):
        optimizer_state = (self.optimizer.state_dict() if self.optimizer is not None
                           else self._pending_optimizer_state)
        return {
            "optimizer": optimizer_state,
            "baseline": None if self.baseline is None else self.baseline.detach().cpu(),
            "pruning_steps": self.pruning_steps,
            "masks_drawn": self.masks_drawn,
        }

    def set_extra_state(self, state):
        self._pending_optimizer_state = state.get("optimizer")
        self.optimizer = None
        baseline = state.get("baseline")
        self.baseline = None if baseline is None else baseline.to(self.drop_bias.device)
        self.pruning_steps = int(state.get("pruning_steps", 0))
        self.masks_drawn = int(state.get("masks_drawn", 0))

    @torch.no_grad()
    def update_statistics(self, logits, padding_mask):
        """Fold one batch's drop logits ``(B, L, T, T)`` into the moving averages and
        prune the layers whose decision statistic reached the threshold (sticky; on the
        device, no host sync). Returns the batch's mean probability that a unit of each
        layer is dropped (the gate's included; 1 for a pruned layer)."""
        probs = logits.sigmoid()
        valid = unit_mask(padding_mask).unsqueeze(1)  # (B, 1, T, T)
        count = valid.sum((-1, -2)).clamp_min(1)  # (B, 1)
        rate = (probs * valid).sum((-1, -2)) / count  # (B, L)
        greedy_all = ((probs > 0.5) | ~valid).all(-1).all(-1).float()  # (B, L)
        gate = self._gate_logits(logits, valid, count).sigmoid()  # (B, L)
        d = self.stats_decay
        self.drop_rate.mul_(d).add_(rate.mean(0), alpha=1 - d)
        self.greedy_all_dropped.mul_(d).add_(greedy_all.mean(0), alpha=1 - d)
        self.gate_prob.mul_(d).add_(gate.mean(0), alpha=1 - d)
        statistic = self.gate_prob if self.decision == "layer" else self.greedy_all_dropped
        self.pruned |= statistic >= self.prune_threshold
        if self.decision == "layer":
            rate = gate + (1 - gate) * rate
        return rate.mean(0).masked_fill(self.pruned, 1.0)

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


def reinforce_step(generator, rewards, log_prob, baseline_decay, leave_one_out=False):
    """One policy-gradient update of the generator (Eq. 4) with its own optimizer.

    ``rewards[t]``: ``(m,)`` per example of cached batch ``t``, without a graph;
    ``log_prob(t)``: the log probabilities ``(m,)`` of batch ``t``'s actions, with a graph
    into the generator. The loss is ``-sum_t (1/m) sum_k (r_tk - b_tk) log P(a_tk)``, with
    ``b`` the moving average of past mean rewards (0 before the first step; updated after
    use, whatever the baseline) or, with ``leave_one_out``, the mean reward of the other
    examples of the batch (the moving average for a batch of one). ``b`` is fixed before
    the backward passes, so one backward per batch gives the gradient of the sum while only
    one batch's graph is alive. Returns the mean reward.
    """
    mean_reward = torch.cat([r.reshape(-1) for r in rewards]).mean().detach()
    baseline = generator.baseline if generator.baseline is not None else torch.zeros_like(
        mean_reward)
    generator.optimizer.zero_grad()
    for t, r in enumerate(rewards):
        b = baseline
        if leave_one_out and r.numel() > 1:
            b = (r.sum() - r) / (r.numel() - 1)
        (-((r - b) * log_prob(t)).mean()).backward()
    generator.optimizer.step()
    generator.baseline = (mean_reward if generator.baseline is None else
                          baseline_decay * generator.baseline + (1 - baseline_decay) * mean_reward)
    return mean_reward
