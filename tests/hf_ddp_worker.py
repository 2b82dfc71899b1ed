"""The processes of tests/test_hf_ddp.py: one RDropTrainer step on 4 examples per case, with
the Trainer's defaults for DDP, after which rank 0 writes the gradient the optimizer would
apply (unclipped) and the eval_loss of the same 4 examples. Under torchrun (gloo, CPU)
each of 2 ranks takes 2 examples; alone (no torchrun) one process takes all 4. Arguments:
output folder, then cases (CASES); "unscaled" runs the mutation that must fail. Evaluation
takes batches of 2 either way: the Trainer averages the batches' mean losses, so one
process sees the batches the ranks see."""

import os
import sys
import warnings
from collections import namedtuple

import torch
from transformers import TrainerCallback, TrainingArguments

from rdrop_fairseq import hf
from tests.tiny_hf_models import Unscaled, causal, classifier, examples, seq2seq

# a case: the model, the fused path or not, gradient accumulation steps, TrainingArguments
# besides the worker's, and rdrop_every
Case = namedtuple("Case", "make fused accumulation extra every", defaults=({}, 1))
CASES = {"causal": Case(causal, False, 1), "causal-fused": Case(causal, True, 1),
         "causal-accumulated": Case(causal, False, 2), "seq2seq-fused": Case(seq2seq, True, 1),
         "classifier": Case(classifier, False, 1), "unscaled": Case(causal, False, 1),
         # each process divides by its own count, as the Trainer does: rank r takes the
         # examples 2r and 2r + 1 in order
         "causal-own-counts": Case(causal, False, 1, {"average_tokens_across_devices": False}),
         # rdrop_every 2: update 0 runs R-Drop, update 1 (the gradient saved last: the
         # learning rate is 0) one pass; every micro-batch and both processes must agree
         "causal-every-2": Case(causal, False, 2, {"max_steps": 2}, 2)}


class SaveGradient(TrainerCallback):
    def __init__(self, out):
        self.out = out

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        if args.process_index == 0:
            torch.save({n: p.grad.clone() for n, p in model.named_parameters()
                        if p.grad is not None}, self.out)


class InOrder(hf.RDropTrainer):
    """The examples in order (transformers 5's train_sampling_strategy="sequential", which
    4.x lacks)."""

    def _get_train_sampler(self, *args, **kwargs):
        return torch.utils.data.SequentialSampler(self.train_dataset)


def run(folder, case):
    make, fused, accumulation, extra, every = CASES[case]
    processes = int(os.environ.get("WORLD_SIZE", 1))
    args = TrainingArguments(**{
        "output_dir": os.path.join(folder, case), "use_cpu": True, "report_to": "none",
        "per_device_train_batch_size": 4 // processes // accumulation,
        "gradient_accumulation_steps": accumulation, "per_device_eval_batch_size": 2,
        "max_steps": 1, "save_strategy": "no", "disable_tqdm": True, "learning_rate": 0.0,
        "max_grad_norm": 0.0, "logging_steps": 1,  # unclipped: clipping would hide a scale
        "average_tokens_across_devices": True,  # (the default from transformers 5 on)
        "ddp_backend": "gloo" if processes > 1 else None, **extra})
    torch.manual_seed(0)
    model = make()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = {"unscaled": Unscaled, "causal-own-counts": InOrder}.get(
            case, hf.RDropTrainer)(
            model=model, args=args, train_dataset=examples(make.__name__),
            rdrop_alpha=1.0, rdrop_fused_linear=fused, rdrop_every=every,
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
