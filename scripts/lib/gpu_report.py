"""scripts/gpu_check.sh's report: OUT/summary.md (the machine and versions, each stage's
status and time, every table), and the stages' scattered outputs gathered into the few
files that come back from a GPU machine: gpu-check.log, bench_rdrop.json (the recipes'
memory rows too, under "recipe_memory"), bench_attendout.json.

    python scripts/lib/gpu_report.py WORK OUT DEVICE
"""

import json
import platform
import sys
from importlib import metadata
from pathlib import Path

# the stages in the order gpu_check.sh runs them, and their logs (WORK/NAME.log)
ORDER = ["setup", "loss", "step", "attendout", "attendout_pruning", "hf", "cuda_tests", "prepare",
         "fp16_train", "fp16_check", "fast_tier", "recipe_memory"]


def versions(device):
    import torch

    def version(*names):
        for name in names:
            try:
                return metadata.version(name)
            except metadata.PackageNotFoundError:
                pass
        return "missing"

    card = torch.cuda.get_device_name(0) if device == "cuda" else f"CPU ({platform.machine()})"
    return (f"{card}; Python {platform.python_version()}, torch {torch.__version__} (CUDA "
            f"{torch.version.cuda}), triton {version('triton', 'pytorch-triton')}, numpy "
            f"{version('numpy')}, fairseq {version('ve-fairseq', 'fairseq-fixed', 'fairseq')}")


def last_line(path, starting=None):
    """The last line of a log (pytest's summary), or the part from a line starting with
    ``starting`` on (a table a script printed)."""
    if not path.is_file():
        return None
    lines = path.read_text(errors="replace").rstrip().splitlines()
    if starting is not None:
        first = next((i for i, line in enumerate(lines) if line.startswith(starting)), None)
        return None if first is None else "\n".join(lines[first:])
    return lines[-1] if lines else None


def last_block(path, starting):
    """The lines of ``path`` from the last one beginning with ``starting`` on (a markdown
    table a benchmark printed), or None."""
    if not path.is_file():
        return None
    lines = path.read_text(errors="replace").splitlines()
    starts = [i for i, line in enumerate(lines) if line.startswith(starting)]
    return "\n".join(lines[starts[-1]:]).strip() if starts else None


def memory_table(work):
    """bench_recipe_memory.py's rows as a markdown table, and how they reach the scripts."""
    path = work / "recipe_memory.json"
    if not path.is_file():
        return ["(no rows: see gpu-check.log)"]
    result = json.loads(path.read_text())
    columns = ["recipe", "max_tokens", "batch", "precision", "peak_gib", "reserved_gib",
               "state_gib", "params", "baseline_gib", "overflows", "seconds"]
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(str(row.get(c)) for c in columns) + " |"
              for row in result["rows"]]
    if result.get("failed"):
        lines += ["", f"Failed: {', '.join(result['failed'])} (gpu-check.log)."]
    return lines + ["", "Into benchmarks/results/recipe_memory.tsv (what the recipe scripts "
                    "read): `python benchmarks/bench_recipe_memory.py record bench_rdrop.json`."]


def main(work, out, device):
    work, out = Path(work), Path(out)
    stages = [line.split("\t") for line in (work / "stages.tsv").read_text().splitlines()]
    stages.sort(key=lambda s: ORDER.index(s[0]) if s[0] in ORDER else len(ORDER))
    md = ["# GPU check", "", f"Machine: {versions(device)}.", "",
          "| stage | status | seconds | time box |", "|---|---|---|---|"]
    md += [f"| {name} | {status} | {seconds} | {limit or '-'} |"
           for name, status, seconds, limit in stages]
    for name in ("loss", "step"):
        text = (work / f"{name}.md").read_text() if (work / f"{name}.md").is_file() else None
        md += ["", text.strip() if text else f"(no {name} table: see gpu-check.log)"]
    md += ["", "Per-step profiles of each method: profile.txt."]
    for name in ("attendout", "attendout_pruning"):
        table = last_line(work / f"{name}.log", starting="Shape:")
        if table:
            md += ["", f"### AttendOut ({name})", "", table]
    hf = last_block(work / "hf.log", starting="batch ")
    md += ["", "### Hugging Face: RDropTrainer, bf16 (hf)", "", hf or "(no table: gpu-check.log)"]
    for name in ("cuda_tests", "fast_tier"):
        md += ["", f"{name}: {last_line(work / f'{name}.log') or '(no output)'}"]
    md += ["", "### The recipes' memory (recipe_memory)", "", *memory_table(work)]
    (out / "summary.md").write_text("\n".join(md) + "\n")

    with open(out / "gpu-check.log", "w") as log:
        for name in ORDER:
            if (work / f"{name}.log").is_file():
                log.write(f"===== {name}\n{(work / f'{name}.log').read_text(errors='replace')}\n")
    for target, parts in (("bench_rdrop.json", ("loss", "step", "recipe_memory", "hf")),
                          ("bench_attendout.json", ("attendout", "attendout_pruning"))):
        merged = {p: json.loads((work / f"{p}.json").read_text())
                  for p in parts if (work / f"{p}.json").is_file()}
        (out / target).write_text(json.dumps(merged, indent=1))


if __name__ == "__main__":
    main(*sys.argv[1:4])
