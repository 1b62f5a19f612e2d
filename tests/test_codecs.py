"""Codecs on the wire (docs/design.md §4): fp16, int8 and int4 round trips and their error
bounds, the bytes they save, that only the stage data is coded, and that a fleet on a coded
wire equals the single-process simulator of the same codec (in memory and over Mosquitto with
real processes)."""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest
from helpers import MemoryJob, max_weight_diff
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from ftpipe_iot.control.config import ControllerConfig
from ftpipe_iot.control.weights_file import load_weights
from ftpipe_iot.core.data import DataSpec, load_dataset
from ftpipe_iot.core.reference import train_reference
from ftpipe_iot.errors import PlanError
from ftpipe_iot.protocol.codecs import BLOCK, bytes_per_value, decode_array, encode_array, roundtrip
from ftpipe_iot.protocol.messages import Activation, LayerReplica, envelope
from ftpipe_iot.protocol.plan import StageAssignment, TrainConfig
from ftpipe_iot.protocol.specs import ModelSpec
from ftpipe_iot.protocol.vocab import ControllerPhase, WireCodec
from ftpipe_iot.protocol.wire import MalformedFrame, WireOptions, decode, encode

FLOATS = arrays(np.float32, st.integers(1, 700),
                elements=st.floats(-1e4, 1e4, width=32, allow_nan=False))


@settings(max_examples=200, deadline=None)
@given(FLOATS, st.sampled_from([WireCodec.INT8, WireCodec.INT4]))
def test_blockwise_codes_are_within_half_a_step_of_their_block_and_deterministic(x, codec):
    back = roundtrip(x, codec)
    assert back.dtype == np.float32 and back.shape == x.shape
    levels = 127 if codec is WireCodec.INT8 else 7
    padded = np.concatenate([x, np.zeros((-x.size) % BLOCK, np.float32)]).reshape(-1, BLOCK)
    step = np.repeat(np.abs(padded).max(axis=1) / levels, BLOCK)[:x.size]
    assert np.all(np.abs(back - x) <= step / 2 * (1 + 1e-5) + 1e-30)
    assert np.array_equal(back, roundtrip(x.copy(), codec))  # same input, same bits
    assert np.array_equal(roundtrip(back, codec), back)  # a coded array codes to itself


@settings(max_examples=100, deadline=None)
@given(FLOATS)
def test_fp16_is_half_precision(x):
    back = roundtrip(x, WireCodec.FP16)
    assert np.array_equal(back, x.astype(np.float16).astype(np.float32))


def test_an_int8_activation_costs_under_a_third_of_its_float32_bytes():
    x = np.random.default_rng(0).standard_normal((8, 32, 16, 16)).astype(np.float32)
    sizes = {codec: len(encode(envelope(Activation(x, np.zeros(8, np.int64), True), "j", "d",
                                        1, 0, 0, 1), WireOptions(compress=False, codec=codec,
                                                                 max_message_bytes=1 << 24))[0])
             for codec in WireCodec}
    assert sizes[WireCodec.NONE] / sizes[WireCodec.INT8] >= 3.5
    assert sizes[WireCodec.NONE] / sizes[WireCodec.INT4] >= 6.5
    assert sizes[WireCodec.NONE] / sizes[WireCodec.FP16] >= 1.9
    assert bytes_per_value(WireCodec.INT8) * 3.5 < bytes_per_value(WireCodec.NONE)
    # integers and labels are never coded
    assert encode_array(np.arange(5), WireCodec.INT8).dtype == np.int64


def test_a_malformed_coded_array_is_a_clear_wire_error():
    coded = encode_array(np.ones(100, np.float32), WireCodec.INT8)
    coded["scale"] = np.ones(7, np.float32)  # two blocks need two scales
    with pytest.raises(ValueError, match="scales do not match"):
        decode_array(coded)
    x = np.ones((4, 4), np.float32)
    frame = encode(envelope(Activation(x, np.zeros(4, np.int64), True), "j", "d", 1, 0, 0, 1),
                   WireOptions(codec=WireCodec.INT4))[0]
    assert np.array_equal(decode(frame).body["x"], x)
    broken = frame.replace(b"shape", b"shapf")
    with pytest.raises(MalformedFrame):
        decode(broken)


def test_the_messenger_codes_the_stage_data_and_nothing_else():
    from prometheus_client import CollectorRegistry

    from ftpipe_iot.observability.metrics import MessagingMetrics
    from ftpipe_iot.transport.memory import MemoryBroker
    from ftpipe_iot.transport.messenger import Messenger

    messenger = Messenger(MemoryBroker().transport("d"), "d", "j",
                          MessagingMetrics(CollectorRegistry(), "device"))
    messenger.options = WireOptions(codec=WireCodec.INT8)
    x = np.random.default_rng(1).standard_normal((4, 50)).astype(np.float32)
    act = decode(messenger.frames(Activation(x, np.zeros(4, np.int64), True))[0]).body["x"]
    assert not np.array_equal(act, x) and np.array_equal(act, roundtrip(x, WireCodec.INT8))
    replica = LayerReplica(0, 3, {"weight": x}, {})
    body = decode(messenger.frames(replica)[0]).body
    assert np.array_equal(body["state"]["weight"], x)  # weights go exact


# -- fleet = the codec's simulator ----------------------------------------------------------------
TRAIN = TrainConfig(model=ModelSpec("cnn"), micro_batches=4, micro_batch_size=8, max_steps=6,
                    lr=0.05, replicate_every=3, wire_codec=WireCodec.INT8)
CUTS = (5, 9)  # [0,5) [5,9) [9,12)


def _stages() -> tuple[StageAssignment, ...]:
    bounds = (0, *CUTS, 12)
    return tuple(StageAssignment.single(k, f"d{k}", bounds[k], bounds[k + 1]) for k in range(3))


def test_the_simulator_needs_the_cuts_of_a_coded_wire():
    with pytest.raises(PlanError, match="needs the cuts"):
        train_reference(TRAIN, load_dataset(DataSpec("digits")), 1)


@pytest.mark.parametrize("codec", [WireCodec.INT8, WireCodec.INT4])
def test_a_fleet_on_a_coded_wire_equals_the_codec_simulator(codec):
    train = replace(TRAIN, wire_codec=codec)
    job = MemoryJob(ControllerConfig(train=train, devices=3, assignment=_stages(),
                                     repartition=False), devices=3)
    job.start()
    assert job.run() is ControllerPhase.DONE
    controller = job.controller
    gathered = [controller.weights[i] for i in range(controller.model.num_layers)]
    simulated = train_reference(train, controller.data, train.max_steps, cuts=CUTS)
    assert max_weight_diff(gathered, simulated) < 1e-5
    # the test can fail: the exact wire trains otherwise
    exact = train_reference(replace(train, wire_codec=WireCodec.NONE), controller.data,
                            train.max_steps)
    assert max_weight_diff(simulated, exact) > 1e-4


@pytest.mark.broker
def test_device_processes_on_an_int8_wire_over_mosquitto_equal_the_simulator(mosquitto,
                                                                             processes,
                                                                             tmp_path):
    job, steps = "codec", 6
    for i in range(3):
        processes.device(f"d{i}", job, mosquitto.url)
    controller = processes.start(
        "controller", "controller", "--job", job, "--broker", mosquitto.url, "--devices", "3",
        "--stop-devices", "--max-steps", str(steps), "--micro-batches", "4",
        "--micro-batch-size", "8", "--wire-codec", "int8", "--replicate-every", "3",
        "--assignment", "d0:0-5,d1:5-9,d2:9-12", "--no-repartition",
        "--save-weights", str(tmp_path / "weights.npz"), "--wait-devices", "60",
        "--stall-timeout", "60", "--json")
    assert processes.wait("controller", 180) == 0, processes.log("controller")[-3000:]
    summary = json.loads(controller.stdout.read().strip().splitlines()[-1])
    assert summary["steps"] == steps
    data = load_dataset(DataSpec("digits"))
    train = replace(TRAIN, max_steps=steps)
    gathered = load_weights(tmp_path / "weights.npz")
    assert max_weight_diff(gathered, train_reference(train, data, steps, cuts=CUTS)) < 1e-5


def test_the_planner_prices_the_codec_on_the_wire_and_not_in_memory():
    from ftpipe_iot.planning.micro import MicroBatchingProblem
    from ftpipe_iot.planning.solver import DeviceSpec, LayerCosts, solve_partition

    costs = LayerCosts((1.0,) * 4, (4e6,) * 4, (1e6,) * 4, micro_batch_size=8)
    int8 = replace(costs, wire_factor=bytes_per_value(WireCodec.INT8) / 4)
    slow = [DeviceSpec(f"d{i}", 1.0, 1.25e6) for i in range(2)]  # 10 Mbit/s links
    exact, coded = solve_partition(costs, slow), solve_partition(int8, slow)
    # a cut costs 6.4 s of link in fp32 (one device alone is faster: 4 s) and 1.7 s in int8
    assert len(exact.stages) == 1 and exact.bottleneck_s == pytest.approx(4.0)
    assert len(coded.stages) == 2 and coded.bottleneck_s == pytest.approx(2 + 6.4 * 1.0625 / 4)
    problem = MicroBatchingProblem(costs, [(0, 2), (2, 4)], slow)
    coded_problem = MicroBatchingProblem(int8, [(0, 2), (2, 4)], slow)
    link = problem.stage_s(0, 8) - 2.0 - 0.002  # compute 2 s, 2 ms a message
    assert coded_problem.stage_s(0, 8) - 2.0 - 0.002 == pytest.approx(link * 1.0625 / 4)
    assert coded_problem.stage_memory(0, 4, 8) == problem.stage_memory(0, 4, 8)
    assert LayerCosts.from_dict({"layer_cost_s": [1.0], "activation_bytes": [1.0],
                                 "layer_memory_bytes": [1.0], "wire_factor": 0.5}).wire_factor \
        == 0.5
    with pytest.raises(Exception, match="wire_factor"):
        replace(costs, wire_factor=2.0)
