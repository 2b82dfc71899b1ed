"""AttendOut's search under fixed rewards (experiments.attendout_controls): the generator
alone, through the task's own pruning update. The full controls (5 seeds, widths 384 and
768, 300 noise steps) are the experiment's run, recorded in docs/attendout.md; these are
their short forms."""

import json

import pytest

from experiments import attendout_controls as controls
from rdrop_fairseq.models.attendout_generator import SEARCH_DEFAULTS


@pytest.mark.slow
def test_costs_the_budget_goes_to_the_cheapest_layers():
    """MiniLM's width and depth, the stand-in costs (layers 4 and 5 cheap), a budget of 2,
    deadline at pruning step 50: the two cheapest layers, in 3 of 3 seeds, before the
    deadline forces anything."""
    costs = controls.STAND_IN_COSTS[6]
    for seed in range(3):
        result = controls.run(reward="costs", dim=384, layers=6, seed=seed, steps=50,
                              costs=costs, budget=2, deadline_step=50, price=0.5)
        assert sorted(result["pruned"]) == [4, 5], result
        assert max(result["pruned"].values()) < 50, result


@pytest.mark.slow
def test_noise_without_a_price_prunes_nothing_where_a_price_prunes_every_layer():
    """A reward independent of the action, no price: 300 pruning steps prune nothing. The
    positive control, so that this means something: the same generator (width, seed, steps)
    with the default price for dropping a layer prunes every layer well within those steps
    (about 30 here). Layer mode, the default; the unit mode's generator cannot reach the
    threshold in 300 steps at the task's learning rate whatever the reward (its statistic
    needs every unit's probability past 0.5), so a noise run there shows nothing."""
    noise = controls.run(reward="noise", dim=64, layers=6, seed=0, steps=300)
    assert noise["pruned"] == {}, noise
    assert max(noise["statistic"]) < 0.5
    priced = controls.run(reward="noise", dim=64, layers=6, seed=0, steps=300,
                          price=SEARCH_DEFAULTS["attendout_drop_price"])
    assert sorted(priced["pruned"]) == list(range(6)), priced
    assert max(priced["pruned"].values()) < 150, priced


def test_the_experiment_reports_each_control(tmp_path, capsys):
    """The command line on a tiny setting: a table line per control, controls.json."""
    trace = tmp_path / "result.json"  # a baseline run's result, its trace's costs
    trace.write_text(json.dumps({"trace": {"costs": [3.0, 3.0, 3.0, 3.0, 0.0, 0.0]}}))
    assert controls.main(["--width", "32", "--seeds", "0", "--noise-steps", "3",
                          "--deadline-step", "3", "--budget", "1", "--price-steps", "2",
                          "--controls", "noise", "budget", "costs", "price",
                          "--costs", str(trace), "--work", str(tmp_path)]) in (0, 1)
    out = capsys.readouterr().out
    assert out.count("width   32") == 4
    saved = json.loads((tmp_path / "controls.json").read_text())
    assert [r["control"] for r in saved["results"]] == ["noise", "budget", "costs", "price"]
    assert saved["results"][2]["costs"] == [3.0, 3.0, 3.0, 3.0, 0.0, 0.0]
    assert "the 1 cheapest ([4])" in saved["results"][2]["expected"]
    budget = saved["results"][1]
    assert all(len(r["pruned"]) == 1 for r in budget["runs"])  # the deadline fills it


def test_the_price_step_reaches_the_budget_controls(tmp_path):
    """--price-step is the dual ascent's step of the budget and costs controls: at 0 the
    price stays at its start, so a noise reward fills the budget only when the deadline
    forces it; a negative step is refused before anything runs."""
    argv = ["--width", "32", "--seeds", "0", "--deadline-step", "4", "--budget", "1",
            "--controls", "budget", "--work", str(tmp_path)]
    assert controls.main(argv + ["--price-step", "0"]) == 0
    saved = json.loads((tmp_path / "controls.json").read_text())
    assert saved["price_step"] == 0
    (run,) = saved["results"][0]["runs"]
    assert list(run["pruned"].values()) == [4] and run["price"] == 0.5
    with pytest.raises(SystemExit):
        controls.main(argv + ["--price-step", "-0.1", "--work", str(tmp_path / "no")])
    assert not (tmp_path / "no").exists()
