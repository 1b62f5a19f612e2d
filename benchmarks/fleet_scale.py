"""Fleet scale benchmark (prints JSON, writes it and a PNG): stage groups on 16 and 32 emulated
devices over one Mosquitto.

1. Fleet F16 = 8x rpi-zero, 6x rpi4, 2x jetson-nano (devices/profiles/*.json: slow-down factors,
   link caps and memory budgets the device agents emulate), CIFAR-style MobileNetV2 at width
   0.25 on synthetic 32x32 data, M=16 micro-batches of 8. The fleet planner plans three layouts
   from the profiles and one cost profile measured here: the best single pipeline (one device
   per stage), the best pure data-parallel group (the fastest devices holding the whole model;
   all 16 as replicas is predicted too) and the hybrid plan. Each runs as a pinned plan
   (``--assignment`` with the planner's shares; the pipeline without repartitioning, the groups
   with share retuning) and its steady-state samples/s is measured.
   Only the devices a plan uses are started: the others would idle.
   Link model: the device agents sleep for their link cap on every payload they send and take
   in, the group's gradient exchange included, which is the planner's link model.
   Calibration: the profile is measured in one process, the emulated devices compute later
   with up to 16 processes sharing the 2 cores, so its compute figures are off by a factor
   while the emulated link delays are exact. The planner's pipeline therefore runs first, the
   factor that makes its predicted step equal the measured one scales the profile's compute
   figures, and the three layouts are planned again with the scaled profile (the pipeline
   runs again only if it changed).
2. Interruption (Stannis): in the hybrid run the fastest member of the largest group slows 4x
   from a set step (a profile step schedule; deterministic where a time schedule would depend
   on each process's start-up). Reported: the steps until its group's shares were retuned, the
   steps until the measured rate (2-step mean) stays within 10% of the planner's prediction for
   the new speeds (scaled by the measured/predicted ratio before the slow-down), and the shares
   and rate per step (the PNG).
3. Predictions (issue: a planner whose error is measured): each layout's samples/s as the
   closed form predicts it (with the compute factor fitted above), as the step model plays a
   step out on the raw profile with every device sharing this host's cores (an emulated
   factor is CPU work then a sleep: a device's CPU share is one over its factor), and as the
   step model does once its per-message cost is fitted to the first pipeline run
   (``planning.calibration``), each next to its measurement; and what the calibrated model
   would choose between the single pipeline and the fleet planner's plan, and why.
   ``--factor-scale 2.5`` multiplies every class's slow-down so that F16 asks for about 1.4
   of this 2-core host's cores (as shipped it asks for 3.6: the devices are then not the
   independent processors the closed form assumes).
4. Scale: the planner's decision time (solve_groups) for F16 and F32 (F16 twice), the
   controller's measured decision time per step boundary, and the broker's messages/s from
   Mosquitto's $SYS counters (``sys_interval 1``) during each run, including a short run of all
   32 devices under ``--layout auto`` (the controller plans with unmeasured speeds, then
   rebalances its pipeline on measured ones).

    python benchmarks/fleet_scale.py [--out benchmarks/results/fleet_scale.json] [--no-32]
                                     [--factor-scale 2.5]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.harness import (  # noqa: E402
    PROFILES,
    JobSpec,
    run_job,
    save_figure,
    say,
    write_results,
)
from ftpipe_iot.control.job import prepare_job  # noqa: E402
from ftpipe_iot.planning.calibration import StepModel  # noqa: E402
from ftpipe_iot.planning.costs import DeviceSpec, LayerCosts  # noqa: E402
from ftpipe_iot.planning.group_search import (  # noqa: E402
    best_single_pipeline,
    data_parallel_plan,
    solve_groups,
)
from ftpipe_iot.planning.groups import GroupPlan, evaluate_groups  # noqa: E402
from ftpipe_iot.planning.layouts import Layout, choose_layout  # noqa: E402
from ftpipe_iot.planning.profiles import load_profile  # noqa: E402
from ftpipe_iot.planning.solver import solve_partition  # noqa: E402
from ftpipe_iot.planning.step_simulation import HostShare  # noqa: E402
from ftpipe_iot.protocol.plan import TrainConfig  # noqa: E402
from ftpipe_iot.protocol.specs import DataSpec, ModelSpec  # noqa: E402
from ftpipe_iot.runtime.broker import BrokerProcess, render_config  # noqa: E402

MB, M = 8, 16
BATCH = MB * M
WIDTH = 0.25
MODEL = ["--model", "mobilenetv2", "--model-width", str(WIDTH), "--data", "synthetic",
         "--data-shape", "3,32,32", "--data-samples", "8192"]
TRAINING = [*MODEL, "--micro-batches", str(M),
            "--micro-batch-size", str(MB), "--max-in-flight", str(M), "--epochs", "20",
            "--replicate-every", "0", "--heartbeat-timeout", "20", "--stall-timeout", "120",
            "--wait-devices", "900"]
CLASSES = (("rpi-zero", "zero", 8), ("rpi4", "pi", 6), ("jetson-nano", "jet", 2))
HOST = "this-host"  # every emulated device runs here: the step model shares its cores
SLOWDOWN = 4.0


def fleet(copies: int, profiles: dict[str, Path] | None = None) -> list[tuple[str, Path]]:
    """Device names and profile files: F16 once per copy (``profiles``: the class -> file
    to use, default the shipped ones)."""
    devices = []
    for profile, prefix, count in CLASSES:
        for i in range(count * copies):
            path = (profiles or {}).get(profile, PROFILES / f"{profile}.json")
            devices.append((f"{prefix}{i}", path))
    return devices


def specs(devices: list[tuple[str, Path]], slowed: dict[str, float] | None = None,
          host: str | None = None) -> list[DeviceSpec]:
    """The declared devices as the planner sees them; ``host``: they all run on this machine
    (the step model shares its cores among them: an emulated factor is CPU work, then a
    sleep, so a device's CPU share is one over its factor)."""
    out = []
    for name, path in devices:
        spec = load_profile(path).device_spec(name=name)
        factor = spec.factor * (slowed or {}).get(name, 1.0)
        out.append(DeviceSpec(name, factor, spec.bandwidth_bytes_per_s, spec.memory_bytes,
                              host=host, cpu_share=min(1.0, 1.0 / factor)))
    return out


def scaled_profiles(folder: Path, scale: float) -> dict[str, Path]:
    """F16's device classes with every slow-down factor times ``scale`` (links and memory as
    shipped), written to ``folder``; the shipped profiles when ``scale`` is 1."""
    if scale == 1.0:
        return {profile: PROFILES / f"{profile}.json" for profile, _, _ in CLASSES}
    out = {}
    for profile, _, _ in CLASSES:
        data = load_profile(PROFILES / f"{profile}.json").to_dict()
        data["factor"] = data["factor"] * scale
        data["name"] = f"{profile}-x{scale:g}"
        path = folder / f"{profile}-x{scale:g}.json"
        path.write_text(json.dumps(data))
        out[profile] = path
    return out


def assignment_text(plan: GroupPlan) -> str:
    """The plan as ``--assignment``: groups with the planner's micro-batch counts as weights."""
    def members(stage) -> str:
        if len(stage.members) == 1:
            return stage.members[0].device
        return "+".join(f"{m.device}*{m.micro_batches}" for m in stage.members)

    return ",".join(f"{members(s)}:{s.start}-{s.end}" for s in plan.stages)


class SysMonitor:
    """Mosquitto's $SYS message counters as they arrive (value and arrival time)."""

    TOPICS = ("$SYS/broker/messages/received", "$SYS/broker/messages/sent",
              "$SYS/broker/publish/messages/received", "$SYS/broker/publish/messages/sent")

    def __init__(self, port: int) -> None:
        import paho.mqtt.client as mqtt

        self.history: dict[str, list[tuple[float, float]]] = {t: [] for t in self.TOPICS}
        self.lock = threading.Lock()
        self.client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id="bench-sys")
        self.client.on_message = self._on_message
        self.client.connect("127.0.0.1", port)
        for topic in self.TOPICS:
            self.client.subscribe(topic)
        self.client.loop_start()

    def _on_message(self, _client, _userdata, message) -> None:
        try:
            value = float(message.payload.decode())
        except ValueError:
            return
        with self.lock:
            self.history[message.topic].append((time.monotonic(), value))

    def rates(self, start: float, end: float) -> dict:
        """Messages/s per counter between the last update before ``start`` and the first after
        ``end`` (Mosquitto publishes a counter every sys_interval while it changes, so a
        window of a few steps may hold no update at all)."""
        out: dict = {}
        with self.lock:
            for topic, samples in self.history.items():
                before = [(t, v) for t, v in samples if t <= start]
                after = [(t, v) for t, v in samples if t >= end]
                key = topic.removeprefix("$SYS/broker/").replace("/", "_") + "_per_s"
                if not before or not after or after[0][0] <= before[-1][0]:
                    out[key] = None
                    continue
                (t0, v0), (t1, v1) = before[-1], after[0]
                out[key] = round((v1 - v0) / (t1 - t0), 1)
                out["window_s"] = round(t1 - t0, 2)
        return out

    def close(self) -> None:
        self.client.loop_stop()
        self.client.disconnect()


def training_window(first: int, last: int, box: dict):
    """A ``during`` callback: the monotonic times training passed steps first and last."""
    def during(watcher, _procs) -> None:
        if watcher.wait_step(first, 1200):
            box["start"] = time.monotonic()
            if watcher.wait_step(last, 1200):
                box["end"] = time.monotonic()
    return during


def scaled(costs: LayerCosts, k: float) -> LayerCosts:
    """``costs`` with every compute figure times ``k`` (bytes unchanged)."""
    return LayerCosts(tuple(c * k for c in costs.layer_cost_s), costs.activation_bytes,
                      costs.layer_memory_bytes, costs.micro_batch_size,
                      costs.stage_overhead_s * k, costs.head_overhead_s * k, costs.param_bytes)


def calibrate(plan: GroupPlan, costs: LayerCosts, fleet_specs: list[DeviceSpec],
              measured_step_s: float) -> float:
    """The factor on the profile's compute figures that makes the planner's step time of
    ``plan`` equal the measured one (bisection: the step time grows with it). The profile is
    measured in one process while other work shares the 2 cores, the emulated devices compute
    later under another load; link delays are emulated exactly and need no factor."""
    def step(k: float) -> float:
        return evaluate_groups(plan, scaled(costs, k), fleet_specs, M, MB).step_s

    lo, hi = 1e-3, 1e3
    for _ in range(60):
        mid = (lo * hi) ** 0.5
        lo, hi = (mid, hi) if step(mid) < measured_step_s else (lo, mid)
    return (lo * hi) ** 0.5


def step_rates(summary: dict) -> dict[int, float]:
    """Samples/s of each step (from the previous step's completion to its own)."""
    times = {h["step"]: h["t"] for h in summary["history"]}
    return {s: BATCH / (times[s] - times[s - 1]) for s in sorted(times)
            if s - 1 in times and times[s] > times[s - 1]}


def steady(summary: dict, lo: int, hi: int) -> float:
    """Samples/s over steps lo..hi."""
    times = {h["step"]: h["t"] for h in summary["history"]}
    return (hi - lo) * BATCH / (times[hi] - times[lo])


def shares_by_step(summary: dict, device_set: set[str], steps: int) -> dict[str, list[float]]:
    """Each device's share at every step, from the plan and shares events."""
    changes = []
    for event in summary["events"]:
        if event["type"] == "plan_changed":
            changes.append((event.get("resume_step", 0), event["stages"]))
        elif event["type"] == "shares_changed":
            changes.append((event["at_step"], event["stages"]))
    changes.sort(key=lambda c: c[0])
    out: dict[str, list[float]] = {d: [] for d in device_set}
    for step in range(steps):
        stages = [s for at, s in changes if at <= step][-1]
        current = {m["device"]: m["share"] for s in stages for m in s["devices"]}
        for device in device_set:
            out[device].append(current.get(device, 0.0))
    return out


def run_plan(broker: BrokerProcess, monitor: SysMonitor, label: str, plan: GroupPlan,
             devices: dict[str, Path], steps: int, window: tuple[int, int],
             extra: list[str] = ()) -> tuple[dict, float, dict]:
    """Run a pinned plan on the devices it uses; its summary, samples/s over the ``window``
    steps and the broker's messages/s meanwhile."""
    used = [(name, devices[name]) for name in plan.devices]
    say(f"{label}: {len(used)} devices, {assignment_text(plan)}")
    spec = JobSpec(f"fleet-{label}", used, [*TRAINING, "--max-steps", str(steps),
                                            "--assignment", assignment_text(plan), *extra],
                   timeout_s=1200)
    box: dict = {}
    summary = run_job(spec, broker, training_window(*window, box))
    rate = steady(summary, *window)
    say(f"{label}: {rate:.1f} samples/s")
    return summary, rate, monitor.rates(box.get("start", 0.0), box.get("end", 0.0))


def interruption(summary: dict, slowed: str, at: int, before_rate: float, predicted: dict,
                 steps: int) -> dict:
    rate = step_rates(summary)
    retunes = [e["at_step"] for e in summary["events"] if e["type"] == "shares_changed"
               and e["at_step"] >= at]
    # The planner's rate for the new speeds, scaled by how far the measurement was off before.
    target = before_rate * predicted["after"] / predicted["before"]
    # back: the first step from which 3 steps in a row run no more than 10% below the
    # prediction (faster counts as back)
    after_slowdown = {s: r for s, r in rate.items() if s >= at}
    back = next((s for s in sorted(after_slowdown)
                 if all(after_slowdown.get(k, 0.0) >= 0.9 * target for k in range(s, s + 3))),
                None)
    after = [rate[s] for s in rate if s >= max(retunes[:1] or [at]) + 1]
    return {"slowed_device": slowed, "slowdown": SLOWDOWN, "from_step": at,
            "rate_before_samples_per_s": round(before_rate, 2),
            "predicted_samples_per_s": {k: round(v, 2) for k, v in predicted.items()},
            "target_samples_per_s": round(target, 2),
            "shares_retuned_at_steps": retunes,
            "steps_until_shares_retuned": (retunes[0] - at) if retunes else None,
            "steps_until_within_10pct": (back - at) if back is not None else None,
            "rate_after_retune_median_samples_per_s":
                round(statistics.median(after), 2) if after else None,
            "repartitions": summary["repartitions"],
            "weights_moved": summary["repartitions"] > 0,
            "per_step_samples_per_s": {s: round(r, 2) for s, r in rate.items()}}


def device_budget(summary: dict, devices: dict[str, Path]) -> dict:
    """Per device and step: measured compute seconds, bytes in and out, and the seconds its
    emulated link sleeps for them (what the step time is made of, next to the prediction)."""
    steps = max(summary["steps"], 1)
    out = {}
    for name, layers in sorted(summary["device_layer_seconds"].items()):
        traffic = summary["device_traffic"].get(name, {})
        cap = load_profile(devices[name]).bandwidth_bytes_per_s
        moved = (traffic.get("sent_bytes", 0) + traffic.get("received_bytes", 0)) / steps
        out[name] = {"compute_s": round(sum(statistics.median(v) for v in layers.values()), 3),
                     "bytes_in": round(traffic.get("received_bytes", 0) / steps),
                     "bytes_out": round(traffic.get("sent_bytes", 0) / steps),
                     "link_s": round(moved / cap, 3) if cap else 0.0}
    return out


def layout_predictions(plans: dict[str, GroupPlan], costs: LayerCosts,
                       shared: list[DeviceSpec], cores: float, first: GroupPlan,
                       first_rate: float, measured: dict[str, float]) -> dict:
    """Each layout's samples/s as the closed form predicted it (with the compute factor fitted
    on the first pipeline run), as the step model plays it out on the raw profile with the
    devices sharing this host's ``cores``, and as the step model does once its message cost
    is fitted to the first pipeline run (``planning.calibration``): next to the measured rate,
    with each prediction's error. Also what the calibrated model would choose between the
    single pipeline and the fleet planner's plan (``choose_layout``), and why."""
    hosts = {HOST: HostShare(cores)}
    model = StepModel(max_in_flight=M, hosts=hosts)
    fitted = model.fitted(0, evaluate_groups(first, costs, shared, M, MB), costs, shared,
                          BATCH / first_rate)

    def rate(step_model: StepModel, plan: GroupPlan) -> float:
        replay = evaluate_groups(plan.assignment, costs, shared, M, MB,
                                 counts=plan.micro_batch_counts)
        return BATCH / step_model.step_s(replay, costs, shared)

    table = {}
    for name, plan in plans.items():
        row = {"closed_form": plan.throughput_samples_per_s, "step_model": rate(model, plan),
               "calibrated": rate(fitted, plan), "measured": measured.get(name)}
        if row["measured"]:
            for kind in ("closed_form", "step_model", "calibrated"):
                row[f"{kind}_error"] = round(row["measured"] / row[kind] - 1.0, 3)
        table[name] = {k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()}
    choice = choose_layout(costs, shared, M, Layout.AUTO, step_model=fitted)
    chosen = "pipeline" if choice.kind == "pipeline" else "planner"
    gain = (choice.pipeline_step_s / choice.planner_step_s) if choice.planner_step_s else None
    why = (f"the calibrated model predicts the fleet planner's {choice.kind} plan at "
           f"{choice.planner_step_s:.3f} s a step against {choice.pipeline_step_s:.3f} s for "
           f"the single pipeline ({gain:.2f}x)" if gain else "no plan of the fleet planner")
    if chosen == "pipeline" and choice.warning:
        why = choice.warning  # why the planner's plan was set aside (layouts.GROUP_MIN_GAIN)
    return {"per_layout": table, "message_cost_s": fitted.calibration.message_cost_s,
            "host_cores": cores,
            "calibrated_choice": {"kind": choice.kind, "takes": chosen, "why": why,
                                  "stages": [[lo, hi, list(members), list(counts)]
                                             for lo, hi, members, counts in choice.stages]}}


def planner_times(costs: LayerCosts) -> dict:
    out = {}
    for copies in (1, 2):
        fleet_specs = specs(fleet(copies))  # the decision's cost: the shipped profiles
        times, cpu = [], []
        for _ in range(3):
            t, c = time.perf_counter(), time.process_time()
            plan = solve_groups(costs, fleet_specs, M, MB)
            times.append(time.perf_counter() - t)
            cpu.append(time.process_time() - c)
        # the controller's per-boundary check of a pipeline plan: the partition solver over
        # every alive device (what took 3.3 s per step at 32 devices before pruning)
        pipeline_cpu = []
        for _ in range(3):
            c = time.process_time()
            solve_partition(costs, fleet_specs)
            pipeline_cpu.append(time.process_time() - c)
        out[f"F{16 * copies}"] = {"devices": len(fleet_specs), "layers": costs.n_layers,
                                  "median_wall_s": round(statistics.median(times), 3),
                                  "median_cpu_s": round(statistics.median(cpu), 3),
                                  "stages": len(plan.stages), "devices_used": len(plan.devices),
                                  "pipeline_solver_median_cpu_s":
                                      round(statistics.median(pipeline_cpu), 3)}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path,
                        default=Path(__file__).parent / "results" / "fleet_scale.json")
    parser.add_argument("--steps", type=int, default=24, help="steps of each F16 run")
    parser.add_argument("--slow-at", type=int, default=14,
                        help="step of the hybrid run's 4x slow-down")
    parser.add_argument("--no-32", action="store_true", help="skip the 32-device run")
    parser.add_argument("--factor-scale", type=float, default=1.0,
                        help="multiply every device class's slow-down factor (2.5: the F16 "
                             "fleet asks for about 1.4 of this host's cores instead of 3.6)")
    args = parser.parse_args()
    started = time.monotonic()
    results: dict = {"fleet": {c[0]: c[2] for c in CLASSES},
                     "model": f"mobilenetv2(width={WIDTH}), synthetic 3x32x32",
                     "micro_batches": M, "micro_batch_size": MB,
                     "loadavg_start": os.getloadavg()}
    say("profiling the model (the cost model every plan below uses)")
    profiled = prepare_job(TrainConfig(
        model=ModelSpec("mobilenetv2", width=WIDTH),
        data=DataSpec("synthetic", shape=(3, 32, 32), samples=8192),
        micro_batches=M, micro_batch_size=MB)).cost_model
    profiles_dir = Path(tempfile.mkdtemp(prefix="fleet-profiles-"))
    profiles = scaled_profiles(profiles_dir, args.factor_scale)
    results["factor_scale"] = args.factor_scale
    devices16 = dict(fleet(1, profiles))
    declared = specs(list(devices16.items()))
    shared = specs(list(devices16.items()), host=HOST)
    results["cores_asked"] = round(sum(1.0 / d.factor for d in declared), 2)
    results["planner_decision"] = planner_times(profiled)
    raw, f16 = profiled, declared
    window = (4, args.slow_at - 1)  # past the fill and the first retuning, before the slow-down

    tmp = Path(tempfile.mkdtemp(prefix="fleet-scale-"))
    broker = BrokerProcess(data_dir=tmp / "broker")
    assert broker.data_dir is not None
    # $SYS counters every second: the broker's messages/s during the runs
    broker.config_text = render_config(broker.port, broker.data_dir) + "\nsys_interval 1\n"
    broker.start()
    monitor = SysMonitor(broker.port)
    measured, broker_rates, decisions = {}, {}, {}
    try:
        # 1. the planner's single pipeline on the profile as measured: its real step time
        # calibrates the profile's compute figures for the plans compared below
        first = best_single_pipeline(raw, f16, M, MB)
        summary, rate, broker_rates["F16-pipeline"] = run_plan(
            broker, monitor, "pipeline", first, devices16, args.steps, window,
            ["--no-repartition"])
        decisions["F16-pipeline"] = summary.get("decision_s")
        k = calibrate(first, raw, f16, BATCH / rate)
        costs = scaled(raw, k)
        plans = {"pipeline": best_single_pipeline(costs, f16, M, MB),
                 "data_parallel": data_parallel_plan(costs, f16, M, MB),
                 "hybrid": solve_groups(costs, f16, M, MB)}
        every = data_parallel_plan(costs, f16, M, MB, members=list(devices16))
        results["calibration"] = {
            "profile_compute_factor": round(k, 4), "pipeline_run": assignment_text(first),
            "pipeline_measured_samples_per_s": round(rate, 2),
            "predicted_samples_per_s_uncalibrated": round(first.throughput_samples_per_s, 2)}
        results["plans"] = {name: assignment_text(p) for name, p in plans.items()}
        results["predicted_samples_per_s"] = {
            **{name: round(p.throughput_samples_per_s, 2) for name, p in plans.items()},
            "data_parallel_all_16": round(every.throughput_samples_per_s, 2)}
        if assignment_text(plans["pipeline"]) == assignment_text(first):
            measured["pipeline"] = rate
        else:
            summary, measured["pipeline"], broker_rates["F16-pipeline"] = run_plan(
                broker, monitor, "pipeline-calibrated", plans["pipeline"], devices16,
                args.steps, window, ["--no-repartition"])
            decisions["F16-pipeline"] = summary.get("decision_s")
        summary, measured["data_parallel"], broker_rates["F16-data_parallel"] = run_plan(
            broker, monitor, "data_parallel", plans["data_parallel"], devices16, args.steps,
            window)
        decisions["F16-data_parallel"] = summary.get("decision_s")

        # 2. the hybrid plan, one member of its largest group slowed 4x from --slow-at
        hybrid = plans["hybrid"]
        group = max(hybrid.stages, key=lambda st: (len(st.members), -st.start))
        slowed = min(group.members, key=lambda m: m.compute_s).device  # its fastest member
        predicted = {"before": hybrid.throughput_samples_per_s,
                     "after": evaluate_groups(hybrid, costs, specs(
                         list(devices16.items()), {slowed: SLOWDOWN}),
                                              M, MB).throughput_samples_per_s}
        profile = load_profile(devices16[slowed]).to_dict()
        profile["step_schedule"] = [{"from_step": args.slow_at, "factor": SLOWDOWN}]
        slowed_path = tmp / f"{slowed}-slowdown.json"
        slowed_path.write_text(json.dumps(profile))
        steps = args.slow_at + 12
        summary, measured["hybrid"], broker_rates["F16-hybrid"] = run_plan(
            broker, monitor, "hybrid", hybrid, {**devices16, slowed: slowed_path}, steps,
            window)
        decisions["F16-hybrid"] = summary.get("decision_s")
        results["interruption"] = interruption(summary, slowed, args.slow_at,
                                               measured["hybrid"], predicted, steps)
        results["interruption"]["shares"] = shares_by_step(summary, set(group.devices), steps)
        results["hybrid_per_device_per_step"] = device_budget(summary, devices16)
        results["hybrid_predicted_step_s"] = round(hybrid.step_s, 3)
        results["hybrid_measured_step_s"] = round(BATCH / measured["hybrid"], 3)
        results["predictions"] = layout_predictions(
            plans, raw, shared, float(os.cpu_count() or 1), first,
            measured["pipeline"] if assignment_text(plans["pipeline"]) == assignment_text(first)
            else rate, measured)

        # 3. all 32 devices, the controller planning with --layout auto
        if not args.no_32:
            say("F32: 32 devices, --layout auto")
            box: dict = {}
            spec = JobSpec("fleet-f32", fleet(2, profiles), [*TRAINING, "--max-steps", "12",
                                                   "--layout", "auto"], timeout_s=1500)
            summary = run_job(spec, broker, training_window(2, 11, box))
            broker_rates["F32-auto"] = monitor.rates(box.get("start", 0.0), box.get("end", 0.0))
            decisions["F32-auto"] = summary.get("decision_s")
            results["f32_auto"] = {
                "stages": [{"start": st["start"], "end": st["end"],
                            "devices": [d["device"] for d in st["devices"]]}
                           for st in summary["stages"]],
                "repartitions": summary["repartitions"],
                "samples_per_s_steps_2_11": round(steady(summary, 2, 11), 2)}
    finally:
        monitor.close()
        broker.cleanup()
    results["measured_samples_per_s"] = {k: round(v, 2) for k, v in measured.items()}
    results["hybrid_over_pipeline"] = round(measured["hybrid"] / measured["pipeline"], 2)
    results["hybrid_over_data_parallel"] = round(measured["hybrid"] / measured["data_parallel"], 2)
    results["targets"] = {"hybrid_over_pipeline": 1.5, "hybrid_over_data_parallel": 1.2,
                          "steps_until_recovered": 3}
    results["broker_messages"] = broker_rates
    results["controller_decision_s"] = decisions
    results["loadavg_end"] = os.getloadavg()
    results["wall_s"] = round(time.monotonic() - started, 1)
    write_results(results, args.out, lambda png: plot(results, png))


def plot(results: dict, png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    inter = results["interruption"]
    fig, (left, middle, right) = plt.subplots(1, 3, figsize=(15, 4))
    labels = ["pipeline", "data_parallel", "hybrid"]
    x = range(len(labels))
    left.bar([i - 0.2 for i in x], [results["predicted_samples_per_s"][k] for k in labels],
             0.4, label="predicted")
    left.bar([i + 0.2 for i in x], [results["measured_samples_per_s"][k] for k in labels],
             0.4, label="measured")
    left.set_xticks(list(x), labels)
    left.set_ylabel("samples/s")
    left.set_title("F16: layouts")
    left.legend()
    rate = {int(k): v for k, v in inter["per_step_samples_per_s"].items()}
    middle.plot(sorted(rate), [rate[s] for s in sorted(rate)], marker=".")
    middle.axhline(inter["target_samples_per_s"], color="grey", linestyle="--",
                   label="planner, new speeds")
    middle.axvline(inter["from_step"], color="red", linestyle=":", label=f"{SLOWDOWN:g}x slow-down")
    middle.set_xlabel("step")
    middle.set_ylabel("samples/s")
    middle.set_title("hybrid: rate per step")
    middle.legend()
    for device, shares in sorted(inter["shares"].items()):
        right.step(range(len(shares)), shares, where="post", label=device)
    right.axvline(inter["from_step"], color="red", linestyle=":")
    right.set_xlabel("step")
    right.set_ylabel("share of the stage's micro-batches")
    right.set_title(f"shares in {inter['slowed_device']}'s group")
    right.legend(fontsize=7)
    save_figure(fig, png)


if __name__ == "__main__":
    main()
