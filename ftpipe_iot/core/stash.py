"""Weight stashing for the asynchronous schedule.

A stale micro-batch of step ``s`` (one of the step's first ``StepVersions.stale_micro_batches``
on this stage) computes with version ``s - 1`` while the optimizer updates the newest weights,
so its forward and backward must see the same parameter values even though the live
parameters change in between; the step's other micro-batches compute with version ``s`` once
step ``s - 1`` is applied. Each step gets its own leaf tensors per version it uses, aliasing
that version's storage (``call_with`` runs a layer with them); the live parameters never
appear in a graph. When a step is applied and the next step's stale
micro-batches compute with the version being replaced, the live parameters move to fresh
storage and the old storage stays behind as that version: at most two versions exist at once
(the one the next step's stale micro-batches use and the live one), and the older one is
dropped the moment the step that used it is applied. Buffers (BatchNorm's running statistics)
are not versioned: they stay the module's own and are updated in forward order.

With delay compensation (``StepVersions.predicts_weights``), a stale micro-batch computes at weights
predicted from its version and the optimizer's state (``core.prediction``) instead of the
version itself. Its weights are made the moment its version becomes live (after the optimizer
step that makes it, or when the stage starts or loads replicas), because the live weights and
the optimizer state move on as soon as the step before it is applied. The live weights are then
updated in place: at most the live version and the predicted weights of two steps exist at
once (one copy more than without compensation). The prediction reads the applied step's
gradient back from the optimizer's first moment before and after its step: the moment before is
snapshotted in ``before_update``, after that step's predicted weights are released.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from torch import nn

from ftpipe_iot.core.grouping import OrderedGradients
from ftpipe_iot.core.prediction import first_moment, predicted_weights
from ftpipe_iot.core.schedule import StepVersions
from ftpipe_iot.errors import PlanError

LayerWeights = dict[str, torch.Tensor]


def has_tied_parameters(layer: nn.Module) -> bool:
    """Whether one of ``layer``'s parameters sits under two names (tied weights): ``call_with``
    must then tie a replacement to every name. Ask once per layer, not per call: walking the
    module tree costs 5-25 us a layer, a tenth of what ``call_with`` saves."""
    return sum(1 for _ in layer.named_parameters(remove_duplicate=False)) != \
        sum(1 for _ in layer.named_parameters())


def call_with(layer: nn.Module, weights: Mapping[str, torch.Tensor] | None,
              inputs: torch.Tensor, tied: bool) -> torch.Tensor:
    """``layer(inputs)`` computed with ``weights`` (parameter name -> tensor) in place of those
    parameters (None: the layer's own), as ``torch.func.functional_call`` computes it;
    ``tied``: ``has_tied_parameters(layer)``.

    A stale stage runs every micro-batch this way, and functional_call's bookkeeping (about
    35 us a layer on the digits CNN, as long as a small layer's arithmetic, and slept ten
    times over on an emulated device ten times slower) is for cases a stage's layer seldom
    has; so the tensors are put in the owning modules' parameter slots for the call and the
    originals put back after it, the same kernels on the same tensors. A layer with tied
    weights keeps functional_call, which ties the replacement to every name."""
    if not weights:  # None, or a layer with nothing to train: its own parameters
        return layer(inputs)
    if tied:
        return torch.func.functional_call(layer, dict(weights), (inputs,))
    swapped: list[tuple[nn.Module, str, object]] = []
    try:
        for name, tensor in weights.items():
            path, _, attr = name.rpartition(".")
            owner = layer.get_submodule(path) if path else layer
            swapped.append((owner, attr, owner._parameters[attr]))
            owner._parameters[attr] = tensor  # type: ignore[assignment]
        return layer(inputs)
    finally:
        for owner, attr, original in reversed(swapped):
            owner._parameters[attr] = original  # type: ignore[assignment]


class WeightStash:
    """The weight versions of one stage's ``layers`` (or of a whole model, in the simulator),
    whose live weights are at version ``start_version``."""

    def __init__(self, layers: Sequence[nn.Module], versions: StepVersions,
                 start_version: int,
                 optimizers: Sequence[torch.optim.Optimizer | None] = (),
                 keep_each: bool = False) -> None:
        if versions.forward_version(start_version) != start_version:
            raise PlanError(f"the asynchronous schedule cannot start at step {start_version}: "
                            "it is not a drain point")
        self.versions = versions
        # a group member keeps each micro-batch's gradient apart for its peers (the reducer)
        self.keep_each = keep_each
        self.params = [[(name, p) for name, p in layer.named_parameters() if p.requires_grad]
                       for layer in layers]
        self.live_version = start_version
        self._kept: dict[int, list[list[torch.Tensor]]] = {}  # version -> storage, by layer
        self._steps: dict[int, list[LayerWeights]] = {}
        self._gradients: dict[int, OrderedGradients] = {}
        # with compensation: the optimizer of each layer, and step -> predicted weights
        self.optimizers = list(optimizers) or [None] * len(self.params)
        if versions.predicts_weights and len(self.optimizers) != len(self.params):
            raise PlanError("weight prediction needs one optimizer (or None) per layer")
        self._predicted: dict[int, list[list[torch.Tensor]]] = {}
        # the optimizers' first moments before the step being applied: the prediction made
        # after it reads the step's gradient back from them (``core.prediction``)
        self._moments_before: dict[torch.Tensor, torch.Tensor] | None = None
        self._predict_next()

    def weights(self, step: int, micro_batch: int) -> list[LayerWeights]:
        """Per layer, the parameters ``micro_batch`` of ``step`` computes with: the same leaves
        for every micro-batch of the step that uses the same version, so autograd sums their
        gradients there."""
        stale = self.versions.micro_batch_is_stale(step, micro_batch)
        leaves = self._steps.get((step, stale))
        if leaves is not None:
            return leaves
        storage = self._storage(step, stale)
        leaves = [{name: tensor.detach().requires_grad_(True)
                   for (name, _), tensor in zip(layer, kept)}
                  for layer, kept in zip(self.params, storage)]
        self._steps[(step, stale)] = leaves
        if step not in self._gradients:
            # one float64 sum in micro-batch order over both versions' leaves: the stale
            # micro-batches are the step's first ones, so the order is the step's own
            self._gradients[step] = OrderedGradients(
                _flat(leaves), self.keep_each,
                sources=lambda index, step=step: self._leaves_of(step, index))
        return leaves

    def _leaves_of(self, step: int, micro_batch: int) -> list[torch.Tensor]:
        stale = self.versions.micro_batch_is_stale(step, micro_batch)
        return _flat(self._steps[(step, stale)])

    def _storage(self, step: int, stale: bool) -> list[list[torch.Tensor]]:
        """The tensors a micro-batch of ``step`` computes with: predicted, kept or live."""
        version = step - 1 if stale else step
        if stale and self.versions.predicts_weights:
            if step in self._predicted:
                return self._predicted[step]
            raise PlanError(f"step {step} needs the weights predicted from version {version}; "
                            f"this stage predicted for steps {sorted(self._predicted)}")
        if version == self.live_version:
            # ``.data`` aliases the storage with its own version counter: a later in-place
            # update of the live parameter cannot reach it (the storage moves first, ``apply``)
            return [[p.data for _, p in layer] for layer in self.params]
        if version in self._kept:
            return self._kept[version]
        raise PlanError(f"step {step} needs weight version {version}; this stage holds "
                        f"{sorted({self.live_version, *self._kept})}")

    def gradients(self, step: int) -> OrderedGradients:
        """Sums step ``step``'s micro-batch gradients in micro-batch order (call ``weights``
        first)."""
        return self._gradients[step]

    def available(self, step: int, micro_batch: int) -> bool:
        """Whether this stage holds the version ``micro_batch`` of ``step`` computes with."""
        stale = self.versions.micro_batch_is_stale(step, micro_batch)
        if stale and self.versions.predicts_weights:
            return step in self._predicted
        version = step - 1 if stale else step
        return version == self.live_version or version in self._kept

    def before_update(self, step: int) -> None:
        """Step ``step`` is complete: its gradients go to the live parameters, its leaves are
        forgotten, and the live weights move to fresh storage if the next step computes with
        them as they are. Call right before the optimizer step."""
        self._steps.pop((step, True), None)
        self._steps.pop((step, False), None)
        gradients = self._gradients.pop(step, None)
        if gradients is not None:
            gradients.finish(step)
        summed = gradients.params if gradients is not None else None
        for index, p in enumerate(p for layer in self.params for _, p in layer):
            p.grad = None if summed is None else summed[index].grad
        self._predicted.pop(step, None)
        self._moments_before = self._first_moments() if self._predicts_from_last(step) \
            else None
        version = step  # the live version before this update
        for old in [v for v in self._kept if v < version]:
            del self._kept[old]
        if not self.versions.drains_after(step) and not self.versions.predicts_weights:
            self._kept[version] = [[p.data for _, p in layer] for layer in self.params]
            for layer in self.params:
                for _, p in layer:
                    p.data = p.data.clone()
        self.live_version = step + 1

    def after_update(self, step: int) -> None:
        """Step ``step``'s optimizer step is done: predict the weights of the step that will
        compute with the new version. Call right after the optimizer step."""
        if self.live_version != step + 1:
            raise PlanError(f"after_update({step}) without before_update({step})")
        self._predict_next()
        self._moments_before = None

    def reload(self) -> None:
        """The live weights and optimizer state were replaced (replicas loaded): predict
        again from them."""
        self._predicted.clear()
        self._moments_before = None
        self._predict_next()

    def _predicts_from_last(self, step: int) -> bool:
        """Whether the prediction made after step ``step`` uses its gradient: it does where
        the step it predicts for is stale, except right after a drain, where a stage may
        have just loaded the version from replicas, which hold no gradient."""
        return (self.versions.predicts_weights and self.versions.is_stale(step + 2)
                and not self.versions.drains_after(step))

    def _first_moments(self) -> dict[torch.Tensor, torch.Tensor]:
        return {p: first_moment(optimizer, p)
                for layer, optimizer in zip(self.params, self.optimizers)
                if optimizer is not None for _, p in layer}

    def _predict_next(self) -> None:
        """Make the predicted weights of the step that computes with the live version while
        it is stale (the step after next), if there is one."""
        step = self.live_version + 1
        if not self.versions.predicts_weights or not self.versions.is_stale(step):
            return
        predicted = []
        for layer, optimizer in zip(self.params, self.optimizers):
            by_param = predicted_weights(optimizer, self._moments_before)
            predicted.append([by_param[p] if p in by_param else p.detach().clone()
                              for _, p in layer])
        self._predicted[step] = predicted

    @property
    def versions_held(self) -> int:
        """Weight versions in memory: the live one and those kept or predicted for in-flight
        steps."""
        return 1 + len(self._kept) + len(self._predicted)

    @property
    def kept_bytes(self) -> int:
        """Bytes of parameter storage beyond the live weights (the cost of stashing)."""
        return sum(t.numel() * t.element_size()
                   for kept in [*self._kept.values(), *self._predicted.values()]
                   for layer in kept for t in layer)


def _flat(leaves: Sequence[LayerWeights]) -> list[torch.Tensor]:
    return [tensor for layer in leaves for tensor in layer.values()]
