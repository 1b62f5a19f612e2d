"""Real links on one Linux host: network namespaces joined by veth pairs, each link capped by a
``tbf`` qdisc and cut by taking it down (docs/design.md §12).

A :class:`NetLab` owns a hub namespace (the broker, and local clients such as the controller
over the hub's loopback) and one namespace per node, joined to the hub by its own veth pair on
its own /30 subnet. Every address lives inside these namespaces: nothing is added to the host's
own namespace and no packet leaves the lab. A link's cap is a ``tbf`` on *both* ends of its
pair (tbf shapes egress only), so upload and download are each capped, as on a real link.

The lab deletes only namespaces it created, also when the test using it fails; their names
carry the creating process id, so a lab left behind by a killed process is removed by the next
one (:func:`sweep_stale`). Everything here needs CAP_NET_ADMIN: :func:`unavailable` says why
not, for tests to skip with that reason.
"""

from __future__ import annotations

import ctypes
import json
import os
import re
import shutil
import signal
import subprocess
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from ftpipe_iot.errors import NetworkLabError

PREFIX = "ftpipe-"
_CLONE_NEWNET = 0x40000000
_CAP_NET_ADMIN = 12
_NETNS_DIR = "/run/netns"
_NAME_RE = re.compile(rf"^{PREFIX}(\d+)-[0-9a-f]+-")
# tbf needs a bucket of at least one MTU and of rate/HZ; 10 ms of the rate is both here.
_BURST_S = 0.010
_MIN_BURST_BYTES = 16 * 1024
# Queue of up to 100 ms of the rate in front of the shaper (more is bufferbloat, less drops).
_QUEUE_LATENCY = "100ms"

T = TypeVar("T")


def _run(args: Sequence[str], check: bool = True) -> subprocess.CompletedProcess:
    result = subprocess.run(list(args), capture_output=True, text=True)
    if check and result.returncode != 0:
        raise NetworkLabError(f"{' '.join(args)} failed: {result.stderr.strip()}")
    return result


def has_net_admin() -> bool:
    """Whether this process holds CAP_NET_ADMIN (root normally does)."""
    try:
        for line in open("/proc/self/status", encoding="ascii"):  # noqa: SIM115
            if line.startswith("CapEff:"):
                return bool(int(line.split()[1], 16) >> _CAP_NET_ADMIN & 1)
    except OSError:
        pass
    return False


def unavailable() -> str | None:
    """Why network labs cannot run here, or None when they can (checked by a real probe)."""
    if not os.path.exists("/proc/self/ns/net"):
        return "no Linux network namespaces on this system"
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        return f"{' and '.join(missing)} not installed (apt-get install iproute2)"
    if not has_net_admin():
        return "needs CAP_NET_ADMIN (run as root) to create network namespaces"
    probe = f"{PREFIX}{os.getpid()}-{uuid.uuid4().hex[:6]}-probe"
    try:
        _run(["ip", "netns", "add", probe])
        _run(["ip", "-n", probe, "link", "add", "p0", "type", "veth", "peer", "name", "p1"])
        _run(["tc", "-n", probe, "qdisc", "add", "dev", "p0", "root", "tbf", "rate", "1mbit",
              "burst", "16kb", "latency", _QUEUE_LATENCY])
    except NetworkLabError as exc:
        return f"cannot build a capped veth link here: {exc}"
    finally:
        _run(["ip", "netns", "del", probe], check=False)
    return None


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def lab_namespaces() -> list[str]:
    """Names of every namespace any lab of this project holds on this host now."""
    try:
        return sorted(n for n in os.listdir(_NETNS_DIR) if n.startswith(PREFIX))
    except FileNotFoundError:
        return []


def sweep_stale() -> list[str]:
    """Delete the lab namespaces whose creating process is gone; returns their names."""
    removed = []
    for name in lab_namespaces():
        match = _NAME_RE.match(name)
        if match and not _pid_alive(int(match.group(1))):
            _kill_members(name)
            _run(["ip", "netns", "del", name], check=False)
            removed.append(name)
    return removed


def namespace_pids(namespace: str) -> list[int]:
    """Processes in a namespace (``ip netns pids``)."""
    out = _run(["ip", "netns", "pids", namespace], check=False).stdout
    return [int(p) for p in out.split()]


def _kill_members(namespace: str) -> None:
    # Only processes the lab's user started can be in a lab namespace.
    for pid in namespace_pids(namespace):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _libc_setns() -> Callable[[int, int], int]:
    setns = ctypes.CDLL(None, use_errno=True).setns
    setns.argtypes = [ctypes.c_int, ctypes.c_int]
    return setns


def enter(namespace: str) -> None:
    """Move the *calling thread* into ``namespace`` (threads it starts inherit it)."""
    fd = os.open(os.path.join(_NETNS_DIR, namespace), os.O_RDONLY)
    try:
        if _libc_setns()(fd, _CLONE_NEWNET) != 0:
            errno = ctypes.get_errno()
            raise NetworkLabError(f"setns into {namespace} failed: {os.strerror(errno)}")
    finally:
        os.close(fd)


def call_in(namespace: str, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """Run ``fn`` on a fresh thread inside ``namespace`` and return its result. Sockets it opens,
    and threads it starts (paho's network loop, a worker), stay in that namespace."""
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            enter(namespace)
            box["result"] = fn(*args, **kwargs)
        except BaseException as exc:  # handed to the caller
            box["error"] = exc

    thread = threading.Thread(target=target, name=f"netns-{namespace}", daemon=True)
    thread.start()
    thread.join()
    if "error" in box:
        raise box["error"]
    return box["result"]


@dataclass(frozen=True)
class Node:
    """One namespace joined to the hub: its address, the broker's address as it sees it, and
    the interface names at both ends of its link."""

    name: str
    namespace: str
    index: int
    address: str
    hub_address: str
    hub_ifname: str
    ifname: str = "uplink"

    def broker_url(self, port: int = 1883) -> str:
        """The hub's broker as this node reaches it."""
        return f"mqtt://{self.hub_address}:{port}"


@dataclass(frozen=True)
class QdiscStats:
    """What the kernel says about a link end's qdisc."""

    kind: str
    rate_bytes_per_s: float | None
    sent_bytes: int
    overlimits: int


def tbf_args(rate_bits_per_s: float) -> list[str]:
    """``tc`` arguments of the cap: rate, a bucket of 10 ms of the rate, 100 ms of queue."""
    if rate_bits_per_s <= 0:
        raise NetworkLabError(f"a link cap must be > 0 bit/s, got {rate_bits_per_s}")
    burst = max(_MIN_BURST_BYTES, int(rate_bits_per_s / 8 * _BURST_S))
    return ["tbf", "rate", f"{int(rate_bits_per_s)}bit", "burst", str(burst),
            "latency", _QUEUE_LATENCY]


class NetLab:
    """A hub namespace and capped links to node namespaces; a context manager that removes
    everything it made (processes in its namespaces included) on exit."""

    def __init__(self, tag: str = "lab") -> None:
        reason = None if has_net_admin() else "needs CAP_NET_ADMIN (run as root)"
        if reason:
            raise NetworkLabError(reason)
        sweep_stale()
        token = uuid.uuid4().hex[:6]
        self.prefix = f"{PREFIX}{os.getpid()}-{token}-{tag}"[:40]
        self.hub = f"{self.prefix}-hub"
        self.nodes: dict[str, Node] = {}
        self._namespaces: list[str] = []
        self._add_namespace(self.hub)

    def _add_namespace(self, namespace: str) -> None:
        _run(["ip", "netns", "add", namespace])
        self._namespaces.append(namespace)
        _run(["ip", "-n", namespace, "link", "set", "lo", "up"])

    def add_node(self, name: str, rate_bits_per_s: float | None = None) -> Node:
        """A namespace for ``name`` joined to the hub, capped at ``rate_bits_per_s`` each way
        (None: uncapped)."""
        if name in self.nodes:
            raise NetworkLabError(f"node {name!r} exists already")
        index = len(self.nodes)
        if index > 250:
            raise NetworkLabError("a lab holds at most 251 nodes")
        namespace = f"{self.prefix}-{index}"
        self._add_namespace(namespace)
        node = Node(name, namespace, index, f"10.201.{index}.2", f"10.201.{index}.1",
                    f"n{index}")
        _run(["ip", "link", "add", node.hub_ifname, "netns", self.hub, "type", "veth", "peer",
              "name", node.ifname, "netns", namespace])
        _run(["ip", "-n", self.hub, "addr", "add", f"{node.hub_address}/30", "dev",
              node.hub_ifname])
        _run(["ip", "-n", namespace, "addr", "add", f"{node.address}/30", "dev", node.ifname])
        _run(["ip", "-n", self.hub, "link", "set", node.hub_ifname, "up"])
        _run(["ip", "-n", namespace, "link", "set", node.ifname, "up"])
        self.nodes[name] = node
        if rate_bits_per_s is not None:
            self.cap(name, rate_bits_per_s)
        return node

    def _ends(self, name: str) -> list[tuple[str, str]]:
        node = self.nodes[name]
        return [(self.hub, node.hub_ifname), (node.namespace, node.ifname)]

    def cap(self, name: str, rate_bits_per_s: float | None) -> None:
        """Cap a node's link each way (replacing any cap), or lift it (None)."""
        for namespace, ifname in self._ends(name):
            if rate_bits_per_s is None:
                _run(["tc", "-n", namespace, "qdisc", "del", "dev", ifname, "root"],
                     check=False)
            else:
                _run(["tc", "-n", namespace, "qdisc", "replace", "dev", ifname, "root",
                      *tbf_args(rate_bits_per_s)])

    def set_link(self, name: str, up: bool) -> None:
        """Cut (``up=False``) or restore a node's link: ``ip link set uplink down|up``."""
        node = self.nodes[name]
        _run(["ip", "-n", node.namespace, "link", "set", node.ifname, "up" if up else "down"])

    def qdisc(self, name: str, hub_side: bool = False) -> QdiscStats:
        """The root qdisc of a node's link end (the node's egress, or the hub's towards it)."""
        namespace, ifname = self._ends(name)[0 if hub_side else 1]
        out = _run(["tc", "-s", "-j", "-n", namespace, "qdisc", "show", "dev", ifname]).stdout
        entries = [q for q in json.loads(out or "[]") if q.get("root")]
        if not entries:
            raise NetworkLabError(f"no root qdisc on {ifname} in {namespace}")
        q = entries[0]
        rate = q.get("options", {}).get("rate")
        return QdiscStats(q["kind"], float(rate) if rate is not None else None,
                          int(q.get("bytes", 0)), int(q.get("overlimits", 0)))

    def link_bytes(self, name: str) -> tuple[int, int]:
        """Bytes the node has sent and received on its link (interface counters)."""
        node = self.nodes[name]
        out = _run(["ip", "-s", "-j", "-n", node.namespace, "link", "show", node.ifname]).stdout
        stats = json.loads(out)[0]["stats64"]
        return int(stats["tx"]["bytes"]), int(stats["rx"]["bytes"])

    @property
    def namespaces(self) -> list[str]:
        return list(self._namespaces)

    def close(self, grace_s: float = 3.0) -> None:
        """Stop whatever still runs in the lab's namespaces, then delete them (and so every veth
        pair and qdisc in them). Safe to call twice."""
        deadline = time.monotonic() + grace_s
        for namespace in self._namespaces:
            for pid in namespace_pids(namespace):
                try:
                    os.kill(pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        while time.monotonic() < deadline and any(namespace_pids(n) for n in self._namespaces):
            time.sleep(0.05)
        for namespace in self._namespaces:
            _kill_members(namespace)
            _run(["ip", "netns", "del", namespace], check=False)
        self._namespaces.clear()
        self.nodes.clear()

    def __enter__(self) -> NetLab:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
