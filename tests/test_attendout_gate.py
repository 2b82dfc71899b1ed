"""AttendOut's pruning decision: the whole-layer gate (``--attendout-decision layer``), the
sticky decision the attacker trains with, the controls (the generator alone under fixed
rewards), static pruning (``--attendout-static-prune-layers``) and bad input.

The fixtures and helpers are tests/test_attendout.py's (tiny 3 x 16 models, CPU).
"""

import subprocess

import pytest
import torch
import torch.nn.functional as F
from fairseq import checkpoint_utils, models, options, tasks
from fairseq.dataclass.utils import convert_namespace_to_omegaconf

from rdrop_fairseq.models.attendout_generator import AttendOutGenerator, sample_drop
from rdrop_fairseq.recipes import export_attendout
from tests.test_attendout import (  # noqa: F401  (data is a fixture)
    BIN,
    HEAD,
    TINY,
    USER_DIR,
    Optimizer,
    build,
    data,
    load,
    make_sample,
    run,
    sharpen,
    train_cmd,
)
from tests.warm_process import machine_env

# --------------------------------------------------------------------------- the gate


def padded(batch=3, length=6, dim=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(batch, length, dim, generator=g)
    pad = torch.zeros(batch, length, dtype=torch.bool)
    pad[1, 4:] = True
    pad[2, 2:] = True
    return h, pad


def test_gate_logit_is_the_masked_mean_of_the_scores_plus_its_scalar():
    g = AttendOutGenerator(16, 3, decision="layer")
    h, pad = padded()
    logits = g(h, pad)
    z = g.gate_logits(logits, pad)
    for b, n in enumerate((6, 4, 2)):
        for i in range(3):
            scores = logits[b, i, :n, :n] - g.drop_bias
            torch.testing.assert_close(z[b, i], scores.mean() + g.gate_bias)
    assert abs(torch.sigmoid(g.gate_bias).item() - 0.1) < 1e-6  # starts at init_drop


def test_gate_log_prob_is_the_probability_of_what_the_attacker_ran():
    """Per layer: all valid units dropped -> log(q + (1 - q) prod p); otherwise log(1 - q)
    plus the units' mean log-probability; pruned layers count 0; mean over layers."""
    torch.manual_seed(0)
    g = AttendOutGenerator(16, 3, decision="layer")
    with torch.no_grad():
        g.q_proj.weight.mul_(3)  # scores far from 0
    h, pad = padded()
    logits = g(h, pad)
    z = g.gate_logits(logits, pad)
    drop = torch.rand(logits.shape) < 0.5
    drop[0, 1] = True  # example 0, layer 1: the gate's event
    drop[2, 0, :2, :2] = True  # example 2 (2 tokens), layer 0: all valid units, pads not
    drop[2, 0, 0, 2:] = False
    g.pruned[2] = True
    expected = []
    for b, n in enumerate((6, 4, 2)):
        terms = []
        for i in range(3):
            if i == 2:
                terms.append(torch.tensor(0.0))
                continue
            p = torch.sigmoid(logits[b, i, :n, :n].double())
            d = drop[b, i, :n, :n]
            q = torch.sigmoid(z[b, i].double())
            if d.all():
                terms.append(torch.log(q + (1 - q) * p.prod()))
            else:
                units = torch.where(d, p, 1 - p).log().mean()
                terms.append(torch.log(1 - q) + units)
        expected.append(torch.stack(terms).mean())
    got = g.action_log_prob(logits, drop, pad)
    torch.testing.assert_close(got.double(), torch.stack(expected), rtol=1e-5, atol=1e-6)
    # the gate's scalar gets a gradient from its terms
    g.requires_grad_(True)
    g.action_log_prob(g(h, pad), drop, pad).sum().backward()
    assert g.gate_bias.grad is not None and g.gate_bias.grad.abs() > 0
    # unit mode: today's Eq. 4 average, no gate (pruned layer 2 still counts 0)
    g.configure("unit", 0.5)
    g.pruned[2] = False
    lp = torch.where(drop, F.logsigmoid(logits), F.logsigmoid(-logits))
    for b, n in enumerate((6, 4, 2)):
        torch.testing.assert_close(g.action_log_prob(logits, drop, pad)[b],
                                   lp[b, :, :n, :n].sum() / (3 * n * n))


def test_sample_fires_whole_layers_per_example_and_is_regenerated_from_its_seed():
    g = AttendOutGenerator(16, 3, decision="layer")
    h, pad = padded(batch=64, length=5)
    pad[:] = False
    with torch.no_grad():
        logits = g(h, pad)
        units = sample_drop(logits.sigmoid(), seed=7)
        g.gate_bias.fill_(-30.0)  # the gate never fires: exactly the unit masks
        assert torch.equal(g.sample(logits, pad, 7), units)
        g.gate_bias.fill_(0.0)
        g.q_proj.weight.zero_()  # scores 0: every gate at probability 1/2
        g.q_proj.bias.zero_()
        logits = g(h, pad)
        drop = g.sample(logits, pad, 7)
        assert torch.equal(drop, g.sample(logits, pad, 7))
        whole = drop.all(-1).all(-1)  # (B, L)
        # the units where the gate did not fire are the unit draw, unchanged
        assert torch.equal(drop[~whole], sample_drop(logits.sigmoid(), 7)[~whole])
        assert 0.3 < whole.float().mean() < 0.7  # per example and layer, p = 1/2
        assert whole.any(0).all() and (~whole).any(0).all()
        g.pruned[1] = True  # a pruned layer is dropped for every example
        assert g.sample(logits, pad, 8)[:, 1].all()


def test_the_decision_reads_the_interval_and_it_is_sticky():
    """The statistic is the mean over the interval's examples (the gate's probability in
    layer mode); a layer whose statistic reaches the threshold is pruned at the pruning
    step, and stays pruned whatever the statistic does later."""
    g = AttendOutGenerator(16, 3, decision="layer", prune_threshold=0.5)
    h, pad = padded()
    with torch.no_grad():
        g.gate_layer_bias.copy_(torch.tensor([0.0, 20.0, -20.0]))  # layer 1 always fires
        totals = {}
        for _ in range(2):
            g.accumulate_statistics(totals, g(h, pad), pad)
        statistic = g.finish_statistics(totals)
        expected = torch.sigmoid(g.gate_logits(g(h, pad), pad)).mean(0)
        torch.testing.assert_close(statistic, expected)
        assert statistic[1] > 0.99 and statistic[2] < 0.01
        assert g.decide(statistic) == [1] and g.pruned_layers() == [1]
        g.gate_layer_bias.fill_(-20.0)
        totals = {}
        g.accumulate_statistics(totals, g(h, pad), pad)
        assert g.decide(g.finish_statistics(totals)) == [] and g.pruned_layers() == [1]
    # unit mode reads the greedy masks instead
    u = AttendOutGenerator(16, 3, decision="unit", prune_threshold=0.5)
    with torch.no_grad():
        u.gate_bias.fill_(20.0)  # (no gate in unit mode)
        totals = {}
        u.accumulate_statistics(totals, u(h, pad), pad)
        assert u.decide(u.finish_statistics(totals)) == []
        u.drop_bias.fill_(40.0)  # every greedy mask drops every unit
        totals = {}
        u.accumulate_statistics(totals, u(h, pad), pad)
        assert u.decide(u.finish_statistics(totals)) == [0, 1, 2]


def test_a_budget_caps_the_decision_and_the_deadline_fills_it():
    g = AttendOutGenerator(16, 4, decision="layer", prune_threshold=0.5)
    stat = torch.tensor([0.9, 0.2, 0.7, 0.6])
    assert g.decide(stat, budget=2) == [0, 2]  # three reached 0.5: the two highest
    assert g.decide(torch.tensor([0.9, 0.95, 0.9, 0.9]), budget=2) == []  # full
    h = AttendOutGenerator(16, 4, decision="layer", prune_threshold=0.5)
    assert h.decide(torch.tensor([0.1, 0.3, 0.2, 0.05]), budget=2) == []
    assert h.decide(torch.tensor([0.1, 0.3, 0.2, 0.05]), budget=2, force=True) == [1, 2]
    k = AttendOutGenerator(16, 4, decision="layer", prune_threshold=0.5)
    assert k.decide(torch.tensor([0.6, 0.3, 0.2, 0.05]), budget=3) == [0]
    assert k.decide(torch.tensor([0.0, 0.1, 0.2, 0.3]), budget=3, force=True) == [2, 3]
    assert k.pruned_layers() == [0, 2, 3]


def test_pruned_layers_run_as_eq3_in_training_and_leave_the_policy(data):
    """Trained as exported: a pruned layer is dropped (Eq. 3) for every example of every
    training batch, and the pruning step's log P has no term for it."""
    task, model, criterion, cfg = build(data)
    assert model.generator.decision == "layer"  # the default
    model.generator.pruned[1] = True  # as a pruning step decides it
    model.set_pruned_layers(model.generator.pruned_layers())
    seen = []
    hook = model.encoder.register_forward_hook(
        lambda m, args, kwargs, out: seen.append(kwargs.get("attendout_drop")),
        with_kwargs=True)
    sample = make_sample(task)
    task.train_step(sample, model, criterion, Optimizer(cfg, model), 0)
    hook.remove()
    assert seen[0][:, 1].all() and not seen[0][:, 0].all()
    # Q and K of the pruned layer got no gradient, in the attacker and in the defender
    # (both run it as Eq. 3, the cheap way); layer 0's did
    for net in (model, model.defender):
        layers = net.encoder.sentence_encoder.layers
        assert layers[1].self_attn.q_proj.weight.grad is None
        assert layers[1].self_attn.v_proj.weight.grad.abs().max() > 0
        assert layers[0].self_attn.q_proj.weight.grad.abs().max() > 0
    g = model.generator
    tokens = sample["net_input"]["src_tokens"]
    pad = tokens.eq(task.source_dictionary.pad())
    logits = task.pruning.drop_logits(model, tokens, pad)
    per_layer = []
    for pruned in (True, False):
        g.pruned[1] = pruned
        per_layer.append(g.action_log_prob(logits, seen[0], pad))
    # 3 layers: the pruned one counts 0, so the difference is layer 1's own term / 3. Its
    # units all dropped: the term is log(q + (1 - q) prod_j p_j) over its valid units, q the
    # gate's probability (computed here in float64)
    keep = ~pad
    valid = keep[:, :, None] & keep[:, None, :]
    q = g.gate_logits(logits, pad)[:, 1].double().sigmoid()
    log_prod = (F.logsigmoid(logits[:, 1].double()) * valid).sum((-1, -2))
    term = torch.log(q + (1 - q) * log_prod.exp())
    assert term.abs().min() > 1e-3  # a term that zero would not pass for
    torch.testing.assert_close(per_layer[0].double(), per_layer[1].double() - term / 3,
                               rtol=1e-5, atol=1e-6)


# The controls (the generator alone under fixed rewards, at a real encoder's width) are
# experiments/attendout_controls.py, tested in experiments/tests/test_attendout_controls.py.


# --------------------------------------------------------------------------- static pruning


def static_args(data, *extra, task="sentence_prediction"):
    return [str(data), "--user-dir", USER_DIR, "--task", task, "--arch", "roberta_attendout",
            *TINY, "--criterion", "sentence_prediction", "--num-classes", "2", "--cpu",
            "--optimizer", "adam", "--lr", "1e-3", *extra]


def build_static(data, layers):
    args = options.parse_args_and_arch(options.get_training_parser(), static_args(
        data, "--attendout-static-prune-layers", layers))
    cfg = convert_namespace_to_omegaconf(args)
    task = tasks.setup_task(cfg.task)
    torch.manual_seed(0)
    model = task.build_model(cfg.model)
    model.register_classification_head(HEAD, num_classes=2)
    return task, model, task.build_criterion(cfg.criterion), cfg


def test_static_pruning_is_a_plain_roberta_with_eq3_layers(data):
    task, model, criterion, cfg = build_static(data, "2,1")
    assert model.inference_only and model.pruned_layers == (1, 2)
    assert model.defender is None and model.generator is None
    plain_cfg = cfg.model
    plain_cfg._name = "roberta"
    plain = models.build_model(plain_cfg, task)
    plain.register_classification_head(HEAD, num_classes=2)
    assert (sum(p.numel() for p in model.parameters())
            == sum(p.numel() for p in plain.parameters()))  # no defender, no generator
    model.train()
    loss, _, _ = criterion(model, make_sample(task))
    loss.backward()
    layers = model.encoder.sentence_encoder.layers
    assert layers[0].self_attn.k_proj.weight.grad.abs().max() > 0
    for i in (1, 2):  # Eq. 3 skips Q and K
        assert layers[i].self_attn.k_proj.weight.grad is None
        assert layers[i].self_attn.v_proj.weight.grad.abs().max() > 0


@pytest.mark.slow
def test_static_pruning_end_to_end_and_its_export(data, tmp_path):
    cmd = train_cmd(data, tmp_path / "ckpt", "--attendout-static-prune-layers", "2",
                    max_update=4)
    cmd[cmd.index("sentence_prediction_attendout")] = "sentence_prediction"
    for flag, value in (("--attendout-interval", "4"), ("--attendout-generator-lr", "1e-2")):
        i = cmd.index(flag)
        del cmd[i:i + 2]
    log = run(cmd, tmp_path)
    assert "AttendOut pruning step" not in log
    state = load(tmp_path / "ckpt" / "checkpoint_last.pt")
    assert not any(k.startswith(("defender.", "generator.")) for k in state["model"])
    # the checkpoint is already the export: it loads with layer 2 pruned
    loaded, _, task = checkpoint_utils.load_model_ensemble_and_task(
        [str(tmp_path / "ckpt" / "checkpoint_last.pt")])
    assert loaded[0].inference_only and loaded[0].pruned_layers == (2,)
    # and the export recipe writes the same format as AttendOut's
    out = tmp_path / "exported.pt"
    assert export_attendout.main(["--checkpoint", str(tmp_path / "ckpt" / "checkpoint_last.pt"),
                                  "--output", str(out)]) == 0
    exported = load(out)
    assert exported["cfg"]["model"].attendout_pruned_layers == "2"
    assert exported["cfg"]["model"].attendout_inference_only
    assert "last_optimizer_state" not in exported
    for key, value in state["model"].items():
        assert torch.equal(exported["model"][key], value), key
    model = checkpoint_utils.load_model_ensemble_and_task([str(out)])[0][0].eval()
    assert model.pruned_layers == (2,)
    sharpen(model)
    sharpen(loaded[0].eval())
    tokens = make_sample(task)["net_input"]["src_tokens"]
    torch.testing.assert_close(model(tokens, classification_head_name=HEAD)[0],
                               loaded[0](tokens, classification_head_name=HEAD)[0])


# --------------------------------------------------------------------------- bad input


@pytest.mark.parametrize("extra,match", [
    (["--attendout-prune-threshold", "1.0"], r"--attendout-prune-threshold must be in \(0, 1\)"),
    (["--attendout-prune-threshold", "0"], r"--attendout-prune-threshold must be in \(0, 1\)"),
    (["--attendout-prune-threshold", "-0.2"], r"--attendout-prune-threshold must be in"),
    (["--attendout-static-prune-layers", "3"], r"static-prune-layers '3': layers are 0\.\.2"),
    (["--attendout-static-prune-layers", "a,b"], r"static-prune-layers must be comma-sep"),
    (["--attendout-static-prune-layers", "1"], r"use --task sentence_prediction, not"),
])
def test_bad_input_fails_while_parsing(data, extra, match):
    """fairseq-train parses (and runs the arch function) before creating anything."""
    with pytest.raises(ValueError, match=match):
        options.parse_args_and_arch(options.get_training_parser(), static_args(
            data, *extra, task="sentence_prediction_attendout"))


def test_an_unknown_decision_mode_is_refused(data, capsys):
    with pytest.raises(SystemExit):
        options.parse_args_and_arch(options.get_training_parser(), static_args(
            data, "--attendout-decision", "heads", task="sentence_prediction_attendout"))
    assert "invalid choice: 'heads'" in capsys.readouterr().err
    with pytest.raises(ValueError, match="--attendout-decision must be one of layer, unit"):
        AttendOutGenerator(16, 3, decision="heads")


@pytest.mark.slow
@pytest.mark.parametrize("flags, message", [
    (["--attendout-static-prune-layers", "1"],
     "use --task sentence_prediction, not sentence_prediction_attendout"),
    (["--attendout-target-layers", "5"], "--attendout-target-layers must be in 1..2"),
], ids=["static-with-the-attendout-task", "budget-out-of-range"])
def test_bad_attendout_options_leave_nothing_behind(data, tmp_path, flags, message):
    """A real fairseq-train process: refused while the options are parsed, before the
    save directory or a log is made."""
    cmd = train_cmd(data, tmp_path / "ckpt", *flags)
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp_path, timeout=300,
                          env={**machine_env(), "PATH": f"{BIN}:/usr/bin:/bin", "HOME": "/tmp"})
    assert proc.returncode != 0
    assert message in proc.stderr
    assert list(tmp_path.iterdir()) == []  # no save dir, no log
