"""Collaborative mode (PiPar's pipelined split learning) vs. the federated-averaging baseline.

Digits, 4 data-owning emulated devices (``devices/profiles/collab-rpi-zero.json``: 10x slower,
10 Mbit/s up, 25 Mbit/s down) and one server (``gateway.json``: the reference speed), all as real
processes on one Mosquitto. For every configuration both modes run with the same data split,
FedAvg interval, epochs and seed, one after the other; the figure compared is the training wall
time until the global model first reaches the target test accuracy (it is evaluated after every
round), and the server side's idle fraction (the server replicas' compute plus FedAvg, over the
training time). Every configuration run is reported, and the median speed-up. A last run trains
with differential privacy on and reports accuracy and epsilon.

Run from the repository root (the benchmark model is ``benchmarks.collab_models``):

    .venv/bin/python benchmarks/collab.py            # prints JSON, writes results/collab.{json,png}
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks.harness import PROFILES, say  # noqa: E402
from ftpipe_iot.collab.config import CollabConfig  # noqa: E402
from ftpipe_iot.collab.data_split import PartitionSpec  # noqa: E402
from ftpipe_iot.collab.demo import CollabDemo, CollabDemoOptions  # noqa: E402
from ftpipe_iot.protocol.collab import PrivacySettings  # noqa: E402
from ftpipe_iot.protocol.plan import TrainConfig  # noqa: E402
from ftpipe_iot.protocol.specs import ModelSpec  # noqa: E402
from ftpipe_iot.protocol.vocab import CollabMode  # noqa: E402
from ftpipe_iot.runtime.broker import BrokerKind, BrokerProcess  # noqa: E402

SPLIT_FRIENDLY = "benchmarks.collab_models:split_friendly"
DEVICE = PROFILES / "collab-rpi-zero.json"
SERVER = PROFILES / "gateway.json"
RESULTS = REPO / "benchmarks" / "results"


@dataclass(frozen=True)
class Setting:
    """One configuration, run in both modes."""

    name: str
    model: str
    partition: str
    aggregate_every: int | None
    epochs: int
    target: float
    lr: float = 0.01
    devices: int = 4
    max_steps: int | None = None
    profiles: bool = True  # the emulated devices and server; False: every process at 1x


def _run(setting: Setting, mode: CollabMode, broker: BrokerProcess, work: Path,
         privacy: PrivacySettings | None = None) -> dict:
    train = TrainConfig(model=ModelSpec(setting.model), micro_batches=4, micro_batch_size=8,
                        epochs=setting.epochs, lr=setting.lr, momentum=0.9, seed=0,
                        max_steps=setting.max_steps)
    config = CollabConfig(mode=mode, train=train, devices=setting.devices,
                          aggregate_every=setting.aggregate_every, privacy=privacy,
                          heartbeat_timeout_s=30.0, wait_devices_s=180.0)
    job = f"bench-{mode.value[:5]}-{setting.name}"[:60]
    options = CollabDemoOptions(config=config, job=job, broker_url=broker.url,
                                work_dir=work / job, partition=PartitionSpec.parse(
                                    setting.partition),
                                device_profile=DEVICE if setting.profiles else None,
                                server_profile=SERVER if setting.profiles else None,
                                coordinator_args=["--save-weights", str(work / job / "w.npz"),
                                                  "--log-level", "WARNING"],
                                device_args=["--log-level", "WARNING"])
    started = time.monotonic()
    summary = CollabDemo(options).run()
    if summary.get("error"):
        raise RuntimeError(f"{job}: {summary['error']} (see {work / job})")
    reached = [e for e in summary["evals"] if e["test_accuracy"] >= setting.target]
    collab = summary["collab"]
    result = {
        "time_to_target_s": reached[0]["train_s"] if reached else None,
        "iterations_to_target": reached[0]["step"] if reached else None,
        "train_s": summary["train_s"], "wall_s": round(time.monotonic() - started, 2),
        "final_accuracy": summary["test_accuracy"], "iterations": summary["steps"],
        "rounds": collab["rounds"], "server_idle_fraction": collab["server_idle_fraction"],
        "server_busy_s": collab["server_busy_s"], "aggregation_s": collab["aggregation_s"],
        "split_point": collab["split_point"], "head_start": collab["head_start"],
        "micro_batches": collab["micro_batches"], "aggregate_every": collab["aggregate_every"],
        "predicted_iteration_s": collab["plan"].get("chosen", {}).get("iteration_s"),
        "predicted_fedavg_iteration_s": collab["plan"].get("fedavg_iteration_s"),
        "epsilon": {n: m["epsilon"] for n, m in collab["members"].items()},
        "curve": [(e["train_s"], e["test_accuracy"]) for e in summary["evals"]],
        "weights": str(work / job / "w.npz"), "data_split": collab.get("data_split"),
    }
    idle = result["server_idle_fraction"]
    say(f"{job}: {result['time_to_target_s']} s to {setting.target}, final "
        f"{result['final_accuracy']:.3f}, server idle "
        f"{'-' if idle is None else f'{idle:.2f}'}")
    return result


def _weight_gap(a: str, b: str) -> float:
    """Largest difference between the two modes' final models (the same maths: FedAvg of the
    device part and of each device's server replica is FedAvg of whole models)."""
    with np.load(a) as x, np.load(b) as y:
        return max(float(np.abs(x[k] - y[k]).max()) for k in x.files)


def _plot(results: list[dict], dp: dict | None, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_time, ax_idle, ax_curve) = plt.subplots(1, 3, figsize=(16, 5))
    names = [r["name"] for r in results]
    xs = np.arange(len(names))
    for offset, mode, color in ((-0.2, "collaborative", "#1f77b4"), (0.2, "fedavg", "#ff7f0e")):
        if any(mode not in r for r in results):
            continue
        values = [r[mode]["time_to_target_s"] or np.nan for r in results]
        ax_time.bar(xs + offset, values, 0.4, label=mode, color=color)
        ax_idle.bar(xs + offset, [r[mode]["server_idle_fraction"] for r in results], 0.4,
                    label=mode, color=color)
    for x, r in zip(xs, results):
        if r.get("speedup"):
            ax_time.annotate(f"{r['speedup']:.1f}x", (x, r["fedavg"]["time_to_target_s"] or 0),
                             textcoords="offset points", xytext=(0, 4), ha="center", fontsize=9)
    ax_time.set_xticks(xs, names, rotation=20, ha="right", fontsize=8)
    ax_time.set_ylabel("training seconds to the target test accuracy")
    ax_time.set_title("time to target (lower is better)")
    ax_time.legend()
    ax_idle.set_xticks(xs, names, rotation=20, ha="right", fontsize=8)
    ax_idle.set_ylim(0, 1.05)
    ax_idle.set_ylabel("server idle fraction")
    ax_idle.set_title("server side idle (lower is better)")
    first = results[0]
    for mode, color in (("collaborative", "#1f77b4"), ("fedavg", "#ff7f0e")):
        if mode not in first:
            continue
        t, acc = zip(*first[mode]["curve"])
        ax_curve.plot(t, acc, marker="o", color=color, label=mode)
    if dp is not None:
        t, acc = zip(*dp["curve"])
        ax_curve.plot(t, acc, marker=".", color="#2ca02c",
                      label=f"collaborative + DP (eps {max(dp['epsilon'].values()):.1f})")
    ax_curve.axhline(first["target"], color="#7f7f7f", linestyle="--", linewidth=1)
    ax_curve.set_xlabel("training seconds")
    ax_curve.set_ylabel("test accuracy")
    ax_curve.set_title(f"{first['name']}: test accuracy over time")
    ax_curve.legend(fontsize=8)
    fig.suptitle("collaborative (PiPar split learning) vs fedavg: 4 devices at 10x on 10/25 "
                 "Mbit/s, one server at 1x", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


SETTINGS = [
    Setting("wide-iid-epoch", SPLIT_FRIENDLY, "iid", None, 6, 0.90),
    Setting("wide-dirichlet0.5-epoch", SPLIT_FRIENDLY, "dirichlet:0.5", None, 6, 0.90),
    Setting("wide-iid-k5", SPLIT_FRIENDLY, "iid", 5, 6, 0.90),
    Setting("wide-dirichlet0.5-k5", SPLIT_FRIENDLY, "dirichlet:0.5", 5, 6, 0.90),
    Setting("cnn-iid-epoch", "cnn", "iid", None, 10, 0.85, lr=0.05),
]
# --smoke: the benchmark's own model (imported by its devices) in the collaborative mode, 2
# devices at 1x, 2 iterations: checks that the benchmark runs, measures nothing.
SMOKE = Setting("smoke", SPLIT_FRIENDLY, "iid", 1, 1, 0.0, devices=2, max_steps=2,
                profiles=False)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", default=None, help="comma-separated setting names")
    parser.add_argument("--no-dp", action="store_true", help="skip the DP run")
    parser.add_argument("--out", default=str(RESULTS / "collab.json"))
    parser.add_argument("--smoke", action="store_true",
                        help="one tiny setting, no DP: checks the benchmark runs (give --out)")
    args = parser.parse_args()
    settings = [s for s in SETTINGS if args.only is None or s.name in args.only.split(",")]
    modes = (CollabMode.COLLABORATIVE, CollabMode.FEDAVG)
    if args.smoke:
        # the devices load the benchmark's model the same way in both modes: one suffices
        settings, args.no_dp, modes = [SMOKE], True, (CollabMode.COLLABORATIVE,)
    os.chdir(REPO)  # children import the benchmark model from here
    load_start = os.getloadavg()
    work = Path(tempfile.mkdtemp(prefix="bench-collab-"))
    broker = BrokerProcess(kind=BrokerKind.MOSQUITTO, data_dir=work / "broker")
    broker.start()
    results, dp = [], None
    try:
        for setting in settings:
            row = {"name": setting.name, "model": setting.model,
                   "partition": setting.partition, "target": setting.target,
                   "epochs": setting.epochs, "lr": setting.lr,
                   "aggregate_every": setting.aggregate_every or "one epoch"}
            for mode in modes:
                row[mode.value] = _run(setting, mode, broker, work)
            if CollabMode.FEDAVG in modes:
                c, f = row["collaborative"], row["fedavg"]
                row["speedup"] = (f["time_to_target_s"] / c["time_to_target_s"]
                                  if c["time_to_target_s"] and f["time_to_target_s"] else None)
                row["idle_ratio"] = (c["server_idle_fraction"] / f["server_idle_fraction"]
                                     if f["server_idle_fraction"] else None)
                row["max_weight_gap"] = _weight_gap(c["weights"], f["weights"])
            results.append(row)
        if not args.no_dp:
            first = settings[0]
            dp = _run(replace(first, name=f"{first.name}-dp", target=0.80),
                      CollabMode.COLLABORATIVE, broker, work,
                      PrivacySettings(noise_multiplier=1.0, max_grad_norm=1.0, delta=1e-5))
            dp.update(setting=first.name, noise_multiplier=1.0, max_grad_norm=1.0, delta=1e-5)
    finally:
        broker.cleanup()
    speedups = [r["speedup"] for r in results if r.get("speedup")]
    report = {
        "benchmark": "collab", "devices": settings[0].devices, "device_profile": DEVICE.name,
        "server_profile": SERVER.name, "loadavg_start": load_start,
        "loadavg_end": os.getloadavg(), "configurations": results,
        "median_speedup": statistics.median(speedups) if speedups else None,
        "idle_halved_in": sum(1 for r in results if r.get("idle_ratio") is not None
                              and r["idle_ratio"] <= 0.5),
        "dp": dp,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    for row in results:
        for mode in modes:
            row[mode.value].pop("weights", None)
    if dp is not None:
        dp.pop("weights", None)
    out.write_text(json.dumps(report, indent=2) + "\n")
    _plot(results, dp, out.with_suffix(".png"))
    print(json.dumps(report))


if __name__ == "__main__":
    main()
