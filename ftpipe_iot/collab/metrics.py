"""Prometheus metrics of the collaborative and federated modes (listed in docs/observability.md).

Devices and the server keep the device metrics every agent has plus rounds, busy seconds and the
epsilon spent; the coordinator keeps the controller's job metrics plus the round, the server's idle
fraction, drop-outs, and per data device (label ``device``) rounds done and missed, epsilon and
idle fraction, read at scrape time like the pipeline's fleet figures.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge

from ftpipe_iot.observability.metrics import (
    ControllerMetrics,
    DeviceMetrics,
    FleetCollector,
    FleetFigures,
)


class CollabAgentMetrics(DeviceMetrics):
    """A data device's or the server's metrics."""

    def __init__(self, registry: CollectorRegistry) -> None:
        super().__init__(registry)
        self.rounds = Counter("ftpipe_collab_rounds_total",
                              "Rounds this process finished its part of", registry=registry)
        self.busy_seconds = Counter("ftpipe_collab_busy_seconds_total",
                                    "Seconds spent computing (emulated slow-down included)",
                                    registry=registry)
        self.epsilon = Gauge("ftpipe_dp_epsilon", "Differential-privacy epsilon spent so far "
                             "at the job's delta (data devices with DP on)", registry=registry)


@dataclass
class MemberFigures:
    """The coordinator's latest figures of one data device (NaN = not known yet)."""

    rounds_done: float = 0.0
    rounds_missed: float = 0.0
    epsilon: float = math.nan
    idle_fraction: float = math.nan


_MEMBER_GAUGES = (
    ("ftpipe_collab_device_rounds_done", "Rounds a data device contributed to", "rounds_done"),
    ("ftpipe_collab_device_rounds_missed", "Rounds a data device was left out of (dropped out, "
     "or joined late)", "rounds_missed"),
    ("ftpipe_collab_device_dp_epsilon", "Epsilon a data device reported spending", "epsilon"),
    ("ftpipe_collab_device_idle_ratio", "Fraction of the training time a data device was not "
     "computing", "idle_fraction"),
)


class CoordinatorMetrics(ControllerMetrics):
    """The coordinator's metrics: the controller's job metrics plus the collaborative ones."""

    def __init__(self, registry: CollectorRegistry) -> None:
        super().__init__(registry)
        self.round = Gauge("ftpipe_collab_round", "Current round (FedAvg interval)",
                           registry=registry)
        self.server_idle = Gauge("ftpipe_collab_server_idle_ratio", "Fraction of the training "
                                 "time the server side was not computing", registry=registry)
        self.dropouts = Counter("ftpipe_collab_dropouts_total",
                                "Data devices that dropped out of a round", registry=registry)
        self.aggregation_seconds = Counter("ftpipe_collab_aggregation_seconds_total",
                                           "Seconds spent in FedAvg", registry=registry)
        self.server_takeovers = Counter("ftpipe_collab_server_takeovers_total",
                                        "Standby servers that took over from a lost serving "
                                        "server", registry=registry)
        self.members = FleetFigures(MemberFigures)
        registry.register(FleetCollector(self.members, _MEMBER_GAUGES))
