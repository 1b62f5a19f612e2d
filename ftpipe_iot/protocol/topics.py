"""Every MQTT topic name the system uses, in one place (docs/design.md §3).

Per-device topics live under ``ftpipe/dev/<device>/`` so broker ACLs can use ``%u`` patterns;
everything a job exchanges lives under ``ftpipe/<job>/``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from ftpipe_iot.errors import ConfigError

ROOT = "ftpipe"
_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")


def check_name(kind: str, value: str) -> str:
    """Reject names that would break topic structure (wildcards, slashes, empty)."""
    if not _NAME.match(value):
        raise ConfigError(
            f"{kind} name {value!r} must be 1-64 characters of letters, digits, '_', '.', '-'"
        )
    return value


@dataclass(frozen=True)
class Topics:
    """Topic names for one job."""

    job: str

    def __post_init__(self) -> None:
        check_name("job", self.job)

    @property
    def base(self) -> str:
        return f"{ROOT}/{self.job}"

    # controller-written (only the controller identity may write ctrl/#)
    @property
    def plan(self) -> str:
        return f"{self.base}/ctrl/plan"

    @property
    def state(self) -> str:
        return f"{self.base}/ctrl/state"

    @property
    def roster(self) -> str:
        """The public keys of the job's identities (retained, signed by the controller)."""
        return f"{self.base}/ctrl/roster"

    @property
    def probe(self) -> str:
        """The controller's own echo topic: how large a message the broker passes."""
        return f"{self.base}/ctrl/probe"

    def cmd(self, device: str) -> str:
        return f"{self.base}/ctrl/cmd/{device}"

    @property
    def events(self) -> str:
        return f"{self.base}/events"

    # pipeline data: one topic per member, so a group's micro-batches reach only their member
    def stage_act(self, stage: int, device: str) -> str:
        return f"{self.base}/stage/{stage}/act/{device}"

    def stage_grad(self, stage: int, device: str) -> str:
        return f"{self.base}/stage/{stage}/grad/{device}"

    def stage_act_all(self, stage: int) -> str:
        """Every member's activations of a stage: what a watching holder subscribes to."""
        return f"{self.base}/stage/{stage}/act/+"

    def stage_grad_all(self, stage: int) -> str:
        return f"{self.base}/stage/{stage}/grad/+"

    @staticmethod
    def addressee(topic: str) -> str:
        """The device a per-member stage topic is addressed to (its last level)."""
        return topic.rsplit("/", 1)[-1]

    def stage_traffic(self, topic: str) -> str | None:
        """What a stage topic of this job carries: ``act``, ``grad`` or ``reduce`` (None for
        any other topic). Known from the topic alone, so also for one chunk of a message."""
        parts = topic.split("/")
        base = self.base.split("/")
        if parts[:len(base)] != base or len(parts) < len(base) + 3 or \
                parts[len(base)] != "stage":
            return None
        kind = parts[len(base) + 2]
        return kind if kind in ("act", "grad", "reduce") else None

    def stage_reduce(self, stage: int) -> str:
        """A stage's micro-batch contributions and forward progress (every holder publishes,
        every holder listens)."""
        return f"{self.base}/stage/{stage}/reduce"

    @property
    def results(self) -> str:
        """Device -> controller: losses, predictions, step completions, snapshots done."""
        return f"{self.base}/results"

    def trace(self, device: str) -> str:
        """Device -> controller: the device's timeline spans (``ftpipe-iot trace``)."""
        return f"{self.base}/trace/{device}"

    @property
    def trace_all(self) -> str:
        return f"{self.base}/trace/+"

    def weights(self, layer: int) -> str:
        """Base topic of a layer's replica; chunk ``i`` is retained at ``<base>/<i>``."""
        return f"{self.base}/weights/{layer}"

    def weights_chunk(self, layer: int, index: int, slot: int | None = None) -> str:
        """Where chunk ``index`` of a layer's replica is retained: ``<base>/<i>``, or
        ``<base>/<slot>-<i>`` for a replica kept in one of several slots (the collaborative
        global model alternates two, so the previous version stays whole while the next one is
        published). One level either way: ``weights_of_layer`` matches every slot."""
        suffix = str(index) if slot is None else f"{slot}-{index}"
        return f"{self.weights(layer)}/{suffix}"

    def weights_of_layer(self, layer: int) -> str:
        return f"{self.weights(layer)}/+"

    @property
    def weights_all(self) -> str:
        return f"{self.base}/weights/+/+"

    # collaborative and federated modes (docs/design.md §13): the coordinator writes job, plan,
    # round and status; devices write their own offer and uplink; the server writes downlinks
    @property
    def collab_job(self) -> str:
        return f"{self.base}/collab/job"

    def collab_offer(self, device: str) -> str:
        return f"{self.base}/collab/offer/{device}"

    @property
    def collab_offers(self) -> str:
        return f"{self.base}/collab/offer/+"

    @property
    def collab_plan(self) -> str:
        return f"{self.base}/collab/plan"

    @property
    def collab_round(self) -> str:
        return f"{self.base}/collab/round"

    def collab_up(self, device: str) -> str:
        """Device -> server: smashed data and gradients of the server's output, no labels."""
        return f"{self.base}/collab/up/{device}"

    @property
    def collab_up_all(self) -> str:
        return f"{self.base}/collab/up/+"

    def collab_down(self, device: str) -> str:
        """Server -> device: the server part's output and the gradient of the device's cut."""
        return f"{self.base}/collab/down/{device}"

    @property
    def collab_update(self) -> str:
        """Model parts at the end of a round (devices and server -> coordinator)."""
        return f"{self.base}/collab/update"

    @property
    def collab_report(self) -> str:
        return f"{self.base}/collab/report"

    @property
    def collab_status(self) -> str:
        return f"{self.base}/collab/status"

    # per-device
    @staticmethod
    def dev_status(device: str) -> str:
        return f"{ROOT}/dev/{device}/status"

    @staticmethod
    def dev_heartbeat(device: str) -> str:
        return f"{ROOT}/dev/{device}/hb"

    ALL_STATUS = f"{ROOT}/dev/+/status"
    ALL_HEARTBEATS = f"{ROOT}/dev/+/hb"

    @staticmethod
    def device_of(topic: str) -> str | None:
        """The device name in a ``ftpipe/dev/<device>/...`` topic, else None."""
        parts = topic.split("/")
        if len(parts) >= 3 and parts[0] == ROOT and parts[1] == "dev":
            return parts[2]
        return None
