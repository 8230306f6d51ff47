#!/usr/bin/env python3
"""Renders a Chrome trace written by `--trace FILE` as a Gantt chart (one row per device or rank,
time in ms across, forward and backward in their own colours, micro-batches labelled, idle time
shaded) and reports the measured bubble fraction next to GPipe's (K-1)/(M+K-1).

    .venv/bin/python scripts/plot_trace.py TRACE.json OUT.png [--step middle|first|last|N|all]

The window is one "step" slice (the trainer's track "main", or a data-parallel rank's track);
the bubble fraction is the idle time of the device rows within that window over rows x window.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_common import gpipe_bubble  # noqa: E402

COLOURS = {"forward": "#1f77b4", "backward": "#ff7f0e", "gradient all-reduce": "#2ca02c",
           "step": "#bbbbbb"}
OTHER_COLOUR = "#9467bd"
IDLE_COLOUR = "#f2dede"
# Slices that are the container of a step rather than work on a device.
WINDOW_NAMES = ("step",)


class TraceError(ValueError):
    """The trace file is missing, not a Chrome trace, or lacks what the chart needs."""


@dataclass
class Slice:
    name: str
    track: str
    start_ms: float
    end_ms: float
    args: Dict[str, object] = field(default_factory=dict)


@dataclass
class TimelineReport:
    window: Tuple[float, float]  # ms, absolute in the trace
    device_tracks: List[str]
    busy_ms: Dict[str, float]
    bubble_fraction: float  # measured idle / (rows x window)
    k: int  # devices (partitions)
    m: int  # micro-batches seen in the window
    gpipe_bubble: Optional[float]  # (K-1)/(M+K-1), None when no micro-batches are traced
    # Idle fraction within the forward phase and the backward phase only (first to last task of
    # each), i.e. without the serial work between and after them; None without such tasks.
    phase_bubble_fraction: Optional[float] = None

    def text(self) -> str:
        line = (f"bubble fraction: measured {self.bubble_fraction:.3f} of the "
                f"{self.window[1] - self.window[0]:.1f} ms step on {self.k} device(s)")
        if self.phase_bubble_fraction is not None:
            line += f" ({self.phase_bubble_fraction:.3f} within the forward and backward phases)"
        if self.gpipe_bubble is not None:
            line += (f"; GPipe (K-1)/(M+K-1) = {self.gpipe_bubble:.3f} (K={self.k}, M={self.m})")
        return line


def load_trace(path: str) -> List[Slice]:
    """Complete ("X") events with their track names (from the thread_name metadata)."""
    if not os.path.isfile(path):
        raise TraceError(f"{path}: trace file not found")
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except json.JSONDecodeError as e:
        raise TraceError(f"{path}: not valid JSON ({e})") from e
    events = data.get("traceEvents") if isinstance(data, dict) else data
    if not isinstance(events, list):
        raise TraceError(f"{path}: no 'traceEvents' list (not a Chrome trace)")
    names: Dict[Tuple[object, object], str] = {}
    for e in events:
        if isinstance(e, dict) and e.get("ph") == "M" and e.get("name") == "thread_name":
            names[(e.get("pid"), e.get("tid"))] = str(e.get("args", {}).get("name"))
    slices = []
    for i, e in enumerate(events):
        if not isinstance(e, dict) or e.get("ph") != "X":
            continue
        try:
            ts, dur = float(e["ts"]), float(e["dur"])
        except (KeyError, TypeError, ValueError) as err:
            raise TraceError(f"{path}: event {i} ({e.get('name')!r}) lacks a numeric ts/dur") from err
        if dur < 0:
            raise TraceError(f"{path}: event {i} ({e.get('name')!r}) has negative duration {dur}")
        track = names.get((e.get("pid"), e.get("tid")), f"tid {e.get('tid')}")
        slices.append(Slice(str(e.get("name")), track, ts / 1000.0, (ts + dur) / 1000.0,
                            dict(e.get("args") or {})))
    if not slices:
        raise TraceError(f"{path}: the trace holds no slices")
    return slices


def merge_traces(paths: List[str]) -> List[Slice]:
    """Several traces (e.g. the .rank{r} files of a data-parallel run) on one chart. Each
    process's clock starts at its own tracer, so the rows are aligned at their first slice."""
    out = []
    for p in paths:
        slices = load_trace(p)
        t0 = min(s.start_ms for s in slices)
        out += [Slice(s.name, s.track, s.start_ms - t0, s.end_ms - t0, s.args) for s in slices]
    return out


def step_windows(slices: List[Slice]) -> List[Tuple[float, float]]:
    """The "step" slices of one track (the first that has them), in time order."""
    steps = [s for s in slices if s.name in WINDOW_NAMES]
    if not steps:
        return []
    track = steps[0].track
    return sorted((s.start_ms, s.end_ms) for s in steps if s.track == track)


def choose_window(slices: List[Slice], step: str) -> Tuple[float, float]:
    windows = step_windows(slices)
    if step == "all" or not windows:
        return (min(s.start_ms for s in slices), max(s.end_ms for s in slices))
    if step == "middle":
        return windows[len(windows) // 2]
    if step == "first":
        return windows[0]
    if step == "last":
        return windows[-1]
    try:
        index = int(step)
    except ValueError:
        raise TraceError(f"--step {step!r}: expected middle, first, last, all or a step number") from None
    if not 0 <= index < len(windows):
        raise TraceError(f"--step {index}: the trace has steps 0..{len(windows) - 1}")
    return windows[index]


def device_tracks(slices: List[Slice]) -> List[str]:
    """Rows that do device work: tracks with slices other than the step containers, in order of
    first appearance (cpu:0 before cpu:1, rank 0 before rank 1)."""
    order: List[str] = []
    for s in sorted(slices, key=lambda s: s.start_ms):
        if s.name not in WINDOW_NAMES and s.track not in order:
            order.append(s.track)
    return sorted(order, key=_natural_key)


def _natural_key(track: str):
    import re
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", track)]


def _union_length(intervals: List[Tuple[float, float]]) -> float:
    total, end = 0.0, None
    start = None
    for a, b in sorted(intervals):
        if end is None or a > end:
            if end is not None:
                total += end - start
            start, end = a, b
        else:
            end = max(end, b)
    if end is not None:
        total += end - start
    return total


def analyse(slices: List[Slice], window: Tuple[float, float]) -> TimelineReport:
    lo, hi = window
    if hi <= lo:
        raise TraceError(f"the chosen window [{lo}, {hi}] ms is empty")
    tracks = device_tracks(slices)
    if not tracks:
        raise TraceError("the trace has no device work (only step slices)")
    busy = {}
    micro_batches = set()
    for t in tracks:
        parts = [(max(s.start_ms, lo), min(s.end_ms, hi)) for s in slices
                 if s.track == t and s.name not in WINDOW_NAMES and s.end_ms > lo and s.start_ms < hi]
        busy[t] = _union_length(parts)
    for s in slices:
        if s.track in tracks and s.end_ms > lo and s.start_ms < hi and "micro_batch" in s.args:
            micro_batches.add(s.args["micro_batch"])
    span = hi - lo
    bubble = 1.0 - sum(busy.values()) / (len(tracks) * span)
    m = len(micro_batches)
    phase_busy, phase_span = 0.0, 0.0
    for name in ("forward", "backward"):
        tasks = [s for s in slices if s.name == name and s.track in tracks and s.start_ms >= lo
                 and s.end_ms <= hi]
        if not tasks:
            continue
        a, b = min(s.start_ms for s in tasks), max(s.end_ms for s in tasks)
        phase_span += b - a
        for t in tracks:
            phase_busy += _union_length([(s.start_ms, s.end_ms) for s in tasks if s.track == t])
    phase = 1.0 - phase_busy / (len(tracks) * phase_span) if phase_span > 0 else None
    return TimelineReport(window, tracks, busy, bubble, len(tracks), m,
                          gpipe_bubble(len(tracks), m) if m else None, phase)


def render(slices: List[Slice], report: TimelineReport, out_png: str, title: Optional[str] = None,
           subtitle: Optional[str] = None) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    lo, hi = report.window
    rows = list(report.device_tracks)
    window_slices = [s for s in slices if s.end_ms > lo and s.start_ms < hi]
    # The step container track (the trainer's "main") is drawn too, as context, below the devices.
    context_tracks = sorted({s.track for s in window_slices if s.track not in rows}, key=_natural_key)
    all_rows = rows + context_tracks
    fig_h = 1.2 + 0.75 * len(all_rows)
    fig, ax = plt.subplots(figsize=(12, max(3.2, fig_h)))
    span = hi - lo
    names_seen = []
    stages_of = {}
    for s_ in window_slices:
        if "stage" in s_.args:
            stages_of.setdefault(s_.track, set()).add(s_.args["stage"])
    several_stages = {t for t, st in stages_of.items() if len(st) > 1}
    for y, track in enumerate(all_rows):
        if track in rows:
            ax.barh(y, span, left=0, height=0.8, color=IDLE_COLOUR, edgecolor="#d9a0a0",
                    hatch="//", linewidth=0.5, zorder=1)
        for s in window_slices:
            if s.track != track:
                continue
            a, b = max(s.start_ms, lo) - lo, min(s.end_ms, hi) - lo
            colour = COLOURS.get(s.name, OTHER_COLOUR)
            context = track not in rows
            ax.barh(y, b - a, left=a, height=0.5 if context else 0.8, color=colour,
                    edgecolor="black", linewidth=0.6, alpha=0.6 if context else 1.0, zorder=2)
            if s.name not in names_seen:
                names_seen.append(s.name)
            label = None
            if "micro_batch" in s.args:
                label = f"{s.name[0].upper()}{s.args['micro_batch']}"
                if track in several_stages and "stage" in s.args:  # interleaved: which chunk
                    label += f".{s.args['stage']}"
            elif context:
                label = s.name
            if label and (b - a) > span * 0.025:
                ax.text((a + b) / 2, y, label, ha="center", va="center", fontsize=9,
                        color="white" if not context else "black", fontweight="bold", zorder=3)
    ax.set_yticks(range(len(all_rows)))
    ax.set_yticklabels(all_rows)
    ax.invert_yaxis()
    ax.set_xlim(0, span)
    ax.set_xlabel("time since the start of the step (ms); idle = no traced task on that device "
                  "(work outside the device rows, e.g. loss and optimizer on the trainer thread, "
                  "counts as idle)", fontsize=9)
    ax.set_ylabel("device / track")
    handles = [Patch(facecolor=COLOURS.get(n, OTHER_COLOUR), edgecolor="black",
                     label={"forward": "forward (F i: micro-batch i)",
                            "backward": "backward (B i: micro-batch i)",
                            "step": "training step (trainer thread)"}.get(n, n))
               for n in names_seen]
    handles.append(Patch(facecolor=IDLE_COLOUR, edgecolor="#d9a0a0", hatch="//",
                         label="idle (bubble) on a device"))
    ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, -0.18 if len(all_rows) < 4 else -0.12),
              ncol=min(4, len(handles)), frameon=False, fontsize=9)
    head = title or "Pipeline timeline of one training step"
    lines = [head, report.text()]
    if subtitle:
        lines.append(subtitle)
    ax.set_title("\n".join(lines), fontsize=10)
    ax.grid(axis="x", linestyle=":", alpha=0.6)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(out_png)), exist_ok=True)
    fig.savefig(out_png, dpi=110)
    plt.close(fig)


def plot_trace(trace_paths, out_png: str, step: str = "middle", title: Optional[str] = None,
               subtitle: Optional[str] = None) -> TimelineReport:
    """Loads, analyses and renders; returns the report (bubble fractions)."""
    if isinstance(trace_paths, str):
        trace_paths = [trace_paths]
    slices = load_trace(trace_paths[0]) if len(trace_paths) == 1 else merge_traces(trace_paths)
    window = choose_window(slices, step)
    report = analyse(slices, window)
    render(slices, report, out_png, title, subtitle)
    return report


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("trace", nargs="+", help="Chrome trace JSON file(s) written by --trace")
    parser.add_argument("out", help="PNG to write")
    parser.add_argument("--step", default="middle",
                        help="which step slice to plot: middle (default), first, last, all or its index")
    parser.add_argument("--title", default=None)
    args = parser.parse_args(argv)
    try:
        report = plot_trace(args.trace, args.out, args.step, args.title)
    except TraceError as e:
        print(f"plot_trace.py: error: {e}", file=sys.stderr)
        return 1
    print(report.text())
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
