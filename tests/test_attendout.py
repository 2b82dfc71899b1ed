"""AttendOut: the maskable layer, the generator, the model, the task's loop, the export.

Tiny models (3 layers x 16) on CPU; the layer and generator tests compare with fairseq's
own encoder layer and with the paper's equations written out here; the loop tests run the
task in-process; a few tests run fairseq-train / fairseq-hydra-train end to end.
"""

import copy
import math
import random
import re
import sys
import types
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from fairseq import tasks
from fairseq.modules.transformer_layer import TransformerEncoderLayer
from omegaconf import OmegaConf

import rdrop_fairseq
from rdrop_fairseq.models.attendout_generator import (
    AttendOutGenerator,
    action_log_prob,
    pack_mask,
    unpack_mask,
)
from rdrop_fairseq.models.attendout_layers import (
    AttendOutEncoderLayer,
    masked_self_attention,
    mean_of_values,
)
from rdrop_fairseq.models.attendout_reinforce import reinforce_step
from rdrop_fairseq.recipes import export_attendout
from rdrop_fairseq.tasks.attendout_plumbing import fp32_master_views
from rdrop_fairseq.tasks.attendout_processes import Processes
from tests.fairseq_config import training_config
from tests.warm_process import machine_env, run_command

BIN = Path(sys.executable).parent
USER_DIR = str(Path(rdrop_fairseq.__file__).parent)
TINY = ["--encoder-layers", "3", "--encoder-embed-dim", "16", "--encoder-ffn-embed-dim", "32",
        "--encoder-attention-heads", "2", "--max-positions", "64"]
WORDS = "the a man woman dog cat runs sleeps park city river old new red blue music".split()
HEAD = "sentence_classification_head"


# --------------------------------------------------------------------------- fixtures


def write_split(root, name, n, rng, regression=False):
    with open(root / f"{name}.input0", "w") as f, open(root / f"{name}.label", "w") as g:
        for _ in range(n):
            words = [rng.choice(WORDS) for _ in range(rng.randint(3, 12))]
            f.write(" ".join(words) + "\n")
            label = f"{words.count('dog') / 2:.2f}" if regression else (
                "pos" if "dog" in words else "neg")
            g.write(label + "\n")


def preprocess(raw, dest, regression=False):
    kinds = ["input0"] if regression else ["input0", "label"]
    for kind in kinds:
        proc = run_command([BIN / "fairseq-preprocess", "--only-source", "--trainpref",
                            raw / f"train.{kind}", "--validpref", raw / f"valid.{kind}",
                            "--destdir", dest / kind, "--workers", "1"],
                           raw, {**machine_env(), "PATH": f"{BIN}:/usr/bin:/bin",
                                 "HOME": "/tmp"}, 300)
        assert proc.returncode == 0, proc.stderr[-3000:]
    if regression:
        (dest / "label").mkdir()
        for split in ("train", "valid"):
            (dest / "label" / f"{split}.label").write_text((raw / f"{split}.label").read_text())


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("attendout-data")
    rng = random.Random(0)
    raw = root / "raw"
    raw.mkdir()
    write_split(raw, "train", 64, rng)
    write_split(raw, "valid", 16, rng)
    preprocess(raw, root / "bin")
    return root / "bin"


@pytest.fixture(scope="module")
def regression_data(tmp_path_factory):
    root = tmp_path_factory.mktemp("attendout-sts")
    rng = random.Random(1)
    raw = root / "raw"
    raw.mkdir()
    write_split(raw, "train", 32, rng, regression=True)
    write_split(raw, "valid", 8, rng, regression=True)
    preprocess(raw, root / "bin", regression=True)
    return root / "bin"


def build(data, *extra, criterion="sentence_prediction", arch="roberta_attendout"):
    """(task, model, criterion) built as fairseq-train builds them."""
    _, cfg = training_config([
        str(data), "--user-dir", USER_DIR, "--task", "sentence_prediction_attendout",
        "--arch", arch, *TINY, "--criterion", criterion, "--num-classes", "2", "--cpu",
        "--optimizer", "adam", "--lr", "1e-3", *extra])
    task = tasks.setup_task(cfg.task)
    torch.manual_seed(0)
    model = task.build_model(cfg.model)
    return task, model, task.build_criterion(cfg.criterion), cfg


def make_sample(task, batch=4, length=9, seed=0):
    """A right-padded batch like sentence_prediction's: <s> words </s> <pad>..."""
    g = torch.Generator().manual_seed(seed)
    d = task.source_dictionary
    lengths = torch.randint(3, length + 1, (batch,), generator=g)
    lengths[0] = length
    tokens = torch.full((batch, length), d.pad())
    for i, n in enumerate(lengths.tolist()):
        tokens[i, :n] = torch.randint(d.nspecial, len(d) - 1, (n,), generator=g)
        tokens[i, 0], tokens[i, n - 1] = d.bos(), d.eos()
    return {"id": torch.arange(batch), "nsentences": batch, "ntokens": int(lengths.sum()),
            "net_input": {"src_tokens": tokens, "src_lengths": lengths},
            "target": torch.randint(0, 2, (batch,), generator=g)}


def sharpen(model, scale=20.0):
    """Scale Q/K weights so that attention is far from uniform (BERT's init makes it ~uniform,
    which would hide the difference between attention and a mean of V)."""
    with torch.no_grad():
        for layer in model.encoder.sentence_encoder.layers:
            layer.self_attn.q_proj.weight.mul_(scale)
            layer.self_attn.k_proj.weight.mul_(scale)


# --------------------------------------------------------------------------- the layer


def layer_pair(normalize_before=False):
    args = types.SimpleNamespace(
        encoder_embed_dim=16, encoder_ffn_embed_dim=32, encoder_attention_heads=2,
        dropout=0.0, attention_dropout=0.0, activation_dropout=0.0, activation_fn="gelu",
        encoder_normalize_before=normalize_before)
    torch.manual_seed(0)
    ours = AttendOutEncoderLayer(args).eval()
    theirs = TransformerEncoderLayer(args).eval()
    with torch.no_grad():
        ours.self_attn.q_proj.weight.mul_(10)  # attention far from uniform
    theirs.load_state_dict(ours.state_dict())
    return ours, theirs


def layer_inputs(batch=3, length=7):
    torch.manual_seed(1)
    x = torch.randn(length, batch, 16)
    padding = torch.zeros(batch, length, dtype=torch.bool)
    padding[1, 5:] = True
    padding[2, 3:] = True
    return x, padding


@pytest.mark.parametrize("normalize_before", [False, True])
def test_masked_path_with_nothing_dropped_equals_fairseqs_layer(normalize_before):
    ours, theirs = layer_pair(normalize_before)
    x, padding = layer_inputs()
    keep_all = torch.zeros(x.size(1), x.size(0), x.size(0), dtype=torch.bool)
    expected = theirs(x, padding)
    valid = ~padding.t()
    torch.testing.assert_close(ours(x, padding, attendout_drop=keep_all)[valid], expected[valid],
                               rtol=1e-5, atol=1e-6)
    assert torch.equal(ours(x, padding), expected)  # no mask, not pruned: fairseq's own code


def eq3(attn, x, padding):
    """Eq. 3 written out: each query attends uniformly (1/n) to the n non-padding keys."""
    T, B, C = x.shape
    v = attn.v_proj(x)  # (T, B, C)
    out = torch.empty_like(x)
    for b in range(B):
        n = int((~padding[b]).sum())
        out[:, b] = v[:n, b].sum(0) / n
    return attn.out_proj(out)


def test_all_dropped_equals_pruned_equals_eq3():
    ours, _ = layer_pair()
    x, padding = layer_inputs()
    all_dropped = torch.ones(x.size(1), x.size(0), x.size(0), dtype=torch.bool)
    attn = ours.self_attn
    reference = eq3(attn, x, padding)
    masked = masked_self_attention(attn, x, padding, all_dropped)
    pruned = mean_of_values(attn, x, padding)
    valid = ~padding.t()
    torch.testing.assert_close(masked[valid], reference[valid], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(pruned[valid], reference[valid], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(ours(x, padding, attendout_drop=all_dropped)[valid],
                               ours(x, padding, attendout_pruned=True)[valid],
                               rtol=1e-5, atol=1e-6)
    # and it is not what full attention gives (the test would be empty otherwise)
    assert (ours(x, padding) - ours(x, padding, attendout_pruned=True))[valid].abs().max() > 1e-2


def test_dropped_units_get_zero_attention_and_padding_never_leaks():
    ours, _ = layer_pair()
    attn = ours.self_attn
    x, padding = layer_inputs()
    T, B = x.size(0), x.size(1)
    g = torch.Generator().manual_seed(0)
    drop = torch.rand(B, T, T, generator=g) < 0.5
    out = masked_self_attention(attn, x, padding, drop)
    # changing the inputs at dropped keys and at padding changes nothing for a query i
    # whose row keeps at least one key: perturb one key j's value through x only where
    # every query that can see j has it dropped
    for b in range(B):
        n = int((~padding[b]).sum())
        for j in range(T):
            sees_j = [i for i in range(n) if not drop[b, i, j] and j < n]
            x2 = x.clone()
            x2[j, b] += 5.0
            out2 = masked_self_attention(attn, x2, padding, drop)
            for i in range(n):
                if i == j or i in sees_j or bool(drop[b, i, :n].all()):
                    continue
                torch.testing.assert_close(out2[i, b], out[i, b], rtol=0, atol=1e-6)
    # the same example alone, without padding, gives the same outputs
    n = int((~padding[2]).sum())
    alone = masked_self_attention(attn, x[:n, 2:3], None, drop[2:3, :n, :n])
    torch.testing.assert_close(alone[:, 0], out[:n, 2], rtol=1e-5, atol=1e-6)
    pruned_alone = mean_of_values(attn, x[:n, 2:3])
    torch.testing.assert_close(pruned_alone[:, 0], mean_of_values(attn, x, padding)[:n, 2],
                               rtol=1e-5, atol=1e-6)


def test_gradients_are_finite_when_rows_are_fully_dropped():
    ours, _ = layer_pair()
    ours.train()
    x, padding = layer_inputs()
    x.requires_grad_(True)
    drop = torch.ones(x.size(1), x.size(0), x.size(0), dtype=torch.bool)
    drop[0, 0, 0] = False  # one row keeps a key, the others are all dropped
    ours(x, padding, attendout_drop=drop).sum().backward()
    assert torch.isfinite(x.grad).all()
    assert all(torch.isfinite(p.grad).all() for p in ours.parameters() if p.grad is not None)


def test_pruned_layer_skips_q_and_k():
    ours, _ = layer_pair()
    x, padding = layer_inputs()
    called = []
    hooks = [getattr(ours.self_attn, n).register_forward_hook(lambda *a, n=n: called.append(n))
             for n in ("q_proj", "k_proj", "v_proj", "out_proj")]
    ours(x, padding, attendout_pruned=True)
    for h in hooks:
        h.remove()
    assert called == ["v_proj", "out_proj"]


# --------------------------------------------------------------------------- the generator


def valid_units(pad, layers):
    keep = ~pad
    return (keep[:, None, :, None] & keep[:, None, None, :]).expand(-1, layers, -1, -1)


def test_generator_starts_near_init_drop_and_stays_float32():
    """The first drop probabilities sigmoid(S + beta) average about init_drop (beta =
    logit(init_drop)) and differ from unit to unit (measured: 0.03 to 0.30 for 0.1)."""
    torch.manual_seed(0)
    g = AttendOutGenerator(16, 3, init_drop=0.1)
    h = F.layer_norm(torch.randn(8, 9, 16), (16,))  # as the embedding LayerNorm gives
    pad = torch.zeros(8, 9, dtype=torch.bool)
    pad[1, 5:] = True
    logits = g(h, pad)
    assert logits.shape == (8, 3, 9, 9) and logits.dtype == torch.float32
    probs = torch.sigmoid(logits)[valid_units(pad, 3)]
    assert abs(probs.mean().item() - 0.1) < 0.01
    assert probs.min() < 0.06 and probs.max() > 0.18  # not one probability for every unit
    g.half()
    assert {p.dtype for p in g.parameters()} == {torch.float32}
    assert not any(p.requires_grad for p in g.parameters())
    for bad in (0.0, 1.0, -0.5, 2.0):
        with pytest.raises(ValueError, match="--attendout-init-drop"):
            AttendOutGenerator(16, 3, init_drop=bad)


def test_generator_logits_do_not_depend_on_padding():
    """A valid unit's logit is the same whatever the padding positions hold, and the same as
    for the example alone."""
    torch.manual_seed(0)
    g = AttendOutGenerator(16, 3)
    h = torch.randn(2, 7, 16)
    pad = torch.zeros(2, 7, dtype=torch.bool)
    pad[1, 4:] = True
    logits = g(h, pad)
    h2 = h.clone()
    h2[1, 4:] = 10 * torch.randn(3, 16)
    torch.testing.assert_close(g(h2, pad)[1, :, :4, :4], logits[1, :, :4, :4])
    alone = g(h[1:, :4], torch.zeros(1, 4, dtype=torch.bool))
    torch.testing.assert_close(alone[0], logits[1, :, :4, :4], rtol=1e-5, atol=1e-5)


def test_generator_statistics_count_valid_units_only():
    """drop_rate: the mean probability over each example's valid units (then over the
    examples); greedy_all_dropped: the fraction of examples whose valid units all have
    p > 0.5 (a padding unit never keeps an example from counting); both over every example
    of the interval's batches, written to the buffers at the pruning step."""
    g = AttendOutGenerator(16, 2, init_drop=0.1, decision="unit")
    pad = torch.tensor([[False] * 4, [False, False, True, True]])
    probs = torch.full((2, 2, 4, 4), 0.2)
    probs[1, :, :2, :2] = 0.9  # example 1: its 4 valid units, every layer
    probs[1, 0, 2:, :] = 0.0  # padding units (either side) that must not count
    probs[1, 0, :, 2:] = 0.0
    probs[0, 1] = 0.7  # example 0, layer 1: every unit
    logits = torch.logit(probs.clamp(1e-6, 1 - 1e-6))
    rate = g.batch_drop_rate(logits, pad)  # per unit, for the training log
    expected = torch.tensor([(0.2 + 0.9) / 2, (0.7 + 0.9) / 2])
    torch.testing.assert_close(rate, expected)
    totals = {}
    g.accumulate_statistics(totals, logits, pad)  # two batches: this one and ...
    other = torch.full((3, 2, 4, 4), -20.0)  # ... 3 examples that drop nothing
    g.accumulate_statistics(totals, other, torch.zeros(3, 4, dtype=torch.bool))
    statistic = g.finish_statistics(totals)
    torch.testing.assert_close(g.drop_rate, 2 * expected / 5, atol=1e-6, rtol=0)
    # all-dropped greedily: layer 0: example 1 only; layer 1: both; out of 5 examples
    torch.testing.assert_close(g.greedy_all_dropped, torch.tensor([1 / 5, 2 / 5]))
    assert statistic is g.greedy_all_dropped  # the unit mode's decision statistic
    g.pruned[1] = True  # a pruned layer's logged rate is 1
    torch.testing.assert_close(g.batch_drop_rate(logits, pad), torch.tensor([expected[0], 1]))


def test_action_log_prob_counts_valid_units_only():
    logits = torch.randn(2, 3, 4, 4)
    drop = torch.rand(2, 3, 4, 4) < 0.5
    pad = torch.tensor([[False] * 4, [False, False, True, True]])
    expected = []
    for b, n in enumerate((4, 2)):
        lp = torch.where(drop[b, :, :n, :n], F.logsigmoid(logits[b, :, :n, :n]),
                         F.logsigmoid(-logits[b, :, :n, :n]))
        expected.append(lp.sum() / (3 * n * n))
    torch.testing.assert_close(action_log_prob(logits, drop, pad), torch.stack(expected))
    # the padded units' values do not matter
    logits2 = logits.clone()
    logits2[1, :, 2:, :] = 100.0
    torch.testing.assert_close(action_log_prob(logits2, drop, pad)[1], expected[1])


def test_mask_packing_round_trip():
    mask = torch.rand(3, 2, 7, 7) < 0.3
    bits, shape = pack_mask(mask)
    assert bits.dtype == torch.uint8 and bits.numel() == math.ceil(mask.numel() / 8)
    assert torch.equal(unpack_mask(bits, shape), mask)


def test_reinforce_moves_the_generator_towards_rewarded_drops():
    """Toy reward: +1 per dropped unit of layer 1, -1 per dropped unit of layer 0. REINFORCE
    must raise layer 1's drop probability and lower layer 0's."""
    torch.manual_seed(0)
    g = AttendOutGenerator(16, 2, init_drop=0.5)
    g.build_optimizer(lr=0.05)
    h = torch.randn(8, 6, 16)
    pad = torch.zeros(8, 6, dtype=torch.bool)
    with torch.no_grad():
        before = torch.sigmoid(g(h, pad)).mean((0, 2, 3))
    for _ in range(30):
        g.requires_grad_(True)
        with torch.no_grad():
            drop = torch.rand(8, 2, 6, 6) < torch.sigmoid(g(h, pad))
        reward = drop[:, 1].float().mean((1, 2)) - drop[:, 0].float().mean((1, 2))
        reinforce_step(g, [reward], lambda t: action_log_prob(g(h, pad), drop, pad), 0.9)
        g.requires_grad_(False)
    with torch.no_grad():
        after = torch.sigmoid(g(h, pad)).mean((0, 2, 3))
    assert after[1] > before[1] + 0.1 and after[0] < before[0] - 0.1, (before, after)


def reinforce_case(batches=3, seed=0):
    """A generator and ``batches`` cached (h, pad, drop, reward) of 4 examples each."""
    torch.manual_seed(seed)
    g = AttendOutGenerator(16, 2, init_drop=0.3)
    cases = []
    for t in range(batches):
        h = torch.randn(4, 6, 16)
        pad = torch.zeros(4, 6, dtype=torch.bool)
        pad[t % 4, 3:] = True
        with torch.no_grad():
            drop = torch.rand(4, 2, 6, 6) < torch.sigmoid(g(h, pad))
        cases.append((h, pad, drop, torch.randn(4)))
    return g, cases


def reinforce_gradient(g, cases, baseline_of):
    """The gradient of Eq. 4's loss as the pruning step computed it before it went per batch:
    every batch's graph alive, one backward of the sum. ``baseline_of(r)``: b per example."""
    g.requires_grad_(True)
    g.zero_grad()
    loss = -sum(((r - baseline_of(r)) * action_log_prob(g(h, pad), drop, pad)).mean()
                for h, pad, drop, r in cases)
    loss.backward()
    g.requires_grad_(False)
    return {n: p.grad.clone() for n, p in g.named_parameters()
            if p.grad is not None}  # the gate's scalar: layer mode only


def reinforce_with_captured_gradient(g, cases, decay, leave_one_out=False):
    g.build_optimizer(lr=1e-3)
    grads = {}
    step = g.optimizer.step

    def capture():
        grads.update({n: p.grad.clone() for n, p in g.named_parameters()
                      if p.grad is not None})  # the gate's scalar: layer mode only
        step()

    g.optimizer.step = capture
    g.requires_grad_(True)
    mean = reinforce_step(g, [r for *_, r in cases],
                          lambda t: action_log_prob(g(*cases[t][:2]), cases[t][2], cases[t][1]),
                          decay, leave_one_out=leave_one_out)
    g.requires_grad_(False)
    g.optimizer.step = step
    return grads, mean


def test_reinforce_per_batch_backward_equals_one_backward_of_the_sum():
    """The pruning step backpropagates one cached batch at a time (bounded memory): the same
    gradient as one backward of the summed loss with every batch's graph alive."""
    g, cases = reinforce_case()
    reference = reinforce_gradient(copy.deepcopy(g), cases, lambda r: torch.zeros(()))
    grads, _ = reinforce_with_captured_gradient(g, cases, 0.9)
    assert grads["drop_bias"].abs() > 0
    for name, grad in reference.items():
        torch.testing.assert_close(grads[name], grad, rtol=1e-5, atol=1e-7, msg=name)


def test_reinforce_baseline_is_the_moving_average_of_past_mean_rewards():
    """b = 0 at the first pruning step, then b_1 = mean(r_1); at the second, the gradient uses
    b_1 and b becomes 0.9 b_1 + 0.1 mean(r_2)."""
    g, first = reinforce_case(seed=0)
    _, second = reinforce_case(seed=1)
    mean1 = torch.cat([r for *_, r in first]).mean()
    mean2 = torch.cat([r for *_, r in second]).mean()
    assert g.baseline is None
    grads1, m1 = reinforce_with_captured_gradient(g, first, 0.9)
    torch.testing.assert_close(m1, mean1)
    torch.testing.assert_close(g.baseline, mean1)
    reference = reinforce_gradient(copy.deepcopy(g), second, lambda r: mean1)
    grads2, _ = reinforce_with_captured_gradient(g, second, 0.9)
    for name, grad in reference.items():
        torch.testing.assert_close(grads2[name], grad, rtol=1e-5, atol=1e-7, msg=name)
    torch.testing.assert_close(g.baseline, 0.9 * mean1 + 0.1 * mean2)


def test_reinforce_leave_one_out_baseline():
    """--attendout-baseline leave_one_out: b_k = the mean reward of the batch's other
    examples; the moving average is still kept."""
    g, cases = reinforce_case()
    g.baseline = torch.tensor(5.0)  # would dominate the gradient if it were used
    reference = reinforce_gradient(copy.deepcopy(g), cases,
                                   lambda r: torch.stack([torch.cat([r[:k], r[k + 1:]]).mean()
                                                          for k in range(len(r))]))
    grads, mean = reinforce_with_captured_gradient(g, cases, 0.9, leave_one_out=True)
    for name, grad in reference.items():
        torch.testing.assert_close(grads[name], grad, rtol=1e-5, atol=1e-7, msg=name)
    torch.testing.assert_close(g.baseline, 0.9 * 5.0 + 0.1 * mean)


# --------------------------------------------------------------------------- model + task


def test_plain_roberta_weights_load_strictly_with_defender_equal_to_attacker(data):
    task, model, _, cfg = build(data)
    plain_args = copy.deepcopy(cfg.model)
    plain_args._name = "roberta"
    from fairseq import models

    torch.manual_seed(5)
    plain = models.build_model(plain_args, task)  # roberta.base/model.pt layout: no head
    state = plain.state_dict()
    generator_before = copy.deepcopy(model.generator.state_dict())
    model.load_state_dict(copy.deepcopy(state), strict=True, model_cfg=cfg.model)
    own = model.state_dict()
    for key, value in state.items():
        assert torch.equal(own[key], value), key
        if key.startswith("encoder.") and not key.endswith("version"):
            assert torch.equal(own["defender." + key], value), key
    for key in own:
        if key.startswith("classification_heads."):
            assert torch.equal(own[key], own["defender." + key]), key
    for key, value in generator_before.items():
        if torch.is_tensor(value):
            assert torch.equal(own["generator." + key], value), key


def test_a_longer_checkpoint_loads_into_a_shorter_model(data):
    """The paper's length 256 from roberta.base's 512 positions: the first rows are kept."""
    task, model, _, cfg = build(data)  # --max-positions 64
    plain_args = copy.deepcopy(cfg.model)
    plain_args._name = "roberta"
    plain_args.max_positions = 128
    from fairseq import models

    state = models.build_model(plain_args, task).state_dict()
    key = "encoder.sentence_encoder.embed_positions.weight"
    assert state[key].size(0) == 130
    model.load_state_dict(copy.deepcopy(state), strict=True, model_cfg=cfg.model)
    assert torch.equal(model.state_dict()[key], state[key][:66])
    assert torch.equal(model.state_dict()["defender." + key], state[key][:66])


def test_a_non_roberta_checkpoint_is_refused(data):
    _, model, _, cfg = build(data)
    with pytest.raises(ValueError, match="RoBERTa-format checkpoints"):
        model.load_state_dict({"decoder.layers.0.fc1.weight": torch.zeros(1)}, strict=True,
                              model_cfg=cfg.model)


@pytest.mark.parametrize("flag,value,match", [
    ("--attendout-interval", "0", "--attendout-interval must be >= 1"),
    ("--attendout-init-drop", "1.0", "--attendout-init-drop must be in"),
    ("--attendout-init-drop", "0", "--attendout-init-drop must be in"),
    ("--attendout-prune-threshold", "0", "--attendout-prune-threshold must be in"),
    ("--attendout-baseline-decay", "1", "--attendout-baseline-decay must be in"),
])
def test_bad_options_fail_at_start_up(data, flag, value, match):
    with pytest.raises(ValueError, match=match):
        build(data, flag, value)


def test_wrong_model_or_criterion_is_refused(data):
    with pytest.raises(ValueError, match="roberta_attendout model"):
        build(data, arch="roberta")
    # (fairseq's own config already fails for most other criteria: sentence_prediction's
    # task config interpolates the criterion's classification_head_name)
    task, _, _, _ = build(data)
    other = OmegaConf.create({"_name": "cross_entropy", "sentence_avg": False})
    with pytest.raises(ValueError, match="sentence-prediction criterion with a classification"):
        task.build_criterion(other)


@pytest.mark.parametrize("extra, match", [
    ((), "with --ddp-backend pytorch_ddp needs --find-unused-parameters"),
    (("--ddp-backend", "fully_sharded"), "needs --ddp-backend pytorch_ddp or legacy_ddp"),
    (("--ddp-backend", "legacy_ddp", "--use-bmuf"), "cannot run with --use-bmuf"),
    (("--ddp-backend", "legacy_ddp", "--zero-sharding", "os",
      "--attendout-sync-optimizer-state"), "that --zero-sharding os spreads"),
    (("--find-unused-parameters", "--report-mcc"), "--report-mcc under 2 processes on the CPU"),
])
def test_what_several_processes_cannot_run_is_refused(data, monkeypatch, extra, match):
    """Under several data-parallel processes (tests/test_attendout_distributed.py runs
    them), the options they cannot run are refused when the task is set up; the same
    options on one process, and the supported backends on two, build."""
    build(data, *extra)
    monkeypatch.setattr(Processes, "world_size", property(lambda self: 2))
    with pytest.raises(ValueError, match=match):
        build(data, *extra)
    for backend in (("--find-unused-parameters",), ("--ddp-backend", "legacy_ddp")):
        build(data, *backend)


class Optimizer:
    """The fp32 FairseqOptimizer fairseq-train builds (trainable parameters only)."""

    def __new__(cls, cfg, model):
        from fairseq import optim

        params = [p for p in model.parameters() if p.requires_grad]
        return optim.build_optimizer(cfg.optimizer, params)


def attacker_equals_defender(model):
    defender = dict(model.defender.named_parameters())
    return all(torch.equal(p, defender[name]) for name, p in model.attacker_parameters())


def run_updates(task, model, criterion, cfg, updates, update_freq=1, seed=0):
    """fairseq's loop, in process. Returns the optimizer, ``(cached batches, A == D)`` at each
    pruning step's start, and A == D after each update."""
    optimizer = Optimizer(cfg, model)
    pruning_calls, equal_after = [], []
    original = task.pruning_step
    task.pruning_step = lambda m, o, *a: (
        pruning_calls.append((len(task._cache), attacker_equals_defender(m))), original(m, o, *a))
    for update in range(updates):
        for micro in range(update_freq):
            sample = make_sample(task, seed=seed + update * update_freq + micro)
            task.train_step(sample, model, criterion, optimizer, update)
        task.optimizer_step(optimizer, model, update)
        optimizer.zero_grad()
        equal_after.append(attacker_equals_defender(model))
    task.pruning_step = original
    return optimizer, pruning_calls, equal_after


@pytest.mark.parametrize("update_freq", [1, 2])
def test_pruning_step_every_T_updates_and_defender_becomes_attacker(data, update_freq):
    task, model, criterion, cfg = build(data, "--attendout-interval", "3")
    generator_before = copy.deepcopy(model.generator.state_dict())
    _, calls, equal_after = run_updates(task, model, criterion, cfg, 7, update_freq)
    # updates 3 and 6, each with the T * update_freq batches since the last one; A and D
    # differ before each (A trained with masks, D without) and are equal right after
    assert calls == [(3 * update_freq, False)] * 2
    assert equal_after == [False, False, True, False, False, True, False]
    assert model.generator.pruning_steps == 2
    assert model.generator.masks_drawn == 7 * update_freq
    changed = [k for k, v in model.generator.state_dict().items()
               if torch.is_tensor(v) and not torch.equal(v, generator_before[k])]
    assert "drop_bias" in changed and "q_proj.weight" in changed


def test_layer_i_gets_the_masks_of_layer_i(data):
    task, model, _, _ = build(data)
    seen = {}
    layers = model.encoder.sentence_encoder.layers
    hooks = [layer.register_forward_hook(
        lambda m, args, kwargs, out, i=i: seen.__setitem__(i, kwargs["attendout_drop"]),
        with_kwargs=True) for i, layer in enumerate(layers)]
    tokens = make_sample(task)["net_input"]["src_tokens"]
    drop = torch.rand(4, 3, 9, 9) < 0.5
    model(tokens, classification_head_name=HEAD, attendout_drop=drop)
    for h in hooks:
        h.remove()
    assert sorted(seen) == [0, 1, 2]
    for i in range(3):
        assert torch.equal(seen[i], drop[:, i]), i


@pytest.mark.parametrize("kind", ["loss", "accuracy", "per_batch", "regression"])
def test_rewards_are_attacker_over_defender(data, regression_data, kind):
    """Per example: defender loss - attacker loss (cross-entropy; the squared error for
    regression), or attacker correct - defender correct; the batch's mean with
    --attendout-reward-per-batch. Computed here from the two networks' outputs."""
    extra = {"loss": [], "accuracy": ["--attendout-reward", "accuracy"],
             "per_batch": ["--attendout-reward-per-batch"],
             "regression": ["--regression-target", "--num-classes", "1"]}[kind]
    task, model, _, _ = build(regression_data if kind == "regression" else data, *extra)
    model.eval()
    torch.manual_seed(1)
    with torch.no_grad():  # attacker and defender far from each other and from uniform
        for name, p in model.named_parameters():
            if not name.startswith("generator."):
                p.add_(torch.randn_like(p))
    sample = make_sample(task, batch=16)
    if kind == "regression":
        sample["target"] = torch.randn(16)
    tokens, y = sample["net_input"]["src_tokens"], sample["target"]
    drop = torch.rand(16, 3, 9, 9) < 0.5
    with torch.no_grad():
        for net, kwargs in ((model, {"attendout_drop": drop}), (model.defender, {})):
            # centre each head's outputs on this batch: both predict either class
            net.classification_heads[HEAD].out_proj.bias -= net(
                tokens, classification_head_name=HEAD, **kwargs)[0].mean(0)
        rewards = task.pruning.rewards(model, sample, drop)
        a = model(tokens, classification_head_name=HEAD, attendout_drop=drop)[0]
        d = model.defender(tokens, classification_head_name=HEAD)[0]
    if kind == "regression":
        expected = (d.view(-1) - y) ** 2 - (a.view(-1) - y) ** 2
    elif kind == "accuracy":
        expected = (a.argmax(-1) == y).float() - (d.argmax(-1) == y).float()
    else:
        expected = F.cross_entropy(d, y, reduction="none") - F.cross_entropy(a, y,
                                                                            reduction="none")
    if kind == "per_batch":
        expected = expected.mean().expand(16)
    assert expected.ne(0).any() and (kind == "per_batch" or expected.unique().numel() > 1)
    torch.testing.assert_close(rewards, expected, rtol=1e-5, atol=1e-6)


def test_leave_one_out_with_one_reward_per_batch_is_refused(data):
    with pytest.raises(ValueError, match="--attendout-baseline moving_average"):
        build(data, "--attendout-baseline", "leave_one_out", "--attendout-reward-per-batch")


def test_pruning_step_uses_the_leave_one_out_baseline_when_asked(data, monkeypatch):
    from rdrop_fairseq.models import attendout_reinforce as module

    seen = []
    monkeypatch.setattr(module, "reinforce_step",
                        lambda *a, **k: seen.append(k.get("leave_one_out")))
    for baseline, expected in (("moving_average", False), ("leave_one_out", True)):
        task, model, criterion, cfg = build(data, "--attendout-interval", "1",
                                            "--attendout-baseline", baseline)
        run_updates(task, model, criterion, cfg, 1)
        assert seen.pop() is expected


def test_a_skipped_update_leaves_no_action_in_the_cache(data, monkeypatch):
    """As fairseq's Trainer.train_step runs them. fp16 overflow: train_step for each batch
    of the update, then clip_grad_norm raises OverflowError: no optimizer_step, zero_grad,
    the next update. AMP overflow: optimizer_step runs, skips the step and lowers the loss
    scale, then the same batch is retried at the same update_num. The cache holds the
    applied updates' batches, once each, and the pruning step waits for an applied update."""
    from rdrop_fairseq.tasks import sentence_prediction_attendout as module

    task, model, criterion, cfg = build(data, "--attendout-interval", "2")
    optimizer = Optimizer(cfg, model)
    batches = [make_sample(task, seed=i) for i in range(4)]
    rewarded = []
    original = task.pruning_step
    task.pruning_step = lambda m, o, *a: (rewarded.append([id(s) for s, *_ in task._cache]),
                                          original(m, o, *a))

    def attempt(samples, update_num, step=True):
        optimizer.zero_grad()
        for sample in samples:
            task.train_step(sample, model, criterion, optimizer, update_num)
        if step:
            task.optimizer_step(optimizer, model, update_num)

    attempt(batches[:2], 0, step=False)  # fp16 overflow
    attempt(batches[2:3], 0)
    assert [id(s) for s, *_ in task._cache] == [id(batches[2])]
    scales = iter([2.0, 1.0, 1.0, 1.0])  # the scale before/after AMP's step: halved = skipped
    monkeypatch.setattr(module, "_amp_optimizer_types", lambda: (type(optimizer),))
    optimizer.scaler = types.SimpleNamespace(get_scale=lambda: next(scales))
    attempt(batches[3:], 1)  # AMP overflow, at a pruning update
    assert rewarded == [] and model.generator.pruning_steps == 0
    attempt(batches[3:], 1)  # the retry
    assert rewarded == [[id(batches[2]), id(batches[3])]]
    assert model.generator.pruning_steps == 1


def test_skipped_updates_do_not_count_in_the_pruning_statistic(data):
    """The decision statistic (the gate's probability, the mean over the interval's examples)
    covers the batches of applied updates only, like the cache: batches of an update that
    fp16 overflow skipped count nowhere. Expected: the mean computed here over the applied
    batches, which differs from the mean that also takes the skipped ones."""
    task, model, criterion, cfg = build(data, "--attendout-interval", "2")
    g = model.generator
    with torch.no_grad():  # gate probabilities that differ from batch to batch
        g.q_proj.weight.mul_(8.0)
        g.k_proj.weight.mul_(8.0)
    optimizer = Optimizer(cfg, model)
    skipped = [make_sample(task, batch=12, seed=50), make_sample(task, batch=12, seed=51)]
    applied = [make_sample(task, batch=4, seed=1), make_sample(task, batch=4, seed=2)]
    pad = task.source_dictionary.pad()
    expected = {}

    def gate_sums(samples):  # (sum over the examples of each layer's gate probability, count)
        with torch.no_grad():
            probs = [g.gate_logits(task.pruning.drop_logits(
                model, s["net_input"]["src_tokens"], s["net_input"]["src_tokens"].eq(pad)),
                s["net_input"]["src_tokens"].eq(pad)).sigmoid() for s in samples]
        return sum(p.sum(0) for p in probs), sum(p.size(0) for p in probs)

    original = task.pruning_step

    def pruning_step(m, o, *a):  # the statistic is taken with the weights of this moment
        model.eval()
        total, n = gate_sums(applied)
        total_all, n_all = gate_sums(applied + skipped)
        model.train()
        expected["applied"], expected["all"] = total / n, total_all / n_all
        return original(m, o, *a)

    task.pruning_step = pruning_step
    optimizer.zero_grad()
    for sample in skipped:  # fp16 overflow: no optimizer_step, zero_grad, the next update
        task.train_step(sample, model, criterion, optimizer, 0)
    optimizer.zero_grad()
    for update, sample in enumerate(applied):
        task.train_step(sample, model, criterion, optimizer, update)
        task.optimizer_step(optimizer, model, update)
        optimizer.zero_grad()
    assert g.pruning_steps == 1
    assert (expected["applied"] - expected["all"]).abs().max() > 1e-3  # the check can tell
    torch.testing.assert_close(g.gate_prob, expected["applied"], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("precision", ["fp32", "fp16", "bf16"])
def test_sync_optimizer_state_copies_the_attackers_adam_moments(data, monkeypatch, precision):
    """--attendout-sync-optimizer-state: at D <- A, the defender's Adam moments become the
    attacker's, wherever fairseq keeps them: keyed by the parameters (fp32), in one flat
    fp32 master (--fp16) or per fp32 master (--bf16, never flat in fairseq)."""
    from fairseq.optim.fp16_optimizer import FP16Optimizer

    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)  # flat masters' dict key
    for sync in (True, False):
        task, model, criterion, cfg = build(
            data, "--attendout-interval", "100", *([f"--{precision}"] * (precision != "fp32")),
            *(["--attendout-sync-optimizer-state"] * sync))
        if precision == "fp32":
            optimizer = Optimizer(cfg, model)
        else:
            model = model.to(torch.float16 if precision == "fp16" else torch.bfloat16)
            optimizer = FP16Optimizer.build_optimizer(
                cfg, [p for p in model.parameters() if p.requires_grad])
            assert isinstance(optimizer.fp32_params, dict if precision == "fp16" else list)
        task.train_step(make_sample(task), model, criterion, optimizer, 0)
        optimizer.step()
        params = [p for p in model.parameters() if p.requires_grad]

        def adam_moments():  # {id(model parameter): (exp_avg, exp_avg_sq)}, () if none
            state = optimizer.optimizer.state
            if precision == "fp16":
                flat = state[optimizer.fp32_params[0]]
                sizes = [p.numel() for p in params]
                return dict(zip(map(id, params), zip(
                    *(flat[k].split(sizes) for k in ("exp_avg", "exp_avg_sq")))))
            masters = optimizer.fp32_params if precision == "bf16" else params
            return {id(p): (state[m]["exp_avg"], state[m]["exp_avg_sq"]) if m in state
                    else () for p, m in zip(params, masters)}

        moments = adam_moments()
        pairs = [(id(a), id(d)) for a, d in model.defender_pairs()]
        assert sum(len(moments[a]) for a, _ in pairs) > 20  # most parameters have state
        assert not all(torch.equal(moments[a][0], moments[d][0]) for a, d in pairs
                       if moments[a])
        task.copy_attacker_to_defender(model, optimizer)
        moments = adam_moments()
        # bit for bit: a step without fairseq's overflow check (--fp16's loss scale) can
        # leave NaN in the moments, which torch.equal never finds equal to its copy
        same = [all(torch.equal(x.view(torch.int32), y.view(torch.int32))
                    for x, y in zip(moments[a], moments[d])) and
                len(moments[a]) == len(moments[d]) for a, d in pairs]
        assert all(same) if sync else not all(same), sync


def test_fairseqs_optimizer_never_holds_the_generator(data):
    task, model, criterion, cfg = build(data, "--attendout-interval", "100")
    optimizer = Optimizer(cfg, model)
    held = {id(p) for group in optimizer.optimizer.param_groups for p in group["params"]}
    assert not held & {id(p) for p in model.generator.parameters()}
    params_before = {k: v.clone() for k, v in model.generator.named_parameters()}
    run_updates(task, model, criterion, cfg, 3)
    for k, v in model.generator.named_parameters():
        assert torch.equal(v, params_before[k]), k  # no pruning step yet: untouched


def test_defender_copy_reaches_fp16_master_weights(data, monkeypatch):
    """--fp16/--bf16: fairseq's FP16Optimizer keeps fp32 masters that overwrite the model
    after every step; D <- A must be written there too (flat masters: --fp16; per-parameter
    masters: --bf16, which fairseq never flattens)."""
    from fairseq.optim.fp16_optimizer import FP16Optimizer

    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)  # flat masters' dict key
    for flag, dtype, flat in (("--fp16", torch.float16, True), ("--bf16", torch.bfloat16, False)):
        task, model, criterion, cfg = build(data, flag, "--attendout-interval", "100")
        model = model.to(dtype)
        params = [p for p in model.parameters() if p.requires_grad]
        optimizer = FP16Optimizer.build_optimizer(cfg, params)
        assert isinstance(optimizer.fp32_params, dict if flat else list)
        with torch.no_grad():
            for _, p in model.attacker_parameters():
                p.add_(0.5)
        masters = fp32_master_views(optimizer)
        for _, p in model.attacker_parameters():
            masters[id(p)].copy_(p.float())
        task.copy_attacker_to_defender(model, optimizer)
        optimizer._sync_fp32_params_to_fp16()  # what the next step does
        for a, d in model.defender_pairs():
            assert torch.equal(a, d)
            assert torch.equal(masters[id(a)], masters[id(d)])


def test_flat_masters_one_layout_for_the_copy_and_the_moments():
    """Both D <- A paths (the master weights, the Adam moments) read one layout of the flat
    fp32 master: the parameters one after another. A dict of one flat master per device
    (fairseq's pipeline parallelism) is refused by both, with the same error, rather than
    one of them silently taking the first device's master."""
    from rdrop_fairseq.tasks.attendout_plumbing import copy_optimizer_state

    a, other, d = torch.zeros(2, 3), torch.zeros(4), torch.zeros(2, 3)  # 6 + 4 + 6 values
    flat = torch.arange(16.0)
    moments = torch.arange(100.0, 116.0)

    def fake(masters):
        return types.SimpleNamespace(fp16_params=[a, other, d], fp32_params=masters,
                                     optimizer=types.SimpleNamespace(
                                         state={flat: {"exp_avg": moments.clone(), "step": 3}}))

    one = fake({0: flat})
    views = fp32_master_views(one)
    assert torch.equal(views[id(a)], torch.arange(0.0, 6.0).view(2, 3))
    assert torch.equal(views[id(other)], torch.arange(6.0, 10.0))
    assert torch.equal(views[id(d)], torch.arange(10.0, 16.0).view(2, 3))
    copy_optimizer_state(one, [(a, d)])
    expected = torch.cat([torch.arange(100.0, 110.0), torch.arange(100.0, 106.0)])
    assert torch.equal(one.optimizer.state[flat]["exp_avg"], expected)
    assert one.optimizer.state[flat]["step"] == 3

    per_device = fake({0: flat, 1: torch.arange(16.0, 32.0)})
    for copy in (lambda o: copy_optimizer_state(o, [(a, d)]), fp32_master_views):
        with pytest.raises(ValueError, match="one flat fp32 master, got 2"):
            copy(per_device)
    assert torch.equal(per_device.optimizer.state[flat]["exp_avg"], moments)  # untouched


def test_composes_with_rdrop_the_mask_is_shared_by_both_passes(data):
    task, model, criterion, cfg = build(data, "--rdrop-alpha", "1.0",
                                        criterion="sentence_prediction_rdrop")
    seen = []
    hook = model.encoder.register_forward_hook(
        lambda m, args, kwargs, out: seen.append(kwargs.get("attendout_drop")),
        with_kwargs=True)
    sample = make_sample(task)
    _, _, log = task.train_step(sample, model, criterion, Optimizer(cfg, model), 0)
    hook.remove()
    drop = seen[0]
    assert drop.size(0) == 2 * sample["nsentences"]  # the doubled batch carries the masks
    assert torch.equal(drop[:4], drop[4:])
    assert log["rdrop_kl"] > 0 and "defender_loss" in log


def test_rdrop_alpha_zero_is_plain_sentence_prediction(data):
    logs = []
    for criterion, extra in (("sentence_prediction", []),
                             ("sentence_prediction_rdrop", ["--rdrop-alpha", "0"])):
        task, model, crit, cfg = build(data, *extra, criterion=criterion)
        torch.manual_seed(0)
        _, _, log = task.train_step(make_sample(task), model, crit, Optimizer(cfg, model), 0)
        logs.append(log)
    for key in ("loss", "defender_loss", "ncorrect"):
        assert torch.equal(torch.as_tensor(logs[0][key]), torch.as_tensor(logs[1][key])), key


def test_validation_reports_the_exported_model(data):
    task, model, criterion, cfg = build(data)
    sharpen(model)
    sample = make_sample(task)
    _, _, plain = task.valid_step(sample, model, criterion)
    assert plain["attendout_num_pruned"] == 0
    torch.testing.assert_close(plain["loss"], plain["loss_unpruned"])
    model.generator.pruned.fill_(True)  # every layer pruned, as a pruning step decides it
    model.set_pruned_layers(model.generator.pruned_layers())
    _, _, pruned = task.valid_step(sample, model, criterion)
    assert pruned["attendout_num_pruned"] == 3
    torch.testing.assert_close(pruned["loss_unpruned"], plain["loss"])
    assert not torch.allclose(pruned["loss"], plain["loss"])
    model.set_pruned_layers((0, 1, 2))
    _, _, direct = super(type(task), task).valid_step(sample, model, criterion)
    torch.testing.assert_close(pruned["loss"], direct["loss"])
    assert model.pruned_layers == (0, 1, 2)  # validation leaves the pruned layers as it found them


# --------------------------------------------------------------------------- command line


def train_cmd(data, save_dir, *extra, max_update=8):
    return [str(BIN / "fairseq-train"), str(data), "--user-dir", USER_DIR, "--cpu",
            "--task", "sentence_prediction_attendout", "--arch", "roberta_attendout", *TINY,
            "--criterion", "sentence_prediction", "--num-classes", "2", "--max-sentences", "8",
            "--optimizer", "adam", "--lr", "1e-3", "--max-update", str(max_update),
            "--attendout-interval", "4", "--attendout-generator-lr", "1e-2",
            "--save-dir", str(save_dir), "--no-epoch-checkpoints", "--log-interval", "1",
            "--no-progress-bar", "--log-format", "simple", "--init-token", "0",
            "--separator-token", "2", "--seed", "3", "--num-workers", "0", *extra]


def run(cmd, cwd):
    """A fairseq tool (started warm: tests/warm_process.py) that must succeed; its output."""
    proc = run_command(cmd, cwd, {**machine_env(), "PATH": f"{BIN}:/usr/bin:/bin",
                                  "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
                                  "HOME": "/tmp"}, 300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout + proc.stderr


def load(path):
    return torch.load(path, map_location="cpu")


# the generator starts near dropping whole layers (p = 0.6 on average): its greedy masks drop
# every unit of a layer for a few examples, and the threshold prunes on such a fraction
# the per-unit rule, whose greedy statistic 8 tiny batches can move past this threshold
STRAIGHT = ("--attendout-decision", "unit", "--attendout-init-drop", "0.6",
            "--attendout-prune-threshold", "0.002")


@pytest.fixture(scope="module")
def straight_run(data, tmp_path_factory):
    save = tmp_path_factory.mktemp("straight")
    log = run(train_cmd(data, save, *STRAIGHT), save)
    return save, log


@pytest.mark.slow
def test_fairseq_train_end_to_end_then_export(straight_run, tmp_path):
    save, log = straight_run
    assert log.count("AttendOut pruning step") == 2
    valid = [line for line in log.splitlines() if "valid on 'valid' subset" in line]
    assert valid and all(re.search(r"accuracy_unpruned [\d.]+", v) for v in valid)
    assert re.search(r"attendout_drop_L2=0\.\d+", log)
    state = load(save / "checkpoint_last.pt")
    extra = state["model"]["generator._extra_state"]
    assert extra["pruning_steps"] == 2 and extra["optimizer"]["state"]
    # the run's own statistic: a layer whose greedy mask dropped every unit for at least the
    # threshold's fraction of examples is pruned, for good (sticky), and validation and the
    # export prune what the run pruned
    fractions = state["model"]["generator.greedy_all_dropped"].tolist()
    pruned = state["model"]["generator.pruned"].tolist()
    expected = [i for i, p in enumerate(pruned) if p]
    assert max(fractions) > 0 and expected, (fractions, pruned)
    assert all(pruned[i] for i, f in enumerate(fractions) if f >= 0.002), (fractions, pruned)
    assert f"attendout_num_pruned {len(expected)}" in valid[-1]  # validated after update 8
    out = tmp_path / "exported" / "model.pt"
    assert export_attendout.main(["--checkpoint", str(save / "checkpoint_last.pt"),
                                  "--output", str(out)]) == 0
    exported = load(out)
    assert not any(k.startswith(("defender.", "generator.")) for k in exported["model"])
    assert "last_optimizer_state" not in exported
    assert exported["cfg"]["model"].attendout_pruned_layers == ",".join(map(str, expected))
    assert exported["cfg"]["model"].attendout_inference_only

    from fairseq import checkpoint_utils, models

    loaded, cfg, task = checkpoint_utils.load_model_ensemble_and_task([str(out)])
    model = loaded[0].eval()
    assert model.inference_only and model.pruned_layers == tuple(expected)
    plain_cfg = copy.deepcopy(cfg.model)
    plain_cfg._name = "roberta"
    plain = models.build_model(plain_cfg, task)
    plain.register_classification_head(HEAD, num_classes=2)
    plain.load_state_dict(exported["model"], strict=True, model_cfg=plain_cfg)
    plain.eval()
    sharpen(plain)
    sharpen(model)
    sample = make_sample(task)
    tokens = sample["net_input"]["src_tokens"]
    full = plain(tokens, classification_head_name=HEAD)[0]
    fast = model(tokens, classification_head_name=HEAD)[0]
    assert not torch.allclose(full, fast, atol=1e-3)  # layers pruned
    model.set_pruned_layers(())
    torch.testing.assert_close(model(tokens, classification_head_name=HEAD)[0], full)


def test_export_refuses_a_checkpoint_without_attendout(tmp_path, capsys):
    path = tmp_path / "plain.pt"
    torch.save({"model": {"encoder.x": torch.zeros(1)}, "cfg": {"task": {}}}, path)
    with pytest.raises(SystemExit):
        export_attendout.main(["--checkpoint", str(path), "--output", str(tmp_path / "o.pt")])
    assert "not an AttendOut training checkpoint" in capsys.readouterr().err
    assert not (tmp_path / "o.pt").exists()


@pytest.mark.slow
def test_resume_between_pruning_steps_restores_every_attendout_state(straight_run, data,
                                                                    tmp_path):
    """6 updates, stop (between the pruning steps after updates 4 and 8), resume to 8: the
    same weights, generator, its Adam, baseline and statistics as the straight 8-update
    run; the pruning step after update 8 is rewarded on updates 5-8, two of which come from
    the checkpoint's cache."""
    straight, _ = straight_run
    run(train_cmd(data, tmp_path, *STRAIGHT, max_update=6), tmp_path)
    first = load(tmp_path / "checkpoint_last.pt")
    extra = first["model"]["generator._extra_state"]
    assert extra["pruning_steps"] == 1 and extra["masks_drawn"] == 6
    cache = first["extra_state"]["SentencePredictionAttendOutTask"]["attendout_cache"]
    assert len(cache) == 2 and all(bits.device.type == "cpu" and rewards is None
                                   for _, (bits, _), rewards in cache)
    log = run(train_cmd(data, tmp_path, *STRAIGHT, max_update=8), tmp_path)
    assert "Loaded checkpoint" in log
    assert "2 batches since the last pruning step restored" in log
    assert "rewarded on 4 cached batches" in log
    resumed = load(tmp_path / "checkpoint_last.pt")["model"]
    reference = load(straight / "checkpoint_last.pt")["model"]
    assert set(resumed) == set(reference)
    for key, value in reference.items():
        if torch.is_tensor(value):
            torch.testing.assert_close(resumed[key], value, rtol=0, atol=0, msg=key)
    a, b = resumed["generator._extra_state"], reference["generator._extra_state"]
    assert (a["pruning_steps"], a["masks_drawn"]) == (b["pruning_steps"], b["masks_drawn"]) == (2, 8)
    torch.testing.assert_close(a["baseline"], b["baseline"], rtol=0, atol=0)
    for name in ("exp_avg", "exp_avg_sq"):
        for i in a["optimizer"]["state"]:
            torch.testing.assert_close(a["optimizer"]["state"][i][name],
                                       b["optimizer"]["state"][i][name], rtol=0, atol=0)


@pytest.mark.slow
def test_restore_a_plain_roberta_checkpoint_then_regression(regression_data, tmp_path):
    """--restore-file of a plain roberta checkpoint (--reset-optimizer), on STS-B-like
    regression (--num-classes 1): trains, rewards (from the squared error: the values are
    test_rewards_are_attacker_over_defender[regression]'s), validates."""
    pre = tmp_path / "pre"
    run([str(BIN / "fairseq-train"), str(regression_data), "--cpu", "--task",
         "sentence_prediction", "--arch", "roberta", *TINY, "--criterion",
         "sentence_prediction", "--regression-target", "--num-classes", "1",
         "--max-sentences", "8", "--optimizer", "adam", "--lr", "1e-3", "--max-update", "2",
         "--save-dir", str(pre), "--no-epoch-checkpoints", "--no-progress-bar",
         "--num-workers", "0"], tmp_path)
    cmd = train_cmd(regression_data, tmp_path / "ft", "--regression-target",
                    "--restore-file", str(pre / "checkpoint_last.pt"), "--reset-optimizer",
                    "--reset-dataloader", "--reset-meters", max_update=4)
    cmd[cmd.index("--num-classes") + 1] = "1"
    log = run(cmd, tmp_path)
    assert f"Loaded checkpoint {pre / 'checkpoint_last.pt'}" in log
    assert "AttendOut pruning step 1 (update 4): generator rewarded on 4 cached batches" in log
    state = load(tmp_path / "ft" / "checkpoint_last.pt")
    assert torch.isfinite(state["model"]["generator.drop_bias"])


@pytest.mark.slow
def test_fairseq_hydra_train_end_to_end(data, tmp_path):
    config = tmp_path / "attendout.yaml"
    config.write_text(f"""\
# @package _group_
common: {{cpu: true, user_dir: {USER_DIR}, log_format: simple, log_interval: 1,
  no_progress_bar: true, seed: 1}}
task: {{_name: sentence_prediction_attendout, data: {data}, num_classes: 2, init_token: 0,
  separator_token: 2, max_positions: 64, attendout_interval: 2}}
model: {{_name: roberta_attendout, encoder_layers: 2, encoder_embed_dim: 16,
  encoder_ffn_embed_dim: 32, encoder_attention_heads: 2, max_positions: 64}}
criterion: {{_name: sentence_prediction}}
optimizer: {{_name: adam}}
lr_scheduler: {{_name: fixed}}
optimization: {{max_update: 4, lr: [0.001]}}
dataset: {{batch_size: 8, num_workers: 0}}
checkpoint: {{save_dir: {tmp_path / 'ckpt'}, no_epoch_checkpoints: true}}
""")
    log = run([str(BIN / "fairseq-hydra-train"), "--config-dir", str(tmp_path),
               "--config-name", "attendout", f"hydra.run.dir={tmp_path / 'hydra'}"], tmp_path)
    assert log.count("AttendOut pruning step") == 2
    assert (tmp_path / "ckpt" / "checkpoint_last.pt").exists()


def run_one_update_past_a_pruning_step(data, save, *extra, cuda=False):
    """9 updates, pruning steps after updates 4 and 8. The learning rate decays to 0 at
    update 8, so update 9 moves no fp32 master weight but writes the masters back into the
    model: the defender equals the attacker at the end only if D <- A reached the masters."""
    cmd = train_cmd(data, save, *extra, "--lr-scheduler", "polynomial_decay",
                    "--total-num-update", "8", "--end-learning-rate", "0", max_update=9)
    if cuda:
        cmd.remove("--cpu")
    log = run(cmd, save)
    assert log.count("AttendOut pruning step") == 2 and "overflow" not in log
    state = load(save / "checkpoint_last.pt")["model"]
    for key, value in state.items():
        if key.startswith(("encoder.", "classification_heads.")) and "version" not in key:
            assert torch.equal(value, state["defender." + key]), key
    assert all(torch.isfinite(v).all() for v in state.values() if torch.is_tensor(v)
               and v.is_floating_point())


@pytest.mark.slow
def test_fp16_run_keeps_the_defender_copy_in_the_masters(data, tmp_path):
    """--fp16 on the CPU, with per-parameter fp32 masters (flat ones need CUDA; --bf16 on the
    CPU is fairseq's TPU path)."""
    run_one_update_past_a_pruning_step(data, tmp_path, "--fp16", "--fp16-no-flatten-grads")


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("precision", ["--fp16", "--amp"])
def test_cuda_mixed_precision_keeps_the_defender_copy(data, tmp_path, precision):
    """On a GPU: --fp16 (fairseq's flat fp32 masters) and --amp (no masters)."""
    run_one_update_past_a_pruning_step(data, tmp_path, precision, cuda=True)
