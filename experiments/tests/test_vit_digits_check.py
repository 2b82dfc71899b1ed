"""experiments.vit_digits_check end to end at a tiny size (a few updates, two seeds): the
digits' fixed split, both arms trained from the same weights on the same batches, the
files it writes and their form, a rerun that trains nothing; and the command
experiments/README.md gives, parsed."""

import json
import re
import shlex
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("sklearn")

from experiments import vit_digits_check  # noqa: E402

REPO = Path(__file__).resolve().parents[2]


def test_the_split_is_fixed_and_covers_the_digits_once():
    first, again = vit_digits_check.digits(), vit_digits_check.digits()
    assert {s: len(v[1]) for s, v in first.items()} == {"train": 1077, "valid": 360,
                                                        "test": 360}
    for split in first:
        assert torch.equal(first[split][0], again[split][0])
    images = torch.cat([first[s][0] for s in first])
    assert images.shape == (1797, 1, 8, 8) and images.dtype == torch.uint8
    assert len({tuple(x.flatten().tolist()) for x in images}) > 1700  # no image twice
    assert int(images.max()) == 255 and set(torch.cat([first[s][1] for s in first]).tolist()) \
        == set(range(10))


def test_both_arms_end_to_end_then_reused(tmp_path, monkeypatch):
    from transformers import Trainer

    from rdrop_fairseq.hf import RDropTrainer

    batches = []
    original = Trainer.training_step

    def spy(self, model, inputs, *args, **kwargs):
        batches.append((type(self).__name__, inputs["labels"].tolist()))
        return original(self, model, inputs, *args, **kwargs)

    monkeypatch.setattr(Trainer, "training_step", spy)
    monkeypatch.setattr(torch, "set_num_threads", lambda n: None)  # the suite's own
    out = tmp_path / "out"
    argv = ["--out", str(out), "--seeds", "1", "2", "--updates", "3", "--batch-size", "16"]
    assert vit_digits_check.main(argv) == 0
    runs = sorted(p.name for p in (out / "runs").iterdir())
    assert runs == ["baseline_seed1.json", "baseline_seed2.json", "rdrop_seed1.json",
                    "rdrop_seed2.json"]
    results = {p: json.loads((out / "runs" / p).read_text()) for p in runs}
    for name, r in results.items():
        assert (r["mode"], r["seed"]) == (name.split("_")[0], int(name[-6]))
        assert r["updates"] == 3 and r["alpha"] == (1.0 if r["mode"] == "rdrop" else 0.0)
        assert 0 <= r["test_accuracy"] <= 100 and 0 <= r["valid_accuracy"] <= 100
        assert r["test_accuracy"] * 360 / 100 == pytest.approx(round(r["test_accuracy"] * 3.6))
        assert r["seconds_per_update"] > 0
    # the same batches for both arms of a seed, RDropTrainer for R-Drop only
    kinds = [k for k, _ in batches]
    assert kinds == (["Trainer"] * 3 + ["RDropTrainer"] * 3) * 2
    assert [b for _, b in batches[:3]] == [b for _, b in batches[3:6]]
    assert all(len(b) == 16 for _, b in batches)
    summary = json.loads((out / "summary.json").read_text())
    s = summary["summary"]
    tests = {m: [results[f"{m}_seed{k}.json"]["test_accuracy"] for k in (1, 2)]
             for m in ("baseline", "rdrop")}
    for mode in ("baseline", "rdrop"):
        mean = sum(tests[mode]) / 2
        sd = (sum((x - mean) ** 2 for x in tests[mode])) ** 0.5  # n - 1 = 1
        assert s[mode]["test_accuracy"] == pytest.approx([mean, sd])
        assert s[mode]["seeds"] == [1, 2]
    assert s["difference"]["per_seed"] == pytest.approx(
        [r - b for r, b in zip(tests["rdrop"], tests["baseline"])])
    assert summary["command"].startswith("python -m experiments.vit_digits_check --out ")
    table = (out / "summary.md").read_text().splitlines()
    assert table[0] == "| arm | seeds | test accuracy (%) | valid accuracy (%) | s / update |"
    assert re.fullmatch(r"\| baseline \| 1,2 \| [\d.]+ ± [\d.]+ \| [\d.]+ ± [\d.]+ \| "
                        r"[\d.]+ ± [\d.]+ \|", table[2])
    assert table[3].startswith("| R-Drop (alpha 1.0) | 1,2 | ")
    assert table[5].startswith("R-Drop - baseline, test accuracy per seed: ")
    # a rerun reuses the finished runs
    monkeypatch.setattr(vit_digits_check, "make_model", lambda *a: pytest.fail("trained"))
    before = (out / "runs" / "rdrop_seed1.json").read_text()
    assert vit_digits_check.main(argv) == 0
    assert (out / "runs" / "rdrop_seed1.json").read_text() == before
    assert RDropTrainer is not None


def test_the_readmes_command_parses_and_its_results_are_its_output():
    """The command experiments/README.md gives, through the script's own parser; the
    committed summary was written by that command (its record of the command it ran)."""
    readme = (REPO / "experiments" / "README.md").read_text(encoding="utf-8")
    (line,) = [x for x in readme.splitlines() if x.startswith("python -m experiments.vit_digits")]
    words = shlex.split(line, comments=True)
    a = vit_digits_check.make_parser().parse_args(words[3:])
    results = REPO / a.out / "summary.json"
    summary = json.loads(results.read_text())
    assert summary["command"] == " ".join(words)
    assert sorted(p.name for p in (REPO / a.out / "runs").iterdir()) == sorted(
        f"{m}_seed{s}.json" for m in a.modes for s in a.seeds)
    table = (REPO / a.out / "summary.md").read_text()
    assert table == vit_digits_check.table(summary["summary"], a)
    # the page that quotes them quotes them as written, and the runs' training time
    page = (REPO / "docs" / "vision.md").read_text(encoding="utf-8")
    assert table in page and line in page
    minutes = sum(r["train_seconds"] for r in summary["runs"]) / 60
    assert f"{minutes:.1f} minutes of\ntraining for the six runs" in page
    assert f"({minutes:.1f} minutes of training on 2 CPU cores" in readme
