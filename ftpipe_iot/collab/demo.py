"""The demo of the collaborative and federated modes: a broker, a coordinator, N data devices
that each start with their own share of the training data (written to ``.npz`` files, IID or
Dirichlet non-IID), and in collaborative mode a server, as separate OS processes.

Processes are started and stopped through ``runtime.supervise.ProcessGroup`` (own sessions, die
with their parent). The demo supervises them as the pipeline demo does: a data device that dies
is the coordinator's business (it leaves the device out of its round and takes it back at the
next; ``restart_devices`` starts it again); a server that dies too, when a standby server
(``config.standby_servers``) can take over; a coordinator killed by a signal is taken over by
the standby coordinator (``standby_controller``) or restarted with ``--resume``. The demo fails
when the coordinator fails, every server has died or the broker dies. Faults
(``runtime.faults``: ``server-kill@round=N``, ``controller-kill@step=N``, ``kill:I@...``) are
injected with real signals when the coordinator's retained status reaches their point. Ctrl-C or
SIGTERM stops every process and reports what was done.
"""

from __future__ import annotations

import json
import logging
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path

from ftpipe_iot.collab.config import CollabConfig
from ftpipe_iot.collab.data_split import PartitionSpec, class_counts, split_indices, write_shards
from ftpipe_iot.core.data import Dataset
from ftpipe_iot.errors import DemoError, FaultSpecError, ReportError
from ftpipe_iot.observability.report import write_report
from ftpipe_iot.observability.watch import JobWatcher
from ftpipe_iot.protocol.collab import CollabStatus
from ftpipe_iot.protocol.vocab import CollabMode
from ftpipe_iot.runtime.broker import BrokerKind, BrokerProcess
from ftpipe_iot.runtime.demo import (
    CONTROLLER_NAMES,
    CONTROLLER_STOP_GRACE_S,
    MAX_RESTARTS,
    DemoInterrupted,
    JobFailed,
    default_work_dir,
    exit_text,
    interrupted_summary,
    last_error,
    read_summary,
)
from ftpipe_iot.runtime.faults import Fault, FaultAction, FaultUnit, fault_schedule
from ftpipe_iot.runtime.preflight import check_job
from ftpipe_iot.runtime.supervise import ProcessGroup
from ftpipe_iot.transport.connection import BrokerConfig, parse_protocol

log = logging.getLogger(__name__)


@dataclass
class CollabDemoOptions:
    """What the demo runs. ``config.devices`` data devices dev0..dev(N-1); ``config.train.data``
    is split among them (its training part) and its test part is the coordinator's test set."""

    config: CollabConfig = field(default_factory=CollabConfig)
    job: str = "demo"
    broker_url: str | None = None
    embedded: bool = False
    work_dir: Path | None = None
    timeout_s: float = 1800.0
    metrics_port_base: int = 0
    partition: PartitionSpec = field(default_factory=PartitionSpec)
    device_profile: Path | None = None
    server_profile: Path | None = None
    device_args: list[str] = field(default_factory=list)
    coordinator_args: list[str] = field(default_factory=list)
    signed: bool = True  # False: --insecure-unsigned (keys otherwise made in work_dir/keys)
    restart_devices: bool = False  # start a data device again when it dies
    faults: list[Fault] = field(default_factory=list)
    standby_controller: bool = False  # a second coordinator that takes over (--standby)


def collab_faults(texts: list[str], devices: int, mode: CollabMode, standby_servers: int = 0
                  ) -> list[Fault]:
    """The faults of a collaborative or fedavg demo (``runtime.faults``), refusing what this
    demo cannot do."""
    faults = fault_schedule(texts, devices, collaborative=True)
    for fault in faults:
        if fault.action is FaultAction.SERVER_KILL and mode is not CollabMode.COLLABORATIVE:
            raise FaultSpecError(f"{fault}: --mode {mode.value} has no server")
    return faults


def server_names(config: CollabConfig) -> list[str]:
    """The demo's servers: ``server`` and a ``serverI`` per standby."""
    if config.mode is not CollabMode.COLLABORATIVE:
        return []
    return ["server", *(f"server{i}" for i in range(1, config.standby_servers + 1))]


def coordinator_args(config: CollabConfig) -> list[str]:
    """The ``controller`` options that give a coordinator ``config`` (besides the training
    config, which goes as a JSON file)."""
    args = ["--mode", config.mode.value, "--devices", str(config.devices),
            "--heartbeat-timeout", str(config.heartbeat_timeout_s),
            "--wait-devices", str(config.wait_devices_s)]
    if config.aggregate_every is not None:
        args += ["--aggregate-every", str(config.aggregate_every)]
    if config.split_point is not None:
        args += ["--split-point", str(config.split_point)]
    if not config.auto_micro_batches:
        args.append("--fixed-micro-batches")
    if config.standby_servers:
        args += ["--standby-servers", str(config.standby_servers)]
    if config.privacy is not None:
        args += ["--dp-noise-multiplier", str(config.privacy.noise_multiplier),
                 "--dp-max-grad-norm", str(config.privacy.max_grad_norm),
                 "--dp-delta", str(config.privacy.delta)]
    if config.save_model is not None:
        args += ["--save-model", str(config.save_model)]
    if config.init_from is not None:
        args += ["--init-from", str(Path(config.init_from).resolve())]
    return args


@contextmanager
def _sigterm_interrupts() -> Iterator[None]:
    """SIGTERM (and SIGINT, even when a parent left it ignored) stops the demo like Ctrl-C
    (KeyboardInterrupt), so the clean-up runs."""
    def interrupt(signum: int, _frame: object) -> None:
        raise KeyboardInterrupt

    previous = {sig: signal.signal(sig, interrupt) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


class CollabDemo:
    """Starts and supervises the demo's processes; ``run`` returns the summary."""

    def __init__(self, options: CollabDemoOptions) -> None:
        self.work_dir = options.work_dir or default_work_dir(options.job)
        self.work_dir.mkdir(parents=True, exist_ok=True)
        # like the pipeline demo, the trained model is a checkpoint in the work dir by default
        self.model_path = (options.config.save_model or self.work_dir / "model.pt").resolve()
        self.options = replace(options, config=replace(options.config,
                                                       save_model=self.model_path))
        self.children = ProcessGroup(self.work_dir, signed=options.signed)
        self.broker: BrokerProcess | None = None
        self.summary_path = self.work_dir / "summary.json"
        self.device_argv: dict[str, list[str]] = {}
        self.coordinator_argv: list[str] = []
        self.gone: dict[str, str] = {}  # data device or server -> why it exited (not restarted)
        self.restarts = 0
        self.coordinator_restarts = 0
        self.leader = "controller"  # the coordinator process that leads the job
        self.expected_exit: set[str] = set()
        self.hung: set[str] = set()
        self.pending_faults = list(options.faults)
        self.injected: list[dict] = []
        self.watcher: JobWatcher | None = None
        self.started = time.monotonic()

    def _shards(self, data: Dataset) -> tuple[list[Path], dict]:
        config = self.options.config
        parts = split_indices(data.y_train, config.devices, self.options.partition,
                              config.train.seed, min_samples=config.train.batch_size)
        paths = write_shards(data.x_train, data.y_train, parts, self.work_dir / "data")
        return paths, {"partition": str(self.options.partition),
                       "samples": [len(p) for p in parts],
                       "classes": class_counts(data.y_train, parts, data.num_classes)}

    def _metrics(self, offset: int) -> list[str]:
        base = self.options.metrics_port_base
        return ["--metrics-port", str(base + offset)] if base else []

    def run(self) -> dict:
        """Run to the end; returns the coordinator's summary plus the data split, the broker,
        the wall time and which data devices exited. Raises ``DemoInterrupted`` on Ctrl-C or
        SIGTERM, ``JobFailed`` when the coordinator failed, ``DemoError`` otherwise."""
        started = self.started = time.monotonic()
        config = self.options.config
        with _sigterm_interrupts():
            try:
                # Bad data, model or split point: said now, before any process starts.
                data = check_job(config.train, config.split_point,
                                 config.mode is CollabMode.COLLABORATIVE)
                shards, split = self._shards(data)
                url, kind = self._broker()
                common = ["--job", self.options.job, "--broker", url]
                if kind is BrokerKind.EMBEDDED:
                    common += ["--mqtt-protocol", "3.1.1"]
                if self.options.faults:
                    self.watcher = JobWatcher(BrokerConfig.from_url(url, protocol=parse_protocol(
                        "3.1.1" if kind is BrokerKind.EMBEDDED else "auto")),
                        self.options.job).start()
                self._start(shards, common)
                self._supervise(started + self.options.timeout_s)
            except KeyboardInterrupt:
                # The coordinators are stopped first, while the devices still run: each
                # writes what it had done (as the pipeline demo's controller does).
                self.children.stop([n for n in self.children.procs if n in CONTROLLER_NAMES],
                                   grace_s=CONTROLLER_STOP_GRACE_S)
                self.stop()
                raise DemoInterrupted(self._interrupted(started)) from None
            finally:
                self.stop()
        summary = json.loads(self.summary_path.read_text())
        summary["collab"]["data_split"] = split
        if self.model_path.exists():
            summary["model"] = str(self.model_path)
        summary.update(broker=kind.value, wall_s=round(time.monotonic() - started, 3),
                       work_dir=str(self.work_dir), **self._figures())
        return {**summary, **self._report(summary)}

    def _figures(self) -> dict:
        """What the demo itself saw: exits, restarts, the faults it injected."""
        return {"exited": dict(self.gone),
                "restarts": {"devices": self.restarts, "controller": self.coordinator_restarts},
                "faults": [f["fault"] for f in self.injected]}

    def _interrupted(self, started: float) -> dict | None:
        summary = interrupted_summary(self.summary_path, self.work_dir, started)
        if summary is not None:
            summary.update(self._figures())
        return summary

    def _report(self, summary: dict) -> dict[str, str]:
        """Where the run report went, or why there is none (the result stands without it)."""
        try:
            paths = write_report(summary, self.work_dir)
        except (ReportError, OSError) as exc:
            log.warning("no run report: %s", exc)
            return {"report_error": str(exc)}
        return {"report_json": str(paths.json), "report_png": str(paths.png)}

    def _broker(self) -> tuple[str, BrokerKind]:
        """The broker to use: the one given, or one of our own (Mosquitto, else embedded)."""
        if not self.options.broker_url:
            self.broker = BrokerProcess(
                kind=BrokerKind.EMBEDDED if self.options.embedded else None,
                data_dir=self.work_dir / "broker")
            self.broker.start()
            assert self.broker.kind is not None
            return self.broker.url, self.broker.kind
        return self.options.broker_url, BrokerKind.MOSQUITTO

    def _start(self, shards: list[Path], common: list[str]) -> None:
        options, config = self.options, self.options.config
        profile = ["--profile", str(options.device_profile)] if options.device_profile else []
        model = config.train.model.name
        # The user asked for this model: let the demo's own devices import it.
        allow = ["--allow-model-module", model.partition(":")[0]] if ":" in model else []
        server = ["--profile", str(options.server_profile)] if options.server_profile else []
        for offset, name in enumerate(server_names(config)):
            self.children.start(name, "device", "--name", name, "--server", *common,
                                *server, *allow, *self._metrics(config.devices + 1 + offset),
                                *options.device_args)
        for index, shard in enumerate(shards):
            name = f"dev{index}"
            self.device_argv[name] = ["device", "--name", name, "--data", f"npz:{shard}",
                                      *common, *profile, *allow, *self._metrics(index + 1),
                                      *options.device_args]
            self.children.start(name, *self.device_argv[name])
        train_path = config.train.save(self.work_dir / "train.json")
        self.coordinator_argv = ["controller", *common, "--train-config", str(train_path),
                                 *coordinator_args(config), "--stop-devices", "--summary-json",
                                 str(self.summary_path), *options.coordinator_args]
        # The coordinator's progress lines are the demo's output: its stderr stays on ours.
        self.children.start("controller", *self.coordinator_argv, *self._metrics(0),
                            log=False)
        if options.standby_controller:
            self.children.start("standby", *self.coordinator_argv, "--standby")

    def _say(self, text: str) -> None:
        log.warning("%s", text)
        print(text, file=sys.stderr, flush=True)

    def _check_devices(self) -> None:
        """A data device that exited is left to the coordinator (restarted with
        ``restart_devices``); only when none is left can the job not go on."""
        for name in self.device_argv:
            code = self.children.procs[name].poll()
            if name in self.gone or code in (None, 0):
                continue
            reason = last_error(self.children.log(name))
            why = exit_text(code) + (f" ({reason})" if reason else "")
            if self.options.restart_devices and self.restarts < MAX_RESTARTS:
                self.restarts += 1
                self._say(f"{name} {why}: restarting it")
                self.children.start(name, *self.device_argv[name])
                continue
            self.gone[name] = why
            self._say(f"{name} {why}; the coordinator goes on without it")
        if self.device_argv and all(name in self.gone for name in self.device_argv):
            last = next(reversed(self.gone.items()))
            raise DemoError(f"every data device has exited; {last[0]} {last[1]}")

    def _failure(self) -> str | None:
        """Why the run cannot go on: every server or the broker exited. A server that exits
        while another is running is the coordinator's business (a standby takes over)."""
        servers = server_names(self.options.config)
        for name in servers:
            code = self.children.procs[name].poll()
            if name in self.gone or code in (None, 0):
                continue
            self.gone[name] = exit_text(code)
            if len(self.gone.keys() & set(servers)) < len(servers):
                self._say(f"server {name} {exit_text(code)}; a standby server takes over")
        if servers and all(name in self.gone for name in servers):
            name = servers[-1]
            return f"every server has exited (the last: {name} {self.gone[name]}); its log: " \
                   f"{self.children.log_path(name)}"
        broker = self.broker.proc if self.broker is not None else None
        if broker is not None and broker.poll() is not None:
            return f"the broker exited with code {broker.returncode}"
        return None

    def _supervise(self, deadline: float) -> None:
        """Until the coordinator exits; then give the devices it shut down time to go."""
        while not self._coordinator_finished():
            self._inject_due()
            self._check_devices()
            problem = self._failure()
            if problem is None and time.monotonic() > deadline:
                problem = f"demo did not finish within {self.options.timeout_s:.0f}s"
            if problem is not None:
                summary = read_summary(self.summary_path, self.work_dir, self.started)
                if summary is not None and summary.get("error"):
                    summary.update(self._figures())
                    raise JobFailed(f"the job failed: {summary['error']}", summary)
                raise DemoError(problem)
            time.sleep(0.1)
        for name in list(self.hung):  # a stopped process cannot act on its shutdown command
            self.children.signal(name, signal.SIGCONT)
        for name in self.children.procs:
            try:
                self.children.wait(name, 10.0)
            except subprocess.TimeoutExpired:
                log.warning("%s did not exit after the job; stopping it", name)

    def _coordinator_finished(self) -> bool:
        """Whether the leading coordinator has ended the job; a coordinator killed by a signal
        is taken over by the standby coordinator, or restarted with ``--resume``."""
        code = self.children.procs[self.leader].poll()
        if code is None:
            return False
        if code == 0:
            return True
        standby = self.children.procs.get("standby")
        if code < 0 and self.leader != "standby" and standby is not None and \
                standby.poll() is None:
            self._say(f"coordinator {exit_text(code)}: the standby coordinator takes over")
            self.leader = "standby"
            return False
        if code < 0 and self.coordinator_restarts < MAX_RESTARTS:
            self.coordinator_restarts += 1
            self._say(f"coordinator {exit_text(code)}: restarting it with --resume")
            self.leader = "controller"
            self.children.start("controller", *self.coordinator_argv, "--resume",
                                *self._metrics(0), log=False)
            return False
        summary = read_summary(self.summary_path, self.work_dir, self.started)
        if summary is not None and summary.get("error"):
            summary.update(self._figures())
            raise JobFailed(f"the job failed: {summary['error']}", summary)
        raise DemoError(f"the coordinator {exit_text(code)}")

    # -- fault injection --------------------------------------------------------------------------
    def _inject_due(self) -> None:
        status = self.watcher.job.collab if self.watcher is not None else None
        if status is None:
            return
        for fault in [f for f in self.pending_faults if _due(f, status)]:
            self.pending_faults.remove(fault)
            self._inject(fault, status)

    def _inject(self, fault: Fault, status: CollabStatus) -> None:
        log.warning("injecting fault %s", fault)
        print(f"fault: {fault}", file=sys.stderr, flush=True)
        if fault.action is FaultAction.SERVER_KILL:
            target = status.server
        elif fault.action in (FaultAction.CONTROLLER_KILL, FaultAction.CONTROLLER_RESTART):
            target = self.leader
        else:
            target = f"dev{fault.target}"
        sig = {FaultAction.HANG: signal.SIGSTOP, FaultAction.CONT: signal.SIGCONT}.get(
            fault.action, signal.SIGKILL)
        if target is None or not self.children.signal(target, sig):
            log.warning("fault %s: %s is not running", fault, target)
            return
        if fault.action is FaultAction.HANG:
            self.hung.add(target)
        elif fault.action is FaultAction.CONT:
            self.hung.discard(target)
        self.injected.append({"fault": str(fault), "target": target, "at": time.time()})

    def stop(self) -> None:
        if self.watcher is not None:
            self.watcher.close()
            self.watcher = None
        self.children.stop_all()
        if self.broker is not None:
            self.broker.stop()


def _due(fault: Fault, status: CollabStatus) -> bool:
    """Whether the coordinator's status has reached the fault's point: ``@round=N`` once N
    rounds are done, ``@step=N`` once the fleet is at iteration N."""
    reached = status.round if fault.unit is FaultUnit.ROUND else status.iteration
    return reached >= fault.step
