"""The controller's process entry points: a leader with its lease term (control/lease.py), a
standby that takes over when the leader is gone, and the lease watch both use (the
collaborative modes' coordinator uses it too). Kept apart from ``entry``, which a device
process imports, so that a device never loads the controller."""

from __future__ import annotations

import logging
import os
import queue
import threading
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from prometheus_client import CollectorRegistry

from ftpipe_iot.control.config import ControllerConfig, controller_will
from ftpipe_iot.control.controller import Controller
from ftpipe_iot.control.job import JobModel, prepare_job
from ftpipe_iot.control.lease import LeaseDecision, LeaseVerdict, LeaseWatch
from ftpipe_iot.control.summary import RunSummary
from ftpipe_iot.errors import ConfigError, FtpipeError
from ftpipe_iot.observability.metrics import MessagingMetrics, serve_metrics
from ftpipe_iot.observability.progress import ProgressReporter
from ftpipe_iot.protocol.messages import ControllerState
from ftpipe_iot.protocol.signing import Credentials
from ftpipe_iot.protocol.topics import Topics, check_name
from ftpipe_iot.runtime.entry import ProcessOptions, on_signals, setup_process
from ftpipe_iot.transport.connection import BrokerConfig
from ftpipe_iot.transport.messenger import Messenger
from ftpipe_iot.transport.mqtt import MqttTransport

log = logging.getLogger(__name__)


def _controller_client_id(job: str) -> str:
    """A client id of this process's own: a leader and its standby must never share one (an
    old leader reconnecting under the same id would cut the new one off, and back)."""
    return f"ftpipe-controller-{job}-{os.urandom(3).hex()}"


def watch_lease(broker: BrokerConfig, job: str, watch: LeaseWatch, client_id: str,
                credentials: Credentials | None = None, wait: bool = True,
                stop: threading.Event | None = None, leader: str = "controller"
                ) -> LeaseDecision:
    """Follow the job's retained controller state (verified like any message, from the sender
    ``leader``: the collaborative modes' coordinator is another name) until ``watch`` says take
    over or the job ended; with ``wait`` False only until the broker has delivered what it
    retains (a probe of our own comes back after it), for the term to lead with."""
    transport = MqttTransport(broker, client_id=client_id)  # no Last Will: a watcher is silent
    messenger = Messenger(transport, "lease-watch", job,
                          MessagingMetrics(CollectorRegistry(), "lease"), credentials=credentials)
    topics = Topics(job)
    probe = os.urandom(16)
    transport.connect()
    try:
        transport.subscribe(topics.state)
        if not wait:
            transport.subscribe(topics.probe, qos=1)
            transport.publish(topics.probe, probe, qos=1)
        while stop is None or not stop.is_set():
            try:
                incoming = transport.inbox.get(timeout=0.2)
            except queue.Empty:
                silent = watch.silence() if wait else LeaseDecision(LeaseVerdict.WAIT)
                if silent.verdict is LeaseVerdict.TAKE_OVER:
                    log.warning("the leader of job %s (term %d) has published nothing for "
                                "%.1f s: it hangs", job, watch.term,
                                watch.clock() - watch.heard_at)
                    return silent
                continue
            if incoming.topic == topics.probe:
                if incoming.payload == probe:
                    return LeaseDecision(LeaseVerdict.WAIT, watch.next_term())
                continue
            inbound = messenger.receive(incoming)
            if inbound is None or inbound.sender != leader or \
                    not isinstance(inbound.message, ControllerState):
                continue
            decision = watch.observe(inbound.message.state, inbound.message.term,
                                     inbound.message.beat_s)
            if decision.verdict is not LeaseVerdict.WAIT:
                return decision
        return LeaseDecision(LeaseVerdict.WAIT, watch.next_term())
    finally:
        transport.close()


def run_controller(job: str, broker: BrokerConfig, config: ControllerConfig,
                   options: ProcessOptions, progress: ProgressReporter,
                   client_id: str | None = None, summary_path: Path | None = None,
                   credentials: Credentials | None = None) -> RunSummary | None:
    """Run one job's controller to completion; write the summary JSON if asked. It leads with
    a term newer than the one the broker's retained state holds (control/lease.py). While
    another controller leads the job, a ``resume`` one waits as its standby (a restarted old
    leader does not take the lease back: None when the job then ends under the other), and a
    new one is refused. A ``resume`` of a job whose retained state says it is done has nothing
    to do (None); one that failed is resumed."""
    check_name("job", job)
    setup_process(options)
    registry = CollectorRegistry()
    serve_metrics(registry, options.metrics_port)
    name = client_id or _controller_client_id(job)
    transport = MqttTransport(broker, client_id=name)
    # Built before anything connects: a model or data that cannot work is said first.
    controller = Controller(job, config, transport, registry, progress, credentials=credentials)
    watch = LeaseWatch()
    lease = watch_lease(broker, job, watch, f"{name}-lease", credentials, wait=False)
    if watch.live:
        if not config.resume:
            raise ConfigError(f"job {job} is led by a live controller (term {watch.term}); "
                              "pick another --job, or start this one with --standby")
        log.warning("a live controller leads job %s (term %d): this one waits as its standby",
                    job, watch.term)
        return _stand_by(job, broker, config, progress, registry, name, summary_path,
                         lambda: credentials, watch)
    if config.resume and lease.verdict is LeaseVerdict.JOB_ENDED and lease.done:
        log.info("job %s is done (its retained state says so): nothing to resume", job)
        return None
    return _lead(controller, lease.term, credentials, summary_path)


def run_standby_controller(job: str, broker: BrokerConfig, config: ControllerConfig,
                           options: ProcessOptions, progress: ProgressReporter,
                           credentials: Callable[[], Credentials | None],
                           client_id: str | None = None, summary_path: Path | None = None
                           ) -> RunSummary | None:
    """Back up the job's controller: watch its retained state and, once its Last Will says it
    is gone, take the lease with the next term and resume the job exactly where its last
    complete checkpoint left off. None when the leader finished the job itself."""
    check_name("job", job)
    setup_process(options)
    registry = CollectorRegistry()
    serve_metrics(registry, options.metrics_port)
    return _stand_by(job, broker, config, progress, registry,
                     client_id or _controller_client_id(job), summary_path, credentials,
                     LeaseWatch())


def _stand_by(job: str, broker: BrokerConfig, config: ControllerConfig,
              progress: ProgressReporter, registry: CollectorRegistry, name: str,
              summary_path: Path | None, credentials: Callable[[], Credentials | None],
              watch: LeaseWatch) -> RunSummary | None:
    stop = threading.Event()
    on_signals(stop.set)
    prepared = _prepare_in_advance(config)
    log.info("standby controller for job %s: waiting for the leader's lease to lapse", job)
    decision = watch_lease(broker, job, watch, f"{name}-standby", credentials(), stop=stop)
    if decision.verdict is not LeaseVerdict.TAKE_OVER:
        log.info("job %s ended under its leader; the standby has nothing to do", job)
        return None
    log.warning("the leader of job %s is gone: taking over with term %d", job, decision.term)
    progress.message(f"standby takes over job {job} (term {decision.term})")
    # Fresh credentials: a new session, newer than the leader's (docs/design.md §4, replays).
    keys = credentials()
    transport = MqttTransport(broker, client_id=name)
    controller = Controller(job, replace(config, resume=True), transport, registry, progress,
                            credentials=keys, prepared=prepared)
    return _lead(controller, decision.term, keys, summary_path)


def _prepare_in_advance(config: ControllerConfig) -> JobModel | None:
    """The job's data and reference costs, prepared while the leader runs (the standby has its
    options): a take-over then starts from the retained plan and weights at once. None when
    it cannot be prepared here (the take-over prepares from the retained plan instead)."""
    try:
        return prepare_job(config.train)
    except FtpipeError as exc:
        log.warning("the standby could not prepare the job in advance (%s); it will when it "
                    "takes over", exc)
        return None


def _lead(controller: Controller, term: int, credentials: Credentials | None,
          summary_path: Path | None) -> RunSummary | None:
    """Run ``controller`` with lease ``term`` (its state and its Last Will carry it), its
    state beating at a quarter of the keepalive (control/lease.py). None when it resumed a
    job its checkpoints show done (nothing to do; it says "done" again on the lease record)."""
    transport = controller.transport
    assert isinstance(transport, MqttTransport)
    controller.config = replace(controller.config, term=term,
                                beat_s=transport.config.keepalive_s / 4)
    transport.will = controller_will(controller.job, credentials, term)
    stop = threading.Event()

    def interrupt() -> None:
        stop.set()
        controller.interrupt()

    on_signals(interrupt)
    try:
        summary = controller.run()
    finally:
        transport.close()
    if controller.nothing_to_resume:
        return None
    if summary_path is not None:
        summary_path.parent.mkdir(parents=True, exist_ok=True)
        summary_path.write_text(summary.to_json(indent=2))
    return summary
