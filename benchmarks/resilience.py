"""Resiliency r benchmark (prints JSON, writes it and a PNG): CIFAR-style MobileNetV2 (width
0.25) on synthetic 32x32 images, 4 stages.

- straggler: one stage-1 device stalls 2 s every 10 steps (a profile's ``stalls``); steady
  samples/s with r = 0, with r = 1 (warm standbys) and with r = 1 over groups of two (peers
  re-issue), each next to the same layout without the straggler;
- failure: SIGKILL of a stage-1 device at step 25 with r = 0 (checkpoint rollback) and r = 1:
  seconds from the kill to the next completed step, next to the median step before the kill
  (the kill comes as a step starts, so a whole step is the least it can take) and what the
  kill added to the step under way; recomputed steps, rollbacks;
- controller fail-over: a standby controller (``controller --standby``) takes over from a
  leader that is SIGKILLed or hung (SIGSTOP) at step 15: seconds from the fault to the next
  completed step, against twice the controllers' keepalive (``--keepalive``, 2 s here);
- trade-off: bytes on the wire per step and samples/s for r = 0, 1, 2, next to the prediction of
  ``ftpipe-iot plan --resiliency`` (``planning.resilience.resilience_cost``).

Every device is a process on this machine, so standbys' decoding and updates take CPU from the
computing devices here, where on a real fleet they have their own.

    python benchmarks/resilience.py [--steps 60] [--out benchmarks/results/resilience.json]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.harness import (  # noqa: E402
    JobSpec,
    rate_between,
    run_job,
    save_figure,
    say,
    write_results,
)
from ftpipe_iot.runtime.broker import BrokerProcess  # noqa: E402

MB, M = 16, 4
BATCH = MB * M
WIDTH = 0.25
# MobileNetV2's 22 layers in 4 stages of similar cost (benchmarks/data, width 0.25)
SPANS = [(0, 3), (3, 4), (4, 8), (8, 22)]
TRAINING = ["--model", "mobilenetv2", "--model-width", str(WIDTH), "--data", "synthetic",
            "--data-shape", "3,32,32", "--data-samples", "8192", "--micro-batches", str(M),
            "--micro-batch-size", str(MB), "--lr", "0.01", "--no-repartition",
            "--replicate-every", "10", "--heartbeat-timeout", "5"]


def _assignment(layout: str) -> str:
    """``pipeline``: one device per stage; ``standbys``: plus one standby each; ``groups``: two
    computing peers per stage; ``standbys2``: two standbys each."""
    parts = []
    for k, (lo, hi) in enumerate(SPANS):
        if layout == "pipeline":
            devices = f"s{k}a"
        elif layout == "standbys":
            devices = f"s{k}a/s{k}b"
        elif layout == "standbys2":
            devices = f"s{k}a/s{k}b+s{k}c"
        else:
            devices = f"s{k}a+s{k}b"
        parts.append(f"{devices}:{lo}-{hi}")
    return ",".join(parts)


def _devices(assignment: str, straggler: Path | None) -> list[tuple[str, Path | None]]:
    names = [d for part in assignment.split(",") for d in
             part.split(":")[0].replace("/", "+").split("+")]
    return [(name, straggler if name == "s1a" else None) for name in names]


def _stall_profile(work: Path) -> Path:
    path = work / "straggler.json"
    path.write_text(json.dumps({"name": "straggler", "description": "stalls 2 s every 10 steps",
                                "stalls": {"every_steps": 10, "seconds": 2.0, "from_step": 5}}))
    return path


def _run(broker: BrokerProcess, name: str, layout: str, resiliency: int, steps: int,
         straggler: Path | None = None, during=None) -> dict:
    assignment = _assignment(layout)
    summary = run_job(JobSpec(name, _devices(assignment, straggler),
                              [*TRAINING, "--max-steps", str(steps), "--assignment", assignment,
                               "--resiliency", str(resiliency)], timeout_s=900),
                      broker, during=during)
    lo, hi = min(5, steps - 2), steps - 1  # the history counts steps from 0
    return {"run": name, "layout": layout, "resiliency": resiliency,
            "devices": len(_devices(assignment, None)), "steps": summary["steps"],
            "samples_per_s": round(rate_between(summary, BATCH, lo, hi), 1),
            "wire_bytes_per_step": round(summary["wire_bytes_per_step"]),
            "takeovers": summary["takeovers"], "late_results": summary["late_results"],
            "rollbacks": summary["rollbacks"], "covered_failures": summary["covered_failures"],
            "recomputed_steps": summary["recomputed_steps"],
            "plans": sum(1 for e in summary["events"] if e["type"] == "plan_changed"),
            "_summary": summary}


def _around(progress: list, at: float) -> dict:
    """Step completions (``(step, t)`` as the watcher saw them) around a fault at ``at``: the
    median step before it, the step that was under way (from the completion before the fault
    to the first after it) and what the fault added to it."""
    times = sorted(t for _, t in progress)
    before = [t for t in times if t <= at]
    after = [t for t in times if t > at]
    intervals = [b - a for a, b in zip(before[-11:], before[-10:])]
    step_s = statistics.median(intervals) if intervals else None
    out = {"step_s_before": round(step_s, 3) if step_s else None,
           "kill_to_next_step_s": round(after[0] - at, 3) if after else None}
    if before and after and step_s:
        disrupted = after[0] - before[-1]
        out.update(disrupted_step_s=round(disrupted, 3),
                   added_by_the_fault_s=round(disrupted - step_s, 3))
    return out


def _kill_run(broker: BrokerProcess, layout: str, resiliency: int, steps: int) -> dict:
    killed: dict[str, float] = {}
    at = min(25, steps - 10)  # between two replications (every 10): r = 0 recomputes steps

    def inject(watcher, procs) -> None:
        if not watcher.wait_step(at, 600):
            raise TimeoutError(f"the job never reached step {at}")
        killed["at"] = time.time()
        os.killpg(procs["s1a"].pid, signal.SIGKILL)

    result = _run(broker, f"kill-r{resiliency}", layout, resiliency, steps, during=inject)
    result["killed_at_step"] = at
    result.update(_around(result["_summary"]["watch_progress"], killed["at"]))
    return result


def _failover_run(broker: BrokerProcess, how: str, steps: int, keepalive_s: int) -> dict:
    """A standby controller takes the job over from a leader that is killed (SIGKILL: the
    broker sees the connection close and fires its Last Will at once) or hangs (SIGSTOP: the
    Will fires 1.5 keepalives later): seconds from the fault to the first step the new leader
    completes, against twice the keepalive."""
    at = min(15, steps - 10)
    fault: dict[str, float] = {}

    def inject(watcher, procs) -> None:
        if not watcher.wait_step(at, 600):
            raise TimeoutError(f"the job never reached step {at}")
        fault["at"] = time.time()
        os.killpg(procs["controller"].pid, signal.SIGKILL if how == "kill" else signal.SIGSTOP)
        if how == "hang":
            # Once the standby leads, the old leader wakes up: fenced by the newer term, it
            # exits, and the job ends with its new leader (a stopped process never would).
            if not watcher.wait_step(at + 2, 600):
                raise TimeoutError(f"no controller completed step {at + 2} after the hang")
            os.killpg(procs["controller"].pid, signal.SIGCONT)

    assignment = _assignment("pipeline")
    summary = run_job(JobSpec(f"failover-{how}", _devices(assignment, None),
                              [*TRAINING, "--max-steps", str(steps), "--assignment", assignment,
                               "--keepalive", str(keepalive_s)],
                              timeout_s=900, standby_controller=True), broker, during=inject)
    after = [t for _, t in summary["watch_progress"] if t > fault["at"]]
    failover = round(after[0] - fault["at"], 3) if after else None
    took_over = _took_over_at(Path(summary["work_dir"]) / "standby.log")
    takeover = round(took_over - fault["at"], 3) if took_over is not None else None
    resumed = [e["resume_step"] for e in summary["events"]
               if e["type"] == "plan_changed" and e.get("resume_step") is not None]
    return {"run": f"failover-{how}", "fault": "SIGKILL" if how == "kill" else "SIGSTOP",
            "keepalive_s": keepalive_s, "fault_at_step": at, "steps": summary["steps"],
            "fault_to_takeover_s": takeover,
            "takeover_within_2x_keepalive": takeover is not None
            and takeover < 2 * keepalive_s,
            "resumed_from_step": resumed[-1] if resumed else None,
            "fault_to_next_step_s": failover,
            "within_2x_keepalive": failover is not None and failover < 2 * keepalive_s,
            "recomputed_steps": summary["recomputed_steps"]}


def _took_over_at(log: Path) -> float | None:
    """When the standby said it takes over (its log line's local time, as epoch seconds)."""
    if not log.exists():
        return None
    for line in log.read_text().splitlines():
        if "taking over with term" in line:
            stamp = datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f")
            return stamp.timestamp()
    return None


def _costs():
    from ftpipe_iot.core.models import profile_layer_costs
    from ftpipe_iot.planning.costs import LayerCosts

    return LayerCosts.from_dict({**profile_layer_costs("mobilenetv2", MB, WIDTH),
                                 "micro_batch_size": MB})


def _predicted(resiliency: int, layout: str, costs) -> dict:
    from ftpipe_iot.cli.options import parse_assignment
    from ftpipe_iot.planning.resilience import resilience_cost

    cost = resilience_cost(parse_assignment(_assignment(layout)), costs, 4.0 * MB * 3 * 32 * 32,
                           M, resiliency)
    return {"wire_bytes_per_step": round(cost.wire_bytes_per_step),
            "compute_s_per_step": round(cost.compute_s_per_step, 4)}


def _plot(results: dict):
    def draw(png: Path) -> None:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        trade = results["trade_off"]
        levels = [t["resiliency"] for t in trade]
        fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
        left.bar([x - 0.2 for x in levels], [t["samples_per_s"] for t in trade], 0.4,
                 label="measured samples/s")
        left.set_xlabel("resiliency r (warm standbys per stage)")
        left.set_ylabel("samples/s")
        twin = left.twinx()
        twin.plot(levels, [t["wire_bytes_per_step"] / 2**20 for t in trade], "o-",
                  color="tab:red", label="measured MiB/step")
        twin.plot(levels, [t["predicted"]["wire_bytes_per_step"] / 2**20 for t in trade],
                  "x--", color="tab:orange", label="predicted MiB/step")
        twin.set_ylabel("MiB on the wire per step")
        left.set_xticks(levels)
        left.set_title("resiliency vs traffic")
        fig.legend(loc="upper left", fontsize=8)
        runs = results["straggler"]
        labels = [f"{r['layout']}\nr={r['resiliency']}" for r in runs["with"]]
        xs = range(len(labels))
        right.bar([x - 0.2 for x in xs], [r["samples_per_s"] for r in runs["without"]], 0.4,
                  label="no straggler")
        right.bar([x + 0.2 for x in xs], [r["samples_per_s"] for r in runs["with"]], 0.4,
                  label="2 s stall every 10 steps")
        right.set_xticks(list(xs), labels)
        right.set_ylabel("samples/s")
        right.set_title("a straggler")
        right.legend(fontsize=8)
        save_figure(fig, png)

    return draw


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--keepalive", type=int, default=2,
                        help="the controllers' MQTT keepalive in the fail-over runs (seconds)")
    parser.add_argument("--out", type=Path,
                        default=Path(__file__).parent / "results" / "resilience.json")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench-resilience-"))
    straggler = _stall_profile(work)
    with BrokerProcess() as broker:
        without, with_stall = [], []
        for layout, r in (("pipeline", 0), ("standbys", 1), ("groups", 1)):
            say(f"straggler: {layout} r={r}")
            without.append(_run(broker, f"calm-{layout}-r{r}", layout, r, args.steps))
            with_stall.append(_run(broker, f"stall-{layout}-r{r}", layout, r, args.steps,
                                   straggler))
        say("failure: SIGKILL of s1a mid-run, r=0 and r=1")
        kills = [_kill_run(broker, "pipeline", 0, args.steps),
                 _kill_run(broker, "standbys", 1, args.steps)]
        say("controller fail-over: the leader killed, then hung, a standby takes over")
        failovers = [_failover_run(broker, how, args.steps, args.keepalive)
                     for how in ("kill", "hang")]
        say("trade-off: r=2")
        two = _run(broker, "calm-standbys2-r2", "standbys2", 2, args.steps)
        trade = [without[0], without[1], two]
        costs = _costs()  # measured once: the three predictions share one profile
        for entry, layout in zip(trade, ("pipeline", "standbys", "standbys2")):
            entry["predicted"] = _predicted(entry["resiliency"], layout, costs)
    for entry in [*without, *with_stall, *kills, two]:
        entry.pop("_summary", None)
    results = {
        "model": f"mobilenetv2(width={WIDTH})", "micro_batch_size": MB, "micro_batches": M,
        "stages": SPANS, "steps": args.steps,
        "straggler": {"without": without, "with": with_stall,
                      "r1_vs_calm": [round(w["samples_per_s"] / c["samples_per_s"], 3)
                                     if c["samples_per_s"] else None
                                     for w, c in zip(with_stall, without)]},
        "failure": kills, "controller_failover": failovers, "trade_off": trade,
        "loadavg": os.getloadavg()}
    write_results(results, args.out, _plot(results))


if __name__ == "__main__":
    main()
