#!/usr/bin/env python
"""Prepare WMT14 En-De or En-Fr: Google's preprocessed WMT'16 En-De, or fairseq's
examples/translation/prepare-wmt14en2{de,fr}.sh.

``--google DIR`` (En-De, the way to compare with the paper): the files of Google's
preprocessed WMT'16 En-De archive (``wmt16_en_de.tar.gz``, extracted into DIR), which the
authors point to (dropreg/R-Drop issue #19: fairseq issue #202, the Scaling NMT recipe).
Made by (an earlier version of) google/seq2seq's bin/data/wmt16_en_de.sh: Europarl v7,
Common Crawl and News Commentary v11, Moses-tokenised without hyphen splitting, a 32k BPE;
newstest2013 as validation, newstest2014 as test. They are binarised as
fairseq's examples/scaling_nmt/README.md does::

    fairseq-preprocess --source-lang en --target-lang de \\
        --trainpref DIR/train.tok.clean.bpe.32000 --validpref DIR/newstest2013.tok.bpe.32000 \\
        --testpref DIR/newstest2014.tok.bpe.32000 --destdir OUT/bin \\
        --nwordssrc 32768 --nwordstgt 32768 --joined-dictionary

Otherwise (``--orig``), from the official archives in a directory (scripts/wmt14.sh fetches
them there: ``python -m rdrop_fairseq.recipes.fetch --dir ORIG NAME ...``, names from
``CORPORA`` below):

* training text: the concatenated corpora below, Moses punctuation normalisation,
  non-printing characters removed, Moses tokenisation with aggressive hyphen splitting
  (``-a``: ``a-b`` -> ``a @-@ b``);
* validation: every 100th (En-De) / 1333rd (En-Fr) training line, before cleaning;
* test: newstest2014 (``test-full``) from the SGML, with ``’`` -> ``'``, tokenised ``-a``;
* a joint subword-nmt BPE learnt on the training text, then training and validation pairs
  cleaned after BPE (1-250 subwords, ratio 1.5), test kept whole; fairseq-preprocess with
  a joined dictionary.

    python -m rdrop_fairseq.recipes.prepare_wmt14 --google wmt16_en_de_bpe32k \\
        --out work/wmt16-google.en-de
    python -m rdrop_fairseq.recipes.prepare_wmt14 --pair en-de --orig work/wmt14-orig \\
        --out work/wmt14.en-de
    python -m rdrop_fairseq.recipes.prepare_wmt14 --pair en-de \\
        --icml17 ...   # news-commentary v9 instead of v12
    python -m rdrop_fairseq.recipes.prepare_wmt14 --pair en-fr --orig ... \\
        --out work/wmt14.en-fr --workers 16

``--bpe-merges`` defaults to the paper's ~32k joint vocabulary (fairseq's scripts use 40000).
"""

import gzip
import os
import re
import subprocess
import sys
import tarfile
from pathlib import Path

from . import fetch as downloader
from .common import ArgumentParser, fairseq_cli, made_or_removed

# "archives": the source table's names (rdrop_fairseq/recipes/sources.json: file, URLs,
# checksum); scripts/wmt14.sh fetches them into ORIG
CORPORA = {
    "en-de": {
        "archives": ["wmt13-europarl-v7", "wmt13-commoncrawl", "wmt17-nc-v12", "wmt14-test-full"],
        "train": ["training/europarl-v7.de-en", "commoncrawl.de-en",
                  "training/news-commentary-v12.de-en"],
        "test": "test-full/newstest2014-deen-{role}.{lang}.sgm",
        "valid_every": 100,
    },
    "en-fr": {
        "archives": ["wmt13-europarl-v7", "wmt13-commoncrawl", "wmt13-un", "wmt14-nc-v9",
                     "wmt10-giga-fren", "wmt14-test-full"],
        "train": ["training/europarl-v7.fr-en", "commoncrawl.fr-en", "un/undoc.2000.fr-en",
                  "training/news-commentary-v9.fr-en", "giga-fren.release2.fixed"],
        "test": "test-full/newstest2014-fren-{role}.{lang}.sgm",
        "valid_every": 1333,
    },
}
ICML17 = {  # fairseq's --icml17: the ConvS2S paper's WMT14 En-De (news-commentary v9)
    "archive": "wmt14-nc-v9",
    "corpus": "training/news-commentary-v9.de-en",
}
# Google's WMT'16 En-De (examples/scaling_nmt/README.md): the fairseq-preprocess prefixes
GOOGLE = {"train": "train.tok.clean.bpe.32000", "valid": "newstest2013.tok.bpe.32000",
          "test": "newstest2014.tok.bpe.32000"}
GOOGLE_VOCAB = 32768  # --nwordssrc / --nwordstgt of the Scaling NMT recipe
_SEG = re.compile(r"<seg id=\"?\d+\"?>\s*(.*?)\s*</seg>")


def corpora(pair, icml17=False):
    spec = {k: list(v) if isinstance(v, list) else v for k, v in CORPORA[pair].items()}
    if icml17:
        if pair != "en-de":
            sys.exit("error: --icml17 applies to en-de only")
        spec["archives"][2], spec["train"][2] = ICML17["archive"], ICML17["corpus"]
    return spec


def extract(sources, orig, into):
    """Each archive of ``sources`` (source table names) from ``orig``, extracted once into
    ``into``. Nothing is downloaded here: scripts/wmt14.sh fetches them into its default
    ORIG."""
    table = downloader.load_sources()
    unknown = [name for name in sources if name not in table]
    if unknown:
        sys.exit(f"error: the source table has no {', '.join(unknown)} (RDROP_SOURCES="
                 f"{os.environ.get('RDROP_SOURCES', '')!s} replaces the packaged one?)")
    files = [(name, table[name]["files"][0]["name"]) for name in sources]
    missing = [(name, f) for name, f in files if not (orig / f).is_file()]
    if missing:
        sys.exit(f"error: {orig} lacks {', '.join(f for _, f in missing)}: fetch "
                 f"{'them' if len(missing) > 1 else 'it'} with python -m "
                 f"rdrop_fairseq.recipes.fetch --dir {orig} "
                 f"{' '.join(name for name, _ in missing)} (docs/data.md)")
    into.mkdir(parents=True, exist_ok=True)
    for _, name in files:
        archive = orig / name
        done = into / f".{archive.name}.extracted"
        if not done.exists():
            print(f"[wmt14] extracting {archive.name}", flush=True)
            try:
                with tarfile.open(archive) as tar:
                    tar.extractall(into, filter="data")
            except (tarfile.TarError, EOFError) as e:
                sys.exit(f"error: {archive} cannot be extracted ({e}); delete it and fetch "
                         "it again")
            done.touch()


def read_corpus(orig, name, lang):
    """Lines of ``orig/NAME.LANG`` (or ``.LANG.gz``, as giga-fren ships)."""
    path = orig / f"{name}.{lang}"
    if path.is_file():
        return path.read_text(encoding="utf-8", errors="replace").splitlines()
    if path.with_name(path.name + ".gz").is_file():
        with gzip.open(path.with_name(path.name + ".gz"), "rt", encoding="utf-8",
                       errors="replace") as f:
            return f.read().splitlines()
    sys.exit(f"error: {path} not found: is {orig} the directory the archives were extracted in?")


def sgm_segments(path):
    if not path.is_file():
        sys.exit(f"error: {path} not found (from test-full.tgz)")
    text = path.read_text(encoding="utf-8")
    return [seg.replace("\u2019", "'") for seg in _SEG.findall(text)]


def assemble(pair, orig, raw, icml17=False):
    """RAW/{train,test}.{en,xx}: the training corpora concatenated, newstest2014."""
    spec = corpora(pair, icml17)
    raw.mkdir(parents=True, exist_ok=True)
    src, tgt = pair.split("-")
    counts = {}
    for lang in (src, tgt):
        lines = []
        for name in spec["train"]:
            corpus = read_corpus(orig, name, lang)
            counts.setdefault(name, set()).add(len(corpus))
            lines += corpus
        (raw / f"train.{lang}").write_text("".join(x + "\n" for x in lines), encoding="utf-8")
        role = "src" if lang == src else "ref"
        test = sgm_segments(orig / spec["test"].format(role=role, lang=lang))
        (raw / f"test.{lang}").write_text("".join(x + "\n" for x in test), encoding="utf-8")
    uneven = [name for name, n in counts.items() if len(n) > 1]
    if uneven:
        sys.exit(f"error: {', '.join(uneven)}: the {src} and {tgt} sides differ in length")
    print(f"[wmt14] {pair}: " + ", ".join(f"{name} {n.pop()}" for name, n in counts.items()),
          flush=True)
    return spec


def binarize_google(google, out, workers):
    """OUT/bin from Google's WMT'16 En-De files in ``google``, as the Scaling NMT recipe."""
    prefixes = {split: google / name for split, name in GOOGLE.items()}
    missing = [f"{prefix.name}.{lang}" for prefix in prefixes.values() for lang in ("en", "de")
               if not prefix.with_name(f"{prefix.name}.{lang}").is_file()]
    if missing:
        sys.exit(f"error: {google} lacks {', '.join(missing)}: --google must be the folder "
                 "wmt16_en_de.tar.gz (Google's preprocessed WMT'16 En-De) was extracted in")
    subprocess.run([fairseq_cli("fairseq-preprocess"), "--source-lang", "en",
                    "--target-lang", "de", "--trainpref", str(prefixes["train"]),
                    "--validpref", str(prefixes["valid"]), "--testpref", str(prefixes["test"]),
                    "--destdir", str(out / "bin"), "--nwordssrc", str(GOOGLE_VOCAB),
                    "--nwordstgt", str(GOOGLE_VOCAB), "--joined-dictionary",
                    "--workers", str(workers)], check=True)


def main(argv=None):
    p = ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--pair", choices=sorted(CORPORA), default="en-de")
    data = p.add_mutually_exclusive_group(required=True)
    data.add_argument("--google", type=Path,
                      help="En-De: the extracted wmt16_en_de.tar.gz (Google's preprocessed "
                           "WMT'16 En-De, as the authors)")
    data.add_argument("--orig", type=Path,
                      help="directory with the official archives (scripts/wmt14.sh fetches "
                           "them into its default ORIG)")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--extract-to", type=Path,
                   help="where the archives are extracted (default: --orig itself)")
    p.add_argument("--icml17", action="store_true", help="En-De with news-commentary v9")
    p.add_argument("--bpe-merges", type=int, help="default: 32000 (not with --google, "
                                                        "whose files are BPE'd already)")
    p.add_argument("--workers", type=int, default=8)
    a = p.parse_args(argv)
    if a.google:
        if a.pair != "en-de":
            p.error("--google is Google's WMT'16 En-De: --pair en-de")
        if a.icml17 or a.bpe_merges is not None:
            p.error("--icml17 and --bpe-merges apply to the official archives (--orig); "
                    "--google's files are tokenised and BPE'd already")
        with made_or_removed(a.out):
            binarize_google(a.google, a.out, a.workers)
        return
    if not a.orig.is_dir():
        p.error(f"--orig {a.orig} is not a folder: the folder holding the archives "
                "(scripts/wmt14.sh fetches them)")
    with made_or_removed(a.out):  # a failure leaves no half-made OUT
        spec = corpora(a.pair, a.icml17)
        into = a.extract_to or a.orig
        extract(spec["archives"], a.orig, into)
        src, tgt = a.pair.split("-")
        assemble(a.pair, into, a.out / "raw", a.icml17)
        subprocess.run([sys.executable, "-m", "rdrop_fairseq.recipes.prepare_translation",
                        "--raw", str(a.out / "raw"), "--src", src, "--tgt", tgt,
                        "--out", str(a.out),
                        "--normalize-punct", "--aggressive-dash", "--clean-after-bpe",
                        "--max-len", "250", "--max-ratio", "1.5",
                        "--valid-from-train", str(spec["valid_every"]),
                        "--bpe-merges", str(a.bpe_merges or 32000), "--workers", str(a.workers)],
                       check=True)


if __name__ == "__main__":
    main()
