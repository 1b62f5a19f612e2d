"""Options of the collaborative and federated modes (``--mode``, FedAvg interval, split, DP) for
``controller`` and ``demo``, and turning them into the library's config (parsing only)."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from ftpipe_iot.cli.options import Decorator, _group, explicit
from ftpipe_iot.protocol.collab import PrivacySettings
from ftpipe_iot.protocol.plan import TrainConfig
from ftpipe_iot.protocol.vocab import CollabMode

if TYPE_CHECKING:
    from ftpipe_iot.collab.config import CollabConfig

_COLLAB: list[Decorator] = [
    click.option("--mode", type=click.Choice([m.value for m in CollabMode]), default="pipeline",
                 show_default=True,
                 help="pipeline: the controller feeds stages; collaborative: PiPar split "
                      "learning, data stays on the devices; fedavg: federated averaging"),
    click.option("--aggregate-every", type=click.IntRange(min=0), default=None,
                 help="collaborative/fedavg: FedAvg every K iterations [default: once per "
                      "epoch; 0 = only at the end]"),
    click.option("--split-point", type=click.IntRange(min=1), default=None,
                 help="collaborative: devices hold layers [0, P) and the head; the server "
                      "[P, head) [default: chosen from the profiles]"),
    click.option("--auto-micro-batches/--fixed-micro-batches", default=True, show_default=True,
                 help="collaborative: choose the number of micro-batches from the profiles, "
                      "or keep --micro-batches (the mini-batch is micro-batches x size)"),
    click.option("--dp-noise-multiplier", type=float, default=None,
                 help="DP-SGD on the device part (Opacus): Gaussian noise std / clipping "
                      "norm; turns DP on"),
    click.option("--dp-max-grad-norm", type=float, default=1.0, show_default=True,
                 help="DP-SGD: per-sample gradient clipping norm"),
    click.option("--dp-delta", type=float, default=1e-5, show_default=True,
                 help="DP-SGD: delta at which epsilon is reported"),
    click.option("--standby-servers", type=click.IntRange(0, 8), default=0, show_default=True,
                 help="collaborative: wait for this many --server offers besides the serving "
                      "one; they keep warm replicas and take over within the round when it "
                      "dies"),
]
_NAMES = ("mode", "aggregate_every", "split_point", "auto_micro_batches", "dp_noise_multiplier",
          "dp_max_grad_norm", "dp_delta", "standby_servers")
collab_options = _group(_COLLAB)
"""--mode and the options of the collaborative and fedavg modes."""

# The collaborative and fedavg demos' epochs unless --epochs is given: each data device sees
# only its share of the digits (a third with 3 devices), so an epoch is a third of the pipeline
# demo's updates; 15 epochs reach 0.986 test accuracy with 3 devices (6 ended at 0.83).
DEMO_EPOCHS = 15


@dataclass(frozen=True)
class CollabChoices:
    """The collaborative options as given."""

    mode: CollabMode
    aggregate_every: int | None
    split_point: int | None
    auto_micro_batches: bool
    privacy: PrivacySettings | None
    standby_servers: int = 0

    @property
    def pipeline(self) -> bool:
        return self.mode is CollabMode.PIPELINE


def collab_choices(ctx: click.Context, values: dict[str, Any]) -> CollabChoices:
    """Take the collaborative options out of ``values`` (a command's keyword arguments); options
    of these modes given with ``--mode pipeline`` are refused rather than ignored."""
    raw = {name: values.pop(name) for name in _NAMES}
    mode = CollabMode(raw["mode"])
    given = [n for n in explicit(ctx, _NAMES) if n != "mode"]
    if mode is CollabMode.PIPELINE and given:
        raise click.UsageError(f"{', '.join('--' + g.replace('_', '-') for g in given)} need "
                               "--mode collaborative or fedavg")
    privacy = None
    if raw["dp_noise_multiplier"] is not None:
        privacy = PrivacySettings(raw["dp_noise_multiplier"], raw["dp_max_grad_norm"],
                                  raw["dp_delta"])
    elif {"dp_max_grad_norm", "dp_delta"} & set(given):
        raise click.UsageError("--dp-max-grad-norm and --dp-delta need --dp-noise-multiplier "
                               "(which turns DP on)")
    return CollabChoices(mode, raw["aggregate_every"], raw["split_point"],
                         raw["auto_micro_batches"], privacy, raw["standby_servers"])


def collab_config(choices: CollabChoices, train: TrainConfig, devices: int, **settings: Any
                  ) -> CollabConfig:
    """The coordinator's config from the options."""
    from ftpipe_iot.collab.config import CollabConfig

    return CollabConfig(mode=choices.mode, train=train, devices=devices,
                        aggregate_every=choices.aggregate_every,
                        split_point=choices.split_point,
                        auto_micro_batches=choices.auto_micro_batches,
                        privacy=choices.privacy, standby_servers=choices.standby_servers,
                        **settings)


def print_summary(summary: dict, as_json: bool) -> None:
    """The demo's and controller's closing lines for these modes."""
    from ftpipe_iot.collab.summary import rounds_text, served_text

    collab = summary["collab"]
    members = collab["members"]
    eps = [m["epsilon"] for m in members.values() if m.get("epsilon") is not None]
    idle = collab.get("server_idle_fraction")
    where = (f"split [0,{collab['split_point']})+[{collab['head_start']},..) on the devices, "
             f"server {collab['server']}, {collab['micro_batches']} micro-batches"
             if collab["mode"] == CollabMode.COLLABORATIVE.value else "whole model on devices")
    text = (f"done ({collab['mode']}): test accuracy {summary['test_accuracy']:.4f} after "
            f"{summary['steps']} iterations in {collab['rounds']} rounds, "
            f"{summary['samples_per_s']:.0f} samples/s, {len(members)} data devices ({where})"
            + (f", server idle {idle:.0%}" if idle is not None else "")
            + (f", max epsilon {max(eps):.2f}" if eps else "")
            + (f", {collab['dropouts']} drop-outs" if collab["dropouts"] else "")
            + (f", {summary['wall_s']:.1f} s" if "wall_s" in summary else ""))
    click.echo(text, err=as_json)
    served = collab.get("round_servers") or []
    if collab.get("server_changes") or collab.get("standbys") or \
            any(len(s) > 1 for s in served):
        click.echo(f"served by: {served_text(served)}", err=as_json)
    for change in collab.get("server_changes", []):
        where = "" if change["round"] is None else f" in round {change['round'] + 1}"
        click.echo(f"server {change['from']} was lost ({change['cause']}){where}: "
                   f"{change['to']} took over", err=as_json)
    if collab.get("resumed_at_round") is not None:
        click.echo(f"the coordinator resumed the job at round {collab['resumed_at_round'] + 1}"
                   + (" (redone from its start)" if collab.get("redone_round") else ""),
                   err=as_json)
    for name, rounds in sorted(collab.get("left_out", {}).items()):
        why = summary.get("exited", {}).get(name)
        click.echo(f"{name} left out of {len(rounds)} of {collab['rounds']} rounds (rounds "
                   f"{rounds_text(rounds)})" + (f": it {why}" if why else ""), err=as_json)
    if "report_png" in summary:
        click.echo(f"report: {summary['report_png']} and {summary['report_json']}", err=True)
    if "model" in summary:
        click.echo(f"model: {summary['model']} (ftpipe-iot evaluate / export read it)", err=True)
    if as_json:
        summary.pop("history", None)
        click.echo(json.dumps(summary))


def run_demo(choices: CollabChoices, train: TrainConfig, devices: int, job: str,
             broker_url: str | None, embedded: bool, work_dir: str | None,
             metrics_port_base: int, partition: str, device_profile: str | None,
             server_profile: str | None, as_json: bool, signed: bool = True,
             restart_devices: bool = False, save_model: Path | None = None,
             init_from: Path | None = None, faults: tuple[str, ...] = (),
             standby_controller: bool = False) -> None:
    """``ftpipe-iot demo --mode collaborative|fedavg``."""
    from ftpipe_iot.cli.stops import end_failed, end_interrupted
    from ftpipe_iot.collab.data_split import PartitionSpec
    from ftpipe_iot.collab.demo import CollabDemo, CollabDemoOptions, collab_faults
    from ftpipe_iot.errors import FtpipeError
    from ftpipe_iot.runtime.demo import JobFailed

    if not explicit(click.get_current_context(), ("epochs",)):
        train = replace(train, epochs=DEMO_EPOCHS)
    try:
        schedule = collab_faults(list(faults), devices, choices.mode,
                                 choices.standby_servers)
    except FtpipeError as exc:
        raise click.UsageError(str(exc)) from None
    options = CollabDemoOptions(
        config=collab_config(choices, train, devices, save_model=save_model,
                             init_from=init_from), job=job,
        broker_url=broker_url,
        embedded=embedded, work_dir=Path(work_dir) if work_dir else None,
        metrics_port_base=metrics_port_base, partition=PartitionSpec.parse(partition),
        device_profile=Path(device_profile) if device_profile else None,
        server_profile=Path(server_profile) if server_profile else None, signed=signed,
        restart_devices=restart_devices, faults=schedule,
        standby_controller=standby_controller)
    try:
        summary = CollabDemo(options).run()
    except KeyboardInterrupt as exc:
        end_interrupted(exc, as_json)
    except JobFailed as exc:
        end_failed(exc, as_json)
    print_summary(summary, as_json)
    if summary.get("error"):
        raise click.ClickException(summary["error"])


def run_controller(choices: CollabChoices, train: TrainConfig, job: str, broker: Any,
                   devices: int, wait_devices: float, heartbeat_timeout: float,
                   stall_timeout: float, stop_devices: bool, save_weights: str | None,
                   summary_json: str | None, as_json: bool, client_id: str | None,
                   process: Any, pipeline_only: list[str],
                   credentials: Callable[[], Any] = lambda: None,
                   save_model: Path | None = None, init_from: Path | None = None,
                   resume: bool = False, standby: bool = False) -> None:
    """``ftpipe-iot controller --mode collaborative|fedavg``: the coordinator (``resume``:
    continue the job from what the broker retains; ``standby``: back up its coordinator)."""
    from ftpipe_iot.cli.stops import end_with
    from ftpipe_iot.collab.entry import run_coordinator, run_standby_coordinator
    from ftpipe_iot.observability.progress import default_progress

    if pipeline_only:
        raise click.UsageError(f"{', '.join('--' + n.replace('_', '-') for n in pipeline_only)}"
                               f" apply to --mode pipeline only")
    config = collab_config(choices, train, devices, wait_devices_s=wait_devices,
                           heartbeat_timeout_s=heartbeat_timeout,
                           stall_timeout_s=max(stall_timeout, 4 * heartbeat_timeout),
                           stop_devices=stop_devices,
                           save_weights=Path(save_weights) if save_weights else None,
                           save_model=save_model, init_from=init_from, resume=resume)
    summary_path = Path(summary_json) if summary_json else None
    if standby:
        credentials()  # a missing key is said now, not when the leader fails
        summary = run_standby_coordinator(config, job, broker, process, default_progress(),
                                          credentials, summary_path, client_id)
    else:
        summary = run_coordinator(config, job, broker, process, default_progress(),
                                  summary_path, client_id, credentials())
    if summary is None:
        click.echo(f"job {job} ended under another coordinator; this one had nothing to do",
                   err=True)
        return
    if as_json:
        click.echo(json.dumps(summary.to_dict(with_history=False)))
    end_with(summary.error)


def plan_collaborative(model: str | None, costs_file: Path | None, devices: list, servers: list,
                       batch: int, aggregate_every: int, split_point: int | None, private: bool,
                       as_json: bool) -> None:
    """``ftpipe-iot plan --mode collaborative``: the candidates and the choice."""
    from ftpipe_iot.collab.layer_times import plan_offline

    if model is None or costs_file is not None:
        raise click.UsageError("--mode collaborative profiles a model on this machine: give "
                               "--model NAME (forward and backward are needed apart, which a "
                               "--costs file does not have)")
    if not servers:
        raise click.UsageError("--mode collaborative needs at least one --server-profile")
    choice = plan_offline(model, devices, servers, batch, aggregate_every, split_point,
                          private=private)
    if as_json:
        click.echo(json.dumps({"model": model, "batch_size": batch,
                               "aggregate_every": aggregate_every, **choice.to_dict()},
                              indent=2))
        return
    rows = [("split", "device layers", "cut B/sample", "N", "PiPar N", "iteration_ms",
             "server_busy_ms", "server_idle")]
    for c in choice.candidates:
        rows.append((str(c.split_point), f"[0,{c.split_point})+[{c.head_start},..)",
                     str(c.cut_bytes), str(c.micro_batches), str(c.rule_micro_batches),
                     f"{c.iteration_s * 1e3:.2f}", f"{c.server_busy_s * 1e3:.2f}",
                     f"{c.server_idle_fraction:.0%}"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    chosen = choice.chosen
    click.echo(f"collaborative plan for model {model}, mini-batch {batch}, {len(devices)} data "
               f"devices, FedAvg every {aggregate_every} iterations")
    for row in rows:
        click.echo("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip())
    click.echo(f"choice: split point {chosen.split_point} (devices hold [0,{chosen.split_point}) "
               f"and [{chosen.head_start},..)), {chosen.micro_batches} micro-batches of "
               f"{batch // chosen.micro_batches}, server {choice.server}: predicted "
               f"{chosen.iteration_s * 1e3:.2f} ms per iteration")
    click.echo(f"fedavg baseline (whole model on every device): predicted "
               f"{choice.fedavg_iteration_s * 1e3:.2f} ms per iteration; predicted speed-up of "
               f"the collaborative mode: {choice.fedavg_iteration_s / chosen.iteration_s:.2f}x")


def print_status(status: dict) -> None:
    """The collaborative part of ``ftpipe-iot status``: round, split, per-device rounds, epsilon
    and idle fraction, the server's idle fraction."""
    idle = status.get("server_idle_fraction")
    standbys = status.get("standbys") or []
    split = (f"devices [0,{status['split_point']})+[{status['head_start']},..), server "
             f"{status['server']}"
             + (f" (standby {', '.join(standbys)})" if standbys else "")
             + f", {status['micro_batches']} micro-batches"
             if status["mode"] == CollabMode.COLLABORATIVE.value else "whole model on devices")
    click.echo(f"{status['mode']}: round {status['round']}/{status['rounds']}, iteration "
               f"{status['iteration']}/{status['iterations']}, {split}"
               + (f", server idle {idle:.0%}" if idle is not None else ""))
    click.echo(f"{'data device':<16}{'state':<10}{'rounds':>7}{'missed':>7}{'iteration':>10}"
               f"{'samples':>8}{'epsilon':>9}{'idle':>6}")
    for m in status["members"]:
        eps = "-" if m["epsilon"] is None else f"{m['epsilon']:.2f}"
        member_idle = "-" if m["idle_fraction"] is None else f"{m['idle_fraction']:.0%}"
        click.echo(f"{m['device']:<16}{m['state']:<10}{m['rounds_done']:>7}"
                   f"{m['rounds_missed']:>7}{m['iteration']:>10}{m['samples']:>8}{eps:>9}"
                   f"{member_idle:>6}")
