#!/usr/bin/env python3
"""The fault table: runs the built programs into each fault a real run meets and records what the
user sees, how long until the program exits, and whether anything is left running.

    .venv/bin/python scripts/fault_injection.py                    # the Markdown table on stdout
    .venv/bin/python scripts/fault_injection.py --out faults.json  # and every row as JSON

Scenarios (gpt2-tiny, a few batches, CPU ranks):
  kill -9         rank 1 of run_data_parallel --world_size 2 is SIGKILLed mid-training
  SIGSTOP         rank 1 is stopped mid-training (--dist_timeout_s 5)
  missing rank    only rank 0 of a world of 2 is started (torchrun's variables, --dist_timeout_s 5)
  port in use     --master_port is held by another socket
  corrupt dataset a --dataset JSON Lines file with a broken line
  disk full       the file-size limit (RLIMIT_FSIZE, SIGXFSZ ignored) stops the first large write
  kill in a save  run_pipeline is SIGKILLed in the middle of writing a checkpoint; --resume auto
Each row passes when the program exits non-zero (the resume: zero) within its bound, its message
says what failed, and no process of it is left. tests/python/test_faults.py runs them all.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import resource
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from typing import Callable, List, Optional

from bench_common import free_port

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = ["--model", "gpt2-tiny", "--model_max_length", "40", "--train_size", "64", "--validation_size", "16",
        "--test_size", "4", "--no_progress", "--batch_size", "8"]


@dataclass
class Outcome:
    scenario: str
    user_sees: str           # the line that says what went wrong
    seconds_to_exit: float
    exit_code: int
    left_running: List[int] = field(default_factory=list)
    bound_s: float = 0.0
    expected: str = ""       # a regular expression the message must match
    passed: bool = False


def descendants(pid: int) -> List[int]:
    parents = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    stat = f.read()
                parents.setdefault(int(stat[stat.rindex(")") + 2:].split()[1]), []).append(int(entry))
            except (OSError, ValueError):
                pass
    out, todo = [], [pid]
    while todo:
        for child in parents.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except OSError:
        return False


def rank_of(pid: int) -> Optional[int]:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            env = dict(e.split(b"=", 1) for e in f.read().split(b"\0") if b"=" in e)
        return int(env[b"RANK"]) if b"RANK" in env else None
    except (OSError, ValueError):
        return None


def worker_of_rank(launcher_pid: int, rank: int) -> Optional[int]:
    """The pid of the launcher's worker whose RANK is `rank`, or None."""
    return next((p for p in descendants(launcher_pid) if rank_of(p) == rank), None)


def telling_line(text: str) -> str:
    """What a user reads: the first error line of the program (or of a rank) and the launcher's
    verdict when there is one, else the last line."""
    lines = [l.strip() for l in text.splitlines() if l.strip()]
    error = next((l for l in lines if "error" in l and not l.startswith("launcher: ")), None)
    launcher = next((l for l in lines if l.startswith("launcher: ")), None)
    shown = [l for l in (error, launcher) if l]
    return " / ".join(shown) if shown else (lines[-1] if lines else "")


class Runner:
    def __init__(self, build_dir: str):
        self.dp = os.path.join(build_dir, "run_data_parallel")
        self.pp = os.path.join(build_dir, "run_pipeline")
        for program in (self.dp, self.pp):
            if not os.access(program, os.X_OK):
                raise SystemExit(f"fault_injection.py: {program} not found: build first (scripts/build.sh)")

    def launch(self, args, env=None, preexec: Optional[Callable[[], None]] = None) -> subprocess.Popen:
        return subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                                preexec_fn=preexec, start_new_session=True)

    def finish(self, scenario: str, proc: subprocess.Popen, start: float, bound_s: float, expected: str,
               watched: List[int], expect_success: bool = False, timeout: float = 120) -> Outcome:
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, err = proc.communicate()
            err += f"\n(fault_injection.py: still running after {timeout:.0f} s; killed)"
        seconds = time.monotonic() - start
        time.sleep(0.3)
        left = [p for p in watched if alive(p)]
        line = telling_line(out + "\n" + err) if not expect_success else "resumed and finished"
        ok_code = proc.returncode == 0 if expect_success else proc.returncode != 0
        outcome = Outcome(scenario, line, round(seconds, 1), proc.returncode, left, bound_s, expected)
        outcome.passed = ok_code and seconds <= bound_s and not left and re.search(expected, out + err) is not None
        return outcome

    def wait_until_training(self, proc: subprocess.Popen, epochs_seen: int = 2, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        seen = 0
        while time.monotonic() < deadline and seen < epochs_seen:
            line = proc.stdout.readline()
            if not line:
                break
            if line.startswith("Epoch "):
                seen += 1

    def two_ranks(self, work: str, extra=()) -> subprocess.Popen:
        return self.launch([self.dp, "--world_size", "2", "--workdir", work, "--master_port", str(free_port()),
                            "--n_epochs", "1000", "--benchmark_only"] + TINY + list(extra))

    def kill_one_rank(self, sig: int, name: str, bound_s: float, expected: str, extra=()) -> Outcome:
        with tempfile.TemporaryDirectory() as work:
            proc = self.two_ranks(work, extra)
            self.wait_until_training(proc)
            workers = descendants(proc.pid)
            rank1 = [p for p in workers if rank_of(p) == 1]
            os.kill(rank1[0], sig)
            return self.finish(name, proc, time.monotonic(), bound_s, expected, workers)

    def kill_9(self) -> Outcome:
        return self.kill_one_rank(signal.SIGKILL, "kill -9 of a rank mid-training", 30,
                                  r"rank 1 was killed by signal 9 \(SIGKILL\)")

    def sigstop(self) -> Outcome:
        return self.kill_one_rank(signal.SIGSTOP, "SIGSTOP of a rank mid-training (--dist_timeout_s 5)", 5 + 15,
                                  r"rank 1 was stopped by SIGSTOP", ["--dist_timeout_s", "5"])

    def missing_rank(self) -> Outcome:
        with tempfile.TemporaryDirectory() as work:
            port = free_port()
            env = dict(os.environ, RANK="0", WORLD_SIZE="2", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                       MASTER_PORT=str(port))
            start = time.monotonic()
            proc = self.launch([self.dp, "--workdir", work, "--dist_timeout_s", "5", "--n_epochs", "1"] + TINY,
                               env=env)
            return self.finish("a rank that never arrives (--dist_timeout_s 5)", proc, start, 5 + 15,
                               r"missing: rank 1", [])

    def port_in_use(self) -> Outcome:
        with tempfile.TemporaryDirectory() as work, socket.socket() as held:
            held.bind(("127.0.0.1", 0))
            held.listen(1)
            port = held.getsockname()[1]
            start = time.monotonic()
            proc = self.launch([self.dp, "--world_size", "2", "--workdir", work, "--master_addr", "127.0.0.1",
                                "--master_port", str(port), "--dist_timeout_s", "10", "--n_epochs", "1"] + TINY)
            return self.finish(f"--master_port {port} already in use", proc, start, 10 + 15,
                               rf"{port}", [])

    def corrupt_dataset(self) -> Outcome:
        with tempfile.TemporaryDirectory() as tmp:
            data = os.path.join(tmp, "corpus")
            subprocess.run([self.pp, "--export_dataset", data] + TINY, check=True, capture_output=True)
            path = os.path.join(data, "validation.jsonl")
            with open(path) as f:
                lines = f.readlines()
            lines[6] = lines[6][: len(lines[6]) // 2] + "\n"  # line 7 cut in half
            with open(path, "w") as f:
                f.writelines(lines)
            start = time.monotonic()
            proc = self.launch([self.pp, "--dataset", data, "--workdir", os.path.join(tmp, "w"), "--n_epochs", "1"]
                               + TINY)
            return self.finish("a corrupted --dataset file", proc, start, 30, r"validation\.jsonl.*(line )?7", [])

    def disk_full(self) -> Outcome:
        def limit_file_size():
            signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # writes fail with EFBIG instead of killing
            resource.setrlimit(resource.RLIMIT_FSIZE, (256 * 1024, 256 * 1024))

        with tempfile.TemporaryDirectory() as work:
            start = time.monotonic()
            proc = self.launch([self.pp, "--workdir", work, "--n_epochs", "1", "--max_batches", "2"] + TINY,
                               preexec=limit_file_size)
            return self.finish("disk full while writing (file-size limit 256 KiB)", proc, start, 60,
                               r"(File too large|No space|cannot write|failed)", [])

    def kill_during_save(self) -> Outcome:
        with tempfile.TemporaryDirectory() as work:
            args = [self.pp, "--workdir", work, "--n_epochs", "2", "--max_batches", "4", "--checkpoint_every", "1"] + TINY
            env = dict(os.environ, HARNESS_TEST_CHECKPOINT_STALL_MS="3000")
            proc = self.launch(args, env=env)
            deadline = time.monotonic() + 120
            checkpoints = os.path.join(work, "checkpoints")
            while time.monotonic() < deadline:  # the first checkpoint is complete, the second one stalls
                names = os.listdir(checkpoints) if os.path.isdir(checkpoints) else []
                if any(n.startswith("step-") for n in names) and any(n.startswith(".step-") for n in names):
                    break
                time.sleep(0.1)
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
            start = time.monotonic()
            resumed = self.launch(args[:1] + ["--resume", "auto"] + args[1:])
            return self.finish("kill -9 in the middle of a checkpoint write, then --resume auto", resumed, start, 120,
                               r"resume: continuing from .*step-", [], expect_success=True)

    SCENARIOS = ("kill_9", "sigstop", "missing_rank", "port_in_use", "corrupt_dataset", "disk_full",
                 "kill_during_save")


def markdown(outcomes: List[Outcome]) -> str:
    rows = ["| scenario | what the user sees | time to exit | left running | ok |", "|---|---|---|---|---|"]
    for o in outcomes:
        seen = o.user_sees.replace("|", "\\|")
        if len(seen) > 240:
            seen = seen[:237] + "..."
        rows.append(f"| {o.scenario} | `{seen}` | {o.seconds_to_exit:.1f} s (bound {o.bound_s:.0f} s) | "
                    f"{'nothing' if not o.left_running else ', '.join(map(str, o.left_running))} | "
                    f"{'yes' if o.passed else 'NO'} |")
    return "\n".join(rows) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--build-dir", default=os.path.join(REPO_ROOT, "build"))
    p.add_argument("--only", nargs="*", choices=Runner.SCENARIOS, help="run these scenarios only")
    p.add_argument("--out", help="write every row as JSON here too")
    args = p.parse_args(argv)
    runner = Runner(args.build_dir)
    outcomes = []
    for name in args.only or Runner.SCENARIOS:
        print(f"[faults] {name} ...", file=sys.stderr, flush=True)
        outcomes.append(getattr(runner, name)())
    print(markdown(outcomes), end="")
    if args.out:
        with open(args.out, "w") as f:
            json.dump([asdict(o) for o in outcomes], f, indent=2)
            f.write("\n")
    return 0 if all(o.passed for o in outcomes) else 1


if __name__ == "__main__":
    sys.exit(main())
