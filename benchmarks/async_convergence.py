"""Steps to a target test accuracy per schedule, over many seeds, in the single-process simulator
(prints JSON; writes it and a PNG).

The fleet's time to accuracy (``benchmarks/speed.py --only accuracy``) is steps to the target
times seconds per step. Its steps are deterministic per seed (fleet = simulator, the exactness
contract), so the simulator measures them for as many seeds as one likes, without the host's
speed in the figure: sync, async without delay compensation and async with prediction, the
test set evaluated every ``--evaluate-every`` steps (a drain point of every schedule, as on the
fleet), each stage's layers stale by their place in the fleet's split (``STAGES``). Per
variant: each seed's steps to ``--target``, the median, how many seeds reach it, and the final
accuracy; async's median steps over sync's is the factor its
samples/s must beat for async to reach the target sooner.

    python benchmarks/async_convergence.py [--model cnn] [--seeds 20] [--first-seed 0]
        [--epochs 8] [--evaluate-every 10] [--target 0.95]
        [--out benchmarks/results/async_convergence.json]
    python benchmarks/async_convergence.py --from-results A.json B.json --out C.json  # shards

The simulator runs one intra-op thread (the fleet's devices do; another count changes the last
bits), so shards of seeds (``--first-seed``) run side by side on a multi-core host and
``--from-results`` merges them.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from benchmarks.codec_accuracy import _dataset  # noqa: E402
from benchmarks.harness import save_figure, say, write_results  # noqa: E402
from ftpipe_iot.collab.parts import evaluate  # noqa: E402
from ftpipe_iot.core.data import Dataset  # noqa: E402
from ftpipe_iot.core.models import ModelSpec  # noqa: E402
from ftpipe_iot.core.reference import train_reference  # noqa: E402
from ftpipe_iot.core.schedule import SyncSchedule  # noqa: E402
from ftpipe_iot.protocol.plan import TrainConfig  # noqa: E402
from ftpipe_iot.protocol.vocab import DelayCompensation, ScheduleName  # noqa: E402

VARIANTS = {  # name -> (schedule, delay compensation), as benchmarks/speed.py names them
    "sync": (ScheduleName.SYNC, DelayCompensation.NONE),
    "async-none": (ScheduleName.ASYNC, DelayCompensation.NONE),
    "async-predict": (ScheduleName.ASYNC, DelayCompensation.PREDICT),
}
# The first layer of each stage on the fleet of benchmarks/speed.py --only accuracy (three
# devices, the split its layout chose): the CNN's [0, 5), [5, 9), [9, 12), MobileNetV2's
# [0, 4), [4, 11), [11, 22).
STAGES = {"cnn": (0, 5, 9), "mobilenetv2": (0, 4, 11)}


def accuracy(layers: Sequence[torch.nn.Module], data: Dataset) -> float:
    """Test accuracy of the live layers, in eval mode (what the fleet's evaluation computes)."""
    return evaluate(layers, data.x_test, data.y_test)[0]


def run(config: TrainConfig, data: Dataset, steps: int, stage_starts: tuple[int, ...]
        ) -> list[tuple]:
    """(steps done, test accuracy) at every evaluation of one simulated job."""
    evaluations: list[tuple] = []
    spe = SyncSchedule(len(data.x_train), config.micro_batches, config.micro_batch_size,
                       config.seed).steps_per_epoch

    def after_step(step: int, layers: Sequence[torch.nn.Module]) -> None:
        done = step + 1
        if done % spe == 0 or done == steps or done % config.evaluate_every == 0:
            evaluations.append((done, accuracy(layers, data)))

    timeline = [(0, stage_starts)] if config.schedule is ScheduleName.ASYNC else []
    train_reference(config, data, steps, stages_from=timeline, after_step=after_step)
    return evaluations


def summarise(runs: list[dict], target: float) -> dict:
    """Per variant: median steps to the target (a seed that never reaches it counts as
    infinitely slow), seeds reaching it, mean final accuracy; async's median over sync's."""
    out: dict = {}
    for variant in VARIANTS:
        mine = [r for r in runs if r["variant"] == variant]
        if not mine:
            continue
        steps = [r["steps_to_target"] if r["steps_to_target"] is not None else float("inf")
                 for r in mine]
        median = statistics.median(steps)
        out[variant] = {"median_steps_to_target": None if median == float("inf") else median,
                        "reached": sum(s != float("inf") for s in steps), "seeds": len(mine),
                        "mean_final_accuracy": round(float(np.mean(
                            [r["final_accuracy"] for r in mine])), 4)}
    sync = out.get("sync", {}).get("median_steps_to_target")
    for row in out.values():
        mine = row["median_steps_to_target"]
        row["steps_vs_sync"] = None if not sync or mine is None else round(mine / sync, 3)
    return out


def plot(runs: list[dict], path: Path, target: float) -> None:
    """Each seed's steps to the target per variant (a dot each, the median a bar)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    names = [v for v in VARIANTS if any(r["variant"] == v for r in runs)]
    for x, variant in enumerate(names):
        steps = [r["steps_to_target"] for r in runs if r["variant"] == variant]
        reached = [s for s in steps if s is not None]
        ax.scatter([x] * len(reached), reached, alpha=0.6)
        if reached:
            ax.hlines(statistics.median(reached), x - 0.3, x + 0.3, color="black")
        missed = len(steps) - len(reached)
        if missed:
            ax.annotate(f"{missed} never", (x, ax.get_ylim()[1]), ha="center", va="top")
    ax.set_xticks(range(len(names)), names)
    ax.set(ylabel=f"steps to {target:.2f} test accuracy",
           title=f"{runs[0]['model']}: steps to target, one dot per seed (simulator)")
    save_figure(fig, path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=sorted(STAGES), default="cnn")
    parser.add_argument("--seeds", type=int, default=20, help="how many seeds")
    parser.add_argument("--first-seed", type=int, default=0)
    parser.add_argument("--from-results", type=Path, nargs="+", default=None,
                        help="merge the runs of these result files instead of training")
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--momentum", type=float, default=0.9)
    parser.add_argument("--evaluate-every", type=int, default=10)
    parser.add_argument("--target", type=float, default=0.95)
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results" /
                        "async_convergence.json")
    args = parser.parse_args()
    if args.from_results:
        shards = [json.loads(path.read_text()) for path in args.from_results]
        merged = {**shards[0], "runs": sorted((r for shard in shards for r in shard["runs"]),
                                              key=lambda r: (r["seed"], r["variant"]))}
        merged["summary"] = summarise(merged["runs"], merged["target"])
        merged["merged_from"] = [str(path) for path in args.from_results]
        write_results(merged, args.out, lambda png: plot(merged["runs"], png, merged["target"]))
        return
    data, data_name = _dataset(args.model, Path(tempfile.mkdtemp(prefix="convergence-")))
    runs: list[dict] = []
    for seed in range(args.first_seed, args.first_seed + args.seeds):
        for variant in args.variants.split(","):
            schedule, compensation = VARIANTS[variant]
            config = TrainConfig(model=ModelSpec(args.model), micro_batches=4,
                                 micro_batch_size=8, seed=seed, epochs=args.epochs, lr=args.lr,
                                 momentum=args.momentum,
                                 schedule=schedule, delay_compensation=compensation,
                                 evaluate_every=args.evaluate_every)
            steps = SyncSchedule(len(data.x_train), 4, 8, seed).total_steps(args.epochs, None)
            started = time.perf_counter()
            evaluations = run(config, data, steps, STAGES[args.model])
            hit = next((done for done, acc in evaluations if acc >= args.target), None)
            runs.append({"model": args.model, "variant": variant, "seed": seed,
                         "steps_to_target": hit, "final_accuracy": evaluations[-1][1],
                         "evaluations": evaluations})
            say(f"seed {seed} {variant}: {hit} steps to {args.target} "
                f"({time.perf_counter() - started:.0f} s)")
    results = {"model": args.model, "data": data_name, "micro_batches": 4,
               "micro_batch_size": 8, "lr": args.lr, "momentum": args.momentum,
               "epochs": args.epochs,
               "evaluate_every": args.evaluate_every, "target": args.target,
               "stages": STAGES[args.model],
               "summary": summarise(runs, args.target), "runs": runs}
    write_results(results, args.out, lambda png: plot(runs, png, args.target))


if __name__ == "__main__":
    main()
