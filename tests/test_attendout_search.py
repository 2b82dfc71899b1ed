"""AttendOut's search for a smaller model: the price for dropping and the reward's scale,
the per-layer gate biases, the budget (dual ascent, the cap, the deadline, then training as
exported), the step timing of the rewards, seeds that match a plain fine-tune's, the lost
cache's warning, and bad input.

The fixtures and helpers are tests/test_attendout.py's (tiny 3 x 16 models, CPU).
"""

import logging
import math

import pytest
import torch
from fairseq import options, tasks
from fairseq.dataclass.utils import convert_namespace_to_omegaconf

from rdrop_fairseq.models.attendout_generator import AttendOutGenerator, unit_mask
from rdrop_fairseq.models.attendout_reinforce import pruning_update, shape_rewards
from tests.test_attendout import (  # noqa: F401  (data is a fixture)
    HEAD,
    TINY,
    USER_DIR,
    Optimizer,
    build,
    data,
    load,
    make_sample,
    run,
    run_updates,
    train_cmd,
)
from tests.test_attendout_gate import padded

# --------------------------------------------------------------------------- the reward


def test_rewards_are_in_noise_sds_clipped_and_priced_per_dropped_layer():
    """The scale is the sd of the rewards where no layer ran as Eq. 3 (a moving average of
    each interval's variance); rewards are clipped to +-5 of it; the price is paid per
    layer that ran as Eq. 3."""
    g = AttendOutGenerator(16, 3, decision="layer")
    g.price = 0.5
    first = [torch.tensor([1.0, -1.0, -900.0]), torch.tensor([3.0, 2.0])]
    dropped = [torch.tensor([0, 2, 1]), torch.tensor([0, 0])]
    shaped = shape_rewards(g, first, dropped, decay=0.9)
    var1 = torch.tensor([1.0, 3.0, 2.0]).var(unbiased=False)  # the quiet examples only
    torch.testing.assert_close(g.reward_var, var1)
    sd = var1.sqrt()
    torch.testing.assert_close(shaped[0], torch.tensor([1.0 / sd, -1.0 / sd + 1.0, -5.0 + 0.5]))
    torch.testing.assert_close(shaped[1], torch.tensor([3.0, 2.0]) / sd)
    # fewer than 2 quiet examples: the variance of all of them
    second = [torch.tensor([4.0, 0.0])]
    shaped = shape_rewards(g, second, [torch.tensor([1, 0])], decay=0.9)
    var = 0.9 * var1 + 0.1 * torch.tensor(4.0)  # this interval's variance: 4
    torch.testing.assert_close(g.reward_var, var)
    torch.testing.assert_close(shaped[0], torch.tensor([4.0 / var.sqrt() + 0.5, 0.0]))
    # a reward without variance is not scaled (no division by 0)
    h = AttendOutGenerator(16, 3)
    torch.testing.assert_close(shape_rewards(h, [torch.tensor([0.25])], [torch.tensor([2])],
                                             0.9)[0], torch.tensor([0.25 + 2 * h.price]))


def test_layers_dropped_counts_the_layers_that_ran_as_eq3_not_the_pruned_ones():
    g = AttendOutGenerator(16, 3, decision="layer")
    _, pad = padded()  # example 1: 4 tokens, example 2: 2
    drop = torch.zeros(3, 3, 6, 6, dtype=torch.bool)
    drop[0, 0] = True  # example 0, layer 0: all units
    drop[2, 1, :2, :2] = True  # example 2, layer 1: all its valid units (pads are not)
    drop[1, 2, :4, :3] = True  # example 1, layer 2: not all
    assert g.layers_dropped(drop, pad).tolist() == [1, 0, 1]
    g.pruned[0] = True
    drop[:, 0] = True  # what sample() gives a pruned layer
    assert g.layers_dropped(drop, pad).tolist() == [0, 0, 1]


def gate_derivative(logits, drop, pad, g):
    """d log P / d gamma_i per example and layer, from the formula (log P is the mean
    over layers): an all-dropped layer's term log(q + (1-q) prod p), else log(1-q)."""
    z = g.gate_logits(logits, pad).double()
    q = torch.sigmoid(z)
    valid = unit_mask(pad).unsqueeze(1)
    prod = torch.where(valid, torch.sigmoid(logits.double()), 1.0).prod(-1).prod(-1)
    whole = (drop | ~valid).all(-1).all(-1)
    d = torch.where(whole, q * (1 - q) * (1 - prod) / (q + (1 - q) * prod), -q)
    return d / logits.size(1)


def test_the_gate_biases_move_by_gate_lr_times_the_mean_credit():
    """SGD on gamma_i, scaled so that one pruning step moves it by gate_lr times the mean
    over the interval's examples of (r - b) * layers * d log P / d gamma_i."""
    torch.manual_seed(0)
    g = AttendOutGenerator(16, 3, decision="layer")
    g.build_optimizer(5e-5, gate_lr=0.7)
    g.price = 0.5
    with torch.no_grad():
        g.gate_layer_bias.copy_(torch.tensor([1.0, -1.0, 0.5]))  # gates near 1/2
    batches = []
    for seed in range(3):
        h, pad = padded(seed=seed)
        batches.append((h, pad, g.sample(g(h, pad), pad, seed)))
    task_rewards = [torch.randn(3, generator=torch.Generator().manual_seed(s)) for s in range(3)]
    dropped = [g.layers_dropped(drop, pad) for _, pad, drop in batches]
    reference = AttendOutGenerator(16, 3)
    reference.price = 0.5
    expected_rewards = shape_rewards(reference, task_rewards, dropped, 0.95)
    credit = torch.zeros(3, dtype=torch.float64)
    with torch.no_grad():
        for (h, pad, drop), r in zip(batches, expected_rewards):
            # b = 0 at the first step; the layers' mean makes a factor 1/3, undone here
            credit += (r.double()[:, None] * gate_derivative(g(h, pad), drop, pad, g) * 3).sum(0)
    credit /= 9  # the mean over the 3 x 3 examples
    before = g.gate_layer_bias.detach().clone()
    g.requires_grad_(True)
    pruning_update(g, task_rewards, dropped,
                   lambda t: (g(*batches[t][:2]), batches[t][2], batches[t][1]),
                   baseline_decay=0.95)
    moved = (g.gate_layer_bias.detach() - before).double()
    torch.testing.assert_close(moved, 0.7 * credit, rtol=1e-4, atol=1e-6)
    assert credit.abs().min() > 1e-3


def test_a_price_turns_a_free_layers_gate_on_and_no_price_leaves_it():
    """Task reward 0 (dropping is free): with a price every gate bias rises (its expected
    credit is price * q (1 - q); 256 examples make the sign certain); without one the
    gradient is 0 and nothing moves."""
    for price, rises in ((1.0, True), (0.0, False)):
        torch.manual_seed(0)
        g = AttendOutGenerator(16, 3, decision="layer")
        g.build_optimizer(5e-5, gate_lr=1.0)
        g.price = price
        h, pad = padded(batch=256)
        logits = g(h, pad)
        drop = g.sample(logits, pad, 1)
        before = g.gate_layer_bias.detach().clone()
        g.requires_grad_(True)
        pruning_update(g, [torch.zeros(256)], [g.layers_dropped(drop, pad)],
                       lambda t: (g(h, pad), drop, pad), baseline_decay=0.95)
        moved = g.gate_layer_bias.detach() - before
        if rises:
            assert (moved > 0).all(), moved
        else:
            assert moved.abs().max() < 1e-7, moved


# --------------------------------------------------------------------------- the budget


def count_defender_calls(model):
    calls = []
    model.defender.register_forward_hook(lambda *a: calls.append(1))
    return calls


def test_a_budget_is_filled_by_the_deadline_then_the_attacker_trains_as_exported(data):
    task, model, criterion, cfg = build(
        data, "--attendout-target-layers", "1", "--max-update", "8", "--attendout-deadline",
        "0.5", "--attendout-interval", "3", "--attendout-drop-price", "0.25",
        "--attendout-price-step", "0.2")
    g = model.generator
    assert task.deadline_update == 4 and g.price == 0.25
    calls = count_defender_calls(model)
    optimizer, pruning_calls, _ = run_updates(task, model, criterion, cfg, 3)
    # the pruning step after update 3: no gate reached 0.5, the price rose (1 missing)
    assert pruning_calls == [(3, False)] and g.pruning_steps == 1
    assert g.pruned_layers() == [] and g.price == pytest.approx(0.45)
    assert len(calls) == 6  # the defender trained on every batch, then scored each
    statistic = g.gate_prob.clone()
    # the deadline's update (4): its own pruning step prunes the highest statistic
    task.pruning_step = lambda m, o, *a: pruning_calls.append(a) or type(task).pruning_step(
        task, m, o, *a)
    sample = make_sample(task, seed=10)
    task.train_step(sample, model, criterion, optimizer, 3)
    task.optimizer_step(optimizer, model, 3)
    optimizer.zero_grad()
    assert pruning_calls[-1] == (4,)
    pruned = g.pruned_layers()
    assert len(pruned) == 1 and g.gate_prob[pruned[0]] == g.gate_prob.max()
    assert model.pruned_layers == tuple(pruned)
    assert model.defender.encoder.sentence_encoder.pruned_layers == tuple(pruned)
    assert task.search_finished(model)
    # from now on: plain steps, no masks, no defender, no cache, no further pruning
    state = {k: v.clone() for k, v in g.state_dict().items() if torch.is_tensor(v)}
    seen = []
    hook = model.encoder.register_forward_hook(
        lambda m, args, kwargs, out: seen.append(kwargs.get("attendout_drop")),
        with_kwargs=True)
    n = len(calls)
    for update in range(4, 8):
        task.train_step(make_sample(task, seed=20 + update), model, criterion, optimizer,
                        update)
        task.optimizer_step(optimizer, model, update)
        optimizer.zero_grad()
    hook.remove()
    assert seen == [None] * 4 and len(calls) == n and task._cache == []
    assert all(torch.equal(g.state_dict()[k], v) for k, v in state.items())
    assert g.pruned_layers() == pruned and statistic.shape == g.gate_prob.shape
    # validation scores the model as exported
    _, _, log = task.valid_step(make_sample(task), model, criterion)
    assert log["attendout_num_pruned"] == 1


def test_the_price_rises_per_missing_layer_and_never_below_zero():
    g = AttendOutGenerator(16, 4, decision="layer")
    g.build_optimizer(5e-5, 1.0)
    h, pad = padded()
    logits = g(h, pad)
    drop = g.sample(logits, pad, 0)
    g.price = 0.3
    step = dict(baseline_decay=0.95, budget=3, price_step=0.1)
    g.requires_grad_(True)
    pruning_update(g, [torch.randn(3)], [g.layers_dropped(drop, pad)],
                   lambda t: (g(h, pad), drop, pad), **step)
    assert g.price == pytest.approx(0.3 + 0.1 * 3)
    g.pruned[:2] = True
    pruning_update(g, [torch.randn(3)], [g.layers_dropped(drop, pad)],
                   lambda t: (g(h, pad), drop, pad), **step)
    assert g.price == pytest.approx(0.6 + 0.1 * 1)
    # no budget: the price stays where it is
    pruning_update(g, [torch.randn(3)], [g.layers_dropped(drop, pad)],
                   lambda t: (g(h, pad), drop, pad), baseline_decay=0.95)
    assert g.price == pytest.approx(0.7)


def test_pruning_decisions_wait_for_the_pruning_step(data):
    """A gate at probability ~1 between two pruning steps prunes nothing until the step,
    so every cached action was drawn under the pruned set it is rewarded with."""
    task, model, criterion, cfg = build(data, "--attendout-interval", "3")
    with torch.no_grad():
        model.generator.gate_layer_bias[2] = 30.0
    optimizer = Optimizer(cfg, model)
    for update in range(2):
        task.train_step(make_sample(task, seed=update), model, criterion, optimizer, update)
        task.optimizer_step(optimizer, model, update)
        optimizer.zero_grad()
        assert model.generator.pruned_layers() == [] and model.pruned_layers == ()
    task.train_step(make_sample(task, seed=2), model, criterion, optimizer, 2)
    task.optimizer_step(optimizer, model, 2)
    assert model.generator.pruned_layers() == [2] and model.pruned_layers == (2,)


# --------------------------------------------------------------------------- the timing


@pytest.mark.parametrize("criterion", ["sentence_prediction", "sentence_prediction_rdrop"])
def test_step_timing_rewards_are_the_steps_own_losses(data, criterion):
    """Without dropout a training forward equals an evaluation forward, so the step
    timing's reward (cached with the batch) equals the interval timing's re-scoring of the
    same batch with the same weights: defender loss - attacker loss, per example; with
    R-Drop's doubled batch, the mean of the two (equal) passes."""
    extra = ["--attendout-reward-timing", "step", "--dropout", "0", "--attention-dropout",
             "0", "--attendout-interval", "5"]
    if criterion == "sentence_prediction_rdrop":
        extra += ["--rdrop-alpha", "1"]
    task, model, crit, cfg = build(data, *extra, criterion=criterion)
    optimizer = Optimizer(cfg, model)
    sample = make_sample(task, batch=6)
    tokens = sample["net_input"]["src_tokens"]
    with torch.no_grad():
        logits = task.pruning.drop_logits(model, tokens, tokens.eq(task.source_dictionary.pad()))
    seed = (task.cfg.seed * 1_000_003 + 1) % (2 ** 62)  # the seed train_step draws
    drop = model.generator.sample(logits, tokens.eq(task.source_dictionary.pad()), seed)
    model.eval()
    with torch.no_grad():
        expected = task.pruning.rewards(model, sample, drop)
    task.train_step(sample, model, crit, optimizer, 0)
    (_, _, rewards), = task._pending
    assert expected.abs().max() > 0
    torch.testing.assert_close(rewards, expected, rtol=1e-4, atol=1e-5)


def test_interval_timing_caches_no_rewards(data):
    task, model, criterion, cfg = build(data, "--attendout-interval", "5")
    task.train_step(make_sample(task), model, criterion, Optimizer(cfg, model), 0)
    (_, _, rewards), = task._pending
    assert rewards is None


# --------------------------------------------------------------------------- seeds


def build_plain(data, seed):
    args = options.parse_args_and_arch(options.get_training_parser(), [
        str(data), "--user-dir", USER_DIR, "--task", "sentence_prediction", "--arch", "roberta",
        *TINY, "--criterion", "sentence_prediction", "--num-classes", "2", "--cpu",
        "--optimizer", "adam", "--lr", "1e-3", "--seed", str(seed)])
    cfg = convert_namespace_to_omegaconf(args)
    task = tasks.setup_task(cfg.task)
    torch.manual_seed(seed)
    return task.build_model(cfg.model)


def test_the_same_seed_gives_the_same_head_and_random_state_as_a_plain_fine_tune(data):
    """The defender and the generator are built (and the defender's head registered)
    without drawing from the global random state: the attacker's classification head,
    and whatever the run draws next (dropout), start as a plain roberta's."""
    plain = build_plain(data, 5)
    after_plain = torch.get_rng_state()
    args = options.parse_args_and_arch(options.get_training_parser(), [
        str(data), "--user-dir", USER_DIR, "--task", "sentence_prediction_attendout",
        "--arch", "roberta_attendout", *TINY, "--criterion", "sentence_prediction",
        "--num-classes", "2", "--cpu", "--optimizer", "adam", "--lr", "1e-3", "--seed", "5"])
    cfg = convert_namespace_to_omegaconf(args)
    task = tasks.setup_task(cfg.task)
    torch.manual_seed(5)
    model = task.build_model(cfg.model)
    assert torch.equal(torch.get_rng_state(), after_plain)
    heads = [m.classification_heads[HEAD].state_dict() for m in (plain, model)]
    assert all(torch.equal(heads[0][k], heads[1][k]) for k in heads[0])
    encoder = dict(plain.encoder.named_parameters())
    assert all(torch.equal(p, encoder[n]) for n, p in model.encoder.named_parameters())
    # and the defender starts as the attacker
    defender = dict(model.defender.named_parameters())
    assert all(torch.equal(p, defender[n]) for n, p in model.attacker_parameters())


# --------------------------------------------------------------------------- the cache


def test_a_cache_not_restored_is_reported(data, caplog):
    """fairseq restores a task's state only with the data iterator: a checkpoint whose
    cache was dropped (--reset-dataloader) says so in the log."""
    task, model, _, _ = build(data)
    model.generator.cached_batches = 3  # as set_extra_state reads it from a checkpoint
    with caplog.at_level(logging.WARNING):
        task.begin_epoch(1, model)
    assert "held 3 batches since the last pruning step, not restored" in caplog.text
    caplog.clear()
    task2, model2, _, _ = build(data)
    model2.generator.cached_batches = 3
    task2.set_checkpoint_dict({"attendout_cache": [({}, (None, None), None)] * 3})
    with caplog.at_level(logging.WARNING):
        task2.begin_epoch(1, model2)
    assert "not restored" not in caplog.text


# --------------------------------------------------------------------------- bad input


def parse(data, *extra):
    return options.parse_args_and_arch(options.get_training_parser(), [
        str(data), "--user-dir", USER_DIR, "--task", "sentence_prediction_attendout",
        "--arch", "roberta_attendout", *TINY, "--criterion", "sentence_prediction",
        "--num-classes", "2", "--cpu", "--optimizer", "adam", "--lr", "1e-3", *extra])


@pytest.mark.parametrize("extra,match", [
    (["--attendout-target-layers", "3", "--max-update", "10"],
     r"--attendout-target-layers must be in 1\.\.2"),
    (["--attendout-target-layers", "-1", "--max-update", "10"],
     r"--attendout-target-layers must be in 1\.\.2"),
    (["--attendout-target-layers", "1"], "--attendout-target-layers needs --max-update"),
    (["--attendout-target-layers", "1", "--max-update", "10", "--attendout-decision", "unit"],
     "needs --attendout-decision layer"),
    (["--attendout-deadline", "1.0"], r"--attendout-deadline must be in \(0, 1\)"),
    (["--attendout-deadline", "0"], r"--attendout-deadline must be in \(0, 1\)"),
    (["--attendout-drop-price", "-0.5"], "--attendout-drop-price must be >= 0"),
    (["--attendout-drop-price", "nan"], "--attendout-drop-price must be >= 0"),
    (["--attendout-price-step", "-1"], "--attendout-price-step must be >= 0"),
    (["--attendout-gate-lr", "-1"], "--attendout-gate-lr must be >= 0"),
])
def test_bad_search_options_fail_while_parsing(data, extra, match):
    with pytest.raises(ValueError, match=match):
        parse(data, *extra)


def test_a_budget_with_static_pruning_is_refused(data):
    with pytest.raises(ValueError, match="use --task sentence_prediction, not"):
        parse(data, "--attendout-target-layers", "1", "--max-update", "10",
              "--attendout-static-prune-layers", "2")


# --------------------------------------------------------------------------- end to end


@pytest.mark.slow
def test_fairseq_train_with_a_budget_then_export(data, tmp_path):
    """fairseq-train with a budget of 1 layer, deadline at update 4 of 8: the log shows the
    deadline's decision and the plain steps after it; the export prunes that layer."""
    from rdrop_fairseq.recipes import export_attendout

    save = tmp_path / "ckpt"
    log = run(train_cmd(data, save, "--attendout-target-layers", "1", "--attendout-deadline",
                        "0.5", "--attendout-interval", "3"), tmp_path)
    assert "budget filled: the attacker trains as exported from now on" in log
    assert "(deadline)" in log or "pruned now" in log
    assert log.count("AttendOut pruning step") == 2  # after update 3 and the deadline's 4
    state = load(save / "checkpoint_last.pt")
    pruned = [i for i, p in enumerate(state["model"]["generator.pruned"].tolist()) if p]
    assert len(pruned) == 1
    out = tmp_path / "exported.pt"
    assert export_attendout.main(["--checkpoint", str(save / "checkpoint_last.pt"),
                                  "--output", str(out)]) == 0
    assert load(out)["cfg"]["model"].attendout_pruned_layers == str(pruned[0])
    assert math.isfinite(state["model"]["generator._extra_state"]["price"])


def test_export_says_when_a_checkpoint_predates_the_filled_budget(data, tmp_path, capsys):
    from omegaconf import OmegaConf

    from rdrop_fairseq.recipes import export_attendout

    task, model, _, cfg = build(data, "--attendout-target-layers", "2", "--max-update", "10")
    model.generator.pruned[2] = True  # 1 of the 2 layers when this checkpoint was saved
    state = {"model": model.state_dict(), "cfg": OmegaConf.to_container(cfg),
             "optimizer_history": [{"num_updates": 3}], "extra_state": {}}
    state["cfg"]["model"] = cfg.model  # (a legacy model's Namespace, as fairseq saves it)
    torch.save(state, tmp_path / "best.pt")
    assert export_attendout.main(["--checkpoint", str(tmp_path / "best.pt"),
                                  "--output", str(tmp_path / "out.pt")]) == 0
    out = capsys.readouterr().out
    assert "1/3 layers pruned: 2" in out
    assert "budget was 2 layers" in out and "(update 3)" in out
    model.generator.pruned[1] = True  # filled: no note
    state["model"] = model.state_dict()
    torch.save(state, tmp_path / "last.pt")
    export_attendout.main(["--checkpoint", str(tmp_path / "last.pt"),
                           "--output", str(tmp_path / "out2.pt")])
    assert "budget was" not in capsys.readouterr().out
