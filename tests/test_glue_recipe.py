"""The GLUE recipe end to end on stand-ins built here (nothing is downloaded): a tiny
byte-level GPT-2 BPE (encoder.json, vocab.bpe, dict.txt), a tiny random RoBERTa saved as a
fairseq checkpoint in place of roberta.large, and tiny RTE (two inputs), STS-B (regression),
CoLA (one input, MCC) and MNLI (three classes, two dev sets) folders in the GLUE layout:
prepare -> fine-tune (R-Drop, baseline, through scripts/glue.sh) -> evaluate; plus the
per-task table against the paper, the config, the options and errors, and the metric
functions."""

import json
import math
import random
import re
import shutil
import sys
from pathlib import Path

import pytest

import rdrop_fairseq
from rdrop_fairseq.recipes import evaluate_glue, prepare_glue
from tests.recipe_helpers import composed_config, dry_run, overrides_of, run, script

REPO = Path(__file__).resolve().parents[1]
CONFIG = "roberta_glue_rdrop"
# the pre-trained checkpoint, which the configs leave required (???)
PRETRAINED = "checkpoint.restore_file=/nonexistent.pt"

BIN = Path(sys.executable).parent
# roberta_base shrunk; the fine-tuning config's roberta_large values are overridden alike
TINY = {"encoder_layers": 1, "encoder_embed_dim": 16, "encoder_ffn_embed_dim": 32,
        "encoder_attention_heads": 2}
FAST = ["common.log_interval=1", "dataset.num_workers=0", "common.no_progress_bar=true"]
WORDS = ("the a man woman dog cat runs sleeps park city river old new red blue music "
         "plays reads book car drives fast slowly house green is not near café").split()
ROWS = {"train": 24, "dev": 8, "test": 4}
MNLI_LABELS = ("entailment", "neutral", "contradiction")




# ------------------------------------------------------------------ stand-ins


def write_gpt2_bpe(root, words, seed=0):
    """A tiny GPT-2-style byte-level BPE: ``encoder.json`` (the 256 byte symbols, then the
    merged symbols), ``vocab.bpe`` (left-to-right merges spelling each word, with and without
    the leading space "Ġ" GPT-2 puts on a word after a space) and a fairseq ``dict.txt`` of
    every BPE id, in shuffled order as GPT-2's dict.txt is ordered by frequency, not id."""
    from fairseq.data.encoders.gpt2_bpe_utils import bytes_to_unicode

    byte_symbol = bytes_to_unicode()
    encoder = {byte_symbol[b]: i for i, b in enumerate(sorted(byte_symbol))}
    merges = []
    for word in words:
        symbols = [byte_symbol[b] for b in word.encode("utf-8")]
        for spelled in ([byte_symbol[ord(" ")]] + symbols, symbols):
            current = spelled[0]
            for nxt in spelled[1:]:
                if (current, nxt) not in merges:
                    merges.append((current, nxt))
                current += nxt
                encoder.setdefault(current, len(encoder))
    root.mkdir(parents=True, exist_ok=True)
    (root / "encoder.json").write_text(json.dumps(encoder, ensure_ascii=False),
                                       encoding="utf-8")
    (root / "vocab.bpe").write_text("#version: 0.2\n" + "".join(f"{a} {b}\n" for a, b in merges),
                                    encoding="utf-8")
    ids = list(range(len(encoder)))
    random.Random(seed).shuffle(ids)
    (root / "dict.txt").write_text("".join(f"{i} {1000 - n}\n" for n, i in enumerate(ids)))
    return root


def sentence(rng, lo=3, hi=9):
    words = [rng.choice(WORDS) for _ in range(rng.randint(lo, hi))]
    return " ".join(words).capitalize() + rng.choice([".", "!", " ?", ""])


def write_glue(root, seed=0):
    """RTE, STS-B, CoLA and MNLI folders in the GLUE download layout (headers, columns)."""
    rng = random.Random(seed)
    rte, stsb, cola, mnli = root / "RTE", root / "STS-B", root / "CoLA", root / "MNLI"
    for folder in (rte, stsb, cola, mnli):
        folder.mkdir(parents=True)
    data = {"RTE": {}, "STS-B": {}, "CoLA": {}, "MNLI": {}}
    for split, n in ROWS.items():
        test = split == "test"
        # CoLA: one sentence; no header in train/dev: source, label, annotation, sentence
        rows = [(sentence(rng), str(i % 2)) for i in range(n + 8)]  # CoLA's batch is 16
        data["CoLA"][split] = rows
        (cola / f"{split}.tsv").write_text("\n".join(
            (["index\tsentence"] + [f"{i}\t{s}" for i, (s, _) in enumerate(rows)]) if test
            else [f"gj04\t{lab}\t{'' if lab == '1' else '*'}\t{s}" for s, lab in rows]) + "\n",
            encoding="utf-8")
        rows = []
        for i in range(n):
            s1, s2 = sentence(rng), sentence(rng)
            label = "entailment" if i % 2 else "not_entailment"
            rows.append((s1, s2, label))
        data["RTE"][split] = rows
        header = "index\tsentence1\tsentence2" + ("" if test else "\tlabel")
        (rte / f"{split}.tsv").write_text("\n".join(
            [header] + [f"{i}\t{s1}\t{s2}" + ("" if test else f"\t{lab}")
                        for i, (s1, s2, lab) in enumerate(rows)]) + "\n", encoding="utf-8")
        rows = []
        for i in range(n + 8):  # STS-B's batch is 16
            s1, s2 = sentence(rng), sentence(rng)
            rows.append((s1, s2, f"{rng.uniform(0, 5):.3f}"))
        data["STS-B"][split] = rows
        header = ("index\tgenre\tfilename\tyear\told_index\tsource1\tsource2\tsentence1\t"
                  "sentence2" + ("" if test else "\tscore"))
        (stsb / f"{split}.tsv").write_text("\n".join(
            [header] + [f"{i}\tmain-captions\tMSRvid\t2012test\t{i:04d}\tnone\tnone\t{s1}\t{s2}"
                        + ("" if test else f"\t{score}")
                        for i, (s1, s2, score) in enumerate(rows)]) + "\n", encoding="utf-8")
        # MNLI: two dev and test sets; text in columns 9, 10; gold label in 12 (train) or
        # 16 (dev: after label1..label5); test without labels
        for name in {"train": ["train"], "dev": ["dev_matched", "dev_mismatched"],
                     "test": ["test_matched", "test_mismatched"]}[split]:
            rows = [(sentence(rng), sentence(rng), MNLI_LABELS[i % 3]) for i in range(n + 8)]
            data["MNLI"][name] = rows
            lines = []
            for i, (s1, s2, lab) in enumerate(rows):
                fields = [str(i), "31193", f"{i}n", "fiction", f"( {s1} )", f"( {s2} )",
                          f"(ROOT {s1})", f"(ROOT {s2})", s1, s2]
                fields += [] if test else [lab] * (1 if split == "train" else 5) + [lab]
                lines.append("\t".join(fields))
            header = "\t".join(["index", "promptID", "pairID", "genre", "s1_bp", "s2_bp",
                                "s1_p", "s2_p", "sentence1", "sentence2"][:10]
                               + ([] if test else ["label1"] * (1 if split == "train" else 5)
                                  + ["gold_label"]))
            (mnli / f"{name}.tsv").write_text("\n".join([header] + lines) + "\n",
                                             encoding="utf-8")
    return data


@pytest.fixture(scope="module")
def glue(tmp_path_factory):
    """BPE files, GLUE folders, their prepared data-bins and the tiny RoBERTa."""
    root = tmp_path_factory.mktemp("glue")
    bpe = write_gpt2_bpe(root / "gpt2_bpe", WORDS)
    data = write_glue(root / "glue_data")
    log = run([sys.executable, "-m", "rdrop_fairseq.recipes.prepare_glue", "rte", "STS-B", "CoLA",
               "mnli", "--glue-dir", root / "glue_data", "--out", root / "bin",
               "--bpe-dir", bpe]).stdout
    # roberta.large stand-in: a masked-LM RoBERTa trained one update on RTE's text with the
    # same dict.txt, saved by fairseq-train; the folder holds model.pt + dict.txt as the
    # roberta.large archive does. With the plugin loaded: under NumPy 2, fairseq's masked-LM
    # data path (TokenBlockDataset, break mode eos) runs with its repair (numpy_compat)
    pretrain = root / "pretrain"
    run([BIN / "fairseq-train", root / "bin" / "RTE-bin" / "input0", "--task", "masked_lm",
         "--user-dir", Path(rdrop_fairseq.__file__).parent,
         "--criterion", "masked_lm", "--arch", "roberta_base",
         *[f"--{k.replace('_', '-')}={v}" for k, v in TINY.items()],
         "--max-positions", "512", "--tokens-per-sample", "512", "--sample-break-mode", "eos",
         "--batch-size", "4", "--optimizer", "adam", "--lr", "1e-4", "--max-update", "1", "--cpu",
         "--disable-validation", "--num-workers", "0", "--save-dir", pretrain,
         "--no-epoch-checkpoints", "--seed", "1"])
    roberta = root / "roberta.large"
    roberta.mkdir()
    shutil.copy(pretrain / "checkpoint_last.pt", roberta / "model.pt")
    shutil.copy(bpe / "dict.txt", roberta / "dict.txt")
    return {"root": root, "bpe": bpe, "data": data, "log": log, "glue_dir": root / "glue_data",
            "bin": root / "bin", "roberta": roberta / "model.pt"}


# ------------------------------------------------------------------ prepare


def test_prepare_writes_fairseqs_sentence_prediction_layout(glue):
    from fairseq.data import Dictionary, data_utils
    from fairseq.data.encoders.gpt2_bpe_utils import get_encoder

    rte, stsb = glue["bin"] / "RTE-bin", glue["bin"] / "STS-B-bin"
    for key in ("input0", "input1"):
        for split in ("train", "valid", "test"):
            assert (rte / key / f"{split}.bin").is_file()
            assert (stsb / key / f"{split}.idx").is_file()
        # --srcdict: the RoBERTa dictionary as it is, not one built from the data
        assert ((rte / key / "dict.txt").read_text().splitlines()
                == (glue["bpe"] / "dict.txt").read_text().splitlines())
    # the binarized text decodes back to the TSV's column (BPE ids -> dict -> BPE decode)
    bpe = get_encoder(glue["bpe"] / "encoder.json", glue["bpe"] / "vocab.bpe")
    vocab = Dictionary.load(str(rte / "input1" / "dict.txt"))
    dataset = data_utils.load_indexed_dataset(str(rte / "input1" / "valid"), vocab)
    decoded = [bpe.decode([int(t) for t in vocab.string(dataset[i]).split()])
               for i in range(len(dataset))]
    assert decoded == [s2 for _, s2, _ in glue["data"]["RTE"]["dev"]]
    assert "are not in" not in glue["log"]  # every BPE id is in dict.txt (no <unk>)
    # labels: a label dictionary built from train, the dev labels binarized with it
    labels = Dictionary.load(str(rte / "label" / "dict.txt"))
    assert {labels[i] for i in range(labels.nspecial, len(labels))
            if not labels[i].startswith("madeupword")} == {"entailment", "not_entailment"}
    dataset = data_utils.load_indexed_dataset(str(rte / "label" / "valid"), labels)
    assert [labels.string(dataset[i]) for i in range(len(dataset))] == [
        lab for _, _, lab in glue["data"]["RTE"]["dev"]]
    # STS-B: no label dictionary; the scores as text, divided by 5 as fairseq's script does
    assert not (stsb / "label" / "dict.txt").exists()
    for split, name in (("train", "train"), ("dev", "valid")):
        values = [float(v) for v in (stsb / "label" / f"{name}.label").read_text().split()]
        assert values == pytest.approx([float(s) / 5 for _, _, s in glue["data"]["STS-B"][split]],
                                       abs=1e-6)
    assert "RTE: train 24, dev 8, test 4 rows" in glue["log"]
    # CoLA: one input, no header in train/dev (every row kept), labels 0/1
    cola = glue["bin"] / "CoLA-bin"
    assert (cola / "input0" / "valid.bin").is_file() and not (cola / "input1").exists()
    assert "CoLA: train 32, dev 16, test 12 rows" in glue["log"]
    # MNLI: valid = dev_matched, valid1 = dev_mismatched, test/test1; three labels
    mnli = glue["bin"] / "MNLI-bin"
    for name in ("train", "valid", "valid1", "test", "test1"):
        assert (mnli / "input1" / f"{name}.bin").is_file(), name
    labels = Dictionary.load(str(mnli / "label" / "dict.txt"))
    for name, split in (("valid", "dev_matched"), ("valid1", "dev_mismatched")):
        dataset = data_utils.load_indexed_dataset(str(mnli / "label" / name), labels)
        assert [labels.string(dataset[i]) for i in range(len(dataset))] == [
            lab for _, _, lab in glue["data"]["MNLI"][split]]
    assert (cola / "processed" / "dev.raw.input0").read_text().splitlines() == [
        s for s, _ in glue["data"]["CoLA"]["dev"]]


def write_tsv(path, rows):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join("\t".join(r) + "\n" for r in rows), encoding="utf-8")


def test_prepare_reads_each_glue_layout(tmp_path):
    # CoLA: train/dev without header, sentence in column 4, label in 2; test with header
    write_tsv(tmp_path / "CoLA" / "train.tsv", [("gj04", "1", "", "The dog runs."),
                                                ("gj04", "0", "*", "Dog the runs.")])
    assert prepare_glue.read_split("CoLA", tmp_path / "CoLA", "train") == [
        (("The dog runs.",), "1"), (("Dog the runs.",), "0")]
    write_tsv(tmp_path / "CoLA" / "test.tsv", [("index", "sentence"), ("0", "A cat.")])
    assert prepare_glue.read_split("CoLA", tmp_path / "CoLA", "test") == [(("A cat.",), None)]
    # SST-2: header; a stray carriage return inside the text is kept, one at the end not
    write_tsv(tmp_path / "SST-2" / "dev.tsv", [("sentence", "label"), ("good \rfilm ", "1\r")])
    assert prepare_glue.read_split("SST-2", tmp_path / "SST-2", "dev") == [
        (("good \rfilm ",), "1")]
    # MNLI: dev files keep the gold label in column 16, train in 12
    row = [str(i) for i in range(1, 17)]
    write_tsv(tmp_path / "MNLI" / "dev_matched.tsv", [row, row])
    write_tsv(tmp_path / "MNLI" / "train.tsv", [row[:12], row[:12]])
    assert prepare_glue.read_split("MNLI", tmp_path / "MNLI", "dev_matched") == [
        (("9", "10"), "16")]
    assert prepare_glue.read_split("MNLI", tmp_path / "MNLI", "train") == [(("9", "10"), "12")]
    assert prepare_glue.TASKS["MNLI"].dev_splits == ("dev_matched", "dev_mismatched")
    # QQP: rows without exactly 6 fields are dropped, as fairseq's script does
    write_tsv(tmp_path / "QQP" / "train.tsv", [
        ("id", "qid1", "qid2", "question1", "question2", "is_duplicate"),
        ("1", "1", "2", "Why?", "How?", "0"), ("2", "3", "4", "broken"),
        ("3", "5", "6", "Who?", "What?", "1", "extra")])
    assert prepare_glue.read_split("QQP", tmp_path / "QQP", "train") == [(("Why?", "How?"), "0")]
    # errors name the file (and line)
    with pytest.raises(prepare_glue.GlueDataError, match=r"RTE.dev\.tsv does not exist"):
        prepare_glue.read_split("RTE", tmp_path / "RTE", "dev")
    write_tsv(tmp_path / "RTE" / "train.tsv", [("index", "s1", "s2", "label"), ("0", "a b")])
    with pytest.raises(prepare_glue.GlueDataError, match=r"train\.tsv:2: 2 tab-separated "
                                                        r"fields, RTE needs 4"):
        prepare_glue.read_split("RTE", tmp_path / "RTE", "train")
    with pytest.raises(prepare_glue.GlueDataError, match="no QNLI/train.tsv in"):
        prepare_glue.task_dir(tmp_path, "QNLI")
    assert prepare_glue.task_dir(tmp_path / "RTE", "RTE") == tmp_path / "RTE"  # the task folder
    with pytest.raises(prepare_glue.GlueDataError, match="no QNLI/train.tsv in"):
        prepare_glue.task_dir(tmp_path / "RTE", "QNLI")  # not another task's folder
    with pytest.raises(prepare_glue.GlueDataError, match="unknown GLUE task 'WNLI'; the tasks"):
        prepare_glue.task_name("WNLI")
    assert prepare_glue.task_name("sts-b") == "STS-B"


def test_prepare_command_line_errors(glue, tmp_path, capsys):
    base = ["--glue-dir", str(glue["glue_dir"]), "--out", str(tmp_path)]
    for argv, message in [
        (["WNLI", *base, "--bpe-dir", str(glue["bpe"])], "unknown GLUE task 'WNLI'"),
        (["RTE", *base], "--encoder-json (or --bpe-dir) is required"),
        (["RTE", *base, "--bpe-dir", str(tmp_path)], "encoder.json does not exist"),
        (["RTE", "--out", str(tmp_path), "--bpe-dir", str(glue["bpe"])],
         "--glue-dir (or $GLUE_DIR) is required"),
    ]:
        with pytest.raises(SystemExit):
            prepare_glue.parse_args(argv)
        assert message in capsys.readouterr().err, argv
    with pytest.raises(SystemExit, match="no QNLI/train.tsv in"):  # checked before any work
        prepare_glue.main(["RTE", "QNLI", *base, "--bpe-dir", str(glue["bpe"])])
    assert list(tmp_path.iterdir()) == []


def test_evaluate_command_line_errors(glue, tmp_path, capsys):
    ckpt = tmp_path / "checkpoint_best.pt"
    ckpt.write_bytes(b"")
    base = ["--data", str(glue["bin"] / "RTE-bin"), "--glue-dir", str(glue["glue_dir"])]
    for argv, message in [
        (["WNLI", "--checkpoint", str(ckpt), *base], "unknown GLUE task 'WNLI'"),
        (["RTE", "--checkpoint", str(tmp_path / "none.pt"), *base],
         "none.pt not found: train first: TASK=RTE bash scripts/glue.sh train"),
        (["RTE", "--checkpoint", str(ckpt), *base], "--encoder-json (or --bpe-dir) is required"),
        (["RTE", "--checkpoint", str(ckpt), *base, "--bpe-dir", str(tmp_path)],
         "encoder.json does not exist"),
        (["RTE", "--checkpoint", str(ckpt), "--data", str(tmp_path), "--glue-dir",
          str(glue["glue_dir"])], "input0/dict.txt not found: run: TASK=RTE bash scripts/glue.sh "
                                 "prepare"),
        (["RTE", "--checkpoint", str(ckpt), *base, "--bpe-dir", str(glue["bpe"]), "--split",
          "test"], "--split test: GLUE's test files have no labels"),
    ]:
        with pytest.raises(SystemExit):
            evaluate_glue.parse_args(argv)
        assert message in capsys.readouterr().err, argv


# ------------------------------------------------------------------ fine-tune + evaluate


def train(glue, task, save_dir, **env):
    return script("glue", "train", *[f"model.{k}={v}" for k, v in TINY.items()], *FAST,
                  TASK=task, GPUS=0, DATA_DIR=glue["bin"], SAVE_DIR=save_dir,
                  ROBERTA_DIR=glue["roberta"].parent, **env).stdout


def stats(log, kind):
    """``[{key: value}]`` of fairseq's simple-format ``kind`` lines (train_inner, valid)."""
    out = []
    for line in log.splitlines():
        if kind == "train_inner" and "[train_inner]" in line:
            out.append(dict(re.findall(r"(\w+)=([^,\s]+)", line)))
        elif kind == "valid" and "| valid on 'valid' subset" in line:
            out.append(dict(re.findall(r"\| (\w+) ([^|\s]+)", line)))
    return out


@pytest.mark.parametrize("task,consistency,metric", [
    ("RTE", "rdrop_kl", "accuracy"), ("STS-B", "rdrop_mse", "pearson"),
    ("CoLA", "rdrop_kl", "mcc"), ("MNLI", "rdrop_kl", "accuracy")])
def test_finetune_with_rdrop_then_evaluate(glue, tmp_path, task, consistency, metric):
    save = tmp_path / "ckpt"
    log = train(glue, task, save, MAX_UPDATE=3)
    assert "criterion: SentencePredictionRDropCriterion" in log
    assert f"Loaded checkpoint {glue['roberta']}" in log  # restored the RoBERTa stand-in
    inner = stats(log, "train_inner")
    assert len(inner) == 3, log[-3000:]
    for line in inner:  # the R-Drop term is logged, positive (dropout 0.1 is on)
        value = float(line[consistency])
        assert math.isfinite(value) and value > 0, line
    valid = stats(log, "valid")
    assert valid and not any(consistency in v for v in valid), log[-3000:]
    assert all(metric in v for v in valid), valid
    # checkpoint_best.pt's validation score as fairseq computed it (on the data-bin)
    best = float(re.findall(r"Saved checkpoint \S+checkpoint_best\.pt .*score ([-\d.]+)",
                            log)[-1])

    out = script("glue", "evaluate", "--batch-size", "3", "--json", tmp_path / "m.json",
                 TASK=task.lower(), GPUS=0, DATA_DIR=glue["bin"], SAVE_DIR=save,
                 GLUE_DIR=glue["glue_dir"], BPE_DIR=glue["bpe"])
    results = json.loads((tmp_path / "m.json").read_text())["metrics"]
    dev_splits = prepare_glue.TASKS[task].dev_splits  # MNLI: matched and mismatched
    assert list(results) == list(dev_splits)
    names = evaluate_glue.METRICS[task]
    for split, result in results.items():
        assert result["examples"] == len(glue["data"][task][split])
        assert set(result) == {*names, "examples"}
        for name in names:
            assert re.search(rf"^{task} {split}: .*{name} {result[name]:.2f}", out.stdout, re.M)
            low = -100 if name in ("pearson", "spearman", "mcc") else 0
            assert low <= result[name] <= 100, result
    # the hub interface on the raw TSV agrees with fairseq's validation on the data-bin
    # (its first validation set: MNLI matched)
    assert results[dev_splits[0]][metric] == pytest.approx(best, abs=0.051)
    assert "batch" in out.stderr  # the tqdm progress bar
    if task == "MNLI":  # both dev sets validated during training (valid1: mismatched)
        assert "valid on 'valid1' subset" in log


def test_baseline_mode_is_fairseqs_sentence_prediction(glue, tmp_path):
    log = train(glue, "RTE", tmp_path / "ckpt", MODE="baseline", MAX_UPDATE=2)
    assert "criterion.rdrop_alpha=0 " in log and "R-Drop is off" in log
    inner = stats(log, "train_inner")
    assert len(inner) == 2 and all("rdrop_kl" not in line and "loss" in line for line in inner)
    assert (tmp_path / "ckpt" / "checkpoint_best.pt").is_file()
    # --split scores other labelled files in the dev layout: here a copy of dev.tsv
    folder = tmp_path / "RTE"
    shutil.copytree(glue["glue_dir"] / "RTE", folder)
    shutil.copy(folder / "dev.tsv", folder / "heldout.tsv")
    run([sys.executable, "-m", "rdrop_fairseq.recipes.evaluate_glue", "RTE", "--cpu",
         "--checkpoint", tmp_path / "ckpt" / "checkpoint_best.pt", "--data",
         glue["bin"] / "RTE-bin", "--glue-dir", folder, "--bpe-dir", glue["bpe"],
         "--split", "heldout", "--split", "dev", "--json", tmp_path / "m.json"])
    results = json.loads((tmp_path / "m.json").read_text())["metrics"]
    assert list(results) == ["heldout", "dev"] and results["heldout"] == results["dev"]
    assert results["dev"]["examples"] == len(glue["data"]["RTE"]["dev"])


# ------------------------------------------------------------------ the paper's settings

# Liang et al., "R-Drop: Regularized Dropout for Neural Networks", NeurIPS 2021, appendix
# table 1 (the GLUE hyper-parameters), copied from the paper: rdrop_fairseq/recipes/
# glue_tasks.tsv, which both GLUE scripts read, must say the same
PAPER_TABLE = {
    #         max update, batch (sentences), alpha
    "CoLA": (5336, 16, 0.5),
    "MRPC": (2296, 16, 1.0),
    "RTE": (3120, 8, 1.0),
    "SST-2": (20935, 32, 1.0),
    "MNLI": (123873, 32, 0.5),
    "QNLI": (33112, 32, 1.0),
    "QQP": (113272, 32, 0.5),
    "STS-B": (3598, 16, 1.0),
}


def test_the_settings_table_is_the_papers():
    rows = [line.split("\t") for line in (REPO / "rdrop_fairseq" / "recipes" / "glue_tasks.tsv")
            .read_text().splitlines() if line and not line.startswith("#")]
    assert rows[0][:4] == ["task", "max_update", "batch", "alpha"]
    assert {r[0]: (int(r[1]), int(r[2]), float(r[3])) for r in rows[1:]} == PAPER_TABLE


def test_task_table_is_the_papers(tmp_path):
    o = {task: overrides_of(command(tmp_path, task)) for task in PAPER_TABLE}
    assert {t: (int(x["optimization.max_update"]), int(x["dataset.batch_size"]),
                float(x["criterion.rdrop_alpha"])) for t, x in o.items()} == PAPER_TABLE
    assert set(prepare_glue.TASKS) == set(PAPER_TABLE) == set(evaluate_glue.METRICS)
    assert {t: int(x["task.num_classes"]) for t, x in o.items()} == {
        **{t: 2 for t in PAPER_TABLE}, "MNLI": 3, "STS-B": 1}
    # checkpoint selection by what the paper reports
    assert {t: x["checkpoint.best_checkpoint_metric"] for t, x in o.items()} == {
        **{t: "accuracy" for t in PAPER_TABLE}, "CoLA": "mcc", "STS-B": "pearson"}
    assert [t for t, s in prepare_glue.TASKS.items() if s.regression] == ["STS-B"]
    # warmup: 6% of the updates (fairseq's GLUE configs: CoLA 320, QNLI 1986, MNLI 7432)
    assert [o[t]["lr_scheduler.warmup_updates"] for t in ("CoLA", "QNLI", "MNLI")] == [
        "320", "1986", "7432"]


def command(tmp_path, task, *overrides, **env):
    """The fairseq-hydra-train command scripts/glue.sh runs (DRY_RUN: no training)."""
    (tmp_path / f"{task}-bin" / "input0").mkdir(parents=True, exist_ok=True)
    (tmp_path / f"{task}-bin" / "input0" / "dict.txt").write_text("")
    (tmp_path / "roberta").mkdir(exist_ok=True)
    (tmp_path / "roberta" / "model.pt").write_bytes(b"")
    env = {"TASK": task, "GPUS": 0, "DATA_DIR": tmp_path, "SAVE_DIR": tmp_path / "s",
           "ROBERTA_DIR": tmp_path / "roberta", **env}
    return dry_run("glue", "train", *overrides, **env)[0][-1]


def test_config_holds_the_papers_common_settings(tmp_path):
    cmd = command(tmp_path, "RTE")
    cfg = composed_config(CONFIG, [PRETRAINED] + [o for o in cmd if o.startswith((
        "task.num_classes", "criterion.", "dataset.batch_size", "optimization.max_update",
        "lr_scheduler.warmup_updates"))])
    assert (cfg.task._name, cfg.task.init_token, cfg.task.separator_token,
            cfg.task.max_positions) == ("sentence_prediction", 0, 2, 512)
    assert (cfg.optimizer._name, cfg.optimizer.adam_eps, cfg.optimizer.weight_decay) == (
        "adam", 1e-6, 0.01)
    assert eval(cfg.optimizer.adam_betas) == (0.9, 0.98)
    assert (cfg.optimization.lr, cfg.optimization.clip_norm) == ([1e-5], 0.0)
    assert (cfg.model._name, cfg.model.dropout, cfg.model.attention_dropout) == (
        "roberta_large", 0.1, 0.1)
    assert cfg.lr_scheduler._name == "polynomial_decay"
    assert cfg.lr_scheduler.total_num_update == cfg.optimization.max_update == 3120
    assert (cfg.lr_scheduler.warmup_updates, cfg.dataset.batch_size) == (187, 8)
    assert (cfg.criterion._name, cfg.criterion.rdrop_alpha) == ("sentence_prediction_rdrop", 1.0)
    assert (cfg.checkpoint.reset_optimizer, cfg.checkpoint.reset_dataloader,
            cfg.checkpoint.reset_meters) == (True, True, True)
    assert cfg.checkpoint.restore_file == "/nonexistent.pt"
    # every task's overrides compose (hydra syntax), e.g. MNLI's two validation sets
    for task in PAPER_TABLE:
        cfg = composed_config(CONFIG, [PRETRAINED] + [
            o for o in command(tmp_path, task, UPDATE_FREQ=2)
            if o.split("=")[0].split(".")[0] in ("task", "criterion", "dataset", "optimization",
                                                  "lr_scheduler", "checkpoint")
            and not o.startswith(("task.data", "checkpoint.restore_file"))])
        assert cfg.optimization.update_freq == [2]
        assert cfg.criterion.regression_target == (task == "STS-B")
    assert cfg.checkpoint.best_checkpoint_metric == "pearson"  # STS-B, the last
    cfg = composed_config(CONFIG, [PRETRAINED] + [o for o in command(tmp_path, "MNLI")
                                                  if o.startswith("dataset.valid_subset")])
    assert cfg.dataset.valid_subset == "valid,valid1"


def test_config_architecture_is_fairseqs_roberta_large():
    """The config spells roberta_large out; with fairseq's arch function applied (as
    build_model does) nothing changes."""
    import argparse

    from fairseq.models import ARCH_CONFIG_REGISTRY
    from omegaconf import OmegaConf

    cfg = composed_config(CONFIG, [PRETRAINED])
    model = OmegaConf.to_container(cfg.model, resolve=True)
    reference = argparse.Namespace()
    ARCH_CONFIG_REGISTRY["roberta_large"](reference)
    assert {k: model[k] for k in TINY} == {k: getattr(reference, k) for k in TINY} == {
        "encoder_layers": 24, "encoder_embed_dim": 1024, "encoder_ffn_embed_dim": 4096,
        "encoder_attention_heads": 16}
    assert model["dropout"] == reference.dropout and model["attention_dropout"] == 0.1


def test_train_fills_in_each_tasks_settings(tmp_path):
    for task, (max_update, batch, alpha) in PAPER_TABLE.items():
        o = overrides_of(command(tmp_path, task))
        assert (o["optimization.max_update"], o["dataset.batch_size"],
                o["criterion.rdrop_alpha"]) == (str(max_update), str(batch), str(alpha)), task
        assert o["lr_scheduler.warmup_updates"] == str(int(0.06 * max_update))
    o = overrides_of(command(tmp_path, "STS-B"))
    assert (o["criterion.regression_target"], o["checkpoint.best_checkpoint_metric"],
            o["criterion.report_pearson_and_spearman"]) == ("true", "pearson", "true")
    o = overrides_of(command(tmp_path, "cola"))
    assert (o["checkpoint.best_checkpoint_metric"], o["criterion.report_mcc"]) == ("mcc", "true")
    assert overrides_of(command(tmp_path, "MRPC"))["criterion.report_acc_and_f1"] == "true"
    assert overrides_of(command(tmp_path, "MNLI"))["dataset.valid_subset"] == "'valid,valid1'"
    # options: alpha, seed, shorter runs (warmup stays 6%), update-freq splits the batch
    o = overrides_of(command(tmp_path, "QNLI", "common.fp16=true", ALPHA=0.3, SEED=4,
                             MAX_UPDATE=1000, UPDATE_FREQ=4))
    assert (o["criterion.rdrop_alpha"], o["common.seed"], o["optimization.max_update"],
            o["lr_scheduler.warmup_updates"], o["dataset.batch_size"],
            o["optimization.update_freq"], o["common.fp16"]) == (
        "0.3", "4", "1000", "60", "8", "[4]", "true")
    cmd = command(tmp_path, "RTE", MODE="baseline")
    assert overrides_of(cmd)["criterion.rdrop_alpha"] == "0"


def test_train_validates_its_input(tmp_path):
    for env, message in [
        ({"TASK": "WNLI"}, "TASK must be one of CoLA, MRPC"),
        ({"MODE": "kl"}, "MODE must be rdrop, baseline, no-kl or doubled-batch, not 'kl'"),
        ({"MODE": "baseline", "ALPHA": "1"}, "ALPHA=1 contradicts MODE=baseline"),
        ({"UPDATE_FREQ": "3"}, "UPDATE_FREQ=3 does not divide RTE's batch of 8"),
        ({"DATA_DIR": tmp_path / "none"}, "none/RTE-bin/input0/dict.txt not found: run: "
                                          "TASK=RTE bash scripts/glue.sh prepare"),
        ({"ROBERTA_DIR": tmp_path / "none"}, "model.pt not found: ROBERTA_DIR must hold"),
    ]:
        command(tmp_path, "RTE")  # the stand-ins
        proc = script("glue", "train", ok=False, **{
            "TASK": "RTE", "GPUS": 0, "DATA_DIR": tmp_path, "SAVE_DIR": tmp_path / "s",
            "ROBERTA_DIR": tmp_path / "roberta", **env})
        assert proc.returncode != 0 and message in proc.stderr, (env, proc.stderr)


def test_train_from_scratch_or_a_run_to_resume_needs_no_checkpoint(tmp_path):
    o = overrides_of(command(tmp_path, "SST-2", FROM_SCRATCH=1, ROBERTA_DIR=tmp_path / "none"))
    # fairseq's default restore: SAVE_DIR/checkpoint_last.pt when it exists (a resumed run,
    # nothing reset), else a random initialisation
    assert [o[f"checkpoint.{k}"] for k in ("restore_file", "reset_optimizer",
                                           "reset_dataloader", "reset_meters")] == [
        "checkpoint_last.pt", "false", "false", "false"]
    assert o["task.num_classes"] == "2" and o["criterion.rdrop_alpha"] == "1.0"
    (tmp_path / "s").mkdir()
    (tmp_path / "s" / "checkpoint_last.pt").write_bytes(b"")
    o = overrides_of(command(tmp_path, "SST-2", ROBERTA_DIR=tmp_path / "none"))
    assert o["checkpoint.restore_file"] == "checkpoint_last.pt"


# ------------------------------------------------------------------ metrics


def test_metrics_agree_with_hand_computed_values():
    gold = ["1", "1", "1", "0", "0", "1"]
    pred = ["1", "0", "1", "0", "1", "1"]
    # TP 3, FP 1, FN 1, TN 1
    assert evaluate_glue.accuracy(pred, gold) == pytest.approx(100 * 4 / 6)
    assert evaluate_glue.f1(pred, gold) == pytest.approx(100 * 2 * 3 / (2 * 3 + 1 + 1))
    mcc = (3 * 1 - 1 * 1) / math.sqrt((3 + 1) * (3 + 1) * (1 + 1) * (1 + 1))
    assert evaluate_glue.mcc(pred, gold) == pytest.approx(100 * mcc)
    assert evaluate_glue.task_metrics("MRPC", pred, gold) == pytest.approx(
        {"f1": 75.0, "accuracy": 100 * 4 / 6})
    assert evaluate_glue.task_metrics("CoLA", pred, gold) == pytest.approx({"mcc": 25.0})
    x, y = [1.0, 2.0, 3.0, 4.0], [1.0, 3.0, 2.0, 5.0]
    # Pearson by hand: means 2.5, 2.75; cov sum 5.5; sqrt(5 * 8.75)
    assert evaluate_glue.pearson(x, y) == pytest.approx(100 * 5.5 / math.sqrt(5 * 8.75))
    # Spearman: ranks of y are 1 3 2 4: 1 - 6 * 2 / (4 * 15)
    assert evaluate_glue.spearman(x, y) == pytest.approx(100 * (1 - 6 * 2 / 60))
    assert set(evaluate_glue.task_metrics("STS-B", x, y)) == {"pearson", "spearman"}
    assert evaluate_glue.task_metrics("MNLI", ["a", "b"], ["a", "c"]) == {"accuracy": 50.0}
    with pytest.raises(ValueError):
        evaluate_glue.task_metrics("RTE", ["a"], ["a", "b"])


# ------------------------------------------------------------------ AttendOut modes


def test_attendout_modes_use_fairseqs_roberta_base_settings():
    """MODE=attendout: the AttendOut config on roberta.base with fairseq's per-task lr,
    batch and updates (its GLUE table), length 256, no KL; attendout_rdrop adds the KL with
    the R-Drop paper's alpha; evaluate exports the attacker first."""
    commands, proc = dry_run("glue", "all", TASK="RTE", GPUS=1, MODE="attendout")
    train_cmd = next(c for c in commands if c[0].endswith("fairseq-hydra-train"))
    o = overrides_of(train_cmd)
    assert train_cmd[train_cmd.index("--config-name") + 1] == "roberta_glue_attendout"
    assert o["optimization.max_update"] == "2036" and o["dataset.batch_size"] == "16"
    assert o["optimization.lr"] == "[2e-05]" and o["criterion.rdrop_alpha"] == "0"
    assert o["checkpoint.restore_file"].endswith("work/roberta.base/model.pt")
    assert o["common.fp16"] == "true"
    assert "/glue.RTE.attendout.seed1" in o["checkpoint.save_dir"]
    modules = [c[2] for c in commands if len(c) > 2 and c[1] == "-m"]
    assert modules[-2:] == ["rdrop_fairseq.recipes.export_attendout",
                            "rdrop_fairseq.recipes.evaluate_glue"]
    evaluate = commands[-1]
    assert evaluate[evaluate.index("--checkpoint") + 1].endswith("exported.pt")
    o = overrides_of(dry_run("glue", "train", TASK="CoLA", GPUS=1,
                             MODE="attendout_rdrop")[0][-1])
    assert o["criterion.rdrop_alpha"] == "0.5" and o["optimization.lr"] == "[1e-05]"
    config = composed_config("roberta_glue_attendout", [PRETRAINED])
    assert config["task"]["_name"] == "sentence_prediction_attendout"
    assert config["task"]["max_positions"] == 256 and config["task"]["shorten_method"] == "truncate"
    assert config["task"]["attendout_interval"] == 25
    assert config["task"]["attendout_generator_lr"] == 5e-05
    assert config["model"]["_name"] == "roberta_attendout_base"
    assert config["model"]["encoder_layers"] == 12 and config["optimizer"]["weight_decay"] == 0.1
    assert config["task"]["attendout_target_layers"] == 0  # no budget unless asked for
    # TARGET_LAYERS: the budget, validated from its deadline (40 % of RTE's 2036) on
    o = overrides_of(dry_run("glue", "train", TASK="RTE", GPUS=1, MODE="attendout",
                             TARGET_LAYERS=10)[0][-1])
    assert o["task.attendout_target_layers"] == "10"
    assert o["task.attendout_price_step"] == "0.03"  # 12 layers: the slower rise
    assert o["dataset.validate_after_updates"] == str(2036 * 2 // 5)


def test_target_layers_without_attendout_is_refused():
    proc = dry_run("glue", "train", TASK="RTE", GPUS=1, MODE="rdrop", TARGET_LAYERS=2,
                   ok=False)[1]
    assert proc.returncode != 0 and "TARGET_LAYERS is AttendOut's budget" in proc.stderr


def test_attendout_mode_trains_exports_and_evaluates(glue, tmp_path):
    save = tmp_path / "ckpt"
    log = train(glue, "RTE", save, MODE="attendout", MAX_UPDATE=4)
    assert "task: SentencePredictionAttendOutTask" in log
    assert f"Loaded checkpoint {glue['roberta']}" in log
    assert "keeping the first 258 of 514 position embeddings" in log
    inner = stats(log, "train_inner")
    assert len(inner) == 4 and all("defender_loss" in line for line in inner)
    assert all("attendout_num_pruned" in v and "accuracy_unpruned" in v
               for v in stats(log, "valid"))
    out = script("glue", "evaluate", "--batch-size", "3", "--json", tmp_path / "m.json",
                 TASK="rte", GPUS=0, DATA_DIR=glue["bin"], SAVE_DIR=save, MODE="attendout",
                 GLUE_DIR=glue["glue_dir"], BPE_DIR=glue["bpe"])
    assert "layers pruned" in out.stdout and (save / "exported.pt").is_file()
    results = json.loads((tmp_path / "m.json").read_text())["metrics"]
    assert results["dev"]["examples"] == len(glue["data"]["RTE"]["dev"])
