"""``ftpipe-iot plan``: offline heterogeneity-aware plan of a model over a profiled fleet: stages,
the group of devices holding each stage and their shares (docs/design.md §7)."""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path

import click

from ftpipe_iot.cli.options import AUTO, COUNT_OR_AUTO, command
from ftpipe_iot.errors import PartitionError
from ftpipe_iot.planning.calibration import (
    MESSAGE_COST_PRIOR_S,
    Calibration,
    StepModel,
    last_calibration,
)
from ftpipe_iot.planning.codec_choice import (
    DEFAULT_BUDGET_POINTS,
    CodecChoice,
    StageHolders,
    choose_codecs,
    priced,
)
from ftpipe_iot.planning.codec_costs import CodecCosts
from ftpipe_iot.planning.group_search import (
    best_single_pipeline,
    data_parallel_plan,
    solve_groups,
)
from ftpipe_iot.planning.groups import GradientExchange, GroupPlan, evaluate_groups, exchange_for
from ftpipe_iot.planning.micro import (
    MicroBatching,
    MicroBatchingProblem,
    choose_micro_batching,
    scaled_costs,
)
from ftpipe_iot.planning.profiles import fleet_device_specs, load_profile
from ftpipe_iot.planning.replication import (
    DEFAULT_BUDGET,
    ReplicationChoice,
    choose_interval,
    planned_costs,
    replica_copies,
)
from ftpipe_iot.planning.resilience import ResilienceOption, resilience_options
from ftpipe_iot.planning.solver import DeviceSpec, LayerCosts, Partition, solve_partition
from ftpipe_iot.planning.stability import StabilityBounds, stale_fraction
from ftpipe_iot.protocol.codecs import bytes_per_value
from ftpipe_iot.protocol.vocab import DelayCompensation, OptimizerName, ScheduleName, WireCodec
from ftpipe_iot.schedules import JobOptions, PlanShape, schedule_for

_DEFAULT_MODEL_MICRO_BATCH = 32


def _model_costs(model: str, micro_batch_size: int) -> LayerCosts:
    # Imported here: the model registry pulls in torch, which planning from a costs file must not.
    try:
        from ftpipe_iot.core.models import profile_layer_costs
    except ImportError as exc:
        raise click.ClickException(
            f"--model needs ftpipe_iot.core.models.profile_layer_costs, which cannot be imported "
            f"({exc}); pass measured costs with --costs FILE instead") from exc
    try:
        data = profile_layer_costs(model, micro_batch_size)
    except (KeyError, ValueError) as exc:
        raise click.ClickException(f"cannot profile model {model!r}: {exc}") from exc
    return LayerCosts.from_dict({**data, "micro_batch_size": micro_batch_size})


def _rescaled(costs: LayerCosts, model: str | None, micro_batch_size: int) -> LayerCosts:
    """The costs at another micro-batch size: profiled again for a model, scaled for a file."""
    return _model_costs(model, micro_batch_size) if model is not None else \
        scaled_costs(costs, micro_batch_size)


def _model_input_bytes(model: str, micro_batch_size: int) -> float:
    # The built-in models' usual inputs (core.models.profile_layer_costs), fp32.
    shape = (3, 32, 32) if model == "mobilenetv2" else (1, 8, 8)
    return 4.0 * micro_batch_size * math.prod(shape)


def _stability_text(bounds: StabilityBounds, compensation: DelayCompensation) -> str:
    """Where async is expected to be stable at this learning rate, against sync."""
    mine = bounds.bound(ScheduleName.ASYNC, compensation)
    return (f"stable learning rates (SGD, momentum {bounds.momentum:g}): async with "
            f"--delay-compensation {compensation.value} converges while lr x curvature < "
            f"{mine:g} (predict {bounds.async_predict:g}, none {bounds.async_none:g}; sync "
            f"{bounds.sync:g}). At --lr {bounds.lr:g} that is the loss's largest curvature "
            f"below {mine / bounds.lr:.3g} (sync: {bounds.sync / bounds.lr:.3g}); it grows "
            f"during training (the digits CNN: 0.3 at the start, about 28 after two epochs "
            f"at lr 0.05), so async may need a smaller --lr than sync; for a curvature h it "
            f"needs --lr below {mine:g} / h. "
            + (f"The bound is for the first stage, which computes "
               f"{bounds.stale_fraction:.0%} of each step's micro-batches at the previous "
               f"version (1F1B's order); later stages fewer, the last stage none."
               if bounds.stale_fraction > 0 else
               "This plan has one stage: async computes every step at the newest weights "
               "there, as sync."))


def _resilience_table(options: list[ResilienceOption], source: str, micro_batches: int) -> str:
    base = options[0]
    lines = [f"resiliency trade-off for {source}, {micro_batches} micro-batches per step "
             "(predicted; a run reports wire_bytes_per_step and takeovers)",
             "r  holders per stage  devices  wire MiB/step  x r=0  compute s/step  samples/s"]
    for option in options:
        cost = option.cost
        ratio = cost.wire_bytes_per_step / base.cost.wire_bytes_per_step \
            if base.cost.wire_bytes_per_step else 1.0
        rate = option.throughput_samples_per_s
        lines.append(f"{cost.resiliency:<2} {'/'.join(map(str, cost.holders)):<18} "
                     f"{cost.devices:<8} {cost.wire_bytes_per_step / 2**20:<14.2f} "
                     f"{ratio:<6.2f} {cost.compute_s_per_step:<15.4f} "
                     f"{'inf' if math.isinf(rate) else f'{rate:.1f}'}")
    for option in options:
        for stage in option.stages:
            if option.cost.resiliency == options[-1].cost.resiliency:
                computing = [d for d in stage.devices if d not in stage.standbys]
                standby = f"; standbys {', '.join(stage.standbys)}" if stage.standbys else ""
                lines.append(f"  r={option.cost.resiliency} stage {stage.stage} layers "
                             f"[{stage.start}, {stage.end}): {', '.join(computing)}{standby}")
        if option.warning:
            lines.append(f"  r={option.cost.resiliency}: {option.warning}")
    return "\n".join(lines)


def _calibration(path: Path | None) -> Calibration | None:
    """The step model fitted in a run (its summary.json, or its run directory)."""
    if path is None:
        return None
    file = path / "summary.json" if path.is_dir() else path
    try:
        summary = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise click.UsageError(f"--calibration: cannot read a run summary from {file}: "
                               f"{exc}") from exc
    if not isinstance(summary, dict):
        raise click.UsageError(f"--calibration: {file} is not a run summary")
    found = last_calibration(summary)
    if found is None:
        raise click.UsageError(f"--calibration: {file} has no fitted step model (no plan of "
                               "that run ran the 10 steps a fit needs)")
    return found


def _step_model_text(modelled_s: float, closed_s: float, calibration: Calibration | None,
                     source: Path | None) -> str:
    """What the step model predicts for the plan, and how far it was off where it was fitted."""
    text = (f"step model: {modelled_s:.4f} s per step played out (the closed form above: "
            f"{closed_s:.4f} s)")
    if calibration is None:
        return text + (f"; not calibrated: {MESSAGE_COST_PRIOR_S * 1e3:.2f} ms a message, the "
                       "prior a controller plans its first plan with (--calibration RUN_DIR "
                       "fits it to a run's steps)")
    before = calibration.uncalibrated_error
    after = (calibration.measured_step_s / calibration.calibrated_step_s - 1.0
             if calibration.measured_step_s and calibration.calibrated_step_s else None)
    return (text + f", calibrated on {source}: {calibration.message_cost_s * 1e3:.2f} ms a "
            f"message; that run's plan was predicted {before:+.1%} off before the fit, "
            f"{after:+.1%} after" if before is not None and after is not None
            else text + f", calibrated on {source}: "
            f"{calibration.message_cost_s * 1e3:.2f} ms a message")


def _replication_text(choice: ReplicationChoice, sizes_known: bool) -> str:
    if not sizes_known:
        return (f"replication: every {choice.every} steps (the costs carry no param_bytes: "
                "replica sizes not known)")
    lines = [choice.describe()]
    for cost in choice.costs:
        rate = cost.upload_bytes_per_s
        link = "an uncapped link" if rate <= 0 or math.isinf(rate) else f"{rate / 1e6:.2f} MB/s"
        lines.append(f"  {cost.device}: replica {cost.replica_bytes / 1e6:.2f} MB, upload "
                     f"{cost.upload_s:.2f} s on {link}, {100 * choice.overhead(cost):.1f} % of "
                     f"the time between replications")
    return "\n".join(lines)


def _seconds(value: float) -> str:
    return "inf" if math.isinf(value) else f"{value:.6f}"


def _throughput(partition: Partition, micro_batch_size: int) -> float | None:
    value = partition.throughput_samples_per_s(micro_batch_size)
    return None if math.isinf(value) else value


def _rows(plan: GroupPlan) -> list[tuple[str, ...]]:
    rows = [("stage", "layers", "device", "share", "micro-batches", "compute_s", "comm_s",
             "time_s", "reduce_s", "memory_MiB")]
    for k, stage in enumerate(plan.stages):
        for i, m in enumerate(stage.members):
            first = i == 0
            rows.append((str(k) if first else "", f"[{stage.start}, {stage.end})" if first else "",
                         m.device, f"{m.share:.3f}", str(m.micro_batches), _seconds(m.compute_s),
                         _seconds(m.comm_s), _seconds(m.time_s), _seconds(m.reduce_s),
                         f"{stage.memory_bytes / 2**20:.1f}" if first else ""))
    return rows


def _rate(plan: GroupPlan) -> str:
    value = plan.throughput_samples_per_s
    return "unbounded (all costs are zero)" if math.isinf(value) else f"{value:.2f} samples/s"


def _table(plan: GroupPlan, source: str, unused: list[str], costs: LayerCosts,
           baselines: dict[str, GroupPlan | str]) -> str:
    rows = _rows(plan)
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = [f"plan for {source}, micro-batch size {plan.micro_batch_size}, "
             f"{plan.micro_batches} micro-batches per step, {costs.n_layers} layers, "
             f"{len(plan.stages)} stage(s), {len(plan.devices)} device(s)"]
    lines += ["  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip()
              for row in rows]
    k = plan.bottleneck_stage
    stage = plan.stages[k]
    lines.append(f"bottleneck: stage {k} ({', '.join(stage.devices)}), busy "
                 f"{_seconds(stage.busy_s)} s per step")
    lines.append(f"step: {_seconds(plan.step_s)} s for {plan.micro_batches} x "
                 f"{plan.micro_batch_size} samples (pipeline fill and drain, gradient exchange "
                 f"in groups)")
    lines.append(f"predicted throughput: {_rate(plan)}")
    if not costs.param_bytes:
        lines.append("note: the costs carry no param_bytes, so the gradient exchange inside "
                     "groups is counted as free")
    if unused:
        lines.append(f"unused devices (no gain from them): {', '.join(unused)}")
    if baselines:
        lines.append("same cost model, other plans:")
        for name, other in baselines.items():
            if isinstance(other, str):
                lines.append(f"  {name}: {other}")
                continue
            ratio = other.step_s / plan.step_s if plan.step_s else 1.0
            lines.append(f"  {name}: {_rate(other)}, {len(other.stages)} stage(s), "
                         f"{len(other.devices)} device(s); the chosen plan is {ratio:.2f}x as fast")
    return "\n".join(lines)


def _baselines(costs: LayerCosts, devices: list[DeviceSpec], micro_batches: int,
               micro_batch_size: int, exchange: GradientExchange) -> dict[str, GroupPlan | str]:
    found: dict[str, GroupPlan | str] = {
        "best single pipeline": best_single_pipeline(costs, devices, micro_batches,
                                                     micro_batch_size)}
    try:
        found["pure data parallelism"] = data_parallel_plan(costs, devices, micro_batches,
                                                            micro_batch_size, exchange=exchange)
    except PartitionError as exc:
        found["pure data parallelism"] = f"not possible ({exc})"
    return found


def _json_baseline(other: GroupPlan | str, chosen: GroupPlan) -> dict[str, object]:
    if isinstance(other, str):
        return {"error": other}
    return {**other.to_dict(), "chosen_speedup": other.step_s / chosen.step_s
            if chosen.step_s else None}


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
@click.option("--micro-batch-size", type=COUNT_OR_AUTO, default=None,
              help=f"Samples per micro-batch [--model default: {_DEFAULT_MODEL_MICRO_BATCH}; "
                   "--costs default: the file's micro_batch_size, else 1]; auto: chosen to "
                   "minimise the time per sample within every device's memory.")
@click.option("--at-step", type=click.IntRange(min=0), default=0, show_default=True,
              help="Evaluate the profiles' step schedules at this training step.")
@click.option("--at-time", type=click.FloatRange(min=0), default=0.0, show_default=True,
              help="Evaluate the profiles' time schedules at this many seconds.")
@click.option("--micro-batches", type=COUNT_OR_AUTO, default=4, show_default=True,
              help="Micro-batches per step; a group has at most this many members; auto: "
                   "chosen to minimise the time per sample (the sync bubble shrinks as it "
                   "grows, held activations grow with it), for the printed plan's groups "
                   "when it has some (at least one micro-batch per member).")
@click.option("--schedule", type=click.Choice([s.value for s in ScheduleName]), default="sync",
              show_default=True, help="the schedule --micro-batches/--micro-batch-size auto "
                                      "choose for (async drains once per --drain-every steps)")
@click.option("--lr", type=click.FloatRange(min=0, min_open=True), default=0.05,
              show_default=True, help="with --schedule async: the learning rate whose stable "
              "range to print")
@click.option("--momentum", type=click.FloatRange(0, 1, max_open=True), default=0.9,
              show_default=True, help="with --schedule async: SGD's momentum, for the range")
@click.option("--delay-compensation", type=click.Choice([c.value for c in DelayCompensation]),
              default="predict", show_default=True,
              help="with --schedule async: the compensation the job will run with")
@click.option("--replicate-every", "--drain-every", "drain_every", type=click.IntRange(min=1),
              default=10, show_default=True,
              help="the training's --replicate-every: the shortest replication interval, and "
                   "with --schedule async the steps between drains")
@click.option("--replication-budget", type=click.FloatRange(0, 1, max_open=True),
              default=DEFAULT_BUDGET, show_default=True,
              help="the controller's --replication-budget: print the replication interval "
                   "that keeps every replica upload within this share of the step time")
@click.option("--optimizer", type=click.Choice([o.value for o in OptimizerName]),
              default="sgd", show_default=True,
              help="what a replica holds besides the weights (SGD's momentum, Adam's moments)")
@click.option("--max-in-flight", type=click.IntRange(min=1), default=8, show_default=True,
              help="micro-batches in flight (their activations are held for backward)")
@click.option("--wire-codec", type=click.Choice([*(c.value for c in WireCodec), AUTO]),
              default="none", show_default=True,
              help="price the activations and gradients at the cuts as this codec puts them "
                   "on the wire (the training's --wire-codec); auto: choose per cut and "
                   "direction for the plan's layout and print the choice and why")
@click.option("--codec-accuracy-budget", type=click.FloatRange(min=0),
              default=DEFAULT_BUDGET_POINTS, show_default=True,
              help="--wire-codec auto: points of test accuracy the codecs may cost in all "
                   "(measured costs: ftpipe_iot/planning/codec_costs.json)")
@click.option("--exchange", type=click.Choice([e.value for e in GradientExchange]),
              default=None,
              help="What group members exchange: their float64 gradient sums (2 g float32 "
                   "copies of a stage's parameters per member; what a run does at "
                   "--resiliency 0) or every micro-batch's gradient (M copies; what a run does "
                   "at --resiliency >= 1, where holders take each other's over). Default: "
                   "what the run would do.")
@click.option("--calibration", "calibration_from", default=None,
              type=click.Path(exists=True, path_type=Path),
              help="A run's summary.json (or its run directory): play the plan's step out "
                   "with the per-message cost that run fitted, and print that run's prediction "
                   "error before and after the fit.")
@click.option("--compare", is_flag=True,
              help="Also show the best single pipeline and pure data parallelism.")
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
@click.option("--resiliency", type=click.IntRange(min=0), default=None,
              help="Predict the resiliency-vs-traffic trade-off for r = 0 .. R: layout with "
                   "warm standbys, bytes on the wire and compute per step, samples/s.")
@click.option("--input-bytes", type=click.FloatRange(min=0), default=None,
              help="--resiliency: bytes of one micro-batch of input [--model: known; --costs: "
                   "the first layer's output bytes, an estimate].")
def plan(model: str | None, costs_file: Path | None, profile_files: tuple[Path, ...],
         more_profiles: tuple[Path, ...], micro_batch_size: int | None, at_step: int,
         at_time: float, micro_batches: int, exchange: str | None, compare: bool,
         as_json: bool, mode: str, server_profiles: tuple[Path, ...], batch_size: int,
         aggregate_every: int, split_point: int | None, dp: bool, resiliency: int | None,
         input_bytes: float | None, schedule: str = "sync", drain_every: int = 10,
         max_in_flight: int = 8, lr: float = 0.05, momentum: float = 0.9,
         delay_compensation: str = "predict", wire_codec: str = "none",
         replication_budget: float = DEFAULT_BUDGET, optimizer: str = "sgd",
         calibration_from: Path | None = None,
         codec_accuracy_budget: float = DEFAULT_BUDGET_POINTS) -> None:
    """Plan stages for a model over devices given by profiles (ftpipe-iot plan --costs c.json
    --profiles a.json b.json): the number of stages, their layers, the group of devices of each
    stage and every member's share of the micro-batches, minimising the time per sample.

    Costs are per micro-batch: seconds of forward+backward on the reference device, bytes of each
    layer's output, bytes to hold each layer, optionally bytes of each layer's parameters
    (param_bytes, for the gradient exchange inside groups). The JSON keeps the one-device-per-
    stage minimum-bottleneck pipeline at the top level and puts the chosen plan in group_plan.
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
    auto_m, auto_b = micro_batches == AUTO, micro_batch_size == AUTO
    if auto_b:
        micro_batch_size = None  # profile at the default size, then choose
    if mode == "collaborative" and (auto_m or auto_b):
        raise click.UsageError("--mode collaborative chooses its own micro-batches")
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
    # auto lays the plan out for the exact wire, then chooses each cut's codecs for it
    codec = WireCodec.NONE if wire_codec == AUTO else WireCodec(wire_codec)
    costs = replace(costs, wire_factor=bytes_per_value(codec) / bytes_per_value(WireCodec.NONE))
    devices = fleet_device_specs(profiles, step=at_step, elapsed_s=at_time)
    if resiliency is not None:
        if auto_m or auto_b:
            raise click.UsageError("--resiliency predicts for a given --micro-batches and "
                                   "--micro-batch-size, not auto")
        if input_bytes is None:
            input_bytes = (_model_input_bytes(model, micro_batch_size) if model is not None
                           else costs.activation_bytes[0])
        options = resilience_options(costs, devices, micro_batches, micro_batch_size,
                                     input_bytes, range(resiliency + 1))
        click.echo(json.dumps([o.to_dict() for o in options], indent=2) if as_json
                   else _resilience_table(options, source, micro_batches))
        return
    partition = solve_partition(costs, devices)
    # this path plans the --resiliency 0 fleet (the trade-off table above prices r >= 1)
    how = GradientExchange(exchange) if exchange is not None else exchange_for(0)
    by_name = {d.name: d for d in devices}
    auto: MicroBatching | None = None
    def choose(stages: list[tuple[int, int]], holders: list) -> None:
        """``--micro-batches/--micro-batch-size auto`` for these stages and holders; the
        costs (and the partition on them) follow a new micro-batch size."""
        nonlocal auto, micro_batches, micro_batch_size, costs, partition
        problem = MicroBatchingProblem(
            costs, stages, holders, schedule=schedule_for(ScheduleName(schedule)),
            drain_every=drain_every, max_in_flight=max_in_flight, exchange=how)
        auto = choose_micro_batching(problem, None if auto_m else int(micro_batches),
                                     None if auto_b else micro_batch_size)
        micro_batches = auto.micro_batches
        if auto.micro_batch_size != micro_batch_size:
            costs = _rescaled(costs, model, auto.micro_batch_size)
            micro_batch_size = auto.micro_batch_size
            partition = solve_partition(costs, devices)

    if auto_m or auto_b:
        choose([(s.start, s.end) for s in partition.stages],
               [by_name[s.device] for s in partition.stages])
    assert isinstance(micro_batches, int) and isinstance(micro_batch_size, int)
    chosen = solve_groups(costs, devices, micro_batches, micro_batch_size, exchange=how)
    grouped = auto is not None and chosen.largest_group > 1 and \
        schedule_for(ScheduleName(schedule)).supports(
            PlanShape.of_members([[m.share for m in s.members] for s in chosen.stages]),
            JobOptions()) is None
    if grouped:
        # The printed plan has groups: choose again for its stages and members (the pipeline's
        # choice ignores that a group needs M >= its members and exchanges gradients), then
        # evaluate that same layout at the new choice.
        choose([(s.start, s.end) for s in chosen.stages],
               [tuple(by_name[name] for name in s.devices) for s in chosen.stages])
        chosen = evaluate_groups(chosen, costs, devices, micro_batches, micro_batch_size)
    codecs: CodecChoice | None = None
    baseline_costs = costs  # other layouts have other cuts: priced without the choice
    if wire_codec == AUTO:
        codecs = choose_codecs(costs, [StageHolders(s.start, s.end, tuple(
            (by_name[m.device], m.share) for m in s.members if m.share > 0))
            for s in chosen.stages], CodecCosts.load(), codec_accuracy_budget)
        costs = priced(costs, [s.start for s in chosen.stages[1:]], codecs.codecs)
        chosen = evaluate_groups(chosen, costs, devices, micro_batches, micro_batch_size)
    unused = [d.name for d in devices if d.name not in partition.devices]
    chosen_unused = [d.name for d in devices if d.name not in chosen.devices]
    baselines = (_baselines(baseline_costs, devices, micro_batches, micro_batch_size, how)
                 if compare
                 else {})
    calibration = _calibration(calibration_from)
    step_model = StepModel(calibration or Calibration.prior(), max_in_flight)
    modelled_s = step_model.step_s(chosen, costs, devices)
    replication = choose_interval(
        drain_every, replication_budget, chosen.step_s,
        planned_costs([(s.members[0].device, s.param_bytes) for s in chosen.stages],
                      {d.name: d.bandwidth_bytes_per_s for d in devices},
                      replica_copies(optimizer, momentum)))
    # the share of a step's micro-batches the first stage computes stale (async's bound)
    fraction = stale_fraction(ScheduleName(schedule), len(chosen.stages), micro_batches)
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
            "micro_batches": micro_batches,
            "param_bytes_known": bool(costs.param_bytes),
            "group_plan": {**chosen.to_dict(), "unused_devices": chosen_unused},
        }
        if auto is not None:
            report["micro_batching"] = {**auto.to_dict(), "schedule": schedule,
                                        "for": "group_plan" if grouped else "pipeline",
                                        "auto": [n for n, on in (("micro_batches", auto_m),
                                                                 ("micro_batch_size", auto_b))
                                                 if on]}
        report["replication"] = replication.to_dict()
        if codecs is not None:
            report["wire_codecs"] = codecs.to_dict()
        report["step_model"] = {"step_s": modelled_s, "closed_form_step_s": chosen.step_s,
                                "calibration": calibration.to_dict() if calibration else None}
        if schedule == ScheduleName.ASYNC.value:
            report["stability"] = {**StabilityBounds.at(lr, momentum, fraction).to_dict(),
                                   "delay_compensation": delay_compensation}
        if compare:
            report["compare"] = {
                "single_pipeline": _json_baseline(baselines["best single pipeline"], chosen),
                "data_parallel": _json_baseline(baselines["pure data parallelism"], chosen)}
        click.echo(json.dumps(report, indent=2))
    else:
        click.echo(_table(chosen, source, chosen_unused, costs, baselines))
        click.echo(_step_model_text(modelled_s, chosen.step_s, calibration, calibration_from))
        click.echo(_replication_text(replication, bool(costs.param_bytes)))
        if codecs is not None:
            click.echo("\n".join(codecs.describe()))
        if auto is not None:
            click.echo(f"micro-batching ({schedule}, auto): {auto.micro_batches} micro-batches "
                       f"of {auto.micro_batch_size}, predicted {auto.samples_per_s:.2f} "
                       f"samples/s on "
                       + ("the plan's stage groups; memory per stage (largest member) "
                          if grouped else "the one-device-per-stage pipeline; memory per stage ")
                       + ", ".join(f"{m / 2**20:.1f}" for m in auto.stage_memory_bytes)
                       + " MiB")
        if schedule == ScheduleName.ASYNC.value:
            click.echo(_stability_text(StabilityBounds.at(lr, momentum, fraction),
                                       DelayCompensation(delay_compensation)))


COMMANDS: list[click.Command] = [plan]
