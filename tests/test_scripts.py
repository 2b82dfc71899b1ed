"""The recipe modules: data preparation and BLEU scoring. (The README's first command, the
LibreOffice demo, is tested in test_demo_rerun.py.)"""

import math
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.warm_process import fairseq_bin, machine_env


REPO = Path(__file__).resolve().parents[1]


def test_prepare_translation_tokenises_cleans_bpe_and_binarizes(tmp_path):
    raw = tmp_path / "raw"
    raw.mkdir()
    words = ["Haus", "Baum", "Katze", "Hund", "Auto", "Buch"]
    train_de = [f"Das {w}, bitte." for w in words] * 5 + ["Ein sehr langer Satz mit vielen Wörtern ."]
    train_en = [f"The {w.lower()}, please." for w in words] * 5 + ["Short ."]  # ratio 9: dropped
    for split, de, en in (("train", train_de, train_en),
                          ("valid", train_de[:3], train_en[:3]), ("test", train_de[3:6], train_en[3:6])):
        (raw / f"{split}.de").write_text("\n".join(de) + "\n")
        (raw / f"{split}.en").write_text("\n".join(en) + "\n")
    out = tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, "-m", "rdrop_fairseq.recipes.prepare_translation", "--raw", raw,
         "--out", out, "--bpe-merges", "20", "--lowercase"],
        capture_output=True, text=True, timeout=300,
        env={**machine_env(), "PATH": str(Path(sys.executable).parent), "OMP_NUM_THREADS": "1",
             "MKL_NUM_THREADS": "1", "FAIRSEQ_BIN": fairseq_bin()},  # fairseq-preprocess starts warm
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    tok = (out / "tok" / "train.de").read_text().splitlines()
    assert len(tok) == 30  # the pair with length ratio 9 > 1.5 is cleaned away
    assert tok[0] == "das haus , bitte ."  # Moses tokenisation, lower-cased
    assert len((out / "tok" / "test.de").read_text().splitlines()) == 3  # test is not cleaned
    assert (out / "bpe.codes").read_text().count("\n") >= 20
    assert "@@" in (out / "bpe" / "train.de").read_text()  # BPE applied
    for name in ("dict.de.txt", "dict.en.txt", "train.de-en.de.bin", "test.de-en.en.idx"):
        assert (out / "bin" / name).is_file(), name
    assert (out / "bin" / "dict.de.txt").read_text() == (out / "bin" / "dict.en.txt").read_text()


def test_prepare_translation_exports_the_committed_libreoffice_corpus(tmp_path):
    from rdrop_fairseq.recipes.prepare_libreoffice_corpus import read_pairs
    from rdrop_fairseq.recipes.prepare_translation import export_libreoffice

    export_libreoffice(tmp_path)
    pairs = read_pairs(REPO / "data" / "libreoffice-help-de-en" / "test.tsv.xz")
    de = (tmp_path / "test.de").read_text(encoding="utf-8").splitlines()
    en = (tmp_path / "test.en").read_text(encoding="utf-8").splitlines()
    assert list(zip(de, en)) == pairs


def test_tokenized_bleu_matches_a_hand_computed_multi_bleu_value(tmp_path):
    """Two sentences, n-gram counts worked out by hand:

    "the cat sat on the mat" vs "the cat sat on a mat": 1-grams 5/6 ("the" clipped to 1),
    2-grams 3/5, 3-grams 2/4, 4-grams 1/3; "a b c d" vs "a b c d e": 4/4, 3/3, 2/2, 1/1.
    Corpus: p = 9/10, 6/8, 4/6, 2/4; hypothesis length 10, reference length 11, so the
    brevity penalty is exp(1 - 11/10).
    """
    hyps = ["the cat sat on the mat", "a b c d"]
    refs = ["the cat sat on a mat", "a b c d e"]
    expected = 100 * math.exp(1 - 11 / 10) * math.exp(
        (math.log(9 / 10) + math.log(6 / 8) + math.log(4 / 6) + math.log(2 / 4)) / 4)
    assert expected == pytest.approx(62.32, abs=0.01)

    from rdrop_fairseq.recipes.score_bleu import tokenized_bleu

    assert tokenized_bleu(hyps, refs).score == pytest.approx(expected, abs=1e-6)
    # multi-bleu.perl is case-sensitive and unsmoothed: no 4-gram match gives 0
    assert tokenized_bleu(["The cat sat on the mat"], ["the cat sat on the mat"]).score < 100
    assert tokenized_bleu(["the cat sat on"], ["the cat lay on"]).score == 0

    # the same through the CLI, from fairseq-generate's output format
    gen = tmp_path / "gen.out"
    gen.write_text("".join(f"S-{i}\tsrc\nT-{i}\t{r}\nH-{i}\t-0.5\t{h}\nD-{i}\t-0.5\t{h}\n"
                           for i, (h, r) in reversed(list(enumerate(zip(hyps, refs))))))
    out = subprocess.run([sys.executable, "-m", "rdrop_fairseq.recipes.score_bleu",
                          "--generate-output", gen, "--tokenized"],
                         capture_output=True, text=True, check=True).stdout
    assert re.search(r"tokenized BLEU \(multi-bleu.perl\) = 62\.32,", out), out


def test_compound_splitting_follows_fairseqs_convention():
    from rdrop_fairseq.recipes.score_bleu import compound_split, tokenized_bleu

    assert compound_split("state-of-the-art x") == \
        "state ##AT##-##AT## of ##AT##-##AT## the ##AT##-##AT## art x"
    assert compound_split("a - b") == "a - b"  # a free-standing hyphen is left alone
    # splitting turns one wrong compound into partly matching tokens
    hyp = ["wir haben einen Test-Fall für das neue System heute"]
    ref = ["wir haben einen Test-Satz für das neue System heute"]
    plain, split = tokenized_bleu(hyp, ref), tokenized_bleu(hyp, ref, compound=True)
    assert plain.sys_len == 9 and split.sys_len == 11
    assert split.score > plain.score


def test_sacrebleu_mode_prints_the_signature(tmp_path):
    (tmp_path / "hyp").write_text("The cat sat on the mat.\n")
    (tmp_path / "ref").write_text("The cat sat on the mat.\n")
    out = subprocess.run([sys.executable, "-m", "rdrop_fairseq.recipes.score_bleu",
                          "--hyp", tmp_path / "hyp", "--ref", tmp_path / "ref"],
                         capture_output=True, text=True, check=True).stdout
    assert re.search(r"sacreBLEU = 100\.00\s+nrefs:1\|case:mixed\|eff:no\|tok:13a", out), out
