"""The training step on the GPU's terms, checked on CPU: kernel launches (dispatched aten
ops), host-device synchronisations, the Triton implementation through the criterion (in
Triton's interpreter), and the benchmark script itself."""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from benchmarks.bench_rdrop import TINY_ARCH, build_step, count_step_ops

REPO = Path(__file__).resolve().parents[1]


def test_step_adds_few_ops_and_no_sync_over_the_floor():
    """V = 32k, 4096 target tokens per pass, --rdrop-chunk-mb 256: a whole training step
    dispatches at most 150 ops more than fairseq's cross-entropy on the doubled batch,
    and synchronises no more often (the floor's syncs are the model's own).

    Counted at 512 tokens with --rdrop-chunk-mb 32: the same number of chunks, so the same
    ops, one by one (the counts depend on shapes only through the chunk count; checked
    once against 4096 tokens at 256 MiB: 614 and 758 ops either way), in a twentieth of
    the time."""
    floor = count_step_ops(*build_step("floor", 32000, 512, arch_args=TINY_ARCH))
    ours = count_step_ops(*build_step("ours-torch", 32000, 512, arch_args=TINY_ARCH,
                                      extra_args=["--rdrop-chunk-mb", "32"]))
    assert ours.total <= floor.total + 150, (ours.total, floor.total)
    assert ours.n_syncing <= floor.n_syncing, (ours.syncing, floor.syncing)
    # and the table of docs/benchmarks.md says so
    table = (REPO / "docs" / "benchmarks.md").read_text()
    for row, ops in (("floor (CE on the doubled batch)", floor),
                     ("ours-torch, `--rdrop-chunk-mb 256` (4 chunks)", ours)):
        assert f"| {row} | {ops.total} | {ops.n_syncing} |" in table, (row, ops.total)


def test_padding_does_not_change_the_ops_a_step_dispatches():
    """Masking by weights: the same kernels run whatever the padding (no data-dependent
    shapes, which on a GPU would need a sync to size)."""
    model, criterion, sample = build_step("ours-torch", 64, 128, arch_args=TINY_ARCH)
    a = count_step_ops(model, criterion, sample)
    sample["target"][::2, -8:] = 1  # more padding
    b = count_step_ops(model, criterion, sample)
    assert a.by_op == b.by_op


def test_triton_impl_matches_torch_impl_through_the_criterion():
    """--rdrop-impl triton runs the kernel on CPU tensors in Triton's interpreter
    (TRITON_INTERPRET=1, set before triton is imported: hence a subprocess, one for the
    three dtypes and the op count below)."""
    pytest.importorskip("triton")
    code = textwrap.dedent("""
        import torch
        from benchmarks.bench_rdrop import TINY_ARCH, build_step
        for dtype in ("float32", "float16", "bfloat16"):
            results = []
            for method in ("ours-torch", "ours-triton"):
                model, criterion, sample = build_step(method, 50, 32, arch_args=TINY_ARCH,
                                                      dtype=dtype)
                torch.manual_seed(3)
                loss, _, log = criterion(model, sample)
                loss.backward()
                grads = torch.cat([p.grad.double().flatten() for p in model.parameters()
                                   if p.grad is not None])
                results.append((loss.double(), log["rdrop_kl"].double(), grads))
            (l1, k1, g1), (l2, k2, g2) = results
            tol = dict(rtol=1e-4, atol=1e-5) if dtype == "float32" else dict(rtol=2e-2, atol=2e-3)
            torch.testing.assert_close(l2, l1, **tol, msg=lambda m: f"{dtype} loss: {m}")
            torch.testing.assert_close(k2, k1, **tol, msg=lambda m: f"{dtype} KL: {m}")
            # a bf16/fp16 model's backward amplifies rounding differences where values
            # cancel: the gradients are compared as a whole
            relative = float((g2 - g1).norm() / g1.norm())
            assert relative < (1e-4 if dtype == "float32" else 2e-2), (dtype, relative)
            print("OK", dtype, float(l1), float(l2), relative)
        # a whole step of the big model's shape (1 + 1 layers here: the criterion's own
        # ops do not depend on the depth), each kernel launch counted as one op
        from benchmarks.bench_rdrop import count_step_ops
        arch = "transformer_vaswani_wmt_en_de_big"
        counts = [count_step_ops(*build_step(method, 64, 32, arch, arch_args=TINY_ARCH))
                  for method in ("floor", "ours-triton")]
        print("OPS", [[ops.total, ops.n_syncing] for ops in counts])
    """)
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          cwd=REPO, env=env, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert [line.split()[1] for line in proc.stdout.splitlines() if line.startswith("OK")] == [
        "float32", "float16", "bfloat16"]
    # the R-Drop step with the kernel dispatches no more ops (on a GPU: launches) than the
    # doubled-batch step, and no more syncs: the batch's duplication (3 cat) is paid for by
    # the fused loss (measured: 603 vs 614 ops; 620 before the criterion stopped
    # duplicating the target, masking rows the kernel had zeroed, and materialising zero
    # gradients for the logged outputs)
    (floor, floor_syncs), (ours, ours_syncs) = json.loads(
        next(line for line in proc.stdout.splitlines() if line.startswith("OPS"))[4:])
    assert ours <= floor and ours_syncs <= floor_syncs, (ours, floor, ours_syncs, floor_syncs)


def test_triton_impl_on_cpu_without_the_interpreter_is_a_clear_error(monkeypatch):
    """Refused when the criterion is built, before any step (torch has no CUDA here)."""
    pytest.importorskip("triton")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    if torch.cuda.is_available():
        pytest.skip("a GPU is available: --rdrop-impl triton is valid")
    with pytest.raises(ValueError, match="--rdrop-impl triton needs a CUDA GPU"):
        build_step("ours-triton", 50, 32, arch_args=TINY_ARCH)


def test_triton_impl_with_cpu_is_refused_even_where_cuda_is_available(monkeypatch):
    """--cpu with --rdrop-impl triton on a machine with CUDA: refused when the criterion is
    built (it used to pass this check and fail at the first step). fairseq's --cpu reaches
    the criterion's config; without --cpu the same criterion builds."""
    pytest.importorskip("triton")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(ValueError, match="--rdrop-impl triton needs a CUDA GPU, and --cpu "):
        build_step("ours-triton", 50, 32, arch_args=TINY_ARCH)  # device="cpu": --cpu
    from tests.test_criteria import translation_case
    case = translation_case()
    case.build_model(dropout=0.1)
    with pytest.raises(ValueError, match="and --cpu trains on the CPU"):
        case.ours(alpha=1.0, rdrop_impl="triton", cpu=True)
    assert case.ours(alpha=1.0, rdrop_impl="triton", cpu=False).rdrop_impl == "triton"


def test_benchmark_script_runs_and_prints_the_tables(tmp_path, monkeypatch):
    """A tiny run of every section on CPU: the tables have a row per method, and each
    ratio is against the floor of its row group. The script measures each method in a
    subprocess of its own (for its peak memory); here they run in this process, and the
    next test runs that subprocess once."""
    import benchmarks.bench_rdrop as bench

    def in_this_process(kind, kw, env=None):
        kw = dict(kw)
        kw.pop("threads")
        result = bench.run_loss(**kw) if kind == "loss" else bench.run_step(**kw)
        return json.loads(json.dumps(result))  # what the worker prints, read back

    md = tmp_path / "bench.md"
    monkeypatch.setattr(bench, "_worker", in_this_process)
    monkeypatch.setattr(sys, "argv", [
        "bench_rdrop.py", "all", "--vocab", "64", "--tokens", "32", "--step-vocab", "64",
        "--step-tokens", "32", "--repeats", "1", "--threads", "1", "--markdown", str(md)])
    threads = torch.get_num_threads()
    try:
        bench.main()
    finally:
        torch.set_num_threads(threads)
    text = md.read_text()
    for method in ("floor", "upstream", "ours-torch"):
        assert text.count(f"| {method} |") == 2, text  # one loss row, one step row
    assert "| float32 V=64 N=32 | floor |" in text and "| 1.00 |" in text
    assert "error" not in text.lower()


def test_benchmark_worker_measures_in_a_subprocess_of_its_own():
    """What the script runs per method: a subprocess that prints one JSON line, and a
    second one for the peak memory alone. The logits are a leaf here, so the step keeps
    their gradient, 2N x V float32 (32 MiB): the peak is at least that, and not several
    times it (the loss's chunks are bounded by its default budget)."""
    import benchmarks.bench_rdrop as bench

    vocab, tokens = 4096, 1024
    kw = dict(method="ours-torch", vocab=vocab, tokens=tokens, repeats=1, threads=1,
              device="cpu", dtype="float32", projection=0)
    result = bench._in_subprocess("loss", **kw)
    assert "error" not in result, result
    assert result["time_s"] > 0 and result["ops"] > 0 and result["syncs"] == 0, result
    gradient_mib = 2 * tokens * vocab * 4 / 2**20
    # from the second subprocess (repeats 0)
    assert gradient_mib <= result["peak_mib"] <= 4 * gradient_mib, result


def test_alternating_processes_give_each_ratio_against_its_own_rounds_floor():
    """bench_rdrop.py --processes N: a method's ratio is the median of its rounds' ratios to
    the floor of the same round (not of the medians), with their range; an error in any
    round is the row's."""
    import benchmarks.bench_rdrop as bench

    floors = [{"time_s": t, "peak_mib": 100.0, "ops": 30, "syncs": 0} for t in (1, 2, 4)]
    ours = [{"time_s": t, "peak_mib": 40.0, "ops": 70, "syncs": 0} for t in (0.9, 1.0, 2.0)]
    row = bench._summary(ours, floors)
    assert row["time_s"] == 1.0 and row["processes"] == 3
    assert (row["time_ratio"], row["ratio_min"], row["ratio_max"]) == (0.5, 0.5, 0.9)
    assert row["peak_mib"] == 40.0 and row["ops"] == 70
    assert "0.50 (0.50-0.90)" in bench._table("t", [("c", "floor", bench._summary(floors, floors)),
                                                   ("c", "ours", row)])
    assert bench._summary(ours[:2] + [{"error": "out of memory"}], floors) == {
        "error": "out of memory"}
