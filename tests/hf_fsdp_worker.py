"""The processes of tests/test_hf_ddp.py's FSDP test: a tiny GPT-2 sharded with FSDP2
(``fully_shard`` on each block and the model: outside its forward the head's weight is a
DTensor shard), one R-Drop loss of this rank's 2 of 4 examples through :func:`rdrop_hf_loss`
with the item count of all 4 and the world size, then rank 0 writes the whole gradients.
Without torchrun: one unsharded process on all 4. Arguments: output path, "fused" or
"logits", and "checkpointing" for gradient checkpointing."""

import os
import sys

import torch
import torch.distributed as dist

from rdrop_fairseq import hf
from tests.tiny_hf_models import causal, examples


def gradients(fused, checkpointing):
    world = int(os.environ.get("WORLD_SIZE", 1))
    torch.manual_seed(0)
    model = causal()
    if checkpointing:
        model.gradient_checkpointing_enable()
    kind = hf.model_kind(model, fused_linear=fused)
    data = examples("causal")
    count = sum(hf.labelled_items(d["labels"], causal=True) for d in data)
    if world > 1:
        from torch.distributed.fsdp import fully_shard

        dist.init_process_group("gloo")
        for block in model.transformer.h:
            fully_shard(block)
        fully_shard(model)
        data = data[2 * dist.get_rank(): 2 * dist.get_rank() + 2]
    batch = {key: torch.stack([d[key] for d in data]) for key in data[0]}
    model.train()  # (dropout 0: every process's passes are the single process's)
    out = hf.rdrop_hf_loss(model, batch, kind=kind, alpha=1.0, fused_linear=fused,
                           num_items_in_batch=count, world_size=world)
    out.loss.backward()
    grads = {n: getattr(p.grad, "full_tensor", lambda g=p.grad: g)()
             for n, p in model.named_parameters() if p.grad is not None}
    sharded = type(model.lm_head.weight).__name__ == "DTensor"
    if world > 1:
        dist.destroy_process_group()
    return grads, sharded


if __name__ == "__main__":
    grads, sharded = gradients(sys.argv[2] == "fused", sys.argv[3:] == ["checkpointing"])
    if int(os.environ.get("RANK", 0)) == 0:
        torch.save({"grads": grads, "sharded": sharded}, sys.argv[1])
