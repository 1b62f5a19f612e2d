"""The CLI through click's test runner: argument errors give a clear message, no traceback."""

from __future__ import annotations

import numpy as np
import pytest
from click.testing import CliRunner

from ftpipe_iot.cli import main
from ftpipe_iot.core.data import DataError, DataSpec, load_dataset
from ftpipe_iot.core.models import ModelError, ModelSpec, build_layers, cut_shapes
from ftpipe_iot.runtime.faults import FaultAction, FaultSpecError, parse_fault


def _run(*args: str):
    return CliRunner().invoke(main, list(args), catch_exceptions=False)


@pytest.mark.parametrize(("args", "message"), [
    (["demo", "--model", "resnet"], "unknown model 'resnet'"),
    (["demo", "--data", "imagenet"], "unknown data set 'imagenet'"),
    (["demo", "--data-shape", "3,x"], "not a comma-separated list"),
    (["demo", "--devices", "0"], "0 is not in the range"),
    (["demo", "--broker", "mqtt://h:1", "--embedded-broker"], "exclude each other"),
    (["demo", "--fault", "explode:1@step=3"], "unknown fault action"),
    (["demo", "--fault", "kill@step=3"], "needs a device index"),
    (["demo", "--fault", "kill:7@step=3", "--devices", "3"], "out of range"),
    (["demo", "--fault", "broker-restart@step=3", "--broker", "mqtt://h:1"], "own broker"),
    (["demo", "--lr", "0"], "not in the range x>0"),
    (["demo", "--momentum", "1.5"], "1.5"),
    (["controller", "--broker", "ftp://x"], "mqtt:// or mqtts://"),
    (["controller", "--broker", "mqtt://h:99999"], "port"),
    (["controller", "--device-names", "a,b", "--devices", "3"], "lists 2 devices"),
    (["controller", "--layout", "data", "--devices", "5", "--micro-batches", "4"],
     "needs micro_batches >= 5"),
    (["controller", "--layout", "groups"], "'groups' is not one of"),
    (["controller", "--config", "/nonexistent/bundle.json"], "cannot read config"),
    (["device"], "give --name or a --config bundle"),
    (["device", "--name", "d", "--profile", "/nonexistent.json"], "nonexistent"),
    (["demo", "--mode", "fedavg", "--schedule", "async"], "--schedule async is for --mode "
                                                          "pipeline"),
    (["demo", "--mode", "collaborative", "--micro-batches", "auto"], "--auto-micro-batches"),
    (["controller", "--micro-batches", "lots"], "neither a whole number nor 'auto'"),
])
def test_argument_errors_are_clear(args, message):
    result = _run(*args)
    assert result.exit_code != 0
    assert message in result.output
    assert "Traceback" not in result.output


def test_model_that_does_not_fit_the_data_is_refused_before_connecting(tmp_path):
    data = tmp_path / "flat.npz"
    rng = np.random.default_rng(0)
    np.savez(data, x=rng.random((40, 5)).astype(np.float32), y=rng.integers(0, 3, 40))
    result = _run("controller", "--model", "cnn", "--data", f"npz:{data}",
                  "--broker", "mqtt://127.0.0.1:1", "--insecure-unsigned")
    assert result.exit_code != 0
    assert "image inputs" in result.output and "use 'mlp'" in result.output


def test_help_lists_every_command():
    result = _run("--help")
    for command in ("broker", "device", "controller", "demo", "plan", "fleet", "status"):
        assert command in result.output


@pytest.mark.parametrize(("content", "message"), [
    ({"x": np.zeros((10, 4))}, "must hold arrays 'x' and 'y'"),
    ({"x": np.zeros((10, 4)), "y": np.zeros(9, np.int64)}, "one label per row"),
    ({"x": np.zeros((10, 4)), "y": np.full(10, 0.5)}, "integer class indices"),
    ({"x": np.zeros(10), "y": np.zeros(10, np.int64)}, "shape (N, features"),
    ({"x": np.full((10, 4), np.nan), "y": np.arange(10) % 2}, "NaN"),
])
def test_bad_npz_files_are_refused(tmp_path, content, message):
    path = tmp_path / "d.npz"
    np.savez(path, **content)
    with pytest.raises(DataError, match=message.replace("(", r"\(")):
        load_dataset(DataSpec(f"npz:{path}"))


def test_user_model_and_npz_data(tmp_path, monkeypatch):
    (tmp_path / "my_model.py").write_text(
        "import torch.nn as nn\n"
        "def build():\n    return nn.Sequential(nn.Linear(5, 8), nn.ReLU(), nn.Linear(8, 3))\n"
        "def wrong():\n    return 42\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    layers = build_layers(ModelSpec("my_model:build"), (5,), 3, seed=0)
    assert len(layers) == 3
    assert cut_shapes(layers, (5,), 3)[-1] == (3,)
    with pytest.raises(ModelError, match="must return an nn.Sequential"):
        build_layers(ModelSpec("my_model:wrong"), (5,), 3, seed=0)
    with pytest.raises(ModelError, match="outputs shape"):
        cut_shapes(layers, (5,), 4)


def test_fault_specs_parse():
    fault = parse_fault("hang:1@step=50", devices=3)
    assert (fault.action, fault.target, fault.step) == (FaultAction.HANG, 1, 50)
    assert str(fault) == "hang:1@step=50"
    assert parse_fault("broker-restart@step=7").target is None
    with pytest.raises(FaultSpecError):
        parse_fault("kill:1@30")


@pytest.mark.parametrize("args", [["controller", "--mode", "fedavg", "--checkpoint-dir", "ck"],
                                  ["controller", "--mode", "collaborative", "--resiliency", "1"],
                                  ["demo", "--mode", "collaborative", "--freeze-layers", "0-1"],
                                  # one table for both commands: the demo refuses --layout too
                                  ["demo", "--mode", "fedavg", "--layout", "pipeline"],
                                  # they evaluate after every round instead
                                  ["demo", "--mode", "fedavg", "--evaluate-every", "5"]])
def test_pipeline_only_options_are_refused_in_the_collaborative_modes(args):
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 2 and "apply to --mode pipeline only" in result.output


def test_collaborative_fault_specs_parse_and_each_demo_refuses_the_others():
    from ftpipe_iot.collab.demo import collab_faults
    from ftpipe_iot.protocol.vocab import CollabMode
    from ftpipe_iot.runtime.faults import FaultUnit, fault_schedule

    fault = parse_fault("server-kill@round=2")
    assert (fault.action, fault.unit, fault.step) == (FaultAction.SERVER_KILL, FaultUnit.ROUND, 2)
    assert str(fault) == "server-kill@round=2"
    faults = collab_faults(["controller-kill@step=9", "server-kill@round=1"], 3,
                           CollabMode.COLLABORATIVE, 1)
    assert [str(f) for f in faults] == ["server-kill@round=1", "controller-kill@step=9"]
    for texts, message in [(["server-kill@step=3"], "is for the collaborative demo"),
                           (["kill:1@round=3"], "the pipeline has no rounds")]:
        with pytest.raises(FaultSpecError, match=message):
            fault_schedule(texts, 3)
    for text, message in [("join@step=3", "is for the pipeline demo"),
                          ("broker-restart@round=1", "is for the pipeline demo")]:
        with pytest.raises(FaultSpecError, match=message):
            collab_faults([text], 3, CollabMode.COLLABORATIVE)
    with pytest.raises(FaultSpecError, match="fedavg has no server"):
        collab_faults(["server-kill@round=1"], 3, CollabMode.FEDAVG)


@pytest.mark.parametrize("args, message", [
    (["demo", "--mode", "fedavg", "--standby-server"], "--standby-server needs --mode "
                                                       "collaborative"),
    (["demo", "--standby-server"], "--standby-server needs --mode collaborative"),
    (["controller", "--standby-servers", "1"], "--standby-servers need --mode collaborative"),
    (["controller", "--mode", "fedavg", "--standby-servers", "1", "--broker",
      "mqtt://127.0.0.1:1", "--insecure-unsigned"], "fedavg has no server"),
    (["demo", "--mode", "fedavg", "--fault", "server-kill@round=1"], "fedavg has no server"),
    (["demo", "--fault", "server-kill@step=3"], "is for the collaborative demo"),
])
def test_standby_servers_and_server_faults_are_refused_where_there_is_no_server(args, message):
    result = CliRunner().invoke(main, args)
    assert result.exit_code != 0 and message in result.output, result.output


def test_the_lazy_command_table_names_every_command_where_its_module_defines_it():
    import importlib

    from ftpipe_iot.cli import COMMAND_MODULES

    defined = {}
    for module_name in sorted(set(COMMAND_MODULES.values())):
        module = importlib.import_module(f"ftpipe_iot.cli.{module_name}")
        defined.update({command.name: module_name for command in module.COMMANDS})
    assert defined == COMMAND_MODULES
    listed = _run("--help").output
    assert all(f"  {name} " in listed for name in COMMAND_MODULES), listed


def test_a_device_process_imports_neither_the_controller_nor_the_fleet_tools():
    import subprocess
    import sys

    probe = ("import sys; from ftpipe_iot.cli import main; "
             "main.get_command(None, 'device'); import ftpipe_iot.runtime.entry; "
             "print(sorted(m for m in sys.modules if m.startswith(('ftpipe_iot.control.'"
             "'controller', 'ftpipe_iot.fleet', 'ftpipe_iot.cli.plan'))))")
    loaded = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                            check=True).stdout.strip()
    assert loaded == "[]"
