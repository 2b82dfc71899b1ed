#!/usr/bin/env python
"""Article -> summary pairs from the English LibreOffice help pages, in the layout of
rdrop_fairseq.recipes.prepare_cnndm, with a GPT-2-format byte-level BPE and dictionary
learnt from them.

A help page opens with its title and a one-paragraph description of what it documents,
written by its authors (for a command, the text of its extended tooltip: "Bring Forward" ->
"Moves the selected object up one level, so that it is closer to top of the stacking
order."). That description is the summary. The article is the rest of the page: the title,
then every later heading and paragraph in page order (menu paths, options, syntax,
examples), without the description or any repeat of it, cut to --max-article-words.

* the description: the first segment after the title with at least MIN_SUMMARY_WORDS words
  (shorter ones before it, icon labels and the like, stay in the article);
* dropped: pages with no description, a description over MAX_SUMMARY_WORDS words (a
  paragraph, not an abstract) or an article under MIN_ARTICLE_WORDS words besides the title;
  exact duplicate pairs; and valid/test pages whose description is also a train summary
  (some pages share one; the model could recall it instead of summarising);
* split by page with prepare_libreoffice_corpus.split_of (a hash of the page path), so a
  page never straddles two splits.

    # apt-get download libreoffice-help-en-us
    python -m experiments.prepare_libreoffice_summaries --deb libreoffice-help-en-us_*.deb \\
        --out work/lo_summ
    # or from an extracted tree (.../share/libreoffice/help, holding en-US/)
    python -m experiments.prepare_libreoffice_summaries --help-root /usr/share/libreoffice/help ...

Writes OUT/raw/{train,val,test}.{source,target} (one article / summary a line),
OUT/gpt2_bpe/{encoder.json,vocab.bpe} (a byte-level BPE learnt on the train split with the
``tokenizers`` package; GPT-2's file format, so fairseq's gpt2 BPE reads it), OUT/dict.txt
(every BPE id with its train count, most frequent first: fairseq's gpt2 dict.txt format)
and OUT/stats.json. Then run rdrop_fairseq.recipes.prepare_cnndm --raw OUT/raw --encoder-json
OUT/gpt2_bpe/encoder.json --vocab-bpe OUT/gpt2_bpe/vocab.bpe --dict OUT/dict.txt.
"""

import json
import re
import sys
import tempfile
from collections import Counter
from pathlib import Path

from rdrop_fairseq.recipes.prepare_libreoffice_corpus import (extract_debs, package_versions,
                                        page_segments, split_of)
from rdrop_fairseq.recipes.common import parser_from_doc

# every paragraph / heading id, including the newer "par_2016..." form the translation
# corpus leaves out (a few pages have their title or description under one)
SEGMENT_ID = re.compile(r"^(par|hd)_\w+$")
MIN_SUMMARY_WORDS = 4
MAX_SUMMARY_WORDS = 60
MIN_ARTICLE_WORDS = 30
SPLIT_NAMES = {"train": "train", "valid": "val", "test": "test"}  # split_of -> CNN/DM layout


def page_pair(segments, max_article_words=None):
    """``(article, summary)`` from a page's segment texts in page order, or None."""
    segments = [s for s in segments if s]
    if not segments:
        return None
    title, rest = segments[0], segments[1:]
    described = [i for i, s in enumerate(rest) if len(s.split()) >= MIN_SUMMARY_WORDS]
    if not described:
        return None
    summary = rest[described[0]]
    if len(summary.split()) > MAX_SUMMARY_WORDS:
        return None
    body = " ".join(s for s in rest if s != summary).split()
    if len(body) < MIN_ARTICLE_WORDS:
        return None
    article = [*title.split(), *body][:max_article_words]
    return " ".join(article), summary


def help_pages(help_root, lang="en-US"):
    """``{page path: [segment text, ...]}`` of every page of ``help_root/lang``."""
    root = Path(help_root) / lang
    if not root.is_dir():
        sys.exit(f"error: {root} not found: --help-root must hold the {lang}/ help tree")
    pages = {str(p.relative_to(root)): list(page_segments(p, SEGMENT_ID).values())
             for p in sorted(root.rglob("*.html"))}
    if not pages:
        sys.exit(f"error: no .html help pages under {root}")
    return pages


def build_splits(pages, max_article_words=None):
    """``{"train"|"val"|"test": [(article, summary), ...]}`` and the count of pages each rule
    dropped."""
    splits = {name: [] for name in SPLIT_NAMES.values()}
    dropped = Counter()
    for page in sorted(pages):
        pair = page_pair(pages[page], max_article_words)
        if pair is None:
            dropped["no description or too short"] += 1
        else:
            splits[SPLIT_NAMES[split_of(page)]].append(pair)
    for name, pairs in splits.items():
        splits[name] = list(dict.fromkeys(pairs))
        dropped["duplicate"] += len(pairs) - len(splits[name])
    train_summaries = {summary for _, summary in splits["train"]}
    for name in ("val", "test"):
        kept = [(a, s) for a, s in splits[name] if s not in train_summaries]
        dropped["summary also in train"] += len(splits[name]) - len(kept)
        splits[name] = kept
    return splits, dict(dropped)


def write_raw(splits, raw):
    raw = Path(raw)
    raw.mkdir(parents=True, exist_ok=True)
    for name, pairs in splits.items():
        for side, lines in (("source", [a for a, _ in pairs]), ("target", [s for _, s in pairs])):
            (raw / f"{name}.{side}").write_text("".join(x + "\n" for x in lines),
                                                encoding="utf-8")


def train_bpe(texts, out_dir, vocab_size):
    """A byte-level BPE learnt on ``texts``, saved as GPT-2's encoder.json / vocab.bpe.
    Returns the tokenizer."""
    try:
        from tokenizers import ByteLevelBPETokenizer
    except ImportError:
        sys.exit("error: the BPE is learnt with the `tokenizers` package: "
                 "pip install tokenizers")
    # GPT-2's pre-tokenisation: no space added before the text, every byte in the alphabet
    # (so any test text encodes)
    tokenizer = ByteLevelBPETokenizer(add_prefix_space=False)
    tokenizer.train_from_iterator(texts, vocab_size=vocab_size, min_frequency=2,
                                  show_progress=False)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    vocab_json, merges_txt = tokenizer.save_model(str(out_dir))
    Path(vocab_json).replace(out_dir / "encoder.json")
    Path(merges_txt).replace(out_dir / "vocab.bpe")  # "#version: 0.2", then a merge a line
    return tokenizer


def write_dict(tokenizer, texts, path):
    """fairseq's gpt2 dict.txt: every BPE id with its count in ``texts``, most frequent first."""
    counts = Counter(i for enc in tokenizer.encode_batch(list(texts)) for i in enc.ids)
    ids = sorted(tokenizer.get_vocab().values(), key=lambda i: (-counts[i], i))
    Path(path).write_text("".join(f"{i} {counts[i]}\n" for i in ids), encoding="utf-8")
    return len(ids)


def prepare(help_root, out, vocab_size=8000, max_article_words=400, sources=()):
    """Pairs -> OUT/raw, BPE -> OUT/gpt2_bpe, OUT/dict.txt, OUT/stats.json. Returns the stats."""
    out = Path(out)
    pages = help_pages(help_root)
    splits, dropped = build_splits(pages, max_article_words)
    if not all(splits.values()):
        sys.exit(f"error: a split is empty ({', '.join(f'{k} {len(v)}' for k, v in splits.items())}"
                 f"): {len(pages)} pages are too few")
    write_raw(splits, out / "raw")
    train_text = [x for pair in splits["train"] for x in pair]
    tokenizer = train_bpe(train_text, out / "gpt2_bpe", vocab_size)
    n_ids = write_dict(tokenizer, train_text, out / "dict.txt")

    def words(pairs, side):
        return round(sum(len(p[side].split()) for p in pairs) / max(len(pairs), 1), 1)

    stats = {"sources": list(sources), "pages": len(pages), "dropped_pages": dropped,
             "pairs": {k: len(v) for k, v in splits.items()},
             "mean_words": {k: {"article": words(v, 0), "summary": words(v, 1)}
                            for k, v in splits.items()},
             "bpe_ids": n_ids, "max_article_words": max_article_words,
             "rules": {"min_summary_words": MIN_SUMMARY_WORDS,
                       "max_summary_words": MAX_SUMMARY_WORDS,
                       "min_article_words": MIN_ARTICLE_WORDS}}
    (out / "stats.json").write_text(json.dumps(stats, indent=2) + "\n", encoding="utf-8")
    return stats


def add_source_options(p):
    """--deb or --help-root: where the English help pages come from (also for the check)."""
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--deb", help="the libreoffice-help-en-us .deb file")
    src.add_argument("--help-root", help="a directory holding the en-US/ help tree")


def parse_args(argv=None):
    p = parser_from_doc(__doc__)
    add_source_options(p)
    p.add_argument("--out", required=True)
    p.add_argument("--vocab-size", type=int, default=8000, help="BPE vocabulary (with the "
                   "256 byte symbols)")
    p.add_argument("--max-article-words", type=int, default=400,
                   help="articles are cut to their first N words (title included)")
    a = p.parse_args(argv)
    if a.deb and not Path(a.deb).is_file():
        p.error(f"--deb {a.deb}: no such file (apt-get download libreoffice-help-en-us)")
    if a.vocab_size <= 256:
        p.error("--vocab-size must exceed the 256 byte symbols")
    return a


def main(argv=None):
    a = parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        if a.deb:
            root, sources = extract_debs([a.deb], tmp), package_versions([a.deb])
        else:
            root, sources = a.help_root, [f"help tree {a.help_root}"]
        stats = prepare(root, a.out, a.vocab_size, a.max_article_words, sources)
    print(f"[prepare] {stats['pages']} pages -> pairs "
          + ", ".join(f"{k} {v}" for k, v in stats["pairs"].items())
          + f" (dropped: {stats['dropped_pages']}); {stats['bpe_ids']} BPE ids; "
          f"{a.out}/raw, {a.out}/gpt2_bpe, {a.out}/dict.txt", flush=True)


if __name__ == "__main__":
    main()
