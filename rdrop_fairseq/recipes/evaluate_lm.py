#!/usr/bin/env python
"""Perplexity of a language-model checkpoint with fairseq-eval-lm, as the paper reports it.

Two protocols (``--protocol``). fairseq-eval-lm scores blocks of ``--tokens-per-sample``
minus ``--context-window`` tokens, each fed to the model after up to ``--context-window``
tokens of the text before it (every token is scored once; model inputs of at most
``--tokens-per-sample`` tokens):

* ``authors`` (default): the authors' evaluate_lm_wiki103.sh, their one evaluation script
  for both models, which is fairseq's examples/language_model README command:
  ``fairseq-eval-lm --batch-size 2 --tokens-per-sample 512 --context-window 400``: the text
  is scored in blocks of 112 tokens, each after up to 400 tokens of context (the README
  explains the trade-off: ``--context-window 0`` scores independent 512-token blocks, a
  higher perplexity; 511 the most context, slowest). The protocol for transformer_lm_gpt,
  which sees at most 512 positions.
* ``adaptive``: the standard protocol of the adaptive-input model (transformer_lm_wiki103,
  trained on 3072-token blocks), as fairseq's examples/quant_noise README evaluates it:
  ``--sample-break-mode complete --max-tokens 3072 --tokens-per-sample 3072
  --context-window 2560 --softmax-batch 1024``: the text is scored in blocks of whole lines
  of at most 512 (3072 - 2560) tokens (a longer line is a block of its own), each after up
  to 2560 tokens of context (less before a line longer than 512 tokens: block and context
  fit in 3072). The published adaptive-input perplexities use it; scripts/wikitext103.sh
  reports it first for ARCH=adaptive, the authors' protocol beside it.

``--protocol`` takes one or more protocols, run one after the other (scripts/wikitext103.sh:
``--protocol adaptive authors`` for ARCH=adaptive). ``--tokens-per-sample``,
``--context-window``, ``--batch-size`` and ``--max-tokens`` override the values of every
protocol run.

    python -m rdrop_fairseq.recipes.evaluate_lm --data work/wikitext-103/bin \\
        --checkpoint checkpoints/wt103-gpt-rdrop/checkpoint_best.pt [--subset valid]
    python -m rdrop_fairseq.recipes.evaluate_lm --protocol adaptive --data ... --checkpoint ...
    # anything after -- is passed to fairseq-eval-lm, e.g. -- --softmax-batch 1024

Prints ``SUBSET: perplexity P, loss L bits/token (N nats), T tokens`` per protocol and exits
non-zero, saying why, when fairseq-eval-lm fails or its output holds no finite perplexity.
``--json PATH`` also writes the numbers: the first protocol's to PATH, each other's beside
it with the protocol's name before the suffix (``test_ppl.json``, ``test_ppl.authors.json``).
With DRY_RUN=1 (scripts/*.sh), prints the fairseq-eval-lm commands (``++ ...``) and runs
none. Environment variables: DATA, CHECKPOINT.
"""

import argparse
import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

from .common import PLUGIN, dry_run, fairseq_cli, need, parser_from_doc, show

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


def settings(a, protocol):
    """fairseq-eval-lm's settings for ``protocol``: its values, overridden by the options
    given (``None``: the protocol's)."""
    return {option: value if getattr(a, option, None) is None else getattr(a, option)
            for option, value in PROTOCOLS[protocol].items()}


def eval_lm_command(a, protocol=None):
    """The fairseq-eval-lm command of ``protocol`` (default: the first of ``a.protocol``)."""
    s = settings(a, protocol or a.protocol[0])
    cmd = [fairseq_cli("fairseq-eval-lm"), str(a.data),
           "--user-dir", str(PLUGIN), "--path", str(a.checkpoint),
           "--gen-subset", a.subset, "--tokens-per-sample", str(s["tokens_per_sample"]),
           "--context-window", str(s["context_window"]),
           "--num-workers", "0", "--log-format", "simple", "--no-progress-bar"]
    for option in ("batch_size", "max_tokens", "sample_break_mode", "softmax_batch"):
        if s[option] is not None:
            cmd += ["--" + option.replace("_", "-"), str(s[option])]
    if a.cpu:
        cmd.append("--cpu")
    if a.fp16:
        cmd.append("--fp16")
    return cmd + a.extra


def json_path(path, index, protocol):
    """Where ``--json PATH`` puts the result of the ``index``-th protocol run: PATH for the
    first (the headline), PATH with ``.PROTOCOL`` before the suffix for the others."""
    path = Path(path)
    return path if index == 0 else path.with_name(f"{path.stem}.{protocol}{path.suffix}")


class _Once(argparse.Action):
    """An option that may be given once: a second ``--protocol`` (e.g. among the extra
    arguments of scripts/wikitext103.sh evaluate, which names ARCH's protocols itself)
    would silently replace the protocols of every run."""

    def __call__(self, parser, namespace, values, option_string=None):
        if getattr(namespace, "_given_" + self.dest, False):
            parser.error(f"{option_string} given twice (scripts/wikitext103.sh evaluate "
                         "gives it already: ARCH=gpt authors, ARCH=adaptive adaptive then "
                         "authors); for other protocols run python -m "
                         "rdrop_fairseq.recipes.evaluate_lm --protocol ... yourself")
        setattr(namespace, "_given_" + self.dest, True)
        setattr(namespace, self.dest, values)


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
    p = parser_from_doc(__doc__)
    p.add_argument("--data", default=os.environ.get("DATA"), help="the data-bin")
    p.add_argument("--checkpoint", default=os.environ.get("CHECKPOINT"))
    p.add_argument("--subset", default="test", help="test (default) or valid")
    p.add_argument("--protocol", choices=sorted(PROTOCOLS), nargs="+", default=["authors"],
                   action=_Once, help="authors: 512/400 (default); adaptive: 3072/2560; "
                   "several: run one after the other")
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
    if len(set(a.protocol)) < len(a.protocol):
        p.error(f"--protocol {' '.join(a.protocol)} names a protocol twice")
    if not a.data or not a.checkpoint:
        p.error("--data and --checkpoint (or $DATA and $CHECKPOINT) are required")
    if not dry_run():  # a dry run prints the commands of inputs not made yet
        need(p, "--data", Path(a.data) / "dict.txt", "run: bash scripts/wikitext103.sh prepare")
        need(p, "--checkpoint", a.checkpoint, "train first: bash scripts/wikitext103.sh train")
    for protocol in a.protocol:
        s = settings(a, protocol)
        if not 0 <= s["context_window"] < s["tokens_per_sample"]:
            p.error(f"--context-window must be in [0, --tokens-per-sample): got "
                    f"{s['context_window']} with --tokens-per-sample "
                    f"{s['tokens_per_sample']} ({protocol} protocol)")
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
    commands = [eval_lm_command(a, protocol) for protocol in a.protocol]
    if dry_run():
        for cmd in commands:
            show(cmd)
        return
    for index, (protocol, cmd) in enumerate(zip(a.protocol, commands)):
        s = settings(a, protocol)
        print("[evaluate] " + " ".join(cmd), flush=True)
        result = read_result(*run(cmd))
        result.update(subset=a.subset, checkpoint=str(a.checkpoint), protocol=protocol,
                      tokens_per_sample=s["tokens_per_sample"],
                      context_window=s["context_window"],
                      loss_nats=result["loss_base2"] * math.log(2))
        tokens = f", {result['tokens']:,} tokens" if result["tokens"] is not None else ""
        print(f"{a.subset}: perplexity {result['perplexity']:.2f}, loss "
              f"{result['loss_base2']:.4f} bits/token ({result['loss_nats']:.4f} nats){tokens} "
              f"({protocol} protocol: tokens per sample {s['tokens_per_sample']}, context "
              f"window {s['context_window']})",
              flush=True)
        if a.json:
            json_path(a.json, index, protocol).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
