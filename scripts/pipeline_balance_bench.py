#!/usr/bin/env python3
"""The pipelines' default split: GPT-2 cut by its own estimated costs, against today's even split
and the timed one, every ratio from this one run.

Two parts:
  * build/pipeline_balance for --balance-models: the default split (GPT-2's pieces costed from
    their shapes), the timed split (--balance auto's measurements on this machine, one thread), and
    each stage's timed seconds under both: the default's slowest stage over the timed split's
    slowest must be within 10%;
  * run_data_parallel --world_size 2 --pipeline_parallel_size 2 --n_chunk 4 (2 processes x 1
    thread, --benchmark_only, dropout 0) on a Hugging Face GPT-2 of 4 blocks, width 256 and
    vocabulary 8192 (freshly initialised, written under WORKDIR), batch 32 x 128 tokens, with the
    default split, the even split (--balance 2,2) and --balance auto, taking turns for --rounds
    rounds (the order reversed every other round); tokens/s is the median over the measured
    epochs, and each ratio the median over rounds of that round's ratio.

Writes WORKDIR/pipeline_balance/*.log, OUT_DIR/pipeline_balance.json and
OUT_DIR/pipeline_balance.png. On CPUs a "device" is one core of a shared 2-core machine.
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
SPLITS = {"default (by cost)": [], "even 2,2": ["--balance", "2,2"], "auto (by time)": ["--balance", "auto"]}
BALANCE_LINE = re.compile(r"stages=2 balance=(\S+)")


def make_model(args):
    """4 blocks, width 256, 4 heads, vocabulary 8192, 256 positions, as a Hugging Face folder."""
    folder = os.path.join(args.workdir, "pipeline_balance", "gpt2-4x256-v8192")
    if os.path.isfile(os.path.join(folder, "model.safetensors")):
        return folder
    from transformers import GPT2Config, GPT2LMHeadModel
    import torch
    torch.manual_seed(0)
    config = GPT2Config(n_layer=4, n_embd=256, n_head=4, n_positions=256, vocab_size=8192)
    GPT2LMHeadModel(config).save_pretrained(folder, safe_serialization=True)
    return folder


def run_split(args, model, name, tag):
    slug = "".join(c if c.isalnum() else "_" for c in f"{name}_{tag}")
    work = os.path.join(args.workdir, "pipeline_balance", slug)
    shutil.rmtree(work, ignore_errors=True)
    cmd = [os.path.join(args.build_dir, "run_data_parallel"), "--model_path", model, "--world_size", "2",
           "--pipeline_parallel_size", "2", "--n_chunk", "4", "--batch_size", "32", "--model_max_length", "128",
           "--n_epochs", str(args.epochs), "--max_batches", str(args.max_batches), "--threads_per_device", "1",
           "--benchmark_only", "--no_progress", "--dropout", "0", "--master_port", str(free_port()),
           "--workdir", work] + SPLITS[name]
    run = run_watched(cmd, args.run_timeout)
    log = work + ".log"
    write_log(log, cmd, run)
    if run.returncode != 0:
        raise BenchmarkError(f"{name} exited {run.returncode} ({error_line(run.stderr)}); see {log}")
    split = BALANCE_LINE.search(run.stderr)
    if not split:
        raise BenchmarkError(f"{log}: no balance in the stages line")
    return {"tokens_per_sec": statistics.median(tokens_per_sec(run.stdout, args.warmup_epochs, log)),
            "split": split[1]}


def estimate_against_timing(args):
    cmd = [os.path.join(args.build_dir, "pipeline_balance"), "--models", args.balance_models, "--stages", "2",
           "--rows", "8", "--tokens", "128", "--threads", "1"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.run_timeout)
    if proc.returncode != 0:
        raise BenchmarkError(f"pipeline_balance exited {proc.returncode}: {proc.stderr.strip()[-500:]}")
    return json.loads(proc.stdout)


def ratio(rounds, numerator, denominator):
    values = [r[numerator]["tokens_per_sec"] / r[denominator]["tokens_per_sec"] for r in rounds]
    return {"median": statistics.median(values), "per_round": values}


def draw(result, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (stages, speed) = plt.subplots(1, 2, figsize=(13, 4.6))
    models = result["estimate_against_timing"]["models"]
    width = 0.25
    for i, key in enumerate(("even_split", "default_split", "timed_split")):
        xs = [j + (i - 1) * width for j in range(len(models))]
        slowest = [max(m["timed_stage_seconds"][key]) / max(m["timed_stage_seconds"]["timed_split"]) for m in models]
        stages.bar(xs, slowest, width, label=key.replace("_", " "))
    stages.set_xticks(range(len(models)))
    stages.set_xticklabels([f"{m['model']}\n{m['default_split']} / {m['timed_split']}" for m in models], fontsize=8)
    stages.axhline(1.10, color="black", linestyle=":", linewidth=1)
    stages.set_ylabel("slowest stage's timed seconds / the timed split's")
    stages.set_title("2 stages: slowest stage under each split (default / timed split below)", fontsize=10)
    stages.legend(fontsize=8)
    names = list(SPLITS)
    medians = [result["tokens_per_sec"][n] for n in names]
    speed.bar(range(len(names)), medians, color=["tab:orange", "tab:blue", "tab:green"])
    speed.set_xticks(range(len(names)))
    speed.set_xticklabels([f"{n}\n{result['splits'][n]}" for n in names], fontsize=8)
    speed.set_ylabel("tokens/s (median over rounds)")
    speed.set_title("run_data_parallel P = 2, M = 4, 4 blocks x 256, vocabulary 8192", fontsize=10)
    fig.suptitle("Pipeline split: 2 CPU processes x 1 thread (a 'device' is one core of a shared 2-core machine)",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--build-dir", default=os.path.join(REPO_ROOT, "build"))
    p.add_argument("--workdir", default="./workdir")
    p.add_argument("--out-dir", default=os.path.join(REPO_ROOT, "submit_figures"))
    p.add_argument("--balance-models", default="gpt2:1417,gpt2:50257,gpt2-mini:1417,gpt2-mini:4096",
                   help="pipeline_balance's --models")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--warmup-epochs", type=int, default=1)
    p.add_argument("--max-batches", type=int, default=4, help="batches per epoch")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--run-timeout", type=float, default=1800.0)
    args = p.parse_args(argv)
    if args.warmup_epochs >= args.epochs:
        raise SystemExit("--warmup-epochs must be below --epochs")

    estimate = estimate_against_timing(args)
    model = make_model(args)
    names = list(SPLITS)
    rounds = []
    for r in range(args.rounds):
        order = names if r % 2 == 0 else names[::-1]
        rounds.append({name: run_split(args, model, name, f"r{r}") for name in order})
        print(f"[pipeline_balance] round {r}: " +
              ", ".join(f"{n} ({rounds[-1][n]['split']}) {rounds[-1][n]['tokens_per_sec']:.0f} tok/s" for n in names),
              file=sys.stderr)
    result = {
        "device": f"CPU processes, one core each, of a shared 2-core machine ({cpu_model_name()})",
        "estimate_against_timing": estimate,
        "splits": {n: rounds[0][n]["split"] for n in names},
        "tokens_per_sec": {n: statistics.median(r[n]["tokens_per_sec"] for r in rounds) for n in names},
        "default_over_even": ratio(rounds, "default (by cost)", "even 2,2"),
        "default_over_auto": ratio(rounds, "default (by cost)", "auto (by time)"),
        "per_round": rounds,
    }
    result["goals"] = {
        "default split over the even split, tokens/s >= 1.25x": result["default_over_even"]["median"] >= 1.25,
    }
    for m in estimate["models"]:
        result["goals"][f"{m['model']}: default's slowest stage within 10% of the timed split's"] = \
            m["default_slowest_over_timed_slowest"] <= 1.10
    result["command"] = " ".join(["scripts/pipeline_balance_bench.py"] + (argv if argv is not None else sys.argv[1:]))
    os.makedirs(args.out_dir, exist_ok=True)
    with open(os.path.join(args.out_dir, "pipeline_balance.json"), "w") as f:
        json.dump(result, f, indent=2)
    draw(result, os.path.join(args.out_dir, "pipeline_balance.png"))
    print(json.dumps({"goals": result["goals"], "splits": result["splits"],
                      "tokens_per_sec": result["tokens_per_sec"],
                      "default_over_even": result["default_over_even"]["median"]}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
