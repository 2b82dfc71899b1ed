#!/usr/bin/env python
"""Translate the test set with fairseq-generate and score it as the paper does.

Decoding: beam 4 / lenpen 0.6 for WMT14 En->De, beam 5 / lenpen 1.0 for the rest (the
paper). BLEU: tokenized BLEU (multi-bleu.perl equivalent) for En<->De and WMT14, with
compound splitting for En<->De as fairseq's scripts/compound_split_bleu.sh, which the
authors' IWSLT14 De->En inference script (run_inference.sh) and their WMT14 advice
(dropreg/R-Drop issue #19) score with; sacreBLEU for the other IWSLT pairs: the output
detokenised with sacremoses against ``--ref``, the original references (default:
``RAW/test.TGT`` beside the data-bin, as prepare_iwslt.py keeps them), case-sensitive
unless the data was prepared lower-cased (prepare_translation.py records that in the
data-bin's prepared.json; ``--lowercase`` for data without the record), signature printed.
Data prepared with sentencepiece (``spm*.model`` in the data-bin, e.g. En<->Zh) is decoded
with ``--remove-bpe sentencepiece``, which gives detokenised text, scored with sacreBLEU (its
``zh`` tokenisation for Chinese references).

    python -m rdrop_fairseq.recipes.evaluate_translation iwslt --data work/iwslt14.de-en/bin \\
        --src de --tgt en --checkpoint checkpoints/iwslt14-rdrop/checkpoint_best.pt
    # the average of the last 10 epoch checkpoints first (fairseq's Scaling NMT recipe)
    python -m rdrop_fairseq.recipes.average_checkpoints --inputs SAVE_DIR \\
        --num-epoch-checkpoints 10 --output SAVE_DIR/checkpoint.avg10.pt

scripts/iwslt14.sh and scripts/wmt14.sh run these in their evaluate stage.

Writes ``OUT`` (default: next to the checkpoint, ``generate-SUBSET.txt``) and prints the
paper's score first, then the other BLEUs of the same output beside it, for comparison
(tokenized BLEU with and without compound splitting, sacreBLEU). With DRY_RUN=1
(scripts/*.sh), prints the fairseq-generate command (``++ ...``) and runs nothing.
Environment variables: DATA, CHECKPOINT, SRC, TGT.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

from sacremoses import MosesDetokenizer

import sacrebleu

from .common import PLUGIN, dry_run, fairseq_cli, need, parser_from_doc, show
from .prepare_translation import PREPARED
from .score_bleu import read_generate_output, tokenized_bleu

RECIPES = ("iwslt", "wmt14")


def decoding_for(recipe, tgt):
    """The paper's beam and length penalty: beam 4 / lenpen 0.6 for WMT14 En->De only."""
    if recipe == "wmt14" and tgt == "de":
        return {"beam": 4, "lenpen": 0.6}
    return {"beam": 5, "lenpen": 1.0}


def recipe_script(recipe, src, tgt):
    """The recipe script (and its variables) that makes this data-bin and checkpoint."""
    if recipe == "wmt14":
        return ("" if (src, tgt) == ("en", "de") else f"PAIR={src}-{tgt} ") + "bash scripts/wmt14.sh"
    return ("" if (src, tgt) == ("de", "en") else f"SRC={src} TGT={tgt} ") + "bash scripts/iwslt14.sh"


def metric_for(recipe, src, tgt, data=None):
    """The paper's BLEU for a recipe and language pair."""
    if data is not None and uses_sentencepiece(data):
        return "sacrebleu"  # no Moses tokens to score
    if {src, tgt} == {"de", "en"}:  # compound_split_bleu.sh, as the authors score
        return "tokenized+compound"
    return "tokenized" if recipe == "wmt14" else "sacrebleu"


def uses_sentencepiece(data):
    """Whether prepare_translation.py built ``data`` with sentencepiece."""
    return any(Path(data).glob("spm*.model"))


def prepared_lowercase(data):
    """Whether prepare_translation.py lower-cased ``data`` (its prepared.json); False when
    there is no such record (other data-bins, or made before it was written)."""
    path = Path(data) / PREPARED
    return path.is_file() and json.loads(path.read_text()).get("lowercase") is True


def score(metric, hyps, refs, tgt, moses_tokens=True, original_refs=None, lowercase=False):
    """``(score line, BLEU)``. sacreBLEU detokenises Moses-tokenised hypotheses and scores
    them against ``original_refs`` (the untouched references) when given, else against the
    data-bin's references detokenised the same way."""
    if metric.startswith("tokenized"):
        if not moses_tokens:
            sys.exit("error: tokenized BLEU needs Moses-tokenised data; this data-bin was "
                     "built with sentencepiece: use --metric sacrebleu")
        result = tokenized_bleu(hyps, refs, compound=metric.endswith("compound"))
        return f"tokenized BLEU ({metric}) = {result.score:.2f}", result.score
    if moses_tokens:
        detok = MosesDetokenizer(lang=tgt)
        hyps = [detok.detokenize(h.split()) for h in hyps]
        refs = [detok.detokenize(r.split()) for r in refs]
    if original_refs is not None:
        if len(original_refs) != len(hyps):
            sys.exit(f"error: {len(original_refs)} original references for {len(hyps)} "
                     "translations: --ref must be the test set's target side")
        refs = original_refs
    bleu = sacrebleu.metrics.BLEU(trg_lang=tgt, lowercase=lowercase)
    result = bleu.corpus_score(hyps, [refs])
    against = "original references" if original_refs is not None else "data-bin references"
    return (f"sacreBLEU = {result.score:.2f}  {bleu.get_signature()} ({against})",
            result.score)


def generate_command(data, checkpoint, src, tgt, subset, beam, lenpen, batch_size, cpu):
    cmd = [fairseq_cli("fairseq-generate"), str(data),
           "--user-dir", str(PLUGIN), "--path", str(checkpoint),
           "--source-lang", src, "--target-lang", tgt, "--gen-subset", subset,
           "--beam", str(beam), "--lenpen", str(lenpen),
           "--remove-bpe=" + ("sentencepiece" if uses_sentencepiece(data) else "@@ "),
           "--batch-size", str(batch_size), "--required-batch-size-multiple", "1"]
    return cmd + ["--cpu"] * bool(cpu)


def generate_and_score(data, checkpoint, out, src="de", tgt="en", subset="test", beam=5,
                       lenpen=1.0, metric="tokenized", batch_size=128, cpu=False, quiet=False,
                       original_refs=None, lowercase=False, extra_args=()):
    """fairseq-generate (with ``extra_args``) into ``out``, then ``(score line, BLEU,
    sentence count)``."""
    cmd = [*generate_command(data, checkpoint, src, tgt, subset, beam, lenpen, batch_size,
                             cpu), *extra_args]
    if not quiet:
        print(f"[evaluate] beam {beam}, lenpen {lenpen}, {metric}: {' '.join(cmd)}", flush=True)
    with open(out, "w", encoding="utf-8") as f:
        subprocess.run(cmd, stdout=f, stderr=subprocess.DEVNULL if quiet else None, check=True)
    hyps, refs = read_generate_output(out)
    line, bleu = score(metric, hyps, refs, tgt, moses_tokens=not uses_sentencepiece(data),
                       original_refs=original_refs, lowercase=lowercase)
    return line, bleu, len(hyps)


def original_references(data, subset, tgt, ref=None):
    """The lines of ``ref``, or of RAW/SUBSET.TGT beside the data-bin (prepare_iwslt.py's
    untouched references) if it is there; None otherwise."""
    path = Path(ref) if ref else Path(data).parent / "raw" / f"{subset}.{tgt}"
    if not path.is_file():
        if ref:
            sys.exit(f"error: --ref {ref} not found")
        return None
    return path.read_text(encoding="utf-8").splitlines()


def main(argv=None):
    p = parser_from_doc(__doc__)
    p.add_argument("recipe", choices=RECIPES)
    p.add_argument("--data", default=os.environ.get("DATA"), required="DATA" not in os.environ)
    p.add_argument("--checkpoint", default=os.environ.get("CHECKPOINT"),
                   required="CHECKPOINT" not in os.environ)
    p.add_argument("--src", default=os.environ.get("SRC", "de"))
    p.add_argument("--tgt", default=os.environ.get("TGT", "en"))
    p.add_argument("--subset", default="test")
    p.add_argument("--beam", type=int)
    p.add_argument("--lenpen", type=float)
    p.add_argument("--metric", choices=["tokenized", "tokenized+compound", "sacrebleu"])
    p.add_argument("--ref", help="sacreBLEU: the original references of SUBSET (default: "
                                 "RAW/SUBSET.TGT beside the data-bin, if there)")
    p.add_argument("--lowercase", action="store_true",
                   help="sacreBLEU case-insensitive (the default for data that "
                        "prepare_translation.py lower-cased: its prepared.json says so)")
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--cpu", action="store_true")
    p.add_argument("--out", help="where to write fairseq-generate's output")
    a = p.parse_args(argv)
    checkpoint = Path(a.checkpoint)
    if not dry_run():  # a dry run prints the commands of inputs not made yet
        script = recipe_script(a.recipe, a.src, a.tgt)
        need(p, "--data", Path(a.data) / f"dict.{a.src}.txt", f"run: {script} prepare")
        need(p, "--checkpoint", checkpoint, f"train first: {script} train")
    decoding = decoding_for(a.recipe, a.tgt)
    beam = a.beam or decoding["beam"]
    lenpen = a.lenpen if a.lenpen is not None else decoding["lenpen"]
    if dry_run():
        show(generate_command(a.data, checkpoint, a.src, a.tgt, a.subset, beam, lenpen,
                              a.batch_size, a.cpu))
        return
    metric = a.metric or metric_for(a.recipe, a.src, a.tgt, a.data)
    out = Path(a.out) if a.out else checkpoint.with_name(f"generate-{a.subset}.txt")
    refs = original_references(a.data, a.subset, a.tgt, a.ref)
    lowercase = a.lowercase or prepared_lowercase(a.data)
    line, _, count = generate_and_score(a.data, checkpoint, out, a.src, a.tgt, a.subset, beam,
                                        lenpen, metric, a.batch_size, a.cpu,
                                        original_refs=refs, lowercase=lowercase)
    print(f"{a.subset}: {count} sentences, {line}")
    if not uses_sentencepiece(a.data):  # the other BLEUs of the same output, for comparison
        hyps, tokenized_refs = read_generate_output(out)
        for other in ("tokenized", "tokenized+compound", "sacrebleu"):
            if other != metric:
                print("  beside it: " + score(other, hyps, tokenized_refs, a.tgt,
                                              original_refs=refs, lowercase=lowercase)[0])
    print(f"(output: {out})")


if __name__ == "__main__":
    main()
