"""Codecs per cut and direction (docs/design.md §4, "Codecs"): the plan carries them, devices
code with their cut's, the simulator applies the same, and ``--wire-codec auto`` chooses them
from the links, the bytes and the measured accuracy costs within a budget."""

from __future__ import annotations

import json
import math
from dataclasses import replace

import numpy as np
import pytest
from helpers import MemoryJob, max_weight_diff
from hypothesis import given, settings
from hypothesis import strategies as st

from ftpipe_iot.control.config import ControllerConfig
from ftpipe_iot.control.plan_codecs import CodecInputs, CodecPolicy, plan_codecs
from ftpipe_iot.control.weights_file import load_weights
from ftpipe_iot.core.data import DataSpec, load_dataset
from ftpipe_iot.core.reference import train_reference
from ftpipe_iot.errors import ConfigError, FtpipeError, PlanError
from ftpipe_iot.planning.capacity import CapacityEstimator
from ftpipe_iot.planning.codec_choice import StageHolders, choose_codecs, priced
from ftpipe_iot.planning.codec_costs import CodecCosts
from ftpipe_iot.planning.costs import DeviceSpec, LayerCosts
from ftpipe_iot.planning.solver import stage_for
from ftpipe_iot.protocol.messages import Capabilities
from ftpipe_iot.protocol.plan import (
    CutCodecs,
    Plan,
    StageAssignment,
    TrainConfig,
    parse_cut_codecs,
)
from ftpipe_iot.protocol.specs import ModelSpec
from ftpipe_iot.protocol.vocab import ControllerPhase, CutDirection, WireCodec

FAST, SLOW = 1e9, 1e6  # bytes/s
# made-up accuracy costs for the decision tests (the shipped ones are measured)
ACCURACY = CodecCosts({d: {WireCodec.FP16: 0.01, WireCodec.INT8: 0.1, WireCodec.INT4: 1.0}
                       for d in CutDirection})
COSTS = LayerCosts((1.0,) * 6, (1e6,) * 6, (1.0,) * 6)  # 1 MB at every cut


def _chain(*links: float) -> list[StageHolders]:
    return [StageHolders(2 * k, 2 * k + 2, ((DeviceSpec(f"d{k}", 1.0, bw), 1.0),))
            for k, bw in enumerate(links)]


# -- the choice -----------------------------------------------------------------------------------
def test_fast_links_keep_the_wire_exact():
    choice = choose_codecs(COSTS, _chain(FAST, FAST, FAST), ACCURACY, budget_points=5.0)
    assert choice.codecs == (CutCodecs(), CutCodecs())
    assert choice.accuracy_points == 0 and choice.step_s == choice.exact_step_s


def test_a_slow_link_gets_a_compressed_codec_on_its_cut_only():
    choice = choose_codecs(COSTS, _chain(FAST, FAST, SLOW), ACCURACY, budget_points=0.5)
    assert choice.codecs[0] == CutCodecs()
    assert choice.codecs[1] == CutCodecs.both(WireCodec.INT8)  # int4 both ways is 2 points
    assert choice.step_s < choice.exact_step_s
    assert choice.cuts[1].saved_bytes == pytest.approx(2e6 * (1 - 1.0625 / 4))
    text = "\n".join(choice.describe())
    assert "cut 1 (before layer 4): forward int8, backward int8" in text


def test_no_budget_no_codec_and_an_unmeasured_codec_is_never_chosen():
    assert choose_codecs(COSTS, _chain(SLOW, SLOW), ACCURACY, 0.0).codecs == (CutCodecs(),)
    only_fp16 = CodecCosts({d: {WireCodec.FP16: 0.0} for d in CutDirection})
    assert choose_codecs(COSTS, _chain(SLOW, SLOW), only_fp16, 9.0).codecs == \
        (CutCodecs.both(WireCodec.FP16),)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.sampled_from([FAST, 3e6, SLOW, 3e5]), min_size=1, max_size=4),
       st.floats(0, 5))
def test_the_choice_stays_within_budget_and_never_slows_the_step(links, budget):
    choice = choose_codecs(COSTS, _chain(*links), ACCURACY, budget)
    assert choice.accuracy_points <= budget + 1e-9
    assert choice.step_s <= choice.exact_step_s * (1 + 1e-12)
    assert len(choice.codecs) == len(links) - 1


def test_the_choice_refuses_a_negative_budget():
    with pytest.raises(FtpipeError, match="budget"):
        choose_codecs(COSTS, _chain(FAST, SLOW), ACCURACY, -1.0)


def test_pricing_per_cut_and_direction_reaches_the_cost_model():
    costs = priced(COSTS, [2, 4], [CutCodecs(WireCodec.INT8, WireCodec.NONE), CutCodecs()])
    assert costs.cut_bytes(1, CutDirection.FORWARD) == pytest.approx(1e6 * 1.0625 / 4)
    assert costs.cut_bytes(1, CutDirection.BACKWARD) == 1e6
    assert costs.round_trip_bytes(3) == 2e6
    stage = stage_for(costs, DeviceSpec("d", 1.0, SLOW), 2, 4)
    assert stage.comm_s == pytest.approx((1e6 * 1.0625 / 4 + 1e6 + 2e6) / SLOW)
    with pytest.raises(FtpipeError, match="cut"):
        priced(COSTS, [2], [])


def test_the_shipped_accuracy_costs_are_measured_for_every_codec_and_direction():
    costs = CodecCosts.load()
    assert "benchmarks/codec_accuracy.py" in costs.source
    for direction in CutDirection:
        for codec in WireCodec:
            assert math.isfinite(costs.cost(codec, direction)) and \
                costs.cost(codec, direction) >= 0


def test_the_controller_chooses_auto_codecs_from_the_declared_links():
    stages = (StageAssignment.single(0, "a", 0, 2), StageAssignment.single(1, "b", 2, 4),
              StageAssignment.single(2, "c", 4, 6))
    caps = {"a": Capabilities(bandwidth_bytes_per_s=FAST),
            "b": Capabilities(bandwidth_bytes_per_s=FAST),
            "c": Capabilities(bandwidth_bytes_per_s=SLOW)}
    codecs, choice, lines = plan_codecs(CodecInputs(
        CodecPolicy(auto=True, budget_points=0.5), stages, COSTS,
        CapacityEstimator.for_costs(COSTS), caps, ACCURACY))
    assert codecs == (CutCodecs(), CutCodecs.both(WireCodec.INT8)) and choice is not None
    assert lines[0].startswith("wire codecs (auto")
    pinned = (CutCodecs(), CutCodecs.both(WireCodec.FP16))
    assert plan_codecs(CodecInputs(CodecPolicy(cuts=pinned), stages, COSTS,
                                   CapacityEstimator.for_costs(COSTS), caps))[0] == pinned
    # a re-planned layout of another shape: the pins no longer apply, the wire goes exact
    codecs, _, lines = plan_codecs(CodecInputs(CodecPolicy(cuts=pinned), stages[:1], COSTS,
                                               CapacityEstimator.for_costs(COSTS), caps))
    assert codecs == () and "go exact" in lines[0]


# -- settings and the plan body -------------------------------------------------------------------
@pytest.mark.parametrize(("text", "error"), [
    ("int9", "bad cut codecs 'int9'"), ("int8/fp16/none", "FORWARD/BACKWARD"), ("", "one entry")])
def test_bad_cut_codecs_are_one_line_errors(text, error):
    with pytest.raises(PlanError, match=error) as info:
        parse_cut_codecs(text)
    assert "\n" not in str(info.value)


def test_per_cut_settings_that_cannot_apply_are_refused():
    stages = (StageAssignment.single(0, "a", 0, 5), StageAssignment.single(1, "b", 5, 12))
    two = parse_cut_codecs("int8,fp16")
    for config, error in [
        (dict(codecs=CodecPolicy(cuts=two)), "needs --assignment"),
        (dict(codecs=CodecPolicy(cuts=two), assignment=stages), "gives 2 cut"),
        (dict(codecs=CodecPolicy(cuts=two[:1]), assignment=stages,
              train=TrainConfig(wire_codec=WireCodec.INT8)), "drop --wire-codec int8")]:
        with pytest.raises(ConfigError, match=error):
            ControllerConfig(**config)
    with pytest.raises(ConfigError, match="drop --cut-codecs"):
        CodecPolicy(auto=True, cuts=two)
    # auto with a training config whose global codec is not none (a --train-config file)
    with pytest.raises(ConfigError, match="set it to none"):
        ControllerConfig(codecs=CodecPolicy(auto=True),
                         train=TrainConfig(wire_codec=WireCodec.INT8))


def test_the_demo_passes_auto_to_its_controller_and_checks_pinned_cuts_before_it_starts(
        monkeypatch):
    """The demo's controller gets the codec policy as options next to its training config
    (which the controller accepts for --wire-codec auto); --cut-codecs, which pins the cuts of
    an --assignment the demo has not got, ends in one line before anything starts."""
    from click.testing import CliRunner

    from ftpipe_iot.cli.run import demo
    from ftpipe_iot.runtime import demo as demo_runtime

    started = []

    class _Demo:
        def __init__(self, options) -> None:
            started.append(options)

        def run(self) -> dict:
            raise KeyboardInterrupt

    monkeypatch.setattr(demo_runtime, "Demo", _Demo)
    runner = CliRunner()
    result = runner.invoke(demo, ["--wire-codec", "auto", "--codec-accuracy-budget", "0.25"])
    assert started, result.output
    args = started[0].controller_args
    assert args[args.index("--wire-codec") + 1] == "auto"
    assert args[args.index("--codec-accuracy-budget") + 1] == "0.25"
    assert started[0].train.wire_codec is WireCodec.NONE
    started.clear()
    result = runner.invoke(demo, ["--cut-codecs", "int8"])
    assert result.exit_code == 1 and not started
    assert result.output.strip().splitlines()[-1] == (
        "Error: --cut-codecs needs --assignment: the codecs are per cut of a pinned plan")


def _plan(n_stages: int, cut_codecs: tuple[CutCodecs, ...], codec=WireCodec.NONE) -> Plan:
    bounds = [round(12 * k / n_stages) for k in range(n_stages + 1)]
    return Plan(1, "j", tuple(StageAssignment.single(k, f"d{k}", bounds[k], bounds[k + 1])
                              for k in range(n_stages)),
                TrainConfig(wire_codec=codec), 12, (1, 8, 8), 10, cut_codecs=cut_codecs)


CODECS = st.builds(CutCodecs, st.sampled_from(WireCodec), st.sampled_from(WireCodec))


@settings(max_examples=100, deadline=None)
@given(st.integers(1, 5).flatmap(lambda n: st.tuples(
    st.just(n), st.one_of(st.just(()), st.lists(CODECS, min_size=n - 1, max_size=n - 1)))))
def test_the_plan_round_trips_its_cut_codecs(case):
    n, cuts = case
    plan = _plan(n, tuple(cuts))
    back = Plan.from_dict(json.loads(json.dumps(plan.to_dict())))
    assert back == plan and back.wire == (tuple(cuts) or (CutCodecs(),) * (n - 1))
    for c in cuts:
        assert CutCodecs.parse(c.text()) == c


def test_the_plan_refuses_cut_codecs_that_do_not_fit_it():
    with pytest.raises(PlanError, match="3 stages has 2 cut"):
        _plan(3, (CutCodecs(),))
    raw = _plan(2, (CutCodecs(),)).to_dict()
    raw["cut_codecs"] = [{"forward": "int3", "backward": "none"}]
    with pytest.raises(PlanError, match="bad cut codecs"):
        Plan.from_dict(raw)
    # a plan of before per-cut codecs has the global one on every cut
    del raw["cut_codecs"]
    old = Plan.from_dict({**raw, "train": {**raw["train"], "wire_codec": "int8"}})
    assert old.wire == (CutCodecs.both(WireCodec.INT8),)
    assert old.sends(0) == {CutDirection.FORWARD: WireCodec.INT8,
                            CutDirection.BACKWARD: WireCodec.NONE}


# -- the simulator and the fleet ------------------------------------------------------------------
TRAIN = TrainConfig(model=ModelSpec("cnn"), micro_batches=4, micro_batch_size=8, max_steps=4,
                    lr=0.05, replicate_every=2)
CUTS = (5, 9)  # [0,5) [5,9) [9,12)
MIXED = (CutCodecs(WireCodec.INT8, WireCodec.FP16), CutCodecs(WireCodec.INT4, WireCodec.NONE))


def test_the_simulator_applies_each_cuts_codecs():
    data = load_dataset(DataSpec("digits"))
    everywhere = train_reference(replace(TRAIN, wire_codec=WireCodec.INT8), data, 2, cuts=CUTS)
    per_cut = train_reference(TRAIN, data, 2, cuts=CUTS,
                              cut_codecs=(CutCodecs.both(WireCodec.INT8),) * 2)
    assert max_weight_diff(everywhere, per_cut) == 0  # the global codec = it on every cut
    mixed = train_reference(TRAIN, data, 2, cuts=CUTS, cut_codecs=MIXED)
    exact = train_reference(TRAIN, data, 2)
    assert max_weight_diff(mixed, per_cut) > 1e-6 and max_weight_diff(mixed, exact) > 1e-6
    with pytest.raises(PlanError, match="one per cut"):
        train_reference(TRAIN, data, 1, cuts=CUTS, cut_codecs=MIXED[:1])


def _stages() -> tuple[StageAssignment, ...]:
    bounds = (0, *CUTS, 12)
    return tuple(StageAssignment.single(k, f"d{k}", bounds[k], bounds[k + 1]) for k in range(3))


def test_a_fleet_with_codecs_per_cut_equals_the_simulator():
    job = MemoryJob(ControllerConfig(train=TRAIN, devices=3, assignment=_stages(),
                                     repartition=False, codecs=CodecPolicy(cuts=MIXED)),
                    devices=3)
    job.start()
    assert job.run() is ControllerPhase.DONE
    controller = job.controller
    assert controller.plan is not None and controller.plan.cut_codecs == MIXED
    gathered = [controller.weights[i] for i in range(controller.model.num_layers)]
    simulated = train_reference(TRAIN, controller.data, TRAIN.max_steps, cuts=CUTS,
                                cut_codecs=MIXED)
    assert max_weight_diff(gathered, simulated) < 1e-5
    # the test can fail: the same codec on every cut trains otherwise
    other = train_reference(TRAIN, controller.data, TRAIN.max_steps, cuts=CUTS,
                            cut_codecs=(CutCodecs.both(WireCodec.INT8),) * 2)
    assert max_weight_diff(simulated, other) > 1e-4


@pytest.mark.broker
def test_device_processes_with_codecs_per_cut_over_mosquitto_equal_the_simulator(
        mosquitto, processes, tmp_path):
    job, steps = "cutcodec", 4
    for i in range(3):
        processes.device(f"d{i}", job, mosquitto.url)
    controller = processes.start(
        "controller", "controller", "--job", job, "--broker", mosquitto.url, "--devices", "3",
        "--stop-devices", "--max-steps", str(steps), "--micro-batches", "4",
        "--micro-batch-size", "8", "--cut-codecs", "int8/fp16,int4/none",
        "--replicate-every", "2", "--assignment", "d0:0-5,d1:5-9,d2:9-12", "--no-repartition",
        "--save-weights", str(tmp_path / "weights.npz"), "--wait-devices", "60",
        "--stall-timeout", "60", "--json")
    assert processes.wait("controller", 180) == 0, processes.log("controller")[-3000:]
    summary = json.loads(controller.stdout.read().strip().splitlines()[-1])
    assert summary["steps"] == steps
    gathered = load_weights(tmp_path / "weights.npz")
    simulated = train_reference(replace(TRAIN, max_steps=steps), load_dataset(DataSpec("digits")),
                                steps, cuts=CUTS, cut_codecs=MIXED)
    assert max_weight_diff(gathered, simulated) < 1e-5
    assert np.isfinite(max_weight_diff(gathered, simulated))
