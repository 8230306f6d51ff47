#!/usr/bin/env python3
"""The zero-bubble schedules against 1F1B, every ratio from this one run.

run_data_parallel --world_size 2 --pipeline_parallel_size 2 (2 processes x 1 thread,
--benchmark_only, dropout 0, --max_grad_norm 1.0) at batch 32 x 128 tokens, for each model of
--models and each M of --n-chunks, under --pipeline_schedule 1f1b, zb1p and zbv, taking turns for
--rounds rounds (the order reversed every other round). For each run:
  * tokens/s, the median over the measured epochs (the first --warmup-epochs dropped);
  * the bubble: from each rank's trace (--trace), the time of a step (after the run's first) in
    which the rank ran no forward, backward or W pass, over the step's time, averaged over the
    ranks and steps. A step's time includes the optimizer and the gradient norm's all-reduce, so
    the figure is that idle share, not the schedule's alone;
  * each rank's peak resident memory (VmHWM).
Each ratio is the median over rounds of that round's ratio. Beside them, the paper's bubbles with
F, B and W one unit each (pipeline_schedule's clock).

Writes WORKDIR/zero_bubble/*.log (each run's folder is removed once measured), OUT_DIR/zero_bubble.json and OUT_DIR/zero_bubble.png. On CPUs a
"device" is one core of a shared 2-core machine.
"""
import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys

from bench_common import BenchmarkError, cpu_model_name, free_port
from parallel_layouts_bench import tokens_per_sec
from zero_memory_bench import error_line, run_watched, write_log

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCHEDULES = ("1f1b", "zb1p", "zbv")
COMPUTE = ("forward", "backward", "weight")
BUBBLE_LINE = re.compile(r"Bubble ratio: ([\d.]+)% against 1F1B's ([\d.]+)%")


def idle_share(trace_path):
    """The share of each step (the first left out) in which this rank ran no stage action."""
    with open(trace_path) as f:
        events = [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X"]
    steps = sorted((e for e in events if e["name"] == "step"), key=lambda e: e["ts"])[1:]
    actions = [e for e in events if e["name"] in COMPUTE]
    if not steps or not actions:
        raise BenchmarkError(f"{trace_path}: no steps or no stage actions traced")
    busy = total = 0.0
    for step in steps:
        start, end = step["ts"], step["ts"] + step["dur"]
        total += step["dur"]
        busy += sum(min(e["ts"] + e["dur"], end) - e["ts"] for e in actions if start <= e["ts"] < end)
    return 1.0 - busy / total


POST_VALIDATION_LINE = re.compile(r"post-validation stepped (\d+) times before the global norm arrived, (\d+) of them undone")


def run_schedule(args, model, n_chunk, schedule, tag, extra=(), max_grad_norm="1.0"):
    slug = f"{model}_m{n_chunk}_{schedule}_{tag}".replace("/", "_")
    work = os.path.join(args.workdir, "zero_bubble", slug)
    shutil.rmtree(work, ignore_errors=True)
    os.makedirs(work, exist_ok=True)
    trace = os.path.join(work, "trace.json")
    cmd = [os.path.join(args.build_dir, "run_data_parallel"), "--model", model, "--world_size", "2",
           "--pipeline_parallel_size", "2", "--pipeline_schedule", schedule, "--n_chunk", str(n_chunk),
           "--batch_size", "32", "--model_max_length", "128", "--n_epochs", str(args.epochs),
           "--max_batches", str(args.max_batches), "--threads_per_device", "1", "--benchmark_only",
           "--no_progress", "--dropout", "0", "--max_grad_norm", str(max_grad_norm), "--master_port", str(free_port()),
           "--workdir", work, "--trace", trace, *extra]
    run = run_watched(cmd, args.run_timeout)
    log = work + ".log"
    write_log(log, cmd, run)
    if run.returncode != 0:
        raise BenchmarkError(f"{slug} exited {run.returncode} ({error_line(run.stderr)}); see {log}")
    bubbles = [idle_share(os.path.join(work, f"trace.rank{r}.json")) for r in (0, 1)]
    shutil.rmtree(work, ignore_errors=True)  # the model each run saves (GPT-2 124M: 2 GB); the log stays
    return {"tokens_per_sec": statistics.median(tokens_per_sec(run.stdout, args.warmup_epochs, log)),
            "bubble": statistics.mean(bubbles), "bubble_per_rank": bubbles,
            "peak_rss_bytes_per_rank": [run.peaks.get(r, 0) for r in sorted(run.peaks)],
            "early_steps": sum(int(m[1]) for m in POST_VALIDATION_LINE.finditer(run.stderr)),
            "undone_steps": sum(int(m[2]) for m in POST_VALIDATION_LINE.finditer(run.stderr))}


def paper_bubbles(args, n_chunk):
    """pipeline_schedule's bubbles on the paper's clock (F, B and W one unit) for P = 2."""
    out = {}
    for schedule in ("zb1p", "zbv"):
        proc = subprocess.run([os.path.join(args.build_dir, "pipeline_schedule"), "--schedule", schedule,
                               "--stages", "2", "--micro_batches", str(n_chunk)],
                              capture_output=True, text=True, timeout=60)
        m = BUBBLE_LINE.search(proc.stdout)
        if proc.returncode != 0 or not m:
            raise BenchmarkError(f"pipeline_schedule --schedule {schedule}: {proc.stderr.strip()[-300:]}")
        out[schedule] = float(m[1]) / 100
        out["1f1b"] = float(m[2]) / 100
    return out


def summarise(rounds):
    def median_ratio(key, a, b, invert=False):
        values = [(r[b][key] / r[a][key]) if invert else (r[a][key] / r[b][key]) for r in rounds]
        return {"median": statistics.median(values), "per_round": values}

    def larger_peak_ratio(schedule):
        values = [max(r[schedule]["peak_rss_bytes_per_rank"]) / max(r["1f1b"]["peak_rss_bytes_per_rank"])
                  for r in rounds]
        return {"median": statistics.median(values), "per_round": values}
    return {
        "tokens_per_sec": {s: statistics.median(r[s]["tokens_per_sec"] for r in rounds) for s in SCHEDULES},
        "bubble": {s: statistics.median(r[s]["bubble"] for r in rounds) for s in SCHEDULES},
        "peak_rss_bytes_per_rank": {s: [max(r[s]["peak_rss_bytes_per_rank"][k] for r in rounds) for k in (0, 1)]
                                    for s in SCHEDULES},
        "zb1p_over_1f1b": median_ratio("tokens_per_sec", "zb1p", "1f1b"),
        "zbv_over_1f1b": median_ratio("tokens_per_sec", "zbv", "1f1b"),
        # What a device must hold: each run's larger rank's peak, paired with its round's 1F1B run
        # (a maximum over rounds would let one run's outlier decide).
        "zb1p_peak_over_1f1b": larger_peak_ratio("zb1p"),
        "zbv_peak_over_1f1b": larger_peak_ratio("zbv"),
        "zb1p_bubble_over_1f1b": median_ratio("bubble", "zb1p", "1f1b"),
        "zbv_bubble_over_1f1b": median_ratio("bubble", "zbv", "1f1b"),
    }


def draw(result, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    cases = result["cases"]
    fig, (speed, bubble) = plt.subplots(1, 2, figsize=(13, 4.6))
    width = 0.26
    colors = {"1f1b": "tab:gray", "zb1p": "tab:blue", "zbv": "tab:green"}
    for i, s in enumerate(SCHEDULES):
        xs = [j + (i - 1) * width for j in range(len(cases))]
        speed.bar(xs, [1.0 if s == "1f1b" else c["summary"][f"{s}_over_1f1b"]["median"] for c in cases], width,
                  label=s, color=colors[s])
        bubble.bar(xs, [c["summary"]["bubble"][s] for c in cases], width, label=s + " measured", color=colors[s])
        bubble.scatter(xs, [c["paper_bubble"][s] for c in cases], marker="_", s=300, color="black",
                       label="paper's clock (F = B = W)" if i == 0 else None, zorder=3)
    labels = [f"{c['model']}, M = {c['n_chunk']}\n1F1B {c['summary']['tokens_per_sec']['1f1b']:.0f} tok/s" for c in cases]
    for ax in (speed, bubble):
        ax.set_xticks(range(len(cases)))
        ax.set_xticklabels(labels, fontsize=8)
    speed.axhline(1.08, color="tab:blue", linestyle=":", linewidth=1, label="goal zb1p 1.08x")
    speed.axhline(1.12, color="tab:green", linestyle=":", linewidth=1, label="goal zbv 1.12x")
    speed.set_ylim(0.8, max(1.25, speed.get_ylim()[1]))
    for ax in (speed, bubble):
        ax.legend(fontsize=8)
    speed.set_ylabel("tokens/s over 1F1B's (median of the rounds' ratios)")
    speed.set_title("P = 2 stages, batch 32 x 128, --max_grad_norm 1.0", fontsize=10)
    bubble.set_ylabel("idle share of a step, mean over the 2 ranks")
    bubble.set_title("bubble: measured from the traces, and the paper's on its clock", fontsize=10)
    fig.suptitle("1F1B, ZB-H1 and ZB-V: 2 CPU processes x 1 thread (a 'device' is one core of a shared 2-core "
                 "machine)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--redraw", metavar="JSON", help="only draw the figure again from an earlier run's JSON")
    p.add_argument("--build-dir", default=os.path.join(REPO_ROOT, "build"))
    p.add_argument("--workdir", default="./workdir")
    p.add_argument("--out-dir", default=os.path.join(REPO_ROOT, "submit_figures"))
    p.add_argument("--models", default="gpt2-mini,gpt2", help="model presets, comma-separated")
    p.add_argument("--n-chunks", default="4,8", help="micro-batches per batch, comma-separated")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--warmup-epochs", type=int, default=1)
    p.add_argument("--max-batches", type=int, default=3, help="batches per epoch")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--rounds-for", default="gpt2=1", help="MODEL=ROUNDS overrides, comma-separated")
    p.add_argument("--run-timeout", type=float, default=3600.0)
    args = p.parse_args(argv)
    if args.redraw:
        with open(args.redraw) as f:
            draw(json.load(f), os.path.join(args.out_dir, "zero_bubble.png"))
        return 0
    if args.warmup_epochs >= args.epochs:
        raise SystemExit("--warmup-epochs must be below --epochs")
    rounds_for = dict(item.split("=") for item in args.rounds_for.split(",") if item)

    cases = []
    for model in args.models.split(","):
        for n_chunk in (int(m) for m in args.n_chunks.split(",")):
            rounds = []
            for r in range(int(rounds_for.get(model, args.rounds))):
                order = SCHEDULES if r % 2 == 0 else SCHEDULES[::-1]
                rounds.append({s: run_schedule(args, model, n_chunk, s, f"r{r}") for s in order})
                print(f"[zero_bubble] {model} M={n_chunk} round {r}: " + ", ".join(
                    f"{s} {rounds[-1][s]['tokens_per_sec']:.0f} tok/s bubble {rounds[-1][s]['bubble']:.3f}"
                    for s in SCHEDULES), file=sys.stderr)
            cases.append({"model": model, "n_chunk": n_chunk, "summary": summarise(rounds),
                          "paper_bubble": paper_bubbles(args, n_chunk), "per_round": rounds})
    headline = next((c for c in cases if c["model"] == "gpt2-mini" and c["n_chunk"] == 4), cases[0])["summary"]
    result = {
        "device": f"CPU processes, one core each, of a shared 2-core machine ({cpu_model_name()})",
        "cases": cases,
        "goals": {
            "zb1p over 1f1b (P = 2, M = 4, gpt2-mini) >= 1.08x tokens/s": headline["zb1p_over_1f1b"]["median"] >= 1.08,
            "zb1p's measured bubble <= 0.4x 1f1b's": headline["zb1p_bubble_over_1f1b"]["median"] <= 0.4,
            "zbv over 1f1b >= 1.12x tokens/s": headline["zbv_over_1f1b"]["median"] >= 1.12,
            "zb1p's peak memory (the larger rank's) <= 1.05x 1f1b's": headline["zb1p_peak_over_1f1b"]["median"] <= 1.05,
        },
        "command": " ".join(["scripts/zero_bubble_bench.py"] + (argv if argv is not None else sys.argv[1:])),
    }
    os.makedirs(args.out_dir, exist_ok=True)
    with open(os.path.join(args.out_dir, "zero_bubble.json"), "w") as f:
        json.dump(result, f, indent=2)
    draw(result, os.path.join(args.out_dir, "zero_bubble.png"))
    print(json.dumps({"goals": result["goals"],
                      "cases": [{k: c[k] for k in ("model", "n_chunk", "paper_bubble")} |
                                {"tokens_per_sec": c["summary"]["tokens_per_sec"], "bubble": c["summary"]["bubble"],
                                 "zb1p_over_1f1b": c["summary"]["zb1p_over_1f1b"]["median"],
                                 "zbv_over_1f1b": c["summary"]["zbv_over_1f1b"]["median"]} for c in cases]},
                     indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
