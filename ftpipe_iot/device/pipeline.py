"""The data path of the stage a device holds: inputs, gradients and the other holders'
contributions in, compute, activations, gradients, contributions and results out.

The agent owns the plan, the weights and the reports; a ``StageRunner`` lives as long as the
stage. What it does beyond its own micro-batches is its role's (``device.roles``): with
resiliency r >= 1 it watches the stage's other holders and takes over their late micro-batches
(``core.takeover``).
"""

from __future__ import annotations

import logging
import queue
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ftpipe_iot.core.outputs import (
    STAGE_DATA,
    MicroBatchDone,
    MicroBatchResult,
    SendActivation,
    SendGradient,
    SendPartial,
    StageOutput,
    StepDone,
)
from ftpipe_iot.core.routing import own_micro_batches
from ftpipe_iot.core.stage import Stage
from ftpipe_iot.core.takeover import TakeoverPhase, Watched
from ftpipe_iot.device.link import LinkMeter
from ftpipe_iot.device.roles import ComputingHolder, role_for
from ftpipe_iot.errors import StageInputError
from ftpipe_iot.observability.metrics import DeviceMetrics
from ftpipe_iot.protocol.messages import Activation, Gradient, GroupPartial, Inbound, Progress
from ftpipe_iot.protocol.plan import Plan
from ftpipe_iot.protocol.results import (
    MicroBatchFinished,
    MicroBatchLoss,
    Report,
    Result,
    StageStepDone,
)
from ftpipe_iot.protocol.topics import Topics
from ftpipe_iot.protocol.vocab import SpanKind
from ftpipe_iot.transport.base import Incoming
from ftpipe_iot.transport.messenger import Messenger

log = logging.getLogger("ftpipe_iot.device")

StageMessage = Activation | Gradient | GroupPartial | Progress


@dataclass(frozen=True)
class RunnerHooks:
    """What the runner asks of its agent: reports to the controller (those of one computation
    together), the end of a step once reported, the
    emulated link for a payload of ``n`` bytes sent or taken in, and the step being computed
    (profiles schedule by step)."""

    report: Callable[[Sequence[Report]], None]
    step_done: Callable[[StepDone], None]  # after its report went out
    link: Callable[[int], None]
    computing: Callable[[int], None]


class StageRunner:
    """Runs one stage of one plan for the device ``name``."""

    def __init__(self, name: str, plan: Plan, stage: Stage, messenger: Messenger,
                 inbox: queue.Queue[Incoming], metrics: DeviceMetrics, link: LinkMeter,
                 hooks: RunnerHooks, clock: Callable[[], float] = time.monotonic) -> None:
        self.name = name
        self.plan = plan
        self.stage = stage
        self.messenger = messenger
        self.inbox = inbox
        self.metrics = metrics
        self.link = link
        self.hooks = hooks
        self.clock = clock
        self.topics = Topics(plan.job)
        # (step, micro-batch) -> the input as it came (route, counts) and its sender, to address
        # the outputs: activations by the route, the gradient back to the sender
        self.routes: dict[tuple[int, int], tuple[Activation, str]] = {}
        self.role: ComputingHolder = role_for(name, plan, stage)
        self.takeovers = 0
        self.deferred: deque[Incoming] = deque()  # set aside by ``_absorb_contributions``
        # training micro-batches' reports held for the step's end: their ends where
        # ``Plan.reports_at_step_end``, their losses where ``Plan.losses_at_step_end``
        self.holds_ends = plan.reports_at_step_end
        self.holds_losses = plan.losses_at_step_end
        self.held: list[Report] = []
        # the bytes of what the stage handed on mid-computation, sent: the rest of the
        # computation's outputs (``_emit_all``) settle the emulated link with them
        self.handed: list[int] = []
        stage.data_sink = self._send_now

    @property
    def topics_to_follow(self) -> list[str]:
        return self.role.topics_to_follow()

    @property
    def echoless_topics(self) -> frozenset[str]:
        """Topics this holder publishes on and need not hear itself on: the group's exchange
        (its own contribution is counted when it is made)."""
        return frozenset({self.topics.stage_reduce(self.stage.index)})

    # -- in -------------------------------------------------------------------------------------
    def on_message(self, inbound: Inbound, message: StageMessage) -> None:
        """One message of the stage's topics (raises StageInputError for what it cannot use)."""
        stage, now = self.stage, self.clock()
        if isinstance(message, GroupPartial):
            self._on_contribution(inbound, message)
        elif isinstance(message, Progress):
            if inbound.sender != self.name:
                self.role.progress_seen(inbound.step, inbound.micro_batch, now)
        elif isinstance(message, Activation):
            addressee = Topics.addressee(inbound.topic)
            if message.train:
                self.role.input_seen(inbound.step, inbound.micro_batch, addressee,
                                     inbound.sender, message, now)
            if addressee != self.name:
                return  # another holder's: watched only
            self.hooks.link(message.nbytes)
            self._forward(inbound.step, inbound.micro_batch, message, inbound.sender,
                          inbound.timestamp)
        else:
            if not self.role.gradient_seen(inbound.step, inbound.micro_batch,
                                           Topics.addressee(inbound.topic), message.g, now):
                return  # kept in case its holder needs replacing
            self.link.observe(inbound.timestamp, message.nbytes, time.time())
            self.hooks.link(message.nbytes)
            self.hooks.computing(inbound.step)
            self._absorb_contributions()
            self._emit_all(stage.backward(inbound.step, inbound.micro_batch, message.g))

    def _forward(self, step: int, micro_batch: int, message: Activation, sender: str,
                 sent_at: float, quiet: bool = False) -> None:
        """Forward one input; ``quiet`` keeps the activation (the next stage has it already)."""
        stage = self.stage
        if sent_at:
            self.link.observe(sent_at, message.nbytes, time.time())
        self.hooks.computing(step)
        self._absorb_contributions()
        self.routes[(step, micro_batch)] = (message, sender)
        own = own_micro_batches(message.counts, stage.index, stage.member) \
            if message.train else None
        if quiet:  # the activation must stay in the list, where it is dropped
            stage.data_sink = None
        try:
            outputs = stage.forward(step, micro_batch, message.x, message.y, message.train,
                                    message.count(stage.index, stage.member), own)
        finally:
            stage.data_sink = self._send_now
        if message.train:
            self.metrics.samples.inc(len(message.y))
        if quiet:
            outputs = [o for o in outputs if not isinstance(o, SendActivation)]
        self._emit_all(outputs)

    def _on_contribution(self, inbound: Inbound, message: GroupPartial) -> None:
        if message.stage != self.stage.index or inbound.sender == self.name:
            return  # our own contribution, echoed back: already counted
        self.role.contribution_seen(inbound.step, inbound.micro_batch, self.clock())
        self.hooks.link(message.nbytes)
        self._emit_all(self.stage.offer_partial(inbound.step, SendPartial(
            inbound.step, inbound.micro_batch, message.grads, message.batch_norm,
            message.covers)))

    def _absorb_contributions(self) -> None:
        """Before computing, take the contributions already queued: a holder coming back from a
        stall finds its backlog done by others and drops it instead of computing it late (a
        holder that takes nothing over has no backlog to drop)."""
        if not self.role.takes_over:
            return
        reduce_topic = self.topics.stage_reduce(self.stage.index)
        queued: list[Incoming] = []
        while True:
            try:
                queued.append(self.inbox.get_nowait())
            except queue.Empty:
                break
        for incoming in queued:
            if incoming.topic != reduce_topic:
                self.deferred.append(incoming)
                continue
            inbound = self.messenger.receive(incoming)
            if inbound is None or inbound.plan_version != self.plan.version:
                continue
            try:
                if isinstance(inbound.message, GroupPartial):
                    self._on_contribution(inbound, inbound.message)
                elif isinstance(inbound.message, Progress) and inbound.sender != self.name:
                    self.role.progress_seen(inbound.step, inbound.micro_batch, self.clock())
            except StageInputError as exc:
                self.messenger.drops.drop(exc.reason, str(exc))

    # -- taking over ----------------------------------------------------------------------------
    def holders_lost(self, devices: tuple[str, ...]) -> None:
        """The controller says these holders of the stage failed: take theirs over at once."""
        self.role.owners_lost(devices)
        self.take_over_due()

    def take_over_due(self) -> None:
        """Compute the other holders' late micro-batches (``core.takeover``)."""
        for item in self.role.due(self.clock()):
            try:
                self._take_over(item)
            except StageInputError as exc:
                self.messenger.drops.drop(exc.reason, str(exc))

    def _take_over(self, item: Watched) -> None:
        log.info("%s takes over micro-batch (%d, %d) from %s (%s)", self.name, item.step,
                 item.micro_batch, item.owner, item.taken.value if item.taken else "")
        self.takeovers += 1
        self.metrics.takeovers.inc()
        late_backward = item.taken is TakeoverPhase.BACKWARD and item.gradient is not None
        self._forward(item.step, item.micro_batch, item.payload, item.sender, 0.0,
                      quiet=late_backward)
        if late_backward and (item.step, item.micro_batch) in self.stage.pending:
            assert item.gradient is not None
            self._emit_all(self.stage.backward(item.step, item.micro_batch, item.gradient))

    # -- out ------------------------------------------------------------------------------------
    def _exchange_readers(self, stage: int) -> tuple[str, ...]:
        """Who reads this holder's contributions and progress: the stage's other holders, and
        this one too where the broker sends its own publishes back (MQTT 3.1.1: it checks the
        echo before dropping it). A tag is a pass over the payload, and a partial is the
        stage's whole gradient: one for itself was half of what sealing a partial cost a
        group of two."""
        holders = self.plan.stages[stage].devices
        if not self.messenger.transport.honours_no_local:
            return holders
        return tuple(d for d in holders if d != self.name) or holders

    def _send_now(self, output: SendActivation | SendGradient) -> None:
        """The stage's ``data_sink``: another stage waits for this, and the computation it came
        from goes on (``Stage.data_sink``)."""
        self.handed.append(self._publish(output))

    def _emit_all(self, outputs: list[StageOutput]) -> None:
        """Activations and gradients first (what the stage handed on while it computed is out
        already), then the reports in one frame (``ResultBatch``), then the group
        contributions, then the step's end to the agent (which may start a replication):
        another stage waits for the data, and nothing waits for a loss or a micro-batch's
        end. A contribution tells the other holders that its micro-batches are done, so it
        goes after their reports: a holder killed between the two leaves micro-batches whose
        losses the controller has and which a watcher computes again (the controller takes a
        loss once), never micro-batches no holder takes over and whose losses never come. An
        emulated link is busy with the data after that, as a real one would be while the
        reports, control traffic, go past (``Traffic``)."""
        sent, self.handed = self.handed, []
        sent += [self._publish(output) for output in outputs
                 if isinstance(output, (SendActivation, SendGradient))]
        reports = [self._report_of(output) for output in outputs
                   if not isinstance(output, STAGE_DATA)]
        if self.holds_ends or self.holds_losses:
            reports = self._due(reports, any(isinstance(o, SendPartial) for o in outputs))
        if reports:
            self.hooks.report(reports)
        sent += [self._publish(output) for output in outputs if isinstance(output, SendPartial)]
        for output in outputs:
            if isinstance(output, StepDone):
                self.hooks.step_done(output)
        for n_bytes in sent:
            self.hooks.link(n_bytes)

    def _due(self, reports: list[Report], contributed: bool) -> list[Report]:
        """The reports to send now where the plan holds training micro-batches' ends
        (``Plan.reports_at_step_end``) or losses (``Plan.losses_at_step_end``): what this
        computation reported, after every report held before it, once the holder has sent its
        contribution to its group (``contributed``: its part of the step is computed, and the
        controller may end the step with another member's step end, so it needs these losses
        now) or reached its step's end; an evaluation loss at once (no step's end follows
        it); the rest is held."""
        due = []
        for report in reports:
            body = report.result.body
            if (isinstance(body, MicroBatchFinished) and self.holds_ends) or \
                    (isinstance(body, MicroBatchLoss) and body.train and self.holds_losses):
                self.held.append(report)
            else:
                due.append(report)
        if contributed or any(isinstance(r.result.body, StageStepDone) for r in due):
            due, self.held = [*self.held, *due], []
        return due

    def _publish(self, output: SendActivation | SendGradient | SendPartial) -> int:
        with self.stage.timeline.span(SpanKind.SEND, output.step, output.micro_batch):
            return self._send(output)

    def _send(self, output: SendActivation | SendGradient | SendPartial) -> int:
        """Publish an output to the stage that takes it in; returns the bytes of the output."""
        version, index, key = self.plan.version, self.stage.index, (output.step,
                                                                   output.micro_batch)
        if isinstance(output, SendActivation):
            came = self.routes.get(key)
            route = came[0].route if came else ()
            counts = came[0].counts if came else ()
            if not output.train:
                self.routes.pop(key, None)
            member = route[index + 1] if index + 1 < len(route) else 0
            device = self.plan.stages[index + 1].members[member].device
            sent = self.messenger.send(
                self.topics.stage_act(index + 1, device),
                Activation(output.x, output.y, output.train, route, counts), version,
                output.step, output.micro_batch,
                receivers=self.plan.input_readers(index + 1, device))
            if output.train and self.role.forwarded(output.step, output.micro_batch,
                                                    self.clock()):  # watchers learn we're alive
                self.messenger.send(self.topics.stage_reduce(index), Progress(index), version,
                                    output.step, output.micro_batch, qos=0,
                                    receivers=self._exchange_readers(index))
            return sent
        if isinstance(output, SendGradient):
            came = self.routes.pop(key, None)
            device = came[1] if came else self.plan.stages[index - 1].leader
            return self.messenger.send(
                self.topics.stage_grad(index - 1, device), Gradient(output.grad), version,
                output.step, output.micro_batch,
                receivers=self.plan.input_readers(index - 1, device))
        self.role.contribution_seen(output.step, output.micro_batch, self.clock())
        return self.messenger.send(
            self.topics.stage_reduce(index),
            GroupPartial(index, self.stage.member, output.grads, output.batch_norm,
                         output.covers),
            version, output.step, output.micro_batch, receivers=self._exchange_readers(index))

    def _report_of(self, output: StageOutput) -> Report:
        """What the controller is told of a loss, a micro-batch's end or a step's end."""
        key = (output.step, getattr(output, "micro_batch", -1))
        if isinstance(output, MicroBatchResult):
            if not output.train:
                self.routes.pop(key, None)
            return Report(output.step, output.micro_batch, Result(MicroBatchLoss(
                output.loss, output.correct, output.count, output.train)))
        if isinstance(output, MicroBatchDone):
            self.routes.pop(key, None)
            return Report(output.step, output.micro_batch, Result(MicroBatchFinished()))
        assert isinstance(output, StepDone)
        self.role.step_done(output.step)
        return Report(output.step, -1, Result(StageStepDone(
            self.stage.index, output.forward_s, output.backward_s, output.layer_times,
            output.typical_s, output.micro_batches, output.typical_cpu_s,
            output.typical_emulated_s)))


class DeferredInbox:
    """The transport's inbox behind the messages a runner set aside (so the worker loop keeps
    their order): ``get``/``get_nowait`` as a queue has them. A blocking ``get`` marks the
    worker idle from then until the next message is taken (``take_idle``): the timeline's
    waits."""

    def __init__(self, inbox: queue.Queue[Incoming], deferred: Callable[[], deque[Incoming]],
                 clock: Callable[[], float] = time.time) -> None:
        self.inbox = inbox
        self.deferred = deferred
        self.clock = clock
        self.idle_since: float | None = None

    def get(self, timeout: float | None = None) -> Incoming:
        waiting = self.deferred()
        if waiting:
            return waiting.popleft()
        if self.idle_since is None:
            self.idle_since = self.clock()
        return self.inbox.get(timeout=timeout)

    def take_idle(self) -> float | None:
        """When the worker became idle before the message it now handles (None: it was not)."""
        since, self.idle_since = self.idle_since, None
        return since

    def get_nowait(self) -> Incoming:
        waiting = self.deferred()
        if waiting:
            return waiting.popleft()
        return self.inbox.get_nowait()
