"""Run reports (report.json, report.png), the demo's report step and metrics ports, and the
metrics documentation."""

from __future__ import annotations

import json
import math
import re
import socket
import subprocess
import sys
import uuid
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from prometheus_client import CollectorRegistry

from ftpipe_iot.observability.metrics import ControllerMetrics, DeviceMetrics
from ftpipe_iot.observability.report import (
    REPORT_JSON,
    REPORT_PNG,
    ReportError,
    build_report,
    write_report,
)
from ftpipe_iot.runtime.broker import mosquitto_binary

ROOT = Path(__file__).resolve().parent.parent


def _summary(failure: bool) -> dict:
    """A summary shaped like the controller's: 120 steps, 2 evaluations, and optionally a
    failure at t=6 recovered at t=9 with a plan change in between."""
    history, t = [], 2.0
    for step in range(120):
        t += 0.05 + (3.0 if failure and step == 60 else 0.0)
        history.append({"step": step, "t": t, "loss": 2.3 * math.exp(-step / 50),
                        "samples_per_s": 0.0 if step < 2 else 600.0 + step})
    events = [{"t": 0.5, "type": "plan_changed", "step": 0},
              {"t": 2.0, "type": "training_started", "step": 0}]
    if failure:
        events += [{"t": 6.0, "type": "failure_detected", "step": 60, "device": "dev1"},
                   {"t": 8.5, "type": "plan_changed", "step": 60},
                   {"t": 9.0, "type": "recovery_done", "step": 60}]
    events.append({"t": t + 0.5, "type": "job_done", "step": 120})
    return {"job": "r", "steps": 120, "epochs": 2, "devices": 3, "test_accuracy": 0.9,
            "samples_per_s": 650.0, "final_loss": history[-1]["loss"], "error": None,
            "history": history, "events": events,
            "evals": [{"epoch": 0, "step": 60, "test_accuracy": 0.7, "test_loss": 0.9, "t": 5.5},
                      {"epoch": 1, "step": 120, "test_accuracy": 0.9, "test_loss": 0.3,
                       "t": t + 0.4}]}


def _red_pixels(path: Path) -> int:
    """Pixels of the failure red (lines are drawn slightly transparent over white)."""
    rgb = np.asarray(Image.open(path).convert("RGB")).astype(int)
    return int(((rgb[..., 0] > 190) & (rgb[..., 1] < 100) & (rgb[..., 2] < 100)).sum())


def _check_png(path: Path) -> None:
    image = Image.open(path)
    image.verify()  # a complete, uncorrupted PNG
    image = Image.open(path).convert("RGB")
    assert image.format is None or image.format == "PNG"
    assert image.width >= 600 and image.height >= 400
    # Non-trivial content: drawn curves, text and markers give many colours; a blank or
    # near-blank figure has a handful.
    assert len(image.getcolors(maxcolors=1 << 20) or []) > 200


def test_report_marks_failures_and_recoveries(tmp_path):
    paths = write_report(_summary(failure=True), tmp_path)
    assert paths.json == tmp_path / REPORT_JSON and paths.png == tmp_path / REPORT_PNG
    report = json.loads(paths.json.read_text())
    assert report["failures"] == 1 and report["recoveries"] == 1
    assert report["plan_changes"] == 2
    assert report["recovering_s"] == pytest.approx(3.0)
    assert report["stalled_s"] == pytest.approx(3.05)  # the 3 s pause plus one step
    assert report["throughput_median"] == pytest.approx(600 + 61, abs=2)
    assert len(report["evals"]) == 2 and report["test_accuracy"] == 0.9
    _check_png(paths.png)
    # The failure line (and the stalled span) is drawn in the failure red; without a failure
    # there is none: the marks depend on the events, not on a fixed decoration.
    calm = write_report(_summary(failure=False), tmp_path / "calm")
    _check_png(calm.png)
    assert _red_pixels(paths.png) > 200
    assert _red_pixels(calm.png) == 0


def test_report_of_a_run_without_history_or_evaluation(tmp_path):
    summary = {"job": "early", "steps": 0, "history": [], "evals": [], "events": [],
               "error": "device dev0 went offline"}
    paths = write_report(summary, tmp_path)
    report = json.loads(paths.json.read_text())
    assert report["steps"] == 0 and report["throughput_median"] is None
    assert report["error"] == "device dev0 went offline"
    assert paths.png.stat().st_size > 0


def test_report_refuses_a_malformed_summary():
    with pytest.raises(ReportError, match="history"):
        build_report({"history": "not a list"})


def _metric_names(registry: CollectorRegistry) -> set[str]:
    return {family.name for family in registry.collect()}


def test_every_metric_is_documented_and_named_by_convention():
    from ftpipe_iot.collab.metrics import CollabAgentMetrics, CoordinatorMetrics

    registry_c, registry_d = CollectorRegistry(), CollectorRegistry()
    registry_cc, registry_cd = CollectorRegistry(), CollectorRegistry()
    ControllerMetrics(registry_c)
    DeviceMetrics(registry_d)
    CoordinatorMetrics(registry_cc)
    CollabAgentMetrics(registry_cd)
    families = {f.name: f for r in (registry_c, registry_d, registry_cc, registry_cd)
                for f in r.collect()}
    doc = (ROOT / "docs" / "observability.md").read_text()
    documented = set(re.findall(r"^\| `(ftpipe_[a-z0-9_]+)` \|", doc, re.M))
    for family in families.values():
        # prometheus_client strips _total from counter family names; the exposed name has it.
        exposed = family.name + "_total" if family.type == "counter" else family.name
        assert exposed.startswith("ftpipe_")
        assert exposed in documented, f"{exposed} is missing from docs/observability.md"
        if family.type == "histogram":
            assert exposed.endswith("_seconds"), exposed
    exposed_all = {f.name + "_total" if f.type == "counter" else f.name
                   for f in families.values()}
    assert documented - exposed_all == set(), "documented metrics that do not exist"


@pytest.mark.slow
def test_demo_writes_a_report_into_a_kept_run_dir_and_serves_metrics(tmp_path):
    if mosquitto_binary() is None:
        pytest.fail("mosquitto is not installed; .ci/run installs it")
    from test_observability import free_port, poll, scrape

    job = f"rep-{uuid.uuid4().hex[:6]}"
    base = free_port()
    while not all(_port_free(base + i) for i in range(4)):
        base = free_port()
    # No --work-dir: the default is runs/<job>-<stamp>/ under the current directory.
    proc = subprocess.Popen([sys.executable, "-m", "ftpipe_iot", "demo", "--json", "--job", job,
                             "--epochs", "1", "--max-steps", "30",
                             "--metrics-port-base", str(base)],
                            cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, stdin=subprocess.DEVNULL)
    try:
        # The controller serves on the base port, dev i on base+1+i, while the demo runs.
        scraped = poll("the demo's controller and devices to serve /metrics",
                       lambda: [scrape(base + i) for i in range(4)], timeout_s=90)
        assert "ftpipe_training_step" in scraped[0]
        assert all("ftpipe_stage_forward_seconds_count" in s for s in scraped[1:])
        out, err = proc.communicate(timeout=150)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, err[-3000:]
    summary = json.loads(out.strip().splitlines()[-1])
    runs = list((tmp_path / "runs").iterdir())
    assert [r.name for r in runs] == [Path(summary["work_dir"]).name]
    assert re.fullmatch(re.escape(job) + r"-\d{8}-\d{6}", runs[0].name)
    assert Path(summary["report_png"]) == runs[0] / REPORT_PNG
    assert Path(summary["report_json"]) == runs[0] / REPORT_JSON
    _check_png(Path(summary["report_png"]))
    report = json.loads(Path(summary["report_json"]).read_text())
    assert report["steps"] == 30 and report["plan_changes"] >= 1
    assert f"report: {summary['report_png']}" in err


def _port_free(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True
