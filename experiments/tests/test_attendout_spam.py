"""The AttendOut real-weights check (experiments.prepare_spam_assassin,
experiments.attendout_spam_check) on a stand-in package built here: e-mail parsing, the
split, the committed derivative, and the training commands of the four modes."""

import argparse
import json
import tarfile
from pathlib import Path

from experiments import attendout_spam_check, prepare_spam_assassin

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


def test_committed_derivative_is_not_saturated_by_construction():
    counts = {s: len(prepare_spam_assassin.read_split(prepare_spam_assassin.OUT, s))
              for s in ("train", "valid", "test")}
    assert counts == {"train": 80, "valid": 100, "test": 309}


def test_training_commands_of_the_four_modes(tmp_path):
    args = argparse.Namespace(
        epochs=10, batch_size=16, lr=3e-5, alpha=1.0, interval=10, generator_lr=5e-5)
    cmds = {mode: [str(c) for c in attendout_spam_check.train_command(
                mode, 1, tmp_path / "bin", tmp_path / "enc", tmp_path / mode, args)]
            for mode in attendout_spam_check.MODES}

    def value(cmd, flag):
        return cmd[cmd.index(flag) + 1]

    assert value(cmds["baseline"], "--task") == "sentence_prediction"
    assert value(cmds["baseline"], "--arch") == "roberta"
    assert value(cmds["rdrop"], "--criterion") == "sentence_prediction_rdrop"
    assert value(cmds["attendout"], "--task") == "sentence_prediction_attendout"
    assert value(cmds["attendout"], "--criterion") == "sentence_prediction"
    assert value(cmds["attendout_rdrop"], "--rdrop-alpha") == "1.0"
    assert value(cmds["attendout_rdrop"], "--arch") == "roberta_attendout"
    assert value(cmds["attendout"], "--attendout-generator-lr") == "5e-05"
    for cmd in cmds.values():
        assert value(cmd, "--max-update") == "50" and "--reset-optimizer" in cmd
    (tmp_path / "baseline").mkdir()
    (tmp_path / "baseline" / "checkpoint_last.pt").write_text("")
    resumed = attendout_spam_check.train_command("baseline", 1, tmp_path / "bin",
                                                  tmp_path / "enc", tmp_path / "baseline", args)
    assert "--restore-file" not in resumed  # fairseq resumes from checkpoint_last.pt
