"""experiments.hf_translation_check: the batches (decoder input as fairseq's), the averaged
weights, the demo's settings in the model, and both arms end to end on tiny data in the
demo's layout, rerun without training again; its bad input."""

import json
import math
import sys
from pathlib import Path

import pytest
import torch

from experiments import hf_translation_check as check
from tests.recipe_helpers import run

REPO = Path(__file__).resolve().parents[2]

pytest.importorskip("transformers")


def test_the_decoder_reads_the_target_after_eos_as_fairseq():
    batch = check.collate([{"input_ids": torch.tensor([5, 6, 2]), "labels": torch.tensor([7, 2])},
                           {"input_ids": torch.tensor([8, 2]), "labels": torch.tensor([9, 10, 2])}],
                          pad=1, eos=2)
    assert batch["input_ids"].tolist() == [[5, 6, 2], [8, 2, 1]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1], [1, 1, 0]]
    assert batch["labels"].tolist() == [[7, 2, -100], [9, 10, 2]]
    assert batch["decoder_input_ids"].tolist() == [[2, 7, 1], [2, 9, 10]]


def test_average_is_the_mean_of_the_epochs_weights(tmp_path):
    states = [{"w": torch.tensor([1.0, 2.0]), "n": torch.tensor([3])},
              {"w": torch.tensor([3.0, 6.0]), "n": torch.tensor([3])}]
    files = []
    for i, state in enumerate(states):
        files.append(tmp_path / f"epoch{i + 1}.pt")
        torch.save(state, files[-1])
    got = check.average(files)
    assert got["w"].tolist() == [2.0, 4.0] and got["n"].tolist() == [3]
    assert check.epoch_files(tmp_path) == files


def test_the_model_has_the_demos_shape_and_shares_its_embeddings():
    from fairseq.data import Dictionary
    dictionary = Dictionary()
    for word in "a b c".split():
        dictionary.add_symbol(word)
    size = check.demo_size()
    model = check.make_model(dictionary, 1, size)
    config = model.config
    assert (config.d_model, config.encoder_layers, config.decoder_layers,
            config.encoder_ffn_dim) == (size["dim"], size["layers"], size["layers"], size["ffn"])
    assert (config.dropout, config.attention_dropout, config.activation_function) == (0.3, 0.0,
                                                                                      "relu")
    assert config.decoder_start_token_id == dictionary.eos()
    embeddings = model.get_input_embeddings().weight
    assert model.get_output_embeddings().weight.data_ptr() == embeddings.data_ptr()
    assert model.model.decoder.embed_tokens.weight.data_ptr() == embeddings.data_ptr()


PAIRS = [("das ist gut .", "that is good ."), ("das ist ein Haus .", "that is a house ."),
         ("ein Haus ist gut .", "a house is good ."), ("es ist gut .", "it is good ."),
         ("das Haus ist alt .", "the house is old ."), ("ein Baum ist alt .", "a tree is old .")]


@pytest.fixture(scope="module")
def tiny_data(tmp_path_factory):
    """The demo's layout (OUT/raw, OUT/tok, OUT/bin) for a few pairs, by its own code."""
    out = tmp_path_factory.mktemp("hf-mt") / "data"
    raw = out / "raw"
    raw.mkdir(parents=True)
    for split, pairs in (("train", PAIRS * 8), ("valid", PAIRS[:2]), ("test", PAIRS[:4])):
        for i, lang in enumerate(("de", "en")):
            (raw / f"{split}.{lang}").write_text("".join(p[i] + "\n" for p in pairs))
    run([sys.executable, "-m", "rdrop_fairseq.recipes.prepare_translation", "--raw", raw,
         "--out", out, "--bpe-merges", "20"])
    return out


def test_both_arms_end_to_end_then_reused(tiny_data, tmp_path):
    work = tmp_path / "work"
    cmd = [sys.executable, "-m", "experiments.hf_translation_check", "--work", work,
           "--data", tiny_data, "--seeds", "1", "--epochs", "3", "--jobs", "1",
           "--max-length", "12"]
    out = run(cmd).stdout
    report = json.loads((work / "results.json").read_text())
    runs = {r["mode"]: r for r in report["runs"]}
    assert set(runs) == {"baseline", "rdrop"}
    size = check.demo_size()
    for r in runs.values():
        assert r["test_sentences"] == 4 and r["updates"] == 3  # 48 pairs: one batch an epoch
        assert r["averaged"] == ["epoch1.pt", "epoch2.pt", "epoch3.pt"]  # <= the demo's 5
        assert len(r["train_loss"]) == 3 and all(math.isfinite(x) for x in r["train_loss"])
        assert 0 <= r["test_bleu_tokenized"] <= 100 and 0 <= r["test_sacrebleu"] <= 100
        assert "nrefs:1" in r["sacrebleu"] and r["seconds_per_update"] > 0
        hyps = (work / "runs" / r["run"] / "test.hyp").read_text().splitlines()
        assert len(hyps) == 4 and not any("@@" in h for h in hyps)
        assert not (work / "runs" / r["run"] / "trainer").exists()
    assert size["average"] == 5 and runs["rdrop"]["alpha"] == size["alpha"]
    # R-Drop's loss is both passes' label-smoothed CE and the KL: above the baseline's
    assert runs["rdrop"]["train_loss"][0] > 1.5 * runs["baseline"]["train_loss"][0]
    assert "| **rdrop**, mean ± std of 1 |" in out
    again = run(cmd).stdout
    assert again.count("done before, reused") == 2 and "training" not in again


@pytest.mark.parametrize("args, message", [
    (["--work", "W", "--alpha", "-1"], "--alpha must be a finite number >= 0"),
    (["--work", "W", "--epochs", "0"], "must be at least 1"),
    (["--work", "W", "--max-length", "1"], "--max-length at least 2"),
    ([], "--work (or $WORK) is required"),
])
def test_bad_arguments_are_refused_before_any_work(args, message, capsys, monkeypatch):
    monkeypatch.delenv("WORK", raising=False)
    with pytest.raises(SystemExit):
        check.parse_args(args)
    assert message in capsys.readouterr().err


def test_data_that_is_not_the_demos_is_named(tmp_path, capsys):
    with pytest.raises(SystemExit):
        check.parse_args(["--work", str(tmp_path), "--data", str(tmp_path)])
    assert "has no bin/dict.de.txt: it is the demo's prepared data" in capsys.readouterr().err


def test_the_commands_in_the_docs_parse():
    docs = (REPO / "docs" / "huggingface.md").read_text(encoding="utf-8")
    commands = [line.split("-m experiments.hf_translation_check", 1)[1].split()
                for line in docs.splitlines() if "-m experiments.hf_translation_check" in line]
    assert commands
    for args in commands:
        assert check.parse_args(args).work
