"""``ftpipe-iot fleet`` via click's CliRunner: argument errors, unknown names, clear messages."""

from __future__ import annotations

import json
from pathlib import Path

import click
import pytest
from click.testing import CliRunner, Result

from ftpipe_iot.cli.fleet import COMMANDS, fleet
from ftpipe_iot.runtime.broker import find_free_port


def run(*args: str, env: dict[str, str] | None = None) -> Result:
    return CliRunner().invoke(fleet, list(args), env=env, catch_exceptions=False)


def assert_clean_error(result: Result, *fragments: str) -> None:
    """Exit code 1, one 'Error: ...' message, no traceback."""
    assert result.exit_code == 1, result.output
    assert result.output.startswith("Error: ")
    assert "Traceback" not in result.output
    for fragment in fragments:
        assert fragment in result.output


@pytest.fixture
def fleet_dir(tmp_path: Path) -> Path:
    directory = tmp_path / "fleet"
    result = run("init", str(directory), "--port", str(find_free_port()), "--bind", "127.0.0.1",
                 "--host", "broker.lan", "--broker-user", "root", "--job", "j1")
    assert result.exit_code == 0, result.output
    assert "mosquitto -c" in result.output
    return directory


def test_exports_a_fleet_group() -> None:
    assert any(isinstance(c, click.Group) and c.name == "fleet" for c in COMMANDS)


def test_argument_errors_are_usage_errors(fleet_dir: Path) -> None:
    for args in (["add-device"], ["add-device", "d1", "--dir", str(fleet_dir), "--role", "boss"],
                 ["init", str(fleet_dir / "x"), "--port", "70000"], ["check"], ["frobnicate"]):
        result = run(*args)
        assert result.exit_code == 2, (args, result.output)
        assert "Traceback" not in result.output


def test_init_twice_is_a_clear_error(fleet_dir: Path) -> None:
    assert_clean_error(run("init", str(fleet_dir)), "already holds a fleet")


def test_add_list_remove(fleet_dir: Path) -> None:
    out = run("add-device", "dev-a", "--dir", str(fleet_dir), "--no-reload")
    assert out.exit_code == 0, out.output
    password = (fleet_dir / "bundles" / "dev-a" / "password").read_text().strip()
    assert password not in out.output and "once the broker reloads" in out.output
    assert run("add-controller", "ctl", "--dir", str(fleet_dir)).exit_code == 0
    assert run("add-operator", "op", "--dir", str(fleet_dir)).exit_code == 0
    assert run("add-device", "ctl2", "--role", "controller", "--job", "j2",
               "--dir", str(fleet_dir)).exit_code == 0
    listed = json.loads(run("list", "--dir", str(fleet_dir), "--json").output)
    assert [(i["name"], i["role"], i["job"]) for i in listed] == [
        ("dev-a", "device", "j1"), ("ctl", "controller", "j1"), ("ctl2", "controller", "j2"),
        ("op", "operator", "j1")]
    table = run("list", "--dir", str(fleet_dir)).output
    assert "dev-a" in table and "operator" in table
    assert_clean_error(run("add-device", "dev-a", "--dir", str(fleet_dir)), "already exists")
    removed = run("remove-device", "dev-a", "--dir", str(fleet_dir))
    assert removed.exit_code == 0 and "removed" in removed.output
    assert "dev-a" not in run("list", "--dir", str(fleet_dir)).output


def test_unknown_device_name(fleet_dir: Path) -> None:
    run("add-device", "dev-a", "--dir", str(fleet_dir))
    assert_clean_error(run("remove-device", "dev-x", "--dir", str(fleet_dir)),
                       "no identity named 'dev-x'", "known: dev-a")


def test_bad_device_name(fleet_dir: Path) -> None:
    assert_clean_error(run("add-device", "bad/#", "--dir", str(fleet_dir)), "1-64 characters")


def test_fleet_dir_from_environment(fleet_dir: Path, tmp_path: Path) -> None:
    env = {"FTPIPE_FLEET_DIR": str(fleet_dir)}
    assert run("add-device", "dev-env", env=env).exit_code == 0
    assert "dev-env" in run("list", env=env).output
    assert_clean_error(run("list", "--dir", str(tmp_path / "nope")), "not a fleet directory")


def test_reload_without_broker(fleet_dir: Path) -> None:
    assert_clean_error(run("reload", "--dir", str(fleet_dir)), "no running broker")


def test_config_rerender_with_new_port(fleet_dir: Path) -> None:
    result = run("config", "--dir", str(fleet_dir), "--port", "9999")
    assert result.exit_code == 0, result.output
    assert "listener 9999 127.0.0.1" in (fleet_dir / "broker" / "mosquitto.conf").read_text()
    run("add-device", "dev-a", "--dir", str(fleet_dir))
    bundle = json.loads((fleet_dir / "bundles" / "dev-a" / "device.json").read_text())
    assert bundle["broker"]["port"] == 9999 and bundle["broker"]["host"] == "broker.lan"


def test_check_errors_are_clear(fleet_dir: Path, tmp_path: Path) -> None:
    assert_clean_error(run("check", "--config", str(tmp_path / "missing.json")),
                       "cannot read config")
    run("add-device", "dev-a", "--dir", str(fleet_dir))
    config = fleet_dir / "bundles" / "dev-a" / "device.json"
    raw = json.loads(config.read_text())
    raw["broker"]["host"] = "127.0.0.1"
    config.write_text(json.dumps(raw))
    # nothing listens on the fleet's port: refused, said plainly
    assert_clean_error(run("check", "--config", str(config), "--timeout", "5"),
                       "connection refused")
