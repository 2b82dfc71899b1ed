"""The README's first command, the LibreOffice demo (``bash scripts/demo.sh``; its module
after the first step), shrunk: it
trains, scores and plots every run, and it can be stopped and run again: a rerun reuses
the prepared data and the finished runs, continues an interrupted run from its
checkpoint, rebuilds a half-written data directory, refuses other settings in the same
--out, and ``--fresh`` starts over. Tiny settings: 200 training pairs, 2 epochs, seeds 1 and 2. The Ctrl-C
plans the default runs (the baseline and R-Drop for both seeds, the doubled-batch control
for the first); the reruns train and score the baseline and R-Drop (``--runs`` is not a
setting: a rerun may choose fewer runs), and ``--fresh`` trains the control alone, for 1
epoch. One test: each step starts from what the one before left."""

import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from rdrop_fairseq.checkpoint_compat import allow_fairseq_checkpoint_globals
from rdrop_fairseq.recipes.libreoffice_demo import Cores
from tests.recipe_helpers import terminal_sigint
from tests.warm_process import fairseq_bin, forks_warm, machine_env, run_command

REPO = Path(__file__).resolve().parents[1]
SETTINGS = ["--quick", "--epochs", "2", "--train-pairs", "200", "--eval-pairs", "20",
            "--seeds", "1", "2"]
DEMO = ["bash", str(REPO / "scripts" / "demo.sh"), *SETTINGS]
RUNS = ["--runs", "baseline", "R-Drop"]  # the reruns' (step 1 plans the default runs)


def env(tmp_path):
    return {**machine_env(),
            "PATH": os.pathsep.join([str(Path(sys.executable).parent), "/usr/bin", "/bin"]),
            "HOME": str(tmp_path)}


def demo(tmp_path, out, *extra):
    """A demo run to its end: what demo.sh runs after its set-up check (step 1 runs the
    script itself), ``python -m rdrop_fairseq.recipes.libreoffice_demo``, started warm as
    fairseq's tools are (tests/warm_process.py): what is about real processes (Ctrl-C, no
    training left running) is step 1's, which runs them as a user's run does."""
    cmd = [sys.executable, "-m", "rdrop_fairseq.recipes.libreoffice_demo", *SETTINGS,
           "--out", str(out), *extra]
    demo_env = {**env(tmp_path), "FAIRSEQ_BIN": fairseq_bin(), "OMP_NUM_THREADS": "1",
                "MKL_NUM_THREADS": "1"}
    assert forks_warm(cmd, demo_env)
    proc = run_command(cmd, REPO, demo_env, 600)
    proc.output = proc.stdout + proc.stderr
    return proc


def table(stdout):
    return [line for line in stdout.splitlines() if line.startswith("| ")]


def processes_mentioning(text):
    """Processes whose command line contains ``text`` (trainings left running)."""
    found = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            if text in cmdline.read_bytes().decode(errors="replace"):
                found.append(cmdline.parent.name)
        except OSError:  # the process ended meanwhile
            pass
    return found


def test_demo_stops_reruns_continues_and_starts_over(tmp_path):
    out = tmp_path / "demo"

    # 1. Ctrl-C while training: the trainings stop, the output says how to go on
    proc = subprocess.Popen([*DEMO, "--out", str(out)], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=env(tmp_path),
                            start_new_session=True, preexec_fn=terminal_sigint)
    seen = []
    for line in proc.stdout:
        seen.append(line)
        if line.startswith("[demo] training"):
            break
    assert seen[-1].startswith("[demo] training"), "".join(seen)[-3000:]  # ended early
    # the default runs: baseline and R-Drop for seeds 1 and 2, the control for seed 1 only
    assert seen[-1].startswith("[demo] training 5 runs, 2 at a time, 2 epochs each"), seen[-1]
    # at once: the trainings start right after that line, and the whole --quick run can
    # end within seconds on a fast machine
    os.killpg(proc.pid, signal.SIGINT)  # what Ctrl-C sends to the terminal's process group
    rest, _ = proc.communicate(timeout=120)
    output = "".join(seen) + rest
    assert proc.returncode != 0, output
    assert "[demo] interrupted. Finished runs are kept in" in output, output[-2000:]
    assert "smoke test" in output  # --quick says what it is
    assert not processes_mentioning(str(out)), "trainings left running"

    # 2. the rerun reuses the data, trains and scores every run, prints the table, plots
    first = demo(tmp_path, out, *RUNS)
    assert first.returncode == 0, first.output[-4000:]
    assert "[demo] reusing the prepared data" in first.stdout
    # setup.sh installs tensorboardX; each fairseq command's import of fairseq would say
    # so if it were missing, warm (which repeats what the import logged) or not
    # (tests/test_warm_process.py has the control)
    assert "Please install tensorboardX" not in first.output
    assert "not a measurement" in first.stdout.split("| R-Drop |")[1]  # said after the table
    assert "[R-Drop s2] epoch 1: valid BLEU" in first.stdout  # progress is streamed
    results = json.loads((out / "results.json").read_text())
    assert results["size"]["pairs"] == 200
    runs = results["runs"]
    assert list(runs) == ["baseline", "R-Drop"]  # in --runs order (R-Drop trained first)
    assert runs["baseline"]["seeds"] == runs["R-Drop"]["seeds"] == [1, 2]
    for name, run in runs.items():
        assert all(0 <= b <= 100 for b in run["test_bleu"])
        assert all(len(c) == 2 for c in run["valid_curves"])
        for seed, bleu in zip(run["seeds"], run["test_bleu"]):  # streamed as each run ends
            assert f"[{name} s{seed}] test BLEU {bleu:.2f} (average of the last 2" in first.stdout
    for run in ("baseline", "R-Drop"):
        assert re.search(rf"^\| {run} \| [\d.]+ ± [\d.]+ \| [\d.]+, [\d.]+ \|$", first.stdout,
                         re.M), first.stdout[-1500:]
    gain = statistics.mean(runs["R-Drop"]["test_bleu"]) - statistics.mean(
        runs["baseline"]["test_bleu"])
    assert f"R-Drop - baseline: {gain:+.2f} BLEU" in first.stdout
    # the test score is the average of the last 2 epoch checkpoints (quick keeps 2)
    allow_fairseq_checkpoint_globals()
    for save_dir in ("baseline_seed1", "r_drop_seed2"):
        assert sorted(p.name for p in (out / save_dir).glob("checkpoint[0-9]*.pt")) == [
            "checkpoint1.pt", "checkpoint2.pt"]
        first_epoch, second_epoch, avg = (
            torch.load(out / save_dir / f"checkpoint{n}.pt", map_location="cpu")["model"]
            for n in ("1", "2", "_avg2"))
        for name, value in avg.items():
            if value.is_floating_point():
                torch.testing.assert_close(value, (first_epoch[name] + second_epoch[name]) / 2)
    assert (out / "valid_bleu.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # --quick's test translations stop at 1.2 x the source's length + 10 tokens (its
    # barely trained models run on to fairseq's default of 200): the P- lines' scores,
    # one per token and the end of sentence
    sources = (out / "data" / "bpe" / "test.de").read_text().splitlines()
    cap = 1.2 * (max(len(line.split()) for line in sources) + 1) + 10  # + 1: its EOS
    lengths = [len(line.split("\t")[1].split()) - 1
               for line in (out / "r_drop_seed2.test.txt").read_text().splitlines()
               if line.startswith("P-")]
    assert len(lengths) == len(sources) == 20 and max(lengths) <= cap, (lengths, cap)
    train_lines = (out / "data" / "tok" / "train.de").read_text().splitlines()
    assert 150 < len(train_lines) <= 200  # the subset, after length cleaning
    assert "'max_tokens': 1024," in (out / "baseline_seed1.log").read_text()

    # 3. a second rerun trains nothing and prints the same table from the saved results
    checkpoints = {p: p.stat().st_mtime_ns for p in out.glob("*/checkpoint*.pt")}
    logs = {p: p.read_text() for p in out.glob("*.log")}
    again = demo(tmp_path, out, *RUNS)
    assert again.returncode == 0, again.output[-4000:]
    assert "valid BLEU" not in again.stdout and "[demo] training" not in again.stdout
    assert "[baseline s1] finished earlier: test BLEU" in again.stdout
    assert table(again.stdout) == table(first.stdout) and len(table(first.stdout)) == 3
    assert json.loads((out / "results.json").read_text()) == results
    assert {p: p.stat().st_mtime_ns for p in out.glob("*/checkpoint*.pt")} == checkpoints
    assert {p: p.read_text() for p in out.glob("*.log")} == logs

    # 4. what an interruption during the baseline's 2nd epoch leaves (checkpoint_last.pt
    # truncated while fairseq copied it), and a data directory whose preparation was cut
    # short: the data is rebuilt, the baseline continues at epoch 2, R-Drop stays done
    base = out / "baseline_seed1"
    log = base.with_suffix(".log")
    text = log.read_text()
    log.write_text(text[:text.index("\n", text.index("Saved checkpoint " + str(base)))])
    for name in ("result.json", "checkpoint2.pt", "checkpoint_avg2.pt"):
        (base / name).unlink()
    data = (base / "checkpoint1.pt").read_bytes()
    (base / "checkpoint_last.pt").write_bytes(data[:len(data) // 2])
    epoch1 = (base / "checkpoint1.pt").stat().st_mtime_ns
    (out / "data" / "done.json").unlink()
    shutil.rmtree(out / "data" / "bin")
    cont = demo(tmp_path, out, *RUNS)
    assert cont.returncode == 0, cont.output[-4000:]
    assert "(no done.json): preparing it again" in cont.stdout
    assert "[baseline s1] checkpoint_last.pt does not load" in cont.stdout
    assert "[baseline s1] continuing from its checkpoint_last.pt (1 epoch done)" in cont.stdout
    assert "[baseline s1] epoch 2: valid BLEU" in cont.stdout
    assert "epoch 1: valid BLEU" not in cont.stdout
    assert "[R-Drop s1] finished earlier" in cont.stdout
    assert (base / "checkpoint1.pt").stat().st_mtime_ns == epoch1  # not trained again
    continued = log.read_text()
    assert continued.startswith(text[:text.index("Saved checkpoint " + str(base))])  # appended
    assert len(re.findall(r"\| valid \| epoch 001 \|", continued)) == 1
    assert len(re.findall(r"\| valid \| epoch 002 \|", continued)) == 1
    # the update count (and with it the lr schedule) comes back only with the optimizer state
    updates = r"\| valid \| epoch 002 \|.*\| num_updates (\d+)"
    assert re.search(updates, continued)[1] == re.search(updates, text)[1]
    resumed = json.loads((base / "result.json").read_text())
    assert len(resumed["valid_curve"]) == 2 and resumed["valid_curve"][0] == (
        results["runs"]["baseline"]["valid_curves"][0][0])

    # 5. other settings in the same --out: a one-line error, nothing touched
    other = demo(tmp_path, out, *RUNS, "--epochs", "3")
    assert other.returncode == 1
    assert other.stderr.strip().splitlines()[-1] == (
        f"error: {out} holds a demo with other settings (epochs 2 -> 3); add --fresh to start "
        "over there, or choose another --out")
    assert (base / "result.json").is_file()

    # 6. --fresh deletes the demo's outputs (and only those) and starts over; the
    # doubled-batch control: the first seed only, twice the baseline's --max-tokens
    (out / "mine.txt").write_text("not the demo's")
    fresh = demo(tmp_path, out, "--fresh", "--epochs", "1", "--runs", "doubled batch")
    assert fresh.returncode == 0, fresh.output[-4000:]
    assert "finished earlier" not in fresh.stdout
    assert "[doubled batch s1] epoch 1: valid BLEU" in fresh.stdout
    assert not (out / "r_drop_seed1").exists() and not (out / "baseline_seed1").exists()
    assert (out / "mine.txt").is_file()
    assert json.loads((out / "settings.json").read_text())["epochs"] == 1
    control = json.loads((out / "results.json").read_text())["runs"]
    assert list(control) == ["doubled batch"] and control["doubled batch"]["seeds"] == [1]
    assert re.search(r"^\| doubled batch \| [\d.]+ ± – \(1 seed\) \| [\d.]+ \|$",
                     fresh.stdout, re.M), fresh.stdout[-1500:]
    assert "'max_tokens': 2048," in (out / "doubled_batch_seed1.log").read_text()


def test_one_scoring_beside_the_trainings_more_on_the_cores_they_leave():
    cores, release, started = Cores(2), threading.Event(), []

    def scoring(i):
        started.append(i)
        assert release.wait(30)

    def running_after_a_while(n):
        deadline = time.monotonic() + 10
        while len(started) < n and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.2)  # time for one too many to start
        return len(started)

    cores.set_trainings(2)
    with ThreadPoolExecutor(max_workers=3) as pool:
        futures = [pool.submit(cores.score, scoring, i) for i in range(3)]
        try:
            assert running_after_a_while(1) == 1  # beside 2 trainings on 2 cores
            cores.set_trainings(1)
            assert running_after_a_while(1) == 1  # 1 training + 1 scoring use both cores
            cores.set_trainings(0)
            assert running_after_a_while(2) == 2  # the trainings are done: one per core
        finally:
            release.set()
    assert [f.result() for f in futures] == [None] * 3 and sorted(started) == [0, 1, 2]


def test_too_few_evaluation_pairs_are_refused_before_anything_is_made(tmp_path, capsys):
    """fairseq-train validates in batches of a multiple of 8 sentences and makes none from
    fewer: --eval-pairs 5 would prepare the data, then every run would fail on an empty
    validation set. Refused first, saying how many pairs are left and what to change."""
    from rdrop_fairseq.recipes import libreoffice_demo

    out = tmp_path / "demo"
    for pairs in ("5", "0"):
        try:
            libreoffice_demo.main(["--quick", "--eval-pairs", pairs, "--out", str(out)])
        except SystemExit as stop:
            assert stop.code == 2
        else:
            raise AssertionError(f"--eval-pairs {pairs} was accepted")
        err = capsys.readouterr().err
        assert err.count("\n") == 1, err
        assert f"--eval-pairs {pairs} keeps {pairs} validation pairs" in err, err
        assert "of at most 15 words a side" in err and "use --eval-pairs 8 or more" in err, err
        assert not out.exists()
