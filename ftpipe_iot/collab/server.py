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

Standby servers (collab/failover.py): every server the plan names subscribes to the devices'
up topics and computes the same replicas from the same inputs; only the one the round names
publishes replies and updates. A standby keeps the replies of the iteration each device is in
and the updates of the round's end it computed; when a round names it, it sends them (the
devices take each reply once), then serves.
"""

from __future__ import annotations

import logging

from prometheus_client import CollectorRegistry

from ftpipe_iot.collab.agent import AgentOptions, CollabAgent
from ftpipe_iot.collab.parts import RoundStart, ServerReplica, export_states, load_states
from ftpipe_iot.core.models import build_layers, cut_shapes
from ftpipe_iot.errors import CollabError
from ftpipe_iot.planning.profiles import DeviceProfile
from ftpipe_iot.protocol.collab import (
    CollabJob,
    CollabPlan,
    LocalUpdate,
    Round,
    RoundRestart,
    Smashed,
)
from ftpipe_iot.protocol.messages import Gradient, Inbound, Message
from ftpipe_iot.protocol.signing import Credentials
from ftpipe_iot.protocol.vocab import CollabMode, CollabRole, DropReason
from ftpipe_iot.transport.base import Transport

log = logging.getLogger("ftpipe_iot.collab")

_MAX_EARLY = 4096


class ServerAgent(CollabAgent):
    """A device started with ``--server``: offers to hold the server part; the planner picks
    the one with the shortest predicted iteration among all such offers to serve, and the others
    online then stand by, warm."""

    role = CollabRole.SERVER

    def __init__(self, name: str, job: str, transport: Transport, registry: CollectorRegistry,
                 profile: DeviceProfile | None = None, options: AgentOptions = AgentOptions(),
                 credentials: Credentials | None = None) -> None:
        super().__init__(name, job, transport, registry, profile, options, credentials)
        self.replicas: dict[str, ServerReplica] = {}
        self.global_states: dict[int, dict] | None = None
        self._loaded_round = -1
        self._early: list[tuple[Inbound, Message]] = []
        # per device: its replica's state at the round's start (to redo the round from); and,
        # standing by, the replies of the iteration it is in (iteration, {(is a gradient,
        # micro-batch): reply}) and the round-end update, both sent if we take over
        self._starts: dict[str, RoundStart] = {}
        self._replies: dict[str, tuple[int, dict[tuple[bool, int], Message]]] = {}
        self._unsent: dict[str, tuple[LocalUpdate, int]] = {}

    @property
    def warm(self) -> bool:
        """This server keeps replicas in the current plan (serving or standing by)."""
        return self.plan is not None and self.name in self.plan.servers

    @property
    def active(self) -> bool:
        """This server answers the devices: the round names it (the plan, before any round)."""
        if self.plan is None:
            return False
        if self.round is not None and self.round.server is not None:
            return self.round.server == self.name
        return self.plan.server == self.name

    def check_job(self, job: CollabJob) -> int:
        if job.mode is CollabMode.FEDAVG:
            raise CollabError("a fedavg job needs no server (the coordinator aggregates)")
        # Listen before any plan: the devices may act on the plan before it reaches us.
        self.transport.subscribe(self.topics.collab_up_all)
        return 0

    def held_layers(self, plan: CollabPlan) -> tuple[int, ...]:
        return plan.server_layers if self.name in plan.servers else ()

    def on_plan(self, plan: CollabPlan) -> None:
        self.replicas, self.global_states, self._loaded_round = {}, None, -1
        self._early, self._starts, self._replies, self._unsent = [], {}, {}, {}
        if not self.warm:
            self.transport.unsubscribe(self.topics.collab_up_all)
            log.info("%s: plan %d uses server %s and no standby of ours; idle", self.name,
                     plan.version, plan.server)
            return
        log.info("%s: %s layers [%d, %d) of plan %d", self.name,
                 "serving" if plan.server == self.name else "standing by (warm) for",
                 plan.split_point, plan.head_start, plan.version)

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

    def on_round(self, rnd: Round, redo: bool) -> None:
        if not self.warm:
            return
        was_active = self.active
        same = self.round is not None and self.round.round == rnd.round
        self.round = rnd
        if same:
            for device in list(self.replicas):
                if device not in rnd.participants:
                    self._forget(device)  # dropped out: its half-done round is discarded
            # A redo needs nothing more here: each device's RoundRestart, in order with its
            # data, takes its replica back to the round's start.
        else:
            # what a standby kept of the last round is of no use now: that round is merged
            self._replies, self._unsent = {}, {}
            self.load_global(rnd.round)
        if self.active and not was_active:
            self._take_over()

    def _forget(self, device: str) -> None:
        self.replicas.pop(device, None)
        self._starts.pop(device, None)
        self._replies.pop(device, None)
        self._unsent.pop(device, None)

    def _take_over(self) -> None:
        """The round names us: send what the devices may still wait for (the replies of the
        iteration each is in, the updates of the round's end), then serve."""
        assert self.plan is not None and self.round is not None
        resent = 0
        replies, self._replies = self._replies, {}
        for device, (it, held) in sorted(replies.items()):
            down = self.topics.collab_down(device)
            for (_, mb), reply in sorted(held.items(), key=lambda item: item[0]):
                self.messenger.send(down, reply, self.plan.version, it, mb, receivers=(device,))
                resent += 1
        for device in sorted(self._unsent):
            self._send_update(device)
        log.warning("%s: serving round %d now (took over); re-sent %d replies", self.name,
                    self.round.round, resent)

    def on_global_loaded(self, version: int, states: dict[int, dict]) -> None:
        if self.round is None or version != self.round.round:
            return
        self.global_states = states
        self._loaded_round = version
        # Every replica starts the round from the global model; optimizer state stays (PiPar).
        for device in list(self.replicas):
            if device in self.round.participants:
                load_states(self.replicas[device].layers, states)
                self._starts[device] = self.replicas[device].round_start(version)
            else:
                self._forget(device)
        early, self._early = self._early, []
        for inbound, message in early:
            self.on_data(inbound, message)

    def _device_of(self, topic: str) -> str | None:
        prefix = self.topics.collab_up("")
        return topic[len(prefix):] if topic.startswith(prefix) else None

    def on_data(self, inbound: Inbound, message: Message) -> None:
        device = self._device_of(inbound.topic)
        if not self.warm or device is None or inbound.sender != device or \
                not isinstance(message, (Smashed, Gradient, RoundRestart)):
            self.messenger.drops.drop(DropReason.UNEXPECTED_KIND,
                                      f"{inbound.kind.value} on {inbound.topic}")
            return
        assert self.plan is not None
        rnd = self.round
        it = message.round if isinstance(message, RoundRestart) else inbound.step
        ahead = it > rnd.round if isinstance(message, RoundRestart) and rnd is not None \
            else rnd is not None and it >= rnd.end_iteration
        if rnd is None or self._loaded_round != rnd.round or ahead:
            if len(self._early) < _MAX_EARLY:
                self._early.append((inbound, message))  # a round not loaded yet
            else:
                self.messenger.drops.drop(DropReason.FUTURE_PLAN, f"iteration {it} too early")
            return
        if isinstance(message, RoundRestart):
            self._restart(device, message)
            return
        if device not in rnd.participants or it < rnd.first_iteration:
            self.messenger.drops.drop(DropReason.STALE_PLAN, f"{device} iteration {it} is not "
                                      f"in round {rnd.round}")
            return
        replica = self.replicas.get(device)
        if replica is None:
            replica = self.replicas[device] = self._new_replica()
            self._starts[device] = replica.round_start(rnd.round)
        mb = inbound.micro_batch
        if isinstance(message, Smashed):
            out = self.meter.run(lambda: replica.forward(it, mb, message.x), it)
            self._reply(device, it, mb, Smashed(out))
            return
        grad, stepped = self.meter.run(lambda: replica.backward(it, mb, message.g), it)
        self._reply(device, it, mb, Gradient(grad))
        if stepped:
            self.metrics.steps.inc()
            if it + 1 == rnd.end_iteration:
                self.metrics.rounds.inc()
                self._unsent[device] = (LocalUpdate(rnd.round, device, self.role,
                                                    export_states(replica.layers)), it)
                if self.active:
                    self._send_update(device)

    def _reply(self, device: str, it: int, mb: int, reply: Smashed | Gradient) -> None:
        """Send the reply when we serve; standing by, keep it for a takeover (the iteration's
        only: a device in a later iteration needs no earlier one)."""
        assert self.plan is not None
        if self.active:
            self.messenger.send(self.topics.collab_down(device), reply, self.plan.version, it,
                                mb, receivers=(device,))
            return
        held = self._replies.get(device)
        if held is None or held[0] != it:
            held = self._replies[device] = (it, {})
        held[1][(isinstance(reply, Gradient), mb)] = reply

    def _send_update(self, device: str) -> None:
        assert self.plan is not None
        update, it = self._unsent.pop(device)
        self.messenger.send(self.topics.collab_update, update, self.plan.version, it,
                            receivers=(self.options.coordinator,))

    def _restart(self, device: str, restart: RoundRestart) -> None:
        """``device`` redoes the round: its replica goes back to the round's start (a replica
        made during the abandoned attempt is made again from the global model when needed)."""
        assert self.round is not None and self.global_states is not None
        if restart.round != self.round.round:
            self.messenger.drops.drop(DropReason.STALE_PLAN, f"{device} restarts round "
                                      f"{restart.round}, we are in round {self.round.round}")
            return
        replica, start = self.replicas.get(device), self._starts.get(device)
        self._replies.pop(device, None)
        self._unsent.pop(device, None)
        if replica is None or start is None or start.round != restart.round:
            self._forget(device)
            return
        replica.go_back(start)
        load_states(replica.layers, self.global_states)
        log.info("%s: %s redoes round %d (term %d): its replica is back at the round's start",
                 self.name, device, restart.round, restart.term)
