"""The translation recipe end to end on a tiny slice: prepare -> train -> average -> evaluate,
and what each --mode turns into."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))
import train_translation  # noqa: E402
from evaluate_translation import metric_for  # noqa: E402
from toy_data import write_corpus  # noqa: E402

TINY_MODEL = [f"model.{side}_{k}={v}" for side in ("encoder", "decoder")
              for k, v in (("layers", 1), ("embed_dim", 32), ("ffn_embed_dim", 64),
                           ("attention_heads", 2))]


def run(cmd, **kw):
    env = {"PATH": str(Path(sys.executable).parent), "OMP_NUM_THREADS": "1", "HOME": "/tmp"}
    proc = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=600,
                          env=env, **kw)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return proc.stdout


@pytest.fixture
def overrides(tmp_path):
    """The fairseq-hydra-train command a --mode turns into (no training)."""
    (tmp_path / "dict.de.txt").write_text("")  # parse_args insists on a data-bin

    def command(mode, *extra):
        a = train_translation.parse_args(["iwslt", "--data", str(tmp_path), "--save-dir",
                                          str(tmp_path / "save"), "--mode", mode, *extra])
        return train_translation.hydra_command(a)
    return command


@pytest.mark.parametrize("mode, expected, absent", [
    ("rdrop", ["dataset.max_tokens=4096"], ["criterion.rdrop_alpha=0.0"]),
    ("baseline", ["criterion.rdrop_alpha=0.0", "dataset.max_tokens=4096"], ["rdrop_two_passes"]),
    ("no-kl", ["criterion.rdrop_alpha=0.0", "criterion.rdrop_two_passes=true",
               "dataset.max_tokens=4096"], []),
    ("doubled-batch", ["criterion.rdrop_alpha=0.0", "dataset.max_tokens=8192"],
     ["rdrop_two_passes"]),
])
def test_modes_map_to_the_paper_settings(overrides, mode, expected, absent):
    cmd = overrides(mode)
    for item in expected:
        assert item in cmd
    assert not [c for c in cmd if any(a in c for a in absent)]


def test_alpha_with_a_kl_free_mode_is_refused(overrides):
    with pytest.raises(SystemExit, match="contradicts"):
        overrides("baseline", "--alpha", "5")


def test_paper_metrics_per_recipe_and_pair():
    assert metric_for("iwslt", "de", "en") == "tokenized"
    assert metric_for("iwslt", "en", "de") == "tokenized"
    assert metric_for("iwslt", "en", "fr") == "sacrebleu"
    assert metric_for("wmt14", "en", "de") == "tokenized+compound"
    assert metric_for("wmt14", "en", "fr") == "tokenized"


def test_recipe_end_to_end_on_a_tiny_slice(tmp_path):
    write_corpus(tmp_path / "raw", {"train": 300, "valid": 20, "test": 20}, vocab=30,
                 max_len=8)
    prep = tmp_path / "prep"
    run([sys.executable, REPO / "scripts" / "prepare_translation.py", "--raw", tmp_path / "raw",
         "--out", prep, "--bpe-merges", "30"])
    save = tmp_path / "ckpt"
    out = run([sys.executable, REPO / "scripts" / "train_translation.py", "iwslt",
               "--data", prep / "bin", "--save-dir", save, "--max-update", "6",
               "--max-tokens", "4096", "--cpu", "--", *TINY_MODEL,
               "task.eval_bleu_args='{\"beam\": 1, \"max_len_b\": 10}'", "common.log_interval=1"])
    kls = [float(x) for x in re.findall(r"rdrop_kl=([\d.]+)", out)]
    assert len(kls) == 6 and all(k > 0 for k in kls), out[-3000:]
    assert re.search(r"valid on 'valid' subset .*\| bleu [\d.]+", out), out[-3000:]
    epochs = sorted(save.glob("checkpoint[0-9]*.pt"))
    assert len(epochs) >= 2

    avg = tmp_path / "avg.pt"
    out = run([sys.executable, REPO / "scripts" / "average_checkpoints.py", "--inputs", save,
               "--num-epoch-checkpoints", "2", "--output", avg])
    assert "averaged 2 checkpoints" in out

    out = run([sys.executable, REPO / "scripts" / "evaluate_translation.py", "iwslt",
               "--data", prep / "bin", "--checkpoint", avg, "--src", "de", "--tgt", "en",
               "--cpu", "--out", tmp_path / "gen.txt"])
    m = re.search(r"test: (\d+) sentences, tokenized BLEU \(tokenized\) = ([\d.]+)", out)
    assert m and int(m[1]) == 20 and 0 <= float(m[2]) <= 100, out
    assert len(re.findall(r"^H-\d+", (tmp_path / "gen.txt").read_text(), re.M)) == 20


def test_prepare_iwslt_follows_fairseqs_iwslt14_recipe(tmp_path):
    import tarfile

    orig = tmp_path / "src" / "de-en"
    orig.mkdir(parents=True)
    train = {"de": [], "en": []}
    for lang, word in (("de", "Haus"), ("en", "House")):
        lines = ["<url>http://www.ted.com/talks/x</url>", "<talkid>1</talkid>",
                 "<keywords>talks</keywords>", f"<title>{word} Titel</title>",
                 f"<description>{word} Beschreibung</description>"]
        lines += [f"{word} Nummer {i} ." for i in range(46)]
        (orig / f"train.tags.de-en.{lang}").write_text("\n".join(lines) + "\n")
        train[lang] = lines
        for name, n in (("IWSLT14.TED.tst2011", 2), ("IWSLT14.TED.dev2010", 1),
                        ("IWSLT14.TEDX.dev2012", 1), ("IWSLT14.TED.tst2010", 1)):
            segs = "".join(f'<seg id="{i}"> {word} {name} {i} it\u2019s </seg>\n'
                           for i in range(1, n + 1))
            (orig / f"{name}.de-en.{lang}.xml").write_text(f"<doc>\n{segs}</doc>\n")
    archive = tmp_path / "de-en.tgz"
    with tarfile.open(archive, "w:gz") as tar:
        tar.add(orig, arcname="de-en")

    out = tmp_path / "iwslt"
    run([sys.executable, REPO / "scripts" / "prepare_iwslt.py", "--archive", archive,
         "--src", "de", "--tgt", "en", "--out", out, "--bpe-merges", "20"])
    raw_train = (out / "raw" / "train.en").read_text().splitlines()
    assert raw_train[:2] == ["House Titel", "House Beschreibung"]  # tags stripped, markup gone
    assert len(raw_train) == 48
    test = (out / "tok" / "test.en").read_text().splitlines()
    assert [t.split()[1] for t in test] == [  # dev sets, then tst sets by year
        "iwslt14.ted.dev2010", "iwslt14.tedx.dev2012", "iwslt14.ted.tst2010",
        "iwslt14.ted.tst2011", "iwslt14.ted.tst2011"]
    assert test[0].endswith("it 's")  # ’ -> ' then Moses tokenisation, lower-cased
    valid = (out / "tok" / "valid.en").read_text().splitlines()
    train_tok = (out / "tok" / "train.en").read_text().splitlines()
    assert valid == ["house nummer 20 .", "house nummer 43 ."]  # lines 23 and 46 (awk NR%23)
    assert len(train_tok) == 46 and not set(valid) & set(train_tok)
    assert (out / "bin" / "test.de-en.de.bin").is_file()


def test_average_checkpoints_is_the_mean_of_the_float_parameters(tmp_path):
    import argparse

    import torch

    from average_checkpoints import average, last_checkpoints

    for i, scale in enumerate((1.0, 2.0, 6.0), start=1):
        torch.save({"model": {"w": torch.full((2, 2), scale), "h": torch.tensor([scale]).half(),
                              "steps": torch.tensor([i])},
                    "cfg": {"model": argparse.Namespace(arch="x")},
                    "last_optimizer_state": {"m": 1}, "extra_state": {"epoch": i}},
                   tmp_path / f"checkpoint{i}.pt")
    (tmp_path / "checkpoint_last.pt").write_bytes(b"")  # not numbered: ignored
    paths = last_checkpoints(tmp_path, 2, r"checkpoint(\d+)\.pt")
    assert [p.name for p in paths] == ["checkpoint2.pt", "checkpoint3.pt"]
    state = average(paths)
    assert torch.equal(state["model"]["w"], torch.full((2, 2), 4.0))
    assert state["model"]["h"].dtype == torch.float16 and state["model"]["h"].item() == 4.0
    assert state["model"]["steps"].item() == 2  # non-float: the first checkpoint's
    assert "last_optimizer_state" not in state and state["extra_state"] == {"epoch": 2}
    with pytest.raises(SystemExit, match="4 requested"):
        last_checkpoints(tmp_path, 4, r"checkpoint(\d+)\.pt")
