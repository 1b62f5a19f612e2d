"""Site brokers: a Mosquitto per site, bridged to the central broker (docs/design.md §12).

Devices connect to their site's broker; the controller connects to the central one. The site
broker holds one bridge connection to the central broker that forwards only what must cross:
the controller's plan, state and commands and the stage-0 inputs come in; results, statuses
and heartbeats go out; replicas go both ways. Activations and gradients between stages stay on
the site broker, so a site's pipeline traffic never loads the central broker or the WAN. That
holds when a job's stages all live on one site: a stage boundary between two sites would need
its topics bridged too, and this map does not do it.

The topic map is data (:func:`bridge_topics`): it renders the bridge's ``topic`` lines, the
central broker's ACL of the site identity, and the docs' table, so the three cannot disagree.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from pathlib import Path

from ftpipe_iot.fleet.errors import FleetError
from ftpipe_iot.protocol.topics import ROOT, Topics, check_name
from ftpipe_iot.runtime.broker import template_text

TEMPLATE_NAME = "mosquitto-site.conf.template"
ENVELOPE_HEADROOM = 4096  # same rule as every ftpipe-iot broker config (brokerconf.py)
ANY_JOB = "+"


class Direction(str, Enum):
    """Mosquitto bridge directions, seen from the site broker."""

    IN = "in"      # central -> site
    OUT = "out"    # site -> central
    BOTH = "both"


@dataclass(frozen=True)
class BridgeTopic:
    """One topic pattern that crosses the bridge, its direction and QoS, and why it crosses."""

    pattern: str
    direction: Direction
    qos: int
    why: str

    def render(self) -> str:
        """The bridge's ``topic`` line (same name on both brokers)."""
        return f"topic {self.pattern} {self.direction.value} {self.qos}"


@dataclass(frozen=True)
class LocalTopic:
    """A topic that does not cross the bridge, and why."""

    pattern: str
    why: str


def bridge_topics(job: str = ANY_JOB) -> tuple[BridgeTopic, ...]:
    """What crosses between a site and the central broker, for one job or every job (``+``)."""
    if job != ANY_JOB:
        check_name("job", job)
    base = f"{ROOT}/{job}"
    return (
        BridgeTopic(f"{base}/ctrl/#", Direction.IN, 1,
                    "the plan, the controller's state (and its Last Will), commands, and its "
                    "message-size probe at start: the controller is central"),
        BridgeTopic(f"{base}/stage/0/act/+", Direction.IN, 1,
                    "the controller feeds stage 0's members (inputs and labels, training and "
                    "evaluation)"),
        BridgeTopic(f"{base}/results", Direction.OUT, 1,
                    "losses, micro-batch and step completions, replication reports"),
        BridgeTopic(f"{base}/trace/+", Direction.OUT, 0,
                    "the devices' timeline spans for the controller's trace"),
        BridgeTopic(f"{base}/weights/#", Direction.BOTH, 1,
                    "retained replicas: out for the controller's central copy, in for layers "
                    "the controller republishes and for loading on a site device"),
        BridgeTopic(Topics.ALL_STATUS, Direction.OUT, 1,
                    "retained device status, and the Last Will the site broker fires"),
        BridgeTopic(Topics.ALL_HEARTBEATS, Direction.OUT, 0,
                    "liveness, compute times and queue depths for the controller"),
    )


def local_topics(job: str = ANY_JOB) -> tuple[LocalTopic, ...]:
    """Topics that do not cross the bridge."""
    base = f"{ROOT}/{job}"
    return (
        LocalTopic(f"{base}/stage/<k>/act/+, k > 0",
                   "activations between stages of the same site"),
        LocalTopic(f"{base}/stage/+/grad/+", "gradients between stages of the same site"),
        LocalTopic(f"{base}/stage/+/reduce",
                   "gradient partials between members of a stage group on the same site"),
        LocalTopic(f"{base}/events", "the controller's events are for observers of the central "
                                     "broker; no device reads them"),
    )


@dataclass(frozen=True)
class BridgeTls:
    """TLS towards the central broker: the fleet CA and this site's client certificate."""

    ca_file: Path
    cert_file: Path
    key_file: Path


@dataclass(frozen=True)
class SiteSettings:
    """One site broker: its own listener and its bridge to the central broker."""

    name: str
    central_host: str
    central_port: int
    port: int = 1883
    bind: str = "0.0.0.0"
    job: str = ANY_JOB
    bridge_protocol: str = "mqttv50"
    max_message_bytes: int = 256 * 1024
    run_as_user: str = "mosquitto"
    tls: BridgeTls | None = None
    username: str | None = None
    password: str | None = None
    password_file: Path | None = None  # the site's own device passwords (None: anonymous)
    acl_file: Path | None = None

    def __post_init__(self) -> None:
        check_name("site", self.name)
        for what, port in (("site", self.port), ("central", self.central_port)):
            if not 0 < port < 65536:
                raise FleetError(f"{what} broker port must be 1..65535, got {port}")
        if self.bridge_protocol not in ("mqttv50", "mqttv311"):
            raise FleetError(f"bridge protocol must be mqttv50 or mqttv311, got "
                             f"{self.bridge_protocol!r}")
        if (self.username is None) != (self.password is None):
            raise FleetError("a bridge username needs its password and the other way round")
        if (self.password_file is None) != (self.acl_file is None):
            raise FleetError("site authentication needs both a password file and an ACL file")


def _lines(*lines: str) -> str:
    return "\n".join(lines)


def render_site_config(settings: SiteSettings, data_dir: Path,
                       template: str | None = None) -> str:
    """The site broker's Mosquitto config: its listener, persistence, limits and the bridge."""
    text = template if template is not None else template_text(TEMPLATE_NAME)
    if settings.password_file is not None:
        local_auth = _lines("allow_anonymous false",
                            f"password_file {Path(settings.password_file).resolve()}",
                            f"acl_file {Path(settings.acl_file).resolve()}")  # type: ignore[arg-type]
    else:
        local_auth = "# Lab use: anonymous devices. `fleet site --dir` sets passwords and ACLs.\n" \
                     "allow_anonymous true"
    remote_auth = "" if settings.username is None else _lines(
        f"remote_username {settings.username}", f"remote_password {settings.password}")
    bridge_tls = "" if settings.tls is None else _lines(
        f"bridge_cafile {settings.tls.ca_file.resolve()}",
        f"bridge_certfile {settings.tls.cert_file.resolve()}",
        f"bridge_keyfile {settings.tls.key_file.resolve()}",
        "bridge_insecure false")
    topics = _lines("# What crosses (fleet/site.py bridge_topics); everything else stays here.",
                    *(t.render() for t in bridge_topics(settings.job)))
    return text.format(
        name=settings.name, run_as_user=settings.run_as_user, port=settings.port,
        bind=settings.bind, local_auth=local_auth, data_dir=str(Path(data_dir).resolve()),
        message_size_limit=settings.max_message_bytes + ENVELOPE_HEADROOM,
        central_host=settings.central_host, central_port=settings.central_port,
        bridge_protocol=settings.bridge_protocol, remote_auth=remote_auth,
        bridge_tls=bridge_tls, topics=topics)


def bridge_state_topic(name: str) -> str:
    """Where the site broker says whether its bridge is up (``1``) or down (``0``)."""
    return f"$SYS/broker/connection/{name}/state"


def topic_map_markdown(job: str = ANY_JOB) -> str:
    """The topic map as a Markdown table (docs/design.md §12 shows its output)."""
    rows = ["| topic | crosses | QoS | why |", "| --- | --- | --- | --- |"]
    arrows = {Direction.IN: "central → site", Direction.OUT: "site → central",
              Direction.BOTH: "both ways"}
    rows += [f"| `{t.pattern}` | {arrows[t.direction]} | {t.qos} | {t.why} |"
             for t in bridge_topics(job)]
    rows += [f"| `{t.pattern}` | does not cross | - | {t.why} |" for t in local_topics(job)]
    return "\n".join(rows)
