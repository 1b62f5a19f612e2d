"""Heartbeat latency while a replica uploads over a real 10 Mbit/s link (prints JSON).

One sender in its own network namespace behind a ``tbf`` of 10 Mbit/s each way (a device),
Mosquitto and one receiver in the lab's hub namespace (the controller), both on the project's
``MqttTransport`` and ``Messenger``. The sender publishes a heartbeat every 0.2 s and an
activation of 100 KB every 0.5 s, first alone (the baseline), then while it uploads a replica of
``--replica-mb`` (default 19 MB: full-width MobileNetV2's weights and momentum). Reported: the
send-to-arrival delay of heartbeats and activations (same host, same clock) as percentiles,
during the upload and before it, and the upload's duration and rate.

It uses only APIs that predate the bulk outbox, so the same file measures the code before it:

    cd /work/wt-links && python -m benchmarks.heartbeats        # this tree
    PYTHONPATH=/old/tree python benchmarks/heartbeats.py        # another tree's ftpipe_iot

Needs root (CAP_NET_ADMIN) and Mosquitto; says so and stops without them.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
from prometheus_client import CollectorRegistry

import ftpipe_iot
from ftpipe_iot.observability.metrics import DeviceMetrics
from ftpipe_iot.protocol.messages import Activation, Heartbeat, LayerReplica
from ftpipe_iot.protocol.topics import Topics
from ftpipe_iot.runtime.broker import BrokerKind, BrokerProcess
from ftpipe_iot.runtime.netns import NetLab, call_in, unavailable
from ftpipe_iot.transport.connection import BrokerConfig
from ftpipe_iot.transport.messenger import Messenger
from ftpipe_iot.transport.mqtt import MqttTransport

JOB = "hb"
PORT = 1883
LAYERS = 8  # the replica is split over this many layers, as a stage's would be
HEARTBEAT_S = 0.2
ACTIVATION_S = 0.5
ACTIVATION_FLOATS = 25_000  # 100 KB, one frame


def percentiles(values: list[float]) -> dict:
    if not values:
        return {"count": 0}
    array = np.array(values)
    return {"count": len(values), "p50_s": round(float(np.percentile(array, 50)), 4),
            "p90_s": round(float(np.percentile(array, 90)), 4),
            "p99_s": round(float(np.percentile(array, 99)), 4),
            "max_s": round(float(array.max()), 4)}


class Receiver:
    """The controller's side: takes heartbeats, activations and replica messages."""

    def __init__(self, transport: MqttTransport) -> None:
        self.transport = transport
        self.messenger = Messenger(transport, "controller", JOB,
                                   DeviceMetrics(CollectorRegistry()))
        self.delays: dict[str, list[tuple[float, float]]] = {"hb": [], "act": []}
        self.replicas = 0
        self.replicas_done_at = 0.0
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self.stopped.is_set():
            try:
                incoming = self.transport.inbox.get(timeout=0.1)
            except Exception:
                continue
            inbound = self.messenger.receive(incoming)
            if inbound is None:
                continue
            arrived = incoming.received_at or time.time()
            if isinstance(inbound.message, Heartbeat):
                self.delays["hb"].append((inbound.timestamp, arrived - inbound.timestamp))
            elif isinstance(inbound.message, Activation):
                self.delays["act"].append((inbound.timestamp, arrived - inbound.timestamp))
            elif isinstance(inbound.message, LayerReplica):
                self.replicas += 1
                self.replicas_done_at = arrived


def _connect(host: str, name: str) -> MqttTransport:
    transport = MqttTransport(BrokerConfig(host=host, port=PORT), name)
    transport.connect()
    return transport


def measure(replica_mb: float, rate_mbit: float, baseline_s: float, activations: bool) -> dict:
    with tempfile.TemporaryDirectory(prefix="bench-hb-") as tmp, NetLab(tag="hb") as lab:
        node = lab.add_node("dev0", rate_mbit * 1e6)
        with BrokerProcess(kind=BrokerKind.MOSQUITTO, port=PORT, bind="0.0.0.0",
                           data_dir=Path(tmp), netns=lab.hub):
            receiver = Receiver(call_in(lab.hub, _connect, "127.0.0.1", "controller"))
            topics = Topics(JOB)
            for topic in (Topics.dev_heartbeat("dev0"), topics.weights_all,
                          topics.stage_act(1, "controller")):
                receiver.transport.subscribe(topic)
            receiver.thread.start()
            sender_transport = call_in(node.namespace, _connect, node.hub_address, "dev0")
            sender = Messenger(sender_transport, "dev0", JOB, DeviceMetrics(CollectorRegistry()))
            stop = threading.Event()
            rng = np.random.default_rng(0)
            x = rng.standard_normal((1, ACTIVATION_FLOATS)).astype(np.float32)

            def beat() -> None:
                while not stop.wait(HEARTBEAT_S):
                    sender.send(Topics.dev_heartbeat("dev0"), Heartbeat(), qos=0)

            def feed() -> None:
                while activations and not stop.wait(ACTIVATION_S):
                    sender.send(topics.stage_act(1, "controller"),
                                Activation(x, np.zeros(1, np.int64), True))

            threads = [threading.Thread(target=beat, daemon=True),
                       threading.Thread(target=feed, daemon=True)]
            for thread in threads:
                thread.start()
            time.sleep(baseline_s)
            per_layer = int(replica_mb * 1e6 / 4 / LAYERS)
            replicas = [LayerReplica(i, 1, {"w": rng.standard_normal(per_layer)
                                            .astype(np.float32)}, None) for i in range(LAYERS)]
            started = time.time()
            sent = sum(sender.send_replica(topics, 1, replica) for replica in replicas)
            handed_s = time.time() - started
            deadline = time.monotonic() + 20 * replica_mb / (rate_mbit / 8) + 30
            while receiver.replicas < LAYERS and time.monotonic() < deadline:
                time.sleep(0.05)
            ended = receiver.replicas_done_at
            time.sleep(1.0)
            stop.set()
            sender_transport.close()
            receiver.stopped.set()
            receiver.thread.join(2)
            receiver.transport.close()
    during = {k: [d for at, d in v if started <= at <= ended] for k, v in receiver.delays.items()}
    before = {k: [d for at, d in v if at < started] for k, v in receiver.delays.items()}
    upload_s = ended - started if receiver.replicas == LAYERS else None
    return {"code": str(Path(ftpipe_iot.__file__).resolve().parent.parent),
            "link_mbit_each_way": rate_mbit, "replica_bytes": sent,
            "replica_layers_delivered": receiver.replicas,
            "publish_call_s": round(handed_s, 3),
            "upload_s": round(upload_s, 2) if upload_s else None,
            "upload_bytes_per_s": round(sent / upload_s) if upload_s else None,
            # the replica and the activations that crossed the link with it: the link's use
            "bulk_bytes_per_s_during_upload":
                round((sent + len(during["act"]) * ACTIVATION_FLOATS * 4) / upload_s)
                if upload_s else None,
            "heartbeat_delay_during_upload": percentiles(during["hb"]),
            "activation_delay_during_upload": percentiles(during["act"]),
            "heartbeat_delay_before_upload": percentiles(before["hb"]),
            "activation_delay_before_upload": percentiles(before["act"])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--replica-mb", type=float, default=19.0)
    parser.add_argument("--rate-mbit", type=float, default=10.0)
    parser.add_argument("--baseline-s", type=float, default=2.0)
    parser.add_argument("--no-activations", action="store_true",
                        help="heartbeats only (no stage data sharing the link)")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    reason = unavailable()
    if reason is not None:
        print(json.dumps({"skipped": f"network namespaces unavailable: {reason}"}))
        sys.exit(0)
    result = measure(args.replica_mb, args.rate_mbit, args.baseline_s, not args.no_activations)
    text = json.dumps(result, indent=2)
    print(text)
    if args.out is not None:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
