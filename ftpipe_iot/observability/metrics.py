"""Prometheus metrics on an injected registry, and a drop counter that logs once per reason.

Names follow Prometheus conventions: prefix ``ftpipe_``, base units, ``_total`` for counters.
"""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from ftpipe_iot.protocol.vocab import DropReason, FailureCause
from ftpipe_iot.transport.base import Traffic

if TYPE_CHECKING:
    from ftpipe_iot.transport.bulk import BulkStats

_TIME_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
                 10.0)



class MessagingMetrics:
    """Traffic counters every process has (device and controller alike)."""

    def __init__(self, registry: CollectorRegistry, role: str) -> None:
        self.role = role
        self.messages_sent = Counter("ftpipe_messages_sent_total", "MQTT messages published",
                                     ["kind"], registry=registry)
        self.messages_received = Counter("ftpipe_messages_received_total",
                                         "Whole messages received and decoded", ["kind"],
                                         registry=registry)
        self.bytes_sent = Counter("ftpipe_sent_bytes_total", "Payload bytes published",
                                  registry=registry)
        self.bytes_received = Counter("ftpipe_received_bytes_total", "Payload bytes received",
                                      registry=registry)
        self.dropped = Counter("ftpipe_messages_dropped_total",
                               "Messages dropped as unusable, by reason", ["reason"],
                               registry=registry)
        for reason in DropReason:
            self.dropped.labels(reason=reason.value)
        self.crypto_seconds = Counter(
            "ftpipe_crypto_seconds_total",
            "CPU seconds spent signing or tagging sent frames and verifying received ones",
            ["direction", "kind"], registry=registry)
        self.queue_depth = Gauge("ftpipe_inbox_queue_depth",
                                 "Messages waiting in the inbox for the worker thread",
                                 registry=registry)
        self.outbox_queued_bytes = Gauge(
            "ftpipe_outbox_queued_bytes", "Bulk bytes waiting in the outbox, by traffic class",
            ["traffic"], registry=registry)
        self.outbox_in_flight_bytes = Gauge(
            "ftpipe_outbox_in_flight_bytes",
            "Bulk bytes handed to the connection and not yet acknowledged", registry=registry)
        self.outbox_window_bytes = Gauge(
            "ftpipe_outbox_window_bytes",
            "Bulk bytes the outbox lets be unacknowledged at once (drain rate x target delay)",
            registry=registry)
        self.outbox_drain_rate = Gauge(
            "ftpipe_outbox_drain_rate_bytes_per_second",
            "Measured rate at which bulk bytes are acknowledged", registry=registry)

    def watch_outbox(self, stats: Callable[[], BulkStats]) -> None:
        """Read the outbox's gauges from ``stats`` at every scrape (nothing on the hot path)."""
        for traffic in (Traffic.STAGE_DATA, Traffic.REPLICA):
            self.outbox_queued_bytes.labels(traffic=traffic.value).set_function(
                lambda t=traffic: stats().queued_bytes.get(t, 0))
        self.outbox_in_flight_bytes.set_function(lambda: stats().in_flight_bytes)
        self.outbox_window_bytes.set_function(lambda: stats().window_bytes)
        self.outbox_drain_rate.set_function(lambda: stats().drain_bytes_per_s)


class DeviceMetrics(MessagingMetrics):
    """Device-side metrics."""

    def __init__(self, registry: CollectorRegistry) -> None:
        super().__init__(registry, "device")
        self.forward_seconds = Histogram("ftpipe_stage_forward_seconds",
                                         "Forward compute time per step on this device",
                                         buckets=_TIME_BUCKETS, registry=registry)
        self.backward_seconds = Histogram("ftpipe_stage_backward_seconds",
                                          "Backward compute time per step on this device",
                                          buckets=_TIME_BUCKETS, registry=registry)
        self.samples = Counter("ftpipe_device_samples_total",
                               "Training samples forwarded by this device", registry=registry)
        self.steps = Counter("ftpipe_device_steps_total", "Optimizer steps applied",
                             registry=registry)
        self.stage = Gauge("ftpipe_device_stage", "Stage index this device holds (-1 = none)",
                           registry=registry)
        self.replication_bytes = Counter("ftpipe_replication_sent_bytes_total",
                                         "Bytes of weights and optimizer state replicated",
                                         registry=registry)
        self.takeovers = Counter("ftpipe_device_takeovers_total",
                                 "Micro-batches computed for a late or dead holder of the stage",
                                 registry=registry)


class ControllerMetrics(MessagingMetrics):
    """Controller-side metrics, including per-device figures taken from heartbeats."""

    def __init__(self, registry: CollectorRegistry) -> None:
        super().__init__(registry, "controller")
        self.step = Gauge("ftpipe_training_step", "Steps completed", registry=registry)
        self.epoch = Gauge("ftpipe_training_epoch", "Current epoch", registry=registry)
        self.samples = Counter("ftpipe_training_samples_total", "Training samples completed",
                               registry=registry)
        self.samples_per_second = Gauge("ftpipe_training_samples_per_second",
                                        "Training throughput over the last steps",
                                        registry=registry)
        self.loss = Gauge("ftpipe_training_loss", "Mean training loss of the last step",
                          registry=registry)
        self.test_accuracy = Gauge("ftpipe_test_accuracy", "Test accuracy after the last epoch",
                                   registry=registry)
        self.plan_version = Gauge("ftpipe_plan_version", "Version of the current plan",
                                  registry=registry)
        self.predicted_step_seconds = Gauge(
            "ftpipe_plan_predicted_step_seconds",
            "The step model's time for the plan and shares in force", registry=registry)
        self.prediction_error = Gauge(
            "ftpipe_plan_prediction_error_ratio",
            "Measured over predicted step time of the plan in force, minus 1 (median step "
            "after the warm-up)", registry=registry)
        self.loss_curvature = Gauge(
            "ftpipe_loss_curvature",
            "Largest curvature of the loss along the layers the schedule's stability bound is "
            "about (control/curvature_watch.py)", registry=registry)
        self.stable_curvature = Gauge(
            "ftpipe_stable_curvature",
            "Largest curvature the schedule tolerates at the job's learning rate",
            registry=registry)
        self.message_cost_seconds = Gauge(
            "ftpipe_plan_message_cost_seconds",
            "The per-message cost the step model was fitted to (planning/calibration.py)",
            registry=registry)
        self.stages = Gauge("ftpipe_plan_stages", "Number of stages in the current plan",
                            registry=registry)
        self.devices_online = Gauge("ftpipe_devices_online", "Devices whose status is online",
                                    registry=registry)
        self.failures = Counter("ftpipe_failures_total", "Device failures detected, by signal",
                                ["cause"], registry=registry)
        # Labelled counters export nothing until a label set is used: start every known cause
        # at zero so that rate()/increase() work from the first scrape.
        for cause in FailureCause:
            self.failures.labels(cause=cause.value)
        self.recoveries = Counter("ftpipe_recoveries_total", "Completed recoveries",
                                  registry=registry)
        self.detection_seconds = Histogram("ftpipe_failure_detection_seconds",
                                           "Seconds from a failure to its detection",
                                           buckets=(0.5, 1, 2, 5, 10, 20, 30, 60),
                                           registry=registry)
        self.recovery_seconds = Histogram("ftpipe_recovery_seconds",
                                          "Seconds from detection to training resumed",
                                          buckets=(0.5, 1, 2, 5, 10, 20, 30, 60),
                                          registry=registry)
        self.replication_interval = Gauge(
            "ftpipe_replication_interval_steps",
            "Steps between replications, as paced to the devices' links", registry=registry)
        self.replication_overhead = Gauge(
            "ftpipe_replication_overhead_ratio",
            "The largest share of training time a device's replica upload takes at the "
            "interval in force", registry=registry)
        self.repartitions = Counter("ftpipe_repartitions_total",
                                    "Plan changes made to rebalance the pipeline",
                                    registry=registry)
        self.fleet = FleetFigures()
        registry.register(FleetCollector(self.fleet))


@dataclass
class DeviceFigures:
    """The latest per-device figures the controller knows (NaN = not known yet)."""

    heartbeat_unix_s: float = math.nan
    step_compute_s: float = math.nan
    capacity_factor: float = math.nan
    link_bytes_per_s: float = math.nan
    stage: int = -1
    share: float = math.nan


class FleetFigures:
    """Per-device figures written by the controller's worker and read at scrape time (the lock
    keeps a scrape from seeing a half-updated fleet). ``make`` builds one device's figures (a
    dataclass of floats, NaN = not known): ``DeviceFigures`` unless another mode keeps others."""

    def __init__(self, make: Callable[[], Any] = DeviceFigures) -> None:
        self._lock = threading.Lock()
        self._make = make
        self._devices: dict[str, Any] = {}

    def update(self, device: str, **values: float) -> None:
        with self._lock:
            figures = self._devices.setdefault(device, self._make())
            for name, value in values.items():
                setattr(figures, name, value)

    def assign(self, places: Mapping[str, tuple[int, float]], known: Iterable[str]) -> None:
        """(stage, share) of every device in the plan; stage -1 for the other ``known``."""
        with self._lock:
            for device in {*known, *places}:
                figures = self._devices.setdefault(device, self._make())
                figures.stage, figures.share = places.get(device, (-1, math.nan))

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            return {name: replace(figures) for name, figures in self._devices.items()}


# name, help, DeviceFigures attribute
_DEVICE_GAUGES = (
    ("ftpipe_device_step_compute_seconds",
     "Forward+backward compute seconds of the last step, from heartbeats", "step_compute_s"),
    ("ftpipe_device_capacity_factor", "Smoothed slow-down of a device vs. the reference profile "
     "(1 = reference speed, 4 = four times slower)", "capacity_factor"),
    ("ftpipe_device_link_bytes_per_second", "Payload bytes per second of a device's incoming "
     "pipeline messages (array bytes over one-way latency), smoothed", "link_bytes_per_s"),
    ("ftpipe_device_stage_assigned", "Stage a device holds in the current plan (-1 = none)",
     "stage"),
    ("ftpipe_device_share", "A device's share of its stage group's micro-batches (1 = alone)",
     "share"),
    ("ftpipe_device_last_heartbeat_timestamp_seconds", "Unix time of the last heartbeat",
     "heartbeat_unix_s"),
)


class FleetCollector(Collector):
    """Exports the per-device gauges (label ``device``) from ``FleetFigures`` at scrape time;
    a figure not known yet is left out rather than exported as NaN. ``gauges`` lists (name,
    help, attribute of the figures) triples."""

    def __init__(self, figures: FleetFigures,
                 gauges: tuple[tuple[str, str, str], ...] = _DEVICE_GAUGES) -> None:
        self._figures = figures
        self._gauges = gauges

    def collect(self) -> Iterator[GaugeMetricFamily]:
        devices = self._figures.snapshot()
        for name, documentation, attribute in self._gauges:
            family = GaugeMetricFamily(name, documentation, labels=["device"])
            for device in sorted(devices):
                value = float(getattr(devices[device], attribute))
                if not math.isnan(value):
                    family.add_metric([device], value)
            yield family


class DropLog:
    """Counts dropped messages and logs the first of each reason (then only every 1000th), so
    a flood of garbage cannot flood the log."""

    def __init__(self, metrics: MessagingMetrics, logger: logging.Logger) -> None:
        self._metrics = metrics
        self._log = logger
        self._counts: dict[str, int] = {}
        self._lock = threading.Lock()

    def drop(self, reason: DropReason, detail: str) -> None:
        self._metrics.dropped.labels(reason=reason.value).inc()
        with self._lock:
            count = self._counts.get(reason.value, 0) + 1
            self._counts[reason.value] = count
        if count == 1 or count % 1000 == 0:
            self._log.warning("dropped a message (%s, %d so far): %s", reason.value, count,
                              detail)

    @property
    def counts(self) -> dict[str, int]:
        with self._lock:
            return dict(self._counts)


def serve_metrics(registry: CollectorRegistry, port: int, addr: str = "0.0.0.0") -> None:
    """Serve ``/metrics`` on ``port`` (0 = off)."""
    if port:
        start_http_server(port, addr=addr, registry=registry)
