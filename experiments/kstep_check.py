#!/usr/bin/env python
"""R-Drop every k updates (``--rdrop-every K``, the paper's k-step study) against the
baseline and R-Drop on every update, on the demo's real German-English data: validation
BLEU against updates and against training time, test BLEU at convergence, and the BLEU
each reaches within equal time budgets.

    python -m experiments.kstep_check --out experiments/results/kstep
    python -m experiments.kstep_check --out /tmp/kstep --ks 2 --seeds 1 --epochs 2 --eval-pairs 16

The setting is the demo's (rdrop_fairseq.recipes.libreoffice_demo: 6,000 training pairs of
the LibreOffice help corpus, a 2+2-layer transformer_iwslt_de_en of width 192, alpha 1,
1,024 tokens a batch, Adam with an inverse-sqrt schedule, greedy validation BLEU every
other epoch, the average of the last 5 epoch checkpoints scored on the test set with beam 5) at
30 epochs, where the runs are close to converged (the demo's 30-epoch runs peak in epochs
26-30). Every arm runs the same epochs, so an arm with fewer R-Drop updates ends sooner.

Runs go two at a time, one thread each, as the demo runs them; the time axis is each run's
own ``train_wall`` (the training steps, without validation and checkpointing, which cost
every arm the same). Writes OUT/work/ (the data, the runs and their logs: not for
committing), OUT/runs/ARM_seedN.json (each finished run's test BLEU and its validated
epochs), and from those OUT/summary.json, OUT/summary.md and OUT/kstep_bleu.png.
Rerunning reuses every finished run (its result.json) and continues an interrupted one;
``--summary-only`` remakes the summary from OUT/runs/ alone.
"""

import json
import os
import re
import statistics
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from rdrop_fairseq.recipes import libreoffice_demo as demo
from rdrop_fairseq.recipes.common import parser_from_doc, write_json

BASELINE = "baseline"
EPOCHS = 30
VALIDATE_INTERVAL = 2


# An arm is (k, pass_mean): k 0 the baseline, else R-Drop every k updates, its R-Drop
# updates' loss the sum of the two passes' (the paper's) or, with pass_mean, their mean.


def arm_name(arm):
    k, mean = arm
    return BASELINE if k == 0 else f"R-Drop k={k}" + (", pass mean" if mean else "")


def arm_slug(arm):
    k, mean = arm
    return BASELINE if k == 0 else f"rdrop_every{k}" + ("_mean" if mean else "")


def train_command(data, save_dir, arm, seed, size):
    """The demo's command for the baseline (k 0) or R-Drop, with ``--rdrop-every k``
    where k > 1 (k 1 is the criterion's default, the demo's own R-Drop command) and
    ``--rdrop-pass-mean`` for a pass-mean arm."""
    k, mean = arm
    cmd = demo.train_command(data, save_dir, BASELINE if k == 0 else "R-Drop", seed, size)
    # validation (greedy BLEU of 300 sentences) every other epoch: a third of an epoch's
    # time here, and not on the time axis
    cmd += ["--validate-interval", str(VALIDATE_INTERVAL)]
    return (cmd + (["--rdrop-every", str(k)] if k > 1 else [])
            + (["--rdrop-pass-mean"] if mean else []))


EPOCH_LINE = re.compile(r"\| train \| epoch (\d+) \|.*?\| num_updates (\d+) \|.*?"
                        r"\| train_wall (\d+(?:\.\d+)?) \|")
VALID_LINE = re.compile(r"valid \| epoch (\d+) \| valid on 'valid' subset .*?\| bleu ([\d.]+)")
RDROP_UPDATES = re.compile(r"\| train \| epoch (\d+) \|.*?\| rdrop_updates (\d+)")


def epoch_rows(log_text):
    """``[{"epoch", "updates", "hours", "valid_bleu", "rdrop_updates"}]`` per validated
    epoch from a fairseq-train log: the updates, the hours (the sum of every epoch's
    ``train_wall``) and the R-Drop updates (summed likewise) at the epoch's end. A continued
    run may log an epoch twice: the last one counts."""
    wall, updates, bleu, rdrop = {}, {}, {}, {}
    for epoch, n, seconds in EPOCH_LINE.findall(log_text):
        wall[int(epoch)], updates[int(epoch)] = float(seconds), int(n)
    for epoch, value in VALID_LINE.findall(log_text):
        bleu[int(epoch)] = float(value)
    for epoch, n in RDROP_UPDATES.findall(log_text):
        rdrop[int(epoch)] = int(n)
    rows, hours, rdrop_updates = [], 0.0, 0
    for epoch in sorted(wall):
        hours += wall[epoch] / 3600
        rdrop_updates += rdrop.get(epoch, 0)
        if epoch in bleu:
            rows.append({"epoch": epoch, "updates": updates[epoch], "hours": round(hours, 5),
                         "valid_bleu": bleu[epoch], "rdrop_updates": rdrop_updates})
    return rows


def load(save_dir):
    """A finished run's result (the demo's scoring: test BLEU of the last checkpoints'
    average), with its epochs read from its log."""
    result = json.loads((save_dir / "result.json").read_text())
    result["epochs"] = epoch_rows(save_dir.with_suffix(".log").read_text(errors="replace"))
    return result


def run_arms(a, size):
    """Train and score what is not finished, and write each run's OUT/runs/ file;
    ``{arm: {seed: result}}``."""
    work = a.out / "work"
    work.mkdir(parents=True, exist_ok=True)
    demo.check_settings(work, size)
    data = demo.prepare(work / "data", size)
    arms = [(0, False), *((k, False) for k in a.ks), *((k, True) for k in a.pass_mean_ks)]
    done, jobs, labels = {arm: {} for arm in arms}, [], {}
    # the longest runs first, as the demo orders them
    for arm in sorted(arms, key=lambda arm: 0 if arm[0] == 0 else -1 / arm[0]):
        for seed in a.seeds:
            save = work / f"{arm_slug(arm)}_seed{seed}"
            name = f"{arm_name(arm)} s{seed}"
            labels[name] = (arm, seed)
            if (save / "result.json").is_file():
                done[arm][seed] = load(save)
                print(f"  [{name}] finished earlier", flush=True)
            else:
                jobs.append((name, train_command(data, save, arm, seed, size),
                             save.with_suffix(".log")))
    os.environ.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    cores = demo.Cores(a.parallel)
    with ThreadPoolExecutor(max_workers=a.parallel) as scorer:
        futures = {}
        demo.run_all(jobs, a.parallel, cores=cores, on_done=lambda name, log: futures.update(
            {name: scorer.submit(cores.score, demo.score_run, name, data, log.with_suffix(""),
                                 size)}))
        for name, future in futures.items():
            future.result()
            arm, seed = labels[name]
            done[arm][seed] = load(work / f"{arm_slug(arm)}_seed{seed}")
    (a.out / "runs").mkdir(exist_ok=True)
    for arm, runs in done.items():
        for seed, result in runs.items():
            write_json(a.out / "runs" / f"{arm_slug(arm)}_seed{seed}.json",
                       {"k": arm[0], "pass_mean": arm[1], "seed": seed,
                        "test_bleu": result["test_bleu"],
                        "epochs": result["epochs"]})
    return done


def read_runs(out):
    """``{(k, pass_mean): {seed: result}}`` from OUT/runs/."""
    done = {}
    for path in sorted((out / "runs").glob("*.json")):
        result = json.loads(path.read_text())
        arm = (result["k"], result.get("pass_mean", False))
        done.setdefault(arm, {})[result["seed"]] = result
    return dict(sorted(done.items()))


def value_within(rows, hours, cost=None):
    """The validation BLEU of the last epoch that ended within ``hours`` of training (None
    if none did), and whether the run had ended by then. With ``cost`` (an update's cost in
    baseline updates), ``hours`` is a number of baseline updates instead, and an epoch's
    time is its updates times ``cost``."""
    def spent(row):
        return row["hours"] if cost is None else row["updates"] * cost

    within = [row for row in rows if spent(row) <= hours]
    return (within[-1]["valid_bleu"] if within else None), spent(rows[-1]) <= hours


def mean_std(values):
    values = [v for v in values if v is not None]
    if not values:
        return None
    return [round(statistics.mean(values), 2),
            round(statistics.stdev(values), 2) if len(values) > 1 else None]


def summarize(done, update_costs=None):
    """Per arm: test BLEU, seconds per update and their ratio to the baseline's, the share
    of updates that ran R-Drop, the best validation epoch, and the validation BLEU within
    budgets of 0.5, 1 and 2 times the baseline's training time; with ``update_costs``
    (``{str(k): an update's cost in baseline updates}``, a benchmark's; a pass-mean arm costs
    what its k does), also within 0.5, 1 and 2 times the baseline's updates at those costs."""
    def per_update(result):
        last = result["epochs"][-1]
        return last["hours"] * 3600 / last["updates"]

    baseline = done[(0, False)].values()
    base_hours = statistics.mean(r["epochs"][-1]["hours"] for r in baseline)
    base_step = statistics.mean(per_update(r) for r in baseline)
    budgets = {f"{f}x baseline": f * base_hours for f in (0.5, 1, 2)}
    base_updates = statistics.mean(r["epochs"][-1]["updates"] for r in baseline)
    arms = {}
    for arm, runs in done.items():
        k = arm[0]
        results = [runs[seed] for seed in sorted(runs)]  # in seed order, however they ended
        step = statistics.mean(per_update(r) for r in results)
        arms[arm_name(arm)] = {
            "k": k, "pass_mean": arm[1], "seeds": sorted(runs),
            "test_bleu": mean_std([r["test_bleu"] for r in results]),
            "test_bleu_per_seed": [r["test_bleu"] for r in results],
            "seconds_per_update": round(step, 4),
            "time_per_update_vs_baseline": round(step / base_step, 3),
            "expected_passes_per_update": 1 if k == 0 else round((k + 1) / k, 3),
            "rdrop_share": round(statistics.mean(
                r["epochs"][-1]["rdrop_updates"] / r["epochs"][-1]["updates"]
                for r in results), 3),
            "training_hours": mean_std([r["epochs"][-1]["hours"] for r in results]),
            "best_valid_epoch": [max(r["epochs"], key=lambda e: e["valid_bleu"])["epoch"]
                                 for r in results],
            "valid_bleu_within": {label: mean_std([value_within(r["epochs"], h)[0]
                                                    for r in results])
                                  for label, h in budgets.items()},
        }
        if update_costs:
            arms[arm_name(arm)]["valid_bleu_within_at_update_costs"] = {
                label: mean_std([value_within(r["epochs"], f * base_updates,
                                              update_costs[str(k)])[0] for r in results])
                for label, f in zip(budgets, (0.5, 1, 2))}
    summary = {"budgets_hours": {k: round(v, 4) for k, v in budgets.items()}, "arms": arms}
    if update_costs:
        summary["update_costs"] = update_costs
    return summary


def markdown(summary):
    budgets = list(summary["budgets_hours"])
    lines = ["| arm | test BLEU (beam 5), mean ± std | per seed | time per update vs baseline "
             "| (k+1)/k | R-Drop updates | best valid epoch | "
             + " | ".join(f"valid BLEU within {b} ({summary['budgets_hours'][b] * 60:.1f} min)"
                          for b in budgets) + " |",
             "|---" * (7 + len(budgets)) + "|"]

    def fmt(pair):
        return "–" if pair is None else (f"{pair[0]:.2f}" if pair[1] is None
                                          else f"{pair[0]:.2f} ± {pair[1]:.2f}")

    for name, arm in summary["arms"].items():
        lines.append(
            f"| {name} | {fmt(arm['test_bleu'])} | "
            f"{', '.join(f'{v:.2f}' for v in arm['test_bleu_per_seed'])} | "
            f"{arm['time_per_update_vs_baseline']:.2f}x | {arm['expected_passes_per_update']} | "
            f"{arm['rdrop_share']:.0%} | {', '.join(map(str, arm['best_valid_epoch']))} | "
            + " | ".join(fmt(arm["valid_bleu_within"][b]) for b in budgets) + " |")
    if "update_costs" in summary:
        lines += ["", "The same budgets in baseline updates, each arm's update costing what "
                  "the benchmark measured (" + ", ".join(
                      f"{arm_name((int(k), False))} {v}x"
                      for k, v in summary["update_costs"].items())
                  + "):", "",
                  "| arm | " + " | ".join(f"valid BLEU within {b}" for b in budgets) + " |",
                  "|---" * (1 + len(budgets)) + "|"]
        lines += [f"| {name} | " + " | ".join(
            fmt(arm["valid_bleu_within_at_update_costs"][b]) for b in budgets) + " |"
            for name, arm in summary["arms"].items()]
    return "\n".join(lines) + "\n"


def plot(done, path):
    import logging

    logging.getLogger("matplotlib").setLevel(logging.WARNING)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (by_update, by_time) = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    for arm, runs in done.items():
        results = [runs[seed] for seed in sorted(runs)]  # in seed order, however they ended
        epochs = min(len(r["epochs"]) for r in results)

        def mean(key):
            return [statistics.mean(r["epochs"][e][key] for r in results) for e in range(epochs)]

        label = f"{arm_name(arm)} ({len(results)} seeds)"
        by_update.plot(mean("updates"), mean("valid_bleu"), marker=".", label=label)
        by_time.plot([60 * h for h in mean("hours")], mean("valid_bleu"), marker=".", label=label)
    by_update.set_xlabel("updates")
    by_time.set_xlabel("training time (minutes, one CPU thread a run)")
    by_update.set_ylabel("validation BLEU (greedy), mean over seeds")
    for ax in (by_update, by_time):
        ax.grid(alpha=0.3)
    by_time.legend()
    fig.suptitle("LibreOffice help de-en: R-Drop every k updates")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def build_parser():
    p = parser_from_doc(__doc__)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--ks", type=int, nargs="*", default=[1, 2, 5],
                   help="the k of each R-Drop arm (default 1 2 5; none: the baseline alone); "
                        "the baseline always runs")
    p.add_argument("--pass-mean-ks", type=int, nargs="*", default=[], metavar="K",
                   help="also an arm with --rdrop-pass-mean for each K (R-Drop updates at a "
                        "one-pass update's scale)")
    p.add_argument("--seeds", type=int, nargs="+", default=[1, 2])
    p.add_argument("--epochs", type=int, default=EPOCHS)
    p.add_argument("--eval-pairs", type=int, help="only the first N valid/test pairs")
    p.add_argument("--train-pairs", type=int, help="only N training pairs (default 6000)")
    p.add_argument("--update-costs", type=float, nargs="+", metavar="X",
                   help="an update's cost in baseline updates for each of --ks, as "
                        "benchmarks/bench_rdrop_every.py measured it: the budgets again, "
                        "in updates at these costs")
    p.add_argument("--summary-only", action="store_true",
                   help="remake the summary from OUT/runs/, training nothing")
    p.add_argument("--parallel", type=int, default=2, help="runs at a time (one thread each)")
    return p


def main(argv=None):
    p = build_parser()
    a = p.parse_args(argv)
    if any(k < 1 for k in a.ks + a.pass_mean_ks):
        p.error("--ks, --pass-mean-ks: each k is a whole number >= 1 (the baseline runs anyway)")
    size = dict(demo.SIZES["full"], epochs=a.epochs)
    if a.eval_pairs:
        size["valid_pairs"] = size["test_pairs"] = a.eval_pairs
    if a.train_pairs:
        size["pairs"] = a.train_pairs
    size["average"] = min(size["average"], size["epochs"])
    done = read_runs(a.out) if a.summary_only else run_arms(a, size)
    if (0, False) not in done:
        p.error(f"no baseline run in {a.out / 'runs'}: run without --summary-only first")
    costs = None
    if a.update_costs:
        if len(a.update_costs) != len(a.ks) or not set(a.pass_mean_ks) <= set(a.ks):
            p.error("--update-costs: one cost for each of --ks (a --pass-mean-ks arm costs "
                    "what the same k in --ks does)")
        costs = {"0": 1.0, **{str(k): c for k, c in zip(a.ks, a.update_costs)}}
    summary = {"size": size, **summarize(done, costs)}
    write_json(a.out / "summary.json", summary)
    (a.out / "summary.md").write_text(markdown(summary))
    plot(done, a.out / "kstep_bleu.png")
    print("\n" + markdown(summary) + f"\nwritten: {a.out}/summary.json, summary.md, "
          "kstep_bleu.png", flush=True)


if __name__ == "__main__":
    sys.exit(main())
