#!/usr/bin/env python3
"""Context parallelism's benchmark: what splitting each sequence saves and costs, every ratio from
this one run.

Measures, on this machine, run_data_parallel with --benchmark_only on gpt2-mini's shape with
n_positions --n-positions (a freshly initialised Hugging Face folder written under WORKDIR and
passed as --model_path), at the same global batch of --batch-size rows, for each of --lengths
tokens per sequence:
  * one process, (D,C) = (1,1);
  * (2,1): data parallelism, each rank half the rows;
  * (1,2): context parallelism, each rank half of every sequence (the zigzag split);
  * T = 2, and T = 2 with --sequence_parallel where the program has that flag (probed with --help;
    recorded as absent otherwise);
every run of 2 processes x 1 thread (the one-process run 1 thread), taking turns for --rounds
rounds so that a slow spell of this shared machine falls on all of them. For each run: tokens/s
(the reporting ranks' sum, median over the measured epochs), the program's own memory plan line
(model state and the activation estimate, per rank), and two peaks per rank:
  * the CPU tensors' peaks: the program run with HARNESS_COUNT_CPU_TENSORS=1 counts every tensor
    allocation (the CPU's analogue of torch.cuda.max_memory_allocated) and each rank prints the
    most bytes its tensors held at once, and the most a training step after the first allocated
    over what it held once its gradients were cleared: the weights and AdamW's state are what is
    left, so the excess is the step's activations (with the gradients made while they are held).
    That is the measured activation peak the plan's estimate is held to;
  * the peak resident memory (VmHWM of the worker processes, read from /proc while they run), which
    also holds the libraries, the tokenizer's and loader's work, and the free space inside glibc's
    heap that the program keeps for reuse (docs/performance.md). Its increase over the same layout's
    run at --base-length tokens (one run each, in the first round) is reported beside.

Writes WORKDIR/context_parallel/*.log, OUT_DIR/context_parallel.json and draws
OUT_DIR/context_parallel.png. On CPUs a "device" is one core of a shared 2-core machine.
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

# name -> flags; None marks the layout whose flag the program may lack.
LAYOUTS = {
    "one process (1,1)": ["--world_size", "1"],
    "data (2,1)": ["--world_size", "2"],
    "context (1,2)": ["--world_size", "2", "--context_parallel_size", "2"],
    "tensor T=2": ["--world_size", "2", "--tensor_parallel_size", "2"],
    "tensor T=2 + sequence parallel": ["--world_size", "2", "--tensor_parallel_size", "2", "--sequence_parallel"],
}
SEQUENCE_PARALLEL = "tensor T=2 + sequence parallel"

TENSOR_PEAK = re.compile(r"rank (\d+)'s CPU tensors peaked at (\d+) bytes; a training step after the first "
                         r"allocated at most (\d+) bytes over what it held once its gradients were cleared")
PLAN_LINE = re.compile(r"memory plan per rank \(the most: ([^)]*)\): weights (\d+) \+ gradients (\d+) \+ "
                       r"optimizer (\d+) = model state (\d+) bytes, activations ~(\d+) bytes")


def plan_of(stderr, log):
    """The run's memory plan line: model state and activation bytes per rank (the most-loaded rank)."""
    m = PLAN_LINE.search(stderr)
    if not m:
        raise BenchmarkError(f"{log}: no memory plan line")
    return {"who": m[1], "model_state_bytes": int(m[5]), "activation_bytes": int(m[6])}


def tensor_peaks_of(stderr, log, ranks):
    """The most-loaded rank's counted CPU tensor peak, and the most a training step allocated over
    what it held once its gradients were cleared (HARNESS_COUNT_CPU_TENSORS=1's closing lines)."""
    found = {int(m[1]): (int(m[2]), int(m[3])) for m in TENSOR_PEAK.finditer(stderr)}
    if sorted(found) != list(range(ranks)):
        raise BenchmarkError(f"{log}: CPU tensor peaks from ranks {sorted(found)}, not from all {ranks}")
    return {"peak": max(p for p, _ in found.values()), "step": max(a for _, a in found.values())}


def make_model(args):
    """gpt2-mini's shape (4 layers, 256 wide, 4 heads, vocabulary 4096) with n_positions long enough
    for the longest length, freshly initialised, as a Hugging Face folder."""
    folder = os.path.join(args.workdir, "context_parallel", f"gpt2-mini-{args.n_positions}")
    if os.path.isfile(os.path.join(folder, "model.safetensors")):
        return folder
    from transformers import GPT2Config, GPT2LMHeadModel
    import torch
    torch.manual_seed(0)
    config = GPT2Config(n_layer=4, n_embd=256, n_head=4, n_positions=args.n_positions, vocab_size=4096)
    GPT2LMHeadModel(config).save_pretrained(folder, safe_serialization=True)
    return folder


def has_flag(args, flag):
    text = subprocess.run([program(args), "--help"], capture_output=True, text=True).stdout
    return flag in text


def program(args):
    return os.path.join(args.build_dir, "run_data_parallel")


def run_layout(args, model, name, length, tag):
    slug = "".join(c if c.isalnum() else "_" for c in f"{name}_{length}_{tag}")
    work = os.path.join(args.workdir, "context_parallel", slug)
    shutil.rmtree(work, ignore_errors=True)
    cmd = [program(args), "--model_path", model, "--batch_size", str(args.batch_size), "--model_max_length",
           str(length), "--n_epochs", str(args.epochs), "--max_batches", str(args.max_batches),
           "--threads_per_device", "1", "--benchmark_only", "--no_progress", "--dropout", "0",
           "--master_port", str(free_port()), "--workdir", work] + LAYOUTS[name]
    run = run_watched(cmd, args.run_timeout, env=dict(os.environ, HARNESS_COUNT_CPU_TENSORS="1"))
    log = work + ".log"
    write_log(log, cmd, run)
    if run.returncode != 0:
        raise BenchmarkError(f"{name} at {length} tokens exited {run.returncode} ({error_line(run.stderr)}); see {log}")
    ranks = int(LAYOUTS[name][LAYOUTS[name].index("--world_size") + 1])
    tensors = tensor_peaks_of(run.stderr, log, ranks)
    return {"tokens_per_sec": statistics.median(tokens_per_sec(run.stdout, args.warmup_epochs, log)),
            "peak_rss_bytes": max(run.peaks.values()), "tensor_peak_bytes": tensors["peak"],
            "step_tensor_increase_bytes": tensors["step"], "plan": plan_of(run.stderr, log)}


def median_of(rounds, name, key):
    return statistics.median(r[name][key] for r in rounds)


def ratio(rounds, numerator, denominator, key="tokens_per_sec"):
    values = [r[numerator][key] / r[denominator][key] for r in rounds]
    return {"median": statistics.median(values), "per_round": values}


def summarise(length, layouts, rounds, bases):
    """Per-layout medians over rounds, the activations' measured and planned peaks, and the ratios
    the goals read."""
    out = {"tokens": length, "layouts": {}, "per_round": rounds}
    for name in layouts:
        plan = rounds[0][name]["plan"]
        measured = median_of(rounds, name, "step_tensor_increase_bytes")
        peak_rss = median_of(rounds, name, "peak_rss_bytes")
        out["layouts"][name] = {
            "tokens_per_sec": median_of(rounds, name, "tokens_per_sec"),
            "model_state_bytes": plan["model_state_bytes"],
            "tensor_peak_bytes": median_of(rounds, name, "tensor_peak_bytes"),
            "measured_activation_bytes": measured,
            "planned_activation_bytes": plan["activation_bytes"],
            "plan_over_measured": plan["activation_bytes"] / measured if measured > 0 else None,
            "peak_rss_bytes": peak_rss,
            "rss_increase_over_base_bytes": peak_rss - bases[name]["peak_rss_bytes"],
        }
    one, context = out["layouts"]["one process (1,1)"], out["layouts"]["context (1,2)"]
    out["context_activations_over_one_process"] = (context["measured_activation_bytes"] /
                                                    one["measured_activation_bytes"])
    out["context_over_data_tokens_per_sec"] = ratio(rounds, "context (1,2)", "data (2,1)")
    if SEQUENCE_PARALLEL in layouts:
        out["sequence_parallel_over_tensor_tokens_per_sec"] = ratio(rounds, SEQUENCE_PARALLEL, "tensor T=2")
    return out


def goals(results, sequence_parallel):
    longest = results[-1]
    tag = f"at {longest['tokens']} tokens"
    g = {
        f"activation peak per rank, C = 2, <= 0.55x one process's {tag}":
            longest["context_activations_over_one_process"] <= 0.55,
        f"ring exchange overlapped: C = 2 tokens/s >= 0.85x D = 2 {tag}":
            longest["context_over_data_tokens_per_sec"]["median"] >= 0.85,
    }
    for r in results:
        for name, layout in r["layouts"].items():
            share = layout["plan_over_measured"]
            g[f"memory plan's activations within 15% of the measured, {name}, {r['tokens']} tokens"] = \
                share is not None and abs(share - 1.0) <= 0.15
    if sequence_parallel:
        sp, t = longest["layouts"][SEQUENCE_PARALLEL], longest["layouts"]["tensor T=2"]
        g[f"sequence parallelism lowers the activation peak {tag}"] = \
            sp["measured_activation_bytes"] < t["measured_activation_bytes"]
        g[f"sequence parallelism tokens/s >= 0.95x T = 2 without it {tag}"] = \
            longest["sequence_parallel_over_tensor_tokens_per_sec"]["median"] >= 0.95
    return g


def draw(results, path, base_length):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    names = list(results[0]["layouts"])
    lengths = [r["tokens"] for r in results]
    fig, (speed, memory) = plt.subplots(1, 2, figsize=(13, 4.8))
    width = 0.8 / len(names)
    for i, name in enumerate(names):
        xs = [j + (i - (len(names) - 1) / 2) * width for j in range(len(lengths))]
        speed.bar(xs, [r["layouts"][name]["tokens_per_sec"] for r in results], width, label=name)
        memory.bar(xs, [r["layouts"][name]["measured_activation_bytes"] / 2**20 for r in results], width,
                   label=name)
        memory.scatter(xs, [r["layouts"][name]["planned_activation_bytes"] / 2**20 for r in results],
                       marker="_", s=200, color="black", zorder=3, label="memory plan" if i == 0 else None)
        memory.scatter(xs, [r["layouts"][name]["rss_increase_over_base_bytes"] / 2**20 for r in results],
                       marker=".", s=40, color="grey", zorder=3,
                       label=f"resident set's increase over a {base_length}-token run" if i == 0 else None)
    for ax in (speed, memory):
        ax.set_xticks(range(len(lengths)))
        ax.set_xticklabels([f"{n} tokens" for n in lengths])
    speed.set_ylabel("tokens/s (sum over replicas, median over rounds)")
    memory.set_ylabel("activations per rank, MiB (a step's counted CPU tensors)")
    memory.legend(fontsize=8)
    speed.set_title("speed, same global batch")
    memory.set_title("activation memory per rank: measured (bars), planned (ticks)")
    fig.suptitle("Context parallelism, gpt2-mini's shape: 2 CPU processes x 1 thread "
                 "(a 'device' is one core of a shared 2-core machine)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--build-dir", default=os.path.join(REPO_ROOT, "build"))
    p.add_argument("--workdir", default="./workdir")
    p.add_argument("--out-dir", default=os.path.join(REPO_ROOT, "submit_figures"))
    p.add_argument("--lengths", default="256,512,1024", help="comma-separated tokens per sequence")
    p.add_argument("--base-length", type=int, default=16, help="the short run whose peak the activations are over")
    p.add_argument("--n-positions", type=int, default=1024)
    p.add_argument("--batch-size", type=int, default=4, help="global rows per step")
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--warmup-epochs", type=int, default=1)
    p.add_argument("--max-batches", type=int, default=3, help="batches per epoch")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--run-timeout", type=float, default=1800.0)
    args = p.parse_args(argv)
    if args.warmup_epochs >= args.epochs:
        raise SystemExit("--warmup-epochs must be below --epochs")
    lengths = [int(n) for n in args.lengths.split(",")]
    if max(lengths) > args.n_positions or args.base_length >= min(lengths):
        raise SystemExit("--lengths must lie in (--base-length, --n-positions]")

    model = make_model(args)
    sequence_parallel = has_flag(args, "--sequence_parallel")
    layouts = [n for n in LAYOUTS if n != SEQUENCE_PARALLEL or sequence_parallel]
    bases = {name: run_layout(args, model, name, args.base_length, "base") for name in layouts}
    results = []
    for length in lengths:
        rounds = []
        for r in range(args.rounds):
            order = layouts if r % 2 == 0 else layouts[::-1]
            rounds.append({name: run_layout(args, model, name, length, f"r{r}") for name in order})
            print(f"[context_parallel] {length} tokens, round {r}: " +
                  ", ".join(f"{n} {rounds[-1][n]['tokens_per_sec']:.0f} tok/s "
                            f"{rounds[-1][n]['tensor_peak_bytes'] / 2**20:.0f} MiB" for n in layouts), file=sys.stderr)
        results.append(summarise(length, layouts, rounds, bases))
    out = {
        "device": f"CPU processes, one core each, of a shared 2-core machine ({cpu_model_name()})",
        "model": f"gpt2-mini's shape, n_positions {args.n_positions}", "global_batch": args.batch_size,
        "base_length": args.base_length, "bases": bases,
        "sequence_parallel": "measured" if sequence_parallel else "absent: run_data_parallel has no --sequence_parallel",
        "results": results, "goals": goals(results, sequence_parallel),
        "command": " ".join([sys.executable] + sys.argv),
    }
    os.makedirs(args.out_dir, exist_ok=True)
    with open(os.path.join(args.out_dir, "context_parallel.json"), "w") as f:
        json.dump(out, f, indent=2)
    draw(results, os.path.join(args.out_dir, "context_parallel.png"), args.base_length)
    print(json.dumps({"goals": out["goals"],
                      "tokens_per_sec": {r["tokens"]: {n: round(v["tokens_per_sec"]) for n, v in r["layouts"].items()}
                                         for r in results}}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
