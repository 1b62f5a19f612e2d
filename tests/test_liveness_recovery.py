"""Pure failure detection, recovery decisions, replicas and the stage loader."""

from __future__ import annotations

import numpy as np
import torch

from ftpipe_iot.control.liveness import LivenessTracker
from ftpipe_iot.control.recovery import choose_devices, recovery_plan
from ftpipe_iot.core.loader import StageLoader
from ftpipe_iot.core.replicas import ReplicaStore, export_layer, import_layer
from ftpipe_iot.core.stage import make_optimizer
from ftpipe_iot.protocol.messages import LayerReplica
from ftpipe_iot.protocol.plan import TrainConfig
from ftpipe_iot.protocol.vocab import FailureCause
from ftpipe_iot.protocol.wire import Envelope, MessageKind, decode, encode


def _replica(layer: int, version: int) -> LayerReplica:
    return LayerReplica(layer, version, {"w": np.full(2, float(version), np.float32)}, None)


def test_heartbeat_timeout_and_stall():
    tracker = LivenessTracker(heartbeat_timeout_s=2.0, stall_timeout_s=10.0)
    tracker.reset({"a", "b"}, now=0.0)
    tracker.seen("a", 1.5)
    assert tracker.check({"a", "b"}, now=1.9) is None
    failure = tracker.check({"a", "b"}, now=2.5)
    assert failure.devices == {"b"} and failure.cause is FailureCause.HEARTBEAT_TIMEOUT
    tracker.seen("a", 8.5)
    tracker.seen("b", 8.5)
    assert tracker.check({"a", "b"}, now=9.0) is None  # last progress at 0.0, limit 10 s
    tracker.seen("a", 10.4)
    tracker.seen("b", 10.4)
    stall = tracker.check({"a", "b"}, now=10.5)
    assert stall.cause is FailureCause.STALLED_STEP and not stall.devices
    tracker.progressed(10.5)
    assert tracker.check({"a", "b"}, now=11.0) is None


def test_replica_store_latest_complete_never_mixes_versions():
    store = ReplicaStore(num_layers=3)
    for layer in range(3):
        store.add(_replica(layer, 10))
    store.add(_replica(0, 20))
    store.add(_replica(1, 20))
    assert store.latest_complete() == 10  # layer 2 never reached 20
    store.add(_replica(2, 20))
    assert store.latest_complete() == 20
    store.drop_newer_than(10)
    assert store.latest_complete() == 10 and store.versions(0) == [10]


def test_recovery_restores_newest_complete_version_and_republishes_the_rest():
    store = ReplicaStore(num_layers=3)
    for layer in range(3):
        store.add(_replica(layer, 10))
    store.add(_replica(0, 20))  # half-published when the failure struck
    plan = recovery_plan(store, {0: 20, 1: 10, 2: 10}, ["a", "b", "c"], {"a", "b", "c", "s"},
                         dead={"b"}, wanted=3)
    assert plan.version == 10
    assert plan.republish == (0,)
    assert plan.devices == ("a", "c", "s")  # survivors first, in order, then the spare


def test_recovery_with_no_checkpoint_starts_from_the_seed():
    plan = recovery_plan(ReplicaStore(num_layers=2), {}, ["a"], {"a"}, dead=set(), wanted=2)
    assert plan.version == 0 and plan.republish == ()


def test_choose_devices_limits_and_skips_the_dead():
    assert choose_devices(["x", "y"], {"x", "y", "z", "w"}, {"y"}, wanted=2) == ("x", "w")


def test_loader_takes_only_its_version_and_prefers_local_copies():
    loader = StageLoader([3, 4, 5], version=10, local={3: _replica(3, 10), 4: _replica(4, 5)})
    assert loader.missing == {4, 5}
    assert not loader.offer(_replica(4, 15))
    assert not loader.offer(_replica(7, 10))
    assert loader.offer(_replica(4, 10)) and loader.offer(_replica(5, 10))
    assert loader.done and loader.replicas()[4].version == 10


def test_layer_with_optimizer_state_round_trips_through_the_wire_exactly():
    layer = torch.nn.Linear(4, 3)
    config = TrainConfig()
    optimizer = make_optimizer(layer, config)
    layer(torch.randn(5, 4)).sum().backward()
    optimizer.step()  # creates momentum buffers
    replica = export_layer(layer, optimizer, index=7, version=3)
    env = Envelope(MessageKind.WEIGHTS, "j", "d", body=replica.to_body())
    back = LayerReplica.from_body(decode(encode(env)[0]).body)
    fresh = torch.nn.Linear(4, 3)
    fresh_opt = make_optimizer(fresh, config)
    import_layer(back, fresh, fresh_opt)
    for a, b in zip(layer.parameters(), fresh.parameters()):
        assert torch.equal(a, b)
    x = torch.randn(5, 4)
    for lay, opt in ((layer, optimizer), (fresh, fresh_opt)):
        opt.zero_grad()
        lay(x).sum().backward()
        opt.step()
    for a, b in zip(layer.parameters(), fresh.parameters()):
        assert torch.equal(a, b)  # momentum restored too: the next update is identical
