"""Federated averaging of model parts, weighted by the devices' sample counts (pure numpy).

FedAvg (McMahan et al.): the new global value of every tensor is ``sum_k n_k w_k / sum_k n_k``
over the updates that hold it. Sums run in float64 and in a fixed order (by device name), so the
result does not depend on the order in which updates arrived.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from ftpipe_iot.errors import CollabError

State = Mapping[str, np.ndarray]


def weighted_mean(states: Sequence[tuple[int, State]]) -> dict[str, np.ndarray]:
    """The sample-weighted mean of several copies of one layer's state.

    Floating-point tensors are averaged; integer tensors (BatchNorm's ``num_batches_tracked``)
    are counters, not weights, and take the largest value.
    """
    if not states:
        raise CollabError("FedAvg of no updates")
    total = sum(weight for weight, _ in states)
    if total <= 0 or any(weight <= 0 for weight, _ in states):
        raise CollabError(f"FedAvg weights must be positive sample counts, got "
                          f"{[w for w, _ in states]}")
    names = set(states[0][1])
    for _, state in states[1:]:
        if set(state) != names:
            raise CollabError(f"updates of one layer disagree on tensors: {sorted(names)} vs "
                              f"{sorted(state)}")
    merged: dict[str, np.ndarray] = {}
    for name in sorted(names):
        first = states[0][1][name]
        if any(state[name].shape != first.shape for _, state in states):
            raise CollabError(f"updates disagree on the shape of {name}")
        if np.issubdtype(first.dtype, np.floating):
            acc = np.zeros(first.shape, dtype=np.float64)
            for weight, state in states:
                acc += weight * state[name].astype(np.float64)
            mean = acc / total
        else:
            mean = np.max(np.stack([state[name] for _, state in states]), axis=0)
        # numpy gives a 0-d array's arithmetic back as a scalar; the wire carries arrays
        merged[name] = np.asarray(mean, dtype=first.dtype)
    return merged


def merge_parts(updates: Sequence[tuple[str, int, Mapping[int, State]]]
                ) -> dict[int, dict[str, np.ndarray]]:
    """FedAvg of ``(device, samples, {layer: state})`` updates, layer by layer; every layer held
    by any update is merged over the updates that hold it."""
    ordered = sorted(updates, key=lambda u: u[0])
    layers = sorted({layer for _, _, parts in ordered for layer in parts})
    return {layer: weighted_mean([(samples, parts[layer]) for _, samples, parts in ordered
                                  if layer in parts])
            for layer in layers}
