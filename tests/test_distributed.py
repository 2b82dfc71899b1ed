"""R-Drop under fairseq's own data-parallel training: 2 workers = the union batch, exactly.

Three runs of ``fairseq-train`` (CPU, gloo) must end with the same parameters and log the
same per-update metrics:

* ``ranks``: 2 processes, one per rank (``--distributed-world-size 2 --distributed-rank R
  --distributed-no-spawn --distributed-backend gloo --ddp-backend legacy_ddp``), B examples
  per rank and batch;
* ``accum``: 1 process, B examples per batch, ``--update-freq 2``;
* ``union``: 1 process, 2B examples per batch: the R-Drop criterion over the union of what
  the two ranks see in each update.

Why the batches line up: fairseq sorts the examples by length (ties broken by ``--seed``),
cuts them into consecutive batches of ``--batch-size`` (``--required-batch-size-multiple
1``, no ``--max-tokens``), and every rank builds the same list; rank r takes batches r,
r+2, r+4, ... and ``--update-freq 2`` groups consecutive batches. ``--curriculum`` turns off
the per-epoch shuffle of that list, so update k covers batches 2k and 2k+1 in all three runs,
and their union is batch k of the 2B run. The test does not take this on trust: the model
prints every batch it trains on, and the test checks the unions update by update.

Why dropout cannot hide a difference: the models' only dropout is a test-only
``RowDropout`` whose mask is a fixed function of the example's tokens and of which copy
(first or second half of R-Drop's ``[x; x]``) the row is. The two passes differ (the KL is
not 0), but identically in every run, so the three runs agree to float rounding (~1e-7).
SGD makes the parameters a direct record of the summed gradients; fairseq's logged values
are rounded to 3-4 digits, so the test plugin makes fairseq print 12 significant digits.

Against vacuous passes: fairseq's logs must show both ranks initialised, each rank must have
trained on its own batches, and a negative control (half the alpha) must move the parameters
by far more than the tolerance. A test keeps fairseq's per-epoch batch shuffling and checks
2 ranks against ``--update-freq 2`` alone; a last one resumes 2 ranks from their own
checkpoint as fairseq does by default (process 0 reads it, the others receive it), which
under torch >= 2.6 works only with the plugin's fix. See docs/distributed.md.
"""

import json
import os
import random
import re
import socket
import subprocess
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from tests.test_cli import parse_stats, tail, tool
from tests.warm_process import fairseq_bin, run_command

TOL = 1e-5
BATCH = 3  # examples per batch and rank
TRAIN_SENTENCES = 12  # 4 batches of 3 = 2 updates an epoch
MAX_UPDATE = 4
TIMEOUT_S = 300
# wall-clock measurements, different in every run
UNTIMED = {"wps", "ups", "wall", "train_wall", "gb_free"}
BATCH_LINE = re.compile(r"^RDROP-TEST-BATCH rank=(\d+) ntokens=(\d+) rows=(.*)$", re.M)

# A --user-dir written into tmp: models whose dropout is deterministic, and full-precision
# logs. It imports rdrop_fairseq, which registers the R-Drop criteria.
TESTKIT = '''
"""Test-only fairseq plugin for tests/test_distributed.py."""

import json
import os
from numbers import Number

import torch
import torch.distributed as dist
from fairseq.distributed import utils as distributed_utils
from fairseq.logging import meters, progress_bar
from fairseq.models import register_model, register_model_architecture
from fairseq.models.transformer import TransformerModel, base_architecture
from fairseq.models.transformer_lm import TransformerLanguageModel, TransformerLanguageModelConfig
from fairseq.modules import FairseqDropout

import rdrop_fairseq  # noqa: F401  (registers the R-Drop criteria)

if os.environ.get("RDROP_TEST_UNDO_BROADCAST_FIX"):  # fairseq's own torch.load on processes > 0
    distributed_utils._broadcast_object_slow = distributed_utils._broadcast_object_slow.__wrapped__

# fairseq rounds logged values to 3-4 decimals; print 12 significant digits instead
_safe_round, _format_stat = meters.safe_round, progress_bar.format_stat
meters.safe_round = lambda number, ndigits: _safe_round(number, 12)
progress_bar.format_stat = (
    lambda s: "{:.12g}".format(s) if isinstance(s, Number) else _format_stat(s))

KEYS = 997


def halves_of(tokens):
    """Which copy of R-Drop's [x; x] each row is (0 or 1); all 0 if not duplicated."""
    rows = tokens.size(0)
    copy = torch.zeros(rows, dtype=torch.long)
    if rows % 2 == 0 and torch.equal(tokens[: rows // 2], tokens[rows // 2:]):
        copy[rows // 2:] = 1
    return copy


class RowDropout(FairseqDropout):
    """Dropout whose mask (per row and channel) is a fixed function of the row's tokens and
    of which copy of [x; x] the row is: independent of the batch the row is in, of its
    padding and of any random state. A FairseqDropout with p > 0, so the criterion sees a
    stochastic layer."""

    def __init__(self, p, salt):
        super().__init__(p)
        self.salt = salt
        self.table = None

    def forward(self, x, tokens, pad, batch_first=True):
        if not self.training:
            return x
        t = tokens.long()
        key = (((t + 1) ** 3 % 10007) * t.ne(pad)).sum(1) % KEYS
        if self.table is None or self.table.size(-1) != x.size(-1):
            gen = torch.Generator().manual_seed(1000 + self.salt)
            self.table = torch.rand(2, KEYS, x.size(-1), generator=gen)
        mask = (self.table[halves_of(tokens), key] >= self.p).to(x.dtype) / (1 - self.p)
        return x * (mask.unsqueeze(1) if batch_first else mask.unsqueeze(0))


def log_batch(src_tokens, tgt_tokens, pad):
    """Print the examples of a training batch (first copy of [x; x]) and its tokens."""
    if not halves_of(src_tokens).any():
        return
    n = src_tokens.size(0) // 2
    tgt = tgt_tokens if tgt_tokens is not None else src_tokens
    rows = sorted([s[s.ne(pad)].tolist(), t[t.ne(pad)].tolist()]
                  for s, t in zip(src_tokens[:n], tgt[:n]))
    rank = dist.get_rank() if dist.is_initialized() else 0
    ntokens = int(tgt[:n].ne(pad).sum())
    print(f"RDROP-TEST-BATCH rank={rank} ntokens={ntokens} rows={json.dumps(rows)}",
          flush=True)


@register_model("rdrop_test_transformer")
class RowDropoutTransformer(TransformerModel):
    """fairseq's transformer with RowDropout on the encoder output and decoder features."""

    @classmethod
    def build_model(cls, args, task):
        model = super().build_model(args, task)
        model.encoder_row_dropout = RowDropout(0.3, salt=1)
        model.decoder_row_dropout = RowDropout(0.3, salt=2)
        return model

    def forward(self, src_tokens, src_lengths, prev_output_tokens, **kwargs):
        pad = self.encoder.padding_idx
        if self.training:
            log_batch(src_tokens, prev_output_tokens, pad)
        enc = self.encoder(src_tokens, src_lengths=src_lengths)
        enc["encoder_out"] = [
            self.encoder_row_dropout(enc["encoder_out"][0], src_tokens, pad, batch_first=False)
        ]
        x, extra = self.decoder(prev_output_tokens, encoder_out=enc, features_only=True,
                                src_lengths=src_lengths)
        x = self.decoder_row_dropout(x, src_tokens, pad)
        return self.decoder.output_layer(x), extra


@register_model_architecture("rdrop_test_transformer", "rdrop_test_transformer")
def rdrop_test_transformer(args):
    base_architecture(args)


@register_model("rdrop_test_lm", dataclass=TransformerLanguageModelConfig)
class RowDropoutLM(TransformerLanguageModel):
    """fairseq's transformer_lm with RowDropout on the decoder features."""

    @classmethod
    def build_model(cls, args, task):
        model = super().build_model(args, task)
        model.row_dropout = RowDropout(0.3, salt=3)
        return model

    def forward(self, src_tokens, **kwargs):
        pad = self.decoder.padding_idx
        if self.training:
            log_batch(src_tokens, None, pad)
        x, extra = self.decoder(src_tokens, features_only=True, **kwargs)
        x = self.row_dropout(x, src_tokens, pad)
        return self.decoder.output_layer(x), extra
'''

WORDS = ["haus", "baum", "katze", "hund", "auto", "buch", "tisch", "stuhl", "fenster",
         "garten", "wasser", "brot", "milch", "apfel", "blume", "vogel"]


def env():
    return dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")


def check_ok(proc):
    assert proc.returncode == 0, "command failed" + tail(proc)
    return proc


def run(cmd, cwd):
    proc = run_command(cmd, cwd, env(), TIMEOUT_S)  # fairseq's tools start warm
    proc.output = proc.stdout + "\n" + proc.stderr
    return proc


# --------------------------------------------------------------------------- setup


@pytest.fixture(scope="module")
def testkit(tmp_path_factory):
    path = tmp_path_factory.mktemp("plugin") / "rdrop_dist_testkit"
    path.mkdir()
    (path / "__init__.py").write_text(TESTKIT)
    return path


def sentences(seed, n):
    """n distinct word sequences of 2-9 words (lengths vary, so do the batches' tokens)."""
    rng, out = random.Random(seed), []
    while len(out) < n:
        words = [rng.choice(WORDS) for _ in range(rng.randint(2, 9))]
        if words not in out:
            out.append(words)
    return out


@pytest.fixture(scope="module")
def translation_bin(tmp_path_factory):
    root = tmp_path_factory.mktemp("dist_translation")
    for split, n in {"train": TRAIN_SENTENCES, "valid": 2}.items():
        rows = sentences(seed=len(split), n=n)
        (root / f"{split}.de").write_text("".join(" ".join(w) + "\n" for w in rows))
        (root / f"{split}.en").write_text(
            "".join(" ".join(x.upper() for x in reversed(w)) + "\n" for w in rows))
    check_ok(run([tool("fairseq-preprocess"), "--source-lang", "de", "--target-lang", "en",
                  "--trainpref", root / "train", "--validpref", root / "valid",
                  "--destdir", root / "bin", "--joined-dictionary", "--workers", "1"], root))
    return root / "bin"


@pytest.fixture(scope="module")
def lm_bin(tmp_path_factory):
    root = tmp_path_factory.mktemp("dist_lm")
    for split, n in {"train": TRAIN_SENTENCES, "valid": 2}.items():
        rows = sentences(seed=10 + len(split), n=n)
        (root / f"{split}.txt").write_text("".join(" ".join(w) + "\n" for w in rows))
    check_ok(run([tool("fairseq-preprocess"), "--only-source", "--trainpref", root / "train.txt",
                  "--validpref", root / "valid.txt", "--destdir", root / "bin",
                  "--workers", "1"], root))
    return root / "bin"


COMMON = ["--cpu", "--num-workers", "0", "--no-progress-bar", "--log-format", "simple",
          "--log-interval", "1", "--seed", "1", "--optimizer", "sgd",
          "--max-update", str(MAX_UPDATE), "--required-batch-size-multiple", "1",
          "--dropout", "0", "--attention-dropout", "0", "--activation-dropout", "0",
          "--disable-validation", "--no-epoch-checkpoints"]
NO_SHUFFLE = ["--curriculum", "1000"]  # don't shuffle the batches for the first 1000 epochs

SETTINGS = {
    "translation": dict(
        data="translation_bin", alpha="5",
        args=["--lr", "0.5", "--task", "translation", "--source-lang", "de", "--target-lang", "en",
              "--arch", "rdrop_test_transformer", "--encoder-layers", "1",
              "--decoder-layers", "1", "--encoder-embed-dim", "16", "--decoder-embed-dim", "16",
              "--encoder-ffn-embed-dim", "32", "--decoder-ffn-embed-dim", "32",
              "--encoder-attention-heads", "2", "--decoder-attention-heads", "2",
              "--criterion", "label_smoothed_cross_entropy_rdrop", "--label-smoothing", "0.1",
              "--report-accuracy"]),
    "lm": dict(  # (with lr 0.5 this LM diverges within 4 updates)
        data="lm_bin", alpha="1",
        args=["--lr", "0.1", "--task", "language_modeling", "--tokens-per-sample", "32",
              "--sample-break-mode", "eos", "--arch", "rdrop_test_lm", "--decoder-layers", "1",
              "--decoder-embed-dim", "16", "--decoder-ffn-embed-dim", "32",
              "--decoder-attention-heads", "2", "--criterion", "cross_entropy_rdrop"]),
}


@dataclass
class Run:
    procs: list  # one per process (rank)
    save_dir: Path

    @property
    def log(self):
        """The logging rank's output: what fairseq reports for the whole run."""
        return self.procs[0].stdout

    def stats(self, name="train_inner"):
        return [{k: v for k, v in line.items() if k not in UNTIMED}
                for line in parse_stats(self.log)[name]]

    def batches(self, rank=None):
        """[(rank, ntokens, Counter of rows)] in training order."""
        out = []
        for proc in self.procs:
            for m in BATCH_LINE.finditer(proc.stdout):
                if rank is None or int(m[1]) == rank:
                    rows = Counter(json.dumps(r) for r in json.loads(m[3]))
                    out.append((int(m[1]), int(m[2]), rows))
        return out

    def params(self):
        ckpt = torch.load(self.save_dir / "checkpoint_last.pt", map_location="cpu",
                          weights_only=False)  # a checkpoint this test just wrote
        return ckpt["model"]


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def train_cmd(testkit, data, setting, save_dir, *extra, alpha=None):
    s = SETTINGS[setting]
    return [tool("fairseq-train"), data, "--user-dir", testkit, *COMMON, *s["args"],
            "--rdrop-alpha", alpha or s["alpha"], "--save-dir", save_dir, *extra]


def train(testkit, data, setting, save_dir, *extra, alpha=None):
    proc = check_ok(run(train_cmd(testkit, data, setting, save_dir, *extra, alpha=alpha),
                        save_dir.parent))
    return Run([proc], save_dir)


def train_ranks(testkit, data, setting, save_dir, *extra, world_size=2):
    """One fairseq-train process per rank, as a CPU-only user would launch them (started
    warm)."""
    def command(rank, init):
        return train_cmd(testkit, data, setting, save_dir, *extra,
                         *rank_args(rank, init, world_size, "legacy_ddp"))

    done = launch_ranks(command, save_dir.parent, env(), world_size)
    for proc in sorted(done, key=lambda p: p.returncode < 0):  # the killed ones last
        check_ok(proc)
    return Run(done, save_dir)


def rank_args(rank, init, world_size, backend):
    """fairseq-train's options for process ``rank`` of ``world_size`` (gloo, on the CPU)."""
    return ["--distributed-world-size", str(world_size), "--distributed-rank", str(rank),
            "--distributed-no-spawn", "--distributed-init-method", init,
            "--distributed-backend", "gloo", "--ddp-backend", backend]


def launch_ranks(command, log_dir, environ, world_size=2):
    """Run ``command(rank, init_method)`` for every rank, each a process of its own forked
    from this worker's warm server (tests/warm_process.py), its output in files of
    ``log_dir``; a failed rank stops the others. Returns a CompletedProcess per rank."""
    for _ in range(3):  # the free port may be taken before rank 0 binds it
        init = f"tcp://127.0.0.1:{free_port()}"
        procs, logs = [], []
        try:
            for rank in range(world_size):
                cmd = command(rank, init)
                # files, not pipes: a rank blocked on a full pipe would stall the other
                logs.append([log_dir / f"rank{rank}.{name}" for name in ("out", "err")])
                # the tool's warm stand-in (tests/warm_process.py): a process of its own per
                # rank, forked from this worker's warm server
                cmd = [Path(fairseq_bin()) / Path(cmd[0]).name, *cmd[1:]]
                with open(logs[-1][0], "w") as out, open(logs[-1][1], "w") as err:
                    procs.append(subprocess.Popen([str(c) for c in cmd], cwd=log_dir,
                                                  env=environ, stdout=out, stderr=err))
            deadline = time.monotonic() + TIMEOUT_S
            # until all are done; a failed rank leaves the others waiting for it: stop them
            while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
                if any(p.poll() not in (None, 0) for p in procs):
                    break
                time.sleep(0.2)
        finally:
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
        done = [subprocess.CompletedProcess(proc.args, proc.returncode, out.read_text(),
                                            err.read_text())
                for proc, (out, err) in zip(procs, logs)]
        if not any("address already in use" in p.stderr.lower() for p in done):
            return done
    return done


@dataclass
class Runs:
    setting: str
    data: Path
    ranks: Run
    accum: Run
    union: Run
    other_alpha: Run


@pytest.fixture(scope="module", params=list(SETTINGS))
def runs(request, testkit, tmp_path_factory):
    setting = request.param
    data = request.getfixturevalue(SETTINGS[setting]["data"])
    root = tmp_path_factory.mktemp(f"runs_{setting}")
    b = str(BATCH)
    ranks = train_ranks(testkit, data, setting, root / "ranks", "--batch-size", b, *NO_SHUFFLE)
    accum = train(testkit, data, setting, root / "accum", "--batch-size", b,
                  "--update-freq", "2", *NO_SHUFFLE)
    union = train(testkit, data, setting, root / "union", "--batch-size", str(2 * BATCH),
                  *NO_SHUFFLE)
    # negative control: the same union run, only alpha differs
    other_alpha = str(float(SETTINGS[setting]["alpha"]) / 2)
    other = train(testkit, data, setting, root / "other_alpha", "--batch-size",
                  str(2 * BATCH), *NO_SHUFFLE, alpha=other_alpha)
    return Runs(setting, data, ranks, accum, union, other)


# --------------------------------------------------------------------------- checks


def updates_of(run, per_update):
    """The multiset of examples of each update, from the batches the model printed."""
    batches = run.batches()
    assert len(batches) == MAX_UPDATE * per_update, batches
    return [sum((rows for _, _, rows in batches[i:i + per_update]), Counter())
            for i in range(0, len(batches), per_update)]


def max_param_diff(a, b):
    assert a.keys() == b.keys()
    return max((a[k].double() - b[k].double()).abs().max().item() for k in a)


def assert_same_stats(got, want, what):
    assert len(got) == len(want) and want, f"{what}: {len(got)} vs {len(want)} log lines"
    for i, (g, w) in enumerate(zip(got, want)):
        assert g.keys() == w.keys(), f"{what}, line {i}: {sorted(g)} vs {sorted(w)}"
        for key in w:
            assert g[key] == pytest.approx(w[key], rel=TOL, abs=TOL), (
                f"{what}, line {i}, {key}: {g[key]} vs {w[key]}")


def test_the_distributed_run_had_two_ranks(runs):
    rank0, rank1 = runs.ranks.procs
    assert "distributed init (rank 0)" in rank0.stdout, tail(rank0)
    assert "initialized host" in rank0.stdout and "as rank 0" in rank0.stdout, tail(rank0)
    assert "training on 2 devices" in rank0.stdout, tail(rank0)
    assert "distributed init (rank 1)" in rank1.stdout, tail(rank1)
    assert re.search(r"initialized host \S+ as rank 1", rank1.stdout), tail(rank1)
    # each rank trained on its own batches, one per update
    for rank, proc in enumerate(runs.ranks.procs):
        batches = runs.ranks.batches(rank)
        assert len(batches) == MAX_UPDATE, tail(proc)
        assert all(r == rank for r, _, _ in batches)


def test_each_update_sees_the_same_examples(runs):
    """Update k of the 2-rank run = rank 0's batch + rank 1's batch = the 2 batches of
    --update-freq 2 = the one batch of the union run."""
    per_rank = [runs.ranks.batches(rank) for rank in (0, 1)]
    accum = runs.accum.batches()
    union = updates_of(runs.union, 1)
    for k in range(MAX_UPDATE):
        (_, n0, rows0), (_, n1, rows1) = per_rank[0][k], per_rank[1][k]
        assert sum(rows0.values()) == sum(rows1.values()) == BATCH
        assert not rows0 & rows1, f"update {k}: the ranks share examples"
        assert [rows0, rows1] == [accum[2 * k][2], accum[2 * k + 1][2]], f"update {k}"
        assert rows0 + rows1 == union[k], f"update {k}"
        assert n0 + n1 == accum[2 * k][1] + accum[2 * k + 1][1]
    # all the data, each example once an epoch; and a per-rank normalisation (each rank
    # dividing by its own token count) would give another answer: the counts differ
    epoch = sum(union[:2], Counter())
    assert len(epoch) == TRAIN_SENTENCES and set(epoch.values()) == {1}
    assert any(per_rank[0][k][1] != per_rank[1][k][1] for k in range(MAX_UPDATE))


def test_logged_metrics_are_equal(runs):
    stats = runs.union.stats()
    assert len(stats) == MAX_UPDATE
    assert all(line["rdrop_kl"] > 1e-3 for line in stats), stats  # the passes differ
    assert_same_stats(runs.ranks.stats(), stats, "2 ranks vs union batch")
    assert_same_stats(runs.accum.stats(), stats, "--update-freq 2 vs union batch")
    # the epoch summaries too
    assert_same_stats(runs.ranks.stats("train"), runs.union.stats("train"), "epoch, 2 ranks")
    assert_same_stats(runs.accum.stats("train"), runs.union.stats("train"), "epoch, accum")


def test_parameters_after_the_updates_are_equal(runs):
    union = runs.union.params()
    assert max_param_diff(runs.ranks.params(), union) < TOL
    assert max_param_diff(runs.accum.params(), union) < TOL


def test_negative_control_another_alpha_is_detected(runs):
    """The comparison is sensitive: halving alpha moves the parameters by >> TOL."""
    union, other = runs.union.params(), runs.other_alpha.params()
    assert max_param_diff(other, union) > 100 * TOL
    # same model before the first update: its forward values agree, later ones do not
    forward = ("loss", "nll_loss", "rdrop_kl")
    first, want = runs.other_alpha.stats()[0], runs.union.stats()[0]
    assert_same_stats([{k: v for k, v in first.items() if k in forward}],
                      [{k: v for k, v in want.items() if k in forward}], "first update")
    last, want = runs.other_alpha.stats()[-1], runs.union.stats()[-1]
    assert abs(last["loss"] - want["loss"]) > 100 * TOL


@pytest.mark.parametrize("runs", ["translation"], indirect=True)
def test_shuffled_batches_two_ranks_equal_update_freq_2(runs, testkit, tmp_path):
    """Without --curriculum fairseq shuffles the list of batches every epoch (seed + epoch),
    the same list on every rank: 2 ranks x update-freq 1 still equal 1 process x
    update-freq 2, update by update."""
    b = str(BATCH)
    ranks = train_ranks(testkit, runs.data, "translation", tmp_path / "ranks", "--batch-size", b)
    accum = train(testkit, runs.data, "translation", tmp_path / "accum", "--batch-size", b,
                  "--update-freq", "2")
    rank_batches = [ranks.batches(rank) for rank in (0, 1)]
    accum_batches = accum.batches()
    for k in range(MAX_UPDATE):
        assert [rank_batches[0][k][2], rank_batches[1][k][2]] == [
            accum_batches[2 * k][2], accum_batches[2 * k + 1][2]], f"update {k}"
    # the shuffle did change the order of the batches (vs the unshuffled runs)
    unshuffled = [rows for _, _, rows in runs.accum.batches()]
    assert [rows for _, _, rows in accum_batches] != unshuffled
    assert_same_stats(ranks.stats(), accum.stats(), "shuffled: 2 ranks vs --update-freq 2")
    assert max_param_diff(ranks.params(), accum.params()) < TOL


@pytest.mark.parametrize("runs", ["translation"], indirect=True)
def test_two_ranks_resume_from_their_own_checkpoint(runs, testkit, tmp_path):
    """Stopped after 2 updates and resumed to 4 on 2 processes, without
    --load-checkpoint-on-all-dp-ranks: fairseq reads checkpoint_last.pt on process 0 and
    sends it to process 1 (``broadcast_object``: ``torch.save`` there, ``torch.load`` here),
    whose ``torch.load`` the plugin makes unpickle fully (a weights-only load, torch >= 2.6's
    default, refuses the DictConfig in it). The resumed run logs the updates and ends with
    the parameters of the uninterrupted 4-update run. Without the plugin's fix, process 1
    stops with that refusal."""
    save, b = tmp_path / "ranks", str(BATCH)
    train_ranks(testkit, runs.data, "translation", save, "--batch-size", b, *NO_SHUFFLE,
                "--max-update", "2")
    resumed = train_ranks(testkit, runs.data, "translation", save, "--batch-size", b,
                          *NO_SHUFFLE)
    assert re.search(r"Loaded checkpoint .*checkpoint_last\.pt \(epoch \d+ @ 2 updates\)",
                     resumed.log), tail(resumed.procs[0])
    # process 1 (which logs only warnings) trained on its batches of updates 3 and 4
    assert resumed.batches(1) == runs.ranks.batches(1)[2:]
    assert_same_stats(resumed.stats(), runs.ranks.stats()[2:], "resumed vs 4 updates")
    assert max_param_diff(resumed.params(), runs.ranks.params()) < TOL
    if tuple(int(v) for v in torch.__version__.split(".")[:2]) >= (2, 6):
        # the fix undone: fairseq's weights-only torch.load of what process 0 sent
        undone = launch_ranks(lambda rank, init: train_cmd(
            testkit, runs.data, "translation", save, "--batch-size", b, *NO_SHUFFLE,
            "--max-update", "6", *rank_args(rank, init, 2, "legacy_ddp")),
            tmp_path, dict(env(), RDROP_TEST_UNDO_BROADCAST_FIX="1"))
        assert undone[1].returncode != 0
        assert "Unsupported global: GLOBAL omegaconf.dictconfig.DictConfig" in undone[1].stderr
