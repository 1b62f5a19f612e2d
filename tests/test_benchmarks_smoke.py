"""Every benchmark in benchmarks/ starts from its entry point, as the docs run it, so a change
elsewhere cannot silently break one again (benchmarks/collab.py did: its devices refused its
model after the trust check landed).

The light ones run for real at their smallest (``--smoke`` or small values of their own
options), writing their JSON to a temporary path, never to benchmarks/results/. The heavy ones
(fleet_scale, heterogeneity, recovery, resilience, speed: several multi-device MobileNetV2 jobs
each) are checked as far as a smoke test can afford: their entry point parses its arguments
(which imports everything they use), and the plumbing every one of them runs its jobs through
(``benchmarks.harness.run_job``) runs one tiny real job. links.py (network namespaces, root)
is heavy too: its arguments are checked, its real run is not started here.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ftpipe_iot.runtime.broker import mosquitto_binary

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parent.parent
BENCH = REPO / "benchmarks"


def _start(script: str, *args: str, timeout: float) -> subprocess.CompletedProcess:
    """``python benchmarks/SCRIPT ARGS`` from the repository root, as the docs run it."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])])}
    return subprocess.run([sys.executable, str(BENCH / script), *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=timeout,
                          stdin=subprocess.DEVNULL)


def _run(script: str, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    result = _start(script, *args, timeout=timeout)
    assert result.returncode == 0, f"{script} {' '.join(args)}:\n{result.stderr[-4000:]}"
    return result


@pytest.fixture
def needs_mosquitto() -> None:
    if mosquitto_binary() is None:
        pytest.fail("mosquitto is not installed; .ci/run installs it")


@pytest.mark.parametrize("script, args", [
    ("churn.py", ["--smoke"]),
    # every broker's probe runs in tests/test_broker_compat.py; here the entry point, once
    ("broker_matrix.py", ["--brokers", "mosquitto-5"]),
    ("planner.py", ["--smoke"]),
    ("wire_bytes.py", ["--steps", "1"]),
    ("transport.py", ["--count", "3", "--repeats", "1"]),
    ("signing.py", ["--only", "frames"]),
])
def test_a_light_benchmark_runs_at_its_smallest(script, args, tmp_path, needs_mosquitto):
    out = tmp_path / f"{Path(script).stem}.json"
    _run(script, *args, "--out", str(out))
    assert json.loads(out.read_text())


def test_the_collaborative_benchmark_trains_its_own_model(tmp_path, needs_mosquitto):
    """The regression that made this file: the benchmark's model is a user model."""
    out = tmp_path / "collab.json"
    _run("collab.py", "--smoke", "--out", str(out))
    (row,) = json.loads(out.read_text())["configurations"]
    assert row["model"] == "benchmarks.collab_models:split_friendly"
    assert row["collaborative"]["iterations"] == 2


def test_torch_pipelining_runs_one_step(tmp_path):
    result = _run("torch_pipelining.py", "--factors", "1,1", "--steps", "1", "--warmup", "0",
                  "--micro-batches", "2", "--micro-batch-size", "4")
    assert json.loads(result.stdout)["samples_per_s"] > 0


def test_cpu_profile_wraps_the_cli(tmp_path):
    """Its wrapping (DeviceAgent._build_stage, Controller._start_training) happens before the
    command runs: ``--help`` checks it and writes the (empty) profile."""
    prof = tmp_path / "help.prof"
    assert "Usage:" in _run("cpu_profile.py", str(prof), "--help").stdout
    assert prof.exists()


HEAVY = ["fleet_scale.py", "heterogeneity.py", "recovery.py", "resilience.py", "speed.py",
         "links.py", "links_l8.py", "speed_trees.py"]
# Each script run as ``__main__`` with ``--help``, one after another in one interpreter: the
# entry point and every import it makes, without paying torch's import once per script.
_HELP_EACH = """
import runpy
import sys

for script in sys.argv[1:]:
    sys.argv = [script, "--help"]
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as stop:
        if stop.code not in (0, None):
            raise
    print(f"parsed {script}", flush=True)
"""


def test_every_heavy_benchmark_parses_its_arguments():
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])])}
    result = subprocess.run([sys.executable, "-c", _HELP_EACH, *(str(BENCH / s) for s in HEAVY)],
                            cwd=REPO, env=env, capture_output=True, text=True, timeout=180,
                            stdin=subprocess.DEVNULL)
    assert result.returncode == 0, result.stderr[-4000:]
    assert result.stdout.count("usage:") == len(HEAVY), result.stdout[-4000:]
    for script in HEAVY:
        assert f"parsed {BENCH / script}" in result.stdout, script


def test_the_tree_comparison_reads_perf_stat_counters_and_skips_what_was_not_counted():
    """speed_trees.py's reading of ``perf stat -x,`` (value, unit, event, ...), as perf 6 writes
    it; a counter a VM does not offer reads ``<not supported>`` and is left out."""
    sys.path.insert(0, str(REPO))
    try:
        from benchmarks.speed_trees import parse_perf_csv
    finally:
        sys.path.remove(str(REPO))
    text = ("# started on Sat Dec  5 22:43:48 2026\n\n"
            "3396150,,page-faults,285181090000,100.00,11.909,K/sec\n"
            "129578,,context-switches,285181090000,100.00,454.371,/sec\n"
            "<not supported>,,cpu-migrations,0,100.00,,\n")
    assert parse_perf_csv(text) == {"page-faults": 3396150, "context-switches": 129578}


def test_the_harness_the_heavy_benchmarks_share_runs_a_job(needs_mosquitto):
    sys.path.insert(0, str(REPO))
    try:
        from benchmarks.harness import JobSpec, run_job
        from ftpipe_iot.runtime.broker import BrokerProcess

        before = time.time()
        with BrokerProcess() as broker:
            summary = run_job(JobSpec("smoke-harness", [("h0", None), ("h1", None)],
                                      ["--max-steps", "2", "--no-repartition"], timeout_s=240),
                              broker)
        after = time.time()
    finally:
        sys.path.remove(str(REPO))
    assert summary["steps"] == 2 and summary["error"] is None
    # the controller's start on the wall clock, from which its steps' times count: what lines
    # up jobs run side by side (benchmarks/signing.py --side-by-side)
    assert before < summary["started_at"] < summary["started_at"] + summary["history"][-1]["t"] \
        < after


def test_the_harness_runs_a_job_with_a_standby_controller_that_takes_it_over(needs_mosquitto):
    """resilience.py's fail-over runs: the leader is killed, the standby finishes the job."""
    import os
    import signal

    sys.path.insert(0, str(REPO))
    try:
        from benchmarks.harness import JobSpec, run_job
        from ftpipe_iot.runtime.broker import BrokerProcess

        def kill_the_leader(watcher, procs) -> None:
            assert watcher.wait_step(3, 120)
            os.killpg(procs["controller"].pid, signal.SIGKILL)

        with BrokerProcess() as broker:
            summary = run_job(JobSpec("smoke-standby", [("h0", None), ("h1", None)],
                                      ["--max-steps", "8", "--no-repartition",
                                       "--replicate-every", "2", "--keepalive", "2"],
                                      timeout_s=240, standby_controller=True),
                              broker, during=kill_the_leader)
    finally:
        sys.path.remove(str(REPO))
    assert summary["steps"] == 8 and summary["error"] is None
    assert any(e["type"] == "recovery_done" for e in summary["events"])  # the standby's resume


def test_links_refuses_a_window_it_cannot_measure():
    """links.py's real run (four MobileNetV2 jobs in network namespaces, minutes) is too heavy
    for a smoke test: its arguments are checked here (and by --help above); where namespaces
    cannot be made it prints a ``skipped`` JSON and exits 0 by design."""
    result = _start("links.py", "--steps", "2", timeout=120)
    assert result.returncode == 2 and "--steps must be at least 4" in result.stderr


def _links_l8(monkeypatch):
    monkeypatch.syspath_prepend(str(REPO))
    import benchmarks.links_l8 as links_l8

    return links_l8


def test_l8_verdicts_compare_equal_epochs_and_the_codec_per_cut(monkeypatch):
    """A run reaching the target an evaluation sooner does not inflate the equal-epochs
    speed-up; the codec's ratio is taken per cut (worst of all cuts and of the cuts trained
    across), not from wire bytes per step of different plans."""
    links_l8 = _links_l8(monkeypatch)
    run = {"failures_detected": 0, "steps": 176}
    results = {"runs": {
        "alone": {**run, "time_to_target_s": 900.0, "train_s": 1000.0},
        "ftpipe-none": {**run, "time_to_target_s": 500.0, "train_s": 600.0,
                        "final_accuracy": 0.97, "stages": [{"end": 8}, {"end": 22}]},
        "ftpipe-int8": {**run, "time_to_target_s": 300.0, "train_s": 620.0,
                        "final_accuracy": 0.99, "stages": [{"end": 5}, {"end": 22}]},
        "ftpipe-fp16": {**run, "steps": 100, "time_to_target_s": None, "train_s": 100.0}},
        "bytes_per_cut": [
            {"cut": 1, "activation_bytes": {"none": 100, "int8": 50}},
            {"cut": 5, "activation_bytes": {"none": 400, "int8": 100}},
            {"cut": 8, "activation_bytes": {"none": 450, "int8": 100}}]}
    verdicts = links_l8.verdicts(results, 0.9)
    assert verdicts["best"] == "ftpipe-int8"
    assert verdicts["best_speedup_over_alone"] == 3.0
    assert verdicts["speedup_at_equal_epochs"] == {"config": "ftpipe-none", "speedup": 1.67}
    assert verdicts["int8_activation_bytes_ratio"] == {"worst_cut": 2.0, "worst_cut_used": 4.0}
    assert verdicts["int8_accuracy_points_below_none"] == -2.0


def test_l8_replication_share_leaves_evaluations_and_new_plans_out(monkeypatch):
    """Steps of 1 s; an evaluation (a 6 s step) and a new plan (8 s) are counted apart from
    replication; the long steps after the replication points (base 10, paced to 20 at step 25)
    are replication's; a long step nowhere near one is counted against it too, and said so."""
    links_l8 = _links_l8(monkeypatch)
    long = {15: 6.0, 31: 8.0, 10: 3.0, 40: 3.0, 52: 2.5}  # 52: no replication near it
    t, history = 0.0, []
    for step in range(60):
        t += long.get(step, 1.0)
        history.append({"step": step, "t": t})
    summary = {"history": history, "replication": {"base": 10},
               "events": [{"type": "epoch_evaluated", "step": 15},
                          {"type": "plan_changed", "resume_step": 31},
                          {"type": "replication_paced", "at_step": 25, "steps": 20}]}
    share = links_l8.replication_share(summary)
    total = t - history[0]["t"]
    assert share["evaluation_share"] == round(5.0 / total, 4)
    assert share["plan_change_share"] == round(7.0 / total, 4)
    assert share["share_of_training"] == round((2.0 + 2.0 + 1.5) / total, 4)
    assert (share["long_steps"], share["long_steps_after_a_replication"]) == (3, 2)


def test_l8_results_say_every_plan_and_what_the_controller_knew(monkeypatch):
    links_l8 = _links_l8(monkeypatch)
    one = [{"stage": 0, "start": 0, "end": 8, "devices": [{"device": "l8-a1", "share": 1.0}]},
           {"stage": 1, "start": 8, "end": 22, "devices": [{"device": "l8-a0", "share": 0.5},
                                                           {"device": "l8-b0", "share": 0.5}]}]
    summary = {"events": [{"type": "training_started", "t": 10.0},
                          {"type": "plan_changed", "t": 9.0, "resume_step": 0, "stages": one},
                          {"type": "plan_changed", "t": 40.0, "resume_step": 13,
                           "stages": one[:1]}],
               "evals": [{"t": 30.0, "test_accuracy": 0.95}], "history": [],
               "predictions": [{"from_step": 0, "predicted_step_s": 1.0, "measured_step_s": 2.0,
                                "error": 1.0, "unmeasured": ["l8-a0"], "other": 1}],
               "device_capacity": {"l8-a0": 3.1}}
    out = links_l8.result_of("ftpipe-none", summary, 0.9)
    assert [(p["from_step"], p["t"], p["stages"]) for p in out["plans"]] == [
        (0, -1.0, "a1:0-8 a0+b0:8-22"), (13, 30.0, "a1:0-8")]
    assert out["predictions"] == [{"from_step": 0, "predicted_step_s": 1.0,
                                   "measured_step_s": 2.0, "error": 1.0,
                                   "unmeasured": ["l8-a0"]}]
    assert out["device_capacity"] == {"l8-a0": 3.1} and out["time_to_target_s"] == 20.0


def test_l8_bytes_per_cut_encodes_every_cut_as_the_messenger_does(monkeypatch, tmp_path):
    links_l8 = _links_l8(monkeypatch)
    from benchmarks.speed import upscaled_digits

    rows = links_l8.bytes_per_cut(upscaled_digits(tmp_path), ["none", "fp16", "int8", "int4"])
    assert [r["cut"] for r in rows] == list(range(1, 22))
    for row in rows:
        for kind in ("activation_bytes", "gradient_bytes"):
            sizes = row[kind]
            assert sizes["none"] > sizes["fp16"] > sizes["int8"] > sizes["int4"], row
    dense = next(r for r in rows if r["cut"] == 8)  # after a linear bottleneck: no zeros
    assert dense["activation_bytes"]["none"] / dense["activation_bytes"]["int8"] > 3.5


def test_the_signing_benchmark_reports_every_pairs_cost_and_their_spread(monkeypatch):
    """Run i of each side is pair i; each pair's cost is against its own unsigned run."""
    monkeypatch.syspath_prepend(str(REPO))
    import benchmarks.signing as signing

    runs = {"signed": [{"samples_per_s": 90.0}, {"samples_per_s": 110.0}],
            "unsigned": [{"samples_per_s": 100.0}, {"samples_per_s": 100.0}]}
    assert signing.pair_costs(runs) == {"pairs_pct": [10.0, -10.0],
                                        "pairs_range_pct": [-10.0, 10.0]}


def test_time_to_accuracy_compares_medians_in_wall_and_in_training_time(monkeypatch):
    """A seed that never reaches the target counts as infinitely slow; the ratio to sync is
    given for the wall time and for the training time (evaluations paused out) apart."""
    monkeypatch.syspath_prepend(str(REPO))
    from benchmarks.speed import accuracy_summary

    def run(variant: str, seed: int, wall: float | None, train: float | None) -> dict:
        return {"model": "cnn", "variant": variant, "seed": seed, "seconds_to_target": wall,
                "train_seconds_to_target": train, "final_accuracy": 0.96,
                "train_samples_per_s": 100.0}

    runs = [run("sync", 0, 10.0, 8.0), run("sync", 1, 12.0, 10.0), run("sync", 2, 30.0, 20.0),
            run("async-predict", 0, 9.0, 6.0), run("async-predict", 1, None, None),
            run("async-predict", 2, 11.0, 7.0)]
    rows = accuracy_summary(runs)["cnn"]
    assert rows["sync"]["median_seconds_to_target"] == 12.0
    assert rows["async-predict"]["median_train_seconds_to_target"] == 7.0
    assert rows["async-predict"]["time_vs_sync"] == round(11.0 / 12.0, 3)
    assert rows["async-predict"]["train_time_vs_sync"] == 0.7
    assert rows["async-predict"]["reached"] == 2


def test_training_time_to_an_evaluation_leaves_the_evaluations_before_it_out(monkeypatch):
    monkeypatch.syspath_prepend(str(REPO))
    from benchmarks.speed import training_seconds

    # steps end at 1, 2, 3 s; the evaluation after step 1 (of 2 steps done) takes 0.5 s, so
    # step 2 ends at 3.5 s; the one after step 3 takes 0.2 s
    history = [(0, 1.0), (1, 2.0), (2, 3.5), (3, 4.5)]
    evals = [{"step": 2, "t": 2.5}, {"step": 4, "t": 4.7}]
    assert training_seconds(evals, history) == [1.0, 3.0]


def test_checkpoints_evaluated_after_a_run_keep_the_run_s_times(monkeypatch, tmp_path):
    """Each checkpoint's point: the wall time to the end of the step that made it, with the
    run's own evaluations before it in the wall time and out of the training time, its epoch,
    and its accuracy as the project's evaluate gives it; an in-run evaluation at a step no
    checkpoint has is a point too."""
    monkeypatch.syspath_prepend(str(REPO))
    from benchmarks.speed import offline_points
    from ftpipe_iot.artifacts.checkpoint import save_checkpoint
    from ftpipe_iot.artifacts.evaluate import evaluate
    from ftpipe_iot.core.data import load_dataset
    from ftpipe_iot.core.models import build_layers
    from ftpipe_iot.protocol.plan import TrainConfig
    from ftpipe_iot.protocol.specs import DataSpec, ModelSpec

    data = load_dataset(DataSpec("digits"))
    train = TrainConfig(model=ModelSpec("mlp"))
    for step, seed in ((0, 0), (2, 1), (4, 2)):
        layers = build_layers(train.model, data.input_shape, data.num_classes, seed=seed)
        save_checkpoint(tmp_path / f"step-{step:07d}.pt",
                        {i: {k: v.detach().numpy().copy() for k, v in layer.state_dict().items()}
                         for i, layer in enumerate(layers)},
                        train, data.input_shape, data.num_classes, step)
    # steps end at 1, 2, 3.5, 4.5 s; the run evaluated at the end of its first epoch (2 steps)
    # for 0.5 s
    history = [(0, 1.0), (1, 2.0), (2, 3.5), (3, 4.5)]
    evals = [{"step": 2, "t": 2.5, "end_of_epoch": True, "test_accuracy": 0.5},
             {"step": 3, "t": 3.7, "end_of_epoch": True, "test_accuracy": 0.25}]
    points = offline_points(tmp_path, "digits", evals, history)
    assert [(p["step"], p["epoch"], p["t"], p["train_s"]) for p in points] == \
        [(2, 0, 1.0, 1.0), (3, 1, 2.5, 2.0), (4, 2, 3.5, 2.8)]
    assert points[1]["accuracy"] == 0.25  # the run's own evaluation: no checkpoint at step 3
    assert points[2]["accuracy"] == evaluate(tmp_path / "step-0000004.pt",
                                             DataSpec("digits")).accuracy
    assert points[0]["accuracy"] != points[2]["accuracy"]


def test_the_convergence_benchmark_evaluates_the_simulator_as_the_fleet_does(monkeypatch):
    """Evaluating in the simulator's step hook changes no weight and no BatchNorm statistic:
    the job trained with the evaluations equals the one without, bit for bit, and they come
    at the epochs' ends and every 5 steps."""
    monkeypatch.syspath_prepend(str(REPO))
    from benchmarks.async_convergence import accuracy, run, summarise
    from ftpipe_iot.core.data import DataSpec, load_dataset
    from ftpipe_iot.core.models import ModelSpec
    from ftpipe_iot.core.reference import train_reference
    from ftpipe_iot.protocol.plan import TrainConfig
    from ftpipe_iot.protocol.vocab import ScheduleName

    data = load_dataset(DataSpec("synthetic", shape=(3, 32, 32), samples=160))
    config = TrainConfig(model=ModelSpec("mobilenetv2", width=0.25), micro_batches=4,
                         micro_batch_size=8, schedule=ScheduleName.ASYNC, evaluate_every=5)
    evaluations = run(config, data, 12, stage_starts=(0, 2))
    per_epoch = len(data.x_train) // 32
    assert [done for done, _ in evaluations] == \
        [d for d in range(1, 13) if d % per_epoch == 0 or d % 5 == 0 or d == 12]
    assert all(0.0 <= acc <= 1.0 for _, acc in evaluations)
    quiet = train_reference(config, data, 12, stages_from=[(0, (0, 2))])
    evaluated = train_reference(config, data, 12, stages_from=[(0, (0, 2))],
                                after_step=lambda step, layers: accuracy(layers, data))
    assert all((quiet[i][k] == evaluated[i][k]).all() for i in range(len(quiet))
               for k in quiet[i])
    rows = summarise([{"variant": "sync", "steps_to_target": 20, "final_accuracy": 0.9},
                      {"variant": "async-predict", "steps_to_target": 30,
                       "final_accuracy": 0.9}], 0.95)
    assert rows["async-predict"]["steps_vs_sync"] == 1.5


def test_jobs_side_by_side_are_compared_over_the_window_both_trained(monkeypatch):
    """Each job's warm-up is left out, and only the step ends inside the window in which every
    job trained count: a job that goes on alone after the other stopped is not compared
    there."""
    monkeypatch.syspath_prepend(str(REPO))
    from benchmarks.harness import rates_side_by_side

    # job a: a step every 0.5 s from t = 10; job b, started 2 s later, a step a second from
    # its own t = 9 (t = 11 on a's clock) to 30 steps, running on alone after a stops
    a = (100.0, [(k, 10 + 0.5 * k) for k in range(20)])
    b = (102.0, [(k, 9 + 1.0 * k) for k in range(30)])
    rates = rates_side_by_side({"a": a, "b": b}, skip=2)
    # the window: from b's third step end (t = 113) to a's last (t = 119.5)
    assert rates["window_s"] == 6.5
    assert rates["steps_per_s"]["a"] == pytest.approx(2.0)
    assert rates["steps_per_s"]["b"] == pytest.approx(1.0)
    with pytest.raises(ValueError, match="run longer jobs"):
        rates_side_by_side({"a": a, "b": (130.0, b[1])}, skip=0)


def test_side_by_side_rounds_on_two_layouts_are_set_apart(monkeypatch):
    """A round whose two jobs laid out differently compares layouts: it counts among all
    rounds, not among the rounds on one layout."""
    monkeypatch.syspath_prepend(str(REPO))
    import benchmarks.signing as signing

    data = [["dev0", "dev1"]]
    pipeline = [["dev0"], ["dev1"], ["dev2"]]
    swapped = [["dev1"], ["dev0"], ["dev2"]]  # the same shape on identical devices
    rounds = [{"cost_pct": 4.0, "layouts": {"signed": pipeline, "unsigned": swapped}},
              {"cost_pct": 20.0, "layouts": {"signed": pipeline, "unsigned": data}},
              {"cost_pct": 2.0, "layouts": {"signed": data, "unsigned": data}}]
    summary = signing.side_by_side_summary(rounds)
    assert summary["median_cost_pct"] == 4.0
    assert summary["rounds_on_one_layout"] == 2
    assert summary["one_layout_mean_cost_pct"] == 3.0
