"""experiments/kstep_check.py: reading fairseq's logs, the summary's arithmetic, the committed
output against the committed runs, and a tiny run end to end."""

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from experiments import kstep_check as k

REPO = Path(__file__).resolve().parents[2]
COMMITTED = REPO / "experiments" / "results" / "kstep"


def train_line(epoch, updates, wall, rdrop=None):
    extra = "" if rdrop is None else f" | rdrop_updates {rdrop}"
    return (f"2026-12-07 06:30:06 | INFO | train | epoch {epoch:03d} | loss 8.6 | nll_loss 8.1"
            f"{extra} | ppl 273.45 | num_updates {updates} | lr 0.001 | train_wall {wall} "
            f"| wall {wall + 5}")


def valid_line(epoch, bleu):
    return (f"2026-12-07 06:30:09 | INFO | valid | epoch {epoch:03d} | valid on 'valid' subset "
            f"| loss 8.2 | bleu {bleu} | wps 4000 | num_updates {epoch * 10}")


def test_epoch_rows_read_the_validated_epochs_with_the_time_and_updates_so_far():
    log = "\n".join([train_line(1, 10, 36, 5), train_line(2, 20, 36, 5), valid_line(2, 1.5),
                     # a restart re-logs epoch 3: the last one counts
                     train_line(3, 30, 50, 5), train_line(3, 30, 36, 5),
                     train_line(4, 40, 36, 5), valid_line(4, 3.25)])
    assert k.epoch_rows(log) == [
        {"epoch": 2, "updates": 20, "hours": 0.02, "valid_bleu": 1.5, "rdrop_updates": 10},
        {"epoch": 4, "updates": 40, "hours": 0.04, "valid_bleu": 3.25, "rdrop_updates": 20}]
    baseline = "\n".join([train_line(1, 10, 18), valid_line(1, 2.0)])
    assert k.epoch_rows(baseline)[0]["rdrop_updates"] == 0


def run(test_bleu, rows):
    """A run's result from (hours, updates, valid BLEU, R-Drop updates) rows."""
    return {"test_bleu": test_bleu, "epochs": [
        {"epoch": i + 1, "hours": h, "updates": u, "valid_bleu": b, "rdrop_updates": r}
        for i, (h, u, b, r) in enumerate(rows)]}


def test_the_summary_divides_time_by_updates_and_reads_the_budgets():
    done = {(0, False): {1: run(20.0, [(0.5, 100, 10.0, 0), (1.0, 200, 15.0, 0)]),
                         2: run(21.0, [(0.5, 100, 11.0, 0), (1.0, 200, 16.0, 0)])},
            (2, False): {1: run(22.0, [(0.75, 100, 12.0, 50), (1.5, 200, 18.0, 100)]),
                         2: run(23.0, [(0.75, 100, 13.0, 50), (1.5, 200, 19.0, 100)])},
            (2, True): {1: run(21.0, [(0.75, 100, 12.0, 50), (1.5, 200, 17.0, 100)])}}
    summary = k.summarize(done, {"0": 1.0, "2": 1.5})
    base, every2 = summary["arms"]["baseline"], summary["arms"]["R-Drop k=2"]
    mean2 = summary["arms"]["R-Drop k=2, pass mean"]
    assert (every2["pass_mean"], mean2["pass_mean"]) == (False, True)
    assert mean2["test_bleu"] == [21.0, None] and mean2["seeds"] == [1]
    # a pass-mean arm costs what its k does: 200 updates x 1.5 = 300 baseline updates
    assert mean2["valid_bleu_within_at_update_costs"]["1x baseline"] == [12.0, None]
    assert mean2["valid_bleu_within_at_update_costs"]["2x baseline"] == [17.0, None]
    assert base["seconds_per_update"] == pytest.approx(18.0)  # 1 h / 200 updates
    assert every2["time_per_update_vs_baseline"] == pytest.approx(1.5)
    assert every2["expected_passes_per_update"] == 1.5 and every2["rdrop_share"] == 0.5
    assert every2["test_bleu"] == [22.5, 0.71]
    assert summary["budgets_hours"] == {"0.5x baseline": 0.5, "1x baseline": 1.0,
                                        "2x baseline": 2.0}
    # within the baseline's hour, k = 2 has validated once (0.75 h): 12.5 on average
    assert every2["valid_bleu_within"]["1x baseline"] == [12.5, 0.71]
    assert every2["valid_bleu_within"]["0.5x baseline"] is None  # none validated by then
    assert "| R-Drop k=2 | 22.50 ± 0.71 | 22.00, 23.00 | 1.50x | 1.5 | 50% |" in k.markdown(summary)
    assert "| R-Drop k=2, pass mean | 21.00 | 21.00 | 1.50x | 1.5 | 50% |" in k.markdown(summary)


def test_the_arms_train_with_their_options(tmp_path):
    def options(arm):
        cmd = k.train_command(tmp_path, tmp_path / "run", arm, 1, dict(demo_size()))
        return [cmd[cmd.index("--criterion") + 1]] + [
            a for a in cmd if a in ("--rdrop-every", "--rdrop-pass-mean", "--rdrop-alpha")]

    assert options((0, False)) == ["label_smoothed_cross_entropy"]  # fairseq's own
    assert options((1, False)) == ["label_smoothed_cross_entropy_rdrop", "--rdrop-alpha"]
    assert options((2, False))[1:] == ["--rdrop-alpha", "--rdrop-every"]
    assert options((5, True))[1:] == ["--rdrop-alpha", "--rdrop-every", "--rdrop-pass-mean"]
    assert k.arm_slug((5, True)) == "rdrop_every5_mean" and k.arm_slug((0, False)) == "baseline"


def demo_size():
    from rdrop_fairseq.recipes import libreoffice_demo as demo

    return demo.SIZES["full"]


def test_the_committed_summary_is_made_from_the_committed_runs():
    summary = json.loads((COMMITTED / "summary.json").read_text())
    done = k.read_runs(COMMITTED)
    assert sorted(done) == [(0, False), (1, False), (2, False), (2, True), (5, False), (5, True)]
    assert all(len(runs) >= 2 for runs in done.values())
    made = k.summarize(done, summary.get("update_costs"))
    assert {key: summary[key] for key in made} == made
    assert (COMMITTED / "summary.md").read_text() == k.markdown(summary)
    for arm in summary["arms"].values():  # what the option promises, in the real logs
        if arm["k"]:
            assert arm["rdrop_share"] == pytest.approx(1 / arm["k"], abs=0.01)


@pytest.mark.slow
def test_a_tiny_study_runs_end_to_end(tmp_path):
    out = tmp_path / "kstep"
    cmd = [sys.executable, "-m", "experiments.kstep_check", "--out", str(out), "--ks", "2",
           "--seeds", "1", "--epochs", "2", "--train-pairs", "400", "--eval-pairs", "16"]
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    runs = k.read_runs(out)
    assert sorted(runs) == [(0, False), (2, False)]
    last = runs[(2, False)][1]["epochs"][-1]
    assert last["epoch"] == 2 and last["rdrop_updates"] == math.ceil(last["updates"] / 2)
    assert runs[(0, False)][1]["epochs"][-1]["rdrop_updates"] == 0
    assert (out / "kstep_bleu.png").stat().st_size > 0
    assert "| R-Drop k=2 |" in (out / "summary.md").read_text()
