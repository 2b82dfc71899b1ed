"""AttendOut under fairseq's data-parallel training: 2 processes = 1 process with the union
batch, as --update-freq 2.

Runs of ``fairseq-train`` (CPU, gloo; tiny 3 x 16 model, dropout off, SGD, the same seed),
sharing one set of runs (module fixture):

* ``ranks``: 2 processes (torch's DDP, ``--ddp-backend pytorch_ddp``), B examples each per
  update; ``accum``: 1 process, B examples per batch, ``--update-freq 2``;
* ``legacy``: 2 processes (fairseq's ``legacy_ddp``) with ``--update-freq 2``, B/2 per
  batch; ``accum4``: 1 process, B/2 per batch, ``--update-freq 4``; both regression
  (STS-B's kind) with R-Drop (``sentence_prediction_rdrop``, whose doubled batch carries
  the masks twice);
* ``mutated``: as ``ranks``, with the rewards' sums over the processes left out (the
  test plugin replaces the reward shaping by one without them): the checks below must
  fail on it;
* and a resumption between two pruning steps, of a 2-process and of a 1-process run.

fairseq deals its batches to the processes in turn (tests/test_distributed.py checks it),
so update k of ``ranks`` sees the batches of update k of ``accum``. The test plugin prints,
on every process, each training batch's examples with the units their masks drop, and
after each pruning step the layers pruned and the search's state (the generator's weights'
sums included); the checks: the same masks for the same examples, every process the same
state after every pruning step, the same layers pruned at the same updates as one process,
and the same parameters (encoder, heads, defender, generator) and generator state after
the run, to float32 rounding. The budget (2 of 3 layers) prunes exactly 2, and the export
of the 2-process checkpoint is exact. Two things of fairseq's run on a GPU only, and the
plugin makes them run on the CPU: torch's DDP as fairseq builds it (with device_ids) and
its gather of the logging outputs (through a CUDA buffer).
"""

import json
import os
import random
import re
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from rdrop_fairseq.recipes import export_attendout
from tests.test_attendout import HEAD, TINY, make_sample, preprocess, write_split
from tests.test_cli import REPO, parse_stats, tail, tool
from tests.test_distributed import launch_ranks, rank_args
from tests.warm_process import run_command

TOL = 1e-6  # the encoder's parameters, absolute (SGD: a record of the summed gradients)
TIMEOUT_S = 300
BATCH = 4  # examples per batch and process in ranks / accum (64 examples: 8 updates an epoch)
MAX_UPDATE = 8
BUDGET = 2
DEADLINE = 6  # --attendout-deadline 0.75 x MAX_UPDATE
COUNTERS = ("price", "pruning_steps", "masks_drawn", "cached_batches")
UNTIMED = {"wps", "ups", "wall", "train_wall", "gb_free"}
MASKS = re.compile(r"^AO-TEST-MASKS rank=(\d+) rows=(.*)$", re.M)
STEP = re.compile(r"^AO-TEST-STEP rank=(\d+) update=(\d+) pruned=(\[.*?\]) state=(.*)$", re.M)

# The --user-dir of these runs: AttendOut (imported from this checkout, PYTHONPATH below),
# what every process did printed, full-precision logs, and the mutation.
TESTKIT = '''
"""Test-only fairseq plugin for tests/test_attendout_distributed.py."""

import json
import os
import pickle
from numbers import Number

import torch
import torch.distributed as dist
from fairseq import utils
from fairseq.distributed import utils as distributed_utils
from fairseq.logging import meters, progress_bar
from fairseq.models import distributed_fairseq_model
from torch.nn.parallel import DistributedDataParallel

import rdrop_fairseq  # noqa: F401  (registers AttendOut)
from rdrop_fairseq.models import attendout_generator, attendout_reinforce
from rdrop_fairseq.models.roberta_attendout import RobertaAttendOutModel
from rdrop_fairseq.tasks.attendout_processes import search_state
from rdrop_fairseq.tasks.attendout_pruning import AttendOutPruning
from rdrop_fairseq.tasks.sentence_prediction_attendout import SentencePredictionAttendOutTask

SHARPEN = float(os.environ.get("AO_TEST_SHARPEN", "20"))
_safe_round, _format_stat = meters.safe_round, progress_bar.format_stat
meters.safe_round = lambda number, ndigits: _safe_round(number, 12)
progress_bar.format_stat = (
    lambda s: "{:.12g}".format(s) if isinstance(s, Number) else _format_stat(s))


def rank():
    return dist.get_rank() if dist.is_initialized() else 0


draw_masks = AttendOutPruning.draw_masks


def draw_and_print(self, model, tokens):
    """Each example of the batch (its tokens) and the units its masks drop, per layer."""
    drop, rate = draw_masks(self, model, tokens)
    pad = tokens.eq(self.pad)
    counts = (drop & attendout_generator.unit_mask(pad).unsqueeze(1)).sum((-1, -2))
    rows = sorted([t[t.ne(self.pad)].tolist(), c.tolist()] for t, c in zip(tokens, counts))
    print(f"AO-TEST-MASKS rank={rank()} rows={json.dumps(rows)}", flush=True)
    return drop, rate


pruning_step = SentencePredictionAttendOutTask.pruning_step


def step_and_print(self, model, optimizer, update=None):
    pruning_step(self, model, optimizer, update)
    generator = model.generator
    print(f"AO-TEST-STEP rank={rank()} update={update} "
          f"pruned={json.dumps(generator.pruned_layers())} "
          f"state={json.dumps(search_state(generator).tolist())}", flush=True)


AttendOutPruning.draw_masks = draw_and_print
SentencePredictionAttendOutTask.pruning_step = step_and_print


class CpuDistributedDataParallel(DistributedDataParallel):
    """torch's DDP as fairseq builds it (--ddp-backend pytorch_ddp), but without the
    device_ids=[0] that fairseq gives it even with --cpu, which torch refuses for a module
    on the CPU."""

    def __init__(self, module, device_ids=None, output_device=None, **kwargs):
        super().__init__(module, **kwargs)


distributed_fairseq_model.DistributedDataParallel = CpuDistributedDataParallel


def all_gather_list_on_the_cpu(data, group=None, max_size=16384):
    """fairseq's all_gather_list (every process's ``data``, in rank order; the same limit on
    its pickled size) without its CUDA buffer."""
    data = utils.move_to_cpu(data)
    if len(pickle.dumps(data)) + 4 > max_size:
        raise ValueError(f"encoded data size exceeds max_size ({max_size})")
    gathered = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, data, group=group)
    return gathered


distributed_utils.all_gather_list = all_gather_list_on_the_cpu
build_model = RobertaAttendOutModel.build_model.__func__


def build_sharp_model(cls, args, task):
    """The model, its attention far from uniform (BERT's initialisation makes it about
    uniform, so that the masks would hardly change the losses, and the rewards be
    differences of nearly equal losses, made of rounding)."""
    model = build_model(cls, args, task)
    with torch.no_grad():
        for layer in model.encoder.sentence_encoder.layers:
            layer.self_attn.q_proj.weight.mul_(SHARPEN)
            layer.self_attn.k_proj.weight.mul_(SHARPEN)
    model.copy_attacker_to_defender()
    return model


RobertaAttendOutModel.build_model = classmethod(build_sharp_model)

if os.environ.get("AO_TEST_LOCAL_REWARDS"):  # the mutation: each process its own rewards' sums
    shape_rewards = attendout_reinforce.shape_rewards
    attendout_reinforce.shape_rewards = (
        lambda generator, task_rewards, dropped, decay, reduce=None:
        shape_rewards(generator, task_rewards, dropped, decay))
'''


def environment(**extra):
    """The runs' environment: this checkout's package first (the plugin imports it), one
    thread, no GPU."""
    return dict(os.environ, PYTHONPATH=str(REPO), PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1",
                MKL_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="", **extra)


def train_cmd(testkit, data, save_dir, *extra):
    """Classification (``data`` a classification set, with F1) or regression (``data`` a
    regression set, with Pearson and Spearman); the processes gather the predictions these
    metrics need. (Not --cpu, which AttendOut refuses with these metrics under several
    processes: no GPU is visible, so fairseq trains on the CPU, and the plugin gathers
    without CUDA.)"""
    kind = (["--regression-target", "--num-classes", "1", "--report-pearson-and-spearman",
             "--lr", "0.05"]  # (0.5 diverges)
            if data.parent.name.startswith("regression") else
            ["--num-classes", "2", "--report-acc-and-f1", "--lr", "0.5"])
    return [tool("fairseq-train"), str(data), "--user-dir", str(testkit), *kind,
            "--task", "sentence_prediction_attendout", "--arch", "roberta_attendout", *TINY,
            "--criterion", "sentence_prediction", "--init-token", "0",
            "--separator-token", "2", "--optimizer", "sgd",
            "--max-update", str(MAX_UPDATE), "--attendout-interval", "2",
            "--attendout-generator-lr", "1e-2", "--attendout-init-drop", "0.3",
            "--attendout-target-layers", str(BUDGET), "--attendout-deadline", "0.75",
            "--dropout", "0", "--attention-dropout", "0", "--activation-dropout", "0",
            "--pooler-dropout", "0", "--required-batch-size-multiple", "1", "--seed", "3",
            "--num-workers", "0", "--save-dir", str(save_dir), "--no-epoch-checkpoints",
            "--log-interval", "1", "--no-progress-bar", "--log-format", "simple", *extra]


@dataclass
class Run:
    procs: list  # one per process (rank)
    save_dir: Path

    @property
    def ok(self):
        return all(p.returncode == 0 for p in self.procs)

    @property
    def output(self):
        return "\n".join(p.stdout + p.stderr for p in self.procs)

    def stats(self, name):
        """What fairseq logs for the run (process 0), wall-clock figures left out (and in
        validation the words and sentences per step: a step is a batch per process)."""
        left_out = UNTIMED | ({"wpb", "bsz"} if name == "valid" else set())
        return [{k: v for k, v in line.items() if k not in left_out}
                for line in parse_stats(self.procs[0].stdout)[name]]

    def masks(self, per_update):
        """Per update: a Counter of [example's tokens, units its masks drop per layer], over
        the ``per_update`` batches of each process."""
        batches = [[json.loads(m[2]) for m in MASKS.finditer(p.stdout)] for p in self.procs]
        updates = max(len(mine) for mine in batches) // per_update
        return [Counter(json.dumps(row) for mine in batches
                        for batch in mine[k * per_update:(k + 1) * per_update] for row in batch)
                for k in range(updates)]

    def steps(self, rank=0):
        """[(update, layers pruned, search state)] after each pruning step of ``rank``."""
        return [(int(m[2]), json.loads(m[3]), json.loads(m[4]))
                for m in STEP.finditer(self.procs[rank].stdout)]

    def checkpoint(self):
        return torch.load(self.save_dir / "checkpoint_last.pt", map_location="cpu",
                          weights_only=False)  # a checkpoint this test just wrote


def train(testkit, data, save_dir, *extra):
    save_dir.mkdir(parents=True)
    proc = run_command(train_cmd(testkit, data, save_dir, *extra), save_dir, environment(),
                       TIMEOUT_S)
    return Run([proc], save_dir)


def train_ranks(testkit, data, save_dir, backend, *extra, **environ):
    """2 fairseq-train processes (ranks 0 and 1)."""
    save_dir.mkdir(parents=True)

    def command(rank, init):
        return train_cmd(testkit, data, save_dir, *extra, *rank_args(rank, init, 2, backend))

    return Run(launch_ranks(command, save_dir, environment(**environ)), save_dir)


@dataclass
class Runs:
    data: Path  # the classification set
    ranks: Run
    accum: Run
    legacy: Run
    accum4: Run
    mutated: Run


def make_data(root, regression):
    """test_attendout.py's sentences; classification labels 1 and 0 (fairseq's GLUE metrics
    read them as numbers), or its regression targets."""
    rng, raw = random.Random(0), root / "raw"
    raw.mkdir()
    write_split(raw, "train", 16 * BATCH, rng, regression)
    write_split(raw, "valid", 16, rng, regression)
    for split in ("train", "valid"):
        path = raw / f"{split}.label"
        path.write_text(path.read_text().replace("pos", "1").replace("neg", "0"))
    preprocess(raw, root / "bin", regression)
    return root / "bin"


@pytest.fixture(scope="module")
def classification(tmp_path_factory):
    return make_data(tmp_path_factory.mktemp("classification"), regression=False)


@pytest.fixture(scope="module")
def testkit(tmp_path_factory):
    testkit = tmp_path_factory.mktemp("plugin") / "attendout_ddp_testkit"
    testkit.mkdir()
    (testkit / "__init__.py").write_text(TESTKIT)
    return testkit


@pytest.fixture(scope="module")
def runs(tmp_path_factory, classification, testkit):
    root, data = tmp_path_factory.mktemp("attendout_ddp"), classification
    sts = make_data(tmp_path_factory.mktemp("regression"), regression=True)
    b, half, torch_ddp = str(BATCH), str(BATCH // 2), ("pytorch_ddp", "--find-unused-parameters")
    rdrop = ("--criterion", "sentence_prediction_rdrop", "--rdrop-alpha", "1.0")
    return Runs(
        data=data,
        ranks=train_ranks(testkit, data, root / "ranks", *torch_ddp, "--batch-size", b),
        accum=train(testkit, data, root / "accum", "--batch-size", b, "--update-freq", "2"),
        legacy=train_ranks(testkit, sts, root / "legacy", "legacy_ddp", "--batch-size", half,
                           "--update-freq", "2", *rdrop),
        accum4=train(testkit, sts, root / "accum4", "--batch-size", half, "--update-freq", "4",
                     *rdrop),
        mutated=train_ranks(testkit, data, root / "mutated", *torch_ddp, "--batch-size", b,
                            AO_TEST_LOCAL_REWARDS="1"))


# (run, batches per update and process, its one-process reference, the reference's, the
# relative tolerance of the search: its state, the generator, the logged metrics).
# A reward is a difference of two losses that differ little: float32's rounding of a loss
# is amplified in it (about 300x for classification here, 600x for regression). ranks and
# accum add the same two batches' gradients (one per process, or one after the other): the
# same weights, the same losses, only the sums over the cached batches round differently,
# 2e-7 measured. With --update-freq 2 per process the gradients add in another order too,
# so the losses differ by their rounding: 2.4e-5 measured on classification, 3e-4 on the
# regression runs here (their rewards smaller).
PAIRS = (("ranks", 1, "accum", 2, 1e-6), ("legacy", 2, "accum4", 4, 2e-3))


def close(got, want, rel):
    return abs(got - want) <= rel * abs(want) + 1e-8


def assert_like_one_process(run, per_update, ref, ref_per_update, rel):
    """The acceptance: the run's masks, decisions, parameters and search state are one
    process's, and every process of the run took the same decisions."""
    assert run.ok and ref.ok, "a run failed" + tail(run.procs[0]) + tail(run.procs[-1])
    masks = run.masks(per_update)
    assert masks == ref.masks(ref_per_update)
    steps, want = run.steps(0), ref.steps(0)
    assert steps == run.steps(1), "the processes' searches differ"
    assert [(u, p) for u, p, _ in steps] == [(u, p) for u, p, _ in want]
    for (update, _, state), (_, _, expected) in zip(steps, want):
        bad = [i for i, (a, b) in enumerate(zip(state, expected)) if not close(a, b, rel)]
        assert not bad, f"update {update}: search state {bad}: {state} vs {expected}"
    got, expected = run.checkpoint()["model"], ref.checkpoint()["model"]
    assert got.keys() == expected.keys()
    for key, value in expected.items():
        if torch.is_tensor(value):
            # the generator's, by the rewards: to their tolerance
            scale = rel if key.startswith("generator.") else 0
            diff = (got[key].double() - value.double()).abs() - scale * value.double().abs()
            assert diff.max().item() <= TOL, f"{key}: {diff.max().item()}"
    a, b = got["generator._extra_state"], expected["generator._extra_state"]
    assert [a[k] for k in COUNTERS] == [b[k] for k in COUNTERS]
    for key in ("baseline", "reward_var"):
        assert abs(a[key].item() - b[key].item()) <= rel * abs(b[key].item()), key


@pytest.mark.slow
@pytest.mark.parametrize("name, per_update, reference, reference_per_update, rel", PAIRS)
def test_two_processes_equal_one_process_with_update_freq(runs, name, per_update, reference,
                                                           reference_per_update, rel):
    run, ref = getattr(runs, name), getattr(runs, reference)
    rank0, rank1 = run.procs
    assert "training on 2 devices" in rank0.stdout, tail(rank0)
    assert re.search(r"initialized host \S+ as rank 1", rank1.stdout), tail(rank1)
    assert_like_one_process(run, per_update, ref, reference_per_update, rel)
    # the budget: exactly 2 layers, filled by the deadline, then no more pruning step
    steps = run.steps(0)
    assert [len(p) for _, p, _ in steps][-1] == BUDGET and steps[-1][0] <= DEADLINE
    assert all(len(p) < BUDGET for _, p, _ in steps[:-1])
    assert run.checkpoint()["model"]["generator.pruned"].sum() == BUDGET
    # each process trained on its own examples, its masks drawn until the budget was filled
    masks = run.masks(per_update)
    assert len(masks) == steps[-1][0] and all(sum(m.values()) == 2 * BATCH for m in masks)
    assert any(sum(json.loads(row)[1]) for m in masks for row in m)


@pytest.mark.slow
def test_logged_metrics_equal_one_processs(runs):
    """What fairseq logs for the 2 processes (summed over them) is one process's log."""
    for name, _, reference, _, rel in PAIRS:
        for stats in ("train_inner", "valid"):
            got, want = getattr(runs, name).stats(stats), getattr(runs, reference).stats(stats)
            assert len(got) == len(want) and want, (name, stats)
            for line, expected in zip(got, want):
                assert line.keys() == expected.keys()
                for key, value in expected.items():
                    assert line[key] == (value if isinstance(value, str) else pytest.approx(
                        value, rel=rel, abs=TOL)), (name, stats, key)
    assert "defender_loss" in runs.ranks.stats("train_inner")[0]
    assert "accuracy_unpruned" in runs.ranks.stats("valid")[-1]
    # the GLUE metrics from both processes' predictions (fairseq gathers them), compared
    # above: F1 (0 here: the model predicts one class yet), and Pearson's correlation
    assert "f1" in runs.ranks.stats("valid")[-1]
    assert abs(runs.legacy.stats("valid")[-1]["pearson"]) > 1


@pytest.mark.slow
def test_the_mutation_without_the_rewards_sums_fails(runs):
    """Each process shaping the rewards with its own batches' sums only: the acceptance
    check fails on it (the processes' reward scales differ, and the run stops at the first
    pruning step, saying so)."""
    with pytest.raises(AssertionError):
        assert_like_one_process(runs.mutated, 1, runs.accum, 2, PAIRS[0][-1])
    assert not runs.mutated.ok
    assert "the data-parallel processes disagree on the search's state" in runs.mutated.output
    assert not runs.mutated.steps(0)


@pytest.mark.slow
def test_the_export_of_two_processes_run_is_exact(runs, tmp_path):
    """The 2-process checkpoint exports as the attacker alone, its 2 pruned layers as a
    mean of V, giving exactly what the trained attacker gives."""
    from fairseq import checkpoint_utils

    out = tmp_path / "exported.pt"
    checkpoint = runs.ranks.save_dir / "checkpoint_last.pt"
    assert export_attendout.main(["--checkpoint", str(checkpoint), "--output", str(out)]) == 0
    (trained,), _, task = checkpoint_utils.load_model_ensemble_and_task([str(checkpoint)])
    (exported,), _, _ = checkpoint_utils.load_model_ensemble_and_task([str(out)])
    assert exported.inference_only and len(exported.pruned_layers) == BUDGET
    assert exported.pruned_layers == tuple(trained.pruned_layers)
    attacker = dict(trained.attacker_parameters())
    assert all(torch.equal(p, attacker[n]) for n, p in exported.named_parameters())
    tokens = make_sample(task)["net_input"]["src_tokens"]
    trained.eval(), exported.eval()
    with torch.no_grad():
        assert torch.equal(exported(tokens, classification_head_name=HEAD)[0],
                           trained(tokens, classification_head_name=HEAD)[0])





@pytest.mark.slow
def test_a_two_process_run_resumed_between_pruning_steps(runs, testkit, tmp_path):
    """Stopped after update 3 (a batch per process since the pruning step after update 2,
    which the checkpoint does not keep: it says so) and resumed to 8: the processes go on
    together, the next pruning step rewarded on the 2 batches of update 4. (No budget: its
    deadline would move with --max-update.)"""
    data = runs.data
    torch_ddp = ("pytorch_ddp", "--find-unused-parameters", "--batch-size", str(BATCH),
                 "--attendout-target-layers", "0")
    first = train_ranks(testkit, data, tmp_path / "first", *torch_ddp, "--max-update", "3")
    assert first.ok, tail(first.procs[0])
    # (process 0 reads the checkpoint and sends it to process 1, as fairseq does by default)
    resumed = train_ranks(testkit, data, tmp_path / "resumed", *torch_ddp, "--restore-file",
                          str(first.save_dir / "checkpoint_last.pt"))
    assert resumed.ok, tail(resumed.procs[0]) + tail(resumed.procs[1])
    assert ("the checkpoint was written by 2 processes, each with 1 batch(es) since the last "
            "pruning step") in resumed.procs[0].stdout
    assert "pruning step 2 (update 4): generator rewarded on 2 cached batches" in (
        resumed.procs[0].stdout)
    steps = resumed.steps(0)
    assert steps == resumed.steps(1) and [u for u, _, _ in steps] == [4, 6, 8]
    # a one-process run's checkpoint (--update-freq 2: the 2 batches of update 3 kept in
    # it), resumed on 2 processes: process 0 rewards them, once, with the 2 of update 4
    alone = train(testkit, data, tmp_path / "alone", *torch_ddp[2:], "--max-update", "3",
                  "--update-freq", "2")
    assert alone.ok, tail(alone.procs[0])
    resumed = train_ranks(testkit, data, tmp_path / "resumed_alone", *torch_ddp,
                          "--restore-file", str(alone.save_dir / "checkpoint_last.pt"))
    assert resumed.ok, tail(resumed.procs[0]) + tail(resumed.procs[1])
    assert "2 batches since the last pruning step restored" in resumed.procs[0].stdout
    assert "pruning step 2 (update 4): generator rewarded on 4 cached batches" in (
        resumed.procs[0].stdout)
    assert resumed.steps(0) == resumed.steps(1)


def glue_cmd(testkit, data, save_dir, roberta, *extra):
    """R-Drop's GLUE fine-tuning without AttendOut: fairseq's ``sentence_prediction`` task,
    a ``roberta`` restored from ``roberta`` (a checkpoint without a classification head),
    ``sentence_prediction_rdrop`` reporting MCC and F1 (lists of predictions); dropout off."""
    return [tool("fairseq-train"), str(data), "--user-dir", str(testkit), "--task",
            "sentence_prediction", "--arch", "roberta", *TINY, "--num-classes", "2",
            "--criterion", "sentence_prediction_rdrop", "--rdrop-alpha", "1.0",
            "--report-mcc", "--report-acc-and-f1", "--init-token", "0", "--separator-token",
            "2", "--optimizer", "sgd", "--lr", "0.5", "--max-update", str(MAX_UPDATE),
            "--dropout", "0", "--attention-dropout", "0", "--activation-dropout", "0",
            "--pooler-dropout", "0", "--required-batch-size-multiple", "1", "--seed", "3",
            "--restore-file", str(roberta), "--reset-optimizer", "--reset-dataloader",
            "--reset-meters", "--num-workers", "0", "--save-dir", str(save_dir),
            "--no-epoch-checkpoints", "--log-interval", "1", "--no-progress-bar",
            "--log-format", "simple", "--batch-size", str(BATCH), *extra]


@pytest.mark.slow
def test_glue_rdrop_from_a_plain_roberta_on_two_processes(classification, testkit, tmp_path):
    """R-Drop's GLUE modes on 2 processes: restored from a plain RoBERTa (a masked LM, no
    classification head) with --restore-file and without --load-checkpoint-on-all-dp-ranks
    (process 0 reads it and sends it to process 1, which the plugin lets unpickle it under
    torch >= 2.6), and reporting MCC and F1, whose lists of predictions the plugin makes
    fairseq's sentence_prediction task gather from the processes (its fast sum fails on
    them). Every logged figure, training and validation (the MCC and F1 of all 16
    validation examples, 8 on each process), equals one process's with --update-freq 2."""
    data = classification
    pre = tmp_path / "roberta"
    proc = run_command([tool("fairseq-train"), str(data / "input0"), "--task", "masked_lm",
                        "--arch", "roberta", *TINY, "--criterion", "masked_lm",
                        "--tokens-per-sample", "32", "--batch-size", "8", "--optimizer",
                        "sgd", "--lr", "0.1", "--max-update", "2", "--disable-validation",
                        "--save-dir", str(pre), "--no-epoch-checkpoints", "--num-workers",
                        "0", "--no-progress-bar"], tmp_path, environment(), TIMEOUT_S)
    assert proc.returncode == 0, tail(proc)
    roberta = pre / "checkpoint_last.pt"
    two = tmp_path / "two"
    two.mkdir()
    two = Run(launch_ranks(lambda rank, init: glue_cmd(
        testkit, data, two, roberta, *rank_args(rank, init, 2, "legacy_ddp")), two,
        environment()), two)
    assert two.ok, tail(two.procs[0]) + tail(two.procs[1])
    one = tmp_path / "one"
    one.mkdir()
    one = Run([run_command(glue_cmd(testkit, data, one, roberta, "--update-freq", "2"), one,
                           environment(), TIMEOUT_S)], one)
    assert one.ok, tail(one.procs[0])
    assert f"Loaded checkpoint {roberta}" in two.procs[0].stdout
    for stats in ("train_inner", "valid"):
        got, want = two.stats(stats), one.stats(stats)
        assert len(got) == len(want) and want, stats
        for line, expected in zip(got, want):
            assert line.keys() == expected.keys()
            for key, value in expected.items():
                assert line[key] == (value if isinstance(value, str) else pytest.approx(
                    value, rel=1e-6, abs=TOL)), (stats, key)
    assert {"mcc", "f1", "acc_and_f1"} <= two.stats("valid")[-1].keys()
