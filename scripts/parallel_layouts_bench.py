#!/usr/bin/env python3
"""Parallel layouts side by side (3D parallelism's benchmark), every ratio from this one run.

Measures, on this machine, 2 processes (or 2 CPU lanes) x 1 thread each, for each --models entry at
--batch-size x --model-max-length tokens:
  * run_data_parallel (D,T,P) = (2,1,1), (1,2,1) and (1,1,2) (1F1B, --n_chunk M);
  * run_pipeline's threaded 1F1B pipeline on 2 lanes (--n_chunk M), and its model parallel (one
    micro-batch, the same stages), the bar the pipeline is held to;
taking turns for --rounds rounds so that a slow spell of this shared machine falls on all of them.
A run's tokens/s is the sum over the ranks that report (one per model replica: SPEC §7.2) of their
Tokens_per_sec, the median over its measured epochs; each layout's figure is the median over rounds,
and each ratio the median of the rounds' ratios.

Writes WORKDIR/parallel_layouts/*.log, OUT_DIR/parallel_layouts.json and draws
OUT_DIR/parallel_layouts.png. On CPUs a "device" is one core of a shared 2-core machine.
"""
import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys

from bench_common import DP_EPOCH_RE, PP_EPOCH_RE, BenchmarkError, free_port

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# name -> (program, flags); every run 2 processes or lanes of 1 thread.
LAYOUTS = {
    "data (2,1,1)": ("run_data_parallel", ["--world_size", "2"]),
    "tensor (1,2,1)": ("run_data_parallel", ["--world_size", "2", "--tensor_parallel_size", "2"]),
    "pipeline processes (1,1,2)": ("run_data_parallel", ["--world_size", "2", "--pipeline_parallel_size", "2",
                                                         "--pipeline_schedule", "1f1b"]),
    "pipeline threads": ("run_pipeline", ["--model_parallel_mode", "pipeline_parallel", "--devices", "cpu:0,cpu:1",
                                          "--pipeline_schedule", "1f1b"]),
    "model parallel threads": ("run_pipeline", ["--model_parallel_mode", "model_parallel", "--devices", "cpu:0,cpu:1"]),
}
PIPELINED = ("pipeline processes (1,1,2)", "pipeline threads")


def tokens_per_sec(text, warmup, path):
    """The run's tokens/s per measured epoch: the reporting ranks' figures summed (SPEC §7.2: one
    per replica), epochs before `warmup` dropped. Raises BenchmarkError naming the log when an
    epoch has no line."""
    by_epoch = {}
    for line in text.splitlines():
        m = DP_EPOCH_RE.match(line.strip())
        if m:
            by_epoch.setdefault(int(m[1]), []).append(float(m[4]))
            continue
        m = PP_EPOCH_RE.match(line.strip())
        if m:
            by_epoch.setdefault(int(m[1]), []).append(float(m[3]))
    measured = [sum(rates) for epoch, rates in sorted(by_epoch.items()) if epoch >= warmup]
    if not measured:
        raise BenchmarkError(f"{path}: no epoch line at or after epoch {warmup}")
    return measured


def run_layout(args, name, model, round_index):
    program, flags = LAYOUTS[name]
    slug = "".join(c if c.isalnum() else "_" for c in f"{model}_{name}_r{round_index}")
    work = os.path.join(args.workdir, "parallel_layouts", slug)
    shutil.rmtree(work, ignore_errors=True)
    cmd = [os.path.join(args.build_dir, program), "--model", model, "--batch_size", str(args.batch_size),
           "--model_max_length", str(args.model_max_length), "--n_epochs", str(args.epochs),
           "--max_batches", str(args.max_batches), "--threads_per_device", "1", "--benchmark_only",
           "--no_progress", "--workdir", work] + flags
    if name in PIPELINED:
        cmd += ["--n_chunk", str(args.n_chunk)]
    if program == "run_data_parallel":
        cmd += ["--master_port", str(free_port())]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.run_timeout)
    log = work + ".log"
    os.makedirs(os.path.dirname(log), exist_ok=True)
    with open(log, "w") as f:
        f.write(" ".join(cmd) + "\n" + proc.stdout + "\n--- stderr ---\n" + proc.stderr)
    if proc.returncode != 0:
        raise BenchmarkError(f"{name} on {model} exited {proc.returncode}; see {log}")
    return statistics.median(tokens_per_sec(proc.stdout, args.warmup_epochs, log))


def ratios(rounds, numerator, denominator):
    values = [r[numerator] / r[denominator] for r in rounds]
    return {"median": statistics.median(values), "per_round": values}


def summarise(model, rounds):
    """Per-layout medians over rounds and the ratios the goals read."""
    layouts = {name: statistics.median(r[name] for r in rounds) for name in LAYOUTS}
    return {
        "model": model,
        "tokens_per_sec": layouts,
        "per_round": rounds,
        "pipeline_processes_over_threads_x": ratios(rounds, "pipeline processes (1,1,2)", "pipeline threads"),
        "pipeline_processes_over_model_parallel_x": ratios(rounds, "pipeline processes (1,1,2)", "model parallel threads"),
        "pipeline_threads_over_model_parallel_x": ratios(rounds, "pipeline threads", "model parallel threads"),
        "fastest": max(layouts, key=layouts.get),
    }


def draw(results, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, len(results), figsize=(6 * len(results), 4.5), squeeze=False)
    for ax, result in zip(axes[0], results):
        names = list(result["tokens_per_sec"])
        values = [result["tokens_per_sec"][n] for n in names]
        ax.barh(names, values, color=["#4c72b0", "#dd8452", "#55a868", "#8fd19e", "#c44e52"])
        for y, v in enumerate(values):
            ax.text(v, y, f" {v:,.0f}", va="center", fontsize=8)
        ax.invert_yaxis()
        ax.set_xlabel("tokens/s (sum over replicas, median over rounds)")
        ax.set_title(f"{result['model']}: 2 CPU processes (or lanes) x 1 thread")
    fig.suptitle("Parallel layouts on one shared 2-core CPU machine (a 'device' is one core)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--build-dir", default=os.path.join(REPO_ROOT, "build"))
    p.add_argument("--workdir", default="./workdir")
    p.add_argument("--out-dir", default=os.path.join(REPO_ROOT, "submit_figures"))
    p.add_argument("--models", default="gpt2-mini,gpt2", help="comma-separated presets (gpt2 = GPT-2 124M)")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--model-max-length", type=int, default=64)
    p.add_argument("--n-chunk", type=int, default=4, help="micro-batches M of the pipelines")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--warmup-epochs", type=int, default=1)
    p.add_argument("--max-batches", type=int, default=4, help="batches per epoch")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--run-timeout", type=float, default=1800.0)
    args = p.parse_args(argv)
    if args.warmup_epochs >= args.epochs:
        raise SystemExit("--warmup-epochs must be below --epochs")

    results = []
    for model in args.models.split(","):
        rounds = []
        for r in range(args.rounds):
            rounds.append({name: run_layout(args, name, model, r) for name in LAYOUTS})
            print(f"[parallel_layouts] {model} round {r}: " +
                  ", ".join(f"{n} {v:.0f}" for n, v in rounds[-1].items()), file=sys.stderr)
        results.append(summarise(model, rounds))
    out = {
        "device": "CPU processes (or run_pipeline lanes), one core each, of a shared 2-core machine",
        "batch": args.batch_size, "model_max_length": args.model_max_length, "n_chunk": args.n_chunk,
        "results": results,
        "goals": {
            f"{r['model']}: pipeline over processes >= 0.95x the threaded pipeline":
                r["pipeline_processes_over_threads_x"]["median"] >= 0.95 for r in results},
        "command": " ".join([sys.executable] + sys.argv),
    }
    for r in results:
        out["goals"][f"{r['model']}: pipeline over processes >= 1.45x model parallel at M={args.n_chunk}"] = \
            r["pipeline_processes_over_model_parallel_x"]["median"] >= 1.45
    os.makedirs(args.out_dir, exist_ok=True)
    with open(os.path.join(args.out_dir, "parallel_layouts.json"), "w") as f:
        json.dump(out, f, indent=2)
    draw(results, os.path.join(args.out_dir, "parallel_layouts.png"))
    print(json.dumps({"goals": out["goals"], "tokens_per_sec": {r["model"]: r["tokens_per_sec"] for r in results}},
                     indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
