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

``--google DIR --regenerate-from ORIG``: DIR's files made first (unless there), from the
statmt.org archives google/seq2seq's script downloads (in ORIG: ``REGENERATE`` below names
them; scripts/wmt14.sh with ``GOOGLE=regenerate`` fetches them), with that script's steps:
the corpora concatenated, the test sets read from their SGML as Moses' input-from-sgm.perl,
Moses tokenisation with sacremoses (``-l de``/``-l en``, XML escaping, no hyphen splitting),
the training pairs cleaned as clean-corpus-n.perl 1 80, subword-nmt's learn_bpe.py -s 32000
on the German and English training text together, applied to every file, as subword-nmt's
master of March 2017 did. Not Google's archive itself: docs/data.md says where it can
differ.

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
    python -m rdrop_fairseq.recipes.prepare_wmt14 --google work/wmt16_en_de_regenerated \\
        --regenerate-from work/wmt14-orig --out work/wmt16-regenerated.en-de
    python -m rdrop_fairseq.recipes.prepare_wmt14 --pair en-de --orig work/wmt14-orig \\
        --out work/wmt14.en-de
    python -m rdrop_fairseq.recipes.prepare_wmt14 --pair en-de \\
        --icml17 ...   # news-commentary v9 instead of v12
    python -m rdrop_fairseq.recipes.prepare_wmt14 --pair en-fr --orig ... \\
        --out work/wmt14.en-fr --workers 16

``--bpe-merges`` defaults to the paper's ~32k joint vocabulary (fairseq's scripts use 40000).
"""

import gzip
import io
import multiprocessing
import os
import re
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

from subword_nmt.apply_bpe import BPE
from subword_nmt.learn_bpe import learn_bpe

from . import fetch as downloader
from .common import fairseq_cli, made_or_removed, parser_from_doc
from .prepare_translation import tokenize, write_lines

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
# --regenerate-from: google/seq2seq's bin/data/wmt16_en_de.sh (its version with a joint 32k
# BPE) remade: its archives (the source table's names), the training corpora in them (in
# its order), and the news test sets it makes: German source and English reference of the
# de-en files; newstest2013 is plain text in dev.tgz
REGENERATE = {
    "archives": ["europarl-v7-de-en", "wmt13-commoncrawl", "wmt16-nc-v11", "wmt16-dev",
                 "wmt16-test"],
    "train": ["europarl-v7.de-en", "commoncrawl.de-en",
              "training-parallel-nc-v11/news-commentary-v11.de-en"],
    "tests": {"newstest2013": "dev/newstest2013.{lang}",
              "newstest2014": "dev/newstest2014-deen-{role}.{lang}.sgm",
              "newstest2015": "dev/newstest2015-deen-{role}.{lang}.sgm",
              "newstest2016": "test/newstest2016-deen-{role}.{lang}.sgm"},
    "merges": 32000,  # learn_bpe.py -s 32000
    "length": (1, 80),  # clean-corpus-n.perl ... 1 80 (its -ratio: 9)
}
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


def _lines(path):
    """The lines of a text file as ``cat`` and Perl read them: split at ``\\n`` only."""
    if not path.is_file():
        sys.exit(f"error: {path} not found: is it the folder the archives were extracted in?")
    text = path.read_text(encoding="utf-8", errors="replace")
    return text[:-1].split("\n") if text.endswith("\n") else text.split("\n") if text else []


def input_from_sgm(path):
    """The segments of an SGML test set as Moses' input-from-sgm.perl gives them: a ``<seg
    ...>`` element's text (an element over several lines joined without a space), runs of
    ASCII white space one space, trimmed. No character is replaced."""
    lines, segments = iter(_lines(path)), []
    for line in lines:
        while re.search(r"<seg[^>]+>", line, re.I) and not re.search(r"</seg>", line, re.I):
            more = next(lines, None)
            if more is None:
                break
            line += more
        seg = re.search(r"<seg[^>]+>\s*(.*)\s*</seg>", line, re.I)
        if seg:
            segments.append(re.sub(r"[ \t\n\r\f\v]+", " ", seg[1]).strip(" "))
    return segments


def clean_corpus_n(de, en, shortest, longest, ratio=9.0, longest_word=1000):
    """The pairs Moses' clean-corpus-n.perl keeps: white space runs made one space and ``|``
    removed (the text is not factored), then pairs with an empty side, a side of fewer than
    ``shortest`` or more than ``longest`` words, one side more than ``ratio`` times as long
    as the other, or a word longer than ``longest_word`` characters are left out."""
    factored = bool(de) and ("|" in de[0] or "|" in en[0])
    too_long = re.compile(r"[^\s|]{%d}" % (longest_word + 1))
    kept = ([], [])
    for pair in zip(de, en):
        f, e = (" ".join((x if factored else x.replace("|", "")).split()) for x in pair)
        if not f or not e:
            continue
        nf, ne = len(f.split(" ")), len(e.split(" "))
        if not (shortest <= nf <= longest and shortest <= ne <= longest):
            continue
        if nf / ne > ratio or ne / nf > ratio or too_long.search(f) or too_long.search(e):
            continue
        kept[0].append(f)
        kept[1].append(e)
    return kept


# subword-nmt as Google's script ran it: the master it cloned in March 2017 (fb526f1,
# 2017-02-27 to 2017-04-07) wrote codes without "#version: 0.2", the end of a word a symbol
# of its own ("e </w>"). Today's subword-nmt learns and applies the same merges when every
# word ends in a character of its own: "<", which Moses tokens never hold (the tokenizer
# escapes it).
_END = "<"
_UNMARK = re.compile(r"(?:@@ )?<(?= |$)")
_BPE = None  # apply_bpe's BPE, in each worker process


def _marked(line):
    return " ".join(word + _END for word in line.split())


def learn_bpe_2017(lines, merges):
    """The codes (its text) subword-nmt's learn_bpe.py -s MERGES of early 2017 learns from
    ``lines``."""
    codes = io.StringIO()
    learn_bpe((_marked(line) for line in lines), codes, merges)
    return codes.getvalue().split("\n", 1)[1].replace(_END + "</w>", "</w>")


def _bpe_init(codes):
    global _BPE
    _BPE = BPE(io.StringIO("#version: 0.2\n" + codes.replace("</w>", _END + "</w>")))


def _bpe_line(line):
    return _UNMARK.sub("", _BPE.process_line(_marked(line)))


def apply_bpe_2017(codes, lines, workers):
    """subword-nmt's apply_bpe.py -c CODES of early 2017 on ``lines`` (``codes``: its text),
    in ``workers`` processes."""
    if workers <= 1 or len(lines) < 10000:
        _bpe_init(codes)
        return [_bpe_line(line) for line in lines]
    with multiprocessing.Pool(workers, _bpe_init, (codes,)) as pool:
        return pool.map(_bpe_line, lines, chunksize=2000)


def regenerate_google(orig, into, google, workers):
    """Google's WMT'16 En-De files (those the Scaling NMT recipe binarises, newstest2015 and
    2016, the BPE codes) made in ``google`` from the statmt.org archives in ``orig``,
    extracted into ``into``, with the steps of google/seq2seq's wmt16_en_de.sh: the training
    corpora concatenated, the test sets from their SGML, Moses tokenisation (sacremoses for
    tokenizer.perl -l de/en: no hyphen splitting, XML escaping), the training pairs cleaned
    (clean-corpus-n.perl 1 80), a joint BPE (learn_bpe.py -s 32000 on the German, then the
    English, training text, as subword-nmt of March 2017) applied to every file."""
    wanted = [f"{prefix}.{lang}" for prefix in GOOGLE.values() for lang in ("en", "de")]
    if all((google / name).is_file() for name in wanted):
        print(f"[wmt16] {google} holds the regenerated files already", flush=True)
        return
    if google.exists():
        sys.exit(f"error: {google} is there, but without {wanted[0]} and the other files "
                 "of Google's archive: move it away, and it is made again")
    extract(REGENERATE["archives"], orig, into)
    text = {}
    for lang, role in (("de", "src"), ("en", "ref")):
        text["train", lang] = [line for name in REGENERATE["train"]
                               for line in _lines(into / f"{name}.{lang}")]
        for test, path in REGENERATE["tests"].items():
            path = into / path.format(lang=lang, role=role)
            text[test, lang] = input_from_sgm(path) if path.suffix == ".sgm" else _lines(path)
    for name in ["train", *REGENERATE["tests"]]:
        if len(text[name, "de"]) != len(text[name, "en"]):
            sys.exit(f"error: {name}: {len(text[name, 'de'])} German lines but "
                     f"{len(text[name, 'en'])} English lines")
    for stale in google.parent.glob(f".{google.name}.tmp-*"):
        shutil.rmtree(stale, ignore_errors=True)  # a run killed while making it
    tmp = google.with_name(f".{google.name}.tmp-{os.getpid()}")
    with made_or_removed(tmp):
        # each text dropped once tokenised, the tokenised training text once cleaned: the
        # training corpus is held in memory twice at most
        tok = {key: tokenize(text.pop(key), key[1], workers=workers, escape=True)
               for key in list(text)}
        total = len(tok["train", "de"])
        print(f"[wmt16] tokenised: train {total} pairs", flush=True)
        tok["train.clean", "de"], tok["train.clean", "en"] = clean_corpus_n(
            tok.pop(("train", "de")), tok.pop(("train", "en")), *REGENERATE["length"])
        print(f"[wmt16] cleaned: {len(tok['train.clean', 'de'])} of {total} training pairs "
              "kept", flush=True)
        codes = learn_bpe_2017(tok["train.clean", "de"] + tok["train.clean", "en"],
                               REGENERATE["merges"])
        tmp.mkdir(parents=True)
        (tmp / f"bpe.{REGENERATE['merges']}").write_text(codes, encoding="utf-8")
        for (name, lang), lines in tok.items():  # not the uncleaned training text
            prefix = "train.tok.clean" if name == "train.clean" else f"{name}.tok"
            write_lines(tmp / f"{prefix}.{lang}", lines)
            write_lines(tmp / f"{prefix}.bpe.{REGENERATE['merges']}.{lang}",
                        apply_bpe_2017(codes, lines, workers))
        os.replace(tmp, google)
    print(f"[wmt16] Google's WMT'16 En-De files regenerated in {google}", flush=True)


def main(argv=None):
    p = parser_from_doc(__doc__)
    p.add_argument("--pair", choices=sorted(CORPORA), default="en-de")
    data = p.add_mutually_exclusive_group(required=True)
    data.add_argument("--google", type=Path,
                      help="En-De: the extracted wmt16_en_de.tar.gz (Google's preprocessed "
                           "WMT'16 En-De, as the authors)")
    data.add_argument("--orig", type=Path,
                      help="directory with the official archives (scripts/wmt14.sh fetches "
                           "them into its default ORIG)")
    p.add_argument("--regenerate-from", type=Path, metavar="ORIG",
                   help="with --google DIR: first make DIR's files again from the statmt.org "
                        "archives in ORIG, as google/seq2seq's wmt16_en_de.sh (docs/data.md "
                        "says how the result differs from Google's archive)")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--extract-to", type=Path,
                   help="where the archives are extracted (default: --orig, or "
                        "--regenerate-from, itself)")
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
        if a.regenerate_from:
            if not a.regenerate_from.is_dir():
                p.error(f"--regenerate-from {a.regenerate_from} is not a folder: the folder "
                        "holding the archives (scripts/wmt14.sh fetches them)")
            regenerate_google(a.regenerate_from, a.extract_to or a.regenerate_from, a.google,
                              a.workers)
        with made_or_removed(a.out):
            binarize_google(a.google, a.out, a.workers)
        return
    if a.regenerate_from:
        p.error("--regenerate-from goes with --google DIR (the folder to make)")
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
