"""R-Drop for the heads beyond single-label classification: multi-label classification
(a Bernoulli distribution per label), question answering (a distribution over the start
position and one over the end position) and multiple choice (a distribution over the
choices), each against its formula written here in plain torch.

As in tests/test_hf.py, every expected loss comes from one forward of the same model on
the doubled batch [x; x] under the same seed (the trainer's dropout masks), in float64;
the expected gradients are autograd's, of that loss. With dropout off and alpha 0 each
loss is twice the model's own. Tiny random BERTs.
"""

import os
import warnings

import pytest
import torch
import torch.nn.functional as F

os.environ.setdefault("HF_HUB_OFFLINE", "1")

transformers = pytest.importorskip("transformers")
from transformers import (BertForMultipleChoice, BertForQuestionAnswering,  # noqa: E402
                          BertForSequenceClassification)

from rdrop_fairseq import hf  # noqa: E402
from rdrop_fairseq.hf import RDropTrainer  # noqa: E402
from tests.test_hf import formula, gradients, random_ids, tiny_bert, training_args  # noqa: E402


def skl(log_p1, log_p2):
    """1/2 (KL(P1||P2) + KL(P2||P1)) over the last dimension, from log-probabilities."""
    p1, p2 = log_p1.exp(), log_p2.exp()
    return 0.5 * ((p1 * (log_p1 - log_p2)).sum(-1) + (p2 * (log_p2 - log_p1)).sum(-1))


def multi_label_formula(logits, y, alpha):
    """Per label entry: BCE of each pass + alpha * 1/2 (KL(p1||p2) + KL(p2||p1)) between
    the passes' Bernoulli distributions, averaged over the entries of one pass."""
    p1, p2 = torch.sigmoid(logits.double()).chunk(2)
    y = y.double()

    def bce(p):
        return -(y * p.log() + (1 - y) * (1 - p).log())

    def kl(a, b):
        return a * (a / b).log() + (1 - a) * ((1 - a) / (1 - b)).log()

    return (bce(p1) + bce(p2) + alpha * 0.5 * (kl(p1, p2) + kl(p2, p1))).mean()


def qa_formula(start, end, start_positions, end_positions, alpha):
    """Per example: 1/2 (CE_start(P1) + CE_start(P2) + CE_end(P1) + CE_end(P2)) + alpha * 1/2
    (SKL_start + SKL_end), averaged over the examples; a position outside the sequence
    (the model's own loss clamps the positions to [0, L] and ignores L) counts nowhere."""
    length = start.size(-1)
    total, items = 0.0, 0
    for logits, positions in ((start, start_positions), (end, end_positions)):
        lp1, lp2 = F.log_softmax(logits.double(), -1).chunk(2)
        positions = positions.clamp(0, length)
        kept = positions.ne(length)
        t = torch.where(kept, positions, 0).unsqueeze(-1)
        ce = -lp1.gather(-1, t).squeeze(-1) - lp2.gather(-1, t).squeeze(-1)
        per = 0.5 * (ce + alpha * skl(lp1, lp2))
        total = total + torch.where(kept, per, 0).sum()
        items = items + kept.sum()
    return total / (items / 2)


def compare(trainer, model, inputs, expected_fn, seed=7):
    """The trainer's training loss and gradient vs ``expected_fn(outputs of [x; x])``'s."""
    model.train()
    doubled = {k: torch.cat([v, v]) for k, v in inputs.items()
               if k not in ("labels", "start_positions", "end_positions")}
    torch.manual_seed(seed)
    outputs = model(**doubled)
    expected = expected_fn(outputs)
    expected.backward()
    want = gradients(model)
    torch.manual_seed(seed)  # the same dropout masks
    loss = trainer.compute_loss(model, dict(inputs))
    loss.backward()
    got = gradients(model)
    torch.testing.assert_close(loss.double(), expected, rtol=1e-5, atol=1e-7)
    # (float32 gradients against float64's: a multiple-choice head's bias sums 24 rows)
    torch.testing.assert_close(got, want.to(got.dtype), rtol=1e-4, atol=1e-6)
    return outputs


def own_twice(model, inputs, tmp_path):
    """(R-Drop's loss at alpha 0, the model's own loss) with dropout off."""
    trainer = RDropTrainer(model=model, args=training_args(tmp_path), rdrop_alpha=0.0)
    model.train()
    loss = float(trainer.compute_loss(model, dict(inputs)))
    with torch.no_grad():
        own = float(model(**inputs).loss)
    return loss, own


def multi_label_case(problem_type, dropout=0.2):
    config = {"problem_type": problem_type} if problem_type else {}
    model = tiny_bert(BertForSequenceClassification, dropout=dropout, num_labels=4, **config)
    labels = torch.tensor([[1, 0, 1, 0], [0, 0, 0, 1], [1, 1, 1, 1], [0, 0, 0, 0]]).float()
    return model, {"input_ids": random_ids(4, 6), "labels": labels}


def qa_case(dropout=0.2):
    model = tiny_bert(BertForQuestionAnswering, dropout=dropout)
    ids = random_ids(4, 7)
    # the third example's answer lies outside the sequence (length 7): ignored, as the
    # model's own loss ignores it; a negative position is clamped to 0, as there
    return model, {"input_ids": ids, "attention_mask": torch.ones_like(ids),
                   "start_positions": torch.tensor([1, 0, 9, -2]),
                   "end_positions": torch.tensor([3, 6, 12, 2])}


def choice_case(dropout=0.2):
    model = tiny_bert(BertForMultipleChoice, dropout=dropout)
    ids = random_ids(3 * 4, 6).view(3, 4, 6)  # 3 examples of 4 choices
    return model, {"input_ids": ids, "labels": torch.tensor([0, 3, 1])}


CASES = {"multi-label": lambda **k: multi_label_case("multi_label_classification", **k),
         "multi-label-unset": lambda **k: multi_label_case(None, **k),
         "question-answering": qa_case, "multiple-choice": choice_case}


def expected(name, inputs, alpha):
    if name.startswith("multi-label"):
        return lambda out: multi_label_formula(out.logits, inputs["labels"], alpha)
    if name == "question-answering":
        return lambda out: qa_formula(out.start_logits, out.end_logits,
                                      inputs["start_positions"], inputs["end_positions"], alpha)
    return lambda out: formula(out.logits, inputs["labels"], alpha)


@pytest.mark.parametrize("name", list(CASES))
def test_each_head_trains_on_its_formula(tmp_path, name):
    """Labels as the model's own loss reads them: float multi-hot with or without
    problem_type set; start and end positions; one choice index per example."""
    model, inputs = CASES[name]()
    trainer = RDropTrainer(model=model, args=training_args(tmp_path), rdrop_alpha=0.7)
    outputs = compare(trainer, model, inputs, expected(name, inputs, 0.7))
    first, second = (outputs.start_logits if name == "question-answering"
                     else outputs.logits).detach().chunk(2)
    assert not torch.allclose(first, second)  # dropout made the passes differ
    # the consistency term counts
    assert float(expected(name, inputs, 0.7)(outputs)) > \
        float(expected(name, inputs, 0.0)(outputs)) + 1e-6


@pytest.mark.parametrize("name", list(CASES))
def test_alpha_zero_without_dropout_is_twice_the_models_own_loss(tmp_path, name):
    model, inputs = CASES[name](dropout=0.0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (no dropout: the KL is 0, which is the point)
        ours, own = own_twice(model, inputs, tmp_path)
    assert ours == pytest.approx(2 * own, rel=1e-6)


@pytest.mark.parametrize("name", list(CASES))
def test_each_head_is_read_as_encoder_and_refused_by_the_fused_path_in_one_line(
        tmp_path, name):
    model, _ = CASES[name]()
    assert hf.model_kind(model) == "encoder"
    with pytest.raises(ValueError, match=r"rdrop_fused_linear: .* has no language-model head"
                                         r"[^\n]*leave it False$"):
        RDropTrainer(model=model, args=training_args(tmp_path), rdrop_fused_linear=True)


def test_question_answering_trains_with_the_trainers_label_names(tmp_path):
    """The Trainer names a question-answering head's labels start_positions and
    end_positions: R-Drop trains on them, counts the labelled positions over an
    accumulated batch (so the accumulated loss is the whole batch's) and logs rdrop_ce,
    the cross-entropy of one pass per position, which with dropout off is the model's own
    loss on the whole batch."""
    model, inputs = qa_case(dropout=0.0)
    data = [{k: v[i] for k, v in inputs.items()} for i in range(4)]
    model.eval()
    with torch.no_grad():
        keep = inputs["start_positions"].ne(9)  # the example with both positions outside
        own = float(model(**{k: v[keep] for k, v in inputs.items()}).loss)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = RDropTrainer(model=model, train_dataset=data, rdrop_alpha=0.0,
                               args=training_args(tmp_path, per_device_train_batch_size=2,
                                                  gradient_accumulation_steps=2,
                                                  logging_steps=1, learning_rate=0.0))
        trainer.train()
    assert trainer.label_names == ["start_positions", "end_positions"]
    logs = trainer.state.log_history
    steps = [log for log in logs if "rdrop_ce" in log]
    assert len(steps) == 1, logs
    step = steps[0]
    assert step["rdrop_ce"] == pytest.approx(own, abs=1e-4)
    assert step["loss"] == pytest.approx(2 * own, abs=1e-4)


def test_labels_a_head_cannot_read_are_refused_saying_what_to_give():
    model, inputs = multi_label_case("multi_label_classification")
    with pytest.raises(ValueError, match="multi-label classification needs float multi-hot "
                                         r"labels of shape \(4, 4\)"):
        hf.rdrop_hf_loss(model, {**inputs, "labels": inputs["labels"].long()}, kind="encoder")
    model, inputs = qa_case()
    with pytest.raises(ValueError, match="start_positions and end_positions"):
        hf.rdrop_hf_loss(model, {k: v for k, v in inputs.items() if k != "end_positions"},
                         kind="encoder")


def test_vilts_vqa_head_is_refused_with_the_scale_that_differs(tmp_path):
    """ViltForQuestionAnswering's own loss is the mean binary cross-entropy times the number
    of answers (checked here on its own forward): not R-Drop's multi-label loss per label
    entry, so the trainer refuses it when made, saying why."""
    from transformers import ViltConfig, ViltForQuestionAnswering

    torch.manual_seed(0)
    config = ViltConfig(hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                        intermediate_size=32, image_size=32, patch_size=16, num_labels=7,
                        max_position_embeddings=16, max_image_length=-1)
    model = ViltForQuestionAnswering(config).eval()
    labels = torch.rand(2, 7)
    out = model(input_ids=random_ids(2, 5), pixel_values=torch.randn(2, 3, 32, 32),
                labels=labels)
    per_entry = F.binary_cross_entropy_with_logits(out.logits, labels)
    torch.testing.assert_close(out.loss, per_entry * 7)  # the reason given, as it is
    with pytest.raises(ValueError, match=r"^RDropTrainer: ViltForQuestionAnswering is a visual question-"
                                         r"answering head whose own loss is the binary "
                                         r"cross-entropy .* times the number of answers"):
        RDropTrainer(model=model, args=training_args(tmp_path))
