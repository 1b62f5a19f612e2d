"""What signatures cost (prints JSON, writes benchmarks/results/signing.json and .png).

* ``frames``: per message of each size, encoding with and without a signature, and decoding
  with and without verification (one process, the wire module and the messenger's check;
  messages above 256 KiB are chunks, each signed and verified on its own);
* ``demo``: the digits demo (`ftpipe-iot demo` defaults, CNN, 3 devices, 6 epochs), signed
  against ``--insecure-unsigned``, runs alternated; the layout is pinned (``--demo-layout``,
  by default the pipeline of three, the layout with the most messages a step; ``auto`` is the
  demo's own, which deploys data parallelism over two devices on identical devices, every run
  recording the layout it ran), so that both sides of a pair run the same layout and the
  pairs measure the signatures, not the layout;
  samples/s, the CPU seconds every process of the demo used (the children's rusage), the
  signing and verifying CPU seconds every process reported (heartbeats, the summary) and where
  they go, per direction and message kind: on a shared 2-core host the wall-clock rate moves by
  10-20 % between runs, the CPU per step much less;
* ``mobilenetv2``: full-width MobileNetV2, 4 equal devices on the split of benchmarks/speed.py
  (micro-batches of 32, M = 8), signed against unsigned, alternated; samples/s after the
  warm-up and the signing seconds as a share of the CPU seconds every process used.

Wall-clock rates on a 2-core host vary by several per cent between runs, more than the cost
measured here; the CPU share is the figure that does not depend on the host's load.
``--side-by-side`` measures the whole jobs' cost without that noise: in each round the signed
and the unsigned job run at the same time, each with its own broker, and their steps/s are
compared over the window in which both were training (``harness.rates_side_by_side``), so
both met the same host at the same moments; the launch order alternates between rounds. Each
job then has about half the host, so it measures what signing costs a job whose host is
busy, which on a 2-core host running four or five processes is what every job meets anyway.

    python benchmarks/signing.py [--only frames|demo|mobilenetv2] [--pairs 3] [--side-by-side]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.harness import (  # noqa: E402
    rates_side_by_side,
    save_figure,
    say,
    write_results,
)
from benchmarks.speed import BATCH, TRAINING, ftpipe, job_crypto_s, loadavg  # noqa: E402
from ftpipe_iot.protocol.messages import Activation, envelope  # noqa: E402
from ftpipe_iot.protocol.signing import (  # noqa: E402
    IdentityKey,
    Roster,
    Signer,
    Verifier,
    generate_private_key,
)
from ftpipe_iot.protocol.wire import Reassembler, WireOptions, encode  # noqa: E402
from ftpipe_iot.runtime.broker import BrokerProcess  # noqa: E402

SIZES = (256, 8 * 1024, 64 * 1024, 1024 * 1024, 4 * 1024 * 1024)


def _timed(fn, repeats: int) -> float:
    """Median seconds of ``fn`` over ``repeats`` calls."""
    samples = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - started)
    return statistics.median(samples)


def _frame_costs(size: int, signer: Signer, verifier: Verifier) -> dict:
    values = np.random.default_rng(0).standard_normal(max(1, size // 4)).astype(np.float32)
    env = envelope(Activation(values, np.zeros(1, np.int64), True), "bench", "dev0", 1, 0, 0,
                   1, session=1)
    options = WireOptions(compress=False)
    plain = encode(env, options)
    signed = encode(env, options, signer)

    def authenticate(header) -> None:
        verifier.verify(header.env.sender, header.key_id, header.signed_content(),
                        header.signature)

    def decode(frames: list[bytes], check) -> None:
        reassembler = Reassembler(authenticate=check)
        for frame in frames:
            reassembler.feed(frame)

    repeats = 200 if size <= 64 * 1024 else 20
    row = {"bytes": size, "frames": len(signed),
           "encode_us": _timed(lambda: encode(env, options), repeats) * 1e6,
           "encode_signed_us": _timed(lambda: encode(env, options, signer), repeats) * 1e6,
           "decode_us": _timed(lambda: decode(plain, None), repeats) * 1e6,
           "decode_verified_us": _timed(lambda: decode(signed, authenticate), repeats) * 1e6,
           "extra_bytes": sum(map(len, signed)) - sum(map(len, plain))}
    row["sign_us"] = row["encode_signed_us"] - row["encode_us"]
    row["verify_us"] = row["decode_verified_us"] - row["decode_us"]
    return {k: round(v, 1) if isinstance(v, float) else v for k, v in row.items()}


def frames() -> list[dict]:
    key = generate_private_key()
    signer = Signer(key)
    verifier = Verifier(Roster(1, {"dev0": (IdentityKey.of(key),)}))
    rows = []
    for size in SIZES:
        row = _frame_costs(size, signer, verifier)
        rows.append(row)
        say(f"frames: {size} B: sign {row['sign_us']:.0f} us, verify {row['verify_us']:.0f} us")
    return rows


def demo(pairs: int, epochs: int, layout_name: str = "pipeline") -> dict:
    from ftpipe_iot.planning.layouts import Layout
    from ftpipe_iot.protocol.plan import TrainConfig
    from ftpipe_iot.runtime.demo import Demo, DemoOptions

    runs: dict[str, list[dict]] = {"signed": [], "unsigned": []}
    for index in range(pairs):
        for signed in _pair_order(index):
            label = "signed" if signed else "unsigned"
            before = loadavg()
            options = DemoOptions(work_dir=Path(tempfile.mkdtemp(prefix="sign-demo-")),
                                  signed=signed, layout=Layout(layout_name),
                                  train=TrainConfig(epochs=epochs))
            children_before = _children_cpu_s()
            summary = Demo(options).run()
            # every process of the demo (broker, controller, devices) is a child, waited for
            cpu_s = _children_cpu_s() - children_before
            crypto = job_crypto_s(summary)
            runs[label].append({"samples_per_s": summary["samples_per_s"],
                                "steps": summary["steps"], "train_s": summary["train_s"],
                                "crypto_s": round(crypto, 4),
                                "crypto_s_per_step": crypto / max(1, summary["steps"]),
                                "crypto_ms_per_step_by_kind": _by_kind(summary),
                                "processes_cpu_s": round(cpu_s, 3),
                                "processes_cpu_ms_per_step": round(
                                    1e3 * cpu_s / max(1, summary["steps"]), 3),
                                "crypto_cpu_share": round(crypto / cpu_s, 4) if cpu_s else 0,
                                "test_accuracy": summary["test_accuracy"],
                                "layout": [[d["device"] for d in stage["devices"]]
                                           for stage in summary["stages"]],
                                "layout_changes": sum(e.get("type") == "plan_changed"
                                                      for e in summary["events"]) - 1,
                                "loadavg_before": before, "loadavg_after": loadavg()})
            say(f"demo {label} #{index}: {summary['samples_per_s']:.0f} samples/s, "
                f"crypto {crypto:.3f} CPU-s of {cpu_s:.1f}")
    result = {**_compare(runs), **pair_costs(runs)}
    # ``auto`` decides its layout in each run: now and then one side of a pair runs another
    # layout (a pipeline of three where the rest ran data parallelism), and that pair measures
    # the layouts, not the signatures. The runs on the layout most runs had are compared too.
    layouts = [str(r["layout"]) for rows in runs.values() for r in rows]
    usual = max(set(layouts), key=layouts.count)
    alike = {label: [r for r in rows if str(r["layout"]) == usual]
             for label, rows in runs.items()}
    result["usual_layout"] = usual
    result["runs_on_another_layout"] = len(layouts) - layouts.count(usual)
    if all(alike.values()):
        result["slowdown_pct_usual_layout"] = _compare(alike)["slowdown_pct"]
    cpu = {label: statistics.median(r["processes_cpu_ms_per_step"] for r in rows)
           for label, rows in runs.items()}
    result["median_cpu_ms_per_step"] = cpu
    result["cpu_cost_pct"] = round(100 * (cpu["signed"] / cpu["unsigned"] - 1), 2)
    result["median_crypto_cpu_share"] = statistics.median(
        r["crypto_cpu_share"] for r in runs["signed"])
    return result


def _round_result(index: int, summaries: dict[str, dict], skip: int) -> dict:
    """One side-by-side round: each job's steps/s over the window both trained, and the
    cost of signing in it."""
    rates = rates_side_by_side(
        {label: (summary["started_at"], [(h["step"], h["t"]) for h in summary["history"]])
         for label, summary in summaries.items()}, skip)
    signed, unsigned = rates["steps_per_s"]["signed"], rates["steps_per_s"]["unsigned"]
    crypto = {label: job_crypto_s(summary) for label, summary in summaries.items()}
    return {"round": index, "first": "signed" if _pair_order(index)[0] else "unsigned",
            "window_s": rates["window_s"],
            "steps_per_s": {k: round(v, 4) for k, v in rates["steps_per_s"].items()},
            "cost_pct": round(100 * (1 - signed / unsigned), 2),
            "signed_crypto_ms_per_step": round(
                1e3 * crypto["signed"] / max(1, summaries["signed"]["steps"]), 4),
            "layouts": {label: [[d["device"] for d in stage["devices"]]
                                for stage in summary["stages"]]
                        for label, summary in summaries.items()}}


def side_by_side_summary(rounds: list[dict]) -> dict:
    """The rounds' costs and, apart, those of the rounds whose two jobs ran one layout: the
    demo's ``auto`` decides in each job, and under a busy host one side now and then lays out
    a pipeline of three where the other keeps data parallelism; such a round compares
    layouts, not signatures. Layouts are alike when their stages have as many devices each."""
    costs = [r["cost_pct"] for r in rounds]
    # the shape (devices a stage): on identical devices which device holds a stage is no
    # difference
    alike = [r["cost_pct"] for r in rounds
             if len({tuple(len(stage) for stage in layout)
                     for layout in r["layouts"].values()}) == 1]
    summary = {"rounds": rounds, "rounds_cost_pct": costs,
               **({"rounds_cpu_cost_pct": [r["cpu_cost_pct"] for r in rounds]}
                  if all("cpu_cost_pct" in r for r in rounds) else {}),
               "median_cost_pct": round(statistics.median(costs), 2),
               "mean_cost_pct": round(statistics.fmean(costs), 2),
               "cost_range_pct": [min(costs), max(costs)],
               "rounds_on_one_layout": len(alike)}
    if alike:
        summary.update(one_layout_median_cost_pct=round(statistics.median(alike), 2),
                       one_layout_mean_cost_pct=round(statistics.fmean(alike), 2))
    return summary


def demo_side_by_side(rounds: int, epochs: int, layout_name: str,
                      demo_options: tuple[str, ...] = ()) -> dict:
    """The demo signed and unsigned at the same time (two ``ftpipe-iot demo`` processes, each
    with its own Mosquitto, both given ``demo_options``), ``rounds`` times; each round's cost
    over the window both trained."""
    options = list(demo_options)
    mode = options[options.index("--mode") + 1] if "--mode" in options[:-1] else "pipeline"
    # a layout is the pipeline mode's; the collaborative modes lay out their own split
    layout = ["--layout", layout_name] if mode == "pipeline" else []
    results = []
    for index in range(rounds):
        before = loadavg()
        work = {label: Path(tempfile.mkdtemp(prefix=f"sign-sbs-{label}-")) / "demo"
                for label in ("signed", "unsigned")}
        procs = {}
        for signed in _pair_order(index):
            label = "signed" if signed else "unsigned"
            procs[label] = subprocess.Popen(
                [sys.executable, "-m", "ftpipe_iot", "demo", "--work-dir", str(work[label]),
                 *layout, "--epochs", str(epochs), "--job", f"sbs-{label}", *options,
                 *([] if signed else ["--insecure-unsigned"])],
                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                stderr=open(work[label].parent / "demo.err", "w"))
        cpu_s = {}
        for label, proc in procs.items():
            # wait4's usage covers the demo and every process it started and waited for
            # (broker, controller, devices): the job's whole CPU, apart from the other job's
            _pid, status, usage = os.wait4(proc.pid, 0)
            proc.returncode = os.waitstatus_to_exitcode(status)
            if proc.returncode != 0:
                raise RuntimeError(f"the {label} demo failed; see {work[label].parent}")
            cpu_s[label] = usage.ru_utime + usage.ru_stime
        summaries = {label: json.loads((work[label] / "summary.json").read_text())
                     for label in procs}
        row = _round_result(index, summaries, skip=1)
        # CPU a step over the whole job (start-up included, the same on both sides): whether
        # the cost is CPU spent or time waited
        cpu = {label: 1e3 * cpu_s[label] / max(1, summaries[label]["steps"]) for label in cpu_s}
        rates = row["steps_per_s"]
        row.update(cpu_ms_per_step={k: round(v, 3) for k, v in cpu.items()},
                   cpu_cost_pct=round(100 * (cpu["signed"] / cpu["unsigned"] - 1), 2),
                   # start-up cancels in the difference; each job has about one core of two,
                   # so CPU spent shows as about as much wall time
                   extra_cpu_ms_per_step=round(cpu["signed"] - cpu["unsigned"], 3),
                   extra_wall_ms_per_step=round(
                       1e3 * (1 / rates["signed"] - 1 / rates["unsigned"]), 3),
                   loadavg_before=before, loadavg_after=loadavg())
        results.append(row)
        say(f"demo side by side #{index}: signed {row['steps_per_s']['signed']:.1f}, unsigned "
            f"{row['steps_per_s']['unsigned']:.1f} steps/s over {row['window_s']:.0f} s: "
            f"cost {row['cost_pct']:+.2f} %; a step {row['extra_wall_ms_per_step']:+.2f} ms "
            f"longer, {row['extra_cpu_ms_per_step']:+.2f} CPU-ms more")
    return side_by_side_summary(results)


def mobilenetv2_side_by_side(rounds: int, steps: int, warmup: int) -> dict:
    """Full-width MobileNetV2 (speed.py's split, 4 devices a job) signed and unsigned at the
    same time, each job on its own broker, ``rounds`` times."""
    # one epoch as long as the run (speed.py's 4096 samples are 16 steps): the jobs start
    # tens of seconds apart on a busy host, and the window both train in must hold many steps
    training = [*TRAINING, "--max-steps", str(warmup + steps)]
    training[training.index("--data-samples") + 1] = str(BATCH * (warmup + steps))
    results = []
    for index in range(rounds):
        before = loadavg()
        with BrokerProcess() as first, BrokerProcess() as second, \
                ThreadPoolExecutor(max_workers=2) as pool:
            jobs = {}
            for signed, broker in zip(_pair_order(index), (first, second)):
                label = "signed" if signed else "unsigned"
                jobs[label] = pool.submit(ftpipe, broker, f"sbs-{label}-{index}", "sync",
                                          (1, 1, 1, 1), steps, warmup, training=training,
                                          signed=signed)
            outcome = {label: job.result() for label, job in jobs.items()}
        summaries = {label: {"started_at": result["started_at"], "steps": result["steps"],
                             "history": [{"step": s, "t": t} for s, t in result["history_t"]],
                             "crypto_s": result["crypto_s"], "device_traffic": {},
                             "stages": []}
                     for label, result in outcome.items()}
        row = _round_result(index, summaries, skip=warmup)
        row.update(loadavg_before=before, loadavg_after=loadavg())
        results.append(row)
        say(f"mobilenetv2 side by side #{index}: signed {row['steps_per_s']['signed']:.4f}, "
            f"unsigned {row['steps_per_s']['unsigned']:.4f} steps/s over "
            f"{row['window_s']:.0f} s: cost {row['cost_pct']:+.2f} %")
    return side_by_side_summary(results)


def _pair_order(index: int) -> tuple[bool, bool]:
    """Which side of pair ``index`` runs first (True: signed): signed first in even pairs,
    unsigned first in odd ones. A series drifts: the load average left by the runs before
    decays, and in the MobileNetV2 series every job joins a broker that has served the ones
    before. With signed always first, the signed side of the second pair ran its job third on
    the broker in both series of one day, and in both it used more CPU than any other run of
    its series (107 and 123 CPU-s against 98-111) and made 13 % fewer samples/s than its
    partner, where the first pairs differed by under 1 %; alternating puts such drift on both
    sides alike."""
    return (True, False) if index % 2 == 0 else (False, True)


def _children_cpu_s() -> float:
    """User and system CPU seconds of every child process waited for so far."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _by_kind(summary: dict) -> dict[str, float]:
    """Milliseconds per step of signing and verifying, per direction and message kind, summed
    over the job's processes (``crypto_by_kind`` of the summary), largest first."""
    steps = max(1, summary["steps"])
    totals: dict[str, float] = {}
    for kinds in summary.get("crypto_by_kind", {}).values():
        for key, (seconds, _frames) in kinds.items():
            totals[key] = totals.get(key, 0.0) + seconds
    return {key: round(1e3 * seconds / steps, 4)
            for key, seconds in sorted(totals.items(), key=lambda item: -item[1])}


def mobilenetv2(pairs: int, steps: int, warmup: int) -> dict:
    runs: dict[str, list[dict]] = {"signed": [], "unsigned": []}
    with BrokerProcess() as broker:
        for index in range(pairs):
            for signed in _pair_order(index):
                label = "signed" if signed else "unsigned"
                result = ftpipe(broker, f"sign-{label}-{index}", "sync", (1, 1, 1, 1), steps,
                                warmup, signed=signed)
                cpu = sum(v["main_thread_cpu_s"] + v["other_threads_cpu_s"]
                          for v in result["process_cpu"].values())
                runs[label].append({"samples_per_s": result["samples_per_s"],
                                    "crypto_s": result["crypto_s"],
                                    "process_cpu_s": round(cpu, 2),
                                    "crypto_cpu_share": result["crypto_s"] / cpu if cpu else 0,
                                    "loadavg_before": result["loadavg_before"],
                                    "loadavg_after": result["loadavg_after"]})
                say(f"mobilenetv2 {label} #{index}: {result['samples_per_s']:.1f} samples/s, "
                    f"crypto {result['crypto_s']:.2f} s of {cpu:.0f} CPU-s")
    return {**_compare(runs), **pair_costs(runs)}


def _compare(runs: dict[str, list[dict]]) -> dict:
    signed = statistics.median(r["samples_per_s"] for r in runs["signed"])
    unsigned = statistics.median(r["samples_per_s"] for r in runs["unsigned"])
    return {"runs": runs, "median_samples_per_s": {"signed": signed, "unsigned": unsigned},
            "slowdown_pct": round(100 * (1 - signed / unsigned), 2)}


def pair_costs(runs: dict[str, list[dict]]) -> dict:
    """What signing cost each pair (run ``i`` of each side is pair ``i``), in per cent of the
    unsigned run's samples/s, and their spread: on a shared 2-core host single pairs differ
    by more than the targets, and the medians alone hide that."""
    costs = [round(100 * (1 - signed["samples_per_s"] / unsigned["samples_per_s"]), 1)
             for signed, unsigned in zip(runs["signed"], runs["unsigned"])]
    return {"pairs_pct": costs, "pairs_range_pct": [min(costs), max(costs)] if costs else []}


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    if "frames" in results:
        rows = results["frames"]
        xs = [r["bytes"] for r in rows]
        left.loglog(xs, [r["sign_us"] for r in rows], "o-", label="sign")
        left.loglog(xs, [r["verify_us"] for r in rows], "s-", label="verify")
        left.loglog(xs, [r["encode_us"] for r in rows], "^--", label="encode (unsigned)")
        left.set_xlabel("message bytes")
        left.set_ylabel("microseconds per message")
        left.set_title("cost per message")
        left.legend()
    else:
        left.axis("off")
    side_by_side = [(name, results[f"{name}_side_by_side"]) for name in ("demo", "mobilenetv2")
                    if f"{name}_side_by_side" in results]
    if side_by_side:
        targets = {"demo": 3.0, "mobilenetv2": 1.0}  # the ceilings, per cent
        for x, (name, rows) in enumerate(side_by_side):
            costs = [r["cost_pct"] for r in rows["rounds"]]
            right.scatter([x] * len(costs), costs, alpha=0.7, label=f"{name}: rounds")
            right.hlines(targets[name], x - 0.3, x + 0.3, colors="red", linestyles="--")
        right.set_xticks(range(len(side_by_side)), [name for name, _ in side_by_side])
        right.axhline(0, color="grey", linewidth=0.5)
        right.set_ylabel("signed job's cost, % of steps/s (dashed: target)")
        right.set_title("signed and unsigned side by side")
        right.legend()
    labels, signed, unsigned = [], [], []
    for name in ("demo", "mobilenetv2"):
        if name in results:
            labels.append(name)
            signed.append(results[name]["median_samples_per_s"]["signed"])
            unsigned.append(results[name]["median_samples_per_s"]["unsigned"])
    if labels:
        xs = np.arange(len(labels))
        right.bar(xs - 0.2, [s / u for s, u in zip(signed, unsigned)], 0.4, label="signed")
        right.bar(xs + 0.2, [1.0] * len(labels), 0.4, label="unsigned")
        right.set_xticks(xs, labels)
        right.set_ylabel("samples/s relative to unsigned (median)")
        right.set_ylim(0.8, 1.1)
        right.legend()
        right.set_title("whole jobs")
    save_figure(fig, path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", choices=["frames", "demo", "mobilenetv2"], default=None)
    parser.add_argument("--pairs", type=int, default=3, help="signed/unsigned runs of each job")
    parser.add_argument("--steps", type=int, default=6, help="MobileNetV2 timed steps per run")
    parser.add_argument("--demo-epochs", type=int, default=6,
                        help="epochs of each demo run (the CLI demo's default)")
    parser.add_argument("--demo-layout", choices=["pipeline", "data", "auto"], default="pipeline",
                        help="the demo's layout on both sides of every pair")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--demo-option", action="append", default=[], metavar="ARG",
                        help="with --side-by-side: pass ARG to both demos (repeatable; "
                             "--demo-option=--replicate-every --demo-option=0)")
    parser.add_argument("--side-by-side", action="store_true",
                        help="run each pair's signed and unsigned job at the same time and "
                             "compare them over the window both trained (--pairs rounds)")
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent /
                        "results" / "signing.json")
    args = parser.parse_args()
    results: dict = {"loadavg_start": loadavg()}
    if args.only in (None, "frames"):
        results["frames"] = frames()
    if args.side_by_side:
        if args.only in (None, "demo"):
            results["demo_side_by_side"] = demo_side_by_side(args.pairs, args.demo_epochs,
                                                             args.demo_layout,
                                                             tuple(args.demo_option))
            results["demo_side_by_side"]["layout"] = args.demo_layout
            results["demo_side_by_side"]["demo_options"] = args.demo_option
            results["demo_side_by_side"]["epochs"] = args.demo_epochs
        if args.only in (None, "mobilenetv2"):
            results["mobilenetv2_side_by_side"] = mobilenetv2_side_by_side(
                args.pairs, args.steps, args.warmup)
            results["mobilenetv2_side_by_side"].update(steps=args.steps, warmup=args.warmup)
    else:
        if args.only in (None, "demo"):
            results["demo"] = demo(args.pairs, args.demo_epochs, args.demo_layout)
            results["demo"]["layout"] = args.demo_layout
        if args.only in (None, "mobilenetv2"):
            results["mobilenetv2"] = mobilenetv2(max(1, args.pairs - 1), args.steps,
                                                 args.warmup)
    results["loadavg_end"] = loadavg()
    write_results(results, args.out, lambda png: plot(results, png))


if __name__ == "__main__":
    main()
