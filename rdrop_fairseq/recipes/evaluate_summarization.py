#!/usr/bin/env python
"""Summarise the CNN/DM test articles with a fine-tuned BART and score ROUGE-1/2/L.

Decoding as the paper and fairseq's examples/bart: beam 4, length penalty 2.0, max_len_b 140,
min_len 55, no repeated trigrams, through fairseq's BART hub interface
(``BARTModel.from_pretrained``) with the local GPT-2 BPE files. ROUGE follows the protocol
of files2rouge (the authors' tool, a wrapper around the Perl ROUGE-1.5.5) on tokenised text
(fairseq's BART README), with the ``rouge-score`` package: F-measure averaged over the
documents, times 100, with Porter stemming (files2rouge stems by default: ROUGE-1.5.5's
``-m`` besides its ``-c 95 -r 1000 -n 2 -a``; ``--no-stemmer`` scores without);
hypotheses and references Moses-tokenised (sacremoses, for the Stanford PTB tokenizer) and
split into sentences at " . " as files2rouge does, one a line, so that ROUGE-L is
ROUGE-1.5.5's summary-level ROUGE-L (``rougeLsum``). docs/summarization.md lists what still
differs.

    python -m rdrop_fairseq.recipes.evaluate_summarization --data work/cnn_dm/bin --raw cnn_dm \\
        --checkpoint checkpoints/cnndm-rdrop/checkpoint_best.pt \\
        --encoder-json gpt2_bpe/encoder.json --vocab-bpe gpt2_bpe/vocab.bpe \\
        [--json rouge.json] [--fp16]
    # score hypotheses written before (no model needed):
    python -m rdrop_fairseq.recipes.evaluate_summarization --score-only --out test.hypo \\
        --target cnn_dm/test.target

Writes the hypotheses (default: next to the checkpoint, CHECKPOINT_STEM.test.hypo), one a
line, and prints the scores. Environment variables: DATA, RAW, CHECKPOINT, GPT2_ENCODER_JSON,
GPT2_VOCAB_BPE.
"""

import argparse
import json
import os
import sys
from pathlib import Path

from .common import PLUGIN, need, parser_from_doc

DECODING = {"beam": 4, "lenpen": 2.0, "max_len_b": 140, "min_len": 55,
            "no_repeat_ngram_size": 3}
ROUGE_KEYS = ("rouge1", "rouge2", "rougeLsum", "rougeL")


def read_lines(path):
    # newline="\n": a line ends at "\n" only, as prepare_cnndm.py counts them
    with open(path, encoding="utf-8", newline="\n") as f:
        return [line.rstrip("\r\n") for line in f]


def split_sentences(text, tokenizer):
    """One sentence a line, for rougeLsum, as files2rouge splits PTB-tokenised text: the
    text tokenised (Moses here: a sentence-final period becomes a token of its own, ``U.S.``
    stays one), then split at every " . " (files2rouge's ``--eos``)."""
    tokens = tokenizer.tokenize(text.strip(), escape=False, return_str=True)
    return " .\n".join(tokens.split(" . "))


def rouge(hypotheses, references, stem=True):
    """Mean F-measure x 100 of rouge1, rouge2, rougeLsum (summary-level ROUGE-L) and rougeL
    (ROUGE-L over the whole text as one sequence), as rouge-score computes them; Porter
    stemming with ``stem`` (files2rouge's default)."""
    from rouge_score import rouge_scorer
    from sacremoses import MosesTokenizer

    if len(hypotheses) != len(references):
        raise ValueError(f"{len(hypotheses)} hypotheses but {len(references)} references")
    if not references:
        raise ValueError("nothing to score")
    scorer = rouge_scorer.RougeScorer(list(ROUGE_KEYS), use_stemmer=stem)
    tokenizer = MosesTokenizer(lang="en")
    totals = dict.fromkeys(ROUGE_KEYS, 0.0)
    for hyp, ref in zip(hypotheses, references):
        scores = scorer.score(target=split_sentences(ref, tokenizer),
                              prediction=split_sentences(hyp, tokenizer))
        for key in ROUGE_KEYS:
            totals[key] += scores[key].fmeasure
    return {key: 100 * total / len(references) for key, total in totals.items()}


def load_bart(checkpoint, data, encoder_json, vocab_bpe, cpu=False, fp16=False,
              batch_size=32):
    """The fine-tuned checkpoint through fairseq's BART hub interface, on the GPU if any."""
    import torch
    from omegaconf import open_dict

    # the plugin lets torch >= 2.6 load fairseq checkpoints; fairseq_fixes lets fairseq 0.12
    # load one into a BART built from a hydra config (as the recipe's fine-tuned model is)
    # and makes no_repeat_ngram_size work where the installed fairseq ignores it
    import rdrop_fairseq.fairseq_fixes  # noqa: F401
    from fairseq.models.bart import BARTModel

    checkpoint = Path(checkpoint).resolve()
    bart = BARTModel.from_pretrained(
        str(checkpoint.parent), checkpoint_file=checkpoint.name,
        data_name_or_path=str(Path(data).resolve()), bpe="gpt2",
        gpt2_encoder_json=str(Path(encoder_json).resolve()),
        gpt2_vocab_bpe=str(Path(vocab_bpe).resolve()),
        user_dir=str(PLUGIN))
    # batch by articles: the training max_tokens (1024) would split a batch of long
    # articles into one-article batches
    with open_dict(bart.cfg.dataset):
        bart.cfg.dataset.max_tokens = None
        bart.cfg.dataset.batch_size = batch_size
    bart.eval()
    if torch.cuda.is_available() and not cpu:
        bart.cuda()
        if fp16:
            bart.half()
    return bart


def summarize(bart, sources, out, batch_size=32, decoding=None):
    """Summaries of ``sources`` in batches, written to ``out`` one a line as they come,
    with a progress bar over the articles."""
    import torch
    from tqdm import tqdm

    decoding = {**DECODING, **(decoding or {})}
    hypotheses = []
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out, "w", encoding="utf-8") as f, \
            tqdm(total=len(sources), unit="article", desc="summarizing", file=sys.stderr,
                 dynamic_ncols=True) as bar:
        for start in range(0, len(sources), batch_size):
            batch = [s.strip() for s in sources[start:start + batch_size]]
            with torch.no_grad():
                batch_hyps = bart.sample(batch, **decoding)
            for hyp in batch_hyps:
                hyp = " ".join(hyp.split())  # one line each, whatever the model emits
                hypotheses.append(hyp)
                f.write(hyp + "\n")
            f.flush()
            bar.update(len(batch))
    return hypotheses


def build_parser():
    env = os.environ.get
    p = parser_from_doc(__doc__)
    p.add_argument("--checkpoint", default=env("CHECKPOINT"),
                   help="the fine-tuned checkpoint (e.g. SAVE_DIR/checkpoint_best.pt)")
    p.add_argument("--data", default=env("DATA"),
                   help="the data-bin it was trained on (for dict.source.txt)")
    p.add_argument("--raw", default=env("RAW"),
                   help="CNN/DM directory: --source/--target default to RAW/SPLIT.source/.target")
    p.add_argument("--split", default="test")
    p.add_argument("--source", help="articles, one a line")
    p.add_argument("--target", help="reference summaries, one a line")
    p.add_argument("--encoder-json", default=env("GPT2_ENCODER_JSON"),
                   help="local GPT-2 encoder.json")
    p.add_argument("--vocab-bpe", default=env("GPT2_VOCAB_BPE"), help="local GPT-2 vocab.bpe")
    p.add_argument("--out", help="hypotheses file (default: CHECKPOINT_STEM.SPLIT.hypo next "
                                 "to the checkpoint)")
    p.add_argument("--json", help="also write the scores to this JSON file")
    p.add_argument("--score-only", action="store_true",
                   help="score the hypotheses in --out against --target; generate nothing")
    p.add_argument("--stemmer", action=argparse.BooleanOptionalAction, default=True,
                   help="ROUGE with Porter stemming (ROUGE-1.5.5's -m), files2rouge's "
                        "default; --no-stemmer scores without (see docs/summarization.md)")
    p.add_argument("--batch-size", type=int, default=32, help="articles per batch")
    p.add_argument("--beam", type=int, default=DECODING["beam"])
    p.add_argument("--lenpen", type=float, default=DECODING["lenpen"])
    p.add_argument("--max-len-b", type=int, default=DECODING["max_len_b"])
    p.add_argument("--min-len", type=int, default=DECODING["min_len"])
    p.add_argument("--no-repeat-ngram-size", type=int, default=DECODING["no_repeat_ngram_size"])
    p.add_argument("--cpu", action="store_true", help="decode on the CPU even with a GPU")
    p.add_argument("--fp16", action="store_true", help="half precision on the GPU (as the "
                                                       "authors' inference script)")
    return p


def parse_args(argv=None):
    """The command line, with --source/--target from --raw and --out's default filled in;
    a missing option or input file is refused with what to run or pass."""
    p = build_parser()
    a = p.parse_args(argv)
    if a.raw:
        a.source = a.source or str(Path(a.raw) / f"{a.split}.source")
        a.target = a.target or str(Path(a.raw) / f"{a.split}.target")
    if not a.target:
        p.error("--target or --raw (or $RAW) is required: the reference summaries")
    script = "bash scripts/cnndm_bart.sh"
    text = "the CNN/DM text, {train,val,test}.{source,target} (docs/summarization.md)"
    needed = [("--target", a.target, text)]
    if a.score_only:
        if not a.out:
            p.error("--score-only needs --out, the hypotheses to score")
        needed.append(("--out", a.out, "the hypotheses to score, one a line"))
    else:
        for opt in ("checkpoint", "data", "source", "encoder_json", "vocab_bpe"):
            if not getattr(a, opt):
                name = "--" + opt.replace("_", "-")
                env_name = {"encoder_json": "GPT2_ENCODER_JSON",
                            "vocab_bpe": "GPT2_VOCAB_BPE"}.get(opt, opt.upper())
                p.error(f"{name} (or ${env_name}) is required"
                        + (" (or --raw)" if opt == "source" else ""))
        needed += [("--data", Path(a.data) / "dict.source.txt", f"run: {script} prepare"),
                   ("--checkpoint", a.checkpoint, f"train first: {script} train"),
                   ("--source", a.source, text),
                   ("--encoder-json", a.encoder_json, "GPT-2's (docs/summarization.md)"),
                   ("--vocab-bpe", a.vocab_bpe, "GPT-2's (docs/summarization.md)")]
        if not a.out:
            checkpoint = Path(a.checkpoint)
            a.out = str(checkpoint.with_name(f"{checkpoint.stem}.{a.split}.hypo"))
    for flag, path, advice in needed:
        need(p, flag, path, advice)
    return a


def main(argv=None):
    a = parse_args(argv)
    references = read_lines(a.target)
    out = Path(a.out)
    decoding = {"beam": a.beam, "lenpen": a.lenpen, "max_len_b": a.max_len_b,
                "min_len": a.min_len, "no_repeat_ngram_size": a.no_repeat_ngram_size}
    if a.score_only:
        hypotheses = read_lines(out)
    else:
        sources = read_lines(a.source)
        if len(sources) != len(references):
            sys.exit(f"error: {a.source} has {len(sources)} articles but {a.target} has "
                     f"{len(references)} summaries")
        print(f"[evaluate] {len(sources)} articles, "
              + ", ".join(f"{k} {v}" for k, v in decoding.items()), flush=True)
        bart = load_bart(a.checkpoint, a.data, a.encoder_json, a.vocab_bpe, a.cpu, a.fp16,
                         a.batch_size)
        hypotheses = summarize(bart, sources, out, a.batch_size, decoding)
    if len(hypotheses) != len(references):
        sys.exit(f"error: {out} has {len(hypotheses)} summaries but {a.target} has "
                 f"{len(references)}")
    scores = rouge(hypotheses, references, stem=a.stemmer)
    stemming = "stemmed" if a.stemmer else "not stemmed"
    print(f"{a.split}: {len(hypotheses)} summaries, ROUGE-1 {scores['rouge1']:.2f}, "
          f"ROUGE-2 {scores['rouge2']:.2f}, ROUGE-L {scores['rougeLsum']:.2f} "
          f"(rouge-score F1 x 100, {stemming}; ROUGE-L = summary-level rougeLsum; "
          f"sentence-level rougeL {scores['rougeL']:.2f})\n(hypotheses: {out})", flush=True)
    if a.json:
        result = {**{k: round(v, 4) for k, v in scores.items()}, "stemmed": a.stemmer,
                  "summaries": len(hypotheses), "hypotheses": str(out),
                  "references": str(a.target)}
        if not a.score_only:
            result.update(checkpoint=str(a.checkpoint), decoding=decoding)
        Path(a.json).write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
