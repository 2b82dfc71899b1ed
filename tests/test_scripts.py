"""The README's first command, shrunk: scripts/toy_demo.py end to end on a few updates."""

import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_toy_demo_trains_generates_and_prints_the_table(tmp_path):
    proc = subprocess.run(
        [sys.executable, REPO / "scripts" / "toy_demo.py", "--out", tmp_path / "demo",
         "--max-update", "20", "--with-baseline"],
        capture_output=True, text=True, timeout=600,
        env={"PATH": str(Path(sys.executable).parent), "OMP_NUM_THREADS": "1"},
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "[demo] training R-Drop (alpha 5)" in proc.stdout  # progress is shown
    assert re.search(r"^\s+valid \| epoch 001", proc.stdout, re.M), proc.stdout[-2000:]
    rows = re.findall(r"^\| (baseline|R-Drop \(alpha 5\)) \| ([\d.]+) \| ([\d.]+) \| (\S+) \|",
                      proc.stdout, re.M)
    assert [r[0] for r in rows] == ["baseline", "R-Drop (alpha 5)"], proc.stdout[-2000:]
    for name, valid_bleu, test_bleu, kl in rows:
        assert 0 <= float(valid_bleu) <= 100 and 0 <= float(test_bleu) <= 100
    assert rows[0][3] == "-" and float(rows[1][3]) > 0  # only R-Drop logs a KL
    for run in ("baseline", "r_drop_alpha_5"):
        assert (tmp_path / "demo" / run / "checkpoint_best.pt").is_file()


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
        [sys.executable, REPO / "scripts" / "prepare_translation.py", "--raw", raw,
         "--out", out, "--bpe-merges", "20", "--lowercase"],
        capture_output=True, text=True, timeout=300,
        env={"PATH": str(Path(sys.executable).parent), "OMP_NUM_THREADS": "1"},
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
    sys.path.insert(0, str(REPO / "scripts"))
    from prepare_libreoffice_corpus import read_pairs
    from prepare_translation import export_libreoffice

    export_libreoffice(tmp_path)
    pairs = read_pairs(REPO / "data" / "libreoffice-help-de-en" / "test.tsv.xz")
    de = (tmp_path / "test.de").read_text(encoding="utf-8").splitlines()
    en = (tmp_path / "test.en").read_text(encoding="utf-8").splitlines()
    assert list(zip(de, en)) == pairs
