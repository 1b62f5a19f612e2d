"""Busy time and micro-batch latency of every layer range on a device group, vectorised (pure).

The group planner's searches (``group_search``) evaluate thousands of (group, range) pairs; this
module computes, for one group at once and for every range ``[s, e)``, the stage's ``T`` and ``b``
of the cost model in ``ftpipe_iot.planning.groups`` with numpy. Tables are cached by the
members' specifications, so groups made of identical devices (a fleet of a few device classes)
share one computation.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ftpipe_iot.planning.costs import DeviceSpec, LayerCosts
from ftpipe_iot.planning.groups import GradientExchange

# A budget equal to the summed memory must fit despite prefix-sum rounding (as in solver.py).
_MEM_TOL = 1e-12

SpecKey = tuple[float, float, float]


class GroupTables:
    """``busy[s, e]`` (``T``, seconds per step) and ``latency[s, e]`` (``b``, seconds per
    micro-batch) of layers ``[s, e)`` on a group, inf where the range is empty, does not fit a
    member's memory or the group has more members than micro-batches.

    ``limit`` (seconds per step) lets a search skip work: a range whose busy time provably
    exceeds it (by the bound ``max(max t, M / sum(1 / t_i))``) may be reported as inf, as no
    plan with a step time within the limit can use it. A search may only lower the limit
    (tables computed earlier under a higher one stay valid).
    """

    def __init__(self, costs: LayerCosts, devices: Sequence[DeviceSpec], micro_batches: int,
                 exchange: GradientExchange = GradientExchange.SUMS):
        n = costs.n_layers
        self.exchange = exchange
        self.n_layers = n
        self.micro_batches = micro_batches
        self.devices = list(devices)
        prefix = np.concatenate([[0.0], np.cumsum(costs.layer_cost_s)])
        self._span = prefix[None, :] - prefix[:, None] + costs.stage_overhead_s
        self._span[:, n] += costs.head_overhead_s
        mem_prefix = np.concatenate([[0.0], np.cumsum(costs.layer_memory_bytes)])
        self._memory = mem_prefix[None, :] - mem_prefix[:, None]
        params = costs.param_bytes or (0.0,) * n
        param_prefix = np.concatenate([[0.0], np.cumsum(params)])
        self._params = param_prefix[None, :] - param_prefix[:, None]
        act = np.asarray(costs.activation_bytes, dtype=float) * np.asarray(costs.mean_factors())
        # cut[i]: bytes crossing the cut before layer i, as a stage's input (s = i) or output
        # (e = i); the model input (i = 0) and the loss (i = n) cross no cut.
        cut = np.concatenate([[0.0], act[:-1], [0.0]])
        self._moved = 2.0 * (cut[:, None] + cut[None, :])
        #: Reference compute of the whole model and the mean bytes at a cut (for rough orders).
        self.model_cost_s = float(self._span[0, n])
        self.mean_cut_bytes = float(act[:-1].mean()) if n > 1 else 0.0
        self._rows, self._cols = np.triu_indices(n + 1, k=1)  # every non-empty range
        self._span_r = self._span[self._rows, self._cols]
        self._moved_r = self._moved[self._rows, self._cols]
        self._params_r = self._params[self._rows, self._cols]
        self._memory_r = self._memory[self._rows, self._cols]
        self.limit = np.inf
        self.keys: list[SpecKey] = [(d.factor, d.bandwidth_bytes_per_s, d.memory_bytes)
                                    for d in self.devices]
        self._cache: dict[tuple[SpecKey, ...], tuple[np.ndarray, np.ndarray]] = {}

    def key(self, members: Sequence[int]) -> tuple[SpecKey, ...]:
        """What a group's tables depend on: its members' specifications, in any order."""
        return tuple(sorted(self.keys[i] for i in members))

    def get(self, members: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
        """``(busy, latency)`` tables of the group of device indices ``members``."""
        key = self.key(members)
        cached = self._cache.get(key)
        if cached is None:
            cached = self._cache[key] = self._compute(key)
        return cached

    def _compute(self, key: tuple[SpecKey, ...]) -> tuple[np.ndarray, np.ndarray]:
        g = len(key)
        busy = np.full(self._span.shape, np.inf)
        latency = np.full(self._span.shape, np.inf)
        if g > self.micro_batches:
            return busy, latency
        budget = min(k[2] for k in key)
        fits = np.flatnonzero(self._memory_r <= budget * (1 + _MEM_TOL))
        factor = np.array([k[0] for k in key])[:, None]
        bandwidth = np.array([k[1] for k in key])[:, None]
        times = factor * self._span_r[fits] + self._moved_r[fits] / bandwidth
        copies = self.exchange.copies(g, self.micro_batches)
        reduce = copies * self._params_r[fits] / float(bandwidth.min()) if g > 1 else 0.0
        if np.isfinite(self.limit):
            with np.errstate(divide="ignore", over="ignore"):
                rate = (1.0 / times).sum(axis=0)
            bound = np.maximum(times.max(axis=0), self.micro_batches / rate) + reduce
            useful = np.flatnonzero(bound <= self.limit * (1 + 1e-9))
            fits, times = fits[useful], times[:, useful]
            if g > 1:
                reduce = reduce[useful]
        where = self._rows[fits], self._cols[fits]
        busy[where] = min_max_work(times, self.micro_batches) + reduce
        latency[where] = times.max(axis=0)
        return busy, latency


def min_max_work(times: np.ndarray, micro_batches: int) -> np.ndarray:
    """``min over apportionments of max_i n_i * t_i`` for every column of ``times`` (members x
    ranges): the value of ``groups.apportion``'s counts, computed column-wise.

    The optimum is the smallest ``W >= max t`` with ``sum floor(W / t_i) >= M``. Start every
    member at ``floor(W0 / t_i)`` for the lower bound ``W0 = max(max t, M / sum(1 / t_i))``
    (those are exactly the multiples of ``t_i`` up to ``W0``, the smallest ones), which leaves
    at most one micro-batch per member to place; place those greedily.
    """
    top = times.max(axis=0)
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        rate = np.where(times > 0, 1.0 / times, np.inf).sum(axis=0)
        low = np.maximum(top, np.where(np.isinf(rate), 0.0, micro_batches / rate) * (1 - 1e-12))
        counts = np.where(times > 0, np.floor(low[None, :] / times), micro_batches)
    # No member ever needs more than M (a count of M alone already holds every micro-batch).
    counts = np.clip(counts, 1.0, micro_batches)
    # More than M counts only when W = max t holds them all; fewer leaves at most g to place.
    deficit = micro_batches - counts.sum(axis=0)
    columns = np.flatnonzero(deficit > 0)
    if columns.size:
        part_counts, part_times = counts[:, columns], times[:, columns]
        left = deficit[columns]
        following = (part_counts + 1) * part_times
        for step in range(int(left.max())):
            active = np.flatnonzero(left > step)
            pick = following[:, active].argmin(axis=0)
            part_counts[pick, active] += 1
            following[pick, active] = (part_counts[pick, active] + 1) * part_times[pick, active]
        counts[:, columns] = part_counts
    with np.errstate(invalid="ignore"):
        return np.where(times > 0, counts * times, 0.0).max(axis=0)
