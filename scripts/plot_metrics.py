#!/usr/bin/env python3
"""Plot a training run's metrics.jsonl: the training loss per optimizer step (and the validation
loss where the run evaluated) above the learning rate, both against steps, as one PNG.

Usage: plot_metrics.py METRICS.jsonl [OUT.png]   (default OUT: beside the metrics file, metrics.png)
"""
import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def read_metrics(path):
    train, evals = [], []
    for number, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError:
            if number == len(Path(path).read_text().splitlines()):
                continue  # a last line cut short by a kill
            raise ValueError(f"line {number} is not JSON")
        (train if record.get("kind") == "train" else evals if record.get("kind") == "eval" else []).append(record)
    return train, evals


def main(argv):
    if len(argv) not in (2, 3):
        print(__doc__.strip(), file=sys.stderr)
        return 2
    src = Path(argv[1])
    out = Path(argv[2]) if len(argv) == 3 else src.with_name("metrics.png")
    try:
        train, evals = read_metrics(src)
    except (OSError, ValueError) as e:
        print(f"plot_metrics.py: {src}: {e}", file=sys.stderr)
        return 1
    if not train:
        print(f"plot_metrics.py: {src}: no training steps in it", file=sys.stderr)
        return 1
    fig, (loss_ax, lr_ax) = plt.subplots(2, 1, figsize=(7.5, 6), sharex=True, height_ratios=(2, 1))
    steps = [r["step"] for r in train]
    loss_ax.plot(steps, [r["loss"] for r in train], lw=1, label="training loss")
    if evals:
        loss_ax.plot([r["step"] for r in evals], [r["validation_loss"] for r in evals], "o-", ms=4,
                     label="validation loss")
    loss_ax.set_ylabel("loss")
    loss_ax.grid(alpha=0.3)
    loss_ax.legend()
    lr_ax.plot(steps, [r["learning_rate"] for r in train], color="tab:green", lw=1)
    lr_ax.set_ylabel("learning rate")
    lr_ax.set_xlabel("optimizer step")
    lr_ax.ticklabel_format(axis="y", style="sci", scilimits=(0, 0))
    lr_ax.grid(alpha=0.3)
    fig.suptitle(f"{src.parent.name or src.name}: {len(train)} steps")
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    print(f"plot_metrics.py: wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
