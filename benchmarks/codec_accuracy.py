"""The accuracy each wire codec costs, measured (prints JSON; writes it, and with ``--write``
the planner's data file ``ftpipe_iot/planning/codec_costs.json``).

The demo's CNN on the handwritten digits, trained by the single-process simulator of the coded
wire (``core.reference``: exactly what a fleet computes with those codecs) on three stages, for
a few seeds: final test accuracy with every cut's activations coded (forward), every cut's
gradients coded (backward), and both, for fp16, int8 and int4, against the exact wire. The
accuracy cost of a codec in a direction is the mean over seeds of the drop in test accuracy,
in points (a negative mean is noise in the codec's favour). The planner charges that figure to
every cut it codes that way (``planning.codec_choice``): a conservative sum, since the figure
was measured with every cut coded.

    python benchmarks/codec_accuracy.py [--epochs 8] [--seeds 0 1 2] [--ways forward backward]
        [--write]
    python benchmarks/codec_accuracy.py --from-log A.log B.log --write  # merge shards
    python benchmarks/codec_accuracy.py --model mobilenetv2 --epochs 4 --cuts 5 6 7 8 16 \
        --codecs int8 --ways both --seeds 0 1 2 3 4  # fleet L8's model, data and cuts

``--model mobilenetv2`` is fleet L8's job (``benchmarks/links_l8.py``): full-width MobileNetV2 on
the digits upscaled to 3 x 32 x 32, 4 micro-batches of 8 at its learning rate; ``--cuts`` are the
first layers of the stages after the first (default: the int8 run's six stages). The planner's
figures (``--write``) come from the CNN only.

Every run prints ``seed S VARIANT: ACCURACY`` on stderr as it ends; ``--from-log`` aggregates
such lines (of shards run in parallel, one seed each) instead of training.
"""

from __future__ import annotations

import argparse
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from benchmarks.harness import write_results  # noqa: E402
from ftpipe_iot.core.data import Dataset, DataSpec, load_dataset  # noqa: E402
from ftpipe_iot.core.models import ModelSpec, build_layers  # noqa: E402
from ftpipe_iot.core.reference import train_reference  # noqa: E402
from ftpipe_iot.core.schedule import SyncSchedule  # noqa: E402
from ftpipe_iot.planning.codec_costs import COSTS_FILE  # noqa: E402
from ftpipe_iot.protocol.codecs import bytes_per_value  # noqa: E402
from ftpipe_iot.protocol.plan import CutCodecs, TrainConfig  # noqa: E402
from ftpipe_iot.protocol.vocab import CutDirection, WireCodec  # noqa: E402

CUTS = {"cnn": (5, 9),  # the CNN's 12 layers as three stages: [0, 5) [5, 9) [9, 12)
        # fleet L8's int8 run: [0, 5) a1, [5, 6) b3, [6, 7) b2, [7, 8) b1, [8, 16) a0, [16, 22) b0
        "mobilenetv2": (5, 6, 7, 8, 16)}
CODED = (WireCodec.FP16, WireCodec.INT8, WireCodec.INT4)
WAYS = ("forward", "backward", "both")


def _codecs(codec: WireCodec, way: str) -> CutCodecs:
    forward = codec if way in ("forward", "both") else WireCodec.NONE
    backward = codec if way in ("backward", "both") else WireCodec.NONE
    return CutCodecs(forward, backward)


def _accuracy(config: TrainConfig, data: Dataset, states: list[dict[str, np.ndarray]]) -> float:
    layers = build_layers(config.model, data.input_shape, data.num_classes, config.seed)
    for layer, state in zip(layers, states, strict=True):
        layer.load_state_dict({k: torch.from_numpy(v) for k, v in state.items()})
        layer.eval()
    with torch.no_grad():
        logits = torch.nn.Sequential(*layers)(torch.from_numpy(data.x_test))
    return float((logits.argmax(dim=1).numpy() == data.y_test).mean())


def _train_all(args: argparse.Namespace, data: Dataset) -> dict[str, dict[int, float]]:
    runs: dict[str, dict[int, float]] = {}
    for seed in args.seeds:
        config = TrainConfig(model=ModelSpec(args.model), micro_batches=4, micro_batch_size=8,
                             seed=seed, epochs=args.epochs, lr=args.lr)
        steps = SyncSchedule(len(data.x_train), config.micro_batches, config.micro_batch_size,
                             seed).total_steps(args.epochs, None)
        variants = [("none", CutCodecs())] + [(f"{codec.value}/{way}", _codecs(codec, way))
                                              for codec in args.codecs for way in args.ways]
        for name, codecs in variants:
            started = time.perf_counter()
            states = train_reference(config, data, steps, cuts=args.cuts,
                                     cut_codecs=(codecs,) * len(args.cuts))
            runs.setdefault(name, {})[seed] = _accuracy(config, data, states)
            print(f"seed {seed} {name}: {runs[name][seed]:.4f}", file=sys.stderr, flush=True)
            print(f"  ({steps} steps in {time.perf_counter() - started:.0f} s)", file=sys.stderr,
                  flush=True)
    return runs


def _from_logs(paths: list[Path]) -> dict[str, dict[int, float]]:
    """The ``seed S VARIANT: ACCURACY`` lines of shard logs (``_train_all``'s stderr)."""
    runs: dict[str, dict[int, float]] = {}
    for path in paths:
        for line in path.read_text().splitlines():
            match = re.fullmatch(r"seed (\d+) (\S+): ([0-9.]+)", line.strip())
            if match:
                runs.setdefault(match[2], {})[int(match[1])] = float(match[3])
    # a seed counts only where every variant the planner reads ran (a shard stopped midway is
    # left out); "both" is reported where it was run
    complete = set.intersection(*(set(v) for name, v in runs.items()
                                  if not name.endswith("/both")))
    return {name: {s: a for s, a in by_seed.items() if s in complete}
            for name, by_seed in runs.items()}


def _dataset(model: str, work: Path) -> tuple[Dataset, str]:
    """The job's data and its name: the digits for the CNN, upscaled for MobileNetV2."""
    if model == "cnn":
        return load_dataset(DataSpec("digits")), "digits"
    from benchmarks.speed import upscaled_digits
    return load_dataset(DataSpec(f"npz:{upscaled_digits(work)}")), "digits upscaled to 3x32x32"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=sorted(CUTS), default="cnn")
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--cuts", type=int, nargs="+", default=None,
                        help="first layer of every stage but the first (default: per model)")
    parser.add_argument("--codecs", nargs="+", type=WireCodec, default=list(CODED),
                        choices=list(CODED), metavar="CODEC",
                        help="which codecs to measure against the exact wire (fp16 int8 int4)")
    parser.add_argument("--out", type=Path, default=None,
                        help="default benchmarks/results/codec_accuracy[-MODEL].json")
    parser.add_argument("--ways", nargs="+", choices=WAYS, default=list(WAYS),
                        help="which directions to code (forward and backward feed the planner)")
    parser.add_argument("--from-log", type=Path, nargs="+", default=None,
                        help="aggregate the per-run lines of these stderr logs, train nothing")
    parser.add_argument("--write", action="store_true",
                        help=f"also write the planner's figures to {COSTS_FILE} (CNN only)")
    args = parser.parse_args()
    if args.write and (args.model != "cnn" or set(args.codecs) != set(CODED)):
        parser.error("--write takes the planner's figures from the CNN with every codec: drop "
                     "--model and --codecs, or drop --write")
    args.cuts = tuple(args.cuts or CUTS[args.model])
    suffix = "" if args.model == "cnn" else f"-{args.model}"
    out = args.out or Path(f"benchmarks/results/codec_accuracy{suffix}.json")
    with tempfile.TemporaryDirectory() as work:
        data, data_name = _dataset(args.model, Path(work))
        started = time.perf_counter()
        runs = _from_logs(args.from_log) if args.from_log else _train_all(args, data)
    seeds = sorted(runs["none"])
    ways = [w for w in WAYS
            if all(set(seeds) <= set(runs.get(f"{c.value}/{w}", {})) for c in args.codecs)]
    base = [runs["none"][s] for s in seeds]
    cost = {way: {codec.value: round(100 * statistics.fmean(
        runs["none"][s] - runs[f"{codec.value}/{way}"][s] for s in seeds), 3)
        for codec in args.codecs} for way in ways}
    # the spread of the seeds' paired drops: a mean inside it is noise of this test set
    spread = {way: {codec.value: [round(100 * (runs["none"][s] - runs[f"{codec.value}/{way}"][s]),
                                        2) for s in seeds]
                    for codec in args.codecs} for way in ways}
    command = "python benchmarks/codec_accuracy.py " + " ".join(sys.argv[1:])
    results = {
        "command": command.strip(),
        "model": args.model, "data": data_name, "cuts": list(args.cuts),
        "epochs": args.epochs, "lr": args.lr,
        "micro_batches": 4, "micro_batch_size": 8, "seeds": seeds,
        "test_samples": int(len(data.y_test)),
        "accuracy": {name: {"mean": statistics.fmean(by_seed[s] for s in seeds),
                            "per_seed": [by_seed[s] for s in seeds]}
                     for name, by_seed in runs.items() if set(seeds) <= set(by_seed)},
        "accuracy_cost_points": cost,
        "accuracy_cost_points_per_seed": spread,
        "bytes_per_value": {c.value: bytes_per_value(c) for c in WireCodec},
        "seconds": round(time.perf_counter() - started, 1),
    }
    if args.write:
        planner = {k: results[k] for k in ("command", "model", "data", "cuts", "epochs",
                                           "seeds", "test_samples")}
        planner["accuracy_none"] = statistics.fmean(base)
        planner["accuracy_cost_points"] = {d.value: cost[d.value] for d in CutDirection}
        planner["note"] = ("points of test accuracy lost per codec and direction, coded on "
                           "every cut, mean over the seeds; the planner charges each coded "
                           "cut the full figure")
        COSTS_FILE.write_text(__import__("json").dumps(planner, indent=2) + "\n")
        results["wrote"] = str(COSTS_FILE)
    write_results(results, out)


if __name__ == "__main__":
    main()
