"""Optimizer post-validation against the synchronous step, every ratio from this one run.

run_data_parallel --world_size 2 --pipeline_parallel_size 2 (2 processes x 1 thread,
--benchmark_only, dropout 0) at batch 32 x 128 tokens, M micro-batches, under --pipeline_schedule
zb1p and zbv, each with post-validation (the default: stages other than the first step before the
global norm arrives) and with --synchronous_step, taking turns for --rounds rounds (the order
reversed every other round). --max_grad_norm is set where clipping rarely applies (gpt2-mini's
norms are about 4 to 11 over the first steps: 10 clips the first step or two), so that the early
steps stand; each run's stderr says how many stages' steps were taken early and how many undone.
For each run: tokens/s (the median over the measured epochs, the first --warmup-epochs dropped),
the bubble from each rank's trace, and each rank's peak resident memory. Each ratio is the median
over rounds of that round's ratio.

Writes WORKDIR/zero_bubble/*.log and OUT_DIR/post_validation.json. On CPUs a "device" is one core
of a shared 2-core machine.
"""
import argparse
import json
import os
import statistics
import sys

from bench_common import add_folder_arguments, cpu_model_name
from zero_bubble_bench import run_schedule

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VARIANTS = (("zb1p", ()), ("zb1p", ("--synchronous_step",)), ("zbv", ()), ("zbv", ("--synchronous_step",)))


def name_of(schedule, extra):
    return schedule + ("_synchronous" if extra else "_post_validated")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_folder_arguments(p, REPO_ROOT)
    p.add_argument("--model", default="gpt2-mini")
    p.add_argument("--n-chunk", type=int, default=4)
    p.add_argument("--max-grad-norm", default="10")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--warmup-epochs", type=int, default=1)
    p.add_argument("--max-batches", type=int, default=4, help="batches per epoch")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--run-timeout", type=float, default=1800.0)
    args = p.parse_args(argv)
    if args.warmup_epochs >= args.epochs:
        raise SystemExit("--warmup-epochs must be below --epochs")
    rounds = []
    for r in range(args.rounds):
        order = VARIANTS if r % 2 == 0 else VARIANTS[::-1]
        rounds.append({name_of(s, extra): run_schedule(args, args.model, args.n_chunk, s, f"pv{r}{'s' if extra else 'p'}",
                                                       extra, args.max_grad_norm)
                       for s, extra in order})
        print(f"[post_validation] round {r}: " + ", ".join(
            f"{k} {v['tokens_per_sec']:.0f} tok/s" for k, v in rounds[-1].items()), file=sys.stderr)
    summary = {}
    for schedule in ("zb1p", "zbv"):
        early, sync = f"{schedule}_post_validated", f"{schedule}_synchronous"
        ratios = [r[early]["tokens_per_sec"] / r[sync]["tokens_per_sec"] for r in rounds]
        summary[schedule] = {
            "tokens_per_sec": {k: statistics.median(r[k]["tokens_per_sec"] for r in rounds) for k in (early, sync)},
            "post_validated_over_synchronous": {"median": statistics.median(ratios), "per_round": ratios},
            "early_steps_per_run": statistics.median(r[early]["early_steps"] for r in rounds),
            "undone_steps_per_run": statistics.median(r[early]["undone_steps"] for r in rounds),
            "peak_rss_bytes_per_rank": {k: [max(r[k]["peak_rss_bytes_per_rank"][i] for r in rounds) for i in (0, 1)]
                                        for k in (early, sync)},
        }
    result = {
        "device": f"CPU processes, one core each, of a shared 2-core machine ({cpu_model_name()})",
        "model": args.model, "n_chunk": args.n_chunk, "max_grad_norm": float(args.max_grad_norm),
        "summary": summary,
        "goals": {"post-validation over the synchronous step >= 1.02x tokens/s (zb1p)":
                  summary["zb1p"]["post_validated_over_synchronous"]["median"] >= 1.02,
                  "post-validation over the synchronous step >= 1.02x tokens/s (zbv)":
                  summary["zbv"]["post_validated_over_synchronous"]["median"] >= 1.02},
        "per_round": rounds,
        "command": " ".join(["scripts/post_validation_bench.py"] + (argv if argv is not None else sys.argv[1:])),
    }
    os.makedirs(args.out_dir, exist_ok=True)
    with open(os.path.join(args.out_dir, "post_validation.json"), "w") as f:
        json.dump(result, f, indent=2)
    print(json.dumps({"goals": result["goals"], "summary": summary}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
