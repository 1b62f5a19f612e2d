"""Scenario H baseline: torch.distributed.pipelining on an emulated heterogeneous fleet.

Trains ``mobilenetv2`` (CIFAR-style, synthetic 32x32x3 data, 10 classes) with
``torch.distributed.pipelining`` -- one process per stage on this machine, gloo backend over
127.0.0.1, CPU, one intra-op thread per rank -- and reports steady-state throughput in samples/s.

* **Split**: by default ``ftpipe_iot.partition.balanced_split`` over the layer costs measured by
  ``ftpipe_iot.models.measure_layer_costs`` (the same "even" split as ftpipe-iot's static
  baseline: it ignores device speed); ``--split 0:5,5:9,...`` overrides it.
* **Schedule**: synchronous ``ScheduleGPipe`` by default (fill-drain: all forwards of the M
  micro-batches, then all backwards, then one SGD step per stage), which matches ftpipe-iot's
  synchronous schedule (docs/design.md §5). ``--schedule 1f1b`` uses ``Schedule1F1B``.
* **Slow-down emulation** (docs/design.md §7): each stage module is wrapped in
  :class:`SlowedStage`. Forward: the real forward is timed with ``time.perf_counter`` and
  followed by a sleep of ``(F - 1) x real``. Backward: two identity ``torch.autograd.Function``
  markers bracket the stage's sub-graph -- ``_BackwardStart`` on the stage output and
  ``_BackwardEnd`` on the stage input. The autograd engine runs ``_BackwardStart.backward`` when
  the output gradient enters the stage and ``_BackwardEnd.backward`` after the whole stage
  backward (input and weight gradients) is done, so the latter measures the real backward time
  and sleeps ``(F - 1) x real`` before handing the input gradient on. On the first stage, whose
  input (the data) does not require grad, the wrapper feeds the inner module a grad-requiring
  copy of the input so that the end marker is part of the graph. F comes from device profiles
  (``ProfileFactor``: ``load_profile(path).factor_at(step, elapsed_s)``, evaluated once per
  micro-batch forward and reused for its backward) or from constant ``--factors``. This mirrors
  ftpipe-iot's device agent, which also sleeps ``(F - 1) x`` the wall-clock real compute
  (``--clock wall``, the default). On a busy host the wall-clock real time includes waiting for a
  core, and F multiplies that too; ``--clock cpu`` multiplies the computing thread's CPU time
  (``time.thread_time``; valid because every rank runs one intra-op thread and CPU autograd runs
  on the calling thread) instead. Both real times are reported per stage either way.

With ``trace_dir`` (``--trace-dir``) every rank records ftpipe-iot's timeline spans (forward,
backward and the optimizer step, by step and micro-batch; the gaps are the schedule's waits and
gloo's transfers) into ``<trace_dir>/torch-rank<k>.jsonl``, which ``ftpipe-iot trace`` and the
report's timeline panel read: the same picture of a step for both systems.

Run ``python benchmarks/torch_pipelining.py --help``; one JSON object is printed on stdout,
progress on stderr. Import :func:`run_torch_pipelining` to call it from another script.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import socket
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from torch import nn

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_PROFILES = tuple(
    str(REPO_ROOT / "devices" / "profiles" / f"bench-h-{f}.json") for f in (1, 2, 4, 10)
)
INPUT_SHAPE = (3, 32, 32)
NUM_CLASSES = 10
SCHEDULES = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B"}
CLOCKS = ("wall", "cpu")


# --------------------------------------------------------------------------- configuration


@dataclass
class TorchPipeliningConfig:
    """What to run. Exactly one of ``factors`` / ``profiles`` sets the per-stage slow-downs (when
    both are empty the four ``devices/profiles/bench-h-{1,2,4,10}.json`` profiles are used); their
    length is the number of stages. ``split`` is a list of half-open ``(start, end)`` layer ranges
    or ``None`` for the balanced split over measured layer costs."""

    width: float = 0.25
    factors: list[float] | None = None
    profiles: list[str] | None = None
    micro_batches: int = 4
    micro_batch_size: int = 8
    steps: int = 10
    warmup: int = 3
    split: list[tuple[int, int]] | None = None
    schedule: str = "gpipe"
    clock: str = "wall"
    lr: float = 0.05
    momentum: float = 0.9
    seed: int = 0
    timeout_s: float = 600.0
    trace_dir: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def stage_count(self) -> int:
        """Number of pipeline stages (= number of emulated devices)."""
        if self.factors:
            return len(self.factors)
        return len(self.profiles or DEFAULT_PROFILES)

    def validate(self) -> None:
        """Raise ``ValueError`` with a readable message on a bad configuration."""
        if self.factors and self.profiles:
            raise ValueError("give either factors or profiles, not both")
        if self.factors:
            for f in self.factors:
                if not (isinstance(f, (int, float)) and math.isfinite(f) and f >= 1):
                    raise ValueError(f"slow-down factors must be finite numbers >= 1, got {f!r}")
        if self.stage_count() < 1:
            raise ValueError("need at least one stage")
        if self.width <= 0:
            raise ValueError(f"width must be > 0, got {self.width}")
        for name in ("micro_batches", "micro_batch_size", "steps"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.warmup < 0:
            raise ValueError(f"warmup must be >= 0, got {self.warmup}")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"schedule must be one of {sorted(SCHEDULES)}, got {self.schedule!r}")
        if self.clock not in CLOCKS:
            raise ValueError(f"clock must be one of {sorted(CLOCKS)}, got {self.clock!r}")
        if self.schedule == "1f1b" and self.micro_batches < self.stage_count():
            raise ValueError("Schedule1F1B needs micro_batches >= number of stages")
        if self.split is not None and len(self.split) != self.stage_count():
            raise ValueError(f"split has {len(self.split)} ranges but there are "
                             f"{self.stage_count()} stages (factors/profiles)")


def coerce_config(config: TorchPipeliningConfig | Mapping[str, Any] | None
                  ) -> TorchPipeliningConfig:
    """Accept a config object, a plain mapping of its fields, or ``None`` (all defaults)."""
    if config is None:
        return TorchPipeliningConfig()
    if isinstance(config, TorchPipeliningConfig):
        return replace(config)
    known = set(TorchPipeliningConfig.__dataclass_fields__)
    unknown = set(config) - known
    if unknown:
        raise ValueError(f"unknown config keys {sorted(unknown)}; known: {sorted(known)}")
    values = dict(config)
    if values.get("split") is not None:
        values["split"] = [tuple(int(v) for v in r) for r in values["split"]]
    if values.get("factors") is not None:
        values["factors"] = [float(f) for f in values["factors"]]
    if values.get("profiles") is not None:
        values["profiles"] = [str(p) for p in values["profiles"]]
    return TorchPipeliningConfig(**values)


def parse_split(text: str) -> list[tuple[int, int]]:
    """Parse ``"0:5,5:9,9:22"`` into ``[(0, 5), (5, 9), (9, 22)]``."""
    ranges = []
    for part in text.split(","):
        start, sep, end = part.strip().partition(":")
        if not sep:
            raise ValueError(f"split range {part!r} must look like start:end")
        ranges.append((int(start), int(end)))
    return ranges


def check_split(split: Sequence[tuple[int, int]], n_layers: int) -> None:
    """Ranges must be non-empty, contiguous and cover layers ``0..n_layers``."""
    expected = 0
    for start, end in split:
        if start != expected or end <= start:
            raise ValueError(f"split {list(split)} must be contiguous non-empty ranges starting "
                             f"at 0 (problem at {start}:{end})")
        expected = end
    if expected != n_layers:
        raise ValueError(f"split {list(split)} covers {expected} layers, the model has {n_layers}")


# --------------------------------------------------------------------------- slow-down wrapper


class ProfileFactor:
    """Slow-down factor ``F(step, elapsed_s)`` from a device profile file, or a constant."""

    def __init__(self, profile_path: str | None = None, constant: float = 1.0) -> None:
        self.profile = None
        self.constant = float(constant)
        if profile_path is not None:
            from ftpipe_iot.planning.profiles import load_profile

            self.profile = load_profile(profile_path)

    def __call__(self, step: int, elapsed_s: float) -> float:
        if self.profile is None:
            return self.constant
        return self.profile.factor_at(step, elapsed_s)


class _CallTiming:
    """Per-forward-call record shared by the two backward markers of that call."""

    __slots__ = ("owner", "factor", "bwd_start", "bwd_start_cpu", "bwd_wall_start", "step",
                 "micro_batch")

    def __init__(self, owner: SlowedStage, factor: float, step: int = -1,
                 micro_batch: int = -1) -> None:
        self.owner = owner
        self.factor = factor
        self.bwd_start: float | None = None
        self.bwd_start_cpu = 0.0
        self.bwd_wall_start = 0.0
        self.step = step
        self.micro_batch = micro_batch


class _BackwardStart(torch.autograd.Function):
    """Identity on the stage output; its backward runs first in the stage's backward pass."""

    @staticmethod
    def forward(ctx: Any, timing: _CallTiming, x: torch.Tensor) -> torch.Tensor:
        ctx.timing = timing
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[None, torch.Tensor]:
        ctx.timing.bwd_start_cpu = time.thread_time()
        ctx.timing.bwd_start = time.perf_counter()
        ctx.timing.bwd_wall_start = time.time()
        return None, grad


class _BackwardEnd(torch.autograd.Function):
    """Identity on the stage input; its backward runs last, times the stage backward and sleeps."""

    @staticmethod
    def forward(ctx: Any, timing: _CallTiming, x: torch.Tensor) -> torch.Tensor:
        ctx.timing = timing
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[None, torch.Tensor]:
        timing: _CallTiming = ctx.timing
        if timing.bwd_start is not None:
            real = time.perf_counter() - timing.bwd_start
            cpu = time.thread_time() - timing.bwd_start_cpu
            timing.owner.record_backward(real, cpu, timing.factor)
            timing.owner.span("backward", timing.bwd_wall_start, timing.step,
                              timing.micro_batch)
        return None, grad


class SlowedStage(nn.Module):
    """Wrap a stage module so each forward and each backward takes ``F`` times its real time.

    ``factor_fn(step, elapsed_s)`` gives F; set :attr:`step` before each training step.
    ``clock`` is what "real time" means: ``"wall"`` (``perf_counter``, like ftpipe-iot's device
    agent) or ``"cpu"`` (``thread_time`` of the computing thread: not inflated when other
    processes compete for the cores; needs one intra-op thread). Real wall and CPU times and
    the added sleep are accumulated in :attr:`stats` (see :meth:`reset_stats`).
    """

    def __init__(self, inner: nn.Module,
                 factor_fn: Callable[[int, float], float] | float = 1.0,
                 clock: str = "wall") -> None:
        super().__init__()
        if clock not in CLOCKS:
            raise ValueError(f"clock must be one of {CLOCKS}, got {clock!r}")
        self.inner = inner
        self.clock = clock
        self.factor_fn: Callable[[int, float], float] = (
            factor_fn if callable(factor_fn) else ProfileFactor(constant=float(factor_fn)))
        self.step = 0
        self.started = time.perf_counter()
        self.stats: dict[str, float] = {}
        self.timeline: Any = None  # ftpipe_iot's Timeline when tracing
        self._forwards: dict[int, int] = {}  # step -> forwards so far (the micro-batch index)
        self.reset_stats()

    def span(self, kind: str, start: float, step: int, micro_batch: int = -1) -> None:
        """One span from ``start`` (wall clock) to now, when tracing."""
        if self.timeline is not None:
            from ftpipe_iot.protocol.vocab import SpanKind

            self.timeline.record(SpanKind(kind), start, time.time(), step, micro_batch)

    def reset_stats(self) -> None:
        """Zero the accumulated timings."""
        self.stats = {"fwd_real_s": 0.0, "bwd_real_s": 0.0, "fwd_cpu_s": 0.0, "bwd_cpu_s": 0.0,
                      "sleep_s": 0.0, "fwd_calls": 0, "bwd_calls": 0, "factor_sum": 0.0}

    def _sleep(self, real_s: float, factor: float) -> None:
        delay = (factor - 1.0) * real_s
        if delay > 0:
            time.sleep(delay)
            self.stats["sleep_s"] += delay

    def record_backward(self, real_s: float, cpu_s: float, factor: float) -> None:
        """Called by the end marker: account one backward (wall ``real_s``, thread CPU
        ``cpu_s``) and sleep the extra time."""
        self.stats["bwd_real_s"] += real_s
        self.stats["bwd_cpu_s"] += cpu_s
        self.stats["bwd_calls"] += 1
        self._sleep(cpu_s if self.clock == "cpu" else real_s, factor)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not torch.is_grad_enabled() or x.device.type == "meta":
            return self.inner(x)
        factor = float(self.factor_fn(self.step, time.perf_counter() - self.started))
        micro_batch = self._forwards.get(self.step, 0)
        self._forwards = {self.step: micro_batch + 1}
        timing = _CallTiming(self, factor, self.step, micro_batch)
        wall_start = time.time()
        if not x.requires_grad:
            # First stage: the data does not require grad, so no backward node would sit on the
            # input side; a grad-requiring leaf copy puts _BackwardEnd into the graph.
            x = x.detach().requires_grad_(True)
        x = _BackwardEnd.apply(timing, x)
        start_cpu = time.thread_time()
        start = time.perf_counter()
        y = self.inner(x)
        real = time.perf_counter() - start
        cpu = time.thread_time() - start_cpu
        self.stats["fwd_real_s"] += real
        self.stats["fwd_cpu_s"] += cpu
        self.stats["fwd_calls"] += 1
        self.stats["factor_sum"] += factor
        self._sleep(cpu if self.clock == "cpu" else real, factor)
        self.span("forward", wall_start, self.step, micro_batch)
        return _BackwardStart.apply(timing, y)


# --------------------------------------------------------------------------- distributed part


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _log(msg: str) -> None:
    print(f"[torch_pipelining] {msg}", file=sys.stderr, flush=True)


def _worker(rank: int, world: int, port: int, cfg: dict[str, Any],
            result_queue: Any) -> None:
    """One pipeline stage per process (spawned)."""
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    from ftpipe_iot.core.models import ModelSpec, build_layers, cut_shapes

    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        mb, n_mb = cfg["micro_batch_size"], cfg["micro_batches"]
        start, end = cfg["split"][rank]
        layers = build_layers(ModelSpec("mobilenetv2", width=cfg["width"]), INPUT_SHAPE,
                              NUM_CLASSES, seed=cfg["seed"])
        shapes = cut_shapes(layers, INPUT_SHAPE, NUM_CLASSES, "mobilenetv2")
        if cfg["factors"]:
            factor_fn = ProfileFactor(constant=cfg["factors"][rank])
        else:
            factor_fn = ProfileFactor(profile_path=cfg["profiles"][rank])
        module = SlowedStage(nn.Sequential(*layers[start:end]), factor_fn, cfg["clock"])
        module.train()
        if cfg.get("trace_dir"):
            from ftpipe_iot.observability.timeline import Timeline

            module.timeline = Timeline()
        device = torch.device("cpu")
        # Static stage metadata: shapes from cut_shapes; requires_grad on the examples tells the
        # runtime which activations carry gradients back (all but the data input of stage 0).
        stage = PipelineStage(
            module, rank, world, device,
            input_args=torch.empty((mb, *shapes[start])).requires_grad_(rank > 0),
            output_args=torch.empty((mb, *shapes[end])).requires_grad_(True),
        )
        schedule_cls = ScheduleGPipe if cfg["schedule"] == "gpipe" else Schedule1F1B
        loss_fn = nn.CrossEntropyLoss()
        schedule = schedule_cls(stage, n_microbatches=n_mb, loss_fn=loss_fn)
        optimizer = torch.optim.SGD(module.parameters(), lr=cfg["lr"], momentum=cfg["momentum"])

        gen = torch.Generator().manual_seed(cfg["seed"] + 1)
        batches = [(torch.randn((n_mb * mb, *INPUT_SHAPE), generator=gen),
                    torch.randint(0, NUM_CLASSES, (n_mb * mb,), generator=gen))
                   for _ in range(2)]
        is_first, is_last = rank == 0, rank == world - 1
        total = cfg["warmup"] + cfg["steps"]
        t0 = time.perf_counter()
        last_losses: list[torch.Tensor] = []
        step_times: list[float] = []
        module.started = time.perf_counter()
        for step in range(total):
            if step == cfg["warmup"]:
                dist.barrier()
                module.reset_stats()
                t0 = time.perf_counter()
            step_start = time.perf_counter()
            module.step = step
            x, y = batches[step % len(batches)]
            optimizer.zero_grad(set_to_none=True)
            losses: list[torch.Tensor] = []
            if is_first and is_last:
                schedule.step(x, target=y, losses=losses)
            elif is_first:
                schedule.step(x)
            elif is_last:
                schedule.step(target=y, losses=losses)
            else:
                schedule.step()
            optimizer_start = time.time()
            optimizer.step()
            module.span("optimizer", optimizer_start, step)
            step_times.append(time.perf_counter() - step_start)
            if is_last:
                last_losses = losses
            if is_first:
                phase = "warm-up" if step < cfg["warmup"] else "timed"
                _log(f"step {step + 1}/{total} ({phase}) rank0 {step_times[-1]:.3f} s")
        dist.barrier()
        elapsed = time.perf_counter() - t0
        if module.timeline is not None:
            from ftpipe_iot.observability.trace import TraceStore

            batch = module.timeline.take(stage=rank)
            if batch is not None:
                TraceStore(Path(cfg["trace_dir"])).add(f"torch-rank{rank}", batch)

        steps = cfg["steps"]
        s = module.stats
        timed_steps = step_times[cfg["warmup"]:]
        stage_stats = {
            "stage": rank,
            "layers": [start, end],
            "factor": s["factor_sum"] / s["fwd_calls"] if s["fwd_calls"] else None,
            "fwd_calls": int(s["fwd_calls"]),
            "bwd_calls": int(s["bwd_calls"]),
            "real_fwd_s_per_step": s["fwd_real_s"] / steps,
            "real_bwd_s_per_step": s["bwd_real_s"] / steps,
            "real_compute_s_per_step": (s["fwd_real_s"] + s["bwd_real_s"]) / steps,
            "real_compute_s_per_micro_batch": (s["fwd_real_s"] + s["bwd_real_s"]) / (steps * n_mb),
            "cpu_fwd_s_per_step": s["fwd_cpu_s"] / steps,
            "cpu_bwd_s_per_step": s["bwd_cpu_s"] / steps,
            "emulated_compute_s_per_step": (s["fwd_real_s"] + s["bwd_real_s"] + s["sleep_s"])
            / steps,
            "sleep_s_per_step": s["sleep_s"] / steps,
            "rank_step_wall_s_mean": sum(timed_steps) / len(timed_steps),
        }
        if is_last and last_losses:
            stage_stats["last_step_loss"] = float(torch.stack(last_losses).detach().mean())
        gathered: list[Any] = [None] * world if is_first else []
        dist.gather_object(stage_stats, gathered if is_first else None, dst=0)
        if is_first:
            result_queue.put({"elapsed_s": elapsed, "stages": gathered})
    finally:
        dist.destroy_process_group()


def _measure_split(cfg: TorchPipeliningConfig) -> tuple[list[tuple[int, int]], list[float], int]:
    """Measured per-layer costs (one thread, one micro-batch) and their balanced split."""
    from ftpipe_iot.core.models import ModelSpec, build_layers, measure_layer_costs
    from ftpipe_iot.planning.partition import balanced_split

    layers = build_layers(ModelSpec("mobilenetv2", width=cfg.width), INPUT_SHAPE, NUM_CLASSES,
                          seed=cfg.seed)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        costs = measure_layer_costs(layers, INPUT_SHAPE, cfg.micro_batch_size)
    finally:
        torch.set_num_threads(threads)
    split = cfg.split if cfg.split is not None else balanced_split(costs, cfg.stage_count())
    return [tuple(r) for r in split], costs, len(layers)


def run_torch_pipelining(
    config: TorchPipeliningConfig | Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """Run the torch.distributed.pipelining baseline and return the result as a JSON-able dict.

    ``config`` is a :class:`TorchPipeliningConfig`, a mapping of its field names, or ``None``.
    The result holds the config, the split, ``samples_per_s`` (timed samples / wall time on
    rank 0 between two barriers) and per-stage statistics.
    """
    import torch.multiprocessing as mp

    cfg = coerce_config(config)
    cfg.validate()
    profiles = None if cfg.factors else list(cfg.profiles or DEFAULT_PROFILES)
    world = cfg.stage_count()
    _log(f"measuring layer costs (width {cfg.width}, micro-batch {cfg.micro_batch_size})")
    split, costs, n_layers = _measure_split(cfg)
    check_split(split, n_layers)
    _log(f"split {split} over {n_layers} layers; stage costs "
         f"{[round(sum(costs[a:b]) * 1000, 1) for a, b in split]} ms/micro-batch")

    worker_cfg = {
        "width": cfg.width, "factors": cfg.factors, "profiles": profiles,
        "micro_batches": cfg.micro_batches, "micro_batch_size": cfg.micro_batch_size,
        "steps": cfg.steps, "warmup": cfg.warmup, "split": split, "schedule": cfg.schedule,
        "clock": cfg.clock,
        "lr": cfg.lr, "momentum": cfg.momentum, "seed": cfg.seed, "trace_dir": cfg.trace_dir,
    }
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    port = _free_port()
    _log(f"spawning {world} ranks (gloo, 127.0.0.1:{port}, {SCHEDULES[cfg.schedule]})")
    started = time.perf_counter()
    procs = mp.start_processes(_worker, args=(world, port, worker_cfg, queue), nprocs=world,
                               join=False, start_method="spawn")
    result: dict[str, Any] | None = None
    deadline = time.monotonic() + cfg.timeout_s
    try:
        while True:
            if result is None and not queue.empty():
                result = queue.get()
            if procs.join(timeout=0.5):
                break
            if time.monotonic() > deadline:
                raise TimeoutError(f"torch pipelining run exceeded {cfg.timeout_s} s")
    finally:
        for p in procs.processes:
            if p.is_alive():
                p.terminate()
                p.join(5)
    if result is None and not queue.empty():
        result = queue.get()
    if result is None:
        raise RuntimeError("rank 0 finished without reporting a result")

    samples = cfg.steps * cfg.micro_batches * cfg.micro_batch_size
    stages = result["stages"]
    config_out = asdict(cfg)
    config_out.pop("extra")
    config_out["profiles"] = profiles
    config_out["split"] = [list(r) for r in split]
    return {
        "benchmark": "torch_pipelining",
        "torch_version": torch.__version__,
        "schedule": SCHEDULES[cfg.schedule],
        "backend": "gloo",
        "model": f"mobilenetv2(width={cfg.width})",
        "config": config_out,
        "stages_count": world,
        "split": [list(r) for r in split],
        "layer_costs_s": costs,
        "timed_samples": samples,
        "elapsed_s": result["elapsed_s"],
        "samples_per_s": samples / result["elapsed_s"],
        "bottleneck_emulated_compute_s_per_step": max(
            s["emulated_compute_s_per_step"] for s in stages),
        "wall_s_total": time.perf_counter() - started,
        "stages": stages,
        **({"extra": cfg.extra} if cfg.extra else {}),
    }


# --------------------------------------------------------------------------- CLI


def build_parser() -> argparse.ArgumentParser:
    """The command-line interface."""
    p = argparse.ArgumentParser(
        description="Throughput of torch.distributed.pipelining (gloo, CPU, one process per "
                    "stage) with emulated per-stage slow-downs (Scenario H baseline).")
    p.add_argument("--width", type=float, default=0.25, help="MobileNetV2 width (default 0.25)")
    group = p.add_mutually_exclusive_group()
    group.add_argument("--factors", help="constant slow-down per stage, e.g. 1,2,4,10")
    group.add_argument("--profiles", nargs="+",
                       help="device profile JSON per stage (comma- or space-separated); default "
                            "devices/profiles/bench-h-{1,2,4,10}.json")
    p.add_argument("--micro-batches", type=int, default=4)
    p.add_argument("--micro-batch-size", type=int, default=8)
    p.add_argument("--steps", type=int, default=10, help="timed steps")
    p.add_argument("--warmup", type=int, default=3, help="untimed warm-up steps")
    p.add_argument("--split", help="explicit layer ranges, e.g. 0:5,5:9,9:16,16:22 "
                                   "(default: balanced split over measured layer costs)")
    p.add_argument("--schedule", choices=sorted(SCHEDULES), default="gpipe")
    p.add_argument("--clock", choices=CLOCKS, default="wall",
                   help="real time the slow-down multiplies: wall (perf_counter, as ftpipe-iot's "
                        "device agent) or cpu (thread CPU time, robust to a busy host)")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=600.0, help="seconds before giving up")
    p.add_argument("--trace-dir", default=None,
                   help="record every rank's timeline spans here (ftpipe-iot trace reads it)")
    return p


def config_from_args(args: argparse.Namespace) -> TorchPipeliningConfig:
    """Turn parsed CLI arguments into a config."""
    profiles = None
    if args.profiles:
        profiles = [part for item in args.profiles for part in item.split(",") if part]
    return TorchPipeliningConfig(
        width=args.width,
        factors=[float(f) for f in args.factors.split(",")] if args.factors else None,
        profiles=profiles,
        micro_batches=args.micro_batches,
        micro_batch_size=args.micro_batch_size,
        steps=args.steps,
        warmup=args.warmup,
        split=parse_split(args.split) if args.split else None,
        schedule=args.schedule,
        clock=args.clock,
        lr=args.lr,
        seed=args.seed,
        timeout_s=args.timeout,
        trace_dir=args.trace_dir,
    )


def main(argv: Sequence[str] | None = None) -> int:
    """CLI entry point: print one JSON object on stdout."""
    args = build_parser().parse_args(argv)
    try:
        config = config_from_args(args)
        result = run_torch_pipelining(config)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(result, indent=2))
    _log(f"{result['samples_per_s']:.2f} samples/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
