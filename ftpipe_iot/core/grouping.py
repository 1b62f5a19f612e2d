"""What the members of a stage group exchange at the end of a step, and how they combine it
(pure: arrays in, layer state out).

Each member keeps the gradient of each of its micro-batches apart and sends them to its peers;
every member then adds all M of them in micro-batch order, which is the single-process
accumulation bit for bit (every micro-batch's loss is already divided by M), so all members
apply the identical update and it equals the reference's. A float sum depends on its order:
adding per-member sums instead would differ in the last bits, and training amplifies that.
BatchNorm's running statistics are sequential in micro-batch order
(r <- (1 - m) r + m * batch_mean), so a member's own updates cannot simply be averaged: each
member records the batch statistics of its micro-batches, and every member replays all of them
in micro-batch order from the step's start (equal to the reference to float rounding: they do
not feed back into training).
Layers with other buffers that change in training cannot be grouped (``grouping_refusal``, asked
by the controller before a job starts and by the layout chooser).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import nn

_BatchNorm = nn.modules.batchnorm._BatchNorm


def _batch_norms(layers: Sequence[nn.Module], first_layer: int) -> list[tuple[str, _BatchNorm]]:
    found = []
    for offset, layer in enumerate(layers):
        for name, module in layer.named_modules():
            if isinstance(module, _BatchNorm) and module.track_running_stats:
                found.append((f"{first_layer + offset}.{name}", module))
    return found


def has_running_statistics(layers: Sequence[nn.Module]) -> bool:
    """Whether a forward in training changes state (BatchNorm's running statistics)."""
    return bool(_batch_norms(layers, 0))


def grouping_refusal(layers: Sequence[nn.Module]) -> str | None:
    """Why these layers cannot be held by a group, or None: buffers that change in training
    other than BatchNorm's (with a momentum) cannot be kept identical across members."""
    for layer in layers:
        for name, module in layer.named_modules():
            if isinstance(module, _BatchNorm):
                if module.track_running_stats and module.momentum is None:
                    return (f"{type(layer).__name__} ({name or 'itself'}) uses a cumulative "
                            "BatchNorm average (momentum=None)")
                continue
            if any(True for _ in module.buffers(recurse=False)):
                return (f"{type(layer).__name__} ({name or 'itself'}) has buffers that change "
                        "in training")
    return None


@dataclass
class BatchNormRecorder:
    """Records each micro-batch's batch statistics at every BatchNorm of a stage, keyed by
    (step, micro-batch): under PipeDream-2BW the forwards of two steps interleave. ``start``
    is the running statistics the next step to apply starts from."""

    layers: Sequence[nn.Module]
    first_layer: int
    current: tuple[int, int] | None = None  # the (step, micro-batch) being forwarded
    stats: dict[tuple[int, int], dict[str, tuple[np.ndarray, np.ndarray]]] = field(
        default_factory=dict)
    start: dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = field(
        default_factory=dict)

    def __post_init__(self) -> None:
        self.modules = _batch_norms(self.layers, self.first_layer)
        for key, module in self.modules:
            module.register_forward_pre_hook(self._hook(key))
        self.snapshot()

    def _hook(self, key: str):
        def record(module: _BatchNorm, args: tuple) -> None:
            if not module.training or self.current is None:
                return
            x = args[0].detach()
            dims = [d for d in range(x.dim()) if d != 1]
            mean = x.mean(dim=dims)
            var = x.var(dim=dims, unbiased=True)
            self.stats.setdefault(self.current, {})[key] = (mean.numpy().copy(),
                                                            var.numpy().copy())
        return record

    def snapshot(self) -> None:
        """Take the running statistics as they are now as the next step's start (after the
        step before it was replayed, or after replicas were loaded)."""
        self.start = {key: (m.running_mean.clone(), m.running_var.clone(),
                            m.num_batches_tracked.clone()) for key, m in self.modules}

    def applied(self, step: int) -> None:
        """``step`` was replayed: forget its records, and start the next step from here."""
        for key in [k for k in self.stats if k[0] <= step]:
            del self.stats[key]
        self.snapshot()

    def partial(self, step: int, micro_batch: int) -> dict[str, np.ndarray]:
        """One micro-batch's records as flat arrays: ``<micro-batch>:<module>:mean|var``."""
        out = {}
        for key, (mean, var) in self.stats.get((step, micro_batch), {}).items():
            out[f"{micro_batch}:{key}:mean"] = mean
            out[f"{micro_batch}:{key}:var"] = var
        return out

    def own(self, step: int) -> dict[str, np.ndarray]:
        """Every record of ``step`` this stage made, flat (a stage alone behind a group)."""
        return {key: value for (s, micro_batch) in self.stats if s == step
                for key, value in self.partial(step, micro_batch).items()}

    def replay(self, records: Mapping[str, np.ndarray], micro_batches: int) -> None:
        """Set every BatchNorm's running statistics as if the step's micro-batches had been
        seen in order by one module (``records`` merges every member's ``partial``)."""
        for key, module in self.modules:
            mean, var, tracked = (t.clone() for t in self.start[key])
            momentum = float(module.momentum)  # grouping_refusal excludes momentum=None
            for micro_batch in range(micro_batches):
                batch_mean = records.get(f"{micro_batch}:{key}:mean")
                batch_var = records.get(f"{micro_batch}:{key}:var")
                if batch_mean is None or batch_var is None:
                    continue
                mean.mul_(1 - momentum).add_(torch.from_numpy(np.array(batch_mean)), alpha=momentum)
                var.mul_(1 - momentum).add_(torch.from_numpy(np.array(batch_var)), alpha=momentum)
                tracked += 1
            # new tensors, not copies into the old ones: under 2BW the next step's forwards
            # ran already and their graphs saved the running statistics they saw (autograd's
            # version check would fail their backwards)
            module.running_mean = mean
            module.running_var = var
            module.num_batches_tracked = tracked


def trainable(layers: Sequence[nn.Module], first_layer: int) -> list[tuple[str, nn.Parameter]]:
    """A stage's trainable parameters, named ``<layer>.<parameter>`` (global layer index)."""
    return [(f"{first_layer + offset}.{name}", param)
            for offset, layer in enumerate(layers)
            for name, param in layer.named_parameters() if param.requires_grad]


def gradient_partial(named: Sequence[tuple[str, nn.Parameter]],
                     each: Mapping[int, Sequence[torch.Tensor | None]]) -> dict[str, np.ndarray]:
    """A member's micro-batch gradients as flat arrays: ``<micro-batch>:<layer>.<parameter>``
    (a parameter that got no gradient in a micro-batch is left out, as autograd leaves it)."""
    out = {}
    for micro_batch, grads in each.items():
        for (key, _), grad in zip(named, grads):
            if grad is not None:
                out[f"{micro_batch}:{key}"] = grad.detach().numpy()
    return out


def apply_gradients(named: Sequence[tuple[str, nn.Parameter]],
                    merged: Mapping[str, np.ndarray], micro_batches: int) -> None:
    """Set every parameter's gradient to the sum of all members' micro-batch gradients, added
    in micro-batch order: the single-process accumulation, bit for bit, on every member."""
    for key, param in named:
        total = None
        for micro_batch in range(micro_batches):
            grad = merged.get(f"{micro_batch}:{key}")
            if grad is not None:
                tensor = torch.from_numpy(np.array(grad, copy=True))
                total = tensor if total is None else total + tensor
        param.grad = total


def partial_misfit(named: Sequence[tuple[str, nn.Parameter]],
                   partial: Mapping[str, np.ndarray]) -> str | None:
    """Why a peer's gradients cannot be added to this stage's, or None."""
    shapes = {key: tuple(param.shape) for key, param in named}
    for key, value in partial.items():
        _, _, name = key.partition(":")
        if name not in shapes:
            return f"gradient partial names an unknown parameter {key!r}"
        if tuple(value.shape) != shapes[name] or value.dtype != np.float32:
            return f"gradient partial {key} is {value.dtype}{list(value.shape)}"
    return None


class OrderedGradients:
    """Gradients summed in micro-batch order, whatever order the backward passes run in.

    Autograd adds each backward's gradient to ``.grad`` in the order the passes run, and a float
    sum depends on its order; the single-process reference runs micro-batches 0, 1, 2, ...
    A backward that runs in order accumulates in place as autograd does (no copy); one that
    runs early is kept aside and added when its turn comes. ``keep_each`` keeps every
    micro-batch's gradient apart instead: what a group member sends its peers.
    """

    def __init__(self, params: Sequence[nn.Parameter], keep_each: bool = False) -> None:
        self.params = list(params)
        self.keep_each = keep_each
        self.next: dict[int, int] = {}  # step -> next micro-batch index to add
        self.early: dict[int, dict[int, list[torch.Tensor | None]]] = {}
        self._saved: list[torch.Tensor | None] | None = None

    def before(self, step: int, micro_batch: int) -> None:
        if self.keep_each or micro_batch != self.next.setdefault(step, 0):
            self._saved = [p.grad for p in self.params]
            for p in self.params:
                p.grad = None

    def after(self, step: int, micro_batch: int) -> None:
        if self._saved is not None:
            self.early.setdefault(step, {})[micro_batch] = [p.grad for p in self.params]
            for p, grad in zip(self.params, self._saved):
                p.grad = grad
            self._saved = None
            if self.keep_each:
                return
        else:
            self.next[step] += 1
        early = self.early.get(step, {})
        while self.next.get(step, 0) in early:
            self._add(early.pop(self.next[step]))
            self.next[step] += 1

    def _add(self, grads: Sequence[torch.Tensor | None]) -> None:
        for p, grad in zip(self.params, grads):
            if grad is not None:
                p.grad = grad if p.grad is None else p.grad + grad

    def take(self, step: int, micro_batch: int) -> list[torch.Tensor | None]:
        """A kept micro-batch gradient (``keep_each``), forgotten here."""
        return self.early.get(step, {}).pop(micro_batch)

    def finish(self, step: int) -> None:
        """The step's gradients are all in ``.grad``."""
        self.next.pop(step, None)
        self.early.pop(step, None)
