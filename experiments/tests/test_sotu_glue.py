"""The State of the Union check of the GLUE recipe (experiments.prepare_sotu_glue,
experiments.sotu_glue_check) on a stand-in package built here, never downloaded: 30
addresses, 1855-1884, each sentence marked with its address's year so every example can be
traced back; the split by address, the labels and scores, the BPE, and a tiny end-to-end
run (from scratch, baseline and R-Drop, both tasks) with its metrics."""

import collections
import json
import math
import re
import sys
from pathlib import Path

import pytest

from experiments import prepare_sotu
from experiments import prepare_sotu_glue
from rdrop_fairseq.recipes import prepare_glue
from tests.recipe_helpers import run

REPO = Path(__file__).resolve().parents[2]

YEARS = range(1855, 1885)
WORDS = ("the nation congress war peace trade people law union states treaty army "
         "tariff labor money bank gold railroad land tax").split()
TINY = ["model.encoder_layers=1", "model.encoder_embed_dim=16",
        "model.encoder_ffn_embed_dim=32", "model.encoder_attention_heads=2",
        "common.log_interval=1"]


def party(year):
    """Whig before 1857, Democratic 1857-1860, then four-year terms: R, D, R, D, ..."""
    if year < 1857:
        return "Whig"
    if year < 1861:
        return "Democratic"
    return ("Republican", "Democratic")[(year - 1861) // 4 % 2]


def address_text(year, sentences=24):
    words = WORDS[year % 7:] + WORDS[:year % 7]
    return " ".join(f"In y{year} the {words[i % len(words)]} and {words[(i * 3) % len(words)]} "
                    f"of {party(year).lower()} men grew {i} times." for i in range(sentences))


@pytest.fixture(scope="module")
def package(tmp_path_factory):
    """The stand-in in the npm package's layout: package/data/YEAR_NAME_P.json."""
    root = tmp_path_factory.mktemp("sotu") / "package"
    (root / "data").mkdir(parents=True)
    for year in YEARS:
        name = f"President {year // 4}"
        record = {"year": year, "name": name, "party": party(year), "text": address_text(year)}
        (root / "data" / f"{year}_president_{year // 4}_{party(year)[0].lower()}.json"
         ).write_text(json.dumps(record))
    return root


def year_of(text):
    years = set(re.findall(r"\by(\d{4})\b", text))
    assert len(years) == 1, text
    return int(years.pop())


def read_tsv(path):
    lines = path.read_text(encoding="utf-8").splitlines()
    return [line.split("\t") for line in lines[1:]]


def test_tasks_split_by_address_with_true_labels(package, tmp_path):
    addresses = prepare_sotu.load_addresses(package, tmp_path)
    tasks = prepare_sotu_glue.build_tasks(addresses, per_address=3)
    folders = prepare_sotu_glue.write_glue_layout(tasks, tmp_path)
    split_of = {address["year"]: split
                for split, kept in prepare_sotu.split_by_address(addresses).items()
                for address in kept}
    assert sorted(y for y, s in split_of.items() if s != "train") == [
        1863, 1864, 1873, 1874, 1883, 1884]
    for task, folder in folders.items():
        for split, name in prepare_sotu_glue.SPLIT_FILES.items():
            rows = read_tsv(folder / f"{name}.tsv")
            years = collections.Counter(year_of(" ".join(r)) for r in rows)
            # every paragraph of an address is in its address's split, 3 per address
            assert {split_of[y] for y in years} == {split}, (task, split)
            assert set(years.values()) == {3}
            if task == "party":  # D and R only, from 1861; the label is the address's party
                assert all(y >= 1861 for y in years)
                assert all(label == party(year_of(text)) for text, label in rows)
            else:  # every address; the year on a 0-5 scale, in STS-B's columns
                assert len(years) == sum(s == split for s in split_of.values())
                for r in rows:
                    year = year_of(r[7] + " " + r[8])
                    assert (r[3], r[2]) == (str(year), f"President {year // 4}")
                    assert float(r[9]) == pytest.approx(5 * (year - 1855) / (1884 - 1855),
                                                        abs=1e-6)
    # read back as the GLUE scripts read SST-2 and STS-B (heldout: labelled, dev layout)
    rows = prepare_glue.read_split("STS-B", folders["year"], "heldout")
    assert len(rows) == 3 * 3 and all(len(inputs) == 2 for inputs, _ in rows)
    assert {label for _, label in prepare_glue.read_split("SST-2", folders["party"], "train")} \
        == {"Democratic", "Republican"}


def test_paragraphs_and_halves():
    text = address_text(1870, sentences=30)
    paragraphs = prepare_sotu_glue.address_paragraphs(text, min_words=40, max_words=50)
    assert all(40 <= len(p.split()) <= 50 for p in paragraphs)
    every = prepare_sotu_glue.address_paragraphs(text, 40, 50)
    assert prepare_sotu_glue.address_paragraphs(text, 40, 50, per_address=3) == [
        every[0], every[len(every) // 3], every[2 * len(every) // 3]]
    # cut at the sentence end nearest the middle word (3.5 of 7)
    assert prepare_sotu_glue.halves("One two three four. Five six. Seven.") == (
        "One two three four.", "Five six. Seven.")
    assert prepare_sotu_glue.halves("a b c d e") == ("a b", "c d e")
    assert prepare_sotu_glue.year_score(1855, 1855, 1884) == 0
    assert prepare_sotu_glue.year_score(1884, 1855, 1884) == 5


def test_bpe_is_gpt2_format_with_whole_word_tokens(tmp_path):
    from fairseq.data import Dictionary
    from fairseq.data.encoders.gpt2_bpe_utils import get_encoder

    texts = [address_text(y) for y in (1861, 1870)] + ["(applause) the nation, café."]
    out = prepare_sotu_glue.build_gpt2_bpe(texts, tmp_path, max_words=50, min_count=2)
    assert (out / "vocab.bpe").read_text().startswith("#version: 0.2\n")
    bpe = get_encoder(out / "encoder.json", out / "vocab.bpe")
    assert len(bpe.encode(" nation")) == 1 and len(bpe.encode(" congress")) == 1
    assert len(bpe.encode(" unseenword")) > 1  # falls back to pieces and bytes
    for text in texts + ["ß naïve 1861 ünknown"]:
        assert bpe.decode(bpe.encode(text)) == text
    # dict.txt: every BPE id, the most frequent in the texts first (the " the" token)
    vocab = Dictionary.load(str(out / "dict.txt"))
    assert len(vocab) - vocab.nspecial == len(bpe.encoder)
    assert vocab[vocab.nspecial] == str(bpe.encode(" the")[0])


def test_errors_say_what_to_change(package, tmp_path, capsys):
    addresses = prepare_sotu.load_addresses(package, tmp_path)
    with pytest.raises(prepare_glue.GlueDataError, match="party task has no examples in"):
        prepare_sotu_glue.build_tasks([a for a in addresses if a["year"] < 1861])
    for argv, message in [([], "--out (or $OUT) is required"),
                          (["--out", "x", "--min-words", "60", "--max-words", "50"],
                           "need 1 <= --min-words <= --max-words")]:
        with pytest.raises(SystemExit):
            prepare_sotu_glue.parse_args(argv)
        assert message in capsys.readouterr().err


def train_inner(log):
    return [dict(re.findall(r"(\w+)=([^,\s]+)", line)) for line in log.splitlines()
            if "[train_inner]" in line]


def test_check_end_to_end_both_tasks(package, tmp_path):
    work = tmp_path / "work"
    out = run([sys.executable, "-m", "experiments.sotu_glue_check", "--source", package,
               "--work", work, "--seeds", "1", "--party-updates", "3", "--year-updates", "3",
               "--per-address", "3", "--", *TINY]).stdout
    results = json.loads((work / "results.json").read_text())
    splits = json.loads((work / "data" / "splits.json").read_text())["tasks"]
    runs = {(r["task"], r["mode"]): r for r in results["runs"]}
    assert set(runs) == {(t, m) for t in ("party", "year") for m in ("baseline", "rdrop")}
    for (task, mode), r in runs.items():
        log = (work / "checkpoints" / f"{task}-{mode}-seed1" / "train.log").read_text()
        assert "No existing checkpoint found" in log  # from scratch
        inner = train_inner(log)
        assert len(inner) == 3, log[-2000:]
        consistency = "rdrop_kl" if task == "party" else "rdrop_mse"
        if mode == "rdrop":  # the recipe's alpha (SST-2, STS-B: 1.0); the term is logged
            assert "criterion.rdrop_alpha=1.0" in log
            assert all(float(line[consistency]) > 0 for line in inner)
        else:
            assert "criterion.rdrop_alpha=0 " in log and "R-Drop is off" in log
        for split in ("valid", "test"):
            assert r[split]["examples"] == splits[task][split]["examples"]
            for name, value in r[split].items():
                if name != "examples":
                    low = 0 if name == "accuracy" else -100
                    assert math.isfinite(value) and low <= value <= 100, r
        # evaluate_glue.py on dev.tsv agrees with fairseq's validation of checkpoint_best.pt
        best = float(re.findall(r"Saved checkpoint \S+checkpoint_best\.pt .*score ([-\d.]+)",
                                log)[-1])
        metric = "accuracy" if task == "party" else "pearson"
        assert r["valid"][metric] == pytest.approx(best, abs=0.051)
    # the majority class of train, scored by hand
    train = splits["party"]["train"]["labels"]
    label = max(train, key=train.get)
    test = splits["party"]["test"]["labels"]
    assert results["majority"]["label"] == label
    assert results["majority"]["test"]["accuracy"] == pytest.approx(
        100 * test.get(label, 0) / sum(test.values()))
    summary = results["summary"]
    assert summary["party"]["accuracy"]["test"]["rdrop"]["values"] == [
        runs["party", "rdrop"]["test"]["accuracy"]]
    assert set(summary["year"]) == {"pearson", "spearman"}
    table = (work / "results.md").read_text()
    assert "| party | accuracy | test | " in table and "| year | pearson | valid | - |" in table
    assert table in out
    # run again: the finished runs of the same commands are kept, not trained again
    out = run([sys.executable, "-m", "experiments.sotu_glue_check", "--source", package,
               "--work", work, "--seeds", "1", "--party-updates", "3", "--year-updates", "3",
               "--per-address", "3", "--", *TINY]).stdout
    assert out.count("done before, kept") == 4
    again = json.loads((work / "results.json").read_text())
    assert again["summary"] == results["summary"]
    # each run folder keeps a copy of the data it was trained on (a changed one: trained again)
    data = work / "checkpoints" / "party-rdrop-seed1" / "data.json"
    assert data.read_text() == (work / "data" / "splits.json").read_text()
