"""The compute of the collaborative and federated modes, with no I/O: arrays in, arrays out.

U-shaped split (docs/design.md §13): a data device holds the front ``[0, p)`` and the head
``[q, L)``, the server holds ``[p, q)`` once per device. Per micro-batch: the device forwards the
front (``DevicePart.forward``), the server its part (``ServerReplica.forward``), the device the
head and the loss with its own labels and backwards the head (``DevicePart.loss``), the server
backwards its part (``ServerReplica.backward``), the device the front (``DevicePart.backward``).
Each side accumulates gradients over the N micro-batches of a mini-batch and applies its
optimizer once, after the N-th backward: the result equals training the whole model on the
device's data in one process with the same micro-batching (the exactness contract).

``LocalModel`` is the federated baseline's whole model on a device: one forward and backward per
mini-batch.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from ftpipe_iot.collab.privacy import DevicePrivacy, check_private_layers
from ftpipe_iot.core.stage import make_optimizer, micro_batch_loss
from ftpipe_iot.errors import StageInputError
from ftpipe_iot.protocol.collab import PrivacySettings
from ftpipe_iot.protocol.plan import TrainConfig
from ftpipe_iot.protocol.vocab import DropReason

States = dict[int, dict[str, np.ndarray]]


def export_states(layers: Mapping[int, nn.Module]) -> States:
    """Every layer's state as numpy copies, by global layer index."""
    return {index: {k: v.detach().cpu().numpy().copy() for k, v in layer.state_dict().items()}
            for index, layer in layers.items()}


def load_states(layers: Mapping[int, nn.Module], states: Mapping[int, Mapping[str, np.ndarray]]
                ) -> None:
    """Load weights (not optimizer state: FedAvg averages the model only) into ``layers``."""
    for index, layer in layers.items():
        layer.load_state_dict({k: torch.from_numpy(np.array(v, copy=True))
                               for k, v in states[index].items()})


def _tensor(x: np.ndarray, shape: tuple[int, ...], what: str) -> torch.Tensor:
    if not isinstance(x, np.ndarray) or not np.issubdtype(x.dtype, np.floating):
        raise StageInputError(DropReason.BAD_TENSOR, f"{what} is not a float array")
    if tuple(x.shape[1:]) != shape:
        raise StageInputError(DropReason.BAD_SHAPE, f"{what} has shape {x.shape}, expected "
                              f"(B, {shape})")
    return torch.from_numpy(np.array(x, dtype=np.float32, copy=True))


@dataclass(frozen=True)
class RoundStart:
    """What a part's training carries from one round into the next besides the weights (which
    come from the global model): its optimizer state (momentum stays local, as in PiPar) and,
    with DP, its noise generator and privacy accountant. Taken when a round starts, so that the
    round can be redone exactly when its coordinator resumes it (collab/failover.py)."""

    round: int
    optimizer: dict[str, Any]
    privacy: dict[str, Any] | None = None


def _optimizer_state(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    return copy.deepcopy(optimizer.state_dict())


def _restore_optimizer(optimizer: torch.optim.Optimizer, state: Mapping[str, Any]) -> None:
    # a copy: load_state_dict may keep the given tensors, which the next step updates in place,
    # and the snapshot must survive a second redo of the same round
    optimizer.load_state_dict(copy.deepcopy(dict(state)))


@dataclass
class _Stash:
    inputs: torch.Tensor
    outputs: torch.Tensor | None


class _Accumulating:
    """Micro-batches of a step done so far; the optimizer steps when all N are."""

    def __init__(self, micro_batches: int) -> None:
        self.micro_batches = micro_batches
        self.pending: dict[tuple[int, int], _Stash] = {}
        self.backwards: dict[int, set[int]] = {}

    def stash(self, step: int, mb: int, stash: _Stash) -> None:
        if (step, mb) in self.pending or mb in self.backwards.get(step, set()):
            raise StageInputError(DropReason.DUPLICATE, f"micro-batch {(step, mb)} again")
        self.pending[(step, mb)] = stash

    def take(self, step: int, mb: int) -> _Stash:
        stash = self.pending.pop((step, mb), None)
        if stash is None:
            raise StageInputError(DropReason.UNEXPECTED,
                                  f"no forward pass stashed for micro-batch {(step, mb)}")
        return stash

    def finish(self, step: int, mb: int) -> bool:
        """Count a backward; True when it was the step's last."""
        done = self.backwards.setdefault(step, set())
        done.add(mb)
        if len(done) < self.micro_batches:
            return False
        del self.backwards[step]
        return True

    def clear(self) -> None:
        self.pending.clear()
        self.backwards.clear()


class DevicePart:
    """A data device's layers in the U-shaped split: the front ``[0, split)`` and the head
    ``[head, L)``, one optimizer over both (DP-SGD clips the whole part's per-sample gradient)."""

    def __init__(self, layers: Sequence[nn.Module], split: int, head: int,
                 cut_shapes: Sequence[tuple[int, ...]], num_classes: int, config: TrainConfig,
                 privacy: PrivacySettings | None = None, samples: int = 0,
                 device: str = "") -> None:
        self.front = nn.Sequential(*layers[:split])
        self.head = nn.Sequential(*layers[head:])
        self.layers = {i: layers[i] for i in (*range(split), *range(head, len(layers)))}
        self.input_shape, self.head_shape = cut_shapes[0], cut_shapes[head]
        self.cut_shape = cut_shapes[split]
        self.num_classes = num_classes
        self.config = config
        self.front.train()
        self.head.train()
        parts = nn.ModuleList([self.front, self.head])
        optimizer = make_optimizer(parts, config)
        assert optimizer is not None, "the head always has parameters"
        self.privacy: DevicePrivacy | None = None
        if privacy is not None:
            check_private_layers(list(self.layers.values()), list(self.layers))
            self.privacy = DevicePrivacy(privacy, [self.front, self.head], optimizer,
                                         config.micro_batch_size, config.micro_batches,
                                         samples, config.seed, device)
        self.optimizer = optimizer
        self._steps = _Accumulating(config.micro_batches)

    @property
    def epsilon(self) -> float | None:
        return None if self.privacy is None else self.privacy.epsilon

    def forward(self, step: int, mb: int, x: np.ndarray) -> np.ndarray:
        """Front forward of one micro-batch: the smashed data to send up. With DP the graph is
        not kept (the backward recomputes it, see ``backward``)."""
        inputs = _tensor(x, self.input_shape, "input")
        if self.privacy is None:
            outputs = self.front(inputs)
            self._steps.stash(step, mb, _Stash(inputs, outputs))
            return outputs.detach().numpy()
        with torch.no_grad():
            outputs = self.front(inputs)
        self._steps.stash(step, mb, _Stash(inputs, None))
        return outputs.numpy()

    def loss(self, step: int, mb: int, a2: np.ndarray, y: np.ndarray
             ) -> tuple[np.ndarray, float, int]:
        """Head forward, loss with the device's labels, head backward; returns the gradient of
        the server's output, the micro-batch's mean loss and its correct predictions."""
        if (step, mb) not in self._steps.pending:
            raise StageInputError(DropReason.UNEXPECTED, f"server output for micro-batch "
                                  f"{(step, mb)} that was not sent")
        inputs = _tensor(a2, self.head_shape, "server output").requires_grad_(True)
        labels = torch.from_numpy(y.astype(np.int64))
        if inputs.shape[0] != labels.shape[0]:
            raise StageInputError(DropReason.BAD_SHAPE, f"server output of {inputs.shape[0]} "
                                  f"rows for {labels.shape[0]} labels")
        logits = self.head(inputs)
        loss = micro_batch_loss(logits, labels, self.config.micro_batches)
        loss.backward()
        correct = int((logits.detach().argmax(dim=1) == labels).sum())
        assert inputs.grad is not None
        return inputs.grad.numpy(), float(loss.detach()) * self.config.micro_batches, correct

    def backward(self, step: int, mb: int, g1: np.ndarray) -> bool:
        """Front backward with the gradient of the cut; True when the optimizer stepped.

        With DP the front's forward runs again here, under Opacus' hooks: Opacus keeps the
        activations of a module's forwards on a stack and takes the newest at each backward,
        which would pair a backward with the wrong micro-batch when N forwards run ahead."""
        stash = self._steps.take(step, mb)
        grad = _tensor(g1, self.cut_shape, "cut gradient")
        outputs = stash.outputs if stash.outputs is not None else self.front(stash.inputs)
        if tuple(grad.shape) != tuple(outputs.shape):
            raise StageInputError(DropReason.BAD_SHAPE, f"cut gradient {tuple(grad.shape)} for "
                                  f"an output of {tuple(outputs.shape)}")
        outputs.backward(grad)
        if not self._steps.finish(step, mb):
            return False
        if self.privacy is not None:
            self.privacy.step()
        else:
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
        return True

    def abandon(self) -> None:
        """Forget a half-done step (a new round starts from the global model)."""
        self._steps.clear()
        self.optimizer.zero_grad(set_to_none=True)
        if self.privacy is not None:
            self.privacy.optimizer.zero_grad(set_to_none=True)

    def round_start(self, round_index: int) -> RoundStart:
        """The state to go back to if round ``round_index``, starting now, is redone."""
        return RoundStart(round_index, _optimizer_state(self.optimizer),
                          None if self.privacy is None else self.privacy.state())

    def go_back(self, start: RoundStart) -> None:
        """Forget the round in progress and restore the state it started with."""
        self.abandon()
        _restore_optimizer(self.optimizer, start.optimizer)
        if self.privacy is not None and start.privacy is not None:
            self.privacy.restore(start.privacy)


class ServerReplica:
    """The server part ``[split, head)`` for one data device (PiPar keeps one per device)."""

    def __init__(self, layers: Sequence[nn.Module], first_index: int,
                 input_shape: tuple[int, ...], config: TrainConfig) -> None:
        self.module = nn.Sequential(*layers)
        self.module.train()
        self.layers = {first_index + i: layer for i, layer in enumerate(layers)}
        self.input_shape = input_shape
        optimizer = make_optimizer(self.module, config)
        if optimizer is None:
            raise StageInputError(DropReason.UNEXPECTED, "server part without parameters")
        self.optimizer = optimizer
        self._steps = _Accumulating(config.micro_batches)

    def forward(self, step: int, mb: int, a1: np.ndarray) -> np.ndarray:
        inputs = _tensor(a1, self.input_shape, "smashed data").requires_grad_(True)
        outputs = self.module(inputs)
        self._steps.stash(step, mb, _Stash(inputs, outputs))
        return outputs.detach().numpy()

    def backward(self, step: int, mb: int, g2: np.ndarray) -> tuple[np.ndarray, bool]:
        """Returns the gradient of the device's cut and whether the optimizer stepped."""
        stash = self._steps.take(step, mb)
        assert stash.outputs is not None
        if not isinstance(g2, np.ndarray) or g2.shape != tuple(stash.outputs.shape):
            self._steps.pending[(step, mb)] = stash
            raise StageInputError(DropReason.BAD_SHAPE, f"gradient of shape "
                                  f"{getattr(g2, 'shape', None)} for an output of shape "
                                  f"{tuple(stash.outputs.shape)}")
        stash.outputs.backward(torch.from_numpy(np.array(g2, dtype=np.float32, copy=True)))
        assert stash.inputs.grad is not None
        grad = stash.inputs.grad.numpy()
        if not self._steps.finish(step, mb):
            return grad, False
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return grad, True

    def round_start(self, round_index: int) -> RoundStart:
        """The state to go back to if round ``round_index``, starting now, is redone."""
        return RoundStart(round_index, _optimizer_state(self.optimizer))

    def go_back(self, start: RoundStart) -> None:
        """Forget the half-done step and restore the optimizer state of the round's start."""
        self._steps.clear()
        self.optimizer.zero_grad(set_to_none=True)
        _restore_optimizer(self.optimizer, start.optimizer)


class LocalModel:
    """The federated baseline: the whole model on the device, one optimizer step per
    mini-batch (DP-SGD on all of it when asked)."""

    def __init__(self, layers: Sequence[nn.Module], input_shape: tuple[int, ...],
                 config: TrainConfig, privacy: PrivacySettings | None = None, samples: int = 0,
                 device: str = "") -> None:
        self.module = nn.Sequential(*layers)
        self.module.train()
        self.layers = dict(enumerate(layers))
        self.input_shape = input_shape
        optimizer = make_optimizer(self.module, config)
        assert optimizer is not None
        self.optimizer = optimizer
        self.privacy: DevicePrivacy | None = None
        if privacy is not None:
            check_private_layers(list(layers), list(range(len(layers))))
            self.privacy = DevicePrivacy(privacy, [self.module], optimizer, config.batch_size,
                                         1, samples, config.seed, device)

    @property
    def epsilon(self) -> float | None:
        return None if self.privacy is None else self.privacy.epsilon

    def train_step(self, x: np.ndarray, y: np.ndarray) -> tuple[float, int]:
        """One mini-batch: mean loss, backward, optimizer step; returns loss and correct."""
        inputs = _tensor(x, self.input_shape, "input")
        labels = torch.from_numpy(y.astype(np.int64))
        logits = self.module(inputs)
        loss = nn.functional.cross_entropy(logits, labels)
        loss.backward()
        if self.privacy is not None:
            self.privacy.step()
        else:
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
        return float(loss.detach()), int((logits.detach().argmax(dim=1) == labels).sum())

    def round_start(self, round_index: int) -> RoundStart:
        """The state to go back to if round ``round_index``, starting now, is redone."""
        return RoundStart(round_index, _optimizer_state(self.optimizer),
                          None if self.privacy is None else self.privacy.state())

    def go_back(self, start: RoundStart) -> None:
        """Restore the state round ``start.round`` started with (a whole step is atomic here:
        nothing half-done to forget)."""
        self.optimizer.zero_grad(set_to_none=True)
        _restore_optimizer(self.optimizer, start.optimizer)
        if self.privacy is not None and start.privacy is not None:
            self.privacy.restore(start.privacy)


def evaluate(layers: Sequence[nn.Module], x: np.ndarray, y: np.ndarray, batch: int = 256
             ) -> tuple[float, float]:
    """Test accuracy and mean loss of the whole model (evaluation mode, no gradients)."""
    model = nn.Sequential(*layers).eval()
    correct, loss = 0, 0.0
    with torch.no_grad():
        for lo in range(0, len(x), batch):
            logits = model(torch.from_numpy(x[lo:lo + batch]))
            labels = torch.from_numpy(y[lo:lo + batch])
            loss += float(nn.functional.cross_entropy(logits, labels, reduction="sum"))
            correct += int((logits.argmax(dim=1) == labels).sum())
    return correct / max(1, len(x)), loss / max(1, len(x))
