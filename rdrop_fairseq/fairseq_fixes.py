"""Two fairseq 0.12 bugs that the summarization recipe runs into, fixed at import.

1. **BART built from a hydra config cannot load a checkpoint.**
   ``BARTModel.upgrade_state_dict_named`` reads ``self.args.task`` (for mBART). A model built
   by ``fairseq-train --arch bart_large`` carries every command-line argument, ``task``
   included; one built from a hydra config (``fairseq-hydra-train``, or a checkpoint
   trained that way and loaded by ``BARTModel.from_pretrained``) carries only the
   architecture's fields. Loading any state dict then fails with ``AttributeError: invalid
   argument task.``: restoring bart.large, resuming, loading the fine-tuned model. Fix: such
   a model reads ``args.task`` as ``None`` (not mBART's ``multilingual_denoising``, which
   is all the check asks).

2. **``--no-repeat-ngram-size`` does nothing** in the ve-fairseq 0.12.3 wheel without the
   CUDA extension (CPU always, GPU when ``ngram_repeat_block_cuda`` is not built):
   ``NGramRepeatBlock._no_repeat_ngram`` compares the last tokens of the whole
   pre-allocated token buffer (padding) instead of the last ones generated, so it never
   bans anything. Fix: a correct implementation, installed only when a self-check shows
   the installed one to be broken (fairseq releases whose fallback works are left alone).

Neither is applied by loading the plugin (``--user-dir``, ``import rdrop_fairseq``): only
the summarization recipe needs them. Importing this module applies both (idempotent; the
n-gram fix only where the self-check finds the bug, the BART fix only acts on a model
without ``args.task``). ``python -m rdrop_fairseq.fairseq_fixes`` takes the arguments of
``fairseq-hydra-train`` and runs it with the fixes (what scripts/cnndm_bart.sh's train stage
runs); the processes fairseq spawns for several GPUs re-import this main module, so they
get the fixes too. ``rdrop_fairseq.recipes.evaluate_summarization`` imports it before
``BARTModel.from_pretrained``.
"""

import functools
import math


def fix_bart_hydra_loading():
    """Let BART models built from a hydra config load state dicts."""
    from fairseq.models.bart import BARTModel
    from fairseq.utils import safe_hasattr

    original = BARTModel.upgrade_state_dict_named
    if getattr(original, "_rdrop_fix", False):
        return

    @functools.wraps(original)
    def upgrade_state_dict_named(self, state_dict, name):
        if not safe_hasattr(self.args, "task"):
            self.args.task = None  # argparse-built models have it; hydra-built ones do not
        return original(self, state_dict, name)

    upgrade_state_dict_named._rdrop_fix = True
    BARTModel.upgrade_state_dict_named = upgrade_state_dict_named


def no_repeat_ngram(self, tokens, lprobs, bsz: int, beam_size: int, step: int):
    """Ban, for each hypothesis, every token that would repeat an n-gram it already holds.

    ``tokens``: the generator's buffer, ``(bsz * beam_size, max_len + 2)``; its first
    ``step + 1`` columns are the tokens so far. ``lprobs`` is updated in place.
    """
    n = self.no_repeat_ngram_size
    length = step + 1
    if length < n:  # fewer than n tokens so far: no n-gram to repeat
        return lprobs
    so_far = tokens[:, :length]
    ngrams = so_far.unfold(1, n, 1)  # (rows, length - n + 1, n): every n-gram so far
    last = so_far[:, length - (n - 1):]  # the n-1 tokens the next one would extend
    repeats = (ngrams[:, :, :-1] == last.unsqueeze(1)).all(dim=2)
    rows, starts = repeats.nonzero(as_tuple=True)
    lprobs[rows, ngrams[rows, starts, -1]] = -math.inf
    return lprobs


def ngram_blocking_is_broken():
    """Whether fairseq's Python n-gram blocking misses a repeat (the ve-fairseq bug)."""
    import torch
    from fairseq.ngram_repeat_block import NGramRepeatBlock

    block = NGramRepeatBlock(2, use_extension=False)
    # generated so far (step 3): 2 5 6 5, then the buffer's padding; 5 -> 6 would repeat
    # the bigram (5, 6), so 6 must be banned
    tokens = torch.tensor([[2, 5, 6, 5, 1, 1, 1]])
    lprobs = block._no_repeat_ngram(tokens, torch.zeros(1, 8), 1, 1, 3)
    return not math.isinf(lprobs[0, 6].item())


def fix_no_repeat_ngram():
    """Install :func:`no_repeat_ngram` if fairseq's own fallback is broken. Returns whether
    it did."""
    from fairseq.ngram_repeat_block import NGramRepeatBlock

    if NGramRepeatBlock._no_repeat_ngram is no_repeat_ngram:
        return True
    if not ngram_blocking_is_broken():
        return False
    NGramRepeatBlock._no_repeat_ngram = no_repeat_ngram
    return True


def apply():
    fix_bart_hydra_loading()
    fix_no_repeat_ngram()


apply()


def main():
    """``fairseq-hydra-train`` with the fixes applied."""
    from fairseq_cli.hydra_train import cli_main

    cli_main()


if __name__ == "__main__":
    main()
