"""Models as sequences of layers: the unit the partitioner cuts between.

Built-in: ``mlp`` and ``cnn`` for the 8x8 digits, ``mobilenetv2`` (CIFAR-style, 32x32 inputs) for
benchmarks, and a user model given as ``module:callable`` returning an ``nn.Sequential`` or a
list of modules. Every device builds the whole model from the same seed and keeps its own range,
so initial weights agree everywhere without moving them.
"""

from __future__ import annotations

import importlib
import time
from collections.abc import Sequence

import torch
from torch import nn

from ftpipe_iot.errors import ModelError
from ftpipe_iot.protocol.specs import ModelSpec


def _mlp(input_shape: Sequence[int], num_classes: int) -> list[nn.Module]:
    features = 1
    for d in input_shape:
        features *= int(d)
    return [nn.Flatten(), nn.Linear(features, 128), nn.ReLU(), nn.Linear(128, 64), nn.ReLU(),
            nn.Linear(64, num_classes)]


def _cnn(input_shape: Sequence[int], num_classes: int) -> list[nn.Module]:
    channels, height, width = _image_shape(input_shape, "cnn")
    flat = 64 * (height // 4) * (width // 4)
    if height < 4 or width < 4:
        raise ModelError(f"model 'cnn' needs images of at least 4x4, got {height}x{width}")
    return [
        nn.Conv2d(channels, 16, 3, padding=1), nn.ReLU(),
        nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(flat, 64), nn.ReLU(), nn.Linear(64, num_classes),
    ]


def _image_shape(input_shape: Sequence[int], model: str) -> tuple[int, int, int]:
    if len(input_shape) != 3:
        raise ModelError(
            f"model {model!r} needs image inputs (channels, height, width), got shape "
            f"{tuple(input_shape)}; use 'mlp' for flat features"
        )
    c, h, w = (int(v) for v in input_shape)
    return c, h, w


class InvertedResidual(nn.Module):
    """MobileNetV2 block: 1x1 expand, 3x3 depthwise, 1x1 project, residual when shapes agree."""

    def __init__(self, inp: int, out: int, stride: int, expand: int) -> None:
        super().__init__()
        hidden = inp * expand
        self.use_residual = stride == 1 and inp == out
        layers: list[nn.Module] = []
        if expand != 1:
            layers += [nn.Conv2d(inp, hidden, 1, bias=False), nn.BatchNorm2d(hidden),
                       nn.ReLU6(inplace=True)]
        layers += [
            nn.Conv2d(hidden, hidden, 3, stride, 1, groups=hidden, bias=False),
            nn.BatchNorm2d(hidden), nn.ReLU6(inplace=True),
            nn.Conv2d(hidden, out, 1, bias=False), nn.BatchNorm2d(out),
        ]
        self.block = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.block(x)
        return x + y if self.use_residual else y


def _mobilenetv2(input_shape: Sequence[int], num_classes: int, width: float) -> list[nn.Module]:
    channels, height, w = _image_shape(input_shape, "mobilenetv2")
    if height < 8 or w < 8:
        raise ModelError(f"model 'mobilenetv2' needs images of at least 8x8, got {height}x{w}")

    def ch(c: int) -> int:
        return max(8, int(c * width + 4) // 8 * 8)

    # CIFAR variant: stride 1 in the stem and the second stage (32x32 inputs keep resolution).
    settings = [(1, 16, 1, 1), (6, 24, 2, 1), (6, 32, 3, 2), (6, 64, 4, 2), (6, 96, 3, 1),
                (6, 160, 3, 2), (6, 320, 1, 1)]
    stem = ch(32)
    layers: list[nn.Module] = [nn.Sequential(nn.Conv2d(channels, stem, 3, 1, 1, bias=False),
                                             nn.BatchNorm2d(stem), nn.ReLU6(inplace=True))]
    inp = stem
    for expand, c, n, s in settings:
        for i in range(n):
            layers.append(InvertedResidual(inp, ch(c), s if i == 0 else 1, expand))
            inp = ch(c)
    last = ch(1280) if width > 1.0 else 1280
    layers += [nn.Sequential(nn.Conv2d(inp, last, 1, bias=False), nn.BatchNorm2d(last),
                             nn.ReLU6(inplace=True)),
               nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(last, num_classes)]
    return layers


def _user_model(name: str) -> list[nn.Module]:
    module_name, _, attr = name.partition(":")
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # a user module may fail in any way: say which and how
        raise ModelError(f"cannot import user model module {module_name!r}: "
                         f"{type(exc).__name__}: {exc}") from exc
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise ModelError(f"{name!r}: {module_name} has no callable {attr!r}")
    try:
        built = factory()
    except Exception as exc:
        raise ModelError(f"user model {name!r} raised {type(exc).__name__}: {exc}") from exc
    if isinstance(built, nn.Sequential):
        return list(built.children())
    if isinstance(built, (list, tuple)) and built and all(isinstance(m, nn.Module) for m in built):
        return list(built)
    raise ModelError(
        f"user model {name!r} must return an nn.Sequential or a non-empty list of nn.Module, "
        f"got {type(built).__name__}"
    )


def build_layers(spec: ModelSpec, input_shape: Sequence[int], num_classes: int,
                 seed: int) -> list[nn.Module]:
    """Build the full layer list with weights initialised from ``seed`` (same on every device)."""
    torch.manual_seed(seed)
    if spec.name == "mlp":
        layers = _mlp(input_shape, num_classes)
    elif spec.name == "cnn":
        layers = _cnn(input_shape, num_classes)
    elif spec.name == "mobilenetv2":
        layers = _mobilenetv2(input_shape, num_classes, spec.width)
    else:
        layers = _user_model(spec.name)
    return layers


def cut_shapes(layers: Sequence[nn.Module], input_shape: Sequence[int], num_classes: int,
               model_name: str = "model") -> list[tuple[int, ...]]:
    """Per-sample shape entering each layer, plus the output shape (len(layers) + 1 entries).

    Raises ModelError when the layers do not accept the input or the output is not
    ``(num_classes,)``: that is the 'does not fit the data' check.
    """
    shapes = [tuple(int(d) for d in input_shape)]
    x = torch.zeros((2, *input_shape))
    with torch.no_grad():
        for index, layer in enumerate(layers):
            was_training = layer.training
            layer.eval()
            try:
                x = layer(x)
            except Exception as exc:
                raise ModelError(
                    f"{model_name}: layer {index} ({type(layer).__name__}) does not accept input "
                    f"of shape {tuple(x.shape[1:])}: {exc}"
                ) from exc
            finally:
                layer.train(was_training)
            shapes.append(tuple(int(d) for d in x.shape[1:]))
    if shapes[-1] != (num_classes,):
        raise ModelError(
            f"{model_name} outputs shape {shapes[-1]} per sample but the data has {num_classes} "
            "classes; the last layer must output one logit per class"
        )
    return shapes


def measure_layer_costs(layers: Sequence[nn.Module], input_shape: Sequence[int],
                        micro_batch_size: int, repeats: int = 7) -> list[float]:
    """Measured forward+backward seconds of each layer for one micro-batch (median of repeats).

    This is the reference per-layer cost profile the static split balances. The whole model runs
    a few times first: the first calls pay one-off allocation and kernel-selection costs that
    would otherwise land on whichever layer happens to go first.
    """
    x = torch.randn((micro_batch_size, *input_shape))
    model = nn.Sequential(*layers)
    model.train()
    for _ in range(3):
        model(x.requires_grad_(True)).sum().backward()
    inputs = []
    with torch.no_grad():
        h = x.detach()
        for layer in layers:
            inputs.append(h)
            h = layer(h)
    costs = []
    for layer, inp in zip(layers, inputs):
        samples = []
        for _ in range(repeats):
            leaf = inp.detach().requires_grad_(True)
            start = time.perf_counter()
            out = layer(leaf)
            if out.requires_grad:
                out.backward(torch.ones_like(out))
            samples.append(time.perf_counter() - start)
        costs.append(sorted(samples)[len(samples) // 2])
    model.zero_grad(set_to_none=True)
    # Running BatchNorm statistics moved during measurement; callers rebuild from the seed.
    return costs


def profile_layer_costs(name: str, micro_batch_size: int, width: float = 1.0) -> dict:
    """Per-layer cost profile of a built-in model on its usual input, for offline planning.

    Returns ``layer_cost_s`` (fwd+bwd seconds per micro-batch, measured in stage context),
    ``stage_overhead_s`` and ``head_overhead_s`` (``core.reference_costs``),
    ``activation_bytes`` (fp32 bytes of each layer's output for one micro-batch) and
    ``layer_memory_bytes`` (parameters, gradients and optimizer state, plus the stashed input
    activation of each micro-batch).
    """
    from ftpipe_iot.core.reference_costs import profile_stages
    from ftpipe_iot.protocol.plan import TrainConfig

    input_shape, classes = ((3, 32, 32), 10) if name == "mobilenetv2" else ((1, 8, 8), 10)
    spec = ModelSpec(name, width=width)
    layers = build_layers(spec, input_shape, classes, seed=0)
    shapes = cut_shapes(layers, input_shape, classes, name)
    profile = profile_stages(lambda: build_layers(spec, input_shape, classes, seed=0), shapes,
                             classes, TrainConfig(model=spec, micro_batch_size=micro_batch_size))

    def numel(shape: tuple[int, ...]) -> int:
        total = micro_batch_size
        for d in shape:
            total *= d
        return total

    params = [sum(p.numel() for p in layer.parameters()) for layer in layers]
    return {
        "layer_cost_s": list(profile.layer_cost_s),
        "stage_overhead_s": profile.stage_overhead_s,
        "head_overhead_s": profile.head_overhead_s,
        "activation_bytes": [4 * numel(s) for s in shapes[1:]],
        "layer_memory_bytes": [4 * 3 * p + 4 * numel(s) for p, s in zip(params, shapes[:-1])],
        "param_bytes": [4 * p for p in params],  # what a group exchanges per micro-batch
    }
