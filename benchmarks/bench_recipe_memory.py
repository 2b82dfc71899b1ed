"""Each recipe's GPU memory for one training step, against the cards it is run on.

For every recipe script (scripts/*.sh) this composes the recipe's hydra config with the
overrides the script itself passes (its ``DRY_RUN`` command for one GPU: the per-GPU
``max_tokens``, fp16, R-Drop's alpha), points ``task.data`` at a synthetic data-bin with
the recipe's dictionary sizes and sentences at the longest length the batches can hold
(the model's max positions, or ``max_tokens`` where that is shorter), builds fairseq's
``Trainer`` (fp16: its ``FP16Optimizer``, fp32 master weights and the optimizer's states)
and runs a warm-up ``train_step`` and a measured one on the batch fairseq's own batching
forms with the most tokens of the longest sentences. The R-Drop criteria run each batch
twice themselves, so the doubled batch is in the figure. Weights are random, no checkpoint
is loaded. One process, the recipes one after another; the figures are
``torch.cuda.max_memory_allocated`` (the peak of the measured step) and
``max_memory_reserved`` (what the caching allocator held), and, on any device, the bytes of
the model's and the optimizer's tensors at rest (``state_gib``, counted tensor by tensor).

Two points per recipe where the script can lower ``max_tokens`` (its paper value and half
of it): the scripts read them (benchmarks/results/recipe_memory.tsv) to say which cards a
batch fits and to lower ``MAX_TOKENS`` on smaller GPUs (scripts/lib/common.sh).

Usage::

    python benchmarks/bench_recipe_memory.py --json mem.json          # CUDA: every recipe
    python benchmarks/bench_recipe_memory.py --recipes iwslt14 --tiny  # toy model, any device
    python benchmarks/bench_recipe_memory.py record mem.json   # its rows into the table

``--tiny``: 1-layer, 16-wide models with 64 positions and a 256-word vocabulary, at the
scripts' max_tokens (batches of 64-token sentences). The suite runs it on the CPU, fp16
included: it checks the path, not the figures. A recipe that fails is reported and the
next one runs; the JSON is rewritten after each recipe, so a run cut short keeps its rows.
"""

import argparse
import datetime
import gc
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from dataclasses import dataclass, field
from pathlib import Path

from rdrop_fairseq.recipes.common import parser_from_doc

REPO = Path(__file__).resolve().parents[1]
TABLE = REPO / "benchmarks" / "results" / "recipe_memory.tsv"
COLUMNS = ["recipe", "max_tokens", "precision", "batch", "peak_gib", "reserved_gib",
           "state_gib", "params", "device", "date"]
GIB = 2 ** 30

TINY_TRANSLATION = ["model.encoder_layers=1", "model.decoder_layers=1",
                    "model.encoder_embed_dim=16", "model.decoder_embed_dim=16",
                    "model.encoder_ffn_embed_dim=32", "model.decoder_ffn_embed_dim=32",
                    "model.encoder_attention_heads=2", "model.decoder_attention_heads=2",
                    "++model.max_source_positions=64", "++model.max_target_positions=64",
                    "++task.max_source_positions=64", "++task.max_target_positions=64"]
TINY_LM = ["model.decoder_layers=1", "model.decoder_embed_dim=16", "model.decoder_input_dim=16",
           "model.decoder_output_dim=16", "model.decoder_ffn_embed_dim=32",
           "model.decoder_attention_heads=2", "task.tokens_per_sample=64"]
TINY_ENCODER = ["model.encoder_layers=1", "model.encoder_embed_dim=16",
                "model.encoder_ffn_embed_dim=32", "model.encoder_attention_heads=2",
                "task.max_positions=64", "++model.max_positions=64"]
TINY_VOCAB = 256


@dataclass
class Recipe:
    script: str  # scripts/SCRIPT.sh
    env: dict  # the script's variables for this recipe
    layout: str  # the data-bin: translation, lm or glue
    vocab: int  # the dictionary's length (specials included) the model is built with
    vocab_from: str  # where that size comes from
    halve: bool  # also measured at half the tokens (the scripts can lower max_tokens)
    tiny: list = field(default_factory=list)  # overrides for --tiny


RECIPES = {
    "iwslt14": Recipe(
        "iwslt14", {}, "translation", 10240,
        "IWSLT14 De-En's joint dictionary: 10,000 BPE merges (prepare_iwslt's default) plus "
        "the characters, rounded up to a multiple of 8; an estimate, not read from "
        "prepared data (10 % off would change the model's parameters by about 1.4 %)",
        True, TINY_TRANSLATION),
    "wmt14": Recipe(
        "wmt14", {}, "translation", 32768,
        "the authors' En-De data: fairseq-preprocess --nwordssrc 32768 --joined-dictionary "
        "(prepare_wmt14's Google data); En-Fr from prepare_wmt14's default 32k merges is "
        "about the same size", True, TINY_TRANSLATION),
    "wikitext103-gpt": Recipe(
        "wikitext103", {"ARCH": "gpt"}, "lm", 267744,
        "fairseq's WikiText-103 dictionary (267,744 with the specials)", True, TINY_LM),
    "wikitext103-adaptive": Recipe(
        "wikitext103", {"ARCH": "adaptive"}, "lm", 267744,
        "fairseq's WikiText-103 dictionary (267,744 with the specials)", False,
        TINY_LM + ["model.adaptive_input_cutoff='64,128'",
                   "model.adaptive_softmax_cutoff='64,128'"]),
    "cnndm_bart": Recipe(
        "cnndm_bart", {}, "translation", 50264,
        "bart.large's dict.txt (50,260 GPT-2 BPE ids) + 4 specials; BART's loading drops "
        "the checkpoint's <mask> row to match", True, TINY_TRANSLATION),
    "glue": Recipe(
        "glue", {"TASK": "MNLI"}, "glue", 50265,
        "GPT-2's dict.txt (50,260 ids) + 4 specials + sentence_prediction's <mask>: "
        "roberta.large's embedding rows", False, TINY_ENCODER),
}


# --------------------------------------------------------------------------- the config


def script_command(recipe, python=sys.executable, args=()):
    """The fairseq-hydra-train command (argv) the recipe's script prints for one GPU;
    ``args``: the train stage's arguments (hydra overrides)."""
    r = RECIPES[recipe]
    with tempfile.TemporaryDirectory() as tmp:
        # BART_DIR / ROBERTA_DIR given: the dry run fetches nothing
        # the recipe's defaults: none of the scripts' variables from this environment
        env = {k: v for k, v in os.environ.items() if k not in (
            "MAX_TOKENS", "UPDATE_FREQ", "MODE", "ALPHA", "RDROP_EVERY", "CPU", "BF16", "FP16",
            "NODES", "CUDA_VISIBLE_DEVICES", "SRC", "TGT", "PAIR", "GOOGLE", "ARCH", "TASK",
            "MAX_UPDATE")}
        env.update(r.env, DRY_RUN="1", GPUS="1", PYTHON=python, DATA_DIR=f"{tmp}/data",
                   SAVE_DIR=f"{tmp}/save", BART_DIR=f"{tmp}/bart", ROBERTA_DIR=f"{tmp}/roberta",
                   RECIPE_MEMORY="/dev/null")  # the table would change the split
        proc = subprocess.run(["bash", str(REPO / "scripts" / f"{r.script}.sh"), "train", *args],
                              capture_output=True, text=True, env=env, timeout=120)
    if proc.returncode != 0:
        raise RuntimeError(f"the dry run of scripts/{r.script}.sh failed: {proc.stderr[-2000:]}")
    commands = [shlex.split(line[2:]) for line in proc.stdout.splitlines()
                if line.startswith("+ ") and "--config-dir" in line]
    if len(commands) != 1:
        raise RuntimeError(f"scripts/{r.script}.sh printed {len(commands)} training commands")
    return commands[0]


def compose(command, data, extra=()):
    """fairseq's config from a training command, as fairseq-hydra-train composes it, with
    task.data replaced, one process (the per-GPU figure), and ``extra`` overrides."""
    from fairseq import utils
    from fairseq.dataclass.initialize import add_defaults, hydra_init
    from hydra import compose as hydra_compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from omegaconf import OmegaConf

    config_dir = command[command.index("--config-dir") + 1]
    name = command[command.index("--config-name") + 1]
    dropped = ("task.data=", "hydra.", "distributed_training.")
    overrides = [a for a in command if "=" in a and not a.startswith(("-", *dropped))]
    overrides += [f"task.data={data}", "distributed_training.distributed_world_size=1",
                  *extra]
    hydra_init(name)
    GlobalHydra.instance().clear()
    with warnings.catch_warnings():  # hydra 1.1 behaviour, as fairseq-hydra-train's
        warnings.simplefilter("ignore")
        with initialize_config_dir(config_dir=config_dir, version_base="1.1"):
            cfg = hydra_compose(config_name=name, overrides=overrides)
    # what fairseq_cli.hydra_train then fairseq_cli.train.main do with it: the plugin
    # imported from common.user_dir (not before: fairseq refuses a user dir whose module
    # name was imported from elsewhere), then add_defaults again, which leaves the config
    # open (the legacy models add keys to it)
    add_defaults(cfg)
    cfg = OmegaConf.create(OmegaConf.to_container(cfg, resolve=True, enum_to_str=True))
    OmegaConf.set_struct(cfg, True)
    utils.import_user_module(cfg.common)
    add_defaults(cfg)
    return cfg


# --------------------------------------------------------------------------- the data


def write_dictionary(path, size, symbols=None):
    """A dict.txt whose Dictionary has ``size`` entries (4 specials first); ``symbols``:
    the words instead (GLUE's labels)."""
    from fairseq.data import Dictionary

    path.parent.mkdir(parents=True, exist_ok=True)
    if symbols is None:
        symbols = [f"w{i}" for i in range(size - Dictionary().nspecial)]
    path.write_text("".join(f"{w} 1\n" for w in symbols))


def write_split(prefix, items, vocab):
    """fairseq's mmap data set (PREFIX.bin / .idx) holding ``items`` (token lists)."""
    import torch
    from fairseq.data import indexed_dataset

    builder = indexed_dataset.make_builder(f"{prefix}.bin", impl="mmap", vocab_size=vocab)
    for item in items:
        builder.add_item(torch.IntTensor(item))
    builder.finalize(f"{prefix}.idx")


def sentences(count, length, vocab, seed, eos=2, nspecial=4):
    """``count`` random sentences of ``length`` tokens, the last one </s>."""
    import torch

    g = torch.Generator().manual_seed(seed)
    body = torch.randint(nspecial, vocab, (count, length - 1), generator=g)
    return [row.tolist() + [eos] for row in body]


def write_dictionaries(data, recipe, cfg, vocab):
    """The data-bin's dictionaries, before the task is set up (it reads them)."""
    layout = RECIPES[recipe].layout
    if layout == "translation":
        for lang in (cfg.task.source_lang, cfg.task.target_lang):
            write_dictionary(data / f"dict.{lang}.txt", vocab)
    elif layout == "lm":
        write_dictionary(data / "dict.txt", vocab)
    else:  # sentence_prediction adds <mask> to input0's dictionary
        write_dictionary(data / "input0" / "dict.txt", vocab - 1)
        write_dictionary(data / "label" / "dict.txt", 0,
                         [str(c) for c in range(cfg.task.num_classes)])


def write_train(data, recipe, cfg, lengths, max_tokens, vocab):
    """The training split: enough sentences of each length in ``lengths`` (the longest the
    batches can hold at each measured max_tokens) for two full batches. Translation: one
    token shorter too, since truncate_source counts a sentence's </s> twice in its size
    (fairseq drops the longer ones there)."""
    layout = RECIPES[recipe].layout
    if layout == "translation":
        src, tgt = cfg.task.source_lang, cfg.task.target_lang
        items = []
        for seed, length in enumerate(sorted(set(lengths) | {n - 1 for n in lengths})):
            items += sentences(2 * (max_tokens // length) + 16, length, vocab, seed)
        for lang in (src, tgt):
            write_split(data / f"train.{src}-{tgt}.{lang}", items, vocab)
    elif layout == "lm":  # blocks of tokens_per_sample over the stream (break mode none)
        block = cfg.task.tokens_per_sample
        write_split(data / "train", sentences(2 * (max_tokens // block) + 4, block, vocab, 0),
                    vocab)
    else:  # input0 gets <s> prepended: one token short of the bound
        items = sentences(2 * (max_tokens // max(lengths)) + 16, max(lengths) - 1, vocab, 0)
        write_split(data / "input0" / "train", items, vocab)
        write_split(data / "label" / "train", [[4 + i % cfg.task.num_classes, 2]
                                               for i in range(len(items))], 8)


# --------------------------------------------------------------------------- the step


def state_bytes(trainer):
    """Bytes of the tensors a training run keeps between steps: the model's weights and
    gradients, and the optimizer's (fp16: its fp32 master weights and their gradients, and
    the states, e.g. Adam's two moments), each storage counted once."""
    import torch

    seen = {}

    def add(t):
        if torch.is_tensor(t) and t.numel():
            seen[(t.device, t.untyped_storage().data_ptr())] = t.untyped_storage().nbytes()

    optimizer = trainer.optimizer.optimizer  # the torch optimizer (fp16: over the masters)
    for group in optimizer.param_groups:
        for p in group["params"]:
            add(p)
            add(p.grad)
    for state in optimizer.state.values():
        for value in state.values():
            add(value)
    for p in trainer.model.parameters():
        add(p)
        add(p.grad)
    return sum(seen.values())


def batch_at(trainer, max_tokens):
    """The batch fairseq's batching forms at ``max_tokens`` with the longest sentences
    (then the most of them), collated as the training loop gets it (the loop's DataLoader
    workers are left out: they take seconds to stop). Among the batches whose sizes tie,
    the widest once collated (truncate_source's sizes count one token more than some
    sentences hold)."""
    trainer.cfg.dataset.max_tokens = max_tokens
    itr = trainer.get_train_iterator(epoch=1, load_dataset=False, disable_iterator_cache=True)
    dataset = itr.dataset

    def size(batch):
        return max(dataset.num_tokens(i) for i in batch), len(batch)

    largest = max(size(b) for b in itr.frozen_batches)
    tied = [b for b in itr.frozen_batches if size(b) == largest]
    samples = [dataset.collater([dataset[i] for i in b]) for b in tied]
    return max(samples, key=lambda s: (s["net_input"]["src_tokens"].shape[1],
                                       s["net_input"]["src_tokens"].numel(),
                                       s["target"].numel()))


def measure(recipe, tiny=False, device="cuda", python=sys.executable, log=print):
    """The recipe's rows: one per measured max_tokens."""
    import torch
    from fairseq import tasks, utils
    from fairseq.trainer import Trainer

    r = RECIPES[recipe]
    command = script_command(recipe, python)
    extra = list(r.tiny) if tiny else []
    if device == "cpu":
        extra.append("common.cpu=true")
    vocab = TINY_VOCAB if tiny else r.vocab
    rows = []
    baseline = torch.cuda.memory_allocated() if device == "cuda" else 0
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "data"
        cfg = compose(command, data, extra)
        max_tokens = cfg.dataset.max_tokens
        points = [max_tokens] + ([max_tokens // 2] if r.halve else [])
        precision = "fp16" if cfg.common.fp16 else "bf16" if cfg.common.bf16 else "fp32"
        write_dictionaries(data, recipe, cfg, vocab)
        utils.set_torch_seed(1)
        task = tasks.setup_task(cfg.task)
        model = task.build_model(cfg.model)
        criterion = task.build_criterion(cfg.criterion)
        bounds = utils.resolve_max_positions(task.max_positions(), model.max_positions())
        bound = min(b for b in (bounds if isinstance(bounds, tuple) else (bounds,)) if b)
        write_train(data, recipe, cfg, [min(bound, t) for t in points], max_tokens, vocab)
        trainer = Trainer(cfg, task, model, criterion)
        task.load_dataset(cfg.dataset.train_subset, epoch=1, combine=True)
        params = sum(p.numel() for p in model.parameters())
        cuda = trainer.cuda
        current_device = torch.cuda.current_device
        if not cuda and precision != "fp32":
            # fairseq's FP16Optimizer keys its flat fp32 copy by torch.cuda.current_device()
            # (CUDA's only path): on the CPU, index 0, so the same optimizer runs here
            torch.cuda.current_device = lambda: 0
        try:
            for tokens in points:
                rows.append(measure_step(trainer, recipe, tokens, precision, params, baseline,
                                         log))
        finally:
            torch.cuda.current_device = current_device
        del trainer, model, criterion, task
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return rows


def update(trainer, sample, what):
    """One train_step that updates the weights: fp16's loss scaler skips the update of a
    step whose gradients overflowed (no optimizer states are made then), so such a step is
    taken again. The overflowed steps, counted."""
    for overflows in range(8):
        before = trainer.get_num_updates()
        if trainer.train_step([sample]) is None:
            raise RuntimeError(f"the {what} step made no update (out of memory?)")
        if trainer.get_num_updates() > before:
            return overflows
    raise RuntimeError(f"the {what} step overflowed 8 times in a row")


def measure_step(trainer, recipe, tokens, precision, params, baseline, log):
    """A warm-up step and a measured one on the longest batch at ``tokens``: the row. The
    CUDA figures are above ``baseline``, the bytes allocated before the recipe's model was
    built (what an earlier recipe in this process left)."""
    import torch

    cuda = trainer.cuda
    sample = batch_at(trainer, tokens)
    sentences_, width = sample["net_input"]["src_tokens"].shape
    if cuda:  # the allocator's cache from an earlier, larger batch would count as reserved
        gc.collect()
        torch.cuda.empty_cache()
    start = time.perf_counter()
    overflows = update(trainer, sample, "warm-up")  # the optimizer's states are made here
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    overflows += update(trainer, sample, "measured")
    peak = reserved = None
    if cuda:
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - baseline
        reserved = torch.cuda.max_memory_reserved() - baseline
    seconds = round(time.perf_counter() - start, 2)
    kept = state_bytes(trainer)
    row = {"recipe": recipe, "max_tokens": tokens, "precision": precision,
           "batch": f"{sentences_}x{width}",
           "peak_gib": None if peak is None else round(peak / GIB, 3),
           "reserved_gib": None if reserved is None else round(reserved / GIB, 3),
           "state_gib": round(kept / GIB, 3), "params": params,
           "device": torch.cuda.get_device_name() if cuda else "cpu",
           "date": datetime.date.today().isoformat(), "state_bytes": kept,
           "peak_bytes": peak, "reserved_bytes": reserved,
           "baseline_gib": round(baseline / GIB, 3), "overflows": overflows, "seconds": seconds}
    log("\t".join(str(row[c]) for c in COLUMNS))
    return row


# --------------------------------------------------------------------------- the table


def read_table(path=TABLE):
    """The table's comment lines and its rows (``{column: text}``)."""
    comments, rows = [], []
    for line in Path(path).read_text().splitlines():
        if line.startswith("#") or not line.strip():
            comments.append(line)
        elif line.split("\t")[0] != "recipe":
            rows.append(dict(zip(COLUMNS, line.split("\t"))))
    return comments, rows


def record(results, path=TABLE):
    """Measured rows into the table: each replaces the row of its recipe, max_tokens and
    precision (or is added). Rows without a CUDA peak are refused: the table is the cards'."""
    comments, rows = read_table(path)
    for new in results:
        if new.get("peak_gib") is None:
            raise ValueError(f"{new['recipe']} at {new['max_tokens']}: no CUDA peak to record")
        new = {c: "-" if new.get(c) is None else str(new[c]) for c in COLUMNS}
        key = (new["recipe"], new["max_tokens"], new["precision"])
        rows = [r for r in rows if (r["recipe"], r["max_tokens"], r["precision"]) != key]
        rows.append(new)
    order = list(RECIPES)
    rows.sort(key=lambda r: (order.index(r["recipe"]) if r["recipe"] in order else len(order),
                             -int(r["max_tokens"]), r["precision"]))
    lines = comments + ["\t".join(COLUMNS)] + ["\t".join(r[c] for c in COLUMNS) for r in rows]
    Path(path).write_text("\n".join(lines) + "\n")


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["record"]:
        p = argparse.ArgumentParser(prog="bench_recipe_memory.py record",
                                    description="a run's rows (its --json, or gpu_check's "
                                                "bench_rdrop.json) into the table")
        p.add_argument("json", type=Path)
        p.add_argument("--table", type=Path, default=TABLE)
        a = p.parse_args(argv[1:])
        results = json.loads(a.json.read_text())
        results = results.get("recipe_memory", results)["rows"]
        record(results, a.table)
        print(f"{len(results)} rows into {a.table}")
        return 0
    p = parser_from_doc(__doc__)
    p.add_argument("--recipes", nargs="+", choices=list(RECIPES), default=list(RECIPES))
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--tiny", action="store_true", help="1-layer 16-wide models, 256 words")
    p.add_argument("--json", type=Path, help="the rows, as JSON")
    a = p.parse_args(argv)
    import torch

    if a.device == "cuda" and not torch.cuda.is_available():
        p.error("no CUDA device: --device cpu (with --tiny) runs the path on the CPU")
    print("\t".join(COLUMNS), flush=True)
    rows, failed = [], []
    for recipe in a.recipes:
        try:
            rows += measure(recipe, tiny=a.tiny, device=a.device,
                            log=lambda line: print(line, flush=True))
        except Exception as e:  # the next recipe still runs; the run fails at the end
            failed.append(recipe)
            print(f"{recipe}: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
            traceback.print_exc()
        gc.collect()  # a failed recipe's model, which its traceback held until here
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        if a.json:  # whole or not at all: a stage cut at its box leaves a readable file
            part = a.json.with_name(a.json.name + ".part")
            part.write_text(json.dumps({"rows": rows, "failed": failed}, indent=1))
            os.replace(part, a.json)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
