"""Fault-tolerance benchmark (prints JSON, writes it): recovery time broken down into detect /
replan / restore weights / resume for MobileNetV2 on 4 devices, after a SIGKILL and after a
SIGSTOP; replication overhead as throughput with R = 1, 10, 50 and without replication, and the
bytes replicated per step.

    python benchmarks/recovery.py [--out benchmarks/results/recovery.json]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.harness import JobSpec, run_job, say, steady_rate  # noqa: E402
from ftpipe_iot.runtime.broker import BrokerProcess  # noqa: E402

MB, M = 8, 4
BATCH = MB * M
TRAINING = ["--model", "mobilenetv2", "--model-width", "0.25", "--data", "synthetic",
            "--data-shape", "3,32,32", "--data-samples", "4096", "--micro-batches", str(M),
            "--micro-batch-size", str(MB),
            "--lr", "0.01", "--epochs", "1", "--no-repartition"]
DEVICES = [(f"r{i}", None) for i in range(4)]


def _fault_run(broker: BrokerProcess, kind: str, at_step: int, steps: int) -> dict:
    injected: dict = {}

    def inject(watcher, procs) -> None:
        if not watcher.wait_step(at_step, 240):
            raise TimeoutError("the job never reached the fault step")
        victim = procs["r2"]
        injected["at"] = time.time()
        os.killpg(victim.pid, signal.SIGKILL if kind == "kill" else signal.SIGSTOP)

    summary = run_job(JobSpec(f"rec-{kind}", DEVICES,
                              [*TRAINING, "--max-steps", str(steps), "--heartbeat-timeout", "3"]),
                      broker, during=inject)
    events = summary["watch_events"]

    def first(kind_: str, after: float) -> float | None:
        times = [e["timestamp"] for e in events if e["type"] == kind_ and e["timestamp"] >= after]
        return min(times) if times else None

    detected = first("failure_detected", injected["at"])
    planned = first("plan_changed", detected or injected["at"])
    restored = first("recovery_done", planned or injected["at"])
    resume_step = next((e.get("step") for e in events if e["type"] == "recovery_done"), None)
    resumed = next((t for step, t in summary["watch_progress"]
                    if restored and t >= restored and resume_step is not None
                    and step > resume_step), None)

    def span(a: float | None, b: float | None) -> float | None:
        return None if a is None or b is None else round(b - a, 3)

    return {"fault": kind, "at_step": at_step, "resumed_from_step": resume_step,
            "detect_s": span(injected["at"], detected), "replan_s": span(detected, planned),
            "restore_weights_s": span(planned, restored),
            "resume_s": span(restored, resumed),
            "detection_to_training_s": span(detected, resumed),
            "recomputed_steps": summary["recomputed_steps"],
            "failures_detected": summary["failures_detected"],
            "steps": summary["steps"]}


def _replication_run(broker: BrokerProcess, every: int, steps: int) -> dict:
    summary = run_job(JobSpec(f"rep-{every}", DEVICES,
                              [*TRAINING, "--max-steps", str(steps), "--replicate-every",
                               str(every)]), broker)
    return {"replicate_every": every, "samples_per_s": steady_rate(summary, BATCH, steps - 4),
            "replicated_bytes_per_step": summary["replicated_bytes"] / max(summary["steps"], 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--out", type=Path,
                        default=Path(__file__).resolve().parent / "results" / "recovery.json")
    args = parser.parse_args()
    started = time.monotonic()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    results: dict = {"model": "mobilenetv2(width=0.25)", "devices": 4, "keepalive_s": 10,
                     "heartbeat_interval_s": 1.0, "heartbeat_timeout_s": 3.0}
    with BrokerProcess() as broker:
        say("recovery after SIGKILL")
        results["kill"] = _fault_run(broker, "kill", 12, args.steps)
        say("recovery after SIGSTOP (hung device)")
        results["hang"] = _fault_run(broker, "hang", 12, args.steps)
        runs = []
        for every in (0, 1, 10, 50):
            say(f"replication every {every or 'never'}")
            runs.append(_replication_run(broker, every, args.steps))
    base = next(r for r in runs if r["replicate_every"] == 0)["samples_per_s"]
    for run in runs:
        run["overhead"] = 1 - run["samples_per_s"] / base if base else None
    results["replication"] = runs
    results["wall_s"] = round(time.monotonic() - started, 1)
    args.out.write_text(json.dumps(results, indent=2))
    print(json.dumps(results))


if __name__ == "__main__":
    main()
