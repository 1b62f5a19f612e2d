"""A fleet's production Mosquitto config, rendered from ``broker/mosquitto-fleet.conf.template``.

The template is the single source of the settings and carries the comments; this module only
computes the values and the fleet-directory paths (docs/security.md explains every setting).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ftpipe_iot.fleet.model import BrokerSettings
from ftpipe_iot.runtime.broker import template_text

TEMPLATE_NAME = "mosquitto-fleet.conf.template"
# A chunk carries the msgpack envelope (version, kind, job, sender, plan version, step, indices,
# checksum...) on top of at most max_message_bytes of data: well under 4 KiB. Same rule as the
# demo config (broker.render_config) so a payload valid there is valid here.
ENVELOPE_HEADROOM = 4096
# The whole MQTT packet adds the fixed header, the topic name and MQTT 5 properties.
PACKET_HEADROOM = 4096


@dataclass(frozen=True)
class BrokerLayout:
    """Where the broker's files live inside a fleet directory."""

    fleet_dir: Path

    @property
    def root(self) -> Path:
        return self.fleet_dir / "broker"

    @property
    def config(self) -> Path:
        return self.root / "mosquitto.conf"

    @property
    def cert(self) -> Path:
        return self.root / "server.crt"

    @property
    def key(self) -> Path:
        return self.root / "server.key"

    @property
    def password_file(self) -> Path:
        return self.root / "passwd"

    @property
    def acl_file(self) -> Path:
        return self.root / "acl"

    @property
    def data_dir(self) -> Path:
        return self.root / "data"

    @property
    def log_file(self) -> Path:
        return self.root / "log" / "mosquitto.log"

    @property
    def pid_file(self) -> Path:
        return self.root / "mosquitto.pid"


def message_size_limit(settings: BrokerSettings) -> int:
    """Largest accepted PUBLISH payload: one full chunk plus envelope headroom."""
    return settings.max_message_bytes + ENVELOPE_HEADROOM


def render_fleet_config(settings: BrokerSettings, layout: BrokerLayout, ca_file: Path,
                        template: str | None = None) -> str:
    """Fill the fleet template with ``settings`` and absolute paths from ``layout``."""
    text = template if template is not None else template_text(TEMPLATE_NAME)
    size_limit = message_size_limit(settings)
    values = {
        "port": settings.port, "bind": settings.bind, "run_as_user": settings.run_as_user,
        "cafile": ca_file.resolve(), "certfile": layout.cert.resolve(),
        "keyfile": layout.key.resolve(), "password_file": layout.password_file.resolve(),
        "acl_file": layout.acl_file.resolve(), "data_dir": layout.data_dir.resolve(),
        "log_file": layout.log_file.resolve(), "pid_file": layout.pid_file.resolve(),
        "message_size_limit": size_limit,
        "max_packet_size": size_limit + PACKET_HEADROOM,
        "max_queued_messages": settings.max_queued_messages,
        "max_queued_bytes": settings.max_queued_bytes,
        "max_inflight_messages": settings.max_inflight_messages,
        "max_keepalive": settings.max_keepalive_s,
        "max_connections": settings.max_connections,
    }
    return text.format(**{k: str(v) for k, v in values.items()})
