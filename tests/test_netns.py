"""Network labs on this host: tbf caps that really cap, links that really go down, and nothing
left behind (namespaces, veth pairs, processes), also when a test fails."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import time

import pytest

from ftpipe_iot.errors import NetworkLabError
from ftpipe_iot.runtime.netns import (
    NetLab,
    call_in,
    lab_namespaces,
    namespace_pids,
    sweep_stale,
    tbf_args,
    unavailable,
)
from ftpipe_iot.runtime.supervise import child_setup

pytestmark = pytest.mark.netns

RATE_BITS = 8_000_000  # 1 MB/s each way
PORT = 5001


def _host_addresses() -> list:
    out = subprocess.run(["ip", "-j", "addr"], capture_output=True, text=True, check=True)
    return sorted((i["ifname"], a["local"]) for i in json.loads(out.stdout)
                  for a in i.get("addr_info", []))


def _listen(address: str) -> socket.socket:
    return socket.create_server((address, PORT))


def _send(address: str, n_bytes: int) -> float:
    started = time.monotonic()
    with socket.create_connection((address, PORT), timeout=30) as sock:
        sock.sendall(b"\x00" * n_bytes)
        sock.shutdown(socket.SHUT_WR)
        sock.recv(1)  # the server closes once it has every byte
    return time.monotonic() - started


def _drain(server: socket.socket, n_bytes: int) -> None:
    conn, _ = server.accept()
    got = 0
    while got < n_bytes:
        chunk = conn.recv(1 << 16)
        if not chunk:
            break
        got += len(chunk)
    conn.close()


def test_the_lab_adds_nothing_to_the_host_namespace(netlab):
    before = _host_addresses()
    netlab.add_node("a", RATE_BITS)
    netlab.add_node("b")
    assert _host_addresses() == before
    assert set(netlab.namespaces) <= set(lab_namespaces())


def test_a_capped_link_carries_no_more_than_its_rate(netlab):
    import threading

    node = netlab.add_node("dev0", RATE_BITS)
    stats = netlab.qdisc("dev0")
    assert stats.kind == "tbf" and stats.rate_bytes_per_s == RATE_BITS / 8
    assert netlab.qdisc("dev0", hub_side=True).kind == "tbf"
    n_bytes = 1_500_000
    server = call_in(netlab.hub, _listen, node.hub_address)
    drain = threading.Thread(target=_drain, args=(server, n_bytes))
    drain.start()
    elapsed = call_in(node.namespace, _send, node.hub_address, n_bytes)
    drain.join(30)
    server.close()
    # A lower bound only: load can slow a transfer, never speed it past the cap.
    assert elapsed >= 0.8 * n_bytes / (RATE_BITS / 8)
    after = netlab.qdisc("dev0")
    assert after.sent_bytes >= n_bytes and after.overlimits > 0
    sent, _ = netlab.link_bytes("dev0")
    assert sent >= n_bytes


def test_a_link_taken_down_carries_nothing_until_it_is_up_again(netlab):
    node = netlab.add_node("dev0")
    server = call_in(netlab.hub, _listen, node.hub_address)
    netlab.set_link("dev0", up=False)
    with pytest.raises(OSError):
        call_in(node.namespace, socket.create_connection, (node.hub_address, PORT), 1.0)
    netlab.set_link("dev0", up=True)
    deadline = time.monotonic() + 10
    while True:
        try:
            call_in(node.namespace, socket.create_connection, (node.hub_address, PORT),
                    1.0).close()
            break
        except OSError:
            assert time.monotonic() < deadline, "the link never came back"
            time.sleep(0.1)
    server.close()


def test_caps_can_change_and_be_lifted(netlab):
    netlab.add_node("dev0", RATE_BITS)
    netlab.cap("dev0", 2 * RATE_BITS)
    assert netlab.qdisc("dev0").rate_bytes_per_s == 2 * RATE_BITS / 8
    netlab.cap("dev0", None)
    assert netlab.qdisc("dev0").kind != "tbf"
    with pytest.raises(NetworkLabError):
        tbf_args(0)


def test_nothing_is_left_behind_when_the_test_body_fails():
    reason = unavailable()
    if reason is not None:
        pytest.skip(f"network namespaces unavailable: {reason}")
    with pytest.raises(RuntimeError, match="boom"):
        with NetLab(tag="fail") as lab:
            node = lab.add_node("dev0", RATE_BITS)
            proc = subprocess.Popen(["sleep", "60"], preexec_fn=child_setup(node.namespace))
            assert proc.pid in namespace_pids(node.namespace)
            namespaces = lab.namespaces
            raise RuntimeError("boom")
    assert proc.wait(5) != 0  # stopped by the lab, not finished
    assert not set(namespaces) & set(lab_namespaces())


def test_a_lab_left_by_a_dead_process_is_swept():
    reason = unavailable()
    if reason is not None:
        pytest.skip(f"network namespaces unavailable: {reason}")
    dead = subprocess.Popen(["true"])
    dead.wait()
    stale = f"ftpipe-{dead.pid}-abcdef-stale-hub"
    mine = f"ftpipe-{os.getpid()}-abcdef-mine-hub"
    for name in (stale, mine):
        subprocess.run(["ip", "netns", "add", name], check=True)
    try:
        assert stale in sweep_stale()
        assert stale not in lab_namespaces() and mine in lab_namespaces()
    finally:
        for name in (stale, mine):
            subprocess.run(["ip", "netns", "del", name], capture_output=True)
