"""The tiny Hugging Face models and examples the tests of several processes share (their
workers and the tests that compare with one process): a GPT-2, a Marian and a BERT
classifier with every dropout off, 4 examples each, the mutation that must fail, and the
Trainer's FSDP arguments in the form the installed transformers expects."""

import torch
from transformers import (BertConfig, BertForSequenceClassification, GPT2Config,
                          GPT2LMHeadModel, MarianConfig, MarianMTModel)

from rdrop_fairseq import hf


def causal():
    return GPT2LMHeadModel(GPT2Config(vocab_size=99, n_embd=16, n_layer=1, n_head=2,
                                      n_positions=32, resid_pdrop=0.0, embd_pdrop=0.0,
                                      attn_pdrop=0.0))


def seq2seq():
    return MarianMTModel(MarianConfig(
        vocab_size=99, d_model=16, encoder_layers=1, decoder_layers=1,
        encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=32,
        decoder_ffn_dim=32, max_position_embeddings=32, pad_token_id=0, eos_token_id=1,
        decoder_start_token_id=0, dropout=0.0, attention_dropout=0.0))


def classifier():
    return BertForSequenceClassification(BertConfig(
        vocab_size=99, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
        intermediate_size=32, num_labels=3, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0))


def examples(kind):
    g = torch.Generator().manual_seed(4)
    ids = torch.randint(3, 99, (4, 6), generator=g)
    if kind == "classifier":
        return [{"input_ids": ids[i], "labels": torch.tensor(i % 3)} for i in range(4)]
    labels = ids.clone() if kind == "causal" else torch.randint(3, 99, (4, 5), generator=g)
    labels[2:, 3:] = -100  # two of the examples hold fewer labelled tokens
    return [{"input_ids": ids[i], "labels": labels[i]} for i in range(4)]


class Unscaled(hf.RDropTrainer):
    """The mutation: the loss without its world-size scale."""

    def compute_loss(self, model, *a, **k):
        loss = super().compute_loss(model, *a, **k)
        return loss / self.args.world_size if model.training else loss


def fsdp_arguments(version, layers):
    """TrainingArguments' FSDP options: full sharding with FSDP ``version`` (1 or 2),
    wrapping the layer classes ``layers``. ``fsdp=True`` with everything in ``fsdp_config``
    where the installed transformers takes it (5.25 logs the string form as deprecated),
    the string ``"full_shard"`` where it does not (the floor's)."""
    from transformers import TrainingArguments

    config = {"version": version, "transformer_layer_cls_to_wrap": layers}
    if TrainingArguments.__dataclass_fields__["fsdp"].metadata.get("const") is True:
        config["reshard_after_forward"] = True if version == 2 else "full_shard"
        return {"fsdp": True, "fsdp_config": config}
    return {"fsdp": "full_shard", "fsdp_config": config}
