#!/usr/bin/env python3
"""What a checkpoint costs: run_pipeline trains one step of a model (default `gpt2`, 124M) and writes
its end-of-epoch checkpoint, then a second run resumes from it; both print their times. Next to
them, a plain copy of the same files on the same disk (write + fsync), so that the write bandwidth
has a yardstick, and the same run with --async_checkpoint: how long training stalls while the
state is copied to host memory, against the synchronous save. The figures go into benchmark_details.json under "checkpoint" (the file is
created if missing, other keys are kept).

    scripts/checkpoint_bench.py [--model gpt2] [--build-dir build] [--workdir workdir/checkpoint_bench]
"""
import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SAVED = re.compile(r"checkpoint: saved (\S+) \(step \d+, epoch \d+, batch \d+, ([\d.]+) MB in ([\d.]+) s\)")
STALLED = re.compile(r"checkpoint: step \d+ copied to host memory in ([\d.]+) s \(training stalled ([\d.]+) s\)")
LOADED = re.compile(r"resume: verified and loaded ([\d.]+) MB in ([\d.]+) s")


def run(cmd):
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} exited {proc.returncode}:\n{proc.stderr[-3000:]}")
    return proc


def plain_copy(src_dir, dst_dir):
    """Copies every file of src_dir into dst_dir with an fsync each; returns (bytes, seconds)."""
    if os.path.exists(dst_dir):
        shutil.rmtree(dst_dir)
    os.makedirs(dst_dir)
    total, start = 0, time.perf_counter()
    for name in sorted(os.listdir(src_dir)):
        with open(os.path.join(src_dir, name), "rb") as f:
            data = f.read()
        with open(os.path.join(dst_dir, name), "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        total += len(data)
    fd = os.open(dst_dir, os.O_RDONLY)
    os.fsync(fd)
    os.close(fd)
    return total, time.perf_counter() - start


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="gpt2")
    p.add_argument("--build-dir", default=os.path.join(REPO_ROOT, "build"))
    p.add_argument("--workdir", default=os.path.join(REPO_ROOT, "workdir", "checkpoint_bench"))
    p.add_argument("--out", default=os.path.join(REPO_ROOT, "submit_figures", "benchmark_details.json"))
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    args = p.parse_args(argv)

    if os.path.exists(args.workdir):
        shutil.rmtree(args.workdir)
    program = os.path.join(args.build_dir, "run_pipeline")
    common = [program, "--model", args.model, "--workdir", args.workdir, "--train_size", "16",
              "--validation_size", "4", "--test_size", "2", "--batch_size", "2", "--model_max_length", "32",
              "--n_epochs", "1", "--max_batches", "1", "--benchmark_only", "--no_progress",
              "--threads_per_device", str(args.threads), "--keep_checkpoints", "1"]
    written = run(common)
    m = SAVED.search(written.stderr)
    if not m:
        raise SystemExit("no 'checkpoint: saved' line:\n" + written.stderr[-2000:])
    path, write_mb, write_s = m[1], float(m[2]), float(m[3])
    resumed = run(common + ["--resume", "auto"])
    m = LOADED.search(resumed.stderr)
    if not m:
        raise SystemExit("no 'resume: verified and loaded' line:\n" + resumed.stderr[-2000:])
    load_mb, load_s = float(m[1]), float(m[2])
    copy_bytes, copy_s = plain_copy(path, os.path.join(args.workdir, "plain_copy"))
    shutil.rmtree(os.path.join(args.workdir, "checkpoints"))
    in_background = run(common + ["--async_checkpoint"])
    m, saved = STALLED.search(in_background.stderr), SAVED.search(in_background.stderr)
    if not m or not saved:
        raise SystemExit("no 'checkpoint: ... copied to host memory' and 'saved' lines:\n" + in_background.stderr[-2000:])
    copy_to_host_s, stall_s, background_write_s = float(m[1]), float(m[2]), float(saved[3])

    figures = {
        "model": args.model,
        "device": f"CPU, {args.threads} thread(s); the checkpoint folder on the work directory's disk",
        "checkpoint_bytes": int(round(write_mb * 1e6)),
        "files": sorted(os.listdir(path)),
        "write_seconds": write_s,
        "write_MB_per_s": write_mb / write_s,
        "load_seconds": load_s,
        "load_MB_per_s": load_mb / load_s,
        "plain_copy_seconds": copy_s,
        "plain_copy_MB_per_s": copy_bytes / 1e6 / copy_s,
        "write_vs_plain_copy": (write_mb / write_s) / (copy_bytes / 1e6 / copy_s),
        "async_stall_seconds": stall_s,
        "async_copy_to_host_seconds": copy_to_host_s,
        "async_background_write_seconds": background_write_s,
        "async_stall_vs_sync_write": stall_s / write_s,
        "note": "write: gathering the unsplit weights and AdamW state, safetensors + JSON files, SHA-256 "
                "of each, fsync of every file and folder, rename; load: SHA-256 verification of every "
                "file, then reading weights and optimizer state into the model. Plain copy: the same "
                "files read and written again with an fsync each. Async: the training thread's stall "
                "(gathering the state, copying the weights into reused host buffers, AdamW's state into "
                "host copies) while a background thread writes the same files.",
    }
    details = {}
    if os.path.exists(args.out):
        with open(args.out) as f:
            details = json.load(f)
    details["checkpoint"] = figures
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(details, f, indent=2)
        f.write("\n")
    print(json.dumps(figures, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
