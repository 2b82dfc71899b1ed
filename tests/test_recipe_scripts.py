"""The recipe scripts (scripts/*.sh) in DRY_RUN mode, for 1, 2, 4 and 8 GPUs and the CPU:
the paper's batch per update, the precision flags, what each MODE turns into, several nodes,
and the one-line errors. No GPU needed: DRY_RUN prints the commands instead of running them.
(The tiny real runs through the scripts are in the recipe tests, one per task family.)"""

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.recipe_helpers import REPO, dry_run, overrides_of, script
from tests.warm_process import fairseq_bin

# script -> (environment, the paper's tokens per update, the paper's R-Drop alpha)
TOKEN_RECIPES = {
    "iwslt14": ({}, 1 * 1 * 4096, "5"),
    "wmt14": ({}, 8 * 16 * 4096, "5"),
    "wmt14 en-fr": ({"PAIR": "en-fr"}, 8 * 16 * 4096, "5"),
    "cnndm_bart": ({}, 4 * 16 * 1024, "0.7"),
    "wikitext103": ({}, 8 * 16 * 2000, "1"),
    "wikitext103 adaptive": ({"ARCH": "adaptive"}, 8 * 3 * 3072, "1"),
}


def train_command(recipe, **env):
    """The training command a recipe script prints, as ``{key: value}`` overrides, the argv
    and the run."""
    name, base_env, _, _ = (recipe.split()[0], *TOKEN_RECIPES.get(recipe, ({}, 0, "")))
    commands, proc = dry_run(name, "train", **{**base_env, **env})
    (cmd,) = [c for c in commands if "--config-dir" in c]
    return overrides_of(cmd), cmd, proc


@pytest.mark.parametrize("gpus", [1, 2, 4, 8])
@pytest.mark.parametrize("recipe", list(TOKEN_RECIPES))
def test_gpus_x_update_freq_x_max_tokens_is_the_papers_batch(recipe, gpus):
    o, cmd, proc = train_command(recipe, GPUS=gpus)
    update_freq = int(o["optimization.update_freq"].strip("[]"))
    max_tokens = int(o["dataset.max_tokens"])
    assert gpus * update_freq * max_tokens == TOKEN_RECIPES[recipe][1], cmd
    assert o["distributed_training.distributed_world_size"] == str(gpus)
    assert o["common.fp16"] == "true" and "common.bf16" not in o and "common.cpu" not in o
    # process 0 reads the checkpoint and sends it to the others (fairseq's default, which
    # the plugin makes work under torch >= 2.6: tests/test_distributed.py)
    assert "checkpoint.load_checkpoint_on_all_dp_ranks" not in o
    # the effective batch is printed before the command
    batch = f"= {TOKEN_RECIPES[recipe][1]} tokens per update (the paper's: "
    assert batch in proc.stdout and proc.stdout.index(batch) < proc.stdout.index("--config-dir")


def test_done_when_wmt14_on_4_gpus_is_fp16_with_update_freq_32():
    o, cmd, _ = train_command("wmt14", GPUS=4)
    assert o["common.fp16"] == "true" and o["optimization.update_freq"] == "[32]"
    assert cmd[0].endswith("fairseq-hydra-train") and o["dataset.max_tokens"] == "4096"


@pytest.mark.parametrize("recipe", ["iwslt14", "wmt14", "cnndm_bart", "wikitext103"])
def test_cpu_and_bf16(recipe):
    o, _, _ = train_command(recipe, GPUS=0)
    assert o["common.cpu"] == "true" and "common.fp16" not in o
    assert o["distributed_training.distributed_world_size"] == "1"
    o, _, _ = train_command(recipe, GPUS=8, CPU=1)
    assert o["common.cpu"] == "true"
    o, _, _ = train_command(recipe, GPUS=2, BF16=1)
    assert o["common.bf16"] == "true" and "common.fp16" not in o
    o, _, _ = train_command(recipe, GPUS=2, FP16=0)
    assert "common.fp16" not in o and "common.bf16" not in o


def test_gpus_default_to_the_visible_ones():
    o, _, _ = train_command("wmt14", CUDA_VISIBLE_DEVICES="0,3")
    assert o["distributed_training.distributed_world_size"] == "2"
    assert o["optimization.update_freq"] == "[64]"
    o, _, _ = train_command("wmt14", CUDA_VISIBLE_DEVICES="")
    assert o["common.cpu"] == "true"


@pytest.mark.parametrize("recipe, gpus", [("wmt14", 3), ("cnndm_bart", 3), ("iwslt14", 3),
                                          ("wikitext103", 6), ("wikitext103 adaptive", 16)])
def test_a_gpu_count_that_does_not_divide_the_batch_is_a_one_line_error(recipe, gpus):
    name, env = recipe.split()[0], TOKEN_RECIPES[recipe][0]
    _, proc = dry_run(name, "train", ok=False, GPUS=gpus, **env)
    assert proc.returncode != 0 and "--config-dir" not in proc.stdout
    error = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(error) == 1 and "UPDATE_FREQ" in error[0] and "MAX_TOKENS" in error[0], proc.stderr


def test_update_freq_and_max_tokens_override_the_split():
    o, _, proc = train_command("wmt14", GPUS=3, UPDATE_FREQ=43, MAX_TOKENS=4096)
    assert (o["optimization.update_freq"], o["dataset.max_tokens"]) == ("[43]", "4096")
    assert "= 528384 tokens per update (the paper's: 524288" in proc.stdout
    o, _, _ = train_command("wmt14", GPUS=4, MAX_TOKENS=2048)
    assert o["optimization.update_freq"] == "[64]"
    o, _, _ = train_command("cnndm_bart", GPUS=4, UPDATE_FREQ=8)
    assert o["dataset.max_tokens"] == "2048"
    # IWSLT's one-GPU batch on more GPUs: smaller batches per GPU, update-freq 1
    o, _, _ = train_command("iwslt14", GPUS=8)
    assert (o["optimization.update_freq"], o["dataset.max_tokens"]) == ("[1]", "512")


@pytest.mark.parametrize("recipe", list(TOKEN_RECIPES))
def test_modes(recipe):
    paper_alpha = TOKEN_RECIPES[recipe][2]
    rdrop, _, _ = train_command(recipe, GPUS=8)
    assert rdrop["criterion.rdrop_alpha"] == paper_alpha
    assert train_command(recipe, GPUS=8, ALPHA=3)[0]["criterion.rdrop_alpha"] == "3"
    baseline, _, _ = train_command(recipe, GPUS=8, MODE="baseline")
    assert baseline["criterion.rdrop_alpha"] == "0"
    assert not any("rdrop_two_passes" in k for k in baseline)
    no_kl, _, _ = train_command(recipe, GPUS=8, MODE="no-kl")
    assert no_kl["criterion.rdrop_alpha"] == "0"
    assert no_kl["++criterion.rdrop_two_passes"] == "true"
    doubled, _, proc = train_command(recipe, GPUS=8, MODE="doubled-batch")
    assert doubled["criterion.rdrop_alpha"] == "0"
    assert int(doubled["dataset.max_tokens"]) == 2 * int(baseline["dataset.max_tokens"])
    assert doubled["optimization.update_freq"] == baseline["optimization.update_freq"]
    assert "doubled by MODE=doubled-batch" in proc.stdout


def test_mode_and_alpha_errors():
    for env, message in [({"MODE": "rdorp"}, "MODE must be rdrop, baseline, no-kl or "
                                             "doubled-batch, not 'rdorp'"),
                         ({"MODE": "baseline", "ALPHA": "5"}, "ALPHA=5 contradicts MODE=baseline"),
                         ({"GPUS": "two"}, "GPUS must be a number")]:
        _, proc = dry_run("iwslt14", "train", ok=False, **env)
        assert proc.returncode != 0 and message in proc.stderr, proc.stderr
    _, proc = dry_run("iwslt14", "fit", ok=False)
    assert "unknown stage 'fit'" in proc.stderr
    assert script("glue", "--help").stdout.startswith("GLUE with R-Drop")  # the header
    assert script("vit", "--help").stdout.startswith("Image classification with R-Drop")


def test_several_nodes_use_fairseqs_distributed_options():
    o, _, _ = train_command("wmt14", GPUS=8, NODES=2, NODE_RANK=1, MASTER_ADDR="10.1.2.3",
                            MASTER_PORT=12345)
    assert o["distributed_training.distributed_world_size"] == "16"
    assert o["distributed_training.distributed_rank"] == "8"  # node 1's first GPU
    assert o["distributed_training.distributed_init_method"] == "tcp://10.1.2.3:12345"
    assert o["optimization.update_freq"] == "[8]"  # 16 GPUs x 8 x 4096
    o, _, _ = train_command("cnndm_bart", GPUS=4, NODES=2, NODE_RANK=0, MASTER_ADDR="host0")
    assert (o["distributed_training.distributed_rank"], o["optimization.update_freq"]) == (
        "0", "[8]")
    for env, message in [({"NODES": 2}, "needs MASTER_ADDR"),
                         ({"NODES": 2, "MASTER_ADDR": "h", "NODE_RANK": 2}, "NODE_RANK must be"),
                         ({"NODES": 2, "GPUS": 0}, "needs GPUs")]:
        _, proc = dry_run("wmt14", "train", ok=False, **{"GPUS": 8, **env})
        assert proc.returncode != 0 and message in proc.stderr, proc.stderr


def test_extra_arguments_and_fairseq_bin_reach_the_command():
    _, cmd, _ = train_command("wikitext103", GPUS=1, FAIRSEQ_BIN="/opt/fs/bin")
    assert cmd[0] == "/opt/fs/bin/fairseq-hydra-train"
    commands, _ = dry_run("iwslt14", "train", "optimization.max_update=7", GPUS=1)
    assert commands[-1][-1] == "optimization.max_update=7"
    # the summarization recipe trains through rdrop_fairseq.fairseq_fixes (its fairseq bugs)
    _, cmd, _ = train_command("cnndm_bart", GPUS=1)
    assert cmd[1:3] == ["-m", "rdrop_fairseq.fairseq_fixes"]


FETCH = "rdrop_fairseq.recipes.fetch"  # the inputs not given, before the stage that needs them


def test_every_stage_of_every_recipe_prints_its_commands():
    expected = {  # the modules each stage runs, in order (all = prepare, train, evaluate)
        ("iwslt14", ()): [FETCH, "rdrop_fairseq.recipes.prepare_iwslt", "fairseq-hydra-train",
                          "rdrop_fairseq.recipes.evaluate_translation"],
        ("wmt14", ()): [FETCH, "rdrop_fairseq.recipes.prepare_wmt14", "fairseq-hydra-train",
                        "rdrop_fairseq.recipes.evaluate_translation"],
        ("cnndm_bart", ()): [FETCH, "rdrop_fairseq.recipes.prepare_cnndm", FETCH,
                             "rdrop_fairseq.fairseq_fixes",
                             "rdrop_fairseq.recipes.evaluate_summarization"],
        ("wikitext103", ()): [FETCH, "rdrop_fairseq.recipes.prepare_wikitext",
                              "fairseq-hydra-train", "rdrop_fairseq.recipes.evaluate_lm"],
        ("glue", ("TASK", "RTE")): [FETCH, "rdrop_fairseq.recipes.prepare_glue", FETCH,
                                    "fairseq-hydra-train", "rdrop_fairseq.recipes.evaluate_glue"],
        # the weights fetched by train; on several GPUs, train through torchrun
        ("vit", ()): [FETCH, "rdrop_fairseq.recipes.vit", FETCH, "rdrop_fairseq.recipes.vit",
                      "rdrop_fairseq.recipes.vit"],
    }
    for (name, env), programs in expected.items():
        commands, proc = dry_run(name, GPUS=1, **dict([env] if env else []))
        ran = [c[2] if c[1:2] == ["-m"] else c[0].rsplit("/", 1)[-1] for c in commands]
        assert ran == programs, proc.stdout
    # evaluation as the authors: checkpoint_best.pt; AVERAGE=10 averages the last 10 epoch
    # checkpoints first (fairseq's Scaling NMT recipe)
    for name in ("wmt14", "iwslt14"):
        (command,), _ = dry_run(name, "evaluate", GPUS=0)
        assert command[command.index("--checkpoint") + 1].endswith("/checkpoint_best.pt")
        assert command[-1] == "--cpu"
    commands, _ = dry_run("wmt14", "evaluate", GPUS=1, AVERAGE=10)
    assert commands[0][commands[0].index("--num-epoch-checkpoints") + 1] == "10"
    assert commands[1][commands[1].index("--checkpoint") + 1].endswith("checkpoint.avg10.pt")
    _, proc = dry_run("wmt14", "evaluate", ok=False, AVERAGE="last")
    assert proc.returncode != 0 and "AVERAGE must be a number" in proc.stderr


def test_wmt14_google_data_is_the_authors_en_de():
    (command,), _ = dry_run("wmt14", "prepare", GOOGLE="/data/wmt16_en_de_bpe32k")
    assert command[command.index("--google") + 1] == "/data/wmt16_en_de_bpe32k"
    assert command[command.index("--out") + 1].endswith("/work/wmt16-google.en-de")
    o, _, _ = train_command("wmt14", GPUS=8, GOOGLE="/data/wmt16_en_de_bpe32k")
    assert o["task.data"].endswith("/work/wmt16-google.en-de/bin")
    assert "/checkpoints/wmt16-google.en-de.rdrop.seed1" in o["checkpoint.save_dir"]
    _, proc = dry_run("wmt14", "prepare", ok=False, PAIR="en-fr", GOOGLE="/data/x")
    assert proc.returncode != 0 and "GOOGLE is Google's WMT'16 En-De" in proc.stderr


def test_the_dry_run_prints_the_commands_the_evaluation_runs():
    """The evaluate stages' modules run fairseq-generate / fairseq-eval-lm themselves: a dry
    run prints those too (``++ `` lines), with the settings the real run uses."""
    def option(cmd, name):
        return cmd[cmd.index(name) + 1]

    (outer,), proc = dry_run("iwslt14", "evaluate", GPUS=0)
    (inner,) = proc.inner
    assert Path(inner[0]).name == "fairseq-generate" and inner[-1] == "--cpu"
    assert option(inner, "--path") == option(outer, "--checkpoint")
    assert (option(inner, "--source-lang"), option(inner, "--beam"),
            option(inner, "--lenpen")) == ("de", "5", "1.0")
    _, proc = dry_run("wmt14", "evaluate", GPUS=1, AVERAGE=10, FAIRSEQ_BIN="/opt/fs/bin")
    (inner,) = proc.inner  # the averaged checkpoint, the paper's En->De decoding
    assert inner[0] == "/opt/fs/bin/fairseq-generate" and "--cpu" not in inner
    assert option(inner, "--path").endswith("/checkpoint.avg10.pt")
    assert (option(inner, "--beam"), option(inner, "--lenpen")) == ("4", "0.6")
    _, proc = dry_run("wikitext103", "evaluate", GPUS=0, ARCH="adaptive")
    assert [(Path(c[0]).name, option(c, "--tokens-per-sample"), option(c, "--context-window"))
            for c in proc.inner] == [("fairseq-eval-lm", "3072", "2560"),
                                     ("fairseq-eval-lm", "512", "400")]


def test_training_and_evaluation_run_the_fairseq_beside_python(tmp_path):
    """One rule for the scripts and the recipe modules: the fairseq CLIs beside $PYTHON
    (the environment that runs the recipe) before those on PATH; so the training command
    and the evaluation's fairseq-eval-lm come from the same install."""
    venv = Path(sys.prefix)
    if not (venv / "pyvenv.cfg").is_file():
        pytest.skip("the tests do not run in a virtual environment to copy")
    env = tmp_path / "env"  # a second environment: this one's interpreter and libraries
    (env / "bin").mkdir(parents=True)
    shutil.copy(venv / "pyvenv.cfg", env)
    (env / "lib").symlink_to(venv / "lib")
    (env / "bin" / "python3").symlink_to(Path(sys.executable).resolve())
    other = tmp_path / "elsewhere"  # another fairseq, first on PATH
    other.mkdir()
    for folder in (env / "bin", other):
        for tool in ("fairseq-hydra-train", "fairseq-eval-lm"):
            (folder / tool).write_text("#!/bin/sh\nexit 1\n")
            (folder / tool).chmod(0o755)
    path = os.pathsep.join([str(other), str(Path(sys.executable).parent), "/usr/bin", "/bin"])
    commands, proc = dry_run("wikitext103", "all", GPUS=0, PYTHON=env / "bin" / "python3",
                             PATH=path, DATA_DIR=tmp_path / "data", SAVE_DIR=tmp_path / "ckpt")
    train = next(c for c in commands if "--config-dir" in c)
    (evaluate,) = proc.inner
    for cmd, tool in ((train, "fairseq-hydra-train"), (evaluate, "fairseq-eval-lm")):
        assert Path(cmd[0]).name == tool, cmd
        assert Path(cmd[0]).parent.resolve() == (env / "bin").resolve(), cmd


# ------------------------------------------------------------------ GLUE: sentences, one GPU

GLUE_PAPER = {"CoLA": (16, "0.5"), "MRPC": (16, "1.0"), "RTE": (8, "1.0"), "SST-2": (32, "1.0"),
              "MNLI": (32, "0.5"), "QNLI": (32, "1.0"), "QQP": (32, "0.5"), "STS-B": (16, "1.0")}


@pytest.mark.parametrize("task", list(GLUE_PAPER))
def test_glue_runs_the_papers_batch_on_one_gpu(task):
    batch, alpha = GLUE_PAPER[task]
    commands, proc = dry_run("glue", "train", TASK=task, GPUS=1)
    o = overrides_of(commands[-1])
    assert (o["dataset.batch_size"], o["optimization.update_freq"]) == (str(batch), "[1]")
    assert o["criterion.rdrop_alpha"] == alpha and o["common.fp16"] == "true"
    o = overrides_of(dry_run("glue", "train", TASK=task, GPUS=1, UPDATE_FREQ=2)[0][-1])
    assert int(o["dataset.batch_size"]) * 2 == batch
    o = overrides_of(dry_run("glue", "train", TASK=task, GPUS=1, MODE="doubled-batch")[0][-1])
    assert (o["dataset.batch_size"], o["criterion.rdrop_alpha"]) == (str(2 * batch), "0")


@pytest.mark.parametrize("gpus, task, mode, update_freq", [
    (2, "CoLA", "rdrop", 1), (4, "RTE", "baseline", 2), (2, "STS-B", "doubled-batch", 1),
    (2, "RTE", "attendout", 1), (4, "QQP", "attendout_rdrop", 2), (8, "STS-B", "attendout", 1)])
def test_glue_splits_its_batch_over_the_gpus(gpus, task, mode, update_freq):
    """Every mode runs on several GPUs: GPUs x update-freq x batch-size sentences is the
    task's batch (R-Drop's: the paper's; AttendOut's: fairseq's roberta.base table, RTE 16,
    QQP 32, STS-B 16; doubled-batch: twice the sentences per batch), and fairseq gathers
    the GLUE metrics' predictions from the GPUs through room for every batch."""
    attendout = mode.startswith("attendout")
    batch = {"RTE": 16, "QQP": 32, "STS-B": 16}[task] if attendout else GLUE_PAPER[task][0]
    factor = 2 if mode == "doubled-batch" else 1
    commands, proc = dry_run("glue", "train", TASK=task, GPUS=gpus, MODE=mode,
                             UPDATE_FREQ=update_freq)
    o = overrides_of(commands[-1])
    assert o["distributed_training.distributed_world_size"] == str(gpus)
    assert o["optimization.update_freq"] == f"[{update_freq}]"
    assert int(o["dataset.batch_size"]) * gpus * update_freq == batch * factor
    assert (f"batch: {gpus} device(s) x update-freq {update_freq} x {o['dataset.batch_size']} "
            f"sentences = {batch * factor} sentences per update (the paper's: {batch})"
            ) in proc.stdout
    assert "checkpoint.load_checkpoint_on_all_dp_ranks" not in o  # broadcast from process 0
    gather = o.get("common.all_gather_list_size")
    assert gather == (None if task == "RTE" else str(16384 * update_freq))  # RTE: accuracy
    _, proc = dry_run("glue", "train", ok=False, TASK=task, GPUS=3, MODE=mode)
    assert f"3 GPUs x UPDATE_FREQ=1 do not divide {task}'s batch of {batch}" in proc.stderr


def test_glue_task_names():
    assert overrides_of(dry_run("glue", "train", TASK="sts-b", GPUS=0)[0][-1])[
        "task.num_classes"] == "1"
    _, proc = dry_run("glue", "train", ok=False, TASK="WNLI")
    assert "TASK must be one of CoLA" in proc.stderr


# ------------------------------------------------------------------ inputs, not a dry run


@pytest.mark.parametrize("name, stage, env, message", [
    ("iwslt14", "train", {}, "bin/dict.de.txt not found: run: bash scripts/iwslt14.sh prepare"),
    ("iwslt14", "evaluate", {}, "checkpoint_best.pt not found: train first"),
    ("iwslt14", "prepare", {"SRC": "en", "TGT": "fr"},
     "iwslt14-en-fr has no live source known to us: fairseq's mirror holds IWSLT14 de-en only"),
    ("wmt14", "train", {}, "bin/dict.en.txt not found"),
    ("cnndm_bart", "prepare", {}, "train.source not found: RAW must hold the CNN/DM text"),
    ("wikitext103", "evaluate", {}, "checkpoint_best.pt not found"),
    ("glue", "train", {"TASK": "RTE"}, "RTE-bin/input0/dict.txt not found"),
])
def test_missing_inputs_are_one_line_errors_that_make_nothing(tmp_path, name, stage, env,
                                                              message):
    proc = script(name, stage, ok=False, GPUS=0, DATA_DIR=tmp_path / "data",
                  SAVE_DIR=tmp_path / "save", RAW=tmp_path / "raw", **env)
    assert proc.returncode != 0
    assert proc.stderr.count("\n") == 1 and message in proc.stderr, proc.stderr
    assert list(tmp_path.iterdir()) == []


# evaluate module -> its arguments besides --data and --checkpoint, the data-bin's file it
# looks for, and the commands that make the data-bin and the checkpoint
EVALUATE = {
    "evaluate_translation iwslt": ([], "dict.de.txt", "bash scripts/iwslt14.sh"),
    "evaluate_translation wmt14": (["--src", "en", "--tgt", "fr"], "dict.en.txt",
                                   "PAIR=en-fr bash scripts/wmt14.sh"),
    "evaluate_lm": ([], "dict.txt", "bash scripts/wikitext103.sh"),
    "evaluate_glue RTE": (["--glue-dir", "GLUE", "--bpe-dir", "BPE"], "input0/dict.txt",
                          "TASK=RTE bash scripts/glue.sh"),
    "evaluate_summarization": (["--raw", "RAW", "--encoder-json", "BPE/encoder.json",
                                "--vocab-bpe", "BPE/vocab.bpe"], "dict.source.txt",
                               "bash scripts/cnndm_bart.sh"),
}


@pytest.mark.parametrize("missing", ["data-bin", "checkpoint"])
@pytest.mark.parametrize("module", list(EVALUATE))
def test_evaluate_modules_name_a_missing_input_and_the_command_that_makes_it(tmp_path, module,
                                                                             missing):
    """Run by hand, not by their script: one line naming the missing path and the recipe
    stage that makes it, not fairseq's traceback."""
    args, data_file, recipe = EVALUATE[module]
    for path in ["RAW/test.source", "RAW/test.target", "BPE/encoder.json", "BPE/vocab.bpe",
                 "GLUE/RTE/dev.tsv", "bin/" + data_file, "checkpoint_best.pt"]:
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).touch()
    data, checkpoint = "bin", "checkpoint_best.pt"
    if missing == "data-bin":
        data, made_by = "MISSING", f"run: {recipe} prepare"
    else:
        checkpoint, made_by = "MISSING.pt", f"train first: {recipe} train"
    name, *positional = module.split()
    proc = subprocess.run([sys.executable, "-m", f"rdrop_fairseq.recipes.{name}", *positional,
                           "--data", data, "--checkpoint", checkpoint, *args],
                          capture_output=True, text=True, cwd=tmp_path, timeout=60)
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert proc.stderr.count("\n") == 1 and "MISSING" in proc.stderr, proc.stderr
    assert made_by in proc.stderr, proc.stderr


@pytest.mark.parametrize("name, env, message", [
    ("iwslt14", {"ALPHA": "-1"}, "ALPHA must be a number >= 0"),
    ("wmt14", {"ALPHA": "nan"}, "ALPHA must be a number >= 0"),
    ("glue", {"ALPHA": "abc", "TASK": "RTE"}, "ALPHA must be a number >= 0"),
    ("cnndm_bart", {"SEED": "1.5"}, "SEED must be a whole number"),
    ("wikitext103", {"MAX_UPDATE": "0"}, "MAX_UPDATE must be a whole number >= 1"),
    ("iwslt14", {"UPDATE_FREQ": "two"}, "UPDATE_FREQ must be a whole number >= 1"),
    ("iwslt14", {"GPUS": "2"}, "GPUS=2 but"),  # no CUDA device on this machine
])
def test_bad_variables_are_one_line_errors_before_anything_is_made(tmp_path, name, env,
                                                                   message):
    """Checked up front, not by hydra after it made its run directory (a real run, not a
    dry run: the data is there, nothing may be created)."""
    data = tmp_path / "data"
    data.mkdir()
    proc = script(name, "train", ok=False, DATA_DIR=data, SAVE_DIR=tmp_path / "save",
                  PYTHON=sys.executable, **{"GPUS": "0", **env})
    assert proc.returncode != 0
    assert proc.stderr.count("\n") == 1 and message in proc.stderr, proc.stderr
    assert [p.name for p in tmp_path.iterdir()] == ["data"] and not any(data.iterdir())


def test_plugin_import_loads_neither_the_recipes_nor_the_fairseq_fixes():
    code = ("import sys, rdrop_fairseq; from fairseq.ngram_repeat_block import NGramRepeatBlock;"
            "print(sorted(m for m in sys.modules if m.startswith(('rdrop_fairseq.recipes',"
            " 'rdrop_fairseq.fairseq_fixes'))), NGramRepeatBlock._no_repeat_ngram.__module__)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, cwd=REPO).stdout
    assert out.split() == ["[]", "fairseq.ngram_repeat_block"]


@pytest.mark.parametrize("module, args", [
    ("prepare_iwslt", ["--archive", "{tmp}/none.tgz", "--src", "de", "--tgt", "en"]),
    ("prepare_wikitext", ["--source", "{tmp}/none"]),
    ("prepare_wmt14", ["--orig", "{tmp}/orig"]),  # nothing to download offline
])
def test_a_failed_prepare_is_one_line_and_leaves_no_half_made_output(tmp_path, module, args):
    from tests.recipe_helpers import OFFLINE, run

    out = tmp_path / "out"
    proc = run([sys.executable, "-m", f"rdrop_fairseq.recipes.{module}", "--out", out,
                *[a.format(tmp=tmp_path) for a in args]], ok=False, env=OFFLINE)
    assert proc.returncode != 0 and "Traceback" not in proc.stderr
    assert len([line for line in proc.stderr.splitlines() if "error" in line]) == 1, proc.stderr
    assert list(tmp_path.iterdir()) == []  # no OUT, no empty download folder


def gpu_check_dry_run(tmp_path, **env):
    """gpu_check.sh's dry run: ``{stage: its time box}``, ``{stage: its command}``."""
    _, proc = dry_run("gpu_check", OUT=tmp_path / "out", PYTHON=sys.executable, **env)
    assert "no CUDA device here" in proc.stdout
    boxes, commands = {}, {}
    for name, box, line in re.findall(r"^\+ \[(\w+), (\d+) s\] (.*)$", proc.stdout, re.M):
        boxes[name], commands[name] = int(box), shlex.split(line)
    assert not (tmp_path / "out").exists()
    return boxes, commands


def test_gpu_check_dry_run_prints_every_stage_with_its_time_box(tmp_path):
    boxes, by_stage = gpu_check_dry_run(tmp_path)
    assert set(boxes) == {"loss", "step", "attendout", "attendout_pruning", "hf", "cuda_tests",
                          "prepare", "fp16_train", "fast_tier", "recipe_memory"}, boxes
    # one 8-minute call: the measurements one after the other, then the rest side by side
    # (the recipes' memory too: an allocator's peak is its own process's)
    serial = sum(boxes[s] for s in ("loss", "step", "attendout", "attendout_pruning", "hf"))
    side = max(boxes["cuda_tests"], boxes["prepare"] + boxes["fp16_train"], boxes["fast_tier"],
               boxes["recipe_memory"])
    assert serial + side + 60 <= 8 * 60, boxes  # the set-up's box (WHEELS) included
    memory = by_stage["recipe_memory"]
    assert memory[1].endswith("bench_recipe_memory.py") and "--tiny" not in memory
    assert memory[memory.index("--device") + 1] == "cuda" and "--recipes" not in memory
    assert by_stage["cuda_tests"][1:5] == ["-m", "pytest", "-m", "cuda"]
    hf = by_stage["hf"]  # RDropTrainer in bf16 at a Llama-3-8B head's shape, on the GPU
    assert hf[1].endswith("bench_hf.py") and "--bf16" in hf and "--one-process" in hf
    assert hf[hf.index("--shape") + 1] == "llama3-8b-head"
    assert hf[hf.index("--length") + 1] == "8192" and hf[hf.index("--device") + 1] == "cuda"
    train = by_stage["fp16_train"]
    assert "--fp16" in train and train[train.index("--criterion") + 1] == (
        "label_smoothed_cross_entropy_rdrop")
    assert train[train.index("--max-update") + 1] == "300"
    loss = by_stage["loss"]
    assert loss[loss.index("--tokens") + 1: loss.index("--projection")] == ["8192"]
    assert loss[loss.index("--dtype") + 1: loss.index("--vocab")] == ["bfloat16", "float16"]
    assert loss[loss.index("--vocab") + 1: loss.index("--tokens")] == ["32000", "267744"]
    methods = loss[loss.index("--methods") + 1: loss.index("--fused-chunk-mb")]
    assert methods == ["floor", "upstream", "ours-triton", "ours-fused-linear"]
    for name in ("loss", "step"):
        assert by_stage[name][1].endswith("bench_rdrop.py")
    step = by_stage["step"]
    assert step[step.index("--step-arch") + 1: step.index("--step-arch") + 3] == [
        "transformer_iwslt_de_en", "transformer_vaswani_wmt_en_de_big"]
    assert "--profile" in step
    assert "--fast" in by_stage["fast_tier"]
    # FULL=1: the whole grid (more token counts and methods) in boxes 4x as long;
    # AttendOut's in its gpu mode (step, inference and pruning memory: one stage)
    full_boxes, full = gpu_check_dry_run(tmp_path, FULL=1)
    assert full_boxes == {name: 4 * box for name, box in boxes.items()
                          if name != "attendout_pruning"}
    assert full["attendout"][2] == "gpu"
    loss = full["loss"]
    assert loss[loss.index("--tokens") + 1: loss.index("--projection")] == ["4096", "8192"]
    assert {"ours-torch", "ours-fused-linear-torch"} <= set(loss)


@pytest.mark.parametrize("env, message", [
    ({"T_LOSS": "1m"}, "T_LOSS must be a whole number of seconds >= 1"),
    ({"T_FAST_TIER": "0"}, "T_FAST_TIER must be a whole number of seconds >= 1"),
    ({"FP16_UPDATES": "-3"}, "FP16_UPDATES must be a whole number >= 1"),
])
def test_gpu_check_bad_variables_are_one_line_errors(tmp_path, env, message):
    proc = script("gpu_check", ok=False, OUT=tmp_path / "out", WORK=tmp_path / "work",
                  PYTHON=sys.executable, **env)
    assert proc.returncode == 1 and proc.stderr.count("\n") == 1, proc.stderr
    assert message in proc.stderr, proc.stderr
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow
def test_gpu_check_cpu_smoke_runs_every_stage_time_boxed_into_eight_files(tmp_path):
    """CPU_SMOKE=1: every stage at toy sizes on the CPU (Triton's interpreter for the
    kernel; the recipes' memory for IWSLT alone), as on a GPU: its results in at most 8 files (what comes back from a GPU
    machine), the tables and the profiles in them. One stage gets a time box of 1 s
    (T_ATTENDOUT_PRUNING=1; it needs about 5 s): it is cut, reported as timed out, the
    stages after it still run, and the check exits with 1."""
    out, work = tmp_path / "out", tmp_path / "work"
    # the python stand-in: its python -m of our modules (the data's preparation) starts
    # warm, any other command line (the benchmarks, pytest) is the real interpreter
    proc = script("gpu_check", ok=False, CPU_SMOKE=1, OUT=out, WORK=work,
                  PYTHON=os.path.join(fairseq_bin(), "python3"), T_ATTENDOUT_PRUNING=1)
    assert proc.returncode == 1, proc.output[-4000:]
    files = sorted(p.name for p in out.rglob("*") if p.is_file())
    assert files == ["bench_attendout.json", "bench_rdrop.json", "cuda-tests.xml",
                     "fast-tier.xml", "fp16-train.log", "gpu-check.log", "profile.txt",
                     "summary.md"], files
    summary = (out / "summary.md").read_text()
    table = summary.split("| stage | status |")[1].split("\n\n")[0]
    stages = {name: (status, seconds, box) for name, status, seconds, box in re.findall(
        r"^\| (\w+) \| ([^|]+) \| ([^|]+) \| ([^|]+) \|$", table, re.M)}
    assert list(stages) == [
        "loss", "step", "attendout", "attendout_pruning", "hf", "cuda_tests", "prepare",
        "fp16_train", "fp16_check", "fast_tier", "recipe_memory"], summary
    cut = stages.pop("attendout_pruning")
    assert cut[0] == "timed out" and cut[2] == "1" and int(cut[1]) <= 3, cut
    assert "attendout_pruning: timed out" in proc.stdout
    assert all(status.startswith("ok") for status, _, _ in stages.values()), summary
    bench = json.loads((out / "bench_rdrop.json").read_text())
    assert {r["method"] for r in bench["loss"]} == {
        "floor", "upstream", "ours-triton", "ours-fused-linear", "ours-fused-linear:0.01",
        "ours-fused-linear:0.1"}
    assert all("error" not in r for r in bench["loss"] + bench["step"]), bench
    sweep = {r["method"]: r["pairs"] for r in bench["loss"] if "pairs" in r}
    assert sweep["ours-fused-linear:0.01"] < sweep["ours-fused-linear:0.1"], sweep
    assert len(bench["step"]) == 6  # 2 archs x floor, upstream, ours-triton
    # the recipes' memory: IWSLT's path on the CPU (tiny), its rows for 'record'
    rows = bench["recipe_memory"]["rows"]
    assert [(r["recipe"], r["max_tokens"]) for r in rows] == [("iwslt14", 4096),
                                                             ("iwslt14", 2048)], rows
    assert "### The recipes' memory (recipe_memory)" in summary and "| iwslt14 | 4096 |" in summary
    assert set(json.loads((out / "bench_attendout.json").read_text())) == {"attendout"}
    # the Hugging Face stage: its three methods, and its table in the summary
    assert [r["method"] for r in bench["hf"]["rows"]] == ["floor", "rdrop", "rdrop-fused"]
    assert "### Hugging Face: RDropTrainer, bf16 (hf)" in summary
    assert "| causal-lm | **RDropTrainer**, fused linear |" in summary
    profiles = (out / "profile.txt").read_text()
    assert profiles.count("## ") == 6 and "per step" in profiles
    assert "| ours-fused-linear:0.1 (" in summary and "### AttendOut (attendout)" in summary
    assert "===== attendout_pruning" in (out / "gpu-check.log").read_text()
    assert "fp16 run: ok" in proc.stdout


def test_gpu_check_without_cuda_says_so_and_fails(tmp_path):
    proc = script("gpu_check", ok=False, OUT=tmp_path / "out", WORK=tmp_path / "work",
                  PYTHON=sys.executable)
    assert proc.returncode == 1 and "no CUDA device" in proc.stderr
    assert proc.stderr.count("\n") == 1 and list(tmp_path.iterdir()) == []
