#!/usr/bin/env python3
"""Peak resident memory of each rank of run_data_parallel, unsplit (T = 1) and split over a
tensor-parallel group (T = 2): one short run of each (a training step, then the evaluation,
generation and BLEU of the epoch, then its checkpoint), the rank processes' VmHWM read from /proc
while they run.

On CPUs a "device" is a share of the cores; the figures are host memory (resident set), which is
where the model lives on a CPU run.

    .venv/bin/python scripts/tensor_parallel_memory.py --model gpt2 --out tp_memory.json
    .venv/bin/python scripts/tensor_parallel_memory.py --program /other/build/run_data_parallel --sizes 2

Writes JSON: for each T, each rank's peak resident megabytes and the parameters it holds.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from typing import Dict, List

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def rank_processes(launcher_pid: int) -> Dict[int, int]:
    """pid -> rank of the launcher's children (RANK from their environment)."""
    found = {}
    try:
        children = open(f"/proc/{launcher_pid}/task/{launcher_pid}/children").read().split()
    except OSError:
        return found
    for child in children:
        try:
            env = open(f"/proc/{child}/environ", "rb").read().split(b"\0")
        except OSError:
            continue
        for entry in env:
            if entry.startswith(b"RANK="):
                found[int(child)] = int(entry[5:])
    return found


def peak_kib(pid: int) -> int:
    try:
        for line in open(f"/proc/{pid}/status"):
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def measure(program: str, model: str, world_size: int, tensor_parallel_size: int, extra: List[str]) -> dict:
    with tempfile.TemporaryDirectory(prefix="harness-tp-memory-") as workdir:
        command = [program, "--world_size", str(world_size), "--tensor_parallel_size", str(tensor_parallel_size),
                   "--model", model, "--model_max_length", "64", "--batch_size", "2", "--max_batches", "1",
                   "--n_epochs", "1", "--train_size", "16", "--validation_size", "2", "--test_size", "1",
                   "--threads_per_device", "1", "--no_progress", "--workdir", workdir] + extra
        started = time.monotonic()
        log_path = os.path.join(workdir, "run.log")
        with open(log_path, "w") as log_file:
            process = subprocess.Popen(command, stdout=log_file, stderr=subprocess.STDOUT)
            peaks: Dict[int, int] = {}
            pids: Dict[int, int] = {}
            while process.poll() is None:
                pids.update(rank_processes(process.pid))
                for pid, rank in pids.items():
                    peaks[rank] = max(peaks.get(rank, 0), peak_kib(pid))
                time.sleep(0.05)
        log = open(log_path).read()
        if process.returncode != 0:
            raise SystemExit(f"{' '.join(command)} exited {process.returncode}:\n{log[-4000:]}")
        counts = re.search(r"\((\d+) parameters(?:, (\d+) on each rank)?\)", log)
        return {
            "world_size": world_size,
            "tensor_parallel_size": tensor_parallel_size,
            "peak_resident_mb_by_rank": {str(r): round(kib / 1024, 1) for r, kib in sorted(peaks.items())},
            "parameters": int(counts.group(1)) if counts else None,
            "parameters_per_rank": int(counts.group(2) or counts.group(1)) if counts else None,
            "seconds": round(time.monotonic() - started, 1),
        }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--program", default=os.path.join(ROOT, "build", "run_data_parallel"))
    parser.add_argument("--model", default="gpt2")
    parser.add_argument("--sizes", default="1,2", help="tensor-parallel sizes to run (each with world size T)")
    parser.add_argument("--out", default="", help="also write the JSON here")
    parser.add_argument("extra", nargs="*", help="more flags for run_data_parallel (after --)")
    args = parser.parse_args()
    runs = [measure(args.program, args.model, int(t), int(t), args.extra) for t in args.sizes.split(",")]
    result = {"program": args.program, "model": args.model,
              "note": "host resident memory (VmHWM) of each rank process; on CPUs a device is a share of the cores",
              "runs": runs}
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
