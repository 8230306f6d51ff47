#!/usr/bin/env python3
"""Plot allreduce_bench's JSON: bus bandwidth against message size, builtin vs ring.

Usage: plot_allreduce.py BENCH.json [OUT.png]   (default OUT: submit_figures/allreduce_bandwidth.png)
"""
import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def size_label(n):
    for unit, scale in (("MB", 1 << 20), ("KB", 1 << 10)):
        if n >= scale:
            return f"{n // scale} {unit}"
    return f"{n} B"


def main(argv):
    if len(argv) not in (2, 3):
        print(__doc__.strip(), file=sys.stderr)
        return 2
    src = Path(argv[1])
    out = Path(argv[2]) if len(argv) == 3 else Path(__file__).resolve().parent.parent / "submit_figures" / "allreduce_bandwidth.png"
    try:
        doc = json.loads(src.read_text())
        results = doc["results"]
        world = doc["world_size"]
    except (OSError, ValueError, KeyError) as e:
        print(f"plot_allreduce.py: {src}: not an allreduce_bench JSON ({e})", file=sys.stderr)
        return 1
    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    for algorithm, style in (("builtin", "o-"), ("ring", "s-")):
        rows = sorted((r for r in results if r["algorithm"] == algorithm), key=lambda r: r["bytes"])
        if not rows:
            continue
        label = "built-in Gloo allreduce" if algorithm == "builtin" else "ring on send/recv (ours)"
        ax.plot([r["bytes"] for r in rows], [r["busbw_GBps"] for r in rows], style, label=label)
    sizes = sorted({r["bytes"] for r in results})
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")  # small messages are latency-bound: GB/s spans four decades
    ticks = [s for i, s in enumerate(sizes) if i % 2 == 0]
    ax.set_xticks(ticks)
    ax.set_xticklabels([size_label(s) for s in ticks], rotation=30)
    ax.set_xlabel("message size (float32)")
    ax.set_ylabel("bus bandwidth, 2(N-1)/N x bytes / time (GB/s)")
    cores = doc.get("cores")
    where = f"{cores}-core CPU machine" if cores else "this machine"
    ax.set_title(f"All-reduce bus bandwidth: CPU, Gloo, {world} ranks on one {where}")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    print(f"plot_allreduce.py: wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
