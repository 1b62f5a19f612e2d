"""Process set-up that every role shares, and the device's entry point: wire a real transport,
metrics server and signals to a device agent. The CLI calls these; tests and the demo start them
as separate OS processes. The controller's entry points are in ``controller_entry``: a device
process never imports the controller (about a quarter of a second of CPU at every start here,
seconds on a small device)."""

from __future__ import annotations

import logging
import signal
import sys
from collections.abc import Callable
from dataclasses import dataclass

import torch
from prometheus_client import CollectorRegistry

from ftpipe_iot.device.agent import DeviceAgent, DeviceOptions, device_will
from ftpipe_iot.observability.metrics import serve_metrics
from ftpipe_iot.planning.profiles import DeviceProfile
from ftpipe_iot.protocol.signing import Credentials
from ftpipe_iot.protocol.topics import check_name
from ftpipe_iot.transport.connection import BrokerConfig
from ftpipe_iot.transport.mqtt import MqttTransport
from ftpipe_iot.transport.tuning import tune_for_large_messages

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ProcessOptions:
    """Per-process settings shared by devices and controllers."""

    metrics_port: int = 0
    threads: int = 1
    log_level: str = "INFO"


def setup_process(options: ProcessOptions) -> None:
    """Logging and torch threads. One intra-op thread by default: several stage processes share
    a small CPU, and oversubscribed thread pools are slower than one thread each."""
    logging.basicConfig(level=options.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if options.threads > 0:
        torch.set_num_threads(options.threads)
    tune_for_large_messages()


def on_signals(handler: Callable[[], None]) -> None:
    """Call ``handler`` on SIGTERM and on Ctrl-C."""
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: handler())


def run_device(name: str, job: str, broker: BrokerConfig, options: ProcessOptions,
               device_options: DeviceOptions = DeviceOptions(),
               profile: DeviceProfile | None = None,
               credentials: Credentials | None = None) -> int:
    """Run a device agent until shutdown (controller command, SIGTERM or Ctrl-C)."""
    check_name("device", name)
    check_name("job", job)
    setup_process(options)
    registry = CollectorRegistry()
    serve_metrics(registry, options.metrics_port)
    transport = MqttTransport(broker, client_id=name, will=device_will(name, job, credentials))
    agent = DeviceAgent(name, job, transport, registry, device_options, profile,
                        credentials=credentials)
    on_signals(agent.stopped.set)
    agent.start()
    try:
        agent.run()
    finally:
        agent.stop()
    return 0
