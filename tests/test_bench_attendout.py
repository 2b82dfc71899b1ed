"""benchmarks/bench_attendout.py: its MAC ratio (the figures docs/attendout.md quotes) and a
tiny CPU run of both sections (the benchmark scripts/gpu_check.sh runs on a GPU)."""

import importlib.util
import json
import mmap
import subprocess
import sys
import types
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "benchmarks" / "bench_attendout.py"


def load_bench():
    spec = importlib.util.spec_from_file_location("bench_attendout", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


bench = load_bench()  # stdlib imports only at module level: torch loads inside its functions
ROBERTA_BASE_CASES = [(10, 256, 1.44), (11, 256, 1.51), (12, 256, 1.58), (11, 512, 1.58)]


@pytest.mark.parametrize("pruned, length, expected", ROBERTA_BASE_CASES)
def test_mac_ratio_of_roberta_base_follows_the_formula(pruned, length, expected):
    d, f = 768, 3072
    full = 4 * length * d * d + 2 * length * length * d + 2 * length * d * f  # Q K V O, QK^T, AV, FFN
    cut = 2 * d * d + 2 * length * d * f  # V and O of one mean vector, FFN
    ratio = bench.mac_ratio(12, pruned, length, d)
    assert ratio == pytest.approx(12 * full / ((12 - pruned) * full + pruned * cut), rel=1e-12)
    assert round(ratio, 2) == expected


def test_docs_quote_the_mac_ratios_of_roberta_base():
    row = "| speed-up from MACs alone | " + " | ".join(
        f"{bench.mac_ratio(12, pruned, length, 768):.2f}x"
        for pruned, length, _ in ROBERTA_BASE_CASES) + " |"
    assert row in (REPO / "docs" / "attendout.md").read_text()


def test_mac_ratio_is_one_without_pruning_and_grows_with_it():
    ratios = [bench.mac_ratio(6, k, 128, 384) for k in range(7)]
    assert ratios[0] == 1.0
    assert all(a < b for a, b in zip(ratios, ratios[1:]))


def children_in_this_process(monkeypatch):
    """The benchmark's per-method subprocesses (fresh, for a peak memory of their own) run
    in this process: here the tables and ratios are tested, not the figures.
    test_tiny_cpu_run_of_the_pruning_section[step] runs real ones."""
    import contextlib
    import io

    import torch

    threads = torch.get_num_threads()
    real_run = subprocess.run

    def run(cmd, *args, **kwargs):
        if list(cmd[:2]) != [sys.executable, bench.__file__]:  # not a child of the benchmark
            return real_run(cmd, *args, **kwargs)
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            assert bench.main([str(c) for c in cmd[2:]]) == 0
        torch.set_num_threads(threads)  # the child sets its own
        return subprocess.CompletedProcess(cmd, 0, out.getvalue(), "")

    monkeypatch.setattr(subprocess, "run", run)


def test_tiny_cpu_run_prints_and_writes_both_sections(tmp_path, monkeypatch, capsys):
    out = tmp_path / "bench.json"
    children_in_this_process(monkeypatch)
    assert bench.main(["all", "--layers", "2", "--dim", "16", "--heads", "2",
                       "--length", "8", "--batch", "2", "--interval", "2", "--intervals", "1",
                       "--repeats", "1", "--work", str(tmp_path / "work"),
                       "--json", str(out)]) == 0
    proc = types.SimpleNamespace(stdout=capsys.readouterr().out)
    result = json.loads(out.read_text())
    steps = result["step"]
    assert [r["method"] for r in steps] == ["baseline", "rdrop", "attendout", "attendout_rdrop",
                                            "attendout_step", "attendout_budget"]
    assert steps[0]["time_ratio"] == 1.0
    # AttendOut searched in every timed update; with a budget, the deadline ended it
    searching = {r["method"]: r["searching_updates"] for r in steps}
    assert searching["attendout"] == steps[2]["updates"] == 2
    assert searching["attendout_budget"] < 2 and searching["baseline"] == 0
    assert all(r["seconds"] > 0 and r["time_ratio"] > 0 for r in steps)
    inference = result["inference"]
    assert [r["pruned"] for r in inference] == [0, 1, 2]  # {0, L/2, L-2, L-1, L} for L = 2
    assert inference[0]["speedup"] == 1.0 and inference[0]["mac_ratio"] == 1.0
    assert [r["mac_ratio"] for r in inference] == [bench.mac_ratio(2, k, 8, 16) for k in (0, 1, 2)]
    assert "| attendout_rdrop |" in proc.stdout and "| MAC ratio |" in proc.stdout


@pytest.mark.parametrize("part", ["generator", "step"])
def test_tiny_cpu_run_of_the_pruning_section(tmp_path, part, monkeypatch):
    out = tmp_path / "bench.json"
    # "step": real processes, whose peak is checked; long enough that one batch's drop
    # logits (B x layers x T x T float32, which the REINFORCE step holds) are 512 KiB
    length, batch = (128, 4) if part == "step" else (8, 2)
    argv = ["pruning", "--layers", "2", "--dim", "16", "--heads", "2", "--length", str(length),
            "--pruning-batch", str(batch), "--prune-t", "1", "2", "--prune-part", part,
            "--work", str(tmp_path / "work"), "--json", str(out)]
    if part == "generator":  # its four children in this process; "step": real ones
        children_in_this_process(monkeypatch)
    proc = subprocess.run([sys.executable, str(SCRIPT), *argv], capture_output=True,
                          text=True, cwd=REPO, timeout=600) if part == "step" else None
    if proc is not None:
        assert proc.returncode == 0, proc.stderr[-3000:]
    else:
        import contextlib
        import io

        stdout = io.StringIO()
        with contextlib.redirect_stdout(stdout):
            assert bench.main(argv) == 0
        proc = types.SimpleNamespace(stdout=stdout.getvalue())
    rows = json.loads(out.read_text())["pruning"]
    impls = ["per_batch"] + (["all_at_once"] if part == "generator" else [])
    assert [(r["impl"], r["cached"]) for r in rows] == [(i, t) for i in impls for t in (1, 2)]
    assert all(r["part"] == part and r["seconds"] > 0 for r in rows)
    if part == "step":  # (in this process the resident set says little: no mmap threshold)
        drop_logits = batch * 2 * length * length * 4
        assert all(r["peak_bytes"] >= drop_logits for r in rows), rows
    assert "| implementation | T (cached batches) | s | peak memory (MiB) |" in proc.stdout


def test_peak_rss_sees_a_transient_allocation():
    # pages of a new anonymous mapping, written: resident until unmapped, whatever the
    # allocator kept from the tests before (a tensor of this worker may reuse memory that
    # is resident already)
    with bench.PeakRSS() as rss:
        block = mmap.mmap(-1, 64 * 2**20)
        block.write(b"\1" * len(block))
        time.sleep(0.05)
        block.close()
    assert 60 * 2**20 < rss.bytes < 100 * 2**20, rss.bytes
