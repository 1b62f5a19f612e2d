"""Process entry points of the collaborative modes: a data device, the server, the coordinator.
Each wires a real MQTT transport, a metrics server and signals to the library objects, like
``runtime.entry`` and ``runtime.controller_entry`` do for the pipeline's processes; the
coordinator leads with a lease term and may stand by for another (control/lease.py), as the
pipeline's controller does."""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from prometheus_client import CollectorRegistry

from ftpipe_iot.collab.agent import AgentOptions, CollabAgent
from ftpipe_iot.collab.client import DataDevice, LocalData
from ftpipe_iot.collab.config import COORDINATOR_NAME, CollabConfig
from ftpipe_iot.collab.coordinator import Coordinator, coordinator_will
from ftpipe_iot.collab.server import ServerAgent
from ftpipe_iot.collab.summary import CollabSummary
from ftpipe_iot.control.lease import LeaseVerdict, LeaseWatch
from ftpipe_iot.device.agent import device_will
from ftpipe_iot.errors import ConfigError
from ftpipe_iot.observability.metrics import serve_metrics
from ftpipe_iot.observability.progress import ProgressReporter
from ftpipe_iot.planning.profiles import DeviceProfile
from ftpipe_iot.protocol.signing import Credentials
from ftpipe_iot.protocol.topics import check_name
from ftpipe_iot.runtime.controller_entry import watch_lease
from ftpipe_iot.runtime.entry import ProcessOptions, on_signals, setup_process
from ftpipe_iot.transport.base import Will
from ftpipe_iot.transport.connection import BrokerConfig
from ftpipe_iot.transport.mqtt import MqttTransport

log = logging.getLogger("ftpipe_iot.collab")


def _connect(options: ProcessOptions, broker: BrokerConfig, client_id: str, will: Will
             ) -> tuple[MqttTransport, CollectorRegistry]:
    """Logging, threads and metrics of this process, and its (not yet connected) transport."""
    setup_process(options)
    registry = CollectorRegistry()
    serve_metrics(registry, options.metrics_port)
    return MqttTransport(broker, client_id=client_id, will=will), registry


def run_collab_device(name: str, job: str, broker: BrokerConfig, options: ProcessOptions,
                      data: str | None, server: bool, profile: DeviceProfile | None = None,
                      agent_options: AgentOptions = AgentOptions(),
                      credentials: Credentials | None = None) -> int:
    """Run a data device (``data`` names its samples) or a server until shut down."""
    check_name("device", name)
    check_name("job", job)
    local = LocalData.load(data) if data is not None else None  # refuse bad data before connecting
    transport, registry = _connect(options, broker, name, device_will(name, job, credentials))
    agent: CollabAgent
    if local is not None:
        agent = DataDevice(name, job, transport, registry, local, profile, agent_options,
                           credentials)
    else:
        assert server
        agent = ServerAgent(name, job, transport, registry, profile, agent_options, credentials)
    on_signals(agent.stopped.set)
    agent.serve_until_shutdown()
    return 0


def _coordinator_client_id(job: str) -> str:
    """A client id of this process's own: a coordinator and its standby must never share one
    (an old leader reconnecting under the same id would cut the new one off, and back)."""
    return f"ftpipe-coordinator-{job}-{os.urandom(3).hex()}"


def run_coordinator(config: CollabConfig, job: str, broker: BrokerConfig,
                    options: ProcessOptions, progress: ProgressReporter,
                    summary_path: Path | None = None, client_id: str | None = None,
                    credentials: Credentials | None = None) -> CollabSummary | None:
    """The coordinator of one collaborative or federated job, to the job's end; the summary
    goes to ``summary_path`` as JSON when given. It leads with a term newer than the one the
    broker retains (control/lease.py). While another coordinator leads the job, a ``resume``
    one waits as its standby (None when the job then ends under the other), and a new one is
    refused."""
    check_name("job", job)
    name = client_id or _coordinator_client_id(job)
    transport, registry = _connect(options, broker, name, coordinator_will(job, credentials))
    # Built before anything connects: a model or data that cannot work is said first.
    coordinator = Coordinator(job, config, transport, registry, progress,
                              credentials=credentials)
    watch = LeaseWatch()
    lease = watch_lease(broker, job, watch, f"{name}-lease", credentials, wait=False,
                        leader=COORDINATOR_NAME)
    if watch.live:
        if not config.resume:
            raise ConfigError(f"job {job} is led by a live coordinator (term {watch.term}); "
                              "pick another --job, or start this one with --standby")
        log.warning("a live coordinator leads job %s (term %d): this one waits as its standby",
                    job, watch.term)
        return _stand_by(job, broker, config, progress, registry, name, summary_path,
                         lambda: credentials, watch)
    return _lead(coordinator, lease.term, credentials, summary_path)


def run_standby_coordinator(config: CollabConfig, job: str, broker: BrokerConfig,
                            options: ProcessOptions, progress: ProgressReporter,
                            credentials: Callable[[], Credentials | None],
                            summary_path: Path | None = None, client_id: str | None = None
                            ) -> CollabSummary | None:
    """Back up the job's coordinator: watch its retained state and, once its Last Will says it
    is gone, take the lease with the next term and resume the job (the round it died in is
    redone from its start, collab/failover.py). None when the leader finished the job itself."""
    check_name("job", job)
    setup_process(options)
    registry = CollectorRegistry()
    serve_metrics(registry, options.metrics_port)
    return _stand_by(job, broker, config, progress, registry,
                     client_id or _coordinator_client_id(job), summary_path, credentials,
                     LeaseWatch())


def _stand_by(job: str, broker: BrokerConfig, config: CollabConfig, progress: ProgressReporter,
              registry: CollectorRegistry, name: str, summary_path: Path | None,
              credentials: Callable[[], Credentials | None], watch: LeaseWatch
              ) -> CollabSummary | None:
    stop = threading.Event()
    on_signals(stop.set)
    log.info("standby coordinator for job %s: waiting for the leader's lease to lapse", job)
    decision = watch_lease(broker, job, watch, f"{name}-standby", credentials(), stop=stop,
                           leader=COORDINATOR_NAME)
    if decision.verdict is not LeaseVerdict.TAKE_OVER:
        log.info("job %s ended under its leader; the standby has nothing to do", job)
        return None
    log.warning("the coordinator of job %s is gone: taking over with term %d", job,
                decision.term)
    progress.message(f"standby takes over job {job} (term {decision.term})")
    # Fresh credentials: a new session, newer than the leader's (docs/design.md §4, replays).
    keys = credentials()
    transport = MqttTransport(broker, client_id=name)
    coordinator = Coordinator(job, replace(config, resume=True), transport, registry, progress,
                              credentials=keys)
    return _lead(coordinator, decision.term, keys, summary_path)


def _lead(coordinator: Coordinator, term: int, credentials: Credentials | None,
          summary_path: Path | None) -> CollabSummary:
    """Run ``coordinator`` with lease ``term`` (its state, its rounds and its Last Will carry
    it)."""
    transport = coordinator.transport
    assert isinstance(transport, MqttTransport)
    coordinator.config = replace(coordinator.config, term=term,
                                 beat_s=transport.config.keepalive_s / 4)
    transport.will = coordinator_will(coordinator.job, credentials, term)
    on_signals(coordinator.interrupt)
    try:
        summary = coordinator.run()
    finally:
        transport.close()
    if summary_path is not None:
        summary.save(summary_path)
    return summary
