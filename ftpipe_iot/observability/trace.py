"""A run's trace: every process's timeline kept in the run directory, and exported as one Chrome
trace-event JSON (Perfetto and chrome://tracing open it) or drawn as the report's timeline panel.

The controller writes ``<run dir>/trace/<process>.jsonl`` (one line per batch of spans, in the
process's own clock) and ``<run dir>/trace/clocks.json`` (each process's offset from the
controller's clock and its error bound). Reading them back needs neither torch nor a broker:
``ftpipe-iot trace RUN_DIR`` works on any saved run.
"""

from __future__ import annotations

import contextlib
import json
import math
import statistics
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ftpipe_iot.errors import ReportError
from ftpipe_iot.observability.timeline import ClockSample, ClockSync, Timeline, clock_sample
from ftpipe_iot.protocol.messages import SpanBatch
from ftpipe_iot.protocol.vocab import SpanKind

TRACE_DIR = "trace"
CLOCKS_FILE = "clocks.json"
CHROME_TRACE = "trace.json"
CONTROLLER = "controller"

# What each kind is, for the trace's categories and the panel's colours.
_CATEGORY = {
    SpanKind.FORWARD: "compute", SpanKind.BACKWARD: "compute", SpanKind.OPTIMIZER: "compute",
    SpanKind.EXCHANGE: "compute", SpanKind.EVALUATE: "compute", SpanKind.REPLICATE: "comm",
    SpanKind.SEND: "comm", SpanKind.RECEIVE: "comm", SpanKind.LINK: "comm",
    SpanKind.FEED: "comm", SpanKind.WAIT_INPUT: "wait", SpanKind.WAIT_GRADIENT: "wait",
    SpanKind.WAIT_EXCHANGE: "wait", SpanKind.WAIT: "wait", SpanKind.STEP: "step",
}
_COLOUR = {
    SpanKind.FORWARD: "#1f77b4", SpanKind.BACKWARD: "#ff7f0e", SpanKind.OPTIMIZER: "#2ca02c",
    SpanKind.EXCHANGE: "#9467bd", SpanKind.EVALUATE: "#17becf", SpanKind.SEND: "#8c564b",
    SpanKind.RECEIVE: "#e377c2", SpanKind.LINK: "#bcbd22", SpanKind.REPLICATE: "#7f7f7f",
    SpanKind.FEED: "#8c564b", SpanKind.WAIT_INPUT: "#c6dbef", SpanKind.WAIT_GRADIENT: "#fdd0a2",
    SpanKind.WAIT_EXCHANGE: "#dadaeb", SpanKind.WAIT: "#eeeeee",
}


def trace_dir(run_dir: Path) -> Path:
    """The trace folder of a run directory (or the folder itself, if given)."""
    return run_dir if run_dir.name == TRACE_DIR else run_dir / TRACE_DIR


class TraceStore:
    """The controller's writer of a run's trace: spans as they come, clock offsets as they
    improve. Appends only: a run that stops at any point leaves a readable trace."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        directory.mkdir(parents=True, exist_ok=True)
        self._clocks: dict[str, ClockSync] = {}
        self._written: dict[str, ClockSample] = {}
        self.stages: dict[str, int] = {}
        self.spans = 0
        self.lost = 0

    def add(self, process: str, batch: SpanBatch) -> None:
        """Append one batch of ``process``'s spans (its own clock)."""
        self.spans += len(batch)
        self.lost += batch.lost
        if batch.stage >= 0:
            self.stages[process] = batch.stage
        line = {"stage": batch.stage, "lost": batch.lost, "names": list(batch.names),
                "kinds": batch.kinds.tolist(), "start": batch.start.tolist(),
                "duration": batch.duration.tolist(), "step": batch.step.tolist(),
                "micro_batch": batch.micro_batch.tolist()}
        with open(self.directory / f"{process}.jsonl", "a") as out:
            out.write(json.dumps(line) + "\n")

    def clock(self, process: str, sample: ClockSample) -> None:
        """One more offset sample of ``process``; clocks.json is rewritten when its best
        estimate changes."""
        sync = self._clocks.setdefault(process, ClockSync())
        sync.observe(sample)
        best = sync.best
        if best is None or self._written.get(process) == best:
            return
        self._written[process] = best
        clocks = {name: {"offset_s": s.offset_s, "error_s": s.delay_s / 2}
                  for name, s in sorted(self._written.items())}
        target = self.directory / CLOCKS_FILE
        scratch = target.with_suffix(".tmp")
        scratch.write_text(json.dumps(clocks, indent=1) + "\n")
        scratch.replace(target)


class RunTracer:
    """The controller's part of a run's trace: its own spans (each micro-batch it feeds, each
    step from its first input to its end), the devices' batches and their clock samples, into
    one ``TraceStore``; without a store it records nothing."""

    def __init__(self, store: TraceStore | None, clock: Callable[[], float] = time.time,
                 flush_every_s: float = 1.0) -> None:
        self.store = store
        self.timeline = Timeline(clock, enabled=store is not None)
        self.flush_every_s = flush_every_s
        self._flushed = clock()
        self._step_started: dict[int, float] = {}

    @property
    def enabled(self) -> bool:
        return self.store is not None

    def feeding(self, micro_batches: Sequence[tuple[int, int]], train: bool
                ) -> contextlib.AbstractContextManager[None]:
        """A span around publishing the inputs of ``micro_batches`` ((step, index) pairs, in
        one frame; the span names the first); a training step starts at its first."""
        if train and self.enabled:
            now = self.timeline.clock()
            for step, _ in micro_batches:
                self._step_started.setdefault(step, now)
        step, micro_batch = micro_batches[0]
        return self.timeline.span(SpanKind.FEED, step, micro_batch)

    def step_done(self, step: int) -> None:
        started = self._step_started.pop(step, None)
        if started is not None:
            self.timeline.record(SpanKind.STEP, started, self.timeline.clock(), step)

    def rewound(self) -> None:
        """The steps in flight were abandoned (a rollback): they are not steps of the trace."""
        self._step_started.clear()

    def device_spans(self, device: str, batch: SpanBatch) -> None:
        if self.store is not None:
            self.store.add(device, batch)

    def heartbeat(self, device: str, beat_sent: float, beat_arrived: float,
                  probe_sent: float, probe_received: float) -> None:
        """A heartbeat's four timestamps (``observability.timeline.clock_sample``)."""
        if self.store is not None and min(beat_sent, beat_arrived, probe_sent,
                                          probe_received) > 0:
            self.store.clock(device, clock_sample(probe_sent, probe_received, beat_sent,
                                                  beat_arrived))

    def tick(self, force: bool = False) -> None:
        """Write the controller's own spans, about every ``flush_every_s``."""
        if self.store is None:
            return
        now = self.timeline.clock()
        if force or now - self._flushed >= self.flush_every_s:
            self._flushed = now
            batch = self.timeline.take()
            if batch is not None:
                self.store.add(CONTROLLER, batch)


@dataclass
class ProcessSpans:
    """One process's spans on the controller's clock, sorted by start."""

    name: str
    kinds: list[SpanKind]
    start: np.ndarray
    duration: np.ndarray
    step: np.ndarray
    micro_batch: np.ndarray
    stage: int = -1
    offset_s: float = 0.0
    error_s: float = 0.0
    lost: int = 0


@dataclass
class Trace:
    """Every process's spans of one run, aligned to the controller's clock."""

    processes: list[ProcessSpans] = field(default_factory=list)

    @property
    def origin(self) -> float:
        """The earliest span start (the trace's time 0)."""
        starts = [float(p.start.min()) for p in self.processes if len(p.start)]
        return min(starts, default=0.0)

    def step_bounds(self) -> dict[int, tuple[float, float]]:
        """Each step's (start, end) as the controller saw it: first input sent to its end."""
        for process in self.processes:
            if process.name == CONTROLLER:
                return {int(s): (float(b), float(b + d)) for k, b, d, s in zip(
                    process.kinds, process.start, process.duration, process.step)
                    if k is SpanKind.STEP}
        return {}


def _read_lines(path: Path) -> tuple[list[dict[str, Any]], int]:
    """The batches of one process's file; a line cut short by a crash is skipped."""
    batches, broken = [], 0
    for line in path.read_text().splitlines():
        try:
            batch = json.loads(line)
        except json.JSONDecodeError:
            broken += 1
            continue
        if isinstance(batch, dict):
            batches.append(batch)
    return batches, broken


def _process(name: str, batches: list[dict[str, Any]], clock: dict[str, float]) -> ProcessSpans:
    """One process's batches as columns on the controller's clock; rows of a kind this version
    does not know, and batches whose columns disagree in length, are left out."""
    known = {k.value: k for k in SpanKind}
    kinds: list[SpanKind] = []
    columns: dict[str, list[float]] = {"start": [], "duration": [], "step": [],
                                       "micro_batch": []}
    stage, lost = -1, 0
    for batch in batches:
        codes = batch.get("kinds", [])
        if any(len(batch.get(key, [])) != len(codes) for key in columns):
            continue
        names = [known.get(n) for n in batch.get("names", [])]
        rows = [(i, names[c]) for i, c in enumerate(codes)
                if 0 <= c < len(names) and names[c] is not None]
        kinds += [kind for _, kind in rows if kind is not None]
        for key, values in columns.items():
            values += [batch[key][i] for i, _ in rows]
        if batch.get("stage", -1) >= 0:
            stage = int(batch["stage"])
        lost += int(batch.get("lost", 0))
    offset = float(clock.get("offset_s", 0.0))
    start = np.asarray(columns["start"], dtype=np.float64) - offset
    order = np.argsort(start, kind="stable")
    return ProcessSpans(name, [kinds[i] for i in order], start[order],
                        np.asarray(columns["duration"], dtype=np.float64)[order],
                        np.asarray(columns["step"], dtype=np.int64)[order],
                        np.asarray(columns["micro_batch"], dtype=np.int64)[order], stage,
                        offset, float(clock.get("error_s", 0.0)), lost)


def load_trace(run_dir: Path) -> Trace:
    """A run's trace from its directory (raises ``ReportError`` when it has none)."""
    directory = trace_dir(run_dir)
    files = sorted(directory.glob("*.jsonl")) if directory.is_dir() else []
    if not files:
        raise ReportError(f"no trace in {run_dir}: a run records one when its controller has "
                          "--trace-dir (the demo always does)")
    clocks: dict[str, dict[str, float]] = {}
    clocks_path = directory / CLOCKS_FILE
    if clocks_path.exists():
        try:
            clocks = json.loads(clocks_path.read_text())
        except json.JSONDecodeError as exc:
            raise ReportError(f"cannot read {clocks_path}: {exc}") from exc
    processes = []
    for path in files:
        batches, _ = _read_lines(path)
        processes.append(_process(path.stem, batches, clocks.get(path.stem, {})))
    # the controller first, then the devices by stage and name
    processes.sort(key=lambda p: (p.name != CONTROLLER, p.stage, p.name))
    return Trace(processes)


def _steps_filter(process: ProcessSpans, steps: tuple[int, int] | None) -> Iterable[int]:
    if steps is None:
        return range(len(process.kinds))
    low, high = steps
    return (i for i in range(len(process.kinds)) if low <= process.step[i] <= high)


def chrome_trace(trace: Trace, steps: tuple[int, int] | None = None) -> dict[str, Any]:
    """The trace as Chrome trace-event JSON: one process per device (and the controller),
    complete events in microseconds from the trace's origin, steps as async spans."""
    origin = trace.origin
    events: list[dict[str, Any]] = []
    for pid, process in enumerate(trace.processes):
        label = process.name if process.stage < 0 else f"{process.name} (stage {process.stage})"
        events.append({"ph": "M", "name": "process_name", "pid": pid, "tid": 0,
                       "args": {"name": label}})
        events.append({"ph": "M", "name": "process_sort_index", "pid": pid, "tid": 0,
                       "args": {"sort_index": pid}})
        for i in _steps_filter(process, steps):
            kind = process.kinds[i]
            ts = (float(process.start[i]) - origin) * 1e6
            dur = float(process.duration[i]) * 1e6
            step, micro_batch = int(process.step[i]), int(process.micro_batch[i])
            args = {"step": step, "micro_batch": micro_batch}
            if kind is SpanKind.STEP:  # steps overlap under async: async events may
                events.append({"ph": "b", "cat": "step", "name": f"step {step}", "id": step,
                               "pid": pid, "tid": 1, "ts": ts, "args": args})
                events.append({"ph": "e", "cat": "step", "name": f"step {step}", "id": step,
                               "pid": pid, "tid": 1, "ts": ts + dur})
                continue
            name = kind.value if micro_batch < 0 else f"{kind.value} {micro_batch}"
            events.append({"ph": "X", "cat": _CATEGORY[kind], "name": name, "pid": pid,
                           "tid": 0, "ts": ts, "dur": dur, "args": args})
    clocks = {p.name: {"offset_s": p.offset_s, "error_s": p.error_s} for p in trace.processes}
    return {"traceEvents": events, "displayTimeUnit": "ms",
            "otherData": {"clock_offsets": clocks,
                          "lost_spans": sum(p.lost for p in trace.processes)}}


@dataclass(frozen=True)
class WrittenTrace:
    """What ``write_trace`` wrote: where, how much, and each device's busy shares over the
    steps written (or the whole run)."""

    path: Path
    spans: int
    processes: int
    steps: tuple[int, int] | None
    shares: list[BusyShare]
    lost: int
    clock_error_s: float


def write_trace(run_dir: Path, out: Path | None = None, steps: str | None = None
                ) -> WrittenTrace:
    """Write the run's Chrome trace (``<run dir>/trace.json`` unless ``out`` is given), of the
    steps ``A:B`` (or ``A``) only when ``steps`` says so."""
    chosen = step_range(steps)
    trace = load_trace(run_dir)
    path = out or trace_dir(run_dir).parent / CHROME_TRACE
    path.parent.mkdir(parents=True, exist_ok=True)
    document = chrome_trace(trace, chosen)
    path.write_text(json.dumps(document))
    spans = sum(1 for e in document["traceEvents"] if e["ph"] in ("X", "b"))
    bounds = trace.step_bounds()
    known = sorted(bounds)
    if chosen is not None:
        known = [s for s in known if chosen[0] <= s <= chosen[1]]
    window = (bounds[known[0]][0], bounds[known[-1]][1]) if known else _span_of(trace, chosen)
    return WrittenTrace(path, spans, len(trace.processes),
                        (known[0], known[-1]) if known else chosen, busy_shares(trace, window),
                        sum(p.lost for p in trace.processes),
                        max((p.error_s for p in trace.processes), default=0.0))


def describe_trace(written: WrittenTrace) -> str:
    """What ``ftpipe-iot trace`` prints: the file, and where each device's time went."""
    steps = f", steps {written.steps[0]}-{written.steps[1]}" if written.steps else ""
    lines = [f"wrote {written.path}: {written.spans} spans of {written.processes} processes"
             f"{steps} (open it in https://ui.perfetto.dev or chrome://tracing)",
             f"clocks aligned to the controller's within {written.clock_error_s * 1e3:.2f} ms"]
    if written.lost:
        lines.append(f"{written.lost} spans were lost (a device's buffer was full)")
    if written.shares:
        lines.append(f"{'device':<14}{'compute':>9}{'comm':>8}{'wait':>8}{'other':>8}")
        for share in written.shares:
            other = max(0.0, 1.0 - share.compute - share.comm - share.wait)
            lines.append(f"{share.name:<14}{share.compute:>9.0%}{share.comm:>8.0%}"
                         f"{share.wait:>8.0%}{other:>8.0%}")
    return "\n".join(lines)


def representative_steps(trace: Trace, count: int = 3) -> tuple[int, int] | None:
    """``count`` consecutive steps whose total time is the median of all such windows (after
    the first steps, which warm up): what a typical stretch of the run looks like."""
    bounds = trace.step_bounds()
    steps = sorted(s for s in bounds if s >= 2) or sorted(bounds)
    windows = [steps[i:i + count] for i in range(len(steps) - count + 1)
               if steps[i + count - 1] - steps[i] == count - 1]
    if not windows:
        return (steps[0], steps[-1]) if steps else None
    lengths = [bounds[w[-1]][1] - bounds[w[0]][0] for w in windows]
    middle = statistics.median_low(lengths)
    window = windows[lengths.index(middle)]
    return window[0], window[-1]


@dataclass(frozen=True)
class BusyShare:
    """What one process did over a stretch of time, as shares of it (compute, comm, wait)."""

    name: str
    compute: float
    comm: float
    wait: float


def busy_shares(trace: Trace, window: tuple[float, float]) -> list[BusyShare]:
    """Each device's shares of ``window`` (controller clock) spent computing, communicating
    and waiting (what the timeline panel's legend says)."""
    low, high = window
    length = max(high - low, 1e-9)
    shares = []
    for process in trace.processes:
        if process.name == CONTROLLER:
            continue
        totals = {"compute": 0.0, "comm": 0.0, "wait": 0.0}
        for kind, start, duration in zip(process.kinds, process.start, process.duration):
            overlap = min(high, start + duration) - max(low, start)
            category = _CATEGORY[kind]
            if overlap > 0 and category in totals:
                totals[category] += float(overlap)
        shares.append(BusyShare(process.name, totals["compute"] / length,
                                totals["comm"] / length, totals["wait"] / length))
    return shares


def draw_timeline(axis: Any, trace: Trace, steps: tuple[int, int]) -> None:
    """Draw ``steps`` (first, last) of ``trace`` on a matplotlib axis: one row per process,
    one bar per span, coloured by kind; waits are left light so the work stands out."""
    bounds = trace.step_bounds()
    if steps[0] in bounds and steps[1] in bounds:
        low, high = bounds[steps[0]][0], bounds[steps[1]][1]
    else:
        low, high = _span_of(trace, steps)
    rows: list[str] = []
    seen: set[SpanKind] = set()
    for row, process in enumerate(trace.processes):
        label = process.name if process.stage < 0 else f"{process.name}\nstage {process.stage}"
        rows.append(label)
        by_kind: dict[SpanKind, list[tuple[float, float]]] = {}
        for kind, start, duration in zip(process.kinds, process.start, process.duration):
            if kind is SpanKind.STEP or start + duration < low or start > high:
                continue
            by_kind.setdefault(kind, []).append((float(start) - low,
                                                 max(float(duration), 1e-5)))
        for kind, bars in by_kind.items():
            axis.broken_barh(bars, (row - 0.4, 0.8), facecolors=_COLOUR[kind],
                             label=None if kind in seen else kind.value, linewidth=0)
            seen.add(kind)
    for step in range(steps[0], steps[1] + 1):
        if step in bounds:
            axis.axvline(bounds[step][1] - low, color="#333333", linewidth=0.6, linestyle=":")
    axis.set_yticks(range(len(rows)))
    axis.set_yticklabels(rows, fontsize=7)
    axis.invert_yaxis()
    axis.set_xlim(0, max(high - low, 1e-3))
    axis.set_xlabel(f"seconds from the start of step {steps[0]} (steps {steps[0]}-{steps[1]}, "
                    "dotted: each step's end)")
    axis.legend(loc="upper center", bbox_to_anchor=(0.5, -0.35), ncol=7, fontsize=7,
                frameon=False)


def _span_of(trace: Trace, steps: tuple[int, int]) -> tuple[float, float]:
    low, high = math.inf, -math.inf
    for process in trace.processes:
        for i in _steps_filter(process, steps):
            low = min(low, float(process.start[i]))
            high = max(high, float(process.start[i] + process.duration[i]))
    return (low, high) if low < high else (0.0, 1.0)


def step_range(text: str | None) -> tuple[int, int] | None:
    """``A:B`` (steps A to B, both in), ``A`` (one step) or None."""
    if not text:
        return None
    try:
        parts: Sequence[str] = text.split(":", 1)
        low = int(parts[0])
        high = int(parts[1]) if len(parts) > 1 else low
    except ValueError:
        raise ReportError(f"--steps must be A:B or A (step numbers), got {text!r}") from None
    if low < 0 or high < low:
        raise ReportError(f"--steps must be A:B with 0 <= A <= B, got {text!r}")
    return low, high
