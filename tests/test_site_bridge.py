"""Site brokers bridged to a central broker: the topic map, the rendered config, the site's ACL
at the central broker, and a job trained over a real bridge between two real Mosquittos that
survives a restart of the central broker while pipeline traffic stays on the site."""

from __future__ import annotations

import getpass
import json
import queue
import time

import pytest
from click.testing import CliRunner
from helpers import max_weight_diff
from test_faults import reference

from ftpipe_iot.cli import main
from ftpipe_iot.control.weights_file import load_weights
from ftpipe_iot.fleet import fleet
from ftpipe_iot.fleet.acl import role_rules
from ftpipe_iot.fleet.errors import FleetError
from ftpipe_iot.fleet.model import BrokerSettings, Role
from ftpipe_iot.fleet.site import (
    Direction,
    SiteSettings,
    bridge_state_topic,
    bridge_topics,
    render_site_config,
    topic_map_markdown,
)
from ftpipe_iot.observability.watch import JobWatcher
from ftpipe_iot.runtime.broker import BrokerKind, BrokerProcess, find_free_port
from ftpipe_iot.transport.base import RECONNECTED_TOPIC, topic_matches
from ftpipe_iot.transport.connection import BrokerConfig
from ftpipe_iot.transport.mqtt import MqttTransport

JOB = "bridged"


def _crossing(topic: str) -> set[Direction]:
    return {t.direction for t in bridge_topics(JOB) if topic_matches(t.pattern, topic)}


def test_the_topic_map_lets_only_what_must_cross_cross():
    base = f"ftpipe/{JOB}"
    assert _crossing(f"{base}/ctrl/plan") == {Direction.IN}
    assert _crossing(f"{base}/ctrl/cmd/dev0") == {Direction.IN}
    assert _crossing(f"{base}/stage/0/act/dev0") == {Direction.IN}
    assert _crossing(f"{base}/results") == {Direction.OUT}
    assert _crossing(f"{base}/weights/3/0") == {Direction.BOTH}
    assert _crossing("ftpipe/dev/dev0/status") == {Direction.OUT}
    assert _crossing("ftpipe/dev/dev0/hb") == {Direction.OUT}
    for local in (f"{base}/stage/1/act/dev1", f"{base}/stage/2/act/dev2",
                  f"{base}/stage/0/grad/dev0", f"{base}/stage/1/grad/dev1",
                  f"{base}/stage/0/reduce", f"{base}/events", "ftpipe/other/ctrl/plan"):
        assert _crossing(local) == set(), local
    table = topic_map_markdown(JOB)
    assert all(f"`{t.pattern}`" in table for t in bridge_topics(JOB))


def test_the_site_identity_may_do_at_the_central_broker_what_the_bridge_does():
    rules = {(r.topic, r.access.value) for r in role_rules(Role.SITE, JOB)}
    assert (f"ftpipe/{JOB}/ctrl/#", "read") in rules
    assert (f"ftpipe/{JOB}/results", "write") in rules
    assert (f"ftpipe/{JOB}/weights/#", "readwrite") in rules
    assert not any("grad" in topic or "reduce" in topic or "stage/1" in topic
                   for topic, _ in rules)


def test_bad_site_settings_are_refused_with_a_reason():
    with pytest.raises(FleetError, match="bridge protocol"):
        SiteSettings("s", "h", 1883, bridge_protocol="mqttv31")
    with pytest.raises(FleetError, match="password"):
        SiteSettings("s", "h", 1883, username="s")
    with pytest.raises(ValueError, match="site name"):
        SiteSettings("bad/name", "h", 1883)


def test_fleet_site_provisions_a_tls_bridge_and_site_logins(tmp_path):
    root = tmp_path / "fleet"
    fleet.init_fleet(root, BrokerSettings(port=8883, hosts=("central.lan",),
                                          run_as_user="root"), job=JOB)
    fleet.add_identity(root, "pi-1", Role.DEVICE)
    result = CliRunner().invoke(main, ["fleet", "site", "plant-a", "--dir", str(root),
                                       "--no-reload"])
    assert result.exit_code == 0, result.output
    bundle = root / "bundles" / "plant-a"
    text = (bundle / "mosquitto-site.conf").read_text()
    password = (bundle / "password").read_text().strip()
    assert "address central.lan:8883" in text and f"remote_password {password}" in text
    assert f"bridge_certfile {(bundle / 'client.crt').resolve()}" in text
    assert "allow_anonymous false" in text and "pi-1:" in (bundle / "passwd").read_text()
    assert oct((bundle / "mosquitto-site.conf").stat().st_mode & 0o777) == "0o600"
    acl = (root / "broker" / "acl").read_text()
    assert "user plant-a" in acl and f"topic write ftpipe/{JOB}/results" in acl


def _probe(port: int, name: str, *topics: str) -> MqttTransport:
    transport = MqttTransport(BrokerConfig(port=port), f"{name}-{time.time_ns()}")
    transport.connect()
    for topic in topics:
        transport.subscribe(topic)
    return transport


def _wait_bridge_up(site_port: int, name: str, timeout_s: float = 30) -> None:
    probe = _probe(site_port, "bridge-state", bridge_state_topic(name))
    deadline = time.monotonic() + timeout_s
    try:
        while time.monotonic() < deadline:
            try:
                incoming = probe.inbox.get(timeout=0.5)
            except queue.Empty:
                continue
            if incoming.payload == b"1":
                return
        raise AssertionError(f"the bridge {name} never came up")
    finally:
        probe.close()


@pytest.mark.broker
@pytest.mark.slow
def test_training_over_a_bridge_survives_a_central_restart_and_keeps_pipeline_local(
        tmp_path, processes):
    steps = 40
    central = BrokerProcess(kind=BrokerKind.MOSQUITTO, data_dir=tmp_path / "central").start()
    site_port = find_free_port()
    settings = SiteSettings("site1", "127.0.0.1", central.port, port=site_port,
                            bind="127.0.0.1", run_as_user=getpass.getuser())
    site_dir = tmp_path / "site"
    site_dir.mkdir()
    site = BrokerProcess(kind=BrokerKind.MOSQUITTO, port=site_port, data_dir=site_dir,
                         config_text=render_site_config(settings, site_dir)).start()
    seen_at_central = _probe(central.port, "probe", f"ftpipe/{JOB}/stage/#")
    watcher = JobWatcher(BrokerConfig(port=central.port), JOB).start()
    try:
        _wait_bridge_up(site_port, "site1")
        for i in range(3):
            processes.device(f"dev{i}", JOB, site.url, "--keepalive", "2")
        processes.start(
            "controller", "controller", "--job", JOB, "--broker", central.url, "--devices", "3",
            "--stop-devices", "--max-steps", str(steps), "--micro-batches", "4",
            "--micro-batch-size", "8", "--max-in-flight", "4", "--replicate-every", "5",
            "--no-repartition", "--heartbeat-timeout", "5", "--stall-timeout", "15",
            "--wait-devices", "60", "--save-weights", str(tmp_path / "weights.npz"),
            "--summary-json", str(tmp_path / "summary.json"))
        assert watcher.wait_step(10, 120), processes.log("controller")[-3000:]
        central.restart()  # the bridge goes down with it and must come back by itself
        assert processes.wait("controller", 240) == 0, processes.log("controller")[-4000:]
    finally:
        topics = set()
        while not seen_at_central.inbox.empty():
            topics.add(seen_at_central.inbox.get().topic)
        topics.discard(RECONNECTED_TOPIC)  # the probe's own note that it reconnected
        seen_at_central.close()
        watcher.close()
        processes.stop_all()
        site.cleanup()
        central.cleanup()
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["steps"] == steps and summary["error"] is None
    assert max_weight_diff(load_weights(tmp_path / "weights.npz"), reference(steps)) < 1e-5
    # Only the controller's feed into stage 0 reached the central broker.
    assert topics and all(t.startswith(f"ftpipe/{JOB}/stage/0/act/") for t in topics), topics

