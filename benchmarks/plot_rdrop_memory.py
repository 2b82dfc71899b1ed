"""Plot peak memory against the vocabulary size from bench_rdrop.py --json files.

    python benchmarks/plot_rdrop_memory.py small.json large.json --tokens 512 \
        --out docs/img/rdrop_memory_vs_vocab.png

One line per method, for the cases with --tokens target tokens per pass (loss mode).
"""

import json
import re

from rdrop_fairseq.recipes.common import parser_from_doc


def main(argv=None):
    p = parser_from_doc(__doc__)
    p.add_argument("json", nargs="+")
    p.add_argument("--tokens", type=int, required=True)
    p.add_argument("--out", required=True)
    a = p.parse_args(argv)
    series, label = {}, ""
    for path in a.json:
        for row in json.load(open(path)):
            if row["kind"] != "loss":
                continue
            fields = dict(re.findall(r"(\w+)=(\d+)", row["case"]))
            if int(fields["N"]) != a.tokens:
                continue
            label = f"{row['case'].split()[0]}, N={a.tokens} tokens per pass, D={fields.get('D')}"
            series.setdefault(row["method"], []).append((int(fields["V"]), row["peak_mib"]))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4))
    for method, points in series.items():
        points.sort()
        ax.plot([v for v, _ in points], [m for _, m in points], marker="o", label=method)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("vocabulary size V")
    ax.set_ylabel("peak memory above the inputs (MiB)")
    ax.set_title(f"R-Drop loss + backward, logits from a projection\n({label}; CPU)")
    ax.legend()
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(a.out, dpi=120)
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
