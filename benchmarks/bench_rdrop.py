"""Side-by-side cost of R-Drop: our criterion vs fairseq's upstream one vs the floor.

The floor is fairseq's plain label-smoothed cross-entropy on the doubled batch: any R-Drop
implementation must compute at least that. Two measurements, each method in a fresh
subprocess (so that its peak resident memory is its own):

* ``loss``: logits -> loss -> backward, N target tokens per pass (~20 % padding), at several
  vocabulary sizes; time (median of repeats) and peak RSS above the logits themselves.
* ``step``: a whole training step (forward, loss, backward) of a small
  ``transformer_iwslt_de_en``-shaped model through the real fairseq criteria.

Usage::

    python benchmarks/bench_rdrop.py                  # both, default sizes
    python benchmarks/bench_rdrop.py loss --vocab 10000 32000 50000 --tokens 4096
    python benchmarks/bench_rdrop.py step
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

LOSS_METHODS = ("ce_doubled", "upstream_rdrop", "ours")
STEP_METHODS = ("ce_doubled", "upstream_rdrop", "ours")
PAD = 1


def _rss_kib(field):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


class _LogSoftmaxModel:
    """The two methods fairseq criteria call on a model, for logits given directly."""

    def get_normalized_probs(self, net_output, log_probs):
        import torch.nn.functional as F

        logits = net_output[0].float()
        return F.log_softmax(logits, -1) if log_probs else F.softmax(logits, -1)


def _loss_fn(method, eps):
    import torch.nn.functional as F
    from fairseq.criterions.label_smoothed_cross_entropy import label_smoothed_nll_loss

    if method == "ce_doubled":
        def fn(logits, target):
            lprobs = F.log_softmax(logits.float(), -1)
            return label_smoothed_nll_loss(lprobs, target, eps, ignore_index=PAD)[0]
    elif method == "upstream_rdrop":
        from fairseq.criterions.label_smoothed_cross_entropy_with_rdrop import compute_kl_loss

        model = _LogSoftmaxModel()

        def fn(logits, target):  # what RdropLabelSmoothedCrossEntropyCriterion.compute_loss does
            lprobs = model.get_normalized_probs((logits,), log_probs=True)
            loss, _ = label_smoothed_nll_loss(lprobs, target, eps, ignore_index=PAD)
            pad_mask = target[: target.size(0) // 2].unsqueeze(-1).eq(PAD)
            return loss + 5.0 * compute_kl_loss(model, (logits,), pad_mask)
    elif method == "ours":
        from rdrop_fairseq.core import rdrop_nll_loss

        def fn(logits, target):
            lprobs = F.log_softmax(logits.float(), -1)
            loss, _, kl = rdrop_nll_loss(lprobs, target, eps, ignore_index=PAD)
            return loss + 5.0 * kl
    else:
        raise ValueError(method)
    return fn


def run_loss(method, vocab, tokens, repeats, eps=0.1):
    import torch

    torch.manual_seed(0)
    target = torch.randint(2, vocab, (tokens,))
    target[torch.rand(tokens) < 0.2] = PAD  # ~20 % padding
    target = torch.cat([target, target])
    logits = torch.randn(2 * tokens, vocab, requires_grad=True)
    fn = _loss_fn(method, eps)
    base = _rss_kib("VmRSS")
    times = []
    for _ in range(repeats + 1):  # the first run also warms up; its peak counts
        logits.grad = None
        t0 = time.perf_counter()
        fn(logits, target).backward()
        times.append(time.perf_counter() - t0)
    peak = _rss_kib("VmHWM") - base
    return {"time_s": statistics.median(times[1:]), "peak_mib": peak / 1024}


def run_step(method, tokens, repeats, vocab):
    import torch
    from fairseq import tasks
    from fairseq.dataclass.utils import convert_namespace_to_omegaconf
    from fairseq.data import Dictionary
    from fairseq.models.transformer import TransformerModel, transformer_iwslt_de_en
    from fairseq import options

    import rdrop_fairseq  # noqa: F401  (registers the criteria)

    torch.manual_seed(0)
    d = Dictionary()
    for i in range(vocab - len(d)):
        d.add_symbol(f"w{i}")
    criterion_args = {
        "ce_doubled": ["--criterion", "label_smoothed_cross_entropy"],
        "upstream_rdrop": ["--criterion", "label_smoothed_cross_entropy_with_rdrop",
                           "--rdrop-alpha", "5"],
        "ours": ["--criterion", "label_smoothed_cross_entropy_rdrop", "--rdrop-alpha", "5"],
    }[method]
    parser = options.get_training_parser()
    args = options.parse_args_and_arch(parser, [
        "/dev/null", "--task", "translation", "--arch", "transformer_iwslt_de_en",
        "--label-smoothing", "0.1", "--cpu", *criterion_args,
    ])
    cfg = convert_namespace_to_omegaconf(args)
    task = tasks.get_task("translation")(cfg.task, d, d)
    model = task.build_model(cfg.model)
    criterion = task.build_criterion(cfg.criterion)
    model.train()
    bsz, src_len, tgt_len = tokens // 24, 24, 24
    # the baseline gets the doubled batch; the R-Drop criteria duplicate it themselves
    rows = 2 * bsz if method == "ce_doubled" else bsz
    src = torch.randint(4, vocab, (rows, src_len))
    tgt = torch.randint(4, vocab, (rows, tgt_len))
    prev = torch.cat([torch.full((rows, 1), d.eos()), tgt[:, :-1]], 1)
    sample = {
        "net_input": {"src_tokens": src, "src_lengths": torch.full((rows,), src_len),
                      "prev_output_tokens": prev},
        "target": tgt, "ntokens": tgt.numel(), "nsentences": rows,
    }
    base = _rss_kib("VmRSS")
    times = []
    for _ in range(repeats + 1):
        model.zero_grad()
        t0 = time.perf_counter()
        loss, _, _ = criterion(model, sample)
        loss.backward()
        times.append(time.perf_counter() - t0)
    return {"time_s": statistics.median(times[1:]), "peak_mib": (_rss_kib("VmHWM") - base) / 1024}


def _in_subprocess(kind, **kw):
    out = subprocess.run(
        [sys.executable, __file__, "_worker", json.dumps({"kind": kind, **kw})],
        check=True, capture_output=True, text=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def _table(title, rows, floor):
    print(f"\n{title}")
    print(f"{'':<18}{'method':<16}{'time (s)':>10}{'x floor':>9}{'peak MiB':>10}{'x floor':>9}")
    for label, method, r in rows:
        f = floor[label]
        print(f"{label:<18}{method:<16}{r['time_s']:>10.3f}{r['time_s'] / f['time_s']:>9.2f}"
              f"{r['peak_mib']:>10.0f}{r['peak_mib'] / f['peak_mib']:>9.2f}")


def main():
    if len(sys.argv) > 2 and sys.argv[1] == "_worker":
        kw = json.loads(sys.argv[2])
        kind = kw.pop("kind")
        torch_threads = kw.pop("threads")
        import torch

        torch.set_num_threads(torch_threads)
        result = run_loss(**kw) if kind == "loss" else run_step(**kw)
        print(json.dumps(result))
        return

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("what", nargs="?", choices=["loss", "step", "all"], default="all")
    p.add_argument("--vocab", type=int, nargs="+", default=[10000, 32000, 50000])
    p.add_argument("--tokens", type=int, default=4096, help="target tokens per pass")
    p.add_argument("--step-tokens", type=int, default=2048, help="target tokens per pass")
    p.add_argument("--step-vocab", type=int, default=10000)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=os.cpu_count())
    a = p.parse_args()
    print(f"threads={a.threads} tokens/pass={a.tokens} (~20% padding) repeats={a.repeats}")
    if a.what in ("loss", "all"):
        rows, floor = [], {}
        for v in a.vocab:
            for m in LOSS_METHODS:
                r = _in_subprocess("loss", method=m, vocab=v, tokens=a.tokens,
                                   repeats=a.repeats, threads=a.threads)
                floor.setdefault(f"V={v}", r)
                rows.append((f"V={v}", m, r))
        _table("loss only: logits -> loss -> backward (floor: ce_doubled)", rows, floor)
    if a.what in ("step", "all"):
        rows, floor = [], {}
        for m in STEP_METHODS:
            r = _in_subprocess("step", method=m, tokens=a.step_tokens, repeats=a.repeats,
                               vocab=a.step_vocab, threads=a.threads)
            floor.setdefault("step", r)
            rows.append(("step", m, r))
        _table(f"training step, transformer_iwslt_de_en, V={a.step_vocab}, "
               f"{a.step_tokens} target tokens/pass (floor: ce_doubled)", rows, floor)


if __name__ == "__main__":
    main()
