#!/usr/bin/env python
"""Baseline vs doubled batch vs R-Drop on real German-English text (LibreOffice help), on CPU.

1. Takes a deterministic subset of the committed corpus (data/libreoffice-help-de-en):
   pairs of at most 15 words a side, 6000 of them for training, and prepares it
   (sacremoses, joint BPE, fairseq-preprocess).
2. Trains a small transformer_iwslt_de_en (2+2 layers, 192 dim) three ways for the same
   number of epochs, two runs at a time (one CPU thread each, the R-Drop runs first
   because they take twice as long): the baseline and R-Drop for each seed (1, 2, 3), and
   for the first seed the baseline with a doubled batch (appendix C.1: R-Drop's compute
   without its KL), streaming each epoch's validation BLEU.
3. As each run ends, averages its last 5 epoch checkpoints and scores the average on the
   test set (beam 5, tokenized BLEU), beside the trainings still going. Then prints a table
   (mean and standard deviation over seeds), plots the validation curves to a PNG (like
   the paper's appendix figure 3) and writes everything to OUT/results.json.

R-Drop's alpha here is 1, not the paper's 5 for translation: with this small model and a
CPU budget of epochs, alpha 5 learns too slowly to finish (docs/results.md has the curves).

    python -m rdrop_fairseq.recipes.libreoffice_demo --out work/lo-demo [--seeds 1 2 3]
    python -m rdrop_fairseq.recipes.libreoffice_demo --quick   # a few minutes, one seed
"""

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from .average_checkpoints import average, last_checkpoints
from .common import PLUGIN, fairseq_cli
from .evaluate_translation import generate_and_score
from .prepare_translation import export_libreoffice

RUNS = {
    "baseline": ["--criterion", "label_smoothed_cross_entropy"],
    "doubled batch": ["--criterion", "label_smoothed_cross_entropy", "DOUBLE_TOKENS"],
    "R-Drop": ["--criterion", "label_smoothed_cross_entropy_rdrop", "--rdrop-alpha", "ALPHA"],
}
CONTROL = "doubled batch"  # the equal-compute control, run for fewer seeds by default
RUN_COST = {"R-Drop": 2}  # relative time per epoch, to start the longest runs first
SIZES = {  # training pairs, valid/test pairs (None: all), pairs of at most max_words words,
    # BPE merges, model, batch, schedule, R-Drop alpha, epochs, epoch checkpoints averaged
    "full": dict(pairs=6000, valid_pairs=300, test_pairs=None, max_words=15, merges=3000,
                 layers=2, dim=192, ffn=768, tokens=1024, lr=2e-3, warmup=400, alpha=1,
                 epochs=18, average=5),
    "quick": dict(pairs=6000, valid_pairs=300, test_pairs=300, max_words=15, merges=3000,
                  layers=1, dim=128, ffn=512, tokens=1024, lr=2e-3, warmup=400, alpha=1,
                  epochs=8, average=2),
}


def prepare(out, size):
    raw = out / "raw"
    export_libreoffice(raw, train_pairs=size["pairs"], valid_pairs=size["valid_pairs"],
                       test_pairs=size["test_pairs"], max_words=size.get("max_words"))
    log = out / "prepare.log"
    with open(log, "w") as handle:
        done = subprocess.run([sys.executable, "-m", "rdrop_fairseq.recipes.prepare_translation",
                               "--raw", str(raw), "--out", str(out),
                               "--bpe-merges", str(size["merges"])],
                              stdout=handle, stderr=subprocess.STDOUT)
    if done.returncode:
        sys.exit(f"error: preparing the data failed, see {log}")
    return out / "bin"


def train_command(data, save_dir, run, seed, size):
    criterion = [str(size["alpha"]) if a == "ALPHA" else a for a in RUNS[run]
                 if a != "DOUBLE_TOKENS"]
    tokens = size["tokens"] * (2 if "DOUBLE_TOKENS" in RUNS[run] else 1)
    d, f, layers = str(size["dim"]), str(size["ffn"]), str(size["layers"])
    return [
        fairseq_cli("fairseq-train"), str(data), "--user-dir", str(PLUGIN),
        "--arch", "transformer_iwslt_de_en", "--share-all-embeddings",
        "--encoder-layers", layers, "--decoder-layers", layers,
        "--encoder-embed-dim", d, "--decoder-embed-dim", d,
        "--encoder-ffn-embed-dim", f, "--decoder-ffn-embed-dim", f,
        "--encoder-attention-heads", "4", "--decoder-attention-heads", "4",
        "--dropout", "0.3", "--weight-decay", "0.0001", "--label-smoothing", "0.1",
        "--optimizer", "adam", "--adam-betas", "(0.9, 0.98)", "--lr", str(size["lr"]),
        "--lr-scheduler", "inverse_sqrt", "--warmup-updates", str(size["warmup"]),
        "--max-tokens", str(tokens), "--max-epoch", str(size["epochs"]), "--seed", str(seed),
        "--cpu", "--num-workers", "0", *criterion,
        "--eval-bleu", "--eval-bleu-args", '{"beam": 1, "max_len_a": 1.2, "max_len_b": 10}',
        "--eval-bleu-detok", "space", "--eval-bleu-remove-bpe",
        "--best-checkpoint-metric", "bleu", "--maximize-best-checkpoint-metric",
        "--keep-last-epochs", str(size["average"]), "--no-save-optimizer-state",
        "--save-dir", str(save_dir),
        "--log-format", "simple", "--log-interval", "1000", "--no-progress-bar",
    ]


def run_all(jobs, parallel, on_done=None):
    """Run (name, command, log) jobs, ``parallel`` at a time, printing validation lines;
    ``on_done(name, log)`` after each job that succeeds."""
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    pending, running = list(jobs), []
    while pending or running:
        while pending and len(running) < parallel:
            name, cmd, log = pending.pop(0)
            handle = open(log, "w")
            running.append((name, subprocess.Popen(cmd, stdout=handle, stderr=subprocess.STDOUT,
                                                   env=env), log, handle, 0))
        time.sleep(2)
        still = []
        for name, proc, log, handle, seen in running:
            lines = Path(log).read_text(errors="replace").splitlines()
            for line in lines[seen:]:
                m = re.search(r"valid \| epoch (\d+) .*\| bleu ([\d.]+)", line)
                if m:
                    print(f"  [{name}] epoch {int(m[1])}: valid BLEU {m[2]}", flush=True)
            if proc.poll() is None:
                still.append((name, proc, log, handle, len(lines)))
            else:
                handle.close()
                if proc.returncode:
                    sys.exit(f"error: {name} failed, see {log}")
                if on_done:
                    on_done(name, log)
        running = still


def score_run(name, data, save_dir, size):
    """Average the run's last epoch checkpoints and score the average on the test set."""
    checkpoint = save_dir / f"checkpoint_avg{size['average']}.pt"
    torch.save(average(last_checkpoints(save_dir, size["average"], r"checkpoint(\d+)\.pt")),
               checkpoint)
    _, bleu, _ = generate_and_score(data, checkpoint, save_dir.with_suffix(".test.txt"),
                                    batch_size=64, cpu=True, quiet=True)
    print(f"  [{name}] test BLEU {bleu:.2f} (average of the last {size['average']} "
          "checkpoints, beam 5)", flush=True)
    return round(bleu, 2)


def valid_curve(log):
    return [float(b) for b in re.findall(r"valid on 'valid' subset .*?\| bleu ([\d.]+)",
                                         Path(log).read_text())]


def plot(curves, path):
    import logging

    # importing fairseq (through the plugin) sets the root logger to DEBUG; quiet matplotlib
    # before its import logs
    logging.getLogger("matplotlib").setLevel(logging.WARNING)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    fig, ax = plt.subplots(figsize=(6, 4))
    for run, per_seed in curves.items():
        epochs = min(len(c) for c in per_seed)
        mean = [statistics.mean(c[e] for c in per_seed) for e in range(epochs)]
        seeds = f"{len(per_seed)} seed{'s' if len(per_seed) > 1 else ''}"
        ax.plot(range(1, epochs + 1), mean, marker=".", label=f"{run} ({seeds})")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("epoch")
    ax.set_ylabel("validation BLEU (greedy)")
    ax.set_title("LibreOffice help de-en: validation BLEU")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=Path("work/libreoffice-demo"))
    p.add_argument("--seeds", type=int, nargs="+",
                   help="seeds of the baseline and R-Drop runs (default: 1 2 3; --quick: 1)")
    p.add_argument("--control-seeds", type=int, nargs="+",
                   help="seeds of the doubled-batch control (default: the first seed)")
    p.add_argument("--runs", nargs="+", choices=list(RUNS), default=list(RUNS))
    p.add_argument("--quick", action="store_true",
                   help="a few minutes: a 1+1-layer model, 8 epochs, one seed")
    p.add_argument("--epochs", type=int, help="override the number of epochs")
    p.add_argument("--train-pairs", type=int, help="override the training subset size")
    p.add_argument("--alpha", type=float, help="override R-Drop's alpha")
    p.add_argument("--eval-pairs", type=int, help="use only the first N valid/test pairs")
    p.add_argument("--parallel", type=int, default=os.cpu_count() or 1,
                   help="runs at a time (one thread each)")
    a = p.parse_args(argv)
    size = dict(SIZES["quick" if a.quick else "full"])
    a.seeds = a.seeds or ([1] if a.quick else [1, 2, 3])
    a.control_seeds = a.control_seeds or a.seeds[:1]
    if a.epochs:
        size["epochs"] = a.epochs
    if a.train_pairs:
        size["pairs"] = a.train_pairs
    if a.alpha is not None:
        size["alpha"] = a.alpha
    if a.eval_pairs:
        size["valid_pairs"] = size["test_pairs"] = a.eval_pairs
    size["average"] = min(size["average"], size["epochs"])
    a.out.mkdir(parents=True, exist_ok=True)
    print(f"[demo] preparing {size['pairs']} training pairs of the LibreOffice help corpus",
          flush=True)
    data = prepare(a.out / "data", size)
    jobs = []
    for run in sorted(a.runs, key=lambda r: -RUN_COST.get(r, 1)):
        for seed in (a.control_seeds if run == CONTROL else a.seeds):
            save = a.out / f"{re.sub(r'[^a-z]+', '_', run.lower())}_seed{seed}"
            jobs.append((f"{run} s{seed}", train_command(data, save, run, seed, size),
                         save.with_suffix(".log")))
    print(f"[demo] training {len(jobs)} runs, {a.parallel} at a time, "
          f"{size['epochs']} epochs each", flush=True)
    # each run is scored as soon as it ends, on one thread beside the trainings still going:
    # the core that the last training leaves idle does the scoring
    os.environ.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    with ThreadPoolExecutor(max_workers=1) as scorer:
        bleu = {}
        run_all(jobs, a.parallel, on_done=lambda name, log: bleu.__setitem__(
            name, scorer.submit(score_run, name, data, log.with_suffix(""), size)))
        results = {}
        for (name, _, log) in sorted(jobs,
                                     key=lambda job: a.runs.index(job[0].rsplit(" s", 1)[0])):
            run, seed = name.rsplit(" s", 1)
            entry = results.setdefault(run, {"seeds": [], "test_bleu": [], "valid_curves": []})
            entry["seeds"].append(int(seed))
            entry["test_bleu"].append(bleu[name].result())
            entry["valid_curves"].append(valid_curve(log))
    (a.out / "results.json").write_text(json.dumps({"size": size, "runs": results}, indent=1))
    plot({run: r["valid_curves"] for run, r in results.items()}, a.out / "valid_bleu.png")

    print("\n| run | test BLEU (beam 5), mean ± std over seeds | per seed |")
    print("|---|---|---|")
    for run, r in results.items():
        scores = r["test_bleu"]
        spread = f"{statistics.stdev(scores):.2f}" if len(scores) > 1 else "– (1 seed)"
        print(f"| {run} | {statistics.mean(scores):.2f} ± {spread} | "
              f"{', '.join(f'{s:.2f}' for s in scores)} |")
    if {"baseline", "R-Drop"} <= results.keys() and len(a.seeds) > 1:
        base, rdrop = results["baseline"]["test_bleu"], results["R-Drop"]["test_bleu"]
        gain = statistics.mean(rdrop) - statistics.mean(base)
        larger = gain > max(statistics.stdev(base), statistics.stdev(rdrop))
        print(f"\nR-Drop - baseline: {gain:+.2f} BLEU, "
              f"{'larger' if larger else 'not larger'} than either run's seed spread (std)")
    print(f"\nplot: {a.out / 'valid_bleu.png'}; results: {a.out / 'results.json'}")


if __name__ == "__main__":
    main()
