"""How the demo ends other than with a result, with real processes: Ctrl-C prints what was
done; no process of the demo outlives it by more than 1 s, whatever killed it; an error found
before start-up is the first and only error line; and the collaborative demo goes on when a
data device dies, naming the device left out."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from ftpipe_iot.artifacts.checkpoint import read_checkpoint

pytestmark = pytest.mark.slow


def _job() -> str:
    return f"stops-{uuid.uuid4().hex[:8]}"


def _processes_of(job: str, work_dir: Path) -> dict[int, str]:
    """Pids and command lines of the demo's children: its devices and controller (they carry
    ``--job JOB``) and its broker (its files are in the work dir); the demo itself excluded."""
    found: dict[int, str] = {}
    for pattern in (f"--job {job}", str(work_dir)):
        out = subprocess.run(["pgrep", "-af", "--", pattern], capture_output=True, text=True)
        for line in out.stdout.splitlines():
            pid, _, cmd = line.partition(" ")
            if "pgrep" not in cmd and "ftpipe_iot demo" not in cmd:
                found[int(pid)] = cmd
    return found


def _alive(pids: set[int]) -> set[int]:
    alive = set()
    for pid in pids:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            continue
        # A zombie (dead, not yet reaped by init) is gone for our purpose.
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state != "Z":
            alive.add(pid)
    return alive


def _gone_within(pids: set[int], seconds: float) -> set[int]:
    """The pids still alive ``seconds`` from now (polled: a process's death has no event we
    can wait on from outside)."""
    deadline = time.monotonic() + seconds
    left = _alive(pids)
    while left and time.monotonic() < deadline:
        time.sleep(0.02)
        left = _alive(left)
    return left


def _start(job: str, work_dir: Path, *args: str, until: str = "step ") -> subprocess.Popen:
    """A demo printing JSON; returns once a stderr line starts with ``until``."""
    proc = subprocess.Popen([sys.executable, "-m", "ftpipe_iot", "demo", "--json", "--job", job,
                             "--work-dir", str(work_dir), *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            stdin=subprocess.DEVNULL)
    seen = []
    assert proc.stderr is not None
    for line in proc.stderr:
        seen.append(line)
        if line.startswith(until):
            return proc
    proc.wait(10)
    raise AssertionError(f"demo ended before {until!r}:\n" + "".join(seen)[-3000:])


def test_ctrl_c_prints_the_summary_of_what_was_done_and_exits_130(tmp_path):
    job = _job()
    proc = _start(job, tmp_path, "--devices", "2", "--epochs", "50")
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err[-3000:]
    assert "interrupted after " in err and "Traceback" not in err
    # a stop the user asked for is not said as an error or a failure
    assert "ERROR" not in err and "FAILED" not in err and "Error:" not in err, err[-3000:]
    summary = json.loads(out.strip().splitlines()[-1])
    assert summary["interrupted"] is True and summary["steps"] > 0
    assert _processes_of(job, tmp_path) == {}


@pytest.mark.parametrize("how", ["kill-9", "double-ctrl-c"])
def test_no_process_of_the_demo_outlives_it_by_a_second(how, tmp_path):
    job = _job()
    proc = _start(job, tmp_path, "--devices", "2", "--epochs", "50")
    children = _processes_of(job, tmp_path)
    assert len(children) >= 4, children  # two devices, the controller and the broker
    if how == "kill-9":
        proc.kill()
    else:
        proc.send_signal(signal.SIGINT)
        time.sleep(0.2)  # the second Ctrl-C of a user who will not wait for the shutdown
        proc.send_signal(signal.SIGINT)
    proc.communicate(timeout=60)
    left = _gone_within(set(children), 1.0)
    assert not left, [children[p] for p in left]


@pytest.mark.parametrize("args, message", [
    (["--mode", "collaborative", "--split-point", "999"], "split point 999 is not usable"),
    (["--data", "npz:/nonexistent/shard.npz"], "data file /nonexistent/shard.npz does not exist"),
    (["--model", "no_such_module_here:build"], "cannot import user model module"),
])
def test_an_error_checkable_before_start_up_is_the_first_and_only_error(args, message,
                                                                         tmp_path):
    job = _job()
    result = subprocess.run([sys.executable, "-m", "ftpipe_iot", "demo", "--job", job,
                             "--work-dir", str(tmp_path), *args],
                            capture_output=True, text=True, timeout=120,
                            stdin=subprocess.DEVNULL)
    assert result.returncode == 1
    lines = result.stderr.strip().splitlines()
    assert lines[0].startswith("Error: ") and message in lines[0], result.stderr
    assert sum(line.startswith("Error:") for line in lines) == 1, result.stderr
    # Nothing was started: no logs of devices, no broker directory.
    assert not list(tmp_path.glob("*.log")) and not (tmp_path / "broker").exists()


def test_the_collaborative_demo_goes_on_without_a_killed_data_device(tmp_path):
    job = _job()
    # Slow data devices, so that rounds remain after the kill.
    profile = tmp_path / "slow.json"
    profile.write_text(json.dumps({"name": "slow", "factor": 6}))
    proc = _start(job, tmp_path / "run", "--mode", "collaborative", "--devices", "3",
                  "--epochs", "3", "--aggregate-every", "5", "--device-profile", str(profile),
                  until="round 2 ")
    victim = next(pid for pid, cmd in _processes_of(job, tmp_path / "run").items()
                  if "--name dev1 " in f"{cmd} ")
    os.kill(victim, signal.SIGKILL)  # as a user would, from another terminal
    out, err = proc.communicate(timeout=240)
    assert proc.returncode == 0, err[-3000:]
    summary = json.loads(out.strip().splitlines()[-1])
    collab = summary["collab"]
    assert summary["error"] is None and collab["rounds"] == 9
    assert "SIGKILL" in summary["exited"]["dev1"]
    left = collab["left_out"]["dev1"]
    assert left and left[-1] == 8 and list(left) == list(range(left[0], 9))
    assert all("dev1" not in collab["round_log"][r]["devices"] for r in left)
    assert set(collab["left_out"]) == {"dev1"}
    assert "dev1 left out of" in err and "goes on without it" in err
    # like every demo, it leaves the trained model as a standard checkpoint
    assert summary["model"] == str((tmp_path / "run" / "model.pt").resolve())
    assert read_checkpoint(summary["model"]).step == summary["steps"]
    assert _processes_of(job, tmp_path / "run") == {}


def test_the_collaborative_demo_survives_its_server_and_its_coordinator(tmp_path):
    """``--standby-server --standby-controller`` with the serving server SIGKILLed once a round
    is done and the coordinator once two are: the standby server serves on within the round,
    the standby coordinator takes the lease and redoes the round its leader died in, and the
    summary says who served which rounds."""
    job = _job()
    profile = tmp_path / "slow.json"
    profile.write_text(json.dumps({"name": "slow", "factor": 8}))
    result = subprocess.run(
        [sys.executable, "-m", "ftpipe_iot", "demo", "--json", "--job", job, "--work-dir",
         str(tmp_path / "run"), "--mode", "collaborative", "--devices", "2", "--max-steps", "12",
         "--aggregate-every", "3", "--device-profile", str(profile), "--standby-server",
         "--standby-controller", "--fault", "server-kill@round=1",
         "--fault", "controller-kill@round=2"],
        capture_output=True, text=True, timeout=240, stdin=subprocess.DEVNULL)
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads(result.stdout.strip().splitlines()[-1])
    collab = summary["collab"]
    assert summary["error"] is None and summary["steps"] == 12 and collab["rounds"] == 4
    assert summary["faults"] == ["server-kill@round=1", "controller-kill@round=2"]
    # the planner picks the server it measured faster to serve first
    first = collab["round_servers"][0][0]
    (then,) = {"server", "server1"} - {first}
    assert "SIGKILL" in summary["exited"][first] and collab["server"] == then
    # the standby server took over within a round (the second, unless the host was slow to
    # strike), or between two when the kill was noticed before the next round began; the
    # resumed coordinator carried the record on from the retained status
    servers = collab["round_servers"]
    took = servers.index([first, then]) if [first, then] in servers else servers.index([then])
    both = servers[took] == [first, then]
    assert took >= 1 and servers == \
        [[first]] * took + ([[first, then]] if both else [[then]]) + [[then]] * (3 - took)
    # the coordinator died in round 3 (redone from its start) or between rounds (none to redo)
    assert collab["resumed_at_round"] >= 2
    err = result.stderr
    assert ("redone from its start" in err) is collab["redone_round"]
    assert f"standby {then} takes over" in err and "the standby coordinator takes over" in err
    last_first = took + 1 if both else took
    assert f"served by: {first} rounds 1-{last_first}, {then} rounds {took + 1}-4" in err
    assert read_checkpoint(summary["model"]).step == 12
    assert _processes_of(job, tmp_path / "run") == {}
