"""Heterogeneity benchmark (prints JSON, writes it and a PNG): dynamic partitioning vs. an even
split, vs. torch.distributed.pipelining with the same even split and slow-downs, and vs. the
oracle (best static partition by exhaustive search over splits and device orders on ground-truth
costs).

Scenario H: 4 emulated devices with slow-down factors 1, 2, 4, 10.
Scenario V: 4 equal devices; one slows 4x from a set step; how many steps until throughput is
back within 10% of the oracle for the new speeds.

Model: CIFAR-style MobileNetV2 at width 0.25 on synthetic 32x32 data (width 1.0 is ~16x the
compute and would not fit the time budget on 2 cores).

    python benchmarks/heterogeneity.py [--out benchmarks/results/heterogeneity.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.harness import PROFILES, JobSpec, rate_between, run_job, say, steady_rate  # noqa: E402
from ftpipe_iot.core.models import profile_layer_costs  # noqa: E402
from ftpipe_iot.planning.profiles import load_profile  # noqa: E402
from ftpipe_iot.planning.solver import DeviceSpec, LayerCosts, exhaustive_partition  # noqa: E402
from ftpipe_iot.runtime.broker import BrokerProcess  # noqa: E402

WIDTH = 0.25
MB, M = 8, 4
BATCH = MB * M
TRAINING = ["--model", "mobilenetv2", "--data", "synthetic", "--data-shape", "3,32,32",
            "--data-samples", "4096", "--micro-batches", str(M), "--micro-batch-size", str(MB),
            "--lr", "0.01", "--epochs", "1"]


def _training(steps: int) -> list[str]:
    return [*TRAINING, "--max-steps", str(steps)]


def oracle_assignment(costs: dict, factors: dict[str, float]) -> tuple[str, float]:
    """Best static plan by brute force over splits and device orders (ground-truth factors)."""
    specs = [DeviceSpec(name, factor) for name, factor in factors.items()]
    best = exhaustive_partition(LayerCosts.from_dict(costs), specs)
    text = ",".join(f"{s.device}:{s.start}-{s.end}" for s in best.stages)
    return text, best.bottleneck_s


def scenario_h(broker: BrokerProcess, steps: int, costs: dict) -> dict:
    # Names sort in factor order, so the even split gives factors 1, 2, 4, 10 to stages 0..3
    # exactly as the torch.distributed.pipelining run below does.
    names = [f"h{i}-x{f}" for i, f in enumerate((1, 2, 4, 10))]
    devices = [(n, PROFILES / f"bench-h-{n.split('-x')[1]}.json") for n in names]
    factors = {n: load_profile(p).factor for n, p in devices}
    results: dict = {"factors": factors}

    say("scenario H: even static split")
    even = run_job(JobSpec("h-even", devices, [*_training(steps), "--no-repartition"]), broker)
    results["even"] = {"samples_per_s": steady_rate(even, BATCH, steps // 2),
                       "stages": even["stages"]}

    say("scenario H: dynamic partitioning")
    dyn_steps = steps + 12
    dyn = run_job(JobSpec("h-dynamic", devices,
                          [*_training(dyn_steps), "--repartition-cooldown", "5"]), broker)
    results["dynamic"] = {"samples_per_s": steady_rate(dyn, BATCH, steps // 2),
                          "stages": dyn["stages"], "repartitions": dyn["repartitions"]}

    say("scenario H: oracle static partition")
    assignment, predicted = oracle_assignment(costs, factors)
    oracle = run_job(JobSpec("h-oracle", devices, [*_training(steps), "--no-repartition",
                                                   "--assignment", assignment]), broker)
    results["oracle"] = {"samples_per_s": steady_rate(oracle, BATCH, steps // 2),
                         "assignment": assignment, "predicted_bottleneck_s": predicted}

    say("scenario H: torch.distributed.pipelining, even split, same slow-downs")
    try:
        from benchmarks.torch_pipelining import TorchPipeliningConfig, run_torch_pipelining

        split = [(s["start"], s["end"]) for s in even["stages"]]
        torch_result = run_torch_pipelining(TorchPipeliningConfig(
            width=WIDTH, factors=list(factors.values()), micro_batches=M,
            micro_batch_size=MB, steps=max(6, steps // 3), warmup=2, split=split,
            clock="cpu"))
        results["torch_pipelining"] = {"samples_per_s": torch_result["samples_per_s"],
                                       "clock": "cpu",
                                       "schedule": torch_result["schedule"], "split": split}
    except Exception as exc:  # the comparison is reported as missing, not silently dropped
        results["torch_pipelining"] = {"error": f"{type(exc).__name__}: {exc}"}
    dyn_rate = results["dynamic"]["samples_per_s"]
    results["ratios"] = {
        "dynamic_over_even": dyn_rate / results["even"]["samples_per_s"],
        "dynamic_over_oracle": dyn_rate / results["oracle"]["samples_per_s"],
        "dynamic_over_torch_pipelining": (
            dyn_rate / results["torch_pipelining"]["samples_per_s"]
            if "samples_per_s" in results["torch_pipelining"] else None),
    }
    return results


def scenario_v(broker: BrokerProcess, costs: dict, slow_from: int, steps: int) -> dict:
    names = ["v0", "v1", "v2", "v3"]
    slow = PROFILES / "bench-v-slowdown.json"
    profile = load_profile(slow)
    slow_from = profile.step_schedule[-1].from_step
    devices = [(n, slow if n == "v3" else None) for n in names]
    say(f"scenario V: 4 equal devices, v3 slows {profile.step_schedule[-1].factor}x "
        f"from step {slow_from}")
    dyn = run_job(JobSpec("v-dynamic", devices,
                          [*_training(steps), "--repartition-cooldown", "5"]), broker)
    new_factors = {n: 1.0 for n in names}
    new_factors["v3"] = float(profile.step_schedule[-1].factor)
    assignment, _ = oracle_assignment(costs, new_factors)
    say("scenario V: oracle for the new speeds")
    oracle_profile = Path(dyn["work_dir"]) / "slow-always.json"
    oracle_profile.write_text(json.dumps({"version": 1, "name": "slow-always",
                                          "factor": new_factors["v3"]}))
    oracle = run_job(JobSpec("v-oracle", [(n, oracle_profile if n == "v3" else None)
                                          for n in names],
                             [*_training(14), "--no-repartition", "--assignment", assignment]),
                     broker)
    oracle_rate = steady_rate(oracle, BATCH, 8)
    # Throughput per step over a 3-step window; recovered when within 10% of the oracle.
    window = 3
    per_step = []
    for step in range(window, steps):
        per_step.append({"step": step, "samples_per_s": rate_between(dyn, BATCH, step - window,
                                                                     step)})
    recovered_at = next((p["step"] for p in per_step if p["step"] > slow_from + window
                         and p["samples_per_s"] >= 0.9 * oracle_rate), None)
    changes = [e for e in dyn["events"] if e["type"] == "plan_changed"]
    return {"slow_from_step": slow_from, "oracle_samples_per_s": oracle_rate,
            "oracle_assignment": assignment,
            "steps_to_within_10pct": None if recovered_at is None else recovered_at - slow_from,
            "repartitions": dyn["repartitions"],
            "plan_changes_at_step": [e.get("resume_step") for e in changes],
            "per_step": per_step}


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    v = results["scenario_v"]
    fig, ax = plt.subplots(figsize=(9, 4.5))
    ax.plot([p["step"] for p in v["per_step"]], [p["samples_per_s"] for p in v["per_step"]],
            label="ftpipe-iot dynamic (3-step window)")
    ax.axhline(v["oracle_samples_per_s"], color="green", linestyle="--",
               label="oracle for the new speeds")
    ax.axhline(0.9 * v["oracle_samples_per_s"], color="green", linestyle=":", alpha=0.6,
               label="90% of oracle")
    ax.axvline(v["slow_from_step"], color="red", label="device slows 4x")
    for i, step in enumerate(s for s in v["plan_changes_at_step"] if s):
        ax.axvline(step, color="purple", linestyle="-.", alpha=0.7,
                   label="plan change" if i == 0 else None)
    ax.set_xlabel("step")
    ax.set_ylabel("samples/s")
    ax.set_title("Scenario V: throughput over steps, MobileNetV2 (width 0.25), 4 devices")
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--v-steps", type=int, default=44)
    parser.add_argument("--out", type=Path,
                        default=Path(__file__).resolve().parent / "results" /
                        "heterogeneity.json")
    args = parser.parse_args()
    started = time.monotonic()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    costs = profile_layer_costs("mobilenetv2", MB, WIDTH)
    with BrokerProcess() as broker:
        results = {"model": f"mobilenetv2(width={WIDTH})", "micro_batches": M,
                   "micro_batch_size": MB,
                   "scenario_h": scenario_h(broker, args.steps, costs),
                   "scenario_v": scenario_v(broker, costs, 30, args.v_steps)}
    results["wall_s"] = round(time.monotonic() - started, 1)
    png = args.out.with_suffix(".png")
    plot(results, png)
    results["plot"] = str(png)
    args.out.write_text(json.dumps(results, indent=2))
    print(json.dumps(results))


if __name__ == "__main__":
    main()
