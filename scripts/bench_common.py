"""Parsing and statistics shared by run_benchmarks.py, gpu_check.py and their tests: the SPEC §7
lines the two programs print, per-epoch figures with warm-up epochs dropped, the SPEC §8 summary,
and small helpers of the scripts that start the programs (free_port).

Only the printed lines are read. A missing, malformed or non-finite figure raises LogParseError
naming the log file (and line), never a silent NaN.
"""
from __future__ import annotations

import math
import os
import re
import shutil
import socket
import statistics
import subprocess
from dataclasses import dataclass, field
from typing import Dict, List, Optional

# A plain decimal as the programs print it (std::to_chars fixed); nan/inf are matched so that
# they can be rejected by name instead of failing the line as "malformed".
_NUMBER = r"([-+]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d+)?|[-+]?nan|[-+]?inf)"

# SPEC §7, each line exactly so.
DP_EPOCH_RE = re.compile(
    rf"^Epoch (\d+) on Rank (\d+): Training Time = {_NUMBER}, Tokens_per_sec = {_NUMBER}$")
PP_EPOCH_RE = re.compile(rf"^Epoch (\d+): Training Time = {_NUMBER}, Tokens_per_sec = {_NUMBER}$")
DP_SUMMARY_RE = re.compile(
    rf"^Rank (\d+) training time: avg:{_NUMBER}, std:{_NUMBER}, "
    rf"tokens_per_second: avg: {_NUMBER}, std:{_NUMBER}$")
PP_SUMMARY_RE = re.compile(
    rf"^Training time: avg:{_NUMBER}, std:{_NUMBER}, "
    rf"tokens_per_second: avg: {_NUMBER}, std:{_NUMBER}$")
DP_VALIDATION_RE = re.compile(rf"^Epoch (\d+) on Rank (\d+): Validation Loss = {_NUMBER}$")
PP_VALIDATION_RE = re.compile(rf"^Epoch (\d+): Validation Loss = {_NUMBER}$")
DP_BLEU_RE = re.compile(rf"^Epoch (\d+) on Rank (\d+): BLEU = {_NUMBER}$")
PP_BLEU_RE = re.compile(rf"^Epoch (\d+): BLEU = {_NUMBER}$")
# The launcher's prefix of a rank's line that names no rank itself.
_RANK_PREFIX_RE = re.compile(r"^\[rank \d+\] ")

# Lines that claim to be one of the above: if such a line does not match exactly, it is malformed.
_EPOCH_CANDIDATE_RE = re.compile(r"^\s*Epoch\b.*Training Time", re.IGNORECASE)
_SUMMARY_CANDIDATE_RE = re.compile(r"^\s*(Rank \d+ )?training time:", re.IGNORECASE)

SUMMARY_STAT_KEYS = ("time_mean", "time_std", "tok_mean", "tok_std")


class LogParseError(ValueError):
    """A benchmark log lacks a line it must have, or has one that is malformed."""


class BenchmarkError(RuntimeError):
    """A benchmark run or its inputs failed (program exit status, bad option values)."""


@dataclass
class EpochFigure:
    epoch: int
    time: float  # seconds
    tok: float  # tokens per second
    line: int  # 1-based line number in the log


@dataclass
class ParsedLog:
    """Per-rank epoch figures of one log; pipeline logs have the single rank 0."""
    path: str
    epochs: Dict[int, List[EpochFigure]] = field(default_factory=dict)  # rank -> by epoch
    summaries: Dict[int, Dict[str, float]] = field(default_factory=dict)  # rank -> avg/std


@dataclass
class Stats:
    time_mean: float
    time_std: float
    tok_mean: float
    tok_std: float
    n: int  # measured epochs behind the figures
    time_median: float = math.nan
    tok_median: float = math.nan

    def as_summary(self) -> Dict[str, float]:
        return {k: getattr(self, k) for k in SUMMARY_STAT_KEYS}


def _finite(text: str, what: str, path: str, lineno: int) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise LogParseError(f"{path}:{lineno}: {what} is {text}, not a finite number")
    return value


def _check_epochs(path: str, rank_label: str, figures: List[EpochFigure],
                  expected_epochs: Optional[int]) -> List[EpochFigure]:
    figures = sorted(figures, key=lambda f: f.epoch)
    seen = [f.epoch for f in figures]
    for a, b in zip(figures, figures[1:]):
        if a.epoch == b.epoch:
            raise LogParseError(f"{path}:{b.line}: {rank_label}epoch {b.epoch} is reported twice "
                                f"(first at line {a.line})")
    want = list(range(expected_epochs if expected_epochs is not None else len(figures)))
    if seen != want:
        missing = sorted(set(want) - set(seen))
        extra = sorted(set(seen) - set(want))
        detail = []
        if missing:
            detail.append(f"missing epoch(s) {missing}")
        if extra:
            detail.append(f"unexpected epoch(s) {extra}")
        raise LogParseError(f"{path}: {rank_label}expected the Training Time lines of epochs "
                            f"0..{len(want) - 1}: {', '.join(detail)} (did the run fail or stop "
                            f"early? see the .stderr.log next to it)")
    return figures


def _check_summary(path: str, rank_label: str, figures: List[EpochFigure],
                   summary: Dict[str, float]) -> None:
    """The program's own mean over all its epochs must agree with its epoch lines."""
    times = [f.time for f in figures]
    toks = [f.tok for f in figures]
    for key, values in (("time avg", times), ("tokens_per_second avg", toks)):
        mean = sum(values) / len(values)
        if not math.isclose(summary[key], mean, rel_tol=1e-6, abs_tol=1e-9):
            raise LogParseError(f"{path}:{summary['line']:.0f}: {rank_label}summary {key} "
                                f"{summary[key]} disagrees with the mean {mean} of its epoch lines")


def parse_log_text(text: str, path: str, kind: str, world_size: int = 1,
                   expected_epochs: Optional[int] = None) -> ParsedLog:
    """Parses a program's stdout. kind is "dp" (run_data_parallel, `world_size` ranks) or "pp"
    (run_pipeline). Every rank must report epochs 0..expected_epochs-1 and its summary line."""
    if kind not in ("dp", "pp"):
        raise ValueError(f"kind must be 'dp' or 'pp', got {kind!r}")
    epoch_re, summary_re = (DP_EPOCH_RE, DP_SUMMARY_RE) if kind == "dp" else (PP_EPOCH_RE, PP_SUMMARY_RE)
    expected_ranks = list(range(world_size if kind == "dp" else 1))
    out = ParsedLog(path=path)
    raw: Dict[int, List[EpochFigure]] = {}
    for lineno, line in enumerate(text.splitlines(), start=1):
        line = line.rstrip("\r")
        if _EPOCH_CANDIDATE_RE.match(line):
            m = epoch_re.match(line)
            if not m:
                raise LogParseError(f"{path}:{lineno}: malformed Training Time line "
                                    f"(expected SPEC §7's {'data parallel' if kind == 'dp' else 'pipeline'} "
                                    f"form): {line!r}")
            if kind == "dp":
                epoch, rank, t, r = int(m.group(1)), int(m.group(2)), m.group(3), m.group(4)
            else:
                epoch, rank, t, r = int(m.group(1)), 0, m.group(2), m.group(3)
            if rank not in expected_ranks:
                raise LogParseError(f"{path}:{lineno}: rank {rank} is outside world size {world_size}")
            raw.setdefault(rank, []).append(EpochFigure(
                epoch, _finite(t, "Training Time", path, lineno),
                _finite(r, "Tokens_per_sec", path, lineno), lineno))
            continue
        if _SUMMARY_CANDIDATE_RE.match(line):
            m = summary_re.match(line)
            if not m:
                raise LogParseError(f"{path}:{lineno}: malformed summary line: {line!r}")
            groups = list(m.groups())
            rank = int(groups.pop(0)) if kind == "dp" else 0
            if rank not in expected_ranks:
                raise LogParseError(f"{path}:{lineno}: rank {rank} is outside world size {world_size}")
            names = ("time avg", "time std", "tokens_per_second avg", "tokens_per_second std")
            out.summaries[rank] = {n: _finite(g, n, path, lineno) for n, g in zip(names, groups)}
            out.summaries[rank]["line"] = lineno
    for rank in expected_ranks:
        label = f"rank {rank}: " if kind == "dp" else ""
        if rank not in raw:
            raise LogParseError(f"{path}: {label}no Training Time line at all (did the run fail? "
                                f"see the .stderr.log next to it)")
        out.epochs[rank] = _check_epochs(path, label, raw[rank], expected_epochs)
        if rank not in out.summaries:
            raise LogParseError(f"{path}: {label}the final 'training time: avg:...' summary line is "
                                f"missing (the run did not finish)")
        _check_summary(path, label, out.epochs[rank], out.summaries[rank])
    return out


def parse_log(path: str, kind: str, world_size: int = 1,
              expected_epochs: Optional[int] = None) -> ParsedLog:
    if not os.path.isfile(path):
        raise LogParseError(f"{path}: log file not found")
    with open(path, encoding="utf-8", errors="replace") as f:
        return parse_log_text(f.read(), path, kind, world_size, expected_epochs)


def printed_figures(text: str) -> Dict[str, List[dict]]:
    """Every epoch line of a program's output as it is found, in either program's form, for a
    report of what a run printed (a failed run's too): no completeness checks, and a nan or inf
    is kept as such. {"training": [{epoch, rank, seconds, tokens_per_sec}], "validation_loss":
    [{epoch, rank, value}], "bleu": [...]}, only the kinds found; run_pipeline's lines are rank 0."""
    kinds = (("training", DP_EPOCH_RE, PP_EPOCH_RE), ("validation_loss", DP_VALIDATION_RE, PP_VALIDATION_RE),
             ("bleu", DP_BLEU_RE, PP_BLEU_RE))
    out: Dict[str, List[dict]] = {}
    for line in text.splitlines():
        line = _RANK_PREFIX_RE.sub("", line.strip())
        for key, dp_re, pp_re in kinds:
            m = dp_re.match(line)
            if m:
                epoch, rank, values = int(m.group(1)), int(m.group(2)), m.groups()[2:]
            else:
                m = pp_re.match(line)
                if not m:
                    continue
                epoch, rank, values = int(m.group(1)), 0, m.groups()[1:]
            if key == "training":
                figure = {"epoch": epoch, "rank": rank, "seconds": float(values[0]),
                          "tokens_per_sec": float(values[1])}
            else:
                figure = {"epoch": epoch, "rank": rank, "value": float(values[0])}
            out.setdefault(key, []).append(figure)
            break
    return out


def add_folder_arguments(parser, repo_root: str) -> None:
    """The folders every benchmark script takes: --build-dir, --workdir and --out-dir."""
    parser.add_argument("--build-dir", default=os.path.join(repo_root, "build"))
    parser.add_argument("--workdir", default="./workdir")
    parser.add_argument("--out-dir", default=os.path.join(repo_root, "submit_figures"))


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free now (for --master_port)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def mean_std(values: List[float]) -> tuple:
    """Mean and population standard deviation, as the programs print them."""
    if not values:
        raise ValueError("mean_std of no values")
    mean = sum(values) / len(values)
    return mean, math.sqrt(sum((v - mean) ** 2 for v in values) / len(values))


def measured_epochs(log: ParsedLog, warmup: int) -> Dict[int, List[EpochFigure]]:
    out = {}
    for rank, figures in log.epochs.items():
        if warmup >= len(figures):
            raise LogParseError(f"{log.path}: {len(figures)} epoch(s) leave none after dropping "
                                f"{warmup} warm-up epoch(s)")
        out[rank] = figures[warmup:]
    return out


def combined_stats(log: ParsedLog, warmup: int) -> Stats:
    """Per measured epoch: time = mean over ranks, throughput = sum over ranks (SPEC §8); then the
    mean and std over epochs. A single-rank log reduces to its own figures."""
    per_rank = measured_epochs(log, warmup)
    ranks = sorted(per_rank)
    n = len(per_rank[ranks[0]])
    times, toks = [], []
    for i in range(n):
        times.append(sum(per_rank[r][i].time for r in ranks) / len(ranks))
        toks.append(sum(per_rank[r][i].tok for r in ranks))
    tm, ts = mean_std(times)
    km, ks = mean_std(toks)
    return Stats(tm, ts, km, ks, n, statistics.median(times), statistics.median(toks))


def speedups(base: Stats, faster: Stats) -> Dict[str, float]:
    return {"speedup_time_reduction_x": base.time_mean / faster.time_mean,
            "speedup_throughput_x": faster.tok_mean / base.tok_mean}


def performance_summary(epochs: int, warmup: int, pipeline_batch_size: int, pipeline_n_chunk: int,
                        dp_single: Optional[Stats], dp_two: Optional[Stats],
                        pp_model: Optional[Stats], pp_pipe: Optional[Stats]) -> dict:
    """SPEC §8's JSON, exactly its keys. A skipped section (--skip-dp/--skip-pp) is null."""
    out = {"config": {"epochs": epochs, "warmup_epochs_dropped": warmup,
                      "pipeline_batch_size": pipeline_batch_size,
                      "pipeline_n_chunk": pipeline_n_chunk}}
    if dp_single and dp_two:
        out["data_parallel"] = {"single_gpu": dp_single.as_summary(), "two_gpu": dp_two.as_summary(),
                                **speedups(dp_single, dp_two)}
    else:
        out["data_parallel"] = None
    if pp_model and pp_pipe:
        out["pipeline_parallel"] = {"model_parallel": pp_model.as_summary(),
                                    "pipeline_parallel": pp_pipe.as_summary(),
                                    **speedups(pp_model, pp_pipe)}
    else:
        out["pipeline_parallel"] = None
    return out


def threshold_failures(summary: dict, dp_time: float, dp_throughput: float, pp_time: float,
                       pp_throughput: float) -> List[str]:
    """The grader's four checks; one message per failed check (skipped sections are not checked)."""
    checks = []
    if summary.get("data_parallel"):
        dp = summary["data_parallel"]
        checks += [("data parallel time speedup", "--dp-time-threshold", dp["speedup_time_reduction_x"], dp_time),
                   ("data parallel throughput speedup", "--dp-throughput-threshold", dp["speedup_throughput_x"], dp_throughput)]
    if summary.get("pipeline_parallel"):
        pp = summary["pipeline_parallel"]
        checks += [("pipeline time speedup", "--pp-time-threshold", pp["speedup_time_reduction_x"], pp_time),
                   ("pipeline throughput speedup", "--pp-throughput-threshold", pp["speedup_throughput_x"], pp_throughput)]
    return [f"{name} {value:.3f}x is below {flag} {limit:.3f}x"
            for name, flag, value, limit in checks if not value >= limit]


def gpipe_bound(k: int, m: int) -> float:
    """Speedup bound of GPipe over one-at-a-time model parallelism: K*M/(M+K-1)."""
    return k * m / (m + k - 1)


def gpipe_bubble(k: int, m: int) -> float:
    """Idle fraction of a GPipe schedule with equal stage times: (K-1)/(M+K-1)."""
    return (k - 1) / (m + k - 1)


def cpu_model_name() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform
    return platform.processor() or "unknown CPU"


def gpu_names() -> List[str]:
    """Names of the NVIDIA GPUs present (nvidia-smi), empty without them."""
    if shutil.which("nvidia-smi") is None:
        return []
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30, check=True).stdout
    except (subprocess.SubprocessError, OSError):
        return []
    return [line.strip() for line in out.splitlines() if line.strip()]


def describe_device(devices: str, threads_per_device: int) -> str:
    """What one "device" of a run was, for the figures' axis labels."""
    if devices.startswith("cuda"):
        names = gpu_names()
        return f"device = 1 GPU ({names[0]})" if names else "device = 1 GPU"
    cores = "core" if threads_per_device == 1 else "cores"
    return (f"CPU device = {threads_per_device} {cores} of {cpu_model_name()} "
            f"({os.cpu_count()} cores on the machine)")
