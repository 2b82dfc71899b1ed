#!/usr/bin/env python
"""Fine-tune BART large on CNN/DailyMail with fairseq-hydra-train: R-Drop, or by one switch
the baseline (the paper's summarization row).

configs/bart_large_cnn_rdrop.yaml holds the paper's hyper-parameters (lr 3e-5 polynomial
decay, 20k updates, 500 warmup, max tokens 1024, dropout 0.1, label smoothing 0.1, alpha 0.7).

Modes:
  rdrop     R-Drop, alpha 0.7 (the default)
  baseline  --rdrop-alpha 0: exactly fairseq's label_smoothed_cross_entropy (plain BART)

    python -m rdrop_fairseq.recipes.train_summarization --data work/cnn_dm/bin \\
        --bart-checkpoint bart.large/model.pt --save-dir checkpoints/cnndm-rdrop \\
        [--mode baseline] [--seed 2] [--update-freq 16]
    # anything after -- is passed to fairseq-hydra-train as overrides, e.g.
    python -m rdrop_fairseq.recipes.train_summarization ... -- common.fp16=true

A fresh run starts from --bart-checkpoint with the optimizer, dataloader and meters reset
(as fairseq's BART example). --resume continues an interrupted run from
SAVE_DIR/checkpoint_last.pt instead; without it a SAVE_DIR that already holds
checkpoint_last.pt is refused rather than overwritten from BART.

fairseq-hydra-train runs as ``python -m rdrop_fairseq.fairseq_fixes`` (same arguments): plain
fairseq 0.12 cannot restore a checkpoint into a BART built from a hydra config.

Every option has an environment variable: DATA, SAVE_DIR, BART_CHECKPOINT, MODE, ALPHA,
SEED, MAX_UPDATE, MAX_TOKENS, UPDATE_FREQ. fairseq uses every visible GPU
(CUDA_VISIBLE_DEVICES); keep GPUs x update-freq = 64 (the authors: 4 GPUs x 16).
"""

import argparse
import os
import sys
from pathlib import Path

from .common import (base_command, baseline_alpha, check_common,  # noqa: E402
                           launch, optional_overrides, parse_with_overrides)
CONFIG = "bart_large_cnn_rdrop"
MODES = ("rdrop", "baseline")
PAPER_ALPHA = 0.7


def env(name, default=None):
    return os.environ.get(name, default)


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--data", default=env("DATA"),
                   help="fairseq data-bin (rdrop_fairseq.recipes.prepare_cnndm's OUT/bin)")
    p.add_argument("--save-dir", default=env("SAVE_DIR"))
    p.add_argument("--bart-checkpoint", default=env("BART_CHECKPOINT"),
                   help="the pre-trained BART to fine-tune (bart.large/model.pt)")
    p.add_argument("--resume", action="store_true",
                   help="continue from SAVE_DIR/checkpoint_last.pt (no resets)")
    p.add_argument("--mode", choices=MODES, default=env("MODE", "rdrop"))
    p.add_argument("--alpha", type=float, default=env("ALPHA"),
                   help=f"R-Drop weight (default: the paper's {PAPER_ALPHA})")
    p.add_argument("--seed", type=int, default=int(env("SEED", 1)))
    p.add_argument("--max-update", type=int, default=env("MAX_UPDATE"),
                   help="default: the paper's 20000 (the lr decays to 0 over it)")
    p.add_argument("--max-tokens", type=int, default=env("MAX_TOKENS"),
                   help="tokens per GPU batch before R-Drop's duplication (default: 1024)")
    p.add_argument("--update-freq", type=int, default=env("UPDATE_FREQ"),
                   help="default: 16 (for 4 GPUs)")
    p.add_argument("--cpu", action="store_true", help="train on the CPU")
    a = parse_with_overrides(p, argv)
    check_common(p, a, MODES)
    data = Path(a.data)
    if not all((data / f"dict.{side}.txt").is_file() for side in ("source", "target")):
        p.error(f"{a.data} is not a CNN/DM data-bin (no dict.source.txt / dict.target.txt): "
                "run rdrop_fairseq.recipes.prepare_cnndm")
    last = Path(a.save_dir) / "checkpoint_last.pt"
    if a.resume:
        if not last.is_file():
            p.error(f"--resume: there is no {last} to continue from")
    elif last.is_file():
        p.error(f"{last} exists: pass --resume to continue that run, or choose another "
                "--save-dir (a new run would restart from BART and overwrite it)")
    elif not a.bart_checkpoint:
        p.error("--bart-checkpoint (or $BART_CHECKPOINT) is required: the pre-trained "
                "bart.large/model.pt to fine-tune")
    elif not Path(a.bart_checkpoint).is_file():
        p.error(f"--bart-checkpoint {a.bart_checkpoint} not found (download and unpack "
                "bart.large.tar.gz; see docs/summarization.md)")
    return a


def hydra_command(a):
    # fairseq-hydra-train with rdrop_fairseq/fairseq_fixes.py applied: fairseq 0.12 cannot
    # load a checkpoint (bart.large) into a BART built from a hydra config without it
    cmd = base_command(CONFIG, a, launcher=(sys.executable, "-m", "rdrop_fairseq.fairseq_fixes"))
    if a.resume:  # fairseq's default restore: SAVE_DIR/checkpoint_last.pt, nothing reset
        cmd += ["checkpoint.restore_file=checkpoint_last.pt", "checkpoint.reset_optimizer=false",
                "checkpoint.reset_dataloader=false", "checkpoint.reset_meters=false"]
    else:
        cmd.append(f"checkpoint.restore_file={Path(a.bart_checkpoint).resolve()}")
    alpha = baseline_alpha(a.mode, a.alpha)
    cmd.append(f"criterion.rdrop_alpha={PAPER_ALPHA if alpha is None else alpha}")
    cmd += optional_overrides(a.max_tokens, a.max_update, a.update_freq, a.cpu)
    return cmd + a.overrides


def main(argv=None):
    a = parse_args(sys.argv[1:] if argv is None else argv)
    launch(hydra_command(a), a.save_dir)


if __name__ == "__main__":
    main()
