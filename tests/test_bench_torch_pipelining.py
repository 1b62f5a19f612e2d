"""The torch.distributed.pipelining baseline of Scenario H (benchmarks/torch_pipelining.py)."""

from __future__ import annotations

import importlib
import statistics
import sys
import time
from pathlib import Path

import pytest
import torch
from torch import nn

from ftpipe_iot.observability.trace import load_trace
from ftpipe_iot.protocol.vocab import SpanKind

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
bench = importlib.import_module("benchmarks.torch_pipelining")


@pytest.fixture
def one_thread():
    """Single intra-op thread, like each pipeline rank (restored afterwards)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _fwd_bwd_seconds(module: nn.Module, x: torch.Tensor, repeats: int = 5) -> float:
    samples = []
    for _ in range(repeats):
        inp = x.detach().requires_grad_(x.requires_grad)
        start = time.perf_counter()
        module(inp).sum().backward()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


@pytest.mark.parametrize(("input_requires_grad", "clock"),
                         [(False, "wall"), (True, "wall"), (True, "cpu")],
                         ids=["first-stage", "mid-stage", "mid-stage-cpu-clock"])
def test_slowdown_wrapper_scales_forward_and_backward(one_thread, input_requires_grad, clock):
    torch.manual_seed(0)
    layer = nn.Linear(1024, 1024)
    x = torch.randn(256, 1024, requires_grad=input_requires_grad)
    factor = 3.0

    slowed = bench.SlowedStage(layer, factor, clock=clock)
    _fwd_bwd_seconds(slowed, x)

    # Both forward and backward were timed and padded, (F - 1) x the time of the chosen clock
    # each (the padding, not a wall-clock ratio: the machine may be busy).
    stats = slowed.stats
    assert stats["fwd_calls"] == 5 and stats["bwd_calls"] == 5
    measured = "cpu" if clock == "cpu" else "real"
    assert stats[f"fwd_{measured}_s"] > 0 and stats[f"bwd_{measured}_s"] > 0
    expected = (factor - 1) * (stats[f"fwd_{measured}_s"] + stats[f"bwd_{measured}_s"])
    assert stats["sleep_s"] == pytest.approx(expected, rel=1e-6)
    assert stats["bwd_real_s"] > 0 and stats["bwd_cpu_s"] > 0
    kind = "cpu" if clock == "cpu" else "real"
    expected_sleep = (factor - 1) * (stats[f"fwd_{kind}_s"] + stats[f"bwd_{kind}_s"])
    assert stats["sleep_s"] == pytest.approx(expected_sleep, rel=1e-6)


def test_slowdown_wrapper_keeps_gradients(one_thread):
    torch.manual_seed(0)
    layer = nn.Sequential(nn.Linear(16, 8), nn.ReLU(), nn.Linear(8, 4))
    x = torch.randn(5, 16, requires_grad=True)
    layer(x).square().sum().backward()
    expected = [p.grad.clone() for p in layer.parameters()], x.grad.clone()
    layer.zero_grad()
    x.grad = None
    bench.SlowedStage(layer, 2.0)(x).square().sum().backward()
    for got, want in zip(layer.parameters(), expected[0]):
        torch.testing.assert_close(got.grad, want)
    torch.testing.assert_close(x.grad, expected[1])


def test_split_parsing_and_checks():
    assert bench.parse_split("0:5,5:9,9:22") == [(0, 5), (5, 9), (9, 22)]
    bench.check_split([(0, 5), (5, 22)], 22)
    with pytest.raises(ValueError):
        bench.check_split([(0, 5), (6, 22)], 22)
    with pytest.raises(ValueError):
        bench.check_split([(0, 5), (5, 21)], 22)
    with pytest.raises(ValueError):
        bench.coerce_config({"factors": [1, 0.5]}).validate()


def test_smoke_two_stages(tmp_path):
    result = bench.run_torch_pipelining(
        {"width": 0.25, "factors": [1, 1], "steps": 2, "warmup": 1, "timeout_s": 120,
         "trace_dir": str(tmp_path / "trace")})
    assert result["samples_per_s"] > 0
    assert result["schedule"] == "ScheduleGPipe"
    assert result["timed_samples"] == 2 * 4 * 8
    assert [s["stage"] for s in result["stages"]] == [0, 1]
    # every rank's timeline, as ftpipe-iot's trace reads it: each micro-batch of each of the
    # 3 steps forwarded and backwarded once, its backward after its forward, one optimizer step
    trace = load_trace(tmp_path)
    assert [p.name for p in trace.processes] == ["torch-rank0", "torch-rank1"]
    everything = sorted((step, mb) for step in range(3) for mb in range(4))
    for process in trace.processes:
        spans = {kind: {} for kind in (SpanKind.FORWARD, SpanKind.BACKWARD)}
        for kind, start, duration, step, mb in zip(process.kinds, process.start,
                                                   process.duration, process.step,
                                                   process.micro_batch):
            if kind in spans:
                spans[kind][(int(step), int(mb))] = (start, start + duration)
        assert sorted(spans[SpanKind.FORWARD]) == everything == sorted(spans[SpanKind.BACKWARD])
        assert all(spans[SpanKind.BACKWARD][k][0] >= spans[SpanKind.FORWARD][k][1] - 1e-6
                   for k in everything)
        assert process.kinds.count(SpanKind.OPTIMIZER) == 3
    for stage in result["stages"]:
        assert stage["fwd_calls"] == 2 * 4 and stage["bwd_calls"] == 2 * 4
        assert stage["real_compute_s_per_step"] > 0
    assert result["split"][0][0] == 0 and result["split"][-1][1] == 22
