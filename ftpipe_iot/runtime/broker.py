"""Start and stop an MQTT broker process: Mosquitto from the project's config, or the embedded
amqtt broker when no Mosquitto binary exists (MQTT 3.1.1 only, slower; a warning says so)."""

from __future__ import annotations

import getpass
import logging
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path

from ftpipe_iot.errors import BrokerError

log = logging.getLogger(__name__)

_REPO_ROOT = Path(__file__).resolve().parents[2]


class BrokerKind(str, Enum):
    """Which broker implementation runs."""

    MOSQUITTO = "mosquitto"
    EMBEDDED = "embedded"



def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


_handed_out: set[int] = set()


def find_free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` now, chosen *below* the ephemeral range: a port from bind(0)
    is ephemeral, and while a process is still starting, an outgoing connection of another one
    can take it as its local port before the server binds it."""
    low = min(_ephemeral_low(), 32768)
    for _ in range(500):
        port = random.randint(20000, low - 1)
        if port in _handed_out:
            continue
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind((host, port))
            except OSError:
                continue
        _handed_out.add(port)
        return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def mosquitto_binary() -> str | None:
    """Path of the mosquitto binary, or None when it is not installed."""
    found = shutil.which("mosquitto")
    if found:
        return found
    for candidate in ("/usr/sbin/mosquitto", "/usr/local/sbin/mosquitto"):
        if os.access(candidate, os.X_OK):
            return candidate
    return None


def shared_file(folder: str, name: str) -> Path:
    """A file of the repo's ``broker/`` or ``devices/`` folder: from the source tree when run
    from a checkout (editable install), else from ``<prefix>/share/ftpipe-iot/`` where a wheel
    install puts them (setup.cfg ``data_files``)."""
    repo_file = _REPO_ROOT / folder / name
    if repo_file.exists():
        return repo_file
    return Path(sys.prefix) / "share" / "ftpipe-iot" / folder / name


def template_text(name: str = "mosquitto.conf.template") -> str:
    """Text of a config template from the ``broker/`` folder."""
    return shared_file("broker", name).read_text()


def render_config(port: int, data_dir: Path, bind: str = "127.0.0.1",
                  max_message_bytes: int = 256 * 1024, template: str | None = None) -> str:
    """Fill the Mosquitto config template for one broker instance."""
    text = template if template is not None else template_text()
    # Envelope overhead on top of a full chunk is well under 4 KiB.
    return text.format(port=port, bind=bind, data_dir=str(data_dir), user=getpass.getuser(),
                       message_size_limit=max_message_bytes + 4096)


def wait_for_port(host: str, port: int, timeout_s: float, proc: subprocess.Popen | None = None
                  ) -> None:
    """Block until a TCP connect to host:port succeeds, or raise BrokerError."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise BrokerError(f"broker exited with code {proc.returncode} before listening")
        try:
            with socket.create_connection((host, port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.05)
    raise BrokerError(f"broker did not listen on {host}:{port} within {timeout_s}s")


@dataclass
class BrokerProcess:
    """A broker subprocess on a local port. Use as a context manager or call start()/stop()."""

    port: int = 0
    kind: BrokerKind | None = None
    data_dir: Path | None = None
    bind: str = "127.0.0.1"
    max_message_bytes: int = 256 * 1024
    config_text: str | None = None
    netns: str | None = None  # run inside this network namespace (runtime/netns.py)
    proc: subprocess.Popen | None = field(default=None, init=False)
    _tmp: tempfile.TemporaryDirectory | None = field(default=None, init=False)

    def __post_init__(self) -> None:
        if self.port == 0:
            self.port = find_free_port(self.bind)
        if self.kind is None:
            self.kind = BrokerKind.MOSQUITTO if mosquitto_binary() else BrokerKind.EMBEDDED
        if self.data_dir is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="ftpipe-broker-")
            self.data_dir = Path(self._tmp.name)
        self.data_dir.mkdir(parents=True, exist_ok=True)

    @property
    def url(self) -> str:
        return f"mqtt://{self.bind}:{self.port}"

    @property
    def config_path(self) -> Path:
        assert self.data_dir is not None
        return self.data_dir / "mosquitto.conf"

    def start(self, timeout_s: float = 15.0) -> BrokerProcess:
        """Start the broker and wait until it accepts TCP connections."""
        assert self.data_dir is not None
        if self.kind is BrokerKind.MOSQUITTO:
            binary = mosquitto_binary()
            if binary is None:
                raise BrokerError("mosquitto is not installed (apt-get install mosquitto)")
            text = self.config_text or render_config(self.port, self.data_dir, self.bind,
                                                     self.max_message_bytes)
            self.config_path.write_text(text)
            cmd = [binary, "-c", str(self.config_path)]
        else:
            reason = "asked for" if mosquitto_binary() else "no mosquitto binary found"
            log.warning("%s: using the embedded amqtt broker (MQTT 3.1.1 only, slower, keeps "
                        "nothing on disk); install mosquitto for real runs", reason)
            cmd = [sys.executable, "-m", "ftpipe_iot.runtime.embedded_broker", "--port",
                   str(self.port), "--bind", self.bind]
        from ftpipe_iot.runtime.supervise import child_setup

        self.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.PIPE, start_new_session=True,
                                     preexec_fn=child_setup(self.netns))
        try:
            if self.netns is None:
                wait_for_port(self.bind, self.port, timeout_s, self.proc)
            else:
                from ftpipe_iot.runtime.netns import call_in

                call_in(self.netns, wait_for_port, self.bind, self.port, timeout_s, self.proc)
        except BrokerError as exc:
            err = self._stderr_tail()
            self.stop()
            raise BrokerError(f"{exc}: {err}") from exc
        return self

    def _stderr_tail(self) -> str:
        if self.proc is None or self.proc.stderr is None or self.proc.poll() is None:
            return ""
        return self.proc.stderr.read().decode(errors="replace")[-2000:]

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stop the broker (SIGTERM, then SIGKILL); Mosquitto saves its persistence on SIGTERM."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.proc.stderr:
            self.proc.stderr.close()
        self.proc = None

    def restart(self) -> None:
        """Stop and start again on the same port and data directory (keeps persistence)."""
        self.stop()
        self.start()

    def cleanup(self) -> None:
        self.stop()
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None

    def __enter__(self) -> BrokerProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.cleanup()
