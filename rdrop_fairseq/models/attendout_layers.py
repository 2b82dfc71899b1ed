"""AttendOut's layers: the maskable encoder layer and the encoder (the generator that draws
their masks is :mod:`.attendout_generator`, its policy-gradient step
:mod:`.attendout_reinforce`).

AttendOut (Wu, Zhao, Zhang, "Not All Attention Is All You Need", arXiv 2104.04692) drops
self-attention units ``(i, j)`` (layer ``i``, element ``j`` of the ``l x l`` attention
map) of the attacker copy while it is fine-tuned; a layer whose units are all dropped
becomes, by the paper's Eq. 3, a *mean of V*: every query position gets
``out_proj(v_proj(mean of the non-padding inputs))``, without Q, K or their dot product.
docs/attendout.md says which choices below are the paper's and which are ours.
"""

import torch
import torch.nn.functional as F
from fairseq.models.transformer import TransformerEncoder
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
