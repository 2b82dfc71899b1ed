#!/usr/bin/env python
"""Prepare CNN/DailyMail for BART fine-tuning: GPT-2 BPE, then fairseq-preprocess with BART's
dictionary.

What fairseq's examples/bart/README.summarization.md does, with every file local:

* ``RAW/{train,val,test}.{source,target}``: one article / one summary a line, untokenised
  and cased (the layout of that README; ``test`` is optional: the evaluation reads the raw
  ``test.source`` / ``test.target``);
* GPT-2 byte-level BPE of every line (stripped; an empty line stays empty, like fairseq's
  ``multiprocessing_bpe_encoder --keep-empty``) with the ``encoder.json`` / ``vocab.bpe``
  given, into ``OUT/bpe/{split}.bpe.{source,target}`` (BPE ids separated by spaces);
* with ``--prepend-bos``, ``<s>`` before every line's ids (see below);
* ``fairseq-preprocess --source-lang source --target-lang target --srcdict DICT --tgtdict
  DICT`` with the ``dict.txt`` of the BART checkpoint, into ``OUT/bin``.

``--prepend-bos`` is for a BART trained from scratch. fairseq's BART hub interface, which
evaluate_summarization.py decodes with, puts ``<s>`` before every article and forces ``<s>``
as the first summary token, as in BART's pre-training data. bart.large has seen that; a
model trained from scratch on data without ``<s>`` has not, and decodes from tokens it never
saw. Fine-tuning bart.large keeps the default (no ``<s>``), as fairseq's README and the
paper do.

Nothing is downloaded: fetch encoder.json, vocab.bpe and dict.txt (fairseq's gpt2_bpe files)
and bart.large yourself (docs/summarization.md).

    python -m rdrop_fairseq.recipes.prepare_cnndm --raw cnn_dm --out work/cnn_dm \\
        --encoder-json gpt2_bpe/encoder.json --vocab-bpe gpt2_bpe/vocab.bpe \\
        --dict bart.large/dict.txt --workers 16

Environment variables: RAW, OUT, GPT2_ENCODER_JSON, GPT2_VOCAB_BPE, BART_DICT, WORKERS.
"""

import multiprocessing
import os
import subprocess
import sys
from pathlib import Path

from .common import fairseq_cli, made_or_removed, parser_from_doc

SPLITS = ("train", "val", "test")
REQUIRED_SPLITS = ("train", "val")
SIDES = ("source", "target")

_encoder = None  # one GPT-2 encoder per worker process
_prefix = ""  # "<s> " with --prepend-bos


def _init_encoder(encoder_json, vocab_bpe, prefix=""):
    global _encoder, _prefix
    from fairseq.data.encoders.gpt2_bpe_utils import get_encoder

    _encoder, _prefix = get_encoder(encoder_json, vocab_bpe), prefix


def _encode(line):
    line = line.strip()
    return (_prefix + " ".join(map(str, _encoder.encode(line)))).strip()


def bpe_encode_file(src, dest, encoder_json, vocab_bpe, workers=1, prepend_bos=False):
    """GPT-2 BPE ids of every line of ``src`` into ``dest`` (streamed), each line after
    ``<s>`` if ``prepend_bos`` (fairseq-preprocess maps it to the dictionary's bos).
    Returns the count."""
    init_args = (encoder_json, vocab_bpe, "<s> " if prepend_bos else "")
    dest.parent.mkdir(parents=True, exist_ok=True)
    n = 0
    # newline="\n": a line ends at "\n" only (a stray "\r" inside an article must not split
    # it, or source and target would fall out of step)
    with open(src, encoding="utf-8", newline="\n") as fin, \
            open(dest, "w", encoding="utf-8") as fout:
        if workers <= 1:
            _init_encoder(*init_args)
            encoded = map(_encode, fin)
            pool = None
        else:
            pool = multiprocessing.Pool(workers, _init_encoder, init_args)
            encoded = pool.imap(_encode, fin, chunksize=256)
        try:
            for n, ids in enumerate(encoded, 1):
                fout.write(ids + "\n")
        finally:
            if pool is not None:
                pool.close()
                pool.join()
    return n


def _one_line(text):
    return text.replace("\r", " ").replace("\n", " ")


# the splits of Hugging Face's abisee/cnn_dailymail 3.0.0 parquet files, by file name
PARQUET_SPLITS = {"train": "train", "validation": "val", "test": "test"}


def from_parquet(paths, raw):
    """RAW/{train,val,test}.{source,target} from the parquet files of Hugging Face's
    ``abisee/cnn_dailymail`` 3.0.0 (columns ``article``, ``highlights``): one article / one
    summary a line, the highlights joined by spaces (the parquet files join them by
    newlines; fairseq's files, made by See et al.'s scripts, by spaces). Needs pyarrow
    (the recipes' extra)."""
    try:
        import pyarrow.parquet as pq
    except ImportError:
        sys.exit("error: reading CNN/DailyMail's parquet files needs pyarrow: "
                 "pip install 'rdrop-fairseq[recipes]' (or pip install pyarrow)")
    raw = Path(raw)
    by_split = {}
    for path in sorted(paths):
        split = next((v for k, v in PARQUET_SPLITS.items() if f"{k}-0" in Path(path).name),
                     None)
        if split is None:
            sys.exit(f"error: {path}: not a train/validation/test parquet file of CNN/DailyMail")
        by_split.setdefault(split, []).append(path)
    for split, files in by_split.items():
        n = 0
        with open(raw / f"{split}.source", "w", encoding="utf-8") as src, \
                open(raw / f"{split}.target", "w", encoding="utf-8") as tgt:
            for path in files:
                table = pq.read_table(path, columns=["article", "highlights"])
                for article, highlights in zip(*(table.column(c).to_pylist()
                                                 for c in ("article", "highlights"))):
                    src.write(_one_line(article) + "\n")
                    tgt.write(_one_line(highlights) + "\n")
                    n += 1
        print(f"[cnndm] {split}: {n} articles from {', '.join(Path(f).name for f in files)}",
              flush=True)


def count_lines(path):
    with open(path, "rb") as f:
        return sum(1 for _ in f)


def check_inputs(raw, encoder_json, vocab_bpe, dict_txt):
    """The splits to prepare; exits with a message naming what is missing."""
    missing = [f"{name} (--{opt} or ${env}): " + (f"no file {path}" if path else "not given")
               for name, path, opt, env in (
                   ("GPT-2 encoder.json", encoder_json, "encoder-json", "GPT2_ENCODER_JSON"),
                   ("GPT-2 vocab.bpe", vocab_bpe, "vocab-bpe", "GPT2_VOCAB_BPE"),
                   ("BART dict.txt", dict_txt, "dict", "BART_DICT"))
               if path is None or not Path(path).is_file()]
    if missing:
        sys.exit("error: " + "; ".join(missing) + ". Download fairseq's "
                 "gpt2_bpe/encoder.json, gpt2_bpe/vocab.bpe and the dict.txt of the BART "
                 "checkpoint (see docs/summarization.md) and pass their local paths.")
    first = Path(dict_txt).read_text(encoding="utf-8").split("\n", 1)[0].split()
    if not first or not first[0].isdigit():
        sys.exit(f"error: {dict_txt} is not a GPT-2 BPE dictionary (its entries are BPE ids, "
                 f"e.g. '13 850314647'; the first line is {' '.join(first)!r}): pass the "
                 "dict.txt of the BART checkpoint")
    if raw is None or not Path(raw).is_dir():
        sys.exit(f"error: CNN/DM directory {raw} not found (--raw, $RAW): it must hold "
                 "{train,val,test}.{source,target}, one article / summary a line")
    raw = Path(raw)
    absent = [f"{s}.{side}" for s in REQUIRED_SPLITS for side in SIDES
              if not (raw / f"{s}.{side}").is_file()]
    if absent:
        sys.exit(f"error: {raw} lacks {', '.join(absent)} (expected "
                 "{train,val,test}.{source,target}, one article / summary a line)")
    splits = [s for s in SPLITS if all((raw / f"{s}.{side}").is_file() for side in SIDES)]
    for split in splits:
        counts = {side: count_lines(raw / f"{split}.{side}") for side in SIDES}
        if counts["source"] != counts["target"]:
            sys.exit(f"error: {raw / split}.source has {counts['source']} lines but "
                     f"{split}.target has {counts['target']}: one summary per article")
    return splits


def binarize(bpe_dir, dest, dict_txt, splits, workers):
    cmd = [fairseq_cli("fairseq-preprocess"),
           "--source-lang", "source", "--target-lang", "target",
           "--trainpref", str(bpe_dir / "train.bpe"), "--validpref", str(bpe_dir / "val.bpe"),
           "--destdir", str(dest), "--workers", str(workers),
           "--srcdict", str(dict_txt), "--tgtdict", str(dict_txt)]
    if "test" in splits:
        cmd += ["--testpref", str(bpe_dir / "test.bpe")]
    print("[prepare] " + " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True)


def parse_args(argv=None):
    env = os.environ.get
    p = parser_from_doc(__doc__)
    p.add_argument("--raw", default=env("RAW"),
                   help="directory with {train,val,test}.{source,target}")
    p.add_argument("--out", default=env("OUT"),
                   help="output directory: OUT/bpe (BPE text), OUT/bin (the data-bin)")
    p.add_argument("--encoder-json", default=env("GPT2_ENCODER_JSON"),
                   help="local GPT-2 encoder.json")
    p.add_argument("--vocab-bpe", default=env("GPT2_VOCAB_BPE"), help="local GPT-2 vocab.bpe")
    p.add_argument("--dict", default=env("BART_DICT"),
                   help="the dict.txt of the BART checkpoint (bart.large/dict.txt)")
    p.add_argument("--workers", type=int, default=int(env("WORKERS", 1)))
    p.add_argument("--prepend-bos", action="store_true",
                   help="start every article and summary with <s>, as the BART hub interface "
                        "does at inference: for a model trained from scratch (not bart.large)")
    a = p.parse_args(argv)
    if not a.out:
        p.error("--out (or $OUT) is required")
    return a


def main(argv=None):
    a = parse_args(argv)
    splits = check_inputs(a.raw, a.encoder_json, a.vocab_bpe, a.dict)
    raw, out = Path(a.raw), Path(a.out)
    with made_or_removed(out):  # a failure leaves no half-made OUT
        if "test" not in splits:
            print("[prepare] no test.{source,target}: binarizing train and val only", flush=True)
        for split in splits:
            for side in SIDES:
                n = bpe_encode_file(raw / f"{split}.{side}", out / "bpe" / f"{split}.bpe.{side}",
                                    a.encoder_json, a.vocab_bpe, a.workers, a.prepend_bos)
                print(f"[prepare] {split}.{side}: {n} lines GPT-2 BPE encoded", flush=True)
        binarize(out / "bpe", out / "bin", a.dict, splits, a.workers)
        print(f"[prepare] data-bin: {out / 'bin'}", flush=True)


if __name__ == "__main__":
    main()
