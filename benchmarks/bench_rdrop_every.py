"""What R-Drop every k updates (``--rdrop-every K``) costs per update, against the baseline
and R-Drop on every update, side by side in one run.

Each arm is the same fairseq transformer (the same weights, the same batch) trained by its
criterion with Adam, ``model.set_num_updates(u)`` before each step as fairseq's task does:

* ``baseline``: ``label_smoothed_cross_entropy_rdrop`` with alpha 0, which is exactly
  fairseq's ``label_smoothed_cross_entropy`` (one pass);
* ``every K``: alpha 5 and ``--rdrop-every K``: the updates 0, K, 2K, ... run R-Drop on
  ``[x; x]``, the others one pass.

A round times every arm over the same span of updates (a multiple of every K, so that each
arm's mean covers whole periods), the arms in a rotating order; the table gives each arm's
median time per update and the median over the rounds of its ratio to the same round's
baseline, with its range. Beside it, the arithmetic: ``(k + 1) / k`` passes per update on
average, and the ratio the k = 1 arm predicts for k, ``((k - 1) + r1) / k`` (one update in
k costs ``r1`` baseline updates, the others one). Usage::

    python benchmarks/bench_rdrop_every.py                     # the demo's model, CPU
    python benchmarks/bench_rdrop_every.py --ks 1 2 5 10 --rounds 7 --markdown every.md
    python benchmarks/bench_rdrop_every.py --device cuda --dtype float16 --vocab 32000
"""

import math
import statistics
import sys
import time

from bench_rdrop import build_step  # this folder: run as python benchmarks/THIS.py

from rdrop_fairseq.recipes.common import parser_from_doc

# the demo's model (rdrop_fairseq/recipes/libreoffice_demo.py): 2 + 2 layers of 192
DEMO_ARCH = ["--encoder-layers", "2", "--decoder-layers", "2", "--encoder-embed-dim", "192",
             "--decoder-embed-dim", "192", "--encoder-ffn-embed-dim", "768",
             "--decoder-ffn-embed-dim", "768", "--encoder-attention-heads", "4",
             "--decoder-attention-heads", "4", "--share-all-embeddings", "--dropout", "0.3"]


def make_arm(every, a):
    """(model, criterion, sample, optimizer) of one arm; ``every`` 0: the baseline."""
    import torch

    extra = ["--rdrop-alpha", "0"] if every == 0 else ["--rdrop-every", str(every)]
    model, criterion, sample = build_step("ours-torch", a.vocab, a.tokens, device=a.device,
                                          dtype=a.dtype, arch_args=DEMO_ARCH,
                                          extra_args=extra, seq_len=a.seq_len)
    return model, criterion, sample, torch.optim.Adam(model.parameters(), lr=1e-4)


def train(arm, first_update, updates, device):
    """``updates`` training updates from ``first_update``; their wall-clock seconds."""
    import torch

    model, criterion, sample, optimizer = arm
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    sync()
    start = time.perf_counter()
    for update in range(first_update, first_update + updates):
        model.set_num_updates(update)
        loss, _, _ = criterion(model, sample)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)
    sync()
    return time.perf_counter() - start


def measure(a):
    """``{arm: [seconds per update, one per round]}``, the baseline's key 0."""
    span = math.lcm(*a.ks) * a.periods
    arms = {k: make_arm(k, a) for k in [0, *a.ks]}
    for k, arm in arms.items():  # warm-up: one span each
        train(arm, 0, span, a.device)
    per_update = {k: [] for k in arms}
    order = list(arms)
    for r in range(a.rounds):
        for k in order[r % len(order):] + order[:r % len(order)]:
            per_update[k].append(train(arms[k], span * (r + 1), span, a.device) / span)
        print(f"round {r + 1}: " + ", ".join(f"{name(k)} {per_update[k][-1] * 1e3:.1f} ms"
                                            for k in arms), flush=True)
    return per_update


def name(k):
    return "baseline" if k == 0 else f"every {k}"


def table(per_update, a):
    base = per_update[0]
    ratios = {k: [t / b for t, b in zip(times, base)] for k, times in per_update.items()}
    r1 = statistics.median(ratios[1]) if 1 in ratios else None
    lines = [f"{a.device} {a.dtype}, {a.threads} thread(s), transformer_iwslt_de_en 2+2 x 192, "
             f"V {a.vocab}, {a.tokens} target tokens per pass, {a.rounds} rounds of "
             f"{math.lcm(*a.ks) * a.periods} updates per arm",
             "",
             "| arm | ms per update (median) | x baseline (median, range) | passes per update "
             "| x baseline predicted from every 1 |",
             "|---|---|---|---|---|"]
    for k, times in per_update.items():
        ratio = ratios[k]
        predicted = "–" if k == 0 or r1 is None else f"{((k - 1) + r1) / k:.2f}"
        lines.append(f"| {name(k)} | {statistics.median(times) * 1e3:.1f} | "
                     f"{statistics.median(ratio):.2f} ({min(ratio):.2f}-{max(ratio):.2f}) | "
                     f"{1 if k == 0 else (k + 1) / k:.2f} | {predicted} |")
    return "\n".join(lines) + "\n"


def main(argv=None):
    p = parser_from_doc(__doc__)
    p.add_argument("--ks", type=int, nargs="+", default=[1, 2, 5],
                   help="R-Drop every K updates, one arm each (default 1 2 5)")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--periods", type=int, default=1,
                   help="a round's span in periods of every K at once (lcm of the ks)")
    p.add_argument("--vocab", type=int, default=6000)
    p.add_argument("--tokens", type=int, default=1024, help="target tokens per pass")
    p.add_argument("--seq-len", type=int, default=16)
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--threads", type=int, default=1, help="CPU threads (default 1)")
    p.add_argument("--markdown", help="also write the table to this file")
    a = p.parse_args(argv)
    if any(k < 1 for k in a.ks) or a.rounds < 1 or a.periods < 1:
        p.error("--ks, --rounds and --periods are whole numbers >= 1")
    import torch

    torch.set_num_threads(a.threads)
    text = table(measure(a), a)
    print("\n" + text)
    if a.markdown:
        with open(a.markdown, "w") as f:
            f.write(text)


if __name__ == "__main__":
    sys.exit(main())
