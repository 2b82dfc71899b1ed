"""The recipes' memory: benchmarks/bench_recipe_memory.py on the CPU at a tiny scale (the
path a GPU run takes: the scripts' own overrides, fairseq's Trainer with its FP16Optimizer
and Adam's states), its table, and what the recipe scripts do with a measured row (the
card sizes DRY_RUN prints, MAX_TOKENS lowered for smaller GPUs; a fake nvidia-smi)."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.recipe_helpers import REPO, dry_run, overrides_of

sys.path.insert(0, str(REPO / "benchmarks"))
import bench_recipe_memory as bench  # noqa: E402

# bytes a parameter keeps between fp16 steps: fp16 weight and gradient (2 + 2), fp32
# master weight and gradient (4 + 4), the optimizer's fp32 state (Adam 8, NAG's momentum 4)
PER_PARAM = {"adam": 20, "nag": 16}


def table_rows(path=bench.TABLE):
    return bench.read_table(path)[1]


def fake_gpus(tmp_path, mib, count=1):
    """A directory holding an nvidia-smi that lists COUNT GPUs of MIB MiB."""
    folder = tmp_path / "fake-bin"
    folder.mkdir(exist_ok=True)
    tool = folder / "nvidia-smi"
    tool.write_text("#!/bin/sh\ncase \"$*\" in\n"
                    f"  *memory.total*) for i in $(seq {count}); do echo {mib}; done ;;\n"
                    f"  *-L*) for i in $(seq {count}); do echo \"GPU $i: fake\"; done ;;\n"
                    "esac\n")
    tool.chmod(0o755)
    return os.pathsep.join([str(folder), str(Path(sys.executable).parent), "/usr/bin", "/bin"])


def measured_table(tmp_path, rows):
    """The committed table with ROWS ``{(recipe, max_tokens): (reserved GiB, params)}``
    measured (as 'record' writes them)."""
    results = [{"recipe": recipe, "max_tokens": tokens, "precision": "fp16", "batch": "4x1024",
                "peak_gib": reserved - 0.5, "reserved_gib": reserved, "state_gib": 1.0,
                "params": params, "device": "NVIDIA Test GPU", "date": "2026-12-02"}
               for (recipe, tokens), (reserved, params) in rows.items()]
    table = tmp_path / "recipe_memory.tsv"
    table.write_text(bench.TABLE.read_text())
    bench.record(results, table)
    return table


def memory_lines(proc):
    return [line for line in proc.stdout.splitlines() if "] memory:" in line]


# ---------------------------------------------------------------- the benchmark, on the CPU


def test_the_config_is_the_scripts_command_composed_for_one_process(tmp_path):
    command = bench.script_command("wmt14")
    o = overrides_of(command)
    assert (o["dataset.max_tokens"], o["common.fp16"], o["criterion.rdrop_alpha"]) == (
        "4096", "true", "5")
    cfg = bench.compose(command, tmp_path / "data")
    assert cfg.task.data == str(tmp_path / "data")
    assert (cfg.dataset.max_tokens, cfg.optimization.update_freq) == (4096, [128])
    assert (cfg.common.fp16, cfg.criterion.rdrop_alpha, cfg.criterion._name) == (
        True, 5.0, "label_smoothed_cross_entropy_rdrop")
    assert cfg.model._name == "transformer_vaswani_wmt_en_de_big"
    assert cfg.distributed_training.distributed_world_size == 1


def test_iwslt14_steps_through_fairseqs_trainer_at_a_tiny_scale():
    """Two points (the script's 4096 tokens and half), each batch the most sentences of the
    longest length the model admits (--tiny: 64 positions), fp16 as the script runs it,
    and after the steps the FP16Optimizer's masters and Adam's moments exist."""
    rows = bench.measure("iwslt14", tiny=True, device="cpu", log=lambda line: None)
    assert [(r["max_tokens"], r["batch"], r["precision"]) for r in rows] == [
        (4096, "64x64", "fp16"), (2048, "32x64", "fp16")]
    for row in rows:
        assert row["state_bytes"] == PER_PARAM["adam"] * row["params"], row
        assert row["device"] == "cpu" and row["peak_gib"] is None


class FakeTrainer:
    """train_step as fairseq's: None after an OOM, no update while fp16 overflows."""

    def __init__(self, overflows, oom=False):
        self.overflows, self.oom, self.updates = overflows, oom, 0

    def get_num_updates(self):
        return self.updates

    def train_step(self, samples):
        if self.oom:
            return None
        if self.overflows:
            self.overflows -= 1
        else:
            self.updates += 1
        return [{}]


@pytest.mark.cuda
def test_the_cuda_figures_at_a_tiny_scale():
    """The CUDA branch (gpu_check's cuda_tests run it): the allocator's peak holds at least
    what the steps keep, reserved at least the peak, the half batch's peak below the
    whole one's (the cache emptied between them)."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    rows = bench.measure("iwslt14", tiny=True, device="cuda", log=lambda line: None)
    assert [(r["max_tokens"], r["batch"], r["precision"]) for r in rows] == [
        (4096, "64x64", "fp16"), (2048, "32x64", "fp16")]
    for row in rows:
        assert row["state_bytes"] == PER_PARAM["adam"] * row["params"], row
        assert row["reserved_bytes"] >= row["peak_bytes"] >= row["state_bytes"], row
        assert row["device"] == torch.cuda.get_device_name()
    assert rows[1]["peak_bytes"] < rows[0]["peak_bytes"], rows


def test_a_step_is_taken_again_until_it_updates():
    """An overflowed fp16 step makes no optimizer states: the warm-up would not warm up."""
    trainer = FakeTrainer(overflows=3)
    assert bench.update(trainer, None, "warm-up") == 3 and trainer.updates == 1
    with pytest.raises(RuntimeError, match="overflowed 8 times in a row"):
        bench.update(FakeTrainer(overflows=8), None, "warm-up")
    with pytest.raises(RuntimeError, match="the measured step made no update"):
        bench.update(FakeTrainer(0, oom=True), None, "measured")


def test_a_failed_recipe_is_reported_and_the_next_one_runs(tmp_path, monkeypatch, capsys):
    def measure(recipe, **kwargs):
        if recipe == "wmt14":
            raise RuntimeError("the measured step made no update (out of memory?)")
        return [{"recipe": recipe, "max_tokens": 1}]

    monkeypatch.setattr(bench, "measure", measure)
    out = tmp_path / "rows.json"
    assert bench.main(["--recipes", "wmt14", "iwslt14", "--device", "cpu", "--json",
                       str(out)]) == 1
    assert json.loads(out.read_text()) == {"rows": [{"recipe": "iwslt14", "max_tokens": 1}],
                                           "failed": ["wmt14"]}
    assert "wmt14: RuntimeError: the measured step made no update" in capsys.readouterr().err
    assert not list(tmp_path.glob("*.part"))


@pytest.mark.slow
def test_every_recipe_runs_on_the_cpu_at_a_tiny_scale(tmp_path):
    out = tmp_path / "rows.json"
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "bench_recipe_memory.py"),
                           "--tiny", "--device", "cpu", "--json", str(out)],
                          capture_output=True, text=True, timeout=300, cwd=REPO,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["failed"] == []
    got = {(r["recipe"], r["max_tokens"]): r for r in result["rows"]}
    # the table's rows are what a GPU run measures
    assert set(got) == {(r["recipe"], int(r["max_tokens"])) for r in table_rows()}
    # --tiny's 64 positions: sentences x 64, at most max_tokens (with truncate_source, a
    # 63-token sentence's size is 64 too: the widest of the batches that tie); GLUE at its
    # 32 sentences
    assert got[("cnndm_bart", 1024)]["batch"] == "16x64"
    assert got[("wikitext103-adaptive", 3072)]["batch"] == "48x64"
    assert got[("glue", 4400)]["batch"] == "32x64"
    for (recipe, _), row in got.items():
        per_param = row["state_bytes"] / row["params"]
        if recipe == "wikitext103-adaptive":  # NAG
            assert per_param == PER_PARAM["nag"], row
        elif recipe == "glue":  # the unused LM head has no gradients
            assert 19.5 < per_param < PER_PARAM["adam"], row
        else:
            assert per_param == PER_PARAM["adam"], row


def test_the_table_has_each_recipes_rows_at_the_scripts_tokens():
    """A row per recipe at the per-GPU max_tokens its script picks for one GPU (and half
    of it where the script can lower it), all empty until a GPU measures them."""
    rows = table_rows()
    assert rows and all(r[c] == "-" for r in rows for c in ("peak_gib", "reserved_gib", "device"))
    for recipe, r in bench.RECIPES.items():
        tokens = bench.compose(bench.script_command(recipe), "/nonexistent").dataset.max_tokens
        expected = [tokens, tokens // 2] if r.halve else [tokens]
        assert [int(t["max_tokens"]) for t in rows if t["recipe"] == recipe] == expected


def test_record_puts_gpu_rows_into_the_table_and_refuses_cpu_ones(tmp_path):
    table = measured_table(tmp_path, {("iwslt14", 4096): (15.5, 40_000_000)})
    rows = table_rows(table)
    assert len(rows) == len(table_rows())  # replaced, not added
    (row,) = [r for r in rows if r["recipe"] == "iwslt14" and r["max_tokens"] == "4096"]
    assert (row["reserved_gib"], row["device"]) == ("15.5", "NVIDIA Test GPU")
    # the CLI takes gpu_check's bench_rdrop.json as it comes back
    gpu_check = tmp_path / "bench_rdrop.json"
    gpu_check.write_text(json.dumps({"recipe_memory": {"rows": [
        {**row, "max_tokens": 2048, "reserved_gib": 8.0}], "failed": []}}))
    assert bench.main(["record", str(gpu_check), "--table", str(table)]) == 0
    assert [r["reserved_gib"] for r in table_rows(table) if r["recipe"] == "iwslt14"] == [
        "15.5", "8.0"]
    with pytest.raises(ValueError, match="no CUDA peak"):
        bench.record([{**row, "peak_gib": None}], table)


# ---------------------------------------------------------------- the scripts read the table


def test_without_a_measured_row_nothing_changes(tmp_path):
    """The committed table (rows not measured yet) and a GPU too small for anything: the
    same commands as without a table, and no memory line."""
    path = fake_gpus(tmp_path, 1024)
    inputs = {"BART_DIR": tmp_path / "bart", "ROBERTA_DIR": tmp_path / "roberta"}  # no fetch
    for name, env in (("iwslt14", {}), ("wmt14", {}), ("wikitext103", {"ARCH": "adaptive"}),
                      ("cnndm_bart", {}), ("glue", {"TASK": "MNLI"})):
        commands, proc = dry_run(name, "train", GPUS=1, PATH=path, **inputs, **env)
        bare, _ = dry_run(name, "train", GPUS=1, PATH=path, RECIPE_MEMORY="/dev/null",
                          **inputs, **env)
        assert commands == bare and memory_lines(proc) == [], proc.stdout


def test_dry_run_says_which_cards_the_batch_fits(tmp_path):
    table = measured_table(tmp_path, {("iwslt14", 4096): (15.5, 40_000_000),
                                      ("glue", 4400): (9.0, 355_000_000)})
    _, proc = dry_run("iwslt14", "train", GPUS=1, RECIPE_MEMORY=table)
    # 15.5 GiB + 1 for the CUDA context: more than a 16 GB card's 14.9 GiB
    assert memory_lines(proc) == [
        "[iwslt14] memory: about 16.5 GiB per GPU at max-tokens 4096 (fp16, measured on "
        "NVIDIA Test GPU: benchmarks/bench_recipe_memory.py): fits 24, 32, 40, 48, 80 GB "
        "cards; not 16 GB"]
    _, proc = dry_run("glue", "train", GPUS=1, TASK="RTE", RECIPE_MEMORY=table,
                      ROBERTA_DIR=tmp_path / "roberta")
    assert memory_lines(proc)[0].endswith(": fits 16, 24, 32, 40, 48, 80 GB cards")
    # another precision, the CPU: no figure
    for env in ({"BF16": "1", "GPUS": "1"}, {"GPUS": "0"}):
        assert memory_lines(dry_run("iwslt14", "train", RECIPE_MEMORY=table, **env)[1]) == []


def test_max_tokens_is_lowered_where_the_gpus_would_not_hold_it(tmp_path):
    """16 GiB GPUs (nvidia-smi) and IWSLT's 4096 tokens measured at 15.5 GiB: half the
    tokens, twice the update-freq, the same tokens per update. A user's MAX_TOKENS wins
    (with a warning), as does a user's UPDATE_FREQ."""
    table = measured_table(tmp_path, {("iwslt14", 4096): (15.5, 40_000_000),
                                      ("iwslt14", 2048): (8.0, 40_000_000)})
    path = fake_gpus(tmp_path, 16384)
    commands, proc = dry_run("iwslt14", "train", GPUS=1, PATH=path, RECIPE_MEMORY=table)
    o = overrides_of(commands[-1])
    assert (o["dataset.max_tokens"], o["optimization.update_freq"]) == ("2048", "[2]")
    assert "= 4096 tokens per update (the paper's: 4096" in proc.stdout
    assert memory_lines(proc) == [
        "[iwslt14] memory: max-tokens 4096 -> 2048, update-freq 1 -> 2: the GPUs have 16.0 GiB "
        "(nvidia-smi)",
        "[iwslt14] memory: about 9.0 GiB per GPU at max-tokens 2048 (fp16, measured on NVIDIA "
        "Test GPU: benchmarks/bench_recipe_memory.py): fits 16, 24, 32, 40, 48, 80 GB cards"]
    for env in ({"MAX_TOKENS": "4096"}, {"UPDATE_FREQ": "1"}):
        commands, proc = dry_run("iwslt14", "train", GPUS=1, PATH=path, RECIPE_MEMORY=table,
                                 **env)
        assert overrides_of(commands[-1])["dataset.max_tokens"] == "4096"
        assert "memory: warning: about 16.5 GiB per GPU at max-tokens 4096, more than the " \
               "GPUs' 16.0 GiB" in proc.stdout
    # 24 GiB GPUs hold the paper's batch
    commands, _ = dry_run("iwslt14", "train", GPUS=1, PATH=fake_gpus(tmp_path, 24576),
                          RECIPE_MEMORY=table)
    assert overrides_of(commands[-1])["dataset.max_tokens"] == "4096"


def test_several_gpus_count_ddps_buckets_and_the_lowering_stops_at_the_scripts_floor(tmp_path):
    """8 GPUs: IWSLT's 512 tokens per GPU, on the line through the measured rows, plus the
    fp16 gradients once more. WikiText-103's adaptive model cannot go below its 3072-token
    sample: only a warning."""
    params = 2 ** 30  # 2 GiB of fp16 gradients
    table = measured_table(tmp_path, {("iwslt14", 4096): (15.5, params),
                                      ("iwslt14", 2048): (8.0, params),
                                      ("wikitext103-adaptive", 3072): (30.0, params)})
    _, proc = dry_run("iwslt14", "train", GPUS=8, RECIPE_MEMORY=table)
    # 8.0 + (15.5 - 8.0) * (512 - 2048) / 2048 = 2.375, + 1 + 2
    assert re.search(r"about 5\.4 GiB per GPU at max-tokens 512 ", proc.stdout), proc.stdout
    commands, proc = dry_run("wikitext103", "train", GPUS=8, ARCH="adaptive", RECIPE_MEMORY=table,
                             PATH=fake_gpus(tmp_path, 16384, count=8))
    assert overrides_of(commands[-1])["dataset.max_tokens"] == "3072"
    assert "memory: warning: about 33.0 GiB per GPU at max-tokens 3072" in proc.stdout
