"""``ftpipe-iot plan``: offline heterogeneity-aware partition of a model over a profiled fleet."""

from __future__ import annotations

import json
import math
from pathlib import Path

import click

from ftpipe_iot.cli.options import command
from ftpipe_iot.planning.profiles import fleet_device_specs, load_profile
from ftpipe_iot.planning.solver import LayerCosts, Partition, solve_partition

_DEFAULT_MODEL_MICRO_BATCH = 32


def _model_costs(model: str, micro_batch_size: int) -> LayerCosts:
    # Imported here: the model registry pulls in torch, which planning from a costs file must not.
    try:
        from ftpipe_iot.core.models import profile_layer_costs
    except ImportError as exc:
        raise click.ClickException(
            f"--model needs ftpipe_iot.models.profile_layer_costs, which cannot be imported "
            f"({exc}); pass measured costs with --costs FILE instead") from exc
    try:
        data = profile_layer_costs(model, micro_batch_size)
    except (KeyError, ValueError) as exc:
        raise click.ClickException(f"cannot profile model {model!r}: {exc}") from exc
    return LayerCosts.from_dict({**data, "micro_batch_size": micro_batch_size})


def _seconds(value: float) -> str:
    return "inf" if math.isinf(value) else f"{value:.6f}"


def _throughput(partition: Partition, micro_batch_size: int) -> float | None:
    value = partition.throughput_samples_per_s(micro_batch_size)
    return None if math.isinf(value) else value


def _table(partition: Partition, source: str, micro_batch_size: int, unused: list[str]) -> str:
    rows = [("stage", "device", "layers", "n", "compute_s", "comm_s", "time_s", "memory_MiB")]
    for k, s in enumerate(partition.stages):
        rows.append((str(k), s.device, f"[{s.start}, {s.end})", str(s.end - s.start),
                     _seconds(s.compute_s), _seconds(s.comm_s), _seconds(s.time_s),
                     f"{s.memory_bytes / 2**20:.1f}"))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = [f"plan for {source}, micro-batch size {micro_batch_size}, "
             f"{partition.stages[-1].end} layers, {len(partition.stages)} stage(s)"]
    lines += ["  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip()
              for row in rows]
    k = partition.bottleneck_stage
    throughput = _throughput(partition, micro_batch_size)
    lines.append(f"bottleneck: stage {k} ({partition.stages[k].device}), "
                 f"{_seconds(partition.bottleneck_s)} s per micro-batch")
    lines.append("predicted throughput: "
                 + ("unbounded (all costs are zero)" if throughput is None
                    else f"{throughput:.2f} samples/s"))
    if unused:
        lines.append(f"unused devices (no gain from them): {', '.join(unused)}")
    return "\n".join(lines)


@command("plan")
@click.option("--model", help="Built-in model to profile on this machine (needs torch).")
@click.option("--costs", "costs_file", type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help='JSON: {"layer_cost_s": [...], "activation_bytes": [...], '
                   '"layer_memory_bytes": [...], "micro_batch_size": N (optional)}.')
@click.option("--profiles", "profile_files", multiple=True,
              type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="Device profile JSON; the files right after it count too (one device each).")
@click.argument("more_profiles", nargs=-1,
                type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option("--micro-batch-size", type=click.IntRange(min=1), default=None,
              help=f"Samples per micro-batch [--model default: {_DEFAULT_MODEL_MICRO_BATCH}; "
                   "--costs default: the file's micro_batch_size, else 1].")
@click.option("--at-step", type=click.IntRange(min=0), default=0, show_default=True,
              help="Evaluate the profiles' step schedules at this training step.")
@click.option("--at-time", type=click.FloatRange(min=0), default=0.0, show_default=True,
              help="Evaluate the profiles' time schedules at this many seconds.")
@click.option("--json", "as_json", is_flag=True, help="Print the plan as JSON.")
@click.option("--mode", type=click.Choice(["pipeline", "collaborative"]), default="pipeline",
              show_default=True, help="collaborative: choose PiPar's split point and number of "
                                      "micro-batches for data devices (--profiles) and servers")
@click.option("--server-profile", "server_profiles", multiple=True,
              type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="collaborative: a server candidate's profile (repeatable)")
@click.option("--batch-size", type=click.IntRange(min=1), default=32, show_default=True,
              help="collaborative: samples per mini-batch (cut into micro-batches)")
@click.option("--aggregate-every", type=click.IntRange(min=1), default=10, show_default=True,
              help="collaborative: iterations per FedAvg round (model exchange)")
@click.option("--split-point", type=click.IntRange(min=1), default=None,
              help="collaborative: pin the split point")
@click.option("--dp", is_flag=True, help="collaborative: DP-SGD on the device part (it "
                                         "recomputes the front's forward)")
def plan(model: str | None, costs_file: Path | None, profile_files: tuple[Path, ...],
         more_profiles: tuple[Path, ...], micro_batch_size: int | None, at_step: int,
         at_time: float, as_json: bool, mode: str, server_profiles: tuple[Path, ...],
         batch_size: int, aggregate_every: int, split_point: int | None, dp: bool) -> None:
    """Plan stages for a model over devices given by profiles (ftpipe-iot plan --costs c.json
    --profiles a.json b.json): minimum-bottleneck split, device order and device choice.

    Costs are per micro-batch: seconds of forward+backward on the reference device, bytes of each
    layer's output, bytes to hold each layer.
    """
    if (model is None) == (costs_file is None):
        raise click.UsageError("give exactly one of --model NAME or --costs FILE")
    paths = [*profile_files, *more_profiles]
    if not paths:
        raise click.UsageError("give at least one device profile with --profiles FILE...")
    profiles = [load_profile(path) for path in paths]
    if mode == "collaborative":
        from ftpipe_iot.cli.collab import plan_collaborative

        return plan_collaborative(model, costs_file, profiles,
                                  [load_profile(p) for p in server_profiles], batch_size,
                                  aggregate_every, split_point, dp, as_json)
    if costs_file is not None:
        costs = LayerCosts.from_json_file(costs_file)
        source = str(costs_file)
        if micro_batch_size is None:
            micro_batch_size = costs.micro_batch_size or 1
        elif costs.micro_batch_size not in (None, micro_batch_size):
            raise click.UsageError(
                f"{costs_file} was measured at micro-batch size {costs.micro_batch_size}, "
                f"not {micro_batch_size}; costs do not scale linearly, re-profile instead")
    else:
        assert model is not None
        micro_batch_size = micro_batch_size or _DEFAULT_MODEL_MICRO_BATCH
        costs = _model_costs(model, micro_batch_size)
        source = f"model {model}"
    devices = fleet_device_specs(profiles, step=at_step, elapsed_s=at_time)
    partition = solve_partition(costs, devices)
    unused = [d.name for d in devices if d.name not in partition.devices]
    if as_json:
        report = {
            "source": source,
            "micro_batch_size": micro_batch_size,
            "n_layers": costs.n_layers,
            "devices": [{"name": d.name, "factor": d.factor,
                         "bandwidth_bytes_per_s": None if math.isinf(d.bandwidth_bytes_per_s)
                         else d.bandwidth_bytes_per_s,
                         "memory_bytes": None if math.isinf(d.memory_bytes) else d.memory_bytes}
                        for d in devices],
            **partition.to_dict(),
            "throughput_samples_per_s": _throughput(partition, micro_batch_size),
            "unused_devices": unused,
        }
        click.echo(json.dumps(report, indent=2))
    else:
        click.echo(_table(partition, source, micro_batch_size, unused))


COMMANDS: list[click.Command] = [plan]
