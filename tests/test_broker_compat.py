"""Broker compatibility (docs/brokers.md): Mosquitto 2 over MQTT 5 and 3.1.1, the embedded amqtt
broker, and RabbitMQ's MQTT plugin on a private node. Each broker is probed with real clients
and must behave as the documented matrix says, and a short job trains over each one to the
same weights as single-process training."""

from __future__ import annotations

import json

import pytest
from helpers import max_weight_diff
from test_faults import reference

from ftpipe_iot.control.weights_file import load_weights
from ftpipe_iot.observability.watch import JobWatcher
from ftpipe_iot.runtime.broker import BrokerKind, BrokerProcess
from ftpipe_iot.runtime.rabbitmq import RabbitMqBroker, rabbitmq_unavailable
from ftpipe_iot.transport.connection import BrokerConfig, MqttProtocol
from ftpipe_iot.transport.probe import probe

pytestmark = [pytest.mark.broker, pytest.mark.slow]

KIB = 1024
# The matrix of docs/brokers.md, as observed on this project's configs of each broker.
EXPECTED = {
    "mosquitto-5": dict(protocol="5", retained_wildcard=True, shared_subscription=True,
                        largest_payload_bytes=256 * KIB),
    "mosquitto-3.1.1": dict(protocol="3.1.1", retained_wildcard=True, shared_subscription=True,
                            largest_payload_bytes=256 * KIB),
    "embedded": dict(protocol="3.1.1", retained_wildcard=True, shared_subscription=False,
                     largest_payload_bytes=4096 * KIB),
    "rabbitmq": dict(protocol="3.1.1", retained_wildcard=False, shared_subscription=False,
                     largest_payload_bytes=4096 * KIB),
}
COMMON = dict(chunked_round_trip=True, retained_exact=True, retained_cleared=True,
              last_will=True)
STEPS = 7  # past one replication point (--replicate-every 5)


@pytest.fixture(scope="module")
def rabbitmq():
    reason = rabbitmq_unavailable()
    if reason is not None:
        pytest.skip(f"RabbitMQ cannot run here: {reason}")
    with RabbitMqBroker() as node:
        yield node


@pytest.fixture(params=list(EXPECTED))
def broker(request, tmp_path):
    """(name, config, url) of a running broker of each kind."""
    name = request.param
    if name == "rabbitmq":
        node = request.getfixturevalue("rabbitmq")
        yield name, BrokerConfig(port=node.port), node.url
        return
    kind = BrokerKind.EMBEDDED if name == "embedded" else BrokerKind.MOSQUITTO
    protocol = MqttProtocol.V311 if name == "mosquitto-3.1.1" else MqttProtocol.AUTO
    with BrokerProcess(kind=kind, data_dir=tmp_path / "broker") as process:
        yield name, BrokerConfig(port=process.port, protocol=protocol), process.url


def test_each_broker_behaves_as_the_matrix_says(broker):
    name, config, _ = broker
    report = probe(config).to_dict()
    observed = {key: report[key] for key in (*EXPECTED[name], *COMMON)}
    assert observed == {**COMMON, **EXPECTED[name]}, report["notes"]


def test_a_job_trains_to_the_reference_weights_on_each_broker(broker, processes, tmp_path):
    name, config, url = broker
    protocol = config.protocol.value
    # RabbitMQ delivers no retained message to a wildcard subscription, so a controller
    # subscribing after the devices announced would never see their retained statuses: the
    # devices start once the controller says it is online (after its subscriptions).
    watcher = JobWatcher(config, "compat").start()
    processes.start(
        "controller", "controller", "--job", "compat", "--broker", url, "--mqtt-protocol",
        protocol, "--devices", "3", "--stop-devices", "--max-steps", str(STEPS),
        "--micro-batches", "4", "--micro-batch-size", "8", "--max-in-flight", "4",
        "--replicate-every", "5", "--no-repartition", "--wait-devices", "60",
        "--save-weights", str(tmp_path / "weights.npz"),
        "--summary-json", str(tmp_path / "summary.json"))
    try:
        assert watcher.wait_for(lambda w: w.job.state == "online", 60), \
            processes.log("controller")[-3000:]
    finally:
        watcher.close()
    for i in range(3):
        processes.device(f"dev{i}", "compat", url, "--mqtt-protocol", protocol)
    assert processes.wait("controller", 180) == 0, processes.log("controller")[-3000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["steps"] == STEPS and summary["error"] is None, name
    assert max_weight_diff(load_weights(tmp_path / "weights.npz"), reference(STEPS)) < 1e-5
