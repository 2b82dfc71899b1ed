#!/usr/bin/env python
"""Prepare an IWSLT TED corpus as fairseq's examples/translation/prepare-iwslt14.sh does.

From the official archive of a pair (``de-en.tgz`` etc., or the same WIT3 layout as a zip,
as the Hugging Face hub serves IWSLT17's ``en-zh.zip``: a local path, or a URL that is
downloaded when online): training text from ``train.tags.PAIR.LANG`` without its markup
lines, the test set from the TED dev/tst XML files (dev2010, dev2012, tst2010-2012 for
IWSLT14 de-en), then ``prepare_translation.py`` with the recipe's settings: Moses
tokenisation, lower-casing for De<->En (as the authors' prepare-iwslt14.sh; the other
pairs keep their case, for the paper's sacreBLEU, which is case-sensitive: ``--lowercase``
/ ``--no-lowercase`` to choose), cleaning (1-175 tokens, ratio 1.5), every 23rd training
pair held out as validation, joint BPE (10k merges) and fairseq-preprocess. The test
references stay as they are in ``OUT/raw/test.LANG`` (``’`` -> ``'``, as fairseq's
script), which evaluate_translation.py scores sacreBLEU against.

    python -m rdrop_fairseq.recipes.prepare_iwslt --archive de-en.tgz --src de --tgt en \\
        --out work/iwslt14.de-en
    python -m rdrop_fairseq.recipes.prepare_iwslt --archive https://.../de-en.tgz --src de \\
        --tgt en --out ...       # fetched into --downloads first

IWSLT14 de-en: scripts/iwslt14.sh fetches fairseq's mirror of the archive (the source
table's ``iwslt14-de-en``: python -m rdrop_fairseq.recipes.fetch --list). For the other
pairs, which no live host serves, pass the archive of the same format (``train.tags.PAIR.*``
and ``IWSLT*.TED*.xml``).
IWSLT17 En<->Zh (``en-zh.zip`` from the Hugging Face hub's ``IWSLT/iwslt2017``, which
scripts/iwslt14.sh fetches, or ``en-zh.tgz``) is prepared as the paper's separate dictionaries: one
sentencepiece BPE model per language on the raw text (which segments the Chinese), no
lower-casing, training pairs of 1-175 pieces without a length-ratio filter (Chinese and
English piece counts are not comparable), ``--vocab-size`` pieces per language.
"""

import argparse
import re
import subprocess
import sys
import os
from pathlib import Path

from . import fetch as downloader
from .fetch.archive import Unreadable, UnsafeMember, unpack
from .common import made_or_removed, parser_from_doc

_MARKUP = ("<url>", "<talkid>", "<keywords>")
_TAGS = re.compile(r"</?(title|description)>")
_SEG = re.compile(r"<seg id=\"?\d+\"?>\s*(.*?)\s*</seg>")


def fetch(archive, downloads):
    """A local archive as is, or a URL fetched into ``downloads`` (resumed, kept: a second
    run reuses it; rdrop_fairseq.recipes.fetch)."""
    if re.match(r"^[a-z]+://", archive):
        target = Path(downloads) / archive.rsplit("/", 1)[-1]
        try:
            return downloader.fetch([archive], target,
                                    local_hint="pass a local archive with --archive")
        except (downloader.FetchError, ValueError) as e:
            sys.exit(f"error: {e}")
    if not Path(archive).is_file():
        sys.exit(f"error: no archive {archive}")
    return Path(archive)


def train_lines(path):
    """``train.tags`` text: markup lines dropped, title/description tags removed."""
    lines = Path(path).read_text(encoding="utf-8").splitlines()
    return [_TAGS.sub("", line).strip() for line in lines
            if not any(tag in line for tag in _MARKUP)]


def xml_segments(path):
    text = Path(path).read_text(encoding="utf-8")
    return [seg.replace("\u2019", "'") for seg in _SEG.findall(text)]


def test_files(root, pair, lang):
    """The TED dev/tst sets of a pair in fairseq's order: dev sets, then tst, by year."""
    files = [f for f in Path(root).rglob(f"IWSLT*.TED*.{pair}.{lang}.xml")]

    def order(f):
        m = re.search(r"\.(dev|tst)(\d{4})\.", f.name)
        return (m[1] != "dev", int(m[2])) if m else (2, 0)
    return sorted(files, key=order)


def extract(archive, src, tgt, raw):
    pair = f"{src}-{tgt}" if Path(archive).name.startswith(f"{src}-{tgt}") else f"{tgt}-{src}"
    work = raw.parent / "orig"
    try:  # a tgz, or the Hugging Face hub's zip (IWSLT17): the same layout
        unpack(archive, work)
    except UnsafeMember as e:
        sys.exit(f"error: {archive} holds an unsafe path {e.member!r}")
    except Unreadable as e:
        sys.exit(f"error: {archive} cannot be extracted ({e}): fetch it again, or give "
                 "another --archive")
    raw.mkdir(parents=True, exist_ok=True)
    for lang in (src, tgt):
        train = list(work.rglob(f"train.tags.{pair}.{lang}"))
        if not train:
            sys.exit(f"error: {archive} holds no train.tags.{pair}.{lang}")
        (raw / f"train.{lang}").write_text("\n".join(train_lines(train[0])) + "\n",
                                           encoding="utf-8")
        tests = test_files(work, pair, lang)
        if not tests:
            sys.exit(f"error: {archive} holds no IWSLT*.TED*.{pair}.{lang}.xml test sets")
        segments = [seg for f in tests for seg in xml_segments(f)]
        (raw / f"test.{lang}").write_text("\n".join(segments) + "\n", encoding="utf-8")
        print(f"[iwslt] {lang}: test from {', '.join(f.name for f in tests)}", flush=True)


def main():
    p = parser_from_doc(__doc__)
    p.add_argument("--archive", required=True, help="path or URL of the pair's archive")
    p.add_argument("--src", required=True)
    p.add_argument("--tgt", required=True)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--downloads", type=Path,
                   default=Path(os.environ.get("DOWNLOADS", "work/downloads")),
                   help="where an --archive URL is fetched to (default: $DOWNLOADS or "
                        "work/downloads)")
    p.add_argument("--bpe-merges", type=int, default=10000)
    p.add_argument("--vocab-size", type=int, default=10000, help="per language, for zh pairs")
    p.add_argument("--lowercase", action=argparse.BooleanOptionalAction,
                   help="lower-case the Moses tokens (default: for De<->En only)")
    a = p.parse_args()
    if a.lowercase is None:
        a.lowercase = {a.src, a.tgt} == {"de", "en"}
    if a.lowercase and "zh" in (a.src, a.tgt):
        p.error("--lowercase applies to Moses tokens; zh pairs use sentencepiece on raw text")
    with made_or_removed(a.out):  # a failure leaves no half-made OUT
        a.out.mkdir(parents=True, exist_ok=True)
        archive = fetch(a.archive, a.downloads)
        extract(archive, a.src, a.tgt, a.out / "raw")
        if "zh" in (a.src, a.tgt):
            subword = ["--subword", "sentencepiece", "--separate-dictionaries",
                       "--vocab-size", str(a.vocab_size), "--max-ratio", "0"]
        else:
            subword = ["--lowercase"] * a.lowercase + ["--bpe-merges", str(a.bpe_merges),
                                                        "--max-ratio", "1.5"]
        subprocess.run([sys.executable, "-m", "rdrop_fairseq.recipes.prepare_translation",
                        "--raw", str(a.out / "raw"), "--src", a.src, "--tgt", a.tgt,
                        "--out", str(a.out), "--max-len", "175", "--valid-from-train", "23",
                        *subword], check=True)


if __name__ == "__main__":
    main()
