"""Reliability of R-Drop training with fairseq: resuming, mixed precision, bad input.

* Resume: an interrupted and resumed run is compared with an uninterrupted one, update by
  update (logged losses) and bit for bit (parameters and Adam state of checkpoint_last.pt).
* Mixed precision on CPU: what this fairseq can run without a GPU (bf16 through
  fairseq-hydra-train, fp16 with --fp16-no-flatten-grads), that the KL stays float32 with a
  bf16 model, and that fairseq's fp16 loss scaler skips overflowing updates with our loss.
* Bad input: infinite alpha, 1- and 3-sentence batches, a checkpoint of another criterion,
  corrupted or missing checkpoints given to resume and to fairseq-generate.

docs/design.md ("Reliability: resume, mixed precision, bad input") summarises the findings.
The command-line tests reuse the helpers and toy corpus of test_cli.py, the in-process ones
the tiny models of test_criteria.py.
"""

import logging
import math
import random
import shutil
import sys

import pytest
import torch

import rdrop_fairseq  # noqa: F401  (the checkpoint allow-list, for torch.load below)
from tests.test_cli import (  # noqa: F401  (translation_data, user_dir: fixtures)
    REPO,
    check_ok,
    generate_args,
    parse_hypotheses,
    parse_stats,
    positive_finite,
    run,
    tail,
    tool,
    translation_data,
    translation_train_cmd,
    user_dir,
)
from tests.test_criteria import doubled, translation_case

# translation_data: 300 training pairs; --max-tokens 400 makes 6 updates an epoch
UPDATES_PER_EPOCH = 6
TIMING_KEYS = {"wps", "ups", "wall", "train_wall"}


def rdrop_cmd(data_bin, user_dir, save_dir, max_update, *extra):
    """The tiny R-Drop translation run (alpha 5, dropout 0.1), logging every update."""
    return translation_train_cmd(data_bin, user_dir, save_dir, max_update, "--dropout", "0.1",
                                 "--rdrop-alpha", "5", "--log-interval", "1", *extra)


def per_update(proc):
    """``{num_updates: logged train_inner values}``, without the timings."""
    return {int(line["num_updates"]): {k: v for k, v in line.items() if k not in TIMING_KEYS}
            for line in parse_stats(proc.stdout)["train_inner"]}


def load(path):
    return torch.load(path, map_location="cpu")


def assert_same_training_state(resumed_path, reference_path):
    """Same parameters and Adam state, bit for bit, and the same position in the data."""
    a, b = load(resumed_path), load(reference_path)
    assert a["model"].keys() == b["model"].keys()
    for name, tensor in b["model"].items():
        assert torch.equal(a["model"][name], tensor), (
            f"{name} differs: max |diff| "
            f"{(a['model'][name].double() - tensor.double()).abs().max().item():.3g}"
        )
    state_a, state_b = a["last_optimizer_state"]["state"], b["last_optimizer_state"]["state"]
    assert state_a.keys() == state_b.keys()
    for key in state_b:
        for field, value in state_b[key].items():
            other = state_a[key][field]
            assert torch.equal(other, value) if torch.is_tensor(value) else other == value, (
                f"Adam state {key}.{field} differs")
    assert a["optimizer_history"][-1]["num_updates"] == b["optimizer_history"][-1]["num_updates"]
    assert a["extra_state"]["train_iterator"] == b["extra_state"]["train_iterator"]


def check_resumed(proc, checkpoint, updates, epoch):
    loaded = f"Loaded checkpoint {checkpoint} (epoch {epoch} @ {updates} updates)"
    assert loaded in proc.stdout, "did not resume" + tail(proc)


def assert_same_updates(resumed, reference, first, last):
    got, want = per_update(resumed), per_update(reference)
    assert sorted(got) == list(range(first, last + 1)), tail(resumed)
    for update in range(first, last + 1):
        assert got[update] == want[update], f"update {update}: {got[update]} != {want[update]}"
        assert positive_finite(got[update]["rdrop_kl"])


# --------------------------------------------------------------------------- 1. resume


@pytest.fixture(scope="module")
def full_run(translation_data, user_dir, tmp_path_factory):
    """Uninterrupted: 15 updates (2.5 epochs), fairseq's default data iteration."""
    save_dir = tmp_path_factory.mktemp("full")
    proc = check_ok(run(rdrop_cmd(translation_data, user_dir, save_dir, 15), cwd=save_dir))
    return proc, save_dir


def test_resume_within_the_first_epoch_is_bit_exact(full_run, translation_data, user_dir,
                                                     tmp_path):
    """Stop after 3 updates (mid-epoch: the iterator position is saved), resume to 15:
    updates 4-15 log the same values and end with the same parameters and Adam state
    (fairseq reseeds dropout with seed + num_updates before every update)."""
    full, full_dir = full_run
    save_dir = tmp_path / "ckpt"
    check_ok(run(rdrop_cmd(translation_data, user_dir, save_dir, 3), cwd=tmp_path))
    iterator = load(save_dir / "checkpoint_last.pt")["extra_state"]["train_iterator"]
    assert iterator["epoch"] == 1 and iterator["iterations_in_epoch"] == 3, iterator

    resumed = check_ok(run(rdrop_cmd(translation_data, user_dir, save_dir, 15), cwd=tmp_path))
    check_resumed(resumed, save_dir / "checkpoint_last.pt", updates=3, epoch=1)
    assert_same_updates(resumed, full, 4, 15)
    assert_same_training_state(save_dir / "checkpoint_last.pt", full_dir / "checkpoint_last.pt")


def test_fairseq_builds_the_batches_from_the_epoch_it_starts_in(translation_data):
    """Why resuming in a later epoch is *not* exact with fairseq's defaults (nothing to do
    with R-Drop): fairseq 0.12.3's FairseqTask.get_batch_iterator sorts examples by length
    breaking ties with numpy_seed(seed + epoch) and, with the default reusable iterator,
    freezes those batches for the whole run. An uninterrupted run keeps the batches of
    epoch 1; a run resumed in epoch 3 builds them with seed + 3, so after resuming, batches
    of the same sizes hold other sentences (the parameters, optimizer state and dropout
    seeds are restored exactly). Fails the day fairseq stops doing this."""
    from fairseq import options, tasks
    from fairseq.dataclass.utils import convert_namespace_to_omegaconf

    args = options.parse_args_and_arch(options.get_training_parser(), [
        str(translation_data), "--task", "translation", "--source-lang", "de",
        "--target-lang", "en", "--arch", "transformer_iwslt_de_en", "--cpu"])
    cfg = convert_namespace_to_omegaconf(args)

    def batches_of_epoch(epoch, start_epoch):
        task = tasks.setup_task(cfg.task)
        task.load_dataset("train")
        itr = task.get_batch_iterator(task.dataset("train"), max_tokens=400, seed=1,
                                      epoch=start_epoch, ignore_invalid_inputs=True,
                                      required_batch_size_multiple=8)
        while True:
            batches = [frozenset(sample["id"].tolist()) for sample in itr.next_epoch_itr()]
            if itr.epoch == epoch:
                return batches

    uninterrupted = batches_of_epoch(3, start_epoch=1)
    resumed = batches_of_epoch(3, start_epoch=3)
    assert len(uninterrupted) == len(resumed) == UPDATES_PER_EPOCH
    assert batches_of_epoch(1, start_epoch=1) == batches_of_epoch(1, start_epoch=1)
    assert set(uninterrupted) != set(resumed), "fairseq now rebuilds batches consistently"
    assert sorted(map(len, uninterrupted)) == sorted(map(len, resumed))
    # with the default --required-batch-size-multiple 8, a few sentences (4 here) are in no
    # batch at all; which ones also depends on the epoch the run started in
    seen, seen_resumed = set().union(*uninterrupted), set().union(*resumed)
    assert len(seen) == len(seen_resumed) < 300 and seen != seen_resumed


REBUILT_BATCHES = ("--update-epoch-batch-itr", "True", "--save-interval-updates", "9")


@pytest.fixture(scope="module")
def full_run_rebuilt_batches(translation_data, user_dir, tmp_path_factory):
    """Uninterrupted: 18 updates (3 epochs) with --update-epoch-batch-itr True (batches
    built per epoch), saving a mid-epoch checkpoint every 9 updates."""
    save_dir = tmp_path_factory.mktemp("full_rebuilt")
    proc = check_ok(run(rdrop_cmd(translation_data, user_dir, save_dir, 18,
                                  *REBUILT_BATCHES), cwd=save_dir))
    return proc, save_dir


@pytest.mark.parametrize("checkpoint,updates,epoch", [
    ("checkpoint2.pt", 12, 3),  # saved at the end of epoch 2 (the iterator says epoch 3)
    ("checkpoint_2_9.pt", 9, 2),  # saved mid-epoch 2, by --save-interval-updates
])
def test_resume_in_a_later_epoch_is_bit_exact_with_update_epoch_batch_itr(
        full_run_rebuilt_batches, translation_data, user_dir, tmp_path, checkpoint, updates,
        epoch):
    """A crash after a saved checkpoint, then a restart of the same command: with fairseq's
    --update-epoch-batch-itr True each epoch's batches depend only on the epoch, and a run
    resumed after an epoch boundary or mid-epoch matches the uninterrupted one exactly."""
    full, full_dir = full_run_rebuilt_batches
    save_dir = tmp_path / "ckpt"
    save_dir.mkdir()
    shutil.copy(full_dir / checkpoint, save_dir / "checkpoint_last.pt")
    resumed = check_ok(run(rdrop_cmd(translation_data, user_dir, save_dir, 18,
                                     *REBUILT_BATCHES), cwd=tmp_path))
    check_resumed(resumed, save_dir / "checkpoint_last.pt", updates=updates, epoch=epoch)
    assert_same_updates(resumed, full, updates + 1, 18)
    assert_same_training_state(save_dir / "checkpoint_last.pt", full_dir / "checkpoint_last.pt")


# --------------------------------------------------------------------------- 2. precision


def hydra_bf16_cmd(data_bin, user_dir, save_dir, max_update):
    return [
        tool("fairseq-hydra-train"), "--config-dir", REPO / "configs",
        "--config-name", "transformer_iwslt_de_en_rdrop",
        f"common.user_dir={user_dir}", f"task.data={data_bin}", "common.cpu=true",
        "common.bf16=true", "common.seed=1", "common.log_interval=1",
        "common.no_progress_bar=true", "dataset.num_workers=0", "dataset.max_tokens=400",
        f"optimization.max_update={max_update}", "optimization.lr=[0.003]",
        "lr_scheduler.warmup_updates=20", "task.eval_bleu=false",
        "checkpoint.best_checkpoint_metric=loss",
        "checkpoint.maximize_best_checkpoint_metric=false",
        f"checkpoint.save_dir={save_dir}", "checkpoint.no_epoch_checkpoints=true",
        "model.encoder_layers=1", "model.decoder_layers=1", "model.encoder_embed_dim=64",
        "model.decoder_embed_dim=64", "model.encoder_ffn_embed_dim=64",
        "model.decoder_ffn_embed_dim=64", "model.dropout=0.1",
    ]


def test_bf16_flag_of_fairseq_train_needs_a_tpu(translation_data, user_dir, tmp_path):
    """fairseq-train --bf16 implies --tpu (fairseq/options.py), which needs torch_xla: on a
    CPU (or GPU) the command-line flag cannot be used, whatever the criterion."""
    proc = run(rdrop_cmd(translation_data, user_dir, tmp_path / "ckpt", 3, "--bf16"),
               cwd=tmp_path)
    assert proc.returncode != 0, "fairseq-train --bf16 --cpu ran" + tail(proc)
    assert "xla_device" in proc.stderr, tail(proc)
    assert "train_inner" not in proc.stdout


def test_bf16_training_on_cpu_through_hydra(translation_data, user_dir, tmp_path):
    """common.bf16=true without tpu (possible through fairseq-hydra-train): a bfloat16 model,
    fp32 master weights (FP16Optimizer, no loss scaler). 300 updates, all finite, learning."""
    save_dir = tmp_path / "ckpt"
    proc = check_ok(run(hydra_bf16_cmd(translation_data, user_dir, save_dir, 300), cwd=tmp_path))
    stats = parse_stats(proc.stdout)
    lines = stats["train_inner"]
    assert len(lines) == 300, tail(proc)
    for line in lines + stats["train"]:
        assert positive_finite(line.get("rdrop_kl")), f"bad rdrop_kl in {line}"
        for key in ("loss", "nll_loss", "gnorm"):
            assert math.isfinite(line[key]), f"bad {key} in {line}"
    assert lines[-1]["loss"] < lines[0]["loss"] - 2, "bf16 training did not learn"
    assert stats["valid"] and all(math.isfinite(line["loss"]) for line in stats["valid"])
    state = load(save_dir / "checkpoint_last.pt")
    assert state["cfg"]["common"]["bf16"] and not state["cfg"]["common"]["tpu"]
    assert state["optimizer_history"][-1]["optimizer_name"] == "FP16Optimizer"
    assert "loss_scale" not in lines[-1]  # no loss scaling with bf16
    # fairseq saves float32 weights (utils.move_to_cpu upcasts bf16/fp16 tensors)
    assert {t.dtype for t in state["model"].values()} == {torch.float32}


def test_fp16_training_on_cpu(translation_data, user_dir, tmp_path):
    """--fp16 --cpu needs --fp16-no-flatten-grads (the flattened fp32 copy is built with
    torch.cuda.current_device()); then the loss-scaled path runs with our criterion."""
    proc = check_ok(run(rdrop_cmd(translation_data, user_dir, tmp_path / "ckpt", 30, "--fp16",
                                  "--fp16-no-flatten-grads", "--no-save"), cwd=tmp_path))
    lines = parse_stats(proc.stdout)["train_inner"]
    assert len(lines) == 30, tail(proc)
    for line in lines:
        assert positive_finite(line["rdrop_kl"]) and math.isfinite(line["loss"]), line
        assert line["loss_scale"] > 0, line


def test_kl_of_a_bf16_model_is_computed_in_float32():
    """With a bfloat16 transformer, the logged KL equals the float64 KL of the *same* bf16
    logits to ~6e-8 (relative), while the same computation kept in bf16 is off by ~5e-4."""
    case = translation_case()
    torch.manual_seed(0)
    model = case.build_model(dropout=0.1).to(torch.bfloat16)
    model.train()
    sample = case.make_sample()
    logits = []
    # a copy: the criterion may write the logits' gradient into their buffer (grad_in_scores)
    hook = model.decoder.register_forward_hook(
        lambda m, i, out: logits.append(out[0].detach().clone()))
    torch.manual_seed(3)
    loss, _, logs = case.ours(alpha=5.0)(model, sample)
    hook.remove()
    loss.backward()

    assert logits[0].dtype == torch.bfloat16 and logits[0].size(0) == 2 * sample["nsentences"]
    assert loss.dtype == logs["rdrop_kl"].dtype == torch.float32
    keep = sample["target"].ne(case.task.target_dictionary.pad())

    def symmetric_kl(lprobs):
        p_log, q_log = lprobs.chunk(2)
        return (0.5 * ((p_log.exp() - q_log.exp()) * (p_log - q_log)).sum(-1))[keep].sum()

    reference = symmetric_kl(logits[0].double().log_softmax(-1)).item()
    in_bf16 = symmetric_kl(logits[0].log_softmax(-1)).item()
    ours = logs["rdrop_kl"].item()
    assert reference > 0.1
    assert abs(ours - reference) <= 1e-6 * reference, (ours, reference)
    assert abs(in_bf16 - reference) > 1e-4 * reference, (in_bf16, reference)
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    assert grads and all(g.dtype == torch.bfloat16 and torch.isfinite(g).all() for g in grads)


def fp16_trainer(init_scale):
    """fairseq's Trainer with --fp16 --fp16-no-flatten-grads on the tiny translation model."""
    from fairseq.trainer import Trainer

    case = translation_case()
    torch.manual_seed(0)
    model = case.build_model(dropout=0.1)
    criterion = case.ours(alpha=5.0)
    case.cfg.common.fp16 = True
    case.cfg.common.fp16_no_flatten_grads = True
    case.cfg.common.fp16_init_scale = init_scale
    trainer = Trainer(case.cfg, case.task, model, criterion)
    return trainer, model, case.make_sample()


def test_fp16_overflow_is_skipped_by_fairseqs_loss_scaler(monkeypatch, caplog):
    """A loss scale of 2**20 overflows the fp16 gradients of our loss: fairseq's scaler
    detects it, the update is skipped (parameters, fp32 master copy and update count
    untouched) and the scale halved, until an update goes through.

    fairseq's overflow handler ends with ``torch.tensor(0.0).cuda()`` (trainer.py), which a
    CPU-only torch cannot run (see the next test); it is made a no-op here so the rest of
    the handler runs as it would on a GPU."""
    monkeypatch.setattr(torch.Tensor, "cuda", lambda self, *args, **kwargs: self)
    trainer, model, sample = fp16_trainer(init_scale=2 ** 20)
    assert next(model.parameters()).dtype == torch.float16
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    master_before = [p.detach().clone() for p in trainer.optimizer.fp32_params]
    scales = []
    with caplog.at_level(logging.INFO, logger="fairseq.trainer"):
        while trainer.get_num_updates() == 0:
            scale = trainer.optimizer.scaler.loss_scale
            logs = trainer.train_step([sample])
            if trainer.get_num_updates() == 0:
                assert logs is None  # skipped
                assert trainer.optimizer.scaler.loss_scale == scale / 2
                for name, p in model.named_parameters():
                    assert torch.equal(p, before[name]), f"{name} changed by a skipped update"
                for p, p0 in zip(trainer.optimizer.fp32_params, master_before):
                    assert torch.equal(p, p0)
                scales.append(scale)
            assert len(scales) < 12, "the loss scale kept overflowing"
    assert len(scales) >= 3, f"expected overflows to start with, got {scales}"
    assert caplog.text.count("gradient overflow detected, ignoring gradient") == len(scales)
    assert logs["loss"] > 0 and positive_finite(float(logs["rdrop_kl"]))
    changed = [n for n, p in model.named_parameters() if not torch.equal(p, before[n])]
    assert changed and all(torch.isfinite(p).all() for p in model.parameters())


@pytest.mark.skipif(torch.backends.cuda.is_built(),
                    reason="about a torch built without CUDA (fairseq's handler calls .cuda())")
def test_fp16_overflow_handling_needs_cuda_in_this_fairseq(caplog):
    """Without the patch above: the overflow is detected, then fairseq's handler fails on a
    CPU-only torch. Documents why fp16 loss scaling cannot be relied on with --cpu here."""
    trainer, model, sample = fp16_trainer(init_scale=2 ** 20)
    with caplog.at_level(logging.INFO, logger="fairseq.trainer"):
        with pytest.raises(AssertionError, match="not compiled with CUDA"):
            trainer.train_step([sample])
    assert "gradient overflow detected, ignoring gradient" in caplog.text


# --------------------------------------------------------------------------- 3. bad input


def test_infinite_rdrop_alpha_fails_before_training(translation_data, user_dir, tmp_path):
    """(-1 and nan are tested in test_cli.py; inf passes argparse's float() too.)"""
    save_dir = tmp_path / "ckpt"
    proc = run(translation_train_cmd(translation_data, user_dir, save_dir, 3,
                                     "--rdrop-alpha", "inf"), cwd=tmp_path)
    assert proc.returncode != 0, "--rdrop-alpha inf was accepted" + tail(proc)
    # refused while fairseq parses its options: argparse's one line, no save dir
    assert "argument --rdrop-alpha: must be a finite number >= 0, got inf" in proc.stderr, \
        tail(proc)
    assert "train_inner" not in proc.output and not save_dir.exists()


@pytest.mark.parametrize("n", [1, 3])
def test_one_and_three_sentence_batches_follow_the_formula(n):
    """The loss of a batch of n sentences is the formula (float64 reference, same dropout
    masks), normalised by the n sentences' tokens."""
    case = translation_case()
    torch.manual_seed(0)
    model = case.build_model(dropout=0.3)
    model.train()
    full = case.make_sample()
    pad = case.task.target_dictionary.pad()
    sample = {"net_input": {k: v[:n] for k, v in full["net_input"].items()},
              "target": full["target"][:n], "nsentences": n}
    sample["ntokens"] = int(sample["target"].ne(pad).sum())

    torch.manual_seed(5)
    loss, sample_size, logs = case.ours(alpha=5.0)(model, sample)
    torch.manual_seed(5)
    with torch.no_grad():
        ref_loss, ref_kl = case.reference(model, doubled(sample), 5.0)
    assert ref_kl > 1e-6  # the passes differ
    torch.testing.assert_close(loss.double(), ref_loss, rtol=2e-5, atol=1e-5)
    torch.testing.assert_close(logs["rdrop_kl"].double(), ref_kl, rtol=2e-5, atol=1e-6)
    assert sample_size == logs["sample_size"] == sample["ntokens"]
    assert logs["nsentences"] == n
    loss.backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)


@pytest.mark.parametrize("n", [1, 3])
def test_one_and_three_sentence_batches_train(translation_data, user_dir, tmp_path, n):
    proc = check_ok(run(rdrop_cmd(translation_data, user_dir, tmp_path, 6, "--batch-size",
                                  str(n), "--required-batch-size-multiple", "1", "--no-save"),
                        cwd=tmp_path))
    lines = parse_stats(proc.stdout)["train_inner"]
    assert len(lines) == 6, tail(proc)
    for line in lines:
        assert line["bsz"] == n and positive_finite(line["rdrop_kl"]), line


def test_checkpoint_of_another_criterion(translation_data, user_dir, tmp_path):
    """A baseline (label_smoothed_cross_entropy) checkpoint continued with R-Drop.

    Same save dir, same command otherwise: fairseq refuses to restore an optimizer saved
    under another criterion (an assertion naming --reset-optimizer), before training and
    without touching the checkpoint. With --reset-optimizer, or --finetune-from-model into
    a new save dir, the baseline's weights are loaded (checkpoints are ordinary models) and
    R-Drop training starts from them, counting updates from 0."""
    base_dir = tmp_path / "base"
    base = check_ok(run(translation_train_cmd(
        translation_data, user_dir, base_dir, 12, "--criterion", "label_smoothed_cross_entropy",
        "--dropout", "0.1", "--log-interval", "1", "--no-epoch-checkpoints"), cwd=tmp_path))
    base_lines = parse_stats(base.stdout)["train_inner"]
    assert "rdrop_kl" not in base_lines[-1]
    checkpoint = base_dir / "checkpoint_last.pt"
    saved = checkpoint.read_bytes()

    refused = run(rdrop_cmd(translation_data, user_dir, base_dir, 18), cwd=tmp_path)
    assert refused.returncode != 0, "resumed another criterion's optimizer" + tail(refused)
    assert ("Criterion does not match; please reset the optimizer (--reset-optimizer). "
            "LabelSmoothedCrossEntropyCriterion vs LabelSmoothedCrossEntropyRDropCriterion"
            in refused.stderr), tail(refused)
    assert "train_inner" not in refused.stdout
    assert checkpoint.read_bytes() == saved

    def check_started_from_baseline(proc):
        lines = parse_stats(proc.stdout)["train_inner"]
        assert [line["num_updates"] for line in lines] == [1, 2, 3], tail(proc)
        assert all(positive_finite(line["rdrop_kl"]) for line in lines)
        # first loss: the baseline's level after 12 updates, not a fresh model's
        assert abs(lines[0]["loss"] - base_lines[-1]["loss"]) < 0.5, (lines[0], base_lines[-1])
        assert lines[0]["loss"] < base_lines[0]["loss"] - 2, (lines[0], base_lines[0])

    finetune = check_ok(run(rdrop_cmd(translation_data, user_dir, tmp_path / "rdrop", 3,
                                      "--finetune-from-model", checkpoint), cwd=tmp_path))
    assert f"loading pretrained model from {checkpoint}" in finetune.stdout, tail(finetune)
    check_started_from_baseline(finetune)

    # last: this one writes its checkpoints over the baseline's
    reset = check_ok(run(rdrop_cmd(translation_data, user_dir, base_dir, 3, "--reset-optimizer"),
                         cwd=tmp_path))
    assert f"Loaded checkpoint {checkpoint} (epoch 3 @ 0 updates)" in reset.stdout, tail(reset)
    check_started_from_baseline(reset)


def corrupt(source, kind, dest):
    data = source.read_bytes()
    dest.parent.mkdir(parents=True, exist_ok=True)
    dest.write_bytes({"truncated": data[: len(data) // 2],
                      "random_bytes": random.Random(0).randbytes(4096),
                      "empty": b""}[kind])
    return dest


# What torch 2.13 raises for each (no message names the file; fairseq logs the path on the
# line before the traceback). The random-bytes message wrongly suggests weights_only=False.
CORRUPTION_ERRORS = {
    "truncated": "RuntimeError: PytorchStreamReader failed reading zip archive",
    "random_bytes": "UnpicklingError: Weights only load failed",
    "empty": "EOFError",
}


def check_load_failure(proc, log_line, kind):
    assert proc.returncode != 0, "a corrupted checkpoint was loaded" + tail(proc)
    lines = proc.output.splitlines()
    logged = [i for i, line in enumerate(lines) if line.rstrip().endswith(log_line)]
    assert logged, f"the path is not in the output ({log_line!r})" + tail(proc)
    after = "\n".join(lines[logged[-1]:])
    assert "Traceback" in after and CORRUPTION_ERRORS[kind] in after, tail(proc)


@pytest.mark.parametrize("kind", list(CORRUPTION_ERRORS))
def test_corrupted_checkpoint_stops_resume(full_run, translation_data, user_dir, tmp_path, kind):
    """A corrupted checkpoint_last.pt is an error, never a silent start from scratch."""
    save_dir = tmp_path / "ckpt"
    checkpoint = corrupt(full_run[1] / "checkpoint_last.pt", kind, save_dir / "checkpoint_last.pt")
    saved = checkpoint.read_bytes()
    proc = run(rdrop_cmd(translation_data, user_dir, save_dir, 18), cwd=tmp_path)
    check_load_failure(proc, f"Preparing to load checkpoint {checkpoint}", kind)
    assert "begin training epoch" not in proc.output and "train_inner" not in proc.output
    assert "No existing checkpoint found" not in proc.output
    assert checkpoint.read_bytes() == saved
    assert sorted(p.name for p in save_dir.iterdir()) == ["checkpoint_last.pt"]


@pytest.mark.parametrize("kind", list(CORRUPTION_ERRORS))
def test_corrupted_checkpoint_stops_generate(full_run, translation_data, user_dir, tmp_path,
                                             kind):
    checkpoint = corrupt(full_run[1] / "checkpoint_last.pt", kind, tmp_path / "model.pt")
    proc = run([tool("fairseq-generate"), *generate_args(translation_data, checkpoint),
                "--user-dir", user_dir], cwd=tmp_path)
    check_load_failure(proc, f"loading model(s) from {checkpoint}", kind)
    assert not parse_hypotheses(proc.stdout)


def test_missing_restore_file_trains_from_scratch_but_finetune_from_model_fails(
        translation_data, user_dir, tmp_path):
    """fairseq's behaviour for a checkpoint that does not exist: --restore-file (like a
    missing checkpoint_last.pt) silently starts from scratch, with an INFO line;
    --finetune-from-model refuses. Pinned because it is the one way a typo trains from
    scratch."""
    missing = tmp_path / "missing.pt"
    proc = check_ok(run(rdrop_cmd(translation_data, user_dir, tmp_path / "a", 2, "--no-save",
                                  "--restore-file", missing), cwd=tmp_path))
    assert f"No existing checkpoint found {missing}" in proc.stdout, tail(proc)
    assert [line["num_updates"] for line in parse_stats(proc.stdout)["train_inner"]] == [1, 2]

    proc = run(rdrop_cmd(translation_data, user_dir, tmp_path / "b", 2, "--no-save",
                         "--finetune-from-model", missing), cwd=tmp_path)
    assert proc.returncode != 0 and "train_inner" not in proc.stdout, tail(proc)
    assert f"--finetune-from-model {missing} does not exist" in proc.stderr, tail(proc)


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q", "-p", "no:cacheprovider"]))
