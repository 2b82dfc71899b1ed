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

Rerunning the same command reuses what is done: the prepared data, every finished run (its
OUT/RUN_seedN/result.json, written when it has been scored) and the epochs of an
interrupted run, which continues from its checkpoint_last.pt. ``--fresh`` starts over.

R-Drop's alpha here is 1, not the paper's 5 for translation: with this small model and a
CPU budget of epochs, alpha 5 learns too slowly to finish (docs/results.md has the curves).

    python -m rdrop_fairseq.recipes.libreoffice_demo --out work/lo-demo [--seeds 1 2 3]
    python -m rdrop_fairseq.recipes.libreoffice_demo --quick   # a smoke test: one seed
"""

import json
import os
import pickle
import re
import shutil
import statistics
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from ..checkpoint_compat import allow_fairseq_checkpoint_globals
from .average_checkpoints import average, last_checkpoints
from .common import PLUGIN, fairseq_cli, parser_from_doc, write_json
from .evaluate_translation import generate_and_score
from .prepare_translation import export_libreoffice, libreoffice_pairs

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
    # the smoke test's models barely learn to end a sentence: its test translations stop at
    # 1.2 x the source's length + 10 tokens, as every validation's do (fairseq's default,
    # 200 tokens, made scoring most of a --quick run's time)
    "quick": dict(pairs=6000, valid_pairs=300, test_pairs=300, max_words=15, merges=3000,
                  layers=1, dim=128, ffn=512, tokens=1024, lr=2e-3, warmup=400, alpha=1,
                  epochs=8, average=2, test_max_len=[1.2, 10]),
}


DATA_KEYS = ("pairs", "valid_pairs", "test_pairs", "max_words", "merges")
# fairseq-train's --required-batch-size-multiple (its default, the demo's): its validation
# batches are multiples of this many sentences, and fewer pairs make none
BATCH_MULTIPLE = 8


def smoke_test(seeds, size):
    return (f"--quick is a smoke test of the pipeline, {len(seeds)} seed{'s' * (len(seeds) > 1)} "
            f"of a {size['layers']}+{size['layers']}-layer model for {size['epochs']} epochs: "
            "its scores are not a measurement of R-Drop (run without --quick for that)")


def slug(run):
    return re.sub(r"[^a-z]+", "_", run.lower())


# what the demo writes into --out: --fresh deletes these and nothing else
OUTPUTS = re.compile(r"settings\.json|results\.json|valid_bleu\.png|"
                     rf"({'|'.join(slug(run) for run in RUNS)})_seed\d+(\.log|\.test\.txt)?")


def ours(path):
    """Whether ``path``, in --out, was written by the demo."""
    if path.name == "data":  # checked by content: --out . would name the repository's data/
        return path.is_dir() and (not any(path.iterdir()) or any(
            (path / name).exists() for name in ("raw", "prepare.log", "done.json")))
    return OUTPUTS.fullmatch(path.name) is not None


def start_over(out):
    for path in out.iterdir():
        if ours(path):
            print(f"[demo] --fresh: deleting {path}", flush=True)
            if path.is_dir():
                shutil.rmtree(path)
            else:
                path.unlink()


def check_settings(out, size):
    """Record the settings in OUT/settings.json; a rerun must use the same ones (finished
    and interrupted runs would not be comparable with new ones)."""
    path = out / "settings.json"
    if path.is_file():
        old = json.loads(path.read_text())
        if old != size:
            changed = ", ".join(f"{k} {old.get(k)} -> {v}" for k, v in size.items()
                                if old.get(k) != v)
            sys.exit(f"error: {out} holds a demo with other settings ({changed}); add --fresh "
                     "to start over there, or choose another --out")
    elif any(ours(p) for p in out.iterdir()):
        sys.exit(f"error: {out} holds demo outputs of unknown settings (no settings.json); "
                 "add --fresh to start over there, or choose another --out")
    write_json(path, size)


def prepare(out, size):
    """Prepare the data into ``out`` once: ``out/done.json`` is written last, so a data
    directory without it (an interrupted preparation) is rebuilt from scratch."""
    marker = out / "done.json"
    settings = {k: size[k] for k in DATA_KEYS}
    if marker.is_file() and json.loads(marker.read_text()) == settings:
        print(f"[demo] reusing the prepared data in {out}", flush=True)
        return out / "bin"
    if out.exists():
        if not ours(out):
            sys.exit(f"error: {out} exists and is not the demo's; choose another --out")
        print(f"[demo] {out} is incomplete (no done.json): preparing it again", flush=True)
        shutil.rmtree(out)
    print(f"[demo] preparing {size['pairs']} training pairs of the LibreOffice help corpus",
          flush=True)
    out.mkdir(parents=True)
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
    write_json(marker, settings)
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
        # checkpoints keep the optimizer state: without it fairseq would continue an
        # interrupted run with fresh Adam moments and its learning-rate warmup from update 0
        "--keep-last-epochs", str(size["average"]),
        "--save-dir", str(save_dir),
        "--log-format", "simple", "--log-interval", "1000", "--no-progress-bar",
    ]


def epochs_done(name, save_dir):
    """How many epochs an interrupted run has done, or None to start it from scratch.

    fairseq-train continues from SAVE_DIR/checkpoint_last.pt by itself. That file is a
    copy of the epoch checkpoint, not written atomically: if an interruption truncated it,
    the newest epoch checkpoint that loads (those are written atomically) replaces it."""
    last = save_dir / "checkpoint_last.pt"
    if not last.is_file():
        return None
    allow_fairseq_checkpoint_globals()
    epochs = sorted(save_dir.glob("checkpoint[0-9]*.pt"), key=lambda p: int(p.stem[10:]))
    for path in [last, *reversed(epochs)]:
        try:
            state = torch.load(path, map_location="cpu")
        except (RuntimeError, EOFError, pickle.UnpicklingError) as e:
            print(f"  [{name}] {path.name} does not load ({str(e).splitlines()[0]})", flush=True)
            continue
        if path != last:
            shutil.copyfile(path, last)
        return state["extra_state"]["train_iterator"]["epoch"] - 1  # saved: the next epoch
    last.unlink()
    return None


class Cores:
    """Who may use the cores: the trainings, ``parallel`` at a time, and the scorings of
    finished runs. One scoring runs beside the trainings; more run at once only on the
    cores that no training uses (the end of the demo, when the last trainings are done)."""

    def __init__(self, cores):
        self.cores, self.trainings, self.scorings = cores, 0, 0
        self.changed = threading.Condition()

    def set_trainings(self, n):
        with self.changed:
            self.trainings = n
            self.changed.notify_all()

    def score(self, fn, *args):
        with self.changed:
            self.changed.wait_for(lambda: self.scorings == 0
                                  or self.scorings + self.trainings < self.cores)
            self.scorings += 1
        try:
            return fn(*args)
        finally:
            with self.changed:
                self.scorings -= 1
                self.changed.notify_all()


def run_all(jobs, parallel, on_done=None, cores=None):
    """Run (name, command, log) jobs, ``parallel`` at a time, printing validation lines;
    ``on_done(name, log)`` after each job that succeeds; ``cores`` (a Cores) is told how
    many run. A job whose save dir (the log's path without .log) holds a checkpoint
    continues from it, appending to its log. Leaving early (an error, Ctrl-C) stops the
    trainings still going."""
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    pending, running = list(jobs), []
    try:
        while pending or running:
            while pending and len(running) < parallel:
                name, cmd, log = pending.pop(0)
                done = epochs_done(name, log.with_suffix(""))
                seen = 0
                if done is None:
                    handle = open(log, "w")
                else:
                    print(f"  [{name}] continuing from its checkpoint_last.pt ({done} "
                          f"epoch{'s' * (done != 1)} done). Its numbers will not be those of "
                          "an uninterrupted run: fairseq 0.12 rebuilds the batches with the "
                          "seed of the epoch it resumes in (weights, optimizer and dropout "
                          "seeds are restored exactly); --fresh for comparable numbers",
                          flush=True)
                    seen = len(log.read_text(errors="replace").splitlines())
                    handle = open(log, "a")
                running.append((name, subprocess.Popen(cmd, stdout=handle,
                                                       stderr=subprocess.STDOUT, env=env),
                                log, handle, seen))
            if cores:
                cores.set_trainings(len(running))
            time.sleep(0.5)  # a job's end is seen (and the next started) within half a second
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
    finally:
        for _, proc, _, handle, _ in running:
            if proc.poll() is None:
                proc.terminate()
                proc.wait()
            handle.close()
        if cores:
            cores.set_trainings(0)


def score_run(name, data, save_dir, size):
    """Average the run's last epoch checkpoints, score the average on the test set and
    write the run's result to SAVE_DIR/result.json, which marks the run as finished."""
    checkpoint = save_dir / f"checkpoint_avg{size['average']}.pt"
    torch.save(average(last_checkpoints(save_dir, size["average"], r"checkpoint(\d+)\.pt")),
               checkpoint)
    max_len = size.get("test_max_len")
    _, bleu, _ = generate_and_score(
        data, checkpoint, save_dir.with_suffix(".test.txt"), batch_size=64, cpu=True,
        quiet=True, extra_args=["--max-len-a", str(max_len[0]), "--max-len-b",
                                str(max_len[1])] if max_len else [])
    print(f"  [{name}] test BLEU {bleu:.2f} (average of the last {size['average']} "
          "checkpoints, beam 5)", flush=True)
    result = {"test_bleu": round(bleu, 2), "valid_curve": valid_curve(save_dir.with_suffix(".log"))}
    write_json(save_dir / "result.json", result)
    return result


def valid_curve(log):
    """Validation BLEU per epoch. A continued run may have logged an epoch twice (when it
    was interrupted after validating, before saving the checkpoint): the last one counts."""
    bleu = {}
    for epoch, value in re.findall(r"valid \| epoch (\d+) \| valid on 'valid' subset "
                                   r".*?\| bleu ([\d.]+)", Path(log).read_text()):
        bleu[int(epoch)] = float(value)
    return [bleu[epoch] for epoch in sorted(bleu)]


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


def train_and_score(a, size):
    """Prepare the data, train and score the runs not finished earlier. Returns the planned
    (name, save dir) pairs and each run's result."""
    data = prepare(a.out / "data", size)
    planned, jobs, finished = [], [], {}
    for run in sorted(a.runs, key=lambda r: -RUN_COST.get(r, 1)):
        for seed in (a.control_seeds if run == CONTROL else a.seeds):
            name, save = f"{run} s{seed}", a.out / f"{slug(run)}_seed{seed}"
            planned.append((name, save))
            if (save / "result.json").is_file():
                finished[name] = json.loads((save / "result.json").read_text())
                print(f"  [{name}] finished earlier: test BLEU {finished[name]['test_bleu']:.2f}"
                      f" ({save / 'result.json'})", flush=True)
            else:
                jobs.append((name, train_command(data, save, run, seed, size),
                             save.with_suffix(".log")))
    if jobs:
        print(f"[demo] training {len(jobs)} runs, {a.parallel} at a time, "
              f"{size['epochs']} epochs each", flush=True)
    # each run is scored as soon as it ends, one thread each: one scoring beside the
    # trainings still going, more on the cores that the last trainings leave idle
    os.environ.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    cores = Cores(a.parallel)
    with ThreadPoolExecutor(max_workers=a.parallel) as scorer:
        scored = {}
        run_all(jobs, a.parallel, cores=cores, on_done=lambda name, log: scored.__setitem__(
            name, scorer.submit(cores.score, score_run, name, data, log.with_suffix(""),
                                size)))
        finished.update({name: future.result() for name, future in scored.items()})
    return planned, finished


def build_parser():
    p = parser_from_doc(__doc__)
    p.add_argument("--out", type=Path, help="where everything goes (default: "
                   "work/libreoffice-demo, with --quick work/libreoffice-demo-quick)")
    p.add_argument("--seeds", type=int, nargs="+",
                   help="seeds of the baseline and R-Drop runs (default: 1 2 3; --quick: 1)")
    p.add_argument("--control-seeds", type=int, nargs="+",
                   help="seeds of the doubled-batch control (default: the first seed)")
    p.add_argument("--runs", nargs="+", choices=list(RUNS), default=list(RUNS))
    p.add_argument("--quick", action="store_true",
                   help="a smoke test of a few minutes: a 1+1-layer model, 8 epochs, one seed")
    p.add_argument("--fresh", action="store_true",
                   help="delete this demo's data and runs in --out first, and start over")
    p.add_argument("--epochs", type=int, help="override the number of epochs")
    p.add_argument("--train-pairs", type=int, help="override the training subset size")
    p.add_argument("--alpha", type=float, help="override R-Drop's alpha")
    p.add_argument("--eval-pairs", type=int,
                   help=f"use only the first N valid/test pairs (at least {BATCH_MULTIPLE}: "
                        "fairseq-train validates in batches of a multiple of that)")
    p.add_argument("--parallel", type=int, default=os.cpu_count() or 1,
                   help="runs at a time (one thread each)")
    return p


def parse_args(argv=None):
    """``(the command line, the demo's size)``: the defaults that depend on --quick filled
    in, the size checked (:func:`demo_size`)."""
    p = build_parser()
    a = p.parse_args(argv)
    # a --quick run of its own directory: its settings differ, and a rerun must find its own
    a.out = a.out or Path("work/libreoffice-demo" + ("-quick" if a.quick else ""))
    a.seeds = a.seeds or ([1] if a.quick else [1, 2, 3])
    a.control_seeds = a.control_seeds or a.seeds[:1]
    return a, demo_size(a, p)


def demo_size(a, p):
    """The entry of SIZES the command line asks for (``--quick`` or the full demo), with
    its overrides (``--epochs``, ``--train-pairs``, ``--alpha``, ``--eval-pairs``); an
    ``--eval-pairs`` that leaves fairseq-train no validation batch is refused."""
    size = dict(SIZES["quick" if a.quick else "full"])
    if a.epochs:
        size["epochs"] = a.epochs
    if a.train_pairs:
        size["pairs"] = a.train_pairs
    if a.alpha is not None:
        size["alpha"] = a.alpha
    if a.eval_pairs is not None:
        kept = max(0, min(a.eval_pairs, len(libreoffice_pairs("valid", size["max_words"]))))
        if kept < BATCH_MULTIPLE:
            p.error(f"--eval-pairs {a.eval_pairs} keeps {kept} validation pairs of at most "
                    f"{size['max_words']} words a side, and fairseq-train validates in batches "
                    f"of a multiple of {BATCH_MULTIPLE} sentences (fewer make none): use "
                    f"--eval-pairs {BATCH_MULTIPLE} or more")
        size["valid_pairs"] = size["test_pairs"] = a.eval_pairs
    size["average"] = min(size["average"], size["epochs"])
    return size


def gather_results(planned, finished, runs):
    """``{run: {"seeds", "test_bleu", "valid_curves"}}`` from each planned run's result, the
    runs in the order of ``runs`` (the command line's), the seeds in the planned order."""
    results = {}
    for name, _ in sorted(planned, key=lambda job: runs.index(job[0].rsplit(" s", 1)[0])):
        run, seed = name.rsplit(" s", 1)
        entry = results.setdefault(run, {"seeds": [], "test_bleu": [], "valid_curves": []})
        entry["seeds"].append(int(seed))
        entry["test_bleu"].append(finished[name]["test_bleu"])
        entry["valid_curves"].append(finished[name]["valid_curve"])
    return results


def print_summary(results, a, size):
    """The table of test BLEU per run (mean ± std over seeds), R-Drop's gain over the
    baseline beside the seeds' spread, and where the plot and the results are."""
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
        print(f"\nR-Drop - baseline: {gain:+.2f} BLEU, " + (
            "a smoke test's number, not a measurement" if a.quick else
            f"{'larger' if larger else 'not larger'} than either run's seed spread (std)"))
    if a.quick:
        print(f"\n{smoke_test(a.seeds, size)}")
    print(f"\nplot: {a.out / 'valid_bleu.png'}; results: {a.out / 'results.json'}, one "
          f"{a.out}/RUN_seedN/result.json per run; rerunning reuses them, --fresh starts over")


def main(argv=None):
    a, size = parse_args(argv)
    a.out.mkdir(parents=True, exist_ok=True)
    if a.fresh:
        start_over(a.out)
    check_settings(a.out, size)
    print(f"[demo] writing to {a.out}: a rerun of this command reuses what is done there and "
          "continues interrupted runs; --fresh starts over", flush=True)
    if a.quick:
        print(f"[demo] {smoke_test(a.seeds, size)}", flush=True)
    try:
        planned, finished = train_and_score(a, size)
    except KeyboardInterrupt:
        sys.exit(f"\n[demo] interrupted. Finished runs are kept in {a.out}; the same command "
                 "continues the others from their last epoch checkpoint (--fresh: start over)")
    results = gather_results(planned, finished, a.runs)
    write_json(a.out / "results.json", {"size": size, "runs": results})
    plot({run: r["valid_curves"] for run, r in results.items()}, a.out / "valid_bleu.png")
    print_summary(results, a, size)


if __name__ == "__main__":
    main()
