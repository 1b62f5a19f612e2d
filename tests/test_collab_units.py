"""The pure parts of the collaborative and fedavg modes: FedAvg, data partitions, the planner
and its schedule simulation, round bookkeeping, DP settings and Opacus on micro-batches, the
wire bodies. No broker."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ftpipe_iot.collab.data_split import PartitionSpec, split_indices
from ftpipe_iot.collab.fedavg import merge_parts, weighted_mean
from ftpipe_iot.collab.parts import DevicePart, ServerReplica, export_states
from ftpipe_iot.collab.planner import Machine, ModelFacts, choose, simulate_iteration
from ftpipe_iot.collab.privacy import check_private_layers
from ftpipe_iot.collab.rounds import RoundSpan, RoundState, round_spans
from ftpipe_iot.core.data import Dataset, load_dataset
from ftpipe_iot.core.models import build_layers, cut_shapes
from ftpipe_iot.core.reference import train_reference
from ftpipe_iot.core.schedule import SyncSchedule
from ftpipe_iot.errors import BadBody, CollabError, DataError, ModelError, PrivacyError
from ftpipe_iot.protocol.collab import LayerTimes, LocalUpdate, PrivacySettings, Round, Smashed
from ftpipe_iot.protocol.messages import decode_message, envelope
from ftpipe_iot.protocol.plan import TrainConfig
from ftpipe_iot.protocol.specs import DataSpec, ModelSpec
from ftpipe_iot.protocol.vocab import CollabRole
from ftpipe_iot.protocol.wire import decode, encode

# -- FedAvg --------------------------------------------------------------------------------------


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(1, 5000), min_size=1, max_size=6), st.integers(0, 2**31 - 1))
def test_fedavg_is_the_sample_weighted_mean(counts, seed):
    rng = np.random.default_rng(seed)
    states = [(n, {"w": rng.standard_normal((3, 4)).astype(np.float32),
                   "b": rng.standard_normal(4).astype(np.float32)}) for n in counts]
    merged = weighted_mean(states)
    total = sum(counts)
    for name in ("w", "b"):
        expected = sum(n * s[name].astype(np.float64) for n, s in states) / total
        np.testing.assert_allclose(merged[name], expected, rtol=1e-6, atol=1e-6)
        assert merged[name].dtype == np.float32


def test_fedavg_weights_by_samples_not_by_count_of_updates():
    merged = weighted_mean([(1, {"w": np.zeros(2, np.float32)}),
                            (3, {"w": np.full(2, 4.0, np.float32)})])
    np.testing.assert_array_equal(merged["w"], [3.0, 3.0])  # (1*0 + 3*4) / 4, not 2


def test_fedavg_does_not_depend_on_arrival_order_and_keeps_counters():
    a = ("a", 2, {0: {"w": np.array([1.0, 2.0], np.float32), "n": np.array(5)}})
    b = ("b", 1, {0: {"w": np.array([4.0, 8.0], np.float32), "n": np.array(7)}})
    first, second = merge_parts([a, b]), merge_parts([b, a])
    np.testing.assert_array_equal(first[0]["w"], second[0]["w"])
    assert int(first[0]["n"]) == 7  # an integer buffer is a counter: the largest, not a mean


def test_a_merged_batchnorm_layer_goes_out_as_a_valid_weights_message():
    """BatchNorm's counter is a 0-d array; the merged model the coordinator publishes must keep
    it an array, or every device drops the new global weights as a bad body (full-width
    MobileNetV2 under --mode fedavg stalled after its first round)."""
    import torch

    from ftpipe_iot.protocol.messages import LayerReplica

    layer = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4))
    state = {k: v.numpy().copy() for k, v in layer.state_dict().items()}
    other = {k: v + 1 for k, v in state.items()}
    merged = weighted_mean([(2, state), (1, other)])
    for name, value in merged.items():
        assert isinstance(value, np.ndarray) and value.shape == state[name].shape, name
        assert value.dtype == state[name].dtype, name
    replica = decode_message(decode(encode(envelope(LayerReplica(0, 1, merged, None), "j",
                                                    "coordinator"))[0])).message
    assert int(replica.state["1.num_batches_tracked"]) == 1
    np.testing.assert_array_equal(replica.state["1.running_var"], merged["1.running_var"])


def test_fedavg_refuses_mismatched_updates():
    with pytest.raises(CollabError, match="shape"):
        weighted_mean([(1, {"w": np.zeros(2)}), (1, {"w": np.zeros(3)})])
    with pytest.raises(CollabError, match="positive"):
        weighted_mean([(0, {"w": np.zeros(2)})])


# -- partitions ----------------------------------------------------------------------------------


@pytest.mark.parametrize("text", ["iid", "dirichlet:0.3"])
def test_partitions_cover_every_sample_once_and_are_deterministic(text):
    labels = np.repeat(np.arange(10), 40)
    spec = PartitionSpec.parse(text)
    parts = split_indices(labels, 4, spec, seed=3, min_samples=16)
    joined = np.concatenate(parts)
    assert sorted(joined.tolist()) == list(range(len(labels)))
    assert all(len(p) >= 16 for p in parts)
    again = split_indices(labels, 4, spec, seed=3, min_samples=16)
    assert all(np.array_equal(a, b) for a, b in zip(parts, again))


def test_dirichlet_skews_classes_more_than_iid():
    labels = np.repeat(np.arange(10), 100)

    def skew(text: str) -> float:
        parts = split_indices(labels, 4, PartitionSpec.parse(text), seed=0, min_samples=1)
        shares = [np.bincount(labels[p], minlength=10) / len(p) for p in parts]
        return float(np.mean([np.abs(s - 0.1).sum() for s in shares]))

    assert skew("dirichlet:0.1") > 3 * skew("iid")


@pytest.mark.parametrize("text", ["dirichlet", "dirichlet:-1", "dirichlet:x", "zipf:2"])
def test_bad_partitions_are_refused(text):
    with pytest.raises(DataError, match="partition"):
        PartitionSpec.parse(text)


# -- planner -------------------------------------------------------------------------------------


def _times(n_layers: int, forward: float, backward: float) -> LayerTimes:
    row_f, row_b = tuple([forward] * n_layers), tuple([backward] * n_layers)
    return LayerTimes((1, 32), (row_f, row_f), (row_b, row_b))  # a fixed cost per call


FACTS = ModelFacts(activation_bytes=(256, 256, 256, 256, 40),
                   param_bytes=(400, 0, 400, 400, 400))


def test_split_points_keep_raw_inputs_and_give_the_server_work():
    mlp = ModelFacts((64, 512, 512, 256, 256, 40), (0, 1000, 0, 1000, 0, 100))
    assert mlp.head_start == 5
    # [Flatten] alone would send the raw input; [Flatten, Linear, ReLU, Linear] leaves the
    # server only a ReLU.
    assert mlp.split_points() == [2, 3]
    assert FACTS.split_points() == [1, 2, 3]


def test_one_micro_batch_on_one_device_is_the_serial_critical_path():
    device = Machine("d", _times(5, 0.01, 0.02), uplink=1000.0, downlink=2000.0)
    server = Machine("s", _times(5, 0.001, 0.002))
    p = simulate_iteration([device], server, FACTS, split=2, batch=4, micro_batches=1,
                           latency_s=0.005, aggregate_every=0)
    front = 2 * 0.01 + 2 * 0.02
    head = 0.01 + 0.02
    middle = 2 * (0.001 + 0.002)
    links = 4 * 256 / 1000 + 4 * 256 / 2000 + 4 * 256 / 1000 + 4 * 256 / 2000
    assert p.iteration_s == pytest.approx(front + head + middle + links + 4 * 0.005)
    assert p.server_busy_s == pytest.approx(middle)


def test_micro_batches_overlap_links_with_compute():
    device = Machine("d", LayerTimes((1, 32), ((0.0,) * 5, (0.032,) * 5),
                                     ((0.0,) * 5, (0.032,) * 5)), uplink=2e3, downlink=2e3)
    server = Machine("s", _times(5, 0.0, 0.0))
    one, eight = (simulate_iteration([device], server, FACTS, 2, 32, n, 0.0, 0).iteration_s
                  for n in (1, 8))
    assert eight < 0.6 * one


def test_a_shared_server_is_busier_with_more_devices():
    device = _times(5, 0.001, 0.001)
    server = Machine("s", _times(5, 0.01, 0.01))
    one = simulate_iteration([Machine("a", device)], server, FACTS, 2, 8, 2, 0.0, 0)
    four = simulate_iteration([Machine(n, device) for n in "abcd"], server, FACTS, 2, 8, 2,
                              0.0, 0)
    assert four.server_busy_s == pytest.approx(4 * one.server_busy_s)
    assert four.iteration_s > 3 * one.iteration_s  # the server is the bottleneck


def test_choose_picks_the_shortest_predicted_iteration_and_refuses_bad_pins():
    devices = [Machine("a", _times(5, 0.01, 0.01), 1e4, 1e4)]
    servers = [Machine("slow", _times(5, 0.01, 0.01)), Machine("fast", _times(5, 0.001, 0.001))]
    choice = choose(devices, servers, FACTS, batch=8, aggregate_every=10)
    assert choice.server == "fast"
    assert choice.chosen.iteration_s == min(c.iteration_s for c in choice.candidates)
    assert {c.split_point for c in choice.candidates} == {1, 2, 3}
    with pytest.raises(CollabError, match="split point 4 is not usable"):
        choose(devices, servers, FACTS, 8, 10, split_point=4)
    with pytest.raises(CollabError, match="do not divide"):
        choose(devices, servers, FACTS, 8, 10, micro_batches=3)
    with pytest.raises(CollabError, match="needs a server"):
        choose(devices, [], FACTS, 8, 10)


# -- rounds --------------------------------------------------------------------------------------


def test_round_spans_cover_the_job():
    assert round_spans(10, 4) == [RoundSpan(0, 0, 4), RoundSpan(1, 4, 4), RoundSpan(2, 8, 2)]
    assert round_spans(10, 0) == [RoundSpan(0, 0, 10)]


def _update(device: str, role: CollabRole, value: float, round_: int = 0) -> LocalUpdate:
    return LocalUpdate(round_, device, role, {0 if role is CollabRole.DATA else 1:
                                              {"w": np.full(2, value, np.float32)}})


def test_a_round_completes_without_a_participant_that_dropped_out():
    state = RoundState(RoundSpan(0, 0, 4), ("a", "b", "c"), needs_server=True)
    for device, value in (("a", 1.0), ("b", 3.0)):
        assert state.add(_update(device, CollabRole.DATA, value))
        assert state.add(_update(device, CollabRole.SERVER, value))
    assert not state.complete  # c still owes its parts
    assert state.drop("c") and state.complete
    assert not state.add(_update("c", CollabRole.DATA, 100.0))  # too late: left out
    merged = state.merged({"a": 1, "b": 3, "c": 1000})
    np.testing.assert_allclose(merged[0]["w"], [2.5, 2.5])  # (1*1 + 3*3) / 4
    np.testing.assert_allclose(merged[1]["w"], [2.5, 2.5])


def test_a_participant_that_delivered_stays_in_after_going_away():
    state = RoundState(RoundSpan(0, 0, 4), ("a",), needs_server=False)
    state.add(_update("a", CollabRole.DATA, 1.0))
    assert not state.drop("a")
    assert state.complete and 0 in state.merged({"a": 5})
    assert not state.add(_update("a", CollabRole.DATA, 1.0, round_=1))  # another round


# -- differential privacy ------------------------------------------------------------------------


@pytest.mark.parametrize("args, message", [
    ((0.0, 1.0, 1e-5), "noise-multiplier must be a finite number > 0"),
    ((-1.0, 1.0, 1e-5), "noise-multiplier"),
    ((math.nan, 1.0, 1e-5), "noise-multiplier"),
    ((1.0, 0.0, 1e-5), "max-grad-norm must be a finite number > 0"),
    ((1.0, math.inf, 1e-5), "max-grad-norm"),
    ((1.0, 1.0, 0.0), "delta must be between 0 and 1"),
    ((1.0, 1.0, 1.5), "delta"),
])
def test_bad_privacy_settings_are_refused(args, message):
    with pytest.raises(PrivacyError, match=message):
        PrivacySettings(*args)


def test_delta_must_be_below_one_over_the_samples():
    with pytest.raises(PrivacyError, match="not below 1/n"):
        PrivacySettings(1.0, 1.0, 0.01).check_samples("dev0", 200)
    PrivacySettings(1.0, 1.0, 0.001).check_samples("dev0", 200)


def test_batchnorm_on_the_device_is_refused_by_name():
    layers = build_layers(ModelSpec("mobilenetv2", width=0.25), (3, 32, 32), 10, seed=0)
    with pytest.raises(PrivacyError, match=r"layer 0 \(Sequential\).*BatchNorm"):
        check_private_layers(layers[:1], [0])


CONFIG = TrainConfig(model=ModelSpec("cnn"), micro_batches=4, micro_batch_size=8)


def _train_split(privacy: PrivacySettings | None, steps: int = 6):
    """One device and its server replica in process (the compute the processes run)."""
    data = load_dataset(DataSpec("digits"))
    x, y = data.x_train[:160], data.y_train[:160]
    layers = build_layers(CONFIG.model, data.input_shape, 10, CONFIG.seed)
    shapes = cut_shapes(layers, data.input_shape, 10)
    device = DevicePart(layers, 3, 11, shapes, 10, CONFIG, privacy, len(y), "d0")
    server = ServerReplica(layers[3:11], 3, shapes[3], CONFIG)
    schedule = SyncSchedule(len(y), 4, 8, CONFIG.seed)
    for step in range(steps):
        batches = schedule.micro_batches_of(step)
        # all forwards first (the pipeline's order), then replies micro-batch by micro-batch
        smashed = [device.forward(step, mb.index, x[mb.sample_indices]) for mb in batches]
        for mb, a1 in zip(batches, smashed):
            g2, _, _ = device.loss(step, mb.index, server.forward(step, mb.index, a1),
                                   y[mb.sample_indices])
            g1, _ = server.backward(step, mb.index, g2)
            device.backward(step, mb.index, g1)
    states = {**export_states(device.layers), **export_states(server.layers)}
    reference = train_reference(CONFIG, Dataset(x, y, data.x_test, data.y_test, 10, "d0"),
                                steps)
    return [states[i] for i in range(len(layers))], reference, device.epsilon


def _max_diff(a, b) -> float:
    return max(float(np.abs(la[k] - lb[k]).max()) for la, lb in zip(a, b) for k in la)


def test_split_compute_equals_single_process_training():
    got, reference, epsilon = _train_split(None)
    assert _max_diff(got, reference) < 1e-6 and epsilon is None


def test_dp_sgd_over_micro_batches_clips_per_sample_of_the_whole_mini_batch():
    # With no clipping in effect and negligible noise, DP-SGD is plain SGD: this fails unless
    # the per-sample gradients of N micro-batches are scaled back and averaged over B.
    got, reference, _ = _train_split(PrivacySettings(1e-12, 1e4, 1e-5))
    assert _max_diff(got, reference) < 1e-5
    noisy, _, epsilon = _train_split(PrivacySettings(1.0, 1.0, 1e-5))
    assert _max_diff(noisy, reference) > 1e-3
    assert epsilon is not None and 0 < epsilon < math.inf


def test_epsilon_is_what_the_accountant_says_for_the_steps_taken():
    from opacus.accountants import RDPAccountant

    _, _, epsilon = _train_split(PrivacySettings(1.1, 1.0, 1e-5), steps=4)
    accountant = RDPAccountant()
    for _ in range(4):
        accountant.step(noise_multiplier=1.1, sample_rate=32 / 160)
    assert epsilon == pytest.approx(accountant.get_epsilon(delta=1e-5))


# -- wire bodies ---------------------------------------------------------------------------------


def _roundtrip(message):
    return decode_message(decode(encode(envelope(message, "j", "s"))[0])).message


def test_collab_bodies_roundtrip():
    update = LocalUpdate(2, "d0", CollabRole.SERVER, {3: {"weight": np.ones((2, 2), np.float32)}})
    back = _roundtrip(update)
    assert back.layers.keys() == {3} and back.role is CollabRole.SERVER
    assert _roundtrip(Round(1, 4, 4, ("a", "b"))) == Round(1, 4, 4, ("a", "b"))
    assert _roundtrip(Smashed(np.zeros((2, 3), np.float32))).x.shape == (2, 3)


def test_malformed_collab_bodies_are_bad_bodies():
    env = encode(envelope(LocalUpdate(0, "d", CollabRole.DATA, {0: {"w": np.zeros(1)}}), "j",
                          "s"))[0]
    decoded = decode(env)
    decoded.body["layers"] = {"zero": {"w": 1}}
    with pytest.raises(BadBody, match="layers"):
        decode_message(decoded)
    bad = decode(encode(envelope(Round(0, 0, 1, ("a",)), "j", "s"))[0])
    bad.body["iterations"] = 0
    with pytest.raises(BadBody, match="iterations"):
        decode_message(bad)


# -- command line --------------------------------------------------------------------------------


def test_plan_collaborative_prints_every_split_point_and_the_choice():
    from click.testing import CliRunner

    from ftpipe_iot.cli import main

    args = ["plan", "--mode", "collaborative", "--model", "cnn", "--profiles",
            "devices/profiles/collab-rpi-zero.json", "devices/profiles/collab-rpi-zero.json",
            "--server-profile", "devices/profiles/gateway.json", "--aggregate-every", "5"]
    text = CliRunner().invoke(main, args, catch_exceptions=False).output
    rows = [line.split() for line in text.splitlines() if line[:1].isdigit()]
    assert [int(r[0]) for r in rows] == list(range(1, 10))  # cnn: split points 1..9
    assert "choice: split point" in text and "fedavg baseline" in text
    report = json.loads(CliRunner().invoke(main, [*args, "--json"]).output)
    best = min(c["iteration_s"] for c in report["candidates"])
    assert report["chosen"]["iteration_s"] == best and report["server"] == "gateway"
    refused = CliRunner().invoke(main, [*args[:3], "--costs", "setup.cfg", *args[5:]])
    assert refused.exit_code != 0 and "--model NAME" in refused.output


# -- trust -----------------------------------------------------------------------------------------


def test_a_data_device_takes_a_job_only_from_the_coordinator_and_imports_no_unlisted_model():
    from prometheus_client import CollectorRegistry

    from ftpipe_iot.collab.client import DataDevice, LocalData
    from ftpipe_iot.collab.config import COORDINATOR_NAME
    from ftpipe_iot.observability.metrics import DeviceMetrics
    from ftpipe_iot.protocol.collab import CollabJob
    from ftpipe_iot.protocol.topics import Topics
    from ftpipe_iot.protocol.vocab import CollabMode
    from ftpipe_iot.transport.memory import MemoryBroker
    from ftpipe_iot.transport.messenger import Messenger

    topics = Topics("j")
    broker = MemoryBroker()
    device = DataDevice("d0", "j", broker.transport("d0"), CollectorRegistry(),
                        LocalData.load("digits"))
    device.start()
    listener = broker.transport("listener")
    listener.connect()
    listener.subscribe(topics.collab_offer("d0"))
    listener.subscribe(topics.results)

    def publish(sender: str, model: str, version: int) -> list[str]:
        """Publish a job as ``sender``; returns the topics the device answered on."""
        transport = broker.transport(f"pub-{version}")
        transport.connect()
        job = CollabJob(version, CollabMode.COLLABORATIVE,
                        TrainConfig(model=ModelSpec(model), micro_batch_size=4), (1, 8, 8), 10)
        Messenger(transport, sender, "j", DeviceMetrics(CollectorRegistry())).send(
            topics.collab_job, job, version)
        while not device.transport.inbox.empty():
            device.handle(device.transport.inbox.get())
        answered = []
        while not listener.inbox.empty():
            answered.append(listener.inbox.get().topic)
        return answered

    assert publish("mallory", "cnn", 1) == []  # well formed, from the wrong sender: ignored
    # from the coordinator, but a module this device was not told to allow: refused, and said why
    assert publish(COORDINATOR_NAME, "os:system", 2) == [topics.results]
    assert device.job is None
    assert device.messenger.drops.counts.get("untrusted_plan") == 2
    assert publish(COORDINATOR_NAME, "cnn", 3) == [topics.collab_offer("d0")]
    assert device.job is not None and device.job.version == 3


def test_the_recorder_names_who_each_round_left_out():
    from prometheus_client import CollectorRegistry

    from ftpipe_iot.collab.metrics import CoordinatorMetrics
    from ftpipe_iot.collab.rounds import Member
    from ftpipe_iot.collab.summary import CollabRecorder
    from ftpipe_iot.observability.progress import SilentProgress

    recorder = CollabRecorder("j", "collaborative", CoordinatorMetrics(CollectorRegistry()),
                              SilentProgress(), lambda event: None, clock=lambda: 0.0,
                              wall_clock=lambda: 1234.5)
    # the start on the wall clock, as a pipeline job's summary says it
    assert recorder.summary.started_at == 1234.5
    members = {n: Member(n, 10) for n in ("dev0", "dev1", "dev2")}
    recorder.round_completed(0, 5, ("dev0", "dev1", "dev2"), members, 0.0)
    recorder.round_completed(1, 10, ("dev0", "dev2"), members, 0.0)
    recorder.round_completed(2, 15, ("dev0",), members, 0.0)
    figures = recorder.summary.collab
    assert figures.left_out == {"dev1": [1, 2], "dev2": [2]}
    assert [r["left_out"] for r in figures.round_log] == [[], ["dev1"], ["dev1", "dev2"]]
    assert json.loads(json.dumps(recorder.summary.to_dict()))["collab"]["left_out"] == \
        {"dev1": [1, 2], "dev2": [2]}


def test_rounds_are_shown_one_based_with_runs_joined():
    from ftpipe_iot.collab.summary import rounds_text

    assert rounds_text([2, 3, 4, 7]) == "3-5, 8"
    assert rounds_text([0]) == "1"
    assert rounds_text([]) == ""


@pytest.mark.parametrize("train, split_point, collaborative, error, message", [
    (TrainConfig(), 999, True, CollabError, "split point 999 is not usable"),
    (TrainConfig(data=DataSpec("npz:/nonexistent/d.npz")), None, False, DataError,
     "does not exist"),
    (TrainConfig(model=ModelSpec("no_such_module_here:build")), None, False, ModelError,
     "cannot import user model module"),
])
def test_what_the_demo_checks_before_it_starts_anything(train, split_point, collaborative,
                                                       error, message):
    from ftpipe_iot.runtime.preflight import check_job

    with pytest.raises(error, match=message):
        check_job(train, split_point, collaborative)
    check_job(TrainConfig(), 3, collaborative=True)  # a usable split point passes


# -- --init-from in the collaborative modes --------------------------------------------------------
def test_the_global_model_starts_from_the_given_weights(tmp_path):
    from prometheus_client import CollectorRegistry

    from ftpipe_iot.artifacts.checkpoint import save_checkpoint
    from ftpipe_iot.collab.config import CollabConfig
    from ftpipe_iot.collab.coordinator import Coordinator
    from ftpipe_iot.transport.memory import MemoryBroker

    data = load_dataset(DataSpec("digits"))
    train = TrainConfig(model=ModelSpec("cnn"), micro_batches=4, micro_batch_size=8, seed=0)
    other = build_layers(train.model, data.input_shape, data.num_classes, seed=7)
    given = {i: {k: v.detach().numpy().copy() for k, v in layer.state_dict().items()}
             for i, layer in enumerate(other)}
    path = save_checkpoint(tmp_path / "start.pt", given, train, data.input_shape,
                           data.num_classes, 0)

    def coordinator(init_from):
        config = CollabConfig(devices=1, train=train, init_from=init_from)
        return Coordinator("j", config, MemoryBroker().transport("controller"),
                           CollectorRegistry(), data=data)

    started = coordinator(path).global_states  # version 0, what every device loads first
    seeded = coordinator(None).global_states
    for index, state in given.items():
        for name, value in state.items():
            np.testing.assert_array_equal(started[index][name], value)
    assert any(not np.array_equal(seeded[i][n], v) for i, s in given.items()
               for n, v in s.items())
    (tmp_path / "bad.pt").write_bytes(b"not a model")
    with pytest.raises(ModelError, match="--init-from"):
        coordinator(tmp_path / "bad.pt")


def test_the_coordinator_beats_and_keeps_the_lease_record_its_own():
    """As the pipeline's controller (control/lease.py): the state again every beat from the
    coordinator's loop, and again at once when an older leader's late Will replaced it."""
    from helpers import quiet_listener
    from prometheus_client import CollectorRegistry

    from ftpipe_iot.collab.config import CollabConfig
    from ftpipe_iot.collab.coordinator import Coordinator
    from ftpipe_iot.protocol.messages import ControllerState
    from ftpipe_iot.protocol.topics import Topics
    from ftpipe_iot.protocol.vocab import ControllerStatus
    from ftpipe_iot.transport.memory import MemoryBroker

    now = [50.0]
    broker = MemoryBroker()
    config = CollabConfig(devices=1, train=TrainConfig(model=ModelSpec("cnn")), term=9,
                          beat_s=0.5)
    coordinator = Coordinator("j", config, broker.transport("controller"), CollectorRegistry(),
                              clock=lambda: now[0], data=load_dataset(DataSpec("digits")))
    coordinator.start()

    def retained() -> ControllerState:
        message = decode_message(decode(broker.retained[Topics("j").state])).message
        assert isinstance(message, ControllerState)
        return message

    assert (retained().term, retained().beat_s) == (9, 0.5)
    listener = quiet_listener(broker, Topics("j").state)
    coordinator.tick()
    assert listener.inbox.empty()
    now[0] += 0.5
    coordinator.tick()
    assert not listener.inbox.empty()  # the beat
    listener.publish(Topics("j").state, encode(envelope(
        ControllerState(ControllerStatus.OFFLINE, "j", term=8), "j", "coordinator"))[0],
        retain=True)
    assert retained().term == 8
    while not coordinator.transport.inbox.empty():
        coordinator.handle(coordinator.transport.inbox.get())
    assert retained().term == 9 and not coordinator.fenced
