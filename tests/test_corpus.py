"""The LibreOffice help corpus: the builder on a tiny help tree, and the committed data."""

import re
from pathlib import Path

import pytest

from rdrop_fairseq.recipes import prepare_libreoffice_corpus as corpus

REPO = Path(__file__).resolve().parents[1]

DATA = REPO / "data" / "libreoffice-help-de-en"


def page(body):
    return f"<html><head><meta charset='utf-8'></head><body>{body}</body></html>"


def pages_in(split, n, prefix):
    """``n`` page names that the builder's hash puts in ``split``."""
    names = (f"text/{prefix}{i}.html" for i in range(10_000))
    return [name for name in names if corpus.split_of(name) == split][:n]


@pytest.fixture
def help_tree(tmp_path):
    train_page, test_page = pages_in("train", 1, "a")[0], pages_in("test", 1, "b")[0]
    de = {
        train_page: page(
            '<h1 id="hd_id1">Tabelle <span class="x">einfügen</span></h1>'
            '<p id="par_id2">Wählen Sie <a href="#">Format</a> – Zellen.<br/>Fertig.</p>'
            '<p id="par_id3">LibreOffice</p>'          # untranslated: same in both
            '<p id="par_id4">Nur deutsch.</p>'          # no English counterpart
            '<p id="other">Kein Segment.</p>'
            '<p id="par_id5">Wählen Sie Format – Zellen.</p>'),  # duplicate text of par_id2
        test_page: page(
            '<p id="par_id6">Wählen Sie Format – Zellen. Fertig.</p>'  # also in train
            '<p id="par_id7">Ein neuer Satz.</p>'),
    }
    en = {
        train_page: page(
            '<h1 id="hd_id1">Insert <span>Table</span></h1>'
            '<p id="par_id2">Choose <a href="#">Format</a> - Cells.<br/>Done.</p>'
            '<p id="par_id3">LibreOffice</p>'
            '<p id="other">Not a segment.</p>'
            '<p id="par_id5">Choose Format - Cells.</p>'),
        test_page: page(
            '<p id="par_id6">Choose Format - Cells. Done.</p>'
            '<p id="par_id7">A new sentence.</p>'),
    }
    for lang, pages in (("de", de), ("en-US", en)):
        for name, html in pages.items():
            path = tmp_path / lang / name
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(html, encoding="utf-8")
    (tmp_path / "de" / "text" / "only_german.html").write_text(page('<p id="par_id9">x</p>'))
    return tmp_path, train_page, test_page


def test_segments_are_aligned_by_id_with_nested_markup_flattened(help_tree):
    root, train_page, test_page = help_tree
    pages = corpus.aligned_pairs(root)
    assert set(pages) == {train_page, test_page}  # a page missing in English is skipped
    assert pages[train_page] == [
        ("hd_id1", "Tabelle einfügen", "Insert Table"),
        ("par_id2", "Wählen Sie Format – Zellen. Fertig.", "Choose Format - Cells. Done."),
        ("par_id3", "LibreOffice", "LibreOffice"),
        ("par_id5", "Wählen Sie Format – Zellen.", "Choose Format - Cells."),
    ]


def test_splits_are_by_page_without_untranslated_duplicates_or_train_overlap(help_tree):
    root, train_page, test_page = help_tree
    splits = corpus.build_splits(corpus.aligned_pairs(root))
    assert splits["train"] == [
        ("Tabelle einfügen", "Insert Table"),
        ("Wählen Sie Format – Zellen. Fertig.", "Choose Format - Cells. Done."),
        ("Wählen Sie Format – Zellen.", "Choose Format - Cells."),
    ]
    # par_id6's German also occurs in train: removed from test; par_id7 stays
    assert splits["test"] == [("Ein neuer Satz.", "A new sentence.")]
    assert splits["valid"] == []


def test_written_splits_read_back_and_say_where_they_come_from(help_tree, tmp_path):
    root, _, _ = help_tree
    splits = corpus.build_splits(corpus.aligned_pairs(root))
    counts = corpus.write(splits, tmp_path / "out", ["pkg-de 1.0", "pkg-en 1.0"])
    for name, pairs in splits.items():
        assert corpus.read_pairs(tmp_path / "out" / f"{name}.tsv.xz") == pairs
    source = (tmp_path / "out" / "SOURCE.md").read_text()
    assert "pkg-de 1.0" in source and "Mozilla Public License 2.0" in source
    assert counts in source


def test_split_assignment_is_stable_and_roughly_proportional():
    names = [f"text/page{i}.html" for i in range(4000)]
    shares = {s: sum(corpus.split_of(n) == s for n in names) / len(names)
              for s in ("train", "valid", "test")}
    assert shares["valid"] == pytest.approx(0.05, abs=0.015)
    assert shares["test"] == pytest.approx(0.05, abs=0.015)
    assert corpus.split_of("text/shared/main0108.html") == corpus.split_of(
        "text/shared/main0108.html")


def test_committed_corpus_is_consistent_with_its_description():
    source = (DATA / "SOURCE.md").read_text()
    splits = {name: corpus.read_pairs(DATA / f"{name}.tsv.xz")
              for name in ("train", "valid", "test")}
    for name, pairs in splits.items():
        assert re.search(rf"\b{name} {len(pairs)}\b", source), (name, len(pairs))
        assert all(len(p) == 2 and p[0] and p[1] and p[0] != p[1] for p in pairs)
        assert len(set(pairs)) == len(pairs)
    assert len(splits["train"]) > 30_000 and len(splits["test"]) > 1_000
    train_sources = {de for de, _ in splits["train"]}
    for name in ("valid", "test"):
        assert not train_sources & {de for de, _ in splits[name]}
