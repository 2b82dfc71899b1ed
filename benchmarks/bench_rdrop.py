"""Side-by-side cost of R-Drop: this plugin vs fairseq's upstream criterion vs the floor.

The floor is fairseq's plain ``label_smoothed_cross_entropy`` on the doubled batch: any
R-Drop implementation must compute at least that. Methods:

* ``floor``: ``label_smoothed_cross_entropy`` given ``[x; x]``;
* ``upstream``: fairseq's ``label_smoothed_cross_entropy_with_rdrop`` (alpha 5);
* ``ours-torch`` / ``ours-triton``: ``label_smoothed_cross_entropy_rdrop`` (alpha 5) with
  ``--rdrop-impl torch`` / ``triton`` (triton: CUDA only);
* ``ours-torch-separate`` (``loss`` only): ``ours-torch`` with the logits' gradient in a
  buffer of its own (``grad_in_scores=False``) where the criterion writes it into the
  logits (only with ``--projection``: leaf logits are never written);
* ``ours-fused-linear`` (``loss`` only, with ``--projection``): ``--rdrop-fused-linear``,
  the loss from the features and the projection's weight without the logits
  (``rdrop_fairseq.fused_linear``).

Two measurements, each method in a fresh subprocess (so that its peak memory is its own),
all methods of a row in one run, so that the ratios compare like with like:

* ``loss``: logits -> loss -> backward, N target tokens per pass (~20 % padding); with
  ``--projection D`` the logits are made in every method by an output projection from
  ``D``-dimensional features (counted in the peak), as in a decoder;
* ``step``: a whole training step (forward, loss, backward) of a fairseq transformer
  through the real criteria (on CUDA in fp16 or bf16, as users train).

Each reports the median time (CPU: wall clock; CUDA: CUDA events), the peak memory above
the inputs (CUDA: ``max_memory_allocated``; CPU: the resident set's high-water mark, taken
in a second run with glibc's mmap threshold fixed at 128 KiB, so that a freed tensor leaves
the resident set: with glibc's default, freed blocks under 32 MiB stay resident and the
peak depends on the order of allocations more than on what is alive), and the aten ops
the step dispatches (each at least one kernel launch on CUDA) and how many of them
synchronise the host with the GPU (``rdrop_fairseq.opcount``).

Usage::

    python benchmarks/bench_rdrop.py                       # CPU: loss at V = 10k/32k/50k, a step
    python benchmarks/bench_rdrop.py loss --vocab 32000 --tokens 4096 --threads 1
    python benchmarks/bench_rdrop.py loss --vocab 32000 --tokens 4096 --threads 1 \
        --projection 512 --methods floor ours-torch-separate ours-torch
    python benchmarks/bench_rdrop.py gpu --markdown gpu.md # the GPU benchmark (docs/benchmarks.md)
"""

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import time

PAD = 1
ALPHA = 5.0
EPS = 0.1
CRITERION_ARGS = {
    "floor": ["--criterion", "label_smoothed_cross_entropy"],
    "upstream": ["--criterion", "label_smoothed_cross_entropy_with_rdrop",
                 "--rdrop-alpha", str(ALPHA)],
    "ours-torch": ["--criterion", "label_smoothed_cross_entropy_rdrop",
                   "--rdrop-alpha", str(ALPHA), "--rdrop-impl", "torch"],
    "ours-triton": ["--criterion", "label_smoothed_cross_entropy_rdrop",
                    "--rdrop-alpha", str(ALPHA), "--rdrop-impl", "triton"],
}
# loss-mode variants of a criterion (not criterion options)
LOSS_ONLY_METHODS = ("ours-torch-separate", "ours-fused-linear")
# a transformer_iwslt_de_en-shaped model small enough for CPU tests of a step's op count
TINY_ARCH = ["--encoder-layers", "1", "--decoder-layers", "1", "--encoder-embed-dim", "16",
             "--decoder-embed-dim", "16", "--encoder-ffn-embed-dim", "16",
             "--decoder-ffn-embed-dim", "16", "--encoder-attention-heads", "2",
             "--decoder-attention-heads", "2", "--share-decoder-input-output-embed"]


def build_step(method, vocab, tokens, arch="transformer_iwslt_de_en", arch_args=(),
               device="cpu", dtype="float32", extra_args=(), seq_len=32):
    """A fairseq model, criterion and sample for one training step of ``method``.

    ``tokens`` target tokens per pass (the last 3 positions of each sentence padding); the
    floor gets the doubled batch, the R-Drop criteria double it themselves.
    """
    import torch
    from fairseq import options, tasks
    from fairseq.data import Dictionary
    from fairseq.dataclass.utils import convert_namespace_to_omegaconf

    import rdrop_fairseq  # noqa: F401  (registers the criteria)

    d = Dictionary()
    for i in range(vocab - len(d)):
        d.add_symbol(f"w{i}")
    args = options.parse_args_and_arch(options.get_training_parser(), [
        "/dev/null", "--task", "translation", "--arch", arch, "--label-smoothing", str(EPS),
        *(["--cpu"] if device == "cpu" else []), *arch_args, *CRITERION_ARGS[method],
        *extra_args,
    ])
    cfg = convert_namespace_to_omegaconf(args)
    task = tasks.get_task("translation")(cfg.task, d, d)
    torch.manual_seed(0)
    model = task.build_model(cfg.model).to(device=device, dtype=getattr(torch, dtype))
    criterion = task.build_criterion(cfg.criterion)
    model.train()
    rows = max(1, tokens // seq_len) * (2 if method == "floor" else 1)
    g = torch.Generator().manual_seed(1)
    src = torch.randint(4, vocab, (rows, seq_len), generator=g)
    tgt = torch.randint(4, vocab, (rows, seq_len), generator=g)
    tgt[:, -3:] = d.pad()
    prev = torch.cat([torch.full((rows, 1), d.eos()), tgt[:, :-1]], 1)
    sample = {
        "net_input": {"src_tokens": src.to(device), "src_lengths": torch.full((rows,), seq_len,
                                                                              device=device),
                      "prev_output_tokens": prev.to(device)},
        "target": tgt.to(device), "ntokens": int(tgt.ne(d.pad()).sum()), "nsentences": rows,
    }
    return model, criterion, sample


def count_step_ops(model, criterion, sample):
    """Ops and syncing ops of one step (after a first one: the criteria check once). A
    launch of the Triton kernel counts as one op, also where Triton's interpreter runs it
    as torch ops (CPU, TRITON_INTERPRET=1)."""
    from rdrop_fairseq.opcount import count_ops

    def step():
        model.zero_grad()
        loss, _, _ = criterion(model, sample)
        loss.backward()

    step()
    with count_ops() as ops, _kernel_launch_as_one_op(ops):
        step()
    return ops


@contextlib.contextmanager
def _kernel_launch_as_one_op(ops):
    module = sys.modules.get("rdrop_fairseq.triton_kernel")
    kernel = getattr(module, "_rdrop_rows_kernel", None)
    if kernel is None:
        yield
        return

    class OneLaunch:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                with ops.as_one("triton._rdrop_rows_kernel"):
                    return kernel[grid](*args, **kwargs)
            return launch

    module._rdrop_rows_kernel = OneLaunch()
    try:
        yield
    finally:
        module._rdrop_rows_kernel = kernel


def _loss_fn(method, dtype, impl=None):
    import torch
    import torch.nn.functional as F
    from fairseq.criterions.label_smoothed_cross_entropy import label_smoothed_nll_loss

    if method == "floor":
        def fn(logits, target):  # what fairseq's criterion does with get_normalized_probs
            lprobs = F.log_softmax(logits.float(), -1)
            return label_smoothed_nll_loss(lprobs, torch.cat([target, target]), EPS,
                                           ignore_index=PAD)[0]
    elif method == "upstream":
        from fairseq.criterions.label_smoothed_cross_entropy_with_rdrop import compute_kl_loss

        class LogSoftmaxModel:
            def get_normalized_probs(self, net_output, log_probs):
                logits = net_output[0].float()
                return F.log_softmax(logits, -1) if log_probs else F.softmax(logits, -1)

        model = LogSoftmaxModel()

        def fn(logits, target):  # RdropLabelSmoothedCrossEntropyCriterion.compute_loss
            lprobs = model.get_normalized_probs((logits,), log_probs=True)
            loss, _ = label_smoothed_nll_loss(lprobs, torch.cat([target, target]), EPS,
                                              ignore_index=PAD)
            pad_mask = target.unsqueeze(-1).eq(PAD)
            return loss + ALPHA * compute_kl_loss(model, (logits,), pad_mask)
    else:
        from rdrop_fairseq.core import rdrop_loss

        impl = method.split("-")[1]
        # as the criteria call it; "ours-torch-separate": the gradient in its own buffer
        into = False if method.endswith("-separate") else "auto"

        def fn(logits, target):
            return rdrop_loss(logits, target, alpha=ALPHA, epsilon=EPS, ignore_index=PAD,
                              impl=impl, grad_in_scores=into).total
    return fn


class _Clock:
    """Wall clock on CPU; CUDA events (and the allocator's peak) on CUDA."""

    def __init__(self, device):
        import torch

        self.torch, self.cuda = torch, device == "cuda"

    def reset_peak(self):
        if self.cuda:
            self.torch.cuda.synchronize()
            self.torch.cuda.reset_peak_memory_stats()
            self.base = self.torch.cuda.memory_allocated()
        else:
            self.base = _rss_kib("VmRSS") * 1024

    def peak_mib(self):
        if self.cuda:
            return (self.torch.cuda.max_memory_allocated() - self.base) / 2**20
        return (_rss_kib("VmHWM") * 1024 - self.base) / 2**20

    def time(self, fn, repeats):
        times = []
        for _ in range(repeats + 1):  # the first run warms up (and its peak counts)
            if self.cuda:
                start, end = (self.torch.cuda.Event(enable_timing=True) for _ in range(2))
                start.record()
                fn()
                end.record()
                self.torch.cuda.synchronize()
                times.append(start.elapsed_time(end) / 1e3)
            else:
                t0 = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t0)
        return statistics.median(times[1:] or times)


def run_loss(method, vocab, tokens, repeats, device="cpu", dtype="float32", projection=0):
    import torch
    import torch.nn.functional as F

    from rdrop_fairseq.opcount import count_ops

    torch.manual_seed(0)
    target = torch.randint(2, vocab, (tokens,), device=device)
    target[torch.rand(tokens, device=device) < 0.2] = PAD  # ~20 % padding
    if method == "ours-fused-linear" and not projection:
        raise ValueError("ours-fused-linear needs --projection D (it starts from features)")
    fn = None if method == "ours-fused-linear" else _loss_fn(method, dtype)
    if projection:  # logits made (and counted) in every method, as a decoder makes them
        features = torch.randn(2 * tokens, projection, device=device,
                               dtype=getattr(torch, dtype), requires_grad=True)
        weight = (torch.randn(vocab, projection, device=device) / projection ** 0.5).to(
            getattr(torch, dtype)).requires_grad_(True)

        if method == "ours-fused-linear":
            from rdrop_fairseq.fused_linear import fused_linear_rdrop_loss

            def step():
                features.grad = weight.grad = None
                fused_linear_rdrop_loss(features, weight, target, alpha=ALPHA, epsilon=EPS,
                                        ignore_index=PAD).total.backward()
        else:
            def step():
                features.grad = weight.grad = None
                fn(F.linear(features, weight), target).backward()
    else:
        logits = torch.randn(2 * tokens, vocab, device=device, dtype=getattr(torch, dtype),
                             requires_grad=True)

        def step():
            logits.grad = None
            fn(logits, target).backward()

    clock = _Clock(device)
    clock.reset_peak()
    seconds = clock.time(step, repeats)
    peak = clock.peak_mib()
    with count_ops() as ops:
        step()
    return {"time_s": seconds, "peak_mib": peak, "ops": ops.total, "syncs": ops.n_syncing}


def run_step(method, vocab, tokens, repeats, arch, device="cpu", dtype="float32"):
    model, criterion, sample = build_step(method, vocab, tokens, arch, device=device,
                                          dtype=dtype)

    def step():
        model.zero_grad(set_to_none=False)
        loss, _, _ = criterion(model, sample)
        loss.backward()

    step()  # gradients allocated before the memory baseline, as in training
    clock = _Clock(device)
    clock.reset_peak()
    seconds = clock.time(step, repeats)
    peak = clock.peak_mib()
    ops = count_step_ops(model, criterion, sample)
    return {"time_s": seconds, "peak_mib": peak, "ops": ops.total, "syncs": ops.n_syncing}


def _rss_kib(field):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def _in_subprocess(kind, **kw):
    result = _worker(kind, kw)
    if kw["device"] == "cpu" and "error" not in result:  # the peak, from a run of its own
        peak = _worker(kind, {**kw, "repeats": 0}, {"MALLOC_MMAP_THRESHOLD_": "131072"})
        result["peak_mib"] = peak.get("peak_mib", float("nan"))
    return result


def _worker(kind, kw, env=None):
    # the workers measure the rdrop_fairseq of this checkout, whatever is installed
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    path = os.pathsep.join(p for p in (repo, os.environ.get("PYTHONPATH")) if p)
    out = subprocess.run(
        [sys.executable, __file__, "_worker", json.dumps({"kind": kind, **kw})],
        capture_output=True, text=True, env={**os.environ, "PYTHONPATH": path, **(env or {})},
    )
    if out.returncode:
        return {"error": (out.stderr.strip().splitlines() or ["failed"])[-1]}
    return json.loads(out.stdout.strip().splitlines()[-1])


def _table(title, rows):
    """Markdown table: each row's ratios against the floor of its group."""
    lines = [f"\n### {title}\n",
             "| case | method | time (ms) | × floor | peak MiB | × floor | ops | syncs |",
             "|---|---|---|---|---|---|---|---|"]
    floor = {}
    for case, method, r in rows:
        if "error" in r:
            lines.append(f"| {case} | {method} | – | – | – | – | – | {r['error'][:60]} |")
            continue
        f = floor.setdefault(case, r)
        lines.append(
            f"| {case} | {method} | {r['time_s'] * 1e3:.1f} | {r['time_s'] / f['time_s']:.2f} "
            f"| {r['peak_mib']:.0f} | {r['peak_mib'] / max(f['peak_mib'], 1e-9):.2f} "
            f"| {r['ops']} | {r['syncs']} |")
    return "\n".join(lines)


def main():
    if len(sys.argv) > 2 and sys.argv[1] == "_worker":
        kw = json.loads(sys.argv[2])
        kind, threads = kw.pop("kind"), kw.pop("threads")
        import torch

        torch.set_num_threads(threads)
        print(json.dumps(run_loss(**kw) if kind == "loss" else run_step(**kw)))
        return

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("what", nargs="?", choices=["loss", "step", "all", "gpu"], default="all",
                   help="gpu: loss in fp16 and bf16 at V = 10k/32k/50k, 4096 and 8192 tokens "
                   "per pass, and fp16 steps of transformer_iwslt_de_en and "
                   "transformer_vaswani_wmt_en_de_big, on CUDA")
    p.add_argument("--device", choices=["cpu", "cuda"], default=None,
                   help="default: cuda for 'gpu', else cpu")
    p.add_argument("--dtype", nargs="+", default=None,
                   help="logits / model dtypes (default: float32 on CPU; gpu: float16 bfloat16)")
    p.add_argument("--vocab", type=int, nargs="+", default=[10000, 32000, 50000])
    p.add_argument("--tokens", type=int, nargs="+", default=None,
                   help="target tokens per pass (default 4096; gpu: 4096 8192)")
    p.add_argument("--step-arch", nargs="+", default=None,
                   help="default: transformer_iwslt_de_en (gpu: also the WMT big model)")
    p.add_argument("--step-vocab", type=int, default=None, help="default 10000 (gpu: 32000)")
    p.add_argument("--step-tokens", type=int, default=None, help="default 2048 (gpu: 4096)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=os.cpu_count())
    p.add_argument("--methods", nargs="+", default=None,
                   choices=list(CRITERION_ARGS) + list(LOSS_ONLY_METHODS))
    p.add_argument("--projection", type=int, default=0, metavar="D",
                   help="loss: make the logits from D-dim features by an output projection")
    p.add_argument("--markdown", help="also write the tables to this file")
    p.add_argument("--json", help="also write every measurement to this file")
    a = p.parse_args()
    gpu = a.what == "gpu"
    device = a.device or ("cuda" if gpu else "cpu")
    dtypes = a.dtype or (["float16", "bfloat16"] if gpu else ["float32"])
    tokens = a.tokens or ([4096, 8192] if gpu else [4096])
    methods = a.methods or (list(CRITERION_ARGS) if device == "cuda"
                            else ["floor", "upstream", "ours-torch"])
    common = dict(repeats=a.repeats, threads=a.threads, device=device)
    out = [f"device={device} threads={a.threads} repeats={a.repeats} (~20% padding in 'loss')"]
    print(out[0])
    measured = []
    if a.what in ("loss", "all", "gpu"):
        rows = []
        for dtype in dtypes:
            for n in tokens:
                for v in a.vocab:
                    for m in methods:
                        case = f"{dtype} V={v} N={n}" + (f" D={a.projection}"
                                                             if a.projection else "")
                        rows.append((case, m, _in_subprocess(
                            "loss", method=m, vocab=v, tokens=n, dtype=dtype,
                            projection=a.projection, **common)))
                        print(f"  loss {rows[-1][0]} {m}: {rows[-1][2]}", flush=True)
        out.append(_table("Loss alone: logits -> loss -> backward", rows))
        measured += [{"kind": "loss", "case": c, "method": m, **r} for c, m, r in rows]
    if a.what in ("step", "all", "gpu"):
        rows = []
        archs = a.step_arch or (["transformer_iwslt_de_en", "transformer_vaswani_wmt_en_de_big"]
                                if gpu else ["transformer_iwslt_de_en"])
        vocab = a.step_vocab or (32000 if gpu else 10000)
        step_tokens = a.step_tokens or (4096 if gpu else 2048)
        step_dtype = "float16" if device == "cuda" else "float32"
        for arch in archs:
            for m in (m for m in methods if m in CRITERION_ARGS):
                rows.append((f"{arch} {step_dtype} V={vocab} N={step_tokens}", m, _in_subprocess(
                    "step", method=m, vocab=vocab, tokens=step_tokens, arch=arch,
                    dtype=step_dtype, **common)))
                print(f"  step {rows[-1][0]} {m}: {rows[-1][2]}", flush=True)
        out.append(_table("A whole training step (forward, loss, backward)", rows))
        measured += [{"kind": "step", "case": c, "method": m, **r} for c, m, r in rows]
    text = "\n".join(out)
    print(text)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(measured, f, indent=1)
    if a.markdown:
        with open(a.markdown, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
