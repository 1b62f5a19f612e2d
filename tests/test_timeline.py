"""The timeline: spans recorded and batched, clock offsets estimated from four timestamps, a run's
trace stored by the controller, exported as Chrome trace-event JSON, printed by ``ftpipe-iot
trace`` and drawn in the report. The fleet end to end is in tests/test_demo.py."""

from __future__ import annotations

import json
import threading

import numpy as np
import pytest
from click.testing import CliRunner
from hypothesis import given
from hypothesis import strategies as st

from ftpipe_iot.cli import main
from ftpipe_iot.errors import ReportError
from ftpipe_iot.observability.report import write_report
from ftpipe_iot.observability.timeline import (
    ClockProbe,
    ClockSample,
    ClockSync,
    Timeline,
    clock_sample,
)
from ftpipe_iot.observability.trace import (
    CONTROLLER,
    RunTracer,
    TraceStore,
    busy_shares,
    chrome_trace,
    load_trace,
    representative_steps,
    step_range,
    write_trace,
)
from ftpipe_iot.protocol.topics import Topics
from ftpipe_iot.protocol.vocab import SpanKind


class FakeClock:
    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def test_a_timeline_batches_what_it_recorded_once():
    clock = FakeClock()
    timeline = Timeline(clock)
    with timeline.span(SpanKind.FORWARD, step=3, micro_batch=1):
        clock.now += 0.25
    timeline.record(SpanKind.SEND, 1000.25, 1000.5, 3, 1)
    batch = timeline.take(stage=2)
    assert batch is not None and len(batch) == 2 and batch.stage == 2
    assert batch.span_kinds() == [SpanKind.FORWARD, SpanKind.SEND]
    assert batch.start.tolist() == [1000.0, 1000.25]
    assert batch.duration.tolist() == pytest.approx([0.25, 0.25])
    assert batch.step.tolist() == [3, 3] and batch.micro_batch.tolist() == [1, 1]
    assert timeline.take() is None  # taken once


def test_a_span_is_recorded_when_its_block_raises():
    timeline = Timeline(FakeClock())
    with pytest.raises(ValueError), timeline.span(SpanKind.BACKWARD, 1, 0):
        raise ValueError("bad gradient")
    batch = timeline.take()
    assert batch is not None and batch.span_kinds() == [SpanKind.BACKWARD]


def test_a_disabled_timeline_records_nothing_and_a_full_one_counts_what_it_drops():
    off = Timeline(FakeClock(), enabled=False)
    with off.span(SpanKind.FORWARD):
        pass
    off.record(SpanKind.SEND, 0.0, 1.0)
    assert off.take() is None
    full = Timeline(FakeClock(), capacity=2)
    for _ in range(5):
        full.record(SpanKind.SEND, 0.0, 1.0)
    batch = full.take()
    assert batch is not None and len(batch) == 2 and batch.lost == 3
    full.record(SpanKind.SEND, 0.0, 1.0)
    again = full.take()
    assert again is not None and len(again) == 1 and again.lost == 0


def test_spans_recorded_while_another_thread_takes_batches_are_all_taken_once():
    timeline = Timeline()
    recorded = 20_000
    taken: list[int] = []

    def record() -> None:
        for i in range(recorded):
            timeline.record(SpanKind.FORWARD, float(i), float(i) + 1, i)

    worker = threading.Thread(target=record)
    worker.start()
    while worker.is_alive():
        batch = timeline.take()
        if batch is not None:
            taken += batch.step.tolist()
    batch = timeline.take()
    if batch is not None:
        taken += batch.step.tolist()
    assert sorted(taken) == list(range(recorded))


@given(offset=st.floats(-3600, 3600), there=st.floats(0, 0.5), held=st.floats(0, 2),
       back=st.floats(0, 0.5))
def test_the_four_timestamp_estimate_is_within_half_the_delay_of_the_true_offset(
        offset, there, held, back):
    sent = 1.7e9  # controller clock
    received = sent + there + offset  # device clock = controller clock + offset
    answered = received + held
    arrived = answered - offset + back
    sample = clock_sample(sent, received, answered, arrived)
    assert sample.delay_s == pytest.approx(there + back, abs=1e-5)
    assert abs(sample.offset_s - offset) <= sample.delay_s / 2 + 1e-5


def test_the_sample_of_the_least_delay_among_the_recent_ones_is_the_estimate():
    sync = ClockSync(window=3)
    assert sync.best is None
    for sample in (ClockSample(0.5, 0.01), ClockSample(0.2, 0.30), ClockSample(0.4, 0.02)):
        sync.observe(sample)
    assert sync.best == ClockSample(0.5, 0.01)
    sync.observe(ClockSample(0.1, 0.05))  # the best one leaves the window
    assert sync.best == ClockSample(0.4, 0.02)


def test_a_probe_keeps_the_quickest_controller_message_between_heartbeats():
    probe = ClockProbe()
    assert probe.take() == (0.0, 0.0)
    probe.heard(10.0, 10.5)
    probe.heard(11.0, 11.1)  # quicker
    probe.heard(12.0, 12.9)
    probe.heard(0.0, 13.0)  # no send time: ignored
    assert probe.take() == (11.0, 11.1)
    assert probe.take() == (11.0, 11.1)  # nothing newer: the last pair again


def _run(tmp_path, device_offset: float = 0.25):
    """A stored run: the controller fed and finished steps 0-5; dev0's clock is
    ``device_offset`` ahead of the controller's, and it computed each step's two micro-batches
    right after they were fed."""
    store = TraceStore(tmp_path / "trace")
    clock = FakeClock(100.0)
    tracer = RunTracer(store, clock)
    device = Timeline(FakeClock())
    for step in range(6):
        for micro_batch in range(2):
            fed = clock.now
            with tracer.feeding([(step, micro_batch)], train=True):
                clock.now += 0.01
            device.record(SpanKind.WAIT_INPUT, fed + device_offset - 0.02 + 0.0,
                          fed + device_offset + 0.011, step, micro_batch)
            device.record(SpanKind.FORWARD, fed + device_offset + 0.011,
                          fed + device_offset + 0.05, step, micro_batch)
            clock.now += 0.05
        clock.now += 0.1 * (1 + (step == 4))  # step 4 is slow
        tracer.step_done(step)
    tracer.tick(force=True)
    batch = device.take(stage=0)
    assert batch is not None
    tracer.device_spans("dev0", batch)
    # the controller sent at 100, the device got it 1 ms later and answered 0.5 s after that
    tracer.heartbeat("dev0", 100.501 + device_offset, 100.503, 100.0, 100.001 + device_offset)
    return store


def test_a_stored_run_exports_one_aligned_chrome_trace(tmp_path):
    _run(tmp_path)
    trace = load_trace(tmp_path)
    assert [p.name for p in trace.processes] == [CONTROLLER, "dev0"]
    dev0 = trace.processes[1]
    assert dev0.offset_s == pytest.approx(0.25, abs=0.002) and dev0.error_s <= 0.002
    feeds = {(int(s), int(m)): t for k, t, s, m in zip(
        trace.processes[0].kinds, trace.processes[0].start, trace.processes[0].step,
        trace.processes[0].micro_batch) if k is SpanKind.FEED}
    for kind, start, step, micro_batch in zip(dev0.kinds, dev0.start, dev0.step,
                                              dev0.micro_batch):
        if kind is SpanKind.FORWARD:  # on the controller's clock: right after its feed
            assert start - feeds[(int(step), int(micro_batch))] == pytest.approx(0.011,
                                                                               abs=0.002)
    document = chrome_trace(trace)
    events = document["traceEvents"]
    names = {e["args"]["name"] for e in events if e["name"] == "process_name"}
    assert names == {"controller", "dev0 (stage 0)"}
    complete = [e for e in events if e["ph"] == "X"]
    assert len(complete) == 12 + 24  # 12 feeds, 12 waits and 12 forwards
    assert min(e["ts"] for e in complete) == 0
    steps = [e for e in events if e["ph"] in ("b", "e")]
    assert len(steps) == 12 and {e["id"] for e in steps} == set(range(6))
    only = chrome_trace(trace, (2, 3))["traceEvents"]
    assert {e["args"]["step"] for e in only if e["ph"] == "X"} == {2, 3}
    json.dumps(document)  # plain JSON


def test_representative_steps_skip_the_warm_up_and_the_outliers(tmp_path):
    _run(tmp_path)
    trace = load_trace(tmp_path)
    assert representative_steps(trace, 2) in ((2, 3), (3, 4))
    window = trace.step_bounds()[2][0], trace.step_bounds()[3][1]
    (share,) = busy_shares(trace, window)
    assert share.name == "dev0" and 0 < share.compute < 1 and 0 < share.wait < 1


def test_the_trace_command_writes_the_json_and_says_where_the_time_went(tmp_path):
    _run(tmp_path)
    result = CliRunner().invoke(main, ["trace", str(tmp_path), "--steps", "1:3"])
    assert result.exit_code == 0, result.output
    assert "steps 1-3" in result.output and "dev0" in result.output
    document = json.loads((tmp_path / "trace.json").read_text())
    assert {e["args"]["step"] for e in document["traceEvents"] if e["ph"] == "X"} == {1, 2, 3}


def test_a_run_without_a_trace_and_a_bad_step_range_are_one_line_errors(tmp_path):
    result = CliRunner().invoke(main, ["trace", str(tmp_path)])
    assert result.exit_code != 0 and "no trace in" in result.output
    assert "Traceback" not in result.output
    with pytest.raises(ReportError, match="--steps"):
        step_range("3:1")
    with pytest.raises(ReportError, match="--steps"):
        step_range("a:b")
    assert step_range("4") == (4, 4) and step_range(None) is None


def test_a_line_cut_short_by_a_crash_loses_only_that_batch(tmp_path):
    _run(tmp_path)
    with open(tmp_path / "trace" / "dev0.jsonl", "a") as out:
        out.write('{"stage": 0, "names": ["forward"], "kinds": [0, 0')
    trace = load_trace(tmp_path)
    assert len(trace.processes[1].kinds) == 24
    written = write_trace(tmp_path)
    assert written.spans == 12 + 24 + 6


def test_the_report_draws_a_timeline_panel_when_the_run_has_a_trace(tmp_path):
    _run(tmp_path)
    summary = {"job": "j", "steps": 6, "history": [{"t": 1.0 + i, "step": i, "loss": 2.0,
                                                    "samples_per_s": 10.0} for i in range(6)],
               "evals": [], "events": []}
    plain = write_report(summary, tmp_path / "plain")
    panel = write_report(summary, tmp_path / "panel", load_trace(tmp_path))
    import matplotlib.image

    plain_rows = matplotlib.image.imread(plain.png).shape[0]
    panel_rows = matplotlib.image.imread(panel.png).shape[0]
    assert panel_rows > plain_rows  # a taller figure: the timeline below the curves
    assert np.asarray(matplotlib.image.imread(panel.png)).std() > 0


def test_a_wait_is_named_by_the_stage_topic_that_ended_it_chunks_included():
    topics = Topics("job")
    assert topics.stage_traffic(topics.stage_act(2, "dev1")) == "act"
    assert topics.stage_traffic(topics.stage_grad(0, "dev0")) == "grad"
    assert topics.stage_traffic(topics.stage_reduce(1)) == "reduce"
    assert topics.stage_traffic(topics.results) is None
    assert topics.stage_traffic(Topics("other").stage_act(0, "dev0")) is None
    assert topics.stage_traffic(topics.weights(3) + "/0") is None
