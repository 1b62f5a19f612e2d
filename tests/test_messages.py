"""Typed message bodies: every body survives the wire unchanged, every bad field is one BadBody
(counted as a ``bad_body`` drop), and the protocol package loads without torch."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry

from ftpipe_iot.errors import BadBody
from ftpipe_iot.observability.metrics import ControllerMetrics
from ftpipe_iot.protocol.messages import (
    Activation,
    ActivationBatch,
    Capabilities,
    Command,
    ControllerState,
    DeviceStatus,
    Event,
    FedInput,
    Gradient,
    GroupPartial,
    Heartbeat,
    LayerReplica,
    PlanMessage,
    Progress,
    SpanBatch,
    decode_message,
    envelope,
)
from ftpipe_iot.protocol.plan import Plan, StageAssignment, TrainConfig
from ftpipe_iot.protocol.results import (
    CapacityProbed,
    DeviceError,
    MicroBatchFinished,
    MicroBatchLoss,
    Missing,
    Ready,
    Replicated,
    Report,
    Result,
    ResultBatch,
    StageStepDone,
)
from ftpipe_iot.protocol.vocab import (
    CommandOp,
    ControllerPhase,
    ControllerStatus,
    DeviceState,
    EventType,
    FailureCause,
    MessageKind,
)
from ftpipe_iot.protocol.wire import Envelope, decode, encode
from ftpipe_iot.transport.memory import MemoryBroker
from ftpipe_iot.transport.messenger import Messenger


def _plan() -> Plan:
    return Plan(version=7, job="j", stages=(StageAssignment.single(0, "a", 0, 2),
                                            StageAssignment.single(1, "b", 2, 6)),
                train=TrainConfig(), num_layers=6, input_shape=(1, 8, 8), num_classes=10)


MESSAGES = [
    PlanMessage(_plan()),
    Command(CommandOp.SHUTDOWN),
    Command(CommandOp.REPLICATE, version=4, layers=(1, 3)),
    Command(CommandOp.REPLICATE, version=4),
    Command(CommandOp.TAKE_OVER, devices=("a", "b")),
    ControllerState(ControllerStatus.TRAINING, "j", ControllerPhase.TRAINING, 10, {"a": 1.5}),
    ControllerState(ControllerStatus.OFFLINE, "j"),
    Event(EventType.FAILURE_DETECTED, cause=FailureCause.LAST_WILL, devices=("a",),
          silent_s=0.5),
    Event(EventType.PLAN_CHANGED, plan=7, resume_step=0, stages=_plan().stages),
    Event(EventType.JOB_FAILED, reason="no devices"),
    Activation(np.ones((2, 3), np.float32), np.array([1, 2]), train=True),
    Gradient(np.zeros((2, 3), np.float32)),
    Activation(np.ones((2, 3), np.float32), np.array([1, 2]), True, route=(0, 1, 0),
               counts=((4,), (2, 2), (3, 1))),
    GroupPartial(1, 0, {"0.weight": np.ones((2, 2), np.float32)},
                 {"2.running_mean": np.zeros(3, np.float32)}),
    GroupPartial(2, 1, {}),
    ActivationBatch((FedInput(3, 0, Activation(np.ones((2, 3), np.float32), np.array([1, 2]),
                                               True, (0,), ((2, 2),))),
                     FedInput(3, 2, Activation(np.zeros((2, 3), np.float32), np.array([3, 4]),
                                               True, (0,), ((2, 2),))))),
    Progress(3),
    LayerReplica(3, 10, {"weight": np.ones((2, 2), np.float32)},
                 {"state": {"0": {"momentum_buffer": np.zeros((2, 2), np.float32)}},
                  "param_groups": [{"lr": 0.1, "params": [0]}]}),
    LayerReplica(0, 0, {}, None),
    DeviceStatus(DeviceState.ONLINE, "j", "0.1.0", Capabilities("rpi4", 5e6, 2**28)),
    DeviceStatus(DeviceState.ONLINE, "j", "0.1.0", Capabilities(host="3f2a9c0d1e4b5a6f")),
    Heartbeat(1, 2, 0.1, 0.2, ((0.01, 0.02),), 3, {"malformed": 2}, 1e6, 0.01),
    Heartbeat(1, 2, 0.1, 0.2, ((0.01, 0.02),), 0, {"late": 1}, 1e6, 0.01, sent_bytes=10,
              received_bytes=20, takeovers=3),
    Heartbeat(clock_sent=1.7e9, clock_received=1.7e9 + 0.002),
    SpanBatch(("forward", "send"), np.array([0, 1, 0], np.uint8),
              np.array([1.7e9, 1.7e9 + 0.01, 1.7e9 + 0.02]), np.array([0.01, 0.002, 0.01],
                                                                      np.float32),
              np.array([3, 3, 3], np.int32), np.array([0, 0, 1], np.int32), stage=1, lost=2),
    Result(Ready(1)),
    Result(MicroBatchLoss(2.3, 4, 8)),
    Result(MicroBatchLoss(18.0, 50, 64, train=False)),
    Result(MicroBatchFinished()),
    Result(StageStepDone(0, 0.1, 0.2, ((0.05, 0.1), (0.05, 0.1)))),
    Result(StageStepDone(0, 0.1, 0.2, (), typical_s=0.3, micro_batches=2, typical_cpu_s=0.1,
                         typical_emulated_s=0.15)),
    Result(Replicated(10, (0, 2), 1234, {"stale_plan": 1})),
    Result(Missing(10, (4, 5))),
    Result(CapacityProbed(0, 12, (0.12, 0.1, 0.11), (0.05, 0.05, 0.06), (0.06, 0.05, 0.05))),
    Result(DeviceError("cannot build the stage")),
    ResultBatch((Report(3, 1, Result(MicroBatchLoss(2.3, 4, 8))),
                 Report(3, 1, Result(MicroBatchFinished())),
                 Report(3, -1, Result(StageStepDone(0, 0.1, 0.2, typical_s=0.3))))),
    ResultBatch((Report(9, 4, Result(MicroBatchLoss(18.0, 50, 64, train=False))),)),
]


def _equal(a: object, b: object) -> bool:
    if isinstance(a, np.ndarray):
        return isinstance(b, np.ndarray) and a.dtype == b.dtype and np.array_equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    if hasattr(a, "__dataclass_fields__"):
        return type(a) is type(b) and all(_equal(getattr(a, f), getattr(b, f))
                                          for f in a.__dataclass_fields__)
    return a == b


@pytest.mark.parametrize("message", MESSAGES, ids=lambda m: type(m).__name__)
def test_every_body_round_trips_through_the_wire(message):
    env = envelope(message, "j", "sender", plan_version=7, step=3, micro_batch=1)
    inbound = decode_message(decode(encode(env)[0]), "some/topic")
    assert inbound.kind is message.KIND
    assert (inbound.sender, inbound.plan_version, inbound.step, inbound.micro_batch) == \
        ("sender", 7, 3, 1)
    assert _equal(inbound.message, message)


DONE = {"type": "mb_done"}
_INPUT = {"x": np.zeros((1, 2), np.float32), "y": np.zeros(1, np.int64), "train": True}


def _spans(**changed: object) -> dict:
    body = {"names": ["forward", "send"], "kinds": np.array([0, 1], np.uint8),
            "start": np.array([1.0, 2.0]), "duration": np.array([0.1, 0.1], np.float32),
            "step": np.array([0, 0], np.int32), "micro_batch": np.array([0, 1], np.int32)}
    return {**body, **changed}


@pytest.mark.parametrize(("kind", "body", "field"), [
    (MessageKind.STATUS, {"state": "online", "job": "j",
                          "capabilities": {"memory_bytes": "lots"}}, "memory_bytes"),
    (MessageKind.STATUS, {"state": "sleeping", "job": "j"}, "state"),
    (MessageKind.HEARTBEAT, {"forward_s": float("nan")}, "forward_s"),
    (MessageKind.HEARTBEAT, {"layer_times": [[0.1]]}, "layer_times"),
    (MessageKind.RESULT, {"type": "loss", "loss": "high", "correct": 1, "count": 2}, "loss"),
    (MessageKind.RESULT, {"type": "step_done", "stage": -1, "forward_s": 0,
                          "backward_s": 0}, "stage"),
    (MessageKind.RESULT, {"type": "teleported"}, "type"),
    (MessageKind.RESULT, {"type": "missing", "version": 3, "layers": ["x"]}, "layers"),
    (MessageKind.RESULTS, {"reports": []}, "reports"),
    (MessageKind.RESULTS, {"reports": [[1, 0]]}, "reports"),
    (MessageKind.RESULTS, {"reports": [[True, 0, DONE]]}, "reports"),
    (MessageKind.RESULTS, {"reports": [[1, -2, DONE]]}, "reports"),
    (MessageKind.RESULTS, {"reports": [[0, 0, DONE]] * 65}, "reports"),
    (MessageKind.RESULTS, {"reports": [[1, 0, DONE], [1, 0, {"type": "loss", "loss": "high",
                                                            "correct": 1, "count": 2}]]}, "loss"),
    (MessageKind.ACTIVATION, {"x": [1, 2], "y": np.zeros(2, np.int64), "train": True}, "x"),
    (MessageKind.ACTIVATIONS, {"inputs": []}, "inputs"),
    (MessageKind.ACTIVATIONS, {"inputs": [[0, 1]]}, "inputs"),
    (MessageKind.ACTIVATIONS, {"inputs": [[0, -1, {}]]}, "inputs"),
    (MessageKind.ACTIVATIONS, {"inputs": [[0, 0, _INPUT]] * 65}, "inputs"),
    (MessageKind.ACTIVATIONS, {"inputs": [[0, 0, {**_INPUT, "train": "yes"}]]}, "train"),
    (MessageKind.ACTIVATION, {"x": np.zeros(2), "y": np.zeros(2, np.int64)}, "train"),
    (MessageKind.WEIGHTS, {"layer": 1, "version": 2, "state": {"w": [1.0]}}, "state"),
    (MessageKind.COMMAND, {"op": "reboot"}, "op"),
    (MessageKind.PLAN, {"plan": {"version": 1}}, "plan"),
    (MessageKind.EVENT, {"type": "failure_detected", "cause": "gremlins"}, "cause"),
    (MessageKind.STATE, {"state": "online", "job": "j", "capacities": {"a": "fast"}},
     "capacities"),
    (MessageKind.SPANS, _spans(kinds=np.array([0, 2], np.uint8)), "kinds"),
    (MessageKind.SPANS, _spans(start=np.array([1.0])), "start"),
    (MessageKind.SPANS, _spans(duration=np.array([0.1, -0.1], np.float32)), "duration"),
    (MessageKind.SPANS, _spans(step=[1, 2]), "step"),
    (MessageKind.HEARTBEAT, {"clock_sent": -1.0}, "clock_sent"),
])
def test_a_bad_field_is_one_bad_body_error_naming_it(kind, body, field):
    env = Envelope(kind, "j", "s", body=body)
    with pytest.raises(BadBody, match=field):
        decode_message(decode(encode(env)[0]))


def test_a_batch_of_inputs_is_taken_as_its_micro_batches_each_as_if_alone():
    """The feed's frame of several micro-batches arrives as one message; a receiver takes its
    inputs in order, each with its own step and index, as separate frames would give them."""
    first = Activation(np.ones((2, 3), np.float32), np.array([1, 2]), True, (1,), ((2, 2),))
    second = Activation(np.zeros((2, 3), np.float32), np.array([3, 4]), True, (1,), ((2, 2),))
    batch = ActivationBatch((FedInput(5, 1, first), FedInput(6, 3, second)))
    assert batch.nbytes == first.nbytes + second.nbytes
    env = envelope(batch, "j", "controller", plan_version=7, step=5, micro_batch=1)
    inbound = decode_message(decode(encode(env)[0]), "ftpipe/j/stage/0/act/d1")
    parts = inbound.unbundled()
    assert [(p.step, p.micro_batch, p.sender, p.topic, p.plan_version) for p in parts] == \
        [(5, 1, "controller", "ftpipe/j/stage/0/act/d1", 7),
         (6, 3, "controller", "ftpipe/j/stage/0/act/d1", 7)]
    assert _equal(parts[0].message, first) and _equal(parts[1].message, second)
    alone = decode_message(decode(encode(envelope(first, "j", "c", step=2))[0]))
    assert alone.unbundled() == [alone]


def test_messenger_counts_a_bad_body_as_a_drop_and_keeps_going():
    broker = MemoryBroker()
    messenger = Messenger(broker.transport("c"), "c", "j", ControllerMetrics(CollectorRegistry()))
    bad = encode(Envelope(MessageKind.HEARTBEAT, "j", "d", body={"queue_depth": -3}))[0]
    good = encode(envelope(Heartbeat(queue_depth=3), "j", "d"))[0]
    from ftpipe_iot.transport.base import Incoming

    assert messenger.receive(Incoming("ftpipe/dev/d/hb", bad)) is None
    inbound = messenger.receive(Incoming("ftpipe/dev/d/hb", good))
    assert inbound is not None and inbound.message == Heartbeat(queue_depth=3)
    assert messenger.drops.counts == {"bad_body": 1}


finite = st.floats(min_value=0, max_value=1e6, allow_nan=False)


@given(stage=st.integers(0, 64), forward=finite, backward=finite,
       times=st.lists(st.tuples(finite, finite), max_size=8))
def test_step_results_round_trip_for_any_valid_values(stage, forward, backward, times):
    message = Result(StageStepDone(stage, forward, backward, tuple(times)))
    back = decode_message(decode(encode(envelope(message, "j", "d"))[0])).message
    assert back == message


def test_loading_a_plan_imports_no_torch():
    code = ("import sys, json\n"
            "from ftpipe_iot.protocol.messages import PlanMessage, decode_message, envelope\n"
            "from ftpipe_iot.protocol.wire import decode, encode\n"
            "from ftpipe_iot.protocol.plan import Plan, StageAssignment, TrainConfig\n"
            "stages = (StageAssignment.single(0, 'a', 0, 3),)\n"
            "plan = Plan(1, 'j', stages, TrainConfig(), 3, (4,), 2)\n"
            "back = decode_message(decode(encode(envelope(PlanMessage(plan), 'j', 'c'))[0]))\n"
            "assert back.message.plan == plan\n"
            "print('torch' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True)
    assert out.stdout.strip() == "False", out.stderr


def test_a_probe_with_uneven_clocks_is_refused_with_one_line():
    body = Result(CapacityProbed(0, 12, (0.1, 0.2), (0.05, 0.1), (0.0, 0.0))).to_body()
    body["cpu_s"] = [0.05]
    with pytest.raises(BadBody, match="cpu_s.*as many entries as wall_s"):
        Result.from_body(body)
    body["cpu_s"] = [0.05, -1.0]
    with pytest.raises(BadBody, match="non-negative finite seconds"):
        Result.from_body(body)
