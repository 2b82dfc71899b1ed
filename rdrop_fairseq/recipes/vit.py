#!/usr/bin/env python
"""R-Drop for image classification (the paper's appendix A.5) through Hugging Face: a ViT
pre-trained on ImageNet-21k fine-tuned with RDropTrainer (rdrop_fairseq.hf) on CIFAR-100 or
ImageNet, scored by top-1 accuracy. Run by scripts/vit.sh, one stage at a time:

    python -m rdrop_fairseq.recipes.vit prepare cifar100 --cifar-dir work/cifar-100-python \\
        --out work/vit/cifar100
    python -m rdrop_fairseq.recipes.vit prepare imagenet --imagenet-dir /data/imagenet \\
        --out work/vit/imagenet
    python -m rdrop_fairseq.recipes.vit train cifar100 --data work/vit/cifar100 \\
        --vit-dir work/vit-base-patch16-224-in21k --mode rdrop --alpha 1.0 -- \\
        --output_dir checkpoints/vit --max_steps 10000 --per_device_train_batch_size 32 ...
    python -m rdrop_fairseq.recipes.vit evaluate cifar100 --data work/vit/cifar100 \\
        --save-dir checkpoints/vit [--json test.json] [--cpu]

prepare: CIFAR-100's python batches (--cifar-dir: train, test, meta) into OUT/{train,test}.pt,
or an index of ImageNet's class folders (train/ and val/) into OUT/{train,val}.tsv; and
OUT/meta.json (recipes.vit_data). train: everything after "--" is Hugging Face
TrainingArguments (--output_dir is the save dir); a save dir with checkpoint-N folders is
resumed from the last one. The model: --vit-dir's ViT with a new head of the dataset's
classes, zero-initialised (as the ViT paper and ViT-pytorch), --dropout on the hidden
states and --attention-dropout on the attention weights, its position embeddings resized
(linearly, corners kept, as the ViT code does) to --image-size. SGD with --momentum and the
TrainingArguments' learning rate and weight decay. MODE rdrop: R-Drop with --alpha; no-kl:
both passes, alpha 0; baseline and doubled-batch: one pass, the model's own loss. The
fine-tuned model goes to SAVE_DIR/final. evaluate: SAVE_DIR/final on the dataset's test
split (ImageNet's: val), each image resized whole, dropout off: top-1 accuracy, printed and
written to --json.
"""

import json
import shutil
import sys
from pathlib import Path

from . import vit_data
from .common import (add_rdrop_every, check_rdrop_every, need, one_pass_trainer,
                     parser_from_doc, run_stage, write_json)

DATASETS = {"cifar100": "CIFAR-100", "imagenet": "ImageNet"}
MODES = ("rdrop", "no-kl", "baseline", "doubled-batch")
WEIGHTS = ("model.safetensors", "pytorch_model.bin")
VIT_FILES = ("a Hugging Face ViT folder such as vit-base-patch16-224-in21k: config.json and "
             "model.safetensors (or pytorch_model.bin)")
MOMENTUM = 0.9  # the ViT paper's fine-tuning (SGD with momentum), ViT-pytorch's
# TrainingArguments of ours, before the script's (which win): a checkpoint every 1,000
# updates (the ViT code's checkpoint_every), the last two kept, a log line every 50
# updates, no experiment tracker, 4 processes decoding and cropping images (ViT-pytorch's
# num_workers)
OUR_TRAINING_ARGUMENTS = ["--save_strategy", "steps", "--save_steps", "1000",
                          "--save_total_limit", "2", "--logging_steps", "50",
                          "--report_to", "none", "--dataloader_num_workers", "4"]


def check_vit_dir(parser, vit_dir):
    """One-line error unless ``vit_dir`` holds a config and weights."""
    for what, names in (("config", ("config.json",)), ("weights", WEIGHTS)):
        if not any((Path(vit_dir) / name).is_file() for name in names):
            parser.error(f"--vit-dir {vit_dir}: no {' or '.join(names)} ({what}): VIT_DIR "
                         f"must be {VIT_FILES}")


# -------------------------------------------------------------------------------- model

def resize_positions(model, size):
    """Give ``model`` (a ViTForImageClassification) position embeddings for ``size`` x
    ``size`` images: the patch grid's embeddings resized linearly with the corners kept
    (scipy's zoom of order 1, as the ViT paper's code and ViT-pytorch resize them), the
    [CLS] token's kept; the configuration says the new size."""
    import torch

    embeddings = model.vit.embeddings
    patch = model.config.patch_size
    if size % patch:
        raise ValueError(f"the image size {size} is not a multiple of the patch size {patch}")
    old = embeddings.position_embeddings.data
    grid, new = int(round((old.shape[1] - 1) ** 0.5)), size // patch
    if grid != new:
        cells = old[:, 1:].reshape(1, grid, grid, -1).permute(0, 3, 1, 2)
        cells = torch.nn.functional.interpolate(cells.float(), size=(new, new),
                                                mode="bilinear", align_corners=True)
        cells = cells.to(old.dtype).permute(0, 2, 3, 1).reshape(1, new * new, -1)
        embeddings.position_embeddings = torch.nn.Parameter(torch.cat([old[:, :1], cells], 1))
    embeddings.patch_embeddings.image_size = embeddings.image_size = (size, size)
    embeddings.patch_embeddings.num_patches = new * new
    model.config.image_size = size
    return model


def load_model(vit_dir, classes, size, dropout, attention_dropout):
    """The pre-trained ViT of ``vit_dir`` with a new, zero-initialised head for ``classes``
    (the ViT paper's and ViT-pytorch's), the given dropout, at ``size``."""
    import torch
    from transformers import ViTForImageClassification

    model = ViTForImageClassification.from_pretrained(
        vit_dir, num_labels=len(classes), id2label=dict(enumerate(classes)),
        label2id={name: i for i, name in enumerate(classes)},
        problem_type="single_label_classification", hidden_dropout_prob=dropout,
        attention_probs_dropout_prob=attention_dropout)
    with torch.no_grad():
        model.classifier.weight.zero_()
        model.classifier.bias.zero_()
    return resize_positions(model, size)


# -------------------------------------------------------------------------------- train

def training_arguments(parser, argv):
    """TrainingArguments from ours and ``argv`` (the script's and the user's, which win)."""
    from transformers import HfArgumentParser, TrainingArguments

    hf = HfArgumentParser(TrainingArguments)
    hf.prog = f"{parser.prog} train ... --"
    (args,) = hf.parse_args_into_dataclasses(args=OUR_TRAINING_ARGUMENTS + list(argv))
    return args


def make_trainer(mode, alpha, args, model, train_dataset, momentum=MOMENTUM, callbacks=(),
                 every=1, pass_mean=False):
    """RDropTrainer (MODE rdrop: ``alpha``; no-kl: 0; R-Drop on one update in ``every``, its
    loss the mean of the two passes' with ``pass_mean``) or
    a one-pass Trainer (baseline, doubled-batch), with SGD of ``momentum`` and TrainingArguments' learning rate and weight
    decay (its schedule, warm-up and clipping are the Trainer's)."""
    import torch

    from ..hf import RDropTrainer

    common = dict(model=model, args=args, train_dataset=train_dataset,
                  data_collator=vit_data.collate, callbacks=list(callbacks),
                  optimizer_cls_and_kwargs=(torch.optim.SGD, {"lr": args.learning_rate,
                                                              "momentum": momentum}))
    if mode in ("rdrop", "no-kl"):
        return RDropTrainer(**common, rdrop_alpha=alpha if mode == "rdrop" else 0.0,
                            rdrop_every=every, rdrop_pass_mean=pass_mean)
    return one_pass_trainer(**common)


def train(a, parser):
    from transformers.trainer_utils import get_last_checkpoint

    args = training_arguments(parser, a.training_args)
    meta = vit_data.load_meta(a.data)
    save_dir = Path(args.output_dir)
    last = get_last_checkpoint(save_dir) if save_dir.is_dir() else None
    model = load_model(a.vit_dir, meta["classes"], a.image_size, a.dropout,
                       a.attention_dropout)
    train_dataset = vit_data.load_split(a.data, "train", a.image_size, train=True)
    made = not save_dir.exists()
    try:
        try:
            trainer = make_trainer(a.mode, a.alpha, args, model, train_dataset, a.momentum,
                                   every=a.rdrop_every, pass_mean=a.rdrop_pass_mean)
        except ValueError as e:  # options RDropTrainer refuses, e.g. a negative alpha
            raise SystemExit(f"error: {e}") from None
        print(f"[train] {DATASETS[a.dataset]}, MODE={a.mode}"
              + (f", alpha {a.alpha}" if a.mode == "rdrop" else "")
              + f": {len(train_dataset)} images at {a.image_size} x {a.image_size}, "
              f"{args.max_steps} updates of {args.per_device_train_batch_size} x "
              f"{args.gradient_accumulation_steps} x {args.world_size} images"
              + (f"; resuming from {last}" if last else ""), flush=True)
        trainer.train(resume_from_checkpoint=last)
    except BaseException:
        # a run that fails before its first checkpoint leaves no save dir behind; one with
        # checkpoints keeps them, to be resumed
        if made and not any(save_dir.glob("checkpoint-*")) and args.process_index == 0:
            shutil.rmtree(save_dir, ignore_errors=True)
        raise
    final = save_dir / "final"
    trainer.save_model(final)
    if args.process_index == 0:
        write_json(final / "vit.json", {
            "dataset": a.dataset, "classes": meta["classes"], "mode": a.mode,
            "alpha": a.alpha if a.mode == "rdrop" else 0.0, "image_size": a.image_size,
            "vit_dir": str(Path(a.vit_dir).resolve())})
        print(f"[train] the fine-tuned model: {final}", flush=True)


# ----------------------------------------------------------------------------- evaluate

def top1(model, dataset, batch_size, device, workers=0):
    """``(correct, examples)``: ``model``'s highest logit against the label, dropout off."""
    import torch

    loader = torch.utils.data.DataLoader(dataset, batch_size=batch_size, num_workers=workers,
                                         collate_fn=vit_data.collate)
    model.eval()
    correct = 0
    with torch.no_grad():
        for batch in loader:
            logits = model(pixel_values=batch["pixel_values"].to(device)).logits
            correct += int(logits.argmax(-1).cpu().eq(batch["labels"]).sum())
    return correct, len(dataset)


def evaluate(a):
    import torch
    from transformers import ViTForImageClassification

    final = Path(a.save_dir) / "final"
    trained = json.loads((final / "vit.json").read_text())
    if trained["dataset"] != a.dataset:
        raise SystemExit(f"error: {final} was fine-tuned on {trained['dataset']}, not "
                         f"{a.dataset}")
    meta = vit_data.load_meta(a.data)
    if meta["classes"] != trained["classes"]:
        raise SystemExit(f"error: {final} was fine-tuned on other classes than {a.data}'s")
    device = "cuda" if torch.cuda.is_available() and not a.cpu else "cpu"
    model = ViTForImageClassification.from_pretrained(final).to(device)
    split = meta["eval_split"]
    dataset = vit_data.load_split(a.data, split, trained["image_size"], train=False)
    correct, examples = top1(model, dataset, a.batch_size, device, a.workers)
    accuracy = 100.0 * correct / examples
    print(f"{DATASETS[a.dataset]} {split}: top-1 accuracy {accuracy:.2f} ({examples} images)",
          flush=True)
    result = {"dataset": a.dataset, "split": split, "model": str(final),
              "mode": trained["mode"], "alpha": trained["alpha"], "accuracy": accuracy,
              "correct": correct, "examples": examples}
    if a.json:
        write_json(Path(a.json), result)
    return result


# ------------------------------------------------------------------------------ command

def prepare(a):
    out = Path(a.out)
    if a.dataset == "cifar100":
        vit_data.prepare_cifar(a.cifar_dir, out)
    else:
        vit_data.prepare_imagenet(a.imagenet_dir, out)
    meta = vit_data.load_meta(out)
    for split, n in meta["examples"].items():
        print(f"[prepare] {DATASETS[a.dataset]} {split}: {n} images, {len(meta['classes'])} "
              f"classes -> {out}", flush=True)


def make_parser():
    p = parser_from_doc(__doc__, prog='python -m rdrop_fairseq.recipes.vit')
    p.add_argument("stage", choices=("prepare", "train", "evaluate"))
    p.add_argument("dataset", choices=list(DATASETS))
    p.add_argument("--cifar-dir", help="prepare cifar100: a folder holding CIFAR-100's train, "
                                       "test and meta (cifar-100-python.tar.gz's "
                                       "cifar-100-python folder)")
    p.add_argument("--imagenet-dir", help="prepare imagenet: " + vit_data.IMAGENET_LAYOUT)
    p.add_argument("--out", help="prepare: the folder for the prepared dataset")
    p.add_argument("--data", help="train, evaluate: the prepared dataset (prepare's --out)")
    p.add_argument("--vit-dir", help="train: " + VIT_FILES)
    p.add_argument("--mode", choices=MODES, default="rdrop", help="train (default rdrop)")
    p.add_argument("--alpha", type=float, help="train, MODE rdrop: R-Drop's alpha")
    add_rdrop_every(p)
    p.add_argument("--image-size", type=int, default=384,
                   help="train: images are resized to this (default %(default)s)")
    p.add_argument("--dropout", type=float, default=0.1,
                   help="train: on the hidden states (default %(default)s)")
    p.add_argument("--attention-dropout", type=float, default=0.0,
                   help="train: on the attention weights (default %(default)s)")
    p.add_argument("--momentum", type=float, default=MOMENTUM,
                   help="train: SGD's momentum (default %(default)s)")
    p.add_argument("--save-dir", help="evaluate: train's --output_dir")
    p.add_argument("--json", help="evaluate: also write the accuracy to this file")
    p.add_argument("--batch-size", type=int, default=64, help="evaluate: images per forward")
    p.add_argument("--workers", type=int, default=4,
                   help="evaluate: processes reading the images (default %(default)s)")
    p.add_argument("--cpu", action="store_true", help="evaluate: even when a GPU is there")
    return p


def check(a, p):
    """The stage's arguments, each missing or wrong one a one-line error."""
    script = f"DATASET={a.dataset} bash scripts/vit.sh"
    required = {"prepare": ("cifar_dir" if a.dataset == "cifar100" else "imagenet_dir", "out"),
                "train": ("data", "vit_dir"), "evaluate": ("data", "save_dir")}[a.stage]
    for name in required:
        if not getattr(a, name):
            p.error(f"--{name.replace('_', '-')} is required for {a.stage} {a.dataset}")
    if a.stage != "train" and a.training_args:
        p.error(f"arguments after -- are TrainingArguments, for train (not {a.stage})")
    if a.stage in ("train", "evaluate"):
        need(p, "--data", Path(a.data) / "meta.json", f"run: {script} prepare")
        prepared = vit_data.load_meta(a.data).get("dataset")
        if prepared != a.dataset:
            p.error(f"--data {a.data} holds {prepared}, not {a.dataset}")
    if a.stage == "train":
        check_vit_dir(p, a.vit_dir)
        if (a.mode == "rdrop") != (a.alpha is not None):
            p.error("--alpha goes with --mode rdrop (and only with it)")
        check_rdrop_every(p, a)
        if "--output_dir" not in a.training_args:
            p.error("give the save dir as TrainingArguments' --output_dir (after --)")
        if a.image_size < 1 or not (0 <= a.dropout < 1 and 0 <= a.attention_dropout < 1):
            p.error("--image-size must be >= 1, --dropout and --attention-dropout in [0, 1)")
    if a.stage == "evaluate":
        need(p, "--save-dir", Path(a.save_dir) / "final" / "vit.json",
             f"train first: {script} train")
        if a.batch_size < 1 or a.workers < 0:
            p.error("--batch-size must be >= 1 and --workers >= 0")


def parse_args(argv):
    p = make_parser()
    argv = list(argv)
    split = argv.index("--") if "--" in argv else len(argv)
    a = p.parse_args(argv[:split])
    a.training_args = argv[split + 1:]
    check(a, p)
    return a, p


def main(argv=None):
    a, parser = parse_args(sys.argv[1:] if argv is None else argv)
    return run_stage(a, parser, prepare, train, evaluate, vit_data.ImageDataError)


if __name__ == "__main__":
    main()
