"""Shared benchmark plumbing: run one job (devices + controller as processes) on a broker and
return the controller's summary, with progress on stderr."""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from ftpipe_iot.observability.watch import JobWatcher
from ftpipe_iot.runtime.broker import BrokerProcess
from ftpipe_iot.runtime.supervise import ProcessGroup
from ftpipe_iot.transport.connection import BrokerConfig

REPO = Path(__file__).resolve().parent.parent
PROFILES = REPO / "devices" / "profiles"


def say(text: str) -> None:
    print(f"[bench] {text}", file=sys.stderr, flush=True)


@dataclass
class Placement:
    """Where a job's processes run: the broker URL each dials and its network namespace
    (ftpipe_iot/runtime/netns.py); by default everything on this host's loopback."""

    controller_url: str
    watch: BrokerConfig
    controller_netns: str | None = None
    device_urls: dict[str, str] = field(default_factory=dict)
    device_netns: dict[str, str] = field(default_factory=dict)
    device_args: list[str] = field(default_factory=list)

    @classmethod
    def loopback(cls, broker: BrokerProcess) -> Placement:
        return cls(broker.url, BrokerConfig(port=broker.port))

    def watcher(self, job: str) -> JobWatcher:
        """A watcher of ``job`` that reaches the broker from where the controller runs."""
        if self.controller_netns is None:
            return JobWatcher(self.watch, job).start()
        from ftpipe_iot.runtime.netns import call_in

        return call_in(self.controller_netns, lambda: JobWatcher(self.watch, job).start())


@dataclass
class JobSpec:
    """One benchmark run: device names with optional profiles, and controller arguments."""

    job: str
    devices: list[tuple[str, Path | None]]
    controller_args: list[str] = field(default_factory=list)
    timeout_s: float = 300.0
    # a second controller with the same options and --standby (``procs["standby"]``), which
    # takes the job over when the leader's Last Will says it is gone
    standby_controller: bool = False


def run_job(spec: JobSpec, broker: BrokerProcess,
            during: Callable[[JobWatcher, dict[str, subprocess.Popen]], None] | None = None,
            placement: Placement | None = None) -> dict:
    """Run a job to completion; ``during`` may inject faults (or take measurements) while it
    runs. Returns the summary (with ``watch_events`` and ``watch_progress`` as seen by an
    outside observer)."""
    place = placement or Placement.loopback(broker)
    work = Path(tempfile.mkdtemp(prefix=f"bench-{spec.job}-"))
    group = ProcessGroup(work)
    procs = group.procs
    watcher = place.watcher(spec.job)
    try:
        for name, profile in spec.devices:
            extra = ["--profile", str(profile)] if profile else []
            group.start(name, "device", "--name", name, "--job", spec.job, "--broker",
                        place.device_urls.get(name, place.controller_url), *extra,
                        *place.device_args, netns=place.device_netns.get(name))
        controllers = ["controller", *(["standby"] if spec.standby_controller else [])]
        # one summary a controller: a fenced old leader that wakes up writes its own, and must
        # not overwrite the one of the controller that finished the job
        summary_paths = {name: work / ("summary.json" if name == "controller"
                                       else f"summary-{name}.json") for name in controllers}
        for name in controllers:
            group.start(name, "controller", "--job", spec.job, "--broker",
                        place.controller_url, "--devices", str(len(spec.devices)),
                        "--stop-devices", "--summary-json", str(summary_paths[name]),
                        "--log-level",
                        "WARNING", *spec.controller_args,
                        *(["--standby"] if name == "standby" else []),
                        netns=place.controller_netns)
        started = time.monotonic()
        last_report = 0.0
        if during is not None:
            during(watcher, procs)
        while any(procs[name].poll() is None for name in controllers):
            if time.monotonic() - started > spec.timeout_s:
                raise TimeoutError(f"{spec.job} did not finish in {spec.timeout_s}s; see {work}")
            if time.monotonic() - last_report > 5:
                last_report = time.monotonic()
                say(f"{spec.job}: step {watcher.job.step}")
            time.sleep(0.2)
        # the controller that ended the job (the standby, when the leader was killed)
        last = max(controllers, key=lambda name: procs[name].returncode == 0)
        if procs[last].returncode != 0:
            raise RuntimeError(f"{spec.job}: controller failed; see {work}/{last}.log")
        summary = json.loads(summary_paths[last].read_text())
        summary["watch_events"] = [e.to_dict() for e in watcher.job.events]
        summary["watch_progress"] = list(watcher.job.progress)
        summary["work_dir"] = str(work)
        return summary
    finally:
        watcher.close()
        group.stop_all(grace_s=10.0)


def steady_rate(summary: dict, batch: int, last: int) -> float:
    """Samples/s over the last ``last`` completed steps (by the controller's step times)."""
    history = sorted(summary["history"], key=lambda h: h["step"])[-(last + 1):]
    if len(history) < 2:
        return 0.0
    span = history[-1]["t"] - history[0]["t"]
    return (len(history) - 1) * batch / span if span > 0 else 0.0


def rate_between(summary: dict, batch: int, lo: int, hi: int) -> float:
    """Samples/s over steps lo..hi (by the controller's step completion times)."""
    times = {h["step"]: h["t"] for h in summary["history"]}
    if lo not in times or hi not in times or hi <= lo:
        return 0.0
    return (hi - lo) * batch / (times[hi] - times[lo])


def rates_side_by_side(runs: dict[str, tuple[float, list[tuple[int, float]]]],
                       skip: int) -> dict:
    """Steps/s of jobs that ran at the same time on one host, each over the window in which
    all of them were training, so that every job met the same host: ``runs`` maps a label to
    (the job's ``started_at``, its (step, t) history); each job's first ``skip`` steps (the
    warm-up) are left out. Returns the window and each job's steps/s in it, from its first
    to its last step end inside the window. Raises ``ValueError`` where the window holds
    fewer than three step ends of some job (the jobs hardly overlapped)."""
    ends = {label: sorted(started + t for _step, t in history)
            for label, (started, history) in runs.items()}
    if any(len(times) <= skip for times in ends.values()):
        raise ValueError("a job ran no step past its warm-up")
    low = max(times[skip] for times in ends.values())
    high = min(times[-1] for times in ends.values())
    rates = {}
    for label, times in ends.items():
        inside = [t for t in times if low <= t <= high]
        if len(inside) < 3:
            raise ValueError(f"{label}: {len(inside)} step ends while every job trained "
                             f"({max(0.0, high - low):.1f} s); run longer jobs")
        rates[label] = (len(inside) - 1) / (inside[-1] - inside[0])
    return {"window_s": round(high - low, 3), "steps_per_s": rates}


def save_figure(fig, path: Path) -> None:
    """Lay out, write and close a matplotlib figure."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_results(results: dict, out: Path, plot: Callable[[Path], None] | None = None) -> None:
    """Write a benchmark's JSON to ``out`` (and its PNG next to it, drawn by ``plot``), then
    print the JSON on stdout."""
    out.parent.mkdir(parents=True, exist_ok=True)
    if plot is not None:
        png = out.with_suffix(".png")
        plot(png)
        results["plot"] = str(png)
    out.write_text(json.dumps(results, indent=2))
    print(json.dumps(results))
