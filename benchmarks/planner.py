"""Group planner benchmark (prints JSON, writes it and a PNG; no devices run, predictions only).

1. Fleet F16 = 8x rpi-zero, 6x rpi4, 2x jetson-nano (devices/profiles/*.json: factors, link caps,
   memory budgets), CIFAR-style MobileNetV2 width 0.25 at micro-batch 32: the fixed cost file
   benchmarks/data/mobilenetv2-w0.25-b32.json (per-layer median of 3 ``profile_layer_costs``
   runs on this machine; ``--profile`` measures afresh, ``--costs FILE`` reads another), with
   parameter bytes from the model:
   predicted samples/s of the best single pipeline (one device per stage; also the pre-group
   planner's minimum-bottleneck pipeline), pure data parallelism (all 16 devices as replicas when
   M >= 16; and the best replica group) and the hybrid plan, for several micro-batch counts M.
2. Decision time (wall and CPU) of the planner at 16 and 32 devices x 60 layers (the heuristic;
   exact search stops at 6 devices), and the heuristic's gap to a 10x longer search there.
3. Exact vs heuristic on small random instances (3-6 devices): gap distribution, exact time.

    python benchmarks/planner.py [--out benchmarks/results/planner.json] [--costs FILE | --profile]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.harness import PROFILES, say  # noqa: E402
from ftpipe_iot.planning.costs import DeviceSpec, LayerCosts  # noqa: E402
from ftpipe_iot.planning.group_heuristic import DEFAULT_MAX_EVALUATIONS  # noqa: E402
from ftpipe_iot.planning.group_search import (  # noqa: E402
    best_single_pipeline,
    data_parallel_plan,
    exact_groups,
    heuristic_groups,
    solve_groups,
)
from ftpipe_iot.planning.groups import GradientExchange, GroupPlan, evaluate_groups  # noqa: E402
from ftpipe_iot.planning.profiles import fleet_device_specs, load_profile  # noqa: E402
from ftpipe_iot.planning.solver import solve_partition  # noqa: E402

MICRO_BATCH = 32
WIDTH = 0.25
F16 = [("rpi-zero", 8), ("rpi4", 6), ("jetson-nano", 2)]
F32 = [("rpi-zero", 16), ("rpi4", 12), ("jetson-nano", 4)]


def fleet(classes: list[tuple[str, int]]) -> list[DeviceSpec]:
    profiles = [load_profile(PROFILES / f"{name}.json") for name, count in classes
                for _ in range(count)]
    return fleet_device_specs(profiles)


FIXED_COSTS = Path(__file__).resolve().parent / "data" / "mobilenetv2-w0.25-b32.json"


def model_costs() -> dict:
    """MobileNetV2 costs measured here once, plus fp32 parameter bytes per layer."""
    from ftpipe_iot.core.models import build_layers, profile_layer_costs
    from ftpipe_iot.protocol.specs import ModelSpec

    data = profile_layer_costs("mobilenetv2", MICRO_BATCH, WIDTH)
    layers = build_layers(ModelSpec("mobilenetv2", width=WIDTH), (3, 32, 32), 10, seed=0)
    data["param_bytes"] = [4 * sum(p.numel() for p in layer.parameters()) for layer in layers]
    data["micro_batch_size"] = MICRO_BATCH
    return data


def median_costs(runs: int) -> dict:
    """Per-layer median of several profiles: one profile on a shared machine can be far off."""
    profiles = [model_costs() for _ in range(runs)]
    merged = dict(profiles[0])
    for key in ("layer_cost_s", "stage_overhead_s", "head_overhead_s"):
        values = [p[key] for p in profiles]
        merged[key] = ([statistics.median(column) for column in zip(*values, strict=True)]
                       if isinstance(values[0], list) else statistics.median(values))
    return merged


def summary(plan: GroupPlan) -> dict:
    return {"samples_per_s": plan.throughput_samples_per_s, "step_s": plan.step_s,
            "stages": [{"start": s.start, "end": s.end,
                        "devices": [{"device": m.device, "micro_batches": m.micro_batches}
                                    for m in s.members]} for s in plan.stages]}


def f16_predictions(costs: LayerCosts, micro_batches: list[int],
                    exchange: GradientExchange) -> dict:
    devices = fleet(F16)
    partition = solve_partition(costs, devices)
    results: dict = {"fleet": {name: count for name, count in F16},
                     "gradient_exchange": exchange.value}
    for m in micro_batches:
        say(f"F16 predictions at M={m}, exchanging {exchange.value}")
        start = time.perf_counter()
        hybrid = solve_groups(costs, devices, m, MICRO_BATCH, exchange=exchange)
        decision_s = time.perf_counter() - start
        single = best_single_pipeline(costs, devices, m, MICRO_BATCH)
        old = evaluate_groups([(s.start, s.end, [s.device]) for s in partition.stages], costs,
                              devices, m, MICRO_BATCH)
        replicas = data_parallel_plan(costs, devices, m, MICRO_BATCH, exchange=exchange)
        row = {"hybrid": summary(hybrid), "decision_s": decision_s,
               "single_pipeline": summary(single),
               "min_bottleneck_pipeline": summary(old),
               "data_parallel_best_group": summary(replicas)}
        if m >= len(devices):
            every = data_parallel_plan(costs, devices, m, MICRO_BATCH, exchange=exchange,
                                       members=[d.name for d in devices])
            row["data_parallel_all"] = summary(every)
        else:
            row["data_parallel_all"] = f"needs M >= {len(devices)} (one micro-batch per replica)"
        best_dp = max(replicas.throughput_samples_per_s,
                      row["data_parallel_all"]["samples_per_s"]
                      if isinstance(row["data_parallel_all"], dict) else 0.0)
        row["hybrid_vs_single_pipeline"] = (hybrid.throughput_samples_per_s
                                            / single.throughput_samples_per_s)
        row["hybrid_vs_data_parallel"] = hybrid.throughput_samples_per_s / best_dp
        results[f"M={m}"] = row
    return results


def synthetic_costs(rng: random.Random, n_layers: int) -> LayerCosts:
    """A MobileNetV2-like profile stretched to ``n_layers``: early layers big activations, late
    layers big parameters."""
    costs = tuple(rng.uniform(0.002, 0.02) for _ in range(n_layers))
    act = tuple(1e6 * (0.05 + 1.5 * (1 - i / n_layers) ** 2) * rng.uniform(0.7, 1.3)
                for i in range(n_layers))
    params = tuple(2e5 * (i / n_layers) ** 2 * rng.uniform(0.5, 1.5) for i in range(n_layers))
    memory = tuple(3 * p + a for p, a in zip(params, act, strict=True))
    return LayerCosts(costs, act, memory, stage_overhead_s=4e-5, head_overhead_s=0.018,
                      param_bytes=params)


def random_fleet(rng: random.Random, count: int) -> list[DeviceSpec]:
    classes = [(10.0, 2.5e6, 2.68e8), (4.0, 5e6, 1.6e9), (1.5, 12.5e6, 2.1e9), (1.0, math.inf,
                                                                               math.inf)]
    out = []
    for i in range(count):
        factor, link, memory = rng.choice(classes)
        out.append(DeviceSpec(f"d{i}", factor * rng.uniform(0.8, 1.25), link, memory))
    return out


def decision_times(repeats: int, fleets: tuple[tuple[int, str], ...] = (
        (16, "F16"), (32, "F32"), (16, "random"), (32, "random")),
        micro_batches: tuple[int, ...] = (4, 16, 32)) -> dict:
    rng = random.Random(2024)
    results: dict = {"layers": 60, "max_evaluations": DEFAULT_MAX_EVALUATIONS, "cases": []}
    for n_dev, kind in fleets:
        for m in micro_batches:
            walls, cpus, gaps = [], [], []
            for r in range(repeats):
                costs = synthetic_costs(rng, 60)
                devices = (fleet(F16 if n_dev == 16 else F32) if kind != "random"
                           else random_fleet(rng, n_dev))
                wall, cpu = time.perf_counter(), time.process_time()
                plan = solve_groups(costs, devices, m, MICRO_BATCH)
                walls.append(time.perf_counter() - wall)
                cpus.append(time.process_time() - cpu)
                if r < 2:  # the slow reference is the expensive part
                    longer = heuristic_groups(costs, devices, m, MICRO_BATCH,
                                              max_evaluations=10 * DEFAULT_MAX_EVALUATIONS)
                    gaps.append(plan.step_s / longer.step_s)
            say(f"decision time {kind} {n_dev} devices M={m}: median {statistics.median(walls):.3f}"
                f" s wall, max {max(walls):.3f} s")
            results["cases"].append({
                "fleet": kind, "devices": n_dev, "micro_batches": m,
                "wall_s_median": statistics.median(walls), "wall_s_max": max(walls),
                "cpu_s_median": statistics.median(cpus), "cpu_s_max": max(cpus),
                "gap_vs_10x_search": gaps})
    return results


def exact_gaps(count: int) -> dict:
    rng = random.Random(7)
    gaps, exact_s, heuristic_s = [], [], []
    for _ in range(count):
        n_dev, n_layers = rng.randint(3, 6), rng.choice([8, 22])
        m = rng.choice([2, 4, 8])
        costs, devices = synthetic_costs(rng, n_layers), random_fleet(rng, n_dev)
        start = time.process_time()
        optimum = exact_groups(costs, devices, m, MICRO_BATCH)
        exact_s.append(time.process_time() - start)
        start = time.process_time()
        plan = heuristic_groups(costs, devices, m, MICRO_BATCH)
        heuristic_s.append(time.process_time() - start)
        gaps.append(plan.step_s / optimum.step_s)
    return {"instances": count, "devices": "3-6", "layers": [8, 22], "micro_batches": [2, 4, 8],
            "share_optimal": sum(g <= 1 + 1e-9 for g in gaps) / count,
            "gap_mean": statistics.mean(gaps), "gap_max": max(gaps),
            "gap_p90": sorted(gaps)[int(0.9 * count)],
            "exact_cpu_s_max": max(exact_s), "heuristic_cpu_s_max": max(heuristic_s)}


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [("single_pipeline", "best single pipeline"),
              ("data_parallel_best_group", "data parallel (best group)"),
              ("data_parallel_all", "data parallel (all 16)"), ("hybrid", "hybrid (groups)")]
    panels = [("f16", "every micro-batch gradient (M copies; the runtime's)"),
              ("f16_sums_exchange", "what-if: gradient sums (g copies)")]
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.5), sharey=True)
    width = 0.2
    for ax, (panel, title) in zip(axes, panels, strict=True):
        rows = results[panel]
        keys = [k for k in rows if k.startswith("M=")]
        for j, (key, label) in enumerate(labels):
            values = [rows[k][key]["samples_per_s"] if isinstance(rows[k][key], dict) else 0.0
                      for k in keys]
            ax.bar([i + (j - 1.5) * width for i in range(len(keys))], values, width,
                   label=label)
        ax.set_xticks(range(len(keys)), keys)
        ax.set_title(title)
    axes[0].set_ylabel("predicted samples/s")
    axes[0].legend()
    fig.suptitle("F16 (8x rpi-zero, 6x rpi4, 2x jetson-nano), MobileNetV2 w0.25, B=32")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path,
                        default=Path(__file__).resolve().parent / "results" / "planner.json")
    parser.add_argument("--costs", type=Path, default=FIXED_COSTS,
                        help="cost file (LayerCosts JSON) [default: the fixed MobileNetV2 one]")
    parser.add_argument("--profile", action="store_true",
                        help="profile MobileNetV2 here instead (median of 3 runs; needs torch)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--small", type=int, default=60, help="small instances for the gaps")
    parser.add_argument("--smoke", action="store_true",
                        help="one case of each part: checks the benchmark runs (give --out)")
    args = parser.parse_args()
    ms = [4] if args.smoke else [4, 8, 16, 32]
    if args.smoke:
        args.repeats, args.small = 1, 2
    load_before = os.getloadavg()
    if args.profile:
        say("profiling MobileNetV2 (width 0.25, micro-batch 32) on this machine, 3 runs")
        cost_data, source = median_costs(3), "profiled (median of 3)"
    else:
        cost_data, source = json.loads(args.costs.read_text()), str(args.costs)
    costs = LayerCosts.from_dict(cost_data)
    results = {"loadavg_before": load_before, "costs_source": source, "costs": cost_data,
               # the runtime exchanges every micro-batch's gradient (exact); sums as a what-if
               "f16": f16_predictions(costs, ms, GradientExchange.MICRO_BATCHES),
               "f16_sums_exchange": f16_predictions(costs, ms, GradientExchange.SUMS),
               "decision_time": decision_times(args.repeats, ((16, "F16"),), (4,))
               if args.smoke else decision_times(args.repeats),
               "exact_vs_heuristic": exact_gaps(args.small)}
    results["loadavg_after"] = os.getloadavg()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    png = args.out.with_suffix(".png")
    plot(results, png)
    results["plot"] = str(png)
    args.out.write_text(json.dumps(results, indent=2) + "\n")
    print(json.dumps({k: v for k, v in results.items() if k != "costs"}, indent=2))


if __name__ == "__main__":
    main()
