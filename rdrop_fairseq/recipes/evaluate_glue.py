#!/usr/bin/env python
"""Score a fine-tuned GLUE checkpoint on the task's dev set, with the GLUE metrics.

The checkpoint is loaded with fairseq's RoBERTa hub interface (RobertaModel.from_pretrained,
GPT-2 BPE from local files); the dev TSVs are read from the GLUE folder, encoded as
training saw them (<s> sentence1 </s> </s> sentence2 </s>) and predicted with dropout off.

    python -m rdrop_fairseq.recipes.evaluate_glue RTE \\
        --checkpoint checkpoints/rte-rdrop/checkpoint_best.pt \\
        --data glue-bin/RTE-bin --glue-dir glue_data --bpe-dir gpt2_bpe [--json rte.json]

Metrics (in %, as the paper's table 3): accuracy (SST-2, MNLI, QNLI, RTE), F1 and accuracy
(MRPC, QQP; F1 of the positive class "1"), Matthews correlation (CoLA), Pearson and
Spearman correlation (STS-B). MNLI: dev_matched and dev_mismatched. Prints one line per
dev set and, with --json PATH, writes them. --split NAME scores GLUE_DIR/TASK/NAME.tsv
instead: a labelled split in the dev layout (e.g. a held-out test split with labels).
Environment variables: CHECKPOINT, DATA, GLUE_DIR, BPE_DIR, ENCODER_JSON, VOCAB_BPE.
"""

import json
import logging
import math
import os
import sys
from pathlib import Path

from . import prepare_glue
from .common import need, parser_from_doc

METRICS = {
    "CoLA": ("mcc",),
    "SST-2": ("accuracy",),
    "MRPC": ("f1", "accuracy"),
    "QQP": ("f1", "accuracy"),
    "STS-B": ("pearson", "spearman"),
    "MNLI": ("accuracy",),
    "QNLI": ("accuracy",),
    "RTE": ("accuracy",),
}
POSITIVE_LABEL = "1"  # MRPC: paraphrase, QQP: duplicate


def accuracy(pred, gold):
    return 100.0 * sum(p == g for p, g in zip(pred, gold)) / len(gold)


def f1(pred, gold, positive=POSITIVE_LABEL):
    from sklearn.metrics import f1_score

    return 100.0 * f1_score(gold, pred, pos_label=positive, average="binary",
                            zero_division=0)


def mcc(pred, gold):
    from sklearn.metrics import matthews_corrcoef

    return 100.0 * matthews_corrcoef(gold, pred)


def pearson(pred, gold):
    from scipy.stats import pearsonr

    return 100.0 * float(pearsonr(pred, gold)[0])


def spearman(pred, gold):
    from scipy.stats import spearmanr

    return 100.0 * float(spearmanr(pred, gold)[0])


METRIC_FUNCTIONS = {"accuracy": accuracy, "f1": f1, "mcc": mcc, "pearson": pearson,
                    "spearman": spearman}


def task_metrics(task, pred, gold):
    """``{metric: value in %}`` for ``task`` (GLUE's metrics; see METRICS)."""
    if len(pred) != len(gold) or not gold:
        raise ValueError(f"{len(pred)} predictions for {len(gold)} examples")
    return {name: METRIC_FUNCTIONS[name](pred, gold) for name in METRICS[task]}


def scored(task, split, pred, gold):
    """The task's metrics of one split, printed (with a warning where one is NaN), and
    ``examples``: its number of rows."""
    scores = task_metrics(task, pred, gold)
    print(f"{task} {split}: " + ", ".join(f"{k} {v:.2f}" for k, v in scores.items())
          + f" ({len(gold)} examples)", flush=True)
    if any(math.isnan(v) for v in scores.values()):
        print(f"[evaluate] WARNING: a NaN metric on {split} (constant predictions?)",
              file=sys.stderr)
    return {**scores, "examples": len(gold)}


def dev_splits(task):
    return prepare_glue.TASKS[task].dev_splits


def load_model(checkpoint, data, encoder_json, vocab_bpe, cpu=False):
    import rdrop_fairseq  # noqa: F401 (torch >= 2.6: allow-lists fairseq checkpoints)
    import torch
    from fairseq.models.roberta import RobertaModel

    # from_pretrained logs the whole training config at INFO
    logging.getLogger("fairseq.models.roberta.model").setLevel(logging.WARNING)

    checkpoint = Path(checkpoint).resolve()
    roberta = RobertaModel.from_pretrained(
        str(checkpoint.parent), checkpoint_file=checkpoint.name,
        data_name_or_path=str(Path(data).resolve()), bpe="gpt2",
        gpt2_encoder_json=str(Path(encoder_json).resolve()),
        gpt2_vocab_bpe=str(Path(vocab_bpe).resolve()))
    roberta.eval()
    if not cpu and torch.cuda.is_available():
        roberta.cuda()
    return roberta


def head_name(roberta):
    name = getattr(getattr(roberta.cfg, "criterion", None), "classification_head_name", None)
    heads = list(roberta.model.classification_heads)
    if name in heads:
        return name
    if len(heads) == 1:
        return heads[0]
    raise SystemExit(f"error: the checkpoint has classification heads {heads}; none is "
                     f"the criterion's {name!r}")


def predict(roberta, rows, regression, batch_size=32, desc=None):
    """Predicted label strings (regression: floats) for ``rows`` of input texts."""
    import torch
    from fairseq.data.data_utils import collate_tokens
    from tqdm import tqdm

    head = head_name(roberta)
    dictionary = roberta.task.source_dictionary
    labels = roberta.task.label_dictionary
    max_positions = roberta.model.max_positions()
    encoded = []
    truncated = 0
    for inputs in rows:
        tokens = roberta.encode(*(text.strip() for text in inputs))
        if len(tokens) > max_positions:
            truncated += 1
            tokens = torch.cat([tokens[:max_positions - 1], tokens[-1:]])
        encoded.append(tokens)
    if truncated:
        print(f"[evaluate] {truncated} examples longer than {max_positions} tokens were "
              "truncated", file=sys.stderr)
    order = sorted(range(len(encoded)), key=lambda i: len(encoded[i]))
    predictions = [None] * len(encoded)
    with torch.no_grad():
        for start in tqdm(range(0, len(order), batch_size), desc=desc, unit="batch",
                          file=sys.stderr):
            index = order[start:start + batch_size]
            batch = collate_tokens([encoded[i] for i in index], pad_idx=dictionary.pad())
            logits = roberta.predict(head, batch, return_logits=True).float().cpu()
            if regression:
                values = logits[:, 0].tolist()
            else:
                values = [labels[int(c) + labels.nspecial] for c in logits.argmax(dim=-1)]
            for i, value in zip(index, values):
                predictions[i] = value
    return predictions


def evaluate(a):
    roberta = load_model(a.checkpoint, a.data, a.encoder_json, a.vocab_bpe, a.cpu)
    regression = bool(getattr(roberta.cfg.criterion, "regression_target", False))
    if regression != prepare_glue.TASKS[a.task].regression:
        raise SystemExit(f"error: {a.checkpoint} was trained "
                         f"{'for regression' if regression else 'as a classifier'}; "
                         f"{a.task} is {'regression' if not regression else 'classification'}")
    folder = prepare_glue.task_dir(a.glue_dir, a.task)
    results = {}
    for split in a.split or dev_splits(a.task):
        rows = prepare_glue.read_split(a.task, folder, split)
        pred = predict(roberta, [inputs for inputs, _ in rows], regression, a.batch_size,
                       desc=f"{a.task} {split}")
        gold = [float(label) if regression else label for _, label in rows]
        results[split] = scored(a.task, split, pred, gold)
    return results


env = os.environ.get  # an option's default: its environment variable


def parse_args(argv):
    p = parser_from_doc(__doc__)
    p.add_argument("task", help=f"{', '.join(METRICS)} (any case)")
    p.add_argument("--checkpoint", default=env("CHECKPOINT"),
                   help="the fine-tuned checkpoint (SAVE_DIR/checkpoint_best.pt)")
    p.add_argument("--data", default=env("DATA"),
                   help="the task's data-bin (its dictionaries; recipes.prepare_glue)")
    p.add_argument("--glue-dir", default=env("GLUE_DIR"),
                   help="the GLUE data folder with TASK/dev.tsv")
    p.add_argument("--bpe-dir", default=env("BPE_DIR"),
                   help="a folder with encoder.json and vocab.bpe")
    p.add_argument("--encoder-json", default=env("ENCODER_JSON"))
    p.add_argument("--vocab-bpe", default=env("VOCAB_BPE"))
    p.add_argument("--split", action="append", metavar="NAME",
                   help="score GLUE_DIR/TASK/NAME.tsv (labelled, in the dev layout) instead "
                        "of the dev set(s); repeatable")
    p.add_argument("--batch-size", type=int, default=32, help="sentences per forward")
    p.add_argument("--cpu", action="store_true", help="even when a GPU is there")
    p.add_argument("--json", help="also write the metrics to this file")
    a = p.parse_args(argv)
    try:
        a.task = prepare_glue.task_name(a.task)
    except prepare_glue.GlueDataError as e:
        p.error(str(e))
    for name in ("checkpoint", "data", "glue_dir"):
        if not getattr(a, name):
            p.error(f"--{name.replace('_', '-')} (or ${name.upper()}) is required")
    script = f"TASK={a.task} bash scripts/glue.sh"
    need(p, "--data", Path(a.data) / "input0" / "dict.txt", f"run: {script} prepare")
    need(p, "--checkpoint", a.checkpoint, f"train first: {script} train")
    for name, file in (("encoder_json", "encoder.json"), ("vocab_bpe", "vocab.bpe")):
        if not getattr(a, name) and a.bpe_dir:
            setattr(a, name, str(Path(a.bpe_dir) / file))
        flag, path = "--" + name.replace("_", "-"), getattr(a, name)
        if not path:
            p.error(f"{flag} (or --bpe-dir) is required: the local {file}")
        if not Path(path).is_file():
            p.error(f"{flag}: {path} does not exist")
    if a.batch_size < 1:
        p.error("--batch-size must be >= 1")
    for split in a.split or ():
        if split.startswith("test"):  # read_split reads test* files as GLUE's, unlabelled
            p.error(f"--split {split}: GLUE's test files have no labels; name a labelled "
                    "split otherwise (e.g. heldout.tsv)")
    return a


def main(argv=None):
    a = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        results = evaluate(a)
    except prepare_glue.GlueDataError as e:
        sys.exit(f"error: {e}")
    if a.json:
        Path(a.json).write_text(json.dumps({"task": a.task, "checkpoint": str(a.checkpoint),
                                            "metrics": results}, indent=2) + "\n")


if __name__ == "__main__":
    main()
