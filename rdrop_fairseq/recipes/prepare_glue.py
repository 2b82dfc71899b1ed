#!/usr/bin/env python
"""Binarize GLUE tasks for fairseq's sentence_prediction task (RoBERTa fine-tuning), as
fairseq's examples/roberta/preprocess_GLUE_tasks.sh does, from local files only.

    python -m rdrop_fairseq.recipes.prepare_glue RTE [MRPC ...|ALL] --glue-dir glue_data \\
        --out glue-bin \\
        --bpe-dir gpt2_bpe          # holds encoder.json, vocab.bpe and dict.txt
    # or each file on its own:
        --encoder-json gpt2_bpe/encoder.json --vocab-bpe gpt2_bpe/vocab.bpe \\
        --dict roberta.large/dict.txt

Input: the standard GLUE layout (what the GLUE download script writes): GLUE_DIR/TASK/
train.tsv, dev.tsv and optionally test.tsv (MNLI: dev_matched.tsv, dev_mismatched.tsv,
test_matched.tsv, test_mismatched.tsv). Every file has a header line except CoLA's
train.tsv and dev.tsv; QQP rows without exactly 6 fields are dropped (as fairseq does).

Output, per task, OUT/TASK-bin/ in fairseq's layout:
  input0/, input1/ (pair tasks)  GPT-2 BPE ids binarized with
                                 `fairseq-preprocess --only-source --srcdict DICT`:
                                 train, valid (MNLI: valid = matched, valid1 = mismatched),
                                 test (test1) when the test files exist
  label/                         classification: `fairseq-preprocess --only-source` of the
                                 label column (label dictionary built from train);
                                 STS-B: train.label / valid.label as text, one float a line,
                                 the score divided by 5 (range [0, 1]) as fairseq's script
                                 does (--stsb-scale 1 keeps the raw 0-5 scores)
  processed/                     the intermediate text files (columns, BPE ids)

DICT must be the RoBERTa checkpoint's dict.txt (identical to GPT-2 BPE's dict.txt).
Environment variables: GLUE_DIR, OUT, BPE_DIR, ENCODER_JSON, VOCAB_BPE, ROBERTA_DICT.
"""

import logging
import os
import sys
from dataclasses import dataclass
from multiprocessing import Pool
from pathlib import Path

from .common import made_or_removed, parser_from_doc


@dataclass(frozen=True)
class GlueTask:
    """Where a task's TSVs keep their fields: 1-based column numbers, as in fairseq's
    preprocess_GLUE_tasks.sh (``cut -f``)."""

    inputs: tuple
    test_inputs: tuple
    label: int
    dev_label: int = None          # MNLI: the dev files' gold label column differs
    dev_splits: tuple = ("dev",)
    test_splits: tuple = ("test",)
    header: bool = True            # CoLA: no header in train.tsv / dev.tsv
    num_fields: int = None         # QQP: keep only rows with exactly this many fields
    regression: bool = False


TASKS = {
    "CoLA": GlueTask(inputs=(4,), test_inputs=(2,), label=2, header=False),
    "SST-2": GlueTask(inputs=(1,), test_inputs=(2,), label=2),
    "MRPC": GlueTask(inputs=(4, 5), test_inputs=(4, 5), label=1),
    "QQP": GlueTask(inputs=(4, 5), test_inputs=(2, 3), label=6, num_fields=6),
    "STS-B": GlueTask(inputs=(8, 9), test_inputs=(8, 9), label=10, regression=True),
    "MNLI": GlueTask(inputs=(9, 10), test_inputs=(9, 10), label=12, dev_label=16,
                     dev_splits=("dev_matched", "dev_mismatched"),
                     test_splits=("test_matched", "test_mismatched")),
    "QNLI": GlueTask(inputs=(2, 3), test_inputs=(2, 3), label=4),
    "RTE": GlueTask(inputs=(2, 3), test_inputs=(2, 3), label=4),
}
STSB_SCALE = 5.0  # fairseq: "output range is converted to be between [0.0, 1.0]"


class GlueDataError(Exception):
    """Bad or missing input; the message says what and where."""


def task_name(name):
    """The canonical GLUE name of ``name`` (case-insensitive), or GlueDataError."""
    for task in TASKS:
        if task.lower() == str(name).lower():
            return task
    raise GlueDataError(f"unknown GLUE task {name!r}; the tasks are {', '.join(TASKS)}")


def task_dir(glue_dir, task):
    """GLUE_DIR/TASK, or GLUE_DIR itself when it is the task's folder (named TASK)."""
    glue_dir = Path(glue_dir)
    candidates = [glue_dir / task]
    if glue_dir.resolve().name.lower() == task.lower():
        candidates.append(glue_dir)
    for candidate in candidates:
        if (candidate / "train.tsv").is_file():
            return candidate
    raise GlueDataError(f"no {task}/train.tsv in {glue_dir}: pass --glue-dir the GLUE data "
                        f"folder (with {task}/train.tsv, as the GLUE download script writes "
                        "it) or the task's own folder")


def read_split(task, folder, split):
    """The rows of ``folder/split.tsv`` as ``(inputs, label)``: ``inputs`` a tuple of the
    task's text columns, ``label`` the label column (None for test splits). Header, QQP's
    malformed rows and trailing carriage returns are dropped as fairseq's script does."""
    spec = TASKS[task]
    path = Path(folder) / f"{split}.tsv"
    if not path.is_file():
        raise GlueDataError(f"{path} does not exist (a {task} split)")
    is_test = split.startswith("test")
    columns = spec.test_inputs if is_test else spec.inputs
    label = None
    if not is_test:
        label = spec.dev_label if (spec.dev_label and split != "train") else spec.label
    # split on "\n" only, as `cut` does: GLUE text holds stray "\r" and other line breaks
    with open(path, encoding="utf-8", newline="\n") as f:
        lines = f.read().split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    first = 1 if (spec.header or is_test) else 0
    needed = max(columns + ((label,) if label else ()))
    rows = []
    for number, line in enumerate(lines[first:], start=first + 1):
        fields = line.rstrip("\r").split("\t")
        if spec.num_fields and not is_test and len(fields) != spec.num_fields:
            continue
        if len(fields) < needed:
            raise GlueDataError(f"{path}:{number}: {len(fields)} tab-separated fields, "
                                f"{task} needs {needed} (is this the GLUE {task} data?)")
        rows.append((tuple(fields[c - 1] for c in columns),
                     fields[label - 1] if label else None))
    if not rows:
        raise GlueDataError(f"{path} holds no {task} rows")
    return rows


_ENCODER = None


MRPC_HEADER = "Quality\t#1 ID\t#2 ID\t#1 String\t#2 String\n"


def mrpc_from_senteval(train_txt, test_txt, dev_ids, out):
    """MRPC in the GLUE layout, as GLUE's download script builds it: ``out/train.tsv`` and
    ``out/dev.tsv`` split SentEval's ``msr_paraphrase_train.txt`` by the pairs listed in
    ``mrpc_dev_ids.tsv``, ``out/test.tsv`` numbers the rows of ``msr_paraphrase_test.txt``."""
    out = Path(out)

    def rows(path):
        with open(path, encoding="utf-8-sig", newline="\n") as f:
            lines = f.read().split("\n")[1:]  # after the header
        fields = [line.strip("\r").split("\t") for line in lines if line.strip()]
        bad = [i + 2 for i, row in enumerate(fields) if len(row) != 5]
        if bad:
            raise GlueDataError(f"{path}: line {bad[0]} has not 5 tab-separated fields "
                                "(Quality, #1 ID, #2 ID, #1 String, #2 String)")
        return fields

    with open(dev_ids, encoding="utf-8-sig") as f:
        dev = {tuple(line.split("\t")[:2]) for line in f.read().split("\n") if line.strip()}
    train, held_out = [], []
    for row in rows(train_txt):
        (held_out if (row[1], row[2]) in dev else train).append("\t".join(row) + "\n")
    if len(held_out) != len(dev):
        raise GlueDataError(f"{dev_ids} lists {len(dev)} pairs, {train_txt} holds "
                            f"{len(held_out)} of them: not the files GLUE's MRPC is made from")
    (out / "train.tsv").write_text(MRPC_HEADER + "".join(train), encoding="utf-8")
    (out / "dev.tsv").write_text(MRPC_HEADER + "".join(held_out), encoding="utf-8")
    test = [f"{i}\t" + "\t".join(row[1:]) + "\n" for i, row in enumerate(rows(test_txt))]
    (out / "test.tsv").write_text("index\t#1 ID\t#2 ID\t#1 String\t#2 String\n"
                                  + "".join(test), encoding="utf-8")
    print(f"[glue] MRPC: {len(train)} train, {len(held_out)} dev, {len(test)} test pairs",
          flush=True)


def mrpc_from_downloads(paths, out):
    """MRPC from the source table's downloads (``make`` of ``glue-MRPC``): SentEval's
    train and test files and GLUE's dev ids, in that order."""
    mrpc_from_senteval(*paths, out)


def _init_bpe(encoder_json, vocab_bpe):
    global _ENCODER
    from fairseq.data.encoders.gpt2_bpe_utils import get_encoder

    _ENCODER = get_encoder(encoder_json, vocab_bpe)


def _bpe_line(text):
    # examples/roberta/multiprocessing_bpe_encoder.py --keep-empty: strip, encode, ids
    return " ".join(map(str, _ENCODER.encode(text.strip())))


def bpe_encode(texts, encoder_json, vocab_bpe, workers=1):
    """GPT-2 BPE ids of each text, as space-separated strings."""
    if workers > 1 and len(texts) > 1000:
        with Pool(workers, initializer=_init_bpe, initargs=(encoder_json, vocab_bpe)) as pool:
            return pool.map(_bpe_line, texts, chunksize=500)
    _init_bpe(encoder_json, vocab_bpe)
    return [_bpe_line(t) for t in texts]


def write_lines(path, lines):
    with open(path, "w", encoding="utf-8", newline="\n") as f:
        f.writelines(line + "\n" for line in lines)


def fairseq_preprocess(argv):
    """``fairseq-preprocess ARGV``, run in this process (it costs one fairseq import, not
    one per call); the command is printed first."""
    from fairseq import options
    from fairseq_cli import preprocess

    print("[prepare] fairseq-preprocess " + " ".join(argv), flush=True)
    args = options.get_preprocessing_parser().parse_args(argv)
    log = logging.getLogger("fairseq_cli.preprocess")
    handlers = list(log.handlers)
    try:
        preprocess.main(args)
    finally:  # main() adds a log file handler per call
        for handler in log.handlers[len(handlers):]:
            log.removeHandler(handler)
            handler.close()


def count_unknown(known, bpe_lines):
    """``(tokens, tokens not in known)`` of BPE lines."""
    total = missing = 0
    for line in bpe_lines:
        tokens = line.split()
        total += len(tokens)
        missing += sum(tok not in known for tok in tokens)
    return total, missing


def prepare_task(task, glue_dir, out, encoder_json, vocab_bpe, dict_path, workers=1,
                 stsb_scale=STSB_SCALE):
    """Write ``out`` (a TASK-bin folder) for ``task``; returns the number of rows per split."""
    spec = TASKS[task]
    out = Path(out)
    processed = out / "processed"
    data, tests = read_task(task, task_dir(glue_dir, task))
    for sub in ("processed", "input0", "input1", "label"):
        target = out / sub
        if target.exists():  # a previous run's output (only the folders this script writes)
            for item in target.iterdir():
                item.unlink()
    processed.mkdir(parents=True, exist_ok=True)
    encode_splits(data, len(spec.inputs), processed, encoder_json, vocab_bpe, dict_path,
                  workers)
    for i in range(len(spec.inputs)):
        argv = ["--only-source", "--trainpref", str(processed / f"train.input{i}"),
                "--validpref", split_prefixes(processed, spec.dev_splits, f"input{i}")]
        if tests:
            argv += ["--testpref", split_prefixes(processed, tests, f"input{i}")]
        argv += ["--destdir", str(out / f"input{i}"), "--workers", str(workers),
                 "--srcdict", str(dict_path)]
        fairseq_preprocess(argv)
    if spec.regression:
        write_scores(task, data, out / "label", stsb_scale)
    else:
        binarize_labels(task, data, processed, out / "label", workers)
    counts = {split: len(rows) for split, rows in data.items()}
    print(f"[prepare] {task}: " + ", ".join(f"{s} {n}" for s, n in counts.items())
          + f" rows -> {out}", flush=True)
    return counts


def read_task(task, folder):
    """``(rows per split, test splits)`` of ``task`` from its folder: train, the dev splits
    and the test splits (:func:`read_split`). The test files are optional, but all of them
    or none."""
    spec = TASKS[task]
    tests = [s for s in spec.test_splits if (folder / f"{s}.tsv").is_file()]
    data = {split: read_split(task, folder, split)
            for split in ["train", *spec.dev_splits, *tests]}
    if tests and len(tests) != len(spec.test_splits):
        missing = sorted(set(spec.test_splits) - set(tests))
        raise GlueDataError(f"{folder} has {', '.join(tests)}.tsv but no "
                            f"{', '.join(missing)}.tsv")
    if not tests:
        print(f"[prepare] {task}: no test split in {folder}; binarizing train and dev",
              flush=True)
    return data, tests


def encode_splits(data, n_inputs, processed, encoder_json, vocab_bpe, dict_path, workers):
    """Write into ``processed`` each split's text columns (SPLIT.raw.inputI), their GPT-2
    BPE ids (SPLIT.inputI) and, but for the test splits, the labels (SPLIT.label). Says
    so when BPE tokens are missing from ``dict_path`` (a dictionary of another BPE)."""
    from fairseq.data import Dictionary

    known = set(Dictionary.load(str(dict_path)).indices)
    total = missing = 0
    for split, rows in data.items():
        for i in range(n_inputs):
            texts = [inputs[i] for inputs, _ in rows]
            write_lines(processed / f"{split}.raw.input{i}", texts)
            bpe = bpe_encode(texts, encoder_json, vocab_bpe, workers)
            write_lines(processed / f"{split}.input{i}", bpe)
            counts = count_unknown(known, bpe)
            total, missing = total + counts[0], missing + counts[1]
        if not split.startswith("test"):
            write_lines(processed / f"{split}.label", [label for _, label in rows])
    if missing:  # a dict.txt of another BPE
        print(f"[prepare] WARNING: {missing} of {total} BPE tokens are not in {dict_path} "
              "(they become <unk>): are the dictionary and the BPE files from the same "
              "GPT-2 BPE?", flush=True)


def split_prefixes(processed, splits, key):
    """fairseq-preprocess's comma-separated prefixes of ``splits``' files ``SPLIT.KEY``
    (MNLI's two dev splits become valid and valid1)."""
    return ",".join(str(processed / f"{s}.{key}") for s in splits)


def binarize_labels(task, data, processed, label_dir, workers):
    """A classification task's labels, binarized into ``label_dir`` with a dictionary built
    from train's; a dev label that train never has is refused."""
    spec = TASKS[task]
    train_labels = {label for _, label in data["train"]}
    for split in spec.dev_splits:
        unseen = sorted({label for _, label in data[split]} - train_labels)
        if unseen:
            raise GlueDataError(f"{task} {split}.tsv has labels that train.tsv never "
                                f"has: {', '.join(map(repr, unseen))}")
    fairseq_preprocess(["--only-source", "--trainpref", str(processed / "train.label"),
                        "--validpref", split_prefixes(processed, spec.dev_splits, "label"),
                        "--destdir", str(label_dir), "--workers", str(workers)])


def write_scores(task, data, label_dir, stsb_scale):
    """A regression task's scores as text, ``label_dir/{train,valid}.label``, one float a
    line divided by ``stsb_scale`` (fairseq's regression path reads them so)."""
    label_dir.mkdir(parents=True, exist_ok=True)
    splits = {"train": "train", **{s: "valid" for s in TASKS[task].dev_splits}}
    for split, name in splits.items():
        values = []
        for number, (_, label) in enumerate(data[split], start=1):
            try:
                values.append(float(label))
            except ValueError:
                raise GlueDataError(f"{task} {split}.tsv row {number}: score {label!r} "
                                    "is not a number") from None
        write_lines(label_dir / f"{name}.label", [f"{v / stsb_scale:.6g}" for v in values])


env = os.environ.get  # an option's default: its environment variable


def parse_args(argv):
    p = parser_from_doc(__doc__)
    p.add_argument("tasks", nargs="+", metavar="TASK",
                   help=f"{', '.join(TASKS)} (any case), or ALL")
    p.add_argument("--glue-dir", default=env("GLUE_DIR"),
                   help="the GLUE data folder (GLUE_DIR/TASK/train.tsv ...)")
    p.add_argument("--out", default=env("OUT", "."),
                   help="where OUT/TASK-bin is written (default: the current directory)")
    p.add_argument("--bpe-dir", default=env("BPE_DIR"),
                   help="a folder with encoder.json, vocab.bpe and dict.txt (the default of "
                        "the next three)")
    p.add_argument("--encoder-json", default=env("ENCODER_JSON"), help="GPT-2 encoder.json")
    p.add_argument("--vocab-bpe", default=env("VOCAB_BPE"), help="GPT-2 vocab.bpe")
    p.add_argument("--dict", default=env("ROBERTA_DICT"),
                   help="the RoBERTa checkpoint's dict.txt (fairseq-preprocess --srcdict)")
    p.add_argument("--workers", type=int, default=1, help="BPE and binarization processes")
    p.add_argument("--stsb-scale", type=float, default=STSB_SCALE,
                   help="STS-B scores are divided by this (default 5, as fairseq's script; "
                        "the Pearson/Spearman correlations do not depend on it)")
    a = p.parse_args(argv)
    try:
        names = list(TASKS) if [t.upper() for t in a.tasks] == ["ALL"] else a.tasks
        a.tasks = list(dict.fromkeys(task_name(t) for t in names))
    except GlueDataError as e:
        p.error(str(e))
    if not a.glue_dir:
        p.error("--glue-dir (or $GLUE_DIR) is required")
    if not Path(a.glue_dir).is_dir():
        p.error(f"--glue-dir {a.glue_dir} is not a directory")
    for name, file in (("encoder_json", "encoder.json"), ("vocab_bpe", "vocab.bpe"),
                       ("dict", "dict.txt")):
        if not getattr(a, name) and a.bpe_dir:
            setattr(a, name, str(Path(a.bpe_dir) / file))
        flag = "--" + name.replace("_", "-")
        if not getattr(a, name):
            p.error(f"{flag} (or --bpe-dir) is required: the local {file} "
                    "(nothing is downloaded)")
        if not Path(getattr(a, name)).is_file():
            p.error(f"{flag}: {getattr(a, name)} does not exist")
    if a.stsb_scale <= 0:
        p.error("--stsb-scale must be > 0")
    return a


def main(argv=None):
    a = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        for task in a.tasks:
            task_dir(a.glue_dir, task)  # fail before any work when a task is missing
        for task in a.tasks:
            out = Path(a.out) / f"{task}-bin"
            with made_or_removed(out):  # a failure leaves no half-made OUT/TASK-bin
                prepare_task(task, a.glue_dir, out, a.encoder_json, a.vocab_bpe, a.dict,
                             a.workers, a.stsb_scale)
    except GlueDataError as e:
        sys.exit(f"error: {e}")


if __name__ == "__main__":
    main()
