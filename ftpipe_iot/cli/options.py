"""Option groups shared by several commands, and turning their values into the library's config
objects (parsing only: every check of a value's meaning lives in the config classes)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import click

from ftpipe_iot.control.plan_codecs import CodecPolicy
from ftpipe_iot.errors import ConfigError, FtpipeError
from ftpipe_iot.planning.codec_choice import DEFAULT_BUDGET_POINTS
from ftpipe_iot.protocol.plan import Member, StageAssignment, TrainConfig, parse_cut_codecs
from ftpipe_iot.protocol.signing import Credentials
from ftpipe_iot.protocol.specs import DataSpec, ModelSpec
from ftpipe_iot.protocol.vocab import DelayCompensation, OptimizerName, ScheduleName, WireCodec
from ftpipe_iot.transport.connection import BrokerConfig, Bundle, load_bundle, parse_protocol

Decorator = Callable[[Callable[..., Any]], Callable[..., Any]]


class CliCommand(click.Command):
    """Every ``FtpipeError`` the command lets through becomes a one-line error (exit code 1):
    a user mistake never shows a traceback; anything else is a bug and keeps its traceback."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except FtpipeError as exc:
            raise click.ClickException(str(exc)) from None


class CliGroup(click.Group):
    """A command group whose commands are ``CliCommand``s."""

    command_class = CliCommand


def command(name: str | None = None, **settings: Any) -> Callable[[Callable[..., Any]],
                                                                    click.Command]:
    """``click.command`` for a ``CliCommand``."""
    return click.command(name, cls=CliCommand, **settings)


AUTO = "auto"


class CountOrAuto(click.ParamType):
    """A whole number >= 1, or ``auto`` (chosen from the measured costs, planning.micro)."""

    name = "N|auto"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None
                ) -> int | str:
        if isinstance(value, int) and not isinstance(value, bool):
            number = value
        elif str(value).strip().lower() == AUTO:
            return AUTO
        else:
            try:
                number = int(str(value))
            except ValueError:
                self.fail(f"{value!r} is neither a whole number nor 'auto'", param, ctx)
        if number < 1:
            self.fail(f"{number} is not >= 1", param, ctx)
        return number


COUNT_OR_AUTO = CountOrAuto()

_TRAINING: list[Decorator] = [
    click.option("--model", default="cnn", show_default=True,
                 help="mlp | cnn | mobilenetv2 | module:callable (returns nn.Sequential or a list "
                      "of modules)"),
    click.option("--model-width", type=click.FloatRange(min=0, min_open=True, max=4),
                 default=1.0, show_default=True,
                 help="channel width multiplier of mobilenetv2 (0.25 for small devices)"),
    click.option("--data", default="digits", show_default=True,
                 help="digits | synthetic | npz:PATH (arrays x and y)"),
    click.option("--data-shape", default="3,32,32", show_default=True,
                 help="sample shape of synthetic data, comma separated"),
    click.option("--data-classes", type=click.IntRange(min=2), default=None,
                 help="classes of synthetic data [default: 10] or of an npz file [default: its "
                      "largest label + 1]"),
    click.option("--data-samples", type=click.IntRange(min=4), default=2048, show_default=True,
                 help="samples of synthetic data"),
    click.option("--epochs", type=click.IntRange(min=1), default=6, show_default=True),
    click.option("--max-steps", type=click.IntRange(min=1), default=None,
                 help="stop after this many steps (evaluates at the end)"),
    click.option("--micro-batches", type=COUNT_OR_AUTO, default=4, show_default=True,
                 help="micro-batches per step (M); auto: chosen from the measured layer costs, "
                      "the number of stages and the schedule (see `ftpipe-iot plan`)"),
    click.option("--micro-batch-size", type=COUNT_OR_AUTO, default=8, show_default=True,
                 help="samples per micro-batch; auto: chosen like --micro-batches auto"),
    click.option("--optimizer", type=click.Choice([o.value for o in OptimizerName]),
                 default="sgd", show_default=True),
    click.option("--lr", type=click.FloatRange(min=0, min_open=True), default=0.05,
                 show_default=True),
    click.option("--momentum", type=click.FloatRange(0, 1, max_open=True), default=0.9,
                 show_default=True),
    click.option("--seed", type=int, default=0, show_default=True),
    click.option("--max-in-flight", type=click.IntRange(min=1), default=8, show_default=True,
                 help="micro-batches in flight at most (brokers drop beyond their queue limits)"),
    click.option("--wire-codec", type=click.Choice([*(c.value for c in WireCodec), AUTO]),
                 default="none", show_default=True,
                 help="code activations and their gradients on the wire, on every cut both "
                      "ways: fp16 (2x fewer bytes), int8 (3.8x) or int4 (7.1x), blockwise; "
                      "deterministic, so the fleet equals a single-process simulator of the "
                      "same codecs (weights and everything else go exact). auto: the planner "
                      "chooses per cut and direction from the links of the cut's two devices, "
                      "its bytes and --codec-accuracy-budget (`ftpipe-iot plan --wire-codec "
                      "auto` shows the choice)"),
    click.option("--codec-accuracy-budget", type=click.FloatRange(min=0),
                 default=DEFAULT_BUDGET_POINTS, show_default=True,
                 help="--wire-codec auto: points of test accuracy the chosen codecs may cost "
                      "in all, summed over the coded cuts and directions (costs measured by "
                      "benchmarks/codec_accuracy.py)"),
    click.option("--cut-codecs", default=None, metavar="FWD[/BWD],...",
                 help="pin each cut's codecs, one entry per cut of the --assignment: "
                      "forward/backward (int8/fp16) or one codec both ways, e.g. none,int8/fp16"),
    click.option("--no-compress", is_flag=True, help="never lz4-compress message bodies"),
    click.option("--replicate-every", type=click.IntRange(min=0), default=10, show_default=True,
                 help="replicate weights every R steps (0 = only at plan changes)"),
    click.option("--evaluate-every", type=click.IntRange(min=0), default=0, show_default=True,
                 help="also evaluate the test set every N steps within an epoch (0 = at "
                      "epoch ends only); under --schedule async each evaluation drains the "
                      "pipeline, so a multiple of --replicate-every adds no drain"),
    click.option("--freeze-layers", default=None, metavar="0-K",
                 help="keep layers [0, K) fixed: no gradients, no optimizer state, and "
                      "gradients stop at the first trainable stage"),
    click.option("--resiliency", type=click.IntRange(min=0), default=0, show_default=True,
                 help="failures each stage survives without rollback: r holders beyond the "
                      "first (group peers or warm standbys) take over late and lost "
                      "micro-batches; costs traffic (see `ftpipe-iot plan --resiliency`)"),
    click.option("--schedule", type=click.Choice([s.value for s in ScheduleName]),
                 default="sync", show_default=True,
                 help="sync drains the pipeline every step; 1f1b too, with at most one "
                      "micro-batch in flight per stage (PipeDream-Flush: sync's result, less "
                      "activation memory); async runs 1F1B across steps, each micro-batch "
                      "at the newest weights 1F1B's order lets exist (two versions at most), "
                      "draining only at replication points, evaluations and epoch ends"),
    click.option("--delay-compensation",
                 type=click.Choice([c.value for c in DelayCompensation]),
                 default="predict", show_default=True,
                 help="async only: predict computes each stale micro-batch at the weights its "
                      "update will reach (from the optimizer's momentum or Adam moments); "
                      "none computes it at the previous version, as PipeDream-2BW does"),
]
TRAINING_NAMES = ("model", "model_width", "data", "data_shape", "data_classes", "data_samples",
                  "epochs", "max_steps", "micro_batches", "micro_batch_size", "optimizer", "lr",
                  "momentum", "seed", "max_in_flight", "wire_codec", "no_compress",
                  "replicate_every", "evaluate_every", "freeze_layers", "resiliency", "schedule",
                  "delay_compensation")

_CONNECTION: list[Decorator] = [
    click.option("--broker", "broker_url", default="mqtt://127.0.0.1:1883", show_default=True,
                 help="mqtt://host:port or mqtts://host:port"),
    click.option("--config", "config_file", type=click.Path(dir_okay=False),
                 help="bundle file from `ftpipe-iot fleet add-device` (overrides --broker)"),
    click.option("--mqtt-protocol", default="auto", show_default=True,
                 type=click.Choice(["auto", "5", "3.1.1"])),
    click.option("--max-message-bytes", type=click.IntRange(min=1024), default=256 * 1024,
                 show_default=True, help="larger payloads are chunked"),
    click.option("--keepalive", type=click.IntRange(min=1), default=10, show_default=True,
                 help="MQTT keepalive seconds (the broker fires the Last Will after 1.5x)"),
]

_SIGNING: list[Decorator] = [
    click.option("--signing-key", type=click.Path(dir_okay=False), default=None,
                 help="this identity's Ed25519 private key (the bundle's, or the demo's keys/)"),
    click.option("--roster", type=click.Path(dir_okay=False), default=None,
                 help="the public keys of the job's identities (roster.json) to verify against"),
    click.option("--insecure-unsigned", is_flag=True,
                 help="neither sign nor verify messages (debugging only: anyone who can publish "
                      "on the broker can then steer the job)"),
]

INSECURE_WARNING = ("WARNING: --insecure-unsigned: messages are neither signed nor verified; "
                    "anyone who can publish on this broker can send this job plans, weights and "
                    "commands (docs/security.md)")

_PROCESS: list[Decorator] = [
    click.option("--metrics-port", type=click.IntRange(min=0, max=65535), default=0,
                 show_default=True, help="serve /metrics on this port (0 = off)"),
    click.option("--threads", type=click.IntRange(min=1), default=1, show_default=True,
                 help="torch intra-op threads"),
    click.option("--log-level", default="INFO", show_default=True,
                 type=click.Choice(["DEBUG", "INFO", "WARNING", "ERROR"], case_sensitive=False)),
]


def _group(options: list[Decorator]) -> Decorator:
    def attach(fn: Callable[..., Any]) -> Callable[..., Any]:
        for option in reversed(options):
            fn = option(fn)
        return fn

    return attach


training_options = _group(_TRAINING)
"""The training options shared by ``controller`` and ``demo``."""
connection_options = _group(_CONNECTION)
"""--broker/--config/--mqtt-protocol/--max-message-bytes/--keepalive."""
process_options = _group(_PROCESS)
"""--metrics-port/--threads/--log-level of a long-running process."""
signing_options = _group(_SIGNING)
"""--signing-key/--roster/--insecure-unsigned."""


def credentials(bundle: Bundle, signing_key: str | None, roster: str | None, insecure: bool,
                publishes_roster: bool = False) -> Credentials:
    """What the process signs with and verifies against: the options, else the bundle's files;
    unsigned only when asked (said loudly on stderr)."""
    key_file = signing_key or bundle.signing_key
    roster_file = roster or bundle.roster
    if insecure:
        if signing_key or roster:
            raise click.UsageError("--insecure-unsigned and --signing-key/--roster exclude "
                                   "each other")
        click.echo(INSECURE_WARNING, err=True)
        return Credentials.unsigned()
    if not key_file or not roster_file:
        missing = "--signing-key" if not key_file else "--roster"
        raise ConfigError(
            f"messages are signed and {missing} is missing: give --signing-key and --roster "
            "(or --config with a bundle from `ftpipe-iot fleet add-device`); "
            "--insecure-unsigned turns signing off for debugging")
    return Credentials.load(Path(key_file), Path(roster_file), publishes_roster)


def parse_shape(text: str) -> tuple[int, ...]:
    try:
        shape = tuple(int(part) for part in text.split(","))
    except ValueError as exc:
        raise click.BadParameter(f"{text!r} is not a comma-separated list of integers",
                                 param_hint="--data-shape") from exc
    if not shape or any(d < 1 for d in shape):
        raise click.BadParameter(f"{text!r}: every dimension must be >= 1",
                                 param_hint="--data-shape")
    return shape


def auto_fields(kw: dict[str, Any]) -> tuple[bool, bool]:
    """Whether --micro-batches and --micro-batch-size were given as ``auto``."""
    return kw["micro_batches"] == AUTO, kw["micro_batch_size"] == AUTO


def codec_policy(kw: dict[str, Any]) -> CodecPolicy:
    """How the cuts get their codecs (``--wire-codec auto``, ``--cut-codecs``); raises the
    library's errors for a bad ``--cut-codecs``."""
    return CodecPolicy(auto=kw["wire_codec"] == AUTO, budget_points=kw["codec_accuracy_budget"],
                       cuts=parse_cut_codecs(kw["cut_codecs"]) if kw["cut_codecs"] else ())


def train_config(kw: dict[str, Any]) -> TrainConfig:
    """The training config the training options describe (raises the library's errors). An
    ``auto`` value stands at its default here: ``control.job.choose_micro_batching`` replaces
    it with the chosen one."""
    auto_m, auto_b = auto_fields(kw)
    return TrainConfig(
        model=ModelSpec(kw["model"], width=kw["model_width"]),
        data=DataSpec(kw["data"], shape=parse_shape(kw["data_shape"]),
                      classes=kw["data_classes"], samples=kw["data_samples"]),
        micro_batches=4 if auto_m else kw["micro_batches"],
        micro_batch_size=8 if auto_b else kw["micro_batch_size"],
        optimizer=OptimizerName(kw["optimizer"]), lr=kw["lr"], momentum=kw["momentum"],
        seed=kw["seed"], epochs=kw["epochs"], max_steps=kw["max_steps"],
        max_in_flight=kw["max_in_flight"],
        # auto chooses per cut (``codec_policy``): the global codec stays none
        wire_codec=WireCodec.NONE if kw["wire_codec"] == AUTO else WireCodec(kw["wire_codec"]),
        compress=not kw["no_compress"], replicate_every=kw["replicate_every"],
        evaluate_every=kw["evaluate_every"],
        frozen_layers=parse_frozen(kw["freeze_layers"]), resiliency=kw["resiliency"],
        schedule=ScheduleName(kw["schedule"]),
        delay_compensation=DelayCompensation(kw["delay_compensation"]))


def parse_frozen(text: str | None) -> int:
    """``0-K`` -> K (layers [0, K) are fixed); only a prefix of the model can be frozen."""
    if not text:
        return 0
    start, _, end = text.partition("-")
    try:
        first, last = int(start), int(end)
    except ValueError as exc:
        raise click.BadParameter(f"{text!r} is not 0-K", param_hint="--freeze-layers") from exc
    if first != 0 or last < 1:
        raise click.BadParameter("only the first layers can be frozen: 0-K with K >= 1",
                                 param_hint="--freeze-layers")
    return last


def explicit(ctx: click.Context, names: tuple[str, ...]) -> list[str]:
    """Options among ``names`` the user gave on the command line (not defaults)."""
    return [name for name in names
            if ctx.get_parameter_source(name) is click.core.ParameterSource.COMMANDLINE]


def _weighted(text: str) -> tuple[str, float]:
    """``dev0*3`` -> ("dev0", 3.0); ``dev0`` -> ("dev0", 1.0)."""
    name, star, weight = text.partition("*")
    value = float(weight) if star else 1.0
    if not value > 0 or value == float("inf"):
        raise click.BadParameter(f"{text!r}: a member's weight must be a number > 0",
                                 param_hint="--assignment")
    return name.strip(), value


def parse_assignment(text: str) -> tuple[StageAssignment, ...]:
    """``dev3/dev4:0-10,dev0*3+dev1:10-22`` -> stage 0 on dev3 with dev4 as its warm standby,
    stage 1 on the group dev0 and dev1, dev0 taking 3 micro-batches for each of dev1's (shares
    are the weights over their sum; equal without weights)."""
    stages = []
    for index, part in enumerate(text.split(",")):
        try:
            devices, _, span = part.partition(":")
            start, _, end = span.partition("-")
            computing, _, spare = devices.partition("/")
            weighted = [_weighted(d) for d in computing.split("+")]
            standbys = [d.strip() for d in spare.split("+")] if spare else []
            if any(not name for name, _ in weighted) or any(not name for name in standbys):
                raise click.BadParameter("every stage needs device names",
                                         param_hint="--assignment")
            total = sum(weight for _, weight in weighted)
            members = tuple(Member(name, weight / total) for name, weight in weighted) + \
                tuple(Member(name, 0.0) for name in standbys)
            stages.append(StageAssignment(index, int(start), int(end), members))
        except ValueError as exc:
            raise click.BadParameter(
                f"{part!r} is not DEVICE[*WEIGHT][+DEVICE...][/STANDBY...]:START-END",
                param_hint="--assignment") from exc
    return tuple(stages)


def broker_settings(url: str, config_file: str | None, protocol: str, max_message: int,
                    keepalive: int, job: str | None) -> tuple[BrokerConfig, str | None, str]:
    """Broker settings, identity name and job from a bundle file or from the options."""
    bundle = identity(url, config_file, protocol, max_message, keepalive, job)
    return bundle.broker, bundle.name or None, bundle.job


def identity(url: str, config_file: str | None, protocol: str, max_message: int,
             keepalive: int, job: str | None) -> Bundle:
    """The bundle file's identity (its job overridden by ``job``), or one made of the options
    (with an empty name)."""
    if config_file:
        bundle = load_bundle(config_file)
        return replace(bundle, job=job or bundle.job)
    config = BrokerConfig.from_url(url, protocol=parse_protocol(protocol),
                                   max_message_bytes=max_message, keepalive_s=keepalive)
    return Bundle(name="", job=job or "default", broker=config)
