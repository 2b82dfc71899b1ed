"""The translation recipes end to end on tiny slices, through scripts/iwslt14.sh and
scripts/wmt14.sh: prepare -> train -> average -> evaluate. (What each MODE and GPU count
turns into: tests/test_recipe_scripts.py.)"""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from sacremoses import MosesTokenizer

from experiments.toy_data import write_corpus
from rdrop_fairseq.recipes.evaluate_translation import decoding_for, metric_for, score
from tests.recipe_helpers import script
from tests.warm_process import fairseq_bin, machine_env

REPO = Path(__file__).resolve().parents[1]

TINY_MODEL = [f"model.{side}_{k}={v}" for side in ("encoder", "decoder")
              for k, v in (("layers", 1), ("embed_dim", 32), ("ffn_embed_dim", 64),
                           ("attention_heads", 2))]


def run(cmd, **kw):
    env = {**machine_env(), "PATH": str(Path(sys.executable).parent), "OMP_NUM_THREADS": "1",
           "MKL_NUM_THREADS": "1", "HOME": "/tmp", "FAIRSEQ_BIN": fairseq_bin()}  # fairseq's tools start warm
    proc = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=600,
                          env=env, **kw)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return proc.stdout


def test_paper_metrics_and_decoding_per_recipe_and_pair():
    # De<->En as the authors' compound_split_bleu.sh (IWSLT: run_inference.sh; WMT: issue #19)
    assert metric_for("iwslt", "de", "en") == "tokenized+compound"
    assert metric_for("iwslt", "en", "de") == "tokenized+compound"
    assert metric_for("iwslt", "en", "fr") == "sacrebleu"
    assert metric_for("wmt14", "en", "de") == "tokenized+compound"
    assert metric_for("wmt14", "en", "fr") == "tokenized"
    # beam 4 / lenpen 0.6 for WMT14 En->De only
    assert decoding_for("wmt14", "de") == {"beam": 4, "lenpen": 0.6}
    for recipe, tgt in (("wmt14", "fr"), ("iwslt", "en"), ("iwslt", "de"), ("iwslt", "fr")):
        assert decoding_for(recipe, tgt) == {"beam": 5, "lenpen": 1.0}


def test_sentencepiece_data_is_scored_with_sacrebleu(tmp_path):
    assert metric_for("iwslt", "de", "en", tmp_path) == "tokenized+compound"
    (tmp_path / "spm.en.model").write_bytes(b"")
    assert metric_for("iwslt", "de", "en", tmp_path) == "sacrebleu"


def test_sacrebleu_scores_detokenised_output_against_the_original_references():
    hyps = ["C' est la maison verte , n' est @-@ ce pas ?", "Un chat ."]
    data_bin_refs = ["c' est la maison verte , n' est @-@ ce pas ?", "un chat ."]
    originals = ["C'est la maison verte, n'est-ce pas ?", "Un chat."]
    line, bleu = score("sacrebleu", hyps, data_bin_refs, "fr", original_refs=originals)
    assert bleu == pytest.approx(100) and "case:mixed" in line
    assert "(original references)" in line
    # the same output lower-cased: case-sensitive against the originals it loses, unless
    # --lowercase (for lower-cased data)
    lower = [h.lower() for h in hyps]
    assert score("sacrebleu", lower, data_bin_refs, "fr", original_refs=originals)[1] < 90
    line, bleu = score("sacrebleu", lower, data_bin_refs, "fr", original_refs=originals,
                       lowercase=True)
    assert bleu == pytest.approx(100) and "case:lc" in line
    with pytest.raises(SystemExit, match="1 original references for 2 translations"):
        score("sacrebleu", hyps, data_bin_refs, "fr", original_refs=originals[:1])


def test_recipe_end_to_end_on_a_tiny_slice(tmp_path):
    write_corpus(tmp_path / "raw", {"train": 300, "valid": 20, "test": 20}, vocab=30,
                 max_len=8)
    prep = tmp_path / "prep"
    run([sys.executable, "-m", "rdrop_fairseq.recipes.prepare_translation", "--raw", tmp_path / "raw",
         "--out", prep, "--bpe-merges", "30"])
    save = tmp_path / "ckpt"
    out = script("iwslt14", "train", *TINY_MODEL, "optimization.max_update=6",
                 "task.eval_bleu_args='{\"beam\": 1, \"max_len_b\": 10}'",
                 "common.log_interval=1", GPUS=0, DATA_DIR=prep, SAVE_DIR=save).output
    assert "batch: 1 device(s) x update-freq 1 x max-tokens 4096 = 4096 tokens" in out
    # the loss path, as the script says it and as the criterion ran it
    assert "[iwslt14] loss: the logits path (the recipe's default)" in out
    assert "R-Drop loss: the logits path, --rdrop-impl auto" in out
    kls = [float(x) for x in re.findall(r"rdrop_kl=([\d.]+)", out)]
    assert len(kls) == 6 and all(k > 0 for k in kls), out[-3000:]
    assert re.search(r"valid on 'valid' subset .*\| bleu [\d.]+", out), out[-3000:]
    epochs = sorted(save.glob("checkpoint[0-9]*.pt"))
    assert len(epochs) >= 2

    avg = tmp_path / "avg.pt"
    out = run([sys.executable, "-m", "rdrop_fairseq.recipes.average_checkpoints", "--inputs", save,
               "--num-epoch-checkpoints", "2", "--output", avg])
    assert "averaged 2 checkpoints" in out

    out = run([sys.executable, "-m", "rdrop_fairseq.recipes.evaluate_translation", "iwslt",
               "--data", prep / "bin", "--checkpoint", avg, "--src", "de", "--tgt", "en",
               "--cpu", "--out", tmp_path / "gen.txt"])
    m = re.search(r"test: (\d+) sentences, tokenized BLEU \(tokenized\+compound\) = "
                  r"([\d.]+)", out)
    assert m and int(m[1]) == 20 and 0 <= float(m[2]) <= 100, out
    assert len(re.findall(r"^H-\d+", (tmp_path / "gen.txt").read_text(), re.M)) == 20


def test_prepare_iwslt_follows_fairseqs_iwslt14_recipe(tmp_path):
    import tarfile

    orig = tmp_path / "src" / "de-en"
    orig.mkdir(parents=True)
    train = {"de": [], "en": []}
    for lang, word in (("de", "Haus"), ("en", "House")):
        lines = ["<url>http://www.ted.com/talks/x</url>", "<talkid>1</talkid>",
                 "<keywords>talks</keywords>", f"<title>{word} Titel</title>",
                 f"<description>{word} Beschreibung</description>"]
        lines += [f"{word} Nummer {i} ." for i in range(46)]
        (orig / f"train.tags.de-en.{lang}").write_text("\n".join(lines) + "\n")
        train[lang] = lines
        for name, n in (("IWSLT14.TED.tst2011", 2), ("IWSLT14.TED.dev2010", 1),
                        ("IWSLT14.TEDX.dev2012", 1), ("IWSLT14.TED.tst2010", 1)):
            segs = "".join(f'<seg id="{i}"> {word} {name} {i} it\u2019s </seg>\n'
                           for i in range(1, n + 1))
            (orig / f"{name}.de-en.{lang}.xml").write_text(f"<doc>\n{segs}</doc>\n")
    archive = tmp_path / "de-en.tgz"
    with tarfile.open(archive, "w:gz") as tar:
        tar.add(orig, arcname="de-en")

    out = tmp_path / "iwslt"
    run([sys.executable, "-m", "rdrop_fairseq.recipes.prepare_iwslt", "--archive", archive,
         "--src", "de", "--tgt", "en", "--out", out, "--bpe-merges", "20"])
    raw_train = (out / "raw" / "train.en").read_text().splitlines()
    assert raw_train[:2] == ["House Titel", "House Beschreibung"]  # tags stripped, markup gone
    assert len(raw_train) == 48
    test = (out / "tok" / "test.en").read_text().splitlines()
    assert [t.split()[1] for t in test] == [  # dev sets, then tst sets by year
        "iwslt14.ted.dev2010", "iwslt14.tedx.dev2012", "iwslt14.ted.tst2010",
        "iwslt14.ted.tst2011", "iwslt14.ted.tst2011"]
    assert test[0].endswith("it 's")  # ’ -> ' then Moses tokenisation, lower-cased
    valid = (out / "tok" / "valid.en").read_text().splitlines()
    train_tok = (out / "tok" / "train.en").read_text().splitlines()
    assert valid == ["house nummer 20 .", "house nummer 43 ."]  # lines 23 and 46 (awk NR%23)
    assert len(train_tok) == 46 and not set(valid) & set(train_tok)
    assert (out / "bin" / "test.de-en.de.bin").is_file()
    assert json.loads((out / "bin" / "prepared.json").read_text()) == {"lowercase": True}


def test_prepare_iwslt_keeps_the_case_of_en_fr_for_sacrebleu(tmp_path):
    """Pairs other than De<->En keep their case (the paper's sacreBLEU is cased), and the
    evaluation finds the original test references in OUT/raw."""
    import tarfile

    from rdrop_fairseq.recipes.evaluate_translation import original_references

    orig = tmp_path / "src" / "en-fr"
    orig.mkdir(parents=True)
    for lang, word in (("en", "House"), ("fr", "Maison")):
        lines = [f"{word} Nummer {i} ." for i in range(46)]
        (orig / f"train.tags.en-fr.{lang}").write_text("\n".join(lines) + "\n")
        segs = f'<seg id="1"> {word}, it\u2019s New-York </seg>\n'
        (orig / f"IWSLT14.TED.tst2010.en-fr.{lang}.xml").write_text(f"<doc>\n{segs}</doc>\n")
    archive = tmp_path / "en-fr.tgz"
    with tarfile.open(archive, "w:gz") as tar:
        tar.add(orig, arcname="en-fr")
    out = tmp_path / "iwslt"
    run([sys.executable, "-m", "rdrop_fairseq.recipes.prepare_iwslt", "--archive", archive,
         "--src", "en", "--tgt", "fr", "--out", out, "--bpe-merges", "20"])
    # Moses' French tokenisation, case kept
    assert (out / "tok" / "test.fr").read_text().splitlines() == ["Maison , it' s New-York"]
    assert (out / "tok" / "train.fr").read_text().splitlines()[0] == "Maison Nummer 0 ."
    assert original_references(out / "bin", "test", "fr") == ["Maison, it's New-York"]
    assert original_references(out / "bin", "valid", "fr") is None  # no original: data-bin's
    assert json.loads((out / "bin" / "prepared.json").read_text()) == {"lowercase": False}


def test_lower_cased_data_is_scored_case_insensitively(tmp_path, monkeypatch, capsys):
    """prepare_iwslt --lowercase on a cased pair (issue 26): the data-bin's prepared.json
    says so, and evaluation scores sacreBLEU case-insensitively against the cased original
    references; without the record, case-sensitively. fairseq-generate is replaced by its
    output: lower-cased Moses tokens, the references' words exactly."""
    from rdrop_fairseq.recipes import evaluate_translation

    refs = ["The House of Commons met on Tuesday in London.",
            "Paris is the capital of France, they said.",
            "We thank the Congress for the work of this year."]
    hyps = [" ".join(MosesTokenizer(lang="en").tokenize(r.lower(), escape=False)) for r in refs]
    generated = "".join(f"S-{i}\tx\nT-{i}\t{h}\nH-{i}\t-0.1\t{h}\n" for i, h in enumerate(hyps))

    def fake_generate(cmd, stdout, **kw):
        stdout.write(generated)
    monkeypatch.setattr(evaluate_translation.subprocess, "run", fake_generate)
    (tmp_path / "raw").mkdir()
    (tmp_path / "raw" / "test.en").write_text("\n".join(refs) + "\n")
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "dict.fr.txt").touch()  # what evaluate checks a data-bin by
    (tmp_path / "model.pt").write_bytes(b"")
    args = ["iwslt", "--data", str(tmp_path / "bin"), "--src", "fr", "--tgt", "en",
            "--checkpoint", str(tmp_path / "model.pt"), "--cpu"]

    def sacrebleu_line():
        evaluate_translation.main(args)
        out = capsys.readouterr().out
        return re.search(r"^test: 3 sentences, sacreBLEU = ([\d.]+) +(\S+)", out, re.M)

    cased = sacrebleu_line()  # no record: case-sensitive
    assert float(cased[1]) < 60 and "|case:mixed|" in cased[2]
    (tmp_path / "bin" / "prepared.json").write_text('{"lowercase": true}\n')
    lower = sacrebleu_line()
    assert float(lower[1]) == 100.0 and "|case:lc|" in lower[2]
    (tmp_path / "bin" / "prepared.json").write_text('{"lowercase": false}\n')
    assert sacrebleu_line()[1] == cased[1]


def test_average_checkpoints_is_the_mean_of_the_float_parameters(tmp_path):
    import argparse

    import torch

    from rdrop_fairseq.recipes.average_checkpoints import average, last_checkpoints

    for i, scale in enumerate((1.0, 2.0, 6.0), start=1):
        torch.save({"model": {"w": torch.full((2, 2), scale), "h": torch.tensor([scale]).half(),
                              "steps": torch.tensor([i])},
                    "cfg": {"model": argparse.Namespace(arch="x")},
                    "last_optimizer_state": {"m": 1}, "extra_state": {"epoch": i}},
                   tmp_path / f"checkpoint{i}.pt")
    (tmp_path / "checkpoint_last.pt").write_bytes(b"")  # not numbered: ignored
    paths = last_checkpoints(tmp_path, 2, r"checkpoint(\d+)\.pt")
    assert [p.name for p in paths] == ["checkpoint2.pt", "checkpoint3.pt"]
    state = average(paths)
    assert torch.equal(state["model"]["w"], torch.full((2, 2), 4.0))
    assert state["model"]["h"].dtype == torch.float16 and state["model"]["h"].item() == 4.0
    assert state["model"]["steps"].item() == 2  # non-float: the first checkpoint's
    assert "last_optimizer_state" not in state and state["extra_state"] == {"epoch": 2}
    with pytest.raises(SystemExit, match="4 requested"):
        last_checkpoints(tmp_path, 4, r"checkpoint(\d+)\.pt")


def _tgz(path, files):
    """A .tgz holding ``{name: lines}``."""
    import io
    import tarfile

    with tarfile.open(path, "w:gz") as tar:
        for name, lines in files.items():
            data = "".join(line + "\n" for line in lines).encode()
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))


def _sgm(lines):
    return ["<srcset>", '<doc docid="x">'] + [f'<seg id="{i}">{line}</seg>'
                                                for i, line in enumerate(lines, 1)] + ["</doc>"]


def test_prepare_wmt14_follows_fairseqs_wmt14_recipe_end_to_end(tmp_path):
    """Official archive layout -> normalised, -a tokenised, every 100th line as valid, cleaned
    after BPE; then train a few updates, generate and score with compound splitting."""
    words = ["house", "garden", "well-known", "car", "tree", "green", "small", "road"]
    wort = {"house": "Haus", "garden": "Garten", "well-known": "alt-bekannt", "car": "Auto",
            "tree": "Baum", "green": "grün", "small": "klein", "road": "Straße"}
    en, de = [], []
    for i in range(240):
        sent = [words[(i * 3 + k) % len(words)] for k in range(3 + i % 4)]
        en.append(" ".join(sent) + " .")
        de.append(" ".join(wort[w] for w in sent) + " .")
    en[4], de[4] = "the \u201chouse\u201d\u200bgarden .", "das \u201eHaus\u201c\u200bGarten ."
    en[6], de[6] = " ".join(["tree"] * 300), " ".join(["Baum"] * 300)  # > 250: cleaned out
    en[8], de[8] = "car", " ".join(["Auto"] * 12)  # ratio > 1.5: cleaned out
    en[199], de[199] = " ".join(["road"] * 260), " ".join(["Straße"] * 260)  # valid line 200
    orig = tmp_path / "orig"
    orig.mkdir()
    split = {"europarl": (0, 100), "commoncrawl": (100, 160), "nc": (160, 240)}
    names = {"europarl": ("training-parallel-europarl-v7.tgz", "training/europarl-v7.de-en"),
             "commoncrawl": ("training-parallel-commoncrawl.tgz", "commoncrawl.de-en"),
             "nc": ("training-parallel-nc-v12.tgz", "training/news-commentary-v12.de-en")}
    for key, (archive, corpus) in names.items():
        lo, hi = split[key]
        _tgz(orig / archive, {f"{corpus}.en": en[lo:hi], f"{corpus}.de": de[lo:hi]})
    test_en = ["the house\u2019s well-known garden", "car"]  # ratio > 1.5, but test stays whole
    test_de = ["des Hauses alt-bekannter Garten", " ".join(["Auto"] * 12)]
    _tgz(orig / "test-full.tgz", {"test-full/newstest2014-deen-src.en.sgm": _sgm(test_en),
                                  "test-full/newstest2014-deen-ref.de.sgm": _sgm(test_de)})

    out = tmp_path / "wmt"
    log = run([sys.executable, "-m", "rdrop_fairseq.recipes.prepare_wmt14", "--pair", "en-de",
               "--orig", orig, "--extract-to", tmp_path / "extracted", "--out", out,
               "--bpe-merges", "30", "--workers", "1"])
    assert sorted(p.name for p in orig.iterdir()) == sorted(  # ORIG used as it is
        [a for a, _ in names.values()] + ["test-full.tgz"])
    tok_en = (out / "tok" / "train.en").read_text().splitlines()
    tok_de = (out / "tok" / "train.de").read_text().splitlines()
    assert tok_de[4] == 'das " Haus " Garten .'  # „“ normalised, zero-width space removed
    assert tok_en[4] == 'the " house " garden .'
    assert tok_en[0] == "house garden well @-@ known ."  # aggressive hyphen splitting
    valid_en = (out / "tok" / "valid.en").read_text().splitlines()
    assert valid_en == [_tok_en(en[99]), _tok_en(en[199])]  # lines 100 and 200, uncleaned
    assert len(tok_en) == 238
    bpe_valid = (out / "bpe" / "valid.en").read_text().splitlines()
    assert len(bpe_valid) == 1  # the 260-token line is cleaned out of valid after BPE
    bpe_train = (out / "bpe" / "train.en").read_text().splitlines()
    assert len(bpe_train) == 236  # the 300-token and the ratio-4 pairs are gone
    assert re.search(r"2 of 238 pairs|236 of 238 pairs", log)
    test = (out / "tok" / "test.en").read_text().splitlines()
    assert test[0] == "the house 's well @-@ known garden" and len(test) == 2  # test kept whole
    assert (out / "bin" / "test.en-de.de.bin").is_file()

    save = tmp_path / "ckpt"
    env = dict(GPUS=0, DATA_DIR=out, SAVE_DIR=save, MAX_TOKENS=4096, UPDATE_FREQ=1)
    script("wmt14", "train", *TINY_MODEL, "optimization.max_update=4",
           "dataset.required_batch_size_multiple=1", **env)  # valid holds one pair
    # AVERAGE: the average of the last epoch checkpoints (here 2); beam 4, lenpen 0.6
    result = script("wmt14", "evaluate", "--out", tmp_path / "gen.txt", AVERAGE=2, **env).output
    assert re.search(r"averaged 2 checkpoints \(checkpoint\d\.pt, checkpoint\d\.pt\)", result)
    m = re.search(r"test: 2 sentences, tokenized BLEU \(tokenized\+compound\) = ([\d.]+)", result)
    assert m and 0 <= float(m[1]) <= 100, result
    assert "[evaluate] beam 4, lenpen 0.6" in result


def test_prepare_wmt14_google_binarises_the_authors_wmt16_files(tmp_path, capsys):
    """GOOGLE=DIR: Google's WMT'16 En-De files (already tokenised and BPE'd) binarised as
    fairseq's Scaling NMT recipe: joined dictionary, newstest2013 valid, newstest2014 test."""
    from fairseq.data import Dictionary, data_utils

    google = tmp_path / "wmt16_en_de_bpe32k"
    google.mkdir()
    text = {"train.tok.clean.bpe.32000": [("the well-known house .", "das alt@@ bekannte Haus ."),
                                          ("a car", "ein Auto")] * 5,
            "newstest2013.tok.bpe.32000": [("the car .", "das Auto .")],
            "newstest2014.tok.bpe.32000": [("a house", "ein Haus"), ("the car", "das Auto")]}
    for prefix, pairs in text.items():
        for side, lang in enumerate(("en", "de")):
            (google / f"{prefix}.{lang}").write_text("".join(p[side] + "\n" for p in pairs))
    (google / "vocab.bpe.32000").write_text("the\n")  # in the archive, not used
    out = tmp_path / "data"
    script("wmt14", "prepare", GOOGLE=google, DATA_DIR=out)
    en, de = ((out / "bin" / f"dict.{lang}.txt").read_text() for lang in ("en", "de"))
    assert en == de and "Haus 5" in en and "house 5" in de  # one joined dictionary (train)
    dictionary = Dictionary.load(str(out / "bin" / "dict.de.txt"))
    for split, prefix in (("valid", "newstest2013"), ("test", "newstest2014")):
        data = data_utils.load_indexed_dataset(str(out / "bin" / f"{split}.en-de.de"),
                                               dictionary)
        expected = [p[1] for p in text[f"{prefix}.tok.bpe.32000"]]
        assert [dictionary.string(data[i]) for i in range(len(data))] == expected

    from rdrop_fairseq.recipes import prepare_wmt14

    with pytest.raises(SystemExit):  # the files are BPE'd already: no --bpe-merges
        prepare_wmt14.main(["--google", str(google), "--out", str(tmp_path / "x"),
                            "--bpe-merges", "100"])
    assert "--bpe-merges apply to the official archives" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        prepare_wmt14.main(["--google", str(google), "--pair", "en-fr", "--out", str(tmp_path)])
    assert "--google is Google's WMT'16 En-De: --pair en-de" in capsys.readouterr().err
    (google / "newstest2013.tok.bpe.32000.de").unlink()
    proc = script("wmt14", "prepare", ok=False, GOOGLE=google, DATA_DIR=tmp_path / "again")
    assert "lacks newstest2013.tok.bpe.32000.de" in proc.stderr, proc.stderr
    assert not (tmp_path / "again").exists()


def _tok_en(line):
    from sacremoses import MosesTokenizer

    return MosesTokenizer("en").tokenize(line, aggressive_dash_splits=True, escape=False,
                                         return_str=True)


def test_prepare_wmt14_says_which_archive_is_missing(tmp_path):
    """It downloads nothing (scripts/wmt14.sh fetches the archives): a missing archive is
    named with the command that fetches it."""
    proc = subprocess.run([sys.executable, "-m", "rdrop_fairseq.recipes.prepare_wmt14", "--orig",
                           tmp_path, "--out", tmp_path / "out"], capture_output=True, text=True,
                          env={**machine_env(), "PATH": str(Path(sys.executable).parent)},
                          timeout=120)
    assert proc.returncode != 0
    assert f"{tmp_path} lacks training-parallel-europarl-v7.tgz" in proc.stderr, proc.stderr
    assert f"fetch --dir {tmp_path} wmt13-europarl-v7 " in proc.stderr
    assert list(tmp_path.iterdir()) == []


ZH = {"house": "房子", "garden": "花园", "car": "汽车", "tree": "大树", "green": "绿色的",
      "small": "小小的", "road": "道路", "friend": "朋友", "likes": "喜欢", "the": "这个"}


def test_iwslt_en_zh_separate_sentencepiece_dictionaries_end_to_end(tmp_path):
    """En->Zh: Chinese segmented by sentencepiece, one dictionary per language, the model
    without shared embeddings, sacreBLEU with its zh tokenisation."""
    import tarfile

    words = list(ZH)
    lines = {"en": [], "zh": []}
    for i in range(150):
        sent = [words[(i * 7 + k) % len(words)] for k in range(2 + i % 5)]
        lines["en"].append(" ".join(sent) + ".")
        lines["zh"].append("".join(ZH[w] for w in sent) + "。")
    orig = tmp_path / "src" / "en-zh"
    orig.mkdir(parents=True)
    for lang in ("en", "zh"):
        (orig / f"train.tags.en-zh.{lang}").write_text(
            "<url>x</url>\n" + "\n".join(lines[lang][:138]) + "\n", encoding="utf-8")
        segs = "".join(f'<seg id="{i}"> {s} </seg>\n' for i, s in enumerate(lines[lang][138:]))
        (orig / f"IWSLT17.TED.tst2015.en-zh.{lang}.xml").write_text(f"<doc>\n{segs}</doc>\n",
                                                                    encoding="utf-8")
    archive = tmp_path / "en-zh.tgz"
    with tarfile.open(archive, "w:gz") as tar:
        tar.add(orig, arcname="en-zh")

    out = tmp_path / "iwslt"
    run([sys.executable, "-m", "rdrop_fairseq.recipes.prepare_iwslt", "--archive", archive,
         "--src", "en", "--tgt", "zh", "--out", out, "--vocab-size", "60"])
    bin_dir = out / "bin"
    assert (bin_dir / "spm.en.model").is_file() and (bin_dir / "spm.zh.model").is_file()
    dict_en = (bin_dir / "dict.en.txt").read_text(encoding="utf-8")
    dict_zh = (bin_dir / "dict.zh.txt").read_text(encoding="utf-8")
    assert dict_en != dict_zh and not re.search(r"[\u4e00-\u9fff]", dict_en)
    zh_pieces = (out / "bpe" / "train.zh").read_text(encoding="utf-8").splitlines()
    assert all(len(line.split()) > 1 for line in zh_pieces[:20])  # segmented, not one token
    assert "".join(zh_pieces[0].split()).replace("\u2581", "") == lines["zh"][0]

    env = dict(GPUS=0, DATA_DIR=out, SAVE_DIR=tmp_path / "ckpt", SRC="en", TGT="zh")
    log = script("iwslt14", "train", *TINY_MODEL, "optimization.max_update=4",
                 "dataset.required_batch_size_multiple=1", **env).output
    assert "++model.share_all_embeddings=false" in log and "++task.eval_bleu=false" in log
    result = script("iwslt14", "evaluate", "--out", tmp_path / "gen.txt", **env).output
    m = re.search(r"test: 12 sentences, sacreBLEU = ([\d.]+) .*tok:zh", result)
    assert m and 0 <= float(m[1]) <= 100, result
    gen = (tmp_path / "gen.txt").read_text(encoding="utf-8")
    refs = re.findall(r"^T-\d+\t(.*)$", gen, re.M)
    assert sorted(refs) == sorted(lines["zh"][138:])  # references decoded back to raw text


@pytest.mark.parametrize("argv, message", [
    (["--src", "en", "--tgt", "zh"], "does not segment 'zh'"),
    (["--separate-dictionaries"], "needs --subword sentencepiece"),
    (["--subword", "sentencepiece", "--lowercase"], "apply to Moses tokens"),
])
def test_prepare_translation_refuses_settings_that_cannot_work(tmp_path, argv, message,
                                                               capsys):
    from rdrop_fairseq.recipes import prepare_translation

    with pytest.raises(SystemExit):
        prepare_translation.parse_args(["--raw", str(tmp_path), "--out", str(tmp_path), *argv])
    assert message in capsys.readouterr().err


def test_non_printing_characters_become_spaces_and_punctuation_is_normalised():
    from rdrop_fairseq.recipes import prepare_translation

    line = "a\u200bb\x07c \u201ed\u201c e\u2026"
    out = prepare_translation._process(line, "de", normalize=True, aggressive_dash=False,
                                       lowercase=False)
    assert out == 'a b c " d " e ...'
    assert prepare_translation.clean(["a b c d"], ["x"], 250, 0) == (["a b c d"], ["x"])
    assert prepare_translation.clean(["a b c d"], ["x"], 250, 1.5) == ([], [])


def test_wmt14_extracts_a_user_set_orig_elsewhere(tmp_path):
    """ORIG set by the user is used as it is: the archives are extracted beside DATA_DIR."""
    from tests.recipe_helpers import dry_run

    (command,), _ = dry_run("wmt14", "prepare", ORIG=tmp_path / "mine", DATA_DIR=tmp_path / "d")
    assert command[command.index("--orig") + 1] == str(tmp_path / "mine")
    assert command[command.index("--extract-to") + 1] == str(tmp_path / "wmt14-extracted")
    commands, _ = dry_run("wmt14", "prepare", DATA_DIR=tmp_path / "d")
    assert "--extract-to" not in commands[-1]  # its own ORIG: extracted in place
