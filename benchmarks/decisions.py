"""Decision stability benchmark (prints JSON, writes it): the demo as ``make demo`` runs it, N
times in a row, and how often its controller moved work with nothing changing in the fleet.

On 3 identical device processes a run should change neither its layout nor a group's shares
after the first plan: every ``shares_changed`` event, every ``plan_changed`` event after the
first and every repartition is counted per run, and the runs' distinct layouts (1 when every
run laid the fleet out the same way). Throughput and accuracy come along, to show
the decisions left alone cost nothing.

    python benchmarks/decisions.py [--runs 10] [--busy-cores K] \
        [--out benchmarks/results/decisions.json]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.harness import say  # noqa: E402


def loadavg() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def one_demo(index: int, extra: list[str]) -> dict:
    """One ``ftpipe-iot demo --json`` (the Makefile's demo) in a fresh work dir."""
    work = Path(tempfile.mkdtemp(prefix=f"decisions-{index}-"))
    started = time.monotonic()
    result = subprocess.run([sys.executable, "-m", "ftpipe_iot", "demo", "--json",
                             "--job", f"decisions-{index}", "--work-dir", str(work), *extra],
                            capture_output=True, text=True, stdin=subprocess.DEVNULL,
                            timeout=900)
    if result.returncode != 0:
        raise RuntimeError(f"demo {index} failed: {result.stderr[-2000:]}")
    summary = json.loads(result.stdout.strip().splitlines()[-1])
    events = summary.get("events", [])
    share_changes = [e.get("at_step") for e in events if e.get("type") == "shares_changed"]
    plans = [e for e in events if e.get("type") == "plan_changed"]
    return {"share_changes": len(share_changes), "share_change_steps": share_changes,
            "layout_changes": max(0, len(plans) - 1), "repartitions": summary["repartitions"],
            "layout": [[d["device"] for d in s["devices"]] for s in summary["stages"]],
            "samples_per_s": round(summary["samples_per_s"], 1),
            "test_accuracy": round(summary["test_accuracy"], 4), "steps": summary["steps"],
            "wall_s": round(time.monotonic() - started, 1), "loadavg_after": loadavg()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent /
                        "results" / "decisions.json")
    parser.add_argument("--busy-cores", type=int, default=0,
                        help="processes spinning alongside every run, as on a loaded host "
                             "(the controller then profiles its layers slower)")
    parser.add_argument("demo_args", nargs="*", help="passed to ftpipe-iot demo (after --)")
    args = parser.parse_args()
    results: dict = {"command": "ftpipe-iot demo --json " + " ".join(args.demo_args),
                     "cores": os.cpu_count(), "busy_cores": args.busy_cores,
                     "loadavg_start": loadavg(), "runs": []}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"])
                for _ in range(args.busy_cores)]
    try:
        for index in range(args.runs):
            say(f"demo {index + 1}/{args.runs}")
            results["runs"].append(one_demo(index, args.demo_args))
            args.out.write_text(json.dumps({**results, "partial": True}, indent=2))
    finally:
        for spinner in spinners:
            spinner.kill()
            spinner.wait()
    runs = results["runs"]
    results["total"] = {"share_changes": sum(r["share_changes"] for r in runs),
                        "layout_changes": sum(r["layout_changes"] for r in runs),
                        "repartitions": sum(r["repartitions"] for r in runs),
                        "runs_without_any_change": sum(
                            r["share_changes"] == r["layout_changes"] == r["repartitions"] == 0
                            for r in runs),
                        # a user who runs the demo twice gets the same layout (issue 23's "no
                        # flapping", between runs as within them)
                        "distinct_layouts": len({json.dumps(r["layout"]) for r in runs})}
    results["loadavg_end"] = loadavg()
    args.out.write_text(json.dumps(results, indent=2))
    print(json.dumps(results))


if __name__ == "__main__":
    main()
