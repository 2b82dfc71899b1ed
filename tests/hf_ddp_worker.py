"""The processes of tests/test_hf_ddp.py: one RDropTrainer step on 4 examples per case, with
the Trainer's defaults for DDP, after which rank 0 writes the gradient the optimizer would
apply (unclipped) and the eval_loss of the same 4 examples. Under torchrun (gloo, CPU)
each of 2 ranks takes 2 examples; alone (no torchrun) one process takes all 4. Arguments:
output folder, then cases (CASES); "unscaled" runs the mutation that must fail. Evaluation
takes batches of 2 either way: the Trainer averages the batches' mean losses, so one
process sees the batches the ranks see."""

import os
import re
import sys
import warnings
from pathlib import Path

import torch
from transformers import (BertConfig, BertForSequenceClassification, GPT2Config,
                          GPT2LMHeadModel, MarianConfig, MarianMTModel, TrainerCallback,
                          TrainingArguments)

from rdrop_fairseq import hf

REPO = Path(__file__).resolve().parents[1]


def child_env(*folders, **extra):
    """The environment of a torchrun launched by a test: the repository first on the path,
    then ``folders``, then the test's own path (the floor's packages, in
    tests/test_transformers_floor.py)."""
    path = os.pathsep.join([str(REPO), *map(str, folders),
                            *filter(None, [os.environ.get("PYTHONPATH")])])
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": path, **extra}


def torchrun(worker, *args, env):
    """Run ``tests/<worker>`` under torchrun on 2 processes; assert that it succeeded,
    showing what it said otherwise (:func:`failure`)."""
    import subprocess

    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
         "2", f"tests/{worker}", *map(str, args)], cwd=REPO, env=env, capture_output=True,
        text=True, timeout=300)
    assert proc.returncode == 0, failure(proc)


def failure(proc):
    """What a failed torchrun said: the lines naming an error or a signal first (a parent
    run that shows only its end still shows them), then the ends of its output."""
    lines = (proc.stdout + proc.stderr).splitlines()
    errors = [line for line in lines if re.search(r"Error|error:|terminate|Signal|abort",
                                                  line)]
    return "\n".join([*errors[-20:], proc.stdout[-2000:], proc.stderr[-2000:]])


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


# case: (model, fused path, gradient accumulation steps[, TrainingArguments besides])
CASES = {"causal": (causal, False, 1), "causal-fused": (causal, True, 1),
         "causal-accumulated": (causal, False, 2), "seq2seq-fused": (seq2seq, True, 1),
         "classifier": (classifier, False, 1), "unscaled": (causal, False, 1),
         # each process divides by its own count, as the Trainer does: rank r takes the
         # examples 2r and 2r + 1 in order
         "causal-own-counts": (causal, False, 1, {"average_tokens_across_devices": False})}


class SaveGradient(TrainerCallback):
    def __init__(self, out):
        self.out = out

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        if args.process_index == 0:
            torch.save({n: p.grad.clone() for n, p in model.named_parameters()
                        if p.grad is not None}, self.out)


class Unscaled(hf.RDropTrainer):
    """The mutation: the loss without its world-size scale."""

    def compute_loss(self, model, *a, **k):
        loss = super().compute_loss(model, *a, **k)
        return loss / self.args.world_size if model.training else loss


class InOrder(hf.RDropTrainer):
    """The examples in order (transformers 5's train_sampling_strategy="sequential", which
    4.x lacks)."""

    def _get_train_sampler(self, *args, **kwargs):
        return torch.utils.data.SequentialSampler(self.train_dataset)


def run(folder, case):
    make, fused, accumulation, *extra = CASES[case]
    processes = int(os.environ.get("WORLD_SIZE", 1))
    args = TrainingArguments(**{
        "output_dir": os.path.join(folder, case), "use_cpu": True, "report_to": "none",
        "per_device_train_batch_size": 4 // processes // accumulation,
        "gradient_accumulation_steps": accumulation, "per_device_eval_batch_size": 2,
        "max_steps": 1, "save_strategy": "no", "disable_tqdm": True, "learning_rate": 0.0,
        "max_grad_norm": 0.0, "logging_steps": 1,  # unclipped: clipping would hide a scale
        "average_tokens_across_devices": True,  # (the default from transformers 5 on)
        "ddp_backend": "gloo" if processes > 1 else None, **(extra[0] if extra else {})})
    torch.manual_seed(0)
    model = make()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = {"unscaled": Unscaled, "causal-own-counts": InOrder}.get(
            case, hf.RDropTrainer)(
            model=model, args=args, train_dataset=examples(make.__name__),
            rdrop_alpha=1.0, rdrop_fused_linear=fused,
            callbacks=[SaveGradient(os.path.join(folder, f"{case}.pt"))])
        trainer.train()
        loss = trainer.evaluate(examples(make.__name__))["eval_loss"]
    logged = next(e for e in trainer.state.log_history if "rdrop_ce" in e)
    if args.process_index == 0:
        with open(os.path.join(folder, f"{case}.eval"), "w") as f:
            f.write(repr((loss, logged["rdrop_ce"], logged["rdrop_kl"])))


if __name__ == "__main__":
    for name in sys.argv[2:]:
        run(sys.argv[1], name)
