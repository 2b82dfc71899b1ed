"""The toy demo (experiments.toy_demo), shrunk: trains, generates and prints its table.
Hypotheses are capped at 20 tokens (fairseq's default: 200): after 4 updates the models
decode to the cap, and the cap is what the decoding costs."""

import re
import subprocess
import sys
from pathlib import Path

from tests.warm_process import fairseq_bin, machine_env

REPO = Path(__file__).resolve().parents[2]


def test_toy_demo_trains_generates_and_prints_the_table(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "experiments.toy_demo", "--out", tmp_path / "demo",
         "--max-update", "4", "--train-pairs", "400", "--eval-pairs", "20", "--with-baseline",
         "--max-len-b", "20"],  # toy targets have 3-12 tokens
        capture_output=True, text=True, timeout=600,
        env={**machine_env(), "PATH": str(Path(sys.executable).parent), "OMP_NUM_THREADS": "1",
             "MKL_NUM_THREADS": "1", "FAIRSEQ_BIN": fairseq_bin()},  # fairseq's tools start warm
        cwd=REPO,
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
