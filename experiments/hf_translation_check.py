#!/usr/bin/env python
"""Real-data check of R-Drop for translation through Hugging Face: a small Marian-shaped
model (transformers' MarianMTModel) trained from scratch with Seq2SeqTrainer on the
LibreOffice help De->En data of the demo (scripts/demo.sh), a plain Seq2SeqTrainer
(baseline) against rdrop_fairseq.hf's RDropSeq2SeqTrainer (R-Drop), over seeds, beside the
demo's fairseq runs.

    python -m experiments.hf_translation_check --work work/hf-mt
    python -m experiments.hf_translation_check --work work/hf-mt --seeds 1 --epochs 2

The same as the demo (rdrop_fairseq.recipes.libreoffice_demo, its full size): the data (its
6,000 training pairs of at most 15 words a side, 300 validation pairs, the test pairs, Moses
tokens and a joint BPE of 3,000 merges, prepared by the demo's own code into WORK/data, its
joined dictionary); the model's size (2 + 2 layers, 192-dim embeddings, 4 heads, 768-dim
FFN, ReLU, post-norm, sinusoidal positions, embeddings scaled by sqrt(192) and shared by the
encoder, the decoder and the output); dropout 0.3 (none on attention and activations);
label smoothing 0.1; Adam (0.9, 0.98), eps 1e-8, decoupled weight decay 1e-4 on every
parameter, lr 2e-3, 400 linear warm-up updates then inverse square root decay, no
clipping; 18 epochs, the last 5 epochs' weights averaged and scored on test with beam 5
(length penalty 1, 200 tokens at most); R-Drop alpha 1 through the logits (as the demo's
criterion); one CPU thread a run, two runs at a time. Scores: tokenized BLEU (the demo's
metric: sacreBLEU on the Moses tokens, BPE removed) and sacreBLEU on the detokenised
output against the untouched references.

What differs: the model's code (transformers' Marian against fairseq's transformer: Marian
adds a bias to the logits, zero and never trained here); the batches: a fixed number of
pairs (as many batches an epoch as fairseq's 1,024-token batches make of the same data),
shuffled each epoch, not pairs of similar length up to 1,024 tokens; the label smoothing's
convention (eps / V on every class in transformers, eps / (V - 1) on the others in
fairseq); the warm-up (from 0 in the Trainer, from 1e-7 in fairseq); the decoder's first
input (`</s>`, as fairseq, instead of Marian's pad).

s / update: the training steps' own time (forward, backward, optimizer step), summed over
the run, divided by its updates.

Resumable: a finished run's result.json (WORK/runs/MODE-sSEED, beside its averaged
weights) is reused; an interrupted run goes on from its last epoch checkpoint. Writes
WORK/results.json and a table.
"""

import argparse
import json
import math
import os
import shutil
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path

import torch

from rdrop_fairseq.recipes.common import parser_from_doc

from .common import DecayAll, mode_rows, step_timer, train_in_process

MODES = ("baseline", "rdrop")
SEEDS = (1, 2)
DEMO = "full"  # libreoffice_demo's size
SRC, TGT = "de", "en"


def demo_size():
    from rdrop_fairseq.recipes.libreoffice_demo import SIZES
    return dict(SIZES[DEMO])


# --------------------------------------------------------------------------------- data

def load_split(data_bin, split):
    """``[(source ids, target ids)]`` of the demo's data-bin (each side ends in ``</s>``),
    and the joined dictionary."""
    from fairseq.data import Dictionary, data_utils
    dictionary = Dictionary.load(str(Path(data_bin) / f"dict.{SRC}.txt"))
    sides = [data_utils.load_indexed_dataset(str(Path(data_bin) / f"{split}.{SRC}-{TGT}.{lang}"),
                                             dictionary) for lang in (SRC, TGT)]
    if None in sides:
        sys.exit(f"error: no {split} split in {data_bin}: is it the demo's data-bin?")
    return [(sides[0][i], sides[1][i]) for i in range(len(sides[0]))], dictionary


def fairseq_batches(pairs, max_tokens):
    """How many batches fairseq-train makes of ``pairs`` with ``--max-tokens``."""
    from fairseq.data import data_utils
    import numpy as np
    sizes = np.array([max(len(s), len(t)) for s, t in pairs])
    order = np.lexsort((sizes,))
    return len(data_utils.batch_by_size(order, lambda i: sizes[i], max_tokens=max_tokens,
                                        required_batch_size_multiple=8))


def examples(pairs):
    return [{"input_ids": s, "labels": t} for s, t in pairs]


def collate(batch, pad, eos):
    """Sources and targets padded to their longest; the decoder's input is the target
    shifted right after ``</s>`` (fairseq's prev_output_tokens); padding labelled -100."""
    n, src_len, tgt_len = (len(batch), max(len(e["input_ids"]) for e in batch),
                           max(len(e["labels"]) for e in batch))
    ids = torch.full((n, src_len), pad, dtype=torch.long)
    labels = torch.full((n, tgt_len), -100, dtype=torch.long)
    decoder = torch.full((n, tgt_len), pad, dtype=torch.long)
    for i, e in enumerate(batch):
        s, t = e["input_ids"], e["labels"]
        ids[i, :len(s)], labels[i, :len(t)] = s, t
        decoder[i, 0], decoder[i, 1:len(t)] = eos, t[:-1]
    return {"input_ids": ids, "attention_mask": ids.ne(pad).long(), "labels": labels,
            "decoder_input_ids": decoder}


# -------------------------------------------------------------------------------- train

def make_model(dictionary, seed, size):
    from transformers import MarianConfig, MarianMTModel, set_seed
    set_seed(seed)
    d, ffn, layers = size["dim"], size["ffn"], size["layers"]
    config = MarianConfig(
        vocab_size=len(dictionary), d_model=d, encoder_layers=layers, decoder_layers=layers,
        encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=ffn,
        decoder_ffn_dim=ffn, activation_function="relu", dropout=0.3, attention_dropout=0.0,
        activation_dropout=0.0, max_position_embeddings=256, scale_embedding=True,
        share_encoder_decoder_embeddings=True, tie_word_embeddings=True,
        pad_token_id=dictionary.pad(), eos_token_id=dictionary.eos(),
        decoder_start_token_id=dictionary.eos(), forced_eos_token_id=None,
        bos_token_id=dictionary.bos())
    return MarianMTModel(config)


def keep_last_epochs(folder, count):
    """A TrainerCallback writing each epoch's weights to ``folder``/epochN.pt and keeping the
    last ``count`` (their average is the scored model)."""
    from transformers import TrainerCallback

    class KeepLastEpochs(TrainerCallback):
        def on_epoch_end(self, args, state, control, model=None, **kwargs):
            epoch = int(round(state.epoch))
            folder.mkdir(parents=True, exist_ok=True)
            torch.save(model.state_dict(), folder / f".epoch{epoch}.pt.tmp")
            os.replace(folder / f".epoch{epoch}.pt.tmp", folder / f"epoch{epoch}.pt")
            for old in epoch_files(folder)[:-count]:
                old.unlink()

    return KeepLastEpochs()


def epoch_files(folder):
    return sorted(Path(folder).glob("epoch*.pt"), key=lambda p: int(p.stem[5:]))


def average(files):
    """The element-wise mean of the state dicts in ``files`` (fairseq's
    average_checkpoints)."""
    states = [torch.load(f, map_location="cpu") for f in files]
    return {k: sum(s[k].double() for s in states).div(len(states)).to(states[0][k].dtype)
            if states[0][k].is_floating_point() else states[0][k] for k in states[0]}


@torch.no_grad()
def translate(model, pairs, dictionary, beam=5, batch_size=32, max_length=200):
    """Beam-search translations of the sources of ``pairs``, as Moses tokens (BPE removed)."""
    model.eval()
    pad, out = dictionary.pad(), []
    for i in range(0, len(pairs), batch_size):
        sources = [s for s, _ in pairs[i:i + batch_size]]
        ids = torch.full((len(sources), max(map(len, sources))), pad, dtype=torch.long)
        for row, s in enumerate(sources):
            ids[row, :len(s)] = s
        generated = model.generate(input_ids=ids, attention_mask=ids.ne(pad).long(),
                                   num_beams=beam, length_penalty=1.0, max_length=max_length,
                                   early_stopping=True)
        for row in generated:
            out.append(dictionary.string(row[1:], bpe_symbol="@@ ",
                                         extra_symbols_to_ignore={dictionary.pad()}))
    return out


def train_one(a):
    """One run (``--run MODE SEED``): train, average the last epochs, translate the test
    set and score it; RUN/result.json."""
    from transformers import Seq2SeqTrainer, Seq2SeqTrainingArguments

    from rdrop_fairseq.hf import RDropSeq2SeqTrainer
    from rdrop_fairseq.recipes.common import write_json  # atomic: whole or not at all
    from rdrop_fairseq.recipes.evaluate_translation import score
    torch.set_num_threads(1)
    size = demo_size()
    mode, seed = a.run[0], int(a.run[1])
    run_dir = Path(a.work) / "runs" / f"{mode}-s{seed}"
    data = Path(a.data)
    train, dictionary = load_split(data / "bin", "train")
    test, _ = load_split(data / "bin", "test")
    batches = fairseq_batches(train, size["tokens"])
    batch_size = round(len(train) / batches)
    model = make_model(dictionary, seed, size)
    args = Seq2SeqTrainingArguments(
        output_dir=str(run_dir / "trainer"), use_cpu=True, seed=seed, data_seed=seed,
        num_train_epochs=a.epochs, per_device_train_batch_size=batch_size,
        learning_rate=size["lr"], lr_scheduler_type="inverse_sqrt",
        warmup_steps=size["warmup"], optim="adamw_torch", adam_beta1=0.9, adam_beta2=0.98,
        adam_epsilon=1e-8, weight_decay=1e-4, max_grad_norm=0.0, label_smoothing_factor=0.1,
        eval_strategy="no", save_strategy="epoch", save_total_limit=1,
        logging_strategy="epoch", report_to="none", disable_tqdm=True,
        dataloader_num_workers=0)
    timer, keep = step_timer(), keep_last_epochs(run_dir / "epochs", size["average"])
    common = dict(model=model, args=args, train_dataset=examples(train),
                  data_collator=partial(collate, pad=dictionary.pad(), eos=dictionary.eos()),
                  callbacks=[timer, keep])
    if mode == "rdrop":
        trainer = type("RDropTrainerDecayAll", (DecayAll, RDropSeq2SeqTrainer), {})(
            **common, rdrop_alpha=a.alpha)
    else:
        trainer = type("TrainerDecayAll", (DecayAll, Seq2SeqTrainer), {})(**common)
    checkpoints = sorted((run_dir / "trainer").glob("checkpoint-*"),
                         key=lambda p: int(p.name.split("-")[1]))
    resume = str(checkpoints[-1]) if checkpoints else None
    start = time.perf_counter()
    trainer.train(resume_from_checkpoint=resume)
    minutes = (time.perf_counter() - start) / 60
    files = epoch_files(run_dir / "epochs")
    model.load_state_dict(average(files))
    hyps = translate(model, test, dictionary, max_length=a.max_length)
    refs = (data / "tok" / f"test.{TGT}").read_text(encoding="utf-8").splitlines()
    raw_refs = (data / "raw" / f"test.{TGT}").read_text(encoding="utf-8").splitlines()
    _, tokenized = score("tokenized", hyps, refs, TGT)
    line, sacre = score("sacrebleu", hyps, refs, TGT, original_refs=raw_refs)
    (run_dir / "test.hyp").write_text("\n".join(hyps) + "\n", encoding="utf-8")
    torch.save(model.state_dict(), run_dir / "averaged.pt")
    result = {"run": f"{mode}-s{seed}", "mode": mode, "seed": seed,
              **({"alpha": a.alpha} if mode == "rdrop" else {}), "epochs": a.epochs,
              "averaged": [f.name for f in files], "batch_size": batch_size,
              "fairseq_batches_per_epoch": batches, "updates": trainer.state.global_step,
              "updates_timed": timer.updates,
              "seconds_per_update": timer.seconds / max(timer.updates, 1),
              "resumed_from": resume, "train_minutes": minutes,
              "test_bleu_tokenized": tokenized, "test_sacrebleu": sacre, "sacrebleu": line,
              "test_sentences": len(hyps),
              "train_loss": [h["loss"] for h in trainer.state.log_history if "loss" in h]}
    write_json(run_dir / "result.json", result)
    shutil.rmtree(run_dir / "trainer", ignore_errors=True)
    print(f"[hf-mt] {result['run']}: test BLEU {tokenized:.2f} tokenized, {sacre:.2f} "
          f"sacreBLEU; {result['seconds_per_update']:.3f} s/update", flush=True)


# ---------------------------------------------------------------------------- the check

def run_in_process(a, mode, seed):
    """One run in a process of its own, on one thread; its result."""
    run_dir = Path(a.work) / "runs" / f"{mode}-s{seed}"
    result = run_dir / "result.json"
    if result.is_file():
        print(f"[hf-mt] {mode}-s{seed}: done before, reused", flush=True)
        return json.loads(result.read_text())
    run_dir.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "experiments.hf_translation_check", "--work", str(a.work),
           "--data", str(a.data), "--run", mode, str(seed), "--epochs", str(a.epochs),
           "--alpha", str(a.alpha), "--max-length", str(a.max_length)]
    return train_in_process("hf-mt", f"{mode}-s{seed}", run_dir, cmd)


def table(results):
    lines = ["| run | test BLEU (tokenized) | sacreBLEU | s / update |", "|---|---|---|---|"]
    for r in results:
        lines.append(f"| {r['run']} | {r['test_bleu_tokenized']:.2f} | "
                     f"{r['test_sacrebleu']:.2f} | {r['seconds_per_update']:.3f} |")
    return "\n".join(lines + mode_rows(results, MODES, (
        ("test_bleu_tokenized", 2), ("test_sacrebleu", 2), ("seconds_per_update", 3))))


def parse_args(argv):
    p = parser_from_doc(__doc__)
    p.add_argument("--work", default=os.environ.get("WORK"),
                   help="working directory: WORK/data, WORK/runs, WORK/results.json")
    p.add_argument("--data", help="the demo's prepared data (libreoffice_demo's OUT/data, "
                                  "made with its full size; default: prepared into WORK/data)")
    p.add_argument("--seeds", type=int, nargs="+", default=list(SEEDS))
    p.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    p.add_argument("--alpha", type=float, default=demo_size()["alpha"],
                   help="default: the demo's, %(default)s")
    p.add_argument("--epochs", type=int, default=demo_size()["epochs"],
                   help="default: the demo's, %(default)s")
    p.add_argument("--max-length", type=int, default=200,
                   help="the longest translation, in tokens (default: fairseq-generate's, "
                        "%(default)s)")
    p.add_argument("--jobs", type=int, default=2, help="runs at a time (default: %(default)s)")
    p.add_argument("--run", nargs=2, metavar=("MODE", "SEED"), help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if not a.work:
        p.error("--work (or $WORK) is required")
    if a.jobs < 1 or a.epochs < 1 or a.max_length < 2:
        p.error("--jobs and --epochs must be at least 1, --max-length at least 2")
    if not (a.alpha >= 0 and math.isfinite(a.alpha)):
        p.error(f"--alpha must be a finite number >= 0, not {a.alpha}")
    if a.data and not (Path(a.data) / "bin" / f"dict.{SRC}.txt").is_file():
        p.error(f"--data {a.data} has no bin/dict.{SRC}.txt: it is the demo's prepared data "
                "(its OUT/data)")
    return a


def main(argv=None):
    a = parse_args(sys.argv[1:] if argv is None else argv)
    if a.run:
        return train_one(a)
    work = Path(a.work)
    work.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    if not a.data:
        from rdrop_fairseq.recipes.libreoffice_demo import prepare
        a.data = str(prepare(work / "data", demo_size()).parent)
    # both R-Drop runs first: they take longest
    jobs = [(mode, seed) for mode in sorted(a.modes, key=lambda m: m != "rdrop")
            for seed in a.seeds]
    with ThreadPoolExecutor(max_workers=a.jobs) as pool:
        results = list(pool.map(lambda job: run_in_process(a, *job), jobs))
    results.sort(key=lambda r: (MODES.index(r["mode"]), r["seed"]))
    md = table(results)
    print("\n" + md + "\n", flush=True)
    from rdrop_fairseq.recipes.common import write_json
    report = {"data": a.data, "demo_size": demo_size(), "seeds": a.seeds, "modes": a.modes,
              "epochs": a.epochs, "alpha": a.alpha, "runs": results, "table": md,
              "total_minutes": (time.monotonic() - start) / 60}
    write_json(work / "results.json", report)
    print(f"[hf-mt] {work / 'results.json'}; {report['total_minutes']:.1f} minutes", flush=True)


if __name__ == "__main__":
    main()
