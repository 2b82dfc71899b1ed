"""RDropTrainer (rdrop_fairseq.hf) against R-Drop's formula, written here in plain torch.

Every expected loss comes from one forward of the same model on the doubled batch [x; x]
under the same seed (so with the same dropout masks as the trainer's forward): cross-entropy
of both passes plus alpha times the symmetric KL (regression: squared errors of both passes
plus alpha times the squared difference), per labelled item of one pass, in float64. The
expected gradients are autograd's, of that loss. Models: tiny random BERTs, and the
pretrained all-MiniLM-L6-v2 (a BERT) that scripts/setup.sh unpacks into the environment
for sentence pairs with token types and padding.
"""

import math
import os
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

# nothing here may come from the Hugging Face hub: a load that tried would fail at once
# (read when huggingface_hub is imported)
os.environ.setdefault("HF_HUB_OFFLINE", "1")

try:  # scripts/gpu_check.sh collects the suite (pytest -m cuda) where transformers may be
    # missing; here, in scripts/setup.sh's environment, it is not (a test fails without it)
    import transformers
    from transformers import (BertConfig, BertForMaskedLM, BertForSequenceClassification,
                              BertForTokenClassification, BertLMHeadModel, BertModel,
                              TrainerCallback, TrainingArguments)

    from rdrop_fairseq.hf import RDropTrainer
except ImportError:
    transformers = None

MINILM = Path(sys.prefix) / "share" / "rdrop-fairseq" / "all-MiniLM-L6-v2"


@pytest.fixture(autouse=True)
def _installed():
    assert transformers is not None, "transformers is not installed: run scripts/setup.sh"


def tiny_bert(cls, dropout=0.2, **config):
    torch.manual_seed(0)
    return cls(BertConfig(vocab_size=40, hidden_size=16, num_hidden_layers=2,
                          num_attention_heads=2, intermediate_size=32,
                          max_position_embeddings=24, hidden_dropout_prob=dropout,
                          attention_probs_dropout_prob=dropout, **config))


def sequential():
    """Batches in the dataset's order: an option of transformers 5 (4's sampler shuffles;
    the tests that read batches in order do not depend on it, they compare sums)."""
    import dataclasses

    fields = {f.name for f in dataclasses.fields(TrainingArguments)}
    return {"train_sampling_strategy": "sequential"} if "train_sampling_strategy" in fields else {}


def training_args(tmp_path, **overrides):
    return TrainingArguments(**{
        "output_dir": str(tmp_path / "out"), "use_cpu": True, "report_to": "none",
        "per_device_train_batch_size": 4, "max_steps": 1, "save_strategy": "no",
        "disable_tqdm": True, **sequential(), **overrides})


def trainer_for(model, tmp_path, alpha=1.0, **overrides):
    return RDropTrainer(model=model, args=training_args(tmp_path, **overrides),
                        rdrop_alpha=alpha)


def formula(logits, labels, alpha):
    """R-Drop's loss per labelled item of one pass, from the logits of [x; x] (float64)."""
    logits = logits.double()
    if labels.is_floating_point():  # regression
        y1, y2 = logits.view(2, -1)
        y = labels.double().view(-1)
        return ((y1 - y) ** 2 + (y2 - y) ** 2 + alpha * (y1 - y2) ** 2).mean()
    lp1, lp2 = F.log_softmax(logits, -1).chunk(2)
    p1, p2 = lp1.exp(), lp2.exp()
    kept = labels.ne(-100)
    t = torch.where(kept, labels, 0).unsqueeze(-1)
    ce1, ce2 = -lp1.gather(-1, t).squeeze(-1), -lp2.gather(-1, t).squeeze(-1)
    kl12, kl21 = (p1 * (lp1 - lp2)).sum(-1), (p2 * (lp2 - lp1)).sum(-1)
    per_item = ce1 + ce2 + alpha * 0.5 * (kl12 + kl21)
    return torch.where(kept, per_item, 0).sum() / kept.sum()


def gradients(model):
    grads = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
    model.zero_grad()
    return grads


def doubled(inputs):
    return {k: torch.cat([v, v]) for k, v in inputs.items() if k != "labels"}


def compare(trainer, model, inputs, expected_fn, seed=7):
    """The trainer's training loss and gradient vs ``expected_fn(logits of [x; x])``'s."""
    model.train()
    torch.manual_seed(seed)
    logits = model(**doubled(inputs)).logits
    expected = expected_fn(logits)
    expected.backward()
    want = gradients(model)
    torch.manual_seed(seed)  # the same dropout masks
    loss = trainer.compute_loss(model, dict(inputs))
    loss.backward()
    got = gradients(model)
    torch.testing.assert_close(loss.double(), expected, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(got, want.to(got.dtype), rtol=1e-4, atol=1e-7)
    return logits.detach(), loss.detach()


def random_ids(batch, length, vocab=40, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(5, vocab, (batch, length), generator=g)


def minilm_pairs():
    """MiniLM (pretrained) with a new 3-class head, and sentence pairs padded to a batch:
    token types 0/1, attention mask 0 on the padding."""
    from transformers import AutoTokenizer

    assert (MINILM / "model.safetensors").is_file(), f"no MiniLM in {MINILM}: scripts/setup.sh"
    tokenizer = AutoTokenizer.from_pretrained(MINILM)
    torch.manual_seed(0)
    model = BertForSequenceClassification.from_pretrained(MINILM, num_labels=3)
    inputs = dict(tokenizer(["A man plays a guitar.", "Rain fell all night long on the town.",
                             "Two dogs.", "The committee approved the budget yesterday."],
                            ["Someone makes music.", "It was dry.", "Animals run.",
                             "Nothing was decided."], padding=True, return_tensors="pt"))
    inputs["labels"] = torch.tensor([0, 2, 1, 2])
    assert inputs["token_type_ids"].eq(1).any() and inputs["attention_mask"].eq(0).any()
    return model, inputs


def case(name):
    """(model, inputs) of each kind of head RDropTrainer covers."""
    if name == "pairs":
        return minilm_pairs()
    if name == "classification":
        model = tiny_bert(BertForSequenceClassification, num_labels=3)
        return model, {"input_ids": random_ids(4, 6), "labels": torch.tensor([0, 2, 1, 2])}
    if name == "regression":
        model = tiny_bert(BertForSequenceClassification, num_labels=1)
        return model, {"input_ids": random_ids(4, 6),
                       "labels": torch.tensor([0.5, 3.2, 1.0, 4.9])}
    ids = random_ids(3, 7)
    mask = torch.ones_like(ids)
    mask[1, 5:] = mask[2, 3:] = 0  # padded rows
    if name == "token-classification":
        model = tiny_bert(BertForTokenClassification, num_labels=5)
        labels = torch.randint(0, 5, ids.shape, generator=torch.Generator().manual_seed(2))
        labels[mask == 0] = -100
        labels[:, 0] = -100  # [CLS]
    else:  # masked LM: a few positions labelled with the vocabulary's ids
        model = tiny_bert(BertForMaskedLM)
        labels = torch.full_like(ids, -100)
        labels[0, 2], labels[0, 4], labels[1, 1], labels[2, 2] = 7, 12, 39, 5
    return model, {"input_ids": ids, "attention_mask": mask, "labels": labels}


CASES = ["classification", "regression", "pairs", "token-classification", "masked-lm"]


@pytest.mark.parametrize("name", CASES)
def test_training_loss_and_gradient_are_the_formulas(tmp_path, name):
    model, inputs = case(name)
    trainer = trainer_for(model, tmp_path, alpha=0.7)
    logits, loss = compare(trainer, model, inputs,
                           lambda logits: formula(logits, inputs["labels"], 0.7))
    first, second = logits.chunk(2)
    assert not torch.allclose(first, second)  # dropout made the passes differ
    # so the consistency term counts: the same logits without it give another loss
    without = formula(logits, inputs["labels"], 0.0)
    assert float(loss) > float(without) + 1e-6


@pytest.mark.parametrize("name", ["classification", "token-classification", "pairs"])
def test_alpha_zero_is_the_cross_entropy_of_both_passes(tmp_path, name):
    """torch's own cross-entropy (ignore_index -100) of each pass, summed, per labelled item
    of one pass; gradients too."""
    model, inputs = case(name)
    labels = inputs["labels"]

    def both_passes(logits):
        first, second = logits.double().chunk(2)
        ce = sum(F.cross_entropy(half.reshape(-1, half.size(-1)), labels.reshape(-1),
                                 reduction="sum", ignore_index=-100) for half in (first, second))
        return ce / labels.ne(-100).sum()

    compare(trainer_for(model, tmp_path, alpha=0.0), model, inputs, both_passes)


def test_regression_is_sentence_prediction_rdrops(tmp_path):
    """What fairseq's sentence_prediction_rdrop computes for --regression-target (MSE of both
    passes + alpha * squared difference of the predictions, summed), per example."""
    model, inputs = case("regression")
    labels = inputs["labels"]

    def fairseq_regression(logits):
        predictions = logits.view(-1).double()
        task = F.mse_loss(predictions, torch.cat([labels, labels]).double(), reduction="sum")
        y1, y2 = predictions.chunk(2)
        return (task + 2.5 * (y1 - y2).pow(2).sum()) / labels.numel()

    compare(trainer_for(model, tmp_path, alpha=2.5), model, inputs, fairseq_regression)


def test_evaluation_and_prediction_run_one_pass_of_the_batch_as_it_is(tmp_path):
    model = tiny_bert(BertForSequenceClassification, num_labels=3)
    ids = random_ids(6, 5, seed=3)
    labels = torch.tensor([0, 1, 2, 2, 1, 0])
    data = [{"input_ids": ids[i], "labels": labels[i]} for i in range(6)]
    trainer = trainer_for(model, tmp_path, per_device_eval_batch_size=4)
    seen = []
    model.register_forward_pre_hook(
        lambda module, args, kwargs: seen.append((tuple(kwargs["input_ids"].shape),
                                                  module.training)), with_kwargs=True)
    metrics = trainer.evaluate(data)
    assert seen == [((4, 5), False), ((2, 5), False)]  # the batches, not doubled; no dropout
    model.eval()
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    expected = F.cross_entropy(logits.double(), labels)  # the model's own loss, one pass
    assert metrics["eval_loss"] == pytest.approx(float(expected), rel=1e-5)
    seen.clear()
    predictions = trainer.predict(data).predictions
    assert [shape for shape, _ in seen] == [(4, 5), (2, 5)]
    torch.testing.assert_close(torch.as_tensor(predictions), logits)


def accumulated_gradients(model, module, data, tmp_path, runs):
    """For each ``(batch, steps)`` of ``runs``, from the same starting weights: the
    gradient RDropTrainer accumulates over ``steps`` micro-batches of ``batch`` examples of
    ``data``, just before the optimizer's step (clipping off), keyed by ``steps``. Dropout
    must be off; a forward hook on ``module`` stands in for it (the second half of [x; x]
    scaled and shifted), so that every run sees the same two passes and the KL is not 0."""

    def second_pass_differs(module, args, out):
        if module.training:
            half = out.size(0) // 2
            return torch.cat([out[:half], out[half:] * 0.5 + 0.3])

    class GradientAtStep(TrainerCallback):
        def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
            self.grad = torch.cat([p.grad.flatten().clone() for p in model.parameters()
                                   if p.grad is not None])

    handle = module.register_forward_hook(second_pass_differs)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    grads = {}
    for batch, steps in runs:
        model.load_state_dict(state)
        grab = GradientAtStep()
        trainer = RDropTrainer(model=model, args=training_args(
            tmp_path, per_device_train_batch_size=batch, gradient_accumulation_steps=steps,
            max_grad_norm=0.0), train_dataset=data, callbacks=[grab], rdrop_alpha=1.0)
        trainer.train()
        grads[steps] = grab.grad
    handle.remove()
    model.load_state_dict(state)
    return grads


def test_gradient_accumulation_gives_the_gradient_of_one_batch_k_times_as_large(tmp_path):
    """Token classification, micro-batches with different numbers of labelled tokens: 2 steps
    of 4 examples accumulate the gradient of one step of 8. Dropout is off and a forward
    hook stands in for it (the second half of [x; x] scaled and shifted), so that both runs
    see the same two passes and the KL term is not 0."""
    model = tiny_bert(BertForTokenClassification, dropout=0.0, num_labels=4)
    ids = random_ids(8, 6, seed=4)
    labels = torch.randint(0, 4, ids.shape, generator=torch.Generator().manual_seed(5))
    labels[4:, 2:] = -100  # the second micro-batch: 2 labelled tokens an example, not 6
    data = [{"input_ids": ids[i], "labels": labels[i]} for i in range(8)]
    grads = accumulated_gradients(model, model.classifier, data, tmp_path, ((8, 1), (4, 2)))
    torch.testing.assert_close(grads[2], grads[1], rtol=1e-5, atol=1e-8)
    # what each micro-batch normalised by its own labelled tokens would give instead (the
    # mean of the two micro-batches' losses; the hook is gone, so dropout-free passes, KL 0)
    trainer = trainer_for(model, tmp_path)
    model.train()
    for half in (slice(0, 4), slice(4, 8)):
        (trainer.compute_loss(model, {"input_ids": ids[half], "labels": labels[half]}) / 2
         ).backward()
    naive = gradients(model)
    assert (naive - grads[1]).norm() > 0.05 * grads[1].norm()


def test_the_step_synchronises_no_more_than_the_doubled_batch_step(tmp_path):
    """Counted on CPU through torch's dispatcher (rdrop_fairseq.opcount): a training step
    after the first (which checks the labels once) reads nothing back from the device that
    Hugging Face's own loss on the doubled batch does not."""
    from rdrop_fairseq.opcount import count_ops

    model, inputs = case("masked-lm")
    trainer = trainer_for(model, tmp_path)
    model.train()

    def ours():
        trainer.compute_loss(model, dict(inputs), num_items_in_batch=torch.tensor(4)).backward()

    def doubled_batch():
        batch = {**doubled(inputs), "labels": torch.cat([inputs["labels"]] * 2)}
        model(**batch).loss.backward()

    ours()
    counts = {}
    for name, step in (("ours", ours), ("doubled", doubled_batch)):
        with count_ops() as ops:
            step()
        counts[name] = ops
    assert counts["ours"].n_syncing <= counts["doubled"].n_syncing, (
        counts["ours"].syncing, counts["doubled"].syncing)


# ---------------------------------------------------------------- bad input, before a step

def files_in(folder):
    return sorted(p for p in Path(folder).rglob("*") if p.is_file())


@pytest.mark.parametrize("alpha", [-0.5, math.nan, math.inf, "lots"])
def test_a_bad_alpha_is_refused_before_anything_is_made(tmp_path, alpha):
    with pytest.raises(ValueError, match="rdrop_alpha must be a finite number >= 0"):
        trainer_for(tiny_bert(BertForSequenceClassification, num_labels=2), tmp_path, alpha)
    assert list(tmp_path.iterdir()) == []


def test_uncovered_models_and_bad_options_are_refused_before_anything_is_made(tmp_path):
    """A model without a head, a next-sentence-prediction head, a bad implementation: refused
    when the trainer is made, naming what is covered (the causal and encoder-decoder LMs that are:
    tests/test_hf_lm.py)."""
    with pytest.raises(ValueError, match="BertModel is a bare model, without a head, which "
                                         "R-Drop's loss here does not cover. Covered: sequence "
                                         "classification"):
        trainer_for(tiny_bert(BertModel), tmp_path)
    with pytest.raises(ValueError, match="RDropTrainer: the model's output has no 'logits' "
                                         "\\(it has: last_hidden_state, pooler_output\\)"):
        trainer_for(tiny_bert(NoLogits), tmp_path)
    from transformers import BertForNextSentencePrediction

    with pytest.raises(ValueError, match="BertForNextSentencePrediction is a "
                                         "next-sentence-prediction head"):
        trainer_for(tiny_bert(BertForNextSentencePrediction), tmp_path)
    model = tiny_bert(BertForSequenceClassification, num_labels=2)
    with pytest.raises(ValueError, match="rdrop_impl must be one of auto, torch, triton"):
        RDropTrainer(model=model, args=training_args(tmp_path), rdrop_impl="cuda")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="rdrop_impl 'triton' needs a CUDA GPU"):
            RDropTrainer(model=model, args=training_args(tmp_path), rdrop_impl="triton")
    with pytest.raises(ValueError, match="rdrop_fused_linear: BertForSequenceClassification has "
                                         "no language-model head"):
        RDropTrainer(model=model, args=training_args(tmp_path), rdrop_fused_linear=True)
    assert list(tmp_path.iterdir()) == []


class NoLogits(transformers.BertPreTrainedModel if transformers else object):
    """A model that takes labels but returns no logits."""

    def __init__(self, config):
        super().__init__(config)
        self.bert = BertModel(config)
        self.post_init()

    def forward(self, input_ids=None, labels=None):
        return self.bert(input_ids=input_ids)


def labelled(ids, labels):
    return [{"input_ids": i, "labels": l} for i, l in zip(ids, labels)]


BAD_BATCHES = {
    "int labels for regression": (
        lambda: tiny_bert(BertForSequenceClassification, num_labels=1),
        lambda ids: labelled(ids, torch.tensor([1, 3, 0, 2])),
        "one output \\(regression\\) but the labels are torch.int64: give float labels"),
    "class index out of range": (
        lambda: tiny_bert(BertForSequenceClassification, num_labels=3),
        lambda ids: labelled(ids, torch.tensor([0, 3, 1, -7])),
        "labels \\[-7, 3\\] are not class indices of a head with 3 outputs"),
    "float labels for classes": (
        lambda: tiny_bert(BertForSequenceClassification, num_labels=3),
        lambda ids: labelled(ids, torch.tensor([0.0, 1.0, 2.0, 1.0])),
        "multi-label classification needs float multi-hot labels of shape \\(4, 3\\)"),
    "no labels": (lambda: tiny_bert(BertForSequenceClassification, num_labels=2),
                  lambda ids: [{"input_ids": i} for i in ids],
                  "a training batch without 'labels' \\(its keys: input_ids\\): R-Drop's "
                  "loss needs the labels of every training batch \\(-100 marks the tokens "
                  "without one\\)$"),
}


@pytest.mark.parametrize("name", list(BAD_BATCHES))
def test_a_batch_that_does_not_fit_fails_at_the_first_step_and_writes_nothing(tmp_path, name):
    """train() with a checkpoint due after the first step: the error comes before it."""
    make_model, make_data, message = BAD_BATCHES[name]
    trainer = trainer_for(make_model(), tmp_path, save_strategy="steps", save_steps=1)
    trainer.train_dataset = make_data(random_ids(4, 5))
    with pytest.raises(ValueError, match=message):
        trainer.train()
    assert files_in(tmp_path) == []


def test_the_benchmark_times_both_steps_on_the_same_doubled_batch(tmp_path):
    """benchmarks/bench_hf.py at tiny shapes, in this process: the floor (a plain Trainer
    given [x; x]) and RDropTrainer (given x; from the logits, and through the fused path
    for the language-model heads) each run one forward of the doubled batch and a backward;
    the table has a row per head and method, the ratios (time, peak memory) against the
    head's floor."""
    import argparse

    from benchmarks import bench_hf

    bert = dict(vocab_size=50, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                intermediate_size=32)
    shapes = {"classification": bert, "masked-lm": bert,
              "causal-lm": dict(vocab_size=50, hidden_size=16, intermediate_size=32,
                                num_hidden_layers=1, num_attention_heads=2,
                                num_key_value_heads=1),
              "seq2seq": dict(vocab_size=50, d_model=16, encoder_layers=1, decoder_layers=1,
                              encoder_attention_heads=2, decoder_attention_heads=2,
                              encoder_ffn_dim=32, decoder_ffn_dim=32)}
    cases = [(head, method) for head in bench_hf.HEADS for method in bench_hf.methods_for(head)]
    assert ("causal-lm", "rdrop-fused") in cases and ("classification", "rdrop-fused") not in cases
    for head, method in cases:
        model, inputs = bench_hf.build(head, 2, 8, shapes[head])
        seen = []
        model.register_forward_pre_hook(
            lambda module, args, kwargs: seen.append(kwargs["input_ids"].shape),
            with_kwargs=True)
        step = bench_hf.make_step(method, model, inputs, tmp_path / method)
        seen.clear()  # (the fused path's check at creation runs a small forward)
        step()
        assert seen == [(4, 8)], (head, method)
        assert model.get_input_embeddings().weight.grad.abs().sum() > 0  # a backward
    results = [bench_hf.measure(method, head, 2, 8, 2, shapes[head]) for _ in range(2)
               for head, method in cases]
    rows = bench_hf.summarise(results)
    assert [(r["head"], r["method"]) for r in rows] == cases
    for r in rows:
        floor = next(f for f in rows if f["head"] == r["head"] and f["method"] == "floor")
        assert r["ratio"] == pytest.approx(r["seconds"] / floor["seconds"])
        assert r["memory_ratio"] == pytest.approx(r["peak_mib"] / floor["peak_mib"])
        assert len(r["processes"]) == 2 and r["peak_mib"] > 0
    table = bench_hf.markdown(rows, argparse.Namespace(batch=2, length=8, threads=1,
                                                         rounds=2, steps=2))
    assert table.count("| **RDropTrainer** (alpha 1) |") == 4
    assert table.count("| **RDropTrainer**, fused linear |") == 3
    # --bf16: the Trainer's autocast, under which the fused path multiplies in bf16
    from rdrop_fairseq.hf import loss as hf_loss

    seen_dtypes = []
    original = hf_loss.fused_linear_rdrop_loss

    def spy(features, weight, *args, **kwargs):
        seen_dtypes.append((features.dtype, weight.dtype))
        return original(features, weight, *args, **kwargs)

    model, inputs = bench_hf.build("causal-lm", 2, 8, shapes["causal-lm"])
    step = bench_hf.make_step("rdrop-fused", model, inputs, tmp_path / "bf16", bf16=True)
    hf_loss.fused_linear_rdrop_loss = spy
    try:
        step()
    finally:
        hf_loss.fused_linear_rdrop_loss = original
    assert seen_dtypes == [(torch.bfloat16, torch.bfloat16)]
    assert model.lm_head.weight.dtype == torch.float32  # the weights stay float32


def test_the_triton_kernel_gives_the_torch_implementations_loss_and_gradient():
    """rdrop_impl='triton' reaches the fused kernel: here in Triton's CPU interpreter
    (TRITON_INTERPRET=1 must be set before triton is imported: a fresh interpreter), on a
    classification and a masked-LM head, against rdrop_impl='torch' with the same dropout."""
    import subprocess
    import textwrap

    code = textwrap.dedent("""
        import tempfile, torch
        from transformers import TrainingArguments
        from rdrop_fairseq.hf import RDropTrainer
        from tests.test_hf import case
        for name in ("classification", "masked-lm"):
            results = []
            for impl in ("torch", "triton"):
                model, inputs = case(name)
                model.train()
                args = TrainingArguments(output_dir=tempfile.mkdtemp(), use_cpu=True,
                                         report_to="none")
                trainer = RDropTrainer(model=model, args=args, rdrop_alpha=0.7, rdrop_impl=impl)
                torch.manual_seed(3)
                loss = trainer.compute_loss(model, dict(inputs))
                loss.backward()
                results.append((loss.detach(), torch.cat([p.grad.flatten() for p in
                                                          model.parameters() if p.grad is not None])))
            (l1, g1), (l2, g2) = results
            torch.testing.assert_close(l2, l1, rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(g2, g1, rtol=1e-4, atol=1e-6)
            print("OK", name, float(l1))
    """)
    repo = Path(__file__).resolve().parents[1]
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1",
           "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          cwd=repo, env=env, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert [line.split()[1] for line in proc.stdout.splitlines() if line.startswith("OK")] == [
        "classification", "masked-lm"]
