#!/usr/bin/env python3
"""Parallel layouts across two emulated hosts whose link is shaped: communication that costs what it
costs on a cluster (scripts/cluster.py's network namespaces on a bridge; needs root).

Each configuration is torchrun on host0 and host1, one process a host, one thread a process
(OMP_NUM_THREADS=1, --threads_per_device 1), so a host is one CPU core and every byte between the
ranks crosses the host's link. gpt2-mini (--fit_vocab), global batch --batch-size x
--model-max-length tokens:
  data            D = 2, --grad_sync bucketed (--bucket-cap-mb, overlapped with backward)
  data_naive      D = 2, --grad_sync naive (per parameter, after backward)
  pipeline_1f1b   P = 2, --pipeline_schedule 1f1b --n_chunk M
  pipeline_zb1p   P = 2, --pipeline_schedule zb1p --n_chunk M
  tensor          T = 2 (Megatron's column/row split, the head split over the vocabulary)
  context         C = 2 (ring attention over zigzag chunks)
  zero3           ZeRO-3 on D = 2
at each link rate (--rates: unshaped, then 1000, 200 and 40 Mbit/s each way), and at the rate
that gives this core H100 + 400 Gb/s InfiniBand's compute-to-bandwidth ratio (--h100-layouts).
Rounds take turns: in each round the link is shaped once per rate and every layout runs at it,
so a slow spell of this shared machine falls on all of them; figures are medians over rounds.

A run's tokens/s is the global batch's tokens over its step time, the median of the steps after
--warmup-steps read from metrics.jsonl (SPEC §7.2: the last stage's first process writes it).
Bytes per step are counted on the link: the bridge-side counters of each host's veth, read
before and after every run, less those of a 1-step run of the same layout (start-up, rendezvous,
the initial broadcast and the final checkpoint cancel), over the steps between; they are compared
with each layout's formula. Before the rounds, one process alone on host0 (world size 1, half the
batch: a D = 2 rank's work) gives this core's achieved FLOP/s, and from it the H100 + IB rate.

The model: a step takes t(r) = t_unshaped + bytes / r (dotted in the figure). The pipeline overtakes
data parallelism below r_x = (bytes_D - bytes_P) / (b t_1), t_1 the one process's step and b the
schedule's bubble ((K-1)/M for 1F1B, a third of it for ZB-H1); the same from the unshaped runs'
step times, r_x = (bytes_D - bytes_P) / (t_P - t_D), and fitted over all rates are given beside
it, and the measured crossover interpolates t_D - t_P linearly in 1/r between the rates measured.

Writes WORKDIR/cluster_layouts/*.log, OUT_DIR/cluster_layouts.json and OUT_DIR/cluster_layouts.png
(tokens/s against link rate), and prints the table. On this machine a "device" is one CPU core.
"""
from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import re
import shutil
import statistics
import subprocess
import sys
import time
from typing import Dict, List, Optional, Sequence

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_common import BenchmarkError, cpu_model_name  # noqa: E402
from precision_memory_bench import flops_per_token  # noqa: E402

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FP32 = 4
UNSHAPED = "unshaped"
H100_RATE = "h100_ib"                  # the rate label of the H100 + InfiniBand point
H100_DENSE_BF16_FLOPS = 989e12         # H100 SXM, dense bf16 tensor-core peak
INFINIBAND_BYTES_PER_S = 400e9 / 8     # one 400 Gb/s NDR port per GPU
MASTER_PORT = 29500                    # each host is a fresh namespace: any port is free there


class Layout:
    """One configuration: its flags, its sizes (D, C, T, P) and how to label it."""

    def __init__(self, key: str, label: str, flags: Sequence[str], data=1, context=1, tensor=1, pipeline=1):
        self.key, self.label, self.flags = key, label, list(flags)
        self.data, self.context, self.tensor, self.pipeline = data, context, tensor, pipeline

    def reporting_rank(self) -> int:
        """Who writes metrics.jsonl (SPEC §7.2-7.3): the last stage's first process,
        rank = ((p·D + d)·C + c)·T + t with p = P - 1 and d = c = t = 0."""
        return (self.pipeline - 1) * self.data * self.context * self.tensor


LAYOUTS = {layout.key: layout for layout in [
    Layout("data", "D=2 bucketed", ["--grad_sync", "bucketed"], data=2),
    Layout("data_naive", "D=2 naive", ["--grad_sync", "naive"], data=2),
    Layout("pipeline_1f1b", "P=2 1F1B", ["--pipeline_parallel_size", "2", "--pipeline_schedule", "1f1b"], pipeline=2),
    Layout("pipeline_zb1p", "P=2 zb1p", ["--pipeline_parallel_size", "2", "--pipeline_schedule", "zb1p"], pipeline=2),
    Layout("tensor", "T=2", ["--tensor_parallel_size", "2"], tensor=2),
    Layout("context", "C=2", ["--context_parallel_size", "2"], context=2),
    Layout("zero3", "ZeRO-3 D=2", ["--zero_stage", "3"], data=2),
]}
DATA, PIPELINES = "data", ("pipeline_1f1b", "pipeline_zb1p")


# ----- What each layout moves: the formulas ------------------------------------------------------

def n_parameters(n_layer: int, n_embd: int, vocab: int, n_positions: int) -> int:
    """GPT-2's parameters, the head tied to wte: per block 12 C^2 + 13 C, embeddings V C + P C,
    ln_f 2 C."""
    return n_layer * (12 * n_embd ** 2 + 13 * n_embd) + (vocab + n_positions) * n_embd + 2 * n_embd


def formula_bytes(key: str, shape: dict) -> dict:
    """Bytes one rank sends per optimizer step in layout `key` (fp32), by formula, with the formula.
    shape: n_params, n_layer, n_embd, vocab, batch (global), tokens (per example). A ring
    all-reduce over g ranks sends 2 (g-1)/g of the tensor from each; an all-gather or a
    reduce-scatter (g-1)/g."""
    N, L, H, V = shape["n_params"], shape["n_layer"], shape["n_embd"], shape["vocab"]
    B, S = shape["batch"], shape["tokens"]
    layout = LAYOUTS[key]
    activation = B * S * H * FP32                  # one [B, S, H] fp32 tensor of the whole batch
    if key in ("data", "data_naive"):
        D = layout.data
        return {"bytes": 2 * (D - 1) / D * FP32 * N,
                "formula": "2(D-1)/D x 4 N: the ring all-reduce of the gradients"}
    if key == "zero3":
        D = layout.data
        return {"bytes": 3 * (D - 1) / D * FP32 * N,
                "formula": "3 (D-1)/D x 4 N: all-gather of the parameters in forward and again in backward, "
                           "reduce-scatter of the gradients"}
    if key in PIPELINES:
        return {"bytes": activation + FP32 * V * H,
                "formula": "4 B S H + 4 V H: each stage sends the activations (stage 0) or their gradients "
                           "(stage 1) of all M micro-batches, and the tied wte's gradient is all-reduced "
                           "between the first and last stage"}
    if key == "tensor":
        T = layout.tensor
        return {"bytes": 2 * (T - 1) / T * ((4 * L + 2) * activation + 3 * B * S * FP32),
                "formula": "2(T-1)/T x ((4 L + 2) x 4 B S H + 3 x 4 B S): per block 2 all-reduces forward "
                           "(after the row-parallel c_proj) and 2 backward (before the column-parallel "
                           "c_attn, c_fc), the vocabulary-parallel embedding's forward and the split head's "
                           "input gradient, and the loss's max, sum and label logit"}
    if key == "context":
        C, D = layout.context, layout.data
        kv_exchange = 2 * B * (S // C) * H * FP32   # K and V of this rank's S/C positions
        return {"bytes": L * (2 * (C - 1) + C) * kv_exchange + 2 * (D * C - 1) / (D * C) * FP32 * N,
                "formula": "L (2(C-1) + C) x 8 B (S/C) H + 2(DC-1)/(DC) x 4 N: ring attention passes K, V "
                           "C-1 times forward and again backward, and dK, dV C times; the gradients are "
                           "all-reduced over the D C ranks"}
    raise ValueError(f"no formula for layout {key!r}")


# ----- Reading a run -----------------------------------------------------------------------------

def step_times(metrics_text: str, steps: int, warmup: int, path: str) -> List[float]:
    """The step_time of each optimizer step after the first `warmup`, from metrics.jsonl's train
    lines. Raises BenchmarkError naming the file when steps are missing or malformed."""
    times: Dict[int, float] = {}
    for lineno, line in enumerate(metrics_text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise BenchmarkError(f"{path}:{lineno}: not JSON ({e})") from None
        if record.get("kind") != "train":
            continue
        value = record.get("step_time")
        if not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
            raise BenchmarkError(f"{path}:{lineno}: step_time {value!r} is not a positive number")
        times[int(record["step"])] = float(value)
    if sorted(times) != list(range(1, steps + 1)):
        raise BenchmarkError(f"{path}: train steps {sorted(times)}, expected 1..{steps} (did the run fail? "
                             f"see the .log next to its folder)")
    measured = [times[s] for s in range(warmup + 1, steps + 1)]
    if not measured:
        raise BenchmarkError(f"{path}: {steps} step(s) leave none after dropping {warmup} warm-up step(s)")
    return measured


def model_of(config_text: str, path: str) -> dict:
    """n_layer, n_embd, n_head, vocab and n_positions from a run's Hugging Face config.json."""
    try:
        config = json.loads(config_text)
        return {"n_layer": int(config["n_layer"]), "n_embd": int(config["n_embd"]), "n_head": int(config["n_head"]),
                "vocab": int(config["vocab_size"]), "n_positions": int(config["n_positions"])}
    except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
        raise BenchmarkError(f"{path}: no GPT-2 shape in it ({e!r})") from None


PARAMETERS_RE = re.compile(r"model=(\S+) \((\d+) parameters\) vocab=(\d+)")


def printed_parameters(text: str, path: str) -> int:
    m = PARAMETERS_RE.search(text)
    if not m:
        raise BenchmarkError(f"{path}: no 'model=NAME (N parameters) vocab=V' line in the run's output")
    return int(m.group(2))


def bytes_per_step(run_sent: float, short_sent: float, run_steps: int, short_steps: int) -> float:
    """Bytes a host sent per step: a run less a shorter run of the same layout, over the steps
    between (start-up, rendezvous, the initial broadcast and the final checkpoint cancel)."""
    if run_steps <= short_steps:
        raise ValueError(f"the run's {run_steps} steps must exceed the short run's {short_steps}")
    return (run_sent - short_sent) / (run_steps - short_steps)


# ----- The model of time against rate -------------------------------------------------------------

def rate_bytes_per_s(rate) -> float:
    """A rate label (Mbit/s each way, or "unshaped": no limit) in bytes/s."""
    return math.inf if rate == UNSHAPED else float(rate) * 1e6 / 8


def predicted_step_seconds(compute_seconds: float, step_bytes: float, rate) -> float:
    """t(r) = t_compute + bytes / r: the step as measured on the unshaped link, plus every byte a
    host sends through a link of rate r, none of it hidden behind compute."""
    return compute_seconds + step_bytes / rate_bytes_per_s(rate)


def crossover_predicted(data_compute: float, data_bytes: float, pipe_compute: float, pipe_bytes: float) -> dict:
    """Where t_D(r) = t_P(r): r_x = (bytes_D - bytes_P) / (t_P - t_D), unshaped step times t.
    Below r_x the pipeline is faster."""
    formula = "r_x = (bytes_D - bytes_P) / (t_P,unshaped - t_D,unshaped)"
    if pipe_compute <= data_compute:
        why = "the pipeline is as fast or faster on the unshaped link" if pipe_bytes <= data_bytes else \
            "the pipeline is faster unshaped but moves more bytes: data parallelism never overtakes it"
        return {"mbit": None, "formula": formula, "why": why}
    if pipe_bytes >= data_bytes:
        return {"mbit": None, "formula": formula,
                "why": "the pipeline moves as many bytes or more: it never overtakes data parallelism"}
    rate = (data_bytes - pipe_bytes) / (pipe_compute - data_compute)
    return {"mbit": rate * 8 / 1e6, "formula": formula}


def schedule_bubble(key: str, n_chunk: int, stages: int = 2) -> float:
    """The time a pipeline's schedule adds to one device's work, as a fraction of it, with F, B and W
    one unit each (docs/pipeline.md): 1F1B (K-1)/M, ZB-H1 (K-1)/(3M)."""
    return (stages - 1) / (3 * n_chunk if key == "pipeline_zb1p" else n_chunk)


def crossover_closed_form(single_seconds: float, data_bytes: float, pipe_bytes: float, bubble: float) -> dict:
    """The crossover from one core's compute alone: t_D = t_1 + bytes_D / r and
    t_P = (1 + bubble) t_1 + bytes_P / r, t_1 one core's step on half the batch through the whole
    model (= one stage on the whole batch), so r_x = (bytes_D - bytes_P) / (bubble x t_1)."""
    return {"mbit": (data_bytes - pipe_bytes) / (bubble * single_seconds) * 8 / 1e6 if data_bytes > pipe_bytes else None,
            "formula": "r_x = (bytes_D - bytes_P) / (b t_1), b = (K-1)/M for 1F1B, (K-1)/(3M) for ZB-H1, t_1 = one "
                       "core's step on half the batch",
            "bubble": bubble, "t_1_seconds": single_seconds}


def crossover_measured(data_seconds: Dict[str, float], pipe_seconds: Dict[str, float]) -> dict:
    """The rate at which the pipeline's measured step time drops below data parallelism's, from the
    rates both were measured at: linear interpolation of t_D - t_P in 1/r (the model's variable;
    unshaped is 1/r = 0) between the fastest link where the pipeline is ahead and the next faster."""
    rates = sorted((r for r in data_seconds if r in pipe_seconds), key=lambda r: 1 / rate_bytes_per_s(r))
    points = [(1 / rate_bytes_per_s(r), data_seconds[r] - pipe_seconds[r], r) for r in rates]
    if not points:
        return {"mbit": None, "why": "no rate where both were measured"}
    if points[0][1] > 0:
        return {"mbit": None, "bracket": [points[0][2], None],
                "why": f"the pipeline is ahead already at the fastest link measured ({points[0][2]})"}
    for (x0, d0, r0), (x1, d1, r1) in zip(points, points[1:]):
        if d0 <= 0 < d1:
            x = x0 + (x1 - x0) * (-d0) / (d1 - d0)
            return {"mbit": 8 / x / 1e6 if x > 0 else None, "bracket": [r0, r1]}
    return {"mbit": None, "bracket": [None, points[-1][2]],
            "why": f"data parallelism is ahead down to the slowest link measured ({points[-1][2]})"}


def fit_rate_model(seconds_by_rate: Dict[str, float]) -> Optional[dict]:
    """Least squares of t = a + b / r over the rates measured (unshaped: 1/r = 0): a the compute,
    b the bytes whose sending is exposed (not hidden behind compute)."""
    points = [(1 / rate_bytes_per_s(r), t) for r, t in seconds_by_rate.items()]
    if len(points) < 2 or len({x for x, _ in points}) < 2:
        return None
    mx = sum(x for x, _ in points) / len(points)
    mt = sum(t for _, t in points) / len(points)
    b = sum((x - mx) * (t - mt) for x, t in points) / sum((x - mx) ** 2 for x, _ in points)
    return {"compute_seconds": mt - b * mx, "exposed_bytes": b}


def h100_equivalent_mbit(core_flops: float, h100_flops: float = H100_DENSE_BF16_FLOPS,
                         link_bytes_per_s: float = INFINIBAND_BYTES_PER_S) -> float:
    """The link rate that gives this core the H100 + InfiniBand compute-to-bandwidth ratio:
    r* = F_core x B_IB / F_H100, in Mbit/s."""
    return core_flops * link_bytes_per_s / h100_flops * 8 / 1e6


# ----- Summary, table, figure ---------------------------------------------------------------------

def rate_sort_key(rate) -> float:
    return rate_bytes_per_s(rate)


def median_or_none(values: Sequence[Optional[float]]) -> Optional[float]:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def summarise_layout(key: str, runs: List[dict], short: Optional[dict], shape: dict, steps: int,
                     h100_mbit: float) -> dict:
    """One layout's figures: tokens/s and step time per rate (per round and median), bytes per step
    counted (each host, the unshaped runs less the short run) against the formula, the model's
    prediction at each rate, how much of bytes / r each rate exposed, and the fit over all rates.
    runs: this layout's {"rate", "round", "tokens_per_sec", "step_seconds", "sent_bytes": [host0,
    host1]} (tokens_per_sec None where the run failed); short: {"steps", "sent_bytes"} or None."""
    def line_rate(rate):
        return rate_bytes_per_s(h100_mbit if rate == H100_RATE else rate)

    rates = sorted({r["rate"] for r in runs}, key=line_rate)
    tokens = {rate: [r["tokens_per_sec"] for r in runs if r["rate"] == rate] for rate in rates}
    seconds = {rate: median_or_none([r["step_seconds"] for r in runs if r["rate"] == rate]) for rate in rates}
    seconds = {rate: t for rate, t in seconds.items() if t is not None}
    formula = formula_bytes(key, shape)
    counted = None
    unshaped = [r for r in runs if r["rate"] == UNSHAPED and r["tokens_per_sec"] is not None]
    if short and unshaped:
        per_host = [bytes_per_step(median_or_none([r["sent_bytes"][h] for r in unshaped]), short["sent_bytes"][h],
                                   steps, short["steps"]) for h in range(len(short["sent_bytes"]))]
        counted = {"per_host": per_host, "max": max(per_host), "over_formula": max(per_host) / formula["bytes"]}
    compute = seconds.get(UNSHAPED)
    step_bytes = counted["max"] if counted else formula["bytes"]
    predicted, exposure = {}, {}
    if compute is not None:
        for rate in rates + ([H100_RATE] if H100_RATE not in rates else []):
            predicted[rate] = shape["global_tokens"] / (compute + step_bytes / line_rate(rate))
        exposure = {rate: (t - compute) / (step_bytes / line_rate(rate)) for rate, t in seconds.items()
                    if rate != UNSHAPED}
    fit = fit_rate_model(_by_rate_value(seconds, h100_mbit))
    if fit is not None:
        fit["exposed_over_counted"] = fit["exposed_bytes"] / step_bytes
    layout = LAYOUTS[key]
    return {
        "label": layout.label, "flags": layout.flags,
        "sizes": {"data": layout.data, "context": layout.context, "tensor": layout.tensor, "pipeline": layout.pipeline},
        "tokens_per_sec": {rate: {"per_round": values, "median": median_or_none(values)}
                           for rate, values in tokens.items()},
        "step_seconds": seconds,
        "bytes_per_step": {"counted": counted, "formula": formula["bytes"], "formula_text": formula["formula"]},
        "predicted_tokens_per_sec": predicted,
        "exposed_over_bytes_at_rate": exposure,
        "fit": fit,
    }


def summarise_crossover(pipe: str, d: dict, p: dict, h100_mbit: float, single_seconds: float, n_chunk: int) -> dict:
    """Where pipeline `pipe` (summary p) overtakes data parallelism (summary d): measured, by the
    closed form (counted bytes, and formula bytes), from the unshaped runs, and fitted."""
    d_counted, p_counted = d["bytes_per_step"]["counted"], p["bytes_per_step"]["counted"]
    d_bytes = d_counted["max"] if d_counted else d["bytes_per_step"]["formula"]
    p_bytes = p_counted["max"] if p_counted else p["bytes_per_step"]["formula"]
    bubble = schedule_bubble(pipe, n_chunk)
    entry = {"between": [DATA, pipe],
             "measured": crossover_measured(_by_rate_value(d["step_seconds"], h100_mbit),
                                            _by_rate_value(p["step_seconds"], h100_mbit)),
             "predicted": dict(crossover_closed_form(single_seconds, d_bytes, p_bytes, bubble),
                               bytes="counted" if d_counted and p_counted else "formula"),
             "predicted_from_formula_bytes": dict(crossover_closed_form(
                 single_seconds, d["bytes_per_step"]["formula"], p["bytes_per_step"]["formula"], bubble),
                 bytes="formula")}
    if UNSHAPED in d["step_seconds"] and UNSHAPED in p["step_seconds"]:
        entry["predicted_from_unshaped_runs"] = crossover_predicted(
            d["step_seconds"][UNSHAPED], d_bytes, p["step_seconds"][UNSHAPED], p_bytes)
    if d["fit"] and p["fit"]:
        entry["fit_over_all_rates"] = dict(
            crossover_predicted(d["fit"]["compute_seconds"], d["fit"]["exposed_bytes"], p["fit"]["compute_seconds"],
                                p["fit"]["exposed_bytes"]),
            formula="the same, with t and bytes fitted to t = a + b/r over all rates")
    return entry


def summarise(runs: List[dict], short_runs: Dict[str, dict], shape: dict, steps: int, h100_mbit: float,
              layouts: Sequence[str], single_seconds: float, n_chunk: int) -> dict:
    """Every layout's figures, and the crossovers of each pipeline with data parallelism.
    single_seconds: one process's step on half the batch (the closed form's t_1)."""
    out = {key: summarise_layout(key, [r for r in runs if r["layout"] == key], short_runs.get(key), shape, steps,
                                 h100_mbit) for key in layouts}
    crossovers = {pipe: summarise_crossover(pipe, out[DATA], out[pipe], h100_mbit, single_seconds, n_chunk)
                  for pipe in PIPELINES if DATA in out and pipe in out}
    return {"layouts": out, "crossover": crossovers}


def _by_rate_value(seconds: Dict[str, float], h100_mbit: float) -> Dict[object, float]:
    """The H100 point's label replaced by its rate, so that it sorts among the others."""
    return {(h100_mbit if r == H100_RATE else r): t for r, t in seconds.items()}


def rate_label(rate, h100_mbit: Optional[float] = None) -> str:
    if rate == UNSHAPED:
        return "unshaped"
    if rate == H100_RATE:
        return f"H100+IB ({h100_mbit:.3g})" if h100_mbit else "H100+IB"
    return f"{float(rate):g} Mbit/s"


def format_mbit(value: Optional[float]) -> str:
    if value is None:
        return "none"
    return f"{value:,.0f} Mbit/s" if value >= 100 else f"{value:.3g} Mbit/s"


def format_table(result: dict) -> str:
    """The printed table: tokens/s per layout per rate (medians), bytes per step counted against
    the formula; the crossovers and the H100 + IB rate below it."""
    h100 = result["h100_infiniband"]["rate_mbit"]
    layouts = result["layouts"]
    rates = sorted({rate for entry in layouts.values() for rate in entry["tokens_per_sec"]},
                   key=lambda r: rate_sort_key(h100 if r == H100_RATE else r), reverse=True)
    headers = ["layout"] + [rate_label(r, h100) for r in rates] + ["MB/step counted", "formula", "ratio"]
    rows = []
    for key, entry in layouts.items():
        row = [entry["label"]]
        for rate in rates:
            cell = entry["tokens_per_sec"].get(rate, {}).get("median")
            row.append("-" if cell is None else f"{cell:,.0f}")
        counted = entry["bytes_per_step"]["counted"]
        row.append("-" if counted is None else "/".join(f"{b / 1e6:.2f}" for b in counted["per_host"]))
        row.append(f"{entry['bytes_per_step']['formula'] / 1e6:.2f}")
        row.append("-" if counted is None else f"{counted['over_formula']:.3f}")
        rows.append(row)
    widths = [max(len(str(r[i])) for r in [headers] + rows) for i in range(len(headers))]
    lines = ["  ".join(h.ljust(w) if i == 0 else h.rjust(w) for i, (h, w) in enumerate(zip(headers, widths)))]
    lines += ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths)))
              for row in rows]
    lines.append("tokens/s: global batch / step time, median over rounds; MB/step counted: what host0/host1 "
                 "sent per step; formula: per rank")
    for pipe, entry in result["crossover"].items():
        measured, predicted = entry["measured"], entry["predicted"]
        bracket = measured.get("bracket") or []
        text = (f"{layouts[pipe]['label']} overtakes {layouts[DATA]['label']} below: measured "
                f"{format_mbit(measured['mbit'])}")
        text += f" ({measured['why']})" if measured.get("why") else \
            f" (between {' and '.join(rate_label(r, h100) for r in bracket)})" if len(bracket) == 2 else ""
        text += (f"; predicted {format_mbit(predicted['mbit'])} ({predicted['bytes']} bytes, bubble "
                 f"{predicted['bubble']:.3g}, t_1 {predicted['t_1_seconds'] * 1e3:.0f} ms)")
        for key, what in (("predicted_from_unshaped_runs", "from the unshaped runs"),
                          ("fit_over_all_rates", "fitted over all rates")):
            if key in entry:
                text += f"; {format_mbit(entry[key]['mbit'])} {what}"
        lines.append(text)
    if result["crossover"]:
        first = next(iter(result["crossover"].values()))
        lines.append("  " + first["predicted"]["formula"])
        if "predicted_from_unshaped_runs" in first:
            lines.append("  from the unshaped runs: " + first["predicted_from_unshaped_runs"]["formula"])
    ib = result["h100_infiniband"]
    lines.append(f"H100 + 400 Gb/s InfiniBand on this core: r* = {ib['core_gflops']:.1f} GFLOP/s x 50 GB/s / "
                 f"989 TFLOP/s = {ib['rate_mbit']:.3g} Mbit/s")
    return "\n".join(lines)


def draw(result: dict, path: str) -> None:
    """Tokens/s against link rate (log-log), one line per layout with its model dotted, the H100 + IB
    rate and the pipeline's crossover (predicted and measured) as vertical lines."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter
    h100 = result["h100_infiniband"]["rate_mbit"]
    layouts = result["layouts"]
    shaped = [float(r) for entry in layouts.values() for r in entry["tokens_per_sec"] if r not in (UNSHAPED, H100_RATE)]
    unshaped_x = max(shaped + [h100, 1000.0]) * 20   # where the unshaped link is drawn, labelled as such
    low = min(shaped + [h100]) / 1.6

    def x_of(rate):
        return unshaped_x if rate == UNSHAPED else h100 if rate == H100_RATE else float(rate)

    fig, ax = plt.subplots(figsize=(10, 6))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    curve = [low * (unshaped_x / 1.5 / low) ** (i / 100) for i in range(101)]
    for i, (key, entry) in enumerate(layouts.items()):
        color = colors[i % len(colors)]
        points = sorted(((x_of(r), v["median"]) for r, v in entry["tokens_per_sec"].items() if v["median"]),
                        key=lambda p: p[0])
        if not points:
            continue
        # The unshaped link's rate is not known (a veth, some Gbit/s): its point stands apart, joined dashed.
        linked = [p for p in points if p[0] != unshaped_x]
        ax.plot([p[0] for p in linked], [p[1] for p in linked], "o-", color=color, label=entry["label"], lw=1.6)
        if linked and points[-1][0] == unshaped_x:
            ax.plot([linked[-1][0], unshaped_x], [linked[-1][1], points[-1][1]], "--", color=color, lw=0.8, alpha=0.5)
        if points[-1][0] == unshaped_x:
            ax.plot([unshaped_x], [points[-1][1]], "s", color=color)
        at_h100 = entry["tokens_per_sec"].get(H100_RATE, {}).get("median")
        if at_h100:
            ax.plot([h100], [at_h100], "*", color=color, ms=12, mec="black", mew=0.6)
        compute = entry["step_seconds"].get(UNSHAPED)
        counted = entry["bytes_per_step"]["counted"]
        if compute:
            step_bytes = counted["max"] if counted else entry["bytes_per_step"]["formula"]
            ax.plot(curve, [result["config"]["global_tokens"] / predicted_step_seconds(compute, step_bytes, r)
                            for r in curve], ":", color=color, lw=1, alpha=0.8)
    ax.axvline(h100, color="black", ls="--", lw=1)
    ax.text(h100, 0.02, f" H100 + 400 Gb/s IB\n equivalent: {h100:.3g} Mbit/s", transform=ax.get_xaxis_transform(),
            fontsize=8, va="bottom")
    notes = []
    for pipe, entry in result["crossover"].items():
        predicted = entry.get("predicted", {}).get("mbit")
        measured = entry["measured"].get("mbit")
        bracket = entry["measured"].get("bracket") or [None, None]
        said = f"below {format_mbit(measured)} measured" if measured else \
            "ahead at every rate measured" if bracket[0] == UNSHAPED and bracket[1] is None else "never, measured"
        notes.append(f"{layouts[pipe]['label']} overtakes {layouts[DATA]['label']}: {said}, "
                     f"predicted below {format_mbit(predicted)}")
        if pipe != PIPELINES[0]:
            continue
        for value, style, what, side in ((predicted, "-.", "predicted", "right"), (measured, "-", "measured", "left")):
            if value and low < value < unshaped_x:
                ax.axvline(value, color="grey", ls=style, lw=0.9)
                ax.text(value, 0.5, f"crossover {what}", transform=ax.get_xaxis_transform(), fontsize=7,
                        color="grey", rotation=90, va="center", ha=side)
    if notes:
        ax.text(0.3, 0.02, "\n".join(notes) + "\ndotted: t(r) = t_unshaped + bytes per step / r",
                transform=ax.transAxes, fontsize=7.5, va="bottom",
                bbox={"facecolor": "white", "edgecolor": "none", "alpha": 0.85})
    ax.set_xscale("log")
    ax.set_yscale("log")
    ticks = sorted({x_of(r) for entry in layouts.values() for r in entry["tokens_per_sec"]} - {h100})
    ax.set_xticks(ticks)
    ax.set_xticklabels(["unshaped" if t == unshaped_x else f"{t:g}" for t in ticks])
    ax.xaxis.set_minor_formatter(NullFormatter())
    ax.yaxis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0)))
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:,.0f}"))
    ax.yaxis.set_minor_formatter(NullFormatter())
    ax.set_xlim(low, unshaped_x * 1.6)
    ax.set_xlabel(f"link rate between the 2 hosts, Mbit/s each way (a host = a device = one core of "
                  f"{result['machine']['cpu']}, shared {result['machine']['cores']}-core machine)", fontsize=8)
    ax.set_ylabel("tokens/s (global batch / step time, median over rounds)")
    cfg = result["config"]
    ax.set_title(f"{cfg['model']}, batch {cfg['batch_size']} x {cfg['model_max_length']} tokens, 2 emulated hosts "
                 f"x 1 process x 1 thread, {cfg['rounds']} round(s)", fontsize=9)
    ax.grid(True, which="major", alpha=0.3)
    ax.legend(fontsize=8, loc="center right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ----- Running on the cluster ---------------------------------------------------------------------

def link_counters(host) -> Dict[str, int]:
    """What a host sent and received, from the bridge-side end of its veth (its rx is what the
    host sent)."""
    base = f"/sys/class/net/{host.bridge_port}/statistics/"
    with open(base + "rx_bytes") as f:
        sent = int(f.read())
    with open(base + "tx_bytes") as f:
        received = int(f.read())
    return {"sent": sent, "received": received}


def tcp_retransmits(host) -> Optional[int]:
    """The host's TCP segments retransmitted so far (its namespace's /proc/net/snmp)."""
    proc = host.run(["cat", "/proc/net/snmp"], timeout=10)
    lines = [line.split() for line in proc.stdout.splitlines() if line.startswith("Tcp:")]
    if len(lines) < 2 or "RetransSegs" not in lines[0]:
        return None
    return int(lines[1][lines[0].index("RetransSegs")])


def load_average() -> float:
    with open("/proc/loadavg") as f:
        return float(f.read().split()[0])


def base_flags(args, steps: int) -> List[str]:
    return ["--model", args.model, "--batch_size", str(args.batch_size), "--model_max_length",
            str(args.model_max_length), "--fit_vocab", "--benchmark_only", "--no_progress", "--n_epochs", "1",
            "--max_batches", str(steps), "--threads_per_device", "1"]


def layout_flags(args, key: str) -> List[str]:
    flags = list(LAYOUTS[key].flags)
    if key in PIPELINES:
        flags += ["--n_chunk", str(args.n_chunk)]
    if key == "data":
        flags += ["--bucket_cap_mb", f"{args.bucket_cap_mb:g}"]
    return flags


def slug(text: str) -> str:
    return "".join(c if c.isalnum() else "_" for c in text)


def drop_weights(work: str) -> None:
    """A run's checkpoints and model are not needed (74 runs would keep 1 GB): its metrics.jsonl,
    config.json and log stay."""
    shutil.rmtree(os.path.join(work, "checkpoints"), ignore_errors=True)
    for name in ("model.safetensors",):
        if os.path.exists(os.path.join(work, name)):
            os.remove(os.path.join(work, name))


class Bench:
    """One cluster of 2 hosts for the whole benchmark; runs a layout at the link's current rate."""

    def __init__(self, args, cluster):
        self.args, self.cluster = args, cluster
        self.program = os.path.join(args.build_dir, "run_data_parallel")
        self.torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
        self.env = dict(os.environ, OMP_NUM_THREADS="1")
        self.env.pop("GLOO_SOCKET_IFNAME", None)   # each rank finds the interface that routes to host0
        self.port = MASTER_PORT
        self.root = os.path.join(args.workdir, "cluster_layouts")
        os.makedirs(self.root, exist_ok=True)

    def shape(self, rate) -> None:
        for host in self.cluster.hosts:
            if rate == UNSHAPED:
                host.unshape()
            else:
                host.shape(float(rate))

    def run_layout(self, key: str, steps: int, name: str) -> dict:
        """torchrun on both hosts; the run's step times, bytes each host sent, retransmits."""
        args = self.args
        work = os.path.join(self.root, slug(name))
        shutil.rmtree(work, ignore_errors=True)
        self.port += 1
        master = self.cluster.hosts[0].address
        before = [link_counters(h) for h in self.cluster.hosts]
        retrans_before = [tcp_retransmits(h) for h in self.cluster.hosts]
        load = load_average()
        started = time.monotonic()
        commands, runs = [], []
        for host in self.cluster.hosts:
            command = [self.torchrun, "--nnodes", str(len(self.cluster.hosts)), "--nproc_per_node", "1",
                       "--node_rank", str(host.index), "--master_addr", master, "--master_port", str(self.port),
                       "--no-python", self.program, "--workdir", os.path.join(work, host.name)] + \
                base_flags(args, steps) + layout_flags(args, key)
            commands.append(command)
            runs.append(host.start(command, env=self.env, echo=False))
        from cluster import wait_all  # the hosts' runs: all ended, or the first failure's grace over
        codes = wait_all(runs, args.run_timeout, grace=20)
        wall = time.monotonic() - started
        if any(code is None for code in codes):
            for host in self.cluster.hosts:
                host.kill_all()
        for proc, output in runs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
            output.wait(timeout=10)
        after = [link_counters(h) for h in self.cluster.hosts]
        retrans_after = [tcp_retransmits(h) for h in self.cluster.hosts]
        log = work + ".log"
        with open(log, "w") as f:
            for host, command, (_, output), code in zip(self.cluster.hosts, commands, runs, codes):
                f.write(f"### {host!r}: exit {code}\n$ {' '.join(command)}\n{output.text()}\n")
        record = {"layout": key, "steps": steps, "wall_seconds": wall, "load_average_before": load, "log": log,
                  "sent_bytes": [a["sent"] - b["sent"] for a, b in zip(after, before)],
                  "received_bytes": [a["received"] - b["received"] for a, b in zip(after, before)],
                  "tcp_retransmits": [None if a is None or b is None else a - b
                                      for a, b in zip(retrans_after, retrans_before)]}
        if codes != [0] * len(codes):
            raise BenchmarkError(f"{name}: exit codes {codes} of host0..; see {log}")
        reporter = self.cluster.hosts[LAYOUTS[key].reporting_rank()]
        metrics = os.path.join(work, reporter.name, "metrics.jsonl")
        if not os.path.isfile(metrics):
            raise BenchmarkError(f"{name}: {metrics} is missing (rank {LAYOUTS[key].reporting_rank()} writes it); "
                                 f"see {log}")
        with open(metrics) as f:
            record["step_times"] = step_times(f.read(), steps, min(args.warmup_steps, steps - 1), metrics)
        record["step_seconds"] = statistics.median(record["step_times"])
        record["tokens_per_sec"] = args.batch_size * args.model_max_length / record["step_seconds"]
        for host in self.cluster.hosts:
            drop_weights(os.path.join(work, host.name))
        return record

    def run_single(self, steps: int) -> dict:
        """One process alone on host0, half the batch (a D = 2 rank's share): this core's compute."""
        args = self.args
        work = os.path.join(self.root, "single_process")
        shutil.rmtree(work, ignore_errors=True)
        flags = base_flags(args, steps)
        flags[flags.index("--batch_size") + 1] = str(args.batch_size // 2)
        command = [self.program, "--world_size", "1", "--workdir", work] + flags
        load = load_average()
        proc = self.cluster.hosts[0].run(command, timeout=args.run_timeout, env=self.env)
        log = work + ".log"
        with open(log, "w") as f:
            f.write(f"$ {' '.join(command)}\n{proc.stdout}\n--- stderr ---\n{proc.stderr}")
        if proc.returncode != 0:
            raise BenchmarkError(f"the single-process run exited {proc.returncode}; see {log}")
        with open(os.path.join(work, "metrics.jsonl")) as f:
            times = step_times(f.read(), steps, min(args.warmup_steps, steps - 1), os.path.join(work, "metrics.jsonl"))
        with open(os.path.join(work, "config.json")) as f:
            model = model_of(f.read(), os.path.join(work, "config.json"))
        drop_weights(work)
        seconds = statistics.median(times)
        return {"step_times": times, "step_seconds": seconds, "batch_size": args.batch_size // 2,
                "tokens_per_sec": args.batch_size // 2 * args.model_max_length / seconds, "model": model,
                "n_params_printed": printed_parameters(proc.stdout + proc.stderr, log),
                "load_average_before": load, "log": log}


def parse_rates(text: str) -> List[str]:
    rates = []
    for item in text.split(","):
        item = item.strip()
        if item == UNSHAPED:
            rates.append(UNSHAPED)
            continue
        try:
            value = float(item)
        except ValueError:
            raise SystemExit(f"--rates: {item!r} is neither 'unshaped' nor a rate in Mbit/s") from None
        if not value > 0:
            raise SystemExit(f"--rates: {item!r} must be above 0 Mbit/s")
        rates.append(f"{value:g}")
    if UNSHAPED not in rates:
        raise SystemExit("--rates must include 'unshaped': each layout's compute and its bytes per step come from it")
    return sorted(dict.fromkeys(rates), key=rate_sort_key, reverse=True)


def parse_layouts(text: str, what: str) -> List[str]:
    if text.strip() in ("", "none"):
        return []
    keys = [k.strip() for k in text.split(",")]
    unknown = [k for k in keys if k not in LAYOUTS]
    if unknown:
        raise SystemExit(f"{what}: unknown layout(s) {unknown}; known: {', '.join(LAYOUTS)}")
    return list(dict.fromkeys(keys))


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--build-dir", default=os.path.join(REPO_ROOT, "build"))
    p.add_argument("--workdir", default="./workdir")
    p.add_argument("--out-dir", default=os.path.join(REPO_ROOT, "submit_figures"))
    p.add_argument("--rates", default="unshaped,1000,200,40", help="link rates, Mbit/s each way (default: %(default)s)")
    p.add_argument("--layouts", default=",".join(LAYOUTS), help="default: %(default)s")
    p.add_argument("--h100-layouts", default="data,pipeline_1f1b",
                   help="layouts also run at the H100 + IB-equivalent rate ('none': not run; default: %(default)s)")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--steps", type=int, default=4, help="optimizer steps a run (default: %(default)s)")
    p.add_argument("--warmup-steps", type=int, default=1, help="steps dropped at a run's start (default: %(default)s)")
    p.add_argument("--model", default="gpt2-mini")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--model-max-length", type=int, default=64)
    p.add_argument("--n-chunk", type=int, default=4, help="micro-batches M of the pipelines (default: %(default)s)")
    p.add_argument("--bucket-cap-mb", type=float, default=4.0,
                   help="bucket size of D=2 bucketed; 4 MB is about one gpt2-mini block, so buckets overlap "
                        "backward (default: %(default)s)")
    p.add_argument("--run-timeout", type=float, default=600.0)
    p.add_argument("--fast", action="store_true", help="1 round of 3 steps (1 warm-up), to try it out")
    p.add_argument("--redraw", action="store_true",
                   help="run nothing: the JSON, figure and table again from WORKDIR/cluster_layouts/measured.json")
    args = p.parse_args(argv)
    if args.fast:
        args.rounds, args.steps = 1, 3
    args.rate_list = parse_rates(args.rates)
    args.layout_list = parse_layouts(args.layouts, "--layouts")
    args.h100_list = parse_layouts(args.h100_layouts, "--h100-layouts")
    if not args.layout_list:
        raise SystemExit("--layouts names no layout")
    if args.steps < 2 or args.warmup_steps >= args.steps:
        raise SystemExit(f"--steps {args.steps} must be at least 2 and above --warmup-steps {args.warmup_steps}")
    if args.rounds < 1:
        raise SystemExit(f"--rounds {args.rounds} must be at least 1")
    if args.batch_size % 4:
        raise SystemExit(f"--batch-size {args.batch_size} must be divisible by 4 (2 ranks, and half of it alone)")
    return args


def refusal(args, cluster_module) -> Optional[str]:
    """Why this benchmark cannot run here, or None."""
    reason = cluster_module.unavailable_reason()
    if reason:
        return f"no emulated hosts here: {reason}"
    program = os.path.join(args.build_dir, "run_data_parallel")
    if not os.access(program, os.X_OK):
        return f"{program} is not built (scripts/build.sh)"
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    if not os.access(torchrun, os.X_OK):
        return f"{torchrun} is missing: run with the project's .venv/bin/python (scripts/setup.sh)"
    return None


def measure(args, bench) -> dict:
    """The calibration (one process alone, each layout's short run), then the rounds."""
    log = lambda text: print(f"[cluster_layouts] {text}", file=sys.stderr, flush=True)  # noqa: E731
    bench.shape(UNSHAPED)
    single = bench.run_single(args.steps)
    model = single["model"]
    fpt = flops_per_token(model["n_layer"], model["n_embd"], model["vocab"], args.model_max_length)
    core_flops = single["tokens_per_sec"] * fpt
    h100 = h100_equivalent_mbit(core_flops)
    log(f"one process alone: {single['tokens_per_sec']:,.0f} tokens/s x {fpt / 1e6:.2f} MFLOP/token = "
        f"{core_flops / 1e9:.1f} GFLOP/s; the H100 + 400 Gb/s IB rate here: {h100:.3g} Mbit/s")
    short_runs, runs, singles, failures = {}, [], [], []
    for key in args.layout_list:
        try:
            short = bench.run_layout(key, 1 + args.warmup_steps, f"{key}_short")
            short_runs[key] = {"steps": short["steps"], "sent_bytes": short["sent_bytes"],
                               "received_bytes": short["received_bytes"], "wall_seconds": short["wall_seconds"]}
        except BenchmarkError as e:
            failures.append(str(e))
            log(f"FAILED {e}")
    rates = list(args.rate_list) + ([H100_RATE] if args.h100_list else [])
    for round_index in range(args.rounds):
        for rate in rates:
            rate_mbit = h100 if rate == H100_RATE else rate
            bench.shape(f"{rate_mbit:.4g}" if rate == H100_RATE else rate)
            keys = args.h100_list if rate == H100_RATE else args.layout_list
            if round_index % 2:
                keys = list(reversed(keys))    # turns alternate: neither end of a round is always first
            if rate == UNSHAPED and round_index > 0:
                singles.append(bench.run_single(args.steps))
            for key in keys:
                name = f"r{round_index}_{slug(str(rate))}_{key}"
                try:
                    record = bench.run_layout(key, args.steps, name)
                except BenchmarkError as e:
                    failures.append(str(e))
                    log(f"FAILED {e}")
                    record = {"layout": key, "tokens_per_sec": None, "step_seconds": None, "error": str(e)}
                record.update({"round": round_index, "rate": rate, "rate_mbit": None if rate == UNSHAPED else
                               float(rate_mbit)})
                runs.append(record)
                if record["tokens_per_sec"] is not None:
                    log(f"round {round_index} {rate_label(rate, h100)} {LAYOUTS[key].label}: "
                        f"{record['tokens_per_sec']:,.0f} tokens/s, sent {record['sent_bytes'][0] / 1e6:.1f}/"
                        f"{record['sent_bytes'][1] / 1e6:.1f} MB, {record['wall_seconds']:.1f} s")
    bench.shape(UNSHAPED)
    return {"single": single, "singles": singles, "fpt": fpt, "core_flops": core_flops, "h100": h100,
            "short_runs": short_runs, "runs": runs, "failures": failures}


def run_config(args) -> dict:
    """What the result's "config" records of the flags."""
    return {"model": args.model, "batch_size": args.batch_size, "model_max_length": args.model_max_length,
            "global_tokens": args.batch_size * args.model_max_length, "n_chunk": args.n_chunk,
            "bucket_cap_mb": args.bucket_cap_mb, "steps": args.steps, "warmup_steps": args.warmup_steps,
            "rounds": args.rounds, "rates_mbit": args.rate_list, "layouts": args.layout_list,
            "h100_layouts": args.h100_list, "hosts": 2, "processes_per_host": 1, "threads_per_process": 1,
            "shaping": "tc tbf on both ends of each host's veth: each direction limited to the rate "
                       "(scripts/cluster.py)"}


def build_result(config: dict, measured: dict, machine: dict) -> dict:
    """The JSON written: the config, the machine, the model, the one-process calibration, the
    H100 + IB rate, each layout's figures, the crossovers, and every run."""
    single, h100 = measured["single"], measured["h100"]
    model = single["model"]
    shape = {"n_params": n_parameters(model["n_layer"], model["n_embd"], model["vocab"], model["n_positions"]),
             "n_layer": model["n_layer"], "n_embd": model["n_embd"], "vocab": model["vocab"],
             "batch": config["batch_size"], "tokens": config["model_max_length"],
             "global_tokens": config["global_tokens"]}
    if shape["n_params"] != single["n_params_printed"]:
        raise BenchmarkError(f"{single['log']}: the program counts {single['n_params_printed']} parameters, "
                             f"the formula {shape['n_params']} from its config.json")
    summary = summarise(measured["runs"], measured["short_runs"], shape, config["steps"], h100, config["layouts"],
                        single["step_seconds"], config["n_chunk"])
    all_singles = [single] + measured["singles"]
    core_flops_rounds = [s["tokens_per_sec"] * measured["fpt"] for s in all_singles]
    layouts = summary["layouts"]
    return {
        "config": config,
        "machine": machine,
        "model": {**model, "n_params": shape["n_params"], "flops_per_token": measured["fpt"],
                  "flops_per_token_formula": "6 (12 L C^2 + V C) + 12 L C T (PaLM's, as precision_memory_bench.py)"},
        "single_process": {"tokens_per_sec": [s["tokens_per_sec"] for s in all_singles],
                           "step_seconds": [s["step_seconds"] for s in all_singles],
                           "batch_size": single["batch_size"],
                           "achieved_gflops": [f / 1e9 for f in core_flops_rounds],
                           "what": "one process alone on host0, half the global batch (a D=2 rank's share): "
                                   "the first before the rounds, then one in each later round's unshaped turn"},
        "h100_infiniband": {
            "rate_mbit": h100, "core_gflops": measured["core_flops"] / 1e9,
            "h100_tflops": H100_DENSE_BF16_FLOPS / 1e12, "infiniband_gbit": INFINIBAND_BYTES_PER_S * 8 / 1e9,
            "formula": "r* = F_core x 50 GB/s / 989 TFLOP/s: this core's achieved FLOP/s (one process alone, "
                       "before the rounds) against an H100 SXM's dense bf16 peak and a 400 Gb/s port",
            "rate_mbit_from_all_single_runs": h100_equivalent_mbit(statistics.median(core_flops_rounds)),
            "rate_mbit_if_h100_at_40pct_mfu": h100 / 0.4,
            "note": "the H100 side is its peak, this core's its achieved rate: an H100 training at 40% MFU "
                    "matches a link 2.5x faster here",
            "measured_tokens_per_sec": {k: layouts[k]["tokens_per_sec"].get(H100_RATE, {}).get("median")
                                        for k in config["h100_layouts"] if k in layouts},
            "predicted_tokens_per_sec": {k: e["predicted_tokens_per_sec"].get(H100_RATE)
                                         for k, e in layouts.items()}},
        **summary,
        "short_runs": measured["short_runs"],
        "runs": measured["runs"],
        "failures": measured["failures"],
    }


def main(argv=None, cluster_module=None) -> int:
    started = time.monotonic()
    args = parse_args(argv)
    raw_path = os.path.join(args.workdir, "cluster_layouts", "measured.json")
    if args.redraw:
        if not os.path.isfile(raw_path):
            raise SystemExit(f"cluster_layouts_bench: --redraw: {raw_path} is missing (run without --redraw first)")
        with open(raw_path) as f:
            raw = json.load(f)
    else:
        if cluster_module is None:
            import cluster as cluster_module
        why = refusal(args, cluster_module)
        if why:
            raise SystemExit(f"cluster_layouts_bench: refused: {why}")
        load_start = load_average()
        with cluster_module.Cluster(2, log=None) as c:
            measured = measure(args, Bench(args, c))
        raw = {"config": run_config(args), "measured": measured,
               "machine": {"cpu": cpu_model_name(), "cores": os.cpu_count(),
                           "device": "a host is one network namespace running one process of one thread: one "
                                     "CPU core of this shared machine",
                           "load_average_start": load_start, "load_average_end": load_average()},
               "command": " ".join([os.path.relpath(sys.executable)] + sys.argv),
               "date": datetime.datetime.now().isoformat(timespec="seconds"),
               "wall_seconds": time.monotonic() - started}
        os.makedirs(os.path.dirname(raw_path), exist_ok=True)
        with open(raw_path, "w") as f:
            json.dump(raw, f, indent=2)
    result = build_result(raw["config"], raw["measured"], raw["machine"])
    result.update({k: raw[k] for k in ("command", "date", "wall_seconds")})
    os.makedirs(args.out_dir, exist_ok=True)
    with open(os.path.join(args.out_dir, "cluster_layouts.json"), "w") as f:
        json.dump(result, f, indent=2)
    draw(result, os.path.join(args.out_dir, "cluster_layouts.png"))
    print(format_table(result))
    machine = result["machine"]
    print(f"wall time {result['wall_seconds']:.0f} s; load average {machine['load_average_start']:.2f} at the "
          f"start, {machine['load_average_end']:.2f} at the end")
    if result["failures"]:
        print(f"{len(result['failures'])} run(s) failed:\n  " + "\n  ".join(result["failures"]), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
