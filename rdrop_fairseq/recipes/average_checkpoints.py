#!/usr/bin/env python
"""Average the parameters of fairseq checkpoints (the paper averages the last few).

fairseq keeps ``rdrop_fairseq.recipes.average_checkpoints`` in its repository but not in the PyPI
packages, so here is the same operation: the float parameters are averaged; the rest of the
first checkpoint (config, non-float buffers, metadata) is kept, its optimizer state dropped.

    python -m rdrop_fairseq.recipes.average_checkpoints --inputs SAVE_DIR \\
        --num-epoch-checkpoints 5 \\
        --output SAVE_DIR/checkpoint_avg5.pt
    python -m rdrop_fairseq.recipes.average_checkpoints --inputs a.pt b.pt c.pt --output avg.pt
"""

import re
import sys
from pathlib import Path

import torch

from ..checkpoint_compat import allow_fairseq_checkpoint_globals
from .common import parser_from_doc


def last_checkpoints(save_dir, n, pattern):
    """The ``n`` checkpoints with the highest number in ``save_dir`` matching ``pattern``."""
    numbered = []
    for path in Path(save_dir).iterdir():
        m = re.fullmatch(pattern, path.name)
        if m:
            numbered.append((int(m.group(1)), path))
    if len(numbered) < n:
        sys.exit(f"error: {save_dir} has {len(numbered)} checkpoints matching {pattern}, "
                 f"{n} requested (keep them with --keep-last-epochs / --keep-interval-updates)")
    return [path for _, path in sorted(numbered)[-n:]]


def average(paths):
    allow_fairseq_checkpoint_globals()
    total, first = None, None
    for path in paths:
        state = torch.load(path, map_location="cpu")
        model = state["model"]
        if total is None:
            first, total = state, {k: v.clone().double() for k, v in model.items()
                                   if v.is_floating_point()}
        elif model.keys() != first["model"].keys():
            sys.exit(f"error: {path} has other parameters than {paths[0]}")
        else:
            for k in total:
                total[k] += model[k].double()
    for k, v in total.items():
        first["model"][k] = (v / len(paths)).to(first["model"][k].dtype)
    first.pop("last_optimizer_state", None)  # an average is not a point to resume from
    return first


def main():
    p = parser_from_doc(__doc__)
    p.add_argument("--inputs", nargs="+", required=True,
                   help="checkpoint files, or one directory with --num-*-checkpoints")
    p.add_argument("--output", required=True)
    group = p.add_mutually_exclusive_group()
    group.add_argument("--num-epoch-checkpoints", type=int)
    group.add_argument("--num-update-checkpoints", type=int)
    a = p.parse_args()
    if a.num_epoch_checkpoints or a.num_update_checkpoints:
        if len(a.inputs) != 1 or not Path(a.inputs[0]).is_dir():
            p.error("--num-*-checkpoints takes one directory in --inputs")
        if a.num_epoch_checkpoints:
            paths = last_checkpoints(a.inputs[0], a.num_epoch_checkpoints, r"checkpoint(\d+)\.pt")
        else:
            paths = last_checkpoints(a.inputs[0], a.num_update_checkpoints,
                                     r"checkpoint_\d+_(\d+)\.pt")
    else:
        paths = [Path(x) for x in a.inputs]
    torch.save(average(paths), a.output)
    print(f"averaged {len(paths)} checkpoints ({', '.join(p.name for p in paths)}) -> {a.output}")


if __name__ == "__main__":
    main()
