"""No single point of failure in the collaborative modes: who serves, when a standby server is
promoted, and where a coordinator that resumes a job picks it up (pure decisions: values in,
values out; docs/design.md §13).

A standby server is warm: it subscribes to the same ``collab/up/<device>`` topics as the serving
server, so MQTT fan-out gives it the same inputs in the same order, and it computes exactly what
the serving server computes (one replica per data device, each a deterministic function of that
device's messages). It publishes nothing while it stands by. When the coordinator sees the
serving server gone (its Last Will, or heartbeats missing beyond the timeout) it names the first
standby in the round; the standby re-sends the replies of the iteration each device is in (the
devices take each reply once) and sends the replicas' updates at the round's end. A server that
was lost never comes back into the plan: a restarted process has lost its replicas' state.

A coordinator that resumes (``controller --resume``, or a standby coordinator that took the
lease) reads the retained job, plan, round and global model. The round in progress when the old
coordinator died is redone from the global model it started from: devices and servers go back to
it and to the optimizer state they had at its start, so the result equals a run without the
failure. A round whose merged model was already published is not redone. The global model is
kept in two retained slots (version ``v`` in slot ``v % 2``), so one killed while publishing
leaves the version before it whole, and the job goes on from that one.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass, field
from enum import Enum

from ftpipe_iot.collab.rounds import RoundSpan
from ftpipe_iot.errors import CollabError
from ftpipe_iot.protocol.collab import CollabPlan, Round


class ServerChangeKind(str, Enum):
    """What losing a server means for the job."""

    PROMOTED = "promoted"              # the serving server is gone: a standby serves now
    STANDBY_LOST = "standby_lost"      # a standby is gone: the serving server goes on
    NO_SERVER_LEFT = "no_server_left"  # the serving server is gone and no standby is left
    NOT_WARM = "not_warm"              # not a server of the plan, or lost already: no change


@dataclass(frozen=True)
class ServerChange:
    """The outcome of losing ``gone``: who serves after it, and the standbys left."""

    kind: ServerChangeKind
    gone: str
    serving: str | None
    standbys: tuple[str, ...]


@dataclass
class ServerRoster:
    """The servers of a plan as the coordinator knows them: the serving one, the warm standbys
    in promotion order, and those lost (they stay lost for the rest of the job)."""

    serving: str | None
    standbys: list[str] = field(default_factory=list)
    lost: list[str] = field(default_factory=list)

    @classmethod
    def of_plan(cls, plan: CollabPlan) -> ServerRoster:
        return cls(plan.server, list(plan.standbys))

    @classmethod
    def of_round(cls, plan: CollabPlan, rnd: Round | None) -> ServerRoster:
        """The roster a retained round describes (the plan's when no round names a server)."""
        if rnd is None or rnd.server is None or rnd.server not in plan.servers:
            return cls.of_plan(plan)
        warm = [rnd.server, *(s for s in rnd.standbys if s in plan.servers)]
        return cls(rnd.server, warm[1:], [s for s in plan.servers if s not in warm])

    @property
    def warm(self) -> tuple[str, ...]:
        """Every server whose replicas are current: the serving one first."""
        return () if self.serving is None else (self.serving, *self.standbys)

    def lose(self, name: str) -> ServerChange:
        """``name`` went away (Last Will, silence, a lost connection): promote the first standby
        when it was serving."""
        if name not in self.warm:
            return ServerChange(ServerChangeKind.NOT_WARM, name, self.serving,
                                tuple(self.standbys))
        self.lost.append(name)
        if name != self.serving:
            self.standbys.remove(name)
            return ServerChange(ServerChangeKind.STANDBY_LOST, name, self.serving,
                                tuple(self.standbys))
        if not self.standbys:
            self.serving = None
            return ServerChange(ServerChangeKind.NO_SERVER_LEFT, name, None, ())
        self.serving = self.standbys.pop(0)
        return ServerChange(ServerChangeKind.PROMOTED, name, self.serving, tuple(self.standbys))


def silent_servers(warm: Iterable[str], last_seen: Mapping[str, float], now: float,
                   timeout_s: float) -> tuple[str, ...]:
    """The warm servers not heard from for longer than ``timeout_s`` (a hung process keeps its
    connection, so its Last Will does not fire: its silence is the signal), serving one first."""
    return tuple(s for s in warm if now - last_seen.get(s, now) > timeout_s)


def round_message(span: RoundSpan, participants: tuple[str, ...], roster: ServerRoster | None,
                  term: int) -> Round:
    """The ``Round`` a coordinator of ``term`` publishes for ``span``: after a change of servers
    the same number, iterations, participants and term, with the roster's serving server and
    standbys (none in fedavg mode, ``roster`` None)."""
    return Round(span.index, span.first, span.iterations, participants,
                 roster.serving if roster is not None else None,
                 tuple(roster.standbys) if roster is not None else (), term)


# -- resuming a job -----------------------------------------------------------------------------
class ResumeAction(str, Enum):
    """What a resuming coordinator does first."""

    PLAN = "plan"                # the job's newest run was never planned: plan it now
    RUN_ROUND = "run_round"      # (re)run round ``round`` from global model ``round``
    FINISH = "finish"            # every round's merged model is there: write the results


@dataclass(frozen=True)
class ResumePoint:
    """Where a resuming coordinator picks the job up."""

    action: ResumeAction
    round: int = 0
    redo: bool = False  # the round had started under the old coordinator: devices go back


def resume_point(job_version: int, plan: CollabPlan | None, rnd: Round | None,
                 global_versions: Mapping[int, Collection[int]], rounds: int) -> ResumePoint:
    """Decide from what the broker retains: the newest job run's plan (``plan``, None when
    there is none), the newest round (``rnd``), the versions of the global model retained for
    each layer under that plan (``global_versions``: layer -> versions = rounds merged; the
    coordinator keeps two slots, so a model it was publishing when it died sits beside the
    whole one before it) and the number of rounds the plan makes. The job goes on from the
    newest version every layer has. Raises ``CollabError`` when the retained state cannot be
    resumed exactly, with the reason."""
    if plan is None or plan.version < job_version:
        return ResumePoint(ResumeAction.PLAN)
    missing = [layer for layer in range(plan.num_layers) if not global_versions.get(layer)]
    if missing:
        raise CollabError(f"cannot resume: the broker retains no global model of plan "
                          f"{plan.version} for layers {missing}")
    complete = set.intersection(*(set(global_versions[layer])
                                  for layer in range(plan.num_layers)))
    if not complete:
        retained = sorted({v for layer in range(plan.num_layers) for v in global_versions[layer]})
        raise CollabError(f"cannot resume: no version of the retained global model is whole "
                          f"(versions {retained} each miss layers); start the job again")
    version = max(complete)
    started = rnd.round if rnd is not None else None
    if version >= rounds:
        return ResumePoint(ResumeAction.FINISH, version)
    if started is None:
        if version != 0:
            raise CollabError(f"cannot resume: global model version {version} is retained but "
                              f"no round")
        return ResumePoint(ResumeAction.RUN_ROUND, 0, redo=False)
    if version == started:
        return ResumePoint(ResumeAction.RUN_ROUND, started, redo=True)
    if version == started + 1:
        return ResumePoint(ResumeAction.RUN_ROUND, version, redo=False)
    raise CollabError(f"cannot resume: the retained global model (version {version}) does not "
                      f"belong to round {started + 1}, the retained round")
