#!/usr/bin/env python
"""BLEU as the R-Drop paper reports it, from fairseq-generate output or plain files.

* ``--tokenized``: corpus BLEU on the tokenised text as it is, case-sensitive, no smoothing
  (a zero n-gram precision gives 0): what multi-bleu.perl computes. The paper uses it for
  IWSLT14 En<->De and WMT14. ``--compound-split`` adds the WMT En->De convention of
  splitting hyphenated compounds (``a-b`` -> ``a ##AT##-##AT## b``, as fairseq's
  ``compound_split_bleu.sh``) on both sides first.
* default: sacreBLEU on detokenised text, printed with its signature (the other IWSLT
  directions).

    python -m rdrop_fairseq.recipes.score_bleu --generate-output gen.out \\
        --tokenized [--compound-split]
    python -m rdrop_fairseq.recipes.score_bleu --hyp hyp.detok.txt --ref ref.txt
"""

import re
import sys

import sacrebleu

from .common import parser_from_doc

_COMPOUND = re.compile(r"(\S)-(\S)")


def compound_split(line):
    """fairseq's ``perl -ple 's{(\\S)-(\\S)}{$1 ##AT##-##AT## $2}g'``."""
    return _COMPOUND.sub(r"\1 ##AT##-##AT## \2", line)


def tokenized_bleu(hyps, refs, compound=False):
    """multi-bleu.perl-equivalent corpus BLEU of already tokenised lines."""
    if compound:
        hyps, refs = [compound_split(h) for h in hyps], [compound_split(r) for r in refs]
    return sacrebleu.corpus_bleu(hyps, [refs], tokenize="none", smooth_method="none",
                                 force=True)


def read_generate_output(path):
    """Hypotheses and references (``H-``/``T-`` lines) of fairseq-generate, in input order."""
    hyps, refs = {}, {}
    with open(path, encoding="utf-8") as f:
        for line in f:
            if line.startswith(("H-", "T-")):
                fields = line.rstrip("\n").split("\t")
                idx = int(fields[0][2:])
                (hyps if line[0] == "H" else refs)[idx] = fields[-1] if len(fields) > 1 else ""
    if not hyps or hyps.keys() != refs.keys():
        sys.exit(f"error: {path}: no matching H-/T- lines (run fairseq-generate without --quiet)")
    order = sorted(hyps)
    return [hyps[i] for i in order], [refs[i] for i in order]


def main():
    p = parser_from_doc(__doc__)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--generate-output", help="fairseq-generate's stdout")
    src.add_argument("--hyp", help="hypotheses, one per line (with --ref)")
    p.add_argument("--ref", help="references, one per line")
    p.add_argument("--tokenized", action="store_true", help="multi-bleu.perl-equivalent BLEU")
    p.add_argument("--compound-split", action="store_true", help="WMT En->De compound split")
    a = p.parse_args()
    if a.generate_output:
        hyps, refs = read_generate_output(a.generate_output)
    else:
        if not a.ref:
            p.error("--hyp needs --ref")
        with open(a.hyp, encoding="utf-8") as h, open(a.ref, encoding="utf-8") as r:
            hyps, refs = h.read().splitlines(), r.read().splitlines()
        if len(hyps) != len(refs):
            sys.exit(f"error: {len(hyps)} hypotheses but {len(refs)} references")
    if a.compound_split and not a.tokenized:
        p.error("--compound-split applies to --tokenized BLEU")
    if a.tokenized:
        score = tokenized_bleu(hyps, refs, compound=a.compound_split)
        kind = "tokenized BLEU (multi-bleu.perl)" + (" with compound splitting" * a.compound_split)
        print(f"{kind} = {score.score:.2f}, {'/'.join(f'{p:.1f}' for p in score.precisions)} "
              f"(BP={score.bp:.3f}, ratio={score.sys_len / score.ref_len:.3f}, "
              f"hyp_len={score.sys_len}, ref_len={score.ref_len})")
    else:
        bleu = sacrebleu.metrics.BLEU()
        score = bleu.corpus_score(hyps, [refs])
        print(f"sacreBLEU = {score.score:.2f}  {bleu.get_signature()}")


if __name__ == "__main__":
    main()
