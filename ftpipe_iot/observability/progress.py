"""Progress output for long runs: a tqdm bar on a terminal, periodic lines otherwise."""

from __future__ import annotations

import sys
import time
from typing import Protocol, TextIO


class ProgressReporter(Protocol):
    """Receives training progress from the controller."""

    def start(self, total_steps: int) -> None: ...

    def step(self, done: int, loss: float, samples_per_s: float) -> None: ...

    def message(self, text: str) -> None: ...

    def close(self) -> None: ...


class SilentProgress:
    """Reports nothing (library use, tests)."""

    def start(self, total_steps: int) -> None:
        pass

    def step(self, done: int, loss: float, samples_per_s: float) -> None:
        pass

    def message(self, text: str) -> None:
        pass

    def close(self) -> None:
        pass


class LineProgress:
    """One line every ``every_s`` seconds (logs, CI, pipes)."""

    def __init__(self, stream: TextIO = sys.stderr, every_s: float = 2.0) -> None:
        self.stream = stream
        self.every_s = every_s
        self.total = 0
        self._last = 0.0

    def start(self, total_steps: int) -> None:
        self.total = total_steps
        self._last = time.monotonic()

    def step(self, done: int, loss: float, samples_per_s: float) -> None:
        now = time.monotonic()
        if now - self._last >= self.every_s or done == self.total:
            self._last = now
            self.stream.write(f"step {done}/{self.total}  loss {loss:.4f}  "
                              f"{samples_per_s:.0f} samples/s\n")
            self.stream.flush()

    def message(self, text: str) -> None:
        self.stream.write(text + "\n")
        self.stream.flush()

    def close(self) -> None:
        pass


class TqdmProgress:
    """A tqdm progress bar over training steps."""

    def __init__(self, stream: TextIO = sys.stderr) -> None:
        self.stream = stream
        self.bar = None

    def start(self, total_steps: int) -> None:
        from tqdm import tqdm

        self.bar = tqdm(total=total_steps, unit="step", file=self.stream, dynamic_ncols=True,
                        mininterval=0.5)

    def step(self, done: int, loss: float, samples_per_s: float) -> None:
        if self.bar is not None:
            self.bar.update(done - self.bar.n)
            self.bar.set_postfix(loss=f"{loss:.3f}", sps=f"{samples_per_s:.0f}", refresh=False)

    def message(self, text: str) -> None:
        if self.bar is not None:
            self.bar.write(text, file=self.stream)
        else:
            self.stream.write(text + "\n")
            self.stream.flush()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None


def default_progress(stream: TextIO = sys.stderr) -> ProgressReporter:
    """tqdm on a terminal, periodic lines otherwise."""
    return TqdmProgress(stream) if stream.isatty() else LineProgress(stream)
