"""Fleet L8 on real capped links (prints JSON, writes it and a PNG): time to a target test
accuracy for the fastest device alone, ftpipe-iot with each wire codec, and federated
averaging over the same links.

Fleet L8: 8 devices, each in its own network namespace behind a ``tbf`` cap each way
(ftpipe_iot/runtime/netns.py), the broker and the controller in the hub: 2 at slow-down 3
behind 40 Mbit/s, 4 at 8 behind 20 Mbit/s, 2 at 20 behind 10 Mbit/s. Their compute demand (the
sum of 1/factor) is about 1.3 cores, so they fit this 2-core host with room for the broker and
the controller, and their compute bound is about 3.8x the fastest device alone. The devices
run with ``--real-link``: their profiles declare the caps and nobody sleeps for them.

Model and data: full-width MobileNetV2 on the scikit-learn digits upscaled to 3 x 32 x 32 (real
labels; ``benchmarks/speed.py``'s ``upscaled_digits``), micro-batches of 8, 4 per step, SGD at
lr 0.05 with momentum 0.9, evaluated after every epoch. Configurations, one after another:

* ``alone``: the fastest device (slow-down 3, 40 Mbit/s) holds the whole model;
* ``ftpipe-<codec>``: all 8 devices, ``--layout auto``, ``--wire-codec <codec>`` for every
  codec of ``--codecs`` (default none, fp16, int8, auto), under ``--schedule`` (default sync;
  another schedule's runs are named ``ftpipe-<codec>-<schedule>``);
* ``fedavg``: every device trains the whole model on its eighth of the training set (IID) and
  the coordinator averages every ``--aggregate-every`` iterations (``--mode fedavg``).

Per configuration: seconds of training until the test accuracy first reaches ``--target``, the
accuracy per epoch with its time, the final accuracy, bytes on the wire per step, failures
detected (default liveness settings: every one on these links is a false one), and for the
pipeline runs the replication interval the controller paced to the links and the share of
the training time replication took (the extra time of the long steps against the median step;
steps that held an evaluation or a new plan are counted apart, ``replication_share``). Bytes per
cut: the wire message of one micro-batch's activations (and of its gradient) at every cut of the
model, encoded as the messenger encodes it (``protocol.wire.encode``) from the real activations
of a batch of the training data, for each codec. Wire bytes per step are
kept as run facts but compare different plans (other cuts, other replicas), so the codec's
verdict is taken per cut.

Targets (issue "real IoT links"): the best ftpipe-iot configuration reaches the target at least
2x sooner than the fastest device alone (also reported: the speed-up at equal epochs, the
training time of the same number of steps, which does not depend on where an evaluation falls);
int8 cuts activation bytes at least 3.5x at every cut with its final accuracy within 0.5
points of none's; no false failure; replication at most 10 % of the time at 10 Mbit/s. Needs
root (CAP_NET_ADMIN); says so and stops without it.

    python benchmarks/links_l8.py [--epochs 4] [--target 0.9] [--codecs none,fp16,int8,auto]
                                  [--skip alone,fedavg,ftpipe-CODEC] [--merge]
                                  [--out benchmarks/results/links_l8.json]

``--merge`` keeps the runs of the existing ``--out`` file that this invocation does not run
(one configuration re-run, or none: the verdicts recomputed) and records which came from where.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.harness import (  # noqa: E402
    JobSpec,
    Placement,
    run_job,
    save_figure,
    say,
    write_results,
)
from benchmarks.speed import upscaled_digits  # noqa: E402
from ftpipe_iot.runtime.broker import BrokerKind, BrokerProcess  # noqa: E402
from ftpipe_iot.runtime.netns import NetLab, unavailable  # noqa: E402
from ftpipe_iot.runtime.supervise import ProcessGroup  # noqa: E402
from ftpipe_iot.transport.connection import BrokerConfig  # noqa: E402

PORT = 1883
# (name, slow-down factor, link cap in Mbit/s each way): fleet L8
FLEET = [("l8-a0", 3, 40), ("l8-a1", 3, 40),
         ("l8-b0", 8, 20), ("l8-b1", 8, 20), ("l8-b2", 8, 20), ("l8-b3", 8, 20),
         ("l8-c0", 20, 10), ("l8-c1", 20, 10)]
MB, M = 8, 4
BATCH = MB * M


def write_profiles(folder: Path) -> dict[str, Path]:
    """Each device's profile: its slow-down and the cap its link declares (bytes/s)."""
    paths = {}
    for name, factor, mbit in FLEET:
        path = folder / f"{name}.json"
        path.write_text(json.dumps({"version": 1, "name": name, "factor": factor,
                                    "bandwidth_bytes_per_s": mbit * 1e6 / 8}))
        paths[name] = path
    return paths


def training_args(data: Path, epochs: int, lr: float, micro_batches: int = M) -> list[str]:
    """The jobs' training options: a step is always BATCH samples, in ``micro_batches``."""
    return ["--model", "mobilenetv2", "--data", f"npz:{data}", "--micro-batches",
            str(micro_batches), "--micro-batch-size", str(BATCH // micro_batches),
            "--lr", str(lr), "--momentum", "0.9",
            "--epochs", str(epochs), "--wait-devices", "600"]


def curve(summary: dict, started_at: float) -> list[tuple[float, float]]:
    """(seconds of training, test accuracy) after every evaluation."""
    return [(round(e["t"] - started_at, 2), e["test_accuracy"]) for e in summary["evals"]]


def training_start(summary: dict) -> float:
    """When training started on the summary's clock (its first plan's training)."""
    started = [e["t"] for e in summary["events"] if e["type"] == "training_started"]
    return started[0] if started else 0.0


def pauses(summary: dict) -> dict[int, str]:
    """The history steps whose interval (from the step before) held a pause that is not
    replication: an evaluation (``epoch_evaluated`` at step s falls between steps s - 1 and s)
    or a new plan (a re-plan, a recovery: the plan's first step is its resume step)."""
    out: dict[int, str] = {}
    for event in summary.get("events", []):
        if event["type"] == "epoch_evaluated":
            out[event["step"]] = "evaluation"
        elif event["type"] == "plan_changed":
            out.setdefault(event["resume_step"], "plan_change")
    return out


def replication_share(summary: dict) -> dict:
    """The replication interval the controller paced to the links and the share of training
    time replication took: the extra time of the long steps (longer than twice the median)
    over the training time, apart from the steps that held an evaluation or a new plan, whose
    extra time is counted beside it (``pauses``). A long step with no such pause is counted as
    replication's, whatever slowed it, so the figure errs against the product; how many of
    them ended within two steps of a replication point (the devices replicate after step s
    where (s + 1) is a multiple of the interval in force) says how much of it is replication's."""
    times = sorted((h["step"], h["t"]) for h in summary["history"])
    intervals = [(b[0], b[1] - a[1]) for a, b in zip(times, times[1:]) if b[0] == a[0] + 1]
    if len(intervals) < 4:
        return {"paced": summary.get("replication", {}), "share_of_training": None}
    median = statistics.median(i for _, i in intervals)
    total = sum(i for _, i in intervals)
    paused = pauses(summary)
    every = _interval_by_step(summary)
    extra: dict[str, float] = {"replication": 0.0, "evaluation": 0.0, "plan_change": 0.0}
    long_steps, near_replication = 0, 0
    for step, interval in intervals:
        if interval <= 2 * median:
            continue
        cause = paused.get(step, "replication")
        extra[cause] += interval - median
        if cause == "replication":
            long_steps += 1
            near_replication += any(every(s) and (s + 1) % every(s) == 0
                                    for s in (step - 1, step - 2))
    share = {cause: round(seconds / total, 4) if total else None
             for cause, seconds in extra.items()}
    return {"paced": summary.get("replication", {}),
            "share_of_training": share["replication"],
            "evaluation_share": share["evaluation"], "plan_change_share": share["plan_change"],
            "long_steps": long_steps, "long_steps_after_a_replication": near_replication}


def _interval_by_step(summary: dict) -> Callable[[int], int]:
    """The replication interval in force at each step: the job's base, then each
    ``replication_paced`` event's from its step on."""
    base = int(summary.get("replication", {}).get("base", 0))
    changes = sorted((e["at_step"], e["steps"]) for e in summary.get("events", [])
                     if e["type"] == "replication_paced")

    def at(step: int) -> int:
        every = base
        for from_step, steps in changes:
            if from_step < step:
                every = steps
        return every
    return at


def result_of(name: str, summary: dict, target: float, extra: dict | None = None) -> dict:
    start = training_start(summary)
    points = curve(summary, start)
    reached = [t for t, accuracy in points if accuracy >= target]
    out = {"config": name, "time_to_target_s": reached[0] if reached else None,
           "final_accuracy": summary.get("test_accuracy"), "curve": points,
           "steps": summary.get("steps"), "failures_detected": summary.get("failures_detected"),
           "wire_bytes_per_step": summary.get("wire_bytes_per_step"),
           "train_s": summary.get("train_s"),
           # what the controller decided and from what: every plan from its step, with its
           # prediction and measurement, and each device's speed as last estimated
           "plans": [{"from_step": e["resume_step"], "t": round(e["t"] - start, 2),
                      "stages": _compact(e["stages"])}
                     for e in summary.get("events", []) if e["type"] == "plan_changed"],
           "predictions": [{k: p.get(k) for k in ("from_step", "predicted_step_s",
                                                  "measured_step_s", "error", "unmeasured")}
                           for p in summary.get("predictions", [])],
           "device_capacity": summary.get("device_capacity", {})}
    out.update(extra or {})
    say(f"{name}: {out['time_to_target_s']} s to {target}, final {out['final_accuracy']}")
    return out


def _compact(stages: list[dict]) -> str:
    """A plan's stages as ``a1:0-8 b0:8-9 a0:9-22`` (group members joined by ``+``)."""
    return " ".join("+".join(d["device"].removeprefix("l8-") for d in stage["devices"]) +
                    f":{stage['start']}-{stage['end']}" for stage in stages)


def pipeline_run(lab: NetLab, nodes: dict, work: Path, name: str, devices: list[str],
                 profiles: dict[str, Path], args: list[str], probe: bool = True) -> dict:
    """An ftpipe-iot job over the lab's links (the broker and controller in the hub);
    ``probe``: idle devices measure themselves (``device.probe``)."""
    with BrokerProcess(kind=BrokerKind.MOSQUITTO, port=PORT, bind="0.0.0.0",
                       data_dir=work / name, netns=lab.hub) as broker:
        placement = Placement(f"mqtt://127.0.0.1:{PORT}", BrokerConfig(port=PORT),
                              controller_netns=lab.hub,
                              device_urls={d: nodes[d].broker_url(PORT) for d in devices},
                              device_netns={d: nodes[d].namespace for d in devices},
                              device_args=["--real-link",
                                           *([] if probe else ["--no-probe-when-idle"])])
        spec = JobSpec(name, [(d, profiles[d]) for d in devices], args, timeout_s=3600)
        return run_job(spec, broker, placement=placement)


def fedavg_run(lab: NetLab, nodes: dict, work: Path, data: Path, profiles: dict[str, Path],
               epochs: int, lr: float, aggregate_every: int, micro_batches: int = M) -> dict:
    """Federated averaging over the same links: each device its eighth of the data."""
    import numpy as np

    from ftpipe_iot.collab.data_split import PartitionSpec, split_indices, write_shards
    from ftpipe_iot.core.data import load_dataset
    from ftpipe_iot.protocol.specs import DataSpec

    dataset = load_dataset(DataSpec(f"npz:{data}"))
    parts = split_indices(dataset.y_train, len(FLEET), PartitionSpec.parse("iid"), 0,
                          min_samples=BATCH)
    shards = write_shards(np.asarray(dataset.x_train), np.asarray(dataset.y_train), parts,
                          work / "shards")
    job = "l8-fedavg"
    group = ProcessGroup(work / job)
    summary_path = work / job / "summary.json"
    with BrokerProcess(kind=BrokerKind.MOSQUITTO, port=PORT, bind="0.0.0.0",
                       data_dir=work / job / "broker", netns=lab.hub) as _broker:
        try:
            for (name, _, _), shard in zip(FLEET, shards):
                group.start(name, "device", "--name", name, "--job", job, "--broker",
                            nodes[name].broker_url(PORT), "--data", f"npz:{shard}",
                            "--profile", str(profiles[name]), "--real-link",
                            netns=nodes[name].namespace)
            group.start("controller", "controller", "--job", job, "--broker",
                        f"mqtt://127.0.0.1:{PORT}", "--mode", "fedavg", "--devices",
                        str(len(FLEET)), "--aggregate-every", str(aggregate_every),
                        "--stop-devices", "--summary-json", str(summary_path),
                        "--log-level", "WARNING",
                        *training_args(data, epochs, lr, micro_batches),
                        netns=lab.hub)
            deadline = time.monotonic() + 3600
            while group.procs["controller"].poll() is None:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{job} did not finish in an hour; see {work / job}")
                time.sleep(1.0)
            if group.procs["controller"].returncode != 0:
                raise RuntimeError(f"{job}: the coordinator failed; see {work / job}")
            return json.loads(summary_path.read_text())
        finally:
            group.stop_all(grace_s=10.0)


def fedavg_result(summary: dict, target: float) -> dict:
    points = [(round(e["train_s"], 2), e["test_accuracy"]) for e in summary["evals"]]
    reached = [t for t, accuracy in points if accuracy >= target]
    out = {"config": "fedavg", "time_to_target_s": reached[0] if reached else None,
           "final_accuracy": summary.get("test_accuracy"), "curve": points,
           "iterations": summary.get("steps"), "rounds": summary["collab"]["rounds"],
           "failures_detected": summary.get("failures_detected"),
           "train_s": summary.get("train_s")}
    say(f"fedavg: {out['time_to_target_s']} s to {target}, final {out['final_accuracy']}")
    return out


def bytes_per_cut(data: Path, codecs: list[str]) -> list[dict]:
    """Wire bytes of one micro-batch's activation and gradient messages at every cut, per
    codec: the model built as the jobs build it (seed 0), its training-mode forward over the
    first micro-batch of the training data, each cut's tensor and the gradient of the loss
    with respect to it encoded by ``protocol.wire.encode`` (msgpack, the codec, lz4 where it
    pays; one frame, no chunking)."""
    import numpy as np
    import torch
    from torch import nn

    from ftpipe_iot.core.data import load_dataset
    from ftpipe_iot.core.models import build_layers
    from ftpipe_iot.protocol.messages import Activation, Gradient
    from ftpipe_iot.protocol.specs import DataSpec, ModelSpec
    from ftpipe_iot.protocol.vocab import MessageKind, WireCodec
    from ftpipe_iot.protocol.wire import Envelope, WireOptions, encode

    dataset = load_dataset(DataSpec(f"npz:{data}"))
    layers = build_layers(ModelSpec("mobilenetv2"), dataset.input_shape, dataset.num_classes,
                          seed=0)
    x = torch.from_numpy(np.asarray(dataset.x_train[:MB], dtype=np.float32))
    y = np.asarray(dataset.y_train[:MB], dtype=np.int64)
    cuts = []
    for layer in layers:
        layer.train()
        x = layer(x)
        x.retain_grad()
        cuts.append(x)
    nn.functional.cross_entropy(cuts[-1], torch.from_numpy(y)).backward()

    def wire_bytes(kind: MessageKind, body: dict, codec: str) -> int:
        options = WireOptions(codec=WireCodec(codec), max_message_bytes=1 << 30)
        return sum(len(f) for f in encode(Envelope(kind, "l8", "dev", body=body), options))

    rows = []
    for cut, tensor in enumerate(cuts[:-1], start=1):
        activation = Activation(tensor.detach().numpy(), y, True).to_body()
        gradient = Gradient(tensor.grad.numpy()).to_body()
        rows.append({"cut": cut, "shape": list(tensor.shape[1:]),
                     "activation_bytes": {c: wire_bytes(MessageKind.ACTIVATION, activation, c)
                                          for c in codecs},
                     "gradient_bytes": {c: wire_bytes(MessageKind.GRADIENT, gradient, c)
                                        for c in codecs}})
    return rows


def used_cuts(results: dict) -> set[int]:
    """The cuts the pipeline runs trained across (stage boundaries of their last plans)."""
    return {stage["end"] for name, run in results["runs"].items()
            if name.startswith("ftpipe-") for stage in (run.get("stages") or [])[:-1]}


def verdicts(results: dict, target: float) -> dict:
    """The issue's targets, as measured."""
    runs = results["runs"]
    alone = runs["alone"]["time_to_target_s"]
    pipeline = {k: v for k, v in runs.items() if k.startswith("ftpipe-")}
    reached = {k: v["time_to_target_s"] for k, v in pipeline.items()
               if v["time_to_target_s"] is not None}
    best = min(reached, key=reached.get) if reached else None
    none, int8 = pipeline.get("ftpipe-none"), pipeline.get("ftpipe-int8")
    out: dict = {"target_accuracy": target, "best": best,
                 "best_speedup_over_alone": round(alone / reached[best], 2)
                 if best and alone else None,
                 "false_failures": {k: v.get("failures_detected") for k, v in runs.items()}}
    same_steps = {k: v["train_s"] for k, v in pipeline.items()
                  if v.get("train_s") and v.get("steps") == runs["alone"].get("steps")}
    if same_steps and runs["alone"].get("train_s"):
        fastest = min(same_steps, key=same_steps.get)
        out["speedup_at_equal_epochs"] = {
            "config": fastest,
            "speedup": round(runs["alone"]["train_s"] / same_steps[fastest], 2)}
    cuts = results.get("bytes_per_cut") or []
    used = used_cuts(results)
    if cuts and "int8" in cuts[0]["activation_bytes"]:
        def ratios(rows: list[dict]) -> list[float]:
            return [r["activation_bytes"]["none"] / r["activation_bytes"]["int8"] for r in rows]

        out["int8_activation_bytes_ratio"] = {
            "worst_cut": round(min(ratios(cuts)), 2),
            "worst_cut_used": round(min(ratios([r for r in cuts if r["cut"] in used])), 2)
            if used else None}
    if none and int8 and none["final_accuracy"] is not None \
            and int8["final_accuracy"] is not None:
        out["int8_accuracy_points_below_none"] = round(
            100 * (none["final_accuracy"] - int8["final_accuracy"]), 2)
    slow_link = [v.get("replication", {}).get("share_of_training") for v in pipeline.values()]
    out["replication_share_of_training"] = slow_link
    return out


def plot(results: dict, png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right, cuts) = plt.subplots(1, 3, figsize=(19, 4.5))
    for name, run in results["runs"].items():
        points = run["curve"]
        if points:
            left.plot([t for t, _ in points], [a for _, a in points], marker="o", label=name)
    left.axhline(results["target_accuracy"], color="grey", linestyle="--", label="target")
    left.set_xlabel("seconds of training")
    left.set_ylabel("test accuracy")
    left.set_title("Fleet L8 on tbf links: accuracy against time")
    left.legend(fontsize=7)
    names = [n for n, r in results["runs"].items() if r.get("time_to_target_s")]
    right.bar(names, [results["runs"][n]["time_to_target_s"] for n in names])
    right.set_ylabel(f"seconds to {results['target_accuracy']}")
    right.set_title("time to the target")
    right.tick_params(axis="x", labelrotation=30)
    rows = results.get("bytes_per_cut") or []
    for codec in (rows[0]["activation_bytes"] if rows else {}):
        cuts.plot([r["cut"] for r in rows], [r["activation_bytes"][codec] / 1e3 for r in rows],
                  marker=".", label=codec)
    for cut in sorted(used_cuts(results)):
        cuts.axvline(cut, color="grey", linewidth=0.8, linestyle=":")
    cuts.set_yscale("log")
    cuts.set_xlabel("cut (after layer)")
    cuts.set_ylabel("kB per micro-batch of 8 on the wire")
    cuts.set_title("activation message per cut (dotted: cuts trained across)")
    cuts.legend(fontsize=7)
    save_figure(fig, png)


def run_name(codec: str, schedule: str, probe: bool = True) -> str:
    """A pipeline run's name: ``ftpipe-<codec>``, with ``-<schedule>`` unless it is sync and
    ``-noprobe`` where idle devices did not measure themselves."""
    return f"ftpipe-{codec}" + ("" if schedule == "sync" else f"-{schedule}") + \
        ("" if probe else "-noprobe")


def run_configurations(work: Path, data: Path, args: argparse.Namespace, codecs: list[str],
                       skip: set[str]) -> dict:
    """Every configuration not skipped, one after another, in one lab of namespaces."""
    runs: dict = {}
    profiles = write_profiles(work)
    with NetLab(tag="l8") as lab:
        nodes = {name: lab.add_node(name, mbit * 1e6) for name, _, mbit in FLEET}
        training = training_args(data, args.epochs, args.lr, args.micro_batches)
        if "alone" not in skip:
            fastest = FLEET[0][0]
            say(f"alone: {fastest}")
            summary = pipeline_run(lab, nodes, work, "l8-alone", [fastest], profiles,
                                   [*training, "--layout", "pipeline"])
            runs["alone"] = result_of("alone", summary, args.target)
        for codec in codecs:
            name = run_name(codec, args.schedule, args.probe)
            say(f"{name}: 8 devices, --layout auto, --schedule {args.schedule}")
            summary = pipeline_run(lab, nodes, work, name.replace("ftpipe-", "l8-"),
                                   [d for d, _, _ in FLEET], profiles,
                                   [*training, "--layout", "auto", "--wire-codec", codec,
                                    "--schedule", args.schedule], args.probe)
            runs[name] = result_of(name, summary, args.target, {
                "stages": summary.get("stages"), "replication": replication_share(summary)})
        if "fedavg" not in skip:
            say("fedavg: 8 devices, each its own data")
            runs["fedavg"] = fedavg_result(
                fedavg_run(lab, nodes, work, data, profiles, args.epochs, args.lr,
                           args.aggregate_every, args.micro_batches), args.target)
    return runs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--target", type=float, default=0.9)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--codecs", default="none,fp16,int8,auto",
                        help="comma-separated --wire-codec values for the 8-device runs")
    parser.add_argument("--schedule", default="sync", choices=["sync", "1f1b", "async"],
                        help="the 8-device runs' --schedule (runs other than sync are named "
                             "ftpipe-<codec>-<schedule>)")
    parser.add_argument("--no-probe", dest="probe", action="store_false",
                        help="idle devices do not measure themselves (--no-probe-when-idle; "
                             "runs named ftpipe-<codec>[-<schedule>]-noprobe)")
    parser.add_argument("--micro-batches", type=int, default=M, choices=[1, 2, 4, 8, 16, 32],
                        help=f"micro-batches of every step of {BATCH} samples (alone and "
                             "pipeline runs)")
    parser.add_argument("--aggregate-every", type=int, default=5,
                        help="fedavg: iterations between averages")
    parser.add_argument("--skip", default="",
                        help="comma-separated configurations to leave out (alone, fedavg, "
                             "ftpipe-<codec>)")
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results" /
                        "links_l8.json")
    parser.add_argument("--merge", action="store_true",
                        help="keep the runs of the existing --out file that are not run now")
    args = parser.parse_args()
    if args.epochs < 1 or not 0 < args.target <= 1:
        parser.error("--epochs must be >= 1 and --target in (0, 1]")
    skip = {s for s in args.skip.split(",") if s}
    codecs = [c for c in args.codecs.split(",")
              if c and run_name(c, args.schedule, args.probe) not in skip]
    earlier = json.loads(args.out.read_text()) if args.merge and args.out.exists() else {}
    anything_to_run = bool(codecs) or not {"alone", "fedavg"} <= skip
    reason = unavailable() if anything_to_run else None
    if reason is not None:
        print(json.dumps({"skipped": f"network namespaces unavailable: {reason}"}))
        return
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwind: the lab is removed
    started, load_before = time.monotonic(), os.getloadavg()
    runs: dict = {}
    with tempfile.TemporaryDirectory(prefix="bench-l8-") as tmp:
        work = Path(tmp)
        data = upscaled_digits(work)
        cut_rows = bytes_per_cut(data, ["none", "fp16", "int8", "int4"])
        if anything_to_run:
            runs = run_configurations(work, data, args, codecs, skip)
    run_at = time.strftime("%Y-%m-%d %H:%M")
    kept = {k: v for k, v in earlier.get("runs", {}).items() if k not in runs}
    said = earlier.get("provenance")
    said = said if isinstance(said, dict) else {"earlier": said} if said else {}
    provenance = {k: v for k, v in said.items() if k not in runs}
    for name in kept:
        provenance.setdefault(name, f"kept from the earlier {args.out.name}")
    provenance.update({k: f"this run, {run_at}" for k in runs})
    results = {"fleet": [{"device": n, "factor": f, "mbit_each_way": c} for n, f, c in FLEET],
               "model": "mobilenetv2(width=1.0), digits upscaled to 3x32x32",
               "micro_batch_size": BATCH // args.micro_batches,
               "micro_batches": args.micro_batches, "lr": args.lr,
               "epochs": args.epochs, "target_accuracy": args.target,
               "runs": {**kept, **runs}, "bytes_per_cut": cut_rows, "provenance": provenance}
    runs = results["runs"]
    if "fedavg" not in runs and "fedavg" in earlier:
        results["fedavg"] = earlier["fedavg"]  # an earlier note on a baseline never finished
    if "other_host_runs" in earlier:  # runs set aside: measured on another host, not compared
        results["other_host_runs"] = earlier["other_host_runs"]
    results["verdicts"] = verdicts(results, args.target) if "alone" in runs else {}
    results.update(loadavg_before=load_before, loadavg_after=os.getloadavg(),
                   wall_s=round(time.monotonic() - started, 1))
    write_results(results, args.out, lambda png: plot(results, png))


if __name__ == "__main__":
    main()
