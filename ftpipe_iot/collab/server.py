"""The server of the collaborative mode: one replica of the server part per data device (as
PiPar), serving every device's micro-batches as they arrive (docs/design.md §13).

Why a replica per device rather than one shared part: each device then trains "its" whole model
(device part + its replica) on its own data only, so a device's iteration is a deterministic
function of its data and the round's global model, whatever order the devices' messages arrive
in; and FedAvg of both halves, weighted by sample counts, is exactly federated averaging of whole
models. A shared part would step once per device mini-batch in arrival order: the result would
depend on timing. The cost is memory: one copy of the server part per device.

Data of a round the server has not loaded yet (a device can be faster than the global model
reaching the server) waits in a bounded buffer and is replayed once it is loaded.
"""

from __future__ import annotations

import logging

from prometheus_client import CollectorRegistry

from ftpipe_iot.collab.agent import AgentOptions, CollabAgent
from ftpipe_iot.collab.parts import ServerReplica, export_states, load_states
from ftpipe_iot.core.models import build_layers, cut_shapes
from ftpipe_iot.errors import CollabError
from ftpipe_iot.planning.profiles import DeviceProfile
from ftpipe_iot.protocol.collab import CollabJob, CollabPlan, LocalUpdate, Round, Smashed
from ftpipe_iot.protocol.messages import Gradient, Inbound, Message
from ftpipe_iot.protocol.signing import Credentials
from ftpipe_iot.protocol.vocab import CollabMode, CollabRole, DropReason
from ftpipe_iot.transport.base import Transport

log = logging.getLogger("ftpipe_iot.collab")

_MAX_EARLY = 4096


class ServerAgent(CollabAgent):
    """A device started with ``--server``: offers to hold the server part; the planner picks
    the one with the shortest predicted iteration among all such offers."""

    role = CollabRole.SERVER

    def __init__(self, name: str, job: str, transport: Transport, registry: CollectorRegistry,
                 profile: DeviceProfile | None = None, options: AgentOptions = AgentOptions(),
                 credentials: Credentials | None = None) -> None:
        super().__init__(name, job, transport, registry, profile, options, credentials)
        self.replicas: dict[str, ServerReplica] = {}
        self.global_states: dict[int, dict] | None = None
        self._loaded_round = -1
        self._early: list[tuple[Inbound, Message]] = []

    @property
    def active(self) -> bool:
        return self.plan is not None and self.plan.server == self.name

    def check_job(self, job: CollabJob) -> int:
        if job.mode is CollabMode.FEDAVG:
            raise CollabError("a fedavg job needs no server (the coordinator aggregates)")
        # Listen before any plan: the devices may act on the plan before it reaches us.
        self.transport.subscribe(self.topics.collab_up_all)
        return 0

    def held_layers(self, plan: CollabPlan) -> tuple[int, ...]:
        return plan.server_layers if plan.server == self.name else ()

    def on_plan(self, plan: CollabPlan) -> None:
        self.replicas, self.global_states, self._loaded_round = {}, None, -1
        self._early = []
        if not self.active:
            self.transport.unsubscribe(self.topics.collab_up_all)
            log.info("%s: plan %d uses server %s; standing by", self.name, plan.version,
                     plan.server)
            return
        log.info("%s: serving layers [%d, %d) of plan %d", self.name, plan.split_point,
                 plan.head_start, plan.version)

    def _new_replica(self) -> ServerReplica:
        plan = self.plan
        assert plan is not None and self.global_states is not None
        layers = build_layers(plan.train.model, plan.input_shape, plan.num_classes,
                              plan.train.seed)
        shapes = cut_shapes(layers, plan.input_shape, plan.num_classes, plan.train.model.name)
        replica = ServerReplica(layers[plan.split_point:plan.head_start], plan.split_point,
                                shapes[plan.split_point], plan.train)
        load_states(replica.layers, self.global_states)
        return replica

    def on_round(self, rnd: Round) -> None:
        if not self.active:
            return
        same = self.round is not None and self.round.round == rnd.round
        self.round = rnd
        for device in list(self.replicas):
            if device not in rnd.participants and same:
                del self.replicas[device]  # dropped out: its half-done round is discarded
        if not same:
            self.load_global(rnd.round)

    def on_global_loaded(self, version: int, states: dict[int, dict]) -> None:
        if self.round is None or version != self.round.round:
            return
        self.global_states = states
        self._loaded_round = version
        # Every replica starts the round from the global model; optimizer state stays (PiPar).
        for device in list(self.replicas):
            if device in self.round.participants:
                load_states(self.replicas[device].layers, states)
            else:
                del self.replicas[device]
        early, self._early = self._early, []
        for inbound, message in early:
            self.on_data(inbound, message)

    def _device_of(self, topic: str) -> str | None:
        prefix = self.topics.collab_up("")
        return topic[len(prefix):] if topic.startswith(prefix) else None

    def on_data(self, inbound: Inbound, message: Message) -> None:
        device = self._device_of(inbound.topic)
        if not self.active or device is None or not isinstance(message, (Smashed, Gradient)):
            self.messenger.drops.drop(DropReason.UNEXPECTED_KIND,
                                      f"{inbound.kind.value} on {inbound.topic}")
            return
        assert self.plan is not None
        rnd, it = self.round, inbound.step
        if rnd is None or self._loaded_round != rnd.round or it >= rnd.end_iteration:
            if len(self._early) < _MAX_EARLY:
                self._early.append((inbound, message))  # a round not loaded yet
            else:
                self.messenger.drops.drop(DropReason.FUTURE_PLAN, f"iteration {it} too early")
            return
        if device not in rnd.participants or it < rnd.first_iteration:
            self.messenger.drops.drop(DropReason.STALE_PLAN, f"{device} iteration {it} is not "
                                      f"in round {rnd.round}")
            return
        replica = self.replicas.get(device)
        if replica is None:
            replica = self.replicas[device] = self._new_replica()
        mb, down = inbound.micro_batch, self.topics.collab_down(device)
        if isinstance(message, Smashed):
            out = self.meter.run(lambda: replica.forward(it, mb, message.x), it)
            self.messenger.send(down, Smashed(out), self.plan.version, it, mb,
                                receivers=(device,))
            return
        grad, stepped = self.meter.run(lambda: replica.backward(it, mb, message.g), it)
        self.messenger.send(down, Gradient(grad), self.plan.version, it, mb, receivers=(device,))
        if stepped:
            self.metrics.steps.inc()
            if it + 1 == rnd.end_iteration:
                self.metrics.rounds.inc()
                self.messenger.send(self.topics.collab_update,
                                    LocalUpdate(rnd.round, device, self.role,
                                                export_states(replica.layers)),
                                    self.plan.version, it,
                                    receivers=(self.options.coordinator,))
