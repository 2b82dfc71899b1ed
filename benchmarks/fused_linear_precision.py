"""Precision of the fused-linear loss's gradients for bf16 and fp16 models, against float64.

For each case, the gradients of features, weight and bias (times a loss scale of 128, as
fairseq's fp16 training) from ``fused_linear_rdrop_loss`` and, for comparison, from the
unfused path (logits by ``F.linear`` in the model's dtype, ``core.rdrop_loss``, autograd's
product backward), each against the same computation in float64 on the same rounded
inputs (``core.rdrop_loss``'s torch path in float64: the definition, tested against
autograd of the formula in tests/test_core.py). Errors: norm-relative / largest entry's.

    python benchmarks/fused_linear_precision.py        # CPU: torch's bf16/fp16 products
"""


import torch
import torch.nn.functional as F

from rdrop_fairseq.core import rdrop_loss
from rdrop_fairseq.fused_linear import fused_linear_rdrop_loss
from rdrop_fairseq.recipes.common import parser_from_doc

PAD, ALPHA, EPS, SCALE = 1, 5.0, 0.1, 128.0


def inputs(n, vocab, dim, dtype, device):
    g = torch.Generator().manual_seed(0)
    base = torch.randn(n, dim, generator=g)  # pass 2: pass 1 plus dropout-like noise
    features = torch.cat([base, base + 0.3 * torch.randn(n, dim, generator=g)])
    weight = torch.randn(vocab, dim, generator=g) * dim ** -0.5
    bias = 0.1 * torch.randn(vocab, generator=g)
    target = torch.randint(2, vocab, (n,), generator=g)
    target[::7] = PAD
    return [t.to(device, dtype) for t in (features, weight, bias)], target.to(device)


def gradients(leaves, target, fused):
    leaves = [t.detach().requires_grad_() for t in leaves]
    if fused:
        out = fused_linear_rdrop_loss(*leaves[:2], target, bias=leaves[2], alpha=ALPHA,
                                      epsilon=EPS, ignore_index=PAD)
    else:
        out = rdrop_loss(F.linear(*leaves), target, alpha=ALPHA, epsilon=EPS,
                         ignore_index=PAD, impl="torch")
    return torch.autograd.grad(SCALE * out.total, leaves)


def errors(mine, exact):
    return "  ".join(
        f"{((m.double() - e).norm() / e.norm()).item():.2e}/"
        f"{((m.double() - e).abs().max() / e.abs().max()).item():.2e}"
        for m, e in zip(mine, exact))


def main():
    p = parser_from_doc(__doc__)
    p.add_argument("--device", default="cpu")
    p.add_argument("--cases", default="2048x4096x64,4096x32000x128", help="NxVxD,...")
    a = p.parse_args()
    torch.set_num_threads(1)
    print("gradient errors against float64, norm-relative/largest entry's: features  weight  bias")
    for dtype in (torch.bfloat16, torch.float16):
        for case in a.cases.split(","):
            n, vocab, dim = map(int, case.split("x"))
            leaves, target = inputs(n, vocab, dim, dtype, a.device)
            exact = gradients([t.double() for t in leaves], target, fused=False)
            for name, fused in (("fused-linear", True), ("unfused", False)):
                print(f"{str(dtype)[6:]:8s} N={n} V={vocab} D={dim} {name:12s} "
                      f"{errors(gradients(leaves, target, fused), exact)}", flush=True)


if __name__ == "__main__":
    main()
