"""What a lost replica costs: --elastic against --max_restarts, every figure from this one run.

run_data_parallel --world_size 3 (3 processes x 1 thread on a shared machine: on CPUs a "device"
is a share of the cores), gpt2-mini, --steps optimizer steps in one epoch, dropout 0, a checkpoint
every --checkpoint-every steps. Four runs:
  - undisturbed (--elastic, nothing killed);
  - elastic: process 1 killed (SIGKILL) once the checkpoint of step --kill-at is written;
  - elastic_alone: the same with no replacement started (HARNESS_ELASTIC_MAX_REPLACEMENTS=0). The
    launcher starts a replacement only once the survivors committed a step without the lost
    process, so that its start does not share their cores while they recover: the two runs
    should recover alike, and this one shows it;
  - restart: the same kill under --max_restarts 1 (no --elastic): every worker restarts and resumes
    from that checkpoint, the best case for a restart.
For each: the global training loss of every step (the mean of the losses of the processes that
trained it, which each process writes through the HARNESS_TEST_STEP_LOSSES hook: under --elastic
the survivors' losses are scaled so that this mean is the undisturbed run's), and for the three
killed runs the wall time from the kill to the next completed step (the step's record appearing in
metrics.jsonl). In the elastic run the launcher starts a replacement for process 1, which joins at
step --join-at (the HARNESS_TEST_JOIN_AT_STEP hook holds the others there until it has asked), so
that the run ends with 3 replicas; the time it took to admit it and send it the state is recorded.

Writes WORKDIR/elastic/*.log, OUT_DIR/elastic.json and OUT_DIR/elastic.png.
"""
import argparse
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time

from bench_common import add_folder_arguments, cpu_model_name, free_port

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from fault_injection import worker_of_rank  # noqa: E402


def train_records(path):
    out = {}
    try:
        with open(path) as f:
            for line in f:
                try:
                    record = json.loads(line)
                except ValueError:
                    continue  # a line being written
                if record.get("kind") == "train":
                    out[record["step"]] = record
    except OSError:
        pass
    return out


def global_losses(folder):
    """step -> the mean loss over the processes that trained it (the last record of each)."""
    by_rank = {}
    for name in os.listdir(folder):
        with open(os.path.join(folder, name)) as f:
            by_rank[name] = {int(a): float(b) for a, b in (line.split() for line in f if line.strip())}
    steps = sorted({s for losses in by_rank.values() for s in losses})
    return {s: statistics.fmean(l[s] for l in by_rank.values() if s in l) for s in steps}


def run_one(args, name, extra, kill, env_extra=None):
    """Runs one configuration; with `kill`, kills process 1 once step args.kill_at's checkpoint is
    saved and times the next step. Returns the losses by step and the recovery time (or None)."""
    work = os.path.join(args.workdir, "elastic", name)
    os.makedirs(os.path.dirname(work), exist_ok=True)
    rows = args.batch_size
    cmd = [os.path.join(args.build_dir, "run_data_parallel"), "--world_size", "3", "--master_port", str(free_port()),
           "--workdir", work, "--model", args.model, "--model_max_length", "64", "--batch_size", str(rows),
           "--train_size", str(rows * args.steps), "--validation_size", "6", "--test_size", "2", "--n_epochs", "1",
           "--dropout", "0", "--threads_per_device", "1", "--no_progress", "--benchmark_only",
           "--checkpoint_every", str(args.checkpoint_every), "--dist_timeout_s", str(args.dist_timeout_s)] + extra
    log_path = os.path.join(args.workdir, "elastic", name + ".log")
    metrics = os.path.join(work, "metrics.jsonl")
    losses = os.path.join(args.workdir, "elastic", name + "-losses")
    shutil.rmtree(losses, ignore_errors=True)
    shutil.rmtree(work, ignore_errors=True)
    os.makedirs(losses)
    saved = threading.Event()
    start = time.time()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                start_new_session=True,
                                env=dict(os.environ, HARNESS_TEST_STEP_LOSSES=losses, **(env_extra or {})))

        def read():
            for line in proc.stdout:
                log.write(line)
                if f"(step {args.kill_at}," in line and "checkpoint: saved" in line:
                    saved.set()
        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        recovery = None
        try:
            if kill:
                if not saved.wait(timeout=args.run_timeout):
                    raise SystemExit(f"{name}: no checkpoint of step {args.kill_at}; see {log_path}")
                pid = worker_of_rank(proc.pid, 1)
                killed_at = time.time()
                os.kill(pid, signal.SIGKILL)
                while proc.poll() is None and args.kill_at + 1 not in train_records(metrics):
                    time.sleep(0.01)
                if args.kill_at + 1 in train_records(metrics):
                    recovery = time.time() - killed_at
            code = proc.wait(timeout=args.run_timeout)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
        reader.join(timeout=10)
    if code != 0:
        raise SystemExit(f"{name} exited {code}; see {log_path}")
    records = train_records(metrics)
    mean = global_losses(losses)
    for what, steps in (("metrics.jsonl", sorted(records)), ("the loss records", sorted(mean))):
        if steps != list(range(1, args.steps + 1)):
            raise SystemExit(f"{name}: steps {steps} in {what}, expected 1 to {args.steps}")
    joined = None
    with open(log_path) as log:
        for line in log:
            m = re.search(r"elastic: generation \d+ at step (\d+): process \d+ joined; .* \(([0-9.]+) s to admit", line)
            if m:
                joined = {"step": int(m[1]), "admit_and_send_s": float(m[2])}
    if env_extra and "HARNESS_TEST_JOIN_AT_STEP" in env_extra and joined is None:
        raise SystemExit(f"{name}: no replacement joined; see {log_path}")
    return {"losses": [mean[s] for s in range(1, args.steps + 1)], "recovery_s": recovery, "joined": joined,
            "wall_s": time.time() - start, "log": os.path.relpath(log_path, REPO_ROOT)}


def plot(summary, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (curves, bars) = plt.subplots(1, 2, figsize=(11, 4), gridspec_kw={"width_ratios": [2.2, 1]})
    steps = list(range(1, summary["config"]["steps"] + 1))
    for name, style in (("undisturbed", "-"), ("elastic", "--"), ("restart", ":")):
        curves.plot(steps, summary["runs"][name]["losses"], style, label=name)
    curves.axvline(summary["config"]["kill_at"] + 0.5, color="grey", lw=0.8)
    curves.axvline(summary["config"]["join_at"] - 0.5, color="grey", lw=0.8, ls=":")
    curves.set_xlabel("optimizer step")
    curves.set_ylabel("training loss (mean over the processes)")
    curves.set_title("process 1 killed after step %d; its replacement joins at step %d"
                     % (summary["config"]["kill_at"], summary["config"]["join_at"]))
    curves.legend()
    names = ["elastic", "elastic_alone", "restart"]
    values = [summary["recovery_s"][n] for n in names]
    bars.bar(["elastic", "elastic,\nno replacement", "restart"], values, color=["tab:orange", "tab:red", "tab:green"])
    for i, v in enumerate(values):
        bars.text(i, v, "%.2f s" % v, ha="center", va="bottom")
    bars.set_ylim(0, 1.15 * max(values))
    bars.set_ylabel("kill to next completed step (s, median)")
    fig.suptitle("--elastic vs --max_restarts, %s, 3 processes x 1 thread (CPU: a device is a share of the cores)"
                 % summary["config"]["model"], fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_folder_arguments(p, REPO_ROOT)
    p.add_argument("--model", default="gpt2-mini")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--kill-at", type=int, default=20, help="kill after this step's checkpoint")
    p.add_argument("--checkpoint-every", type=int, default=10)
    p.add_argument("--join-at", type=int, default=30, help="the step a replacement joins the elastic run at")
    p.add_argument("--batch-size", type=int, default=24)
    p.add_argument("--dist-timeout-s", type=int, default=10)
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--run-timeout", type=float, default=1800.0)
    args = p.parse_args(argv)
    if args.kill_at % args.checkpoint_every or not 0 < args.kill_at < args.steps:
        raise SystemExit("--kill-at must be a checkpoint's step (a multiple of --checkpoint-every) below --steps")
    if not args.kill_at + 2 <= args.join_at <= args.steps:
        raise SystemExit("--join-at must lie after the step that follows --kill-at, and not past --steps")
    runs = {"undisturbed": ["--elastic"], "elastic": ["--elastic"], "elastic_alone": ["--elastic"],
            "restart": ["--max_restarts", "1"]}
    envs = {"elastic": {"HARNESS_TEST_JOIN_AT_STEP": str(args.join_at)},
            "elastic_alone": {"HARNESS_ELASTIC_MAX_REPLACEMENTS": "0"}}
    rounds = []
    for r in range(args.rounds):
        order = list(runs) if r % 2 == 0 else list(runs)[::-1]
        rounds.append({name: run_one(args, f"{name}{r}", runs[name], kill=name != "undisturbed",
                                     env_extra=envs.get(name)) for name in order})
        print(f"[elastic] round {r}: " + ", ".join(f"{n} {v['recovery_s']}" for n, v in rounds[-1].items()),
              file=sys.stderr)
    recovered = ("elastic", "elastic_alone", "restart")
    recovery = {n: statistics.median(r[n]["recovery_s"] for r in rounds) for n in recovered}
    last = rounds[-1]
    summary = {
        "config": {"model": args.model, "world_size": 3, "threads_per_process": 1, "steps": args.steps,
                   "kill_at": args.kill_at, "checkpoint_every": args.checkpoint_every, "batch_size": args.batch_size,
                   "dist_timeout_s": args.dist_timeout_s, "rounds": args.rounds, "cpu": cpu_model_name(),
                   "device": "CPU: each process a share of the cores", "join_at": args.join_at},
        "recovery_s": recovery,
        "recovery_ratio_elastic_over_restart": recovery["elastic"] / recovery["restart"],
        # The same loss with no replacement started (elastic's starts after the recovery).
        "recovery_ratio_elastic_alone_over_restart": recovery["elastic_alone"] / recovery["restart"],
        "replacement_admit_and_send_s": statistics.median(r["elastic"]["joined"]["admit_and_send_s"] for r in rounds),
        "largest_loss_difference_from_undisturbed": {
            n: max(abs(a - b) for a, b in zip(last[n]["losses"], last["undisturbed"]["losses"]))
            for n in recovered},
        "runs": last,
        "rounds": [{n: r[n]["recovery_s"] for n in r} for r in rounds],
    }
    os.makedirs(args.out_dir, exist_ok=True)
    with open(os.path.join(args.out_dir, "elastic.json"), "w") as f:
        json.dump(summary, f, indent=1)
    plot(summary, os.path.join(args.out_dir, "elastic.png"))
    print(json.dumps({k: summary[k] for k in ("recovery_s", "recovery_ratio_elastic_over_restart",
                                              "recovery_ratio_elastic_alone_over_restart",
                                              "replacement_admit_and_send_s",
                                              "largest_loss_difference_from_undisturbed")}, indent=1))


if __name__ == "__main__":
    main()
