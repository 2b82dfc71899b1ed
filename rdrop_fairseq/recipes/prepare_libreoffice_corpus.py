#!/usr/bin/env python
"""Build a German-English parallel corpus from Debian's LibreOffice help packages.

``libreoffice-help-de`` and ``libreoffice-help-en-us`` ship the same help pages in both
languages, and every paragraph / heading carries the same ``id`` (``par_id...``,
``hd_id...``) in both. Pairing them gives ~35k aligned segments of real text (MPL-2.0).

Segments are split into train / valid / test **by document** (a help page never straddles
two splits), then cleaned: untranslated segments (German == English) and exact duplicates
are dropped, and valid/test lose any pair whose German side also occurs in train.

    # from the two .deb files (apt-get download libreoffice-help-de libreoffice-help-en-us)
    python -m rdrop_fairseq.recipes.prepare_libreoffice_corpus --deb libreoffice-help-de_*.deb \\
        --deb libreoffice-help-en-us_*.deb --out data/libreoffice-help-de-en
    # or from already extracted trees (.../share/libreoffice/help/{de,en-US})
    python -m rdrop_fairseq.recipes.prepare_libreoffice_corpus \\
        --help-root /usr/share/libreoffice/help --out ...

Writes ``{train,valid,test}.tsv.xz`` (one pair per line: German TAB English; segments are
whitespace-normalised, so they hold no tab) and ``SOURCE.md`` (package versions, counts,
licence). ``read_pairs`` reads a split back.
"""

import hashlib
import html.parser
import lzma
import re
import subprocess
import sys
import tempfile
from pathlib import Path

from .common import made_or_removed, parser_from_doc

ID_PATTERN = re.compile(r"^(par_id|hd_id)\w*$")
SPLIT_PERCENT = {"valid": 5, "test": 5}  # the rest is train
MAX_WORDS = 80


class _SegmentParser(html.parser.HTMLParser):
    """Collects the text of every element whose id matches ``id_pattern`` (par_id / hd_id)."""

    def __init__(self, id_pattern=ID_PATTERN):
        super().__init__(convert_charrefs=True)
        self.id_pattern = id_pattern
        self.segments = {}
        self._stack = []  # [tag, id or None, text parts] for open elements

    def handle_starttag(self, tag, attrs):
        if tag in ("br", "img", "meta", "link", "input", "hr"):  # void elements
            if tag == "br":
                self.handle_data(" ")
            return
        segment_id = dict(attrs).get("id")
        if segment_id and not self.id_pattern.match(segment_id):
            segment_id = None
        self._stack.append([tag, segment_id, []])

    def handle_endtag(self, tag):
        # close up to the matching tag (help pages are well-formed; be lenient anyway)
        for depth in range(len(self._stack) - 1, -1, -1):
            if self._stack[depth][0] == tag:
                break
        else:
            return
        while len(self._stack) > depth:
            _, segment_id, parts = self._stack.pop()
            text = "".join(parts)
            if segment_id:
                self.segments.setdefault(segment_id, normalize(text))
            if self._stack:
                self._stack[-1][2].append(text)

    def handle_data(self, data):
        if self._stack:
            self._stack[-1][2].append(data)


def normalize(text):
    return " ".join(text.split())


def page_segments(path, id_pattern=ID_PATTERN):
    """``{id: text}`` of a help page's segments, in the order their elements close."""
    parser = _SegmentParser(id_pattern)
    parser.feed(Path(path).read_text(encoding="utf-8", errors="replace"))
    parser.close()
    return parser.segments


def aligned_pairs(help_root):
    """``{page: [(id, de, en), ...]}`` for every page present in both languages."""
    root = Path(help_root)
    de_root, en_root = root / "de", root / "en-US"
    for d in (de_root, en_root):
        if not d.is_dir():
            sys.exit(f"error: {d} not found: --help-root must contain de/ and en-US/")
    pages = {}
    for de_page in sorted(de_root.rglob("*.html")):
        rel = de_page.relative_to(de_root)
        en_page = en_root / rel
        if not en_page.is_file():
            continue
        de_segments, en_segments = page_segments(de_page), page_segments(en_page)
        pairs = [(i, de_segments[i], en_segments[i]) for i in de_segments if i in en_segments]
        if pairs:
            pages[str(rel)] = pairs
    return pages


def split_of(page):
    """A stable split for a page, from a hash of its path (same on every machine)."""
    bucket = int(hashlib.sha1(page.encode()).hexdigest(), 16) % 100
    if bucket < SPLIT_PERCENT["valid"]:
        return "valid"
    if bucket < SPLIT_PERCENT["valid"] + SPLIT_PERCENT["test"]:
        return "test"
    return "train"


def keep(de, en):
    return de and en and de != en and len(de.split()) <= MAX_WORDS and len(en.split()) <= MAX_WORDS


def build_splits(pages):
    """Split by page, drop untranslated / too long / duplicate pairs and train overlap."""
    splits = {"train": [], "valid": [], "test": []}
    for page in sorted(pages):
        splits[split_of(page)].extend((de, en) for _, de, en in pages[page] if keep(de, en))
    for name in splits:
        splits[name] = list(dict.fromkeys(splits[name]))  # exact duplicates, order kept
    train_sources = {de for de, _ in splits["train"]}
    for name in ("valid", "test"):
        splits[name] = [(de, en) for de, en in splits[name] if de not in train_sources]
    return splits


def extract_debs(debs, into):
    for deb in debs:
        subprocess.run(["dpkg-deb", "-x", str(deb), str(into)], check=True)
    roots = list(Path(into).rglob("libreoffice/help"))
    if not roots:
        sys.exit("error: the .deb files hold no share/libreoffice/help tree")
    return roots[0]


def package_versions(debs):
    versions = []
    for deb in debs:
        out = subprocess.run(["dpkg-deb", "-f", str(deb), "Package", "Version"],
                             check=True, capture_output=True, text=True).stdout.split("\n")
        versions.append(f"{out[0].split(': ', 1)[1]} {out[1].split(': ', 1)[1]}")
    return versions


def write(splits, out, sources):
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    for name, pairs in splits.items():
        text = "".join(f"{de}\t{en}\n" for de, en in pairs)
        (out / f"{name}.tsv.xz").write_bytes(lzma.compress(text.encode("utf-8"), preset=9))
    counts = ", ".join(f"{name} {len(pairs)}" for name, pairs in splits.items())
    (out / "SOURCE.md").write_text(f"""# LibreOffice help, German-English

Aligned paragraphs and headings of the LibreOffice help pages, German and English (US).

* Source: Debian packages {"; ".join(sources)}.
* Licence: Mozilla Public License 2.0, https://mozilla.org/MPL/2.0/ (the help content is
  under `Files: *` of the packages' `/usr/share/doc/*/copyright`). Copyright 2000, 2010
  Oracle and/or its affiliates; The Document Foundation and the LibreOffice contributors.
* Built by `rdrop_fairseq.recipes.prepare_libreoffice_corpus` (this file's sibling files are its
  output; rerun it to rebuild): segments with the same `par_id`/`hd_id` on the same page
  in both languages, whitespace-normalised, split by page (train / valid / test by a hash of
  the page path), untranslated, over-long (> {MAX_WORDS} words) and duplicate pairs
  dropped, and valid/test pairs whose German side occurs in train removed.
* Segments: {counts}.
""", encoding="utf-8")
    return counts


def read_pairs(path):
    """``[(de, en), ...]`` from a ``{split}.tsv.xz`` written by this script."""
    lines = lzma.decompress(Path(path).read_bytes()).decode("utf-8").splitlines()
    return [tuple(line.split("\t")) for line in lines]


def main():
    p = parser_from_doc(__doc__)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--deb", action="append", help="a libreoffice-help-{de,en-us} .deb file")
    src.add_argument("--help-root", help="a directory holding de/ and en-US/ help trees")
    p.add_argument("--out", required=True)
    a = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        if a.deb:
            missing = [d for d in a.deb if not Path(d).is_file()]
            if missing:
                sys.exit(f"error: no such .deb: {', '.join(missing)}")
            root, sources = extract_debs(a.deb, tmp), package_versions(a.deb)
        else:
            root, sources = a.help_root, [f"help tree {a.help_root}"]
        with made_or_removed(a.out):  # a failure leaves no half-made OUT
            counts = write(build_splits(aligned_pairs(root)), a.out, sources)
    print(f"wrote {a.out}: {counts}")


if __name__ == "__main__":
    main()
