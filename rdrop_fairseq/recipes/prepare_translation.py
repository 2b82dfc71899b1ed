#!/usr/bin/env python
"""Prepare a translation corpus for fairseq: normalise, tokenise, clean, subword, binarize.

What fairseq's examples/translation/prepare-*.sh scripts do, without perl or git clones:

* Moses tokenisation with sacremoses (``--aggressive-dash``: ``-a``, hyphens split as
  ``@-@``), optional lower-casing; ``--normalize-punct``: Moses punctuation normalisation
  and non-printing-character removal of the training (and validation) text, as the WMT14
  scripts do (the test set is left as the official references);
* cleaning by length (1..max-len tokens a side, length ratio <= max-ratio; 0 turns the
  ratio off) of the training pairs before BPE, or with ``--clean-after-bpe`` of the
  training and validation pairs after BPE (the WMT14 scripts);
* subwords: a joint BPE learnt on the training data with subword-nmt (the default), or
  ``--subword sentencepiece``: sentencepiece BPE models on the raw text instead of Moses
  tokens, which is how Chinese gets segmented (Moses does not split Chinese);
* ``fairseq-preprocess``, with a joined dictionary unless ``--separate-dictionaries``
  (sentencepiece then learns one model per language).

Input: ``RAW/{train,valid,test}.{SRC,TGT}``, one sentence per line; or ``--libreoffice``
to take the corpus committed in data/libreoffice-help-de-en (de-en). With
``--valid-from-train N`` there is no RAW/valid: every N-th training pair becomes the
validation set instead (fairseq: N = 23 for IWSLT14, 100 for WMT14 En-De, 1333 for En-Fr).

    python -m rdrop_fairseq.recipes.prepare_translation --libreoffice --out work/lo-de-en \\
        --bpe-merges 8000
    python -m rdrop_fairseq.recipes.prepare_translation --raw iwslt14/raw --src de --tgt en \\
        --lowercase \\
        --bpe-merges 10000 --out work/iwslt14.de-en
    python -m rdrop_fairseq.recipes.prepare_translation --raw iwslt17/raw --src en --tgt zh \\
        --subword sentencepiece --separate-dictionaries --max-ratio 0 --out work/iwslt17.en-zh

Writes ``OUT/tok`` (tokenised text; raw text with sentencepiece), ``OUT/bpe`` (subwords),
``OUT/bpe.codes`` or ``OUT/bin/spm*.model``, and ``OUT/bin`` (the data-bin; evaluation and
training recognise sentencepiece data by the ``spm*.model`` files in it, and
evaluate_translation.py lower-cased data by ``OUT/bin/prepared.json``).
"""

import functools
import json
import multiprocessing
import random
import re
import shutil
import subprocess
import sys
import unicodedata
from pathlib import Path

from sacremoses import MosesPunctNormalizer, MosesTokenizer
from subword_nmt.apply_bpe import BPE
from subword_nmt.learn_bpe import learn_bpe

from .common import REPO, fairseq_cli, made_or_removed, parser_from_doc
from .prepare_libreoffice_corpus import read_pairs

SPLITS = ("train", "valid", "test")
PREPARED = "prepared.json"  # in the data-bin: {"lowercase": ...}, read by evaluation
MOSES_DOES_NOT_SEGMENT = ("zh", "ja", "ko", "th")


def libreoffice_pairs(split, max_words=None):
    """``[(de, en), ...]`` of the committed LibreOffice help corpus's ``split``; with
    ``max_words``, only the pairs of at most that many words a side."""
    pairs = read_pairs(REPO / "data" / "libreoffice-help-de-en" / f"{split}.tsv.xz")
    if max_words:
        pairs = [p for p in pairs if max(len(p[0].split()), len(p[1].split())) <= max_words]
    return pairs


def export_libreoffice(raw, train_pairs=None, valid_pairs=None, test_pairs=None, seed=0,
                       max_words=None):
    """Write the committed LibreOffice help corpus as RAW/{split}.{de,en}.

    ``max_words``: only pairs of at most that many words a side (every split);
    ``train_pairs``: a random subset (fixed by ``seed``) of that many training pairs;
    ``valid_pairs`` / ``test_pairs``: the first that many validation / test pairs.
    """
    keep = {"valid": valid_pairs, "test": test_pairs}
    raw.mkdir(parents=True, exist_ok=True)
    for split in SPLITS:
        pairs = libreoffice_pairs(split, max_words)
        if split == "train" and train_pairs:
            pairs = random.Random(seed).sample(pairs, min(train_pairs, len(pairs)))
        elif keep.get(split):
            pairs = pairs[:keep[split]]
        for side, lang in ((0, "de"), (1, "en")):
            (raw / f"{split}.{lang}").write_text("".join(p[side] + "\n" for p in pairs),
                                                 encoding="utf-8")


def read_lines(path):
    if not path.is_file():
        sys.exit(f"error: {path} not found (expected RAW/{{train,valid,test}}.{{src,tgt}})")
    return path.read_text(encoding="utf-8").splitlines()


@functools.lru_cache(maxsize=None)
def _non_printing():
    r"""A regex of every Unicode ``\p{C}`` character, which remove-non-printing-char.perl
    replaces by a space (built once: Python's re has no ``\p{...}``)."""
    ranges, start = [], None
    for i in range(sys.maxunicode + 2):
        other = i <= sys.maxunicode and unicodedata.category(chr(i))[0] == "C"
        if other and start is None:
            start = i
        elif not other and start is not None:
            ranges.append(f"{re.escape(chr(start))}-{re.escape(chr(i - 1))}")
            start = None
    return re.compile("[" + "".join(ranges) + "]")


@functools.lru_cache(maxsize=None)
def _moses(kind, lang):
    return (MosesPunctNormalizer(lang=lang, perl_parity=True) if kind == "norm"
            else MosesTokenizer(lang=lang))


def _process(line, lang, normalize, aggressive_dash, lowercase, escape=False):
    if normalize:  # normalize-punctuation.perl, then remove-non-printing-char.perl
        line = _non_printing().sub(" ", _moses("norm", lang).normalize(line))
    line = _moses("tok", lang).tokenize(line, aggressive_dash_splits=aggressive_dash,
                                        escape=escape, return_str=True)
    return line.lower() if lowercase else line


def tokenize(lines, lang, lowercase=False, normalize=False, aggressive_dash=False, workers=1,
             escape=False):
    """Moses tokenisation (sacremoses) of ``lines``, in ``workers`` processes; ``escape``:
    ``&``, ``|``, ``<``, ``>``, quotes and brackets as XML entities (``&apos;``, ``&quot;``,
    ...), as tokenizer.perl does unless given -no-escape."""
    fn = functools.partial(_process, lang=lang, normalize=normalize,
                           aggressive_dash=aggressive_dash, lowercase=lowercase, escape=escape)
    if workers <= 1 or len(lines) < 10000:
        return [fn(line) for line in lines]
    with multiprocessing.Pool(workers) as pool:
        return pool.map(fn, lines, chunksize=2000)


def clean(src, tgt, max_len, max_ratio, min_len=1):
    """Pairs with min_len..max_len tokens a side and a length ratio <= max_ratio (0: any),
    as Moses' clean-corpus-n.perl."""
    kept = []
    for s, t in zip(src, tgt):
        ls, lt = len(s.split()), len(t.split())
        if not (min_len <= ls <= max_len and min_len <= lt <= max_len):
            continue
        if max_ratio and max(ls, lt) > max_ratio * min(ls, lt):
            continue
        kept.append((s, t))
    return [s for s, _ in kept], [t for _, t in kept]


def every_nth(src, tgt, n):
    """(kept, held out): every n-th pair held out, as awk 'NR % n == 0'."""
    held = (src[n - 1::n], tgt[n - 1::n])
    kept = ([s for i, s in enumerate(src, 1) if i % n], [t for i, t in enumerate(tgt, 1) if i % n])
    return kept, held


def write_lines(path, lines):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")


def joint_bpe(tok, merges, codes):
    """subword-nmt: learn a joint BPE on the training text, apply it to every split."""
    with open(codes, "w", encoding="utf-8") as out:
        learn_bpe(tok["train"][0] + tok["train"][1], out, merges)
    with open(codes, encoding="utf-8") as f:
        bpe = BPE(f)
    return {split: tuple([bpe.process_line(line) for line in side] for side in pair)
            for split, pair in tok.items()}


def sentencepiece_bpe(tok, langs, vocab_size, separate, model_dir):
    """sentencepiece BPE on the raw text: one model per language with ``separate``, else
    one joint model; the models are written to ``model_dir`` as spm[.LANG].model."""
    import sentencepiece as spm

    model_dir.mkdir(parents=True, exist_ok=True)
    sides = [(0,), (1,)] if separate else [(0, 1)]
    processors = {}
    for side in sides:
        name = f"spm.{langs[side[0]]}" if separate else "spm"
        text = [line for i in side for line in tok["train"][i]]
        cjk = any(langs[i] in MOSES_DOES_NOT_SEGMENT for i in side)
        spm.SentencePieceTrainer.train(
            sentence_iterator=iter(text), model_prefix=str(model_dir / name),
            vocab_size=vocab_size, model_type="bpe", hard_vocab_limit=False,
            character_coverage=0.9995 if cjk else 1.0, input_sentence_size=2_000_000,
            shuffle_input_sentence=True, minloglevel=2)
        for i in side:
            processors[i] = spm.SentencePieceProcessor(model_file=str(model_dir / f"{name}.model"))
    return {split: tuple([" ".join(processors[i].encode(line, out_type=str)) for line in side]
                         for i, side in enumerate(pair))
            for split, pair in tok.items()}


def binarize(bpe_dir, dest, src, tgt, joined, workers):
    cmd = [fairseq_cli("fairseq-preprocess"),
           "--source-lang", src, "--target-lang", tgt, "--trainpref", bpe_dir / "train",
           "--validpref", bpe_dir / "valid", "--testpref", bpe_dir / "test",
           "--destdir", dest, "--workers", str(workers)]
    subprocess.run(cmd + (["--joined-dictionary"] if joined else []), check=True)


def parse_args(argv=None):
    p = parser_from_doc(__doc__)
    src_group = p.add_mutually_exclusive_group(required=True)
    src_group.add_argument("--raw", type=Path, help="directory with {train,valid,test}.{src,tgt}")
    src_group.add_argument("--libreoffice", action="store_true",
                           help="use data/libreoffice-help-de-en (de-en)")
    p.add_argument("--src", default="de")
    p.add_argument("--tgt", default="en")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--subword", choices=["bpe", "sentencepiece"], default="bpe",
                   help="subword-nmt joint BPE on Moses tokens, or sentencepiece on raw text")
    p.add_argument("--bpe-merges", type=int, default=10000, help="subword-nmt merges")
    p.add_argument("--vocab-size", type=int, default=10000,
                   help="sentencepiece vocabulary size (per language if separate)")
    p.add_argument("--separate-dictionaries", action="store_true",
                   help="one dictionary per language (needs --subword sentencepiece)")
    p.add_argument("--lowercase", action="store_true")
    p.add_argument("--normalize-punct", action="store_true",
                   help="Moses punctuation normalisation + non-printing-character removal "
                        "of the training and validation text")
    p.add_argument("--aggressive-dash", action="store_true",
                   help="split hyphens as @-@ (tokenizer.perl -a)")
    p.add_argument("--max-len", type=int, default=175)
    p.add_argument("--max-ratio", type=float, default=1.5, help="0: no length-ratio filter")
    p.add_argument("--clean-after-bpe", action="store_true",
                   help="clean training and validation pairs after BPE, not training before")
    p.add_argument("--valid-from-train", type=int, metavar="N",
                   help="hold out every N-th training pair as the validation set")
    p.add_argument("--workers", type=int, default=1)
    a = p.parse_args(argv)
    if a.separate_dictionaries and a.subword != "sentencepiece":
        p.error("--separate-dictionaries needs --subword sentencepiece (subword-nmt BPE "
                "here is learnt jointly)")
    for lang in (a.src, a.tgt):
        if lang in MOSES_DOES_NOT_SEGMENT and a.subword != "sentencepiece":
            p.error(f"Moses tokenisation does not segment {lang!r} text: use --subword "
                    "sentencepiece (with --separate-dictionaries for the paper's En-Zh)")
    if a.subword == "sentencepiece" and (a.aggressive_dash or a.lowercase):
        p.error("--aggressive-dash and --lowercase apply to Moses tokens, not sentencepiece")
    return a


def main(argv=None):
    a = parse_args(argv)
    with made_or_removed(a.out):  # a failure leaves no half-made OUT
        prepare(a)


def prepare(a):
    raw = a.raw
    if a.libreoffice:
        raw = a.out / "raw"
        export_libreoffice(raw)
    moses = a.subword == "bpe"
    tok = {}
    for split in SPLITS:
        if split == "valid" and a.valid_from_train:
            continue  # taken from train below
        pair = []
        for lang in (a.src, a.tgt):
            lines = read_lines(raw / f"{split}.{lang}")
            normalize = a.normalize_punct and split != "test"
            if moses:
                lines = tokenize(lines, lang, a.lowercase, normalize, a.aggressive_dash, a.workers)
            elif normalize:
                lines = [_non_printing().sub(" ", _moses("norm", lang).normalize(x)) for x in lines]
            pair.append(lines)
        src, tgt = pair
        if len(src) != len(tgt):
            sys.exit(f"error: {split}: {len(src)} {a.src} lines but {len(tgt)} {a.tgt} lines")
        if split == "train":
            if moses and not a.clean_after_bpe:
                src, tgt = clean(src, tgt, a.max_len, a.max_ratio)
            if a.valid_from_train:
                (src, tgt), tok["valid"] = every_nth(src, tgt, a.valid_from_train)
        tok[split] = (src, tgt)
    for split in SPLITS:
        for lang, lines in zip((a.src, a.tgt), tok[split]):
            write_lines(a.out / "tok" / f"{split}.{lang}", lines)
        print(f"[prepare] {split}: {len(tok[split][0])} pairs tokenised", flush=True)

    bin_dir = a.out / "bin"
    if moses:
        sub = joint_bpe(tok, a.bpe_merges, a.out / "bpe.codes")
        print(f"[prepare] joint BPE with {a.bpe_merges} merges: {a.out / 'bpe.codes'}", flush=True)
    else:
        if bin_dir.exists():  # a stale data-bin must not mix with new models
            shutil.rmtree(bin_dir)
        sub = sentencepiece_bpe(tok, (a.src, a.tgt), a.vocab_size, a.separate_dictionaries,
                                bin_dir)
        print(f"[prepare] sentencepiece BPE, vocabulary {a.vocab_size}"
              f"{' per language' if a.separate_dictionaries else ''}: {bin_dir}", flush=True)
    for split in SPLITS:
        if a.clean_after_bpe and split != "test" or not moses and split == "train":
            before = len(sub[split][0])
            sub[split] = clean(*sub[split], a.max_len, a.max_ratio)
            print(f"[prepare] {split}: {len(sub[split][0])} of {before} pairs kept after "
                  f"cleaning (1-{a.max_len} subwords, ratio {a.max_ratio or 'any'})", flush=True)
        for lang, lines in zip((a.src, a.tgt), sub[split]):
            write_lines(a.out / "bpe" / f"{split}.{lang}", lines)
    binarize(a.out / "bpe", bin_dir, a.src, a.tgt, not a.separate_dictionaries, a.workers)
    # what evaluation must know of the text: lower-cased data is scored case-insensitively
    (bin_dir / PREPARED).write_text(json.dumps({"lowercase": bool(a.lowercase)}) + "\n")
    print(f"[prepare] data-bin: {bin_dir}", flush=True)


if __name__ == "__main__":
    main()
