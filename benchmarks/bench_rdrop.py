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
* ``ours-fused-linear`` / ``ours-fused-linear-torch`` (``loss`` only, with
  ``--projection``): ``--rdrop-fused-linear``, the loss from the features and the
  projection's weight without the logits (``rdrop_fairseq.fused_linear``), with
  ``impl="auto"`` (the Triton kernel on CUDA, torch ops elsewhere) / ``impl="torch"``;
  ``--fused-chunk-mb MB ...`` adds ``ours-fused-linear:MB`` rows (``--rdrop-chunk-mb MB``,
  the row pairs per chunk in the table).

Two measurements, all methods of a row in one run, so that the ratios compare like with
like; on CPU each method in a fresh subprocess (so that its peak memory is its own), on
CUDA all in this process by default (``--one-process``: the allocator's peak is reset per
method, and fairseq is imported once):

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

from rdrop_fairseq.recipes.common import parser_from_doc

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
LOSS_ONLY_METHODS = ("ours-torch-separate", "ours-fused-linear", "ours-fused-linear-torch")
# a transformer_iwslt_de_en-shaped model small enough for CPU tests of a step's op count
TINY_ARCH = ["--encoder-layers", "1", "--decoder-layers", "1", "--encoder-embed-dim", "16",
             "--decoder-embed-dim", "16", "--encoder-ffn-embed-dim", "16",
             "--decoder-ffn-embed-dim", "16", "--encoder-attention-heads", "2",
             "--decoder-attention-heads", "2", "--share-decoder-input-output-embed"]


def build_step(method, vocab, tokens, arch="transformer_iwslt_de_en", arch_args=(),
               device="cpu", dtype="float32", extra_args=(), seq_len=32):
    """A fairseq model, criterion and sample for one training step of ``method``.

    ``tokens`` target tokens per pass (rounded down to whole sentences), in sentences of
    ``seq_len`` tokens (one sentence of ``tokens``, at least 4, where that is fewer), the
    last 3 positions of each sentence padding; the
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
    seq_len = max(4, min(seq_len, tokens))
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
    module = sys.modules.get("rdrop_fairseq.ops.rows_triton")
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


def fused_variant(method):
    """``(impl, chunk_mb)`` of ``ours-fused-linear[-torch][:MB]`` (auto: triton on CUDA;
    MB: an explicit --rdrop-chunk-mb, 0 automatic), None for the other methods."""
    name, _, mb = method.partition(":")
    if name not in ("ours-fused-linear", "ours-fused-linear-torch"):
        return None
    return ("torch" if name.endswith("-torch") else "auto"), float(mb or 0)


def run_loss(method, vocab, tokens, repeats, device="cpu", dtype="float32", projection=0):
    import torch
    import torch.nn.functional as F

    from rdrop_fairseq.opcount import count_ops

    torch.manual_seed(0)
    target = torch.randint(2, vocab, (tokens,), device=device)
    target[torch.rand(tokens, device=device) < 0.2] = PAD  # ~20 % padding
    fused = fused_variant(method)
    if fused and not projection:
        raise ValueError(f"{method} needs --projection D (it starts from features)")
    fn = None if fused else _loss_fn(method, dtype)
    extra = {}
    if projection:  # logits made (and counted) in every method, as a decoder makes them
        features = torch.randn(2 * tokens, projection, device=device,
                               dtype=getattr(torch, dtype), requires_grad=True)
        weight = (torch.randn(vocab, projection, device=device) / projection ** 0.5).to(
            getattr(torch, dtype)).requires_grad_(True)

        if fused:
            from rdrop_fairseq.ops.impl import resolve_impl
            from rdrop_fairseq.fused_linear import chunk_pairs, fused_linear_rdrop_loss

            impl, chunk_mb = fused
            extra["pairs"] = chunk_pairs(vocab, features, chunk_mb,
                                         resolve_impl(impl, features))

            def step():
                features.grad = weight.grad = None
                fused_linear_rdrop_loss(features, weight, target, alpha=ALPHA, epsilon=EPS,
                                        ignore_index=PAD, chunk_mb=chunk_mb,
                                        impl=impl).total.backward()
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
    with count_ops() as ops, _kernel_launch_as_one_op(ops):
        step()
    return {"time_s": seconds, "peak_mib": peak, "ops": ops.total, "syncs": ops.n_syncing,
            **extra}


def run_step(method, vocab, tokens, repeats, arch, device="cpu", dtype="float32", tiny=False,
             profile=False):
    model, criterion, sample = build_step(method, vocab, tokens, arch, device=device,
                                          dtype=dtype, arch_args=TINY_ARCH if tiny else ())

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
    result = {"time_s": seconds, "peak_mib": peak, "ops": ops.total, "syncs": ops.n_syncing}
    if profile:
        result["profile"] = profile_steps(step, device)
    return result


PROFILE_STEPS = 3


def profile_steps(step, device):
    """torch.profiler over PROFILE_STEPS steps: per step, the GPU's busy time (the sum of
    the kernels' own times), the kernel launches, and the ops that take most of it."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    cuda = device == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        for _ in range(PROFILE_STEPS):
            step()
        if cuda:
            torch.cuda.synchronize()
    events = prof.key_averages()
    busy = sum(e.self_device_time_total for e in events) / PROFILE_STEPS / 1e3
    launches = sum(e.count for e in events if "LaunchKernel" in e.key) / PROFILE_STEPS
    host = sum(e.self_cpu_time_total for e in events) / PROFILE_STEPS / 1e3
    head = f"per step ({PROFILE_STEPS} profiled): host {host:.1f} ms (the ops' own CPU time)"
    if cuda:
        head += f", GPU busy {busy:.1f} ms (the kernels' own time), {launches:.0f} launches"
    table = events.table(sort_by="self_device_time_total" if cuda else "self_cpu_time_total",
                         row_limit=25)
    return head + "\n" + table


def _rss_kib(field):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def _measure(kind, one_process, peak=True, **kw):
    return _in_this_process(kind, kw) if one_process else _in_subprocess(kind, peak, **kw)


def _summary(results, floors):
    """One method over alternating rounds: the median time, and its ratio to the floor of
    the same round as the median and range of the rounds' ratios (a process's speed moves
    with the machine: a ratio is only fair within a round). Peak, ops and syncs: the first
    round's (they do not move)."""
    import statistics

    bad = next((r for r in results + floors if "error" in r), None)
    if bad is not None:
        return {"error": bad["error"]}
    ratios = [r["time_s"] / f["time_s"] for r, f in zip(results, floors)]
    return {**results[0], "time_s": statistics.median(r["time_s"] for r in results),
            "time_ratio": statistics.median(ratios), "ratio_min": min(ratios),
            "ratio_max": max(ratios), "processes": len(results)}


def _in_this_process(kind, kw):
    """One method measured in this process: on CUDA the allocator's peak is reset per
    method, so the peaks are the methods' own (a fresh process costs fairseq's import)."""
    import gc

    import torch

    kw = dict(kw)
    torch.set_num_threads(kw.pop("threads"))
    try:
        result = run_loss(**kw) if kind == "loss" else run_step(**kw)
    except torch.cuda.OutOfMemoryError:
        result = {"error": "out of memory"}
    except Exception as exc:  # noqa: BLE001 - as a failed subprocess: noted, the table goes on
        result = {"error": f"{type(exc).__name__}: {exc}".splitlines()[0]}
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return result


def _in_subprocess(kind, peak=True, **kw):
    result = _worker(kind, kw)
    if peak and kw["device"] == "cpu" and "error" not in result:  # the peak, from its own run
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
        if "pairs" in r:
            method = f"{method} ({r['pairs']} pairs/chunk)"
        ratio = f"{r['time_s'] / f['time_s']:.2f}"
        if r.get("processes", 1) > 1:  # median of the rounds' ratios (their range)
            ratio = f"{r['time_ratio']:.2f} ({r['ratio_min']:.2f}-{r['ratio_max']:.2f})"
        lines.append(
            f"| {case} | {method} | {r['time_s'] * 1e3:.1f} | {ratio} "
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

    p = parser_from_doc(__doc__)
    p.add_argument("what", nargs="?", choices=["loss", "step", "all", "gpu"], default="all",
                   help="gpu: on CUDA, in one process per table: the loss in bf16 and fp16 at "
                   "V = 32k and 267,744, 8192 tokens per pass, logits from D = 1024 features "
                   "(floor, upstream, ours-triton, ours-fused-linear), and fp16 steps of "
                   "transformer_iwslt_de_en and transformer_vaswani_wmt_en_de_big (floor, "
                   "upstream, ours-triton)")
    p.add_argument("--device", choices=["cpu", "cuda"], default=None,
                   help="default: cuda for 'gpu', else cpu")
    p.add_argument("--dtype", nargs="+", default=None,
                   help="logits / model dtypes (default: float32 on CPU; gpu: bfloat16 float16)")
    p.add_argument("--vocab", type=int, nargs="+", default=None,
                   help="default 10000 32000 50000 (gpu: 32000 267744)")
    p.add_argument("--tokens", type=int, nargs="+", default=None,
                   help="target tokens per pass (default 4096; gpu: 8192)")
    p.add_argument("--step-arch", nargs="+", default=None,
                   help="default: transformer_iwslt_de_en (gpu: also the WMT big model)")
    p.add_argument("--step-vocab", type=int, default=None, help="default 10000 (gpu: 32000)")
    p.add_argument("--step-tokens", type=int, default=None, help="default 2048 (gpu: 4096)")
    p.add_argument("--step-tiny", action="store_true",
                   help="steps of the arch with 1 + 1 layers of 16 dims (a quick check)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=os.cpu_count())
    p.add_argument("--methods", nargs="+", default=None,
                   choices=list(CRITERION_ARGS) + list(LOSS_ONLY_METHODS))
    p.add_argument("--projection", type=int, default=None, metavar="D",
                   help="loss: make the logits from D-dim features by an output projection "
                   "(gpu: 1024)")
    p.add_argument("--fused-chunk-mb", type=float, nargs="+", default=[], metavar="MB",
                   help="loss: also ours-fused-linear with each of these --rdrop-chunk-mb "
                   "(the table gives the row pairs per chunk)")
    p.add_argument("--processes", type=int, default=1, metavar="N",
                   help="CPU: N rounds, each method once a round in a fresh process, the "
                        "floor first; a ratio is the median of the rounds' ratios to their "
                        "own floor, with its range (the CPU tables: 5)")
    p.add_argument("--one-process", action=argparse.BooleanOptionalAction, default=None,
                   help="measure every method in this process (default on CUDA, where the "
                   "allocator's peak is reset per method; on CPU a fresh process per method "
                   "gives each its own resident-set peak)")
    p.add_argument("--profile", metavar="FILE",
                   help="step: also write torch.profiler tables of each method's step here")
    p.add_argument("--markdown", help="also write the tables to this file")
    p.add_argument("--json", help="also write every measurement to this file (as it goes)")
    a = p.parse_args()
    gpu = a.what == "gpu"
    device = a.device or ("cuda" if gpu else "cpu")
    one_process = device == "cuda" if a.one_process is None else a.one_process
    if a.processes > 1 and one_process:
        p.error("--processes N alternates fresh processes: not with --one-process (or CUDA)")
    dtypes = a.dtype or (["bfloat16", "float16"] if gpu else ["float32"])
    tokens = a.tokens or ([8192] if gpu else [4096])
    vocabs = a.vocab or ([32000, 267744] if gpu else [10000, 32000, 50000])
    projection = a.projection if a.projection is not None else (1024 if gpu else 0)
    methods = a.methods or (["floor", "upstream", "ours-triton", "ours-fused-linear"] if gpu
                            else list(CRITERION_ARGS) if device == "cuda"
                            else ["floor", "upstream", "ours-torch"])
    common = dict(repeats=a.repeats, threads=a.threads, device=device)
    out = [f"device={device} threads={a.threads} repeats={a.repeats} (~20% padding in 'loss')"]
    print(out[0])
    measured = []

    def record(kind, case, method, result):
        print(f"  {kind} {case} {method}: {result}", flush=True)
        measured.append({"kind": kind, "case": case, "method": method, **result})
        if a.json:  # as it goes: a run stopped half-way keeps what it measured
            with open(a.json, "w") as f:
                json.dump(measured, f, indent=1)
        return case, method, result

    if a.what in ("loss", "all", "gpu"):
        rows = []
        loss_methods = methods + [f"ours-fused-linear:{mb:g}" for mb in a.fused_chunk_mb]
        for dtype in dtypes:
            for n in tokens:
                for v in vocabs:
                    case = f"{dtype} V={v} N={n}" + (f" D={projection}" if projection else "")
                    per = {m: [] for m in loss_methods}
                    for i in range(a.processes):  # rounds: the methods alternate
                        for m in loss_methods:
                            per[m].append(record("loss", case, m, _measure(
                                "loss", one_process, peak=i == 0, method=m, vocab=v,
                                tokens=n, dtype=dtype, projection=projection, **common))[2])
                    for m in loss_methods:
                        rows.append((case, m, per[m][0] if a.processes == 1 else
                                     _summary(per[m], per[loss_methods[0]])))
        out.append(_table("Loss alone: logits -> loss -> backward", rows))
    if a.what in ("step", "all", "gpu"):
        rows, profiles = [], []
        archs = a.step_arch or (["transformer_iwslt_de_en", "transformer_vaswani_wmt_en_de_big"]
                                if gpu else ["transformer_iwslt_de_en"])
        vocab = a.step_vocab or (32000 if gpu else 10000)
        step_tokens = a.step_tokens or (4096 if gpu else 2048)
        step_dtype = "float16" if device == "cuda" else "float32"
        step_methods = [m for m in methods if m in CRITERION_ARGS]
        if gpu and not a.methods:
            step_methods = ["floor", "upstream", "ours-triton"]
        for arch in archs:
            case = f"{arch}{' (tiny)' if a.step_tiny else ''} {step_dtype} V={vocab} N={step_tokens}"
            for m in step_methods:
                result = _measure("step", one_process, method=m, vocab=vocab, tokens=step_tokens,
                                  arch=arch, dtype=step_dtype, tiny=a.step_tiny,
                                  profile=bool(a.profile), **common)
                if "profile" in result:
                    profiles.append(f"## {case}, {m}\n\n{result.pop('profile')}\n")
                rows.append(record("step", case, m, result))
        out.append(_table("A whole training step (forward, loss, backward)", rows))
        if a.profile:
            with open(a.profile, "w") as f:
                f.write("\n".join(profiles))
    text = "\n".join(out)
    print(text)
    if a.markdown:
        with open(a.markdown, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
