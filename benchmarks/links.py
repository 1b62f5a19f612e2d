"""Scenario H on real links (prints JSON, writes it and a PNG): 4 devices with slow-downs 1, 2,
4, 10 (as in benchmarks/heterogeneity.py) whose links are capped by the kernel, each device in
its own network namespace behind a ``tbf`` of 10 or 40 Mbit/s each way, the broker and the
controller in the hub namespace (ftpipe_iot/runtime/netns.py). The devices run with
``--real-link``: their profiles declare the caps to the controller and nobody sleeps for them.

The model is MobileNetV2 at width 1.0 on synthetic 32x32 images, 8 samples per micro-batch,
4 micro-batches per step.

Per run: samples/s of the even split and of dynamic partitioning; per stage of the final plan,
what the solver's link model predicts (compute + bytes moved / declared bandwidth, one
half-duplex budget per device) against what the links carried (bytes each way from the veth
counters over a window of steps, the time those bytes take at the cap, the device's reported
compute). The same two runs with the caps emulated by sleeping (the agent's old way, no
namespaces) are the comparison. Needs root (CAP_NET_ADMIN); says so and stops without it.

    python benchmarks/links.py [--steps 16] [--out benchmarks/results/links.json]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.harness import (  # noqa: E402
    JobSpec,
    Placement,
    run_job,
    save_figure,
    say,
    steady_rate,
    write_results,
)
from benchmarks.heterogeneity import BATCH, MB, M, _training  # noqa: E402
from ftpipe_iot.core.models import profile_layer_costs  # noqa: E402
from ftpipe_iot.planning.partition import balanced_split  # noqa: E402
from ftpipe_iot.planning.profiles import load_profile  # noqa: E402
from ftpipe_iot.planning.solver import LayerCosts, evaluate_partition  # noqa: E402
from ftpipe_iot.runtime.broker import BrokerKind, BrokerProcess  # noqa: E402
from ftpipe_iot.runtime.netns import NetLab, unavailable  # noqa: E402

FACTORS = (1, 2, 4, 10)
# The fastest and the slowest device sit behind the slow links: the solver has to weigh a
# device's speed against its link.
CAPS_MBIT = (10, 40, 40, 10)
NAMES = [f"h{i}-x{f}" for i, f in enumerate(FACTORS)]
PORT = 1883
# The jobs train MobileNetV2 at width 1.0: the CLI has no width option (heterogeneity.py's
# WIDTH = 0.25 only reaches its own cost profile). The predictions here use the model that runs.
WIDTH = 1.0
# The default detectors (5 s heartbeat, 30 s stall): a replica upload over a 10 Mbit/s link
# takes seconds, but heartbeats no longer queue behind it (the bulk outbox, docs/design.md §4)
# and every replica chunk is a sign of life (§6). Longer detectors were needed before that.
DETECTORS: list[str] = []
# Replicas only at plan changes (outside the measuring window): the solver's link model counts
# activations and gradients, and the window measures what it models. What one replication
# costs on each link is reported on its own (``replication``).
REPLICATION = ["--replicate-every", "0"]


def write_profiles(folder: Path) -> dict[str, Path]:
    """One profile per device: its slow-down and its link cap (bytes/s) as declared."""
    paths = {}
    for name, factor, mbit in zip(NAMES, FACTORS, CAPS_MBIT):
        path = folder / f"{name}.json"
        path.write_text(json.dumps({"version": 1, "name": name, "factor": factor,
                                    "bandwidth_bytes_per_s": mbit * 1e6 / 8}))
        paths[name] = path
    return paths


def even_assignment(costs: dict) -> str:
    """The even split of heterogeneity.py: balanced by reference cost, devices in name order."""
    ranges = balanced_split(costs["layer_cost_s"], len(NAMES))
    return ",".join(f"{n}:{start}-{end}" for n, (start, end) in zip(NAMES, ranges))


class LinkWindow:
    """Measures, between two steps of a run, the bytes every device's link carried each way
    and the compute time it reported."""

    def __init__(self, lab: NetLab | None, first: int, last: int) -> None:
        self.lab, self.first, self.last = lab, first, last
        self.result: dict = {}

    def _counters(self) -> dict[str, tuple[int, int]]:
        assert self.lab is not None
        return {name: self.lab.link_bytes(name) for name in NAMES}

    def __call__(self, watcher, procs) -> None:
        if not watcher.wait_step(self.first, 900):
            raise TimeoutError(f"never reached step {self.first}")
        before, started = (self._counters() if self.lab else {}), time.monotonic()
        if not watcher.wait_step(self.last, 900):
            raise TimeoutError(f"never reached step {self.last}")
        span, micro_batches = time.monotonic() - started, (self.last - self.first) * M
        after = self._counters() if self.lab else {}
        self.result = {"steps": [self.first, self.last], "seconds": span, "devices": {},
                       "capacities": dict(watcher.job.capacities)}
        for name in NAMES:
            view = watcher.devices.get(name)
            entry = {"reported_compute_s_per_micro_batch":
                     (view.compute_s / M) if view is not None else None}
            if self.lab is not None:
                tx = (after[name][0] - before[name][0]) / micro_batches
                rx = (after[name][1] - before[name][1]) / micro_batches
                entry.update(tx_bytes_per_micro_batch=tx, rx_bytes_per_micro_batch=rx)
            self.result["devices"][name] = entry


def predicted_and_measured(summary: dict, window: dict, costs: dict, profiles: dict) -> dict:
    """The solver's view of the final plan next to what the window measured, stage by stage."""
    specs = [load_profile(profiles[n]).device_spec(name=n) for n in NAMES]
    # One device per stage here (no stage groups): the stage's only member.
    assignment = [(s["devices"][0]["device"], s["start"], s["end"]) for s in summary["stages"]]
    plan = evaluate_partition(assignment, LayerCosts.from_dict(costs), specs)
    # The controller's own view: the capacity factors it measured during the run.
    measured_specs = [replace(spec, factor=window["capacities"].get(spec.name, spec.factor))
                      for spec in specs]
    seen = evaluate_partition(assignment, LayerCosts.from_dict(costs), measured_specs)
    stages = []
    for stage, seen_stage in zip(plan.stages, seen.stages):
        rate = load_profile(profiles[stage.device]).bandwidth_bytes_per_s
        measured = window["devices"][stage.device]
        row = {"device": stage.device, "layers": [stage.start, stage.end],
               "predicted": {"compute_s": stage.compute_s, "comm_s": stage.comm_s,
                             "time_s": stage.time_s},
               "predicted_with_measured_capacity": {"compute_s": seen_stage.compute_s,
                                                    "time_s": seen_stage.time_s},
               "measured": dict(measured)}
        if "tx_bytes_per_micro_batch" in measured:
            tx, rx = measured["tx_bytes_per_micro_batch"], measured["rx_bytes_per_micro_batch"]
            row["measured"].update(
                link_s_half_duplex=(tx + rx) / rate,  # the solver's one shared budget
                link_s_each_way=max(tx, rx) / rate)   # what a full-duplex tbf pair allows
        stages.append(row)
    per_micro_batch = window["seconds"] / ((window["steps"][1] - window["steps"][0]) * M)
    return {"stages": stages, "predicted_bottleneck_s": plan.bottleneck_s,
            "predicted_samples_per_s": MB / plan.bottleneck_s,
            "predicted_samples_per_s_with_measured_capacity": MB / seen.bottleneck_s,
            "measured_s_per_micro_batch": per_micro_batch,
            "measured_samples_per_s": MB / per_micro_batch}


def run_pair(real: bool, steps: int, costs: dict, profiles: dict, work: Path) -> dict:
    """The even split and dynamic partitioning, on real capped links or with sleeps."""
    out: dict = {}
    for mode in ("even", "dynamic"):
        run_steps = steps if mode == "even" else steps + 12
        policy = (["--no-repartition", "--assignment", even_assignment(costs)] if mode == "even"
                  else ["--repartition-cooldown", "5"])
        args = [*_training(run_steps), *policy, *DETECTORS, *REPLICATION]
        spec = JobSpec(f"links-{'real' if real else 'sleep'}-{mode}",
                       [(n, profiles[n]) for n in NAMES], args, timeout_s=1800)
        first = run_steps - steps // 2
        say(f"{'real tbf links' if real else 'sleep-emulated links'}: {mode}")
        if real:
            summary, window = _real_run(spec, first, run_steps - 1, work)
        else:
            window = LinkWindow(None, first, run_steps - 1)
            with BrokerProcess(kind=BrokerKind.MOSQUITTO) as broker:
                summary = run_job(spec, broker, during=window)
            window = window.result
        out[mode] = {"samples_per_s": steady_rate(summary, BATCH, steps // 2),
                     "stages": summary["stages"], "repartitions": summary["repartitions"],
                     "failures_detected": summary["failures_detected"],
                     "replicated_bytes": summary["replicated_bytes"],
                     "window": window,
                     "model_vs_links": predicted_and_measured(summary, window, costs,
                                                              profiles)}
    out["dynamic_over_even"] = out["dynamic"]["samples_per_s"] / out["even"]["samples_per_s"]
    return out


def _real_run(spec: JobSpec, first: int, last: int, work: Path) -> tuple[dict, dict]:
    with NetLab(tag="links") as lab:
        nodes = {n: lab.add_node(n, mbit * 1e6) for n, mbit in zip(NAMES, CAPS_MBIT)}
        with BrokerProcess(kind=BrokerKind.MOSQUITTO, port=PORT, bind="0.0.0.0",
                           data_dir=work / spec.job, netns=lab.hub) as broker:
            from ftpipe_iot.transport.connection import BrokerConfig

            placement = Placement(f"mqtt://127.0.0.1:{PORT}", BrokerConfig(port=PORT),
                                  controller_netns=lab.hub,
                                  device_urls={n: node.broker_url(PORT)
                                               for n, node in nodes.items()},
                                  device_netns={n: node.namespace for n, node in nodes.items()},
                                  device_args=["--real-link"])
            window = LinkWindow(lab, first, last)
            summary = run_job(spec, broker, during=window, placement=placement)
    return summary, window.result


def replication_cost() -> dict:
    """What one replication of every layer weighs (its state plus an SGD momentum buffer per
    parameter) and how long it takes through a 10 and a 40 Mbit/s link: traffic the solver's
    model leaves out."""
    from ftpipe_iot.core.models import ModelSpec, build_layers

    layers = build_layers(ModelSpec("mobilenetv2", width=WIDTH), (3, 32, 32), 10, 0)
    state = sum(t.numel() * t.element_size() for layer in layers
                for t in layer.state_dict().values())
    momentum = sum(p.numel() * p.element_size() for layer in layers for p in layer.parameters())
    total = state + momentum
    return {"replica_bytes": total,
            "seconds_at": {f"{mbit} Mbit/s": total / (mbit * 1e6 / 8) for mbit in (10, 40)}}


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    labels, values = [], []
    for links in ("real", "sleep"):
        for mode in ("even", "dynamic"):
            labels.append(f"{mode}\n{'tbf links' if links == 'real' else 'sleeps'}")
            values.append(results[links][mode]["samples_per_s"])
    left.bar(labels, values, color=["#4c72b0", "#55a868", "#8da0cb", "#a6d854"])
    left.set_ylabel("samples/s (steady state)")
    left.set_title("Scenario H, links capped 10/40/40/10 Mbit/s")
    stages = results["real"]["dynamic"]["model_vs_links"]["stages"]
    xs = range(len(stages))
    right.bar([x - 0.3 for x in xs], [s["predicted"]["time_s"] for s in stages], 0.3,
              label="solver: compute + comm (half duplex)")
    right.bar(list(xs), [s["measured"].get("link_s_half_duplex", 0) +
                         (s["measured"]["reported_compute_s_per_micro_batch"] or 0)
                         for s in stages], 0.3, label="measured: compute + link, half duplex")
    right.bar([x + 0.3 for x in xs], [max(s["measured"].get("link_s_each_way", 0),
                                          s["measured"]["reported_compute_s_per_micro_batch"]
                                          or 0) for s in stages], 0.3,
              label="measured: max(compute, each way)")
    right.set_xticks(list(xs), [s["device"] for s in stages])
    right.set_ylabel("seconds per micro-batch")
    right.set_title("dynamic plan on tbf links: predicted vs measured per stage")
    right.legend(fontsize=7)
    save_figure(fig, path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results" /
                        "links.json")
    args = parser.parse_args()
    if args.steps < 4:
        # The measured window is the last steps/2 steps of each run: fewer than 2 is no window.
        parser.error(f"--steps must be at least 4 (the window is the last half), got {args.steps}")
    reason = unavailable()
    if reason is not None:
        print(json.dumps({"skipped": f"network namespaces unavailable: {reason}"}))
        return
    # A SIGTERM unwinds like Ctrl-C, so the lab's namespaces and processes are removed.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    started, load_before = time.monotonic(), os.getloadavg()
    costs = profile_layer_costs("mobilenetv2", MB, WIDTH)
    with tempfile.TemporaryDirectory(prefix="bench-links-") as tmp:
        work = Path(tmp)
        profiles = write_profiles(work)
        results = {"model": f"mobilenetv2(width={WIDTH})", "micro_batches": M,
                   "micro_batch_size": MB, "factors": dict(zip(NAMES, FACTORS)),
                   "caps_mbit_each_way": dict(zip(NAMES, CAPS_MBIT)),
                   "replication": replication_cost(),
                   "real": run_pair(True, args.steps, costs, profiles, work),
                   "sleep": run_pair(False, args.steps, costs, profiles, work)}
    results.update(loadavg_before=load_before, loadavg_after=os.getloadavg(),
                   wall_s=round(time.monotonic() - started, 1))
    write_results(results, args.out, lambda png: plot(results, png))


if __name__ == "__main__":
    main()
