"""What the R-Drop criteria read off a fairseq model's output layer: whether the fused loss
may start from its logits (:func:`uses_stock_log_softmax`), and the output projection the
fused-linear path computes with (:func:`fused_output_projection`)."""

import torch
from fairseq.models import BaseFairseqModel
from fairseq.models.fairseq_decoder import FairseqDecoder
from fairseq.models.transformer import TransformerDecoderBase, TransformerModelBase


def fused_output_projection(model):
    """The decoder's output projection, for --rdrop-fused-linear; a ValueError naming what
    to change if the model's output is not ``log_softmax(output_projection(features))``."""
    decoder = getattr(model, "decoder", None)
    what = type(decoder).__name__
    if decoder is None:
        raise ValueError("--rdrop-fused-linear needs a model with a decoder (transformer, "
                         f"BART, transformer_lm), got {type(model).__name__}")
    if getattr(decoder, "adaptive_softmax", None) is not None:
        raise ValueError("--rdrop-fused-linear cannot compute an adaptive softmax: drop the "
                         "flag, or use adaptive_loss_rdrop")
    projection = getattr(decoder, "output_projection", None)
    if type(projection) is not torch.nn.Linear:
        raise ValueError(f"--rdrop-fused-linear needs the decoder's output_projection to be a "
                         f"torch.nn.Linear; {what} has {type(projection).__name__}: drop the flag")
    if not (is_method(decoder.output_layer, TransformerDecoderBase.output_layer)
            and uses_stock_log_softmax(model)):
        raise ValueError(f"--rdrop-fused-linear: {what} overrides its output layer or "
                         "normalisation, which the fused loss would skip: drop the flag")
    return projection


def uses_stock_log_softmax(model):
    """Whether ``model.get_normalized_probs`` is fairseq's plain ``log_softmax`` of
    ``net_output[0]``, so that the fused loss may start from the logits.

    True for fairseq's encoder-decoder and decoder-only models without an adaptive softmax
    (transformer, BART, transformer_lm, ...). A model or decoder that overrides the
    normalisation keeps the log-probability path. (A DDP wrapper forwards these attributes
    to the model.)
    """
    decoder = getattr(model, "decoder", None)
    if decoder is None or getattr(decoder, "adaptive_softmax", None) is not None:
        return False
    model_fn = getattr(model.get_normalized_probs, "__func__", None)
    return (
        model_fn in (BaseFairseqModel.get_normalized_probs,
                     TransformerModelBase.get_normalized_probs)
        and is_method(model.get_normalized_probs_scriptable,
                       BaseFairseqModel.get_normalized_probs_scriptable)
        and is_method(decoder.get_normalized_probs, FairseqDecoder.get_normalized_probs)
        and is_method(decoder.get_normalized_probs_scriptable,
                       FairseqDecoder.get_normalized_probs_scriptable)
    )


def is_method(bound, function):
    """Whether the method ``bound`` is ``function`` itself, not an override of it."""
    return getattr(bound, "__func__", None) is function
