#!/usr/bin/env python3
"""ZeRO stages side by side: each rank's memory and the training speed, every ratio from this one run.

Measures, on this machine, run_data_parallel with 2 ranks x 1 thread, --benchmark_only, at
--batch-size x --model-max-length tokens, --epochs epochs of --max-batches batches (the first
--warmup-epochs dropped), for every --zero_stage the program accepts (0, 1, 2, and 3 once the
program takes it: probed with --zero_stage 3 --memory_plan, skipped with a note otherwise):
  * at GPT-2 124M: each rank's peak resident memory (VmHWM of the worker processes, read from
    /proc while they run: the program itself writes only rank 0's figure, to metrics.jsonl, which
    is kept beside it), its model-state bytes from the program's memory plan line and the AdamW
    state rank 0 reports keeping, and tokens/s;
  * at gpt2-mini: tokens/s;
taking turns for --rounds rounds (the stage order reversed every other round) so that a slow spell
of this shared machine falls on all of them; each figure is the median over rounds and each ratio
the median of the rounds' ratios. Then GPT-2 large on 2 ranks: --zero_stage 0 must be refused by
the memory plan, with --memory_plan and as a run; --zero_stage 3, when the program has it, trains
3 optimizer steps and its ranks' peaks are reported.

Writes WORKDIR/zero_memory/*.log, --out (submit_figures/zero_memory.json) and draws zero_memory.png
beside it. On CPUs a "device" is one core of a shared 2-core machine.
"""
import argparse
import hashlib
import json
import os
import re
import resource
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time

from bench_common import BenchmarkError, cpu_model_name, free_port
from fault_injection import descendants, rank_of
from parallel_layouts_bench import tokens_per_sec

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# The program's lines read here (stderr, maybe behind the launcher's "[rank 0] ").
PLAN_LINE = re.compile(r"memory plan per rank \(the most: ([^)]*)\): weights (\d+) \+ gradients (\d+) \+ "
                       r"optimizer (\d+) = model state (\d+) bytes")
ADAMW_LINE = re.compile(r"--zero_stage (\d+) keeps (\d+) bytes of AdamW state on rank 0 \(replicated: (\d+)")
PLAN_HEADER = re.compile(r"memory plan of \S+: (\S+) \((\d+) layers, n_embd (\d+), n_head (\d+), vocab (\d+), "
                         r"(\d+) parameters\)")
PLAN_VERDICT = re.compile(r"^model state per rank: at most (\d+) bytes.*: (fits|does NOT fit.*|not checked)$", re.M)
CANNOT_RUN = re.compile(r"cannot run it: (.*)$", re.M)
REFUSAL = re.compile(r"^.*the model state needs .*$", re.M)
VM_HWM = re.compile(r"^VmHWM:\s+(\d+) kB$", re.M)
VM_RSS = re.compile(r"^VmRSS:\s+(\d+) kB$", re.M)
RANK_EPOCH = re.compile(r"^Epoch (\d+) on Rank (\d+): Training Time")
# What a worker process that is not ours would carry; the launcher sets them for its workers.
WORKER_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


# ---- what the program printed ----------------------------------------------------------------

def model_state(stderr):
    """The memory plan's line of a run: {"who", "weights", "gradients", "optimizer", "total"} bytes
    per rank (the most-loaded rank's), or None when the run printed no plan."""
    m = PLAN_LINE.search(stderr)
    if not m:
        return None
    return {"who": m[1], "weights": int(m[2]), "gradients": int(m[3]), "optimizer": int(m[4]), "total": int(m[5])}


def adamw_state(stderr):
    """The AdamW bytes rank 0 says it keeps (ZeRO stages only), and the replicated run's, or None."""
    m = ADAMW_LINE.search(stderr)
    return {"stage": int(m[1]), "rank0_bytes": int(m[2]), "replicated_bytes": int(m[3])} if m else None


def plan_printout(text):
    """The full --memory_plan printout: the model's shape, the verdict on the model state and, when
    the program planned a stage it cannot run, why."""
    header, verdict, cannot = PLAN_HEADER.search(text), PLAN_VERDICT.search(text), CANNOT_RUN.search(text)
    if not header or not verdict:
        raise BenchmarkError(f"no memory plan in the printout: {text[-400:]!r}")
    return {"model": header[1], "n_layer": int(header[2]), "n_embd": int(header[3]), "vocab": int(header[5]),
            "parameters": int(header[6]), "model_state_bytes": int(verdict[1]), "verdict": verdict[2],
            "refused": verdict[2].startswith("does NOT fit"), "cannot_run": cannot[1].strip() if cannot else None}


def largest_unit_parameters(n_layer, n_embd, parameters):
    """Parameters of the largest unit ZeRO-3 gathers whole: a block (12C^2 + 13C) or the embeddings
    (wte + wpe: what remains once the blocks and ln_f are taken)."""
    block = 12 * n_embd * n_embd + 13 * n_embd
    return max(block, parameters - n_layer * block - 2 * n_embd)


def stage_available(text, returncode):
    """Whether `--zero_stage N --memory_plan` says this build runs stage N, and if not why."""
    cannot = CANNOT_RUN.search(text)
    if cannot:
        return False, cannot[1].strip()
    if returncode != 0 or "expected 0, 1 or 2" in text:
        refusal = next((l for l in text.splitlines() if "zero_stage" in l), text.strip()[-300:])
        return False, refusal.strip()
    return True, None


def peak_memory_of_rank0(metrics_path):
    """The program's own peak resident bytes of rank 0 (metrics.jsonl's peak_memory_bytes, the most
    over its steps), or None without the file."""
    if not os.path.isfile(metrics_path):
        return None
    peaks = []
    with open(metrics_path) as f:
        for line in f:
            record = json.loads(line)
            if record.get("kind") == "train":
                peaks.append(record["peak_memory_bytes"])
    return max(peaks) if peaks else None


def train_steps(metrics_path):
    if not os.path.isfile(metrics_path):
        return 0
    with open(metrics_path) as f:
        return sum(1 for line in f if json.loads(line).get("kind") == "train")


# ---- runs, with each worker's VmHWM watched ------------------------------------------------

def vm_hwm_bytes(pid, field=VM_HWM):
    try:
        with open(f"/proc/{pid}/status") as f:
            m = field.search(f.read())
        return int(m[1]) * 1024 if m else None
    except OSError:
        return None


def mem_available_bytes():
    with open("/proc/meminfo") as f:
        return int(re.search(r"^MemAvailable:\s+(\d+) kB$", f.read(), re.M)[1]) * 1024


class Measured:
    """A finished run: exit status, output, seconds, and each rank's VmHWM: the last reading before
    the worker went (the whole run, its checkpoints and final save included), and the one read when
    the rank printed its first epoch line (training alone: before the first checkpoint)."""

    def __init__(self, returncode, stdout, stderr, seconds, peaks, peaks_at_first_epoch, timed_out,
                 over_memory=None):
        self.returncode, self.stdout, self.stderr, self.seconds = returncode, stdout, stderr, seconds
        self.peaks, self.peaks_at_first_epoch, self.timed_out = peaks, peaks_at_first_epoch, timed_out
        self.over_memory = over_memory  # the workers' summed resident bytes when it was stopped for it


def run_watched(cmd, timeout, poll_s=0.2, env=None, preexec_fn=None, memory_limit=None):
    """Runs cmd in a session of its own, reading every `poll_s` the VmHWM of each descendant that has
    RANK in its environment (the launcher's workers), until it exits or `timeout` seconds pass (then
    the session is killed). VmHWM only grows, so the last reading is the peak up to then. With
    `memory_limit`, the session is also killed once the workers' resident bytes together pass it,
    before the kernel's out-of-memory killer would pick a process of this shared machine."""
    env = dict(os.environ if env is None else env)
    for name in WORKER_VARIABLES:  # the launcher must not take this script for a worker's parent
        env.pop(name, None)
    start = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            start_new_session=True, preexec_fn=preexec_fn)
    peaks, at_epoch, pids = {}, {}, {}
    lock = threading.Lock()
    resident = [0]

    def poll():
        resident[0] = 0
        for pid in descendants(proc.pid):
            rank = pids.get(pid)
            if rank is None:
                rank = rank_of(pid)
                if rank is None:
                    continue
                pids[pid] = rank
            value = vm_hwm_bytes(pid)
            if value is not None:
                with lock:
                    peaks[rank] = max(peaks.get(rank, 0), value)
            resident[0] += vm_hwm_bytes(pid, VM_RSS) or 0

    out_lines, err_lines = [], []

    def read_stdout():
        for line in proc.stdout:
            out_lines.append(line)
            m = RANK_EPOCH.match(line.strip())
            if m:
                rank = int(m[2])
                for pid, r in list(pids.items()):
                    value = vm_hwm_bytes(pid) if r == rank else None
                    if value is not None:
                        with lock:
                            peaks[rank] = max(peaks.get(rank, 0), value)
                            at_epoch.setdefault(rank, value)

    def read_stderr():
        for line in proc.stderr:
            err_lines.append(line)

    readers = [threading.Thread(target=read_stdout, daemon=True), threading.Thread(target=read_stderr, daemon=True)]
    for t in readers:
        t.start()
    timed_out, over_memory = False, None
    while proc.poll() is None:
        poll()
        if memory_limit is not None and resident[0] > memory_limit:
            over_memory = resident[0]
            os.killpg(proc.pid, signal.SIGKILL)
            break
        if time.monotonic() - start > timeout:
            timed_out = True
            os.killpg(proc.pid, signal.SIGKILL)
            break
        time.sleep(poll_s)
    proc.wait()
    for t in readers:
        t.join(timeout=10)
    proc.stdout.close()
    proc.stderr.close()
    return Measured(proc.returncode, "".join(out_lines), "".join(err_lines), time.monotonic() - start,
                    dict(sorted(peaks.items())), dict(sorted(at_epoch.items())), timed_out, over_memory)


def error_line(text):
    """The program's first error line (a rank's, or the launcher's verdict), else its last line."""
    lines = [l.strip() for l in text.splitlines() if l.strip()]
    return next((l for l in lines if "error" in l), lines[-1] if lines else "")


def write_log(path, cmd, run):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write(" ".join(cmd) + "\n" + run.stdout + "\n--- stderr ---\n" + run.stderr)


def program(args):
    return args.program


def memory_plan(args, model, stage, batch_size, model_max_length):
    cmd = [program(args), "--model", model, "--world_size", "2", "--zero_stage", str(stage), "--memory_plan",
           "--batch_size", str(batch_size), "--model_max_length", str(model_max_length)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    return cmd, proc.returncode, proc.stdout + proc.stderr


def probe_stages(args):
    """The ZeRO stages this build of the program runs: 0-2, and 3 when --memory_plan no longer says
    it cannot (or the flag is not refused). Returns (stages, note on stage 3 or None)."""
    _, rc, text = memory_plan(args, "gpt2", 3, args.batch_size, args.model_max_length)
    available, why = stage_available(text, rc)
    return ([0, 1, 2, 3], None) if available else ([0, 1, 2], f"--zero_stage 3 skipped: the program says {why!r}")


def train_run(args, model, stage, round_index):
    slug = f"{model}_zero{stage}_r{round_index}"
    work = os.path.join(args.workdir, "zero_memory", slug)
    shutil.rmtree(work, ignore_errors=True)
    cmd = [program(args), "--model", model, "--world_size", "2", "--zero_stage", str(stage),
           "--batch_size", str(args.batch_size), "--model_max_length", str(args.model_max_length),
           "--n_epochs", str(args.epochs), "--max_batches", str(args.max_batches), "--threads_per_device", "1",
           "--benchmark_only", "--no_progress", "--workdir", work, "--master_port", str(free_port())]
    run = run_watched(cmd, args.run_timeout)
    log = work + ".log"
    write_log(log, cmd, run)
    if run.returncode != 0:
        raise BenchmarkError(f"{model} --zero_stage {stage} exited {run.returncode}"
                             f"{' (timed out)' if run.timed_out else ''}: {error_line(run.stderr)!r}; see {log}")
    metrics = os.path.join(work, "metrics.jsonl")
    figures = {
        "tokens_per_sec": statistics.median(tokens_per_sec(run.stdout, args.warmup_epochs, log)),
        "peak_rss_bytes": {str(r): v for r, v in run.peaks.items()},
        "peak_rss_training_bytes": {str(r): v for r, v in run.peaks_at_first_epoch.items()},
        "program_peak_rss_rank0_bytes": peak_memory_of_rank0(metrics),
        "model_state_per_rank": model_state(run.stderr),
        "adamw_state": adamw_state(run.stderr),
        "seconds": run.seconds,
        "log": os.path.relpath(log, REPO_ROOT) if log.startswith(REPO_ROOT) else log,
    }
    if os.path.isfile(metrics):
        shutil.copy(metrics, work + ".metrics.jsonl")
    shutil.rmtree(work, ignore_errors=True)  # the checkpoints (1.5 GB at 124M) are not measured
    return figures


# ---- GPT-2 large --------------------------------------------------------------------------

def file_size_guard(limit_bytes):
    """For a child: files stop at limit_bytes (the write fails, SIGXFSZ ignored), so that a run whose
    checkpoint this disk cannot take fails at it instead of filling the disk."""
    def apply():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit_bytes, limit_bytes))
    return apply


def gpt2_large(args, stages, stage3_note):
    """--zero_stage 0 refused by the memory plan (printout and run); --zero_stage 3 trained 3 steps."""
    model, out = args.large_model, {}
    cmd, rc, text = memory_plan(args, model, 0, args.large_batch_size, args.model_max_length)
    plan = plan_printout(text)
    out["zero_stage_0_memory_plan"] = {"command": " ".join(cmd), "exit_code": rc, "refused": plan["refused"],
                                       "message": next(l for l in text.splitlines() if l.startswith("model state per rank")),
                                       "model_state_bytes": plan["model_state_bytes"], "parameters": plan["parameters"]}
    base = [program(args), "--model", model, "--world_size", "2", "--batch_size", str(args.large_batch_size),
            "--model_max_length", str(args.model_max_length), "--n_epochs", "1", "--max_batches", "3",
            "--max_steps", "3", "--threads_per_device", "1", "--benchmark_only", "--no_progress"]
    work = os.path.join(args.workdir, "zero_memory", f"{model}_zero0")
    shutil.rmtree(work, ignore_errors=True)
    cmd = base + ["--zero_stage", "0", "--workdir", work, "--master_port", str(free_port())]
    run = run_watched(cmd, 300)
    write_log(work + ".log", cmd, run)
    refusal = REFUSAL.search(run.stderr)
    out["zero_stage_0_run"] = {
        "command": " ".join(cmd), "exit_code": run.returncode, "seconds": run.seconds,
        "workers_seen": len(run.peaks),
        # Refused up front: a non-zero exit naming the model state, before any worker started.
        "refused_by_memory_plan": run.returncode != 0 and refusal is not None and not run.peaks,
        "message": refusal[0].strip() if refusal else run.stderr.strip()[-500:]}
    shutil.rmtree(work, ignore_errors=True)
    if 3 not in stages:
        out["zero_stage_3_run"] = {"skipped": True, "note": stage3_note}
        return out
    cmd3, rc3, text3 = memory_plan(args, model, 3, args.large_batch_size, args.model_max_length)
    plan3 = plan_printout(text3)
    work = os.path.join(args.workdir, "zero_memory", f"{model}_zero3")
    shutil.rmtree(work, ignore_errors=True)
    os.makedirs(os.path.dirname(work), exist_ok=True)
    # The run ends with a checkpoint of the whole unsharded state and the saved model (16 bytes a
    # parameter); where the disk has not room for them, files are capped so the run stops there.
    needed = 16 * plan3["parameters"]
    free = shutil.disk_usage(os.path.dirname(work)).free
    guard = free < 1.25 * needed
    cmd = base + ["--zero_stage", "3", "--workdir", work, "--master_port", str(free_port())]
    limit = mem_available_bytes() - int(args.memory_margin_gib * 2 ** 30)
    run = run_watched(cmd, args.large_timeout, preexec_fn=file_size_guard(64 << 20) if guard else None,
                      memory_limit=limit)
    write_log(work + ".log", cmd, run)
    metrics = os.path.join(work, "metrics.jsonl")
    steps = train_steps(metrics)
    out["zero_stage_3_run"] = {
        "command": " ".join(cmd), "exit_code": run.returncode, "timed_out": run.timed_out, "seconds": run.seconds,
        "error": (f"stopped here: the workers held {run.over_memory} bytes together, past {limit} (MemAvailable at "
                  f"the start less {args.memory_margin_gib} GiB)" if run.over_memory else
                  error_line(run.stderr) if run.returncode != 0 else None),
        "memory_plan": {"verdict": plan3["verdict"], "model_state_bytes": plan3["model_state_bytes"]},
        "model_state_per_rank": model_state(run.stderr), "adamw_state": adamw_state(run.stderr),
        "optimizer_steps": steps, "trained_3_steps": steps >= 3,
        "peak_rss_bytes": {str(r): v for r, v in run.peaks.items()},
        "peak_rss_training_bytes": {str(r): v for r, v in run.peaks_at_first_epoch.items()},
        "program_peak_rss_rank0_bytes": peak_memory_of_rank0(metrics),
        "disk_guard": (f"files capped at 64 MiB: {free} bytes free on the disk, the final checkpoint and model "
                       f"need about {needed}; the run is expected to stop at its final checkpoint") if guard else None,
    }
    if os.path.isfile(metrics):
        shutil.copy(metrics, work + ".metrics.jsonl")
    shutil.rmtree(work, ignore_errors=True)
    return out


# ---- medians, ratios, goals ----------------------------------------------------------------

def median_or_none(values):
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def summarise(model, stages, rounds):
    """Per stage: the medians over rounds of tokens/s and each rank's peak; the model state (the same
    every round: the first round's)."""
    out = {"model": model, "per_round": rounds, "stages": {}}
    for s in stages:
        key = str(s)
        runs = [r[key] for r in rounds]
        ranks = sorted({rank for run in runs for rank in run["peak_rss_bytes"]})

        def per_rank(field):
            return {rank: median_or_none([run.get(field, {}).get(rank) for run in runs]) for rank in ranks}
        out["stages"][key] = {
            "tokens_per_sec": statistics.median(run["tokens_per_sec"] for run in runs),
            "peak_rss_training_bytes": per_rank("peak_rss_training_bytes"),
            "peak_rss_bytes": per_rank("peak_rss_bytes"),
            "program_peak_rss_rank0_bytes": median_or_none([run["program_peak_rss_rank0_bytes"] for run in runs]),
            "model_state_per_rank": runs[0]["model_state_per_rank"],
            "adamw_state": runs[0]["adamw_state"],
        }
    return out


def ratio(rounds, numerator, denominator):
    """The median of each round's tokens/s ratio of two stages, or None when one is missing."""
    if any(str(numerator) not in r or str(denominator) not in r for r in rounds):
        return None
    values = [r[str(numerator)]["tokens_per_sec"] / r[str(denominator)]["tokens_per_sec"] for r in rounds]
    return {"median": statistics.median(values), "per_round": values}


def goals(results, large, stages, stage3_note, unit_parameters):
    """Each goal: {"met": true, false or null (not measured, with a note), "measured", "goal"}."""
    out = {}

    def goal(name, met, measured, note=None):
        out[name] = {"met": met, "measured": measured}
        if note:
            out[name]["note"] = note

    for result in results:
        model = result["model"]
        r21 = result["zero2_over_zero1_x"]
        goal(f"{model}: ZeRO-2 tokens/s >= 0.98x ZeRO-1", r21["median"] >= 0.98 if r21 else None,
             r21["median"] if r21 else None)
        r30 = result["zero3_over_zero0_x"]
        goal(f"{model}: ZeRO-3 tokens/s >= 0.90x the replicated run", r30["median"] >= 0.90 if r30 else None,
             r30["median"] if r30 else None, None if r30 else stage3_note)
    gpt2 = next((r for r in results if r["model"] == "gpt2"), None)
    if gpt2 is not None:
        name = "gpt2: ZeRO-3 model state per rank = 16 psi / N within one unit"
        if 3 in stages:
            state = gpt2["stages"]["3"]["model_state_per_rank"]
            psi = gpt2["parameters"]
            ideal, unit = 16 * psi / 2, 16 * unit_parameters
            goal(name, abs(state["total"] - ideal) <= unit,
                 {"model_state_bytes": state["total"], "16_psi_over_n_bytes": ideal, "one_unit_bytes": unit})
        else:
            goal(name, None, None, stage3_note)
    plan0, run0 = large["zero_stage_0_memory_plan"], large["zero_stage_0_run"]
    goal("gpt2-large: --zero_stage 0 refused up front by the memory plan (--memory_plan and a run)",
         plan0["refused"] and run0["refused_by_memory_plan"], {"memory_plan": plan0["message"], "run": run0["message"]})
    run3 = large["zero_stage_3_run"]
    if run3.get("skipped"):
        goal("gpt2-large: --zero_stage 3 trains 3 optimizer steps on 2 ranks", None, None, stage3_note)
    else:
        goal("gpt2-large: --zero_stage 3 trains 3 optimizer steps on 2 ranks", run3["trained_3_steps"],
             {"optimizer_steps": run3["optimizer_steps"], "peak_rss_bytes": run3["peak_rss_bytes"]})
    return out


# ---- the figure ----------------------------------------------------------------------------

def draw(results, stages, large, path, title_note):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    gib = 1024 ** 3
    fig, axes = plt.subplots(1, 1 + len(results), figsize=(5.5 * (1 + len(results)), 4.6))
    labels = [f"ZeRO-{s}" for s in stages]
    memory = next(r for r in results if r["model"] == "gpt2") if any(r["model"] == "gpt2" for r in results) else results[0]
    ax = axes[0]
    width = 0.27
    series = [("peak RSS rank 0, training", lambda st: st["peak_rss_training_bytes"].get("0"), "#4c72b0"),
              ("peak RSS rank 1, training", lambda st: st["peak_rss_training_bytes"].get("1"), "#8da0cb"),
              ("model state per rank (plan)", lambda st: (st["model_state_per_rank"] or {}).get("total"), "#dd8452")]
    for k, (name, get, color) in enumerate(series):
        values = [(get(memory["stages"][str(s)]) or 0) / gib for s in stages]
        xs = [i + (k - 1) * width for i in range(len(stages))]
        ax.bar(xs, values, width, label=name, color=color)
        for x, v in zip(xs, values):
            ax.text(x, v, f"{v:.2f}", ha="center", va="bottom", fontsize=7)
    for i, s in enumerate(stages):  # the whole run's peak (checkpoints and the final save included)
        whole = memory["stages"][str(s)]["peak_rss_bytes"]
        for k, rank in enumerate(("0", "1")):
            if whole.get(rank):
                ax.plot([i + (k - 1) * width], [whole[rank] / gib], marker="_", color="black", markersize=14)
    ax.plot([], [], marker="_", color="black", linestyle="none", markersize=14,
            label="peak RSS, whole run (checkpoints, final save)")
    ax.set_xticks(range(len(stages)), labels)
    ax.set_ylim(0, ax.get_ylim()[1] * 1.35)
    ax.set_ylabel("GiB per rank")
    ax.set_title(f"{memory['model']}: memory per rank (median over rounds)", fontsize=9)
    ax.legend(fontsize=7, loc="upper right")
    for ax, result in zip(axes[1:], results):
        values = [result["stages"][str(s)]["tokens_per_sec"] for s in stages]
        base = values[0]
        ax.bar(labels, values, color=["#4c72b0", "#55a868", "#c44e52", "#8172b3"][:len(stages)])
        for i, v in enumerate(values):
            ax.text(i, v, f"{v:,.0f}\n{v / base:.2f}x", ha="center", va="bottom", fontsize=7)
        ax.set_ylabel("tokens/s (sum over ranks, median over rounds)")
        ax.set_ylim(0, max(values) * 1.2)
        ax.set_title(f"{result['model']}: tokens/s (x ZeRO-0)", fontsize=9)
    fig.suptitle("ZeRO stages, run_data_parallel 2 ranks x 1 thread; a 'device' is one CPU core of a shared "
                 "2-core machine" + ("\nZeRO-3 not measured: see the JSON's stage_3 note" if title_note else ""),
                 fontsize=9)
    run3 = large["zero_stage_3_run"]
    if run3.get("skipped"):
        third = "not run (see the JSON's stage_3 note)"
    else:
        peaks = ", ".join(f"{v / gib:.2f}" for v in run3["peak_rss_bytes"].values())
        stopped = run3.get("error") or ""
        why = (" (stopped at the memory limit)" if stopped.startswith("stopped here") else
               f" (exit {run3['exit_code']})" if run3["exit_code"] != 0 else "")
        third = f"{run3['optimizer_steps']} of 3 optimizer steps{why}, peak RSS per rank {peaks} GiB"
    caption = ("gpt2-large, 2 ranks: --zero_stage 0 " +
               ("refused by the memory plan" if large["zero_stage_0_run"]["refused_by_memory_plan"] else "NOT refused") +
               "; --zero_stage 3: " + third)
    fig.text(0.5, 0.01, caption, ha="center", fontsize=8)
    fig.tight_layout(rect=(0, 0.04, 1, 0.92))
    fig.savefig(path, dpi=120)


# ---- main ----------------------------------------------------------------------------------

def git_head():
    proc = subprocess.run(["git", "-C", REPO_ROOT, "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    return proc.stdout.strip() or None


def uncommitted_sources():
    """The C++ sources (src/, include/, apps/) that differ from HEAD: what the program was built from
    beyond the commit."""
    proc = subprocess.run(["git", "-C", REPO_ROOT, "status", "--porcelain", "--", "src", "include", "apps"],
                          capture_output=True, text=True)
    return [line[3:] for line in proc.stdout.splitlines()]


def sha256(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--build-dir", default=os.path.join(REPO_ROOT, "build"))
    p.add_argument("--workdir", default="./workdir")
    p.add_argument("--out", default=os.path.join(REPO_ROOT, "submit_figures", "zero_memory.json"),
                   help="the JSON; the figure zero_memory.png goes beside it")
    p.add_argument("--models", default="gpt2,gpt2-mini", help="comma-separated presets (gpt2 = GPT-2 124M)")
    p.add_argument("--large-model", default="gpt2-large")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--large-batch-size", type=int, default=2)
    p.add_argument("--model-max-length", type=int, default=64)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--warmup-epochs", type=int, default=1)
    p.add_argument("--max-batches", type=int, default=4, help="batches per epoch")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--run-timeout", type=float, default=1200.0)
    p.add_argument("--large-timeout", type=float, default=1800.0)
    p.add_argument("--memory-margin-gib", type=float, default=1.5,
                   help="GPT-2 large's --zero_stage 3 run is stopped when its workers leave less than this of "
                        "the memory available at its start")
    p.add_argument("--no-large", action="store_true", help="skip GPT-2 large")
    p.add_argument("--redraw", action="store_true", help="only draw zero_memory.png again from --out's JSON")
    args = p.parse_args(argv)
    if args.redraw:
        with open(args.out) as f:
            out = json.load(f)
        draw(out["results"], out["stages"], out["gpt2_large"],
             os.path.join(os.path.dirname(os.path.abspath(args.out)), "zero_memory.png"), out["stage_3"]["note"])
        return 0
    if args.warmup_epochs >= args.epochs:
        raise SystemExit("--warmup-epochs must be below --epochs")
    built = os.path.join(args.build_dir, "run_data_parallel")
    if not os.access(built, os.X_OK):
        raise SystemExit(f"zero_memory_bench.py: {built} not found: build first (scripts/build.sh)")
    # Every run of the benchmark uses the same program, even if the build folder is rebuilt meanwhile.
    args.program = os.path.join(os.path.abspath(args.workdir), "zero_memory", "bin", "run_data_parallel")
    os.makedirs(os.path.dirname(args.program), exist_ok=True)
    shutil.copy2(built, args.program)
    binary_sha = sha256(args.program)
    # What the program was built from, as it stood when it was copied.
    head, uncommitted = git_head(), uncommitted_sources()

    stages, stage3_note = probe_stages(args)
    models = args.models.split(",")
    shapes = {}
    for model in models:
        _, _, text = memory_plan(args, model, 0, args.batch_size, args.model_max_length)
        shapes[model] = plan_printout(text)
    rounds = {model: [] for model in models}
    for r in range(args.rounds):
        order = stages if r % 2 == 0 else list(reversed(stages))
        for model in models:
            figures = {}
            for s in order:
                if s not in stages:
                    continue
                try:
                    figures[str(s)] = train_run(args, model, s, r)
                except BenchmarkError as e:
                    if s != 3:
                        raise
                    # The program takes the flag but its run fails: stage 3 is left out of the run.
                    stages.remove(3)
                    stage3_note = f"--zero_stage 3 left out: the program takes it, but {e}"
                    for done in rounds.values():
                        for earlier in done:
                            earlier.pop("3", None)
            rounds[model].append(figures)
            print(f"[zero_memory] {model} round {r}: " + ", ".join(
                f"ZeRO-{s} {rounds[model][-1][str(s)]['tokens_per_sec']:.1f} tok/s" for s in stages), file=sys.stderr)
    results = []
    for model in models:
        result = summarise(model, stages, rounds[model])
        result["parameters"] = shapes[model]["parameters"]
        result["zero1_over_zero0_x"] = ratio(rounds[model], 1, 0)
        result["zero2_over_zero1_x"] = ratio(rounds[model], 2, 1)
        result["zero2_over_zero0_x"] = ratio(rounds[model], 2, 0)
        result["zero3_over_zero0_x"] = ratio(rounds[model], 3, 0)
        results.append(result)
    if args.no_large:
        large = {"zero_stage_0_memory_plan": {"refused": None, "message": "skipped (--no-large)"},
                 "zero_stage_0_run": {"refused_by_memory_plan": None, "message": "skipped (--no-large)"},
                 "zero_stage_3_run": {"skipped": True, "note": "--no-large"}}
    else:
        large = gpt2_large(args, stages, stage3_note)
    unit = largest_unit_parameters(shapes.get("gpt2", shapes[models[0]])["n_layer"],
                                   shapes.get("gpt2", shapes[models[0]])["n_embd"],
                                   shapes.get("gpt2", shapes[models[0]])["parameters"])
    out = {
        "device": f"CPU processes, one core each ({cpu_model_name()}), of a shared {os.cpu_count()}-core machine",
        "program": {"path": os.path.relpath(built, REPO_ROOT), "sha256": binary_sha,
                    "rebuilt_during_the_run": sha256(built) != binary_sha, "git_head": head,
                    "source_changes_not_committed": uncommitted},
        "settings": {"world_size": 2, "threads_per_device": 1, "batch": args.batch_size,
                     "model_max_length": args.model_max_length, "epochs": args.epochs,
                     "warmup_epochs_dropped": args.warmup_epochs, "max_batches": args.max_batches,
                     "rounds": args.rounds, "large_model": args.large_model, "large_batch": args.large_batch_size},
        "stages": stages,
        "stage_3": {"available": 3 in stages, "note": stage3_note},
        "how": {"tokens_per_sec": "SPEC's epoch lines, both ranks summed per epoch, median over the measured epochs; "
                                  "medians over rounds, ratios the median of each round's",
                "peak_rss_bytes": "VmHWM of each worker process (RANK in its environment) read from /proc every "
                                  "0.2 s and when it prints an epoch line; the last reading before it exits",
                "program_peak_rss_rank0_bytes": "the program's own figure, metrics.jsonl's peak_memory_bytes "
                                                "(getrusage's ru_maxrss after each step, rank 0 only)",
                "model_state_per_rank": "the run's memory plan line at start (weights + gradients + AdamW, fp32)",
                "adamw_state": "the bytes of AdamW state rank 0 says it keeps (ZeRO stages only)",
                "one_unit": "16 bytes x the largest unit ZeRO-3 gathers whole (GPT-2's embeddings wte + wpe)"},
        "largest_unit_parameters": unit,
        "results": results,
        "gpt2_large": large,
        "command": " ".join([sys.executable] + sys.argv),
    }
    out["goals"] = goals(results, large, stages, stage3_note, unit)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=2)
    draw(results, stages, large, os.path.join(os.path.dirname(os.path.abspath(args.out)), "zero_memory.png"),
         stage3_note)
    print(json.dumps({"goals": out["goals"],
                      "tokens_per_sec": {r["model"]: {s: v["tokens_per_sec"] for s, v in r["stages"].items()}
                                         for r in results}}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
