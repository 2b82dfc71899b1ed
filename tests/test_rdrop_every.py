"""``--rdrop-every K`` (the paper's k-step R-Drop) in the fairseq criteria.

Updates 0, K, 2K, ... run R-Drop, the others one pass with the parent criterion's own loss.
In the criterion alone (every case of tests/test_criteria.py): K = 1 is today's loss on
every update; at K = 2 the plain updates are exactly the fairseq parent and the R-Drop
updates exactly today's criterion; the model sees 6 batches in 4 updates, not 8; the logs
count the R-Drop updates and average the KL over those only. Through fairseq-train (the
deterministic-dropout models of tests/test_distributed.py, which print every batch they
train on twice): every micro-batch of an update under ``--update-freq`` agrees, so do two
processes, and a resumed run keeps the schedule.
"""

import math
import re

import pytest
import torch
from fairseq.logging import metrics

from tests.test_criteria import CASES, assert_grads_close, parse, run
from tests.test_distributed import (  # noqa: F401  (testkit, translation_bin: fixtures)
    BATCH_LINE,
    NO_SHUFFLE,
    TOL,
    assert_same_stats,
    max_param_diff,
    testkit,
    train,
    train_ranks,
    translation_bin,
)


@pytest.fixture(params=list(CASES))
def case(request):
    torch.manual_seed(0)
    return CASES[request.param]()


def at_update(model, update):
    model.set_num_updates(update)  # what fairseq's task does before the criterion
    return model


def test_every_one_is_todays_criterion_on_every_update(case):
    model = case.build_model(dropout=0.2)
    model.train()
    sample = case.make_sample()
    today, every_one = case.ours(alpha=2.0), case.ours(alpha=2.0, rdrop_every=1)
    for update in (0, 1, 3):
        ours = run(every_one, at_update(model, update), sample, seed=update)
        theirs = run(today, model, sample, seed=update)
        assert torch.equal(ours[0], theirs[0]) and ours[1] == theirs[1]
        assert_grads_close(ours[3], theirs[3], rtol=0, atol=0)
        assert ours[2]["rdrop_update"] == 1


def test_every_two_alternates_todays_criterion_and_the_fairseq_parent(case):
    model = case.build_model(dropout=0.2)
    model.train()
    sample = case.make_sample()
    every_two = case.ours(alpha=2.0, rdrop_every=2)
    for update in range(4):
        ours = run(every_two, at_update(model, update), sample, seed=update)
        reference = case.ours(alpha=2.0) if update % 2 == 0 else case.parent()
        theirs = run(reference, model, sample, seed=update)
        assert torch.equal(ours[0], theirs[0]) and ours[1] == theirs[1]
        assert_grads_close(ours[3], theirs[3], rtol=0, atol=0)
        assert ours[2].pop("rdrop_update") == int(update % 2 == 0)
        theirs[2].pop("rdrop_update", None)  # today's criterion logs it too, the parent not
        assert ours[2].keys() == theirs[2].keys()


def test_pass_mean_halves_the_rdrop_updates_and_leaves_the_plain_ones(case):
    model = case.build_model(dropout=0.2)
    model.train()
    sample = case.make_sample()
    mean = case.ours(alpha=2.0, rdrop_every=2, rdrop_pass_mean=True)
    for update in range(4):
        ours = run(mean, at_update(model, update), sample, seed=update)
        rdrop = update % 2 == 0
        theirs = run(case.ours(alpha=2.0) if rdrop else case.parent(), model, sample, seed=update)
        scale = 0.5 if rdrop else 1.0
        assert torch.allclose(ours[0], scale * theirs[0], rtol=1e-6, atol=0)
        assert_grads_close(ours[3], {n: scale * g for n, g in theirs[3].items()}, rtol=1e-6, atol=0)
        theirs[2].pop("rdrop_update", None)
        assert ours[2].pop("rdrop_update") == int(rdrop)
        assert ours[1] == theirs[1]  # the logged figures are untouched: still per pass
        assert {k: float(v) for k, v in ours[2].items()} == {k: float(v) for k, v in theirs[2].items()}


def test_pass_mean_at_alpha_zero_without_dropout_is_a_one_pass_update(case):
    """The option's promise: an R-Drop update at a one-pass update's scale. With both passes
    identical (no dropout) and no KL, it is the parent's update on the batch itself."""
    model = case.build_model(dropout=0.0)
    model.train()
    sample = case.make_sample()
    ours = run(case.ours(alpha=0.0, two_passes=True, rdrop_pass_mean=True),
               at_update(model, 0), sample)
    theirs = run(case.parent(), model, sample)
    assert ours[1] == theirs[1]
    assert torch.allclose(ours[0], theirs[0], rtol=1e-5, atol=1e-6)
    assert_grads_close(ours[3], theirs[3], rtol=1e-4, atol=1e-5)  # summed in another order


def test_four_updates_at_every_two_show_the_model_six_batches(case):
    model = case.build_model(dropout=0.2)
    model.train()
    sample = case.make_sample()
    rows = []
    model.register_forward_pre_hook(
        lambda module, args, kwargs: rows.append(next(iter(kwargs.values())).size(0)),
        with_kwargs=True)
    criterion = case.ours(alpha=1.0, rdrop_every=2)
    for update in range(4):
        run(criterion, at_update(model, update), sample)
    batch = sample["target"].size(0)
    assert rows == [2 * batch, batch, 2 * batch, batch]  # 6 batches' rows, not 8


def test_the_logs_count_rdrop_updates_and_average_the_kl_over_them(case):
    model = case.build_model(dropout=0.2)
    model.train()
    sample = case.make_sample()
    criterion = case.ours(alpha=2.0, rdrop_every=3)
    key = "rdrop_mse" if case.name == "regression" else "rdrop_kl"
    logs = [run(criterion, at_update(model, u), sample, seed=u)[2] for u in range(6)]
    with metrics.aggregate() as agg:
        for log in logs:  # fairseq reduces each update's logs on their own
            type(criterion).reduce_metrics([log])
    rdrop = [log for log in logs if log["rdrop_update"]]
    assert len(rdrop) == 2 and agg["rdrop_updates"].sum == 2
    expected = (sum(float(log[key]) for log in rdrop)
                / sum(log["sample_size"] for log in rdrop) / math.log(2))
    assert agg[key].avg == pytest.approx(expected, rel=1e-3, abs=1e-5)


def test_evaluation_is_unchanged(case):
    model = case.build_model(dropout=0.2)
    sample = case.make_sample()
    model.eval()
    ours = case.ours(alpha=1.0, rdrop_every=2)(at_update(model, 0), sample)
    theirs = case.parent()(model, sample)
    assert torch.equal(ours[0], theirs[0]) and "rdrop_update" not in ours[2]


def test_a_step_without_an_update_number_is_refused_in_one_line(case):
    model = case.build_model(dropout=0.2)
    model.train()
    with pytest.raises(RuntimeError, match=r"--rdrop-every 2 needs the number of the update"):
        case.ours(alpha=1.0, rdrop_every=2)(model, case.make_sample())


@pytest.mark.parametrize("value", [0, -1, 2.5, True, "x"])
def test_invalid_k_is_refused_naming_the_option(value):
    case = CASES["translation"]()
    case.build_model(dropout=0.1)
    with pytest.raises(ValueError, match=r"^--rdrop-every must be a whole number >= 1 "):
        case.ours(alpha=1.0, rdrop_every=value)


@pytest.mark.parametrize("value", ["0", "-2", "2.5", "two"])
def test_invalid_k_is_refused_while_fairseq_parses_it(value, capsys):
    with pytest.raises(SystemExit) as stop:
        parse(["--task", "translation", "--arch", "transformer_iwslt_de_en",
               "--criterion", "label_smoothed_cross_entropy_rdrop", "--rdrop-every", value])
    assert stop.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].endswith(f"error: argument --rdrop-every: must be a whole number >= 1 "
                            f"(R-Drop on one update in K; 1: every update), got '{value}'")


@pytest.mark.parametrize("criterion", ["label_smoothed_cross_entropy_rdrop", "cross_entropy_rdrop",
                                       "adaptive_loss_rdrop", "sentence_prediction_rdrop"])
def test_every_criterion_takes_the_option(criterion):
    _, cfg = parse(["--task", "translation", "--arch", "transformer_iwslt_de_en",
                    "--criterion", criterion, "--rdrop-every", "5"])
    assert cfg.criterion.rdrop_every == 5 and cfg.criterion.rdrop_pass_mean is False


def test_the_docs_fairseq_lines_parse():
    """docs/rdrop-every.md's fairseq-train lines, "..." a translation task's arguments."""
    from pathlib import Path

    page = (Path(__file__).resolve().parents[1] / "docs" / "rdrop-every.md").read_text()
    lines = re.findall(r"^fairseq-train \.\.\. (.*)$", page, re.M)
    assert len(lines) == 2
    for line in lines:
        args = line.split("#")[0].split()
        _, cfg = parse(["--task", "translation", "--arch", "transformer_iwslt_de_en", *args])
        assert cfg.criterion.rdrop_every == 2 and cfg.criterion.rdrop_alpha == 5
    assert cfg.criterion.rdrop_pass_mean is True


# --------------------------------------------------------------------------- fairseq-train

LOG_OR_BATCH = re.compile(r"^RDROP-TEST-BATCH rank=\d+ |\| INFO \| train_inner \| .*"
                          r"num_updates=(\d+)", re.M)


def batches_per_update(text):
    """{update number (1-based, as fairseq logs it): R-Drop batches the model printed during
    that update, and that update's logged rdrop_updates and whether it logged a KL}."""
    out, pending = {}, 0
    for m in LOG_OR_BATCH.finditer(text):
        if m[1] is None:
            pending += 1
            continue
        line = text[m.start():text.index("\n", m.start())]
        updates = re.search(r"rdrop_updates=(\d+)", line)
        # a KL logged in this update (fairseq prints a meter not updated since as None)
        kl = re.search(r"rdrop_kl=([\d.]+)", line)
        out[int(m[1])] = (pending, int(updates[1]) if updates else None, kl is not None)
        pending = 0
    return out


@pytest.mark.slow
def test_accumulation_agrees_per_update_and_a_resumed_run_keeps_the_schedule(
        testkit, translation_bin, tmp_path):
    """--update-freq 2, --rdrop-every 3: updates 0 and 3 run R-Drop (both micro-batches),
    1 and 2 neither; resumed from its checkpoint at update 4, updates 4 and 5 stay plain and
    6 runs R-Drop (a schedule counted from the restart would run 4)."""
    save = tmp_path / "accum"
    first = train(testkit, translation_bin, "translation", save, "--batch-size", "3",
                  "--update-freq", "2", "--rdrop-every", "3", *NO_SHUFFLE)
    assert batches_per_update(first.log) == {1: (2, 1, True), 2: (0, 0, False),
                                             3: (0, 0, False), 4: (2, 1, True)}
    resumed = train(testkit, translation_bin, "translation", save, "--batch-size", "3",
                    "--update-freq", "2", "--rdrop-every", "3", *NO_SHUFFLE,
                    "--max-update", "7")
    assert "loaded checkpoint" in (resumed.procs[0].stdout + resumed.procs[0].stderr).lower()
    assert batches_per_update(resumed.log) == {5: (0, 0, False), 6: (0, 0, False),
                                               7: (2, 1, True)}


@pytest.mark.slow
def test_two_processes_agree_per_update(testkit, translation_bin, tmp_path):
    """2 processes, --rdrop-every 2: each prints its R-Drop batches of updates 0 and 2, and
    they are the second micro-batches of the same updates in a 1-process --update-freq 2
    run (rank 1 takes batches 1, 3, 5, ...)."""
    ranks = train_ranks(testkit, translation_bin, "translation", tmp_path / "ranks",
                        "--batch-size", "3", "--rdrop-every", "2", *NO_SHUFFLE)
    accum = train(testkit, translation_bin, "translation", tmp_path / "accum",
                  "--batch-size", "3", "--update-freq", "2", "--rdrop-every", "2", *NO_SHUFFLE)
    assert batches_per_update(ranks.log) == {1: (1, 1, True), 2: (0, 0, False),
                                             3: (1, 1, True), 4: (0, 0, False)}
    in_accum = accum.batches()  # micro-batches 0, 1 of update 0, then of update 2
    assert len(in_accum) == 4
    for rank in (0, 1):
        printed = ranks.batches(rank)
        assert [rows for _, _, rows in printed] == [in_accum[rank][2], in_accum[2 + rank][2]]


@pytest.mark.slow
def test_pass_mean_on_two_processes_is_the_accumulated_run(testkit, translation_bin, tmp_path):
    """--rdrop-every 2 --rdrop-pass-mean: 2 processes (gloo) log and end with the weights of
    1 process at --update-freq 2, and the option does move them (against the sum)."""
    options = ("--batch-size", "3", "--rdrop-every", "2", *NO_SHUFFLE)
    ranks = train_ranks(testkit, translation_bin, "translation", tmp_path / "ranks", *options,
                        "--rdrop-pass-mean")
    accum = train(testkit, translation_bin, "translation", tmp_path / "accum", *options,
                  "--update-freq", "2", "--rdrop-pass-mean")
    summed = train(testkit, translation_bin, "translation", tmp_path / "sum", *options,
                   "--update-freq", "2")
    # per epoch (a plain update logs no KL: its train_inner line reads rdrop_kl None)
    assert_same_stats(ranks.stats("train"), accum.stats("train"), "pass mean: 2 ranks vs accum")
    assert max_param_diff(ranks.params(), accum.params()) < TOL
    assert max_param_diff(summed.params(), accum.params()) > 100 * TOL


# --------------------------------------------------------------------------- the recipes


@pytest.mark.parametrize("recipe", ["iwslt14", "wmt14", "wikitext103-gpt", "cnndm_bart", "glue"])
def test_the_recipes_take_rdrop_every_and_say_it(recipe):
    from benchmarks import bench_recipe_memory as bench
    from tests.recipe_helpers import dry_run

    r = bench.RECIPES[recipe]
    env = {"GPUS": 1, "BART_DIR": "/nonexistent", "ROBERTA_DIR": "/nonexistent", **r.env}
    for every, override in (("1", None), ("5", "++criterion.rdrop_every=5")):
        commands, proc = dry_run(r.script, "train", RDROP_EVERY=every, **env)
        (train_cmd,) = [c for c in commands if "--config-dir" in c]
        assert (override in train_cmd) if override else not any(
            "rdrop_every" in arg for arg in train_cmd)
        assert bench.compose(train_cmd, "/nonexistent").criterion.rdrop_every == int(every)
        if every == "1":  # the docs' override by hand, without the recipe's variable
            composed = bench.compose(train_cmd, "/nonexistent", ["criterion.rdrop_every=3"])
            assert composed.criterion.rdrop_every == 3
        said = ("R-Drop on every update (RDROP_EVERY=1)" if every == "1" else
                "R-Drop on one update in 5 (RDROP_EVERY=5): updates 0, 5, 10, ...")
        assert f"[{r.script}] {said}" in proc.stdout


@pytest.mark.parametrize("recipe", ["iwslt14", "wmt14", "wikitext103-gpt", "cnndm_bart", "glue"])
def test_the_recipes_take_rdrop_pass_mean_and_say_it(recipe):
    from benchmarks import bench_recipe_memory as bench
    from tests.recipe_helpers import dry_run

    r = bench.RECIPES[recipe]
    env = {"GPUS": 1, "BART_DIR": "/nonexistent", "ROBERTA_DIR": "/nonexistent", **r.env}
    for flag, override in (("0", None), ("1", "++criterion.rdrop_pass_mean=true")):
        commands, proc = dry_run(r.script, "train", RDROP_EVERY=2, RDROP_PASS_MEAN=flag, **env)
        (train_cmd,) = [c for c in commands if "--config-dir" in c]
        assert (override in train_cmd) if override else not any(
            "rdrop_pass_mean" in arg for arg in train_cmd)
        composed = bench.compose(train_cmd, "/nonexistent")
        assert composed.criterion.rdrop_pass_mean is (flag == "1")
        assert composed.criterion.rdrop_every == 2
        said = f"[{r.script}] an R-Drop update's loss: the mean of its two passes' (RDROP_PASS_MEAN=1)"
        assert (said in proc.stdout) is (flag == "1")
    # the config names the option: hydra's override by hand, without the recipe's variable
    composed = bench.compose(train_cmd, "/nonexistent", ["criterion.rdrop_pass_mean=false"])
    assert composed.criterion.rdrop_pass_mean is False


@pytest.mark.parametrize("script, env", [("glue_bert", {"TASK": "MRPC"}),
                                         ("vit", {"VIT_DIR": "/v"})])
def test_the_hugging_face_recipes_pass_rdrop_every_to_the_trainer(script, env):
    from tests.recipe_helpers import dry_run

    (cmd,), proc = dry_run(script, "train", GPUS=1, RDROP_EVERY=2, **env)
    assert cmd[cmd.index("--rdrop-every") + 1] == "2"
    assert f"[{script}] R-Drop on one update in 2 (RDROP_EVERY=2)" in proc.stdout
    (cmd,), _ = dry_run(script, "train", GPUS=1, **env)
    assert "--rdrop-every" not in cmd and "--rdrop-pass-mean" not in cmd
    (cmd,), proc = dry_run(script, "train", GPUS=1, RDROP_PASS_MEAN=1, **env)
    assert "--rdrop-pass-mean" in cmd
    assert f"[{script}] an R-Drop update's loss: the mean of its two passes'" in proc.stdout


@pytest.mark.parametrize("env, said", [
    ({"RDROP_EVERY": "0"}, "error: RDROP_EVERY must be a whole number >= 1, not '0'"),
    ({"RDROP_EVERY": "2.5"}, "error: RDROP_EVERY must be a whole number >= 1, not '2.5'"),
    ({"RDROP_EVERY": "2", "MODE": "baseline"},
     "error: RDROP_EVERY=2 is R-Drop's period, and MODE=baseline runs no R-Drop"),
    ({"RDROP_PASS_MEAN": "yes"}, "error: RDROP_PASS_MEAN must be 0 or 1, not 'yes'"),
    ({"RDROP_PASS_MEAN": "1", "MODE": "doubled-batch"},
     "error: RDROP_PASS_MEAN=1 scales R-Drop's updates, and MODE=doubled-batch runs no R-Drop"),
])
def test_a_bad_rdrop_every_stops_the_recipe_in_one_line(env, said):
    from tests.recipe_helpers import dry_run

    _, proc = dry_run("iwslt14", "train", ok=False, GPUS=1, **env)
    assert proc.returncode != 0 and proc.stderr.strip() == said


# --------------------------------------------------------------------------- the docs' loops


def python_block_after(page, marker):
    """The first ```python block of docs/PAGE after ``marker``."""
    from pathlib import Path

    text = (Path(__file__).resolve().parents[1] / "docs" / page).read_text()
    rest = text[text.index(marker):]
    return rest[rest.index("```python\n") + 10:rest.index("\n```", rest.index("```python"))]


def test_the_plain_pytorch_loop_of_the_docs_runs_rdrop_on_one_update_in_two():
    import torch.nn.functional as F

    from rdrop_fairseq.core import rdrop_loss

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(20, 8), torch.nn.Dropout(0.3),
                                torch.nn.Linear(8, 20))
    rows = []
    model.register_forward_pre_hook(lambda module, args: rows.append(args[0].size(0)))
    data = [(torch.randint(1, 20, (3, 5)), torch.randint(1, 20, (3, 5))) for _ in range(4)]
    before = model[2].weight.detach().clone()
    namespace = {"torch": torch, "F": F, "rdrop_loss": rdrop_loss, "model": model, "data": data,
                 "PAD": 0, "optimizer": torch.optim.SGD(model.parameters(), lr=0.1)}
    exec(python_block_after("plain-pytorch.md", "R-Drop on one update in k"), namespace)
    assert rows == [6, 3, 6, 3]
    assert not torch.equal(before, model[2].weight)
