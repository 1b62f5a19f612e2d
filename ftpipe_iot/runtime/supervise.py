"""Starting and stopping ``ftpipe-iot`` processes on this machine: the demo, the benchmarks and
the tests all run their brokers' clients through here.

Every child runs in its own session (so a signal to its process group reaches everything it
started) and, on Linux, is killed when its parent dies (PR_SET_PDEATHSIG, SIGKILL): no
orphans, even after kill -9 of the parent. Devices and controllers sign their messages with keys
the group makes in ``<log_dir>/keys`` (unless they were given a bundle or keys of their own), or
run unsigned where the group is told so.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import IO

from ftpipe_iot.runtime.keys import LocalKeys

_PR_SET_PDEATHSIG = 1
# Subcommands that sign and verify, and the options with which a caller chose keys itself.
_SIGNING_COMMANDS = ("device", "controller")
_OWN_KEYS = ("--config", "--signing-key", "--insecure-unsigned")


def _die_with_parent(parent: int) -> None:
    # SIGKILL, not SIGTERM: the parent is gone only when it could not stop its children itself
    # (kill -9, a crash, a second Ctrl-C), and then nobody waits for a clean shutdown any more;
    # a SIGTERM'd device or controller took seconds to flush and disconnect.
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except OSError:
        return  # not Linux: the supervisor's own cleanup still applies
    if os.getppid() != parent:
        os._exit(1)  # the parent died before the request was in place: nobody would kill us


def child_setup(netns: str | None = None) -> Callable[[], None]:
    """What a child runs before exec: die with the parent and, if given, enter the network
    namespace ``netns`` (runtime/netns.py)."""
    parent = os.getpid()

    def setup() -> None:
        _die_with_parent(parent)
        if netns is not None:
            from ftpipe_iot.runtime.netns import enter

            enter(netns)
    return setup


def spawn_cli(args: list[str], stderr: IO | int | None = None,
              stdout: IO | int | None = subprocess.DEVNULL,
              netns: str | None = None) -> subprocess.Popen:
    """``python -m ftpipe_iot ARGS`` in its own session, tied to this process's life, inside
    the network namespace ``netns`` when given."""
    return subprocess.Popen([sys.executable, "-m", "ftpipe_iot", *args],
                            stdin=subprocess.DEVNULL, stdout=stdout, stderr=stderr,
                            text=stdout == subprocess.PIPE, start_new_session=True,
                            preexec_fn=child_setup(netns))


def signal_group(proc: subprocess.Popen, sig: int) -> bool:
    """Send ``sig`` to the child's process group; False when it is already gone."""
    try:
        os.killpg(proc.pid, sig)
    except ProcessLookupError:
        return False
    return True


def stop_process_groups(procs: Iterable[subprocess.Popen], grace_s: float = 5.0) -> None:
    """Stop children started with ``spawn_cli``: SIGCONT (a stopped process ignores TERM),
    SIGTERM to each process group, SIGKILL what is left after ``grace_s``."""
    procs = list(procs)
    for proc in procs:
        if proc.poll() is None:
            signal_group(proc, signal.SIGCONT)
            signal_group(proc, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    try:
        for proc in procs:
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                signal_group(proc, signal.SIGKILL)
                proc.wait()
    except KeyboardInterrupt:
        # A second Ctrl-C while the children shut down: the user will not wait, so nothing
        # the children would still do is worth outliving us.
        kill_process_groups(procs)
        raise


def kill_process_groups(procs: Iterable[subprocess.Popen]) -> None:
    """SIGKILL every child's process group and reap the children (no clean shutdown)."""
    procs = list(procs)
    for proc in procs:
        if proc.poll() is None:
            signal_group(proc, signal.SIGKILL)
    for proc in procs:
        proc.wait()


class ProcessGroup:
    """Named ``ftpipe-iot`` child processes, each with its stderr in ``<log_dir>/<name>.log``.
    ``signed`` False starts devices and controllers with ``--insecure-unsigned``."""

    def __init__(self, log_dir: Path, signed: bool = True) -> None:
        self.log_dir = Path(log_dir)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.procs: dict[str, subprocess.Popen] = {}
        self._logs: dict[str, IO] = {}
        self.signed = signed
        self._keys: LocalKeys | None = None

    @property
    def keys(self) -> LocalKeys:
        """The run's keys (made on first use)."""
        if self._keys is None:
            self._keys = LocalKeys(self.log_dir / "keys")
        return self._keys

    def signing_args(self, args: list[str]) -> list[str]:
        """The key options a child of ``args`` needs (none when it brings its own)."""
        if not args or args[0] not in _SIGNING_COMMANDS or any(a in args for a in _OWN_KEYS):
            return []
        if not self.signed:
            return ["--insecure-unsigned"]
        if args[0] == "controller":
            return self.keys.args("controller")
        return self.keys.args(args[args.index("--name") + 1])

    def start(self, name: str, *args: str, stdout: IO | int | None = subprocess.DEVNULL,
              log: bool = True, netns: str | None = None) -> subprocess.Popen:
        """Start (or restart, under the same name) one child, in network namespace ``netns``
        when given; ``log=False`` keeps its stderr on this process's stderr (for a child whose
        output the user should see)."""
        self._close_log(name)
        stderr = None
        if log:
            stderr = self._logs[name] = open(self.log_path(name), "w")  # noqa: SIM115
        argv = list(args)
        argv[1:1] = self.signing_args(argv)
        proc = spawn_cli(argv, stderr=stderr, stdout=stdout, netns=netns)
        self.procs[name] = proc
        return proc

    def log_path(self, name: str) -> Path:
        return self.log_dir / f"{name}.log"

    def log(self, name: str) -> str:
        path = self.log_path(name)
        return path.read_text() if path.exists() else ""

    def signal(self, name: str, sig: int) -> bool:
        """Send ``sig`` to a child's process group; False when it is not running."""
        proc = self.procs.get(name)
        return proc is not None and proc.poll() is None and signal_group(proc, sig)

    def wait(self, name: str, timeout_s: float) -> int:
        """Wait for a child's exit code; raises ``subprocess.TimeoutExpired``."""
        return self.procs[name].wait(timeout_s)

    def stop(self, names: Iterable[str], grace_s: float = 5.0) -> None:
        """Stop the named children (``stop_process_groups``) and leave the others running."""
        stop_process_groups([self.procs[n] for n in names if n in self.procs], grace_s)

    def stop_all(self, grace_s: float = 5.0) -> None:
        """Stop every child (``stop_process_groups``) and close their logs."""
        stop_process_groups(self.procs.values(), grace_s)
        for proc in self.procs.values():
            if proc.stdout:
                proc.stdout.close()
        for name in list(self._logs):
            self._close_log(name)

    def _close_log(self, name: str) -> None:
        log = self._logs.pop(name, None)
        if log is not None:
            log.close()
