"""How long a device's incoming pipeline messages take to move (reported in heartbeats)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class LinkMeter:
    """One-way latency of incoming pipeline messages from the sender's timestamp (hosts keep NTP
    time) and the array bytes they carried, both exponentially smoothed."""

    smoothing: float = 0.2
    latency_s: float = 0.0
    bytes_per_s: float = 0.0
    samples: int = 0

    def observe(self, sent_at: float, n_bytes: int, now: float) -> None:
        """Fold in one message sent at ``sent_at`` carrying ``n_bytes`` of arrays."""
        latency = max(now - sent_at, 1e-4)
        rate = n_bytes / latency
        if self.samples == 0:
            self.latency_s, self.bytes_per_s = latency, rate
        else:
            a = self.smoothing
            self.latency_s = a * latency + (1 - a) * self.latency_s
            self.bytes_per_s = a * rate + (1 - a) * self.bytes_per_s
        self.samples += 1
