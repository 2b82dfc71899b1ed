"""The processes of tests/test_hf_ddp.py's DeepSpeed tests: one SGD step of RDropTrainer on
4 examples under DeepSpeed ZeRO (torchrun, 2 CPU processes, gloo), after which rank 0
writes, per case, the update of every parameter (gathered whole under ZeRO-3), the step's
training loss and the eval_loss after it. Alone (no torchrun, no DeepSpeed), ``reference``
gives the same from one process on all 4 examples. Arguments: output folder, then cases
(CASES).

DeepSpeed runs on the CPU with its CPU accelerator (DS_ACCELERATOR=cpu). The Trainer hands
DeepSpeed no process-group backend, and without one accelerate takes a DeepSpeed run on a
machine without GPUs for a single process; so the state is configured here first with
gloo, and the Trainer told to use it (``use_configured_state``)."""

import os
import sys
import warnings

import torch
from transformers import TrainerCallback, TrainingArguments

from rdrop_fairseq import hf
from tests.hf_ddp_worker import causal, examples, seq2seq

# case: (ZeRO stage, model, fused path, gradient checkpointing, accumulation steps)
CASES = {"zero3-logits": (3, causal, False, False, 1),
         "zero3-fused": (3, causal, True, False, 1),
         "zero3-logits-checkpointing": (3, causal, False, True, 1),
         "zero3-fused-checkpointing": (3, causal, True, True, 1),
         "zero3-fused-accumulated": (3, causal, True, False, 2),
         "zero3-seq2seq-fused": (3, seq2seq, True, False, 1),
         "zero2-fused": (2, causal, True, False, 1),
         "zero3-unscaled": (3, causal, False, False, 1)}  # the mutation that must fail


class Unscaled(hf.RDropTrainer):
    """The mutation: the loss without its world-size scale."""

    def compute_loss(self, model, *a, **k):
        loss = super().compute_loss(model, *a, **k)
        return loss / self.args.world_size if model.training else loss


class HeadShard(TrainerCallback):
    """Whether the output embedding's weight is a shard (empty here) before the step's
    forward, as ZeRO-3 leaves it outside a module's call."""

    sharded = None

    def on_step_begin(self, args, state, control, model=None, **kwargs):
        HeadShard.sharded = model.get_output_embeddings().weight.numel() == 0


def _arguments(folder, processes, accumulation, checkpointing, **extra):
    return TrainingArguments(
        output_dir=folder, report_to="none", optim="sgd", learning_rate=0.5,
        per_device_train_batch_size=4 // processes // accumulation,
        gradient_accumulation_steps=accumulation, per_device_eval_batch_size=2, max_steps=1,
        save_strategy="no", disable_tqdm=True, max_grad_norm=0.0, logging_steps=1,
        gradient_checkpointing=checkpointing, **extra)


def _step(trainer_class, make, args, fused):
    """(the parameters before, the trainer, its training loss, eval_loss after the step)"""
    torch.manual_seed(0)
    model = make()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = trainer_class(model=model, args=args, train_dataset=examples(make.__name__),
                                rdrop_alpha=1.0, rdrop_fused_linear=fused,
                                callbacks=[HeadShard()])
        loss = trainer.train().training_loss
        after = trainer.evaluate(examples(make.__name__))["eval_loss"]
    return before, trainer, loss, after


def reference(folder, case):
    """One process, no DeepSpeed: {"update", "loss", "eval_after"}."""
    _, make, fused, checkpointing, _ = CASES[case]
    args = _arguments(os.path.join(folder, case), 1, 1, checkpointing, use_cpu=True)
    before, trainer, loss, after = _step(hf.RDropTrainer, make, args, fused)
    update = {n: p.detach() - before[n] for n, p in trainer.model.named_parameters()}
    return {"update": update, "loss": loss, "eval_after": after}


def run(folder, case):
    import deepspeed
    from accelerate.state import AcceleratorState

    stage, make, fused, checkpointing, accumulation = CASES[case]
    # every parameter partitioned (by default ZeRO-3 keeps those under 100k elements whole)
    config = {"zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
              "train_micro_batch_size_per_gpu": "auto",
              "gradient_accumulation_steps": "auto", "gradient_clipping": "auto",
              "zero_allow_untested_optimizer": True}  # the Trainer's SGD
    AcceleratorState._reset_state()  # each case's DeepSpeed plugin anew; the processes stay
    args = _arguments(os.path.join(folder, case), int(os.environ["WORLD_SIZE"]), accumulation,
                      checkpointing, deepspeed=config,
                      accelerator_config={"use_configured_state": True})
    before, trainer, loss, after = _step(Unscaled if case == "zero3-unscaled"
                                         else hf.RDropTrainer, make, args, fused)
    engine = trainer.model_wrapped
    assert type(engine).__name__ == "DeepSpeedEngine", type(engine)
    parameters = list(trainer.model.named_parameters())
    with deepspeed.zero.GatheredParameters([p for _, p in parameters]):  # on every rank
        update = {n: p.detach() - before[n] for n, p in parameters}
    if args.process_index == 0:
        torch.save({"update": update, "loss": loss, "eval_after": after,
                    "sharded": HeadShard.sharded},
                   os.path.join(folder, f"{case}.pt"))


if __name__ == "__main__":
    from accelerate.state import PartialState
    from deepspeed.comm import torch as deepspeed_torch

    # the shared-memory all-reduce DeepSpeed compiles for CPU inference (a C++ build of a
    # minute) is not used in training
    deepspeed_torch.build_shm_op = lambda: None
    os.environ["ACCELERATE_USE_DEEPSPEED"] = "true"
    PartialState(backend="gloo")
    for name in sys.argv[2:]:
        run(sys.argv[1], name)
