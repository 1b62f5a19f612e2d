"""What the members of a stage group exchange at the end of a step, and how they combine it
(pure: arrays in, layer state out).

Every gradient is accumulated in float64, on every stage and in the reference alike, and cast to
float32 once, for the optimizer. A float32 sum depends on its order, and training amplifies its
last-bit differences (ReLU6's kinks in MobileNetV2 turn 1e-7 into 1e-2 in three steps); a float64
sum of the same float32 gradients in another order differs by far less than a float32 rounding
step, so once cast it is, all but never, the same float32 number. That is what lets the members
of a group exchange one partial sum each instead of every micro-batch's gradient: a member sums
its own micro-batches in micro-batch order, every member adds the partials in the same order
(by their first micro-batch), and the update equals the single-process one. Holders that take
over each other's micro-batches (``--resiliency >= 1``) still exchange per micro-batch, so that
the first result of each counts once; those are added in micro-batch order, the reference's
float64 sum exactly.
BatchNorm's running statistics are sequential in micro-batch order
(r <- (1 - m) r + m * batch_mean), so a member's own updates cannot simply be averaged: each
member records the batch statistics of its micro-batches, and every member replays all of them
in micro-batch order from the step's start (equal to the reference to float rounding: they do
not feed back into training).
Layers with other buffers that change in training cannot be grouped (``grouping_refusal``, asked
by the controller before a job starts and by the layout chooser).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
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
    (step, micro-batch): under the asynchronous schedule the forwards of two steps interleave.
    ``start`` is the running statistics the next step to apply starts from."""

    layers: Sequence[nn.Module]
    first_layer: int
    current: tuple[int, int] | None = None  # the (step, micro-batch) being forwarded
    stats: dict[tuple[int, int], dict[str, tuple[np.ndarray, np.ndarray]]] = field(
        default_factory=dict)
    start: dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = field(
        default_factory=dict)

    def __post_init__(self) -> None:
        self.modules = _batch_norms(self.layers, self.first_layer)
        # module -> its running statistics and momentum while a recorded forward runs
        self._lent: dict[_BatchNorm, tuple[torch.Tensor, torch.Tensor, torch.Tensor | None,
                                           float | None]] = {}
        for key, module in self.modules:
            module.register_forward_pre_hook(self._lend)
            module.register_forward_hook(self._record(key))
        self.snapshot()

    def _lend(self, module: _BatchNorm, _args: tuple) -> None:
        """Before a recorded forward, give the module fresh running statistics and a momentum
        of 1: the kernel then writes into them exactly the batch mean and unbiased variance it
        computed anyway, and the module's own statistics stay the step's start (every
        member replays the step's records from there). Computing the statistics again
        (``x.mean``, ``x.var``) took longer than the forward of MobileNetV2's layers itself.
        Fresh tensors each time: autograd keeps the ones a forward saw until its backward."""
        if not module.training or self.current is None:
            return
        self._give_back(module)  # a forward that raised left them lent
        self._lent[module] = (module.running_mean, module.running_var,
                              module.num_batches_tracked, module.momentum)
        channels = module.running_mean.shape
        module.running_mean = torch.zeros(channels, dtype=module.running_mean.dtype)
        module.running_var = torch.ones(channels, dtype=module.running_var.dtype)
        if module.num_batches_tracked is not None:
            module.num_batches_tracked = torch.zeros_like(module.num_batches_tracked)
        module.momentum = 1.0

    def _give_back(self, module: _BatchNorm) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Put the module's own running statistics and momentum back; the lent statistics,
        which now hold the batch's, or None when none were lent."""
        lent = self._lent.pop(module, None)
        if lent is None:
            return None
        batch = (module.running_mean, module.running_var)
        module.running_mean, module.running_var, module.num_batches_tracked, \
            module.momentum = lent
        return batch

    def _record(self, key: str):
        def record(module: _BatchNorm, _args: tuple, _output: torch.Tensor) -> None:
            batch = self._give_back(module)
            if batch is None or self.current is None:
                return
            mean, var = batch
            self.stats.setdefault(self.current, {})[key] = (mean.numpy(), var.numpy())
        return record

    def snapshot(self) -> None:
        """Take the running statistics as they are now as the next step's start (after the
        step before it was replayed, or after replicas were loaded)."""
        self.start = {key: (m.running_mean.clone(), m.running_var.clone(),
                            m.num_batches_tracked.clone()) for key, m in self.modules}

    def step_start_state(self, layer: int) -> dict[str, np.ndarray]:
        """The running statistics of ``layer`` as the current step started, named as the
        layer's ``state_dict`` names them: the state a replica of the current version holds,
        whatever forwards of the step have done to the live buffers since."""
        prefix = f"{layer}."
        state = {}
        for key, (mean, var, tracked) in self.start.items():
            if not key.startswith(prefix):
                continue
            module = key[len(prefix):]
            path = f"{module}." if module else ""
            state[f"{path}running_mean"] = mean.numpy().copy()
            state[f"{path}running_var"] = var.numpy().copy()
            state[f"{path}num_batches_tracked"] = tracked.numpy().copy()
        return state

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
            # new tensors, not copies into the old ones: under async the next step's forwards
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


def sum_partial(named: Sequence[tuple[str, nn.Parameter]],
                totals: Sequence[torch.Tensor | None]) -> dict[str, np.ndarray]:
    """A member's float64 sum over its micro-batches as flat arrays: ``<layer>.<parameter>``
    (a parameter none of its micro-batches reached is left out)."""
    return {key: total.numpy() for (key, _), total in zip(named, totals) if total is not None}


def apply_gradients(named: Sequence[tuple[str, nn.Parameter]],
                    merged: Mapping[str, np.ndarray], micro_batches: int) -> None:
    """Set every parameter's gradient to the sum of all members' micro-batch gradients, added
    in float64 in micro-batch order and cast once: the single-process accumulation, bit for
    bit, on every member."""
    for key, param in named:
        total = None
        for micro_batch in range(micro_batches):
            grad = merged.get(f"{micro_batch}:{key}")
            if grad is not None:
                tensor = torch.from_numpy(np.array(grad, dtype=np.float64))  # a copy
                total = tensor if total is None else total.add_(tensor)
        param.grad = None if total is None else total.to(param.dtype)


def apply_sums(named: Sequence[tuple[str, nn.Parameter]],
               partials: Sequence[Mapping[str, np.ndarray]]) -> None:
    """Set every parameter's gradient to the float64 sum of the members' partial sums, added in
    the given order (the same on every member), cast once."""
    for key, param in named:
        total = None
        for partial in partials:
            value = partial.get(key)
            if value is not None:
                tensor = torch.from_numpy(np.array(value, dtype=np.float64))  # a copy
                total = tensor if total is None else total.add_(tensor)
        param.grad = None if total is None else total.to(param.dtype)


def partial_misfit(named: Sequence[tuple[str, nn.Parameter]],
                   partial: Mapping[str, np.ndarray], summed: bool = False) -> str | None:
    """Why a peer's gradients cannot be added to this stage's, or None: per micro-batch
    (``<micro-batch>:<name>``, float32) or, ``summed``, a partial sum (``<name>``, float64)."""
    shapes = {key: tuple(param.shape) for key, param in named}
    dtype = np.float64 if summed else np.float32
    for key, value in partial.items():
        name = key if summed else key.partition(":")[2]
        if name not in shapes:
            return f"gradient partial names an unknown parameter {key!r}"
        if tuple(value.shape) != shapes[name] or value.dtype != dtype:
            return f"gradient partial {key} is {value.dtype}{list(value.shape)}"
    return None


class OrderedGradients:
    """Gradients summed in float64, in a fixed micro-batch order, whatever order the backward
    passes run in.

    Each backward runs with ``.grad`` cleared, so it leaves exactly its micro-batch's gradient;
    that is added to the step's float64 total when its turn in the order comes (a backward that
    runs early is kept aside until then), and ``finish`` puts the total, cast to the
    parameter's dtype, in ``.grad``. The order is 0, 1, 2, ... unless ``expect`` gives the
    micro-batches this holder computes. ``keep_each`` keeps every micro-batch's gradient apart
    instead: what a holder that may be taken over sends its peers.
    """

    def __init__(self, params: Sequence[nn.Parameter], keep_each: bool = False,
                 sources: Callable[[int], Sequence[torch.Tensor]] | None = None) -> None:
        self.params = list(params)
        self.keep_each = keep_each
        # where a micro-batch's backward leaves its gradient, when not in ``params`` (a step
        # whose micro-batches compute with two weight versions, ``core.stash``); the sums
        # still go to ``params``
        self.sources = sources
        self.order: dict[int, tuple[int, ...]] = {}  # step -> the micro-batches, in order
        self.next: dict[int, int] = {}  # step -> position in the order of the next to add
        self.early: dict[int, dict[int, list[torch.Tensor | None]]] = {}
        self.totals: dict[int, list[torch.Tensor | None]] = {}

    def expect(self, step: int, micro_batches: Sequence[int]) -> None:
        """The micro-batches of ``step`` this holder computes, in the order to add them."""
        self.order.setdefault(step, tuple(sorted(micro_batches)))

    def _source(self, micro_batch: int) -> Sequence[torch.Tensor]:
        return self.params if self.sources is None else self.sources(micro_batch)

    def before(self, step: int, micro_batch: int) -> None:
        for p in self._source(micro_batch):
            p.grad = None

    def after(self, step: int, micro_batch: int) -> None:
        source = self._source(micro_batch)
        grads = [p.grad for p in source]
        for p in source:
            p.grad = None
        self.early.setdefault(step, {})[micro_batch] = grads
        if self.keep_each:
            return
        early = self.early[step]
        while (index := self._next_index(step)) is not None and index in early:
            self._add(step, early.pop(index))
            self.next[step] = self.next.get(step, 0) + 1

    def _next_index(self, step: int) -> int | None:
        position = self.next.get(step, 0)
        order = self.order.get(step)
        if order is None:
            return position
        return order[position] if position < len(order) else None

    def _add(self, step: int, grads: Sequence[torch.Tensor | None]) -> None:
        totals = self.totals.setdefault(step, [None] * len(self.params))
        for i, grad in enumerate(grads):
            if grad is None:
                continue
            if totals[i] is None:
                totals[i] = grad.detach().to(torch.float64)
            else:
                totals[i].add_(grad.detach())

    def take(self, step: int, micro_batch: int) -> list[torch.Tensor | None]:
        """A kept micro-batch gradient (``keep_each``), forgotten here."""
        return self.early.get(step, {}).pop(micro_batch)

    def total(self, step: int) -> list[torch.Tensor | None]:
        """The step's float64 sums so far (per parameter; None where nothing came)."""
        return list(self.totals.get(step, [None] * len(self.params)))

    def finish(self, step: int) -> None:
        """The step's sum goes to ``.grad``, cast to each parameter's dtype; forgotten here."""
        totals = self.totals.pop(step, None)
        for i, p in enumerate(self.params):
            total = None if totals is None else totals[i]
            p.grad = None if total is None else total.to(p.dtype)
        self.next.pop(step, None)
        self.early.pop(step, None)
        self.order.pop(step, None)
