"""``rdrop_every=K`` (the paper's k-step R-Drop) in the Hugging Face trainers and
``rdrop_hf_loss``: updates 0, K, 2K, ... run R-Drop, the others one pass with the model's
own loss. K = 1 is today's loss; at K = 2 the plain updates are the model's own loss
exactly (the Trainer's label-smoothed loss under ``label_smoothing_factor``) and the R-Drop
updates today's; a real Trainer run shows the model 6 batches in 4 updates, one decision
per update under gradient accumulation, the schedule kept across a resume, and the log
counts the R-Drop updates."""

import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from transformers import BertForSequenceClassification, Trainer, TrainerCallback  # noqa: E402

from rdrop_fairseq.hf import RDropTrainer, model_kind, rdrop_hf_loss  # noqa: E402
from tests.test_hf import case, gradients, tiny_bert, training_args  # noqa: E402

NAMES = ["classification", "regression", "token-classification", "masked-lm"]


def step(compute, model, inputs, seed):
    """One training step's loss and gradient, under ``seed`` (the dropout masks)."""
    model.train()
    torch.manual_seed(seed)
    loss = compute(model, dict(inputs))
    loss.backward()
    return loss.detach(), gradients(model)


def at_update(trainer, update):
    trainer.state.global_step = update  # the updates the Trainer has made
    return trainer.compute_loss


@pytest.mark.parametrize("name", NAMES)
def test_every_two_alternates_todays_loss_and_the_models_own(tmp_path, name):
    model, inputs = case(name)
    every_two = RDropTrainer(model=model, args=training_args(tmp_path), rdrop_alpha=0.7,
                             rdrop_every=2)
    today = RDropTrainer(model=model, args=training_args(tmp_path), rdrop_alpha=0.7)
    for update in range(4):
        loss, grad = step(at_update(every_two, update), model, inputs, seed=update)
        if update % 2 == 0:
            want_loss, want_grad = step(at_update(today, update), model, inputs, seed=update)
        else:
            want_loss, want_grad = step(lambda m, i: m(**i).loss, model, inputs, seed=update)
        assert torch.equal(loss, want_loss)
        assert torch.equal(grad, want_grad)


@pytest.mark.parametrize("name", NAMES)
def test_pass_mean_halves_the_rdrop_updates_and_leaves_the_plain_ones(tmp_path, name):
    model, inputs = case(name)
    mean = RDropTrainer(model=model, args=training_args(tmp_path), rdrop_alpha=0.7,
                        rdrop_every=2, rdrop_pass_mean=True)
    today = RDropTrainer(model=model, args=training_args(tmp_path), rdrop_alpha=0.7)
    for update in range(4):
        loss, grad = step(at_update(mean, update), model, inputs, seed=update)
        if update % 2 == 0:
            want_loss, want_grad = step(at_update(today, update), model, inputs, seed=update)
            want_loss, want_grad = want_loss / 2, want_grad / 2
        else:
            want_loss, want_grad = step(lambda m, i: m(**i).loss, model, inputs, seed=update)
        torch.testing.assert_close(loss, want_loss, rtol=1e-6, atol=0)
        torch.testing.assert_close(grad, want_grad, rtol=1e-6, atol=0)


def test_pass_mean_at_alpha_zero_without_dropout_is_a_one_pass_update():
    """The option's promise: an R-Drop update at a one-pass update's scale. With both passes
    identical (no dropout) and no KL, it is the model's own update on the batch itself."""
    model = tiny_bert(BertForSequenceClassification, dropout=0.0, num_labels=3)
    inputs = case("classification")[1]
    kind = model_kind(model)
    ours, grad = step(lambda m, i: rdrop_hf_loss(m, i, kind=kind, alpha=0.0,
                                                 pass_mean=True).loss, model, inputs, seed=1)
    own, own_grad = step(lambda m, i: m(**i).loss, model, inputs, seed=1)
    torch.testing.assert_close(ours, own, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(grad, own_grad, rtol=1e-4, atol=1e-6)


def test_a_bad_pass_mean_is_refused_naming_the_option(tmp_path):
    model, _ = case("classification")
    with pytest.raises(ValueError, match=r"^rdrop_pass_mean must be True or False, got 'yes'"):
        RDropTrainer(model=model, args=training_args(tmp_path), rdrop_pass_mean="yes")


def test_a_plain_update_with_label_smoothing_is_the_trainers_own_loss(tmp_path):
    model, inputs = case("token-classification")
    args = training_args(tmp_path, label_smoothing_factor=0.1)
    ours = RDropTrainer(model=model, args=args, rdrop_every=3)
    theirs = Trainer(model=model, args=args)
    loss, grad = step(at_update(ours, 4), model, inputs, seed=3)
    want_loss, want_grad = step(theirs.compute_loss, model, inputs, seed=3)
    torch.testing.assert_close(loss, want_loss, rtol=1e-6, atol=0)
    torch.testing.assert_close(grad, want_grad, rtol=1e-5, atol=1e-8)
    assert not torch.equal(loss, step(lambda m, i: m(**i).loss, model, inputs, seed=3)[0])


class Rows(TrainerCallback):
    """The rows of every forward in training, and the logs."""

    def __init__(self, model):
        self.rows, self.logs = [], []
        model.register_forward_pre_hook(self.record, with_kwargs=True)

    def record(self, module, args, kwargs):
        if module.training:
            self.rows.append(kwargs["input_ids"].size(0))

    def on_train_begin(self, args, state, control, **kwargs):
        self.rows.clear()  # not the probe's forward when the trainer was made

    def on_log(self, args, state, control, logs=None, **kwargs):
        self.logs.append(dict(logs or {}))


def train(tmp_path, model, every, resume=None, **overrides):
    ids = torch.randint(5, 40, (16, 6), generator=torch.Generator().manual_seed(3))
    data = [{"input_ids": ids[i], "labels": torch.tensor(i % 3)} for i in range(16)]
    rows = Rows(model)
    trainer = RDropTrainer(model=model, args=training_args(tmp_path, **overrides),
                           train_dataset=data, callbacks=[rows], rdrop_every=every)
    trainer.train(resume_from_checkpoint=resume)
    return rows


def test_four_updates_at_every_two_show_the_model_six_batches_and_log_two(tmp_path):
    model, _ = case("classification")
    rows = train(tmp_path, model, 2, max_steps=4, per_device_train_batch_size=2,
                 logging_steps=4)
    assert rows.rows == [4, 2, 4, 2]
    assert [log["rdrop_updates"] for log in rows.logs if "loss" in log] == [2]


def test_the_micro_batches_of_an_update_agree(tmp_path):
    model, _ = case("classification")
    rows = train(tmp_path, model, 2, max_steps=4, per_device_train_batch_size=2,
                 gradient_accumulation_steps=2, logging_steps=2)
    assert rows.rows == [4, 4, 2, 2, 4, 4, 2, 2]
    assert [log["rdrop_updates"] for log in rows.logs if "loss" in log] == [1, 1]


def test_a_resumed_run_keeps_the_schedule(tmp_path):
    """every 3: updates 0 and 3 run R-Drop. Stopped after update 1 (a checkpoint at 2
    updates), resumed to 4: updates 2 (plain) and 3 (R-Drop); a schedule counted from the
    restart would run R-Drop at 2."""
    model, _ = case("classification")
    options = dict(per_device_train_batch_size=2, save_strategy="steps", save_steps=2)
    train(tmp_path, model, 3, max_steps=2, **options)
    checkpoint = tmp_path / "out" / "checkpoint-2"
    assert checkpoint.is_dir()
    model, _ = case("classification")
    rows = train(tmp_path, model, 3, max_steps=4, resume=str(checkpoint), **options)
    assert rows.rows == [2, 4]


def test_rdrop_hf_loss_takes_the_update_number_from_the_caller():
    model, inputs = case("classification")
    kind = model_kind(model)
    with pytest.raises(ValueError, match=r"every=2 needs update="):
        rdrop_hf_loss(model, inputs, kind=kind, every=2)
    with pytest.raises(ValueError, match=r"^every must be a whole number >= 1"):
        rdrop_hf_loss(model, inputs, kind=kind, every=0, update=0)
    plain, _ = step(lambda m, i: rdrop_hf_loss(m, i, kind=kind, every=2, update=3).loss,
                    model, inputs, seed=1)
    own, _ = step(lambda m, i: m(**i).loss, model, inputs, seed=1)
    assert torch.equal(plain, own)
    rdrop, _ = step(lambda m, i: rdrop_hf_loss(m, i, kind=kind, every=2, update=4).loss,
                    model, inputs, seed=1)
    today, _ = step(lambda m, i: rdrop_hf_loss(m, i, kind=kind).loss, model, inputs, seed=1)
    assert torch.equal(rdrop, today)


@pytest.mark.parametrize("every", [0, -1, 1.5, True, "x"])
def test_a_bad_every_is_refused_naming_the_option(tmp_path, every):
    model, _ = case("classification")
    with pytest.raises(ValueError, match=r"^rdrop_every must be a whole number >= 1"):
        RDropTrainer(model=model, args=training_args(tmp_path), rdrop_every=every)


def test_the_loop_of_the_docs_passes_the_update_number():
    from tests.test_rdrop_every import python_block_after

    model, inputs = case("classification")
    rows = []
    model.register_forward_pre_hook(lambda m, a, kw: rows.append(kw["input_ids"].size(0)),
                                    with_kwargs=True)
    halves = [{k: v[:2] for k, v in inputs.items()}, {k: v[2:] for k, v in inputs.items()}]
    namespace = {"rdrop_hf_loss": rdrop_hf_loss, "model": model, "kind": model_kind(model),
                 "updates": [halves, halves, halves],
                 "optimizer": torch.optim.SGD(model.parameters(), lr=0.1)}
    model.train()
    rows.clear()  # (model_kind's probe)
    exec(python_block_after("rdrop-every.md", "A loop of your own"), namespace)
    assert rows == [4, 4, 2, 2, 4, 4]  # updates 0 and 2 doubled, both micro-batches alike
