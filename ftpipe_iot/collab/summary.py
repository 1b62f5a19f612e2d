"""The run summary of a collaborative or federated job, and the recorder that writes it, the
metrics, the progress lines and the events topic together (so the four never disagree).

The summary carries the fields the run report reads for any job (``history``, ``evals``,
``events``, ``test_accuracy``...) plus a ``collab`` block: mode, split, per-device rounds and
epsilon, the server's idle fraction.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ftpipe_iot.collab.metrics import CoordinatorMetrics
from ftpipe_iot.collab.planner import Choice
from ftpipe_iot.collab.rounds import Member
from ftpipe_iot.control.summary import RunSummary
from ftpipe_iot.observability.progress import ProgressReporter
from ftpipe_iot.protocol.collab import CollabPlan
from ftpipe_iot.protocol.messages import Event
from ftpipe_iot.protocol.vocab import CollabMode, EventType, FailureCause


@dataclass
class CollabFigures:
    """The ``collab`` block of the summary."""

    mode: str
    split_point: int = 0
    head_start: int = 0
    micro_batches: int = 0
    micro_batch_size: int = 0
    aggregate_every: int = 0
    iterations_per_epoch: int = 0
    server: str | None = None
    rounds: int = 0
    dropouts: int = 0
    server_busy_s: float = 0.0
    aggregation_s: float = 0.0
    server_idle_fraction: float | None = None
    privacy: dict[str, float] | None = None
    members: dict[str, dict[str, Any]] = field(default_factory=dict)
    plan: dict[str, Any] = field(default_factory=dict)
    round_log: list[dict[str, Any]] = field(default_factory=list)
    # data device -> indices (0-based, as in ``round_log``) of the rounds it was left out of
    left_out: dict[str, list[int]] = field(default_factory=dict)
    # the warm standby servers of the plan, and per round (0-based) the servers that served it
    # in order (two when a standby took over in it); each server change as it happened
    standbys: list[str] = field(default_factory=list)
    round_servers: list[list[str]] = field(default_factory=list)
    server_changes: list[dict[str, Any]] = field(default_factory=list)
    # the round (0-based) this coordinator resumed the job at, and whether it redid it
    resumed_at_round: int | None = None
    redone_round: bool = False


@dataclass
class CollabSummary(RunSummary):
    """What a collaborative or federated job achieved: the run summary every mode writes (the
    run report reads it), ``steps`` counting iterations and ``failures_detected`` drop-outs,
    plus the ``collab`` block."""

    collab: CollabFigures = field(default_factory=lambda: CollabFigures(""))

    def save(self, path: Path) -> Path:
        """Write the summary as JSON (what the demo and the benchmarks read)."""
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_dict(), indent=2))
        return path


def left_out_of(included: tuple[str, ...], members: dict[str, Member]) -> tuple[str, ...]:
    """The known data devices a round's FedAvg did not include (dropped out of it, or offline
    when it began), in name order."""
    return tuple(sorted(set(members) - set(included)))


def served_text(round_servers: list[list[str]]) -> str:
    """Who served which rounds, as a person reads it: ``server rounds 1-3, server1 rounds
    3-9`` (a round two servers served is in both)."""
    by_server: dict[str, list[int]] = {}
    for index, servers in enumerate(round_servers):
        for name in servers:
            by_server.setdefault(name, []).append(index)
    order = sorted(by_server, key=lambda n: (min(by_server[n]), n))
    return ", ".join(f"{name} rounds {rounds_text(by_server[name])}" for name in order)


def rounds_text(rounds: list[int]) -> str:
    """Round indices as a person reads them (1-based, runs joined): ``[2, 3, 4, 7]`` ->
    ``3-5, 8``."""
    runs: list[list[int]] = []
    for r in sorted(rounds):
        if runs and r == runs[-1][1] + 1:
            runs[-1][1] = r
        else:
            runs.append([r, r])
    return ", ".join(f"{a + 1}" if a == b else f"{a + 1}-{b + 1}" for a, b in runs)


class CollabRecorder:
    """Records one job; ``publish`` sends an event on the events topic; ``clock`` times the
    job, ``wall_clock`` stamps its start (the summary's ``started_at``, as a pipeline job's)."""

    def __init__(self, job: str, mode: str, metrics: CoordinatorMetrics,
                 progress: ProgressReporter, publish: Callable[[Event], None],
                 clock: Callable[[], float] = time.monotonic,
                 wall_clock: Callable[[], float] = time.time) -> None:
        self.summary = CollabSummary(job, collab=CollabFigures(mode), started_at=wall_clock())
        self.metrics = metrics
        self.progress = progress
        self._publish = publish
        self._clock = clock
        self._started = clock()
        self._training_since: float | None = None
        self._samples = 0
        self._losses: list[float] = []
        self._fleet_done = 0
        self._round_started = 0.0
        self._serving: list[str] = []  # the servers of the round in progress, in order

    @property
    def elapsed_s(self) -> float:
        return self._clock() - self._started

    @property
    def train_s(self) -> float:
        return 0.0 if self._training_since is None else self._clock() - self._training_since

    def _event(self, event: Event) -> None:
        self.summary.events.append({"t": self.elapsed_s, "step": self.summary.steps,
                                    **event.to_dict()})
        self._publish(event)

    def message(self, text: str) -> None:
        self.progress.message(text)

    def planned(self, plan: CollabPlan, choice: Choice | None, devices: int) -> None:
        """The plan's figures into the summary, a line for the person watching, an event."""
        figures = self.summary.collab
        figures.split_point, figures.head_start = plan.split_point, plan.head_start
        figures.micro_batches = plan.train.micro_batches
        figures.micro_batch_size = plan.train.micro_batch_size
        figures.aggregate_every, figures.server = plan.aggregate_every, plan.server
        figures.standbys = list(plan.standbys)
        figures.iterations_per_epoch = plan.iterations_per_epoch
        figures.privacy = plan.privacy.to_body() if plan.privacy else None
        figures.plan = choice.to_dict() if choice else {}
        self.summary.devices = devices
        where = (f"device layers [0,{plan.split_point}) + [{plan.head_start},{plan.num_layers}), "
                 f"server {plan.server} layers [{plan.split_point},{plan.head_start}), "
                 f"{plan.train.micro_batches} micro-batches of {plan.train.micro_batch_size}"
                 if plan.mode is CollabMode.COLLABORATIVE else "the whole model on every device")
        if plan.standbys:
            where += f", standby server{'s' if len(plan.standbys) > 1 else ''} " \
                     f"{', '.join(plan.standbys)}"
        predicted = "" if choice is None else \
            f"; predicted {choice.chosen.iteration_s * 1e3:.1f} ms per iteration (fedavg " \
            f"{choice.fedavg_iteration_s * 1e3:.1f} ms)"
        self.progress.message(f"plan {plan.version}: {plan.mode.value}, {where}; "
                              f"{plan.total_iterations} iterations, FedAvg every "
                              f"{plan.aggregate_every or plan.total_iterations}{predicted}")
        self._event(Event(EventType.PLAN_CHANGED, plan=plan.version,
                          steps=plan.total_iterations))

    def resumed(self, round_index: int, redo: bool, round_servers: list[list[str]],
                rounds_done: int, steps: int) -> None:
        """This coordinator picks the job up at ``round_index`` (``redo``: the old coordinator
        had started it; devices and servers go back to its start)."""
        figures = self.summary.collab
        figures.resumed_at_round, figures.redone_round = round_index, redo
        known = [list(s) for s in round_servers[:rounds_done]]
        # the retained status can lag one round behind the retained global model: unknown
        figures.round_servers = known + [[] for _ in range(rounds_done - len(known))]
        figures.rounds, self.summary.steps = rounds_done, steps
        self.progress.message(f"resuming at round {round_index + 1}"
                              + (" (redone from its start: the old coordinator died in it)"
                                 if redo else ""))

    def servers_now(self, serving: str | None, standbys: tuple[str, ...]) -> None:
        """Who serves and who stands by from now on (the summary's ``server`` and
        ``standbys``)."""
        self.summary.collab.server, self.summary.collab.standbys = serving, list(standbys)

    def round_started(self, server: str | None) -> None:
        """A round begins, served by ``server`` (None: fedavg)."""
        self._serving = [server] if server is not None else []

    def server_lost(self, server: str, cause: FailureCause, silent_s: float,
                    round_index: int | None, promoted: str | None, standbys: tuple[str, ...]
                    ) -> None:
        """A server of the plan is gone: the serving one (``promoted`` took over, or None: no
        standby was left) or a standby."""
        self.summary.failures_detected += 1
        self.summary.detect_s.append(round(silent_s, 3))
        self.metrics.failures.labels(cause=cause.value).inc()
        where = "" if round_index is None else f" in round {round_index + 1}"
        self._event(Event(EventType.FAILURE_DETECTED, cause=cause, devices=(server,),
                          silent_s=silent_s, at_step=round_index))
        if promoted is None:
            self.progress.message(f"server {server} is gone ({cause.value}){where}"
                                  + (f"; standbys left: {', '.join(standbys)}" if standbys
                                     else ""))
            return
        self.metrics.server_takeovers.inc()
        self.summary.collab.server_changes.append({
            "round": round_index, "from": server, "to": promoted, "cause": cause.value,
            "t": self.elapsed_s, "steps": self.summary.steps})
        if round_index is not None:
            self._serving.append(promoted)
        self.progress.message(f"server {server} is gone ({cause.value}){where}: standby "
                              f"{promoted} takes over")
        self._event(Event(EventType.FAILURE_COVERED, devices=(server, promoted),
                          cause=cause, at_step=round_index))

    @property
    def round_servers(self) -> list[list[str]]:
        """Per completed round, the servers that served it."""
        return self.summary.collab.round_servers

    def training_started(self, total_iterations: int) -> None:
        self._training_since = self._round_started = self._clock()
        self.progress.start(total_iterations)
        self._event(Event(EventType.TRAINING_STARTED, steps=total_iterations))

    def iteration(self, device: str, loss: float, count: int, done: int) -> None:
        """A device finished an iteration; ``done`` is the fleet's progress in iterations (every
        participant has finished that many): the history gets a row when it moves."""
        self._samples += count
        self._losses.append(loss)
        self.metrics.samples.inc(count)
        self.metrics.loss.set(loss)
        rate = self._samples / self.train_s if self.train_s > 0 else 0.0
        self.metrics.samples_per_second.set(rate)
        if done > self._fleet_done:
            self._fleet_done = done
            mean = sum(self._losses) / len(self._losses)
            self._losses = []
            self.summary.final_loss = mean
            self.summary.history.append({"step": done - 1, "t": self.elapsed_s, "loss": mean,
                                         "samples_per_s": rate})
            self.progress.step(done, mean, rate)

    def round_completed(self, index: int, end_iteration: int, included: tuple[str, ...],
                        members: dict[str, Member], aggregation_s: float) -> None:
        now = self._clock()
        span = now - self._round_started
        self.summary.steps = end_iteration
        self.summary.collab.rounds = index + 1
        self.summary.collab.aggregation_s += aggregation_s
        self.metrics.step.set(end_iteration)
        self.metrics.round.set(index + 1)
        self.metrics.aggregation_seconds.inc(aggregation_s)
        for name, member in members.items():
            self.metrics.members.update(name, rounds_done=member.rounds_done,
                                        rounds_missed=member.rounds_missed)
        missing = left_out_of(included, members)
        for name in missing:
            self.summary.collab.left_out.setdefault(name, []).append(index)
        self.summary.collab.round_servers.append(list(self._serving))
        self.summary.collab.round_log.append({
            "round": index, "end_iteration": end_iteration, "t": now - self._started,
            "round_s": span, "aggregation_s": aggregation_s, "devices": list(included),
            "left_out": list(missing), "servers": list(self._serving)})
        self._round_started = now
        self._event(Event(EventType.ROUND_COMPLETED, at_step=index, steps=end_iteration,
                          devices=included))

    def evaluated(self, index: int, iteration: int, epoch: int, accuracy: float, loss: float
                  ) -> None:
        self.summary.test_accuracy, self.summary.test_loss = accuracy, loss
        self.summary.epochs = epoch
        self.summary.evals.append({"round": index, "step": iteration, "epoch": epoch,
                                   "test_accuracy": accuracy, "test_loss": loss,
                                   "t": self.elapsed_s, "train_s": self.train_s})
        self.metrics.test_accuracy.set(accuracy)
        self.metrics.epoch.set(epoch)
        self.progress.message(f"round {index + 1} (iteration {iteration}): test accuracy "
                              f"{accuracy:.4f}, test loss {loss:.4f}")
        self._event(Event(EventType.EPOCH_EVALUATED, epoch=epoch, test_accuracy=accuracy))

    def dropped_out(self, device: str, cause: FailureCause, silent_s: float, round_index: int
                    ) -> None:
        self.summary.collab.dropouts += 1
        self.summary.failures_detected += 1
        self.summary.detect_s.append(round(silent_s, 3))
        self.metrics.dropouts.inc()
        self.metrics.failures.labels(cause=cause.value).inc()
        self.progress.message(f"{device} dropped out of round {round_index + 1} "
                              f"({cause.value}); the round goes on without it")
        self._event(Event(EventType.FAILURE_DETECTED, cause=cause, devices=(device,),
                          silent_s=silent_s, at_step=round_index))

    def server_idle(self, busy_s: float) -> float | None:
        figures = self.summary.collab
        figures.server_busy_s = busy_s
        if self.train_s <= 0:
            return None
        idle = max(0.0, 1.0 - (busy_s + figures.aggregation_s) / self.train_s)
        figures.server_idle_fraction = idle
        self.metrics.server_idle.set(idle)
        return idle

    def members(self, members: dict[str, Member]) -> None:
        train = self.train_s
        rows = {}
        for name, m in sorted(members.items()):
            idle = max(0.0, 1.0 - m.busy_s / train) if train > 0 else None
            rows[name] = {"samples": m.samples, "rounds_done": m.rounds_done,
                          "rounds_missed": m.rounds_missed, "iterations": m.iteration + 1,
                          "epsilon": m.epsilon, "busy_s": m.busy_s, "idle_fraction": idle}
            self.metrics.members.update(name, **({"epsilon": m.epsilon}
                                                 if m.epsilon is not None else {}),
                                        **({"idle_fraction": idle} if idle is not None else {}))
        self.summary.collab.members = rows

    def finish(self, dropped: dict[str, int], error: str | None = None,
               interrupted: bool = False) -> CollabSummary:
        """The job ended (``error``: why it stopped; ``interrupted``: its user stopped it, which
        the demo or the CLI says with the summary, once)."""
        self.summary.train_s = self.train_s
        self.summary.samples_per_s = self._samples / self.train_s if self.train_s > 0 else 0.0
        self.summary.wall_s = self.elapsed_s
        self.summary.dropped = dropped
        if error is not None:
            self.summary.error = error
            if not interrupted:
                self.progress.message(f"FAILED: {error}")
            self._event(Event(EventType.JOB_FAILED, reason=error))
        else:
            self._event(Event(EventType.JOB_DONE, steps=self.summary.steps,
                              test_accuracy=self.summary.test_accuracy))
        return self.summary
