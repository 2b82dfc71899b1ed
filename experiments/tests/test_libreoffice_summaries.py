"""The LibreOffice help summarization data (experiments.prepare_libreoffice_summaries) and the
baseline-vs-R-Drop check (experiments.libreoffice_summarization_check) on stand-in help pages
built here (nothing downloaded): the pairs, the split by page, the GPT-2-format BPE through
fairseq's encoder and prepare_cnndm.py, and a tiny end-to-end run that produces ROUGE."""

import json
import random
import re
import sys
from pathlib import Path

import pytest

from experiments import prepare_libreoffice_summaries as summaries
from rdrop_fairseq.recipes import prepare_cnndm
from rdrop_fairseq.recipes.prepare_libreoffice_corpus import split_of
from tests.recipe_helpers import run

REPO = Path(__file__).resolve().parents[2]

WORDS = ("cell sheet row column table chart select choose format insert the a of to and "
         "value text menu dialog option field click document page style function").split()
SPLIT_PAGES = {"train": 16, "valid": 3, "test": 3}


def page_html(title, paragraphs, title_id="hd_id1"):
    """A help page as LibreOffice's help generator writes it (trimmed)."""
    body = "\n".join(f'<p id="{pid}" class="paragraph" dir="auto">{text}</p>'
                     for pid, text in paragraphs)
    return (f'<!DOCTYPE html><html lang="en-US"><head><meta charset="utf-8">'
            f'<title>{title}</title></head><body><div id="DisplayArea">'
            f'<a name="bm_id1"></a><meta itemprop="keywords" content="x">'
            f'<h1 id="{title_id}" dir="auto"><a name="h"></a>{title}</h1>\n{body}'
            f'<p id="other">not a segment</p></div></body></html>')


def pages_in(split, n, prefix):
    """``n`` page paths that split_of puts in ``split``."""
    names = (f"text/scalc/01/{prefix}{i}.html" for i in range(10_000))
    return [name for name in names if split_of(name) == split][:n]


def sentence(rng, n):
    return " ".join(rng.choice(WORDS) for _ in range(n)).capitalize() + "."


@pytest.fixture(scope="module")
def help_tree(tmp_path_factory):
    """``root/en-US/...``: pages in every split, each with a title, a description and a
    body; plus pages the builder must drop. Returns (root, {page: (article, summary)})."""
    rng = random.Random(0)
    root = tmp_path_factory.mktemp("help")
    expected = {}

    def write(name, html):
        path = root / "en-US" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(html, encoding="utf-8")

    for split, n in SPLIT_PAGES.items():
        for i, name in enumerate(pages_in(split, n, f"func_{split}_")):
            title = f"{split.upper()}{i} Function"
            description = f"Calculates the {rng.choice(WORDS)} of {split} values number {i}."
            body = [sentence(rng, rng.randint(6, 12)) for _ in range(6)]
            paragraphs = [("par_id2", "Icon"),  # a short label: stays in the article
                          ("par_id3", f'<span class="avis">{description}</span>'),
                          ("hd_id4", "Syntax"), *(
                              (f"par_id{5 + k}", text) for k, text in enumerate(body)),
                          ("par_id20", description)]  # a repeat: left out of the article
            write(name, page_html(title, paragraphs))
            expected[name] = (" ".join([title, "Icon", "Syntax", *body]), description)
    words = [f"w{k}" for k in range(50)]
    drop = {  # split_of puts these in train or not: they are dropped either way
        "text/shared/no_description.html": [("par_id2", "Icon"), ("par_id3", "OK")],
        "text/shared/near_empty.html": [("par_id2", "Moves the object up one level.")],
        "text/shared/long_description.html": [("par_id2", " ".join(words + words[:15])),
                                              ("par_id3", " ".join(words[:40]))],
    }
    for name, paragraphs in drop.items():
        write(name, page_html("Dropped", paragraphs))
    # a test page whose description is a train summary: dropped from test
    train_name, test_name = next(iter(expected)), pages_in("test", 1, "shared_desc_")[0]
    write(test_name, page_html("Other Title", [
        ("par_id2", expected[train_name][1]),
        *((f"par_id{k}", sentence(rng, 10)) for k in range(3, 9))]))
    # the newer id form (par_2016...) holds this page's title
    name = pages_in("train", 1, "new_ids_")[0]
    body = [sentence(rng, 10) for _ in range(5)]
    write(name, page_html("New Ids", [("par_2016112109232", "Adds a set of numbers together."),
                                      *((f"par_id{k}", t) for k, t in enumerate(body))],
                          title_id="hd_2016112109231"))
    expected[name] = (" ".join(["New Ids", *body]), "Adds a set of numbers together.")
    return root, expected


def test_page_pair_takes_the_description_as_summary_and_the_rest_as_article():
    body = ["Choose Format - Arrange - Bring Forward.", "Moves the selected object up one "
            "level, so that it is closer to top of the stacking order."]
    segments = ["Bring Forward", "", "Icon", body[1], "Syntax", body[0], *["x y z w v"] * 6,
                body[1]]
    article, summary = summaries.page_pair(segments)
    assert summary == body[1]
    assert article == " ".join(["Bring Forward", "Icon", "Syntax", body[0], *["x y z w v"] * 6])
    assert summary not in article  # its repeat at the end is left out too
    assert summaries.page_pair(segments, max_article_words=4)[0] == "Bring Forward Icon Syntax"
    assert summaries.page_pair(["Title", "Only short", "Ok"]) is None  # no description
    assert summaries.page_pair(["Title", "A description of four words.", "Too short."]) is None
    assert summaries.page_pair(["Title", " ".join(["w"] * 61), *["x y z w v"] * 7]) is None
    assert summaries.page_pair([]) is None


def test_pages_are_parsed_with_every_segment_id_form(help_tree):
    root, expected = help_tree
    pages = summaries.help_pages(root)
    name = pages_in("train", 1, "new_ids_")[0]
    assert pages[name][:2] == ["New Ids", "Adds a set of numbers together."]
    assert summaries.page_pair(pages[name]) == expected[name]
    assert not any("not a segment" in s for segs in pages.values() for s in segs)


def test_splits_are_by_page_without_near_empty_pages_or_train_summaries(help_tree):
    root, expected = help_tree
    splits, dropped = summaries.build_splits(summaries.help_pages(root))
    assert set(splits) == {"train", "val", "test"}  # prepare_cnndm.py's names
    names = {"valid": "val"}
    want = {names.get(s, s): [] for s in SPLIT_PAGES}
    for name in sorted(expected):  # every kept page in its split_of split, in page order
        want[names.get(split_of(name), split_of(name))].append(expected[name])
    assert splits == want
    assert dropped == {"no description or too short": 3, "duplicate": 0,
                       "summary also in train": 1}


@pytest.fixture(scope="module")
def prepared(help_tree, tmp_path_factory):
    root, _ = help_tree
    out = tmp_path_factory.mktemp("lo_summ")
    log = run([sys.executable, "-m", "experiments.prepare_libreoffice_summaries",
               "--help-root", root, "--out", out, "--vocab-size", 300]).stdout
    return out, log


def test_prepare_writes_the_cnndm_layout(prepared, help_tree):
    out, log = prepared
    _, expected = help_tree
    splits, _ = summaries.build_splits(summaries.help_pages(help_tree[0]),
                                       max_article_words=400)
    for split, pairs in splits.items():
        for side, k in (("source", 0), ("target", 1)):
            lines = (out / "raw" / f"{split}.{side}").read_text(encoding="utf-8").splitlines()
            assert lines == [p[k] for p in pairs] and lines
    stats = json.loads((out / "stats.json").read_text())
    assert stats["pairs"] == {k: len(v) for k, v in splits.items()}
    assert f"pairs train {len(splits['train'])}, val 3, test 3" in log


def test_bpe_files_are_gpt2_format_and_prepare_cnndm_accepts_them(prepared, tmp_path):
    from fairseq.data.encoders.gpt2_bpe_utils import get_encoder
    from tokenizers import ByteLevelBPETokenizer

    out, _ = prepared
    encoder_json, vocab_bpe = out / "gpt2_bpe" / "encoder.json", out / "gpt2_bpe" / "vocab.bpe"
    merges = vocab_bpe.read_text(encoding="utf-8").split("\n")
    assert merges[0] == "#version: 0.2" and merges[-1] == ""  # what fairseq's reader skips
    assert all(len(m.split()) == 2 for m in merges[1:-1])
    vocab = json.loads(encoder_json.read_text(encoding="utf-8"))
    assert len(vocab) == 300 and sorted(vocab.values()) == list(range(300))
    bpe = get_encoder(str(encoder_json), str(vocab_bpe))
    hf = ByteLevelBPETokenizer(str(encoder_json), str(vocab_bpe), add_prefix_space=False)
    text = (out / "raw" / "test.source").read_text(encoding="utf-8").splitlines()[0]
    for line in (text, "Grüße – 漢字 they're"):  # bytes never seen in training encode too
        ids = bpe.encode(line)
        assert ids == hf.encode(line).ids and bpe.decode(ids) == line
    assert len(bpe.encode(text)) < len(text.encode("utf-8"))  # the merges apply
    # dict.txt: fairseq's gpt2 dict, every BPE id once, most frequent first
    entries = [line.split() for line in (out / "dict.txt").read_text().splitlines()]
    assert sorted(int(i) for i, _ in entries) == list(range(300))
    counts = [int(c) for _, c in entries]
    assert counts == sorted(counts, reverse=True) and counts[0] > 0
    assert prepare_cnndm.check_inputs(out / "raw", encoder_json, vocab_bpe,
                                      out / "dict.txt") == ["train", "val", "test"]
    log = run([sys.executable, "-m", "rdrop_fairseq.recipes.prepare_cnndm", "--raw", out / "raw",
               "--out", tmp_path, "--encoder-json", encoder_json, "--vocab-bpe", vocab_bpe,
               "--dict", out / "dict.txt"]).output
    assert (tmp_path / "bin" / "test.source-target.source.bin").is_file()
    assert "0.0% replaced" in log and not re.search(r"[1-9][\d.]*% replaced", log)


def test_prepare_names_what_is_missing(tmp_path):
    with pytest.raises(SystemExit, match=r"en-US not found: --help-root must hold"):
        summaries.help_pages(tmp_path)
    (tmp_path / "en-US").mkdir()
    with pytest.raises(SystemExit, match="no .html help pages"):
        summaries.help_pages(tmp_path)
    proc = run([sys.executable, "-m", "experiments.prepare_libreoffice_summaries",
                "--deb", tmp_path / "missing.deb", "--out", tmp_path], ok=False)
    assert proc.returncode and "apt-get download libreoffice-help-en-us" in proc.stderr


def test_check_end_to_end_baseline_and_rdrop_give_rouge(help_tree, tmp_path):
    """The whole check on the stand-in pages: prepare, a random BART per seed, both modes
    through scripts/cnndm_bart.sh train (2 epochs) and evaluate, the table; a rerun. Run as
    ``python -m`` (each stage a subprocess of its own, one training at a time), warm
    (tests/warm_process.py): the stages are forked by the warm server, not children of the
    check, so the CPU seconds it reads for them are not theirs (the next test checks that
    measurement on real processes)."""
    root, _ = help_tree
    work = tmp_path / "work"
    args = [sys.executable, "-m", "experiments.libreoffice_summarization_check",
            "--help-root", root, "--work", work, "--seeds", 1, "--vocab-size", 300]
    out = run([*args, "--max-epoch", 2, "--max-update", 20, "--max-tokens", 1024,
               "--parallel", 1]).stdout
    results = json.loads((work / "results.json").read_text())
    assert set(results["runs"]) == {"baseline", "R-Drop"}
    n_test = len((work / "data" / "raw" / "test.target").read_text().splitlines())
    for mode, runs in results["runs"].items():
        (r,) = runs
        assert r["seed"] == 1 and len(r["valid_losses"]) == 2
        assert r["best_valid_loss"] == min(r["valid_losses"])
        for key in ("rouge1", "rouge2", "rougeLsum", "rougeL"):
            assert 0 <= r[key] <= 100
        assert 0 <= r["cpu_s"] <= r["wall_s"] + 1 and r["evaluate_cpu_s"] >= 0
        save = work / "runs" / f"{'rdrop' if mode == 'R-Drop' else 'baseline'}_seed1"
        hyps = (save / "checkpoint_best.test.hypo").read_text().splitlines()
        assert len(hyps) == n_test
    rdrop_log = (work / "runs" / "rdrop_seed1.log").read_text()
    baseline_log = (work / "runs" / "baseline_seed1.log").read_text()
    assert "criterion.rdrop_alpha=0.7" in rdrop_log and "| rdrop_kl " in rdrop_log
    assert "criterion.rdrop_alpha=0 " in baseline_log and "rdrop_kl" not in baseline_log
    # both modes of a seed start from the same random BART
    for log in (rdrop_log, baseline_log):
        assert f"Loaded checkpoint {work / 'init' / 'seed1' / 'model.pt'}" in log
    table = (work / "results.md").read_text()
    assert re.search(r"^\| baseline \| [\d.]+ ± 0\.00 \|", table, re.M), table
    assert re.search(r"^\| R-Drop \| [\d.]+ ± 0\.00 \|", table, re.M), table
    assert table in out
    # a rerun reuses the finished trainings and scores
    again = run(args).stdout
    assert "[check] start" not in again and table in again


def test_each_jobs_wall_and_cpu_seconds_are_its_processes(tmp_path):
    """run_parallel, two at a time: each job's LOG.time.json holds the CPU seconds of its own
    processes (wait4), here a child that burns about 1.5 s of CPU beside one that sleeps;
    a job that fails stops the check, naming its log."""
    from experiments.libreoffice_summarization_check import run_parallel

    burn = ("import time\nend = time.process_time() + 1.5\n"
            "while time.process_time() < end: pass")
    jobs = [("burns", [sys.executable, "-c", burn], tmp_path / "burns.log"),
            ("sleeps", [sys.executable, "-c", "import time; time.sleep(1.5)"],
             tmp_path / "sleeps.log")]
    run_parallel(jobs, 2)
    burns, sleeps = (json.loads((tmp_path / f"{name}.time.json").read_text())
                     for name in ("burns", "sleeps"))
    assert burns["cpu_s"] in (1, 2) and burns["wall_s"] >= 1, burns
    assert sleeps["cpu_s"] == 0 and sleeps["wall_s"] >= 1, sleeps
    with pytest.raises(SystemExit,
                       match=re.escape(f"error: fails failed, see {tmp_path / 'fails.log'}")):
        run_parallel([("fails", [sys.executable, "-c", "raise SystemExit(3)"],
                       tmp_path / "fails.log")], 1)
