"""R-Drop's training step through RDropTrainer vs a plain ``transformers.Trainer`` step on
the doubled batch, side by side.

The floor is what any R-Drop step has to compute: the plain Trainer's ``training_step``
(forward, the model's own loss, backward) given ``[x; x]`` and ``[y; y]``. ``rdrop`` is
``RDropTrainer.training_step`` given ``x`` (alpha 1): it doubles the batch itself and
computes the loss with the fused core (the torch implementation on CPU). Two heads on a
BERT of all-MiniLM-L6-v2's shape (6 layers, 384 wide, 12 heads, random weights, dropout
0.1):

* ``classification``: a 2-class sequence classification head;
* ``masked-lm``: BERT's masked-LM head over the 30,522-token vocabulary, 15 % of the
  positions labelled.

Each measurement is a fresh process (``--rounds`` of them per method, the methods
alternating, so that a slow spell of a shared machine hits both): one warm-up step, then
``--steps`` timed steps (wall clock), their median. A method's figure is the median of its
processes' medians; the ratio is rdrop / floor.

    python benchmarks/bench_hf.py                      # both heads, batch 4 x 128 tokens
    python benchmarks/bench_hf.py --heads masked-lm --rounds 5 --steps 5 --json out.json
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
METHODS = ("floor", "rdrop")
HEADS = ("classification", "masked-lm")
MINILM_SHAPE = dict(vocab_size=30522, hidden_size=384, num_hidden_layers=6,
                    num_attention_heads=12, intermediate_size=1536)


def build(head, batch, length, shape=None, seed=0):
    """The model (training mode) and one pass's batch: token ids, and labels (classes, or
    15 % of the tokens for the masked LM, -100 elsewhere)."""
    import torch
    from transformers import BertConfig, BertForMaskedLM, BertForSequenceClassification

    torch.manual_seed(seed)
    config = BertConfig(**(shape or MINILM_SHAPE), max_position_embeddings=max(length, 512),
                        num_labels=2)
    model = (BertForMaskedLM if head == "masked-lm" else BertForSequenceClassification)(config)
    model.train()
    g = torch.Generator().manual_seed(seed + 1)
    ids = torch.randint(min(1000, config.vocab_size // 2), config.vocab_size, (batch, length),
                        generator=g)
    if head == "masked-lm":
        labels = torch.full_like(ids, -100)
        masked = torch.rand(ids.shape, generator=g) < 0.15
        labels[masked] = ids[masked]
    else:
        labels = torch.randint(0, 2, (batch,), generator=g)
    return model, {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels}


def make_step(method, model, inputs, work):
    """A function running one training step of ``method`` (gradients reset first)."""
    import torch
    from transformers import Trainer, TrainingArguments

    from rdrop_fairseq.hf import RDropTrainer, labelled_items

    args = TrainingArguments(output_dir=str(work), use_cpu=True, report_to="none",
                             disable_tqdm=True)
    if method == "floor":
        trainer = Trainer(model=model, args=args)
        batch = {key: torch.cat([value, value]) for key, value in inputs.items()}
    else:
        trainer = RDropTrainer(model=model, args=args, rdrop_alpha=1.0)
        batch = inputs
    trainer.current_gradient_accumulation_steps = 1  # set by train()'s loop, read by the step
    # as train() passes it: the floor's model takes it (BERT's heads ignore it)
    items = labelled_items(batch["labels"])

    def step():
        model.zero_grad(set_to_none=True)
        trainer.training_step(model, dict(batch), items)

    return step


def measure(method, head, batch, length, steps, shape=None):
    """One process's measurement: the median of ``steps`` timed steps after a warm-up."""
    model, inputs = build(head, batch, length, shape)
    with tempfile.TemporaryDirectory() as work:
        step = make_step(method, model, inputs, work)
        step()  # warm-up (and RDropTrainer's one-time label check)
        times = []
        for _ in range(steps):
            start = time.perf_counter()
            step()
            times.append(time.perf_counter() - start)
    return {"method": method, "head": head, "seconds": statistics.median(times),
            "times": times}


def run_child(method, head, args):
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads),
               MKL_NUM_THREADS=str(args.threads), HF_HUB_OFFLINE="1")
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    out = subprocess.run([sys.executable, __file__, "_child", method, head, "--batch",
                          str(args.batch), "--length", str(args.length), "--steps",
                          str(args.steps), "--threads", str(args.threads)],
                         capture_output=True, text=True, env=env, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def summarise(results):
    """Per head: each method's median over its processes, and rdrop / floor."""
    rows = []
    for head in dict.fromkeys(r["head"] for r in results):
        per_method = {m: [r["seconds"] for r in results if r["head"] == head
                          and r["method"] == m] for m in METHODS}
        medians = {m: statistics.median(v) for m, v in per_method.items() if v}
        for method, seconds in medians.items():
            rows.append({"head": head, "method": method, "seconds": seconds,
                         "processes": per_method[method],
                         "ratio": seconds / medians["floor"] if "floor" in medians else None})
    return rows


def markdown(rows, args):
    out = [f"BERT of all-MiniLM-L6-v2's shape (6 x 384), batch {args.batch} x {args.length} "
           f"tokens per pass, {args.threads} thread(s), {args.rounds} processes per method "
           f"(alternating), {args.steps} timed steps each:", "",
           "| head | method | s / step (median) | x floor | per process |", "|---|---|---|---|---|"]
    names = {"floor": "floor: Trainer on [x; x]", "rdrop": "**RDropTrainer** (alpha 1)"}
    for r in rows:
        out.append(f"| {r['head']} | {names[r['method']]} | {r['seconds']:.3f} | "
                   f"{r['ratio']:.3f} | {', '.join(f'{s:.3f}' for s in r['processes'])} |")
    return "\n".join(out)


def parse(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("what", nargs="?", default="run", choices=["run", "_child"])
    p.add_argument("method", nargs="?", choices=METHODS)
    p.add_argument("head", nargs="?", choices=HEADS)
    p.add_argument("--heads", nargs="+", choices=HEADS, default=list(HEADS))
    p.add_argument("--batch", type=int, default=4, help="examples per pass (default 4)")
    p.add_argument("--length", type=int, default=128, help="tokens per example (default 128)")
    p.add_argument("--steps", type=int, default=3, help="timed steps per process")
    p.add_argument("--rounds", type=int, default=3, help="processes per method")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--json", type=Path, help="also write the results here")
    return p.parse_args(argv)


def main(argv=None):
    args = parse(argv)
    if args.what == "_child":
        import torch

        torch.set_num_threads(args.threads)
        print(json.dumps(measure(args.method, args.head, args.batch, args.length, args.steps)))
        return 0
    results = []
    for head in args.heads:
        for _ in range(args.rounds):
            for method in METHODS:
                results.append(run_child(method, head, args))
                print(f"[bench_hf] {head} {method}: {results[-1]['seconds']:.3f} s",
                      file=sys.stderr, flush=True)
    rows = summarise(results)
    print(markdown(rows, args))
    if args.json:
        args.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()},
                                         "rows": rows, "processes": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
