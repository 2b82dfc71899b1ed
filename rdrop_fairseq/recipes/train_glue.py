#!/usr/bin/env python
"""Fine-tune RoBERTa-large on a GLUE task with fairseq-hydra-train: R-Drop, or by one
switch the baseline, with the paper's per-task settings.

configs/roberta_glue_rdrop.yaml holds the settings common to all tasks; this script adds
the task's row of the paper's table (appendix table 1): max updates, batch size
(sentences), alpha; and: number of classes (MNLI 3, STS-B 1: regression, others 2),
warmup 6% of max updates, the metric that picks checkpoint_best.pt (what the paper
reports: Matthews correlation for CoLA, Pearson correlation for STS-B, accuracy for the
others; MRPC and QQP also log F1), and for MNLI validation on both dev sets.

Modes:
  rdrop     R-Drop (the default): criterion sentence_prediction_rdrop, the task's alpha
  baseline  criterion.rdrop_alpha=0: exactly fairseq's sentence_prediction

    python -m rdrop_fairseq.recipes.train_glue RTE --data glue-bin/RTE-bin \\
        --roberta-checkpoint roberta.large/model.pt --save-dir checkpoints/rte-rdrop \\
        [--mode baseline] [--alpha 0.5] [--seed 2] [--max-update N] [--update-freq 2]
    # anything after -- is passed to fairseq-hydra-train as overrides, e.g.
    python -m rdrop_fairseq.recipes.train_glue RTE ... -- common.fp16=true
    # no pre-trained model: --from-scratch instead of --roberta-checkpoint (a randomly
    # initialised model; give its size and learning rate as overrides)
    python -m rdrop_fairseq.recipes.train_glue SST-2 --from-scratch ... -- model.encoder_layers=2 ...

Every option with a value has an environment variable: DATA, SAVE_DIR, ROBERTA_CHECKPOINT,
MODE, ALPHA, SEED, MAX_UPDATE, UPDATE_FREQ (the switches --from-scratch, --cpu, --fp16 have
none). One GPU, as the paper (fairseq runs on every visible GPU:
set CUDA_VISIBLE_DEVICES). --update-freq N keeps the paper's batch by running it as N
batches of batch/N sentences (R-Drop doubles each batch in memory).
"""

import argparse
import os
import sys
from dataclasses import dataclass
from pathlib import Path

from .common import base_command, launch, parse_with_overrides  # noqa: E402
CONFIG = "roberta_glue_rdrop"
MODES = ("rdrop", "baseline")
# fairseq's examples/roberta GLUE configs: warmup = 6% of max updates (their table differs
# for QQP, 28318 = 25%, and STS-B, 214; the authors' QNLI script: 1986 = 6% of 33112)
WARMUP_RATIO = 0.06


@dataclass(frozen=True)
class GlueSettings:
    max_update: int
    batch_size: int
    alpha: float
    num_classes: int = 2
    metric: str = "accuracy"        # checkpoint_best.pt: what the paper reports
    report: str = None              # the criterion's report_* option for that metric

    @property
    def regression(self):
        return self.num_classes == 1


# The paper's appendix table 1 (RoBERTa-large; reference/rdrop-method.md).
TASKS = {
    "CoLA": GlueSettings(5336, 16, 0.5, metric="mcc", report="report_mcc"),
    "MRPC": GlueSettings(2296, 16, 1.0, report="report_acc_and_f1"),
    "RTE": GlueSettings(3120, 8, 1.0),
    "SST-2": GlueSettings(20935, 32, 1.0),
    "MNLI": GlueSettings(123873, 32, 0.5, num_classes=3),
    "QNLI": GlueSettings(33112, 32, 1.0),
    "QQP": GlueSettings(113272, 32, 0.5, report="report_acc_and_f1"),
    "STS-B": GlueSettings(3598, 16, 1.0, num_classes=1, metric="pearson",
                          report="report_pearson_and_spearman"),
}
PAIR_TASKS = {"MRPC", "RTE", "MNLI", "QNLI", "QQP", "STS-B"}  # two inputs: input0, input1


def warmup_updates(max_update):
    return int(WARMUP_RATIO * max_update)


def task_name(name):
    for task in TASKS:
        if task.lower() == str(name).lower():
            return task
    return None


env = os.environ.get  # an option's default: its environment variable


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("task", help=f"{', '.join(TASKS)} (any case)")
    p.add_argument("--data", default=env("DATA"),
                   help="the task's data-bin (rdrop_fairseq.recipes.prepare_glue's OUT/TASK-bin)")
    p.add_argument("--roberta-checkpoint", default=env("ROBERTA_CHECKPOINT"),
                   help="the pre-trained model to fine-tune (roberta.large/model.pt)")
    p.add_argument("--from-scratch", action="store_true",
                   help="no --roberta-checkpoint: train a randomly initialised model "
                        "(resuming from SAVE_DIR/checkpoint_last.pt when there is one)")
    p.add_argument("--save-dir", default=env("SAVE_DIR"))
    p.add_argument("--mode", default=env("MODE", "rdrop"), help=" or ".join(MODES))
    p.add_argument("--alpha", type=float, default=env("ALPHA"),
                   help="R-Drop alpha (default: the paper's for the task)")
    p.add_argument("--seed", type=int, default=int(env("SEED", 1)))
    p.add_argument("--max-update", type=int, default=env("MAX_UPDATE"),
                   help="default: the paper's for the task; warmup stays 6%% of it")
    p.add_argument("--update-freq", type=int, default=int(env("UPDATE_FREQ", 1)),
                   help="run the paper's batch as N batches of batch/N sentences")
    p.add_argument("--cpu", action="store_true", help="train on the CPU")
    p.add_argument("--fp16", action="store_true", help="common.fp16=true (GPU)")
    a = parse_with_overrides(p, argv)
    task = task_name(a.task)
    if task is None:
        p.error(f"unknown GLUE task {a.task!r}; the tasks are {', '.join(TASKS)}")
    a.task = task
    if a.mode not in MODES:
        p.error(f"--mode (or $MODE) must be one of {', '.join(MODES)}, not {a.mode!r}")
    if a.mode == "baseline" and a.alpha not in (None, 0):
        p.error(f"--alpha {a.alpha} contradicts --mode baseline (which has no R-Drop term)")
    if a.alpha is not None and not a.alpha >= 0:
        p.error(f"--alpha must be >= 0, not {a.alpha}")
    if a.from_scratch and a.roberta_checkpoint:
        p.error(f"--from-scratch contradicts --roberta-checkpoint {a.roberta_checkpoint} "
                "(or $ROBERTA_CHECKPOINT)")
    for name in ("data", "save_dir") + (() if a.from_scratch else ("roberta_checkpoint",)):
        if not getattr(a, name):
            hint = " (or --from-scratch)" if name == "roberta_checkpoint" else ""
            p.error(f"--{name.replace('_', '-')} (or ${name.upper()}) is required{hint}")
    if not a.from_scratch and not Path(a.roberta_checkpoint).is_file():
        p.error(f"--roberta-checkpoint {a.roberta_checkpoint} does not exist (download and "
                "unpack roberta.large: docs/glue.md)")
    if a.max_update is not None and a.max_update < 1:
        p.error("--max-update must be >= 1")
    batch = TASKS[task].batch_size
    if a.update_freq < 1 or batch % a.update_freq:
        p.error(f"--update-freq {a.update_freq} does not divide {task}'s batch of {batch}")
    problem = check_data(task, Path(a.data))
    if problem:
        p.error(problem)
    return a


def check_data(task, data):
    """What is wrong with ``data`` as ``task``'s data-bin, or None."""
    settings = TASKS[task]
    hint = f"run rdrop_fairseq.recipes.prepare_glue {task}"
    inputs = ("input0", "input1") if task in PAIR_TASKS else ("input0",)
    for key in inputs:
        for file in ("dict.txt", "train.bin", "valid.bin"):
            if not (data / key / file).is_file():
                return f"{data} is not a {task} data-bin (no {key}/{file}): {hint}"
    if settings.regression:
        for split in ("train", "valid"):
            if not (data / "label" / f"{split}.label").is_file():
                return f"{data} has no label/{split}.label ({task} scores): {hint}"
        return None
    label_dict = data / "label" / "dict.txt"
    if not label_dict.is_file():
        return f"{data} has no label/dict.txt: {hint}"
    labels = [line.split()[0] for line in label_dict.read_text(encoding="utf-8").splitlines()
              if line.strip() and not line.startswith("madeupword")]
    if len(labels) != settings.num_classes:
        return (f"{label_dict} lists {len(labels)} labels ({', '.join(labels)}); {task} has "
                f"{settings.num_classes}: is {data} the {task} data-bin?")
    return None


def hydra_command(a):
    s = TASKS[a.task]
    max_update = a.max_update or s.max_update
    alpha = 0.0 if a.mode == "baseline" else (s.alpha if a.alpha is None else a.alpha)
    if a.from_scratch:  # fairseq's default: resume SAVE_DIR/checkpoint_last.pt, if any
        restore = ["checkpoint.restore_file=checkpoint_last.pt",
                   "checkpoint.reset_optimizer=false", "checkpoint.reset_dataloader=false",
                   "checkpoint.reset_meters=false"]
    else:
        restore = [f"checkpoint.restore_file={Path(a.roberta_checkpoint).resolve()}"]
    cmd = base_command(CONFIG, a) + restore + [
           f"task.num_classes={s.num_classes}",
           f"criterion.rdrop_alpha={alpha}",
           f"criterion.regression_target={str(s.regression).lower()}",
           f"dataset.batch_size={s.batch_size // a.update_freq}",
           f"optimization.update_freq=[{a.update_freq}]",
           f"optimization.max_update={max_update}",
           f"lr_scheduler.warmup_updates={warmup_updates(max_update)}",
           f"checkpoint.best_checkpoint_metric={s.metric}",
           "checkpoint.maximize_best_checkpoint_metric=true"]
    if s.report:
        cmd.append(f"criterion.{s.report}=true")
    if a.task == "MNLI":  # valid = dev_matched, valid1 = dev_mismatched; best by matched
        cmd.append("dataset.valid_subset='valid,valid1'")  # quoted: hydra reads a,b as a sweep
    if a.cpu:
        cmd.append("common.cpu=true")
    if a.fp16:
        cmd.append("common.fp16=true")
    return cmd + a.overrides


def main(argv=None):
    a = parse_args(sys.argv[1:] if argv is None else argv)
    launch(hydra_command(a), a.save_dir)


if __name__ == "__main__":
    main()
