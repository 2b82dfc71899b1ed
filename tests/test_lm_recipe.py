"""The WikiText-103 language-model recipes end to end on a tiny corpus in the WikiText layout:
prepare (zip) -> binarize -> train through scripts/wikitext103.sh (ARCH gpt and adaptive;
R-Drop and baseline) -> evaluate, the configs against fairseq's architectures and the paper,
and the errors on missing data."""

import json
import math
import random
import re
import sys
import zipfile
from pathlib import Path

import pytest

from rdrop_fairseq.recipes import evaluate_lm, fetch, prepare_wikitext
from tests.recipe_helpers import OFFLINE, composed_config, dry_run, run, script

REPO = Path(__file__).resolve().parents[1]
CONFIGS = {"gpt": "transformer_lm_gpt_rdrop", "wiki103": "transformer_lm_wiki103_rdrop"}
ARCH_OF = {"gpt": "gpt", "wiki103": "adaptive"}  # scripts/wikitext103.sh's ARCH

TINY_MODEL = [f"model.decoder_{k}={v}" for k, v in (
    ("layers", 1), ("embed_dim", 32), ("input_dim", 32), ("output_dim", 32),
    ("ffn_embed_dim", 64), ("attention_heads", 2))]
FAST = ["task.tokens_per_sample=32", "common.log_interval=1", "dataset.num_workers=0",
        "checkpoint.no_epoch_checkpoints=true"]
TINY_CUTOFF = ["model.adaptive_input_cutoff='10,20'", "model.adaptive_softmax_cutoff='10,20'"]
UPDATES = 4
WORDS = ("the a of in and river city old new king war song team north south west east music "
         "band first second early later game film").split()
ARTICLES = {"train": 40, "valid": 4, "test": 4}




def write_wikitext(root):
    """``root/wiki.{split}.tokens`` as WikiText-103 writes them: `` = Title = `` headings,
    blank lines, one paragraph a line, ``@-@`` and ``<unk>`` tokens. Returns the lines."""
    rng = random.Random(0)
    root.mkdir(parents=True, exist_ok=True)
    corpus = {}
    for split, n in ARTICLES.items():
        lines = []
        for i in range(n):
            lines += [" ", f" = {rng.choice(WORDS).title()} {split} {i} = ", " "]
            for _ in range(3):
                words = [rng.choice(WORDS) for _ in range(rng.randint(8, 20))]
                words[rng.randrange(len(words))] += " @-@ <unk>"
                lines.append(" " + " ".join(words) + " . ")
        (root / f"wiki.{split}.tokens").write_text("\n".join(lines) + "\n", encoding="utf-8")
        corpus[split] = lines
    return corpus


@pytest.fixture(scope="module")
def wikitext(tmp_path_factory):
    """A tiny corpus zipped like wikitext-103-v1.zip, prepared by prepare_wikitext.py."""
    root = tmp_path_factory.mktemp("wikitext")
    corpus = write_wikitext(root / "corpus" / "wikitext-103")
    archive = root / "wikitext-103-v1.zip"
    with zipfile.ZipFile(archive, "w") as zf:
        for split in ARTICLES:
            zf.write(root / "corpus" / "wikitext-103" / f"wiki.{split}.tokens",
                     f"wikitext-103/wiki.{split}.tokens")
    out = root / "prep"
    log = run([sys.executable, "-m", "rdrop_fairseq.recipes.prepare_wikitext", "--source", archive,
               "--out", out]).stdout
    return {"bin": out / "bin", "out": out, "corpus": corpus, "log": log}


def test_prepare_extracts_the_zip_and_binarizes_only_source(wikitext):
    out, corpus = wikitext["out"], wikitext["corpus"]
    for split in ARTICLES:  # the zip's files, extracted flat into OUT/raw, unchanged
        raw = (out / "raw" / f"wiki.{split}.tokens").read_text(encoding="utf-8")
        assert raw.splitlines() == corpus[split]
        for ext in ("bin", "idx"):  # --only-source: no language suffix
            assert (wikitext["bin"] / f"{split}.{ext}").is_file()
    entries = [line.split()[0] for line in (wikitext["bin"] / "dict.txt").read_text().splitlines()]
    train_words = {w for line in corpus["train"] for w in line.split()} - {"<unk>"}
    # one dictionary of the training text, no threshold (fairseq pads it to a multiple of 8
    # with made-up words)
    assert {w for w in entries if not w.startswith("madeupword")} == train_words
    assert f"dictionary of {len(entries)} words" in wikitext["log"]


def test_prepare_finds_the_files_in_a_directory(tmp_path):
    write_wikitext(tmp_path / "unzipped" / "wikitext-103")
    files = prepare_wikitext.corpus_files(tmp_path / "unzipped", tmp_path / "out")
    assert files == {s: tmp_path / "unzipped" / "wikitext-103" / f"wiki.{s}.tokens"
                     for s in ARTICLES}


def test_prepare_offline_says_to_pass_a_local_path(tmp_path):
    """The default source is the download; with no network (here: a proxy that refuses every
    connection) it fails at once, saying to pass the local zip or directory."""
    proc = run([sys.executable, "-m", "rdrop_fairseq.recipes.prepare_wikitext", "--out",
                tmp_path / "out", "--downloads", tmp_path / "downloads"], ok=False, env=OFFLINE)
    assert proc.returncode != 0
    url = fetch.load_sources(fetch.TABLE)["wikitext-103"]["files"][0]["urls"][0]
    assert f"cannot fetch wikitext-103-v1.zip: {url}: no connection" in proc.stderr, proc.output
    assert "or set SOURCE to a local wikitext-103-v1.zip" in proc.stderr
    assert list(tmp_path.iterdir()) == []  # no partial download, no folder left behind


def test_prepare_missing_data_is_named(tmp_path):
    with pytest.raises(SystemExit, match="does not exist; pass the WikiText directory"):
        prepare_wikitext.corpus_files(tmp_path / "nowhere", tmp_path / "out")
    (tmp_path / "partial").mkdir()
    (tmp_path / "partial" / "wiki.train.tokens").write_text(" a b\n")
    with pytest.raises(SystemExit, match="holds no directory with wiki.train.tokens, "
                                         "wiki.valid.tokens, wiki.test.tokens"):
        prepare_wikitext.corpus_files(tmp_path / "partial", tmp_path / "out")
    with zipfile.ZipFile(tmp_path / "other.zip", "w") as zf:
        zf.writestr("wikitext-103/wiki.train.tokens", " a b\n")
    with pytest.raises(SystemExit, match="holds no wiki.valid.tokens, wiki.test.tokens"):
        prepare_wikitext.corpus_files(tmp_path / "other.zip", tmp_path / "out")


def train(recipe, data_dir, save_dir, **env):
    extra = TINY_MODEL + FAST + (TINY_CUTOFF if recipe == "wiki103" else [])
    return script("wikitext103", "train", *extra, f"optimization.max_update={UPDATES}",
                  ARCH=ARCH_OF[recipe], GPUS=0, DATA_DIR=data_dir, SAVE_DIR=save_dir,
                  MAX_TOKENS=256, UPDATE_FREQ=1, **env).stdout


def train_inner(log):
    lines = [line for line in log.splitlines() if "[train_inner]" in line]
    assert len(lines) == UPDATES, log[-3000:]
    return lines


@pytest.mark.parametrize("recipe", ["gpt", "wiki103"])
def test_recipe_trains_with_rdrop_and_evaluates(wikitext, tmp_path, recipe):
    save = tmp_path / "ckpt"
    log = train(recipe, wikitext["out"], save)
    criterion = {"gpt": "CrossEntropyRDropCriterion", "wiki103": "AdaptiveLossRDrop"}[recipe]
    assert f"criterion: {criterion}" in log
    for line in train_inner(log):
        kl = re.search(r"rdrop_kl=([^,\s]+)", line)
        assert kl and math.isfinite(float(kl[1])) and float(kl[1]) > 0, line
    valid = [line for line in log.splitlines() if "valid on 'valid' subset" in line]
    assert valid and not any("rdrop_kl" in line for line in valid), log[-3000:]

    out = script("wikitext103", "evaluate", "--tokens-per-sample", 32, "--context-window", 16,
                 ARCH=ARCH_OF[recipe], GPUS=0, DATA_DIR=wikitext["out"], SAVE_DIR=save).stdout
    m = re.search(r"^test: perplexity ([\d.]+), loss ([\d.]+) bits/token", out, re.M)
    assert m, out[-3000:]
    ppl, loss = float(m[1]), float(m[2])
    assert math.isfinite(ppl) and ppl > 1
    assert ppl == pytest.approx(2 ** loss, rel=1e-3)
    result = json.loads((save / "test_ppl.json").read_text())
    assert result["perplexity"] == ppl and result["context_window"] == 16
    # every test token scored once: each word plus one end-of-line per line
    assert result["tokens"] == sum(len(line.split()) + 1 for line in wikitext["corpus"]["test"])
    # the adaptive-input model: its standard protocol is the headline, the authors' beside it
    assert result["protocol"] == {"gpt": "authors", "wiki103": "adaptive"}[recipe]
    assert (save / "test_ppl.authors.json").is_file() == (recipe == "wiki103")


@pytest.mark.parametrize("recipe", ["gpt", "wiki103"])
def test_baseline_mode_is_the_plain_fairseq_criterion(wikitext, tmp_path, recipe):
    log = train(recipe, wikitext["out"], tmp_path / "ckpt", MODE="baseline")
    assert "criterion.rdrop_alpha=0 " in log
    for line in train_inner(log):
        assert "rdrop_kl" not in line and re.search(r"loss=[\d.]+", line), line
    assert (tmp_path / "ckpt" / "checkpoint_last.pt").is_file()


# ----------------------------------------------------------------- configs and options

ARCH = {"gpt": "transformer_lm_gpt", "wiki103": "transformer_lm_wiki103"}
# keys where the config knowingly differs from `--arch X` (reason), or that are unused
CONFIG_DEVIATIONS = {"gpt": {"share_decoder_input_output_embed": True},  # authors' script
                     "wiki103": {}}
UNUSED = {"base_shuffle", "tokens_per_sample"}  # no BASE layers; tokens: the task's


@pytest.mark.parametrize("recipe", ["gpt", "wiki103"])
def test_config_is_the_fairseq_architecture(recipe):
    """hydra does not apply --arch defaults, so the config spells the architecture out: after
    what fairseq's build_model does, it must equal `fairseq-train --arch X`'s model."""
    import argparse

    from fairseq import options
    from fairseq.models import ARCH_CONFIG_REGISTRY
    from omegaconf import OmegaConf

    cfg = composed_config(CONFIGS[recipe])
    model = argparse.Namespace(**OmegaConf.to_container(cfg.model, resolve=True))
    assert model._name == ARCH[recipe]
    ARCH_CONFIG_REGISTRY[model._name](model)
    parser = options.get_training_parser()
    ref = vars(options.parse_args_and_arch(parser, [
        "/nonexistent", "--task", "language_modeling", "--arch", ARCH[recipe]]))
    differ = {k: (v, ref[k]) for k, v in vars(model).items()
              if k in ref and k not in UNUSED and v != ref[k]}
    assert differ == {k: (v, not v) for k, v in CONFIG_DEVIATIONS[recipe].items()}


def test_configs_hold_the_papers_settings():
    gpt = composed_config("transformer_lm_gpt_rdrop")
    assert (gpt.criterion._name, gpt.criterion.rdrop_alpha) == ("cross_entropy_rdrop", 1.0)
    assert (gpt.model.decoder_layers, gpt.model.decoder_embed_dim,
            gpt.model.decoder_ffn_embed_dim, gpt.model.decoder_attention_heads) == (
        12, 768, 3072, 12)
    assert (gpt.model.dropout, gpt.model.attention_dropout) == (0.1, 0.1)
    assert (gpt.optimizer._name, gpt.optimization.lr, gpt.lr_scheduler.warmup_updates) == (
        "adam", [0.0005], 4000)
    assert (gpt.optimization.max_update, gpt.task.tokens_per_sample) == (50000, 512)

    ada = composed_config("transformer_lm_wiki103_rdrop")
    assert (ada.criterion._name, ada.criterion.rdrop_alpha) == ("adaptive_loss_rdrop", 1.0)
    assert (ada.model.decoder_layers, ada.model.decoder_embed_dim,
            ada.model.decoder_ffn_embed_dim) == (16, 1024, 4096)
    assert (ada.model.dropout, ada.model.attention_dropout, ada.model.activation_dropout,
            ada.model.adaptive_softmax_dropout) == (0.3, 0.1, 0.1, 0.2)
    assert ada.model.adaptive_input and ada.model.adaptive_softmax_cutoff == "20000,60000"
    assert (ada.optimizer._name, ada.optimization.lr, ada.lr_scheduler._name) == (
        "nag", [1.0], "cosine")
    assert (ada.optimization.max_update, ada.task.tokens_per_sample) == (286000, 3072)
    assert ada.distributed_training.ddp_backend == "legacy_ddp"  # adaptive_loss needs it


@pytest.fixture
def command(tmp_path):
    """The fairseq-hydra-train command scripts/wikitext103.sh runs (DRY_RUN: no training)."""
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "dict.txt").write_text("".join(f"w{i} 1\n" for i in range(100)))

    def make(recipe, *overrides, ok=True, **env):
        commands, proc = dry_run("wikitext103", "train", *overrides, ok=ok, GPUS=0,
                                 ARCH=ARCH_OF[recipe], DATA_DIR=tmp_path, SAVE_DIR=tmp_path / "s",
                                 **env)
        return commands[-1] if ok else proc
    return make


def test_train_options_become_overrides(command):
    cmd = command("gpt")
    assert "--config-name" in cmd and "transformer_lm_gpt_rdrop" in cmd
    assert "criterion.rdrop_alpha=1" in cmd  # the paper's
    assert not [c for c in cmd if c.startswith("optimization.max_update")]  # the config's
    cmd = command("gpt", "optimization.max_update=10", "common.fp16=true", ALPHA=0.5, SEED=3,
                  MAX_TOKENS=1000, UPDATE_FREQ=32)
    for item in ("criterion.rdrop_alpha=0.5", "common.seed=3", "dataset.max_tokens=1000",
                 "optimization.update_freq=[32]", "optimization.max_update=10"):
        assert item in cmd
    assert cmd[-1] == "common.fp16=true"
    assert "criterion.rdrop_alpha=0" in command("gpt", MODE="baseline")
    assert "contradicts MODE=baseline" in command("gpt", ok=False, MODE="baseline",
                                                   ALPHA=1).stderr


def test_wiki103_cutoffs_need_a_large_vocabulary(command):
    proc = command("wiki103", ok=False)
    assert proc.returncode != 0 and "need more than 60000 words" in proc.stderr
    assert TINY_CUTOFF[0] in command("wiki103", *TINY_CUTOFF)


def test_evaluate_reads_fairseqs_summary_and_refuses_anything_else():
    out = ("INFO:fairseq_cli.eval_lm:Evaluated 245,569 tokens in 56.1s (4379.02 tokens/s)\n"
           "INFO:fairseq_cli.eval_lm:Loss (base 2): 4.9283, Perplexity: 30.46\n")
    assert evaluate_lm.read_result(0, out) == {"loss_base2": 4.9283, "perplexity": 30.46,
                                               "tokens": 245569}
    with pytest.raises(SystemExit, match="cannot read the perplexity: fairseq-eval-lm printed "
                                         "no 'Loss"):
        evaluate_lm.read_result(0, "Evaluated 0 tokens in 0.0s\n")
    with pytest.raises(SystemExit, match="non-finite perplexity"):
        evaluate_lm.read_result(0, "Loss (base 2): nan, Perplexity: nan\n")
    with pytest.raises(SystemExit, match="fairseq-eval-lm failed .exit code 1"):
        evaluate_lm.read_result(1, out)


def test_evaluate_protocols_are_the_authors_and_the_adaptive_input_standard(wikitext, tmp_path):
    checkpoint = tmp_path / "model.pt"
    checkpoint.write_bytes(b"")

    def command(*args):
        a = evaluate_lm.parse_args(["--data", str(wikitext["bin"]), "--checkpoint",
                                    str(checkpoint), *args])
        cmd = evaluate_lm.eval_lm_command(a)
        return {opt: cmd[i + 1] for i, opt in enumerate(cmd) if opt.startswith("--")
                and i + 1 < len(cmd) and not cmd[i + 1].startswith("--")}

    # the authors' evaluate_lm_wiki103.sh (= fairseq's language_model README)
    authors = command()
    assert (authors["--tokens-per-sample"], authors["--context-window"],
            authors["--batch-size"]) == ("512", "400", "2")
    assert "--max-tokens" not in authors and "--sample-break-mode" not in authors
    # the adaptive-input model's (fairseq's quant_noise README)
    adaptive = command("--protocol", "adaptive")
    assert {k: adaptive[k] for k in ("--tokens-per-sample", "--context-window", "--max-tokens",
                                     "--sample-break-mode", "--softmax-batch")} == {
        "--tokens-per-sample": "3072", "--context-window": "2560", "--max-tokens": "3072",
        "--sample-break-mode": "complete", "--softmax-batch": "1024"}
    assert "--batch-size" not in adaptive
    assert command("--protocol", "adaptive", "--context-window", "0")["--context-window"] == "0"
    with pytest.raises(SystemExit):
        command("--context-window", "512")  # must be below --tokens-per-sample


def test_evaluate_stage_reports_both_protocols_for_adaptive_input(tmp_path):
    for arch, protocols in (("gpt", ["authors"]), ("adaptive", ["adaptive", "authors"])):
        (command,), proc = dry_run("wikitext103", "evaluate", ARCH=arch, GPUS=0,
                                   SAVE_DIR=tmp_path / arch)
        i = command.index("--protocol") + 1
        assert command[i:i + len(protocols) + 1] == [*protocols, "--data"]
        assert Path(command[command.index("--json") + 1]).name == "test_ppl.json"
        assert [c[c.index("--context-window") + 1] for c in proc.inner] == [
            {"authors": "400", "adaptive": "2560"}[p] for p in protocols]


def test_docs_say_what_each_protocol_scores():
    """fairseq-eval-lm scores blocks of tokens-per-sample minus context-window tokens (issue
    26: the adaptive protocol was described as scoring 3072-token blocks): evaluate_lm's
    docstring and docs/language-modeling.md give each protocol's block and context."""
    docs = (REPO / "docs" / "language-modeling.md").read_text()
    for text in (" ".join(evaluate_lm.__doc__.split()), " ".join(docs.split())):
        for protocol, s in evaluate_lm.PROTOCOLS.items():
            block = s["tokens_per_sample"] - s["context_window"]
            of = "of at most " if s["sample_break_mode"] == "complete" else "of "
            assert re.search(rf"blocks (of whole lines )?{of}{block}\b[^.]*? tokens\b[^.]*?, "
                             rf"each after up to {s['context_window']} tokens of context",
                             text), protocol
        assert "3072-token blocks with" not in text


def fake_eval_lm(folder):
    """A stand-in fairseq-eval-lm (for FAIRSEQ_BIN) whose perplexity is the
    --tokens-per-sample it was given: which protocol wrote a result shows in it."""
    folder.mkdir()
    tool = folder / "fairseq-eval-lm"
    tool.write_text("#!/bin/sh\n"
                    'while [ $# -gt 0 ]; do [ "$1" = --tokens-per-sample ] && t=$2; shift; done\n'
                    'echo "Evaluated 1,000 tokens in 1.0s (1000.00 tokens/s)"\n'
                    'echo "Loss (base 2): 1.5, Perplexity: $t"\n')
    tool.chmod(0o755)
    return folder


def test_each_protocol_result_lands_in_its_own_json(tmp_path):
    """ARCH=adaptive with --json among the arguments (issue 26): the headline (the adaptive
    protocol) in that file, the authors' protocol beside it, nothing overwritten; the
    script's default test_ppl.json is not written. A --protocol there is an error."""
    data, save = tmp_path / "data", tmp_path / "ckpt"
    (data / "bin").mkdir(parents=True)
    (data / "bin" / "dict.txt").write_text("a 1\n")
    save.mkdir()
    (save / "checkpoint_best.pt").write_bytes(b"")
    env = dict(ARCH="adaptive", GPUS=0, DATA_DIR=data, SAVE_DIR=save,
               FAIRSEQ_BIN=fake_eval_lm(tmp_path / "bin"))
    script("wikitext103", "evaluate", "--subset", "valid", "--json", tmp_path / "valid.json",
           **env)
    headline = json.loads((tmp_path / "valid.json").read_text())
    beside = json.loads((tmp_path / "valid.authors.json").read_text())
    assert (headline["protocol"], headline["perplexity"], headline["context_window"]) == (
        "adaptive", 3072, 2560)
    assert (beside["protocol"], beside["perplexity"], beside["context_window"]) == (
        "authors", 512, 400)
    assert headline["subset"] == beside["subset"] == "valid"
    assert not (save / "test_ppl.json").exists()
    proc = script("wikitext103", "evaluate", "--protocol", "authors", ok=False, **env)
    assert proc.returncode != 0 and "--protocol given twice" in proc.stderr, proc.output
    assert not (save / "test_ppl.json").exists()


def test_evaluate_exits_non_zero_when_the_output_has_no_perplexity(wikitext, tmp_path):
    """Through the real tool: `-- --help` makes fairseq-eval-lm print its usage and exit 0."""
    checkpoint = tmp_path / "model.pt"
    checkpoint.write_bytes(b"")
    proc = run([sys.executable, "-m", "rdrop_fairseq.recipes.evaluate_lm", "--data", wikitext["bin"],
                "--checkpoint", checkpoint, "--cpu", "--", "--help"], ok=False)
    assert proc.returncode != 0
    assert "error: cannot read the perplexity" in proc.stderr, proc.output[-3000:]
    proc = run([sys.executable, "-m", "rdrop_fairseq.recipes.evaluate_lm", "--data", wikitext["bin"],
                "--checkpoint", tmp_path / "missing.pt"], ok=False)
    assert proc.returncode != 0 and "missing.pt not found: train first: bash scripts/" \
        "wikitext103.sh train" in proc.stderr, proc.stderr
