"""Each R-Drop criterion on real (tiny) fairseq models, against fairseq and the formula.

Every criterion is exercised through the same checks:

* off (alpha 0) it *is* its fairseq parent: same loss, gradients and logs;
* with two passes, its task loss is the parent's on the doubled batch ``[x; x]``;
* its training loss equals the paper's formula computed here, in float64, from the real
  model's two halves (same dropout masks, by replaying the RNG);
* adding padding changes nothing (the two passes are made to differ deterministically);
* a model without dropout gives KL 0 and a warning; evaluation runs one pass.
"""

import logging
import math
from dataclasses import dataclass
from typing import Callable

import pytest
import torch
import torch.nn.functional as F

from fairseq.criterions.adaptive_loss import AdaptiveLoss
from fairseq.criterions.cross_entropy import CrossEntropyCriterion
from fairseq.criterions.label_smoothed_cross_entropy import LabelSmoothedCrossEntropyCriterion
from fairseq.criterions.sentence_prediction import (
    SentencePredictionConfig,
    SentencePredictionCriterion,
)
from fairseq.data import Dictionary
from fairseq.data.data_utils import collate_tokens
from fairseq.logging import metrics
from fairseq.tasks.language_modeling import LanguageModelingTask
from fairseq.tasks.sentence_prediction import SentencePredictionTask
from fairseq.tasks.translation import TranslationTask

from rdrop_fairseq.core import RDropBatchError
from rdrop_fairseq.criterions import (
    AdaptiveLossRDrop,
    CrossEntropyRDropCriterion,
    LabelSmoothedCrossEntropyRDropCriterion,
    SentencePredictionRDropCriterion,
)
from rdrop_fairseq.criterions.adaptive_loss_rdrop import AdaptiveLossRDropConfig
from rdrop_fairseq.criterions.cross_entropy_rdrop import CrossEntropyRDropConfig
from rdrop_fairseq.criterions.label_smoothed_cross_entropy_rdrop import (
    LabelSmoothedCrossEntropyRDropConfig,
)
from rdrop_fairseq.criterions.sentence_prediction_rdrop import SentencePredictionRDropConfig
from rdrop_fairseq.opcount import LiveBytes
from tests.fairseq_config import training_config

VOCAB = 40
HEAD = "sentence_classification_head"


def make_dictionary(n=VOCAB):
    d = Dictionary()
    for i in range(n - len(d)):
        d.add_symbol(f"w{i}")
    return d


def parse(argv):
    return training_config(["/dev/null", "--cpu", "--optimizer", "adam", "--lr", "1e-3", *argv])


def lengths_batch(gen, n, lo, hi):
    return [torch.randint(4, VOCAB, (int(torch.randint(lo, hi + 1, (1,), generator=gen)),),
                          generator=gen) for _ in range(n)]


# --- the four settings: model, sample, criteria, reference formula --------------------------


@dataclass
class Case:
    name: str
    build_model: Callable  # dropout -> model
    make_sample: Callable  # extra_pad -> sample
    ours: Callable  # (task, alpha, two_passes, **kw) -> criterion
    parent: Callable  # task, **kw -> fairseq criterion
    reference: Callable  # (model, pair_sample, alpha, **kw) -> (loss, consistency) float64
    task: object = None
    cfg: object = None


def translation_case():
    d = make_dictionary()

    def build_model(dropout, **kw):
        args, cfg = parse([
            "--task", "translation", "--arch", "transformer_iwslt_de_en",
            "--encoder-layers", "1", "--decoder-layers", "1", "--encoder-embed-dim", "16",
            "--decoder-embed-dim", "16", "--encoder-ffn-embed-dim", "32",
            "--decoder-ffn-embed-dim", "32", "--encoder-attention-heads", "2",
            "--decoder-attention-heads", "2", "--dropout", str(dropout),
            "--attention-dropout", str(dropout), "--activation-dropout", str(dropout),
        ])
        case.task, case.cfg = TranslationTask(cfg.task, d, d), cfg
        return case.task.build_model(cfg.model)

    def make_sample(extra_pad=0):
        gen = torch.Generator().manual_seed(1)
        src, tgt = lengths_batch(gen, 5, 2, 7), lengths_batch(gen, 5, 2, 7)
        tgt = [torch.cat([t, torch.tensor([d.eos()])]) for t in tgt]
        src_tokens = collate_tokens(src, d.pad(), left_pad=True)
        target = collate_tokens(tgt, d.pad())
        prev = collate_tokens(tgt, d.pad(), move_eos_to_beginning=True)
        if extra_pad:  # more padding: on the left of the source, on the right of the target
            src_tokens = F.pad(src_tokens, (extra_pad, 0), value=d.pad())
            target = F.pad(target, (0, extra_pad), value=d.pad())
            prev = F.pad(prev, (0, extra_pad), value=d.pad())
        return {
            "net_input": {"src_tokens": src_tokens,
                          "src_lengths": torch.tensor([len(s) for s in src]),
                          "prev_output_tokens": prev},
            "target": target, "ntokens": int(target.ne(d.pad()).sum()), "nsentences": 5,
        }

    def ours(alpha, two_passes=False, label_smoothing=0.1, **kw):
        return LabelSmoothedCrossEntropyRDropCriterion(LabelSmoothedCrossEntropyRDropConfig(
            label_smoothing=label_smoothing, rdrop_alpha=alpha, rdrop_two_passes=two_passes,
            sentence_avg=kw.pop("sentence_avg", False), **kw), case.task)

    def parent(label_smoothing=0.1, **kw):
        return LabelSmoothedCrossEntropyCriterion(
            case.task, kw.pop("sentence_avg", False), label_smoothing, **kw)

    def reference(model, pair, alpha, label_smoothing=0.1, ignore_prefix_size=0, **kw):
        out = model(**pair["net_input"])
        lprobs = model.get_normalized_probs(out, log_probs=True).double()
        target = pair["target"]
        lprobs, target = lprobs[:, ignore_prefix_size:], target[:, ignore_prefix_size:]
        return token_reference(lprobs, target, d.pad(), alpha, label_smoothing)

    case = Case("translation", build_model, make_sample, ours, parent, reference)
    return case


def token_reference(lprobs, target, pad, alpha, eps):
    """Label-smoothed NLL of both passes + alpha * symmetric KL, from the definition."""
    keep = target.ne(pad)
    vocab = lprobs.size(-1)
    nll = -lprobs.gather(-1, target.unsqueeze(-1)).squeeze(-1)
    smooth = -lprobs.sum(-1)
    eps_i = eps / (vocab - 1)
    task = ((1 - eps - eps_i) * nll + eps_i * smooth)[keep].sum()
    p_log, q_log = lprobs.chunk(2)
    p, q = p_log.exp(), q_log.exp()
    kl_pq = (p * (p_log - q_log)).sum(-1)
    kl_qp = (q * (q_log - p_log)).sum(-1)
    kl = (0.5 * (kl_pq + kl_qp))[keep.chunk(2)[0]].sum()
    return task + alpha * kl, kl


def lm_case(adaptive):
    d = make_dictionary()

    def build_model(dropout, softmax_dropout=0.0):
        # the adaptive softmax's own dropout is separate: the RNG-replaying reference below
        # draws its masks in another order than the criterion's chunks do
        arch = ["--arch", "transformer_lm_wiki103", "--adaptive-input-cutoff", "10,20",
                "--adaptive-softmax-cutoff", "10,20", "--decoder-input-dim", "16",
                "--decoder-output-dim", "16", "--adaptive-softmax-dropout",
                str(softmax_dropout)] if adaptive else ["--arch", "transformer_lm_gpt"]
        args, cfg = parse([
            "--task", "language_modeling", *arch, "--decoder-layers", "1",
            "--decoder-embed-dim", "16", "--decoder-ffn-embed-dim", "32",
            "--decoder-attention-heads", "2", "--tokens-per-sample", "16",
            "--dropout", str(dropout), "--attention-dropout", str(dropout),
            "--activation-dropout", str(dropout), "--ddp-backend", "legacy_ddp",
        ])
        case.task, case.cfg = LanguageModelingTask(cfg.task, d), cfg
        return case.task.build_model(cfg.model)

    def make_sample(extra_pad=0, avoid=(11, 21)):
        gen = torch.Generator().manual_seed(2)
        seqs = lengths_batch(gen, 4, 3, 9)
        # fairseq's adaptive_loss drops the tail term of the word at id cutoff + padding_idx
        # of each tail cluster (ids 11 and 21 here; see test_adaptive_nll_is_the_true_one)
        seqs = [s.masked_fill((s == avoid[0]) | (s == avoid[1]), 12) for s in seqs]
        src = collate_tokens([s[:-1] for s in seqs], d.pad())
        target = collate_tokens([s[1:] for s in seqs], d.pad())
        if extra_pad:
            src = F.pad(src, (0, extra_pad), value=d.pad())
            target = F.pad(target, (0, extra_pad), value=d.pad())
        return {"net_input": {"src_tokens": src,
                              "src_lengths": torch.tensor([len(s) - 1 for s in seqs])},
                "target": target, "ntokens": int(target.ne(d.pad()).sum()), "nsentences": 4}

    if adaptive:
        def ours(alpha, two_passes=False, **kw):
            return AdaptiveLossRDrop(AdaptiveLossRDropConfig(
                sentence_avg=False, rdrop_alpha=alpha, rdrop_two_passes=two_passes, **kw),
                case.task)

        def parent(**kw):
            return AdaptiveLoss(case.task, False)

        def reference(model, pair, alpha, **kw):
            # p(w) = p_head(cluster of w) * p_tail(w | cluster), over the whole vocabulary
            asm = model.decoder.adaptive_softmax
            features = model(**pair["net_input"])[0]
            features = features.reshape(-1, features.size(-1))
            head = asm.head(features).double().log_softmax(-1)
            first = asm.cutoff[0]
            lprobs = torch.cat([head[:, :first]] + [
                tail(features).double().log_softmax(-1) + head[:, first + i, None]
                for i, tail in enumerate(asm.tail)], dim=1)
            lprobs = lprobs.view(*pair["target"].shape, -1)
            return token_reference(lprobs, pair["target"], d.pad(), alpha, 0.0)
    else:
        def ours(alpha, two_passes=False, **kw):
            return CrossEntropyRDropCriterion(CrossEntropyRDropConfig(
                sentence_avg=False, rdrop_alpha=alpha, rdrop_two_passes=two_passes, **kw),
                case.task)

        def parent(**kw):
            return CrossEntropyCriterion(case.task, False)

        def reference(model, pair, alpha, **kw):
            out = model(**pair["net_input"])
            lprobs = model.get_normalized_probs(out, log_probs=True).double()
            return token_reference(lprobs, pair["target"], d.pad(), alpha, 0.0)

    case = Case("adaptive_lm" if adaptive else "lm", build_model, make_sample, ours, parent,
                reference)
    return case


def sentence_case(regression):
    d = make_dictionary()
    labels = make_dictionary(3 + 4)  # 3 classes after the 4 special symbols
    num_classes = 1 if regression else 3

    def build_model(dropout, **kw):
        args, cfg = parse([
            "--task", "sentence_prediction", "--criterion", "sentence_prediction",
            "--arch", "roberta_base",
            "--num-classes", str(num_classes), "--encoder-layers", "1",
            "--encoder-embed-dim", "16", "--encoder-ffn-embed-dim", "32",
            "--encoder-attention-heads", "2", "--max-positions", "32",
            "--dropout", str(dropout), "--attention-dropout", str(dropout),
            "--activation-dropout", str(dropout), "--pooler-dropout", str(dropout),
            *(["--regression-target"] if regression else []),
        ])
        case.task, case.cfg = SentencePredictionTask(cfg.task, d, labels), cfg
        model = case.task.build_model(cfg.model)
        model.register_classification_head(HEAD, num_classes=num_classes)
        return model

    def make_sample(extra_pad=0):
        gen = torch.Generator().manual_seed(3)
        seqs = [torch.cat([torch.tensor([d.bos()]), s]) for s in lengths_batch(gen, 6, 2, 8)]
        src = collate_tokens(seqs, d.pad())
        if extra_pad:
            src = F.pad(src, (0, extra_pad), value=d.pad())
        target = (torch.randn(6, generator=gen) if regression
                  else torch.randint(0, 3, (6,), generator=gen))
        return {"net_input": {"src_tokens": src,
                              "src_lengths": torch.tensor([len(s) for s in seqs])},
                "target": target, "ntokens": int(src.ne(d.pad()).sum()), "nsentences": 6}

    def config(**kw):
        return dict(regression_target=regression, classification_head_name=HEAD)

    def ours(alpha, two_passes=False, **kw):
        return SentencePredictionRDropCriterion(
            SentencePredictionRDropConfig(rdrop_alpha=alpha, rdrop_two_passes=two_passes,
                                          **config(), **kw), case.task)

    def parent(**kw):
        return SentencePredictionCriterion(SentencePredictionConfig(**config()), case.task)

    def reference(model, pair, alpha, **kw):
        logits = model(**pair["net_input"], features_only=True,
                       classification_head_name=HEAD)[0].double()
        target = pair["target"]
        if regression:
            y = logits.view(-1)
            y1, y2 = y.chunk(2)
            consistency = ((y1 - y2) ** 2).sum()
            return ((y - target.double()) ** 2).sum() + alpha * consistency, consistency
        lprobs = logits.log_softmax(-1)
        nll = -lprobs.gather(1, target.unsqueeze(1)).sum()
        p_log, q_log = lprobs.chunk(2)
        kl = 0.5 * ((p_log.exp() - q_log.exp()) * (p_log - q_log)).sum()
        return nll + alpha * kl, kl

    case = Case("regression" if regression else "classification", build_model, make_sample,
                ours, parent, reference)
    return case


CASES = {
    "translation": translation_case,
    "lm": lambda: lm_case(adaptive=False),
    "adaptive_lm": lambda: lm_case(adaptive=True),
    "classification": lambda: sentence_case(regression=False),
    "regression": lambda: sentence_case(regression=True),
}
CONSISTENCY_KEY = {"regression": "rdrop_mse"}


@pytest.fixture(params=list(CASES))
def case(request):
    torch.manual_seed(0)
    return CASES[request.param]()


# --- helpers -----------------------------------------------------------------------------


def run(criterion, model, sample, seed=0):
    """Forward + backward under a fixed seed; returns loss, sample size, logs and grads."""
    model.zero_grad()
    torch.manual_seed(seed)
    loss, sample_size, logs = criterion(model, sample)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return loss.detach(), sample_size, logs, grads


def doubled(sample):
    """``[x; x]`` built by hand, for fairseq's own criteria."""
    def cat(v):
        return torch.cat([v, v]) if torch.is_tensor(v) else v
    return {"net_input": {k: cat(v) for k, v in sample["net_input"].items()},
            "target": cat(sample["target"]), "ntokens": 2 * sample["ntokens"],
            "nsentences": 2 * sample["nsentences"]}


def assert_grads_close(a, b, rtol=1e-5, atol=1e-7):
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(a[name].double(), b[name].double(), rtol=rtol, atol=atol,
                                   msg=lambda m, name=name: f"{name}: {m}")


class SecondHalfOffset:
    """Adds a fixed, position-indexed offset to the second half of a module's output.

    Stands in for dropout where a test needs the two passes to differ deterministically
    and independently of the batch's shape (e.g. when padding is added).
    """

    def __init__(self, module, scale=0.7):
        self.scale = scale
        self.table = None
        module.register_forward_hook(self)

    def __call__(self, module, inputs, output):
        x = output[0] if isinstance(output, tuple) else output
        if x.size(0) % 2:
            return output
        length = x.size(1) if x.dim() == 3 else 1
        if self.table is None or self.table.size(0) < length:
            gen = torch.Generator().manual_seed(7)
            self.table = self.scale * torch.randn(64, x.size(-1), generator=gen)
        offset = self.table[:length] if x.dim() == 3 else self.table[0]
        half = x.size(0) // 2
        x = torch.cat([x[:half], x[half:] + offset])
        return (x, *output[1:]) if isinstance(output, tuple) else x


def perturbed_module(case, model):
    if case.name in ("classification", "regression"):
        return model.classification_heads[HEAD]
    return model.decoder


# --- the checks ----------------------------------------------------------------------------


def test_alpha_zero_is_exactly_the_fairseq_parent(case):
    model = case.build_model(dropout=0.2)
    model.train()
    sample = case.make_sample()
    ours = run(case.ours(alpha=0.0), model, sample)
    theirs = run(case.parent(), model, sample)
    assert torch.equal(ours[0], theirs[0])
    assert ours[1] == theirs[1]
    assert ours[2].keys() == theirs[2].keys()
    assert_grads_close(ours[3], theirs[3], rtol=0, atol=0)


def test_two_passes_task_loss_is_the_parent_on_the_doubled_batch(case):
    """The 'two passes without KL' ablation: fairseq's loss on [x; x], normalised by x."""
    model = case.build_model(dropout=0.2)
    model.train()
    sample = case.make_sample()
    loss, sample_size, logs, grads = run(case.ours(alpha=0.0, two_passes=True), model, sample)
    p_loss, p_size, p_logs, p_grads = run(case.parent(), model, doubled(sample))
    torch.testing.assert_close(loss.reshape(()), p_loss.reshape(()), rtol=1e-5, atol=1e-6)
    assert_grads_close(grads, p_grads, rtol=1e-4, atol=1e-6)
    assert sample_size * 2 == p_size  # normalised by the original batch, not the doubled one
    torch.testing.assert_close((logs["loss"] * 2).reshape(()), p_logs["loss"].reshape(()),
                               rtol=1e-5, atol=1e-6)
    assert logs[CONSISTENCY_KEY.get(case.name, "rdrop_kl")] > 0  # still measured


@pytest.mark.parametrize("alpha", [0.7, 5.0])
def test_training_loss_is_the_formula_on_the_models_two_halves(case, alpha):
    model = case.build_model(dropout=0.3)
    model.train()
    sample = case.make_sample()
    criterion = case.ours(alpha=alpha)
    loss, sample_size, logs, grads = run(criterion, model, sample, seed=11)

    torch.manual_seed(11)  # same dropout masks: the reference repeats the same forward
    model.zero_grad()
    ref_loss, ref_consistency = case.reference(model, doubled(sample), alpha)
    ref_loss.backward()
    ref_grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    assert ref_consistency > 1e-6  # dropout really made the two passes differ
    torch.testing.assert_close(loss.double(), ref_loss.detach(), rtol=2e-5, atol=1e-5)
    key = CONSISTENCY_KEY.get(case.name, "rdrop_kl")
    torch.testing.assert_close(logs[key].double(), ref_consistency.detach(), rtol=2e-5, atol=1e-6)
    assert_grads_close(grads, ref_grads, rtol=1e-3, atol=1e-6)
    assert sample_size == (sample["nsentences"] if case.name in ("classification", "regression")
                           else sample["ntokens"])


def test_padding_changes_nothing(case):
    model = case.build_model(dropout=0.0)
    SecondHalfOffset(perturbed_module(case, model))
    model.train()
    criterion = case.ours(alpha=2.0)
    loss, sample_size, logs, grads = run(criterion, model, case.make_sample())
    loss_p, sample_size_p, logs_p, grads_p = run(criterion, model, case.make_sample(extra_pad=3))
    key = CONSISTENCY_KEY.get(case.name, "rdrop_kl")
    assert logs[key] > 1e-4  # the offset made the passes differ
    torch.testing.assert_close(loss_p, loss, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(logs_p[key], logs[key], rtol=1e-5, atol=1e-6)
    assert sample_size_p == sample_size
    assert_grads_close(grads_p, grads, rtol=1e-4, atol=1e-6)


def test_model_without_dropout_gives_zero_kl_and_a_warning(case, caplog):
    model = case.build_model(dropout=0.0)
    model.train()
    with caplog.at_level(logging.WARNING):
        loss, _, logs, _ = run(case.ours(alpha=5.0), model, case.make_sample())
    assert "every dropout of the model is 0" in caplog.text
    assert abs(float(logs[CONSISTENCY_KEY.get(case.name, "rdrop_kl")])) < 1e-6


def test_evaluation_runs_one_pass_like_the_parent(case):
    model = case.build_model(dropout=0.3)
    model.eval()
    sample = case.make_sample()
    with torch.no_grad():
        loss, size, logs = case.ours(alpha=5.0)(model, sample)
        p_loss, p_size, p_logs = case.parent()(model, sample)
    assert torch.equal(loss, p_loss) and size == p_size
    assert not any(k.startswith("rdrop") for k in logs)


def test_callers_sample_is_not_modified(case):
    model = case.build_model(dropout=0.1)
    model.train()
    sample = case.make_sample()
    before = {k: v.clone() for k, v in sample["net_input"].items()}
    target = sample["target"].clone()
    run(case.ours(alpha=1.0), model, sample)
    assert sample["net_input"].keys() == before.keys()
    for k, v in before.items():
        assert torch.equal(sample["net_input"][k], v)
    assert torch.equal(sample["target"], target)


def test_logged_metrics_are_per_token_and_comparable_to_the_baseline(case):
    """loss/nll_loss: mean of the two passes; the consistency term on its own, base 2."""
    model = case.build_model(dropout=0.2)
    model.train()
    sample = case.make_sample()
    criterion = case.ours(alpha=3.0, two_passes=False)
    _, _, logs, _ = run(criterion, model, sample)
    with metrics.aggregate() as agg:
        type(criterion).reduce_metrics([logs])
    key = CONSISTENCY_KEY.get(case.name, "rdrop_kl")
    size = logs["sample_size"]
    assert agg[key].avg == pytest.approx(float(logs[key]) / size / math.log(2), rel=1e-3, abs=1e-4)
    assert agg["loss"].avg == pytest.approx(float(logs["loss"]) / size / math.log(2), rel=1e-3)


# --- options and bad input ------------------------------------------------------------------


@pytest.mark.parametrize("alpha", [-1.0, float("nan"), float("inf")])
def test_invalid_alpha_is_rejected_naming_the_flag(case, alpha):
    case.build_model(dropout=0.1)
    with pytest.raises(ValueError, match="--rdrop-alpha"):
        case.ours(alpha=alpha)


@pytest.mark.parametrize("flag, value", [("--rdrop-alpha", "-1"), ("--rdrop-alpha", "nan"),
                                         ("--rdrop-alpha", "inf"), ("--rdrop-chunk-mb", "-1")])
@pytest.mark.parametrize("criterion", ["label_smoothed_cross_entropy_rdrop",
                                       "sentence_prediction_rdrop"])
def test_invalid_option_is_refused_while_fairseq_parses_it(criterion, flag, value, capsys):
    """As fairseq-train parses its command line, before it makes the save dir: argparse's
    one-line error naming the flag, not a traceback once training has set up."""
    with pytest.raises(SystemExit) as stop:
        parse(["--task", "translation", "--arch", "transformer_iwslt_de_en",
               "--criterion", criterion, flag, value])
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert f"error: argument {flag}: must be a finite number >= 0, got {value}" in err, err


@pytest.mark.parametrize("flag", ["--rdrop-alpha", "--rdrop-chunk-mb"])
@pytest.mark.parametrize("criterion", ["label_smoothed_cross_entropy_rdrop",
                                       "sentence_prediction_rdrop"])
@pytest.mark.parametrize("good", ["0", "0.5", "5"])
def test_valid_option_values_parse_into_the_criterions_config(criterion, flag, good):
    """The check above refuses only what it should: 0 (its bound) and positive values parse
    (each parse builds fairseq's whole config: a quarter second)."""
    _, cfg = parse(["--task", "translation", "--arch", "transformer_iwslt_de_en",
                    "--criterion", criterion, flag, good])
    assert getattr(cfg.criterion, flag[2:].replace("-", "_")) == float(good)


@pytest.mark.parametrize("chunk_mb", [-1.0, float("nan"), float("inf")])
def test_invalid_chunk_size_is_rejected_naming_the_flag(case, chunk_mb):
    case.build_model(dropout=0.1)
    with pytest.raises(ValueError, match="--rdrop-chunk-mb"):
        case.ours(alpha=1.0, rdrop_chunk_mb=chunk_mb)


def test_unknown_or_unavailable_impl_is_rejected_naming_the_flag(case, monkeypatch):
    from rdrop_fairseq.ops import rows_triton as triton_kernel

    case.build_model(dropout=0.1)
    with pytest.raises(ValueError, match="--rdrop-impl"):
        case.ours(alpha=1.0, rdrop_impl="cuda")
    monkeypatch.setattr(triton_kernel, "triton", None)  # as without the package
    with pytest.raises(ValueError, match="--rdrop-impl triton needs the triton package"):
        case.ours(alpha=1.0, rdrop_impl="triton")


def test_triton_impl_without_cuda_is_refused_when_the_criterion_is_built(monkeypatch):
    """Not at the first step (issue 20): without a GPU and without Triton's interpreter."""
    pytest.importorskip("triton")
    case = translation_case()
    case.build_model(dropout=0.1)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="--rdrop-impl triton needs a CUDA GPU"):
        case.ours(alpha=1.0, rdrop_impl="triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # the tests' interpreter stays usable
    assert case.ours(alpha=1.0, rdrop_impl="triton").rdrop_impl == "triton"


@pytest.mark.parametrize("chunk_mb", [1e-6, 0.0])
def test_chunk_size_changes_no_result(case, chunk_mb):
    """One row pair per chunk or the automatic size: the same loss and gradients."""
    model = case.build_model(dropout=0.3)
    model.train()
    sample = case.make_sample()
    a = run(case.ours(alpha=5.0, rdrop_chunk_mb=chunk_mb), model, sample, seed=5)
    b = run(case.ours(alpha=5.0, rdrop_chunk_mb=1e6), model, sample, seed=5)
    # float32 sums in another order (the adaptive case also re-runs its chunks)
    torch.testing.assert_close(a[0], b[0], rtol=1e-6, atol=1e-6)
    assert_grads_close(a[3], b[3], rtol=1e-4, atol=1e-5)


def test_training_step_adds_no_host_sync_over_the_parent(case):
    """Whatever the fairseq parent synchronises on the doubled batch (the model's own
    checks), the R-Drop criterion adds nothing to it: on a GPU the step never waits."""
    from rdrop_fairseq.opcount import count_ops

    model = case.build_model(dropout=0.3)
    model.train()
    sample = case.make_sample(extra_pad=2)

    def syncs(criterion, batch):
        run(criterion, model, batch)  # the first step's once-only checks
        with count_ops() as ops:
            run(criterion, model, batch)
        return ops.syncing

    ours, parent = syncs(case.ours(alpha=5.0), sample), syncs(case.parent(), doubled(sample))
    assert sum(ours.values()) <= sum(parent.values()), (ours, parent)


def test_model_with_its_own_normalisation_takes_the_log_prob_path():
    """A model whose get_normalized_probs is not fairseq's plain log_softmax (here: a
    temperature) is trained on *its* distribution: loss and KL follow the formula on it."""
    import types

    from rdrop_fairseq.criterions.output_layer import uses_stock_log_softmax

    case = CASES["translation"]()
    model = case.build_model(dropout=0.3)
    model.train()
    assert uses_stock_log_softmax(model)

    def tempered(self, net_output, log_probs, sample=None):
        logits = net_output[0].float() / 2.0
        return F.log_softmax(logits, -1) if log_probs else F.softmax(logits, -1)

    model.get_normalized_probs = types.MethodType(tempered, model)
    assert not uses_stock_log_softmax(model)
    sample = case.make_sample()
    loss, _, logs, grads = run(case.ours(alpha=5.0), model, sample, seed=11)
    torch.manual_seed(11)
    model.zero_grad()
    ref_loss, ref_kl = case.reference(model, doubled(sample), 5.0)  # uses the model's lprobs
    ref_loss.backward()
    torch.testing.assert_close(loss.double(), ref_loss.detach(), rtol=2e-5, atol=1e-5)
    torch.testing.assert_close(logs["rdrop_kl"].double(), ref_kl.detach(), rtol=2e-5, atol=1e-6)
    ref_grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    assert_grads_close(grads, ref_grads, rtol=1e-3, atol=1e-6)


def test_off_criterion_says_so(case, caplog):
    case.build_model(dropout=0.1)
    with caplog.at_level(logging.WARNING):
        case.ours(alpha=0.0)
    assert "R-Drop is off" in caplog.text


def test_undoubleable_batch_names_the_key(case):
    model = case.build_model(dropout=0.1)
    model.train()
    sample = case.make_sample()
    sample["net_input"]["src_lengths"] = sample["net_input"]["src_lengths"][:-1]
    with pytest.raises(RDropBatchError, match=r"net_input\['src_lengths'\]"):
        case.ours(alpha=1.0)(model, sample)


def test_sample_without_target_is_a_clear_error(case):
    model = case.build_model(dropout=0.1)
    model.train()
    sample = case.make_sample()
    del sample["target"]
    with pytest.raises(RDropBatchError, match="'target'"):
        case.ours(alpha=1.0)(model, sample)


@pytest.mark.parametrize("ignore_prefix_size", [0, 1])
@pytest.mark.parametrize("label_smoothing", [0.0, 0.1])
def test_label_smoothing_and_prefix_options_follow_the_formula(label_smoothing, ignore_prefix_size):
    case = translation_case()
    model = case.build_model(dropout=0.3)
    model.train()
    sample = case.make_sample()
    opts = dict(label_smoothing=label_smoothing, ignore_prefix_size=ignore_prefix_size)
    loss, _, logs, _ = run(case.ours(alpha=5.0, **opts), model, sample, seed=3)
    torch.manual_seed(3)
    with torch.no_grad():
        ref_loss, ref_kl = case.reference(model, doubled(sample), 5.0, **opts)
    torch.testing.assert_close(loss.double(), ref_loss, rtol=2e-5, atol=1e-5)
    torch.testing.assert_close(logs["rdrop_kl"].double(), ref_kl, rtol=2e-5, atol=1e-6)


def test_sentence_avg_and_accuracy_are_reported_per_original_batch():
    case = translation_case()
    model = case.build_model(dropout=0.3)
    model.train()
    sample = case.make_sample()
    _, sample_size, logs, _ = run(
        case.ours(alpha=5.0, sentence_avg=True, report_accuracy=True), model, sample)
    assert sample_size == sample["nsentences"]
    assert logs["total"] == sample["ntokens"]  # mean over the two passes
    assert 0 <= logs["n_correct"] <= logs["total"]


def test_adaptive_loss_rdrop_needs_an_adaptive_softmax():
    lm = lm_case(adaptive=False)
    model = lm.build_model(dropout=0.1)
    model.train()
    criterion = AdaptiveLossRDrop(AdaptiveLossRDropConfig(sentence_avg=False, rdrop_alpha=1.0),
                                  lm.task)
    with pytest.raises(ValueError, match="adaptive softmax"):
        criterion(model, lm.make_sample())


def test_adaptive_full_distribution_is_fairseqs():
    from rdrop_fairseq.criterions.adaptive_loss_rdrop import full_log_prob

    lm = lm_case(adaptive=True)
    model = lm.build_model(dropout=0.1, softmax_dropout=0.2)
    model.eval()
    asm = model.decoder.adaptive_softmax
    features = torch.randn(7, 16)
    with torch.no_grad():
        ours = full_log_prob(asm, features)
        theirs = asm.get_log_prob(features.unsqueeze(0), None).squeeze(0)
    torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(ours.exp().sum(-1), torch.ones(7), rtol=1e-5, atol=1e-5)


def test_adaptive_softmax_dropout_alone_makes_the_passes_differ():
    lm = lm_case(adaptive=True)
    model = lm.build_model(dropout=0.0, softmax_dropout=0.3)
    model.train()
    loss, _, logs, grads = run(lm.ours(alpha=1.0), model, lm.make_sample())
    assert logs["rdrop_kl"] > 1e-4 and torch.isfinite(loss).all()
    assert all(torch.isfinite(g).all() for g in grads.values())


def test_adaptive_nll_is_the_true_one_where_fairseq_drops_a_tail_term():
    """fairseq's adaptive_loss compares tail-relative targets with padding_idx, so the word
    at id cutoff[i] + padding_idx loses its tail term; ours is -log p(w), as fairseq-eval-lm."""
    lm = lm_case(adaptive=True)
    model = lm.build_model(dropout=0.0)
    model.eval()
    sample = lm.make_sample(avoid=(0, 0))
    target = sample["target"]
    assert target.eq(11).any() or target.eq(21).any()
    features = model(**sample["net_input"])[0].reshape(-1, 16)
    lprobs = model.decoder.adaptive_softmax.get_log_prob(features.unsqueeze(0), None)[0]
    nll = -lprobs.gather(1, target.view(-1, 1)).squeeze(1)[target.view(-1).ne(1)].sum()
    model.train()  # no dropout: both passes equal the eval pass
    _, _, logs, _ = run(lm.ours(alpha=0.0, two_passes=True), model, sample)
    torch.testing.assert_close(logs["loss"].double(), nll.double(), rtol=1e-5, atol=1e-5)
    fairseq_loss = lm.parent()(model, sample)[0]
    assert fairseq_loss.item() < nll.item() - 1e-3


@pytest.mark.parametrize("name", ["translation", "classification"])
def test_fairseq_trainer_dummy_batch_gives_zero_gradient(name):
    """An empty batch (e.g. an exhausted shard in distributed training) makes fairseq's
    Trainer replay its dummy batch with ignore_grad: the criterion must run and add nothing."""
    from fairseq.trainer import Trainer

    case = CASES[name]()
    model = case.build_model(dropout=0.3)
    criterion = case.ours(alpha=5.0)
    sample = case.make_sample()
    trainer = Trainer(case.cfg, case.task, model, criterion)
    trainer.reset_dummy_batch(sample)

    logs = trainer.train_step([sample])
    assert logs["loss"] > 0 and logs["rdrop_kl"] > 0
    trainer.train_step([{}])  # empty: replaced by the dummy batch, loss * 0
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    assert grads and all(g.abs().sum() == 0 for g in grads)
    assert trainer.get_num_updates() == 2


def test_label_smoothing_one_is_the_fairseq_parent_on_the_doubled_batch():
    """--label-smoothing 1.0, which fairseq's parent supports: the two-pass task loss and its
    gradient are the parent's on [x; x] (issue 19, item 8)."""
    case = translation_case()
    model = case.build_model(dropout=0.2)
    model.train()
    sample = case.make_sample()
    loss, _, logs, grads = run(case.ours(alpha=0.0, two_passes=True, label_smoothing=1.0),
                               model, sample)
    p_loss, _, p_logs, p_grads = run(case.parent(label_smoothing=1.0), model, doubled(sample))
    torch.testing.assert_close(loss.reshape(()), p_loss.reshape(()), rtol=1e-5, atol=1e-6)
    assert_grads_close(grads, p_grads, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close((logs["nll_loss"] * 2).reshape(()),
                               p_logs["nll_loss"].reshape(()), rtol=1e-5, atol=1e-6)


def test_accuracy_is_read_before_the_gradient_overwrites_the_logits():
    """The transformer's logits take the gradient in place (grad_in_scores="auto"): the
    reported accuracy must be that of the logits, computed before."""
    case = translation_case()
    model = case.build_model(dropout=0.3)
    model.train()
    sample = case.make_sample()
    _, _, logs, _ = run(case.ours(alpha=5.0, report_accuracy=True), model, sample, seed=5)
    torch.manual_seed(5)
    with torch.no_grad():
        pair = doubled(sample)
        predicted = model(**pair["net_input"])[0].argmax(-1)
    mask = pair["target"].ne(case.task.target_dictionary.pad())
    assert logs["n_correct"] == (predicted.eq(pair["target"]) & mask).sum() / 2


def test_classification_accuracy_is_read_before_the_gradient_overwrites_the_logits():
    case = CASES["classification"]()
    model = case.build_model(dropout=0.3)
    model.train()
    sample = case.make_sample()
    _, _, logs, _ = run(case.ours(alpha=1.0), model, sample, seed=6)
    torch.manual_seed(6)
    with torch.no_grad():
        pair = doubled(sample)
        logits, _ = model(**pair["net_input"], features_only=True, classification_head_name=HEAD)
    targets = pair["target"].view(-1)
    assert logs["ncorrect"] == (logits.argmax(1) == targets).sum() / 2


def test_keep_logits_from_the_command_line():
    """--rdrop-keep-logits is a flag of every R-Drop criterion and reaches the loss call."""
    for criterion, flags, expected in [
            ("label_smoothed_cross_entropy_rdrop", ["--rdrop-keep-logits"], False),
            ("label_smoothed_cross_entropy_rdrop", [], "auto"),
            ("cross_entropy_rdrop", ["--rdrop-keep-logits"], False)]:
        case = translation_case()
        case.build_model(dropout=0.1)
        _, cfg = parse(["--task", "translation", "--arch", "transformer_iwslt_de_en",
                        "--criterion", criterion, "--rdrop-alpha", "1", *flags])
        assert cfg.criterion.rdrop_keep_logits is bool(flags)
        assert case.task.build_criterion(cfg.criterion).grad_in_logits == expected


def recorded_and_reference(name, keep_logits, alpha=5.0, seed=7):
    """A forward hook records the logits the way a user would, ``output.detach()`` (shares
    storage), through one training step (criterion + backward) of ``name``'s model; returns
    what it holds after the step, the logits of the same forward made independently (same
    dropout masks), and the float64 gradient of the paper's loss with respect to them."""
    case = CASES[name]()
    model = case.build_model(dropout=0.3)
    model.train()
    sample = case.make_sample()
    translation = name == "translation"
    module = model.decoder if translation else model.classification_heads[HEAD]
    recorded = []
    hook = module.register_forward_hook(
        lambda m, i, out: recorded.append((out[0] if translation else out).detach()))
    run(case.ours(alpha=alpha, rdrop_keep_logits=keep_logits), model, sample, seed=seed)
    hook.remove()

    pair = doubled(sample)
    torch.manual_seed(seed)
    with torch.no_grad():
        if translation:
            logits = model(**pair["net_input"])[0]
        else:
            logits = model(**pair["net_input"], features_only=True,
                           classification_head_name=HEAD)[0]
    leaf = logits.double().requires_grad_()
    lprobs = leaf.log_softmax(-1)
    if translation:
        loss, _ = token_reference(lprobs, pair["target"], case.task.target_dictionary.pad(),
                                  alpha, 0.1)
    else:  # sentence_prediction: NLL of both passes + alpha * symmetric KL
        p_log, q_log = lprobs.chunk(2)
        loss = (-lprobs.gather(1, pair["target"].view(-1, 1)).sum()
                + alpha * 0.5 * ((p_log.exp() - q_log.exp()) * (p_log - q_log)).sum())
    (grad,) = torch.autograd.grad(loss, leaf)
    assert len(recorded) == 1
    return recorded[0], logits, grad


@pytest.mark.parametrize("name", ["translation", "classification"])
def test_a_hook_recording_the_logits_reads_them_with_keep_logits(name):
    """--rdrop-keep-logits (issue 26): the logits a forward hook recorded without a copy are
    still the logits after the step (the gradient went into a buffer of its own)."""
    recorded, logits, grad = recorded_and_reference(name, keep_logits=True)
    torch.testing.assert_close(recorded, logits, rtol=1e-6, atol=1e-6)
    assert not torch.allclose(recorded.double(), grad, atol=1e-3)


@pytest.mark.parametrize("name", ["translation", "classification"])
def test_without_keep_logits_a_hook_recording_the_logits_reads_their_gradient(name):
    """What README's --rdrop-keep-logits row says a reader gets without the flag: after the
    backward, the logits' buffer holds the gradient of the criterion's loss (the sum that
    fairseq normalises afterwards) with respect to the logits."""
    recorded, logits, grad = recorded_and_reference(name, keep_logits=False)
    torch.testing.assert_close(recorded.double(), grad, rtol=1e-4, atol=1e-6)
    assert not torch.allclose(recorded, logits, atol=1e-3)


def test_log_prob_fallback_is_logged_once(caplog):
    import types

    case = CASES["translation"]()
    model = case.build_model(dropout=0.3)
    model.train()

    def tempered(self, net_output, log_probs, sample=None):
        return F.log_softmax(net_output[0].float() / 2.0, -1)

    model.get_normalized_probs = types.MethodType(tempered, model)
    criterion = case.ours(alpha=5.0)
    with caplog.at_level(logging.INFO, logger="rdrop_fairseq.criterions.rdrop"):
        for seed in range(3):
            run(criterion, model, case.make_sample(), seed=seed)
    assert sum("log-probabilities" in r.getMessage() for r in caplog.records) == 1


@pytest.mark.parametrize("chunk_mb", [8.0, 32.0])
def test_adaptive_chunk_stays_within_its_budget(chunk_mb):
    """--rdrop-chunk-mb bounds the adaptive path too: forward and backward of the whole
    loss (several chunks) allocate at most 1.2x the budget at any time (it took 2-2.5x)."""
    from fairseq.modules.adaptive_softmax import AdaptiveSoftmax

    from rdrop_fairseq.criterions.adaptive_loss_rdrop import adaptive_rdrop_loss

    torch.manual_seed(0)
    vocab, dim, n = 20000, 32, 512  # 2n x V float32 = 78 MiB in all
    asm = AdaptiveSoftmax(vocab, dim, [2000, 8000], dropout=0.1)
    features = torch.randn(2 * n, dim, requires_grad=True)
    target = torch.randint(2, vocab, (n,)).repeat(2)
    with LiveBytes() as memory:
        total, _, _ = adaptive_rdrop_loss(asm, features, target, 1, 1.0, chunk_mb, "torch")
        total.backward()
    assert memory.peak <= 1.2 * chunk_mb * 2**20, memory.peak / 2**20


def test_transformer_logits_take_the_gradient_in_place_with_equal_gradients(monkeypatch):
    """fairseq's output_projection (F.linear on 3D features) qualifies: the logits' buffer is
    overwritten, and every parameter's gradient equals the separate buffer's (fp32, 1e-6)."""
    from rdrop_fairseq import core

    case = translation_case()
    model = case.build_model(dropout=0.3)
    model.train()
    sample = case.make_sample()
    seen = {}

    def keep_copy(module, inputs, output):
        seen["logits"], seen["copy"] = output, output.detach().clone()

    model.decoder.output_projection.register_forward_hook(keep_copy)
    criterion = case.ours(alpha=5.0, report_accuracy=True)
    in_place = run(criterion, model, sample, seed=7)
    assert not torch.equal(seen["logits"], seen["copy"])
    monkeypatch.setattr(core, "_grad_into_scores", lambda *args: False)
    separate = run(criterion, model, sample, seed=7)
    assert torch.equal(seen["logits"], seen["copy"])
    assert torch.equal(in_place[0], separate[0])
    assert_grads_close(in_place[3], separate[3], rtol=1e-6, atol=1e-9)
