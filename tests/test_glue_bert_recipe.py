"""The BERT-base GLUE recipe (scripts/glue_bert.sh, rdrop_fairseq.recipes.glue_bert) on
stand-ins built here, nothing downloaded: tiny GLUE folders in the GLUE layout
(tests/test_glue_recipe.py's) and a tiny random BERT with all-MiniLM-L6-v2's uncased
WordPiece tokenizer (from the environment, scripts/setup.sh) in place of bert-base-uncased.
RTE runs prepare -> 20 updates -> rerun to 30, resumed from the last checkpoint -> dev
score through the script; STS-B (regression) and MNLI (two dev sets) through the module.
Scores are checked against predictions and metrics computed here. The script's settings are
checked against the paper's table in dry runs."""

import argparse
import json
import math
import os
import shutil
import sys
from pathlib import Path

import pytest
import torch

from rdrop_fairseq.recipes import glue_bert
from tests.recipe_helpers import OFFLINE, dry_run, script
from tests.test_glue_recipe import PAPER_TABLE, write_glue
from tests.test_hf import sequential

# nothing may come from the Hugging Face hub (read when huggingface_hub is imported; the
# script's processes get it from the test's env)
os.environ.setdefault("HF_HUB_OFFLINE", "1")
MINILM = Path(sys.prefix) / "share" / "rdrop-fairseq" / "all-MiniLM-L6-v2"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def write_bert(folder):
    """A 2-layer, 32-wide random BERT with MiniLM's tokenizer (BERT's uncased vocabulary)."""
    from transformers import BertConfig, BertForPreTraining

    assert (MINILM / "tokenizer.json").is_file(), f"no MiniLM in {MINILM}: scripts/setup.sh"
    torch.manual_seed(0)
    BertForPreTraining(BertConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                  intermediate_size=64, max_position_embeddings=128)
                       ).save_pretrained(folder)
    for name in TOKENIZER_FILES:
        shutil.copy(MINILM / name, folder / name)
    return folder


@pytest.fixture(scope="module")
def stand_ins(tmp_path_factory):
    root = tmp_path_factory.mktemp("glue_bert")
    data = write_glue(root / "glue_data")
    return {"root": root, "glue_dir": root / "glue_data", "data": data,
            "bert": write_bert(root / "bert-base-uncased")}


def predict_here(model_dir, bert_dir, rows):
    """Predictions of the fine-tuned model for raw (sentence, ..., label) rows, tokenised
    here, one example at a time (no padding), dropout off."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(bert_dir)
    model = AutoModelForSequenceClassification.from_pretrained(model_dir).eval()
    out = []
    with torch.no_grad():
        for row in rows:
            inputs = tokenizer(*row[:-1], truncation=True, max_length=128, return_tensors="pt")
            logits = model(**inputs).logits[0]
            out.append(float(logits[0]) if logits.numel() == 1
                       else model.config.id2label[int(logits.argmax())])
    return out


def accuracy(pred, gold):
    return 100.0 * sum(p == g for p, g in zip(pred, gold)) / len(gold)


def test_rte_prepare_train_resume_evaluate_through_the_script(stand_ins, tmp_path):
    glue_dir, bert = stand_ins["glue_dir"], stand_ins["bert"]
    env = dict(OFFLINE, HF_HUB_OFFLINE="1", TASK="rte", GPUS=0, GLUE_DIR=glue_dir,
               BERT_DIR=bert, DATA_DIR=tmp_path / "data", SAVE_DIR=tmp_path / "save")
    script("glue_bert", "prepare", **env)
    meta = json.loads((tmp_path / "data" / "RTE" / "meta.json").read_text())
    assert meta["labels"] == ["entailment", "not_entailment"]
    assert meta["dev_splits"] == ["dev"] and meta["examples"] == {"train": 24, "dev": 8}
    # a pair as BERT reads it: [CLS] a [SEP] b [SEP], token types 0 then 1
    from transformers import AutoTokenizer

    first = json.loads((tmp_path / "data" / "RTE" / "train.jsonl").read_text().splitlines()[0])
    s1, s2, label = stand_ins["data"]["RTE"]["train"][0]
    tokenizer = AutoTokenizer.from_pretrained(bert)
    a, b = tokenizer.tokenize(s1), tokenizer.tokenize(s2)
    assert tokenizer.convert_ids_to_tokens(first["input_ids"]) == [
        "[CLS]", *a, "[SEP]", *b, "[SEP]"]
    assert first["token_type_ids"] == [0] * (len(a) + 2) + [1] * (len(b) + 1)
    assert first["label"] == label

    fast = ["--save_steps", "10", "--logging_steps", "10", "--disable_tqdm", "true"]
    log = script("glue_bert", "train", *fast, MAX_UPDATE=20, **env).output
    assert "MODE=rdrop, alpha 1.0: 24 examples, 20 updates of 8 x 1 examples" in log
    assert "resuming" not in log
    assert sorted(p.name for p in (tmp_path / "save").glob("checkpoint-*")) == [
        "checkpoint-10", "checkpoint-20"]
    # rerun to 30 updates: prepare skipped (its output is there), training resumed
    proc = script("glue_bert", "all", *fast, MAX_UPDATE=30, **env)
    assert "prepare: " in proc.output and "is there already" in proc.output
    assert f"resuming from {tmp_path / 'save' / 'checkpoint-20'}" in proc.output
    state = json.loads((tmp_path / "save" / "checkpoint-30" / "trainer_state.json").read_text())
    assert state["global_step"] == 30
    assert not (tmp_path / "save" / "checkpoint-10").exists()  # the last two are kept
    result = json.loads((tmp_path / "save" / "dev.json").read_text())
    assert (result["task"], result["mode"], result["alpha"]) == ("RTE", "rdrop", 1.0)
    rows = stand_ins["data"]["RTE"]["dev"]
    pred = predict_here(tmp_path / "save" / "final", bert, rows)
    expected = accuracy(pred, [row[-1] for row in rows])
    assert result["metrics"]["dev"] == {"accuracy": pytest.approx(expected), "examples": 8}
    assert f"RTE dev: accuracy {expected:.2f} (8 examples)" in proc.output


@pytest.mark.parametrize("task, mode", [("STS-B", "no-kl"), ("MNLI", "baseline")])
def test_regression_and_two_dev_sets_through_the_module(stand_ins, tmp_path, task, mode,
                                                        capsys):
    """In this process (the script's commands, called as functions): STS-B's score (the
    0-5 value as it is) and Pearson / Spearman; MNLI's three classes, matched and
    mismatched."""
    from scipy.stats import pearsonr, spearmanr

    data, save = tmp_path / "data", tmp_path / "save"
    bert = stand_ins["bert"]
    glue_bert.main(["prepare", task, "--glue-dir", str(stand_ins["glue_dir"]),
                    "--bert-dir", str(bert), "--out", str(data)])
    glue_bert.main(["train", task, "--data", str(data), "--bert-dir", str(bert),
                    "--mode", mode, "--", "--output_dir", str(save), "--max_steps", "4",
                    "--per_device_train_batch_size", "8", "--use_cpu", "--report_to", "none",
                    "--disable_tqdm", "true", "--learning_rate", "1e-3"])
    results = glue_bert.main(["evaluate", task, "--data", str(data), "--save-dir", str(save),
                              "--json", str(tmp_path / "dev.json")])
    splits = ["dev_matched", "dev_mismatched"] if task == "MNLI" else ["dev"]
    assert list(results) == splits
    for split in splits:
        rows = stand_ins["data"][task]["dev" if task == "STS-B" else split]
        pred = predict_here(save / "final", bert, rows)
        if task == "STS-B":
            gold = [float(row[-1]) for row in rows]
            # (after 4 updates the predictions are close together: the rounding of batched
            # forwards with padding shows in the 5th digit of the correlation)
            assert results[split]["pearson"] == pytest.approx(100 * pearsonr(pred, gold)[0],
                                                              rel=1e-3)
            assert results[split]["spearman"] == pytest.approx(
                100 * spearmanr(pred, gold)[0], rel=1e-3)
        else:
            assert results[split]["accuracy"] == pytest.approx(
                accuracy(pred, [row[-1] for row in rows]))
    written = json.loads((tmp_path / "dev.json").read_text())
    assert written["metrics"].keys() == results.keys() and written["mode"] == mode


def test_each_mode_trains_with_its_trainer(stand_ins, tmp_path):
    """rdrop and no-kl: RDropTrainer (alpha, 0); baseline and doubled-batch: one pass, the
    model's own loss, whose gradient with accumulation over k steps is that of one batch
    k times as large (transformers 5 alone would give k times that gradient for BERT)."""
    from transformers import (AutoModelForSequenceClassification, AutoTokenizer,
                              TrainerCallback, TrainingArguments)

    from rdrop_fairseq.hf import RDropTrainer

    def trainer(mode, alpha=None, batch=8, steps=1, callbacks=(), every=1, pass_mean=False):
        args = argparse.Namespace(mode=mode, alpha=alpha, rdrop_impl="auto", rdrop_every=every,
                                  rdrop_pass_mean=pass_mean)
        torch.manual_seed(0)
        # no dropout, the attention's included (transformers 4 applies it as a function of
        # the configuration's probability): the same gradient in both runs
        model = AutoModelForSequenceClassification.from_pretrained(
            stand_ins["bert"], num_labels=2, hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0)
        for module in model.modules():
            if isinstance(module, torch.nn.Dropout):
                module.p = 0.0
        training = TrainingArguments(output_dir=str(tmp_path / "out"), use_cpu=True,
                                     report_to="none", per_device_train_batch_size=batch,
                                     gradient_accumulation_steps=steps, max_steps=1,
                                     max_grad_norm=0.0, save_strategy="no",
                                     disable_tqdm=True, **sequential())
        tokenizer = AutoTokenizer.from_pretrained(stand_ins["bert"])
        rows = [tokenizer(s1, s2) for s1, s2, _ in stand_ins["data"]["RTE"]["train"][:8]]
        dataset = [{"input_ids": r["input_ids"], "token_type_ids": r["token_type_ids"],
                    "labels": i % 2} for i, r in enumerate(rows)]
        t = glue_bert.make_trainer(args, training, model, tokenizer, dataset)
        for callback in callbacks:
            t.add_callback(callback)
        return t

    rdrop = trainer("rdrop", 0.3)
    assert isinstance(rdrop, RDropTrainer) and rdrop.rdrop_alpha == 0.3
    no_kl = trainer("no-kl")
    assert isinstance(no_kl, RDropTrainer) and no_kl.rdrop_alpha == 0.0
    assert (rdrop.rdrop.every, rdrop.rdrop.pass_mean) == (1, False)
    every = trainer("rdrop", 0.3, every=3, pass_mean=True)  # --rdrop-every, --rdrop-pass-mean
    assert (every.rdrop.every, every.rdrop.pass_mean) == (3, True)

    class Grab(TrainerCallback):
        def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
            self.grad = torch.cat([p.grad.flatten().clone() for p in model.parameters()
                                   if p.grad is not None])

    grads = {}
    for mode in ("baseline", "doubled-batch"):
        for batch, steps in ((8, 1), (4, 2)):
            grab = Grab()
            t = trainer(mode, batch=batch, steps=steps, callbacks=[grab])
            assert not isinstance(t, RDropTrainer)
            t.train()
            grads[mode, steps] = grab.grad
        torch.testing.assert_close(grads[mode, 2], grads[mode, 1], rtol=1e-4, atol=1e-7)


# ------------------------------------------------------------------ the script's settings


@pytest.mark.parametrize("task", list(PAPER_TABLE))
def test_train_uses_the_papers_settings_for_each_task(task):
    updates, batch, alpha = PAPER_TABLE[task]
    commands, proc = dry_run("glue_bert", "train", TASK=task.lower(), GPUS=1)
    (cmd,) = commands
    assert cmd[1:5] == ["-m", "rdrop_fairseq.recipes.glue_bert", "train", task]
    ours, hf = cmd[:cmd.index("--")], cmd[cmd.index("--") + 1:]
    options = dict(zip(hf[::2], hf[1::2]))
    assert ours[ours.index("--mode") + 1] == "rdrop"
    assert float(ours[ours.index("--alpha") + 1]) == alpha
    assert ours[ours.index("--warmup") + 1] == "0.06"  # fairseq's RoBERTa GLUE schedule
    assert hf[-1] == "--fp16"  # as the authors' run.sh, on the GPU
    assert {k: options[k] for k in ("--max_steps", "--per_device_train_batch_size",
                                    "--gradient_accumulation_steps")} == {
        "--max_steps": str(updates), "--per_device_train_batch_size": str(batch),
        "--gradient_accumulation_steps": "1"}
    # the paper's optimiser (appendix); the rest is TrainingArguments' defaults
    assert {k: options[k] for k in ("--learning_rate", "--adam_beta1", "--adam_beta2",
                                    "--adam_epsilon", "--weight_decay")} == {
        "--learning_rate": "1e-5", "--adam_beta1": "0.9", "--adam_beta2": "0.98",
        "--adam_epsilon": "1e-6", "--weight_decay": "0.01"}
    assert options["--output_dir"].endswith(f"/checkpoints/glue_bert.{task}.rdrop.seed1")


def test_modes_batches_and_devices():
    def train_command(**env):
        (cmd,), proc = dry_run("glue_bert", "train", **{"TASK": "MRPC", "GPUS": 1, **env})
        hf = cmd[cmd.index("--") + 1:]
        return cmd[:cmd.index("--")], dict(zip(hf[::2], hf[1::2])), hf, proc

    ours, _, _, _ = train_command(ALPHA=0.3)
    assert ours[-6:] == ["--mode", "rdrop", "--alpha", "0.3", "--warmup", "0.06"]
    for mode in ("baseline", "no-kl"):
        ours, options, _, _ = train_command(MODE=mode)
        assert ours[-4:-2] == ["--mode", mode] and options["--per_device_train_batch_size"] == "16"
    ours, options, _, proc = train_command(MODE="doubled-batch")
    assert ours[-4:-2] == ["--mode", "doubled-batch"]
    assert options["--per_device_train_batch_size"] == "32"
    _, options, _, proc = train_command(UPDATE_FREQ=4, SEED=3, MAX_UPDATE=7)
    assert (options["--per_device_train_batch_size"], options["--gradient_accumulation_steps"],
            options["--seed"], options["--max_steps"]) == ("4", "4", "3", "7")
    assert "1 device x 4 steps x 4 sentences = 16 sentences per update" in proc.stdout
    assert train_command(GPUS=0)[2][-1] == "--use_cpu"
    assert train_command(BF16=1)[2][-1] == "--bf16"
    _, _, hf, _ = train_command(FP16=0)
    assert "--fp16" not in hf and "--use_cpu" not in hf
    (cmd,), _ = dry_run("glue_bert", "train", "--learning_rate", "2e-5", TASK="RTE", GPUS=1)
    assert cmd[-2:] == ["--learning_rate", "2e-5"]  # after the script's: it wins
    (cmd,), _ = dry_run("glue_bert", "train", TASK="RTE", GPUS=1, WARMUP=0.1)
    assert cmd[cmd.index("--warmup") + 1] == "0.1"
    (cmd,), _ = dry_run("glue_bert", "evaluate", TASK="RTE", GPUS=0)
    assert cmd[cmd.index("--json") + 1].endswith("glue_bert.RTE.rdrop.seed1/dev.json")
    assert cmd[-1] == "--cpu"


def test_authors_code_alpha_is_half_the_per_device_batch():
    """The authors' Hugging Face code weighs a KL summed over the batch by 0.5 beside mean
    cross-entropies: alpha = 0.5 x B here (docs/huggingface.md)."""
    for env, alpha in (({"TASK": "MRPC"}, "8"), ({"TASK": "MRPC", "UPDATE_FREQ": 2}, "4"),
                       ({"TASK": "RTE"}, "4")):
        (cmd,), proc = dry_run("glue_bert", "train", GPUS=1, AUTHORS_CODE=1, **env)
        assert cmd[cmd.index("--alpha") + 1] == alpha
        assert f"alpha = 0.5 x" in proc.stdout


@pytest.mark.parametrize("extra, env", [
    ([], {}), ([], {"WARMUP": 0}), ([], {"WARMUP": 0.1, "UPDATE_FREQ": 2}),
    (["--learning_rate", "2e-5"], {}), ([], {"GPUS": 0}), ([], {"BF16": 1})])
def test_the_training_arguments_parse_as_transformers_reads_them(tmp_path, extra, env):
    """The whole command the script gives the module, and what the docs tell users to add,
    through the module's own parsing and the real TrainingArguments: the warm-up is a
    linear schedule over the given fraction of the updates on this transformers version."""
    from transformers.optimization import get_scheduler

    (cmd,), _ = dry_run("glue_bert", "train", *extra, **{"TASK": "MRPC", "GPUS": 1, **env})
    module_args = cmd[cmd.index("train"):]
    split = module_args.index("--")
    warmup = float(module_args[module_args.index("--warmup") + 1])
    hf_args = module_args[split + 1:]
    parser = glue_bert.parser_from_doc(glue_bert.__doc__, prog="glue_bert")
    # fp16 needs a GPU to parse, bf16 a GPU or the CPU's flag: the CPU's flag here
    hf_args = [arg for arg in hf_args if arg != "--fp16"]
    args = glue_bert.training_arguments(parser, hf_args + ["--use_cpu"], warmup)
    assert args.lr_scheduler_type == "linear"
    steps = args.get_warmup_steps(args.max_steps)
    assert steps == math.ceil(warmup * args.max_steps)
    if extra:
        assert args.learning_rate == 2e-5
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=args.learning_rate)
    schedule = get_scheduler(args.lr_scheduler_type, optimizer, steps, args.max_steps)
    rates = []
    for _ in range(args.max_steps):
        rates.append(schedule.get_last_lr()[0])
        optimizer.step()
        schedule.step()
    peak = rates.index(max(rates))
    assert peak == max(steps, 1) - (steps == 0)  # up for `steps` updates, then down to 0
    assert rates[-1] < rates[peak] / 100


@pytest.mark.parametrize("env, message", [
    ({"AUTHORS_CODE": 1, "ALPHA": 2}, "AUTHORS_CODE=1 sets alpha"),
    ({"AUTHORS_CODE": 1, "MODE": "baseline"}, "AUTHORS_CODE=1 sets R-Drop's alpha"),
    ({"GPUS": 2}, "fine-tunes on one GPU, as the paper: set GPUS=1"),
    ({"MODE": "baseline", "ALPHA": 1}, "ALPHA=1 contradicts MODE=baseline"),
    ({"UPDATE_FREQ": 3}, "UPDATE_FREQ=3 does not divide RTE's batch of 8"),
    ({"TASK": "WNLI"}, "TASK must be one of CoLA"),
])
def test_bad_settings_are_one_line_errors(env, message):
    _, proc = dry_run("glue_bert", "train", ok=False, **{"TASK": "RTE", **env})
    # (a dry run notes the missing inputs on stderr first)
    errors = [line for line in proc.stderr.splitlines() if not line.startswith("[glue_bert]")]
    assert proc.returncode != 0 and len(errors) == 1, proc.stderr
    assert message in errors[0]


@pytest.mark.parametrize("stage, make, message", [
    ("prepare", (), "RTE/train.tsv not found: GLUE_DIR must hold the GLUE tasks"),
    ("prepare", ("glue",), "config.json not found: BERT_DIR must be a local copy of Hugging "
                           "Face's bert-base-uncased"),
    ("train", ("glue",), "RTE/meta.json not found: run: TASK=RTE bash scripts/glue_bert.sh "
                         "prepare"),
    ("evaluate", (), "final/glue.json not found: train first: TASK=RTE bash "
                     "scripts/glue_bert.sh train"),
])
def test_missing_inputs_say_what_to_put_where_and_make_nothing(tmp_path, stage, make, message):
    glue = tmp_path / "glue"
    if "glue" in make:
        (glue / "RTE").mkdir(parents=True)
        (glue / "RTE" / "train.tsv").write_text("index\tsentence1\tsentence2\tlabel\n")
    before = sorted(tmp_path.rglob("*"))
    proc = script("glue_bert", stage, ok=False, TASK="RTE", GPUS=0, GLUE_DIR=glue,
                  BERT_DIR=tmp_path / "bert", DATA_DIR=tmp_path / "data",
                  SAVE_DIR=tmp_path / "save")
    assert proc.returncode != 0 and proc.stderr.count("\n") == 1, proc.stderr
    assert message in proc.stderr
    assert sorted(tmp_path.rglob("*")) == before


def test_module_errors_name_what_is_missing(tmp_path, capsys):
    (tmp_path / "bert").mkdir()
    (tmp_path / "bert" / "config.json").write_text("{}")
    for argv, message in [
        (["prepare", "RTE", "--glue-dir", "g", "--bert-dir", str(tmp_path / "bert"),
          "--out", "o"], "no model.safetensors or pytorch_model.bin (weights): BERT_DIR must "
                         "be a Hugging Face BERT folder"),
        (["train", "RTE", "--data", "d", "--bert-dir", "b", "--mode", "baseline",
          "--alpha", "1"], "no config.json"),
        (["evaluate", "RTE", "--data", "d"], "--save-dir is required for evaluate"),
        (["prepare", "WNLI", "--glue-dir", "g"], "unknown GLUE task 'WNLI'"),
        (["evaluate", "RTE", "--data", "d", "--save-dir", "s", "--", "--seed", "1"],
         "arguments after -- are TrainingArguments, for train"),
    ]:
        with pytest.raises(SystemExit):
            glue_bert.main(argv)
        assert message in capsys.readouterr().err
