"""Export an AttendOut checkpoint as the attacker alone, with its pruned layers recorded.

The output holds the attacker's encoder and classification heads (the keys of a plain
``roberta`` checkpoint), no defender, generator or optimizer state, and in its model config
``attendout_pruned_layers`` and ``attendout_inference_only``. Loaded with the plugin imported
(``--user-dir``, or ``import rdrop_fairseq`` before ``RobertaModel.from_pretrained``), the
pruned layers run as a mean of V (Eq. 3 of the paper); the same weights load strictly into
a plain ``roberta`` model, which runs every layer in full.

The pruned layers are the ones the run pruned during training (the generator's sticky
``pruned`` buffer; ``--attendout-decision``, ``--attendout-prune-threshold``): the attacker
trained with them as a mean of V, and validation scored them. A checkpoint from before that
buffer existed is pruned by the older rule: the generator's greedy mask (drop probability
> 0.5) dropped all of a layer's units for at least ``--threshold`` of the training examples.
A static-pruning checkpoint (``--attendout-static-prune-layers``) is exported the same way,
with its static layers.

Usage::

    python -m rdrop_fairseq.recipes.export_attendout --checkpoint CKPT --output OUT.pt
"""

import argparse
import copy
import os
import sys

import torch
from .common import parser_from_doc


def export(state, threshold=None):
    """The exported checkpoint dict and a report ``[(layer, statistic, pruned)]``."""
    model_state = state["model"]
    cfg = state.get("cfg")
    if not isinstance(cfg, dict):
        raise ValueError("the checkpoint has no fairseq config (cfg); was it written by "
                         "fairseq-train >= 0.10?")
    static = _model_cfg_get(cfg.get("model"), "attendout_static_prune_layers", "")
    key = "generator.greedy_all_dropped"
    if static:
        if threshold is not None:
            raise ValueError("--threshold: a static-pruning checkpoint has fixed layers")
        num_layers = _model_cfg_get(cfg["model"], "encoder_layers", 0)
        layers = {int(i) for i in static.split(",")}
        report = [(i, None, i in layers) for i in range(num_layers)]
    elif "generator.pruned" in model_state:
        if threshold is not None:
            raise ValueError("--threshold: this checkpoint's pruning was decided during "
                             "training (and trained with); the export writes that decision")
        decision = cfg["task"].get("attendout_decision", "layer")
        stat = model_state["generator.gate_prob" if decision == "layer" else key]
        report = [(i, f, bool(p)) for i, (f, p) in
                  enumerate(zip(stat.float().tolist(), model_state["generator.pruned"].tolist()))]
    elif key in model_state:  # before the pruned buffer: the greedy rule, at export time
        if threshold is None:
            threshold = cfg["task"].get("attendout_prune_threshold", 0.5)
        if not 0 < threshold <= 1:
            raise ValueError(f"--threshold must be in (0, 1], got {threshold}")
        report = [(i, f, f >= threshold) for i, f in enumerate(model_state[key].float().tolist())]
    else:
        raise ValueError("not an AttendOut training checkpoint: it has no generator "
                         f"statistics ({key}) and no --attendout-static-prune-layers; was it "
                         "trained with --arch roberta_attendout?")
    pruned = [i for i, _, p in report if p]
    exported = {k: v for k, v in state.items()
                if k != "last_optimizer_state"}
    exported["model"] = {k: v for k, v in model_state.items()
                         if not k.startswith(("defender.", "generator."))}
    exported["optimizer_history"] = [
        {k: v for k, v in h.items() if k != "optimizer"} for h in state["optimizer_history"]]
    cfg = copy.deepcopy(cfg)
    model_cfg = {"attendout_pruned_layers": ",".join(map(str, pruned)),
                 "attendout_inference_only": True, "attendout_static_prune_layers": ""}
    if isinstance(cfg["model"], argparse.Namespace):  # fairseq's legacy (argparse) models
        vars(cfg["model"]).update(model_cfg)
    else:
        cfg["model"].update(model_cfg)
    exported["cfg"] = cfg
    return exported, report, threshold


def budget_of(state):
    """The run's --attendout-target-layers (0: none, or a checkpoint without it)."""
    task = (state.get("cfg") or {}).get("task") or {}
    return int(_model_cfg_get(task, "attendout_target_layers", 0) or 0)


def _model_cfg_get(model_cfg, name, default):
    if isinstance(model_cfg, argparse.Namespace):
        return getattr(model_cfg, name, default)
    return model_cfg.get(name, default) if model_cfg is not None else default


def main(argv=None):
    parser = parser_from_doc(__doc__)
    parser.add_argument("--checkpoint", required=True, help="an AttendOut training checkpoint")
    parser.add_argument("--output", required=True, help="where to write the exported model")
    parser.add_argument("--threshold", type=float, default=None,
                        help="only for checkpoints written before the pruning decision was "
                        "made in training: prune a layer whose greedy mask dropped all units "
                        "for at least this fraction of examples (default: the run's "
                        "--attendout-prune-threshold)")
    args = parser.parse_args(argv)
    if not os.path.isfile(args.checkpoint):
        parser.error(f"--checkpoint {args.checkpoint}: no such file")
    import rdrop_fairseq  # noqa: F401  (allow-lists fairseq checkpoint globals for torch.load)
    # the checkpoint as fairseq wrote it (cfg a plain dict), not upgraded by fairseq's loader
    state = torch.load(args.checkpoint, map_location="cpu")
    try:
        exported, report, threshold = export(state, args.threshold)
    except ValueError as e:
        parser.error(str(e))
    if threshold is not None:
        print(f"layers pruned where the generator's greedy mask dropped every attention unit "
              f"for >= {threshold:g} of the training examples (moving average):")
    else:
        print("layers pruned (statistic: the moving average the decision read, if any):")
    for layer, stat, pruned in report:
        stat = "" if stat is None else f"{stat:6.3f}"
        print(f"  layer {layer:2d}: {stat:6s}  {'pruned (mean of V)' if pruned else 'kept'}")
    pruned = [str(layer) for layer, _, p in report if p]
    print(f"{len(pruned)}/{len(report)} layers pruned: {','.join(pruned) or 'none'}")
    budget = budget_of(state)
    if budget and len(pruned) < budget:
        print(f"note: the run's budget was {budget} layers (--attendout-target-layers), and "
              f"this checkpoint was saved before it was filled (update "
              f"{state.get('optimizer_history', [{}])[-1].get('num_updates', '?')}); export "
              "checkpoint_last.pt, or validate from the deadline on (--validate-after-updates "
              "set to --attendout-deadline x --max-update) so that checkpoint_best.pt has "
              "them all")
    os.makedirs(os.path.dirname(os.path.abspath(args.output)), exist_ok=True)
    tmp = args.output + ".tmp"
    torch.save(exported, tmp)
    os.replace(tmp, args.output)  # never a half-written export
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
