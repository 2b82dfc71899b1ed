"""Convert a Hugging Face BERT encoder into a fairseq ``roberta`` checkpoint.

Reads a Hugging Face model directory (``config.json``, ``model.safetensors``,
``tokenizer.json``) with the ``safetensors`` and ``tokenizers`` packages and writes, into
OUTDIR:

* ``model.pt``: a ``roberta``-architecture checkpoint in the layout of fairseq's
  ``roberta.base/model.pt`` (for ``--restore-file`` with ``--reset-optimizer``, or
  ``RobertaModel.from_pretrained``); it also loads into ``roberta_attendout``;
* ``dict.txt``: the fairseq dictionary of BERT's WordPiece vocabulary;
* ``tokenizer.json``: BERT's tokenizer, to encode text into that dictionary's symbols
  (:func:`encode_line`).

The mapping. fairseq's ``roberta`` is BERT's architecture (post-LN, GELU, learned positions,
an embedding LayerNorm), so the weights map one to one, except:

* fairseq's first four symbols are ``<s> <pad> </s> <unk>``: they get BERT's ``[CLS]``,
  ``[PAD]``, ``[SEP]`` and ``[UNK]`` embeddings, and the ``<mask>`` fairseq's
  sentence-prediction and masked-LM tasks append gets ``[MASK]``'s. With the GLUE recipe's
  ``--init-token 0 --separator-token 2`` and fairseq-preprocess's end-of-sentence symbol,
  a sentence is ``[CLS] ... [SEP]`` as BERT expects, and the classification head pools
  ``[CLS]``;
* fairseq's learned positions start after the padding index (position ``i`` is row
  ``i + 2``): BERT's position table moves down two rows, and the token-type-0 embedding
  (every sentence of a single-segment input) is folded into it. Sentence pairs lose BERT's
  segment-1 embedding: fairseq's roberta has no token types (as RoBERTa);
* BERT's LayerNorm epsilon is 1e-12, fairseq's 1e-5 (not configurable in fairseq's roberta):
  the converted encoder's outputs differ by the amount ``tests/test_convert_hf_bert.py``
  measures;
* BERT's pooler is not used: fairseq's classification head has its own dense + tanh on
  ``[CLS]``, initialised at random when fine-tuning starts (as for RoBERTa). The masked-LM
  head, absent from encoder-only checkpoints, is left at fairseq's initialisation.

Usage::

    python -m rdrop_fairseq.recipes.convert_hf_bert --hf-dir all-MiniLM-L6-v2 --output OUTDIR
"""

import argparse
import json
import os
import shutil
import sys
from pathlib import Path

import torch
from .common import parser_from_doc

SPECIALS = {"<s>": "[CLS]", "<pad>": "[PAD]", "</s>": "[SEP]", "<unk>": "[UNK]"}
MASK = "[MASK]"
POSITION_OFFSET = 2  # fairseq: padding_idx (1) + 1


def read_hf_dir(hf_dir):
    """(config dict, {name: tensor} without a ``bert.`` prefix, tokenizers.Tokenizer)."""
    from safetensors.torch import load_file

    hf_dir = Path(hf_dir)
    missing = [n for n in ("config.json", "model.safetensors", "tokenizer.json")
               if not (hf_dir / n).is_file()]
    if missing:
        raise FileNotFoundError(f"{hf_dir} is not a Hugging Face BERT directory: no "
                                f"{', '.join(missing)}")
    config = json.loads((hf_dir / "config.json").read_text())
    if config.get("model_type") != "bert":
        raise ValueError(f"{hf_dir}/config.json: model_type {config.get('model_type')!r}, "
                         "expected 'bert'")
    if config.get("position_embedding_type", "absolute") != "absolute":
        raise ValueError("only absolute position embeddings map onto fairseq's roberta")
    weights = {k[len("bert."):] if k.startswith("bert.") else k: v
               for k, v in load_file(str(hf_dir / "model.safetensors")).items()}
    return config, weights, load_tokenizer(hf_dir / "tokenizer.json")


def fairseq_vocabulary(tokenizer):
    """BERT ids in fairseq's order: the four specials, the rest of the vocabulary in BERT's
    order (the lines of dict.txt), then ``[MASK]`` (the ``<mask>`` the tasks append)."""
    vocab = tokenizer.get_vocab()
    for name in [*SPECIALS.values(), MASK]:
        if name not in vocab:
            raise ValueError(f"the tokenizer has no {name} token")
    skip = {vocab[n] for n in [*SPECIALS.values(), MASK]}
    words = [w for w, i in sorted(vocab.items(), key=lambda kv: kv[1]) if i not in skip]
    ids = [vocab[n] for n in SPECIALS.values()] + [vocab[w] for w in words] + [vocab[MASK]]
    return words, ids


def roberta_args(config):
    """fairseq model args of a ``roberta`` with BERT's dimensions (dropouts BERT's)."""
    if config["hidden_act"] not in ("gelu", "gelu_python"):
        raise ValueError(f"hidden_act {config['hidden_act']!r}: fairseq's roberta uses exact "
                         "GELU")
    return argparse.Namespace(
        arch="roberta", _name="roberta", task="masked_lm", criterion="masked_lm",
        encoder_layers=config["num_hidden_layers"],
        encoder_embed_dim=config["hidden_size"],
        encoder_ffn_embed_dim=config["intermediate_size"],
        encoder_attention_heads=config["num_attention_heads"],
        max_positions=config["max_position_embeddings"],
        tokens_per_sample=config["max_position_embeddings"],
        dropout=config.get("hidden_dropout_prob", 0.1),
        attention_dropout=config.get("attention_probs_dropout_prob", 0.1),
        activation_fn="gelu", activation_dropout=0.0, pooler_dropout=0.0,
        encoder_normalize_before=False, layernorm_embedding=True, encoder_learned_pos=True,
        no_scale_embedding=True, untie_weights_roberta=False, seed=1)


def convert_weights(config, weights, ids, reference_state):
    """fairseq roberta state dict from BERT weights; ``reference_state`` gives the keys and
    shapes (and the initial masked-LM head)."""
    out = {k: v.clone() for k, v in reference_state.items()}
    enc = "encoder.sentence_encoder."
    out[enc + "embed_tokens.weight"] = weights["embeddings.word_embeddings.weight"][ids].clone()
    positions = weights["embeddings.position_embeddings.weight"]
    token_type0 = weights["embeddings.token_type_embeddings.weight"][0]
    table = torch.zeros_like(out[enc + "embed_positions.weight"])
    table[POSITION_OFFSET:POSITION_OFFSET + positions.size(0)] = positions + token_type0
    out[enc + "embed_positions.weight"] = table
    out[enc + "layernorm_embedding.weight"] = weights["embeddings.LayerNorm.weight"]
    out[enc + "layernorm_embedding.bias"] = weights["embeddings.LayerNorm.bias"]
    names = {"self_attn.q_proj": "attention.self.query", "self_attn.k_proj": "attention.self.key",
             "self_attn.v_proj": "attention.self.value",
             "self_attn.out_proj": "attention.output.dense",
             "self_attn_layer_norm": "attention.output.LayerNorm",
             "fc1": "intermediate.dense", "fc2": "output.dense",
             "final_layer_norm": "output.LayerNorm"}
    for i in range(config["num_hidden_layers"]):
        for ours, theirs in names.items():
            for kind in ("weight", "bias"):
                out[f"{enc}layers.{i}.{ours}.{kind}"] = weights[
                    f"encoder.layer.{i}.{theirs}.{kind}"]
    out["encoder.lm_head.weight"] = out[enc + "embed_tokens.weight"]  # tied, as roberta
    return out


class _Task:  # what RobertaModel.build_model needs of a task
    def __init__(self, dictionary):
        self.source_dictionary = dictionary

    def max_positions(self):
        return None


def convert(hf_dir, output):
    """Write model.pt, dict.txt and tokenizer.json into ``output``; return the model args."""
    from fairseq.data import Dictionary
    from fairseq.models.roberta import RobertaModel

    config, weights, tokenizer = read_hf_dir(hf_dir)
    words, ids = fairseq_vocabulary(tokenizer)
    output = Path(output)
    tmp = output.with_name(output.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    (tmp / "dict.txt").write_text("".join(f"{w} 1\n" for w in words), encoding="utf-8")
    dictionary = Dictionary.load(str(tmp / "dict.txt"))
    dictionary.add_symbol("<mask>")
    if len(dictionary) != len(ids):
        raise ValueError(f"dictionary of {len(dictionary)} symbols for {len(ids)} BERT ids: a "
                         "token of the vocabulary is not a single fairseq symbol")
    args = roberta_args(config)
    torch.manual_seed(args.seed)
    model = RobertaModel.build_model(args, _Task(dictionary))
    state = convert_weights(config, weights, ids, model.state_dict())
    model.load_state_dict(state, strict=True)  # every key and shape checked
    torch.save({"args": args, "model": state, "extra_state": {"train_iterator": {"epoch": 1}},
                "optimizer_history": [{"criterion_name": "MaskedLmLoss",
                                       "optimizer_name": "Adam", "lr_scheduler_state": {},
                                       "num_updates": 0}],
                "last_optimizer_state": None}, tmp / "model.pt")
    shutil.copy(Path(hf_dir) / "tokenizer.json", tmp / "tokenizer.json")
    shutil.rmtree(output, ignore_errors=True)
    os.replace(tmp, output)  # never a half-written output
    return args


def load_tokenizer(path):
    """BERT's tokenizer from a tokenizer.json, without its padding and truncation (fairseq
    pads batches itself; truncate with ``encode_line(max_tokens=)``)."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(path))
    tokenizer.no_padding()
    tokenizer.no_truncation()
    return tokenizer


def encode_line(tokenizer, text, max_tokens=None):
    """BERT's WordPiece tokens of ``text`` (no special tokens), space-separated: a line for
    fairseq-preprocess with the converted dict.txt. ``max_tokens`` truncates."""
    tokens = tokenizer.encode(text, add_special_tokens=False).tokens
    return " ".join(tokens[:max_tokens] if max_tokens else tokens)


def main(argv=None):
    parser = parser_from_doc(__doc__)
    parser.add_argument("--hf-dir", required=True,
                        help="Hugging Face BERT directory (config.json, model.safetensors, "
                        "tokenizer.json)")
    parser.add_argument("--output", required=True, help="output directory (replaced)")
    args = parser.parse_args(argv)
    try:
        model_args = convert(args.hf_dir, args.output)
    except (FileNotFoundError, ValueError) as e:
        parser.error(str(e))
    print(f"wrote {args.output}/model.pt (roberta: {model_args.encoder_layers} layers x "
          f"{model_args.encoder_embed_dim}, {model_args.encoder_attention_heads} heads), "
          f"dict.txt, tokenizer.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
