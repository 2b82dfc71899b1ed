#!/usr/bin/env python
"""The BART summarization recipe on real text, on CPU: baseline vs R-Drop on the LibreOffice
help pages (article -> its description), over seeds.

1. experiments.prepare_libreoffice_summaries: pages -> RAW/{train,val,test}.{source,target}
   (articles cut to --max-article-words, 40 by default, to fit a CPU budget), a GPT-2-format
   byte-level BPE and a gpt2-style dict.txt learnt on the train split;
   then rdrop_fairseq.recipes.prepare_cnndm --prepend-bos: GPT-2 BPE + fairseq-preprocess with that
   dict, every line after <s>, as the BART hub interface feeds the model at inference (a
   model trained from scratch must see it in training; bart.large saw it in pre-training).
2. A small BART (MODEL: 2+2 layers, 128 dim by default), randomly initialised once per seed
   and saved like bart.large (there is no pre-trained BART offline): both modes of a seed
   start from the same weights.
3. scripts/cnndm_bart.sh train, MODE=baseline and R-Drop (alpha 0.7), for every seed,
   two runs at a time on one CPU thread each: the recipe's config with the model shrunk, a
   from-scratch learning rate (LEARN) decaying to 0 over --max-update, at most --max-epoch
   epochs, stopped after --patience epochs without a better validation loss; the best
   checkpoint by validation loss is kept.
4. scripts/cnndm_bart.sh evaluate on the test pages with decoding lengths for one-sentence
   summaries (--min-len, --max-len-b), ROUGE-1/2/L (rouge-score, stemmed: the recipe's
   default, files2rouge's).
5. A markdown table (mean +- std over seeds) to stdout and WORK/results.md, everything to
   WORK/results.json.

    # apt-get download libreoffice-help-en-us
    python -m experiments.libreoffice_summarization_check --deb libreoffice-help-en-us_*.deb \\
        --work work/lo_summ --seeds 1 2
    # time one epoch of each mode first (seed 1, nothing evaluated):
    python -m experiments.libreoffice_summarization_check --deb ... --work ... --time-epoch

Reruns reuse what WORK already holds (the prepared data, finished trainings, scores);
delete a run's directory to redo it.
"""

import json
import os
import re
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

from rdrop_fairseq.recipes.common import parser_from_doc

from .common import recipe_script
from .prepare_libreoffice_summaries import add_source_options
MODE_ARGS = {"baseline": "baseline", "R-Drop": "rdrop"}  # cnndm_bart.sh's MODE (R-Drop: alpha 0.7)
MODEL = {"encoder_layers": 2, "decoder_layers": 2, "encoder_embed_dim": 128,
         "decoder_embed_dim": 128, "encoder_ffn_embed_dim": 512, "decoder_ffn_embed_dim": 512,
         "encoder_attention_heads": 4, "decoder_attention_heads": 4}
# a model trained from scratch needs more than fine-tuning's 3e-5 after 500 warm-up updates
LEARN = {"lr": 3e-3, "warmup": 100}
# the summaries: 18 words on average (ROUGE: the recipe's default, stemmed)
DECODE = ["--min-len", "5", "--max-len-b", "60"]


def run(cmd, log):
    print(f"[check] {' '.join(map(str, cmd))} > {log}", flush=True)
    with open(log, "w") as handle:
        if subprocess.run([str(c) for c in cmd], stdout=handle, stderr=subprocess.STDOUT,
                          env=one_thread_env()).returncode:
            sys.exit(f"error: {Path(cmd[1]).name} failed, see {log}")


def one_thread_env():
    return dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", RAYON_NUM_THREADS="1",
                TOKENIZERS_PARALLELISM="false", PYTHONUNBUFFERED="1")


def prepare(a, work):
    data = work / "data"
    if not (data / "stats.json").is_file():
        run([sys.executable, "-m", "experiments.prepare_libreoffice_summaries",
             *(["--deb", a.deb] if a.deb else ["--help-root", a.help_root]), "--out", data,
             "--vocab-size", a.vocab_size, "--max-article-words", a.max_article_words],
            work / "prepare_pages.log")
    if not (data / "bin" / "dict.source.txt").is_file():
        run([sys.executable, "-m", "rdrop_fairseq.recipes.prepare_cnndm", "--raw", data / "raw",
             "--out", data, "--encoder-json", data / "gpt2_bpe" / "encoder.json",
             "--vocab-bpe", data / "gpt2_bpe" / "vocab.bpe", "--dict", data / "dict.txt",
             "--prepend-bos"],
            work / "prepare_cnndm.log")
    return data


def write_random_bart(path, dict_txt, model, seed, num_updates=0, epoch=1):
    """A randomly initialised bart_base with ``model``'s sizes, saved like bart.large: a
    checkpoint with its args, built by fairseq's denoising task (which adds <mask> to the
    dictionary, so the embeddings have one row more than dict.txt plus the specials, as
    bart.large's), recording ``num_updates`` and ``epoch`` as a pre-training run would."""
    import shutil

    import torch
    from fairseq import options, tasks

    path.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy(dict_txt, path.parent / "dict.txt")
    torch.manual_seed(seed)
    arch = [f"--{k.replace('_', '-')}={v}" for k, v in model.items()]
    args = options.parse_args_and_arch(options.get_training_parser(), [
        str(path.parent), "--task", "denoising", "--arch", "bart_base", *arch])
    task = tasks.setup_task(args)
    state = {"args": args, "model": task.build_model(args).state_dict(),
             "optimizer_history": [{"criterion_name": "CrossEntropyCriterion",
                                    "optimizer_name": "FairseqAdam",
                                    "lr_scheduler_state": {"best": None},
                                    "num_updates": num_updates}],
             "extra_state": {"train_iterator": {"epoch": epoch}}, "last_optimizer_state": None}
    torch.save(state, path)
    return path


def train_command(a, data, init, save_dir, mode, seed, max_epoch):
    overrides = [f"model.{k}={v}" for k, v in MODEL.items()] + [
        f"optimization.lr=[{LEARN['lr']}]", f"lr_scheduler.warmup_updates={LEARN['warmup']}",
        f"optimization.max_epoch={max_epoch}", f"checkpoint.patience={a.patience}",
        "checkpoint.no_epoch_checkpoints=true",
        "checkpoint.no_last_checkpoints=true", "dataset.num_workers=0",
        "common.log_interval=50"]
    return recipe_script("cnndm_bart", "train", *overrides,
                         f"optimization.max_update={a.max_update}", DATA_DIR=data,
                         BART_DIR=init.parent, SAVE_DIR=save_dir, MODE=MODE_ARGS[mode],
                         SEED=seed, MAX_TOKENS=a.max_tokens, UPDATE_FREQ=1)


def valid_losses(log):
    return [float(x) for x in re.findall(r"epoch \d+ \| valid on 'valid' subset \| loss ([\d.]+)",
                                         Path(log).read_text(errors="replace"))]


def wait_for_one(running, seconds):
    """Sleep ``seconds``, or less: until one of the ``running`` jobs' processes ends (not
    reaped: run_parallel's wait4 reads its CPU time)."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        if any(os.waitid(os.P_PID, job[1].pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
               for job in running):
            return
        time.sleep(0.1)


def run_parallel(jobs, parallel):
    """Run (name, command, log) jobs ``parallel`` at a time, printing validation losses;
    each job's wall and CPU seconds (its processes' user + system time) go to LOG.time.json."""
    pending, running = list(jobs), []
    try:
        while pending or running:
            while pending and len(running) < parallel:
                name, cmd, log = pending.pop(0)
                print(f"[check] start {name}: {' '.join(map(str, cmd))}", flush=True)
                Path(log).parent.mkdir(parents=True, exist_ok=True)
                handle = open(log, "w")
                # a session of its own: a failure stops the job's fairseq process too
                proc = subprocess.Popen([str(c) for c in cmd], stdout=handle,
                                        stderr=subprocess.STDOUT, env=one_thread_env(),
                                        start_new_session=True)
                running.append([name, proc, log, handle, 0, time.time()])
            wait_for_one(running, 5)
            for job in list(running):
                name, proc, log, handle, seen, start = job
                losses = valid_losses(log)
                for epoch in range(seen, len(losses)):
                    print(f"  [{name}] epoch {epoch + 1}: valid loss {losses[epoch]:.3f} "
                          f"({time.time() - start:.0f} s)", flush=True)
                job[4] = len(losses)
                # wait4 rather than poll: it also gives the CPU time of the job's processes
                pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
                if pid:
                    proc.returncode = os.waitstatus_to_exitcode(status)
                    handle.close()
                    running.remove(job)
                    if proc.returncode:
                        sys.exit(f"error: {name} failed, see {log}")
                    seconds = {"wall_s": round(time.time() - start),
                               "cpu_s": round(usage.ru_utime + usage.ru_stime)}
                    Path(log).with_suffix(".time.json").write_text(json.dumps(seconds) + "\n")
    finally:
        for _, proc, *_ in running:  # after a failure or an interrupt
            try:
                os.killpg(proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass


def evaluate_command(data, save_dir):
    # checkpoint_best.pt; scores into SAVE_DIR/rouge.json
    return recipe_script("cnndm_bart", "evaluate", *DECODE, DATA_DIR=data, RAW=data / "raw",
                         BPE_DIR=data / "gpt2_bpe", SAVE_DIR=save_dir)


def mean_std(values):
    return (f"{statistics.mean(values):.2f} ± "
            f"{statistics.stdev(values) if len(values) > 1 else 0.0:.2f}")


def table(results):
    lines = ["| mode | ROUGE-1 | ROUGE-2 | ROUGE-L | best valid loss (epoch) | training CPU time |",
             "|---|---|---|---|---|---|"]
    for mode, runs in results.items():
        cells = [mean_std([r[k] for r in runs]) for k in ("rouge1", "rouge2", "rougeLsum")]
        best = ", ".join(f"{r['best_valid_loss']:.3f} ({r['best_epoch']})" for r in runs)
        seconds = ", ".join(f"{r['cpu_s']} s" for r in runs)
        lines.append(f"| {mode} | {' | '.join(cells)} | {best} | {seconds} |")
    lines += ["", "| mode | seed | ROUGE-1 | ROUGE-2 | ROUGE-L | rougeL (sentence) |",
              "|---|---|---|---|---|---|"]
    for mode, runs in results.items():
        for r in runs:
            lines.append(f"| {mode} | {r['seed']} | {r['rouge1']:.2f} | {r['rouge2']:.2f} | "
                         f"{r['rougeLsum']:.2f} | {r['rougeL']:.2f} |")
    runs = [r for mode_runs in results.values() for r in mode_runs]
    lines += ["", f"CPU time: training {sum(r['cpu_s'] for r in runs) / 60:.1f} min, "
                  f"evaluation {sum(r['evaluate_cpu_s'] for r in runs) / 60:.1f} min."]
    return "\n".join(lines)


def parse_args(argv=None):
    p = parser_from_doc(__doc__)
    add_source_options(p)
    p.add_argument("--work", type=Path, required=True, help="where everything is written")
    p.add_argument("--seeds", type=int, nargs="+", default=[1, 2])
    p.add_argument("--modes", nargs="+", choices=list(MODE_ARGS), default=list(MODE_ARGS))
    p.add_argument("--max-epoch", type=int, default=30)
    p.add_argument("--patience", type=int, default=3,
                   help="stop a run after this many epochs without a better validation loss")
    p.add_argument("--max-update", type=int, default=3200,
                   help="the learning rate decays linearly to 0 over this many updates")
    p.add_argument("--max-tokens", type=int, default=1024)
    p.add_argument("--vocab-size", type=int, default=4000)
    p.add_argument("--max-article-words", type=int, default=40)
    p.add_argument("--parallel", type=int, default=2, help="trainings at a time (1 thread each)")
    p.add_argument("--time-epoch", action="store_true",
                   help="train one epoch of each mode (first seed) to size the run; no scores")
    a = p.parse_args(argv)
    if a.deb and not Path(a.deb).is_file():
        p.error(f"--deb {a.deb}: no such file (apt-get download libreoffice-help-en-us)")
    if a.help_root and not (Path(a.help_root) / "en-US").is_dir():
        p.error(f"--help-root {a.help_root} holds no en-US/ help tree")
    return a


def main(argv=None):
    a = parse_args(argv)
    work = a.work.resolve()
    work.mkdir(parents=True, exist_ok=True)
    data = prepare(a, work)
    stats = json.loads((data / "stats.json").read_text())
    print(f"[check] pairs: {stats['pairs']}", flush=True)
    seeds, max_epoch, runs_dir = a.seeds, a.max_epoch, work / "runs"
    if a.time_epoch:
        seeds, max_epoch, runs_dir = seeds[:1], 1, work / "time_epoch"
    jobs, save_dirs = [], {}
    for seed in seeds:
        init = work / "init" / f"seed{seed}" / "model.pt"
        if not init.is_file():
            write_random_bart(init, data / "dict.txt", MODEL, seed)
        for mode in sorted(a.modes, key=lambda m: m != "R-Drop"):  # the longer runs first
            save_dir = runs_dir / f"{MODE_ARGS[mode]}_seed{seed}"
            save_dirs[mode, seed] = save_dir
            # LOG.time.json is written when a training ends well (a stopped one has a
            # checkpoint_best.pt too)
            if not save_dir.with_suffix(".time.json").is_file():
                jobs.append((f"{mode} s{seed}", train_command(a, data, init, save_dir, mode,
                                                              seed, max_epoch),
                             save_dir.with_suffix(".log")))
    run_parallel(jobs, a.parallel)
    if a.time_epoch:
        for (mode, seed), save_dir in save_dirs.items():
            seconds = json.loads(save_dir.with_suffix(".time.json").read_text())
            print(f"[check] {mode}: one epoch (with validation and start-up) "
                  f"{seconds['cpu_s']} CPU s ({seconds['wall_s']} s wall)")
        return
    evals = [(f"evaluate {mode} s{seed}", evaluate_command(data, save_dir),
              save_dir.with_suffix(".evaluate.log"))
             for (mode, seed), save_dir in save_dirs.items()
             if not (save_dir / "rouge.json").is_file()]
    run_parallel(evals, a.parallel)
    results = {}
    for mode in a.modes:
        for seed in seeds:
            save_dir = save_dirs[mode, seed]
            losses = valid_losses(save_dir.with_suffix(".log"))
            scores = json.loads((save_dir / "rouge.json").read_text())
            results.setdefault(mode, []).append({
                "seed": seed, **{k: scores[k] for k in ("rouge1", "rouge2", "rougeLsum",
                                                        "rougeL")},
                "valid_losses": losses, "best_valid_loss": min(losses),
                "best_epoch": losses.index(min(losses)) + 1,
                **json.loads(save_dir.with_suffix(".time.json").read_text()),
                "evaluate_cpu_s": json.loads(
                    save_dir.with_suffix(".evaluate.time.json").read_text())["cpu_s"]})
    setup = {"pairs": stats["pairs"], "model": MODEL, "learn": LEARN, "decode": DECODE,
             "max_epoch": a.max_epoch, "patience": a.patience, "max_update": a.max_update,
             "max_tokens": a.max_tokens, "seeds": seeds, "sources": stats["sources"]}
    (work / "results.json").write_text(json.dumps({"setup": setup, "runs": results}, indent=1)
                                       + "\n")
    text = table(results)
    (work / "results.md").write_text(text + "\n")
    print("\n" + text, flush=True)


if __name__ == "__main__":
    main()
