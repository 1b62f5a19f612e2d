"""Everything a controller publishes, on its job's topics, tagged with the plan in force."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from ftpipe_iot.protocol.messages import (
    ActivationBatch,
    Command,
    ControllerState,
    Event,
    FedInput,
    LayerReplica,
    PlanMessage,
)
from ftpipe_iot.protocol.plan import Plan, StageAssignment
from ftpipe_iot.protocol.topics import Topics
from ftpipe_iot.protocol.vocab import CommandOp
from ftpipe_iot.transport.messenger import Messenger


class JobOutbox:
    """The controller's publishes; ``plan_version`` follows the last plan sent."""

    def __init__(self, messenger: Messenger, topics: Topics) -> None:
        self.messenger = messenger
        self.topics = topics
        self.plan_version = 0
        self._plan: Plan | None = None
        self.devices: tuple[str, ...] = ()  # the plan's devices: they read the state each step

    def use(self, plan: Plan) -> None:
        """Tag what follows with ``plan`` (its version; who reads the data fed)."""
        self.plan_version = plan.version
        self._plan = plan
        self.devices = (*plan.devices, self.messenger.name)  # we read it too: fencing

    def plan(self, plan: Plan) -> None:
        """The new plan, retained (devices and a resumed controller read it from the broker)."""
        self.use(plan)
        self.messenger.send(self.topics.plan, PlanMessage(plan), plan.version, retain=True)

    def state(self, state: ControllerState, step: int, idle: Iterable[str] = ()) -> None:
        """The controller's state, retained: tags for the plan's devices and the ``idle`` ones
        (all of them read it every step; an idle device checking a signature instead spent
        40 ms of a demo's 14 s on it), a signature for anyone else."""
        readers = (*self.devices, *(d for d in idle if d not in self.devices))
        self.messenger.send(self.topics.state, state, self.plan_version, step, retain=True,
                            receivers=readers or None)

    def event(self, event: Event, step: int) -> None:
        self.messenger.send(self.topics.events, event, self.plan_version, step)

    def command(self, device: str, command: Command) -> None:
        self.messenger.send(self.topics.cmd(device), command, self.plan_version)

    def take_over(self, stages: Iterable[StageAssignment], gone: frozenset[str],
                  excluded: set[str]) -> None:
        """Tell the live holders of every stage that lost ``gone`` to compute its micro-batches
        now, not after their deadline (they learn of the failure from the controller: the fleet
        ACLs keep other devices' statuses private)."""
        for stage in stages:
            lost = tuple(sorted(gone & set(stage.devices)))
            for device in (d for d in stage.devices if lost and d not in excluded):
                self.command(device, Command(CommandOp.TAKE_OVER, devices=lost))

    def inputs(self, inputs: Sequence[FedInput], device: str) -> None:
        """Micro-batches of data into stage 0's member ``device``, in order: one alone as an
        ``Activation``, several in one ``ActivationBatch`` frame."""
        readers = self._plan.input_readers(0, device) if self._plan is not None else None
        first = inputs[0]
        message = first.activation if len(inputs) == 1 else ActivationBatch(tuple(inputs))
        self.messenger.send(self.topics.stage_act(0, device), message, self.plan_version,
                            first.step, first.micro_batch, receivers=readers)

    def replicas(self, replicas: Iterable[LayerReplica]) -> None:
        """The controller's own copies of layers, retained on their weights topics."""
        for replica in replicas:
            self.messenger.send_replica(self.topics, self.plan_version, replica)
