"""``--wire-codec auto``: the codec of every cut and direction, chosen from the links of the
cut's two ends, the bytes crossing it and an accuracy budget (pure; docs/design.md §4,
"Codecs").

Cost model (``planning.solver``'s, per micro-batch): stage ``k`` held by device ``d`` (share
``s`` of the micro-batches) is busy ``s * (d.factor * compute_k + moved_k / d.bandwidth)``,
where ``moved_k`` is what crosses its cuts: on the cut before it the activation it receives and
the gradient it sends back, on the cut after it the activation it sends and the gradient it
receives, each at its codec's ``bytes_per_value`` over float32's 4. The step time is the
slowest stage's. A codec changes only the link part, so on a compute-bound pipeline (or on
fast links) nothing is worth coding.

Accuracy: each coded (cut, direction) spends the codec's measured cost in that direction
(``planning.codec_costs``); their sum must stay within the budget.

Choice: the shortest step time any assignment within the budget reaches, found exactly (a
chain DP over the cuts: cut ``k`` touches stages ``k`` and ``k + 1`` only; for a bound ``T`` it
gives the least accuracy cost with every stage within ``T``, and the candidate bounds are the
finitely many stage times). Gains under ``min_gain`` of the step are not worth any accuracy,
so the least-cost assignment within ``(1 + min_gain)`` of that shortest step is taken; ties go
to the less lossy codec (``none`` over fp16 over int8 over int4).
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import product

from ftpipe_iot.errors import PartitionError
from ftpipe_iot.planning.codec_costs import CodecCosts
from ftpipe_iot.planning.costs import DeviceSpec, LayerCosts
from ftpipe_iot.protocol.codecs import bytes_per_value
from ftpipe_iot.protocol.plan import CutCodecs
from ftpipe_iot.protocol.vocab import CutDirection, WireCodec

#: A step shorter by less than this share is not worth any accuracy.
DEFAULT_MIN_GAIN = 0.01
#: The default accuracy budget of ``--codec-accuracy-budget``, in points of test accuracy.
DEFAULT_BUDGET_POINTS = 0.5

_PAIRS = tuple(CutCodecs(f, b) for f, b in product(WireCodec, WireCodec))


def wire_factor(codec: WireCodec) -> float:
    """Bytes on the wire per byte of a float32 value under ``codec``."""
    return bytes_per_value(codec) / bytes_per_value(WireCodec.NONE)


def priced(costs: LayerCosts, cuts: Sequence[int], codecs: Sequence[CutCodecs]) -> LayerCosts:
    """``costs`` with every cut priced at its codecs: ``cuts`` are the first layers of the
    stages after the first (``Plan.cuts``), ``codecs`` one pair per cut (``Plan.wire``)."""
    if len(cuts) != len(codecs):
        raise PartitionError(f"{len(codecs)} codec pair(s) for {len(cuts)} cut(s)")
    return costs.with_cut_factors({layer - 1: (wire_factor(c.forward), wire_factor(c.backward))
                                   for layer, c in zip(cuts, codecs, strict=True)})


@dataclass(frozen=True)
class StageHolders:
    """One stage as the codec choice sees it: its layers and its computing devices with their
    shares of the micro-batches (one device: share 1)."""

    start: int
    end: int
    holders: tuple[tuple[DeviceSpec, float], ...]


@dataclass(frozen=True)
class CutDecision:
    """Why one cut got its codecs: the bytes of its activation (and gradient) per micro-batch
    exact and as coded, and the accuracy the codecs spend."""

    cut: int  # between stages cut and cut + 1
    layer: int  # the first layer after the cut
    codecs: CutCodecs
    exact_bytes: float  # one direction, float32
    forward_bytes: float
    backward_bytes: float
    accuracy_points: float

    @property
    def saved_bytes(self) -> float:
        """Bytes per micro-batch the codecs save on this cut, both directions."""
        return 2 * self.exact_bytes - self.forward_bytes - self.backward_bytes

    def to_dict(self) -> dict[str, object]:
        return {"cut": self.cut, "layer": self.layer, **self.codecs.to_dict(),
                "exact_bytes": self.exact_bytes, "forward_bytes": self.forward_bytes,
                "backward_bytes": self.backward_bytes, "saved_bytes": self.saved_bytes,
                "accuracy_points": self.accuracy_points}


@dataclass(frozen=True)
class CodecChoice:
    """The codecs of every cut, the step (seconds per micro-batch, the slowest stage) exact
    and with them, and the accuracy they spend of the budget."""

    cuts: tuple[CutDecision, ...]
    exact_step_s: float
    step_s: float
    accuracy_points: float
    budget_points: float
    source: str = ""  # the command that measured the accuracy costs

    @property
    def codecs(self) -> tuple[CutCodecs, ...]:
        """One pair per cut, in cut order (``Plan.cut_codecs``)."""
        return tuple(c.codecs for c in self.cuts)

    def describe(self) -> list[str]:
        """Lines for a person: the choice per cut and direction, and why."""
        lines = [f"wire codecs (auto, accuracy budget {self.budget_points:g} points): step "
                 f"{self.exact_step_s:.4f} s exact -> {self.step_s:.4f} s per micro-batch, "
                 f"{self.accuracy_points:.2f} points spent"]
        for c in self.cuts:
            lines.append(
                f"  cut {c.cut} (before layer {c.layer}): forward {c.codecs.forward.value}, "
                f"backward {c.codecs.backward.value}; {c.exact_bytes / 1e3:.1f} kB each way "
                f"exact, {c.forward_bytes / 1e3:.1f} + {c.backward_bytes / 1e3:.1f} kB coded "
                f"({c.saved_bytes / 1e3:.1f} kB saved per micro-batch), "
                f"{c.accuracy_points:.2f} points")
        if self.source:
            lines.append(f"  accuracy costs measured by: {self.source}")
        return lines

    def to_dict(self) -> dict[str, object]:
        return {"cuts": [c.to_dict() for c in self.cuts], "exact_step_s": self.exact_step_s,
                "step_s": self.step_s, "accuracy_points": self.accuracy_points,
                "budget_points": self.budget_points, "source": self.source}


class _Problem:
    """The chain of stages and cuts with every stage's time under every codec pair of its two
    cuts, for the DP."""

    def __init__(self, costs: LayerCosts, stages: Sequence[StageHolders],
                 accuracy: CodecCosts) -> None:
        self.costs, self.stages = costs, list(stages)
        self.n_cuts = len(self.stages) - 1
        self.exact = [costs.activation_bytes[s.start - 1] for s in self.stages[1:]]
        self.pair_cost = {p: (accuracy.cost(p.forward, CutDirection.FORWARD)
                              + accuracy.cost(p.backward, CutDirection.BACKWARD),
                              # ties: the less lossy pair (more bytes)
                              -bytes_per_value(p.forward) - bytes_per_value(p.backward))
                          for p in _PAIRS}
        self.pairs = [p for p in _PAIRS if math.isfinite(self.pair_cost[p][0])]
        self._times: dict[tuple[int, CutCodecs | None, CutCodecs | None], float] = {}

    def moved(self, cut: int, pair: CutCodecs) -> float:
        return self.exact[cut] * (wire_factor(pair.forward) + wire_factor(pair.backward))

    def stage_s(self, k: int, before: CutCodecs | None, after: CutCodecs | None) -> float:
        key = (k, before, after)
        if key not in self._times:
            stage = self.stages[k]
            compute = self.costs.stage_cost_s(stage.start, stage.end)
            moved = (self.moved(k - 1, before) if before is not None else 0.0) + \
                (self.moved(k, after) if after is not None else 0.0)
            self._times[key] = max(share * (d.factor * compute + moved / d.bandwidth_bytes_per_s)
                                   for d, share in stage.holders)
        return self._times[key]

    def options(self, k: int) -> list[tuple[CutCodecs | None, CutCodecs | None]]:
        """The codec pairs of stage ``k``'s cut before and after (None: no cut there)."""
        before = self.pairs if k > 0 else [None]
        after = self.pairs if k < self.n_cuts else [None]
        return [(b, a) for b in before for a in after]

    def step_s(self, codecs: Sequence[CutCodecs]) -> float:
        return max(self.stage_s(k, codecs[k - 1] if k > 0 else None,
                                codecs[k] if k < self.n_cuts else None)
                   for k in range(len(self.stages)))

    def cheapest(self, bound: float) -> tuple[tuple[float, float], tuple[CutCodecs, ...]] | None:
        """The least (accuracy, lossiness) assignment with every stage within ``bound``."""
        inf = (math.inf, math.inf)
        # best[p]: the least cost of cuts 0..k with cut k at pair p, stages 0..k within bound
        best: dict[CutCodecs, tuple[tuple[float, float], tuple[CutCodecs, ...]]] = {}
        for p in self.pairs:
            if self.stage_s(0, None, p) <= bound:
                best[p] = (self.pair_cost[p], (p,))
        for k in range(1, self.n_cuts):
            step: dict[CutCodecs, tuple[tuple[float, float], tuple[CutCodecs, ...]]] = {}
            for p in self.pairs:
                chosen = min(((cost, path) for q, (cost, path) in best.items()
                              if self.stage_s(k, q, p) <= bound),
                             key=lambda item: item[0], default=None)
                if chosen is not None:
                    cost, path = chosen
                    step[p] = ((cost[0] + self.pair_cost[p][0], cost[1] + self.pair_cost[p][1]),
                               (*path, p))
            best = step
        last = len(self.stages) - 1
        final = [(cost, path) for p, (cost, path) in best.items()
                 if self.stage_s(last, p, None) <= bound]
        if not final:
            return None
        cost, path = min(final, key=lambda item: item[0])
        return (cost, path) if cost < inf else None


def choose_codecs(costs: LayerCosts, stages: Sequence[StageHolders], accuracy: CodecCosts,
                  budget_points: float = DEFAULT_BUDGET_POINTS,
                  min_gain: float = DEFAULT_MIN_GAIN) -> CodecChoice:
    """The codecs of every cut of ``stages`` (module docstring). ``costs.activation_bytes``
    are float32 bytes (its own ``wire_factor`` is ignored: the codecs are what is chosen)."""
    if not math.isfinite(budget_points) or budget_points < 0:
        raise PartitionError(f"the codec accuracy budget must be >= 0 points, got "
                             f"{budget_points}")
    if not 0 <= min_gain < 1:
        raise PartitionError(f"min_gain must be in [0, 1), got {min_gain}")
    if not stages:
        raise PartitionError("choosing codecs needs at least one stage")
    problem = _Problem(costs, stages, accuracy)
    exact = (CutCodecs(),) * problem.n_cuts
    exact_s = problem.step_s(exact)
    if problem.n_cuts == 0:
        return CodecChoice((), exact_s, exact_s, 0.0, budget_points, accuracy.source)
    bounds = sorted({problem.stage_s(k, b, a) for k in range(len(problem.stages))
                     for b, a in problem.options(k)})
    # the least bound within budget: the DP's least cost only falls as the bound grows
    lo, hi = 0, bisect.bisect_right(bounds, exact_s) - 1  # the exact wire fits at exact_s

    def fits(index: int) -> bool:
        found = problem.cheapest(bounds[index])
        return found is not None and found[0][0] <= budget_points + 1e-9

    while lo < hi:
        mid = (lo + hi) // 2
        if fits(mid):
            hi = mid
        else:
            lo = mid + 1
    found = problem.cheapest(bounds[lo] * (1 + min_gain))
    assert found is not None  # the bound at lo fits, a looser one too
    (points, _), codecs = found
    decisions = tuple(CutDecision(
        k, problem.stages[k + 1].start, pair, problem.exact[k],
        problem.exact[k] * wire_factor(pair.forward), problem.exact[k] *
        wire_factor(pair.backward), problem.pair_cost[pair][0]) for k, pair in enumerate(codecs))
    return CodecChoice(decisions, exact_s, problem.step_s(codecs), points, budget_points,
                       accuracy.source)
