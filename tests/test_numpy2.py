"""fairseq 0.12 under NumPy 2 with the plugin loaded (rdrop_fairseq/numpy_compat.py): the
language-model data path (TokenBlockDataset, break mode "eos"), the translation data path
with length buckets (LanguagePairDataset, num_buckets > 0) and the non-autoregressive
models' DynamicCRF, each checked against what it must compute. The set-up installs NumPy 2
(its check insists), so the suite runs these under it; without the plugin's repair each
stops with an AttributeError or TypeError there."""

import itertools

import numpy
import torch
from fairseq.data import Dictionary, LanguagePairDataset, TokenBlockDataset, token_block_dataset
from fairseq.modules import DynamicCRF

import rdrop_fairseq  # noqa: F401  (the plugin, loaded as --user-dir loads it)


def test_the_suite_runs_under_numpy_2_and_numpy_itself_is_unchanged():
    assert int(numpy.__version__.split(".")[0]) >= 2, numpy.__version__
    assert not hasattr(numpy, "compat")  # only fairseq's modules see it
    assert token_block_dataset.np.compat.long is int
    assert token_block_dataset.np.ndarray is numpy.ndarray


def dictionary(words="abcdefgh"):
    d = Dictionary()
    for w in words:
        d.add_symbol(w)
    return d


def encode(d, text):
    return torch.tensor([d.index(w) for w in text] + [d.eos()])


def test_token_block_dataset_breaks_at_each_sentence_end():
    d = dictionary()
    lines = [encode(d, s) for s in ("abc", "defgh", "ha", "b")]
    blocks = TokenBlockDataset(lines, [len(x) for x in lines], None, d.pad(), d.eos(),
                               break_mode="eos", include_targets=True)
    assert list(blocks.sizes) == [4, 6, 3, 2]
    for i, line in enumerate(lines):
        source, target, past = blocks[i]
        assert target.tolist() == line.tolist()  # a block is one sentence with its end
        assert source.tolist() == [d.eos()] + line[:-1].tolist()  # shifted right by one
        assert past.tolist() == [d.pad(), d.eos()] + line[:-2].tolist()


def bucketed(sizes, num_buckets=2):
    """Each size raised to the smallest bucket that holds it; the buckets: the sizes at
    equal percentiles, rounded down to a size (fairseq's get_buckets)."""
    ordered = sorted(sizes)
    buckets = {ordered[int((k + 1) / num_buckets * (len(sizes) - 1))]
               for k in range(num_buckets)}
    return [min(b for b in buckets if b >= size) for size in sizes]


def test_language_pair_dataset_pads_to_length_buckets():
    d = dictionary()
    src = [encode(d, s) for s in ("a", "ab", "abcd", "abcdefg")]
    tgt = [encode(d, s) for s in ("h", "hg", "h", "hgfedc")]
    src_sizes, tgt_sizes = [2, 3, 5, 8], [2, 3, 2, 7]
    pairs = LanguagePairDataset(src, numpy.array(src_sizes), d, tgt, numpy.array(tgt_sizes),
                                d, shuffle=False, num_buckets=2)
    assert bucketed(src_sizes) == [3, 3, 8, 8] and bucketed(tgt_sizes) == [2, 7, 2, 7]
    assert list(pairs.src_sizes) == bucketed(src_sizes)
    assert list(pairs.tgt_sizes) == bucketed(tgt_sizes)
    assert list(pairs.bucketed_num_tokens) == [3, 7, 8, 8]  # the larger of the two
    assert [int(n) for _, n in pairs.buckets] == [3, 7, 8]
    batch = pairs.collater([pairs[i] for i in range(4)])
    assert batch["net_input"]["src_tokens"].shape == (4, 8)
    assert batch["target"].shape == (4, 7)
    # a sentence is padded to its bucket; the padding is not counted as tokens
    assert batch["net_input"]["src_lengths"].tolist() == [8, 5, 3, 2]
    assert batch["ntokens"] == sum(tgt_sizes)


def test_dynamic_crf_likelihood_is_the_exact_one_when_the_beam_holds_every_token():
    torch.manual_seed(0)
    vocab, length = 3, 4
    crf = DynamicCRF(vocab, low_rank=2, beam_size=vocab)
    emissions = torch.randn(1, length, vocab)
    targets = torch.tensor([[0, 2, 1, 2]])
    masks = torch.ones(1, length, dtype=torch.bool)
    transition = crf.E1.weight @ crf.E2.weight.T  # score of token j after token i

    def score(path):
        return (sum(emissions[0, t, y] for t, y in enumerate(path))
                + sum(transition[a, b] for a, b in zip(path, path[1:])))

    log_z = torch.logsumexp(torch.stack(
        [score(p) for p in itertools.product(range(vocab), repeat=length)]), 0)
    expected = score(targets[0].tolist()) - log_z
    assert torch.allclose(crf(emissions, targets, masks), expected, atol=1e-5)
