"""The processes of tests/test_hf_loop.py: docs/huggingface.md's loops of one's own, run
as written on a tiny GPT-2 (dropout off, so that processes and passes agree), an SGD
optimizer (learning rate 0.5) and a loader of the 4 examples of tests/tiny_hf_models.py
(the last two hold fewer labelled tokens), one batch of 4 // processes per process. The
model's parameters after the step are written by rank 0. Arguments: output path, then
"plain" (the first loop, one process) or "accelerate" (the second, under torchrun)."""

import os
import re
import sys
from pathlib import Path

import torch

from tests.tiny_hf_models import causal, examples

REPO = Path(__file__).resolve().parents[1]


def loops():
    """The Python blocks of the section "A loop of your own", in order."""
    doc = (REPO / "docs" / "huggingface.md").read_text(encoding="utf-8")
    section = doc[doc.index("## A loop of your own"):]
    section = section[:section.index("\n## ", 1)]
    return re.findall(r"```python\n(.*?)```", section, re.S)


def step(which):
    """The parameters after the loop ``which`` (0: plain, 1: Accelerate) has run."""
    torch.manual_seed(0)
    model = causal()
    model.train()
    data = examples("causal")
    loader = torch.utils.data.DataLoader(
        data, batch_size=len(data) // int(os.environ.get("WORLD_SIZE", 1)),
        collate_fn=lambda rows: {key: torch.stack([r[key] for r in rows]) for key in rows[0]})
    scope = {"model": model, "optimizer": torch.optim.SGD(model.parameters(), lr=0.5),
             "loader": loader}
    exec(compile(loops()[which], "docs/huggingface.md", "exec"), scope)
    trained = getattr(scope["model"], "module", scope["model"])  # (DDP's wrapper)
    return {n: p.detach().clone() for n, p in trained.named_parameters()}, scope


if __name__ == "__main__":
    parameters, scope = step({"plain": 0, "accelerate": 1}[sys.argv[2]])
    if int(os.environ.get("RANK", 0)) == 0:
        torch.save({"parameters": parameters,
                    "processes": getattr(scope.get("accelerator"), "num_processes", 1)},
                   sys.argv[1])
