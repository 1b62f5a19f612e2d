"""Process entry points of the collaborative modes: a data device, the server, the coordinator.
Each wires a real MQTT transport, a metrics server and signals to the library objects, like
``runtime.entry`` does for the pipeline's processes."""

from __future__ import annotations

from pathlib import Path

from prometheus_client import CollectorRegistry

from ftpipe_iot.collab.agent import AgentOptions, CollabAgent
from ftpipe_iot.collab.client import DataDevice, LocalData
from ftpipe_iot.collab.config import CollabConfig
from ftpipe_iot.collab.coordinator import Coordinator, coordinator_will
from ftpipe_iot.collab.server import ServerAgent
from ftpipe_iot.collab.summary import CollabSummary
from ftpipe_iot.device.agent import device_will
from ftpipe_iot.observability.metrics import serve_metrics
from ftpipe_iot.observability.progress import ProgressReporter
from ftpipe_iot.planning.profiles import DeviceProfile
from ftpipe_iot.protocol.signing import Credentials
from ftpipe_iot.protocol.topics import check_name
from ftpipe_iot.runtime.entry import ProcessOptions, _on_signals, setup_process
from ftpipe_iot.transport.base import Will
from ftpipe_iot.transport.connection import BrokerConfig
from ftpipe_iot.transport.mqtt import MqttTransport


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
    _on_signals(agent.stopped.set)
    agent.serve_until_shutdown()
    return 0


def run_coordinator(config: CollabConfig, job: str, broker: BrokerConfig,
                    options: ProcessOptions, progress: ProgressReporter,
                    summary_path: Path | None = None, client_id: str | None = None,
                    credentials: Credentials | None = None) -> CollabSummary:
    """The coordinator of one collaborative or federated job, to the job's end; the summary
    goes to ``summary_path`` as JSON when given."""
    check_name("job", job)
    transport, registry = _connect(options, broker, client_id or f"ftpipe-coordinator-{job}",
                                   coordinator_will(job, credentials))
    coordinator = Coordinator(job, config, transport, registry, progress,
                              credentials=credentials)
    _on_signals(lambda: coordinator.fail("interrupted"))
    try:
        summary = coordinator.run()
    finally:
        transport.close()
    if summary_path is not None:
        summary.save(summary_path)
    return summary
