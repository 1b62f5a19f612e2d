"""The coordinator of a collaborative or federated job: the controller of these modes
(docs/design.md §13).

It never sees a sample. It asks for offers (``CollabJob``), plans the split from the offered
profiles, publishes the initial global model as retained layer replicas, then runs rounds: it
publishes a ``Round``, collects each participant's device part (and, collaborative, the server's
replica of it), averages them weighted by the devices' sample counts, publishes the new global
model (retained, so a late or restarted device starts from it), evaluates it on the held-out test
set, and starts the next round with everyone online. A device that drops out mid-round (Last
Will, or silence beyond the heartbeat timeout) is left out of that round; it rejoins at the next.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from dataclasses import replace

import numpy as np
from prometheus_client import CollectorRegistry

from ftpipe_iot.artifacts.checkpoint import initial_layers, save_checkpoint
from ftpipe_iot.collab.config import COORDINATOR_NAME, CollabConfig
from ftpipe_iot.collab.layer_times import model_facts
from ftpipe_iot.collab.metrics import CoordinatorMetrics
from ftpipe_iot.collab.parts import evaluate, export_states, load_states
from ftpipe_iot.collab.planner import Choice, Machine, choose
from ftpipe_iot.collab.privacy import check_private_layers
from ftpipe_iot.collab.rounds import (
    Member,
    RoundSpan,
    RoundState,
    next_participants,
    round_spans,
)
from ftpipe_iot.collab.summary import CollabRecorder, CollabSummary
from ftpipe_iot.core.data import Dataset, load_dataset
from ftpipe_iot.core.models import build_layers, cut_shapes
from ftpipe_iot.errors import FtpipeError
from ftpipe_iot.observability.progress import ProgressReporter, SilentProgress
from ftpipe_iot.protocol.collab import (
    CollabJob,
    CollabPlan,
    CollabReport,
    CollabStatus,
    LocalUpdate,
    MemberRow,
    Offer,
    Round,
)
from ftpipe_iot.protocol.messages import (
    Command,
    ControllerState,
    DeviceStatus,
    Event,
    Heartbeat,
    LayerReplica,
)
from ftpipe_iot.protocol.results import DeviceError, Result
from ftpipe_iot.protocol.signing import Credentials
from ftpipe_iot.protocol.topics import Topics
from ftpipe_iot.protocol.vocab import (
    CollabMode,
    CollabRole,
    CommandOp,
    ControllerPhase,
    ControllerStatus,
    DeviceState,
    FailureCause,
    MemberState,
)
from ftpipe_iot.protocol.wire import WireOptions
from ftpipe_iot.transport.base import Incoming, Transport, Will, serve
from ftpipe_iot.transport.messenger import Messenger, will_of

log = logging.getLogger("ftpipe_iot.collab")
Phase = ControllerPhase


def coordinator_will(job: str, credentials: Credentials | None = None) -> Will:
    """The retained state says offline if the coordinator vanishes."""
    return will_of(Topics(job).state, ControllerState(ControllerStatus.OFFLINE, job), job,
                   COORDINATOR_NAME, credentials)


class Coordinator:
    """One collaborative or federated job. Drive it with ``run()`` or ``handle``/``tick``."""

    def __init__(self, job: str, config: CollabConfig, transport: Transport,
                 registry: CollectorRegistry, progress: ProgressReporter | None = None,
                 clock: Callable[[], float] = time.monotonic, data: Dataset | None = None,
                 credentials: Credentials | None = None) -> None:
        self.job = job
        self.config = config
        self.topics = Topics(job)
        self.transport = transport
        self.metrics = CoordinatorMetrics(registry)
        self.messenger = Messenger(transport, COORDINATOR_NAME, job, self.metrics, logger=log,
                                   options=WireOptions(compress=config.train.compress),
                                   credentials=credentials)
        self.clock = clock
        self.recorder = CollabRecorder(job, config.mode.value, self.metrics,
                                       progress or SilentProgress(), self._publish_event, clock)
        self.data = data if data is not None else load_dataset(config.train.data)
        train = config.train
        self.layers = build_layers(train.model, self.data.input_shape, self.data.num_classes,
                                   train.seed)
        self.shapes = cut_shapes(self.layers, self.data.input_shape, self.data.num_classes,
                                 train.model.name)
        self.version = int(time.time() * 1000)
        self.phase = Phase.WAITING_DEVICES
        self.offers: dict[str, Offer] = {}
        self.members: dict[str, Member] = {}
        self.server_online: dict[str, bool] = {}
        self.plan: CollabPlan | None = None
        self.choice: Choice | None = None
        self.spans: list[RoundSpan] = []
        self.current: RoundState | None = None
        if config.init_from is not None:
            # version 0 of the global model is the given weights, as --init-from makes it in a
            # pipeline job; every device and the server load it for the first round
            load_states(dict(enumerate(self.layers)),
                        initial_layers(config.init_from, list(self.layers)))
        self.global_states: dict[int, dict] = export_states(dict(enumerate(self.layers)))
        self.server_busy = 0.0
        self._last_progress = clock()
        self._next_status = 0.0

    @property
    def summary(self) -> CollabSummary:
        return self.recorder.summary

    # -- lifecycle ------------------------------------------------------------------------------
    def start(self) -> None:
        self.transport.connect()
        self.messenger.start_trust()
        for topic in (Topics.ALL_STATUS, Topics.ALL_HEARTBEATS, self.topics.collab_offers,
                      self.topics.collab_update, self.topics.collab_report, self.topics.results):
            self.transport.subscribe(topic)
        self._publish_state(ControllerStatus.ONLINE)
        job = CollabJob(self.version, self.config.mode, self.config.train,
                        self.data.input_shape, self.data.num_classes)
        self.messenger.send(self.topics.collab_job, job, self.version, retain=True)
        self.recorder.message(f"{self.config.mode.value} job {self.job}: "
                              f"{self.config.train.model.name}, {len(self.layers)} layers; "
                              f"waiting for "
                              f"{self.config.devices} data devices"
                              + (" and a server" if self._collaborative else ""))

    @property
    def _collaborative(self) -> bool:
        return self.config.mode is CollabMode.COLLABORATIVE

    @property
    def finished(self) -> bool:
        return self.phase in (Phase.DONE, Phase.FAILED)

    def run(self, poll_s: float = 0.02) -> CollabSummary:
        """Run the job to its end or its failure; the retained state says which."""
        self.start()
        try:
            serve(self.transport.inbox, self.handle, self.tick, lambda: self.finished, poll_s)
        finally:
            self.recorder.progress.close()
            ended = ControllerStatus.DONE if self.phase is Phase.DONE else ControllerStatus.FAILED
            self._publish_state(ended)
        return self.summary

    def fail(self, reason: str) -> None:
        """End the job with a reason the summary, the events and the progress lines give."""
        if not self.finished:
            log.error("job %s failed: %s", self.job, reason)
            self.recorder.members(self.members)
            self.recorder.finish(self.messenger.drops.counts, reason)
            self.phase = Phase.FAILED

    # -- inbound --------------------------------------------------------------------------------
    def handle(self, incoming: Incoming) -> None:
        inbound = self.messenger.receive(incoming)
        if inbound is None:
            return
        message, sender, now = inbound.message, inbound.sender, self.clock()
        if isinstance(message, DeviceStatus):
            if Topics.device_of(inbound.topic) == sender and message.job == self.job:
                self._on_status(sender, message.state is DeviceState.ONLINE)
        elif isinstance(message, Heartbeat):
            if sender in self.members:
                self.members[sender].last_seen = now
                if not self.members[sender].online:
                    self._on_status(sender, True)
        elif isinstance(message, Offer):
            if message.job_version == self.version:
                self._on_offer(sender, message)
        elif inbound.plan_version not in (self.version, self.plan and self.plan.version):
            return  # a left-over of an earlier run of this job name
        elif isinstance(message, Result) and isinstance(message.body, DeviceError):
            self.fail(f"device {sender}: {message.body.message}")
        elif isinstance(message, LocalUpdate):
            self._on_update(message)
        elif isinstance(message, CollabReport):
            self._on_report(sender, inbound.step, message)

    def _on_status(self, device: str, online: bool) -> None:
        if device in self.server_online:
            self.server_online[device] = online
            if not online and self.plan is not None and device == self.plan.server \
                    and self.phase is Phase.TRAINING:
                self.fail(f"server {device} went offline; collaborative mode does not move the "
                          "server replicas to another server (see docs/design.md §13)")
            return
        member = self.members.get(device)
        if member is None:
            return
        was = member.online
        member.online, member.last_seen = online, self.clock()
        if online and not was:
            self.recorder.message(f"{device} is back online: it takes part from the next round")
        elif not online and was:
            self._drop(device, FailureCause.LAST_WILL, 0.0)

    def _on_offer(self, device: str, offer: Offer) -> None:
        self.offers[device] = offer
        if offer.role is CollabRole.SERVER:
            self.server_online.setdefault(device, True)
            return
        if device in self.members:
            self.members[device].online = True
            self.members[device].samples = offer.samples
            return
        if self.plan is not None:
            problem = self._unfit(device, offer.samples)
            if problem:
                log.warning("not taking %s in: %s", device, problem)
                return
            self.recorder.message(f"{device} joins with {offer.samples} samples")
        self.members[device] = Member(device, offer.samples, last_seen=self.clock())

    def _on_update(self, update: LocalUpdate) -> None:
        if self.current is None or not self.current.add(update):
            return
        self._last_progress = self.clock()
        if self.current.complete:
            self._complete_round()

    def _on_report(self, sender: str, step: int, report: CollabReport) -> None:
        self._last_progress = self.clock()
        if report.role is CollabRole.SERVER:
            self.server_busy = report.busy_s
            return
        member = self.members.get(sender)
        if member is None:
            return
        member.busy_s, member.last_seen = report.busy_s, self.clock()
        if report.epsilon is not None:
            member.epsilon = report.epsilon
        if report.loss is not None and step >= 0:
            member.iteration = max(member.iteration, step)
            self.recorder.iteration(sender, report.loss, report.count, self._fleet_iteration())

    # -- periodic -------------------------------------------------------------------------------
    def tick(self) -> None:
        now = self.clock()
        if self.messenger.tick_trust(now):
            # Statuses of identities the old roster did not know were dropped: take them again.
            self.transport.unsubscribe(Topics.ALL_STATUS)
            self.transport.subscribe(Topics.ALL_STATUS)
        if self.phase is Phase.WAITING_DEVICES:
            if self.plan is None:
                self._maybe_plan()
            else:
                self._maybe_start_round()
            if self.phase is Phase.WAITING_DEVICES and \
                    self.recorder.elapsed_s > self.config.wait_devices_s:
                self.fail(self._waiting_for())
        elif self.phase is Phase.TRAINING and self.current is not None:
            for name in self.current.remaining:
                silent = now - self.members[name].last_seen
                if silent > self.config.heartbeat_timeout_s and self.members[name].online:
                    self.members[name].online = False
                    self._drop(name, FailureCause.HEARTBEAT_TIMEOUT, silent)
            if self.phase is Phase.TRAINING and \
                    now - self._last_progress > self.config.stall_timeout_s:
                self.fail(f"no progress for {self.config.stall_timeout_s:.0f}s in round "
                          f"{self.current.span.index + 1}")
        if now >= self._next_status and self.plan is not None:
            self._next_status = now + 1.0
            self._publish_status()

    def _waiting_for(self) -> str:
        online = sorted(m.name for m in self.members.values() if m.online)
        text = f"{len(online)} of {self.config.devices} data devices offered within " \
               f"{self.config.wait_devices_s:.0f}s: {online}"
        if self._collaborative and not any(self.server_online.values()):
            text += "; no server offered (start one with `ftpipe-iot device --server`)"
        return text

    # -- planning -------------------------------------------------------------------------------
    def _unfit(self, device: str, samples: int) -> str | None:
        batch = self.config.train.batch_size
        if samples < batch:
            return f"device {device} holds {samples} samples, fewer than one mini-batch of " \
                   f"{batch}; lower --micro-batches x --micro-batch-size"
        if self.config.privacy is not None:
            try:
                self.config.privacy.check_samples(device, samples)
            except FtpipeError as exc:
                return str(exc)
        return None

    def _maybe_plan(self) -> None:
        data = sorted(n for n, m in self.members.items() if m.online)
        servers = sorted(n for n, up in self.server_online.items() if up)
        if len(data) < self.config.devices or (self._collaborative and not servers):
            return
        try:
            self._plan(data, servers)
        except FtpipeError as exc:
            self.fail(str(exc))

    def _plan(self, data: list[str], servers: list[str]) -> None:
        config, train = self.config, self.config.train
        for name in data:
            problem = self._unfit(name, self.members[name].samples)
            if problem:
                self.fail(problem)
                return
        batch, n_layers = train.batch_size, len(self.layers)
        per_epoch = max(1, round(float(np.mean([self.members[n].samples for n in data])) / batch))
        total = per_epoch * train.epochs
        if train.max_steps is not None:
            total = min(total, train.max_steps)
        every = per_epoch if config.aggregate_every is None else config.aggregate_every
        split, head, server = n_layers, n_layers, None
        micro = train.micro_batches
        if self._collaborative:
            facts = model_facts(self.layers, self.shapes)
            machines = [self._machine(n) for n in data]
            self.choice = choose(machines, [self._machine(s) for s in servers], facts, batch,
                                 every or total, config.link_latency_s, config.split_point,
                                 None if config.auto_micro_batches else micro,
                                 config.privacy is not None)
            chosen = self.choice.chosen
            split, head, server, micro = chosen.split_point, chosen.head_start, \
                self.choice.server, chosen.micro_batches
        if config.privacy is not None:
            held = [*range(split), *range(head, n_layers)]
            check_private_layers([self.layers[i] for i in held], held)
        train = replace(train, micro_batches=micro, micro_batch_size=batch // micro)
        self.plan = CollabPlan(int(time.time() * 1000), config.mode, train, n_layers,
                               self.data.input_shape, self.data.num_classes, split, head, server,
                               every, total, per_epoch, config.privacy)
        self.spans = round_spans(total, every)
        self.recorder.planned(self.plan, self.choice, len(data))
        self.messenger.send(self.topics.collab_plan, self.plan, self.plan.version, retain=True)
        self._publish_global(0)
        self.phase = Phase.WAITING_DEVICES
        self._maybe_start_round()

    def _machine(self, name: str) -> Machine:
        offer = self.offers[name]
        return Machine(name, offer.times, offer.uplink_bytes_per_s or math.inf,
                       offer.downlink_bytes_per_s or math.inf)

    # -- rounds ---------------------------------------------------------------------------------
    def _publish_global(self, version: int) -> None:
        assert self.plan is not None
        for layer in range(self.plan.num_layers):
            self.messenger.send_replica(self.topics, self.plan.version,
                                        LayerReplica(layer, version, self.global_states[layer],
                                                     None))

    def _maybe_start_round(self) -> None:
        done = self.summary.collab.rounds
        participants = next_participants(m for m in self.members.values())
        if not participants:
            return
        if self.recorder.train_s == 0:
            self.recorder.training_started(self.spans[-1].first + self.spans[-1].iterations)
        span = self.spans[done]
        self.current = RoundState(span, participants, self._collaborative)
        self.phase = Phase.TRAINING
        self._last_progress = self.clock()
        for name in participants:
            self.members[name].last_seen = self.clock()
        self._publish_round()

    def _publish_round(self) -> None:
        assert self.plan is not None and self.current is not None
        span = self.current.span
        self.messenger.send(self.topics.collab_round,
                            Round(span.index, span.first, span.iterations,
                                  self.current.remaining),
                            self.plan.version, span.first, retain=True)
        self._publish_status()

    def _drop(self, device: str, cause: FailureCause, silent_s: float) -> None:
        current = self.current
        if current is None or self.phase is not Phase.TRAINING or not current.drop(device):
            return
        self.recorder.dropped_out(device, cause, silent_s, current.span.index)
        self._publish_round()  # a restarted device must not rejoin the round it left
        if current.complete:
            self._complete_round()

    def _complete_round(self) -> None:
        current, plan = self.current, self.plan
        assert current is not None and plan is not None
        started = time.perf_counter()
        merged = current.merged({n: m.samples for n, m in self.members.items()})
        self.global_states.update(merged)
        aggregation_s = time.perf_counter() - started
        included = tuple(d for d in current.remaining if current.delivered(d))
        for name, member in self.members.items():
            if name in included:
                member.rounds_done += 1
            else:
                member.rounds_missed += 1
        index, end = current.span.index, current.span.first + current.span.iterations
        self.recorder.round_completed(index, end, included, self.members, aggregation_s)
        self.current = None
        self._publish_global(index + 1)
        load_states(dict(enumerate(self.layers)), self.global_states)
        accuracy, loss = evaluate(self.layers, self.data.x_test, self.data.y_test,
                                  plan.train.eval_batch_size)
        self.recorder.evaluated(index, end, end // plan.iterations_per_epoch, accuracy, loss)
        self.recorder.server_idle(self.server_busy)
        self.recorder.members(self.members)
        if index + 1 < len(self.spans):
            self.phase = Phase.WAITING_DEVICES
            self._maybe_start_round()
        else:
            self._finish()

    def _fleet_iteration(self) -> int:
        if self.current is None:
            return self.summary.steps
        done = [self.members[n].iteration + 1 for n in self.current.remaining]
        return max(self.current.span.first, min(done, default=self.current.span.first))

    def _finish(self) -> None:
        if self.config.save_weights is not None:
            self.config.save_weights.parent.mkdir(parents=True, exist_ok=True)
            np.savez(self.config.save_weights,
                     **{f"{layer}/{name}": value for layer, state in self.global_states.items()
                        for name, value in state.items()})
        if self.config.save_model is not None:
            # the global model the last round's evaluation used: device part and server part
            save_checkpoint(self.config.save_model, self.global_states, self.config.train,
                            self.data.input_shape, self.data.num_classes, self.summary.steps)
        if self.config.stop_devices:
            for device in sorted({*self.members, *self.server_online}):
                self.messenger.send(self.topics.cmd(device), Command(CommandOp.SHUTDOWN),
                                    self.plan.version if self.plan else 0)
        self.recorder.finish(self.messenger.drops.counts)
        self._publish_status()
        self.phase = Phase.DONE

    # -- publishing -----------------------------------------------------------------------------
    def _publish_state(self, state: ControllerStatus) -> None:
        capacities = {n: o.factor for n, o in self.offers.items()}
        self.messenger.send(self.topics.state,
                            ControllerState(state, self.job, self.phase, None, capacities),
                            self.plan.version if self.plan else 0, self._fleet_iteration(),
                            retain=True)

    def _publish_status(self) -> None:
        plan = self.plan
        if plan is None:
            return
        current = self.current
        rows = []
        for name, m in sorted(self.members.items()):
            state = current.state_of(name) if current is not None else \
                (MemberState.WAITING if m.online else MemberState.DROPPED)
            idle = max(0.0, 1.0 - m.busy_s / self.recorder.train_s) \
                if self.recorder.train_s > 0 else None
            rows.append(MemberRow(name, state, m.rounds_done, m.rounds_missed, m.iteration,
                                  m.samples, m.epsilon, idle))
        status = CollabStatus(plan.mode, self.summary.collab.rounds, len(self.spans),
                              self._fleet_iteration(), plan.total_iterations, plan.server,
                              plan.split_point, plan.head_start, plan.train.micro_batches,
                              self.recorder.server_idle(self.server_busy), tuple(rows))
        self.messenger.send(self.topics.collab_status, status, plan.version,
                            self._fleet_iteration(), retain=True)
        if self.phase is Phase.TRAINING:
            self._publish_state(ControllerStatus.TRAINING)

    def _publish_event(self, event: Event) -> None:
        self.messenger.send(self.topics.events, event, self.plan.version if self.plan else 0,
                            self.summary.steps)
