#!/usr/bin/env python
"""Write a small generated parallel corpus (train/valid/test .src/.tgt) for smoke runs.

The "translation" is deterministic but not trivial: each source word maps to its own
target word, and adjacent word pairs are swapped, so a model must learn a lexicon and a
local reordering. Used by the quick demo and the end-to-end tests; not a benchmark.

    python -m experiments.toy_data OUT_DIR [--train 3000 --valid 200 --test 200 --seed 1]
"""

import random
from pathlib import Path

from rdrop_fairseq.recipes.common import parser_from_doc


def translate(words):
    mapped = [w.replace("w", "T") for w in words]
    for i in range(0, len(mapped) - 1, 2):
        mapped[i], mapped[i + 1] = mapped[i + 1], mapped[i]
    return mapped


def write_corpus(out_dir, sizes, vocab=60, min_len=3, max_len=12, seed=1, src="de", tgt="en"):
    """Write ``{split}.{src}`` / ``{split}.{tgt}`` for each ``split: size`` in ``sizes``."""
    rng = random.Random(seed)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    words = [f"w{i}" for i in range(vocab)]
    for split, n in sizes.items():
        src_lines, tgt_lines = [], []
        for _ in range(n):
            sentence = [rng.choice(words) for _ in range(rng.randint(min_len, max_len))]
            src_lines.append(" ".join(sentence))
            tgt_lines.append(" ".join(translate(sentence)))
        (out / f"{split}.{src}").write_text("\n".join(src_lines) + "\n")
        (out / f"{split}.{tgt}").write_text("\n".join(tgt_lines) + "\n")
    return out


def main():
    p = parser_from_doc(__doc__)
    p.add_argument("out_dir")
    p.add_argument("--train", type=int, default=3000)
    p.add_argument("--valid", type=int, default=200)
    p.add_argument("--test", type=int, default=200)
    p.add_argument("--vocab", type=int, default=60)
    p.add_argument("--seed", type=int, default=1)
    a = p.parse_args()
    write_corpus(a.out_dir, {"train": a.train, "valid": a.valid, "test": a.test},
                 vocab=a.vocab, seed=a.seed)


if __name__ == "__main__":
    main()
