"""``python benchmarks/cpu_profile.py OUT.prof ARGS...`` runs ``python -m ftpipe_iot ARGS`` with
its main thread profiled in CPU seconds (``time.thread_time``: waiting for a core on a busy
host is not counted) from the moment a device builds its stage until the process exits, so
imports and start-up stay out of the breakdown (a controller: from the start of training;
benchmarks/speed.py reads the file)."""

from __future__ import annotations

import cProfile
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from ftpipe_iot.cli import main  # noqa: E402
from ftpipe_iot.control.controller import Controller  # noqa: E402
from ftpipe_iot.device.agent import DeviceAgent  # noqa: E402


def run() -> None:
    out, sys.argv = sys.argv[1], [sys.argv[0], *sys.argv[2:]]
    profiler = cProfile.Profile(time.thread_time)
    state = {"on": False}

    def profiled(method):  # type: ignore[no-untyped-def]
        def wrapper(self, *args):  # type: ignore[no-untyped-def]
            method(self, *args)
            if not state["on"]:
                state["on"] = True
                profiler.enable()
        return wrapper

    DeviceAgent._build_stage = profiled(DeviceAgent._build_stage)  # type: ignore[method-assign]
    Controller._start_training = profiled(Controller._start_training)  # type: ignore[method-assign]
    try:
        main()
    finally:
        profiler.disable()
        profiler.dump_stats(out)


if __name__ == "__main__":
    run()
