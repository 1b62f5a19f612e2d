"""The demo: a broker, a controller and N device agents as separate OS processes on this machine.

The demo supervises them as systemd would: a device that dies is the controller's business (it
recovers without it; ``restart_devices`` starts it again), a controller killed by a signal is
restarted with ``--resume``, a dead broker of the demo's own is restarted. Only Ctrl-C (or
SIGTERM) or the job failing ends the demo early; either way every process it started is stopped
(``runtime.supervise``): no orphans, no leftover broker.
"""

from __future__ import annotations

import json
import logging
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

from ftpipe_iot.errors import ConfigError, DemoError, ReportError
from ftpipe_iot.observability.report import write_report
from ftpipe_iot.observability.trace import TRACE_DIR, Trace, load_trace, write_trace
from ftpipe_iot.observability.watch import JobWatcher
from ftpipe_iot.planning.layouts import Layout
from ftpipe_iot.protocol.plan import TrainConfig
from ftpipe_iot.protocol.vocab import EventType
from ftpipe_iot.runtime.broker import BrokerKind, BrokerProcess
from ftpipe_iot.runtime.faults import Fault, FaultAction
from ftpipe_iot.runtime.preflight import check_job
from ftpipe_iot.runtime.supervise import ProcessGroup
from ftpipe_iot.transport.connection import BrokerConfig, parse_protocol

log = logging.getLogger(__name__)

# The demos' controller processes (coordinators in the collaborative modes): the first leader
# and the standby of --standby-controller.
CONTROLLER_NAMES = ("controller", "standby")
# How long an interrupted demo's controller may take to write its summary before it is killed
# (about 1 s on an idle host with its devices still running).
CONTROLLER_STOP_GRACE_S = 20.0

# Restarts of one kind of process after which the demo gives up (a crash loop is not recovery).
MAX_RESTARTS = 10  # per kind of process, also in the collaborative demo


def exit_text(code: int) -> str:
    """How a child ended, for a person: ``was killed by SIGKILL``, ``exited with code 1``."""
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


class DemoInterrupted(KeyboardInterrupt):
    """Ctrl-C or SIGTERM stopped the demo after its processes were stopped; ``summary`` is what
    the controller had done by then (``interrupted`` True), None when it wrote nothing."""

    def __init__(self, summary: dict | None) -> None:
        super().__init__("interrupted")
        self.summary = summary


class JobFailed(DemoError):
    """The job failed and its controller already printed why (its stderr is the demo's):
    the CLI says nothing more. ``summary`` is the controller's, ``error`` included."""

    def __init__(self, message: str, summary: dict) -> None:
        super().__init__(message)
        self.summary = summary


def read_summary(path: Path, work_dir: Path, started: float) -> dict | None:
    """The controller's summary at ``path`` with the demo's wall time and work dir, or None
    when there is none (yet)."""
    try:
        summary = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    summary["wall_s"] = round(time.monotonic() - started, 3)
    summary["work_dir"] = str(work_dir)
    return summary


def interrupted_summary(path: Path, work_dir: Path, started: float) -> dict | None:
    """What an interrupted demo reports: the controller's summary marked ``interrupted``."""
    summary = read_summary(path, work_dir, started)
    if summary is not None:
        summary["interrupted"] = True
    return summary


def last_error(log_text: str) -> str | None:
    """The reason a CLI process gave for exiting: its last ``Error:`` line."""
    lines = [line.strip() for line in log_text.splitlines() if line.startswith("Error:")]
    return lines[-1].removeprefix("Error:").strip() if lines else None


@dataclass
class DemoOptions:
    """What the demo runs: ``train`` goes to the controller as a JSON file; ``controller_args``
    and ``device_args`` are passed through to ``ftpipe-iot controller`` and ``device``.

    ``work_dir`` keeps logs, the summary and the report (default: ``default_work_dir``).
    ``layout`` goes to the controller (``--layout``): by default stage groups when the fleet
    planner predicts them faster. ``metrics_port_base`` N > 0 serves ``/metrics`` on port N
    for the controller and N+1..N+k for the devices dev0..dev(k-1); 0 serves none.
    """

    devices: int = 3
    job: str = "demo"
    broker_url: str | None = None
    embedded: bool = False
    train: TrainConfig = field(default_factory=TrainConfig)
    controller_args: list[str] = field(default_factory=list)
    device_args: list[str] = field(default_factory=list)
    work_dir: Path | None = None
    timeout_s: float = 900.0
    metrics_port_base: int = 0
    faults: list[Fault] = field(default_factory=list)
    restart_devices: bool = False
    standby_controller: bool = False  # a second controller that takes over (--standby)
    max_message_bytes: int | None = None
    save_model: Path | None = None  # the trained model's checkpoint [default: work_dir/model.pt]
    layout: Layout = Layout.AUTO
    signed: bool = True  # False: --insecure-unsigned (keys otherwise made in work_dir/keys)
    # the timeline is always recorded in work_dir/trace; this also writes trace.json
    write_trace: bool = False

    def __post_init__(self) -> None:
        if self.metrics_port_base and not 1024 <= self.metrics_port_base <= 65535 - self.devices:
            raise ConfigError(f"metrics_port_base {self.metrics_port_base} leaves no room for "
                             f"{self.devices} device ports below 65536 (or is privileged)")


def default_work_dir(job: str, now: datetime | None = None, root: Path | None = None) -> Path:
    """``runs/<job>-<YYYYmmdd-HHMMSS>`` under ``root`` (the current directory): kept after the
    demo, so its logs, summary and report can be looked at later."""
    stamp = (now or datetime.now()).strftime("%Y%m%d-%H%M%S")
    return (root or Path.cwd()) / "runs" / f"{job}-{stamp}"


class Demo:
    """Starts and supervises the demo's processes."""

    def __init__(self, options: DemoOptions) -> None:
        self.options = options
        self.broker: BrokerProcess | None = None
        self.work_dir = options.work_dir or default_work_dir(options.job)
        self.work_dir.mkdir(parents=True, exist_ok=True)
        self.children = ProcessGroup(self.work_dir, signed=options.signed)
        self.common: list[str] = []
        self.summary_path = self.work_dir / "summary.json"
        self.model_path = (options.save_model.resolve() if options.save_model
                           else self.work_dir / "model.pt")
        self.train_path = options.train.save(self.work_dir / "train.json")
        self.watcher: JobWatcher | None = None
        self.pending_faults = list(options.faults)
        self.injected: list[dict] = []
        self.expected_exit: set[str] = set()
        self.hung: set[str] = set()
        self.gone: dict[str, str] = {}  # device -> why it exited (not restarted)
        self.restarts = {"controller": 0, "devices": 0, "broker": 0}
        self.leader = "controller"  # the controller process that leads the job
        self._next_device = options.devices
        self.started = time.monotonic()

    def _spawn_device(self, index: int) -> None:
        self._spawn_named_device(f"dev{index}")

    def _spawn_named_device(self, name: str) -> None:
        index = int(name.removeprefix("dev"))
        model = self.options.train.model.name
        # The user asked for this model: let the demo's own devices import it.
        allow = ["--allow-model-module", model.partition(":")[0]] if ":" in model else []
        self.children.start(name, "device", "--name", name, *self.common, *allow,
                            *self._metrics_args(index + 1), *self.options.device_args)

    def _spawn_controller(self, resume: bool = False, name: str = "controller",
                          standby: bool = False) -> None:
        # The controller's progress lines are the demo's output: its stderr stays on ours.
        self.children.start(name, "controller", *self.common, "--devices",
                            str(self.options.devices), "--stop-devices",
                            "--summary-json", str(self.summary_path),
                            "--save-model", str(self.model_path),
                            "--layout", self.options.layout.value,
                            "--trace-dir", str(self.work_dir / TRACE_DIR),
                            *(["--resume"] if resume else ["--train-config", str(self.train_path)]),
                            *(["--standby"] if standby else self._metrics_args(0)),
                            *self.options.controller_args, log=standby)

    def _trace(self) -> Trace | None:
        try:
            return load_trace(self.work_dir)
        except (ReportError, OSError) as exc:
            log.warning("no timeline for the report: %s", exc)
            return None

    def _trace_figures(self) -> dict:
        """trace.json's path when asked for (or why there is none)."""
        if not self.options.write_trace:
            return {}
        try:
            return {"trace": str(write_trace(self.work_dir).path)}
        except (ReportError, OSError) as exc:
            return {"trace_error": str(exc)}

    def run(self) -> dict:
        """Run to the end; returns the controller's summary plus broker kind and wall time."""
        started = self.started = time.monotonic()
        previous = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}

        def interrupt(signum: int, _frame: object) -> None:
            raise KeyboardInterrupt

        # SIGINT too: a demo started by a parent that ignores it (a background job of a
        # non-interactive shell) must still stop on Ctrl-C.
        for sig in previous:
            signal.signal(sig, interrupt)
        try:
            # Everything that can be checked is checked before any process starts, the
            # cheapest first: a given broker (its URL, whether it answers), then the data and
            # the model (seconds: torch), then our own broker is started.
            if self.options.broker_url:
                self._watch(self.options.broker_url, BrokerKind.MOSQUITTO)
            check_job(self.options.train)
            broker_url, kind = self._start_broker()
            if self.watcher is None:
                self._watch(broker_url, kind)
            self.common = ["--job", self.options.job, "--broker", broker_url]
            if kind is BrokerKind.EMBEDDED:
                self.common += ["--mqtt-protocol", "3.1.1"]
            if self.options.max_message_bytes:
                self.common += ["--max-message-bytes", str(self.options.max_message_bytes)]
            for index in range(self.options.devices):
                self._spawn_device(index)
            self._spawn_controller()
            if self.options.standby_controller:
                self._spawn_controller(name="standby", standby=True)
            self._supervise(started)
            summary = json.loads(self.summary_path.read_text())
            summary.update(self._fleet_figures(summary))
            summary["broker"] = kind.value
            summary["wall_s"] = round(time.monotonic() - started, 3)
            summary["work_dir"] = str(self.work_dir)
            if self.model_path.exists():
                summary["model"] = str(self.model_path)
            summary.update(self._trace_figures())
            try:
                paths = write_report(summary, self.work_dir, self._trace())
            except (ReportError, OSError) as exc:
                # The training result stands without its pictures: say so, do not fail.
                log.warning("could not write the run report: %s", exc)
                summary["report_error"] = str(exc)
            else:
                summary["report_json"] = str(paths.json)
                summary["report_png"] = str(paths.png)
            return summary
        except KeyboardInterrupt:
            # Stop the controllers first, while the devices still run: a controller sends
            # its final state, takes in the devices' last spans and writes what it had done.
            # Stopped together, it would wait for spans from devices already gone, and on a
            # loaded host the grace ran out before it wrote the summary. Then the rest.
            self.children.stop([n for n in self.children.procs if n in CONTROLLER_NAMES],
                               grace_s=CONTROLLER_STOP_GRACE_S)
            self.stop()
            raise DemoInterrupted(interrupted_summary(self.summary_path, self.work_dir,
                                                      started)) from None
        finally:
            self.stop()
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def _watch(self, broker_url: str, kind: BrokerKind) -> None:
        """Connect the job's watcher; this checks the broker: an unreachable one or a bad URL
        is said plainly before any process starts."""
        protocol = parse_protocol("3.1.1" if kind is BrokerKind.EMBEDDED else "auto")
        self.watcher = JobWatcher(BrokerConfig.from_url(broker_url, protocol=protocol),
                                  self.options.job).start()

    def _metrics_args(self, offset: int) -> list[str]:
        """``--metrics-port`` for the process at ``offset`` (0 = controller, i+1 = dev i)."""
        base = self.options.metrics_port_base
        return ["--metrics-port", str(base + offset)] if base else []

    def _start_broker(self) -> tuple[str, BrokerKind]:
        if self.options.broker_url:
            return self.options.broker_url, BrokerKind.MOSQUITTO
        kind = BrokerKind.EMBEDDED if self.options.embedded else None
        self.broker = BrokerProcess(kind=kind, data_dir=self.work_dir / "broker")
        self.broker.start()
        assert self.broker.kind is not None
        return self.broker.url, self.broker.kind

    def _say(self, text: str) -> None:
        log.warning("%s", text)
        print(text, file=sys.stderr, flush=True)

    def _supervise(self, started: float) -> None:
        while not self._controller_finished():
            self._inject_due()
            self._check_devices()
            self._check_broker()
            if time.monotonic() - started > self.options.timeout_s:
                raise DemoError(f"demo did not finish within {self.options.timeout_s:.0f}s")
            time.sleep(0.1)
        self._wait_devices()

    def _controller_finished(self) -> bool:
        code = self.children.procs[self.leader].poll()
        if code is None or self.leader in self.expected_exit:
            return False
        if code == 0:
            return True
        standby = "standby"
        if code < 0 and self.leader != standby and standby in self.children.procs and \
                self.children.procs[standby].poll() is None:
            self._say(f"controller {exit_text(code)}: the standby controller takes over")
            self.leader = standby
            return False
        if code < 0 and self.restarts["controller"] < MAX_RESTARTS:
            self.restarts["controller"] += 1
            self._say(f"controller {exit_text(code)}: restarting it with --resume")
            self._spawn_controller(resume=True)
            return False
        summary = read_summary(self.summary_path, self.work_dir, self.started)
        if summary is not None and summary.get("error"):
            raise JobFailed(f"the job failed: {summary['error']}", summary)
        raise DemoError(f"controller {exit_text(code)}")

    def _check_devices(self) -> None:
        for name, proc in list(self.children.procs.items()):
            code = proc.poll()
            if name in CONTROLLER_NAMES or name in self.gone or code in (None, 0):
                continue
            reason = last_error(self.children.log(name))
            why = exit_text(code) + (f" ({reason})" if reason else "")
            if self.options.restart_devices and self.restarts["devices"] < MAX_RESTARTS:
                self.restarts["devices"] += 1
                self._say(f"{name} {why}: restarting it")
                self._spawn_named_device(name)
                continue
            self.gone[name] = why
            if name not in self.expected_exit:
                self._say(f"{name} {why}; the controller goes on without it")
        running = [n for n, p in self.children.procs.items()
                   if n not in CONTROLLER_NAMES and n not in self.gone]
        if not running:
            last = next(reversed(self.gone.items()))
            raise DemoError(f"every device has exited; {last[0]} {last[1]}")

    def _check_broker(self) -> None:
        broker = self.broker
        if broker is None or broker.proc is None or broker.proc.poll() is None:
            return
        if self.restarts["broker"] >= MAX_RESTARTS:
            raise DemoError(f"the broker exited with code {broker.proc.returncode} "
                            f"{self.restarts['broker']} times")
        self.restarts["broker"] += 1
        self._say(f"broker exited with code {broker.proc.returncode}: restarting it")
        broker.restart()

    # -- fault injection --------------------------------------------------------------------------
    def _inject_due(self) -> None:
        if self.watcher is None:
            return
        while self.pending_faults and self.watcher.job.step >= self.pending_faults[0].step:
            fault = self.pending_faults.pop(0)
            self._inject(fault)

    def _inject(self, fault: Fault) -> None:
        at = time.time()
        name = f"dev{fault.target}" if fault.target is not None else None
        log.warning("injecting fault %s", fault)
        print(f"fault: {fault}", file=sys.stderr, flush=True)
        if fault.action in (FaultAction.KILL, FaultAction.HANG, FaultAction.CONT):
            assert name is not None
            sig = {FaultAction.KILL: signal.SIGKILL, FaultAction.HANG: signal.SIGSTOP,
                   FaultAction.CONT: signal.SIGCONT}[fault.action]
            if not self.children.signal(name, sig):
                log.warning("fault %s: %s is not running", fault, name)
                return
            if fault.action is FaultAction.KILL:
                self.expected_exit.add(name)
            elif fault.action is FaultAction.HANG:
                self.hung.add(name)
            else:
                self.hung.discard(name)
        elif fault.action is FaultAction.JOIN:
            self._spawn_device(self._next_device)
            self._next_device += 1
        elif fault.action is FaultAction.BROKER_RESTART:
            if self.broker is None:
                log.warning("fault %s: the demo did not start the broker", fault)
                return
            self.broker.restart()
        elif fault.action is FaultAction.CONTROLLER_KILL:
            self.children.signal(self.leader, signal.SIGKILL)
        elif fault.action is FaultAction.CONTROLLER_RESTART:
            self.expected_exit.add("controller")
            self.children.signal("controller", signal.SIGKILL)
            self.children.wait("controller", 30)
            self._spawn_controller(resume=True)
            self.expected_exit.discard("controller")
        self.injected.append({"fault": str(fault), "action": fault.action.value,
                              "device": name, "at": at})

    def _fleet_figures(self, summary: dict) -> dict:
        """Failures and recoveries counted from the events topic (a resumed controller only
        knows its own part of the job), restarts, and the detection delay of each injected
        device fault, measured from the moment it was injected."""
        assert self.watcher is not None
        detections = self.watcher.events_of(EventType.FAILURE_DETECTED)
        detect = []
        for fault in self.injected:
            if fault["action"] not in ("kill", "hang"):
                continue
            later = [e.timestamp - fault["at"] for e in detections
                     if e.timestamp >= fault["at"] and fault["device"] in (e.event.devices or ())]
            if later:
                detect.append(round(min(later), 3))
        recovered = self.watcher.events_of(EventType.RECOVERY_DONE)
        return {"faults": [f["fault"] for f in self.injected], "restarts": dict(self.restarts),
                "exited": dict(self.gone),
                "failures_detected": len(detections), "recoveries": len(recovered),
                "recover_s": [round(e.event.recover_s, 3) for e in recovered
                              if e.event.recover_s is not None],
                "detect_silence_s": summary.get("detect_s", []), "detect_s": detect}

    def _wait_devices(self, timeout_s: float = 10.0) -> None:
        for name in list(self.hung):  # a stopped process cannot act on its shutdown command
            self.children.signal(name, signal.SIGCONT)
        deadline = time.monotonic() + timeout_s
        for name, proc in self.children.procs.items():
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning("%s did not exit after shutdown; stopping it", name)

    def stop(self) -> None:
        """Terminate every child (SIGCONT, SIGTERM, then SIGKILL) and the broker."""
        if self.watcher is not None:
            self.watcher.close()
            self.watcher = None
        self.children.stop_all()
        if self.broker is not None:
            self.broker.stop()
