#!/usr/bin/env python
"""Prepare a translation corpus for fairseq: tokenise, clean, joint BPE, binarize.

What fairseq's examples/translation/prepare-iwslt14.sh does, without perl or git clones:
Moses tokenisation with sacremoses, optional lower-casing, training pairs cleaned by length
(1..max-len tokens, length ratio <= max-ratio), a joint BPE learnt on the training data with
subword-nmt, and ``fairseq-preprocess --joined-dictionary``.

Input: ``RAW/{train,valid,test}.{SRC,TGT}``, one sentence per line; or ``--libreoffice``
to take the corpus committed in data/libreoffice-help-de-en (de-en). With
``--valid-from-train N`` there is no RAW/valid: every N-th cleaned training pair becomes
the validation set instead (fairseq's IWSLT14 recipe uses N = 23).

    python scripts/prepare_translation.py --libreoffice --out work/lo-de-en --bpe-merges 8000
    python scripts/prepare_translation.py --raw iwslt14/raw --src de --tgt en --lowercase \\
        --bpe-merges 10000 --out work/iwslt14.de-en

Writes ``OUT/tok``, ``OUT/bpe`` (text), ``OUT/bpe.codes`` and ``OUT/bin`` (the data-bin).
"""

import argparse
import random
import subprocess
import sys
from pathlib import Path

from sacremoses import MosesTokenizer
from subword_nmt.apply_bpe import BPE
from subword_nmt.learn_bpe import learn_bpe

REPO = Path(__file__).resolve().parents[1]
SPLITS = ("train", "valid", "test")


def export_libreoffice(raw, train_pairs=None, eval_pairs=None, seed=0):
    """Write the committed LibreOffice help corpus as RAW/{split}.{de,en}.

    ``train_pairs``: a random subset (fixed by ``seed``) of that many training pairs;
    ``eval_pairs``: the first that many validation and test pairs.
    """
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from prepare_libreoffice_corpus import read_pairs

    raw.mkdir(parents=True, exist_ok=True)
    for split in SPLITS:
        pairs = read_pairs(REPO / "data" / "libreoffice-help-de-en" / f"{split}.tsv.xz")
        if split == "train" and train_pairs:
            pairs = random.Random(seed).sample(pairs, min(train_pairs, len(pairs)))
        elif split != "train" and eval_pairs:
            pairs = pairs[:eval_pairs]
        for side, lang in ((0, "de"), (1, "en")):
            (raw / f"{split}.{lang}").write_text("".join(p[side] + "\n" for p in pairs),
                                                 encoding="utf-8")


def read_lines(path):
    if not path.is_file():
        sys.exit(f"error: {path} not found (expected RAW/{{train,valid,test}}.{{src,tgt}})")
    return path.read_text(encoding="utf-8").splitlines()


def tokenize(lines, lang, lowercase):
    tok = MosesTokenizer(lang=lang)
    out = [tok.tokenize(line, escape=False, return_str=True) for line in lines]
    return [line.lower() for line in out] if lowercase else out


def clean(src, tgt, max_len, max_ratio):
    """Training pairs with 1..max_len tokens a side and a length ratio <= max_ratio."""
    kept = []
    for s, t in zip(src, tgt):
        ls, lt = len(s.split()), len(t.split())
        if 1 <= ls <= max_len and 1 <= lt <= max_len and max(ls, lt) <= max_ratio * min(ls, lt):
            kept.append((s, t))
    return [s for s, _ in kept], [t for _, t in kept]


def write_lines(path, lines):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    src_group = p.add_mutually_exclusive_group(required=True)
    src_group.add_argument("--raw", type=Path, help="directory with {train,valid,test}.{src,tgt}")
    src_group.add_argument("--libreoffice", action="store_true",
                           help="use data/libreoffice-help-de-en (de-en)")
    p.add_argument("--src", default="de")
    p.add_argument("--tgt", default="en")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--bpe-merges", type=int, default=10000)
    p.add_argument("--lowercase", action="store_true")
    p.add_argument("--max-len", type=int, default=175)
    p.add_argument("--max-ratio", type=float, default=1.5)
    p.add_argument("--valid-from-train", type=int, metavar="N",
                   help="hold out every N-th cleaned training pair as the validation set")
    p.add_argument("--workers", type=int, default=1)
    a = p.parse_args()

    raw = a.raw
    if a.libreoffice:
        raw = a.out / "raw"
        export_libreoffice(raw)
    tok = {}
    for split in SPLITS:
        if split == "valid" and a.valid_from_train:
            continue  # taken from train below
        src = tokenize(read_lines(raw / f"{split}.{a.src}"), a.src, a.lowercase)
        tgt = tokenize(read_lines(raw / f"{split}.{a.tgt}"), a.tgt, a.lowercase)
        if len(src) != len(tgt):
            sys.exit(f"error: {split}: {len(src)} {a.src} lines but {len(tgt)} {a.tgt} lines")
        if split == "train":
            src, tgt = clean(src, tgt, a.max_len, a.max_ratio)
            if a.valid_from_train:
                n = a.valid_from_train  # line numbers 1-based, as awk 'NR % n == 0'
                tok["valid"] = (src[n - 1::n], tgt[n - 1::n])
                src = [s for i, s in enumerate(src, 1) if i % n]
                tgt = [t for i, t in enumerate(tgt, 1) if i % n]
        tok[split] = (src, tgt)
    for split in SPLITS:
        src, tgt = tok[split]
        write_lines(a.out / "tok" / f"{split}.{a.src}", src)
        write_lines(a.out / "tok" / f"{split}.{a.tgt}", tgt)
        print(f"[prepare] {split}: {len(src)} pairs tokenised", flush=True)

    codes = a.out / "bpe.codes"
    with open(codes, "w", encoding="utf-8") as out:
        learn_bpe(tok["train"][0] + tok["train"][1], out, a.bpe_merges)
    with open(codes, encoding="utf-8") as f:
        bpe = BPE(f)
    for split in SPLITS:
        src, tgt = tok[split]
        write_lines(a.out / "bpe" / f"{split}.{a.src}", [bpe.process_line(s) for s in src])
        write_lines(a.out / "bpe" / f"{split}.{a.tgt}", [bpe.process_line(t) for t in tgt])
    print(f"[prepare] joint BPE with {a.bpe_merges} merges: {codes}", flush=True)

    preprocess = Path(sys.executable).parent / "fairseq-preprocess"
    bpe_dir = a.out / "bpe"
    subprocess.run([str(preprocess), "--source-lang", a.src, "--target-lang", a.tgt,
                    "--trainpref", bpe_dir / "train", "--validpref", bpe_dir / "valid",
                    "--testpref", bpe_dir / "test", "--destdir", a.out / "bin",
                    "--joined-dictionary", "--workers", str(a.workers)], check=True)
    print(f"[prepare] data-bin: {a.out / 'bin'}", flush=True)


if __name__ == "__main__":
    main()
