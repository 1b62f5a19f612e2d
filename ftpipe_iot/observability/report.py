"""Run reports: ``report.json`` (figures a person or a script compares between runs) and
``report.png`` (throughput, loss and test accuracy over time, with plan changes, failures and
recoveries marked), made from a run summary as the controller writes it (``--summary-json``).

The summary is read as plain JSON on purpose: a report can be made after the fact from any
saved summary, without importing the controller (and torch).
"""

from __future__ import annotations

import json
import math
import statistics
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ftpipe_iot.errors import ReportError
from ftpipe_iot.observability.trace import Trace, draw_timeline, representative_steps
from ftpipe_iot.protocol.vocab import EventType

REPORT_JSON = "report.json"
REPORT_PNG = "report.png"



@dataclass(frozen=True)
class _Style:
    color: str
    linestyle: str
    label: str


# Events drawn as vertical lines (other types are listed in the JSON but not drawn): one look
# per event, chosen so that failures (red, solid) stand out from the routine plan changes
# (grey, dashed) even in a greyscale print.
_STYLES: dict[EventType, _Style] = {
    EventType.PLAN_CHANGED: _Style("#7f7f7f", "--", "plan changed"),
    EventType.REPARTITIONED: _Style("#9467bd", "-.", "repartitioned"),
    EventType.FAILURE_DETECTED: _Style("#d62728", "-", "failure detected"),
    EventType.RECOVERY_DONE: _Style("#2ca02c", ":", "recovery done"),
}


@dataclass(frozen=True)
class ReportPaths:
    """Where a report was written."""

    json: Path
    png: Path


@dataclass
class RunReport:
    """The figures in ``report.json``; times are seconds since the controller started."""

    job: str
    steps: int
    epochs: int
    devices: int
    error: str | None
    final_loss: float | None
    test_accuracy: float | None
    samples_per_s: float | None
    throughput_median: float | None
    throughput_p10: float | None
    train_s: float | None
    wall_s: float | None
    plan_changes: int
    repartitions: int
    failures: int
    recoveries: int
    recovering_s: float
    stalled_s: float
    evals: list[dict[str, Any]] = field(default_factory=list)
    events: list[dict[str, Any]] = field(default_factory=list)
    dropped: dict[str, int] = field(default_factory=dict)
    collab: dict[str, Any] | None = None  # collaborative and fedavg modes: _collab_figures


def _collab_figures(summary: dict[str, Any]) -> dict[str, Any] | None:
    """Mode, split, rounds, server idle fraction and each data device's rounds and epsilon."""
    collab = summary.get("collab")
    if not isinstance(collab, dict):
        return None
    keys = ("mode", "split_point", "head_start", "micro_batches", "aggregate_every", "server",
            "rounds", "dropouts", "server_idle_fraction", "server_busy_s", "aggregation_s",
            "privacy", "data_split")
    members = collab.get("members") if isinstance(collab.get("members"), dict) else {}
    return {**{k: collab.get(k) for k in keys},
            "devices": {name: {k: m.get(k) for k in ("samples", "rounds_done", "rounds_missed",
                                                      "epsilon", "idle_fraction")}
                        for name, m in members.items() if isinstance(m, dict)}}


def _series(rows: list[dict[str, Any]], key: str) -> tuple[list[float], list[float]]:
    """(t, value) pairs of ``key`` from rows that have both as finite numbers."""
    ts: list[float] = []
    values: list[float] = []
    for row in rows:
        t, value = row.get("t"), row.get(key)
        if isinstance(t, (int, float)) and isinstance(value, (int, float)) and \
                math.isfinite(t) and math.isfinite(value):
            ts.append(float(t))
            values.append(float(value))
    return ts, values


def _gap_limit(ts: list[float]) -> float:
    """Seconds between two completed steps beyond which the run counts as stalled: ten typical
    steps, and at least a second (an evaluation pause is not a stall)."""
    gaps = sorted(b - a for a, b in zip(ts, ts[1:]))
    return max(1.0, 10 * gaps[len(gaps) // 2]) if gaps else math.inf


def _stalls(ts: list[float]) -> list[tuple[float, float]]:
    """Spans in which no step completed for longer than ``_gap_limit``."""
    limit = _gap_limit(ts)
    return [(a, b) for a, b in zip(ts, ts[1:]) if b - a > limit]


def _break_gaps(ts: list[float], values: list[float]) -> tuple[list[float], list[float]]:
    """Insert NaN where the run paused (evaluation, a failure): matplotlib then leaves a gap
    instead of drawing a line that suggests training went on at the old pace."""
    if len(ts) < 3:
        return ts, values
    limit = _gap_limit(ts)
    out_t, out_v = [ts[0]], [values[0]]
    for (t0, t1), value in zip(zip(ts, ts[1:]), values[1:]):
        if t1 - t0 > limit:
            out_t.append((t0 + t1) / 2)
            out_v.append(math.nan)
        out_t.append(t1)
        out_v.append(value)
    return out_t, out_v


def _list_of_dicts(summary: dict[str, Any], key: str) -> list[dict[str, Any]]:
    value = summary.get(key) or []
    if not isinstance(value, list) or not all(isinstance(item, dict) for item in value):
        raise ReportError(f"summary[{key!r}] must be a list of objects")
    return value


def _count(events: list[dict[str, Any]], kind: EventType) -> int:
    return sum(1 for e in events if e.get("type") == kind.value)


def _recovering(events: list[dict[str, Any]], end_t: float) -> tuple[float, list[tuple[float,
                                                                                       float]]]:
    """Total seconds between each failure detection and the next recovery (or the end of the
    run when it never recovered), and those intervals."""
    intervals: list[tuple[float, float]] = []
    down_since: float | None = None
    for event in sorted(events, key=lambda e: float(e.get("t", 0.0))):
        kind, t = event.get("type"), float(event.get("t", 0.0))
        if kind == EventType.FAILURE_DETECTED.value and down_since is None:
            down_since = t
        elif kind == EventType.RECOVERY_DONE.value and down_since is not None:
            intervals.append((down_since, t))
            down_since = None
    if down_since is not None:
        intervals.append((down_since, max(end_t, down_since)))
    return sum(b - a for a, b in intervals), intervals


def _number(summary: dict[str, Any], key: str) -> float | None:
    value = summary.get(key)
    return float(value) if isinstance(value, (int, float)) and math.isfinite(value) else None


def build_report(summary: dict[str, Any]) -> RunReport:
    """The report's figures from a controller summary dict (``RunSummary.to_dict()``)."""
    if not isinstance(summary, dict):
        raise ReportError("a summary is a JSON object")
    history = _list_of_dicts(summary, "history")
    evals = _list_of_dicts(summary, "evals")
    events = _list_of_dicts(summary, "events")
    _, rates = _series(history, "samples_per_s")
    # The first rates are measured over one or two steps only (and are 0 before that): leave
    # them out of the distribution so the median describes the steady state.
    steady = [r for r in rates[2:] if r > 0] or [r for r in rates if r > 0]
    end_t = max([0.0, *(_series(history, "loss")[0]), *(float(e.get("t", 0.0)) for e in events)])
    recovering, _ = _recovering(events, end_t)
    dropped = summary.get("dropped") or {}
    return RunReport(
        job=str(summary.get("job", "")),
        steps=int(summary.get("steps") or len(history)),
        epochs=int(summary.get("epochs") or 0),
        devices=int(summary.get("devices") or 0),
        error=summary.get("error"),
        final_loss=_number(summary, "final_loss"),
        test_accuracy=_number(summary, "test_accuracy"),
        samples_per_s=_number(summary, "samples_per_s"),
        throughput_median=statistics.median(steady) if steady else None,
        throughput_p10=(statistics.quantiles(steady, n=10)[0] if len(steady) >= 2
                        else (steady[0] if steady else None)),
        train_s=_number(summary, "train_s"),
        wall_s=_number(summary, "wall_s"),
        plan_changes=_count(events, EventType.PLAN_CHANGED),
        repartitions=_count(events, EventType.REPARTITIONED),
        failures=_count(events, EventType.FAILURE_DETECTED),
        recoveries=_count(events, EventType.RECOVERY_DONE),
        recovering_s=round(recovering, 3),
        stalled_s=round(sum(b - a for a, b in _stalls(_series(history, "loss")[0])), 3),
        evals=evals,
        events=events,
        dropped={str(k): int(v) for k, v in dropped.items()} if isinstance(dropped, dict) else {},
        collab=_collab_figures(summary),
    )


def _mark_events(axes: list[Any], events: list[dict[str, Any]],
                 stalls: list[tuple[float, float]]) -> None:
    """Vertical lines for marked events and shaded stalls on every axis; legend entries once."""
    seen: set[EventType] = set()
    for event in events:
        try:
            kind = EventType(event.get("type"))
        except ValueError:
            continue
        if kind not in _STYLES:
            continue
        t = event.get("t")
        if not isinstance(t, (int, float)):
            continue
        style = _STYLES[kind]
        for index, ax in enumerate(axes):
            label = style.label if index == 0 and kind not in seen else None
            ax.axvline(float(t), color=style.color, linestyle=style.linestyle, linewidth=1.2,
                       alpha=0.85, label=label, zorder=1)
        seen.add(kind)
    for number, (start, stop) in enumerate(stalls):
        for index, ax in enumerate(axes):
            ax.axvspan(start, stop, color="#d62728", alpha=0.08, zorder=0,
                       label="no step completed" if index == 0 and number == 0 else None)


def _title(report: RunReport) -> str:
    parts = [f"job {report.job}", f"{report.steps} steps", f"{report.devices} devices"]
    if report.test_accuracy is not None and report.evals:
        parts.append(f"test accuracy {report.test_accuracy:.3f}")
    if report.samples_per_s:
        parts.append(f"{report.samples_per_s:.0f} samples/s")
    if report.failures:
        parts.append(f"{report.failures} failure(s), {report.recoveries} recovered")
    if report.stalled_s:
        parts.append(f"{report.stalled_s:.1f} s without progress")
    if report.collab:
        idle = report.collab.get("server_idle_fraction")
        parts[2] = f"{report.collab.get('mode')}, {len(report.collab['devices'])} data devices"
        if isinstance(idle, (int, float)):
            parts.append(f"server idle {idle:.0%}")
        eps = [d["epsilon"] for d in report.collab["devices"].values()
               if isinstance(d.get("epsilon"), (int, float))]
        if eps:
            parts.append(f"epsilon <= {max(eps):.2f}")
    if report.error:
        parts.append("FAILED")
    return ", ".join(parts)


def _shares(events: list[dict[str, Any]]) -> dict[str, tuple[list[float], list[float]]]:
    """Each device's share of its stage group over time, from the plan and share events; empty
    when no stage was ever held by more than one device."""
    series: dict[str, tuple[list[float], list[float]]] = {}
    grouped = False
    for event in events:
        if event.get("type") not in (EventType.PLAN_CHANGED.value,
                                     EventType.SHARES_CHANGED.value):
            continue
        t, stages = event.get("t"), event.get("stages")
        if not isinstance(t, (int, float)) or not isinstance(stages, list):
            continue
        present = set()
        for stage in stages:
            members = stage.get("devices") if isinstance(stage, dict) else None
            if not isinstance(members, list):
                continue
            grouped = grouped or len(members) > 1
            for member in members:
                if isinstance(member, dict) and isinstance(member.get("share"), (int, float)):
                    name = f"{member.get('device')} (stage {stage.get('stage')})"
                    times, values = series.setdefault(name, ([], []))
                    times.append(float(t))
                    values.append(float(member["share"]))
                    present.add(name)
        for name, (times, values) in series.items():
            if name not in present and values and values[-1] != 0.0:
                times.append(float(t))
                values.append(0.0)
    return series if grouped else {}


def plot_report(summary: dict[str, Any], path: Path, report: RunReport | None = None,
                trace: Trace | None = None) -> Path:
    """Draw throughput, training loss and test accuracy over time into a PNG at ``path``;
    with the run's ``trace``, also the timeline of a few representative steps."""
    import matplotlib

    matplotlib.use("Agg")  # no display on devices and CI; must precede pyplot
    import matplotlib.pyplot as plt

    report = report or build_report(summary)
    history = _list_of_dicts(summary, "history")
    evals = _list_of_dicts(summary, "evals")
    events = _list_of_dicts(summary, "events")
    rate_t, rate = _series(history, "samples_per_s")
    # The controller reports 0 until it has two steps to measure over: not a real dip.
    while rate and rate[0] <= 0:
        rate_t, rate = rate_t[1:], rate[1:]
    loss_t, loss = _series(history, "loss")
    acc_t, acc = _series(evals, "test_accuracy")
    end_t = max([0.0, *rate_t, *acc_t, *(float(e.get("t", 0.0)) for e in events)])

    shares = _shares(events)
    steps = representative_steps(trace) if trace is not None else None
    heights = [1.2, 1.2, 1.0, 1.0][:4 if shares else 3]
    rows = len(trace.processes) if trace is not None and steps is not None else 0
    fig = plt.figure(figsize=(10, sum(heights) * 2.6 + (1.2 + 0.3 * rows if rows else 0)))
    grid = fig.add_gridspec(len(heights) + (1 if rows else 0), 1,
                            height_ratios=heights + ([0.4 + 0.22 * rows] if rows else []))
    axes = [fig.add_subplot(grid[0])]
    axes += [fig.add_subplot(grid[i], sharex=axes[0]) for i in range(1, len(heights))]
    for ax in axes[:-1]:
        ax.tick_params(labelbottom=False)
    try:
        ax_rate, ax_loss, ax_acc = axes[:3]
        if shares:
            ax_share = axes[3]
            for name, (times, values) in sorted(shares.items()):
                ax_share.step([*times, end_t], [*values, values[-1]], where="post",
                              linewidth=1.2, label=name)
            ax_share.set_ylabel("share of its group")
            ax_share.set_ylim(0, 1.15)
            ax_share.legend(loc="lower right", fontsize=7, ncol=4)
        ax_rate.plot(*_break_gaps(rate_t, rate), color="#1f77b4", linewidth=1.4, label="throughput")
        ax_rate.set_ylabel("samples / s")
        ax_rate.set_ylim(bottom=0)
        ax_loss.plot(*_break_gaps(loss_t, loss), color="#ff7f0e", linewidth=1.0, alpha=0.5,
                     label="step loss")
        if len(loss) >= 5:
            # A centred rolling mean: the raw per-step loss is noisy at small batch sizes.
            window = max(3, len(loss) // 20)
            smooth = [statistics.fmean(loss[max(0, i - window // 2):i + window // 2 + 1])
                      for i in range(len(loss))]
            ax_loss.plot(*_break_gaps(loss_t, smooth), color="#ff7f0e", linewidth=2.0,
                         label=f"mean of {window} steps")
        ax_loss.set_ylabel("training loss")
        ax_loss.legend(loc="upper right", fontsize=8)
        if acc:
            ax_acc.plot(acc_t, acc, color="#2ca02c", marker="o", linewidth=1.6,
                        label="test accuracy")
            for t, value in zip(acc_t, acc):
                ax_acc.annotate(f"{value:.3f}", (t, value), textcoords="offset points",
                                xytext=(0, 6), ha="center", fontsize=8)
        else:
            ax_acc.text(0.5, 0.5, "no evaluation in this run", transform=ax_acc.transAxes,
                        ha="center", va="center", color="#7f7f7f")
        ax_acc.set_ylim(0, 1.05)
        ax_acc.set_ylabel("test accuracy")
        axes[-1].set_xlabel("seconds since the controller started")
        ax_acc.set_xlim(0, max(end_t * 1.02, 1.0))
        for ax in axes:
            ax.grid(True, alpha=0.3)
        _mark_events(list(axes), events, _stalls(loss_t))
        started = [float(e["t"]) for e in events
                   if e.get("type") == EventType.TRAINING_STARTED.value
                   and isinstance(e.get("t"), (int, float))]
        if started:
            for index, ax in enumerate(axes):
                ax.axvspan(0, started[0], color="#7f7f7f", alpha=0.08, zorder=0,
                           label="waiting for devices" if index == 0 else None)
        handles, labels = ax_rate.get_legend_handles_labels()
        ax_rate.legend(handles, labels, loc="lower right", fontsize=8, ncol=3)
        if rows and trace is not None and steps is not None:
            ax_timeline = fig.add_subplot(grid[-1])
            draw_timeline(ax_timeline, trace, steps)
            ax_timeline.set_title("timeline (ftpipe-iot trace writes all of it for Perfetto)",
                                  fontsize=9)
        fig.suptitle(_title(report), fontsize=11)
        fig.tight_layout()
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, dpi=100)
    finally:
        plt.close(fig)
    return path


def write_report(summary: dict[str, Any], out_dir: Path, trace: Trace | None = None
                 ) -> ReportPaths:
    """Write ``report.json`` and ``report.png`` for ``summary`` into ``out_dir`` (with a
    timeline panel when the run's ``trace`` is given)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    report = build_report(summary)
    json_path = out_dir / REPORT_JSON
    json_path.write_text(json.dumps(asdict(report), indent=2, default=str) + "\n")
    png_path = plot_report(summary, out_dir / REPORT_PNG, report, trace)
    return ReportPaths(json=json_path, png=png_path)


def write_report_from_file(summary_path: Path, out_dir: Path | None = None) -> ReportPaths:
    """Write a report for a saved summary JSON, next to it unless ``out_dir`` is given."""
    try:
        summary = json.loads(summary_path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ReportError(f"cannot read the summary {summary_path}: {exc}") from exc
    return write_report(summary, out_dir or summary_path.parent)
