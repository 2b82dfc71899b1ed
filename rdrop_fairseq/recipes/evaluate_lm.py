#!/usr/bin/env python
"""Perplexity of a language-model checkpoint with fairseq-eval-lm, as the paper reports it.

Two protocols (``--protocol``):

* ``authors`` (default): the authors' evaluate_lm_wiki103.sh, their one evaluation script
  for both models, which is fairseq's examples/language_model README command:
  ``fairseq-eval-lm --batch-size 2 --tokens-per-sample 512 --context-window 400``: the text
  is scored in blocks of 112 tokens, each token seeing at least 400 tokens of context (the
  README explains the trade-off: ``--context-window 0`` scores independent 512-token blocks,
  a higher perplexity; 511 the most context, slowest). The protocol for transformer_lm_gpt,
  which sees at most 512 positions.
* ``adaptive``: the standard protocol of the adaptive-input model (transformer_lm_wiki103,
  trained on 3072-token blocks), as fairseq's examples/quant_noise README evaluates it:
  ``--sample-break-mode complete --max-tokens 3072 --tokens-per-sample 3072
  --context-window 2560 --softmax-batch 1024``: blocks of whole lines up to 3072 tokens,
  each scored token seeing up to 2560 tokens of context. The published adaptive-input
  perplexities use it; scripts/wikitext103.sh reports it first for ARCH=adaptive, the
  authors' protocol beside it.

``--tokens-per-sample``, ``--context-window``, ``--batch-size`` and ``--max-tokens``
override the protocol's values.

    python -m rdrop_fairseq.recipes.evaluate_lm --data work/wikitext-103/bin \\
        --checkpoint checkpoints/wt103-gpt-rdrop/checkpoint_best.pt [--subset valid]
    python -m rdrop_fairseq.recipes.evaluate_lm --protocol adaptive --data ... --checkpoint ...
    # anything after -- is passed to fairseq-eval-lm, e.g. -- --softmax-batch 1024

Prints ``SUBSET: perplexity P, loss L bits/token (N nats), T tokens`` and exits non-zero,
saying why, when fairseq-eval-lm fails or its output holds no finite perplexity.
``--json PATH`` also writes the numbers. Environment variables: DATA, CHECKPOINT.
"""

import argparse
import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

from .common import ArgumentParser, PLUGIN, fairseq_cli

# fairseq-eval-lm's settings per protocol; None: not passed
PROTOCOLS = {
    "authors": {"tokens_per_sample": 512, "context_window": 400, "batch_size": 2,
                "max_tokens": None, "sample_break_mode": None, "softmax_batch": None},
    "adaptive": {"tokens_per_sample": 3072, "context_window": 2560, "batch_size": None,
                 "max_tokens": 3072, "sample_break_mode": "complete", "softmax_batch": 1024},
}

_NUMBER = r"(-?(?:[\d.]+|nan|inf))"
_SUMMARY = re.compile(r"Loss \(base 2\): " + _NUMBER + r", Perplexity: " + _NUMBER)
_TOKENS = re.compile(r"Evaluated ([\d,]+) tokens in")


class EvalOutputError(ValueError):
    pass


def parse_output(text):
    """``{"loss_base2", "perplexity", "tokens"}`` from fairseq-eval-lm's log (the last
    summary line); ``EvalOutputError`` when there is none."""
    summaries = _SUMMARY.findall(text)
    if not summaries:
        raise EvalOutputError("fairseq-eval-lm printed no 'Loss (base 2): ..., Perplexity: ...' "
                              "line")
    loss, ppl = (float(x) for x in summaries[-1])
    tokens = _TOKENS.findall(text)
    return {"loss_base2": loss, "perplexity": ppl,
            "tokens": int(tokens[-1].replace(",", "")) if tokens else None}


def eval_lm_command(a):
    cmd = [fairseq_cli("fairseq-eval-lm"), str(a.data),
           "--user-dir", str(PLUGIN), "--path", str(a.checkpoint),
           "--gen-subset", a.subset, "--tokens-per-sample", str(a.tokens_per_sample),
           "--context-window", str(a.context_window),
           "--num-workers", "0", "--log-format", "simple", "--no-progress-bar"]
    for option in ("batch_size", "max_tokens", "sample_break_mode", "softmax_batch"):
        if getattr(a, option) is not None:
            cmd += ["--" + option.replace("_", "-"), str(getattr(a, option))]
    if a.cpu:
        cmd.append("--cpu")
    if a.fp16:
        cmd.append("--fp16")
    return cmd + a.extra


def run(cmd):
    """Run ``cmd``, echoing its output, and return ``(exit code, output)``."""
    lines = []
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          errors="replace") as proc:
        for line in proc.stdout:
            sys.stdout.write(line)
            lines.append(line)
    sys.stdout.flush()
    return proc.returncode, "".join(lines)


def parse_args(argv):
    p = ArgumentParser(description=__doc__.split("\n\n")[0],
                       formatter_class=argparse.RawDescriptionHelpFormatter,
                       epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--data", default=os.environ.get("DATA"), help="the data-bin")
    p.add_argument("--checkpoint", default=os.environ.get("CHECKPOINT"))
    p.add_argument("--subset", default="test", help="test (default) or valid")
    p.add_argument("--protocol", choices=sorted(PROTOCOLS), default="authors",
                   help="authors: 512/400 (default); adaptive: 3072/2560")
    p.add_argument("--tokens-per-sample", type=int, help="default: the protocol's")
    p.add_argument("--context-window", type=int, help="default: the protocol's")
    p.add_argument("--batch-size", type=int, help="default: the protocol's")
    p.add_argument("--max-tokens", type=int, help="default: the protocol's")
    p.add_argument("--cpu", action="store_true")
    p.add_argument("--fp16", action="store_true")
    p.add_argument("--json", help="also write the results to this file")
    extra = []
    if "--" in argv:
        argv, extra = argv[:argv.index("--")], argv[argv.index("--") + 1:]
    a = p.parse_args(argv)
    a.extra = extra
    a.sample_break_mode = a.softmax_batch = None
    for option, value in PROTOCOLS[a.protocol].items():
        if getattr(a, option) is None:
            setattr(a, option, value)
    if not a.data or not a.checkpoint:
        p.error("--data and --checkpoint (or $DATA and $CHECKPOINT) are required")
    if not (Path(a.data) / "dict.txt").is_file():
        p.error(f"{a.data} is not a language-model data-bin (no dict.txt)")
    if not Path(a.checkpoint).is_file():
        p.error(f"no checkpoint {a.checkpoint}")
    if not 0 <= a.context_window < a.tokens_per_sample:
        p.error(f"--context-window must be in [0, --tokens-per-sample): got "
                f"{a.context_window} with --tokens-per-sample {a.tokens_per_sample}")
    return a


def read_result(code, output):
    """The numbers of a fairseq-eval-lm run (exit ``code``, ``output``), or ``SystemExit``
    saying why there are none."""
    if code != 0:
        raise SystemExit(f"error: fairseq-eval-lm failed (exit code {code}); its output is "
                         "above")
    try:
        result = parse_output(output)
    except EvalOutputError as e:
        raise SystemExit(f"error: cannot read the perplexity: {e}; its output is above")
    if not (math.isfinite(result["perplexity"]) and math.isfinite(result["loss_base2"])):
        raise SystemExit(f"error: fairseq-eval-lm reported a non-finite perplexity "
                         f"({result['perplexity']}, loss {result['loss_base2']} bits)")
    return result


def main(argv=None):
    a = parse_args(sys.argv[1:] if argv is None else argv)
    cmd = eval_lm_command(a)
    print("[evaluate] " + " ".join(cmd), flush=True)
    result = read_result(*run(cmd))
    result.update(subset=a.subset, checkpoint=str(a.checkpoint), protocol=a.protocol,
                  tokens_per_sample=a.tokens_per_sample, context_window=a.context_window,
                  loss_nats=result["loss_base2"] * math.log(2))
    tokens = f", {result['tokens']:,} tokens" if result["tokens"] is not None else ""
    print(f"{a.subset}: perplexity {result['perplexity']:.2f}, loss "
          f"{result['loss_base2']:.4f} bits/token ({result['loss_nats']:.4f} nats){tokens} "
          f"({a.protocol} protocol: tokens per sample {a.tokens_per_sample}, context window "
          f"{a.context_window})",
          flush=True)
    if a.json:
        Path(a.json).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
