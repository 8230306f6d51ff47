#!/usr/bin/env python3
"""Precision and memory benchmark (issue: beyond fp32 replicas), every ratio from this one run.

Measures, on this machine:
  * the matmul peak: one single-thread process, and two at once (fp32 and bf16, N x N matrices),
    and the two-process fp32 peak again at the start of every round;
  * run_data_parallel, 2 ranks x 1 thread, gpt2-mini: fp32, --precision bf16, --zero_stage 1,
    and --gradient_accumulation_steps 4 on a quarter of the batch (the same examples per optimizer
    step), taking turns for --rounds rounds; tokens/s (the median over every measured epoch),
    model-FLOPs utilisation against the round's two-process fp32 peak and the throughput ratios,
    both per round and their medians over rounds, bytes put into gradient
    all-reduces per optimizer step;
  * --zero_stage 1's AdamW state per rank at 2 and 4 ranks against the replicated run's.

Writes WORKDIR/perf_precision/*.log, merges "precision_memory" into OUT_DIR/benchmark_details.json
and draws OUT_DIR/precision_memory.png. On CPUs a "device" is one core of a shared machine.
"""
import argparse
import json
import multiprocessing as mp
import os
import re
import shutil
import statistics
import subprocess
import sys
import time

from bench_common import free_port

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRAIN = re.compile(r"^Epoch (\d+) on Rank (\d+): Training Time = ([\d.]+), Tokens_per_sec = ([\d.]+)$")
SENT = re.compile(r"gradient sync put (\d+) bytes into all-reduces in (\d+) optimizer steps \((\d+) per step\)")
STATE = re.compile(r"--zero_stage 1 keeps (\d+) bytes of AdamW state on rank 0 \(replicated: (\d+)")
VOCAB = re.compile(r"vocab=(\d+)")
VALIDATION = re.compile(r"^Epoch (\d+) on Rank 0: Validation Loss = ([-+\d.eE]+|nan|inf)$", re.M)
BLEU = re.compile(r"^Epoch (\d+) on Rank 0: BLEU = ([-+\d.eE]+|nan|inf)$", re.M)
# scripts/run.sh's settings (the main job): the quality goal compares bf16 with fp32 on them.
RUN_SH_FLAGS = ["--world_size", "2", "--model", "gpt2-mini", "--n_epochs", "3", "--batch_size", "32",
                "--learning_rate", "1e-3", "--model_max_length", "40", "--fit_vocab"]


def matmul_worker(dtype_name, n, seconds, barrier, out):
    """Multiplies n x n matrices for about `seconds` (at least once); a dtype without fast kernels
    here (bf16 on a CPU without bf16 units is ~100x slower) gets a smaller n, found from a probe, so
    that one product takes at most about `seconds`."""
    import torch
    torch.set_num_threads(1)
    dtype = getattr(torch, dtype_name)
    probe = torch.randn(256, 256).to(dtype)
    start = time.perf_counter()
    probe @ probe
    per_flop = (time.perf_counter() - start) / (2.0 * 256 ** 3)
    while n > 256 and per_flop * 2.0 * n ** 3 > seconds:
        n //= 2
    a, b = torch.randn(n, n).to(dtype), torch.randn(n, n).to(dtype)
    a @ b  # warm-up
    barrier.wait()
    start, repeats = time.perf_counter(), 0
    while repeats == 0 or time.perf_counter() - start < seconds:
        a @ b
        repeats += 1
    out.put((2.0 * n ** 3 * repeats / (time.perf_counter() - start) / 1e9, n))


def matmul_peak(dtype_name, processes, n, seconds=2.0):
    """GFLOP/s of `processes` single-thread processes multiplying at once (summed), and the size
    they used."""
    ctx = mp.get_context("spawn")
    barrier, out = ctx.Barrier(processes), ctx.Queue()
    workers = [ctx.Process(target=matmul_worker, args=(dtype_name, n, seconds, barrier, out))
               for _ in range(processes)]
    for w in workers:
        w.start()
    results = [out.get(timeout=600) for _ in workers]
    for w in workers:
        w.join()
    return sum(r for r, _ in results), min(size for _, size in results)


def run_logged(args, name, cmd):
    """Runs cmd, keeping its stdout and stderr in WORKDIR/perf_precision/NAME[.stderr].log; a
    non-zero exit ends the benchmark with the end of its stderr."""
    perf = os.path.join(args.workdir, "perf_precision")
    os.makedirs(perf, exist_ok=True)
    print(f"[precision] {name}: {' '.join(cmd)}", file=sys.stderr, flush=True)
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.run_timeout)
    with open(os.path.join(perf, name + ".log"), "w") as f:
        f.write(proc.stdout)
    with open(os.path.join(perf, name + ".stderr.log"), "w") as f:
        f.write(proc.stderr)
    if proc.returncode != 0:
        raise SystemExit(f"{name}: exited {proc.returncode}:\n{proc.stderr[-2000:]}")
    return proc


def fresh_run_dir(args, name):
    """WORKDIR/perf_precision/runs/NAME, emptied: a run of an earlier benchmark left its checkpoints
    there, which run_data_parallel rightly refuses to mix with a new run's."""
    folder = os.path.join(args.workdir, "perf_precision", "runs", name)
    shutil.rmtree(folder, ignore_errors=True)
    return folder


def run_dp(args, name, world, batch, extra, epochs, max_batches):
    cmd = [os.path.join(args.build_dir, "run_data_parallel"), "--world_size", str(world), "--batch_size", str(batch),
           "--device", "cpu", "--model", args.model, "--model_max_length", str(args.model_max_length),
           "--fit_vocab", "--benchmark_only", "--no_progress", "--threads_per_device", "1",
           "--n_epochs", str(epochs), "--max_batches", str(max_batches), "--master_port", str(free_port()),
           "--workdir", fresh_run_dir(args, name)] + extra
    proc = run_logged(args, name, cmd)
    per_epoch = {}
    for line in proc.stdout.splitlines():
        m = TRAIN.match(line)
        if m:
            per_epoch.setdefault(int(m[1]), []).append(float(m[4]))
    measured = [sum(v) for e, v in sorted(per_epoch.items()) if e >= args.warmup_epochs]
    sent = SENT.search(proc.stderr)
    state = STATE.search(proc.stderr)
    return {"command": " ".join(cmd),
            "tokens_per_sec": sum(measured) / len(measured) if measured else None,
            "tokens_per_sec_per_epoch": measured,
            "bytes_per_optimizer_step": int(sent[3]) if sent else None,
            "optimizer_steps": int(sent[2]) if sent else None,
            "state_bytes_rank0": int(state[1]) if state else None,
            "replicated_state_bytes": int(state[2]) if state else None,
            "vocab": int(VOCAB.search(proc.stderr)[1])}


def merge_rounds(results):
    """One figure from several runs of one configuration: the median tokens/s over every measured
    epoch of every run; the counts (bytes, state) from the first run, which all share."""
    epochs = sorted(e for r in results for e in r["tokens_per_sec_per_epoch"])
    merged = dict(results[0])
    merged["tokens_per_sec"] = statistics.median(epochs) if epochs else None
    merged["tokens_per_sec_per_epoch"] = [r["tokens_per_sec_per_epoch"] for r in results]
    merged["commands"] = [r["command"] for r in results]
    del merged["command"]
    return merged


def quality_run(args, name, extra):
    """run_data_parallel with scripts/run.sh's settings plus `extra`: rank 0's validation loss and
    BLEU per epoch."""
    perf = os.path.join(args.workdir, "perf_precision")
    cmd = ([os.path.join(args.build_dir, "run_data_parallel")] + RUN_SH_FLAGS +
           ["--no_progress", "--master_port", str(free_port()), "--workdir", fresh_run_dir(args, name)] + extra)
    proc = run_logged(args, name, cmd)
    validation = {int(e): float(v) for e, v in VALIDATION.findall(proc.stdout)}
    bleu = {int(e): float(v) for e, v in BLEU.findall(proc.stdout)}
    if not validation or not bleu:
        raise SystemExit(f"{name}: no validation loss or BLEU line from rank 0 in {perf}/{name}.log")
    return {"command": " ".join(cmd), "validation_loss": validation, "bleu": bleu,
            "final_validation_loss": validation[max(validation)], "final_bleu": bleu[max(bleu)]}


def bf16_quality(args):
    """bf16 against fp32 on scripts/run.sh's settings, once per seed: the last epoch's validation
    loss and BLEU, their means over the seeds, and fp32's own spread over the seeds (the seed also
    draws the embedded corpus), which says how much of a difference is noise."""
    per_seed = {}
    for seed in args.quality_seeds:
        flags = ["--seed", str(seed)]
        per_seed[seed] = {"fp32": quality_run(args, f"quality_fp32_seed{seed}", flags),
                          "bf16": quality_run(args, f"quality_bf16_seed{seed}", flags + ["--precision", "bf16"])}

    def mean(precision, key):
        return sum(r[precision][key] for r in per_seed.values()) / len(per_seed)

    fp32_loss, bf16_loss = mean("fp32", "final_validation_loss"), mean("bf16", "final_validation_loss")
    fp32_losses = [r["fp32"]["final_validation_loss"] for r in per_seed.values()]
    return {"settings": "scripts/run.sh: " + " ".join(RUN_SH_FLAGS), "seeds": args.quality_seeds,
            "per_seed": {str(k): v for k, v in per_seed.items()},
            "fp32_mean_validation_loss": fp32_loss, "bf16_mean_validation_loss": bf16_loss,
            "fp32_mean_bleu": mean("fp32", "final_bleu"), "bf16_mean_bleu": mean("bf16", "final_bleu"),
            "validation_loss_relative_difference": abs(bf16_loss - fp32_loss) / fp32_loss,
            "bleu_difference": mean("bf16", "final_bleu") - mean("fp32", "final_bleu"),
            "fp32_validation_loss_spread_over_seeds": (max(fp32_losses) - min(fp32_losses)) / fp32_loss}


def per_round_ratios(rounds, round_peaks, fpt):
    """Per round (its runs minutes apart): fp32's model-FLOPs utilisation against the two-process
    fp32 peak measured just before it, and each configuration's tokens/s over fp32's; with the
    median over rounds (each run's figure being the mean of its measured epochs)."""
    def summary(values):
        return {"per_round": values, "median": statistics.median(values)}
    fp32 = [r["tokens_per_sec"] for r in rounds["fp32"]]
    out = {"fp32_two_process_peak_gflops": round_peaks,
           "fp32_mfu": summary([t * fpt / 1e9 / peak for t, peak in zip(fp32, round_peaks)])}
    for name in ("bf16", "zero1", "accumulation4"):
        if name in rounds:
            out[f"{name}_over_fp32_x"] = summary([r["tokens_per_sec"] / t for r, t in zip(rounds[name], fp32)])
    return out


def flops_per_token(n_layer, n_embd, vocab, tokens):
    """Training FLOPs per token: 6 x the matmul parameters (blocks and the tied head) plus
    attention's 12 L C T (PaLM's appendix B), T = the padded length (an upper bound)."""
    return 6 * (12 * n_layer * n_embd ** 2 + vocab * n_embd) + 12 * n_layer * n_embd * tokens


def figure(path, r, footer):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 4, figsize=(17, 4.4))
    ax = axes[0]
    names = ["fp32", "bf16", "ZeRO-1", "accum. 4"]
    values = [r["runs"][k]["tokens_per_sec"] or 0.0 for k in ("fp32", "bf16", "zero1", "accumulation4")]
    ax.bar(names, values, color=["#4477aa", "#ee6677", "#228833", "#ccbb44"])
    ratio = r["bf16_over_fp32_throughput_x"]
    ax.set_title("2 ranks: tokens/s " + (f"(bf16/fp32 {ratio:.2f}×)" if ratio else "(bf16 not run: no bf16 units)"))
    ax = axes[1]
    labels = ["replicated", "ZeRO-1 N=2", "ZeRO-1 N=4"]
    b = [r["zero"]["replicated_state_bytes"], r["zero"]["state_bytes_n2"], r["zero"]["state_bytes_n4"]]
    ax.bar(labels, [x / 1e6 for x in b], color=["#4477aa", "#228833", "#66aa55"])
    ax.set_title("AdamW state per rank (MB)")
    ax = axes[2]
    a = r["accumulation"]
    ax.bar(["N=1", "N=4"], [a["bytes_per_optimizer_step_n1"] / 1e6, a["bytes_per_optimizer_step_n4"] / 1e6],
           color=["#4477aa", "#ccbb44"])
    ax.set_title(f"all-reduced MB per optimizer step\n(per batch, N=4 sends {a['n4_over_n1_bytes_per_batch_x']:.2f}× N=1's)")
    ax = axes[3]
    p = r["peaks_gflops"]
    fp32_peak = statistics.median(r["per_round"]["fp32_two_process_peak_gflops"])
    ax.bar(["fp32 peak\n2 procs", "ours fp32", "bf16 peak\n2 procs", "ours bf16"],
           [fp32_peak, r["achieved_gflops"]["fp32"], p["bf16_two_processes"], r["achieved_gflops"]["bf16"] or 0.0],
           color=["#bbbbbb", "#4477aa", "#dddddd", "#ee6677"])
    ax.set_title(f"GFLOP/s (medians): fp32 MFU {100 * r['fp32_mfu']:.1f}%\n(per round, against its own peak)")
    fig.suptitle("Precision and memory: bf16 autocast, ZeRO-1, gradient accumulation (one run)")
    fig.text(0.5, 0.01, footer, ha="center", fontsize=8)
    fig.tight_layout(rect=(0, 0.05, 1, 0.95))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--build-dir", default=os.path.join(REPO_ROOT, "build"))
    p.add_argument("--workdir", default="./workdir")
    p.add_argument("--out-dir", default=os.path.join(REPO_ROOT, "submit_figures"))
    p.add_argument("--model", default="gpt2-mini")
    p.add_argument("--model-max-length", type=int, default=64)
    p.add_argument("--batch-size", type=int, default=64, help="global batch of the 2-rank runs")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--warmup-epochs", type=int, default=1)
    p.add_argument("--max-batches", type=int, default=8, help="batches per rank and epoch")
    p.add_argument("--rounds", type=int, default=3, help="runs of each configuration, taking turns")
    p.add_argument("--matmul-size", type=int, default=2048)
    p.add_argument("--run-timeout", type=float, default=1800.0)
    p.add_argument("--force-bf16", action="store_true", help="run bf16 even where the bf16 matmul peak is below fp32's")
    p.add_argument("--quality", action="store_true",
                   help="also train scripts/run.sh's job in fp32 and in bf16 once per --quality-seeds (about 10 min "
                        "per seed here) and compare the last epoch's validation loss and BLEU")
    p.add_argument("--quality-seeds", type=lambda text: [int(v) for v in text.split(",")], default=[1234, 2],
                   help="comma-separated seeds of the --quality runs")
    args = p.parse_args(argv)

    peaks, sizes = {}, {}
    for d, short in (("float32", "fp32"), ("bfloat16", "bf16")):
        for label, n in (("one_process", 1), ("two_processes", 2)):
            peaks[f"{short}_{label}"], sizes[f"{short}_{label}"] = matmul_peak(d, n, args.matmul_size)
    print(f"[precision] matmul peaks (GFLOP/s): {peaks} at sizes {sizes}", file=sys.stderr)

    E, K, B = args.epochs, args.max_batches, args.batch_size
    # Without bf16 matmul units (no AVX-512 BF16 / AMX on a CPU), ATen multiplies bf16 by a slow
    # reference path: a bf16 run would measure that path, not autocast. It is skipped, and why said.
    bf16_hardware = peaks["bf16_two_processes"] >= peaks["fp32_two_processes"]
    configs = {"fp32": ("dp2_fp32", B, [], K), "bf16": ("dp2_bf16", B, ["--precision", "bf16"], K),
               "zero1": ("dp2_zero1", B, ["--zero_stage", "1"], K),
               "accumulation4": ("dp2_accum4", B // 4, ["--gradient_accumulation_steps", "4"], 4 * K)}
    if not (bf16_hardware or args.force_bf16):
        del configs["bf16"]
    # The runs take turns, round after round, so that a slow spell of this shared machine falls on
    # all of them; each figure is the median over every measured epoch of every round.
    # Each round also measures the two-process fp32 peak just before its fp32 run: this machine's
    # speed drifts by tens of percent over minutes, so the utilisation is taken per round against
    # its own peak, and the throughput ratios per round (runs minutes apart), medians over rounds.
    rounds = {name: [] for name in configs}
    round_peaks = []
    for r in range(args.rounds):
        round_peaks.append(matmul_peak("float32", 2, args.matmul_size)[0])
        for name, (log, batch, extra, batches) in configs.items():
            rounds[name].append(run_dp(args, f"{log}_round{r}", 2, batch, extra, E, batches))
    runs = {name: merge_rounds(results) for name, results in rounds.items()}
    if "bf16" not in runs:
        runs["bf16"] = {"skipped": f"the measured bf16 matmul peak ({peaks['bf16_two_processes']:.1f} GFLOP/s) is below "
                                   f"fp32's ({peaks['fp32_two_processes']:.1f}): no bf16 matmul units here "
                                   f"(--force-bf16 runs it anyway)", "tokens_per_sec": None}
    zero4 = run_dp(args, "dp4_zero1_state", 4, B, ["--zero_stage", "1"], 1, 1)
    quality = bf16_quality(args) if args.quality else None

    from_config = {"gpt2-mini": (4, 256), "gpt2-tiny": (2, 64), "gpt2": (12, 768)}
    n_layer, n_embd = from_config[args.model]
    fpt = flops_per_token(n_layer, n_embd, runs["fp32"]["vocab"], args.model_max_length)
    achieved = {k: runs[k]["tokens_per_sec"] * fpt / 1e9 if runs[k]["tokens_per_sec"] else None
                for k in ("fp32", "bf16")}
    per_round = per_round_ratios(rounds, round_peaks, fpt)
    bf16_ratio = per_round["bf16_over_fp32_x"]["median"] if "bf16" in rounds else None
    zero = {"replicated_state_bytes": runs["zero1"]["replicated_state_bytes"],
            "state_bytes_n2": runs["zero1"]["state_bytes_rank0"], "state_bytes_n4": zero4["state_bytes_rank0"]}
    zero["n2_fraction"] = zero["state_bytes_n2"] / zero["replicated_state_bytes"]
    zero["n4_fraction"] = zero["state_bytes_n4"] / zero["replicated_state_bytes"]
    n1, n4 = runs["fp32"]["bytes_per_optimizer_step"], runs["accumulation4"]["bytes_per_optimizer_step"]
    result = {
        "device": "CPU ranks, one core each, of a shared 2-core machine; peaks measured in the same run",
        "model": args.model, "model_max_length": args.model_max_length, "global_batch": B,
        "flops_per_token": fpt, "peaks_gflops": peaks, "peak_matrix_sizes": sizes, "achieved_gflops": achieved,
        "fp32_mfu": per_round["fp32_mfu"]["median"],
        "fp32_mfu_against_the_first_peak": achieved["fp32"] / peaks["fp32_two_processes"],
        "per_round": per_round,
        "bf16_mfu_of_bf16_peak": achieved["bf16"] / peaks["bf16_two_processes"] if achieved["bf16"] else None,
        "bf16_over_fp32_throughput_x": bf16_ratio,
        "zero1_over_replicated_throughput_x": per_round["zero1_over_fp32_x"]["median"],
        "zero": zero,
        "accumulation": {"bytes_per_optimizer_step_n1": n1, "bytes_per_optimizer_step_n4": n4,
                         "n4_over_n1_bytes_per_batch_x": (n4 / 4) / n1,
                         "throughput_over_n1_x": per_round["accumulation4_over_fp32_x"]["median"]},
        "bf16_quality": quality,
        "goals": {},
        "runs": runs, "zero_n4_run": zero4,
        "command": " ".join([sys.executable] + sys.argv),
    }
    result["goals"] = {
        "fp32 MFU >= 0.80 of the two-process fp32 peak": result["fp32_mfu"] >= 0.80,
        "bf16 / fp32 tokens/s >= 1.6": bf16_ratio >= 1.6 if bf16_ratio else None,
        "ZeRO-1 state <= 1/N of replicated + one bucket (N=2, 4)":
            zero["state_bytes_n2"] <= zero["replicated_state_bytes"] / 2 + 25 * 2 ** 20
            and zero["state_bytes_n4"] <= zero["replicated_state_bytes"] / 4 + 25 * 2 ** 20,
        "ZeRO-1 tokens/s >= replicated": result["zero1_over_replicated_throughput_x"] >= 1.0,
        "accumulation N=4: communication per batch 1/4 of N=1's": (n4 / 4) / n1 == 0.25,
        "bf16 quality (run.sh settings): validation loss within 3% of fp32's":
            quality["validation_loss_relative_difference"] <= 0.03 if quality else None,
        "bf16 quality (run.sh settings): BLEU within 2 points of fp32's":
            abs(quality["bleu_difference"]) <= 2.0 if quality else None,
    }
    os.makedirs(args.out_dir, exist_ok=True)
    details_path = os.path.join(args.out_dir, "benchmark_details.json")
    details = json.load(open(details_path)) if os.path.isfile(details_path) else {}
    details["precision_memory"] = result
    with open(details_path, "w") as f:
        json.dump(details, f, indent=2)
        f.write("\n")
    footer = (f"{args.model}, {args.model_max_length} tokens, global batch {B}, 2 ranks x 1 thread on CPU cores of a "
              f"shared machine, {args.rounds} rounds of {E} epochs of {K} batches/rank, {args.warmup_epochs} warm-up "
              f"dropped, medians")
    figure(os.path.join(args.out_dir, "precision_memory.png"), result, footer)
    print(json.dumps({k: v for k, v in result.items() if k not in ("runs", "zero_n4_run")}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
