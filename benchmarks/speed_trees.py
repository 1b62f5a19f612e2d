"""Two trees of the project back to back on the synchronous speed job (prints JSON, writes it
and a PNG): the check issue 21's speed contract asks for ("measure before and after, back to
back on a quiet machine"), with the system counters that tell where a difference goes.

Each tree is a ``git archive`` of one revision; every run is that tree's own
``benchmarks/speed.py`` ``ftpipe`` job (``--schedule sync`` on ``equal``: full-width
MobileNetV2, 4 equal devices on the fixed split, micro-batches of 32, M = 8) started from the
tree's directory, so its devices and controller import the tree's code, not the installed
project. Runs alternate (after, before, before, after, ...) so a drift of the host's speed
falls on both trees alike. Around each run, where ``perf`` works, ``perf stat -a`` counts page
faults, context switches and CPU migrations over the whole host; every process's CPU seconds
come from the job itself (``process_cpu``).

On a 2-core host shared with other work the rates move by 5-20 % between runs of one tree:
run this through ``../shared/tools/quiet-run`` and with several pairs.

    python benchmarks/speed_trees.py [--before cea808b] [--after HEAD] [--pairs 2] [--steps 12]
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
_DRIVER = """
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


def one_run(tree: Path, steps: int, warmup: int, counted: bool) -> dict:
    """One sync job of ``tree``'s own benchmark, with the host's counters around it."""
    env = {**os.environ, "PYTHONPATH": str(tree)}
    command = [sys.executable, "-c", _DRIVER, str(steps), str(warmup)]
    with tempfile.NamedTemporaryFile(suffix=".perf") as counters:
        if counted:
            command = ["perf", "stat", "-a", "-x,", "-o", counters.name,
                       "-e", ",".join(COUNTERS), "--", *command]
        done = subprocess.run(command, cwd=tree, env=env, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"the job of {tree.name} failed: {done.stderr.strip()[-800:]}")
        run = json.loads(done.stdout.strip().splitlines()[-1])
        if counted:
            run["counters"] = parse_perf_csv(Path(counters.name).read_text())
    run["process_cpu_s"] = round(sum(cpu["main_thread_cpu_s"] + cpu["other_threads_cpu_s"]
                                     for cpu in run["process_cpu"].values()), 2)
    return run


def summarize(runs: list[dict]) -> dict:
    """Medians of one tree's runs."""
    summary = {"samples_per_s": round(statistics.median(r["samples_per_s"] for r in runs), 2),
               "process_cpu_s": round(statistics.median(r["process_cpu_s"] for r in runs), 1)}
    for counter in COUNTERS:
        values = [r["counters"][counter] for r in runs if counter in r.get("counters", {})]
        if values:
            summary[counter] = int(statistics.median(values))
    return summary


def plot(results: dict, png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    for axis, key, label in ((axes[0], "samples_per_s", "samples/s"),
                             (axes[1], "process_cpu_s", "CPU seconds, all processes")):
        for offset, side in ((-0.2, "before"), (0.2, "after")):
            values = [r[key] for r in results["runs"][side]]
            axis.bar([i + offset for i in range(len(values))], values, width=0.4,
                     label=f"{side} {results[side]['commit'][:8]}")
        axis.set_xlabel("pair")
        axis.set_ylabel(label)
        axis.legend(fontsize=8)
    fig.suptitle("sync, equal: two trees back to back")
    save_figure(fig, png)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", default="cea808b", help="revision of the reference tree")
    parser.add_argument("--after", default="HEAD", help="revision of the tree judged")
    parser.add_argument("--pairs", type=int, default=2, help="runs of each tree")
    parser.add_argument("--steps", type=int, default=12, help="timed steps per run")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--out", type=Path,
                        default=REPO / "benchmarks" / "results" / "speed-trees.json")
    args = parser.parse_args()
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
                run = one_run(trees[side][0], args.steps, args.warmup, counted)
                runs[side].append(run)
                say(f"pair {pair} {side}: {run['samples_per_s']:.1f} samples/s, "
                    f"{run['process_cpu_s']:.0f} CPU-s, {run.get('counters', {})}")
    results: dict = {"what": "sync on `equal`, two trees alternated", "steps": args.steps,
                     "warmup": args.warmup, "runs": runs}
    for side in ("before", "after"):
        results[side] = {"revision": getattr(args, side), "commit": trees[side][1],
                         **summarize(runs[side])}
    results["after_over_before"] = round(results["after"]["samples_per_s"]
                                         / results["before"]["samples_per_s"], 3)
    write_results(results, args.out, lambda png: plot(results, png))


if __name__ == "__main__":
    main()
