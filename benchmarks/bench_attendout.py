"""Cost of AttendOut: the training step, and the pruned encoder's inference latency.

* ``step``: one training update (task.train_step + task.optimizer_step) of fine-tuning on
  sentence prediction, side by side in one run, each method in a fresh subprocess (so that
  its peak memory is its own): ``baseline`` (sentence_prediction, plain roberta),
  ``rdrop`` (sentence_prediction_rdrop, alpha 1), ``attendout`` (sentence_prediction_attendout,
  roberta_attendout, searching: the pruning step amortised, T = --interval),
  ``attendout_rdrop``, ``attendout_step`` (the rewards from the training step's own
  losses: no re-scoring at the pruning step), and ``attendout_budget``: a budget of one
  layer with the default
  deadline (40 % of the timed updates), so that the mean covers the search and the updates
  trained as exported after it.
  Median time per update and peak memory above the model's (CPU: the resident set's
  high-water mark with glibc's mmap threshold fixed, as bench_rdrop.py; CUDA:
  max_memory_allocated), as ratios to the baseline.
* ``inference``: the encoder + classification head in evaluation mode with 0, half, all
  but 2, all but 1 and all layers pruned (a pruned layer's attention is the mean of V),
  median latency per batch, next to the ratio of multiply-accumulates for the same shape
  (:func:`mac_ratio`).
* ``pruning``: peak memory of the pruning step above what it starts with, for T cached
  batches (T in ``--prune-t``), each in a fresh subprocess. ``--prune-part step``: the
  whole ``task.pruning_step`` (rewards, REINFORCE, D <- A); ``generator``: its REINFORCE
  update alone (the generator's graph, the part that used to grow with T), both as
  implemented (``per_batch``: one backward per cached batch) and as it was
  (``all_at_once``: every batch's graph alive until one backward). CPU: the resident set,
  sampled every millisecond; CUDA: max_memory_allocated.

Usage::

    python benchmarks/bench_attendout.py                  # CPU: both, a MiniLM-sized shape
    python benchmarks/bench_attendout.py step --layers 6 --dim 384 --length 128
    python benchmarks/bench_attendout.py gpu --json gpu.json   # roberta-base shape, fp16
    python benchmarks/bench_attendout.py pruning --layers 12 --dim 768 --length 256 \
        --pruning-batch 16 --prune-t 1 2 4           # roberta-base's generator, CPU
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

from rdrop_fairseq.recipes.common import parser_from_doc

REPO = Path(__file__).resolve().parents[1]
METHODS = ("baseline", "rdrop", "attendout", "attendout_rdrop", "attendout_step",
           "attendout_budget")


def mac_ratio(layers, pruned, length, dim, ffn=None):
    """The speed-up that multiply-accumulates alone predict: a full layer costs ``4 l d^2``
    (Q, K, V, O projections) + ``2 l^2 d`` (scores and their product with V) + ``2 l d f``
    (FFN); a pruned layer ``2 d^2`` (V and O of the mean) + the FFN. Embeddings and head
    ignored. Not a bound on time: the softmax and masking over the ``heads x l x l`` scores
    cost time and no MACs, and a pruned layer skips them too."""
    ffn = ffn or 4 * dim
    full = 4 * length * dim ** 2 + 2 * length ** 2 * dim + 2 * length * dim * ffn
    cut = 2 * dim ** 2 + 2 * length * dim * ffn
    return layers * full / ((layers - pruned) * full + pruned * cut)


def build(method, args, data):
    import torch
    from fairseq import options, tasks
    from fairseq.dataclass.utils import convert_namespace_to_omegaconf

    import rdrop_fairseq

    attendout = method.startswith("attendout")
    rdrop = method.endswith("rdrop")
    argv = [str(data), "--user-dir", str(Path(rdrop_fairseq.__file__).parent),
            "--task", "sentence_prediction_attendout" if attendout else "sentence_prediction",
            "--arch", "roberta_attendout" if attendout else "roberta",
            "--encoder-layers", str(args.layers), "--encoder-embed-dim", str(args.dim),
            "--encoder-ffn-embed-dim", str(4 * args.dim),
            "--encoder-attention-heads", str(args.heads), "--max-positions", "512",
            "--criterion", "sentence_prediction_rdrop" if rdrop else "sentence_prediction",
            *(["--rdrop-alpha", "1.0"] if rdrop else []),
            *(["--attendout-interval", str(args.interval)] if attendout else []),
            # a budget of 1 layer whose deadline falls within the timed updates: the search,
            # then training as exported (update 0 is the warm-up)
            *(["--attendout-target-layers", "1", "--attendout-deadline", "0.4",
               "--max-update", str(args.interval * args.intervals + 1)]
              if method == "attendout_budget" else []),
            *(["--attendout-reward-timing", "step"] if method == "attendout_step" else []),
            "--num-classes", "2", "--optimizer", "adam", "--lr", "1e-5"]
    if args.device == "cpu":
        argv.append("--cpu")
    cfg = convert_namespace_to_omegaconf(
        options.parse_args_and_arch(options.get_training_parser(), argv))
    task = tasks.setup_task(cfg.task)
    torch.manual_seed(0)
    model = task.build_model(cfg.model).to(args.device)
    if args.dtype == "float16":
        model = model.half()
    criterion = task.build_criterion(cfg.criterion)
    from fairseq import optim

    params = [p for p in model.parameters() if p.requires_grad]
    if args.dtype == "float16":
        optimizer = optim.FP16Optimizer.build_optimizer(cfg, params)
    else:
        optimizer = optim.build_optimizer(cfg.optimizer, params)
    return task, model, criterion, optimizer


def sample(task, args, seed):
    import torch

    g = torch.Generator().manual_seed(seed)
    d = task.source_dictionary
    tokens = torch.randint(d.nspecial, len(d) - 1, (args.batch, args.length), generator=g)
    tokens[:, 0] = d.bos()
    for i in range(args.batch // 2):  # half the batch with ~20% padding
        tokens[i, int(0.8 * args.length):] = d.pad()
    return {"net_input": {"src_tokens": tokens.to(args.device)}, "nsentences": args.batch,
            "ntokens": int(tokens.ne(d.pad()).sum()),
            "target": torch.randint(0, 2, (args.batch,), generator=g).to(args.device)}


def tiny_data(root):
    """A dictionary-only data folder for task setup (the benchmark makes its own batches)."""
    root = Path(root)
    for kind, words in (("input0", [f"w{i}" for i in range(1000)]), ("label", ["0", "1"])):
        (root / kind).mkdir(parents=True, exist_ok=True)
        (root / kind / "dict.txt").write_text("".join(f"{w} 1\n" for w in words))
    return root


def measure_step(method, args):
    import resource

    import torch

    torch.set_num_threads(args.threads)
    task, model, criterion, optimizer = build(method, args, tiny_data(args.work))
    cuda = args.device == "cuda"

    def update(i):
        task.train_step(sample(task, args, i), model, criterion, optimizer, i)
        task.optimizer_step(optimizer, model, i)
        optimizer.zero_grad()

    update(0)  # warm-up: lazily built state (Adam moments, the generator's optimizer)
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    else:
        base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    times, searching = [], 0
    n = args.interval * args.intervals  # whole pruning intervals: the pruning step amortised
    for i in range(1, n + 1):
        searching += hasattr(task, "search_finished") and not task.search_finished(model)
        start = time.perf_counter()
        update(i)
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    if cuda:
        peak = torch.cuda.max_memory_allocated() - base
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - base
    return {"method": method, "seconds": statistics.mean(times),
            "median_seconds": statistics.median(times), "peak_bytes": max(peak, 0),
            "searching_updates": searching, "updates": n}


def measure_inference(args):
    import torch

    torch.set_num_threads(args.threads)
    task, model, _, _ = build("attendout", args, tiny_data(args.work))
    model.eval()
    head = "sentence_classification_head"
    batch = sample(task, args, 0)["net_input"]["src_tokens"]
    rows = []
    L = args.layers
    for k in sorted({0, L // 2, L - 2, L - 1, L}):
        model.set_pruned_layers(range(L - k, L))  # the last layers, as the paper finds
        with torch.no_grad():
            model(batch, classification_head_name=head)
            times = []
            for _ in range(args.repeats):
                if args.device == "cuda":
                    torch.cuda.synchronize()
                start = time.perf_counter()
                model(batch, classification_head_name=head)
                if args.device == "cuda":
                    torch.cuda.synchronize()
                times.append(time.perf_counter() - start)
        rows.append({"pruned": k, "seconds": statistics.median(times),
                     "mac_ratio": mac_ratio(L, k, args.length, args.dim)})
    full = rows[0]["seconds"]
    for row in rows:
        row["speedup"] = full / row["seconds"]
    return rows


class PeakRSS:
    """The resident set's peak above its size at entry, sampled every millisecond (torch's
    kernels release the GIL); with child_env's mmap threshold freed tensors leave it."""

    def __enter__(self):
        self.page = os.sysconf("SC_PAGE_SIZE")
        self.start = self.peak = self.rss()
        self.running = True
        self.thread = threading.Thread(target=self.sample, daemon=True)
        self.thread.start()
        return self

    def rss(self):
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * self.page

    def sample(self):
        while self.running:
            self.peak = max(self.peak, self.rss())
            time.sleep(0.001)

    def __exit__(self, *exc):
        self.running = False
        self.thread.join()
        self.peak = max(self.peak, self.rss())
        self.bytes = self.peak - self.start


def measure_pruning(args, cached, impl):
    """Peak memory of one pruning step over ``cached`` batches (see the module's doc)."""
    import torch

    from rdrop_fairseq.models.attendout_generator import (
        action_log_prob,
        pack_mask,
        sample_drop,
        unpack_mask,
    )
    from rdrop_fairseq.models.attendout_reinforce import reinforce_step

    torch.set_num_threads(args.threads)
    task, model, _, optimizer = build("attendout", args, tiny_data(args.work))
    bench_args = argparse.Namespace(**vars(args) | {"batch": args.pruning_batch})
    generator = model.generator
    pad = task.source_dictionary.pad()
    batches = [sample(task, bench_args, seed) for seed in range(cached)]
    with torch.no_grad():
        for i, batch in enumerate(batches):
            tokens = batch["net_input"]["src_tokens"]
            probs = torch.sigmoid(task.pruning.drop_logits(model, tokens, tokens.eq(pad)))
            task._cache.append((batch, pack_mask(sample_drop(probs, i)), None))
            del probs
    generator.build_optimizer(task.cfg.attendout_generator_lr)
    cuda = args.device == "cuda"
    if args.prune_part == "step":
        if impl != "per_batch":
            raise ValueError("--prune-part step measures the implementation (per_batch) only")
        run = lambda: task.pruning_step(model, optimizer)  # noqa: E731
    else:
        model.eval()
        cache = task._cache
        rewards = [torch.randn(args.pruning_batch, device=args.device) for _ in cache]

        def log_prob(t):
            batch, packed, _ = cache[t]
            tokens = batch["net_input"]["src_tokens"]
            return action_log_prob(task.pruning.drop_logits(model, tokens, tokens.eq(pad)),
                                   unpack_mask(*packed), tokens.eq(pad))

        def run():
            generator.requires_grad_(True)
            if impl == "per_batch":
                reinforce_step(generator, rewards, log_prob, 0.95)
            else:  # the implementation before: every batch's graph alive, one backward
                log_probs = [log_prob(t) for t in range(len(cache))]
                loss = -sum((r * lp).mean() for r, lp in zip(rewards, log_probs))
                generator.optimizer.zero_grad()
                loss.backward()
                generator.optimizer.step()
            generator.requires_grad_(False)

    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        start = time.perf_counter()
        run()
        torch.cuda.synchronize()
        seconds = time.perf_counter() - start
        peak = torch.cuda.max_memory_allocated() - base
    else:
        with PeakRSS() as rss:
            start = time.perf_counter()
            run()
            seconds = time.perf_counter() - start
        peak = rss.bytes
    return {"part": args.prune_part, "impl": impl, "cached": cached, "seconds": seconds,
            "peak_bytes": max(peak, 0)}


def run_pruning(args):
    impls = ["per_batch"] + (["all_at_once"] if args.prune_part == "generator" else [])
    rows = []
    for impl in impls:
        for cached in args.prune_t:  # each in a fresh process: its peak memory is its own
            out = subprocess.run([sys.executable, __file__, "_pruning", impl, str(cached),
                                  *child_argv(args)],
                                 capture_output=True, text=True, env=child_env(), check=True)
            rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
    return rows


def child_env():
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="131072", OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    return env


def run_steps(args):
    rows = []
    for method in args.methods:  # each in a fresh process: its peak memory is its own
        out = subprocess.run([sys.executable, __file__, "_step", method, *child_argv(args)],
                             capture_output=True, text=True, env=child_env(), check=True)
        rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
    base = rows[0]
    for row in rows:
        row["time_ratio"] = row["seconds"] / base["seconds"]
        row["memory_ratio"] = row["peak_bytes"] / max(base["peak_bytes"], 1)
    return rows


def child_argv(args):
    return ["--layers", str(args.layers), "--dim", str(args.dim), "--heads", str(args.heads),
            "--length", str(args.length), "--batch", str(args.batch), "--threads",
            str(args.threads), "--interval", str(args.interval), "--intervals",
            str(args.intervals), "--device", args.device, "--dtype", args.dtype,
            "--work", str(args.work), "--pruning-batch", str(args.pruning_batch),
            "--prune-part", args.prune_part]


def markdown(steps, inference, args, pruning=()):
    shape = (f"{args.layers} layers x {args.dim}, {args.heads} heads, batch {args.batch} x "
             f"{args.length} tokens, {args.device} {args.dtype}, {args.threads} thread(s)")
    out = [f"Shape: {shape}.", ""]
    if steps:
        out += [f"Training step (mean over {args.intervals} pruning intervals of T = "
                f"{args.interval} updates):", "",
                "| method | s / update | x baseline | peak memory (MiB) | x baseline | "
                "AttendOut searching |", "|---|---|---|---|---|---|"]
        out += [f"| {r['method']} | {r['seconds']:.3f} | {r['time_ratio']:.2f} | "
                f"{r['peak_bytes'] / 2**20:.0f} | {r['memory_ratio']:.2f} | "
                + (f"{r['searching_updates']}/{r['updates']} updates |"
                   if r["method"].startswith("attendout") else "- |") for r in steps]
        out.append("")
    if inference:
        out += ["Inference (encoder + head, one batch, median):", "",
                "| layers pruned | s / batch | speed-up | MAC ratio |", "|---|---|---|---|"]
        out += [f"| {r['pruned']}/{args.layers} | {r['seconds']:.4f} | {r['speedup']:.2f} | "
                f"{r['mac_ratio']:.2f} |" for r in inference]
        out.append("")
    if pruning:
        what = ("the whole pruning step" if args.prune_part == "step"
                else "the generator's REINFORCE update")
        out += [f"Pruning step, {what}, batch {args.pruning_batch} x {args.length} "
                "(peak memory above its start):", "",
                "| implementation | T (cached batches) | s | peak memory (MiB) |",
                "|---|---|---|---|"]
        out += [f"| {r['impl']} | {r['cached']} | {r['seconds']:.2f} | "
                f"{r['peak_bytes'] / 2**20:.0f} |" for r in pruning]
    return "\n".join(out).rstrip()


def parse(argv):
    p = parser_from_doc(__doc__)
    p.add_argument("what", nargs="?", default="all",
                   choices=["all", "step", "inference", "pruning", "gpu", "_step",
                            "_pruning"])
    p.add_argument("method", nargs="?")
    p.add_argument("cached", nargs="?", type=int)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--dim", type=int, default=384)
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--length", type=int, default=128)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--interval", type=int, default=5, help="--attendout-interval T")
    p.add_argument("--intervals", type=int, default=2, help="pruning intervals timed")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--methods", nargs="+", choices=METHODS, default=list(METHODS),
                   help="the training-step arms (default: all; baseline, the ratios' base, "
                        "is always measured first)")
    p.add_argument("--pruning-batch", type=int, help="pruning: batch size (default --batch)")
    p.add_argument("--prune-t", type=int, nargs="+", default=[1, 2, 4],
                   help="pruning: cached batches T, one fresh process each")
    p.add_argument("--prune-part", choices=["generator", "step"], default="generator",
                   help="pruning: REINFORCE alone (both implementations) or the whole step")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32", choices=["float32", "float16"])
    p.add_argument("--work", type=Path, default=Path("/tmp/bench_attendout"))
    p.add_argument("--json", type=Path, help="also write the results here")
    args = p.parse_args(argv)
    if args.what == "gpu":  # roberta-base at the paper's length, fp16, as users fine-tune
        import torch

        if not torch.cuda.is_available():
            p.error("gpu: no CUDA device")
        args.layers, args.dim, args.heads, args.length, args.batch = 12, 768, 12, 256, 32
        args.device, args.dtype, args.interval = "cuda", "float16", 25
        args.pruning_batch, args.prune_t, args.prune_part = 16, [1, 4, 8, 25], "step"
    args.pruning_batch = args.pruning_batch or args.batch
    args.methods = ["baseline"] + [m for m in args.methods if m != "baseline"]
    return args


def main(argv=None):
    args = parse(argv)
    if args.what == "_step":
        print(json.dumps(measure_step(args.method, args)))
        return 0
    if args.what == "_pruning":
        print(json.dumps(measure_pruning(args, args.cached, args.method)))
        return 0
    steps = run_steps(args) if args.what in ("all", "step", "gpu") else []
    inference = measure_inference(args) if args.what in ("all", "inference", "gpu") else []
    pruning = run_pruning(args) if args.what in ("pruning", "gpu") else []
    print(markdown(steps, inference, args, pruning))
    if args.json:
        args.json.write_text(json.dumps({"shape": vars(args) | {"work": str(args.work),
                                                                "json": str(args.json)},
                                         "step": steps, "inference": inference,
                                         "pruning": pruning}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
