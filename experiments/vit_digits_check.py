#!/usr/bin/env python
"""Baseline against R-Drop for image classification through the ViT recipe's trainer, on
real images, without a network: a tiny ViT (transformers' ViTForImageClassification,
trained from scratch) on scikit-learn's handwritten digits (1,797 real 8 x 8 grey images of
0-9, bundled with scikit-learn), over seeds.

    python -m experiments.vit_digits_check --out experiments/results/vit-digits
    python -m experiments.vit_digits_check --out /tmp/digits --seeds 1 --updates 20

The same as the recipe (rdrop_fairseq.recipes.vit): its trainers (make_trainer: a one-pass
Trainer for the baseline, RDropTrainer with alpha for R-Drop), SGD with momentum 0.9, a
cosine schedule after a linear warm-up, the gradients clipped at norm 1, no weight decay,
dropout on the hidden states only, the images scaled to [-1, 1] as the recipe scales them
(vit_data.to_model) and scored by top-1 accuracy after the last update. Ours, for images
this small and a model trained from scratch: no random crops (an 8 x 8 digit cropped to
5 % of its area is no digit), the model's size (2 layers, width 64, 4 heads, MLP 128,
2 x 2 patches: 16 patches and [CLS]), dropout 0.2, the learning rate and the updates.

The split is fixed (a permutation drawn from seed 0): 1,077 training images, 360 valid,
360 test. Both arms of a seed start from the same weights and see the same batches. The
valid accuracy is reported beside the test accuracy, not used to pick anything. Seconds per
update: the training steps' own time (forward, backward and optimizer step), on
--threads threads. Writes OUT/runs/MODE_seedK.json (a finished run's is reused) and
OUT/summary.json and summary.md: per arm the mean and standard deviation over the seeds,
and R-Drop - baseline per seed.
"""

import json
import shutil
import sys
import time
from pathlib import Path

import torch

from experiments.common import mean_std, step_timer
from rdrop_fairseq.recipes import vit, vit_data
from rdrop_fairseq.recipes.common import parser_from_doc, write_json

MODES = ("baseline", "rdrop")
SPLIT = {"train": 1077, "valid": 360, "test": 360}
MODEL = dict(image_size=8, patch_size=2, num_channels=1, hidden_size=64,
             num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
             attention_probs_dropout_prob=0.0)


def digits():
    """``{split: (images uint8 N x 1 x 8 x 8, labels)}``: scikit-learn's digits (grey
    levels 0-16, scaled to 0-255) in a fixed split."""
    from sklearn.datasets import load_digits

    data = load_digits()
    images = torch.from_numpy(data.images).mul(16).clamp(max=255).to(torch.uint8)[:, None]
    labels = torch.from_numpy(data.target).long()
    order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(0))
    out, start = {}, 0
    for split, n in SPLIT.items():
        index = order[start:start + n]
        out[split] = (images[index], labels[index])
        start += n
    return out


def make_model(seed, dropout):
    from transformers import ViTConfig, ViTForImageClassification

    torch.manual_seed(seed)
    return ViTForImageClassification(ViTConfig(**MODEL, hidden_dropout_prob=dropout,
                                               num_labels=10))


def training_arguments(a, seed, output_dir):
    from transformers import TrainingArguments

    return TrainingArguments(
        output_dir=str(output_dir), use_cpu=True, seed=seed, max_steps=a.updates,
        per_device_train_batch_size=a.batch_size, learning_rate=a.lr,
        lr_scheduler_type="cosine", warmup_steps=max(1, a.updates // 20), weight_decay=0.0,
        max_grad_norm=1.0, save_strategy="no", report_to="none", disable_tqdm=True,
        logging_steps=max(1, a.updates // 10), dataloader_num_workers=0)


def one_run(mode, seed, data, a):
    path = Path(a.out) / "runs" / f"{mode}_seed{seed}.json"
    if path.is_file():
        return json.loads(path.read_text())
    sets = {split: vit_data.ImageSet(images, labels, MODEL["image_size"], train=False)
            for split, (images, labels) in data.items()}
    model = make_model(seed, a.dropout)
    work = Path(a.out) / "runs" / f".{mode}_seed{seed}"
    timer = step_timer()
    trainer = vit.make_trainer(mode, a.alpha, training_arguments(a, seed, work), model,
                               sets["train"], callbacks=[timer])
    start = time.perf_counter()
    trainer.train()
    wall = time.perf_counter() - start
    shutil.rmtree(work, ignore_errors=True)
    scores = {split: vit.top1(model, sets[split], 128, "cpu") for split in ("valid", "test")}
    result = {"mode": mode, "seed": seed, "alpha": a.alpha if mode == "rdrop" else 0.0,
              "updates": a.updates, "batch_size": a.batch_size, "lr": a.lr,
              "dropout": a.dropout, "threads": torch.get_num_threads(),
              **{f"{split}_accuracy": 100.0 * c / n for split, (c, n) in scores.items()},
              "seconds_per_update": timer.seconds / timer.updates, "train_seconds": wall,
              "mean_train_loss": trainer.state.log_history[-1].get("train_loss")}
    path.parent.mkdir(parents=True, exist_ok=True)
    write_json(path, result)
    return result


def summarise(results, seeds):
    """Mean and standard deviation per arm, and R-Drop - baseline per seed."""
    summary = {}
    for mode in MODES:
        runs = [r for r in results if r["mode"] == mode]
        summary[mode] = {key: list(mean_std([r[key] for r in runs])) for key in
                         ("test_accuracy", "valid_accuracy", "seconds_per_update")}
        summary[mode]["seeds"] = [r["seed"] for r in runs]
    by = {(r["mode"], r["seed"]): r for r in results}
    paired = [by["rdrop", s]["test_accuracy"] - by["baseline", s]["test_accuracy"]
              for s in seeds if ("rdrop", s) in by and ("baseline", s) in by]
    summary["difference"] = {"per_seed": paired,
                             "test_accuracy": list(mean_std(paired)) if paired else None}
    if summary["baseline"]["seeds"] and summary["rdrop"]["seeds"]:
        summary["seconds_ratio"] = (summary["rdrop"]["seconds_per_update"][0]
                                    / summary["baseline"]["seconds_per_update"][0])
    return summary


def table(summary, a):
    lines = ["| arm | seeds | test accuracy (%) | valid accuracy (%) | s / update |",
             "|---|---|---|---|---|"]
    for mode in MODES:
        s = summary[mode]
        if not s["seeds"]:
            continue
        name = f"R-Drop (alpha {a.alpha})" if mode == "rdrop" else "baseline"
        cells = [f"{m:.2f} ± {d:.2f}" for m, d in (s["test_accuracy"], s["valid_accuracy"])]
        seconds = "{:.4f} ± {:.4f}".format(*s["seconds_per_update"])
        lines.append(f"| {name} | {','.join(map(str, s['seeds']))} | {' | '.join(cells)} | "
                     f"{seconds} |")
    diff = summary["difference"]
    if diff["per_seed"]:
        lines.append("")
        lines.append("R-Drop - baseline, test accuracy per seed: "
                     + ", ".join(f"{d:+.2f}" for d in diff["per_seed"])
                     + " (mean {:+.2f} ± {:.2f}); an update takes {:.2f}x a baseline one."
                     .format(*diff["test_accuracy"], summary["seconds_ratio"]))
    return "\n".join(lines) + "\n"


def make_parser():
    p = parser_from_doc(__doc__, prog='python -m experiments.vit_digits_check')
    p.add_argument("--out", required=True, help="the folder for the runs and the summary")
    p.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    p.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    p.add_argument("--updates", type=int, default=1500)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--lr", type=float, default=0.1)
    p.add_argument("--alpha", type=float, default=1.0, help="R-Drop's (default %(default)s)")
    p.add_argument("--dropout", type=float, default=0.2)
    p.add_argument("--threads", type=int, default=1, help="torch's threads (default 1)")
    return p


def main(argv=None):
    p = make_parser()
    a = p.parse_args(argv)
    if a.updates < 1 or a.batch_size < 1 or a.threads < 1 or not 0 <= a.dropout < 1:
        p.error("--updates, --batch-size and --threads must be >= 1, --dropout in [0, 1)")
    torch.set_num_threads(a.threads)
    data = digits()
    results = [one_run(mode, seed, data, a) for seed in a.seeds for mode in a.modes]
    summary = summarise(results, a.seeds)
    import transformers

    out = Path(a.out)
    write_json(out / "summary.json", {
        "command": "python -m experiments.vit_digits_check "
                   + " ".join(sys.argv[1:] if argv is None else argv),
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__},
        "split": SPLIT, "model": MODEL, "summary": summary, "runs": results})
    (out / "summary.md").write_text(table(summary, a))
    print(table(summary, a), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
