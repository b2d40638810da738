"""Where a CUDA graph replay's time goes (`dsuf bench --model --trace`).

A batch-1 decode step is a chain of short kernels on several streams, so the sum of kernel times
says little: what bounds the step is the time some kernel on the critical path runs, plus the time
no kernel runs at all. From one replay's kernel timeline (torch.profiler, CUPTI timestamps) this
module reports, per kernel name, the time it ran alone on the GPU (nothing else to overlap it
with: certainly on the critical path), the time kernels overlapped, and the idle gaps between
kernels, summed by the pair of kernels around them (a gap is launch or dependency latency: a
cross-stream join, the graph's own start).

With programmatic dependent launch a kernel is resident, and traced as running, from while its
predecessor on the stream still runs; it only waits there (griddepcontrol.wait). So a kernel's
work is taken to start when the kernel before it on its stream has ended.
"""

from __future__ import annotations

import json
import tempfile
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

NAME_WIDTH = 48


@dataclass(frozen=True)
class Span:
    """One kernel's run on a stream: start and end in µs."""

    name: str
    start: float
    end: float
    stream: int = 0


@dataclass
class KernelTime:
    launches: int = 0
    total: float = 0.0  # summed working durations, µs
    alone: float = 0.0  # µs while no other kernel ran


@dataclass
class Timeline:
    span: float  # first start to last end, µs
    idle: float  # no kernel running
    overlapped: float  # two kernels or more running
    kernels: dict[str, KernelTime] = field(default_factory=dict)
    gaps: dict[tuple[str, str], tuple[int, float]] = field(default_factory=dict)  # (before, after) -> (count, µs)


def working(spans: list[Span]) -> list[Span]:
    """The spans from when each kernel can work: not before the kernel before it on its stream ends."""
    ended: dict[int, float] = {}
    out = []
    for s in sorted(spans, key=lambda s: s.start):
        out.append(Span(s.name, min(s.end, max(s.start, ended.get(s.stream, s.start))), s.end, s.stream))
        ended[s.stream] = s.end
    return out


def analyse(spans: list[Span]) -> Timeline:
    """Sweep the working spans' starts and ends in time order, attributing each interval to the one
    kernel running (alone), to overlap (several) or to idleness (none)."""
    if not spans:
        return Timeline(0.0, 0.0, 0.0)
    spans = working(spans)
    kernels: dict[str, KernelTime] = defaultdict(KernelTime)
    for s in spans:
        kernels[s.name].launches += 1
        kernels[s.name].total += s.end - s.start
    # Ends sort before starts at the same instant: a kernel that starts as another ends does not overlap it.
    edges = sorted([(s.start, 1, i) for i, s in enumerate(spans)] + [(s.end, 0, i) for i, s in enumerate(spans)])
    running: set[int] = set()
    idle = overlapped = 0.0
    gaps: dict[tuple[str, str], list] = defaultdict(lambda: [0, 0.0])
    last_ended = None
    t0 = edges[0][0]
    for t, is_start, i in edges:
        dt = t - t0
        if dt > 0:
            if not running:
                idle += dt
                key = (spans[last_ended].name if last_ended is not None else "(start)", spans[i].name)
                gaps[key][0] += 1
                gaps[key][1] += dt
            elif len(running) == 1:
                kernels[spans[next(iter(running))].name].alone += dt
            else:
                overlapped += dt
        if is_start:
            running.add(i)
        else:
            running.discard(i)
            last_ended = i
        t0 = t
    span = edges[-1][0] - edges[0][0]
    return Timeline(span, idle, overlapped, dict(kernels), {k: (n, us) for k, (n, us) in gaps.items()})


def graph_spans(graph: torch.cuda.CUDAGraph, save: Path | None = None) -> list[Span]:
    """The kernels of one replay of `graph` (see trace_spans)."""
    return trace_spans(graph.replay, save)


def trace_spans(run: Callable[[], object], save: Path | None = None) -> list[Span]:
    """The kernels of one call of `run` (a graph replay, or eager work that launches the same
    kernels every call), from torch.profiler's trace of two calls after an untraced one (also
    written to `save`, for Perfetto or chrome://tracing). The calls run one after the other, so
    the second's kernels are the later half; the first absorbs what tracing costs at its start (a
    tensor-parallel rank's first collective waits for its peer's profiler to start)."""
    from torch.profiler import ProfilerActivity, profile

    run()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        run()
        run()
        torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(path))
        text = path.read_text()
    if save is not None:
        save.write_text(text)
    events = json.loads(text)["traceEvents"]
    spans = sorted((Span(e["name"], float(e["ts"]), float(e["ts"]) + float(e["dur"]), int(e["args"]["stream"]))
                    for e in events if e.get("cat") == "kernel"), key=lambda s: s.start)
    return spans[len(spans) // 2 :]


def report(t: Timeline, rows: int = 25) -> str:
    """The timeline as text: totals, the kernels by time alone, the gaps by the kernels around them."""

    def short(name: str) -> str:
        return name if len(name) <= NAME_WIDTH else name[: NAME_WIDTH - 1] + "…"

    def pct(us: float) -> str:
        return f"{100 * us / t.span:.0f} %" if t.span else "–"

    busy = sum(k.alone for k in t.kernels.values())
    lines = [f"span {t.span:.1f} µs: one kernel alone {busy:.1f} µs ({pct(busy)}), kernels overlapping {t.overlapped:.1f} µs "
             f"({pct(t.overlapped)}), no kernel {t.idle:.1f} µs ({pct(t.idle)})", "",
             "| kernel | launches | total µs | alone µs | alone µs a launch |", "|---|---|---|---|---|"]
    for name, k in sorted(t.kernels.items(), key=lambda kv: -kv[1].alone)[:rows]:
        lines.append(f"| {short(name)} | {k.launches} | {k.total:.1f} | {k.alone:.1f} | {k.alone / k.launches:.2f} |")
    lines += ["", "| idle gap after | before | gaps | µs | µs a gap |", "|---|---|---|---|---|"]
    for (before, after), (n, us) in sorted(t.gaps.items(), key=lambda kv: -kv[1][1])[:rows]:
        lines.append(f"| {short(before)} | {short(after)} | {n} | {us:.1f} | {us / n:.2f} |")
    return "\n".join(lines)
