"""Speed benchmark (prints JSON, writes it): one run, side by side, on the same split.

Configuration (issue 14): CIFAR-style MobileNetV2 at full width on synthetic 32x32 data,
micro-batches of 32, M = 8, 4 stages on the split [0,3),[3,5),[5,12),[12,22):

* ``equal``: 4 equal devices; ``scenario_h``: slow-down factors 1, 2, 4, 10 (stage order);
  ``--equal-factor F`` emulates the 4 equal devices F times slower than the host (every
  system, torch's ranks too, sleeps the same share of its compute): at F = 1 the four stages
  ask for 4 cores of a 2-core host and every system measures the host's contention, at F = 4
  they ask for one core, so the pipeline's bubbles and messages are what differs;
* single process, one thread (the whole model, the same micro-batching);
* torch.distributed.pipelining (gloo) ScheduleGPipe and Schedule1F1B
  (benchmarks/torch_pipelining.py);
* ftpipe-iot ``--schedule sync`` and ``--schedule async`` (devices and controller as processes
  over a Mosquitto on loopback), rate over the steps after the warm-up;
* per ftpipe-iot stage process, where its CPU goes: the main thread profiled with cProfile
  (self time split into layer compute, wire encode/decode and compression, array copies,
  transport and queues, other Python, idle waits) and every thread's CPU seconds from
  /proc (the network thread is not seen by cProfile). ``--profile-run`` adds one profiled
  sync run of ``equal`` (profiling slows Python, so rates come from the unprofiled runs);
* time to 0.95 test accuracy on digits (3 devices, 4 x 8, lr 0.05): sync, async without and
  with delay compensation, over seeds, for the CNN (8 x 8) and full-width MobileNetV2 (the
  digits upscaled to 3 x 32 x 32) (``--only accuracy``): the wall time from the first step
  to the first evaluation at 0.95, the median over the seeds, and a plot of accuracy against
  wall time; each run's planner chooses its split unless ``--acc-split`` pins one for all;
  the runs evaluate every ``--acc-evaluate-every`` steps, each evaluation a pause of the run
  (on MobileNetV2 at factor 2 about 2.5 s every 10 steps of 7, a third of the wall time, the
  same seconds for both schedules), or with ``--acc-offline`` only at their epoch ends (the
  product's default) while every checkpoint is written and evaluated after the run;
* where each schedule's time goes on the time-to-accuracy fleet (``--only shares``): sync and
  async traced over ``--shares-steps`` steps of ``--shares-model`` (MobileNetV2 on the
  upscaled digits, or the CNN on the digits) at ``--acc-factor``, each
  device's compute, communication and wait shares and its compute seconds per step over the
  steps after the first replication point, so whether a device is the bottleneck, and whether
  computing at once (async fills the bubble) slows each device's compute (a shared host);
* what the timeline costs (``--only trace``): sync on ``equal`` with and without
  ``--trace-dir``, in pairs whose order alternates, the median rate of each and the overhead;
  a PNG of one representative step of the last traced run (what each stage did when) above
  the same step of torch.distributed.pipelining's GPipe, traced the same way.

The host has 2 cores shared with other work: ``loadavg`` is recorded before and after every
run; rates are noisy at the 10-20% level.

    python benchmarks/speed.py [--steps 8] [--out benchmarks/results/speed.json]
"""

from __future__ import annotations

import argparse
import json
import os
import pstats
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.harness import PROFILES, say, steady_rate  # noqa: E402
from ftpipe_iot.runtime.broker import BrokerProcess  # noqa: E402
from ftpipe_iot.runtime.keys import LocalKeys  # noqa: E402

SPLIT = [(0, 3), (3, 5), (5, 12), (12, 22)]
MB, M = 32, 8
BATCH = MB * M
FACTORS_H = (1, 2, 4, 10)
TRAINING = ["--model", "mobilenetv2", "--data", "synthetic", "--data-shape", "3,32,32",
            "--data-samples", "4096", "--micro-batches", str(M), "--micro-batch-size", str(MB),
            "--lr", "0.01", "--epochs", "1", "--max-in-flight", str(M)]


def loadavg() -> list[float]:
    return [round(v, 2) for v in os.getloadavg()]


# ------------------------------------------------------------------ single process


def single_process(steps: int, warmup: int) -> dict:
    """The whole model in this process, one intra-op thread, the same micro-batching."""
    import torch

    from ftpipe_iot.core.models import ModelSpec, build_layers
    from ftpipe_iot.core.stage import micro_batch_loss

    torch.set_num_threads(1)
    layers = build_layers(ModelSpec("mobilenetv2"), (3, 32, 32), 10, 0)
    model = torch.nn.Sequential(*layers)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    rng = torch.Generator().manual_seed(0)
    x = torch.randn(MB, 3, 32, 32, generator=rng)
    y = torch.randint(0, 10, (MB,), generator=rng)
    before = loadavg()
    for step in range(warmup + steps):
        if step == warmup:
            started = time.perf_counter()
        for _ in range(M):
            micro_batch_loss(model(x), y, M).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    elapsed = time.perf_counter() - started
    return {"samples_per_s": steps * BATCH / elapsed, "loadavg_before": before,
            "loadavg_after": loadavg()}


# ------------------------------------------------------------------ torch pipelining


def torch_pipelining(schedule: str, factors: tuple[float, ...], steps: int, warmup: int,
                     trace_dir: Path | None = None) -> dict:
    from benchmarks.torch_pipelining import TorchPipeliningConfig, run_torch_pipelining

    before = loadavg()
    try:
        result = run_torch_pipelining(TorchPipeliningConfig(
            width=1.0, factors=[float(f) for f in factors], micro_batches=M,
            micro_batch_size=MB, steps=steps, warmup=warmup, split=SPLIT, schedule=schedule,
            clock="cpu", trace_dir=str(trace_dir) if trace_dir else None))
    except Exception as exc:  # reported as missing, not dropped
        return {"error": f"{type(exc).__name__}: {exc}"}
    costs = result["layer_costs_s"]
    return {"samples_per_s": result["samples_per_s"], "schedule": result["schedule"],
            "clock": "cpu", "loadavg_before": before, "loadavg_after": loadavg(),
            "stage_costs_s": [round(sum(costs[a:b]), 4) for a, b in SPLIT]}


def schedule_bounds(stage_costs_s: list[float], factors: tuple[float, ...]) -> dict:
    """What the split allows each kind of schedule at best, from the profiled forward and
    backward seconds of a micro-batch per stage (times each device's slow-down), with every
    stage a processor of its own and messages free: a schedule that drains every step
    (GPipe, 1F1B, ftpipe-iot sync) takes at least sum(t) + (M - 1) max(t) a step, one that
    never drains (PipeDream-2BW between its drains) M max(t). Their ratio is the most an
    asynchronous schedule can gain over a flushing one on this split."""
    times = [t * f for t, f in zip(stage_costs_s, factors)]
    flushing = sum(times) + (M - 1) * max(times)
    streaming = M * max(times)
    return {"stage_s": [round(t, 4) for t in times],
            "flushing_step_s": round(flushing, 3), "streaming_step_s": round(streaming, 3),
            "flushing_samples_per_s": round(BATCH / flushing, 2),
            "streaming_samples_per_s": round(BATCH / streaming, 2),
            "most_async_over_flushing": round(flushing / streaming, 3)}


# ------------------------------------------------------------------ ftpipe-iot


class _ThreadCpu:
    """Per-thread CPU seconds of a process, the last values read before it exited."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.threads: dict[int, float] = {}
        self.tick = os.sysconf("SC_CLK_TCK")

    def sample(self) -> None:
        try:
            tids = os.listdir(f"/proc/{self.pid}/task")
        except OSError:
            return
        for tid in tids:
            try:
                with open(f"/proc/{self.pid}/task/{tid}/stat") as stat:
                    fields = stat.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            self.threads[int(tid)] = (int(fields[11]) + int(fields[12])) / self.tick

    def split(self) -> dict[str, float]:
        main = self.threads.get(self.pid, 0.0)
        return {"main_thread_cpu_s": round(main, 2),
                "other_threads_cpu_s": round(sum(self.threads.values()) - main, 2)}


_CATEGORIES = (
    ("idle", ("acquire' of '_thread.lock", "method 'acquire'", "time.sleep", "select.",
              "method 'poll'", "'wait' of", "threading.py:", "queue.py:")),
    ("layer_compute", ("torch", "conv", "batch_norm", "linear", "relu", "hardtanh",
                       "adaptive_avg", "run_backward", "cross_entropy", "addmm")),
    ("wire_encode_decode", ("ftpipe_iot/protocol/wire", "msgpack", "lz4", "zlib",
                            "protocol/messages", "protocol/fields", "transport/messenger")),
    ("array_copies", ("numpy", "method 'copy'", "tobytes", "frombuffer", "built-in method "
                      "numpy", "ndarray")),
    ("transport_queues", ("paho", "ftpipe_iot/transport", "socket", "ssl")),
)


def _category(filename: str, name: str) -> str:
    text = f"{filename}:{name}"
    for category, needles in _CATEGORIES:
        if any(needle in text for needle in needles):
            return category
    return "other_python"


def cpu_breakdown(profile: Path) -> dict[str, float]:
    """Self time of the main thread by category (seconds)."""
    stats = pstats.Stats(str(profile))
    totals: dict[str, float] = {}
    for (filename, _line, name), (_cc, _nc, tottime, _ct, _callers) in stats.stats.items():
        category = _category(filename, name)
        totals[category] = totals.get(category, 0.0) + tottime
    busy = sum(v for k, v in totals.items() if k != "idle")
    out = {k: round(v, 2) for k, v in sorted(totals.items())}
    out["busy_s"] = round(busy, 2)
    out["beyond_compute_share"] = round(1 - totals.get("layer_compute", 0.0) / busy, 3) \
        if busy else 0.0
    return out


def _top(profile: Path, n: int = 12) -> list[str]:
    stats = pstats.Stats(str(profile))
    rows = sorted(stats.stats.items(), key=lambda kv: kv[1][2], reverse=True)
    return [f"{tottime:.2f}s {Path(f).name}:{line}:{name}"
            for (f, line, name), (_cc, _nc, tottime, _ct, _c) in rows
            if _category(f, name) != "idle"][:n]


def job_crypto_s(summary: dict) -> float:
    """CPU seconds a job's processes spent signing and verifying: the controller's and each
    device's as last heartbeated (a run summary's ``crypto_s`` and ``device_traffic``)."""
    return summary.get("crypto_s", 0.0) + sum(
        t.get("crypto_s", 0.0) for t in summary["device_traffic"].values())


def ftpipe(broker: BrokerProcess, job: str, schedule: str, factors: tuple[float, ...],
           steps: int, warmup: int, profile: bool = False,
           training: list[str] | None = None, assignment: bool = True,
           timeout_s: float = 1200.0, signed: bool = True, trace: bool = False,
           repartition: bool = False) -> dict:
    """One ftpipe-iot job on the fixed split; devices optionally under cProfile; every message
    signed unless ``signed`` is False (``--insecure-unsigned``); the run's timeline kept in
    its work dir when ``trace``; the controller's rebalancing off unless ``repartition``
    (runs compared side by side keep their first plan)."""
    work = Path(tempfile.mkdtemp(prefix=f"speed-{job}-"))
    names = [f"{job}-d{k}" for k in range(len(factors))]
    procs: dict[str, subprocess.Popen] = {}
    cpu: dict[str, _ThreadCpu] = {}
    python = [sys.executable]
    env = dict(os.environ)
    keys = LocalKeys(work / "keys")  # signed, as every job runs by default

    def key_args(name: str) -> list[str]:
        return keys.args(name) if signed else ["--insecure-unsigned"]

    before = loadavg()
    try:
        for name, factor in zip(names, factors):
            extra = ["--profile", str(PROFILES / f"bench-h-{factor}.json")] if factor != 1 \
                else []
            entry = [str(Path(__file__).with_name("cpu_profile.py")), str(work / f"{name}.prof")] \
                if profile else ["-m", "ftpipe_iot"]
            procs[name] = subprocess.Popen(
                [*python, *entry, "device", "--name", name, "--job", job,
                 "--broker", broker.url, "--log-level", "INFO", *key_args(name), *extra],
                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                stderr=open(work / f"{name}.log", "w"), start_new_session=True, env=env)
            cpu[name] = _ThreadCpu(procs[name].pid)
        cpu["broker"] = _ThreadCpu(broker.proc.pid)
        cpu["broker"].sample()
        broker_before = sum(cpu["broker"].threads.values())
        pinned = ",".join(f"{n}:{a}-{b}" for n, (a, b) in zip(names, SPLIT))
        summary_path = work / "summary.json"
        args = training if training is not None else [*TRAINING, "--max-steps",
                                                      str(warmup + steps)]
        entry = [str(Path(__file__).with_name("cpu_profile.py")), str(work / "controller.prof")] \
            if profile else ["-m", "ftpipe_iot"]
        procs["controller"] = subprocess.Popen(
            [*python, *entry, "controller", "--job", job, "--broker", broker.url,
             "--devices", str(len(names)), "--stop-devices", "--summary-json",
             str(summary_path), "--log-level", "WARNING",
             *([] if repartition else ["--no-repartition"]),
             "--wait-devices", "900", "--stall-timeout", "300",
             "--schedule", schedule, *(["--assignment", pinned] if assignment else []),
             *(["--trace-dir", str(work / "trace")] if trace else []),
             *key_args("controller"), *args],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
            stderr=open(work / "controller.log", "w"), start_new_session=True, env=env)
        cpu["controller"] = _ThreadCpu(procs["controller"].pid)
        started = time.monotonic()
        while procs["controller"].poll() is None:
            if time.monotonic() - started > timeout_s:
                raise TimeoutError(f"{job} did not finish in {timeout_s}s; see {work}")
            for sampler in cpu.values():
                sampler.sample()
            time.sleep(0.5)
        if procs["controller"].returncode != 0:
            raise RuntimeError(f"{job}: controller failed; see {work}/controller.log")
        for name in names:
            procs[name].wait(60)
        summary = json.loads(summary_path.read_text())
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.terminate()
    result = {"samples_per_s": steady_rate(summary, BATCH, steps) if training is None
              else summary["samples_per_s"],
              "schedule": schedule, "steps": summary["steps"],
              "loadavg_before": before, "loadavg_after": loadavg(),
              "process_cpu": {name: sampler.split() for name, sampler in cpu.items()
                              if name != "broker"},
              "broker_cpu_s": round(sum(cpu["broker"].threads.values()) - broker_before, 2),
              "summary": {k: summary[k] for k in ("wall_s", "train_s", "test_accuracy",
                                                  "evals", "wire_bytes_per_step",
                                                  "events")},
              "crypto_s": round(job_crypto_s(summary), 4),
              "history_t": [(h["step"], round(h["t"], 3)) for h in summary["history"]],
              "started_at": summary.get("started_at", 0.0),
              "work_dir": str(work)}
    if trace:
        files = list((work / "trace").glob("*.jsonl"))
        result["trace_bytes"] = sum(f.stat().st_size for f in files)
        result["trace_spans"] = sum(len(json.loads(line)["kinds"]) for f in files
                                    for line in f.read_text().splitlines())
    if profile:
        result["cpu_breakdown"] = {name: {**cpu_breakdown(work / f"{name}.prof"),
                                          "top": _top(work / f"{name}.prof")}
                                   for name in [*names, "controller"]}
    return result


ACCURACY_VARIANTS = {  # name -> (--schedule, --delay-compensation)
    "sync": ("sync", "none"),
    "async-none": ("async", "none"),
    "async-predict": ("async", "predict"),
}


def upscaled_digits(directory: Path) -> Path:
    """scikit-learn's digits as 3 x 32 x 32 images (each pixel 4 x 4, grey in three channels),
    as an npz file the devices load (``--data npz:PATH``; the same train/test split as
    ``--data digits``): real labels at the input size the CIFAR-style MobileNetV2 is built
    for, whose stride-2 stages leave nothing of 8 x 8 images."""
    import numpy as np
    from sklearn.datasets import load_digits

    digits = load_digits()
    x = (digits.images.astype(np.float32) / 16.0)[:, None]
    x = np.repeat(np.repeat(np.repeat(x, 4, axis=2), 4, axis=3), 3, axis=1)
    path = directory / "digits-3x32x32.npz"
    np.savez(path, x=x, y=digits.target.astype(np.int64))
    return path


def time_to_accuracy(broker: BrokerProcess, variant: str, seed: int, model: str = "cnn",
                     target: float = 0.95, lr: float = 0.05, epochs: int = 4,
                     data: str = "digits", factor: float = 1, evaluate_every: int = 0,
                     max_in_flight: int = 8, split: list[tuple[int, int]] | None = None,
                     offline: bool = False) -> dict:
    """One job on ``data`` (3 devices, 4 x 8) until ``epochs`` end, evaluated every epoch
    and every ``evaluate_every`` steps (0: at epoch ends only; a multiple of the replication
    interval, 10, adds no drain to the asynchronous schedule): the time from its first step
    to the first evaluation at ``target``, as wall time (``seconds_to_target``, evaluations
    included) and as training time (``train_seconds_to_target``, the evaluations paused
    out: with more of them both schedules pay the same seconds more). ``factor``: the
    devices emulated that many times slower than this host (``bench-h-F`` profiles: the
    compute beyond the real part is slept), so three devices on two cores no longer fill
    each other's idle time, as separate devices would not. ``max_in_flight``: the product's
    default, 8: two steps' micro-batches, which only the asynchronous schedule can use (sync
    feeds one step of 4 at a time); results before it was an option ran with 4. ``split``:
    the three stages' layers, pinned for every run (``--assignment``), where the planner's
    choice would otherwise differ between runs whose profiles differ by noise: a comparison
    of schedules on one split, as the GPipe comparison is. ``offline``: the run evaluates at
    its epoch ends only (the product's default) and writes every checkpoint (``--checkpoint-dir``,
    each replication, every 10 steps); the checkpoints are evaluated after it
    (``offline_points``), so the curve's evaluations no longer pause the run they measure."""
    schedule, compensation = ACCURACY_VARIANTS[variant]
    checkpoints = Path(tempfile.mkdtemp(prefix=f"acc-ckpt-{variant}-s{seed}-")) if offline \
        else None
    if offline:
        evaluate_every = 0
    job = f"acc-{model}-{variant}-s{seed}"
    training = ["--model", model, "--data", data, "--micro-batches", "4",
                "--micro-batch-size", "8", "--lr", str(lr), "--epochs", str(epochs),
                "--max-in-flight", str(max_in_flight), "--seed", str(seed),
                "--delay-compensation", compensation, "--evaluate-every", str(evaluate_every)]
    if split is not None:
        training += ["--assignment", ",".join(f"{job}-d{k}:{start}-{end}"
                                              for k, (start, end) in enumerate(split))]
    if checkpoints is not None:
        training += ["--checkpoint-dir", str(checkpoints)]
    run = ftpipe(broker, job, schedule, (factor,) * 3, 0, 0, training=training,
                 assignment=False)
    evals = run["summary"]["evals"]
    first_t = run["history_t"][0][1] if run["history_t"] else 0.0
    offline_check: dict = {}
    if checkpoints is None:
        trained = training_seconds(evals, run["history_t"])
        points = [{"step": e["step"], "epoch": e["epoch"], "accuracy": e["test_accuracy"],
                   "t": round(e["t"] - first_t, 2), "train_s": t}
                  for e, t in zip(evals, trained)]
    else:
        say(f"evaluating {len(list(checkpoints.glob('step-*.pt')))} checkpoints offline")
        points = offline_points(checkpoints, data, evals, run["history_t"])
        shutil.rmtree(checkpoints, ignore_errors=True)
        # the same weights evaluated by the fleet at the job's end and here: the same figure
        last = next((p for p in points if evals and p["step"] == evals[-1]["step"]), None)
        offline_check = {"final_step_in_run_accuracy": evals[-1]["test_accuracy"] if evals
                         else None,
                         "final_step_offline_accuracy": None if last is None
                         else last["accuracy"]}
    hit = next((p for p in points if p["accuracy"] >= target), None)
    return {"variant": variant, "schedule": schedule, "delay_compensation": compensation,
            "model": model, "seed": seed, "target": target, "lr": lr, "momentum": 0.9,
            "device_factor": factor, "evaluate_every": evaluate_every,
            "max_in_flight": max_in_flight,
            "evaluated": "checkpoints, after the run" if offline else "in the run",
            **offline_check,
            "seconds_to_target": None if hit is None else hit["t"],
            "train_seconds_to_target": None if hit is None else hit["train_s"],
            "steps_to_target": None if hit is None else hit["step"],
            "epochs_to_target": None if hit is None else hit["epoch"] + 1,
            "step_by_evaluation": [p["step"] for p in points],
            "accuracy_by_evaluation": [round(p["accuracy"], 4) for p in points],
            "seconds_by_evaluation": [p["t"] for p in points],
            "train_seconds_by_evaluation": [p["train_s"] for p in points],
            "accuracy_by_epoch": [round(e["test_accuracy"], 4) for e in evals
                                  if e.get("end_of_epoch", True)],
            "final_accuracy": round(evals[-1]["test_accuracy"], 4) if evals else None,
            "train_samples_per_s": run["samples_per_s"], "loadavg_after": run["loadavg_after"],
            # each plan's stages: under async they decide which micro-batches are stale
            "plans": [{"resume_step": e["resume_step"],
                       "layers": [[st["start"], st["end"]] for st in e["stages"]]}
                      for e in run["summary"].get("events", [])
                      if e.get("type") == "plan_changed" and e.get("stages")]}


def parse_split(text: str) -> list[tuple[int, int]]:
    """``0-3,3-6,6-12`` as [(0, 3), (3, 6), (6, 12)]: three contiguous stages from layer 0."""
    try:
        split = [(int(a), int(b)) for a, b in (part.split("-") for part in text.split(","))]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected A-B,B-C,C-D") from None
    if len(split) != 3 or split[0][0] != 0 or any(
            a >= b for a, b in split) or any(split[k][1] != split[k + 1][0] for k in range(2)):
        raise argparse.ArgumentTypeError(f"{text!r}: three contiguous stages from layer 0")
    return split


def offline_points(checkpoints: Path, data: str, evals: list[dict],
                   history_t: list[tuple[int, float]]) -> list[dict]:
    """Every checkpoint in ``checkpoints`` (``step-N.pt``, the weights after N steps) evaluated
    on the test set here, after the run, and the run's own evaluations (its epoch ends) at the
    steps no checkpoint has, with their times in the run: ``t`` from the first step's end to
    the end of step N (the in-run evaluations before it included: the run paid them),
    ``train_s`` the same without them. Epoch of step N as the run's evaluations count them."""
    from ftpipe_iot.artifacts.evaluate import evaluate
    from ftpipe_iot.protocol.specs import DataSpec

    ended = dict(history_t)
    if not ended:
        return []
    first_t = history_t[0][1]
    spec = DataSpec(data)
    epoch_ends = sorted(e["step"] for e in evals if e.get("end_of_epoch", True))
    accuracy = {int(path.stem.split("-")[1]): path for path in checkpoints.glob("step-*.pt")}
    in_run = {e["step"]: e["test_accuracy"] for e in evals}
    points = []
    for step in sorted(set(accuracy) | set(in_run)):
        if step == 0 or step - 1 not in ended:
            continue
        t = ended[step - 1] - first_t
        paused = sum(evaluation_pause_s(e, ended) for e in evals if e["step"] < step)
        epoch = sum(1 for end in epoch_ends if end < step)
        points.append({"step": step, "epoch": epoch, "t": round(t, 2),
                       "train_s": round(t - paused, 2),
                       "accuracy": evaluate(accuracy[step], spec).accuracy
                       if step in accuracy else in_run[step]})
    return points


def training_seconds(evals: list[dict], history_t: list[tuple[int, float]]) -> list[float]:
    """For each evaluation, the seconds from the first step's end to the end of the step it
    evaluated, without the evaluations before it: each one lasts from the end of its step
    (``step - 1`` in the history) to its own record, and nothing trains meanwhile (a drain
    point of every schedule)."""
    ended = dict(history_t)
    if not ended:
        return []
    first_t = history_t[0][1]
    out: list[float] = []
    paused = 0.0
    for e in evals:
        out.append(round(ended.get(e["step"] - 1, e["t"]) - first_t - paused, 2))
        paused += evaluation_pause_s(e, ended)
    return out


def evaluation_pause_s(evaluation: dict, ended: dict[int, float]) -> float:
    """How long an in-run evaluation paused its run: from the end of the step it evaluates
    (``step - 1`` in the history, whose step ends are ``ended``) to its own record."""
    return evaluation["t"] - ended.get(evaluation["step"] - 1, evaluation["t"])


def accuracy_summary(runs: list[dict]) -> dict:
    """Per model and variant: the median wall time to the target over the seeds (a seed that
    never reaches it counts as infinitely slow), the final accuracies, and async's median
    time as a fraction of sync's."""
    def median_time(mine: list[dict], key: str) -> float | None:
        times = sorted(r.get(key) if r.get(key) is not None else float("inf") for r in mine)
        median = times[len(times) // 2] if len(times) % 2 else \
            (times[len(times) // 2 - 1] + times[len(times) // 2]) / 2
        return None if median == float("inf") else round(median, 2)

    out: dict = {}
    for model in sorted({r["model"] for r in runs}):
        rows: dict = {}
        for variant in ACCURACY_VARIANTS:
            mine = [r for r in runs if r["model"] == model and r["variant"] == variant]
            if not mine:
                continue
            finals = [r["final_accuracy"] for r in mine]
            rows[variant] = {"median_seconds_to_target": median_time(mine, "seconds_to_target"),
                             "median_train_seconds_to_target":
                             median_time(mine, "train_seconds_to_target"),
                             "reached": sum(r["seconds_to_target"] is not None for r in mine),
                             "seeds": len(mine),
                             "mean_final_accuracy": round(sum(finals) / len(finals), 4),
                             "median_samples_per_s": sorted(
                                 r["train_samples_per_s"] for r in mine)[len(mine) // 2]}
        for key, ratio in (("median_seconds_to_target", "time_vs_sync"),
                           ("median_train_seconds_to_target", "train_time_vs_sync")):
            sync = rows.get("sync", {}).get(key)
            for row in rows.values():
                mine = row[key]
                row[ratio] = None if not sync or mine is None else round(mine / sync, 3)
        out[model] = rows
    return out


def schedule_shares(broker: BrokerProcess, data: Path, factor: int, steps: int,
                    repartition: bool = False, model: str = "mobilenetv2") -> dict:
    """Sync and async on the time-to-accuracy fleet, traced (``--only shares``): per schedule
    the steady step time over the last 20 steps but one and each device's shares of it;
    ``repartition``: the controller may rebalance the first plan from measured times (then
    the window starts after its last new plan)."""
    from ftpipe_iot.observability.trace import busy_shares, load_trace

    out: dict = {}
    for schedule in ("sync", "async"):
        say(f"shares: {schedule}, {steps} steps, factor {factor}")
        dataset = "digits" if model == "cnn" else f"npz:{data}"
        training = ["--model", model, "--data", dataset, "--micro-batches", "4",
                    "--micro-batch-size", "8", "--lr", "0.05", "--max-steps", str(steps),
                    "--seed", "0"]
        run = ftpipe(broker, f"shares-{schedule}", schedule, (factor,) * 3, 0, 0,
                     training=training, assignment=False, trace=True, repartition=repartition)
        trace = load_trace(Path(run["work_dir"]) / "trace")
        bounds = trace.step_bounds()
        summary = json.loads((Path(run["work_dir"]) / "summary.json").read_text())
        plans = [e for e in summary["events"] if e["type"] == "plan_changed"]
        last = steps - 2
        first = max(8, last - 20, *(e["resume_step"] + 2 for e in plans))
        window = (bounds[first][0], bounds[last][1])
        step_s = (window[1] - window[0]) / (last - first + 1)
        out[schedule] = {
            "samples_per_s": run["samples_per_s"], "window_steps": [first, last],
            "plans": [{"resume_step": e["resume_step"],
                       "layers": [[st["start"], st["end"]] for st in e["stages"]]}
                      for e in plans],
            "window_step_s": round(step_s, 4),
            "devices": [{"device": share.name, "compute": round(share.compute, 3),
                         "comm": round(share.comm, 3), "wait": round(share.wait, 3),
                         "compute_s_per_step": round(share.compute * step_s, 4)}
                        for share in busy_shares(trace, window)]}
    sync, asynchronous = out["sync"], out["async"]
    out["async_speedup_in_window"] = round(sync["window_step_s"] / asynchronous["window_step_s"],
                                           3)
    out["compute_inflation"] = [
        round(a["compute_s_per_step"] / s["compute_s_per_step"], 3)
        for s, a in zip(sync["devices"], asynchronous["devices"])]
    return out


def plot_accuracy(runs: list[dict], path: Path) -> None:
    """Test accuracy against wall time, one panel per model, one colour per variant."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = sorted({r["model"] for r in runs})
    fig, axes = plt.subplots(1, len(models), figsize=(6 * len(models), 4), squeeze=False)
    colours = dict(zip(ACCURACY_VARIANTS, ("tab:blue", "tab:red", "tab:green")))
    for ax, model in zip(axes[0], models):
        for r in (r for r in runs if r["model"] == model):
            label = r["variant"] if r["seed"] == min(x["seed"] for x in runs) else None
            ax.plot(r["train_seconds_by_evaluation"], r["accuracy_by_evaluation"], marker="o",
                    color=colours[r["variant"]], alpha=0.7, label=label)
        ax.axhline(runs[0]["target"], color="grey", linestyle=":")
        ax.set(title=f"{model} on digits (one line per seed)",
               xlabel="training time (s, evaluations paused out)",
               ylabel="test accuracy", ylim=(0, 1))
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def trace_overhead(broker: BrokerProcess, steps: int, warmup: int, pairs: int,
                   timeline_png: Path, save,  # type: ignore[no-untyped-def]
                   factors: tuple[float, ...] = (1, 1, 1, 1)) -> dict:
    """Sync on ``equal`` (its devices at ``factors``) with and without the timeline, ``pairs``
    times, the order alternating (a drifting host load hits both alike); the overhead of the
    medians; and one representative step of the last traced run drawn into ``timeline_png``
    above the same step of torch's GPipe at the same factors."""
    import statistics

    from ftpipe_iot.observability.trace import draw_timeline, load_trace, representative_steps

    runs: dict[str, list[dict]] = {"untraced": [], "traced": []}
    for pair in range(pairs):
        for traced in (False, True) if pair % 2 == 0 else (True, False):
            key = "traced" if traced else "untraced"
            say(f"timeline cost: pair {pair + 1}/{pairs}, {key}")
            runs[key].append(ftpipe(broker, f"trace-{pair}-{key}", "sync", factors,
                                    steps, warmup, trace=traced))
    rates = {key: [r["samples_per_s"] for r in found] for key, found in runs.items()}
    medians = {key: statistics.median(values) for key, values in rates.items()}
    out: dict = {"factors": list(factors), "rates": rates, "median_samples_per_s": medians,
                 "overhead": round(1 - medians["traced"] / medians["untraced"], 4),
                 "spans_per_step": [round(r["trace_spans"] / r["steps"], 1)
                                    for r in runs["traced"]],
                 "trace_bytes_per_step": [round(r["trace_bytes"] / r["steps"])
                                          for r in runs["traced"]]}
    say("timeline of torch.distributed.pipelining GPipe on the same split")
    save(out)
    torch_dir = Path(tempfile.mkdtemp(prefix="speed-torch-")) / "trace"
    out["torch_gpipe"] = torch_pipelining("gpipe", factors, steps, warmup, torch_dir)
    trace = load_trace(Path(runs["traced"][-1]["work_dir"]))
    steps_shown = representative_steps(trace, 1)
    if steps_shown is not None:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        torch_trace = load_trace(torch_dir)
        torch_step = min(steps_shown[0], warmup + steps - 1)
        fig, (top, bottom) = plt.subplots(2, 1, figsize=(12, 2.6 + 0.9 * len(trace.processes)))
        draw_timeline(top, trace, steps_shown)
        speed = "one core each of 2" if set(factors) == {1} else \
            f"emulated {factors[0]:g}x slower than the host"
        top.set_title(f"ftpipe-iot --schedule sync, step {steps_shown[0]} of MobileNetV2 "
                      f"(M = {M}, micro-batches of {MB}, 4 equal devices, {speed})",
                      fontsize=10)
        draw_timeline(bottom, torch_trace, (torch_step, torch_step))
        bottom.set_title(f"torch.distributed.pipelining ScheduleGPipe (gloo), step {torch_step}"
                         ", same split; gaps are its waits and transfers", fontsize=10)
        width = max(top.get_xlim()[1], bottom.get_xlim()[1])
        top.set_xlim(0, width)
        bottom.set_xlim(0, width)
        fig.tight_layout()
        fig.savefig(timeline_png, dpi=110)
        plt.close(fig)
        out["timeline_png"] = str(timeline_png)
        out["timeline_step"] = {"ftpipe": steps_shown[0], "torch_gpipe": torch_step}
    return out


def configuration(broker: BrokerProcess, name: str, factors: tuple[float, ...], steps: int,
                  warmup: int, torch_steps: int, save,  # type: ignore[no-untyped-def]
                  repeats: int = 1) -> dict:
    """The four pipelined runs of one configuration; ``save(partial)`` after each (a long
    benchmark on a busy host keeps what it measured). With ``repeats`` > 1 the four run that
    many times, the order reversed every other time (GPipe, 1F1B, sync, async, then async,
    sync, 1F1B, GPipe, ...), so a host that drifts during the benchmark weighs on every
    system alike; each system's figure is then the median of its runs (``runs`` keeps all)."""
    import statistics

    out: dict = {"factors": list(factors), "split": SPLIT, "repeats": repeats}
    systems = {"torch_gpipe": lambda: torch_pipelining("gpipe", factors, torch_steps, warmup),
               "torch_1f1b": lambda: torch_pipelining("1f1b", factors, torch_steps, warmup),
               "ftpipe_sync": lambda: ftpipe(broker, f"{name}-sync", "sync", factors, steps,
                                             warmup),
               "ftpipe_async": lambda: ftpipe(broker, f"{name}-async", "async", factors, steps,
                                              warmup)}
    runs: dict[str, list[dict]] = {key: [] for key in systems}
    for repeat in range(repeats):
        order = list(systems) if repeat % 2 == 0 else list(reversed(systems))
        for key in order:
            say(f"{name}: {key}" + (f" ({repeat + 1}/{repeats})" if repeats > 1 else ""))
            result = systems[key]()
            runs[key].append(result)
            rates = [r["samples_per_s"] for r in runs[key] if "samples_per_s" in r]
            out[key] = {**result, "samples_per_s": statistics.median(rates)} if rates \
                else result
            if repeats > 1:
                out[key]["runs_samples_per_s"] = [round(r, 2) for r in rates]
            save(out)
    gpipe, one_f = out["torch_gpipe"], out["torch_1f1b"]
    sync, asynchronous = out["ftpipe_sync"], out["ftpipe_async"]

    def ratio(a: dict, b: dict) -> float | None:
        if "samples_per_s" not in a or "samples_per_s" not in b or not b["samples_per_s"]:
            return None
        return round(a["samples_per_s"] / b["samples_per_s"], 3)

    profiled = [r["stage_costs_s"] for r in runs["torch_gpipe"] + runs["torch_1f1b"]
                if "stage_costs_s" in r]
    if profiled:
        medians = [statistics.median(costs) for costs in zip(*profiled)]
        out["bounds"] = schedule_bounds(medians, factors)
    out["ratios"] = {"sync_over_torch_gpipe": ratio(sync, gpipe),
                     "async_over_torch_1f1b": ratio(asynchronous, one_f),
                     "async_over_sync": ratio(asynchronous, sync)}
    save(out)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8, help="timed steps per run")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--only", choices=["equal", "h", "accuracy", "profile", "trace",
                                           "shares"],
                        default=None)
    parser.add_argument("--equal-factor", type=int, choices=[1, 2, 4, 10], default=1,
                        help="'equal': the 4 devices emulated this many times slower than "
                             "the host (4: they ask for one core of the host's two)")
    parser.add_argument("--repeats", type=int, default=1,
                        help="'equal' and 'h': run the four systems this many times, the "
                             "order reversed every other time; report each one's median")
    parser.add_argument("--trace-pairs", type=int, default=3,
                        help="--only trace: traced/untraced pairs")
    parser.add_argument("--shares-steps", type=int, default=30,
                        help="--only shares: steps of each traced run")
    parser.add_argument("--shares-model", choices=["mobilenetv2", "cnn"], default="mobilenetv2",
                        help="--only shares: the model traced")
    parser.add_argument("--shares-repartition", action="store_true",
                        help="--only shares: let the controller rebalance the first plan")
    parser.add_argument("--acc-lr", type=float, default=0.05)
    parser.add_argument("--acc-epochs", type=int, default=8)
    parser.add_argument("--acc-factor", type=int, choices=[1, 2, 4, 10], default=1,
                        help="devices emulated this many times slower than the host (1: "
                             "real speed, the three devices sharing its cores)")
    parser.add_argument("--acc-seeds", default="0,1,2", help="comma-separated seeds")
    parser.add_argument("--acc-max-in-flight", type=int, default=8,
                        help="--max-in-flight of the runs (the product's default; 4 before "
                             "this option existed)")
    parser.add_argument("--acc-evaluate-every", type=int, default=10,
                        help="evaluate every N steps too (0: at epoch ends only; the default "
                             "is the replication interval: no drain added)")
    parser.add_argument("--acc-offline", action="store_true",
                        help="evaluate the runs' checkpoints (every replication) after each "
                             "run instead of pausing it: the run evaluates at epoch ends only "
                             "(the product's default); --acc-evaluate-every is then unused")
    parser.add_argument("--acc-split", type=parse_split, default=None, metavar="A-B,B-C,C-D",
                        help="pin the three stages' layers in every run (default: each run's "
                             "planner chooses)")
    parser.add_argument("--acc-models", default="cnn,mobilenetv2",
                        help="comma-separated models (mobilenetv2 at full width)")
    parser.add_argument("--acc-variants", default=",".join(ACCURACY_VARIANTS),
                        help=f"comma-separated among {', '.join(ACCURACY_VARIANTS)}")
    parser.add_argument("--profile-run", action="store_true",
                        help="also one profiled ftpipe-iot sync run of 'equal'")
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent /
                        "results" / "speed.json")
    args = parser.parse_args()
    started = time.monotonic()
    results: dict = {"model": "mobilenetv2(width=1.0)", "micro_batch_size": MB,
                     "micro_batches": M, "split": SPLIT, "cores": os.cpu_count(),
                     "loadavg_start": loadavg()}
    equal_factors = (args.equal_factor,) * 4
    equal_key = "equal" if args.equal_factor == 1 else f"equal_x{args.equal_factor}"
    if args.only is not None:
        suffix = args.only if args.only not in ("equal", "trace") or args.equal_factor == 1 \
            else f"{args.only}-x{args.equal_factor}"
        args.out = args.out.with_name(f"{args.out.stem}-{suffix}.json")
    args.out.parent.mkdir(parents=True, exist_ok=True)

    def save(key: str):  # type: ignore[no-untyped-def]
        def store(partial: dict) -> None:
            results[key] = partial
            args.out.write_text(json.dumps({**results, "partial": True}, indent=2))
        return store

    with BrokerProcess() as broker:
        if args.only in (None, "equal"):
            say("single process")
            results["single_process"] = single_process(max(2, args.steps // 2), 1)
            configuration(broker, equal_key, equal_factors, args.steps, args.warmup,
                          args.steps, save(equal_key), args.repeats)
        if args.only in (None, "h"):
            configuration(broker, "h", FACTORS_H, args.steps, args.warmup, args.steps,
                          save("scenario_h"), args.repeats)
        if args.only in (None, "accuracy"):
            runs: list[dict] = []
            results["time_to_accuracy"] = {"runs": runs}
            upscaled = upscaled_digits(Path(tempfile.mkdtemp(prefix="speed-digits-")))
            for model in args.acc_models.split(","):
                # the CNN reads 8 x 8 digits; MobileNetV2 the same digits at 3 x 32 x 32
                data = "digits" if model == "cnn" else f"npz:{upscaled}"
                for seed in (int(x) for x in args.acc_seeds.split(",")):
                    for variant in args.acc_variants.split(","):
                        say(f"time to 0.95 on digits: {model}, {variant}, seed {seed}")
                        runs.append(time_to_accuracy(broker, variant, seed, model,
                                                     lr=args.acc_lr, epochs=args.acc_epochs,
                                                     data=data, factor=args.acc_factor,
                                                     evaluate_every=args.acc_evaluate_every,
                                                     max_in_flight=args.acc_max_in_flight,
                                                     split=args.acc_split,
                                                     offline=args.acc_offline))
                        results["time_to_accuracy"]["summary"] = accuracy_summary(runs)
                        save("time_to_accuracy")(results["time_to_accuracy"])
            plot = args.out.with_suffix(".png")
            plot_accuracy(runs, plot)
            results["time_to_accuracy"]["plot"] = str(plot)
        if args.only == "shares":
            upscaled = upscaled_digits(Path(tempfile.mkdtemp(prefix="speed-digits-")))
            results["schedule_shares"] = schedule_shares(broker, upscaled, args.acc_factor,
                                                         args.shares_steps,
                                                         args.shares_repartition,
                                                         args.shares_model)
            results["schedule_shares"]["factor"] = args.acc_factor
            results["schedule_shares"]["model"] = args.shares_model
        if args.only == "trace":
            results["trace_overhead"] = trace_overhead(
                broker, args.steps, args.warmup, args.trace_pairs, args.out.with_suffix(".png"),
                save("trace_overhead"), equal_factors)
            save("trace_overhead")(results["trace_overhead"])
        if args.profile_run or args.only == "profile":
            say("profiled ftpipe-iot sync run (equal devices)")
            results["profiled_sync"] = ftpipe(broker, "prof-sync", "sync", (1, 1, 1, 1),
                                              max(2, args.steps // 2), 1, profile=True)
    results["wall_s"] = round(time.monotonic() - started, 1)
    results["loadavg_end"] = loadavg()
    args.out.write_text(json.dumps(results, indent=2))
    print(json.dumps(results))


if __name__ == "__main__":
    main()
