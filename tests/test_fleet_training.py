"""A short training run over TLS with provisioned identities, against the generated config."""

from __future__ import annotations

import json

import pytest

from ftpipe_iot.fleet import fleet
from ftpipe_iot.fleet.model import BrokerSettings, Role, load_state
from ftpipe_iot.runtime.broker import BrokerProcess, find_free_port, mosquitto_binary

pytestmark = [pytest.mark.broker, pytest.mark.slow]

JOB = "secure"


def test_training_over_tls_with_provisioned_identities(tmp_path, processes):
    if mosquitto_binary() is None:
        pytest.fail("mosquitto is not installed; .ci/run installs it")
    root = tmp_path / "fleet"
    port = find_free_port()
    fleet.init_fleet(root, BrokerSettings(port=port, bind="127.0.0.1", run_as_user="root"),
                     job=JOB)
    names = ["pi-1", "pi-2", "pi-3"]
    for name in names:
        fleet.add_identity(root, name, Role.DEVICE)
    fleet.add_identity(root, "ctl", Role.CONTROLLER)
    state = load_state(root)

    def bundle(name: str) -> str:
        return str(root / "bundles" / name / f"{state.get(name).role.value}.json")

    broker = BrokerProcess(port=port, config_text=(root / "broker" / "mosquitto.conf").read_text(),
                           data_dir=root / "run")
    broker.start()
    try:
        for name in names:
            processes.start(name, "device", "--config", bundle(name), "--heartbeat-interval",
                            "0.2")
        processes.start("ctl", "controller", "--config", bundle("ctl"), "--devices", "3",
                        "--max-steps", "15", "--stop-devices", "--json", "--wait-devices", "60",
                        "--summary-json", str(tmp_path / "summary.json"))
        assert processes.wait("ctl", 180) == 0, processes.log("ctl")[-3000:]
        for name in names:
            assert processes.wait(name, 30) == 0, processes.log(name)[-2000:]
    finally:
        broker.cleanup()
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["steps"] == 15 and summary["error"] is None
    assert sorted(d["device"] for s in summary["stages"] for d in s["devices"]) == names
    # secrets never reach logs or the command line
    for name in [*names, "ctl"]:
        password = (root / "bundles" / name / "password").read_text().strip()
        assert len(password) >= 16
        assert password not in processes.log(name)
        assert all(password not in arg for arg in processes.procs[name].args)
