"""Bytes on the wire per sample at every cut of real models (prints JSON, writes it and a PNG):
activations and gradients of a trained model encoded by the project's wire (msgpack envelope,
lz4 when it pays, optional fp16), with and without compression and in fp32 and fp16.

The models are trained first (the demo's CNN on the handwritten digits; MobileNetV2 at width
0.25 on synthetic 32x32 images, as in the heterogeneity benchmark), so the ReLU outputs have
the sparsity they have in training, not at initialisation.

    python benchmarks/wire_bytes.py [--steps 60] [--out benchmarks/results/wire_bytes.json]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from benchmarks.harness import save_figure, write_results  # noqa: E402
from ftpipe_iot.core.data import DataSpec, load_dataset  # noqa: E402
from ftpipe_iot.core.models import ModelSpec, build_layers  # noqa: E402
from ftpipe_iot.core.reference import train_reference  # noqa: E402
from ftpipe_iot.core.stage import micro_batch_loss  # noqa: E402
from ftpipe_iot.protocol.messages import Activation, Gradient, envelope  # noqa: E402
from ftpipe_iot.protocol.plan import TrainConfig  # noqa: E402
from ftpipe_iot.protocol.vocab import WireCodec  # noqa: E402
from ftpipe_iot.protocol.wire import WireOptions, encode  # noqa: E402

MB = 8
ENCODINGS = {
    "fp32": WireOptions(compress=False),
    "fp32+lz4": WireOptions(compress=True),
    "fp16": WireOptions(compress=False, codec=WireCodec.FP16),
    "fp16+lz4": WireOptions(compress=True, codec=WireCodec.FP16),
    "int8": WireOptions(compress=False, codec=WireCodec.INT8),
    "int4": WireOptions(compress=False, codec=WireCodec.INT4),
}
MODELS = {
    "cnn/digits": TrainConfig(model=ModelSpec("cnn"), data=DataSpec("digits"),
                              micro_batches=4, micro_batch_size=MB),
    "mobilenetv2(0.25)/synthetic-32x32": TrainConfig(
        model=ModelSpec("mobilenetv2", width=0.25),
        data=DataSpec("synthetic", shape=(3, 32, 32), samples=1024),
        micro_batches=4, micro_batch_size=MB, lr=0.01),
}


def _bytes(message, options: WireOptions) -> int:
    return sum(len(f) for f in encode(envelope(message, "bench", "dev0", 1, 0, 0, 1), options))


def cuts_of(config: TrainConfig, steps: int) -> list[dict]:
    """Per cut: the tensor, its zero fraction and its bytes per sample in every encoding."""
    data = load_dataset(config.data)
    weights = train_reference(config, data, steps)
    layers = build_layers(config.model, data.input_shape, data.num_classes, config.seed)
    for layer, state in zip(layers, weights):
        layer.load_state_dict({k: torch.from_numpy(v) for k, v in state.items()})
    x = torch.from_numpy(data.x_train[:MB])
    y = torch.from_numpy(data.y_train[:MB])
    outputs = []
    value = x
    for layer in layers:
        value = layer(value)
        value.retain_grad()
        outputs.append(value)
    micro_batch_loss(value, y, config.micro_batches).backward()
    labels = y.numpy()
    rows = []
    for index, out in enumerate(outputs[:-1]):  # the last output is the loss input, not a cut
        act = out.detach().numpy()
        grad = out.grad.numpy()
        row = {"cut_after_layer": index, "layer": type(layers[index]).__name__,
               "shape": list(act.shape[1:]), "zero_fraction": float((act == 0).mean()),
               "raw_fp32_bytes_per_sample": act[0].nbytes}
        for name, options in ENCODINGS.items():
            row[f"act_{name}"] = _bytes(Activation(act, labels, True), options) / MB
            row[f"grad_{name}"] = _bytes(Gradient(grad), options) / MB
        rows.append(row)
    return rows


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results["models"]), figsize=(12, 4.5))
    for ax, (name, rows) in zip(np.atleast_1d(axes), results["models"].items()):
        cuts = [r["cut_after_layer"] for r in rows]
        for encoding in ENCODINGS:
            ax.plot(cuts, [r[f"act_{encoding}"] / 1024 for r in rows], marker="o",
                    label=f"activations, {encoding}")
        ax.set_title(name, fontsize=9)
        ax.set_xlabel("cut after layer")
        ax.set_ylabel("KiB per sample on the wire")
        ax.set_yscale("log")
        ax.legend(fontsize=7)
    save_figure(fig, path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60, help="training steps before measuring")
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results" /
                        "wire_bytes.json")
    args = parser.parse_args()
    torch.set_num_threads(1)
    started = time.monotonic()
    models = {}
    for name, config in MODELS.items():
        models[name] = cuts_of(config, args.steps)
    results = {"micro_batch_size": MB, "trained_steps": args.steps, "models": models,
               "loadavg": os.getloadavg(), "wall_s": round(time.monotonic() - started, 1)}
    write_results(results, args.out, lambda png: plot(results, png))


if __name__ == "__main__":
    main()
