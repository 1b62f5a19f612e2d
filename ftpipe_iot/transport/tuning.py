"""Process settings for moving large messages through paho-mqtt (docs/design.md §12).

Two costs dominate a process that receives megabytes per second on paho's network thread and
decodes them on a worker thread, and neither is the decoding itself:

- Page faults. glibc serves every allocation above its mmap threshold (128 KiB at start) with a
  fresh ``mmap`` and gives it back on free, so every socket read into a large buffer, every
  chunk and every reassembled tensor touches new zeroed pages. Raising the threshold and the
  trim threshold keeps those buffers in the heap and reuses them; the price is that up to
  ``trim_threshold`` bytes of freed memory stay mapped by the process.
- The GIL hand-over. A thread coming back from a socket call waits for the running thread to
  drop the GIL, by default up to 5 ms; a network thread doing hundreds of socket calls per
  second then waits behind the worker most of the time. A shorter switch interval bounds it.

Both are process-wide: the process entry points call :func:`tune_for_large_messages` once.
"""

from __future__ import annotations

import ctypes
import logging
import sys

log = logging.getLogger(__name__)

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
# glibc's upper bound for the mmap threshold on 64-bit systems.
MMAP_THRESHOLD_BYTES = 32 * 1024 * 1024
TRIM_THRESHOLD_BYTES = 64 * 1024 * 1024
SWITCH_INTERVAL_S = 0.0005


def tune_for_large_messages(mmap_threshold: int = MMAP_THRESHOLD_BYTES,
                            trim_threshold: int = TRIM_THRESHOLD_BYTES,
                            switch_interval_s: float = SWITCH_INTERVAL_S) -> bool:
    """Apply both settings; returns whether the allocator part took effect (glibc only)."""
    sys.setswitchinterval(switch_interval_s)
    try:
        libc = ctypes.CDLL(None)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False  # not glibc (musl, macOS): the allocator keeps its defaults
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    done = bool(mallopt(_M_MMAP_THRESHOLD, mmap_threshold)) and \
        bool(mallopt(_M_TRIM_THRESHOLD, trim_threshold))
    if not done:
        log.info("mallopt refused the large-message settings; keeping the allocator defaults")
    return done
