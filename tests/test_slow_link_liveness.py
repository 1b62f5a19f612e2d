"""A replica upload that fills a real 10 Mbit/s link for longer than the heartbeat timeout is
not a dead device (docs/design.md §4 traffic classes, §6 liveness, §12 links).

Full-width MobileNetV2 on one device behind a ``tbf`` of 10 Mbit/s each way, Mosquitto and the
controller in the lab's hub namespace, every liveness setting at its default (5 s heartbeat
timeout, 30 s stall timeout, a heartbeat a second). The job ends with the replication of every
layer, about 19 MB: 15 s of this link. Heartbeats published behind it in paho's FIFO queue
used to arrive after the timeout, and the controller declared the device dead.
"""

from __future__ import annotations

import json

import pytest

from ftpipe_iot.runtime.broker import BrokerKind, BrokerProcess

pytestmark = [pytest.mark.broker, pytest.mark.slow, pytest.mark.netns]

PORT = 1883  # the hub namespace is the lab's own: every port is free there
RATE_BITS = 10_000_000
HEARTBEAT_TIMEOUT_S = 5.0  # the controller's default, not passed: defaults are what is tested


def test_a_replica_upload_longer_than_the_heartbeat_timeout_is_no_failure(
        netlab, processes, tmp_path):
    node = netlab.add_node("dev0", RATE_BITS)
    broker = BrokerProcess(kind=BrokerKind.MOSQUITTO, port=PORT, bind="0.0.0.0",
                           data_dir=tmp_path / "broker", netns=netlab.hub).start()
    try:
        summary_path = tmp_path / "summary.json"
        processes.start("dev0", "device", "--name", "dev0", "--job", "slowlink", "--broker",
                        node.broker_url(PORT), netns=node.namespace)
        processes.start(
            "controller", "controller", "--job", "slowlink",
            "--broker", f"mqtt://127.0.0.1:{PORT}", "--devices", "1", "--stop-devices",
            "--model", "mobilenetv2", "--data", "synthetic", "--data-samples", "40",
            "--max-steps", "2", "--micro-batches", "2", "--micro-batch-size", "2",
            "--replicate-every", "0", "--no-repartition", "--wait-devices", "60",
            "--summary-json", str(summary_path), netns=netlab.hub)
        code = processes.wait("controller", 120)
        log = processes.log("controller")
        assert code == 0, log[-4000:]
        summary = json.loads(summary_path.read_text())
        upload_s = summary["replicated_bytes"] / (RATE_BITS / 8)
        assert upload_s > 2 * HEARTBEAT_TIMEOUT_S, summary["replicated_bytes"]
        assert summary["error"] is None
        assert summary["failures_detected"] == 0, log[-4000:]
        assert summary["steps"] == 2
        sent, _ = netlab.link_bytes("dev0")
        assert sent >= summary["replicated_bytes"]  # the replica really crossed the link
    finally:
        broker.cleanup()
