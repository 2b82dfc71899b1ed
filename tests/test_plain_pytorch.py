"""The plain-PyTorch example (docs/plain-pytorch.md, issue 26): R-Drop's loss in a torch
training loop, through ``rdrop_loss`` and ``fused_linear_rdrop_loss``, without fairseq.

One fresh interpreter runs the example as ``python -m`` would (small sizes, seconds), checks
its loss against the paper's formula computed here in float64, and reports which modules got
imported: fairseq is installed but must not be among them.
"""

import importlib.util
import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SMALL = ["--vocab", "8192", "--dim", "32", "--layers", "1", "--heads", "2", "--batch", "4",
         "--length", "16", "--corpus", "2", "--steps", "6", "--threads", "1", "--chunk-mb",
         "0.25", "--json"]

SCRIPT = textwrap.dedent("""
    import json, runpy, sys
    import torch

    sys.argv = ["plain_pytorch_lm", *%r]
    runpy.run_module("rdrop_fairseq.examples.plain_pytorch_lm", run_name="__main__")

    # the example's loss against the formula, for one batch and the same dropout masks
    from rdrop_fairseq.examples.plain_pytorch_lm import PAD, TinyCausalLM, batches, rdrop_step_loss
    torch.manual_seed(0)
    model = TinyCausalLM(300, 16, 1, 2, 12, 0.3).double()
    tokens, target = next(batches(300, 3, 12, seed=4))
    alpha = 1.5
    formula = {}
    for path in ("logits", "fused-linear"):
        torch.manual_seed(1)
        loss, _ = rdrop_step_loss(model, tokens, target, alpha=alpha, path=path)
        formula[path] = loss.item()
    torch.manual_seed(1)
    lp = model(torch.cat([tokens, tokens])).log_softmax(-1)  # same masks: same RNG draws
    keep = target.ne(PAD)
    t = torch.cat([target, target]).unsqueeze(-1)
    nll = -lp.gather(-1, t).squeeze(-1)[torch.cat([keep, keep])].sum()
    p, q = lp.chunk(2)
    kl = (0.5 * ((p.exp() - q.exp()) * (p - q)).sum(-1))[keep].sum()
    formula["reference"] = ((nll + alpha * kl) / keep.sum()).item()
    print(json.dumps({"fairseq": sorted(m for m in sys.modules if m.split(".")[0] == "fairseq"),
                      "criteria": "rdrop_fairseq.criterions" in sys.modules,
                      "formula": formula}))
""") % (SMALL,)


@pytest.fixture(scope="module")
def example():
    assert importlib.util.find_spec("fairseq") is not None, "the check needs fairseq installed"
    proc = subprocess.run([sys.executable, "-c", SCRIPT], cwd=REPO, capture_output=True,
                          text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.strip().splitlines()
    return json.loads(lines[-2]), json.loads(lines[-1]), proc.stdout


def test_the_example_imports_no_fairseq(example):
    _, imported, _ = example
    assert imported["fairseq"] == [] and not imported["criteria"]


def test_the_example_loss_is_the_papers_formula(example):
    _, imported, _ = example
    formula = imported["formula"]
    assert formula["logits"] == pytest.approx(formula["reference"], rel=1e-9)
    assert formula["fused-linear"] == pytest.approx(formula["reference"], rel=1e-9)


def test_both_losses_train_alike_and_the_loss_decreases(example):
    results, _, stdout = example
    logits, fused = results["curves"]["logits"], results["curves"]["fused-linear"]
    assert len(logits) == len(fused) == 6
    for (a, kl_a), (b, kl_b) in zip(logits, fused):
        assert b == pytest.approx(a, rel=1e-4) and kl_b == pytest.approx(kl_a, rel=1e-3, abs=1e-6)
    # the corpus is 2 batches: steps 1, 3, 5 see the first, 2, 4, 6 the second (nats/token)
    assert logits[4][0] < logits[2][0] < logits[0][0] - 1.0
    assert logits[5][0] < logits[3][0] < logits[1][0] - 1.0
    assert all(kl > 0 for _, kl in logits)  # dropout makes the passes differ
    for path, diff in results["differences"].items():
        assert diff["loss"] < 1e-5 and diff["grad"] < 1e-5, (path, diff)
    assert "loss (fused linear)" in stdout


def test_the_fused_path_saves_the_logits_memory(example):
    """One step's peak: the logits path holds the logits and their gradient (2 x 2N x V
    float32, L each); with the gradient in the logits' buffer, one of them; the fused path
    neither, only a chunk (0.25 MiB here) and the V x d weight gradient (L / 4 here)."""
    results, _, _ = example
    peak, logits = results["peak_mib"], results["logits_mib"]
    assert logits == 2 * 4 * 16 * 8192 * 4 / 2**20  # L: [x; x] x V float32, 4 MiB
    assert peak["logits"] >= 2 * logits
    assert peak["logits"] - peak["logits-in-place"] >= 0.75 * logits
    assert peak["logits-in-place"] - peak["fused-linear"] >= 0.5 * logits
    assert peak["fused-linear"] <= peak["logits"] - 1.25 * logits


@pytest.mark.slow
def test_the_docs_show_what_the_example_prints_with_its_defaults():
    """docs/plain-pytorch.md's tables are the output of ``python -m
    rdrop_fairseq.examples.plain_pytorch_lm`` with its defaults: the losses of the steps it
    shows, and the peak memory of each path (about a minute of CPU). Within the tolerances
    the page states (0.001 in a loss, 0.2 MiB in a peak): another CPU's BLAS sums in
    another order, and 20 optimizer steps carry that into the 4th decimal."""
    proc = subprocess.run([sys.executable, "-m", "rdrop_fairseq.examples.plain_pytorch_lm",
                           "--threads", "1"], cwd=REPO, capture_output=True, text=True,
                          timeout=600, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    printed = {int(fields[0]): fields[1:] for fields in map(str.split, proc.stdout.splitlines())
               if len(fields) == 4 and fields[0].isdigit()}
    doc = (REPO / "docs" / "plain-pytorch.md").read_text()
    steps = re.findall(r"^\| (\d+) \| ([\d.]+) \| ([\d.]+) \| ([\d.]+) \|$", doc, re.M)
    assert len(steps) >= 2 and {int(s[0]) for s in steps} <= set(printed), steps
    for step, *losses in steps:
        assert all(abs(float(a) - float(b)) <= 1e-3 for a, b in zip(printed[int(step)], losses)), \
            (step, printed[int(step)], losses)
    peaks = re.findall(r"^\| `[^|]*\| ([\d.]+) \|$", doc, re.M)
    measured = [float(m) for m in re.findall(r" ([\d.]+) MiB  ", proc.stdout)]
    assert len(peaks) == 3 and len(measured) == 3, (peaks, proc.stdout)
    assert all(abs(float(p) - m) <= 0.2 for p, m in zip(peaks, measured)), (peaks, measured)
