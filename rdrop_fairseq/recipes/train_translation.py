#!/usr/bin/env python
"""Train a translation recipe of the paper with fairseq-hydra-train: R-Drop, or by one switch
the baseline or an appendix ablation.

Recipes (configs/ holds the paper's hyper-parameters):
  iwslt   transformer_iwslt_de_en, alpha 5   (IWSLT14 De<->En, En<->Fr, En<->Es; IWSLT17 En<->Zh)
  wmt14   transformer_vaswani_wmt_en_de_big, alpha 5   (WMT14 En->De, En->Fr)

Modes:
  rdrop          R-Drop (the default)
  baseline       --rdrop-alpha 0: exactly fairseq's label_smoothed_cross_entropy
  no-kl          two passes without the KL (appendix C.2)
  doubled-batch  the baseline with twice the max tokens per batch (appendix C.1)

    python -m rdrop_fairseq.recipes.train_translation iwslt --data work/iwslt14.de-en/bin --src de --tgt en \\
        --save-dir checkpoints/iwslt14-rdrop [--mode baseline] [--seed 2] [--max-update 300000]
    # anything after -- is passed to fairseq-hydra-train as overrides, e.g.
    python -m rdrop_fairseq.recipes.train_translation wmt14 ... -- common.fp16=true

Every option has an environment variable: DATA, SAVE_DIR, SRC, TGT, MODE, ALPHA, SEED,
MAX_UPDATE, MAX_TOKENS, UPDATE_FREQ. fairseq uses every visible GPU (CUDA_VISIBLE_DEVICES);
keep GPUs x update-freq equal to the paper's (1 x 1 for iwslt, 8 x 16 for wmt14).
"""

import argparse
import os
import sys
from pathlib import Path

from .common import (base_command, baseline_alpha, check_common, launch,  # noqa: E402
                           optional_overrides, parse_with_overrides)

RECIPES = {"iwslt": "transformer_iwslt_de_en_rdrop", "wmt14": "transformer_wmt14_big_rdrop"}
PAPER_MAX_TOKENS = 4096
MODES = ("rdrop", "baseline", "no-kl", "doubled-batch")


def env(name, default=None):
    return os.environ.get(name, default)


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("recipe", choices=sorted(RECIPES))
    p.add_argument("--data", default=env("DATA"), help="fairseq data-bin directory")
    p.add_argument("--save-dir", default=env("SAVE_DIR"))
    p.add_argument("--src", default=env("SRC"), help="source language (default: the config's)")
    p.add_argument("--tgt", default=env("TGT"))
    p.add_argument("--mode", choices=MODES, default=env("MODE", "rdrop"))
    p.add_argument("--alpha", type=float, default=env("ALPHA"), help="default: the paper's 5")
    p.add_argument("--seed", type=int, default=int(env("SEED", 1)))
    p.add_argument("--max-update", type=int, default=env("MAX_UPDATE"))
    p.add_argument("--max-tokens", type=int, default=int(env("MAX_TOKENS", PAPER_MAX_TOKENS)))
    p.add_argument("--update-freq", type=int, default=env("UPDATE_FREQ"))
    p.add_argument("--cpu", action="store_true", help="train on the CPU")
    a = parse_with_overrides(p, argv)
    check_common(p, a, MODES)
    if not (Path(a.data) / "dict.txt").exists() and not list(Path(a.data).glob("dict.*.txt")):
        p.error(f"{a.data} is not a fairseq data-bin (no dict.*.txt): run prepare_translation.py")
    return a


def data_overrides(data, src, tgt):
    """Overrides the data-bin calls for: separate dictionaries cannot share all embeddings,
    and sentencepiece data is decoded with sentencepiece for the validation BLEU. sacreBLEU's
    default tokenisation cannot score Chinese, so a Chinese target selects the best checkpoint
    by validation loss."""
    data, out = Path(data), []  # ++: the wmt14 config has no eval_bleu keys to override
    dicts = sorted(data.glob("dict.*.txt"))
    if len(dicts) == 2 and dicts[0].read_bytes() != dicts[1].read_bytes():
        out += ["++model.share_all_embeddings=false",
                "++model.share_decoder_input_output_embed=true"]
    if any(data.glob("spm*.model")):
        out += ["++task.eval_bleu_remove_bpe=sentencepiece", "++task.eval_bleu_detok=space"]
    if tgt == "zh":
        out += ["++task.eval_bleu=false", "++checkpoint.best_checkpoint_metric=loss",
                "++checkpoint.maximize_best_checkpoint_metric=false"]
    return out


def hydra_command(a):
    cmd = base_command(RECIPES[a.recipe], a)
    if a.src:
        cmd.append(f"task.source_lang={a.src}")
    if a.tgt:
        cmd.append(f"task.target_lang={a.tgt}")
    alpha = baseline_alpha(a.mode, a.alpha, without_kl=MODES[1:])
    if a.mode == "no-kl":
        cmd.append("criterion.rdrop_two_passes=true")
    if alpha is not None:
        cmd.append(f"criterion.rdrop_alpha={alpha}")
    max_tokens = a.max_tokens * (2 if a.mode == "doubled-batch" else 1)
    cmd += optional_overrides(max_tokens, a.max_update, a.update_freq, a.cpu)
    return cmd + data_overrides(a.data, a.src, a.tgt) + a.overrides


def main(argv=None):
    a = parse_args(sys.argv[1:] if argv is None else argv)
    launch(hydra_command(a), a.save_dir)


if __name__ == "__main__":
    main()
