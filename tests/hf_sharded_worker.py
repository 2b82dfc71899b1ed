"""The processes of tests/test_hf_sharded.py: one SGD step of RDropTrainer on 4 examples
with the model sharded by the Trainer itself, under DeepSpeed ZeRO (its ``deepspeed=``
configuration) or FSDP2 (``fsdp=True`` with ``fsdp_config``, FSDP version 2), on torchrun's 2 CPU
processes (gloo); then rank 0 writes, per case, the update of every parameter (gathered
whole), the step's training loss, the eval_loss after it, and whether the output
embedding's weight was a shard before the step. Alone (no torchrun), ``reference`` gives
the same from one process on all 4 examples, unsharded. Arguments: output folder, then
cases (CASES).

Set up here, not by the Trainer: accelerate starts a process group only for GPUs (or, with
``use_cpu``, for plain DDP), and applies FSDP only to GPU processes. So the process state
is made first with gloo (under DeepSpeed through DeepSpeed's own communication, with its
CPU accelerator: DS_ACCELERATOR=cpu), the Trainer is told to use it
(``use_configured_state``), and for FSDP the state calls its processes GPU ones, which
makes accelerate apply its FSDP plugin; the model stays on the CPU."""

import gc
import os
import sys
import warnings
from collections import namedtuple

import torch
import transformers
from transformers import TrainerCallback, TrainingArguments

from rdrop_fairseq import hf
from tests.tiny_hf_models import Unscaled, causal, examples, fsdp_arguments, seq2seq

# a case: the sharding, the model, the fused path or not, gradient checkpointing or not,
# gradient accumulation steps; each sharding with both paths under gradient checkpointing,
# and without it through the accumulation, the Marian model and the mutations
Case = namedtuple("Case", "sharding make fused checkpointing accumulation")
CASES = {"zero3-logits-checkpointing": Case("zero3", causal, False, True, 1),
         "zero3-fused-checkpointing": Case("zero3", causal, True, True, 1),
         "zero3-fused-accumulated": Case("zero3", causal, True, False, 2),
         "zero3-seq2seq-fused": Case("zero3", seq2seq, True, False, 1),
         # DeepSpeed's bf16 (weights and products in bf16, float32 master weights)
         "zero3-fused-checkpointing-bf16": Case("zero3", causal, True, True, 1),
         "zero2-fused": Case("zero2", causal, True, False, 1),
         "fsdp2-logits-checkpointing": Case("fsdp2", causal, False, True, 1),
         "fsdp2-fused-checkpointing": Case("fsdp2", causal, True, True, 1),
         "fsdp2-fused-accumulated": Case("fsdp2", causal, True, False, 2),
         "zero3-unscaled": Case("zero3", causal, False, False, 1),  # the mutations that must fail
         "fsdp2-unscaled": Case("fsdp2", causal, False, False, 1)}
SHARDED = ("zero3", "fsdp2")  # the head's weight a shard outside the forward
# the Trainer's FSDP2 (fsdp_config "version": 2) as tested here: transformers 5; 4.x's
# Trainer makes FSDP1, which needs a GPU (tests/test_hf_ddp.py's CUDA test)
FSDP2_IN_THE_TRAINER = int(transformers.__version__.split(".")[0]) >= 5
RUNNABLE = [name for name, case in CASES.items()
            if case.sharding != "fsdp2" or FSDP2_IN_THE_TRAINER]


class HeadShard(TrainerCallback):
    """Whether the output embedding's weight is a shard before the step's forward: empty
    (ZeRO-3 outside a module's call) or a DTensor's part (FSDP2)."""

    sharded = None

    def on_step_begin(self, args, state, control, model=None, **kwargs):
        weight = model.get_output_embeddings().weight
        local = getattr(weight, "_local_tensor", weight)
        HeadShard.sharded = local.numel() < weight.shape.numel() or weight.numel() == 0


def _arguments(folder, processes, accumulation, checkpointing, **extra):
    return TrainingArguments(
        output_dir=folder, report_to="none", optim="sgd", learning_rate=0.5,
        per_device_train_batch_size=4 // processes // accumulation,
        gradient_accumulation_steps=accumulation, per_device_eval_batch_size=2, max_steps=1,
        save_strategy="no", disable_tqdm=True, max_grad_norm=0.0, logging_steps=1,
        average_tokens_across_devices=True,  # (the default from transformers 5 on)
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
    """One process, nothing sharded: {"update", "loss", "eval_after"}."""
    c = CASES[case]
    args = _arguments(os.path.join(folder, case), 1, 1, c.checkpointing, use_cpu=True)
    before, trainer, loss, after = _step(hf.RDropTrainer, c.make, args, c.fused)
    update = {n: p.detach() - before[n] for n, p in trainer.model.named_parameters()}
    return {"update": update, "loss": loss, "eval_after": after}


def _sharding(how, make):
    """TrainingArguments for the sharding, with the process state it needs."""
    from accelerate.state import AcceleratorState, PartialState
    from accelerate.utils import DistributedType

    AcceleratorState._reset_state()  # each case's plugin anew; the process group stays
    # the last case's, which accelerate and transformers leave in the environment (4.x's
    # TrainingArguments would take the last case's bf16 as its own)
    for flag in ("ACCELERATE_USE_DEEPSPEED", "ACCELERATE_USE_FSDP",
                 "ACCELERATE_MIXED_PRECISION"):
        os.environ.pop(flag, None)
    if how.startswith("zero"):
        PartialState().distributed_type = DistributedType.DEEPSPEED
        # every parameter partitioned (by default ZeRO-3 keeps those under 100k elements
        # whole); the Trainer's SGD is an optimizer DeepSpeed has not tested
        config = {"zero_optimization": {"stage": int(how[-1]),
                                        "stage3_param_persistence_threshold": 0},
                  "train_micro_batch_size_per_gpu": "auto", "gradient_clipping": "auto",
                  "gradient_accumulation_steps": "auto", "zero_allow_untested_optimizer": True}
        return {"deepspeed": config}
    PartialState().distributed_type = DistributedType.MULTI_GPU  # see the module's doc
    layers = {"causal": ["GPT2Block"], "seq2seq": ["MarianEncoderLayer", "MarianDecoderLayer"]}
    return fsdp_arguments(2, layers[make.__name__])


def _gathered(trainer, before):
    """Every parameter's update, whole (a collective: every rank calls it)."""
    import deepspeed

    parameters = list(trainer.model.named_parameters())
    with deepspeed.zero.GatheredParameters([p for _, p in parameters]):  # (ZeRO-3 only)
        return {n: getattr(p, "full_tensor", p.detach)().detach() - before[n]
                for n, p in parameters}


def run(folder, case):
    how, make, fused, checkpointing, accumulation = CASES[case]  # a Case
    sharding = _sharding(how, make)
    if case.endswith("bf16"):
        # (use_cpu: the Trainer takes bf16 without a GPU only on the CPU; the process state
        # stays DeepSpeed's)
        sharding["deepspeed"]["bf16"] = {"enabled": "auto"}
        sharding.update(bf16=True, use_cpu=True)
    args = _arguments(os.path.join(folder, case), int(os.environ["WORLD_SIZE"]), accumulation,
                      checkpointing, accelerator_config={"use_configured_state": True},
                      **sharding)
    before, trainer, loss, after = _step(Unscaled if case.endswith("unscaled")
                                         else hf.RDropTrainer, make, args, fused)
    wrapped = type(trainer.model_wrapped).__name__
    # FSDP2 makes the model's class an FSDP one: FSDPGPT2LMHeadModel
    assert (wrapped == "DeepSpeedEngine" if how.startswith("zero") else
            wrapped.startswith("FSDP")), wrapped
    update = _gathered(trainer, before)
    if args.process_index == 0:
        torch.save({"update": update, "loss": loss, "eval_after": after,
                    "sharded": HeadShard.sharded}, os.path.join(folder, f"{case}.pt"))
    # the case's engine taken down on every rank at the same point, not by the garbage
    # collector at a moment of each rank's own
    if hasattr(trainer.model_wrapped, "destroy"):
        trainer.model_wrapped.destroy()
    del trainer
    gc.collect()
    torch.distributed.barrier()


if __name__ == "__main__":
    from accelerate.state import PartialState
    from deepspeed.comm import torch as deepspeed_torch

    # the shared-memory all-reduce DeepSpeed compiles for CPU inference (a C++ build of a
    # minute) is not used in training
    deepspeed_torch.build_shm_op = lambda: None
    os.environ["ACCELERATE_USE_DEEPSPEED"] = "true"  # the group through DeepSpeed's comm
    PartialState(backend="gloo")
    del os.environ["ACCELERATE_USE_DEEPSPEED"]
    for name in sys.argv[2:]:
        run(sys.argv[1], name)
    torch.distributed.destroy_process_group()  # (run() ends each case at a barrier)
