"""The trained model in users' hands: standard checkpoints, exports verified against PyTorch,
evaluation, and fine-tuning from given weights (exact over a real Mosquitto, frozen layers get no
gradients)."""

from __future__ import annotations

import json
import time

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from helpers import MemoryJob, max_weight_diff

from ftpipe_iot.artifacts.checkpoint import (
    initial_layers,
    load_model,
    read_checkpoint,
    save_checkpoint,
)
from ftpipe_iot.artifacts.evaluate import evaluate
from ftpipe_iot.artifacts.export import ExportFormat, export_model
from ftpipe_iot.cli import main
from ftpipe_iot.control.config import ControllerConfig
from ftpipe_iot.control.weights_file import load_weights
from ftpipe_iot.core.data import load_dataset
from ftpipe_iot.core.models import build_layers
from ftpipe_iot.core.reference import train_reference
from ftpipe_iot.errors import DataError, ModelError
from ftpipe_iot.protocol.plan import TrainConfig
from ftpipe_iot.protocol.specs import DataSpec, ModelSpec
from ftpipe_iot.protocol.topics import Topics
from ftpipe_iot.protocol.vocab import ControllerPhase
from ftpipe_iot.transport.connection import BrokerConfig
from ftpipe_iot.transport.mqtt import MqttTransport

TRAIN = TrainConfig(model=ModelSpec("cnn"), micro_batches=4, micro_batch_size=8, max_steps=6)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A short in-memory training run saved as a standard checkpoint."""
    job = MemoryJob(ControllerConfig(train=TRAIN, devices=2), devices=2)
    job.start()
    assert job.run() is ControllerPhase.DONE
    path = tmp_path_factory.mktemp("ckpt") / "model.pt"
    data = job.controller.data
    save_checkpoint(path, job.controller.weights, TRAIN, data.input_shape, data.num_classes, 6)
    return path, job.controller.weights, data


def test_a_checkpoint_opens_with_plain_torch_and_rebuilds_in_one_call(trained):
    path, weights, data = trained
    raw = torch.load(path, weights_only=True)
    assert raw["step"] == 6 and raw["num_classes"] == 10 and raw["model"]["name"] == "cnn"
    model = load_model(path)
    reference = torch.nn.Sequential(*build_layers(TRAIN.model, data.input_shape, 10, 0))
    for index, layer in enumerate(reference):
        layer.load_state_dict({k: torch.from_numpy(v) for k, v in weights[index].items()})
    x = torch.from_numpy(data.x_test[:16])
    with torch.no_grad():
        assert torch.equal(model(x), reference.eval()(x))


@pytest.mark.parametrize("fmt", list(ExportFormat))
def test_exports_reproduce_the_pytorch_model(trained, tmp_path, fmt):
    path, _, data = trained
    out = tmp_path / f"model.{fmt.value}"
    report = export_model(path, fmt, out)
    assert report.max_abs_diff < 1e-4 and out.exists()
    x = data.x_test[:5]
    with torch.no_grad():
        expected = load_model(path)(torch.from_numpy(x)).numpy()
    if fmt is ExportFormat.TORCHSCRIPT:
        got = torch.jit.load(str(out))(torch.from_numpy(x)).detach().numpy()
    else:
        import onnxruntime

        session = onnxruntime.InferenceSession(str(out))
        got = session.run(None, {session.get_inputs()[0].name: x})[0]
    assert np.abs(got - expected).max() < 1e-4  # another batch size than the export's


def test_evaluate_reports_accuracy_loss_and_a_confusion_matrix(trained, tmp_path):
    path, _, data = trained
    result = evaluate(path, DataSpec("digits"), tmp_path / "confusion.png")
    with torch.no_grad():
        predicted = load_model(path)(torch.from_numpy(data.x_test)).argmax(dim=1).numpy()
    assert result.accuracy == pytest.approx(float((predicted == data.y_test).mean()))
    assert result.samples == len(data.y_test) and sum(map(sum, result.confusion)) == len(
        data.y_test)
    assert (tmp_path / "confusion.png").stat().st_size > 1000
    out = CliRunner().invoke(main, ["evaluate", str(path), "--json",
                                    "--confusion", str(tmp_path / "c.png")])
    assert out.exit_code == 0 and json.loads(out.output)["accuracy"] == result.accuracy
    flat = tmp_path / "flat.npz"
    np.savez(flat, x=np.zeros((20, 7), np.float32), y=np.arange(20) % 2)
    with pytest.raises(DataError, match="shape"):
        evaluate(path, DataSpec(f"npz:{flat}"))


def test_bad_files_are_refused_with_the_first_mismatch(trained, tmp_path):
    path, weights, _ = trained
    text = tmp_path / "notes.pt"
    text.write_text("not a model")
    with pytest.raises(ModelError, match="not a PyTorch checkpoint"):
        read_checkpoint(text)
    layers = build_layers(ModelSpec("cnn"), (1, 8, 8), 10, 0)
    state = torch.nn.Sequential(*layers).state_dict()
    state["9.weight"] = torch.zeros(3, 3)
    bad = tmp_path / "bad.pt"
    torch.save(state, bad)
    with pytest.raises(ModelError, match=r"'9.weight' has shape \[3, 3\]"):
        initial_layers(bad, layers)
    del state["9.weight"]
    torch.save(state, bad)
    with pytest.raises(ModelError, match="missing '9.weight'"):
        initial_layers(bad, layers)
    result = CliRunner().invoke(main, ["export", str(text)])
    assert result.exit_code == 1 and "Traceback" not in result.output


@pytest.mark.broker
@pytest.mark.slow
def test_fine_tuning_with_frozen_layers_is_exact_and_sends_no_gradients_back(
        trained, mosquitto, processes, tmp_path):
    path, weights, data = trained
    steps, job = 8, "finetune"
    seen: list[str] = []
    spy = MqttTransport(BrokerConfig(port=mosquitto.port), "gradient-spy")
    spy.connect()
    spy.subscribe(f"{Topics(job).base}/stage/+/grad/+")
    for i in range(3):
        processes.device(f"dev{i}", job, mosquitto.url)
    processes.start("controller", "controller", "--job", job, "--broker", mosquitto.url,
                    "--devices", "3", "--assignment", "dev0:0-3,dev1:3-6,dev2:6-12",
                    "--no-repartition", "--max-steps", str(steps), "--micro-batches", "4",
                    "--micro-batch-size", "8", "--freeze-layers", "0-5",
                    "--init-from", str(path), "--stop-devices",
                    "--save-weights", str(tmp_path / "w.npz"))
    assert processes.wait("controller", 180) == 0, processes.log("controller")[-3000:]
    deadline = time.monotonic() + 1
    while time.monotonic() < deadline:
        try:
            seen.append(spy.inbox.get(timeout=0.1).topic)
        except Exception:
            continue
    spy.close()
    stages = {topic.split("/")[3] for topic in seen}
    assert stages == {"1"}, f"gradients went to stages {stages}"  # none to stage 0 (frozen)
    train = TrainConfig(model=ModelSpec("cnn"), micro_batches=4, micro_batch_size=8,
                        frozen_layers=5)
    reference = train_reference(train, load_dataset(DataSpec("digits")), steps, initial=weights)
    gathered = load_weights(tmp_path / "w.npz")
    assert max_weight_diff(gathered, reference) < 1e-5
    for layer in range(5):  # the frozen layers kept the given weights exactly
        assert max_weight_diff([gathered[layer]], [weights[layer]]) == 0.0
    assert max_weight_diff(gathered[5:], [weights[i] for i in range(5, 12)]) > 1e-4


def test_checkpoint_dir_writes_every_complete_version_in_the_standard_format(tmp_path):
    train = TrainConfig(model=ModelSpec("cnn"), micro_batches=4, micro_batch_size=8,
                        max_steps=6, replicate_every=3)
    job = MemoryJob(ControllerConfig(train=train, devices=2, checkpoint_dir=tmp_path), devices=2)
    job.start()
    assert job.run() is ControllerPhase.DONE
    written = sorted(p.name for p in tmp_path.glob("step-*.pt"))
    assert {"step-0000003.pt", "step-0000006.pt"} <= set(written), written
    data = load_dataset(DataSpec("digits"))
    at_three = train_reference(train, data, steps=3)
    model = load_model(tmp_path / "step-0000003.pt")
    for index, layer in enumerate(model):
        for key, value in layer.state_dict().items():
            np.testing.assert_allclose(value.numpy(), at_three[index][key], atol=1e-5)
