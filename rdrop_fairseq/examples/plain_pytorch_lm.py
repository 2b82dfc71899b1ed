"""R-Drop in a plain PyTorch training loop: no fairseq, only torch and the plugin's core.

A small causal language model with tied input/output embeddings and a large vocabulary,
built in torch alone, is trained with R-Drop (Liang et al., NeurIPS 2021) two ways:

* :func:`rdrop_fairseq.core.rdrop_loss` from the logits ``model(x)``;
* :func:`rdrop_fairseq.fused_linear.fused_linear_rdrop_loss` from the features and the
  tied embedding matrix, a chunk of positions at a time, so that the ``2N x V`` logits and
  their gradient never exist.

Both passes run as one forward of the doubled batch ``[x; x]``: dropout draws independent
masks for the two copies. The loss is the NLL of both passes plus ``alpha`` times their
symmetric KL, summed over the target tokens; like fairseq we divide it by the number of
target tokens of *one* pass, so the paper's alpha values carry over (docs/plain-pytorch.md).

Run ``python -m rdrop_fairseq.examples.plain_pytorch_lm`` (``--help`` for the sizes): it
trains the same initial model with each loss (the curves agree), checks that the two give
the same loss and gradients, and measures one training step's peak memory for each.
"""

import json
import math
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

from rdrop_fairseq.core import rdrop_loss
from rdrop_fairseq.fused_linear import fused_linear_rdrop_loss
from rdrop_fairseq.opcount import LiveBytes
from rdrop_fairseq.recipes.common import parser_from_doc

PAD = 0

# the ways to compute the loss: (label, path)
PATHS = {
    "logits": "rdrop_loss(model(x)), the gradient in a buffer of its own",
    "logits-in-place": "rdrop_loss(model(x), grad_in_scores='auto'): the gradient in the logits",
    "fused-linear": "fused_linear_rdrop_loss(model.features(x), model.embed.weight)",
}


class TinyCausalLM(nn.Module):
    """A decoder-only transformer; the output projection is the input embedding (tied)."""

    def __init__(self, vocab, dim=64, layers=2, heads=4, max_len=128, dropout=0.1):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim, padding_idx=PAD)
        nn.init.normal_(self.embed.weight, std=dim ** -0.5)
        self.positions = nn.Embedding(max_len, dim)
        self.dropout = nn.Dropout(dropout)
        layer = nn.TransformerEncoderLayer(dim, heads, 4 * dim, dropout, batch_first=True,
                                           norm_first=True)
        self.layers = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(dim)

    def features(self, tokens):
        """``(B, T, dim)``: what the output projection turns into logits."""
        length = tokens.size(1)
        x = self.embed(tokens) + self.positions(torch.arange(length, device=tokens.device))
        causal = nn.Transformer.generate_square_subsequent_mask(length, device=tokens.device)
        # right padding: a real position attends to none (the causal mask), and padded
        # positions are left out of the loss (ignore_index)
        return self.norm(self.layers(self.dropout(x), mask=causal, is_causal=True))

    def forward(self, tokens):
        """``(B, T, V)`` logits, through the tied embedding."""
        return F.linear(self.features(tokens), self.embed.weight)


def batches(vocab, batch, length, corpus=4, seed=0):
    """An endless stream of ``(tokens, target)``, cycling over a corpus of ``corpus``
    batches: sequences that follow a fixed random successor table (so that they can be
    learnt), of varying length, padded on the right with :data:`PAD`."""
    gen = torch.Generator().manual_seed(seed)
    successor = torch.randint(1, vocab, (vocab,), generator=gen)
    data = []
    for _ in range(corpus):
        seq = torch.empty(batch, length + 1, dtype=torch.long)
        seq[:, 0] = torch.randint(1, vocab, (batch,), generator=gen)
        for t in range(length):
            seq[:, t + 1] = successor[seq[:, t]]
        ends = torch.randint(length // 2, length + 1, (batch, 1), generator=gen)
        seq[:, 1:].masked_fill_(torch.arange(length).view(1, -1) >= ends, PAD)
        data.append((seq[:, :-1].clone(), seq[:, 1:].clone()))
    while True:
        yield from data


def rdrop_step_loss(model, tokens, target, *, alpha, path="logits", chunk_mb=0.0):
    """R-Drop's loss of one batch, per target token of one pass, and its
    :data:`rdrop_fairseq.core.RDropLoss` (sums)."""
    doubled = torch.cat([tokens, tokens])  # [x; x]: pass 1, then pass 2, along dim 0
    if path == "fused-linear":
        out = fused_linear_rdrop_loss(model.features(doubled), model.embed.weight, target,
                                      alpha=alpha, ignore_index=PAD, chunk_mb=chunk_mb)
    else:
        # grad_in_scores='auto': the gradient overwrites the logits, which nothing reads
        # after the loss here (a hook that kept them would read the gradient)
        into = "auto" if path == "logits-in-place" else False
        out = rdrop_loss(model(doubled), target, alpha=alpha, ignore_index=PAD,
                         chunk_mb=chunk_mb, grad_in_scores=into)
    ntokens = target.ne(PAD).sum()  # a tensor: no host-device sync
    return out.total / ntokens, out


def train(model, data, steps, *, alpha, path, lr=1e-2, seed=0, chunk_mb=0.0):
    """A plain training loop; returns each step's ``(loss per token, KL per token)``, where
    the loss is the task loss of one pass (the mean of the two), as fairseq logs it."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    torch.manual_seed(seed)  # the dropout masks
    model.train()
    log = []
    for _, (tokens, target) in zip(range(steps), data):
        loss, out = rdrop_step_loss(model, tokens, target, alpha=alpha, path=path,
                                    chunk_mb=chunk_mb)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        ntokens = target.ne(PAD).sum()
        log.append(((out.loss / 2 / ntokens).item(), (out.kl / ntokens).item()))
    return log


def compare_paths(model, tokens, target, *, alpha, seed=0, chunk_mb=0.0):
    """Loss and parameter gradients of each path for the same dropout masks: returns the
    largest absolute difference of each path from the ``logits`` path."""
    results = {}
    for path in PATHS:
        model.zero_grad(set_to_none=True)
        torch.manual_seed(seed)
        loss, _ = rdrop_step_loss(model, tokens, target, alpha=alpha, path=path,
                                  chunk_mb=chunk_mb)
        loss.backward()
        results[path] = (loss.detach(), [p.grad.clone() for p in model.parameters()])
    ref_loss, ref_grads = results["logits"]
    return {path: {"loss": (loss - ref_loss).abs().item(),
                   "grad": max((g - r).abs().max().item() for g, r in zip(grads, ref_grads))}
            for path, (loss, grads) in results.items() if path != "logits"}


def step_peak_bytes(model, tokens, target, *, alpha, path, chunk_mb=0.0):
    """Peak memory a training step (forward, loss, backward) allocates beyond the model,
    its gradients (allocated beforehand, as after the first step) and the batch."""
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    torch.manual_seed(0)

    def step():
        loss, _ = rdrop_step_loss(model, tokens, target, alpha=alpha, path=path,
                                  chunk_mb=chunk_mb)
        loss.backward()

    if tokens.is_cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        step()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - base
    with LiveBytes() as memory:
        step()
    return memory.peak


def build_parser():
    parser = parser_from_doc(__doc__)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--batch", type=int, default=8, help="sequences per pass")
    parser.add_argument("--length", type=int, default=64, help="tokens per sequence")
    parser.add_argument("--dropout", type=float, default=0.1)
    parser.add_argument("--alpha", type=float, default=1.0,
                        help="weight of the KL (the paper: 1 for language modelling)")
    parser.add_argument("--corpus", type=int, default=4, help="batches in the training data")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--lr", type=float, default=1e-2)
    parser.add_argument("--chunk-mb", type=float, default=0.0,
                        help="bound on one chunk's float32 temporaries (0 = automatic)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: default)")
    parser.add_argument("--json", action="store_true", help="end with the results as JSON")
    return parser


def print_curves(curves):
    """Each step's loss with each path, and the KL, per target token in base 2."""
    print(f"\n{'step':>4}  {'loss (rdrop_loss)':>18}  {'loss (fused linear)':>19}  {'KL':>8}")
    for i, ((loss, kl), (fused, _)) in enumerate(zip(*curves.values())):
        print(f"{i + 1:>4}  {loss / math.log(2):>18.4f}  {fused / math.log(2):>19.4f}  "
              f"{kl / math.log(2):>8.4f}")
    print("(per target token, base 2, as fairseq logs them: loss, the NLL of one pass (the "
          "mean of the two); KL, rdrop_kl)")


def print_differences(differences):
    """:func:`compare_paths`'s differences from the ``logits`` path."""
    print("\nsame dropout masks, largest difference from rdrop_loss on the logits:")
    for path, diff in differences.items():
        print(f"  {path:<16} loss {diff['loss']:.2e}, parameter gradients {diff['grad']:.2e}")


def print_peaks(peak_mib, device):
    """One training step's peak memory with each path, in MiB."""
    where = "CUDA max_memory_allocated" if device.type == "cuda" else \
        "storages allocated by torch ops, CPU"
    print(f"\npeak memory of one training step beyond the model and its gradients ({where}):")
    for path, mib in peak_mib.items():
        print(f"  {mib:8.1f} MiB  {PATHS[path]}")


def main(argv=None):
    a = build_parser().parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    device = torch.device(a.device)

    def fresh_model():
        torch.manual_seed(0)
        return TinyCausalLM(a.vocab, a.dim, a.layers, a.heads, a.length, a.dropout).to(device)

    def data():
        return ((x.to(device), y.to(device)) for x, y in batches(a.vocab, a.batch, a.length,
                                                                 a.corpus))

    tokens, target = next(data())
    n_rows = 2 * tokens.numel()
    logits_mib = n_rows * a.vocab * 4 / 2**20
    print(f"causal LM: V = {a.vocab}, d = {a.dim}, {a.layers} layers, tied embeddings; "
          f"{a.batch} x {a.length} tokens per pass, so the logits of [x; x] are "
          f"{n_rows} x {a.vocab} float32 = {logits_mib:.1f} MiB")

    results = {"logits_mib": logits_mib, "curves": {}}
    for path in ("logits", "fused-linear"):  # the same initial model, the same batches
        results["curves"][path] = train(fresh_model(), data(), a.steps, alpha=a.alpha,
                                        path=path, lr=a.lr, chunk_mb=a.chunk_mb)
    print_curves(results["curves"])

    model = fresh_model()
    results["differences"] = compare_paths(model, tokens, target, alpha=a.alpha,
                                           chunk_mb=a.chunk_mb)
    print_differences(results["differences"])

    results["peak_mib"] = {
        path: step_peak_bytes(model, tokens, target, alpha=a.alpha, path=path,
                              chunk_mb=a.chunk_mb) / 2**20 for path in PATHS}
    print_peaks(results["peak_mib"], device)
    if a.json:
        print(json.dumps(results))
    return results


if __name__ == "__main__":
    main(sys.argv[1:])
