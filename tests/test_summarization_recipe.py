"""The CNN/DM summarization recipe end to end on stand-ins built here (nothing downloaded):
a tiny GPT-2 byte-level BPE (encoder.json / vocab.bpe), a tiny randomly initialised BART
saved like bart.large (model.pt + dict.txt, with the <mask> embedding row of the denoising
task), and a tiny corpus in the CNN/DM layout. prepare -> fine-tune (R-Drop and baseline,
through scripts/cnndm_bart.sh) -> summarise + ROUGE; the config against fairseq's bart_large
and the paper; the errors."""

import json
import math
import random
import re
import sys

import pytest

from rdrop_fairseq.recipes import evaluate_summarization, prepare_cnndm
from tests.recipe_helpers import composed_config, dry_run, run, script

CONFIG = "bart_large_cnn_rdrop"
# the pre-trained checkpoint, which the config leaves required (???)
PRETRAINED = "checkpoint.restore_file=/nonexistent/model.pt"

TINY = {"encoder_layers": 1, "decoder_layers": 1, "encoder_embed_dim": 16,
        "decoder_embed_dim": 16, "encoder_ffn_embed_dim": 32, "decoder_ffn_embed_dim": 32,
        "encoder_attention_heads": 2, "decoder_attention_heads": 2}
TINY_OVERRIDES = [f"model.{k}={v}" for k, v in TINY.items()]
FAST = ["common.log_interval=1", "dataset.num_workers=0", "checkpoint.no_epoch_checkpoints=true"]
# the paper's lr (3e-5 after 500 warm-up updates) leaves a random model as it is: it would
# only ever emit <s>, i.e. empty summaries. A large one gives the tiny model a start.
LEARN = ["optimization.lr=[0.01]", "lr_scheduler.warmup_updates=1"]
UPDATES = 6
SHORT = ["--min-len", "3", "--max-len-b", "12", "--batch-size", "2"]  # test decoding
WORDS = ("the a of in and river city old new king war song team north south west east music "
         "band first second early later game film café").split()
SPLITS = {"train": 24, "val": 3, "test": 5}
MERGES = [("Ġ", "t"), ("h", "e"), ("Ġt", "he"), ("i", "n"), ("Ġ", "a"), ("o", "n"),
          ("a", "r"), ("Ġ", "s")]




def write_corpus(raw):
    """``raw/{split}.{source,target}``: articles of a few sentences, the lead sentence and a
    later one as the summary, one a line."""
    rng = random.Random(0)
    raw.mkdir(parents=True, exist_ok=True)
    corpus = {}
    for split, n in SPLITS.items():
        sources, targets = [], []
        for _ in range(n):
            sentences = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(5, 9))).capitalize()
                         + "." for _ in range(rng.randint(3, 5))]
            sources.append(" ".join(sentences))
            targets.append(f"{sentences[0]} {sentences[-1]}")
        for side, lines in (("source", sources), ("target", targets)):
            (raw / f"{split}.{side}").write_text("".join(x + "\n" for x in lines),
                                                 encoding="utf-8")
        corpus[split] = (sources, targets)
    return corpus


def write_gpt2_bpe(root, text):
    """A GPT-2-style byte-level BPE: ``encoder.json`` maps the byte symbols of every byte
    ``text`` uses, plus a few merges, to ids; ``vocab.bpe`` lists the merges."""
    from fairseq.data.encoders.gpt2_bpe_utils import bytes_to_unicode

    byte_symbol = bytes_to_unicode()
    vocab = [byte_symbol[b] for b in sorted(set(text.encode("utf-8")))]
    vocab += ["".join(m) for m in MERGES]
    root.mkdir(parents=True, exist_ok=True)
    (root / "encoder.json").write_text(json.dumps({s: i for i, s in enumerate(vocab)}),
                                       encoding="utf-8")
    (root / "vocab.bpe").write_text("#version: 0.2\n" + "".join(f"{a} {b}\n" for a, b in MERGES),
                                    encoding="utf-8")
    return root / "encoder.json", root / "vocab.bpe", len(vocab)


def write_bart_dict(path, encoder_json, vocab_bpe, text):
    """BART's dict.txt: every BPE id as a token with its count, most frequent first."""
    from collections import Counter

    from fairseq.data.encoders.gpt2_bpe_utils import get_encoder

    bpe = get_encoder(str(encoder_json), str(vocab_bpe))
    counts = Counter(bpe.encode(text))
    ids = sorted(bpe.encoder.values(), key=lambda i: (-counts[i], i))
    path.write_text("".join(f"{i} {counts[i]}\n" for i in ids), encoding="utf-8")


def write_tiny_bart(root, dict_txt):
    """libreoffice_summarization_check.write_random_bart shrunk to TINY, as if pre-trained
    for 500 updates (fine-tuning must start from 0). Returns the checkpoint path and its
    number of embedding rows."""
    import torch

    import rdrop_fairseq  # noqa: F401
    from experiments.libreoffice_summarization_check import write_random_bart

    path = write_random_bart(root / "model.pt", dict_txt, TINY, seed=0, num_updates=500,
                             epoch=2)
    state = torch.load(path)  # weights-only, with the plugin's allow-list
    return path, state["model"]["encoder.embed_tokens.weight"].shape[0]


@pytest.fixture(scope="module")
def recipe(tmp_path_factory):
    """Stand-ins for the downloads, and the corpus prepared by prepare_cnndm.py."""
    root = tmp_path_factory.mktemp("cnndm")
    corpus = write_corpus(root / "cnn_dm")
    text = "\n".join(line for src, tgt in corpus.values() for line in src + tgt)
    encoder_json, vocab_bpe, n_bpe = write_gpt2_bpe(root / "gpt2_bpe", text)
    write_bart_dict(root / "dict.txt", encoder_json, vocab_bpe, text)
    bart, n_embeddings = write_tiny_bart(root / "bart.tiny", root / "dict.txt")
    out = root / "prep"
    log = run([sys.executable, "-m", "rdrop_fairseq.recipes.prepare_cnndm", "--raw", root / "cnn_dm",
               "--out", out, "--encoder-json", encoder_json, "--vocab-bpe", vocab_bpe,
               "--dict", bart.parent / "dict.txt"]).stdout
    return {"root": root, "corpus": corpus, "encoder_json": encoder_json,
            "vocab_bpe": vocab_bpe, "n_bpe": n_bpe, "bart": bart, "n_embeddings": n_embeddings,
            "out": out, "bin": out / "bin", "log": log}


def test_stand_ins_are_shaped_like_the_real_downloads(recipe):
    from fairseq.data.encoders.gpt2_bpe_utils import get_encoder

    bpe = get_encoder(str(recipe["encoder_json"]), str(recipe["vocab_bpe"]))
    ids = bpe.encode(" the café")
    assert len(ids) < len(" the café".encode("utf-8"))  # the merges apply
    assert bpe.decode(ids) == " the café"  # byte-level: multi-byte characters round-trip
    # bart.large: 50260 BPE ids in dict.txt + 4 specials + <mask> = 50265 embedding rows
    assert recipe["n_embeddings"] == recipe["n_bpe"] + 4 + 1


def test_prepare_encodes_with_gpt2_bpe_and_binarizes_with_barts_dictionary(recipe):
    from fairseq.data.encoders.gpt2_bpe_utils import get_encoder

    out, corpus = recipe["out"], recipe["corpus"]
    bpe = get_encoder(str(recipe["encoder_json"]), str(recipe["vocab_bpe"]))
    for split, (sources, targets) in corpus.items():
        for side, lines in (("source", sources), ("target", targets)):
            encoded = (out / "bpe" / f"{split}.bpe.{side}").read_text().splitlines()
            # multiprocessing_bpe_encoder's output: the GPT-2 ids of each line
            assert encoded == [" ".join(map(str, bpe.encode(x))) for x in lines]
            binarized = "valid" if split == "val" else split  # fairseq's --validpref name
            for ext in ("bin", "idx"):
                assert (recipe["bin"] / f"{binarized}.source-target.{side}.{ext}").is_file()
    for side in ("source", "target"):  # fairseq-preprocess --srcdict/--tgtdict: BART's dict
        assert ((recipe["bin"] / f"dict.{side}.txt").read_text()
                == (recipe["bart"].parent / "dict.txt").read_text())
    assert "train.source: 24 lines GPT-2 BPE encoded" in recipe["log"]


def test_prepare_workers_give_the_same_encoding(recipe, tmp_path):
    args = (recipe["root"] / "cnn_dm" / "val.source", tmp_path / "val.bpe.source",
            str(recipe["encoder_json"]), str(recipe["vocab_bpe"]))
    assert prepare_cnndm.bpe_encode_file(*args, workers=2) == SPLITS["val"]
    assert (tmp_path / "val.bpe.source").read_text() == (
        recipe["out"] / "bpe" / "val.bpe.source").read_text()


def test_prepare_names_what_is_missing(recipe, tmp_path):
    files = dict(encoder_json=recipe["encoder_json"], vocab_bpe=recipe["vocab_bpe"],
                 dict_txt=recipe["bart"].parent / "dict.txt")
    raw = recipe["root"] / "cnn_dm"
    with pytest.raises(SystemExit, match=r"GPT-2 vocab.bpe \(--vocab-bpe or \$GPT2_VOCAB_BPE\): "
                                         r"no file .*nowhere.bpe"):
        prepare_cnndm.check_inputs(raw, **{**files, "vocab_bpe": tmp_path / "nowhere.bpe"})
    with pytest.raises(SystemExit, match=r"BART dict.txt \(--dict or \$BART_DICT\): not given"):
        prepare_cnndm.check_inputs(raw, **{**files, "dict_txt": None})
    (tmp_path / "words.txt").write_text("the 10\nof 5\n")
    with pytest.raises(SystemExit, match="is not a GPT-2 BPE dictionary"):
        prepare_cnndm.check_inputs(raw, **{**files, "dict_txt": tmp_path / "words.txt"})
    with pytest.raises(SystemExit, match="CNN/DM directory .* not found"):
        prepare_cnndm.check_inputs(tmp_path / "nowhere", **files)
    (tmp_path / "partial").mkdir()
    (tmp_path / "partial" / "train.source").write_text("a\n")
    (tmp_path / "partial" / "train.target").write_text("a\nb\n")
    with pytest.raises(SystemExit, match="lacks val.source, val.target"):
        prepare_cnndm.check_inputs(tmp_path / "partial", **files)
    for side in ("source", "target"):
        (tmp_path / "partial" / f"val.{side}").write_text("a\n")
    with pytest.raises(SystemExit, match="train.source has 1 lines but train.target has 2"):
        prepare_cnndm.check_inputs(tmp_path / "partial", **files)
    (tmp_path / "partial" / "train.target").write_text("a\n")  # no test split: train, val
    assert prepare_cnndm.check_inputs(tmp_path / "partial", **files) == ["train", "val"]


# ------------------------------------------------------------------ fine-tune + evaluate

def paths(recipe, save_dir):
    """The environment that points scripts/cnndm_bart.sh at the stand-ins."""
    return dict(GPUS=0, DATA_DIR=recipe["out"], SAVE_DIR=save_dir, RAW=recipe["root"] / "cnn_dm",
                BPE_DIR=recipe["encoder_json"].parent, BART_DIR=recipe["bart"].parent)


def train(recipe, save_dir, **env):
    return script("cnndm_bart", "train", *TINY_OVERRIDES, *FAST, *LEARN,
                  f"optimization.max_update={UPDATES}", MAX_TOKENS=512, UPDATE_FREQ=1,
                  **paths(recipe, save_dir), **env).stdout


def train_inner(log):
    lines = [line for line in log.splitlines() if "[train_inner]" in line]
    assert len(lines) == UPDATES, log[-3000:]
    return lines


@pytest.fixture(scope="module")
def finetuned(recipe, tmp_path_factory):
    save = tmp_path_factory.mktemp("rdrop")
    return save, train(recipe, save)


def test_finetune_with_rdrop_restores_bart_and_logs_the_kl(finetuned, recipe):
    save, log = finetuned
    assert "criterion: LabelSmoothedCrossEntropyRDropCriterion" in log
    assert "criterion.rdrop_alpha=0.7" in log
    # restored from the stand-in bart.large, its <mask> row dropped, nothing else reset:
    # the update count starts at 0 whatever the pre-trained checkpoint recorded
    assert f"Loaded checkpoint {recipe['bart']}" in log, log[-3000:]
    for i, line in enumerate(train_inner(log), 1):
        assert f"num_updates={i}," in line, line
        kl = re.search(r"rdrop_kl=([^,\s]+)", line)
        assert kl and math.isfinite(float(kl[1])) and float(kl[1]) > 0, line
    valid = [line for line in log.splitlines() if "valid on 'valid' subset" in line]
    assert valid and not any("rdrop_kl" in line for line in valid), log[-3000:]
    assert (save / "checkpoint_best.pt").is_file()


def test_baseline_mode_is_the_plain_fairseq_criterion(recipe, tmp_path):
    log = train(recipe, tmp_path / "ckpt", MODE="baseline")
    assert "criterion.rdrop_alpha=0 " in log
    for line in train_inner(log):
        assert "rdrop_kl" not in line and re.search(r"loss=[\d.]+", line), line
    assert (tmp_path / "ckpt" / "checkpoint_last.pt").is_file()


def test_evaluate_summarises_every_test_article_and_scores_rouge(finetuned, recipe, tmp_path):
    save, _ = finetuned
    sources, targets = recipe["corpus"]["test"]
    proc = script("cnndm_bart", "evaluate", *SHORT, "--json", tmp_path / "rouge.json",
                  **paths(recipe, save))
    out = proc.stdout
    assert "beam 4, lenpen 2.0, max_len_b 12, min_len 3, no_repeat_ngram_size 3" in out
    assert re.search(rf"summarizing: 100%.*{len(sources)}/{len(sources)}", proc.stderr), \
        proc.stderr[-2000:]  # the progress bar over the test set
    hypo = save / "checkpoint_best.test.hypo"
    hyps = hypo.read_text(encoding="utf-8").splitlines()
    assert len(hyps) == len(sources) and all(h.strip() for h in hyps)
    m = re.search(r"^test: (\d+) summaries, ROUGE-1 ([\d.]+), ROUGE-2 ([\d.]+), "
                  r"ROUGE-L ([\d.]+)", out, re.M)
    assert m and int(m[1]) == len(sources), out[-3000:]
    result = json.loads((tmp_path / "rouge.json").read_text())
    for key, printed in zip(("rouge1", "rouge2", "rougeLsum"), m.groups()[1:]):
        assert 0 <= result[key] <= 100 and result[key] == pytest.approx(float(printed), abs=0.01)
    assert 0 <= result["rougeL"] <= 100
    assert result["summaries"] == len(sources) and result["decoding"]["min_len"] == 3
    assert result["rouge1"] == pytest.approx(evaluate_summarization.rouge(hyps, targets)["rouge1"],
                                             abs=1e-3)

    assert result["stemmed"] is True and ", stemmed;" in out  # files2rouge's default

    # --score-only scores the written hypotheses again, without the model
    score = [sys.executable, "-m", "rdrop_fairseq.recipes.evaluate_summarization", "--score-only",
             "--out", hypo, "--target", recipe["root"] / "cnn_dm" / "test.target"]
    assert m[0] in run(score).stdout
    unstemmed = run(score + ["--no-stemmer", "--json", tmp_path / "unstemmed.json"]).stdout
    assert "not stemmed;" in unstemmed
    unstemmed = json.loads((tmp_path / "unstemmed.json").read_text())
    assert unstemmed["stemmed"] is False
    assert unstemmed["rouge1"] == pytest.approx(
        evaluate_summarization.rouge(hyps, targets, stem=False)["rouge1"], abs=1e-3)


def test_prepend_bos_data_is_what_the_hub_interface_feeds_the_model(finetuned, recipe,
                                                                     tmp_path):
    """--prepend-bos (for models trained from scratch): every binarized article is the
    hub interface's encoding of it (<s> ... </s>), every summary starts with <s>, the token
    the hub forces first; without it the data lacks exactly that <s>."""
    from fairseq.data import data_utils

    save, _ = finetuned
    root = recipe["root"]
    run([sys.executable, "-m", "rdrop_fairseq.recipes.prepare_cnndm", "--raw", root / "cnn_dm",
         "--out", tmp_path, "--encoder-json", recipe["encoder_json"], "--vocab-bpe",
         recipe["vocab_bpe"], "--dict", recipe["bart"].parent / "dict.txt", "--prepend-bos"])
    bart = evaluate_summarization.load_bart(save / "checkpoint_best.pt", recipe["bin"],
                                            recipe["encoder_json"], recipe["vocab_bpe"],
                                            cpu=True)
    bos = bart.task.source_dictionary.bos()
    sources, targets = recipe["corpus"]["test"]

    def dataset(data_bin, side):
        return data_utils.load_indexed_dataset(str(data_bin / f"test.source-target.{side}"),
                                               bart.task.source_dictionary)

    with_bos, plain = dataset(tmp_path / "bin", "source"), dataset(recipe["bin"], "source")
    assert len(with_bos) == len(sources)
    for i, article in enumerate(sources):
        assert with_bos[i].tolist() == bart.encode(article).tolist()
        assert with_bos[i].tolist() == [bos] + plain[i].tolist()
    with_bos, plain = dataset(tmp_path / "bin", "target"), dataset(recipe["bin"], "target")
    for i in range(len(targets)):
        assert with_bos[i].tolist() == [bos] + plain[i].tolist()
        assert bart.decode(with_bos[i]) == targets[i].strip()  # decode drops the <s>


# ----------------------------------------------------------------------------- ROUGE

def test_rouge_follows_files2rouge_with_summary_level_rouge_l():
    rouge = evaluate_summarization.rouge
    ref = ["The cats sat on the mat. Dogs ran in the park."]
    assert rouge(ref, ref) == pytest.approx(dict.fromkeys(evaluate_summarization.ROUGE_KEYS,
                                                          100.0))
    assert rouge(["Nothing alike here."], ref) == pytest.approx(
        dict.fromkeys(evaluate_summarization.ROUGE_KEYS, 0.0))
    assert rouge(["The cat sits on the mats."], ["The cats sat on the mat."])["rouge1"] > rouge(
        ["The dog ran off the rug."], ["The cats sat on the mat."])["rouge1"]
    # files2rouge's default: Porter stemming (ROUGE-1.5.5's -m): cats/cat, running/run match
    assert rouge(["the cat run"], ["the cats running"])["rouge1"] == pytest.approx(100)
    assert rouge(["the cat run"], ["the cats running"], stem=False)["rouge1"] < 50
    # summary-level ROUGE-L (rougeLsum) takes the LCS per reference sentence, so sentences in
    # another order still match; sentence-level rougeL does not
    swapped = rouge(["Dogs ran in the park. The cats sat on the mat."], ref)
    assert swapped["rougeLsum"] == pytest.approx(100.0) and swapped["rougeL"] < 100
    # files2rouge splits tokenised text at " . " only: not after "!" or "?", nor inside the
    # abbreviation "U.S."
    from sacremoses import MosesTokenizer

    split = evaluate_summarization.split_sentences
    assert split("The U.S. team won. Fans cheered! Why? Nobody knows.",
                 MosesTokenizer(lang="en")) == (
        "The U.S. team won .\nFans cheered ! Why ? Nobody knows .")
    with pytest.raises(ValueError, match="2 hypotheses but 1 references"):
        rouge(["a", "b"], ["a"])


def test_evaluate_names_what_is_missing(recipe, tmp_path, capsys):
    parse = evaluate_summarization.parse_args
    base = ["--data", str(recipe["bin"]), "--raw", str(recipe["root"] / "cnn_dm"),
            "--encoder-json", str(recipe["encoder_json"]), "--vocab-bpe", str(recipe["vocab_bpe"])]
    with pytest.raises(SystemExit):
        parse(base + ["--checkpoint", str(tmp_path / "missing.pt")])
    assert "--checkpoint: " in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse(base[:-2] + ["--checkpoint", str(recipe["bart"])])
    assert "--vocab-bpe (or $GPT2_VOCAB_BPE) is required" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse(["--score-only", "--target", str(tmp_path / "t")])
    assert "--score-only needs --out" in capsys.readouterr().err
    a = parse(base + ["--checkpoint", str(recipe["bart"])])
    assert a.out == str(recipe["bart"].with_name("model.test.hypo"))
    assert a.source == str(recipe["root"] / "cnn_dm" / "test.source")


# ------------------------------------------------------------ fairseq fixes (decoding)

def banned_by_definition(seq, n):
    """The tokens that would repeat an n-gram of ``seq`` (a brute-force reference)."""
    grams = [tuple(seq[i:i + n]) for i in range(len(seq) - n + 1)]
    tail = tuple(seq[len(seq) - n + 1:]) if n > 1 else ()
    return {g[-1] for g in grams if g[:-1] == tail}


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_no_repeat_ngram_bans_exactly_the_repeats(n):
    """The fixed n-gram blocking against the definition, on a generator-like buffer (the
    tokens so far, then padding), for every step."""
    import torch
    from fairseq.ngram_repeat_block import NGramRepeatBlock

    from rdrop_fairseq import fairseq_fixes

    block = NGramRepeatBlock(n, use_extension=False)
    gen = torch.Generator().manual_seed(n)
    seqs = torch.randint(4, 8, (6, 20), generator=gen)  # 4 symbols: many repeats
    for step in range(seqs.size(1)):
        buffer = torch.ones(6, 24, dtype=torch.long)  # pad = 1
        buffer[:, :step + 1] = seqs[:, :step + 1]
        lprobs = fairseq_fixes.no_repeat_ngram(block, buffer, torch.zeros(6, 10), 3, 2, step)
        for row in range(6):
            banned = {i for i in range(10) if math.isinf(lprobs[row, i])}
            assert banned == banned_by_definition(seqs[row, :step + 1].tolist(), n), (row, step)


def test_fairseq_fixes_are_in_place_after_import():
    import torch
    from fairseq.models.bart import BARTModel
    from fairseq.ngram_repeat_block import NGramRepeatBlock

    from rdrop_fairseq import fairseq_fixes

    assert not fairseq_fixes.ngram_blocking_is_broken()  # fixed, or never broken
    assert BARTModel.upgrade_state_dict_named._rdrop_fix
    fairseq_fixes.apply()  # idempotent
    assert not hasattr(BARTModel.upgrade_state_dict_named.__wrapped__, "_rdrop_fix")
    lprobs = NGramRepeatBlock(3, use_extension=False)(
        torch.tensor([[2, 0, 9, 9, 9, 1]]), torch.zeros(1, 12), 1, 1, 4)
    assert math.isinf(lprobs[0, 9])  # 9 9 9 9 would repeat the trigram 9 9 9


# ----------------------------------------------------------------- configs and options

def test_config_is_bart_large():
    """What fairseq builds from the config's model is `fairseq-train --arch bart_large`'s
    model (the config spells the architecture out)."""
    import argparse

    from fairseq import options
    from fairseq.models import ARCH_CONFIG_REGISTRY
    from omegaconf import OmegaConf

    cfg = composed_config(CONFIG, [PRETRAINED])
    model = argparse.Namespace(**OmegaConf.to_container(cfg.model, resolve=True))
    assert model._name == "bart_large"
    ARCH_CONFIG_REGISTRY[model._name](model)
    ref = vars(options.parse_args_and_arch(options.get_training_parser(), [
        "/nonexistent", "--task", "translation", "--arch", "bart_large",
        "--dropout", "0.1", "--attention-dropout", "0.1"]))  # the fine-tuning command's
    differ = {k: (v, ref[k]) for k, v in vars(model).items() if k in ref and v != ref[k]}
    assert differ == {}
    assert (model.encoder_layers, model.encoder_embed_dim, model.encoder_ffn_embed_dim,
            model.decoder_layers) == (12, 1024, 4096, 12)


def test_config_holds_the_papers_settings():
    cfg = composed_config(CONFIG, [PRETRAINED])
    assert (cfg.criterion._name, cfg.criterion.rdrop_alpha, cfg.criterion.label_smoothing) == (
        "label_smoothed_cross_entropy_rdrop", 0.7, 0.1)
    assert (cfg.model.dropout, cfg.model.attention_dropout) == (0.1, 0.1)
    assert (cfg.task._name, cfg.task.source_lang, cfg.task.target_lang,
            cfg.task.truncate_source) == ("translation", "source", "target", True)
    assert (cfg.optimizer._name, cfg.optimizer.weight_decay, cfg.optimization.lr,
            cfg.optimization.clip_norm) == ("adam", 0.01, [3e-05], 0.1)
    assert (cfg.lr_scheduler._name, cfg.lr_scheduler.warmup_updates) == ("polynomial_decay", 500)
    assert cfg.lr_scheduler.total_num_update == cfg.optimization.max_update == 20000
    assert cfg.dataset.max_tokens == 1024 and cfg.optimization.update_freq == [16]
    assert (cfg.checkpoint.reset_optimizer, cfg.checkpoint.reset_dataloader,
            cfg.checkpoint.reset_meters) == (True, True, True)


@pytest.fixture
def command(tmp_path):
    """The fairseq-hydra-train command scripts/cnndm_bart.sh runs (DRY_RUN: no training)."""
    data = tmp_path / "data" / "bin"
    data.mkdir(parents=True)
    for side in ("source", "target"):
        (data / f"dict.{side}.txt").write_text("13 5\n")
    (tmp_path / "bart").mkdir()
    (tmp_path / "bart" / "model.pt").write_bytes(b"")

    def make(*overrides, **env):
        env = {"GPUS": 0, "DATA_DIR": tmp_path / "data", "SAVE_DIR": tmp_path / "s",
               "BART_DIR": tmp_path / "bart", **env}
        return dry_run("cnndm_bart", "train", *overrides, **env)[0][-1]
    return make


def test_train_options_become_overrides(command, tmp_path):
    cmd = command()
    # fairseq-hydra-train with rdrop_fairseq/fairseq_fixes.py applied
    assert cmd[1:3] == ["-m", "rdrop_fairseq.fairseq_fixes"]
    assert "--config-name" in cmd and CONFIG in cmd
    assert f"checkpoint.restore_file={tmp_path / 'bart' / 'model.pt'}" in cmd
    assert "criterion.rdrop_alpha=0.7" in cmd
    assert not [c for c in cmd if c.startswith("optimization.max_update")]
    cmd = command("optimization.max_update=10", "common.fp16=true", ALPHA=0.5, SEED=3,
                  MAX_TOKENS=2048, UPDATE_FREQ=4)
    for item in ("criterion.rdrop_alpha=0.5", "common.seed=3", "dataset.max_tokens=2048",
                 "optimization.update_freq=[4]", "optimization.max_update=10"):
        assert item in cmd
    assert cmd[-1] == "common.fp16=true"
    assert "criterion.rdrop_alpha=0" in command(MODE="baseline")


def test_train_resumes_a_run_and_names_missing_inputs(command, tmp_path):
    (tmp_path / "s").mkdir()
    (tmp_path / "s" / "checkpoint_last.pt").write_bytes(b"")
    # a SAVE_DIR holding checkpoint_last.pt: resumed (fairseq's default), nothing reset
    cmd = command(BART_DIR=tmp_path / "nowhere")
    assert {"checkpoint.restore_file=checkpoint_last.pt", "checkpoint.reset_optimizer=false",
            "checkpoint.reset_dataloader=false", "checkpoint.reset_meters=false"} <= set(cmd)
    for env, message in [({"SAVE_DIR": tmp_path / "new", "BART_DIR": tmp_path / "nowhere"},
                          "nowhere/model.pt not found: BART_DIR must hold bart.large"),
                         ({"DATA_DIR": tmp_path / "none"},
                          "dict.source.txt not found: run: bash scripts/cnndm_bart.sh prepare")]:
        proc = script("cnndm_bart", "train", ok=False, **{
            "GPUS": 0, "DATA_DIR": tmp_path / "data", "SAVE_DIR": tmp_path / "s",
            "BART_DIR": tmp_path / "bart", **env})
        assert proc.returncode != 0 and message in proc.stderr, proc.stderr
