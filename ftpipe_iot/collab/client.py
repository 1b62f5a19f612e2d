"""A data-owning device: its samples and labels never leave it (docs/design.md §13).

Collaborative mode, per iteration (one mini-batch of N micro-batches of its own data, in the
order of ``core.schedule.SyncSchedule``): the N front forwards go out back to back, and the
server's outputs and cut gradients are worked on as they come back (head, loss, head backward;
front backward); after the N-th front backward the device part steps. Federated mode: the whole
model trains on the mini-batch here. At a round's end the device part goes to the coordinator,
and the next round starts from the retained global model.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
from prometheus_client import CollectorRegistry

from ftpipe_iot.collab.agent import AgentOptions, CollabAgent
from ftpipe_iot.collab.parts import (
    DevicePart,
    LocalModel,
    RoundStart,
    export_states,
    load_states,
)
from ftpipe_iot.core.data import load_dataset
from ftpipe_iot.core.models import build_layers, cut_shapes
from ftpipe_iot.core.schedule import SyncSchedule
from ftpipe_iot.errors import DataError
from ftpipe_iot.planning.profiles import DeviceProfile
from ftpipe_iot.protocol.collab import (
    CollabJob,
    CollabPlan,
    CollabReport,
    LocalUpdate,
    Round,
    RoundRestart,
    Smashed,
)
from ftpipe_iot.protocol.messages import Gradient, Inbound, Message
from ftpipe_iot.protocol.signing import Credentials
from ftpipe_iot.protocol.specs import DataSpec
from ftpipe_iot.protocol.vocab import CollabMode, CollabRole, DropReason
from ftpipe_iot.transport.base import Transport

log = logging.getLogger("ftpipe_iot.collab")


@dataclass(frozen=True)
class LocalData:
    """A device's own training samples: every row of an ``.npz`` (arrays ``x``, ``y``), or the
    training split of ``digits``/``synthetic`` (to try things out)."""

    x: np.ndarray
    y: np.ndarray
    source: str

    @classmethod
    def load(cls, name: str) -> LocalData:
        spec = DataSpec(name)
        dataset = load_dataset(spec)  # validates: shapes, dtypes, labels, finite values
        if not name.startswith("npz:"):
            return cls(dataset.x_train, dataset.y_train, name)
        with np.load(name[4:], allow_pickle=False) as archive:
            return cls(archive["x"].astype(np.float32), archive["y"].astype(np.int64), name)

    def check(self, input_shape: tuple[int, ...], num_classes: int) -> None:
        """Refuse data that does not fit the job's model, saying how."""
        if tuple(self.x.shape[1:]) != tuple(input_shape):
            raise DataError(f"{self.source}: samples of shape {tuple(self.x.shape[1:])}, the "
                            f"job's model takes {tuple(input_shape)}")
        if int(self.y.max()) >= num_classes:
            raise DataError(f"{self.source}: label {int(self.y.max())} outside the job's "
                            f"{num_classes} classes")


class DataDevice(CollabAgent):
    """A device that holds data, the front and the head of the model (or all of it, fedavg)."""

    role = CollabRole.DATA

    def __init__(self, name: str, job: str, transport: Transport, registry: CollectorRegistry,
                 data: LocalData, profile: DeviceProfile | None = None,
                 options: AgentOptions = AgentOptions(),
                 credentials: Credentials | None = None) -> None:
        super().__init__(name, job, transport, registry, profile, options, credentials)
        self.data = data
        self.part: DevicePart | LocalModel | None = None
        self.schedule: SyncSchedule | None = None
        self.iteration: int | None = None  # the one being computed; None between rounds
        self._loss = 0.0
        self._correct = 0
        self._labels: dict[int, np.ndarray] = {}
        # the replies of this iteration taken so far, (is a gradient, micro-batch): a standby
        # server that takes over re-sends what it computed, and each reply counts once
        self._taken: set[tuple[bool, int]] = set()
        self._round_start: RoundStart | None = None

    @property
    def epsilon(self) -> float | None:
        return None if self.part is None else self.part.epsilon

    @property
    def progress_step(self) -> int:
        return -1 if self.iteration is None else self.iteration

    @property
    def _server(self) -> tuple[str, ...] | None:
        """Who reads this device's uplink: the plan's servers, the serving one and its warm
        standbys (tags for them, not a signature)."""
        servers = self.plan.servers if self.plan is not None else ()
        return servers or None

    def check_job(self, job: CollabJob) -> int:
        self.data.check(job.input_shape, job.num_classes)
        return len(self.data.y)

    def held_layers(self, plan: CollabPlan) -> tuple[int, ...]:
        return plan.device_layers

    def on_plan(self, plan: CollabPlan) -> None:
        train = plan.train
        layers = build_layers(train.model, plan.input_shape, plan.num_classes, train.seed)
        shapes = cut_shapes(layers, plan.input_shape, plan.num_classes, train.model.name)
        self.schedule = SyncSchedule(len(self.data.y), train.micro_batches,
                                     train.micro_batch_size, train.seed)
        if plan.mode is CollabMode.FEDAVG:
            self.part = LocalModel(layers, plan.input_shape, train, plan.privacy,
                                   len(self.data.y), self.name)
        else:
            self.part = DevicePart(layers, plan.split_point, plan.head_start, shapes,
                                   plan.num_classes, train, plan.privacy, len(self.data.y),
                                   self.name)
            self.transport.subscribe(self.topics.collab_down(self.name))
        self.iteration = None
        log.info("%s: plan %d, %s, layers %s", self.name, plan.version, plan.mode.value,
                 list(plan.device_layers))

    def on_round(self, rnd: Round, redo: bool) -> None:
        same = self.round is not None and self.round.round == rnd.round
        if self.name not in rnd.participants:
            if same or self.iteration is not None:
                log.info("%s: left out of round %d", self.name, rnd.round)
                self._pause()
            self.round = None
            return
        if same and not redo:
            self.round = rnd
            return  # the participants or the serving server changed: nothing to do for us
        self._pause()
        if redo:
            self._go_back(rnd)
        self.round = rnd
        self.load_global(rnd.round)

    def _go_back(self, rnd: Round) -> None:
        """Back to the state round ``rnd`` started with, and tell the servers where, in this
        device's stream, the abandoned attempt ends (``RoundRestart``)."""
        start = self._round_start
        if self.part is not None and start is not None and start.round == rnd.round:
            self.part.go_back(start)
        else:
            log.warning("%s: no state of round %d's start to go back to; redoing it from the "
                        "global model with the optimizer state as it is", self.name, rnd.round)
        if isinstance(self.part, DevicePart):
            self.send_up(self.topics.collab_up(self.name), RoundRestart(rnd.round, rnd.term),
                         receivers=self._server)

    def _pause(self) -> None:
        self.iteration = None
        if isinstance(self.part, DevicePart):
            self.part.abandon()

    def on_global_loaded(self, version: int, states: dict[int, dict]) -> None:
        if self.round is None or version != self.round.round or self.part is None:
            return
        load_states(self.part.layers, states)
        self._round_start = self.part.round_start(version)
        self.iteration = self.round.first_iteration
        if isinstance(self.part, DevicePart):
            self._start_iteration()

    # -- collaborative: one iteration, driven by the server's replies ---------------------------
    def _batches(self, iteration: int) -> list[np.ndarray]:
        assert self.schedule is not None
        return [mb.sample_indices for mb in self.schedule.micro_batches_of(iteration)]

    def _start_iteration(self) -> None:
        assert isinstance(self.part, DevicePart) and self.iteration is not None
        it, part = self.iteration, self.part
        self._loss, self._correct, self._labels, self._taken = 0.0, 0, {}, set()
        for index, rows in enumerate(self._batches(it)):
            self._labels[index] = self.data.y[rows]
            x = self.data.x[rows]
            smashed = self.meter.run(lambda x=x, index=index: part.forward(it, index, x), it)
            self.send_up(self.topics.collab_up(self.name), Smashed(smashed), it, index,
                         self._server)
        self.metrics.samples.inc(sum(len(v) for v in self._labels.values()))

    def on_data(self, inbound: Inbound, message: Message) -> None:
        part = self.part
        if not isinstance(part, DevicePart) or not isinstance(message, (Smashed, Gradient)) \
                or inbound.topic != self.topics.collab_down(self.name):
            self.messenger.drops.drop(DropReason.UNEXPECTED_KIND,
                                      f"{inbound.kind.value} on {inbound.topic}")
            return
        assert self.plan is not None
        if inbound.sender not in self.plan.servers:
            self.messenger.drops.drop(DropReason.UNEXPECTED, f"a reply from {inbound.sender}, "
                                      f"not a server of plan {self.plan.version}")
            return
        it, mb = inbound.step, inbound.micro_batch
        if it != self.iteration or mb not in self._labels:
            self.messenger.drops.drop(DropReason.STALE_PLAN, f"data of iteration {it}, "
                                      f"computing {self.iteration}")
            return
        reply = (isinstance(message, Gradient), mb)
        if reply in self._taken:
            self.messenger.drops.drop(DropReason.LATE, f"{inbound.kind.value} of micro-batch "
                                      f"{(it, mb)} again (from {inbound.sender})")
            return
        if isinstance(message, Smashed):
            labels = self._labels[mb]
            grad, loss, correct = self.meter.run(lambda: part.loss(it, mb, message.x, labels),
                                                 it)
            self._taken.add(reply)
            self._loss += loss * len(labels)
            self._correct += correct
            self.send_up(self.topics.collab_up(self.name), Gradient(grad), it, mb, self._server)
            return
        stepped = self.meter.run(lambda: part.backward(it, mb, message.g), it)
        self._taken.add(reply)
        if stepped:
            self._iteration_done(self._loss, self._correct)

    # -- federated: iterations run from the worker loop -----------------------------------------
    def has_work(self) -> bool:
        return isinstance(self.part, LocalModel) and self.iteration is not None

    def work(self) -> None:
        if not self.has_work():
            return
        assert isinstance(self.part, LocalModel) and self.iteration is not None
        rows = np.concatenate(self._batches(self.iteration))
        part, x, y = self.part, self.data.x[rows], self.data.y[rows]
        loss, correct = self.meter.run(lambda: part.train_step(x, y), self.iteration)
        self.metrics.samples.inc(len(rows))
        self._iteration_done(loss * len(rows), correct)

    # -- the end of an iteration and of a round -------------------------------------------------
    def _iteration_done(self, loss_sum: float, correct: int) -> None:
        assert self.iteration is not None and self.round is not None and self.part is not None
        it = self.iteration
        count = self.round_batch
        self.metrics.steps.inc()
        self.report(CollabReport(self.role, self.meter.busy_s, loss_sum / count, correct, count,
                                 self.epsilon), step=it)
        if it + 1 < self.round.end_iteration:
            self.iteration = it + 1
            if isinstance(self.part, DevicePart):
                self._start_iteration()
            return
        self.iteration = None
        self.metrics.rounds.inc()
        self.send_up(self.topics.collab_update,
                     LocalUpdate(self.round.round, self.name, self.role,
                                 export_states(self.part.layers)), it,
                     receivers=(self.options.coordinator,))
        log.info("%s: round %d done (iterations %d-%d)", self.name, self.round.round,
                 self.round.first_iteration, it)

    @property
    def round_batch(self) -> int:
        assert self.plan is not None
        return self.plan.train.batch_size
