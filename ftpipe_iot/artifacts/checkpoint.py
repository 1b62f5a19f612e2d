"""Standard model checkpoints: one ``.pt`` file that plain ``torch.load`` opens.

It holds the state dict of the whole ``nn.Sequential`` (keys ``<layer>.<tensor>``), the model
spec, input shape, classes, the training config and the step the weights are from. Every value
is a tensor or a plain Python value, so ``torch.load(path, weights_only=True)`` reads it without
unpickling any code. ``load_model`` rebuilds the module in one call.
"""

from __future__ import annotations

import zipfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from ftpipe_iot.core.models import build_layers
from ftpipe_iot.errors import ModelError
from ftpipe_iot.protocol.plan import TrainConfig
from ftpipe_iot.protocol.specs import ModelSpec

FORMAT = "ftpipe-iot-model"
FORMAT_VERSION = 1


def _why_not(path: Path, exc: Exception) -> str:
    # torch's own message suggests weights_only=False, which would run pickled code from the
    # file: never repeat that advice for a file we refused.
    if not zipfile.is_zipfile(path):
        return "not a torch.save archive"
    return f"it holds more than tensors and plain values ({type(exc).__name__})"


@dataclass(frozen=True)
class Checkpoint:
    """A trained model as the file holds it."""

    state_dict: dict[str, torch.Tensor]
    model: ModelSpec
    input_shape: tuple[int, ...]
    num_classes: int
    train: TrainConfig
    step: int

    def build(self) -> nn.Sequential:
        """The model with these weights, in evaluation mode."""
        module = nn.Sequential(*build_layers(self.model, self.input_shape, self.num_classes,
                                             self.train.seed))
        problem = state_dict_misfit(module, self.state_dict)
        if problem:
            raise ModelError(f"checkpoint does not fit model {self.model.name!r}: {problem}")
        module.load_state_dict(self.state_dict)
        return module.eval()


def layers_state_dict(layers: Mapping[int, Mapping[str, np.ndarray]]) -> dict[str, torch.Tensor]:
    """Per-layer states (layer index -> tensor name -> array) as one ``nn.Sequential`` dict."""
    return {f"{layer}.{name}": torch.from_numpy(np.array(value, copy=True))
            for layer in sorted(layers) for name, value in layers[layer].items()}


def save_checkpoint(path: Path, layers: Mapping[int, Mapping[str, np.ndarray]],
                    train: TrainConfig, input_shape: tuple[int, ...], num_classes: int,
                    step: int) -> Path:
    """Write a standard checkpoint of per-layer states gathered from the fleet."""
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"format": FORMAT, "format_version": FORMAT_VERSION,
                "state_dict": layers_state_dict(layers), "model": {
                    "name": train.model.name, "width": train.model.width},
                "input_shape": list(input_shape), "num_classes": num_classes,
                "train": train.to_dict(), "step": step}, path)
    return path


def read_checkpoint(path: str | Path) -> Checkpoint:
    """Read a checkpoint written by ``save_checkpoint``; a clear error for anything else."""
    path = Path(path)
    try:
        raw = torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError as exc:
        raise ModelError(f"checkpoint {path} does not exist") from exc
    except Exception as exc:  # torch raises many types on a file that is not a checkpoint
        raise ModelError(f"{path} is not a PyTorch checkpoint ({_why_not(path, exc)})") from exc
    if not isinstance(raw, dict) or raw.get("format") != FORMAT:
        raise ModelError(f"{path} is not an ftpipe-iot model checkpoint (a plain state dict can "
                         "be given to --init-from, but export and evaluate need the model spec)")
    if raw.get("format_version") != FORMAT_VERSION:
        raise ModelError(f"{path}: checkpoint format {raw.get('format_version')!r}, this build "
                         f"reads {FORMAT_VERSION}")
    try:
        return Checkpoint(dict(raw["state_dict"]), ModelSpec(**raw["model"]),
                          tuple(int(d) for d in raw["input_shape"]), int(raw["num_classes"]),
                          TrainConfig.from_dict(raw["train"]), int(raw["step"]))
    except (KeyError, TypeError, ValueError) as exc:
        raise ModelError(f"{path}: checkpoint field missing or wrong: {exc}") from exc


def load_model(path: str | Path) -> nn.Sequential:
    """The trained ``nn.Sequential`` from a checkpoint file, ready for inference."""
    return read_checkpoint(path).build()


def state_dict_misfit(module: nn.Module, state: Mapping[str, Any]) -> str | None:
    """The first key or shape that does not fit ``module``, as a sentence; None when it fits."""
    expected = module.state_dict()
    for key, value in expected.items():
        if key not in state:
            return f"missing {key!r} (shape {list(value.shape)})"
        given = state[key]
        if not hasattr(given, "shape") or tuple(given.shape) != tuple(value.shape):
            return (f"{key!r} has shape {list(getattr(given, 'shape', []))}, the model needs "
                    f"{list(value.shape)}")
    extra = sorted(set(state) - set(expected))
    return f"unexpected {extra[0]!r}" if extra else None


def initial_layers(path: str | Path, layers: list[nn.Module]) -> dict[int, dict[str, np.ndarray]]:
    """Per-layer states to start training from: a checkpoint of ours, or a plain state dict of
    the whole ``nn.Sequential``; refused with the first mismatch."""
    path = Path(path)
    try:
        raw = torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError as exc:
        raise ModelError(f"--init-from: {path} does not exist") from exc
    except Exception as exc:
        raise ModelError(f"--init-from: {path} is not a PyTorch file ({_why_not(path, exc)})") \
            from exc
    state = raw.get("state_dict") if isinstance(raw, dict) and raw.get("format") == FORMAT \
        else raw
    if not isinstance(state, Mapping):
        raise ModelError(f"--init-from: {path} holds no state dict")
    module = nn.Sequential(*layers)
    problem = state_dict_misfit(module, state)
    if problem:
        raise ModelError(f"--init-from {path} does not fit the model: {problem}")
    out: dict[int, dict[str, np.ndarray]] = {i: {} for i in range(len(layers))}
    for key, value in state.items():
        layer, _, name = key.partition(".")
        out[int(layer)][name] = value.detach().cpu().numpy().copy()
    return out
