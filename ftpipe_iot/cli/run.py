"""``broker``, ``device``, ``controller`` and ``demo``: parse arguments, call the library."""

from __future__ import annotations

import json
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import click

from ftpipe_iot.cli.collab import collab_choices, collab_options
from ftpipe_iot.cli.options import (
    AUTO,
    INSECURE_WARNING,
    TRAINING_NAMES,
    auto_fields,
    codec_policy,
    command,
    connection_options,
    credentials,
    explicit,
    identity,
    parse_assignment,
    process_options,
    signing_options,
    train_config,
    training_options,
)
from ftpipe_iot.planning.layouts import Layout
from ftpipe_iot.planning.replication import DEFAULT_BUDGET
from ftpipe_iot.protocol.plan import StageAssignment, TrainConfig
from ftpipe_iot.protocol.signing import Credentials
from ftpipe_iot.protocol.vocab import CollabMode


@command()
@click.option("--port", type=click.IntRange(1, 65535), default=1883, show_default=True)
@click.option("--bind", default="127.0.0.1", show_default=True)
@click.option("--data-dir", type=click.Path(file_okay=False), default=None,
              help="persistence directory (default: a temporary one)")
@click.option("--embedded", is_flag=True, help="use the embedded amqtt broker (MQTT 3.1.1)")
def broker(port: int, bind: str, data_dir: str | None, embedded: bool) -> None:
    """Run Mosquitto with the project's config in the foreground (Ctrl-C stops it)."""
    from ftpipe_iot.runtime.broker import BrokerKind, BrokerProcess

    kind = BrokerKind.EMBEDDED if embedded else None
    proc = BrokerProcess(port=port, bind=bind, kind=kind,
                         data_dir=Path(data_dir) if data_dir else None)
    proc.start()
    assert proc.kind is not None
    click.echo(f"{proc.kind.value} broker listening on {proc.url} (data in {proc.data_dir}); "
               "Ctrl-C to stop", err=True)
    try:
        while proc.proc is not None and proc.proc.poll() is None:
            time.sleep(0.5)
    except KeyboardInterrupt:
        pass
    finally:
        proc.cleanup()


@command()
@click.option("--name", default=None, help="device name (= MQTT client id and username)")
@click.option("--job", default=None, help="job name [default: the bundle's, else 'default']")
@click.option("--heartbeat-interval", type=click.FloatRange(min=0.05), default=1.0,
              show_default=True, help="seconds between heartbeats")
@click.option("--profile", "profile_file", type=click.Path(dir_okay=False), default=None,
              help="device profile (devices/profiles/*.json) emulating a slower device")
@click.option("--real-link", is_flag=True,
              help="the network enforces the profile's link cap (e.g. a tbf-capped namespace): "
                   "declare it, do not sleep for it")
@click.option("--probe-when-idle/--no-probe-when-idle", default=True, show_default=True,
              help="while a plan leaves this device idle, train the model for a few "
                   "micro-batches of random data once and tell the controller how fast it was")
@click.option("--controller-name", default="controller", show_default=True,
              help="sender name the job's plans must carry")
@click.option("--allow-model-module", "allowed_modules", multiple=True, metavar="MODULE",
              help="module a plan's user model (MODULE:callable) may be imported from "
                   "(repeatable; also `allow_model_modules` in the bundle)")
@click.option("--data", "data", default=None, metavar="npz:PATH",
              help="collaborative/fedavg modes: train on this data, which never leaves the "
                   "device (an .npz with x and y; or digits/synthetic to try things out)")
@click.option("--server", is_flag=True,
              help="collaborative mode: offer to hold the server part of the model")
@connection_options
@signing_options
@process_options
def device(name: str | None, job: str | None, heartbeat_interval: float,
           profile_file: str | None, real_link: bool, probe_when_idle: bool,
           controller_name: str,
           allowed_modules: tuple[str, ...], data: str | None, server: bool, broker_url: str,
           config_file: str | None, mqtt_protocol: str, max_message_bytes: int, keepalive: int,
           signing_key: str | None, roster: str | None, insecure_unsigned: bool,
           metrics_port: int, threads: int, log_level: str) -> None:
    """Run a device agent: announce, take a stage from the plan, compute, report (with --data
    or --server: a data device or the server of the collaborative modes)."""
    from ftpipe_iot.device.agent import DeviceOptions
    from ftpipe_iot.planning.profiles import load_profile
    from ftpipe_iot.runtime.entry import ProcessOptions, run_device

    bundle = identity(broker_url, config_file, mqtt_protocol, max_message_bytes, keepalive, job)
    name = name or bundle.name
    if not name:
        raise click.UsageError("give --name or a --config bundle")
    profile = load_profile(profile_file) if profile_file else None
    process = ProcessOptions(metrics_port, threads, log_level)
    if data is not None or server:
        from ftpipe_iot.collab.agent import AgentOptions
        from ftpipe_iot.collab.entry import run_collab_device

        if data is not None and server:
            raise click.UsageError("--data and --server exclude each other")
        if not probe_when_idle:
            raise click.UsageError("--no-probe-when-idle is for pipeline devices: a device of "
                                   "the collaborative modes measures the model for the "
                                   "coordinator's plan; drop the option")
        keys = credentials(bundle, signing_key, roster, insecure_unsigned)
        sys.exit(run_collab_device(
            name, bundle.job, bundle.broker, process, data, server, profile,
            AgentOptions(heartbeat_interval, allowed_model_modules=(
                *bundle.allow_model_modules, *allowed_modules)), keys))
    options = DeviceOptions(heartbeat_interval_s=heartbeat_interval, controller=controller_name,
                            allowed_model_modules=(*bundle.allow_model_modules,
                                                   *allowed_modules),
                            emulate_link=not real_link, probe_when_idle=probe_when_idle)
    keys = credentials(bundle, signing_key, roster, insecure_unsigned)
    sys.exit(run_device(name, bundle.job, bundle.broker, process, options, profile, keys))


# Options only --mode pipeline implements: the collaborative modes refuse them, not ignore
# them. One table for `controller` and `demo` (each has a part of them).
_PIPELINE_ONLY = ("assignment", "checkpoint_dir", "device_names", "freeze_layers", "resiliency",
                  "layout", "trace_dir", "write_trace", "wire_codec", "replication_budget",
                  "cut_codecs", "codec_accuracy_budget", "evaluate_every")


@command()
@click.option("--job", default=None, help="job name [default: the bundle's, else 'default']")
@click.option("--devices", type=click.IntRange(min=1), default=3, show_default=True,
              help="devices to wait for")
@click.option("--device-names", default=None, help="comma-separated device names to use")
@click.option("--wait-devices", type=click.FloatRange(min=1), default=120.0, show_default=True,
              help="seconds to wait for the devices")
@click.option("--stall-timeout", type=click.FloatRange(min=1), default=30.0, show_default=True,
              help="recover when no progress for this many seconds (lost messages)")
@click.option("--heartbeat-timeout", type=click.FloatRange(min=0.1), default=5.0,
              show_default=True, help="a device silent this long is declared failed")
@click.option("--checkpoint-dir", type=click.Path(file_okay=False), default=None,
              help="also write every complete checkpoint version here (step-N.pt, the "
                   "--save-model format)")
@click.option("--resume", is_flag=True,
              help="continue the job from the retained plan, state and weights on the broker "
                   "(collaborative/fedavg: its job, plan, round and global model; the round "
                   "in progress is redone from its start)")
@click.option("--standby", is_flag=True,
              help="back up the job's controller: wait until its Last Will says it is gone, "
                   "then take over with a newer term and resume from the retained plan, state "
                   "and weights (start it with the leader's options, on another host)")
@click.option("--replication-budget", type=click.FloatRange(0, 1, max_open=True),
              default=DEFAULT_BUDGET, show_default=True,
              help="the share of training time replica uploads may take: the interval "
                   "grows from --replicate-every by powers of two (up to 32x) until the "
                   "slowest device's upload fits (0: always --replicate-every)")
@click.option("--repartition/--no-repartition", default=True, show_default=True,
              help="move layers between devices when that pays off")
@click.option("--repartition-threshold", type=click.FloatRange(0, 1, max_open=True),
              default=0.10, show_default=True, help="minimum predicted gain to repartition")
@click.option("--repartition-cooldown", type=click.IntRange(min=0), default=10,
              show_default=True, help="steps between repartitions")
@click.option("--assignment", default=None, metavar="DEV:START-END,...",
              help="pin the first plan, e.g. dev3:0-10,dev0*3+dev1:10-22 (stages in order; "
                   "+ makes a group, *W weighs a member's share, /D adds a warm standby)")
@click.option("--layout", type=click.Choice([x.value for x in Layout]), default="pipeline",
              show_default=True,
              help="new plans: one device per stage (pipeline), one stage held by every device "
                   "(data), or the fleet planner's data-parallel or hybrid plan when it predicts "
                   "a step 25% shorter than the best single pipeline, which it also regroups "
                   "once the model fitted to its steps says so (auto)")
@click.option("--init-from", type=click.Path(dir_okay=False), default=None,
              help="start from these weights: a --save-model checkpoint or a state dict of the "
                   "whole nn.Sequential (fine-tuning)")
@click.option("--save-model", type=click.Path(dir_okay=False), default=None,
              help="write the trained model here: a PyTorch checkpoint (.pt) that "
                   "`ftpipe-iot export` and `evaluate` read")
@click.option("--save-weights", type=click.Path(dir_okay=False), default=None,
              help="also write the trained layers as the project's .npz")
@click.option("--summary-json", type=click.Path(dir_okay=False), default=None,
              help="write the run summary here")
@click.option("--trace-dir", type=click.Path(file_okay=False), default=None,
              help="keep the run's timeline here (every device's spans; `ftpipe-iot trace` "
                   "reads it)")
@click.option("--stop-devices", is_flag=True, help="shut the devices down at the end")
@click.option("--json", "as_json", is_flag=True, help="print the summary as JSON on stdout")
@click.option("--train-config", "train_file", type=click.Path(dir_okay=False), default=None,
              help="training settings as a JSON file (instead of the training options)")
@connection_options
@signing_options
@process_options
@training_options
@collab_options
@click.pass_context
def controller(ctx: click.Context, job: str | None, devices: int, device_names: str | None,
               wait_devices: float, stall_timeout: float, heartbeat_timeout: float,
               checkpoint_dir: str | None, resume: bool, standby: bool, repartition: bool,
               repartition_threshold: float, repartition_cooldown: int, assignment: str | None,
               layout: str, init_from: str | None, save_model: str | None, save_weights: str | None,
               summary_json: str | None, trace_dir: str | None, replication_budget: float,
               stop_devices: bool,
               as_json: bool, train_file: str | None, broker_url: str, config_file: str | None,
               mqtt_protocol: str, max_message_bytes: int, keepalive: int,
               signing_key: str | None, roster: str | None, insecure_unsigned: bool,
               metrics_port: int, threads: int, log_level: str, **training: Any) -> None:
    """Run a job's controller: plan, feed data, collect losses, evaluate, snapshot."""
    from ftpipe_iot.cli.stops import end_with
    from ftpipe_iot.control.config import ControllerConfig
    from ftpipe_iot.observability.progress import default_progress

    bundle = identity(broker_url, config_file, mqtt_protocol, max_message_bytes, keepalive, job)
    config, bundle_name, job = bundle.broker, bundle.name or None, bundle.job
    names = tuple(n.strip() for n in device_names.split(",")) if device_names else ()
    if names and len(names) != devices:
        raise click.UsageError(f"--device-names lists {len(names)} devices, --devices is "
                               f"{devices}")
    # --wire-codec auto is how the cuts get their codecs, not a training setting: it may come
    # with a training config (whose global codec it leaves at none), as the demo passes it
    given = [name for name in explicit(ctx, TRAINING_NAMES)
             if not (name == "wire_codec" and training["wire_codec"] == AUTO)]
    if train_file and given:
        raise click.UsageError(f"--train-config and training options ({', '.join(given)}) "
                               "exclude each other")
    train = TrainConfig.load(train_file) if train_file else train_config(training)
    collab = collab_choices(ctx, training)
    if collab.pipeline:  # a combination the schedule refuses ends here, before anything starts
        _refuse_what_the_schedule_cannot_run(
            train, Layout(layout), devices, parse_assignment(assignment) if assignment else ())
    # only now: the process entry points import torch, seconds on a small device
    from ftpipe_iot.runtime.controller_entry import run_controller
    from ftpipe_iot.runtime.entry import ProcessOptions

    train = _auto_micro_batching(train, training, devices, collab.pipeline, Layout(layout),
                                 parse_assignment(assignment) if assignment else ())

    def keys() -> Credentials:
        """Asked once every other setting was checked: their errors come first."""
        return credentials(bundle, signing_key, roster, insecure_unsigned, publishes_roster=True)

    if not collab.pipeline:
        from ftpipe_iot.cli.collab import run_controller as run_collab

        return run_collab(collab, train, job, config, devices, wait_devices, heartbeat_timeout,
                          stall_timeout, stop_devices, save_weights, summary_json, as_json,
                          bundle_name, ProcessOptions(metrics_port, threads, log_level),
                          explicit(ctx, _PIPELINE_ONLY), keys,
                          save_model=Path(save_model) if save_model else None,
                          init_from=Path(init_from) if init_from else None, resume=resume,
                          standby=standby)
    ctrl_config = ControllerConfig(
        train=train, devices=devices, device_names=names,
        wait_devices_s=wait_devices, stall_timeout_s=stall_timeout,
        heartbeat_timeout_s=heartbeat_timeout,
        checkpoint_dir=Path(checkpoint_dir) if checkpoint_dir else None, resume=resume,
        repartition=repartition, repartition_threshold=repartition_threshold,
        repartition_cooldown_steps=repartition_cooldown,
        assignment=parse_assignment(assignment) if assignment else (), layout=Layout(layout),
        save_weights=Path(save_weights) if save_weights else None,
        save_model=Path(save_model) if save_model else None,
        init_from=Path(init_from) if init_from else None, stop_devices=stop_devices,
        trace_dir=Path(trace_dir) if trace_dir else None,
        replication_budget=replication_budget, codecs=codec_policy(training))
    process = ProcessOptions(metrics_port, threads, log_level)
    summary_path = Path(summary_json) if summary_json else None
    if standby:
        from ftpipe_iot.runtime.controller_entry import run_standby_controller

        keys()  # a missing key is said now, not when the leader fails
        summary = run_standby_controller(job, config, ctrl_config, process, default_progress(),
                                         keys, client_id=bundle_name, summary_path=summary_path)
    else:
        summary = run_controller(job, config, ctrl_config, process, default_progress(),
                                 client_id=bundle_name, summary_path=summary_path,
                                 credentials=keys())
    if summary is None:
        click.echo(f"job {job} ended under another controller; this one had nothing to do",
                   err=True)
        return
    if as_json:
        click.echo(summary.to_json(with_history=False))
    end_with(summary.error)


@command()
@click.option("--devices", type=click.IntRange(min=1, max=32), default=3, show_default=True)
@click.option("--broker", "broker_url", default=None,
              help="use this broker (mqtt://host:port) instead of starting one")
@click.option("--embedded-broker", is_flag=True,
              help="start the embedded amqtt broker instead of Mosquitto")
@click.option("--job", default="demo", show_default=True)
@click.option("--work-dir", type=click.Path(file_okay=False), default=None,
              help="keep logs, the summary and the report here "
                   "[default: runs/<job>-<YYYYmmdd-HHMMSS>]")
@click.option("--metrics-port-base", type=click.IntRange(min=0, max=65535), default=0,
              show_default=True,
              help="serve /metrics: the controller on this port, device i on port+1+i "
                   "(0 = off)")
@click.option("--fault", "faults", multiple=True, metavar="ACTION[:DEVICE]@step=N",
              help="inject a fault with real signals: kill:2@step=30, hang:1@step=50, "
                   "cont:1@step=60, join@step=40, broker-restart@step=70, "
                   "controller-restart@step=80, controller-kill@step=90; collaborative: "
                   "server-kill@round=2 (the serving server; @round=N: once N rounds are "
                   "done, @step=N: at iteration N) (repeatable)")
@click.option("--restart-devices", is_flag=True,
              help="start a device process again when it dies (as systemd would)")
@click.option("--standby-controller", is_flag=True,
              help="start a second controller with --standby: when the leader dies (e.g. "
                   "--fault controller-kill@step=N) it takes over and resumes exactly")
@click.option("--standby-server", is_flag=True,
              help="collaborative: start a second server that stands by warm and takes over "
                   "when the serving one dies (--fault server-kill@round=N); the same as "
                   "--standby-servers 1")
@click.option("--max-message-bytes", type=click.IntRange(min=1024), default=None,
              help="largest MQTT message (larger payloads are chunked); at most the broker's "
                   "limit")
@click.option("--init-from", type=click.Path(dir_okay=False, exists=True), default=None,
              help="start from these weights (a model.pt of an earlier run, or a state dict)")
@click.option("--save-model", type=click.Path(dir_okay=False), default=None,
              help="write the trained model here (.pt) [default: model.pt in the work dir]")
@click.option("--layout", type=click.Choice([x.value for x in Layout]), default="auto",
              show_default=True,
              help="the controller's --layout: auto uses stage groups when the fleet planner "
                   "predicts them faster than one device per stage")
@click.option("--replication-budget", type=click.FloatRange(0, 1, max_open=True),
              default=DEFAULT_BUDGET, show_default=True,
              help="the controller's --replication-budget: the share of training time "
                   "replica uploads may take (0: always --replicate-every)")
@click.option("--json", "as_json", is_flag=True,
              help="print the summary as one JSON object on the last line of stdout")
@click.option("--trace", "write_trace", is_flag=True,
              help="also write the run's timeline as trace.json (Chrome trace-event JSON for "
                   "Perfetto); the timeline is recorded either way (`ftpipe-iot trace WORK_DIR`)")
@click.option("--partition", default="iid", show_default=True,
              help="collaborative/fedavg: split the training data among the devices: iid or "
                   "dirichlet:ALPHA (non-IID)")
@click.option("--device-profile", type=click.Path(dir_okay=False, exists=True), default=None,
              help="collaborative/fedavg: profile of every data device")
@click.option("--server-profile", type=click.Path(dir_okay=False, exists=True), default=None,
              help="collaborative: profile of the server")
@click.option("--insecure-unsigned", is_flag=True,
              help="run every process without signing or verifying messages (debugging only; "
                   "by default the demo makes keys in its work dir and signs everything)")
@training_options
@collab_options
@click.pass_context
def demo(ctx: click.Context, devices: int, broker_url: str | None, embedded_broker: bool,
         job: str, work_dir: str | None, metrics_port_base: int, faults: tuple[str, ...],
         restart_devices: bool, standby_controller: bool, standby_server: bool,
         max_message_bytes: int | None,
         init_from: str | None,
         save_model: str | None, layout: str, as_json: bool, write_trace: bool, partition: str,
         device_profile: str | None, server_profile: str | None, insecure_unsigned: bool,
         replication_budget: float, **training: Any) -> None:
    """Train the CNN on digits with a broker, a controller and N device processes (with --mode
    collaborative or fedavg: N data devices, each with its share of the digits)."""
    from ftpipe_iot.cli.stops import end_failed, end_interrupted
    from ftpipe_iot.runtime.demo import Demo, DemoOptions, JobFailed
    from ftpipe_iot.runtime.faults import FaultAction, fault_schedule

    if broker_url and embedded_broker:
        raise click.UsageError("--broker and --embedded-broker exclude each other")
    if insecure_unsigned:
        click.echo(INSECURE_WARNING, err=True)
    collab = collab_choices(ctx, training)
    if standby_server:
        if collab.mode is not CollabMode.COLLABORATIVE:
            raise click.UsageError("--standby-server needs --mode collaborative")
        if collab.standby_servers:
            raise click.UsageError("--standby-server and --standby-servers exclude each other")
        collab = replace(collab, standby_servers=1)
    if collab.pipeline:  # a combination the schedule refuses ends here, before anything starts
        _refuse_what_the_schedule_cannot_run(train_config(training), Layout(layout), devices)
    train = _auto_micro_batching(train_config(training), training, devices, collab.pipeline,
                                 Layout(layout))
    if not collab.pipeline:
        from ftpipe_iot.cli.collab import run_demo as run_collab_demo

        refused = explicit(ctx, _PIPELINE_ONLY)
        if refused:
            raise click.UsageError(f"{', '.join('--' + n.replace('_', '-') for n in refused)}"
                                   " apply to --mode pipeline only")
        return run_collab_demo(collab, train, devices, job, broker_url,
                               embedded_broker, work_dir, metrics_port_base, partition,
                               device_profile, server_profile, as_json,
                               signed=not insecure_unsigned, restart_devices=restart_devices,
                               save_model=Path(save_model) if save_model else None,
                               init_from=Path(init_from) if init_from else None,
                               faults=faults, standby_controller=standby_controller)
    # The training config the controller gets holds one global codec; how the cuts get theirs
    # (auto, pinned) is the controller's policy: checked here, passed on as its options.
    codecs = codec_policy(training)
    codecs.check(train.wire_codec, ())
    if (partition != "iid" or device_profile or server_profile):
        raise click.UsageError("--partition, --device-profile and --server-profile need "
                               "--mode collaborative or fedavg")
    schedule = fault_schedule(list(faults), devices)
    if broker_url and any(f.action is FaultAction.BROKER_RESTART for f in schedule):
        raise click.UsageError("broker-restart needs the demo's own broker (no --broker)")
    if embedded_broker and any(f.action is FaultAction.BROKER_RESTART for f in schedule):
        raise click.UsageError("broker-restart needs Mosquitto: the embedded broker keeps "
                               "nothing across a restart")
    options = DemoOptions(devices=devices, job=job, broker_url=broker_url,
                          embedded=embedded_broker, train=train,
                          work_dir=Path(work_dir) if work_dir else None,
                          metrics_port_base=metrics_port_base, faults=schedule,
                          restart_devices=restart_devices,
                          standby_controller=standby_controller,
                          max_message_bytes=max_message_bytes,
                          save_model=Path(save_model) if save_model else None,
                          layout=Layout(layout), signed=not insecure_unsigned,
                          write_trace=write_trace,
                          controller_args=[
                              *(["--init-from", str(Path(init_from).resolve())]
                                if init_from else []),
                              "--replication-budget", str(replication_budget),
                              *(["--wire-codec", AUTO, "--codec-accuracy-budget",
                                 str(codecs.budget_points)] if codecs.auto else [])])
    try:
        summary = Demo(options).run()
    except KeyboardInterrupt as exc:
        end_interrupted(exc, as_json)
    except JobFailed as exc:
        end_failed(exc, as_json)
    click.echo(_summary_text(summary), err=as_json)
    if "report_png" in summary:
        click.echo(f"report: {summary['report_png']} and {summary['report_json']}", err=True)
    elif "report_error" in summary:
        click.echo(f"no report: {summary['report_error']}", err=True)
    if "model" in summary:
        click.echo(f"model: {summary['model']} (ftpipe-iot evaluate / export read it)", err=True)
    if "trace" in summary:
        click.echo(f"trace: {summary['trace']} (open it in https://ui.perfetto.dev)", err=True)
    elif "trace_error" in summary:
        click.echo(f"no trace: {summary['trace_error']}", err=True)
    if as_json:
        summary.pop("history", None)
        click.echo(json.dumps(summary))


def _refuse_what_the_schedule_cannot_run(train: TrainConfig, layout: Layout, devices: int,
                                         assignment: tuple[StageAssignment, ...] = ()) -> None:
    """Ask the job's schedule whether it runs what the options request (``Schedule.supports``)
    and raise its refusal, which names the option to change, before any process starts."""
    from ftpipe_iot.control.config import schedule_refusal

    refusal = schedule_refusal(train, layout, devices, assignment)
    if refusal is not None:
        raise refusal.error()


def _auto_micro_batching(train: TrainConfig, training: dict[str, Any], devices: int,
                         pipeline: bool, layout: Layout = Layout.PIPELINE,
                         assignment: tuple[StageAssignment, ...] = ()) -> TrainConfig:
    """Replace ``auto`` micro-batching values by the chosen ones (and say what was chosen):
    for the pinned assignment's stages, ``--layout data``'s group, else ``devices`` stages."""
    auto_m, auto_b = auto_fields(training)
    if not (auto_m or auto_b):
        return train
    if not pipeline:
        raise click.UsageError("--micro-batches/--micro-batch-size auto are for --mode "
                               "pipeline; the collaborative modes choose with "
                               "--auto-micro-batches")
    from ftpipe_iot.control.job import choose_job_micro_batching, describe_holders

    train, choice = choose_job_micro_batching(train, devices, auto_m, auto_b, layout=layout,
                                              assignment=assignment)
    click.echo(f"micro-batching: {choice.micro_batches} micro-batches of "
               f"{choice.micro_batch_size} (predicted {choice.samples_per_s:.1f} samples/s on "
               f"{describe_holders(devices, layout, assignment, train.resiliency)}, "
               f"{train.schedule.value} schedule)", err=True)
    return train


def _summary_text(summary: dict) -> str:
    stages = ", ".join("+".join(d["device"] for d in s["devices"]) + f"=[{s['start']},{s['end']})"
                       for s in summary["stages"])
    text = (f"done: test accuracy {summary['test_accuracy']:.4f} after {summary['steps']} steps "
            f"({summary['epochs']} epochs), {summary['samples_per_s']:.0f} samples/s, "
            f"{summary['devices']} devices [{stages}], broker {summary['broker']}, "
            f"{summary['wall_s']:.1f} s")
    if summary.get("failures_detected") or summary.get("repartitions"):
        text += (f"; {summary.get('failures_detected', 0)} failures detected, "
                 f"{summary.get('recoveries', 0)} recoveries, "
                 f"{summary.get('repartitions', 0)} repartitions")
    return text


COMMANDS = [broker, device, controller, demo]
