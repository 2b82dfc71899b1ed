"""The process of tests/test_hf_ddp.py's CUDA test: one SGD step of RDropTrainer on a tiny
GPT-2 (4 examples) on a GPU, with the Trainer's own FSDP, version 1 or 2 (full sharding,
under torchrun: FSDP1 needs a GPU; FSDP2 also runs on CPU processes in
tests/test_hf_sharded.py), or without; writes the step's training loss and the eval_loss
after it. Arguments: output path, "fused" or "logits", "fsdp1", "fsdp2" or "plain"."""

import json
import sys
import warnings

import torch
from transformers import TrainingArguments

from rdrop_fairseq import hf
from tests.tiny_hf_models import causal, examples, fsdp_arguments

if __name__ == "__main__":
    out, fused = sys.argv[1], sys.argv[2] == "fused"
    fsdp = sys.argv[3] if sys.argv[3].startswith("fsdp") else None  # fsdp1, fsdp2
    args = TrainingArguments(
        output_dir=out + ".d", report_to="none", per_device_train_batch_size=4,
        per_device_eval_batch_size=2, max_steps=1, save_strategy="no", disable_tqdm=True,
        optim="sgd", learning_rate=0.5, max_grad_norm=0.0, logging_steps=1,
        **(fsdp_arguments(int(fsdp[-1]), ["GPT2Block"]) if fsdp else {}))
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = hf.RDropTrainer(model=causal(), args=args, train_dataset=examples("causal"),
                                  rdrop_alpha=1.0, rdrop_fused_linear=fused)
        loss = trainer.train().training_loss
        after = trainer.evaluate(examples("causal"))["eval_loss"]
    wrapped = type(trainer.model_wrapped).__name__
    if args.process_index == 0:
        with open(out, "w") as f:
            json.dump({"loss": loss, "eval_after": after, "wrapped": wrapped}, f)
