"""Repartition churn on identical devices (prints JSON, writes it): the default demo job run
N times (3 identical device processes, the CNN on digits) and one long run, counting the
repartitions each made. Identical devices should never repartition.

    python benchmarks/churn.py [--runs 10] [--long-epochs 30] [--out benchmarks/results/churn.json]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.harness import say  # noqa: E402


def _demo(epochs: int, work: Path, extra: list[str] | None = None) -> dict:
    out = subprocess.run([sys.executable, "-m", "ftpipe_iot", "demo", "--json", "--epochs",
                          str(epochs), "--work-dir", str(work), *(extra or [])],
                         capture_output=True, text=True, timeout=1800, stdin=subprocess.DEVNULL)
    if out.returncode != 0:
        raise RuntimeError(f"demo failed: {out.stderr[-2000:]}")
    summary = json.loads(out.stdout.strip().splitlines()[-1])
    return {"epochs": epochs, "steps": summary["steps"], "repartitions": summary["repartitions"],
            "plans": sum(1 for e in summary["events"] if e["type"] == "plan_changed"),
            "samples_per_s": round(summary["samples_per_s"], 1),
            "test_accuracy": round(summary["test_accuracy"], 4)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--long-epochs", type=int, default=30)
    parser.add_argument("--out", type=Path,
                        default=Path(__file__).parent / "results" / "churn.json")
    parser.add_argument("--smoke", action="store_true",
                        help="one 3-step demo run on 2 devices, no long run: checks the "
                             "benchmark runs (give --out)")
    args = parser.parse_args()
    smoke = ["--devices", "2", "--max-steps", "3"] if args.smoke else []
    if args.smoke:
        args.runs, args.long_epochs = 1, 0
    work = Path(tempfile.mkdtemp(prefix="bench-churn-"))
    runs = []
    for index in range(args.runs):
        runs.append(_demo(6, work / f"demo-{index}", smoke))
        say(f"demo run {index + 1}/{args.runs}: {runs[-1]['repartitions']} repartitions")
    long = _demo(args.long_epochs, work / "long") if args.long_epochs else None
    if long:
        say(f"long run: {long['steps']} steps, {long['repartitions']} repartitions")
    result = {"demo_runs": runs, "demo_repartitions": [r["repartitions"] for r in runs],
              "long_run": long, "loadavg": os.getloadavg()}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
