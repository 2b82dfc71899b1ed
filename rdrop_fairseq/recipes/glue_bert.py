#!/usr/bin/env python
"""The paper's BERT-base GLUE row through Hugging Face: tokenise, fine-tune with
RDropTrainer (rdrop_fairseq.hf), score the dev set. Run by scripts/glue_bert.sh, one
stage at a time:

    python -m rdrop_fairseq.recipes.glue_bert prepare RTE --glue-dir glue_data \\
        --bert-dir bert-base-uncased --out glue-bert/RTE
    python -m rdrop_fairseq.recipes.glue_bert train RTE --data glue-bert/RTE \\
        --bert-dir bert-base-uncased --mode rdrop --alpha 1.0 -- \\
        --output_dir checkpoints/rte --max_steps 3120 --per_device_train_batch_size 8 ...
    python -m rdrop_fairseq.recipes.glue_bert evaluate RTE --data glue-bert/RTE \\
        --save-dir checkpoints/rte [--json dev.json] [--cpu]

prepare: the task's train and dev TSVs (read as recipes.prepare_glue reads them) tokenised
with BERT's own tokenizer, sentence pairs as [CLS] a [SEP] b [SEP] with token types 0 and
1, at most 128 tokens (run_glue's max_seq_length), into OUT/{train,DEV}.jsonl and
OUT/meta.json (the task, its labels: those of train, sorted; STS-B: the 0-5 score as it is).
train: everything after "--" is Hugging Face TrainingArguments (--output_dir is the save
dir); a save dir with checkpoint-N folders is resumed from the last one. MODE rdrop: R-Drop
with --alpha; no-kl: both passes, alpha 0; baseline and doubled-batch: one pass, the
model's own loss (transformers.Trainer). The fine-tuned model goes to SAVE_DIR/final.
evaluate: SAVE_DIR/final on the dev set(s) (MNLI: matched and mismatched) with the paper's
metric for the task (recipes.evaluate_glue's), printed and written to --json.
"""

import json
import shutil
import sys
from pathlib import Path

from . import prepare_glue
from .common import (add_rdrop_every, check_rdrop_every, made_or_removed, need,
                     one_pass_trainer, parser_from_doc, run_stage, write_json)
from .evaluate_glue import METRICS, scored

MAX_LENGTH = 128  # run_glue's max_seq_length
FEATURES = ("input_ids", "token_type_ids")  # what prepare keeps of the tokenizer's output
MODES = ("rdrop", "no-kl", "baseline", "doubled-batch")
WEIGHTS = ("model.safetensors", "pytorch_model.bin")
TOKENIZER = ("tokenizer.json", "vocab.txt")
BERT_FILES = ("a Hugging Face BERT folder such as bert-base-uncased: config.json, "
              "model.safetensors (or pytorch_model.bin) and tokenizer.json (or vocab.txt)")
# TrainingArguments of ours, before the script's (which win): a checkpoint every 500
# updates (run_glue's), only the last two kept (a BERT-base checkpoint with its optimizer
# state is 1.3 GB), a log line every 50 updates, no experiment tracker
OUR_TRAINING_ARGUMENTS = ["--save_strategy", "steps", "--save_steps", "500",
                          "--save_total_limit", "2", "--logging_steps", "50",
                          "--report_to", "none"]
# the learning rate warms up linearly over this fraction of the updates, then decays
# linearly to 0 (TrainingArguments' default schedule): fairseq's RoBERTa GLUE recipe (6 %,
# polynomial decay of power 1) and the authors' bert_rdrop/run.sh
WARMUP = 0.06


def check_bert_dir(parser, bert_dir):
    """One-line error unless ``bert_dir`` holds a config, weights and a tokenizer."""
    bert_dir = Path(bert_dir)
    for what, names in (("config", ("config.json",)), ("weights", WEIGHTS),
                        ("tokenizer", TOKENIZER)):
        if not any((bert_dir / name).is_file() for name in names):
            parser.error(f"--bert-dir {bert_dir}: no {' or '.join(names)} ({what}): BERT_DIR "
                         f"must be {BERT_FILES}")


def read_jsonl(path):
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def load_meta(data):
    return json.loads((Path(data) / "meta.json").read_text())


# ------------------------------------------------------------------------------ prepare

def prepare(a):
    from transformers import AutoTokenizer

    spec = prepare_glue.TASKS[a.task]
    folder = prepare_glue.task_dir(a.glue_dir, a.task)
    splits = {split: prepare_glue.read_split(a.task, folder, split)
              for split in ("train", *spec.dev_splits)}
    labels = None
    if not spec.regression:
        labels = sorted({label for _, label in splits["train"]})
        for split in spec.dev_splits:
            unseen = sorted({label for _, label in splits[split]} - set(labels))
            if unseen:
                raise prepare_glue.GlueDataError(
                    f"{folder / split}.tsv has labels {unseen} that train.tsv has not")
    tokenizer = AutoTokenizer.from_pretrained(a.bert_dir)
    out = Path(a.out)
    with made_or_removed(out):
        out.mkdir(parents=True, exist_ok=True)
        for split, rows in splits.items():
            columns = list(zip(*(inputs for inputs, _ in rows)))
            encoded = tokenizer(*[[text.strip() for text in column] for column in columns],
                                truncation=True, max_length=a.max_length)
            with open(out / f"{split}.jsonl", "w", encoding="utf-8") as f:
                for i, (_, label) in enumerate(rows):
                    example = {key: encoded[key][i] for key in FEATURES if key in encoded}
                    example["label"] = float(label) if spec.regression else label
                    f.write(json.dumps(example) + "\n")
            print(f"[prepare] {a.task} {split}: {len(rows)} examples -> {out / split}.jsonl",
                  flush=True)
        write_json(out / "meta.json", {
            "task": a.task, "labels": labels, "dev_splits": list(spec.dev_splits),
            "max_length": a.max_length, "bert_dir": str(Path(a.bert_dir).resolve()),
            "examples": {split: len(rows) for split, rows in splits.items()}})


# -------------------------------------------------------------------------------- train

def training_arguments(parser, argv, warmup=WARMUP):
    """TrainingArguments from ours (a warm-up over ``warmup`` of the updates among them) and
    ``argv`` (the script's and the user's, which win)."""
    from transformers import HfArgumentParser, TrainingArguments

    from ..hf import warmup_arguments

    hf = HfArgumentParser(TrainingArguments)
    hf.prog = f"{parser.prog} train ... --"
    ours = OUR_TRAINING_ARGUMENTS + warmup_arguments(warmup)
    (args,) = hf.parse_args_into_dataclasses(args=ours + list(argv))
    return args


def examples(rows, labels):
    """Trainer examples: token ids, token types and the label (class index, or the score)."""
    index = {label: i for i, label in enumerate(labels or ())}
    return [{**{key: row[key] for key in FEATURES if key in row},
             "labels": index[row["label"]] if labels else row["label"]} for row in rows]


def make_trainer(a, args, model, tokenizer, train_dataset):
    from transformers import DataCollatorWithPadding

    from ..hf import RDropTrainer

    common = dict(model=model, args=args, train_dataset=train_dataset,
                  data_collator=DataCollatorWithPadding(tokenizer), processing_class=tokenizer)
    if a.mode in ("rdrop", "no-kl"):
        return RDropTrainer(**common, rdrop_alpha=a.alpha if a.mode == "rdrop" else 0.0,
                            rdrop_impl=a.rdrop_impl, rdrop_every=a.rdrop_every,
                            rdrop_pass_mean=a.rdrop_pass_mean)
    return one_pass_trainer(**common)


def train(a, parser):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer
    from transformers.trainer_utils import get_last_checkpoint

    args = training_arguments(parser, a.training_args, a.warmup)
    meta = load_meta(a.data)
    if meta["task"] != a.task:
        parser.error(f"--data {a.data} holds {meta['task']}, not {a.task}")
    labels = meta["labels"]
    save_dir = Path(args.output_dir)
    last = get_last_checkpoint(save_dir) if save_dir.is_dir() else None
    tokenizer = AutoTokenizer.from_pretrained(a.bert_dir)
    head = (dict(num_labels=len(labels), problem_type="single_label_classification",
                 id2label=dict(enumerate(labels)),
                 label2id={label: i for i, label in enumerate(labels)})
            if labels else dict(num_labels=1, problem_type="regression"))
    model = AutoModelForSequenceClassification.from_pretrained(a.bert_dir, **head)
    train_dataset = examples(read_jsonl(Path(a.data) / "train.jsonl"), labels)
    made = not save_dir.exists()
    try:
        try:
            trainer = make_trainer(a, args, model, tokenizer, train_dataset)
        except ValueError as e:  # options RDropTrainer refuses, e.g. a negative alpha
            raise SystemExit(f"error: {e}") from None
        print(f"[train] {a.task}, MODE={a.mode}"
              + (f", alpha {a.alpha}" if a.mode == "rdrop" else "")
              + f": {len(train_dataset)} examples, {args.max_steps} updates of "
              f"{args.per_device_train_batch_size} x {args.gradient_accumulation_steps} "
              f"examples" + (f"; resuming from {last}" if last else ""), flush=True)
        trainer.train(resume_from_checkpoint=last)
    except BaseException:
        # a run that fails before its first checkpoint leaves no save dir behind; one with
        # checkpoints keeps them, to be resumed
        if made and not any(save_dir.glob("checkpoint-*")):
            shutil.rmtree(save_dir, ignore_errors=True)
        raise
    final = save_dir / "final"
    trainer.save_model(final)
    write_json(final / "glue.json", {"task": a.task, "labels": labels, "mode": a.mode,
                                     "alpha": a.alpha if a.mode == "rdrop" else 0.0})
    print(f"[train] the fine-tuned model: {final}", flush=True)


# ----------------------------------------------------------------------------- evaluate

def predict(model, rows, batch_size, device):
    """Class indices (or regression values) for ``rows``, one forward per batch, dropout off,
    batches of similar lengths."""
    import torch

    pad = model.config.pad_token_id or 0
    order = sorted(range(len(rows)), key=lambda i: len(rows[i]["input_ids"]))
    out = [None] * len(rows)
    model.eval()
    with torch.no_grad():
        for start in range(0, len(order), batch_size):
            index = order[start:start + batch_size]
            length = max(len(rows[i]["input_ids"]) for i in index)
            batch = {key: torch.tensor([rows[i][key] + [fill] * (length - len(rows[i][key]))
                                        for i in index], device=device)
                     for key, fill in (("input_ids", pad), ("token_type_ids", 0))
                     if key in rows[index[0]]}
            batch["attention_mask"] = torch.tensor(
                [[1] * len(rows[i]["input_ids"]) + [0] * (length - len(rows[i]["input_ids"]))
                 for i in index], device=device)
            logits = model(**batch).logits.float().cpu()
            values = logits[:, 0].tolist() if logits.size(-1) == 1 else logits.argmax(-1).tolist()
            for i, value in zip(index, values):
                out[i] = value
    return out


def evaluate(a):
    import torch
    from transformers import AutoModelForSequenceClassification

    final = Path(a.save_dir) / "final"
    trained = json.loads((final / "glue.json").read_text())
    if trained["task"] != a.task:
        raise SystemExit(f"error: {final} was fine-tuned on {trained['task']}, not {a.task}")
    meta = load_meta(a.data)
    labels = trained["labels"]
    device = "cuda" if torch.cuda.is_available() and not a.cpu else "cpu"
    model = AutoModelForSequenceClassification.from_pretrained(final).to(device)
    results = {}
    for split in meta["dev_splits"]:
        rows = read_jsonl(Path(a.data) / f"{split}.jsonl")
        values = predict(model, rows, a.batch_size, device)
        pred = values if labels is None else [labels[v] for v in values]
        gold = [row["label"] for row in rows]
        results[split] = scored(a.task, split, pred, gold)
    if a.json:
        write_json(Path(a.json), {"task": a.task, "model": str(final), "mode": trained["mode"],
                                  "alpha": trained["alpha"], "metrics": results})
    return results


# ------------------------------------------------------------------------------ command

def parse_args(argv):
    p = parser_from_doc(__doc__, prog='python -m rdrop_fairseq.recipes.glue_bert')
    p.add_argument("stage", choices=("prepare", "train", "evaluate"))
    p.add_argument("task", help=f"{', '.join(METRICS)} (any case)")
    p.add_argument("--glue-dir", help="prepare: the GLUE data folder (TASK/train.tsv, dev.tsv)")
    p.add_argument("--bert-dir", help="prepare, train: " + BERT_FILES)
    p.add_argument("--out", help="prepare: the folder for the tokenised task")
    p.add_argument("--max-length", type=int, default=MAX_LENGTH,
                   help="prepare: tokens per example at most (default %(default)s)")
    p.add_argument("--data", help="train, evaluate: the prepared task (prepare's --out)")
    p.add_argument("--mode", choices=MODES, default="rdrop", help="train (default rdrop)")
    p.add_argument("--alpha", type=float, help="train, MODE rdrop: R-Drop's alpha")
    p.add_argument("--rdrop-impl", choices=("auto", "torch", "triton"), default="auto",
                   help="train: the R-Drop loss's implementation (default auto)")
    add_rdrop_every(p)
    p.add_argument("--warmup", type=float, default=WARMUP, metavar="FRACTION",
                   help="train: warm the learning rate up over this fraction of the updates "
                        "(default %(default)s; 0: none)")
    p.add_argument("--save-dir", help="evaluate: train's --output_dir")
    p.add_argument("--json", help="evaluate: also write the metrics to this file")
    p.add_argument("--batch-size", type=int, default=32, help="evaluate: examples per forward")
    p.add_argument("--cpu", action="store_true", help="evaluate: even when a GPU is there")
    argv = list(argv)
    split = argv.index("--") if "--" in argv else len(argv)
    a = p.parse_args(argv[:split])
    a.training_args = argv[split + 1:]
    try:
        a.task = prepare_glue.task_name(a.task)
    except prepare_glue.GlueDataError as e:
        p.error(str(e))
    script = f"TASK={a.task} bash scripts/glue_bert.sh"
    required = {"prepare": ("glue_dir", "bert_dir", "out"), "train": ("data", "bert_dir"),
                "evaluate": ("data", "save_dir")}[a.stage]
    for name in required:
        if not getattr(a, name):
            p.error(f"--{name.replace('_', '-')} is required for {a.stage}")
    if a.stage != "train" and a.training_args:
        p.error(f"arguments after -- are TrainingArguments, for train (not {a.stage})")
    if a.stage in ("prepare", "train"):
        check_bert_dir(p, a.bert_dir)
    if a.stage in ("train", "evaluate"):
        need(p, "--data", Path(a.data) / "meta.json", f"run: {script} prepare")
    if a.stage == "train":
        if (a.mode == "rdrop") != (a.alpha is not None):
            p.error("--alpha goes with --mode rdrop (and only with it)")
        check_rdrop_every(p, a)
        if "--output_dir" not in a.training_args:
            p.error("give the save dir as TrainingArguments' --output_dir (after --)")
        if not 0 <= a.warmup < 1:
            p.error(f"--warmup is a fraction of the updates, in [0, 1): got {a.warmup}")
    if a.stage == "evaluate":
        need(p, "--save-dir", Path(a.save_dir) / "final" / "glue.json",
             f"train first: {script} train")
        if a.batch_size < 1:
            p.error("--batch-size must be >= 1")
    return a, p


def main(argv=None):
    a, parser = parse_args(sys.argv[1:] if argv is None else argv)
    return run_stage(a, parser, prepare, train, evaluate, prepare_glue.GlueDataError)


if __name__ == "__main__":
    main()
