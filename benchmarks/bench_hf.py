"""R-Drop's training step through RDropTrainer vs a plain ``transformers.Trainer`` step on
the doubled batch, side by side: time and peak memory.

The floor is what any R-Drop step has to compute: the plain Trainer's ``training_step``
(forward, the model's own loss, backward) given ``[x; x]`` and ``[y; y]``. ``rdrop`` is
``RDropTrainer.training_step`` given ``x`` (alpha 1): it doubles the batch itself and
computes the loss with the fused core (the torch implementation on CPU) from the logits;
``rdrop-fused`` (language-model heads) from the hidden states and the output embedding
(``rdrop_fused_linear``), so that the logits are never made. Random weights, dropout 0.1:

* ``classification``: a BERT of all-MiniLM-L6-v2's shape (6 layers, 384 wide, 12 heads)
  with a 2-class sequence classification head;
* ``masked-lm``: the same BERT with its masked-LM head over 30,522 tokens, 15 % of the
  positions labelled;
* ``causal-lm``: a Qwen-style causal LM (Llama architecture, V = 151,936, 256 wide, 2
  layers), every position labelled;
* ``seq2seq``: a Marian-shaped translation model (V = 58,101, 256 wide, 2 + 2 layers),
  target tokens labelled.

The peak is the most bytes of tensor storage alive at once during one more step, counted
through torch's dispatcher (``rdrop_fairseq.opcount.LiveBytes``: what the step allocates,
the model's weights and the batch not included), the same way for every method.

Each measurement is a fresh process (``--rounds`` of them per method, the methods
alternating, so that a slow spell of a shared machine hits both): one warm-up step, then
``--steps`` timed steps (wall clock), their median. A method's figure is the median of its
processes' medians; the ratio is rdrop / floor.

    python benchmarks/bench_hf.py --heads classification masked-lm   # batch 4 x 128 tokens
    python benchmarks/bench_hf.py --heads causal-lm seq2seq --batch 2 --length 512
    python benchmarks/bench_hf.py --heads masked-lm --rounds 5 --steps 5 --json out.json
    python benchmarks/bench_hf.py --heads causal-lm --bf16   # TrainingArguments(bf16=True)
    python benchmarks/bench_hf.py --heads causal-lm --bf16 --device cuda \
        --shape llama3-8b-head --batch 1 --length 8192 --rounds 1 --steps 2   # on a GPU

With ``--bf16`` every method runs under bf16 autocast (float32 weights), as
``TrainingArguments(bf16=True)`` trains: the fused path's products then run in bf16, as the
head's own would.
"""

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from rdrop_fairseq.recipes.common import parser_from_doc

REPO = Path(__file__).resolve().parents[1]
METHODS = ("floor", "rdrop", "rdrop-fused")
HEADS = ("classification", "masked-lm", "causal-lm", "seq2seq")
LM_HEADS = ("masked-lm", "causal-lm", "seq2seq")  # where rdrop-fused applies
MINILM_SHAPE = dict(vocab_size=30522, hidden_size=384, num_hidden_layers=6,
                    num_attention_heads=12, intermediate_size=1536)
QWEN_SHAPE = dict(vocab_size=151936, hidden_size=256, intermediate_size=704,
                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
# a Llama-3-8B head's shape (hidden 4,096, V = 128,256, untied) on one layer: what the loss
# and the head cost, not the whole model (scripts/gpu_check.sh's hf stage, on a GPU)
LLAMA3_HEAD_SHAPE = dict(vocab_size=128256, hidden_size=4096, intermediate_size=4096,
                         num_hidden_layers=1, num_attention_heads=32, num_key_value_heads=8,
                         tie_word_embeddings=False)
TINY_CAUSAL_SHAPE = dict(vocab_size=256, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1)
SHAPES = {"llama3-8b-head": LLAMA3_HEAD_SHAPE, "tiny": TINY_CAUSAL_SHAPE}
MARIAN_SHAPE = dict(vocab_size=58101, d_model=256, encoder_layers=2, decoder_layers=2,
                    encoder_attention_heads=4, decoder_attention_heads=4,
                    encoder_ffn_dim=1024, decoder_ffn_dim=1024)


def methods_for(head):
    return [m for m in METHODS if m != "rdrop-fused" or head in LM_HEADS]


def build(head, batch, length, shape=None, seed=0, device="cpu"):
    """The model (training mode) and one pass's batch: token ids, and labels (classes; 15 %
    of the tokens for the masked LM, -100 elsewhere; every token for the causal LM; target
    tokens for seq2seq)."""
    import torch

    torch.manual_seed(seed)
    with torch.device(device):  # made where it runs (a 1 B-parameter head: seconds on a CPU)
        model, config = _model(head, length, shape)
    model.train()
    g = torch.Generator().manual_seed(seed + 1)
    ids = torch.randint(min(1000, config.vocab_size // 2), config.vocab_size, (batch, length),
                        generator=g)
    if head == "masked-lm":
        labels = torch.full_like(ids, -100)
        masked = torch.rand(ids.shape, generator=g) < 0.15
        labels[masked] = ids[masked]
    elif head == "causal-lm":
        labels = ids.clone()
    elif head == "seq2seq":
        labels = torch.randint(2, config.vocab_size, (batch, length), generator=g)
    else:
        labels = torch.randint(0, 2, (batch,), generator=g)
    inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels}
    if head == "seq2seq":  # the collator's decoder inputs, as DataCollatorForSeq2Seq makes them
        inputs["decoder_input_ids"] = model.prepare_decoder_input_ids_from_labels(labels=labels)
    return model, inputs


def _model(head, length, shape):
    from transformers import (BertConfig, BertForMaskedLM, BertForSequenceClassification,
                              LlamaConfig, LlamaForCausalLM, MarianConfig, MarianMTModel)

    if head == "causal-lm":
        config = LlamaConfig(**{"tie_word_embeddings": True, **(shape or QWEN_SHAPE)},
                             max_position_embeddings=max(length, 512), attention_dropout=0.1)
        model = LlamaForCausalLM(config)
    elif head == "seq2seq":
        config = MarianConfig(**(shape or MARIAN_SHAPE), max_position_embeddings=max(length, 512),
                              dropout=0.1, attention_dropout=0.1, pad_token_id=0,
                              eos_token_id=1, decoder_start_token_id=0)
        model = MarianMTModel(config)
    else:
        config = BertConfig(**(shape or MINILM_SHAPE), max_position_embeddings=max(length, 512),
                            num_labels=2)
        model = (BertForMaskedLM if head == "masked-lm" else BertForSequenceClassification)(config)
    return model, config


def make_step(method, model, inputs, work, bf16=False):
    """A function running one training step of ``method`` (gradients reset first), on the
    model's device."""
    import torch
    from transformers import Trainer, TrainingArguments

    from rdrop_fairseq.hf import RDropTrainer, labelled_items

    device = next(model.parameters()).device.type
    args = TrainingArguments(output_dir=str(work), use_cpu=device == "cpu", report_to="none",
                             disable_tqdm=True, bf16=bf16)
    if method == "floor":
        trainer = Trainer(model=model, args=args)
        batch = {key: torch.cat([value, value]) for key, value in inputs.items()}
    else:
        trainer = RDropTrainer(model=model, args=args, rdrop_alpha=1.0,
                               rdrop_fused_linear=method == "rdrop-fused")
        batch = inputs
    trainer.current_gradient_accumulation_steps = 1  # set by train()'s loop, read by the step
    # as train() passes it: the floor's model takes it
    items = labelled_items(batch["labels"], causal=model.config.model_type == "llama")

    def step():
        model.zero_grad(set_to_none=True)
        # the autocast train() gets from accelerate's prepared model (not made here)
        with torch.autocast(device, dtype=torch.bfloat16, enabled=bf16):
            trainer.training_step(model, dict(batch), items)

    return step


def measure(method, head, batch, length, steps, shape=None, bf16=False, device="cpu"):
    """One process's measurement: the median of ``steps`` timed steps after a warm-up, and
    the peak of one more step: on the CPU the live tensor bytes, on CUDA the allocator's
    peak above what was allocated before the step (weights, optimizer-free)."""
    import torch

    from rdrop_fairseq.opcount import LiveBytes

    model, inputs = build(head, batch, length, shape, device=device)
    inputs = {key: value.to(device) for key, value in inputs.items()}
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    with tempfile.TemporaryDirectory() as work:
        step = make_step(method, model, inputs, work, bf16)
        step()  # warm-up (and RDropTrainer's one-time label check)
        times = []
        for _ in range(steps):
            sync()
            start = time.perf_counter()
            step()
            sync()
            times.append(time.perf_counter() - start)
        if device == "cuda":
            model.zero_grad(set_to_none=True)
            before = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            step()
            peak = torch.cuda.max_memory_allocated() - before
        else:
            with LiveBytes() as memory:
                step()
            peak = memory.peak
    return {"method": method, "head": head, "bf16": bf16, "device": device,
            "seconds": statistics.median(times), "times": times, "peak_mib": peak / 2**20}


def in_this_process(method, head, args):
    """--one-process: the measurement here (a GPU's time box), the allocator emptied first."""
    import torch

    if args.device == "cuda":
        torch.cuda.empty_cache()
    return measure(method, head, args.batch, args.length, args.steps,
                   shape=SHAPES.get(args.shape), bf16=args.bf16, device=args.device)


def run_child(method, head, args):
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads),
               MKL_NUM_THREADS=str(args.threads), HF_HUB_OFFLINE="1")
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    out = subprocess.run([sys.executable, __file__, "_child", method, head, "--batch",
                          str(args.batch), "--length", str(args.length), "--steps",
                          str(args.steps), "--threads", str(args.threads),
                          "--device", args.device,
                          *(["--shape", args.shape] if args.shape else []),
                          *(["--bf16"] if args.bf16 else [])],
                         capture_output=True, text=True, env=env, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def summarise(results):
    """Per head: each method's median over its processes, and its ratios to the floor
    (time, and peak memory)."""
    rows = []
    for head in dict.fromkeys(r["head"] for r in results):
        per_method = {m: [r for r in results if r["head"] == head and r["method"] == m]
                      for m in METHODS}
        medians = {m: (statistics.median(r["seconds"] for r in v),
                       statistics.median(r.get("peak_mib", 0.0) for r in v))
                   for m, v in per_method.items() if v}
        floor = medians.get("floor")
        for method, (seconds, peak) in medians.items():
            rows.append({"head": head, "method": method, "seconds": seconds, "peak_mib": peak,
                         "processes": [r["seconds"] for r in per_method[method]],
                         "ratio": seconds / floor[0] if floor else None,
                         "memory_ratio": peak / floor[1] if floor and floor[1] else None})
    return rows


def markdown(rows, args):
    out = [f"batch {args.batch} x {args.length} tokens per pass, "
           f"{getattr(args, 'device', 'cpu')}{', ' + args.shape if getattr(args, 'shape', None) else ''}, "
           f"{'bf16 autocast, ' if getattr(args, 'bf16', False) else ''}{args.threads} thread(s), "
           f"{args.rounds} processes per method (alternating), {args.steps} timed steps each:",
           "", "| head | method | s / step (median) | x floor | peak MiB | x floor | per process |",
           "|---|---|---|---|---|---|---|"]
    names = {"floor": "floor: Trainer on [x; x]", "rdrop": "**RDropTrainer** (alpha 1)",
             "rdrop-fused": "**RDropTrainer**, fused linear"}
    for r in rows:
        memory = f"{r['memory_ratio']:.3f}" if r["memory_ratio"] is not None else "-"
        out.append(f"| {r['head']} | {names[r['method']]} | {r['seconds']:.3f} | "
                   f"{r['ratio']:.3f} | {r['peak_mib']:.0f} | {memory} | "
                   f"{', '.join(f'{s:.3f}' for s in r['processes'])} |")
    return "\n".join(out)


def parse(argv):
    p = parser_from_doc(__doc__)
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
    p.add_argument("--bf16", action="store_true", help="TrainingArguments(bf16=True): autocast")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--one-process", action="store_true",
                   help="every measurement in this process (no import per method)")
    p.add_argument("--shape", choices=sorted(SHAPES),
                   help="the causal LM's shape instead of the Qwen-style default")
    return p.parse_args(argv)


def main(argv=None):
    args = parse(argv)
    if args.shape and set(args.heads) != {"causal-lm"} and args.what == "run":
        sys.exit("bench_hf: --shape is a causal LM's shape: give --heads causal-lm")
    if args.what == "_child":
        import torch

        torch.set_num_threads(args.threads)
        print(json.dumps(measure(args.method, args.head, args.batch, args.length, args.steps,
                                 shape=SHAPES.get(args.shape), bf16=args.bf16,
                                 device=args.device)))
        return 0
    results = []
    for head in args.heads:
        for _ in range(args.rounds):
            for method in methods_for(head):
                results.append(in_this_process(method, head, args) if args.one_process
                               else run_child(method, head, args))
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
