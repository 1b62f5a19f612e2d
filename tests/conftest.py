"""Shared fixtures: a real Mosquitto broker on a free port with a temp config."""

from __future__ import annotations

import shutil
from collections.abc import Iterator

import pytest

from ftpipe_iot.runtime.broker import BrokerKind, BrokerProcess, mosquitto_binary


@pytest.fixture(autouse=True, scope="session")
def one_torch_thread() -> Iterator[None]:
    """In-process stages compute with one intra-op thread, like the device processes and the
    single-process reference: a different thread count changes the last bits of reductions."""
    import torch

    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture
def mosquitto(tmp_path) -> Iterator[BrokerProcess]:
    """A fresh Mosquitto (persistence on) on a free loopback port, stopped after the test."""
    if mosquitto_binary() is None:
        pytest.fail("mosquitto is not installed; .ci/run installs it (apt-get install mosquitto)")
    broker = BrokerProcess(kind=BrokerKind.MOSQUITTO, data_dir=tmp_path / "broker")
    broker.start()
    try:
        yield broker
    finally:
        broker.cleanup()


@pytest.fixture
def mosquitto_clients() -> None:
    """Fail clearly when the mosquitto_pub/mosquitto_sub clients are missing."""
    if not (shutil.which("mosquitto_pub") and shutil.which("mosquitto_sub")):
        pytest.fail("mosquitto-clients are not installed; .ci/run installs them")


@pytest.fixture
def processes(tmp_path):
    """Child processes of the package's CLI, killed at the end of the test."""
    from helpers import Processes

    procs = Processes(tmp_path / "logs")
    try:
        yield procs
    finally:
        procs.stop_all()


@pytest.fixture
def netlab(request):
    """A network lab (hub + capped veth links, runtime/netns.py), removed after the test; skips
    with the reason when this host cannot make one (no CAP_NET_ADMIN, no iproute2)."""
    from ftpipe_iot.runtime.netns import NetLab, unavailable

    reason = unavailable()
    if reason is not None:
        pytest.skip(f"network namespaces unavailable: {reason}")
    lab = NetLab(tag=request.node.name[5:17].replace("_", ""))
    try:
        yield lab
    finally:
        lab.close()
