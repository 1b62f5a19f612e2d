"""Two trees of the project back to back on one of issue 21's speed jobs (prints JSON, writes it
and a PNG): the check its speed contract asks for ("measure before and after, back to back on a
quiet machine"), with the system counters that tell where a difference goes.

Each tree is a ``git archive`` of one revision; every run is that tree's own benchmark started
from the tree's directory, so its devices and controller import the tree's code, not the
installed project. Two jobs:

- ``sync-equal`` (default): ``benchmarks/speed.py``'s ``ftpipe`` job, ``--schedule sync`` on
  ``equal`` (full-width MobileNetV2, 4 equal devices on the fixed split, micro-batches of 32,
  M = 8); one rate, ``sync``.
- ``fleet``: ``benchmarks/fleet_scale.py --no-32`` (fleet F16, MobileNetV2 width 0.25, the
  planner's single pipeline, data-parallel group and hybrid plan, each pinned); one rate per
  layout, with the plan each tree's planner chose (a layout whose plan differs between the
  trees is not the same job, and the summary says so).
- ``fleet-pinned``: the same four F16 plans in both trees (``PINNED_PLANS``: two single
  pipelines, one device holding everything, a hybrid with a group of seven), each run through
  the tree's own ``fleet_scale.run_plan`` for 16 steps, samples/s over steps 4-15.

Runs alternate (after, before, before, after, ...) so a drift of the host's speed falls on both
trees alike. Around each run, where ``perf`` works, ``perf stat -a`` counts page faults,
context switches and CPU migrations over the whole host.

On a 2-core host shared with other work the rates move by 5-20 % between runs of one tree:
run this through ``../shared/tools/quiet-run`` and with several pairs.

    python benchmarks/speed_trees.py [--job sync-equal|fleet|fleet-pinned] [--before cea808b]
                                     [--after HEAD] [--pairs 2] [--steps N]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.harness import save_figure, say, write_results  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
COUNTERS = ("page-faults", "context-switches", "cpu-migrations")

# Run inside a tree (cwd and PYTHONPATH: the tree): one sync job of its own speed.py.
_SYNC_DRIVER = """
import json, sys
sys.path.insert(0, ".")
import benchmarks.speed as speed
from ftpipe_iot.runtime.broker import BrokerProcess
steps, warmup = int(sys.argv[1]), int(sys.argv[2])
with BrokerProcess() as broker:
    run = speed.ftpipe(broker, "trees-sync", "sync", (1, 1, 1, 1), steps, warmup)
print(json.dumps({key: run[key] for key in ("samples_per_s", "process_cpu", "broker_cpu_s",
                                            "loadavg_before", "loadavg_after")}))
"""


class TreeJob:
    """A benchmark job one tree runs from its own directory; ``read`` turns what it left into
    ``{"rates": {name: samples/s}, ...}``."""

    name = ""
    what = ""
    default_steps = 0

    def command(self, steps: int, warmup: int, out: Path) -> list[str]:
        raise NotImplementedError

    def read(self, stdout: str, out: Path) -> dict:
        raise NotImplementedError


class SyncEqualJob(TreeJob):
    """speed.py's sync job on ``equal``: one rate, with every process's CPU seconds."""

    name = "sync-equal"
    what = "sync on `equal`, two trees alternated"
    default_steps = 12

    def command(self, steps: int, warmup: int, out: Path) -> list[str]:
        return [sys.executable, "-c", _SYNC_DRIVER, str(steps), str(warmup)]

    def read(self, stdout: str, out: Path) -> dict:
        run = json.loads(stdout.strip().splitlines()[-1])
        run["rates"] = {"sync": run.pop("samples_per_s")}
        run["process_cpu_s"] = round(sum(cpu["main_thread_cpu_s"] + cpu["other_threads_cpu_s"]
                                         for cpu in run["process_cpu"].values()), 2)
        return run


class FleetJob(TreeJob):
    """fleet_scale.py on F16 without the 32-device run: one rate per layout, and the plans."""

    name = "fleet"
    what = "fleet_scale.py --no-32 (F16: pipeline, data parallel, hybrid), two trees alternated"
    default_steps = 24

    def command(self, steps: int, warmup: int, out: Path) -> list[str]:
        return [sys.executable, "benchmarks/fleet_scale.py", "--no-32", "--steps", str(steps),
                "--out", str(out)]

    def read(self, stdout: str, out: Path) -> dict:
        results = json.loads(out.read_text())
        return {"rates": results["measured_samples_per_s"], "plans": results["plans"],
                "wall_s": results.get("wall_s"),
                "loadavg_before": results.get("loadavg_start"),
                "loadavg_after": results.get("loadavg_end")}


# Run inside a tree: the same pinned F16 plans through that tree's own fleet_scale.run_plan
# (its device profiles, harness and controller options), with the broker's $SYS rates.
_FLEET_PINNED_DRIVER = """
import json, sys, tempfile
from pathlib import Path
sys.path.insert(0, ".")
import benchmarks.fleet_scale as fleet_scale
from ftpipe_iot.runtime.broker import BrokerProcess


class Pinned:
    def __init__(self, text):
        self.text = text
        self.devices = [member.split("*")[0] for stage in text.split(",")
                        for member in stage.split(":")[0].split("+")]


fleet_scale.assignment_text = lambda plan: plan.text
plans, steps = json.loads(sys.argv[1]), int(sys.argv[2])
devices = dict(fleet_scale.fleet(1))
work = Path(tempfile.mkdtemp(prefix="fleet-pinned-"))
broker = BrokerProcess(data_dir=work / "broker")
config = fleet_scale.render_config(broker.port, broker.data_dir)
broker.config_text = config + "\\nsys_interval 1\\n"
broker.start()
monitor = fleet_scale.SysMonitor(broker.port)
rates, messages = {}, {}
try:
    for label, text in plans.items():
        grouped = "+" in text
        _, rates[label], messages[label] = fleet_scale.run_plan(
            broker, monitor, label, Pinned(text), devices, steps, (4, steps - 1),
            [] if grouped else ["--no-repartition"])
finally:
    monitor.close()
    broker.cleanup()
print(json.dumps({"rates": rates, "broker_messages": messages}))
"""

# Plans both trees' planners chose on F16 in the fleet runs (speed-trees-fleet-run*.json).
PINNED_PLANS = {
    "pipeline": "jet0:0-5,jet1:5-22",
    "pipeline_3": "jet0:0-5,jet1:5-15,pi0:15-22",
    "data_parallel": "jet0:0-22",
    "hybrid": "pi0*2+pi1*2+pi2*2+pi3*2+pi4*2+pi5*1+jet0*5:0-11,jet1:11-22",
}


class FleetPinnedJob(TreeJob):
    """The same F16 plans pinned in both trees (the planner's choice varies from run to run
    and between the trees, so ``fleet`` compares a layout only where the plans agree)."""

    name = "fleet-pinned"
    what = "F16 plans pinned in both trees, each through its own fleet_scale.run_plan"
    default_steps = 16

    def command(self, steps: int, warmup: int, out: Path) -> list[str]:
        return [sys.executable, "-c", _FLEET_PINNED_DRIVER, json.dumps(PINNED_PLANS),
                str(steps)]

    def read(self, stdout: str, out: Path) -> dict:
        run = json.loads(stdout.strip().splitlines()[-1])
        run["plans"] = dict(PINNED_PLANS)
        return run


JOBS: dict[str, TreeJob] = {job.name: job
                            for job in (SyncEqualJob(), FleetJob(), FleetPinnedJob())}


def export_tree(revision: str, into: Path) -> tuple[Path, str]:
    """The files of ``revision`` under ``into``; returns the directory and the full hash."""
    commit = subprocess.run(["git", "-C", str(REPO), "rev-parse", revision], check=True,
                            capture_output=True, text=True).stdout.strip()
    tree = into / commit[:12]
    tree.mkdir(parents=True)
    archive = subprocess.Popen(["git", "-C", str(REPO), "archive", commit],
                               stdout=subprocess.PIPE)
    subprocess.run(["tar", "-x", "-C", str(tree)], stdin=archive.stdout, check=True)
    if archive.wait() != 0:
        raise RuntimeError(f"git archive {revision} failed")
    return tree, commit


def perf_works() -> bool:
    """Whether ``perf stat`` can count software events over the whole host here."""
    if shutil.which("perf") is None:
        return False
    probe = subprocess.run(["perf", "stat", "-a", "-x,", "-e", "page-faults", "--", "true"],
                           capture_output=True, text=True)
    return probe.returncode == 0 and "not supported" not in probe.stderr


def parse_perf_csv(text: str) -> dict[str, int]:
    """``perf stat -x,`` output: value,unit,event,... per line."""
    counts: dict[str, int] = {}
    for line in text.splitlines():
        fields = line.split(",")
        if len(fields) >= 3 and fields[2] in COUNTERS and fields[0].isdigit():
            counts[fields[2]] = int(fields[0])
    return counts


def one_run(job: TreeJob, tree: Path, steps: int, warmup: int, counted: bool) -> dict:
    """One run of ``job`` from ``tree``'s own benchmark, with the host's counters around it."""
    env = {**os.environ, "PYTHONPATH": str(tree)}
    with tempfile.TemporaryDirectory(prefix="tree-run-") as scratch:
        out = Path(scratch) / "results.json"
        counters = Path(scratch) / "counters.perf"
        command = job.command(steps, warmup, out)
        if counted:
            command = ["perf", "stat", "-a", "-x,", "-o", str(counters),
                       "-e", ",".join(COUNTERS), "--", *command]
        done = subprocess.run(command, cwd=tree, env=env, capture_output=True, text=True,
                              stdin=subprocess.DEVNULL)
        if done.returncode != 0:
            raise RuntimeError(f"the {job.name} job of {tree.name} failed: "
                               f"{done.stderr.strip()[-800:]}")
        run = job.read(done.stdout, out)
        if counted:
            run["counters"] = parse_perf_csv(counters.read_text())
    return run


def summarize(runs: list[dict]) -> dict:
    """Medians of one tree's runs: each rate, the CPU seconds where the job counts them, and
    the host's counters."""
    summary: dict = {"samples_per_s": {name: round(statistics.median(r["rates"][name]
                                                                     for r in runs), 2)
                                       for name in runs[0]["rates"]}}
    cpu = [r["process_cpu_s"] for r in runs if "process_cpu_s" in r]
    if cpu:
        summary["process_cpu_s"] = round(statistics.median(cpu), 1)
    for counter in COUNTERS:
        values = [r["counters"][counter] for r in runs if counter in r.get("counters", {})]
        if values:
            summary[counter] = int(statistics.median(values))
    return summary


def plans_compared(runs: dict[str, list[dict]]) -> dict[str, dict]:
    """Per layout, the plans each tree's runs chose and whether one plan was run throughout:
    a rate compares two trees only where they ran the same plan."""
    compared: dict[str, dict] = {}
    layouts = {name for side in runs.values() for run in side for name in run.get("plans", {})}
    for name in sorted(layouts):
        chosen = {side: sorted({run["plans"][name] for run in side_runs
                                if name in run.get("plans", {})})
                  for side, side_runs in runs.items()}
        compared[name] = {"plans": chosen,
                          "same_plan": len({plan for plans in chosen.values()
                                            for plan in plans}) == 1}
    return compared


def plot(results: dict, png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rates = list(results["before"]["samples_per_s"])
    panels = [(f"{name}: samples/s", lambda run, name=name: run["rates"][name]) for name in rates]
    if "process_cpu_s" in results["before"]:
        panels.append(("CPU seconds, all processes", lambda run: run["process_cpu_s"]))
    fig, axes = plt.subplots(1, len(panels), figsize=(4.6 * len(panels), 3.6), squeeze=False)
    for axis, (label, value) in zip(axes[0], panels):
        pairs = 0
        for offset, side in ((-0.2, "before"), (0.2, "after")):
            values = [value(run) for run in results["runs"][side]]
            pairs = max(pairs, len(values))
            axis.bar([i + offset for i in range(len(values))], values, width=0.4,
                     label=f"{side} {results[side]['commit'][:8]}")
        axis.set_xticks(range(pairs))
        axis.set_xlabel("pair")
        axis.set_ylabel(label)
        axis.legend(fontsize=8)
    fig.suptitle(f"{results['job']}: two trees back to back")
    save_figure(fig, png)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--job", choices=sorted(JOBS), default="sync-equal",
                        help="which benchmark each tree runs")
    parser.add_argument("--before", default="cea808b", help="revision of the reference tree")
    parser.add_argument("--after", default="HEAD", help="revision of the tree judged")
    parser.add_argument("--pairs", type=int, default=2, help="runs of each tree")
    parser.add_argument("--steps", type=int, default=None,
                        help="timed steps per run (sync-equal: 12; fleet: 24 per layout)")
    parser.add_argument("--warmup", type=int, default=2, help="warm-up steps (sync-equal)")
    parser.add_argument("--out", type=Path, default=None,
                        help="results file (default benchmarks/results/speed-trees-JOB.json)")
    args = parser.parse_args()
    job = JOBS[args.job]
    steps = args.steps if args.steps is not None else job.default_steps
    out = args.out or REPO / "benchmarks" / "results" / f"speed-trees-{job.name}.json"
    counted = perf_works()
    if not counted:
        say("perf cannot count here: rates and CPU seconds only")
    with tempfile.TemporaryDirectory(prefix="speed-trees-") as work:
        trees = {side: export_tree(revision, Path(work))
                 for side, revision in (("before", args.before), ("after", args.after))}
        runs: dict[str, list[dict]] = {"before": [], "after": []}
        for pair in range(args.pairs):
            order = ("after", "before") if pair % 2 == 0 else ("before", "after")
            for side in order:
                run = one_run(job, trees[side][0], steps, args.warmup, counted)
                runs[side].append(run)
                cpu = f", {run['process_cpu_s']:.0f} CPU-s" if "process_cpu_s" in run else ""
                say(f"pair {pair} {side}: {run['rates']} samples/s{cpu}, "
                    f"{run.get('counters', {})}")
    results: dict = {"job": job.name, "what": job.what, "steps": steps, "runs": runs}
    if job is JOBS["sync-equal"]:
        results["warmup"] = args.warmup
    for side in ("before", "after"):
        results[side] = {"revision": getattr(args, side), "commit": trees[side][1],
                         **summarize(runs[side])}
    results["after_over_before"] = {
        name: round(results["after"]["samples_per_s"][name]
                    / results["before"]["samples_per_s"][name], 3)
        for name in results["before"]["samples_per_s"]}
    compared = plans_compared(runs)
    if compared:
        results["plans"] = compared
    write_results(results, out, lambda png: plot(results, png))


if __name__ == "__main__":
    main()
