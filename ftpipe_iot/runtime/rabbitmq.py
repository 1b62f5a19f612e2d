"""A private RabbitMQ node with its MQTT plugin, for compatibility tests and the broker matrix
(docs/brokers.md).

The node is this process's own: its own node name, ports, data, logs, plugins file and Erlang
cookie (a temporary HOME), so a RabbitMQ already running on the host is neither touched nor
reused. The host's epmd is shared when one runs (the node only registers its name there); when
none runs, the one the node starts is stopped again afterwards.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import uuid
from pathlib import Path

from ftpipe_iot.errors import BrokerError
from ftpipe_iot.runtime.broker import find_free_port, wait_for_port

_SERVER = "/usr/lib/rabbitmq/bin/rabbitmq-server"
_PLUGIN_DIRS = ("/usr/lib/rabbitmq/lib",)
_EPMD_PORT = 4369


def _server_binary() -> str | None:
    if os.access(_SERVER, os.X_OK):
        return _SERVER
    return shutil.which("rabbitmq-server")


def mqtt_plugin_version() -> str | None:
    """Version of the installed ``rabbitmq_mqtt`` plugin (= RabbitMQ's), or None."""
    for base in _PLUGIN_DIRS:
        for plugin in sorted(Path(base).glob("*/plugins/rabbitmq_mqtt-*")):
            return plugin.name.split("-", 1)[1].removesuffix(".ez")
    return None


def _has_mqtt_plugin() -> bool:
    return mqtt_plugin_version() is not None


def rabbitmq_unavailable() -> str | None:
    """Why a RabbitMQ node cannot be started here, or None when it can."""
    if _server_binary() is None:
        return "rabbitmq-server is not installed (apt-get install rabbitmq-server)"
    if not _has_mqtt_plugin():
        return "RabbitMQ's MQTT plugin (rabbitmq_mqtt) is not installed"
    return None


def _epmd_running() -> bool:
    try:
        with socket.create_connection(("127.0.0.1", _EPMD_PORT), timeout=0.5):
            return True
    except OSError:
        return False


class RabbitMqBroker:
    """A RabbitMQ node with ``rabbitmq_mqtt`` listening on a free loopback port (MQTT 3.1.1,
    anonymous as ``guest``). A context manager; ``cleanup`` removes every trace of it."""

    def __init__(self, port: int = 0) -> None:
        reason = rabbitmq_unavailable()
        if reason:
            raise BrokerError(reason)
        self.port = port or find_free_port()
        self.node = f"ftpipe-{os.getpid()}-{uuid.uuid4().hex[:6]}@localhost"
        self._tmp = tempfile.TemporaryDirectory(prefix="ftpipe-rabbitmq-")
        self.root = Path(self._tmp.name)
        self.proc: subprocess.Popen | None = None
        self._started_epmd = False

    @property
    def url(self) -> str:
        return f"mqtt://127.0.0.1:{self.port}"

    def _environment(self) -> dict[str, str]:
        root = self.root
        (root / "rabbitmq.conf").write_text("\n".join([
            "loopback_users = none",
            f"listeners.tcp.default = 127.0.0.1:{find_free_port()}",
            f"mqtt.listeners.tcp.default = 127.0.0.1:{self.port}",
            "mqtt.allow_anonymous = true",
            "mqtt.default_user = guest",
            "mqtt.default_pass = guest",
            "mqtt.vhost = /",
            "mqtt.exchange = amq.topic",
            "mqtt.retained_message_store = rabbit_mqtt_retained_msg_store_dets",
        ]) + "\n")
        (root / "enabled_plugins").write_text("[rabbitmq_mqtt].\n")
        (root / "rabbitmq-env.conf").write_text("")  # not the host's /etc/rabbitmq one
        env = {k: v for k, v in os.environ.items() if not k.startswith("RABBITMQ_")}
        env.update({
            "HOME": str(root),  # the node's own Erlang cookie
            "RABBITMQ_NODENAME": self.node,
            "RABBITMQ_CONF_ENV_FILE": str(root / "rabbitmq-env.conf"),
            "RABBITMQ_CONFIG_FILE": str(root / "rabbitmq.conf"),
            "RABBITMQ_ENABLED_PLUGINS_FILE": str(root / "enabled_plugins"),
            "RABBITMQ_MNESIA_BASE": str(root / "mnesia"),
            "RABBITMQ_LOG_BASE": str(root / "log"),
            "RABBITMQ_PID_FILE": str(root / "rabbitmq.pid"),
            "RABBITMQ_DIST_PORT": str(find_free_port()),
            "RABBITMQ_LOGS": str(root / "log" / "node.log"),
            "ERL_EPMD_ADDRESS": "127.0.0.1",
        })
        return env

    def start(self, timeout_s: float = 60.0) -> RabbitMqBroker:
        """Start the node and wait until its MQTT listener accepts connections."""
        self._started_epmd = not _epmd_running()
        log = open(self.root / "server.out", "w")  # noqa: SIM115 (closed with the process)
        self.proc = subprocess.Popen([_server_binary() or _SERVER], env=self._environment(),
                                     stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                                     cwd=self.root, start_new_session=True)
        log.close()
        try:
            wait_for_port("127.0.0.1", self.port, timeout_s, self.proc)
        except BrokerError as exc:
            tail = (self.root / "server.out").read_text(errors="replace")[-2000:]
            self.cleanup()
            raise BrokerError(f"RabbitMQ node {self.node}: {exc}: {tail}") from exc
        return self

    def stop(self, timeout_s: float = 30.0) -> None:
        """Stop the node: SIGTERM to its process group, SIGKILL after ``timeout_s``."""
        if self.proc is None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait(timeout_s)
        except ProcessLookupError:
            pass
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        self.proc = None
        if self._started_epmd:
            subprocess.run(["epmd", "-kill"], capture_output=True,
                           env={**os.environ, "ERL_EPMD_ADDRESS": "127.0.0.1"})
            self._started_epmd = False

    def cleanup(self) -> None:
        """Stop the node and delete its data, logs and cookie."""
        self.stop()
        self._tmp.cleanup()

    def __enter__(self) -> RabbitMqBroker:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.cleanup()


def wait_until_gone(node_pid: int, timeout_s: float = 10.0) -> bool:
    """Whether process ``node_pid`` has exited within ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            os.kill(node_pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.05)
    return False
