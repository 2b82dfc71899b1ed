"""End-to-end tests of the plugin through fairseq's real command-line tools.

Every test runs ``fairseq-preprocess``/``-train``/``-generate``/``-eval-lm``/``-hydra-train``
(from the environment that runs pytest) on tiny generated data, with ``--user-dir $(python
-m rdrop_fairseq)``, and asserts on what the tools print and write. The tools start warm
(forked from a process that has their libraries loaded, tests/warm_process.py) unless
``run(..., warm=False)``: the "real processes" tests at the end run each tool as a real
process and check that it gives what the warm one gives; ``fairseq-hydra-train`` runs as a
real process only. Data is preprocessed once per kind and trained checkpoints are shared
(session fixtures); tiny models, ``--cpu``, a few hundred updates at most.
"""

import math
import os
import random
import re
import shutil
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.warm_process import forks_warm, run_command

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
TIMEOUT_S = 300


# --------------------------------------------------------------------------- helpers


def tool(name):
    """Path of a fairseq console script of the environment that runs pytest."""
    path = BIN / name
    assert path.exists(), f"{name} not found next to {sys.executable}"
    return str(path)


def run(cmd, cwd, timeout=TIMEOUT_S, warm=True):
    """Run a command, capture its output; ``proc.output`` is stdout + stderr. fairseq's tools
    start warm (tests/warm_process.py) unless ``warm=False``.

    One intra-op thread: on a small machine shared with other jobs, torch's default (a
    thread per core, spin-waiting) makes these tiny models train 10-100x slower. No GPU
    (CUDA_VISIBLE_DEVICES empty): the suite's commands are CPU runs, and stay so where
    CUDA is visible (fairseq's defaults follow the GPU count).
    """
    proc = run_command(cmd, cwd, tool_env(), timeout, warm=warm)
    proc.output = proc.stdout + "\n" + proc.stderr
    return proc


def tool_env():
    """The environment ``run`` gives a command."""
    return dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", MKL_NUM_THREADS="1",
                CUDA_VISIBLE_DEVICES="")


def tail(proc, chars=4000):
    """The end of a process's output, for assertion messages."""
    return (
        f"\n--- command: {' '.join(map(str, proc.args))}\n--- exit code: {proc.returncode}\n"
        f"--- stdout (tail):\n{proc.stdout[-chars:]}\n--- stderr (tail):\n{proc.stderr[-chars:]}"
    )


def check_ok(proc):
    assert proc.returncode == 0, "command failed" + tail(proc)
    return proc


# fairseq's own format ("date time | INFO | train | msg"), hydra's ("[date][train][INFO] - msg")
# and python's default ("INFO:train:msg")
_LOG_LINE = re.compile(
    r"^(?:\S+ \S+ \| \w+ \| (?P<name>[\w.]+) \| "
    r"|\[[^\]]*\]\[(?P<hname>[\w.]+)\]\[\w+\] - "
    r"|[A-Z]+:(?P<pname>[\w.]+):)(?P<msg>.*)$"
)
STATS_LOGGERS = ("train_inner", "train", "valid")


def _number(value):
    try:
        return float(value)
    except ValueError:
        return value


def parse_stats(text):
    """fairseq's simple-format statistics lines, as ``{"train": [dict, ...], ...}``.

    ``train``/``valid`` lines are ``| key value | key value |``; ``train_inner`` lines are
    ``epoch 001:  1 / 3 key=value, key=value``. Numeric values become floats.
    """
    stats = {name: [] for name in STATS_LOGGERS}
    for line in text.splitlines():
        m = _LOG_LINE.match(line.strip())
        if not m:
            continue
        name = m["name"] or m["hname"] or m["pname"]
        if name not in stats:
            continue
        if name == "train_inner":
            fields = dict(re.findall(r"(\w+)=([^,\s]+)", m["msg"]))
        else:
            fields = {}
            for part in m["msg"].split(" | "):
                key, _, value = part.strip().partition(" ")
                fields[key] = value.strip()
        stats[name].append({k: _number(v) for k, v in fields.items()})
    return stats


def parse_hypotheses(text):
    """``{sentence id: (score, hypothesis)}`` from fairseq-generate's ``H-`` lines."""
    hypos = {}
    for line in text.splitlines():
        if line.startswith("H-"):
            head, score, *hyp = line.split("\t")
            hypos[int(head[2:])] = (float(score), hyp[0] if hyp else "")
    return hypos


def parse_eval_lm(text):
    """``(loss in base 2, perplexity)`` from fairseq-eval-lm's summary line."""
    m = re.search(r"Loss \(base 2\): ([-\d.naif]+), Perplexity: ([-\d.naif]+)", text)
    assert m, "no 'Loss (base 2): ..., Perplexity: ...' line"
    return float(m[1]), float(m[2])


def positive_finite(value):
    return isinstance(value, float) and math.isfinite(value) and value > 0


def vocab_size(dict_txt):
    """Size of a fairseq dictionary: the dict.txt entries plus the 4 special symbols."""
    return len(Path(dict_txt).read_text().splitlines()) + 4


COMMON_TRAIN = ["--cpu", "--num-workers", "0", "--no-progress-bar", "--log-format", "simple",
                "--seed", "1", "--optimizer", "adam"]


# --------------------------------------------------------------------------- data


@pytest.fixture(scope="session")
def user_dir():
    """The documented one-liner: ``--user-dir $(python -m rdrop_fairseq)``."""
    proc = check_ok(run([sys.executable, "-m", "rdrop_fairseq"], cwd=REPO))
    lines = [line for line in proc.stdout.splitlines() if line.strip()]
    assert len(lines) == 1, "python -m rdrop_fairseq must print exactly one line" + tail(proc)
    path = Path(lines[0])
    assert path.is_absolute() and (path / "__init__.py").is_file(), tail(proc)
    assert path.resolve() == (REPO / "rdrop_fairseq").resolve()
    return str(path)


DE_WORDS = ["haus", "baum", "katze", "hund", "auto", "buch", "tisch", "stuhl", "fenster",
            "garten", "wasser", "brot", "milch", "apfel", "blume", "vogel", "fisch", "stadt",
            "land", "berg", "fluss", "see", "meer", "sonne", "mond", "stern", "himmel", "erde",
            "feuer", "luft", "schule", "lehrer", "kind", "mann", "frau", "freund", "zeit",
            "tag", "nacht", "jahr"]
TRANSLATION_SPLITS = {"train": 300, "valid": 30, "test": 30}


@pytest.fixture(scope="session")
def translation_data(tmp_path_factory):
    """de->en toy corpus (en = the de words reversed and upper-cased), binarized."""
    root = tmp_path_factory.mktemp("translation")
    raw = root / "raw"
    raw.mkdir()
    rng = random.Random(0)
    for split, n in TRANSLATION_SPLITS.items():
        de, en = [], []
        for _ in range(n):
            words = [rng.choice(DE_WORDS) for _ in range(rng.randint(3, 8))]
            de.append(" ".join(words))
            en.append(" ".join(w.upper() for w in reversed(words)))
        (raw / f"{split}.de").write_text("\n".join(de) + "\n")
        (raw / f"{split}.en").write_text("\n".join(en) + "\n")
    data_bin = root / "bin"
    check_ok(run([tool("fairseq-preprocess"), "--source-lang", "de", "--target-lang", "en",
                  "--trainpref", raw / "train", "--validpref", raw / "valid",
                  "--testpref", raw / "test", "--destdir", data_bin, "--joined-dictionary",
                  "--workers", "1"], cwd=root))
    assert (data_bin / "dict.de.txt").read_text() == (data_bin / "dict.en.txt").read_text()
    return data_bin


LM_DET = ["the", "a", "every", "some"]
LM_ADJ = ["big", "small", "red", "blue", "old", "young", "happy", "quiet"]
LM_NOUN = ["cat", "dog", "bird", "house", "tree", "river", "child", "teacher"]
LM_VERB = ["sees", "likes", "follows", "finds", "hears", "paints"]


@pytest.fixture(scope="session")
def lm_data(tmp_path_factory):
    """Monolingual toy corpus (det adj noun verb det adj noun), ``--only-source``."""
    root = tmp_path_factory.mktemp("lm")
    rng = random.Random(1)

    def phrase():
        return [rng.choice(LM_DET), rng.choice(LM_ADJ), rng.choice(LM_NOUN)]

    for split, n in {"train": 400, "valid": 40, "test": 40}.items():
        lines = [" ".join(phrase() + [rng.choice(LM_VERB)] + phrase()) for _ in range(n)]
        (root / f"{split}.txt").write_text("\n".join(lines) + "\n")
    data_bin = root / "bin"
    check_ok(run([tool("fairseq-preprocess"), "--only-source", "--trainpref", root / "train.txt",
                  "--validpref", root / "valid.txt", "--testpref", root / "test.txt",
                  "--destdir", data_bin, "--workers", "1"], cwd=root))
    return data_bin


SP_WORDS = ["alpha", "beta", "gamma", "delta", "eps", "zeta", "eta", "theta", "iota", "kappa"]
SP_MARKER = "marker"
SP_SPLITS = {"train": 200, "valid": 40}


def _sp_sentences(seed):
    """{split: [(words, has_marker)]} for the sentence prediction tasks."""
    rng = random.Random(seed)
    out = {}
    for split, n in SP_SPLITS.items():
        rows = []
        for _ in range(n):
            words = [rng.choice(SP_WORDS) for _ in range(rng.randint(3, 8))]
            has_marker = rng.random() < 0.5
            if has_marker:
                words.insert(rng.randrange(len(words) + 1), SP_MARKER)
            rows.append((words, has_marker))
        out[split] = rows
    return out


@pytest.fixture(scope="session")
def classification_data(tmp_path_factory):
    """Two classes (sentence contains the marker word or not), laid out as the RoBERTa GLUE
    recipe does: ``DIR/input0`` and ``DIR/label``, both binarized with ``--only-source``."""
    root = tmp_path_factory.mktemp("classification")
    raw = root / "raw"
    raw.mkdir()
    for split, rows in _sp_sentences(seed=2).items():
        (raw / f"{split}.input0").write_text("".join(" ".join(w) + "\n" for w, _ in rows))
        labels = ["pos" if has_marker else "neg" for _, has_marker in rows]
        (raw / f"{split}.label").write_text("".join(label + "\n" for label in labels))
    data_bin = root / "bin"
    for key in ("input0", "label"):
        check_ok(run([tool("fairseq-preprocess"), "--only-source",
                      "--trainpref", raw / f"train.{key}", "--validpref", raw / f"valid.{key}",
                      "--destdir", data_bin / key, "--workers", "1"], cwd=root))
    return data_bin


@pytest.fixture(scope="session")
def regression_data(tmp_path_factory):
    """Float targets (number of words / 10): binarized ``DIR/input0``, and raw
    ``DIR/label/{split}.label`` files, one float per line, no label dictionary (this is
    what fairseq's sentence_prediction task reads with --regression-target)."""
    root = tmp_path_factory.mktemp("regression")
    raw = root / "raw"
    raw.mkdir()
    data_bin = root / "bin"
    (data_bin / "label").mkdir(parents=True)
    for split, rows in _sp_sentences(seed=3).items():
        (raw / f"{split}.input0").write_text("".join(" ".join(w) + "\n" for w, _ in rows))
        (data_bin / "label" / f"{split}.label").write_text(
            "".join(f"{len(w) / 10:.2f}\n" for w, _ in rows)
        )
    check_ok(run([tool("fairseq-preprocess"), "--only-source",
                  "--trainpref", raw / "train.input0", "--validpref", raw / "valid.input0",
                  "--destdir", data_bin / "input0", "--workers", "1"], cwd=root))
    return data_bin


# --------------------------------------------------------------------------- translation

TRANSLATION_UPDATES = 240  # 6 updates an epoch: ends on an epoch boundary (epoch 40)
RESUME_UPDATES = 270
GEN_BEAM = "2"


def translation_train_cmd(data_bin, user_dir, save_dir, max_update, *extra):
    return [
        tool("fairseq-train"), data_bin, "--user-dir", user_dir, *COMMON_TRAIN,
        "--task", "translation", "--source-lang", "de", "--target-lang", "en",
        "--arch", "transformer_iwslt_de_en",
        "--encoder-layers", "1", "--decoder-layers", "1",
        "--encoder-embed-dim", "64", "--decoder-embed-dim", "64",
        "--encoder-ffn-embed-dim", "64", "--decoder-ffn-embed-dim", "64",
        "--encoder-attention-heads", "2", "--decoder-attention-heads", "2",
        "--share-decoder-input-output-embed",
        "--criterion", "label_smoothed_cross_entropy_rdrop", "--label-smoothing", "0.1",
        "--lr", "0.003", "--max-tokens", "400", "--max-update", str(max_update),
        "--save-dir", save_dir, *extra,
    ]


def rdrop_translation_cmd(data_bin, user_dir, save_dir, max_update):
    """The R-Drop translation recipe (alpha 5, --eval-bleu, best checkpoint by BLEU)."""
    return translation_train_cmd(
        data_bin, user_dir, save_dir, max_update,
        "--dropout", "0.1", "--rdrop-alpha", "5",
        "--eval-bleu", "--eval-bleu-detok", "space",
        "--eval-bleu-args", '{"beam": 2, "max_len_a": 1.2, "max_len_b": 10}',
        "--best-checkpoint-metric", "bleu", "--maximize-best-checkpoint-metric",
        "--validate-interval", "10", "--log-interval", "10", "--no-epoch-checkpoints",
    )


@dataclass
class Run:
    proc: subprocess.CompletedProcess
    save_dir: Path
    stats: dict


@pytest.fixture(scope="session")
def translation_run(translation_data, user_dir, tmp_path_factory):
    save_dir = tmp_path_factory.mktemp("translation_ckpt")
    proc = run(rdrop_translation_cmd(translation_data, user_dir, save_dir, TRANSLATION_UPDATES),
               cwd=save_dir)
    return Run(proc, save_dir, parse_stats(proc.stdout))


def test_translation_trains_with_rdrop_kl_and_eval_bleu(translation_run):
    proc, stats = translation_run.proc, translation_run.stats
    check_ok(proc)
    for name in ("checkpoint_best.pt", "checkpoint_last.pt"):
        assert (translation_run.save_dir / name).is_file(), f"no {name}" + tail(proc)

    train_lines = stats["train_inner"] + stats["train"]
    assert stats["train_inner"] and stats["train"], "no training statistics" + tail(proc)
    for line in train_lines:
        assert positive_finite(line.get("rdrop_kl")), f"bad rdrop_kl in {line}" + tail(proc)
        assert "loss" in line and "nll_loss" in line and "ppl" in line, line
    assert stats["train"][-1]["num_updates"] == TRANSLATION_UPDATES

    assert stats["valid"], "no validation statistics" + tail(proc)
    for line in stats["valid"]:
        assert "bleu" in line and 0 <= line["bleu"] <= 100, f"no BLEU in {line}" + tail(proc)
        assert "rdrop_kl" not in line, f"validation must run one pass: {line}"
    assert "best_bleu" in stats["valid"][-1]


def test_translation_resumes_from_checkpoint_last(translation_run, translation_data, user_dir,
                                                  tmp_path):
    check_ok(translation_run.proc)
    save_dir = tmp_path / "ckpt"  # a copy: the shared checkpoints stay as they are
    shutil.copytree(translation_run.save_dir, save_dir)
    proc = check_ok(run(rdrop_translation_cmd(translation_data, user_dir, save_dir,
                                              RESUME_UPDATES), cwd=tmp_path))

    loaded = re.search(r"Loaded checkpoint (\S+) \(epoch (\d+) @ (\d+) updates\)", proc.stdout)
    assert loaded, "did not load a checkpoint" + tail(proc)
    assert Path(loaded[1]).name == "checkpoint_last.pt", loaded[0]
    assert int(loaded[3]) == TRANSLATION_UPDATES, loaded[0]

    stats = parse_stats(proc.stdout)
    updates = [line["num_updates"] for line in stats["train_inner"] + stats["train"]]
    assert updates and min(updates) > TRANSLATION_UPDATES, f"restarted from scratch: {updates}"
    assert stats["train"][-1]["num_updates"] == RESUME_UPDATES, tail(proc)
    assert all(positive_finite(line.get("rdrop_kl")) for line in stats["train"])
    assert f"num_updates: {RESUME_UPDATES} >= max_update: {RESUME_UPDATES}" in proc.stdout


def generate_args(data_bin, checkpoint):
    # --required-batch-size-multiple 1: with fairseq's default (8), batch_by_size drops a
    # last batch whose size is not a multiple of 8, so 24 of the 30 test sentences would be
    # translated (fairseq/data/data_utils.py, "if bsz_mult > 1 and len(b[-1]) % bsz_mult").
    return [data_bin, "--path", checkpoint, "--gen-subset", "test", "--source-lang", "de",
            "--target-lang", "en", "--beam", GEN_BEAM, "--max-len-a", "1.2", "--max-len-b", "10",
            "--batch-size", "16", "--required-batch-size-multiple", "1", "--cpu",
            "--num-workers", "0"]


@pytest.fixture(scope="session")
def plugin_generation(translation_run, translation_data, user_dir):
    check_ok(translation_run.proc)
    ckpt = translation_run.save_dir / "checkpoint_best.pt"
    return run([tool("fairseq-generate"), *generate_args(translation_data, ckpt),
                "--user-dir", user_dir], cwd=translation_run.save_dir)


def test_generate_with_plugin(plugin_generation):
    proc = check_ok(plugin_generation)
    bleu = re.search(r"Generate test with beam=(\d+): BLEU4 = ([\d.]+)", proc.stdout)
    assert bleu, "no BLEU line" + tail(proc)
    assert bleu[1] == GEN_BEAM and 0 <= float(bleu[2]) <= 100, bleu[0]
    hypos = parse_hypotheses(proc.stdout)
    assert sorted(hypos) == list(range(TRANSLATION_SPLITS["test"])), (
        f"{len(hypos)} hypotheses for {TRANSLATION_SPLITS['test']} test sentences" + tail(proc)
    )
    assert all(math.isfinite(score) for score, _ in hypos.values())


# Written out here, without importing rdrop_fairseq: what any user of a checkpoint needs
# under torch >= 2.6 to run stock fairseq on it.
STOCK_GENERATE_SCRIPT = textwrap.dedent(
    """
    import argparse, importlib.abc, sys
    import numpy as np
    import torch

    class NoPlugin(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] == "rdrop_fairseq":
                raise ImportError("the plugin must not be needed: " + name)

    sys.meta_path.insert(0, NoPlugin())
    if int(np.__version__.split(".")[0]) >= 2:
        from numpy._core import multiarray
    else:
        from numpy.core import multiarray
    numeric = ["bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32",
               "uint64", "float16", "float32", "float64"]
    dtype_classes = {type(np.dtype(n)) for n in numeric} - {np.dtype}
    torch.serialization.add_safe_globals(
        [argparse.Namespace, np.ndarray, np.dtype, multiarray._reconstruct, multiarray.scalar,
         *dtype_classes])

    sys.argv = ["fairseq-generate", *sys.argv[1:]]
    from fairseq_cli.generate import cli_main
    cli_main()
    assert "rdrop_fairseq" not in sys.modules, "rdrop_fairseq was imported"
    print("GENERATED WITHOUT rdrop_fairseq")
    """
)


def test_generate_without_plugin_gives_same_hypotheses(plugin_generation, translation_run,
                                                       translation_data, tmp_path):
    check_ok(plugin_generation)
    ckpt = translation_run.save_dir / "checkpoint_best.pt"
    proc = check_ok(run([sys.executable, "-c", STOCK_GENERATE_SCRIPT,
                         *generate_args(translation_data, ckpt)], cwd=tmp_path))
    assert "GENERATED WITHOUT rdrop_fairseq" in proc.stdout, tail(proc)

    with_plugin = parse_hypotheses(plugin_generation.stdout)
    without_plugin = parse_hypotheses(proc.stdout)
    assert sorted(without_plugin) == sorted(with_plugin), tail(proc)
    for i, (score, hyp) in with_plugin.items():
        assert without_plugin[i][1] == hyp, f"sentence {i}: {without_plugin[i]} vs {hyp}"
        assert without_plugin[i][0] == pytest.approx(score, abs=1e-4)


def test_stock_generate_needs_the_allow_list(translation_run, translation_data, tmp_path):
    """Documents why the allow-list exists; fails the day torch/fairseq no longer need it."""
    check_ok(translation_run.proc)
    ckpt = translation_run.save_dir / "checkpoint_best.pt"
    proc = run([tool("fairseq-generate"), *generate_args(translation_data, ckpt)], cwd=tmp_path)
    assert proc.returncode != 0, "stock fairseq-generate loaded the checkpoint" + tail(proc)
    assert "weights_only" in proc.stderr and "argparse.Namespace" in proc.stderr, tail(proc)


# --------------------------------------------------------------------------- language models


def lm_train_cmd(data_bin, user_dir, save_dir, *model_args):
    return [tool("fairseq-train"), data_bin, "--user-dir", user_dir, *COMMON_TRAIN,
            "--task", "language_modeling", "--tokens-per-sample", "32", "--lr", "0.005",
            "--max-tokens", "512", "--max-update", "24", "--log-interval", "4",
            "--save-dir", save_dir, "--no-epoch-checkpoints", *model_args]


def eval_lm(data_bin, user_dir, checkpoint, cwd):
    return run([tool("fairseq-eval-lm"), data_bin, "--user-dir", user_dir, "--path", checkpoint,
                "--gen-subset", "test", "--tokens-per-sample", "32", "--max-tokens", "512",
                "--cpu", "--num-workers", "0", "--no-progress-bar", "--log-format", "simple"],
               cwd=cwd)


def check_perplexity(proc, data_bin):
    check_ok(proc)
    loss, ppl = parse_eval_lm(proc.output)
    assert math.isfinite(ppl) and 1 < ppl < 3 * vocab_size(data_bin / "dict.txt"), (
        f"perplexity {ppl}" + tail(proc)
    )
    assert ppl == pytest.approx(2 ** loss, rel=0.01)


def lm_model_args(criterion, data_bin):
    """A shrunk transformer_lm_gpt (full softmax) or transformer_lm_wiki103 (adaptive)."""
    if criterion == "cross_entropy_rdrop":
        return ["--arch", "transformer_lm_gpt", "--decoder-layers", "1",
                "--decoder-embed-dim", "32", "--decoder-ffn-embed-dim", "64",
                "--decoder-attention-heads", "2", "--dropout", "0.1"]
    vocab = vocab_size(data_bin / "dict.txt")
    cutoff = f"{vocab // 4},{vocab // 2}"
    return ["--arch", "transformer_lm_wiki103", "--decoder-layers", "1",
            "--decoder-embed-dim", "32", "--decoder-input-dim", "32", "--decoder-output-dim", "32",
            "--decoder-ffn-embed-dim", "64", "--decoder-attention-heads", "2",
            "--adaptive-input-cutoff", cutoff, "--adaptive-softmax-cutoff", cutoff,
            "--ddp-backend", "legacy_ddp"]


@pytest.mark.parametrize("criterion", ["cross_entropy_rdrop", "adaptive_loss_rdrop"])
def test_language_model_trains_and_evaluates(criterion, lm_data, user_dir, tmp_path):
    train = check_ok(run(lm_train_cmd(
        lm_data, user_dir, tmp_path, *lm_model_args(criterion, lm_data),
        "--criterion", criterion, "--rdrop-alpha", "1"), cwd=tmp_path))
    stats = parse_stats(train.stdout)
    assert stats["train"], tail(train)
    for line in stats["train_inner"] + stats["train"]:
        assert positive_finite(line.get("rdrop_kl")), f"bad rdrop_kl in {line}" + tail(train)
    assert stats["valid"] and all("rdrop_kl" not in line for line in stats["valid"])

    check_perplexity(eval_lm(lm_data, user_dir, tmp_path / "checkpoint_best.pt", tmp_path),
                     lm_data)


# --------------------------------------------------------------------------- sentence prediction


def sentence_prediction_cmd(data_bin, user_dir, save_dir, *extra):
    return [tool("fairseq-train"), data_bin, "--user-dir", user_dir, *COMMON_TRAIN,
            "--task", "sentence_prediction", "--arch", "roberta_base",
            "--encoder-layers", "1", "--encoder-embed-dim", "32",
            "--encoder-ffn-embed-dim", "64", "--encoder-attention-heads", "2",
            "--max-positions", "64", "--init-token", "0", "--separator-token", "2",
            "--criterion", "sentence_prediction_rdrop", "--rdrop-alpha", "1",
            "--dropout", "0.1", "--lr", "0.001", "--batch-size", "32", "--max-update", "14",
            "--log-interval", "7", "--save-dir", save_dir, "--no-epoch-checkpoints", *extra]


def test_sentence_classification_rdrop(classification_data, user_dir, tmp_path):
    proc = check_ok(run(sentence_prediction_cmd(
        classification_data, user_dir, tmp_path, "--num-classes", "2",
        "--best-checkpoint-metric", "accuracy", "--maximize-best-checkpoint-metric"),
        cwd=tmp_path))
    stats = parse_stats(proc.stdout)
    assert stats["train"], tail(proc)
    for line in stats["train_inner"] + stats["train"]:
        assert positive_finite(line.get("rdrop_kl")), f"bad rdrop_kl in {line}" + tail(proc)
        assert "rdrop_mse" not in line
    assert stats["valid"], tail(proc)
    for line in stats["valid"]:
        assert isinstance(line.get("accuracy"), float) and 0 <= line["accuracy"] <= 100, line
        assert "rdrop_kl" not in line
    assert (tmp_path / "checkpoint_best.pt").is_file()


def test_sentence_regression_rdrop(regression_data, user_dir, tmp_path):
    proc = check_ok(run(sentence_prediction_cmd(
        regression_data, user_dir, tmp_path, "--regression-target", "--num-classes", "1",
        "--best-checkpoint-metric", "loss"), cwd=tmp_path))
    stats = parse_stats(proc.stdout)
    assert stats["train"], tail(proc)
    for line in stats["train_inner"] + stats["train"]:
        assert positive_finite(line.get("rdrop_mse")), f"bad rdrop_mse in {line}" + tail(proc)
        assert "rdrop_kl" not in line, line
    assert stats["valid"], tail(proc)
    for line in stats["valid"]:
        assert math.isfinite(line["loss"]) and "rdrop_mse" not in line, line
    assert (tmp_path / "checkpoint_best.pt").is_file()


# --------------------------------------------------------------------------- bad input


@pytest.mark.parametrize("alpha", ["-1", "nan"])
def test_invalid_rdrop_alpha_is_refused_before_the_save_dir_exists(translation_data, user_dir, tmp_path, alpha):
    save_dir = tmp_path / "ckpt"
    proc = run(translation_train_cmd(translation_data, user_dir, save_dir, 3,
                                     "--rdrop-alpha", alpha), cwd=tmp_path)
    assert proc.returncode != 0, f"--rdrop-alpha {alpha} was accepted" + tail(proc)
    assert f"error: argument --rdrop-alpha: must be a finite number >= 0, got {alpha}" \
        in proc.stderr, tail(proc)
    assert "Traceback" not in proc.output, tail(proc)  # refused while parsing the options
    assert not save_dir.exists(), "the save dir was made before the refusal"


def test_rdrop_without_dropout_warns_and_kl_is_zero(translation_data, user_dir, tmp_path):
    proc = check_ok(run(translation_train_cmd(
        translation_data, user_dir, tmp_path, 6, "--rdrop-alpha", "5", "--dropout", "0",
        "--attention-dropout", "0", "--activation-dropout", "0", "--log-interval", "1",
        "--no-save"), cwd=tmp_path))
    warnings = [line for line in proc.output.splitlines()
                if "WARNING" in line and "KL is always 0" in line]
    assert len(warnings) == 1, "expected one warning that the KL is always 0" + tail(proc)
    assert "--rdrop-alpha 5" in warnings[0] and "dropout" in warnings[0]
    stats = parse_stats(proc.stdout)
    lines = stats["train_inner"] + stats["train"]
    assert len(stats["train_inner"]) == 6, tail(proc)
    assert all(line.get("rdrop_kl") == 0 for line in lines), lines


def test_two_passes_without_kl_ablation_from_the_cli(translation_data, user_dir, tmp_path):
    """Appendix C.2: --rdrop-alpha 0 --rdrop-two-passes trains on [x; x] without the KL,
    still logging how far apart the passes are; a baseline run logs no rdrop_kl."""
    ablation = check_ok(run(translation_train_cmd(
        translation_data, user_dir, tmp_path / "a", 6, "--rdrop-alpha", "0",
        "--rdrop-two-passes", "--dropout", "0.3", "--log-interval", "1", "--no-save"),
        cwd=tmp_path))
    assert "R-Drop is off" not in ablation.output, tail(ablation)
    lines = parse_stats(ablation.stdout)["train_inner"]
    assert len(lines) == 6 and all(positive_finite(line.get("rdrop_kl")) for line in lines)
    off = check_ok(run(translation_train_cmd(
        translation_data, user_dir, tmp_path / "b", 2, "--rdrop-alpha", "0", "--dropout", "0.3",
        "--log-interval", "1", "--no-save"), cwd=tmp_path))
    assert "R-Drop is off" in off.output, tail(off)
    assert all("rdrop_kl" not in line for line in parse_stats(off.stdout)["train_inner"])


# --------------------------------------------------------------------------- hydra


def hydra_train(translation_data, user_dir, cwd, warm):
    """fairseq-hydra-train with the shipped config, shrunk, 4 updates, in ``cwd``."""
    return check_ok(run([
        tool("fairseq-hydra-train"), "--config-dir", REPO / "configs",
        "--config-name", "transformer_iwslt_de_en_rdrop",
        f"common.user_dir={user_dir}", f"task.data={translation_data}", "common.cpu=true",
        "optimization.max_update=4", "dataset.max_tokens=1000", f"checkpoint.save_dir={cwd / 'ckpt'}",
        "task.eval_bleu_detok=space", "dataset.num_workers=0", "common.no_progress_bar=true",
        "model.encoder_layers=1", "model.decoder_layers=1",
        "model.encoder_embed_dim=32", "model.decoder_embed_dim=32",
        "model.encoder_ffn_embed_dim=64", "model.decoder_ffn_embed_dim=64",
    ], cwd=cwd, warm=warm))


def test_hydra_train_with_shipped_config(translation_data, user_dir, tmp_path):
    """A real fairseq-hydra-train process (hydra sets up its own logging and run directory),
    and the warm one: the same statistics and weights."""
    assert forks_warm([tool("fairseq-hydra-train")], tool_env())
    (tmp_path / "real").mkdir()
    (tmp_path / "warm").mkdir()
    proc = hydra_train(translation_data, user_dir, tmp_path / "real", warm=False)
    warm = hydra_train(translation_data, user_dir, tmp_path / "warm", warm=True)
    stats = parse_stats(proc.stdout)
    assert stats["train"], "no training statistics in hydra's log" + tail(proc)
    for line in stats["train"]:
        assert positive_finite(line.get("rdrop_kl")), f"bad rdrop_kl in {line}" + tail(proc)
    assert stats["train"][-1]["num_updates"] == 4
    assert stats["valid"] and all("bleu" in line and "rdrop_kl" not in line
                                  for line in stats["valid"]), stats["valid"]
    assert (tmp_path / "real" / "outputs").is_dir()  # hydra's run directory, in the cwd
    assert_same_training(stats, parse_stats(warm.stdout), ("train", "valid"))
    assert_same_weights(*(d / "ckpt" / "checkpoint_last.pt"
                          for d in (tmp_path / "real", tmp_path / "warm")))


# --------------------------------------------------------------------------- real processes
# The tests above start fairseq's tools warm (tests/warm_process.py). These run each tool
# the project's recipes start as a real process, to completion, and check that it gives
# what the warm one gives: the same files, statistics, hypotheses and perplexity.


def assert_same_training(real_stats, warm_stats, loggers):
    """Two trainings' logged statistics (``parse_stats``) agree line by line."""
    keep = ("loss", "nll_loss", "rdrop_kl", "bleu", "num_updates")
    for logger in loggers:
        assert ([{k: v for k, v in line.items() if k in keep} for line in real_stats[logger]]
                == [{k: v for k, v in line.items() if k in keep}
                    for line in warm_stats[logger]]), logger


def assert_same_weights(real_checkpoint, warm_checkpoint):
    """Two checkpoints hold bit-identical model weights."""
    import torch

    from rdrop_fairseq.checkpoint_compat import allow_fairseq_checkpoint_globals

    allow_fairseq_checkpoint_globals()
    real, warm = (torch.load(c, map_location="cpu")["model"]
                  for c in (real_checkpoint, warm_checkpoint))
    assert real.keys() == warm.keys()
    assert all(torch.equal(real[k], warm[k]) for k in real)


def test_real_fairseq_preprocess_writes_what_the_warm_one_wrote(translation_data, tmp_path):
    raw = translation_data.parent / "raw"
    assert forks_warm([tool("fairseq-preprocess")], tool_env())  # the fixture's ran warm
    proc = check_ok(run([tool("fairseq-preprocess"), "--source-lang", "de", "--target-lang",
                         "en", "--trainpref", raw / "train", "--validpref", raw / "valid",
                         "--testpref", raw / "test", "--destdir", tmp_path / "bin",
                         "--joined-dictionary", "--workers", "1"], cwd=tmp_path, warm=False))
    # a real fairseq-preprocess: fairseq's import set logging up first (stderr, Python's
    # default format)
    assert "INFO:fairseq_cli.preprocess:Wrote preprocessed data to" in proc.stderr, tail(proc)
    written = sorted(p.name for p in translation_data.iterdir())
    assert sorted(p.name for p in (tmp_path / "bin").iterdir()) == written
    for name in written:  # preprocess.log: the same but for the --destdir it names
        real, warm = ((d / name).read_text(errors="replace").replace(str(d), "DEST")
                      for d in (tmp_path / "bin", translation_data))
        assert real == warm, name


def test_real_fairseq_train_and_generate_give_what_the_warm_ones_give(
        translation_data, user_dir, tmp_path):
    assert forks_warm([tool("fairseq-train")], tool_env())  # warm against real, not real twice
    runs = {}
    for kind in ("real", "warm"):
        save_dir = tmp_path / kind
        save_dir.mkdir()
        train = check_ok(run(rdrop_translation_cmd(translation_data, user_dir, save_dir, 12),
                             cwd=save_dir, warm=kind == "warm"))
        generate = check_ok(run([tool("fairseq-generate"),
                                 *generate_args(translation_data, save_dir / "checkpoint_last.pt"),
                                 "--user-dir", user_dir], cwd=save_dir, warm=kind == "warm"))
        runs[kind] = train, generate, save_dir
    (real, real_generate, real_dir), (warm, warm_generate, warm_dir) = runs["real"], runs["warm"]
    # setup.sh installs tensorboardX: fairseq's import does not ask for it (the control, a
    # process where it cannot be imported, is in tests/test_warm_process.py)
    assert "Please install tensorboardX" not in real.output
    real_stats, warm_stats = parse_stats(real.stdout), parse_stats(warm.stdout)
    assert real_stats["train"][-1]["num_updates"] == 12, tail(real)
    assert positive_finite(real_stats["train"][-1].get("rdrop_kl")), tail(real)
    assert_same_training(real_stats, warm_stats, ("train_inner", "train", "valid"))
    assert_same_weights(real_dir / "checkpoint_last.pt", warm_dir / "checkpoint_last.pt")
    assert parse_hypotheses(real_generate.stdout) == parse_hypotheses(warm_generate.stdout)
    assert len(parse_hypotheses(real_generate.stdout)) == TRANSLATION_SPLITS["test"]


def test_real_fairseq_eval_lm_gives_the_warm_ones_perplexity(lm_data, user_dir, tmp_path):
    check_ok(run(lm_train_cmd(lm_data, user_dir, tmp_path,
                              *lm_model_args("cross_entropy_rdrop", lm_data),
                              "--criterion", "cross_entropy_rdrop", "--rdrop-alpha", "1",
                              "--max-update", "8"), cwd=tmp_path))
    checkpoint = tmp_path / "checkpoint_last.pt"
    assert forks_warm([tool("fairseq-eval-lm")], tool_env())
    real = run([tool("fairseq-eval-lm"), lm_data, "--user-dir", user_dir, "--path", checkpoint,
                "--gen-subset", "test", "--tokens-per-sample", "32", "--max-tokens", "512",
                "--cpu", "--num-workers", "0", "--no-progress-bar", "--log-format", "simple"],
               cwd=tmp_path, warm=False)
    check_perplexity(real, lm_data)
    assert parse_eval_lm(real.output) == parse_eval_lm(
        eval_lm(lm_data, user_dir, checkpoint, tmp_path).output)
