"""One pipeline stage's compute and bookkeeping, with no I/O: inputs in, outputs out.

The device agent turns wire messages into calls here and the returned outputs into wire messages.
Per step a stage forwards and backwards M micro-batches, accumulating gradients, and applies its
optimizer exactly once when the step's gradients are all in; that is what makes the result equal
single-process training with the same micro-batching.

A stage is a compute kernel (this module: the layers' forward and backward, timed, seeded and
checked) plus a versioning (``core.versioning``: which weights a step computes with, one version
or the asynchronous schedule's stash) plus a reducer (``core.reducers``: when a step is
complete and with which gradients, local accumulation or the group exchange). The stage knows
no schedule: the versioning and the reducer are chosen from the schedule's answers and the
stage's holders, and any versioning works with any reducer.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import nn

from ftpipe_iot.core.grouping import (
    BatchNormRecorder,
    OrderedGradients,
    apply_gradients,
    apply_sums,
    gradient_partial,
    has_running_statistics,
    partial_misfit,
    sum_partial,
    trainable,
)
from ftpipe_iot.core.outputs import (
    MicroBatchDone,
    MicroBatchResult,
    SendActivation,
    SendGradient,
    SendPartial,
    StageOutput,
    StepDone,
)
from ftpipe_iot.core.reducers import GroupExchange, PartialSums, Reducers, Update, reducer_for
from ftpipe_iot.core.replicas import export_layer, import_layer
from ftpipe_iot.core.rng import seed_layer
from ftpipe_iot.core.schedule import StepVersions
from ftpipe_iot.core.stash import call_with, has_tied_parameters
from ftpipe_iot.core.timings import StageTimings, Timed
from ftpipe_iot.core.versioning import Versioning, versioning_for
from ftpipe_iot.errors import PlanError, StageInputError
from ftpipe_iot.observability.timeline import Timeline
from ftpipe_iot.protocol.messages import LayerReplica
from ftpipe_iot.protocol.plan import Plan, TrainConfig
from ftpipe_iot.protocol.vocab import DropReason, OptimizerName, SpanKind


def _stamp(arrivals: dict[int, float], index: int) -> Callable[[torch.Tensor], None]:
    def hook(_grad: torch.Tensor) -> None:
        arrivals[index] = time.perf_counter()

    return hook


def make_optimizer(layer: nn.Module, config: TrainConfig) -> torch.optim.Optimizer | None:
    """One optimizer per layer: the maths is per-parameter, and per-layer state can be replicated
    and moved between devices layer by layer."""
    params = [p for p in layer.parameters() if p.requires_grad]
    if not params:
        return None
    if config.optimizer is OptimizerName.ADAM:
        return torch.optim.Adam(params, lr=config.lr)
    return torch.optim.SGD(params, lr=config.lr, momentum=config.momentum)


def freeze(layers: Sequence[nn.Module], frozen: int, first_layer: int = 0) -> None:
    """Layers with a global index below ``frozen`` get no gradients (so no optimizer state)."""
    for offset, layer in enumerate(layers):
        if first_layer + offset < frozen:
            for param in layer.parameters():
                param.requires_grad_(False)


def train_mode(layers: Sequence[nn.Module], frozen: int, first_layer: int = 0) -> None:
    """Training mode, but frozen layers in evaluation mode: a fixed layer's BatchNorm keeps its
    running statistics and its Dropout is off, as fine-tuning expects."""
    for offset, layer in enumerate(layers):
        layer.train(first_layer + offset >= frozen)


def micro_batch_loss(logits: torch.Tensor, labels: torch.Tensor, micro_batches: int
                     ) -> torch.Tensor:
    """Loss whose gradients, summed over M micro-batches, equal the mini-batch mean loss's."""
    return nn.functional.cross_entropy(logits, labels) / micro_batches


@dataclass
class _Pending:
    inputs: torch.Tensor
    outputs: torch.Tensor
    # perf_counter when the gradient reached each layer's output, filled during backward
    grad_arrivals: dict[int, float] = field(default_factory=dict)


@dataclass
class Stage:
    """Compute state of stage ``index`` of ``n_stages`` holding ``layers`` (global ids from
    ``first_layer``). ``expected_shape`` is the per-sample input shape the stage accepts.

    A stage held by more than one device (``group_size`` holders: group members and warm
    standbys) exchanges: at ``--resiliency 0`` each member publishes one float64 partial sum
    of its micro-batches (``core.reducers.PartialSums``), at ``--resiliency >= 1`` every
    holder publishes each micro-batch's gradient as soon as its backward is done
    (``GroupExchange``), and it applies the optimizer once all M micro-batches of the step are
    covered, by its own or other holders' contributions (``offer_partial``), in step order. A
    stage alone (``LocalAccumulation``) applies the optimizer after its expected micro-batches
    (given with the step's first forward). ``versions``: the schedule bound to the
    job's numbers; under the asynchronous schedule the stage keeps the stash
    (``core.stash.WeightStash``).

    ``data_sink``: where activations and gradients go as soon as they are made, before the
    call computes on (a device sends them from there); without one every output is in the
    list the call returns. One call may do several things in a row: a backward, then the
    step's update, then the forwards of the next step's inputs that came early; a gradient
    held in the list until all of it was done reached the stage before only after the
    update and those forwards (under async, at every step's boundary: the first stage then
    waited for it, and the last for the forwards it gates). A group contribution stays in
    the list: it tells the other holders that the micro-batch is done, so it goes out with
    the micro-batch's loss report; a holder killed between the two would leave a micro-batch
    that no holder takes over and whose loss the controller never gets (a stalled step).
    """

    index: int
    n_stages: int
    layers: Sequence[nn.Module]
    first_layer: int
    config: TrainConfig
    expected_shape: tuple[int, ...]
    num_classes: int
    # emulates a slower device after each computation: gets its CPU seconds, sleeps, and
    # returns the seconds it meant to sleep (the emulated device's own slowness)
    compute_hook: Callable[[float], float] | None = None
    start_step: int = 0
    group_size: int = 1
    member: int = 0
    versions: StepVersions | None = None  # asynchronous: which version each step uses
    # False when an earlier stage has several holders: inputs then arrive out of order
    ordered_inputs: bool = True
    # where the compute's spans go (forward, backward, optimizer, exchange, evaluate)
    timeline: Timeline = field(default_factory=lambda: Timeline(enabled=False))
    data_sink: Callable[[SendActivation | SendGradient], None] | None = None
    module: nn.Sequential = field(init=False)
    optimizers: list[torch.optim.Optimizer | None] = field(init=False)
    pending: dict[tuple[int, int], _Pending] = field(init=False, default_factory=dict)
    completed_steps: set[int] = field(init=False, default_factory=set)
    timings: StageTimings = field(init=False, default_factory=StageTimings)
    reducer: Reducers = field(init=False)
    versioning: Versioning = field(init=False)

    def __post_init__(self) -> None:
        self.module = nn.Sequential(*self.layers)
        frozen = self.config.frozen_layers
        freeze(self.layers, frozen, self.first_layer)
        # Gradients stop at the first trainable stage: a stage after only fixed layers sends
        # none back, and a stage of only fixed layers does no backward at all.
        self.sends_gradients = not self.is_first and self.first_layer > frozen
        self.all_frozen = self.first_layer + len(self.layers) <= frozen
        self.optimizers = [make_optimizer(layer, self.config) for layer in self.layers]
        self.tied_weights = [has_tied_parameters(layer) for layer in self.layers]
        if self.start_step > 0:
            self.completed_steps = {self.start_step - 1}
        self.named = trainable(self.layers, self.first_layer)
        self.reducer = reducer_for(self.group_size, self.config.micro_batches,
                                   takes_over=self.config.resiliency >= 1)
        if self.versions is not None:
            self.versions = self.versions.for_stage(later_stages=self.n_stages - 1 - self.index)
        self.versioning = versioning_for(self.layers, [p for _, p in self.named], self.versions,
                                         self.start_step, self.optimizers,
                                         keep_each=isinstance(self.reducer, GroupExchange))
        # BatchNorm's running statistics are updated in forward order. Holders that exchange,
        # and a stage alone behind a group, record each micro-batch's batch statistics and
        # replay them in index order when the step is applied, so the stage behind a group
        # forwards its micro-batches as they come instead of waiting for the slowest member's
        # (records are keyed by step: under async two steps' forwards interleave). A stage alone
        # with inputs in order feeds its layers in index order: no recording cost.
        running = has_running_statistics(self.layers)
        self.recorder = BatchNormRecorder(self.layers, self.first_layer) \
            if self.reducer.exchanges or (running and not self.ordered_inputs) else None
        self._in_order = not self.reducer.exchanges and running and self.recorder is None
        self._early: dict[int, dict[int, tuple[np.ndarray, np.ndarray]]] = {}
        self._next_forward: dict[int, int] = {}
        # training inputs of a later step than the weights: held until the stage gets there
        self._future: dict[int, dict[int, tuple[np.ndarray, np.ndarray, int | None,
                                                Sequence[int] | None]]] = {}
        self.computed: dict[int, int] = {}  # step -> micro-batches this holder computed
        self._own: dict[int, tuple[int, ...]] = {}  # step -> the micro-batches routed here

    @classmethod
    def from_plan(cls, plan: Plan, device: str, layers: Sequence[nn.Module],
                  shapes: Sequence[tuple[int, ...]],
                  compute_hook: Callable[[float], float] | None = None,
                  timeline: Timeline | None = None) -> Stage:
        """The stage ``device`` holds under ``plan``, from the whole model's ``layers`` and
        the per-sample input shape at every cut (``shapes``): its layers, its holders (so its
        reducer), the schedule's versions (so its versioning), and whether an earlier stage
        has several holders (its inputs then come out of order)."""
        assignment = plan.stage_of(device)
        if assignment is None:
            raise PlanError(f"plan {plan.version} gives {device} no stage")
        return cls(index=assignment.stage, n_stages=plan.n_stages,
                   layers=layers[assignment.start:assignment.end],
                   first_layer=assignment.start, config=plan.train,
                   expected_shape=tuple(shapes[assignment.start]),
                   num_classes=plan.num_classes, compute_hook=compute_hook,
                   start_step=plan.resume_step, group_size=len(assignment.members),
                   member=assignment.member_index(device) or 0,
                   versions=StepVersions.of(plan.train, plan.steps_per_epoch),
                   ordered_inputs=all(len(s.members) == 1 for s in plan.stages[:assignment.stage]),
                   timeline=timeline if timeline is not None else Timeline(enabled=False))

    @property
    def is_first(self) -> bool:
        return self.index == 0

    @property
    def is_last(self) -> bool:
        return self.index == self.n_stages - 1

    @property
    def last_completed_step(self) -> int:
        return max(self.completed_steps, default=-1)

    @property
    def version(self) -> int:
        """Steps applied so far: the replica version of this stage's current weights."""
        return self.last_completed_step + 1

    @property
    def at_step_boundary(self) -> bool:
        """No micro-batch of the current step is half done (weights equal ``version``)."""
        return not self.pending and self.reducer.idle() \
            and not any(self._early.values()) and not self._future

    @property
    def exportable(self) -> bool:
        """Whether ``export`` gives the state of ``version`` now. Weights and optimizer change
        only when a step is applied; BatchNorm's running statistics change with every forward,
        but a stage that records them keeps the step's start, so a group member that already
        forwards the next step's inputs (they came while it finished this one) still exports
        the boundary it passed."""
        return self.at_step_boundary or self.recorder is not None \
            or not has_running_statistics(self.layers)

    def export(self) -> list[LayerReplica]:
        """Replicas of every layer at the current version (call when ``exportable``)."""
        replicas = [export_layer(layer, optimizer, self.first_layer + offset, self.version)
                    for offset, (layer, optimizer) in enumerate(zip(self.layers,
                                                                    self.optimizers))]
        if self.recorder is not None:
            for replica in replicas:
                replica.state.update(self.recorder.step_start_state(replica.layer))
        return replicas

    def load(self, replicas: dict[int, LayerReplica]) -> None:
        """Load every layer's weights and optimizer state from replicas (one version)."""
        for offset, (layer, optimizer) in enumerate(zip(self.layers, self.optimizers)):
            import_layer(replicas[self.first_layer + offset], layer, optimizer)
        self.versioning.reload()
        if self.recorder is not None:  # the loaded running statistics are the next step's start
            self.recorder.snapshot()

    def _check_input(self, x: np.ndarray, y: np.ndarray) -> None:
        if not isinstance(x, np.ndarray) or not isinstance(y, np.ndarray):
            raise StageInputError(DropReason.BAD_TENSOR, "activation or labels are not arrays")
        if x.ndim < 1 or tuple(x.shape[1:]) != self.expected_shape:
            raise StageInputError(DropReason.BAD_SHAPE, f"stage {self.index} expects inputs of "
                                  f"shape (B, {self.expected_shape}), got {x.shape}")
        if y.shape != (x.shape[0],) or not np.issubdtype(y.dtype, np.integer):
            raise StageInputError(DropReason.BAD_SHAPE, f"labels of shape {y.shape} do not match "
                                  f"a batch of {x.shape[0]}")
        if not np.issubdtype(x.dtype, np.floating):
            raise StageInputError(DropReason.BAD_TENSOR, f"activation dtype {x.dtype} is not float")
        if self.is_last and (y.min(initial=0) < 0 or y.max(initial=0) >= self.num_classes):
            raise StageInputError(DropReason.BAD_LABEL, f"labels outside 0..{self.num_classes - 1}")

    def _timed(self, fn: Callable[[], torch.Tensor]) -> tuple[torch.Tensor, Timed]:
        """Run ``fn``; returns its result and its ``Timed`` seconds (the wall seconds are what
        the capacity estimate sees).

        The emulation hook gets this thread's CPU seconds instead: with one intra-op thread the
        compute runs on this thread, and CPU time leaves out waits for the GIL (the network
        thread reading the next activation) or for a core, which a slow-down factor would
        otherwise multiply into a device far slower than its profile says.
        """
        start, cpu_start = time.perf_counter(), time.thread_time()
        result = fn()
        cpu_s = time.thread_time() - cpu_start
        computed = time.perf_counter()
        # the sleep the emulation meant: waking from it late (a core or the interpreter
        # held by others) is the host's, not the emulated device's
        emulated_s = self.compute_hook(cpu_s) if self.compute_hook is not None else 0.0
        ended = time.perf_counter()
        if torch.get_num_threads() > 1:
            cpu_s = computed - start
        return result, Timed(ended - start, min(cpu_s, computed - start), emulated_s)

    def forward(self, step: int, micro_batch: int, x: np.ndarray, y: np.ndarray, train: bool,
                expected: int | None = None, own: Sequence[int] | None = None
                ) -> list[StageOutput]:
        """Forward one micro-batch; the last stage also computes the loss and starts backward.
        ``expected``: how many of the step's micro-batches this member computes (all of them
        without a group); ``own``: which ones, when the routes say (their gradients are then
        summed in that order)."""
        self._check_input(x, y)
        if not train:
            return self._evaluate(step, micro_batch, x, y)
        key = (step, micro_batch)
        if self.reducer.exchanges and step < self.version:
            raise StageInputError(DropReason.LATE, f"micro-batch {key}: the step is complete, "
                                  "other holders computed it")
        already = self.reducer.already(step, micro_batch)
        if key in self.pending or already is DropReason.DUPLICATE \
                or step in self.completed_steps or micro_batch in self._early.get(step, {}):
            raise StageInputError(DropReason.DUPLICATE, f"micro-batch {key} was already processed")
        if already is DropReason.LATE:
            raise StageInputError(DropReason.LATE, f"micro-batch {key} was already computed by "
                                  "another holder")
        # a holder behind its peers, or a micro-batch that computes with the version the step
        # before makes: wait for it (in index order: a later one of the step waits too)
        if not self.versioning.available(step, micro_batch) or \
                any(index < micro_batch for index in self._future.get(step, {})):
            self._future.setdefault(step, {})[micro_batch] = (x, y, expected, own)
            return []
        if own is not None:
            self._own.setdefault(step, tuple(own))
        self.reducer.expect(step, len(own) if own is not None
                            else expected or self.config.micro_batches)
        if not self._in_order:
            return self._handed_on(self._forward_one(step, micro_batch, x, y))
        early = self._early.setdefault(step, {})
        early[micro_batch] = (x, y)
        out: list[StageOutput] = []
        while self._next_forward.setdefault(step, 0) in early:
            index = self._next_forward[step]
            out += self._handed_on(self._forward_one(step, index, *early.pop(index)))
            self._next_forward[step] = index + 1
        return out

    def _forward_one(self, step: int, micro_batch: int, x: np.ndarray, y: np.ndarray
                     ) -> list[StageOutput]:
        key = (step, micro_batch)
        train_mode(self.layers, self.config.frozen_layers, self.first_layer)
        inputs = torch.from_numpy(np.array(x, dtype=np.float32, copy=True))
        if self.sends_gradients:
            inputs.requires_grad_(True)
        if self.all_frozen:
            return self._forward_frozen(step, micro_batch, inputs, y)
        arrivals: dict[int, float] = {}
        if self.recorder is not None:
            self.recorder.current = key
        with self.timeline.span(SpanKind.FORWARD, step, micro_batch):
            outputs, timed = self._timed(
                lambda: self._forward_layers(inputs, arrivals, step, micro_batch))
        if self.recorder is not None:
            self.recorder.current = None
        self.timings.forward_s += timed.wall_s
        self.timings.add(micro_batch, timed)
        if not self.is_last:
            self.pending[key] = _Pending(inputs, outputs, arrivals)
            return [SendActivation(step, micro_batch, outputs.detach().numpy(), y, True)]
        labels = torch.from_numpy(y.astype(np.int64))
        loss = micro_batch_loss(outputs, labels, self.config.micro_batches)
        correct = int((outputs.detach().argmax(dim=1) == labels).sum())
        result = MicroBatchResult(step, micro_batch, True,
                                  float(loss.detach()) * self.config.micro_batches, correct,
                                  int(len(y)))
        self.pending[key] = _Pending(inputs, loss, arrivals)
        return [result, *self._backward(step, micro_batch, None)]

    def _forward_frozen(self, step: int, micro_batch: int, inputs: torch.Tensor, y: np.ndarray
                        ) -> list[StageOutput]:
        """A stage of fixed layers: forward only; the micro-batch is done once it is sent on."""
        with torch.no_grad(), self.timeline.span(SpanKind.FORWARD, step, micro_batch):
            outputs, timed = self._timed(
                lambda: self._forward_layers(inputs, {}, step, micro_batch))
        self.timings.forward_s += timed.wall_s
        self.timings.add(micro_batch, timed)
        out: list[StageOutput] = [SendActivation(step, micro_batch, outputs.numpy(), y, True)]
        self.computed[step] = self.computed.get(step, 0) + 1
        # nothing to sum, but the holders count the micro-batch done
        return self._handed_on(out) + self._micro_batch_done(step, micro_batch, None)

    def _forward_layers(self, inputs: torch.Tensor, arrivals: dict[int, float], step: int,
                        micro_batch: int) -> torch.Tensor:
        """``nn.Sequential``'s loop, timing each layer; a gradient hook on each output stamps
        when backward reaches it, which times each layer's backward too. Hooks return None, so
        the arithmetic is exactly the unhooked one. Each layer draws its random numbers from a
        generator keyed by (seed, step, micro-batch, layer) (``core.rng``)."""
        self.timings.per_layer(len(self.layers))
        weights = self.versioning.weights(step, micro_batch)
        h = inputs
        for index, layer in enumerate(self.layers):
            seed_layer(self.config.seed, step, micro_batch, self.first_layer + index)
            start = time.perf_counter()
            h = call_with(layer, None if weights is None else weights[index], h,
                          self.tied_weights[index])
            self.timings.layer_forward_s[index] += time.perf_counter() - start
            if h.requires_grad:
                h.register_hook(_stamp(arrivals, index))
        return h

    def _handed_on(self, outputs: list[StageOutput]) -> list[StageOutput]:
        """``outputs`` less the activations and gradients, which go to ``data_sink`` now (all
        of them without one)."""
        sink = self.data_sink
        if sink is None:
            return outputs
        kept: list[StageOutput] = []
        for output in outputs:
            if isinstance(output, (SendActivation, SendGradient)):
                sink(output)
            else:
                kept.append(output)
        return kept

    def contributed(self, step: int, micro_batch: int) -> bool:
        """Whether another holder's contribution of this training micro-batch is already in."""
        return self.reducer.already(step, micro_batch) is DropReason.LATE

    def backward(self, step: int, micro_batch: int, grad: np.ndarray) -> list[StageOutput]:
        """Backward one micro-batch with the gradient of this stage's output."""
        key = (step, micro_batch)
        if self.contributed(step, micro_batch):
            self.pending.pop(key, None)
            raise StageInputError(DropReason.LATE, f"micro-batch {key} was already computed by "
                                  "another holder")
        pending = self.pending.get(key)
        if pending is None and self.reducer.exchanges and step < self.version:
            raise StageInputError(DropReason.LATE, f"gradient of {key}: the step is complete, "
                                  "other holders computed it")
        if pending is None:
            reason = DropReason.DUPLICATE if self.reducer.already(step, micro_batch) or \
                step in self.completed_steps else DropReason.UNEXPECTED
            raise StageInputError(reason, f"no forward pass stashed for micro-batch {key}")
        if not isinstance(grad, np.ndarray) or grad.shape != tuple(pending.outputs.shape):
            shape = getattr(grad, "shape", None)
            raise StageInputError(DropReason.BAD_SHAPE, f"gradient of shape {shape} for an output "
                                  f"of shape {tuple(pending.outputs.shape)}")
        return self._backward(step, micro_batch, grad)

    def _backward(self, step: int, micro_batch: int, grad: np.ndarray | None
                  ) -> list[StageOutput]:
        pending = self.pending.pop((step, micro_batch))
        grad_tensor = None if grad is None else torch.from_numpy(
            np.array(grad, dtype=np.float32, copy=True))

        gradients = self.versioning.gradients(step)
        if step in self._own:
            gradients.expect(step, self._own[step])

        def run() -> torch.Tensor:
            gradients.before(step, micro_batch)
            if pending.outputs.requires_grad:  # else only parameter-free layers, nothing to do
                pending.outputs.backward(grad_tensor)
            gradients.after(step, micro_batch)
            pending.grad_arrivals[-1] = time.perf_counter()  # end of this backward
            return pending.outputs

        with self.timeline.span(SpanKind.BACKWARD, step, micro_batch):
            _, timed = self._timed(run)
        self.timings.backward_s += timed.wall_s
        self.timings.add(micro_batch, timed)
        self._account_backward(pending.grad_arrivals)
        out: list[StageOutput] = []
        if self.sends_gradients:
            assert pending.inputs.grad is not None
            out.append(SendGradient(step, micro_batch, pending.inputs.grad.numpy()))
        else:  # the first stage, or the first trainable one: this micro-batch is done
            out.append(MicroBatchDone(step, micro_batch))
        self.computed[step] = self.computed.get(step, 0) + 1
        return self._handed_on(out) + self._micro_batch_done(step, micro_batch, gradients)

    def _micro_batch_done(self, step: int, micro_batch: int,
                          gradients: OrderedGradients | None) -> list[StageOutput]:
        """One of this holder's micro-batches is done (``gradients``: where its gradient is;
        None for a stage of fixed layers): the reducer's contribution and the steps now
        complete."""
        reducer = self.reducer
        if isinstance(reducer, GroupExchange):
            assert self.recorder is not None
            grads = {} if gradients is None else gradient_partial(
                self.named, {micro_batch: gradients.take(step, micro_batch)})
            own = SendPartial(step, micro_batch, grads, self.recorder.partial(step, micro_batch))
            return [own, *self.offer_partial(step, own)]
        if isinstance(reducer, PartialSums):
            covers = reducer.micro_batch_done(step, micro_batch)
            if covers is None:
                return []  # more of this holder's share to come
            assert self.recorder is not None
            records = {k: v for m in covers for k, v in self.recorder.partial(step, m).items()}
            grads = {} if gradients is None else sum_partial(self.named, gradients.total(step))
            own = SendPartial(step, covers[0], grads, records, covers)
            return [own, *self.offer_partial(step, own)]
        return self._apply(reducer.micro_batch_done(step, micro_batch, self.version))

    def offer_partial(self, step: int, partial: SendPartial) -> list[StageOutput]:
        """A holder's contribution (this one's own included). Steps are applied in order, each
        once all its M micro-batches are in; every holder applies the same update."""
        if step < self.version:
            raise StageInputError(DropReason.LATE, f"contribution to finished step {step}")
        reducer = self.reducer
        if isinstance(reducer, PartialSums):
            if not partial.covers:
                raise StageInputError(DropReason.UNEXPECTED, f"stage {self.index} exchanges "
                                      "partial sums, not single micro-batches")
            misfit = partial_misfit(self.named, partial.grads, summed=True)
            if misfit is not None:
                raise StageInputError(DropReason.BAD_SHAPE, misfit)
            return self._apply(reducer.offer(step, partial.covers, partial.grads,
                                             partial.batch_norm, self.version))
        if not isinstance(reducer, GroupExchange):
            raise StageInputError(DropReason.UNEXPECTED, f"stage {self.index} has one holder: "
                                  "it takes no contributions")
        if partial.covers:
            raise StageInputError(DropReason.UNEXPECTED, f"stage {self.index} exchanges single "
                                  "micro-batches (its holders take over), not partial sums")
        misfit = partial_misfit(self.named, partial.grads)
        if misfit is not None:
            raise StageInputError(DropReason.BAD_SHAPE, misfit)
        return self._apply(reducer.offer(step, partial.micro_batch, partial.grads,
                                         partial.batch_norm, self.version))

    def _apply(self, updates: list[Update]) -> list[StageOutput]:
        """Apply the complete steps, in order: their gradients into the live parameters (the
        versioning's sum, or the exchange's merge of every holder's), BatchNorm's running
        statistics replayed in micro-batch order where they were recorded, the optimizer."""
        out: list[StageOutput] = []
        for update in updates:
            step = update.step
            self.versioning.before_update(step)
            if update.grads is not None or update.sums is not None:
                with self.timeline.span(SpanKind.EXCHANGE, step):
                    if update.sums is not None:
                        apply_sums(self.named, update.sums)
                    else:
                        assert update.grads is not None
                        apply_gradients(self.named, update.grads, self.config.micro_batches)
                    assert self.recorder is not None
                    self.recorder.replay(update.batch_norm or {}, self.config.micro_batches)
                # forwards of this step that others finished first get no backward: forget them
                for key in [k for k in self.pending if k[0] == step]:
                    del self.pending[key]
            elif self.recorder is not None:  # alone behind a group: in micro-batch order
                self.recorder.replay(self.recorder.own(step), self.config.micro_batches)
            out += self._optimizer_step(step)
        return out

    def _account_backward(self, arrivals: dict[int, float]) -> None:
        """Layer i's backward runs from the gradient reaching its output until it reaches the
        output of the closest earlier layer that has one (the end of backward for the first).
        A layer whose output needs no gradient (e.g. a Flatten of the input) has no backward."""
        end = arrivals.pop(-1, None)
        if not arrivals or end is None:
            return
        self.timings.per_layer(len(self.layers))
        stamped = sorted(arrivals)
        for position, index in enumerate(stamped):
            until = arrivals[stamped[position - 1]] if position > 0 else end
            self.timings.layer_backward_s[index] += max(0.0, until - arrivals[index])

    def _optimizer_step(self, step: int) -> list[StageOutput]:
        """The optimizer step of ``step`` (its gradients are in place); then the inputs of
        later steps that came early."""
        with self.timeline.span(SpanKind.OPTIMIZER, step):
            for optimizer in self.optimizers:
                if optimizer is not None:
                    optimizer.step()
                    optimizer.zero_grad(set_to_none=True)
            self.versioning.after_update(step)
        self.reducer.forget(step)
        self._own.pop(step, None)
        self._early.pop(step, None)
        self._next_forward.pop(step, None)
        self.completed_steps = {s for s in self.completed_steps if s > step - 16} | {step}
        if self.recorder is not None:
            self.recorder.applied(step)
        out: list[StageOutput] = [StepDone(
            step, self.timings.forward_s, self.timings.backward_s,
            tuple(self.timings.layer_forward_s), tuple(self.timings.layer_backward_s),
            self.timings.typical_s, self.computed.pop(step, 0),
            self.timings.typical_cpu_s, self.timings.typical_emulated_s)]
        self.timings = StageTimings()
        # in (step, micro-batch) order; a forward may complete a step and come back here
        for later in sorted(self._future):
            while (held := self._future.get(later)) and \
                    self.versioning.available(later, index := min(held)):
                x, y, expected, own = held.pop(index)
                if not held:
                    del self._future[later]
                out += self.forward(later, index, x, y, True, expected, own)
        return out

    def _evaluate(self, step: int, micro_batch: int, x: np.ndarray, y: np.ndarray
                  ) -> list[StageOutput]:
        self.module.eval()
        with torch.no_grad(), self.timeline.span(SpanKind.EVALUATE, step, micro_batch):
            outputs, _ = self._timed(
                lambda: self.module(torch.from_numpy(np.array(x, dtype=np.float32))))
        if not self.is_last:
            return [SendActivation(step, micro_batch, outputs.numpy(), y, False)]
        labels = torch.from_numpy(y.astype(np.int64))
        loss = float(nn.functional.cross_entropy(outputs, labels, reduction="sum"))
        correct = int((outputs.argmax(dim=1) == labels).sum())
        return [MicroBatchResult(step, micro_batch, False, loss, correct, int(len(y)))]
