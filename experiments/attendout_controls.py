#!/usr/bin/env python
"""AttendOut's search under fixed rewards: the generator alone, at a real encoder's width,
driven through the same pruning update the task runs (rdrop_fairseq.models.
attendout_reinforce.pruning_update), with rewards that say exactly what each layer costs.

    python -m experiments.attendout_controls                       # every control, 5 seeds
    python -m experiments.attendout_controls --controls costs --width 768
    python -m experiments.attendout_controls --costs work/attendout-check/trace.json

Controls (--controls):
* ``noise``: a reward independent of the action, no price, no budget, 300 pruning steps:
  nothing should be pruned (either decision mode).
* ``budget``: the same noise with a budget of K layers and a deadline: exactly K pruned,
  none after the deadline.
* ``costs``: the reward is minus what the layers that ran as Eq. 3 cost (per layer, in
  units of the reward's noise), plus that noise; a budget of K, the deadline at
  --deadline-step: the K cheapest layers should be the ones pruned, within 50 pruning
  steps. The costs come from a real trace (--costs: a baseline run's result.json of
  ``experiments.attendout_check``, whose ``trace`` has them) or, by default, a stand-in
  profile where the deep layers are cheap (the paper: the last layers pruned first).
* ``price``: the same costs, the default price and no budget, 100 pruning steps: which
  layers a price alone prunes (the layers cheaper than the price should go).
* ``drift``: the noise reward without a price, as long as the paper's longer runs
  (--drift-steps, 2000 pruning steps: SST-2 at T = 25 has 837), on a narrow generator (64
  wide: the drift is the gate biases' and the shared weights' random walk, not a matter of
  width): does anything get pruned by drift alone, and when?

A costs or price run passes when it pruned the cheapest layers, or a set that costs at most
0.05 reward-sd more per layer (real traces have near-ties; both are reported).

Inputs: token vectors around a shared direction, layer-normed, as real embeddings are
(anisotropic); lengths 4-10; --batches batches of --batch examples per pruning step (the
real-weights check's 10 x 16). The generator is the task's, at the task's defaults
(--attendout-generator-lr 5e-5, gate lr, price step, threshold 0.5, init drop 0.1).
Writes WORK/controls.json and prints a table.
"""

import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from rdrop_fairseq.models.attendout_generator import SEARCH_DEFAULTS, AttendOutGenerator, unit_mask
from rdrop_fairseq.models.attendout_reinforce import pruning_update
from rdrop_fairseq.recipes.common import parser_from_doc, write_json

REPO = Path(__file__).resolve().parents[1]
CONTROLS = ("noise", "budget", "costs", "price", "drift")
# a stand-in cost profile per layer (reward-noise sd units), the first layers dearest
STAND_IN_COSTS = {6: [2.0, 1.6, 1.2, 0.8, 0.15, 0.1],
                  12: [2.0, 1.8, 1.6, 1.4, 1.2, 1.0, 0.8, 0.6, 0.4, 0.3, 0.15, 0.1]}


def inputs(gen, batch, dim, min_len=4, max_len=10):
    lengths = torch.randint(min_len, max_len + 1, (batch,), generator=gen)
    T = int(lengths.max())
    pad = torch.arange(T)[None, :] >= lengths[:, None]
    h = torch.randn(batch, T, dim, generator=gen) + torch.randn(dim, generator=gen)
    return F.layer_norm(h, (dim,)).masked_fill(pad[..., None], 0), pad


def run(*, reward, dim, layers, seed, steps, decision="layer", costs=None, budget=0,
        deadline_step=None, price=0.0, price_step=SEARCH_DEFAULTS["attendout_price_step"],
        gate_lr=SEARCH_DEFAULTS["attendout_gate_lr"], generator_lr=5e-5, batches=10,
        batch=16, baseline_decay=0.95):
    """One control run: ``{"pruned": {layer: pruning step}, "steps": steps run, ...}``.
    Stops once a budget is filled (the task stops searching then), or once every layer is
    pruned (nothing is left to decide: a pruned layer stays pruned)."""
    torch.manual_seed(seed)
    g = AttendOutGenerator(dim, layers, init_drop=0.1, decision=decision, prune_threshold=0.5)
    g.build_optimizer(generator_lr, gate_lr)
    g.price = price
    gen = torch.Generator().manual_seed(1000 + seed)
    cost = None if costs is None else torch.tensor(costs, dtype=torch.float32)
    pruned_at, history = {}, []
    for step in range(1, steps + 1):
        cache = []
        g.requires_grad_(True)  # one forward serves the action and its log P (the task
        for _ in range(batches):  # recomputes the same logits in its pruning step)
            h, pad = inputs(gen, batch, dim)
            logits = g(h, pad)
            seed_ = int(torch.randint(0, 2 ** 62, (1,), generator=gen))
            cache.append((logits, g.sample(logits.detach(), pad, seed_), pad))
        g.requires_grad_(False)
        task_rewards, dropped = [], []
        for _, drop, pad in cache:
            noise = torch.randn(pad.size(0), generator=gen)
            if reward == "costs":
                ran = (drop | ~unit_mask(pad)[:, None]).all(-1).all(-1) & ~g.pruned
                noise = noise - ran.float() @ cost
            task_rewards.append(noise)
            dropped.append(g.layers_dropped(drop, pad))
        force = bool(budget) and deadline_step is not None and step >= deadline_step
        statistic, now = pruning_update(
            g, task_rewards, dropped, lambda t: cache[t], baseline_decay=baseline_decay,
            budget=budget, price_step=price_step, force=force)
        for layer in now:
            pruned_at[layer] = step
        if step in (1, 10, 25, 50, 100, 200, 300) or now:
            history.append({"step": step, "statistic": [round(x, 3) for x in statistic.tolist()],
                            "price": round(g.price, 3)})
        if budget and len(pruned_at) >= budget or len(pruned_at) == layers:
            break
    return {"pruned": pruned_at, "steps": step, "price": round(g.price, 3),
            "statistic": [round(x, 3) for x in statistic.tolist()], "history": history}


def control(name, width, layers, seeds, args, costs=None):
    """The runs of one control over the seeds, and whether it passed."""
    if name == "noise":
        runs = [run(reward="noise", dim=width, layers=layers, seed=s, steps=args.noise_steps,
                    decision=d) for d in ("layer", "unit") for s in seeds]
        passed = all(not r["pruned"] for r in runs)
        expected = "nothing pruned in either mode"
    elif name == "budget":
        runs = [run(reward="noise", dim=width, layers=layers, seed=s, steps=args.deadline_step,
                    budget=args.budget, deadline_step=args.deadline_step,
                    price=SEARCH_DEFAULTS["attendout_drop_price"],
                    price_step=args.price_step) for s in seeds]
        passed = all(len(r["pruned"]) == args.budget
                     and max(r["pruned"].values()) <= args.deadline_step for r in runs)
        expected = f"exactly {args.budget} pruned by step {args.deadline_step}"
    elif name == "price":
        price = SEARCH_DEFAULTS["attendout_drop_price"]
        runs = [run(reward="costs", dim=width, layers=layers, seed=s, steps=args.price_steps,
                    costs=costs, price=price) for s in seeds]
        cheaper = sorted(i for i in range(layers) if costs[i] < price)
        for r in runs:
            r["hit"] = sorted(r["pruned"]) == cheaper
        passed = sum(r["hit"] for r in runs) >= min(4, len(seeds))
        expected = f"the layers cheaper than the price {price} ({cheaper}) in >= 4 of 5 seeds"
    elif name == "drift":
        runs = [run(reward="noise", dim=64, layers=layers, seed=s, steps=args.drift_steps,
                    decision=d) for d in ("layer", "unit") for s in seeds]
        passed = True  # a measurement, not a pass/fail control
        expected = f"(measured) what {args.drift_steps} pruning steps of noise prune"
    else:
        order = sorted(range(layers), key=lambda i: costs[i])
        cheapest = sorted(order[:args.budget])
        best = sum(costs[i] for i in cheapest)
        runs = [run(reward="costs", dim=width, layers=layers, seed=s, steps=args.deadline_step,
                    costs=costs, budget=args.budget, deadline_step=args.deadline_step,
                    price=SEARCH_DEFAULTS["attendout_drop_price"],
                    price_step=args.price_step) for s in seeds]
        for r in runs:
            r["hit"] = sorted(r["pruned"]) == cheapest
            r["regret_per_layer"] = round((sum(costs[int(i)] for i in r["pruned"]) - best)
                                          / args.budget, 4)
        passed = sum(r["hit"] or r["regret_per_layer"] <= 0.05 for r in runs) >= min(
            4, len(seeds))
        expected = (f"the {args.budget} cheapest ({cheapest}), or within 0.05 sd per layer, "
                    "in >= 4 of 5 seeds")
    return {"control": name, "width": width, "layers": layers, "expected": expected,
            "passed": passed, "costs": costs, "runs": runs}


def main(argv=None):
    parser = parser_from_doc(__doc__)
    parser.add_argument("--controls", nargs="+", choices=CONTROLS, default=list(CONTROLS))
    parser.add_argument("--width", type=int, nargs="+", default=[384, 768],
                        help="generator widths; 384 runs 6 layers (MiniLM), 768 runs 12 "
                        "(roberta-base)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    parser.add_argument("--budget", type=int, default=2, help="K for budget and costs")
    parser.add_argument("--deadline-step", type=int, default=50,
                        help="the pruning step by which the budget is filled")
    parser.add_argument("--price-step", type=float,
                        default=SEARCH_DEFAULTS["attendout_price_step"],
                        help="--attendout-price-step of the budget and costs controls")
    parser.add_argument("--noise-steps", type=int, default=300)
    parser.add_argument("--price-steps", type=int, default=100)
    parser.add_argument("--drift-steps", type=int, default=2000)
    parser.add_argument("--costs", type=Path,
                        help="costs per layer (reward-sd units) for width 384: a baseline "
                        "run's result.json (its 'trace') or a JSON with 'costs'; default: a "
                        "stand-in profile")
    parser.add_argument("--work", type=Path, default=REPO / "work" / "attendout-controls")
    args = parser.parse_args(argv)
    if not args.price_step >= 0:
        parser.error(f"--price-step must be >= 0, got {args.price_step}")
    torch.set_num_threads(1)
    results = []
    for width in args.width:
        layers = 6 if width <= 384 else 12
        costs = STAND_IN_COSTS[layers]
        if args.costs and layers == 6:
            saved = json.loads(args.costs.read_text())
            costs = saved.get("trace", saved)["costs"]
        for name in args.controls:
            start = time.time()
            result = control(name, width, layers, args.seeds, args,
                             costs if name in ("costs", "price") else None)
            result["seconds"] = round(time.time() - start, 1)
            results.append(result)
            pruned = "; ".join(",".join(f"{k}@{v}" for k, v in sorted(r["pruned"].items()))
                               or "none" for r in result["runs"])
            print(f"{name:6s} width {width:4d}: {'PASS' if result['passed'] else 'FAIL'} "
                  f"({result['expected']}); pruned layer@step per run: {pruned}; "
                  f"{result['seconds']} s", flush=True)
    args.work.mkdir(parents=True, exist_ok=True)
    write_json(args.work / "controls.json", {"defaults": SEARCH_DEFAULTS,
                                             "price_step": args.price_step, "results": results})
    return 0 if all(r["passed"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
