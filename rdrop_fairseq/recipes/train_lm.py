#!/usr/bin/env python
"""Train a WikiText-103 language model of the paper with fairseq-hydra-train: R-Drop, or by
one switch the baseline.

Recipes (configs/ holds the paper's hyper-parameters):
  gpt      transformer_lm_gpt, criterion cross_entropy_rdrop, alpha 1
           (8 GPUs x 2000 tokens x update-freq 16, 50k updates)
  wiki103  transformer_lm_wiki103 (adaptive input + adaptive softmax), criterion
           adaptive_loss_rdrop, alpha 1 (8 GPUs x 3072 tokens x update-freq 3, 286k updates)

Modes:
  rdrop     R-Drop (the default)
  baseline  --rdrop-alpha 0: exactly fairseq's cross_entropy / adaptive_loss

    python -m rdrop_fairseq.recipes.train_lm gpt --data work/wikitext-103/bin \\
        --save-dir checkpoints/wt103-gpt-rdrop [--mode baseline] [--seed 2] [--max-update 50000]
    # anything after -- is passed to fairseq-hydra-train as overrides, e.g.
    python -m rdrop_fairseq.recipes.train_lm wiki103 ... -- common.fp16=true

Every option has an environment variable: DATA, SAVE_DIR, MODE, ALPHA, SEED, MAX_UPDATE,
MAX_TOKENS, UPDATE_FREQ. fairseq uses every visible GPU (CUDA_VISIBLE_DEVICES); keep
GPUs x update-freq equal to the paper's (8 x 16 = 128 for gpt, 8 x 3 = 24 for wiki103).
"""

import argparse
import os
import sys
from pathlib import Path

from .common import (base_command, baseline_alpha, check_common, launch,  # noqa: E402
                           optional_overrides, parse_with_overrides)
RECIPES = {"gpt": "transformer_lm_gpt_rdrop", "wiki103": "transformer_lm_wiki103_rdrop"}
MODES = ("rdrop", "baseline")
WIKI103_CUTOFF = (20000, 60000)  # the config's adaptive input / softmax cut-offs


def env(name, default=None):
    return os.environ.get(name, default)


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("recipe", choices=sorted(RECIPES))
    p.add_argument("--data", default=env("DATA"),
                   help="fairseq data-bin (rdrop_fairseq.recipes.prepare_wikitext's OUT/bin)")
    p.add_argument("--save-dir", default=env("SAVE_DIR"))
    p.add_argument("--mode", choices=MODES, default=env("MODE", "rdrop"))
    p.add_argument("--alpha", type=float, default=env("ALPHA"), help="default: the paper's 1")
    p.add_argument("--seed", type=int, default=int(env("SEED", 1)))
    p.add_argument("--max-update", type=int, default=env("MAX_UPDATE"),
                   help="default: the paper's (50000 gpt, 286000 wiki103)")
    p.add_argument("--max-tokens", type=int, default=env("MAX_TOKENS"),
                   help="tokens per GPU batch before R-Drop's duplication "
                        "(default: 2000 gpt, 3072 wiki103)")
    p.add_argument("--update-freq", type=int, default=env("UPDATE_FREQ"),
                   help="default: 16 gpt, 3 wiki103 (for 8 GPUs)")
    p.add_argument("--cpu", action="store_true", help="train on the CPU")
    a = parse_with_overrides(p, argv)
    overrides = a.overrides
    check_common(p, a, MODES)
    dict_txt = Path(a.data) / "dict.txt"
    if not dict_txt.is_file():
        p.error(f"{a.data} is not a language-model data-bin (no dict.txt): run "
                "rdrop_fairseq.recipes.prepare_wikitext")
    cutoff_keys = ("model.adaptive_softmax_cutoff=", "model.adaptive_input_cutoff=")
    if a.recipe == "wiki103" and not any(o.lstrip("+").startswith(cutoff_keys)
                                         for o in overrides):
        vocab = len(dict_txt.read_text(encoding="utf-8").splitlines()) + 4
        if vocab <= WIKI103_CUTOFF[-1]:
            p.error(f"the wiki103 recipe's adaptive cut-offs {WIKI103_CUTOFF} need a vocabulary "
                    f"of more than {WIKI103_CUTOFF[-1]} words; {a.data} has {vocab}. Override "
                    "both after --: model.adaptive_input_cutoff=\"'A,B'\" "
                    "model.adaptive_softmax_cutoff=\"'A,B'\" with B < the vocabulary")
    return a


def hydra_command(a):
    cmd = base_command(RECIPES[a.recipe], a)
    alpha = baseline_alpha(a.mode, a.alpha)
    if alpha is not None:
        cmd.append(f"criterion.rdrop_alpha={alpha}")
    cmd += optional_overrides(a.max_tokens, a.max_update, a.update_freq, a.cpu)
    return cmd + a.overrides


def main(argv=None):
    a = parse_args(sys.argv[1:] if argv is None else argv)
    launch(hydra_command(a), a.save_dir)


if __name__ == "__main__":
    main()
