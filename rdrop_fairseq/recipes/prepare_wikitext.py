#!/usr/bin/env python
"""Prepare WikiText-103 (or any corpus in its layout) for fairseq language modelling.

What fairseq's examples/language_model README does (prepare-wikitext-103.sh, then
``fairseq-preprocess --only-source``), without wget or unzip:

1. the corpus: ``wiki.train.tokens``, ``wiki.valid.tokens`` and ``wiki.test.tokens``
   (already tokenised, one paragraph a line), found anywhere under ``--source``, which is
   * a directory holding them (e.g. the unzipped ``wikitext-103/``), or
   * a zip holding them (``wikitext-103-v1.zip``), extracted into ``OUT/raw``, or
   * a URL, fetched into ``--downloads`` first (rdrop_fairseq.recipes.fetch: resumed,
     kept for a second run);
   * nothing: the source table's WikiText-103 (a live mirror of the zip fairseq's script
     downloaded, MD5-checked) is fetched into ``--downloads``. Offline, fetch the zip
     elsewhere and pass the local file or directory with ``--source``;
2. ``fairseq-preprocess --only-source`` into ``OUT/bin``: one dictionary (every word of the
   training text; WikiText-103 has 267k) and the binarized splits ``train``, ``valid``,
   ``test``, the data-bin of scripts/wikitext103.sh (OUT is its DATA_DIR).

    python -m rdrop_fairseq.recipes.prepare_wikitext --out work/wikitext-103            # download
    python -m rdrop_fairseq.recipes.prepare_wikitext --source wikitext-103-v1.zip \\
        --out work/wikitext-103
    python -m rdrop_fairseq.recipes.prepare_wikitext --source path/to/wikitext-103 \\
        --out work/wikitext-103

Environment variables: SOURCE, OUT, WORKERS, DOWNLOADS.
"""

import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

from . import fetch as downloader
from .common import fairseq_cli, made_or_removed, parser_from_doc

SPLITS = ("train", "valid", "test")
FILES = tuple(f"wiki.{split}.tokens" for split in SPLITS)


def is_url(source):
    return bool(re.match(r"^[a-z]+://", str(source)))


def download(url, downloads):
    """``url`` fetched into ``downloads`` (kept: a second run reuses it); the source
    table's WikiText-103 when ``url`` is None."""
    hint = (f"fetch {'/'.join(FILES)}'s zip elsewhere and pass it, or the directory holding "
            "them, with --source PATH")
    try:
        if url is None:
            return downloader.get("wikitext-103", downloads)[0]
        return downloader.fetch([url], Path(downloads) / url.rsplit("/", 1)[-1],
                                local_hint=hint)
    except (downloader.FetchError, ValueError) as e:
        sys.exit(f"error: {e}")


def find_in_directory(root):
    """``{split: path}`` of the three files under ``root`` (one directory holding all)."""
    root = Path(root)
    for train in sorted(root.rglob(FILES[0])):
        here = train.parent
        if all((here / name).is_file() for name in FILES):
            return {split: here / name for split, name in zip(SPLITS, FILES)}
    sys.exit(f"error: {root} holds no directory with {', '.join(FILES)} (the WikiText "
             "layout); pass the unzipped corpus or wikitext-103-v1.zip with --source")


def extract_zip(archive, raw):
    """The three files of a WikiText zip into ``raw`` (flattened), ``{split: path}``."""
    try:
        zf = zipfile.ZipFile(archive)
    except zipfile.BadZipFile as e:
        sys.exit(f"error: {archive} is not a zip file ({e})")
    with zf:
        members = {}
        for info in zf.infolist():
            name = info.filename.rsplit("/", 1)[-1]
            if name in FILES and not info.is_dir():
                members.setdefault(name, info)
        missing = [name for name in FILES if name not in members]
        if missing:
            sys.exit(f"error: {archive} holds no {', '.join(missing)} (the WikiText layout)")
        raw.mkdir(parents=True, exist_ok=True)
        paths = {}
        for split, name in zip(SPLITS, FILES):
            target = raw / name
            if not (target.is_file() and target.stat().st_size == members[name].file_size):
                print(f"[wikitext] extracting {members[name].filename}", flush=True)
                with zf.open(members[name]) as src, open(target, "wb") as dst:
                    shutil.copyfileobj(src, dst, 1 << 20)
            paths[split] = target
    return paths


def corpus_files(source, out, downloads="work/downloads"):
    """``{split: path}`` of the corpus at ``source`` (URL, zip or directory; None: the
    source table's WikiText-103, fetched into ``downloads``)."""
    if source is None or is_url(source):
        source = download(source, downloads)
    source = Path(source)
    if not source.exists():
        sys.exit(f"error: {source} does not exist; pass the WikiText directory or zip "
                 "with --source")
    if source.is_dir():
        return find_in_directory(source)
    return extract_zip(source, Path(out) / "raw")


def binarize(files, dest, workers):
    """fairseq-preprocess --only-source, as fairseq's examples/language_model README."""
    if dest.exists():
        shutil.rmtree(dest)
    cmd = [fairseq_cli("fairseq-preprocess"), "--only-source",
           "--trainpref", str(files["train"]), "--validpref", str(files["valid"]),
           "--testpref", str(files["test"]), "--destdir", str(dest),
           "--workers", str(workers)]
    print("[wikitext] " + " ".join(cmd), flush=True)
    proc = subprocess.run(cmd)
    if proc.returncode != 0:
        sys.exit(f"error: fairseq-preprocess failed (exit code {proc.returncode})")


def main(argv=None):
    p = parser_from_doc(__doc__)
    p.add_argument("--source", default=os.environ.get("SOURCE"),
                   help="directory, zip or URL of the corpus (default: the source table's "
                        "WikiText-103, fetched into --downloads)")
    p.add_argument("--downloads", default=os.environ.get("DOWNLOADS", "work/downloads"),
                   help="where a fetched zip goes (default: $DOWNLOADS or work/downloads)")
    p.add_argument("--out", default=os.environ.get("OUT"),
                   help="output directory (the data-bin is OUT/bin)")
    p.add_argument("--workers", type=int, default=int(os.environ.get("WORKERS", 1)),
                   help="fairseq-preprocess workers (fairseq's README: 20)")
    a = p.parse_args(argv)
    if not a.out:
        p.error("--out (or $OUT) is required")
    out = Path(a.out)
    with made_or_removed(out):  # a failure leaves no half-made OUT
        out.mkdir(parents=True, exist_ok=True)
        files = corpus_files(a.source, out, a.downloads)
        for split in SPLITS:
            print(f"[wikitext] {split}: {files[split]}", flush=True)
        binarize(files, out / "bin", a.workers)
        words = len((out / "bin" / "dict.txt").read_text(encoding="utf-8").splitlines())
        print(f"[wikitext] data-bin {out / 'bin'}: dictionary of {words} words "
              f"(+4 special symbols)", flush=True)


if __name__ == "__main__":
    main()
