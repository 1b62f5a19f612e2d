"""The training loss's largest curvature along some of a model's layers: the top eigenvalue of
the Hessian block of their parameters, by power iteration on Hessian-vector products.

It is what says whether a learning rate is inside a schedule's stable region
(``planning.stability``): along a direction of curvature h, SGD with momentum converges while
lr * h stays below the schedule's constant. The asynchronous schedule computes the layers
before its last stage at stale weights, so the block that matters there is theirs.

The loss is the one training minimises (the mean cross-entropy of a batch, BatchNorm in
training mode), measured on a copy of the layers so no running statistic of the caller moves.
Power iteration converges to the eigenvalue of largest magnitude; its absolute value bounds the
largest positive curvature from above, which is the safe side for a warning.
"""

from __future__ import annotations

import copy
import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn


@dataclass(frozen=True)
class Curvature:
    """The largest curvature (absolute top eigenvalue) of the loss along ``layers``
    ([first, end)) on ``samples`` samples; ``converged`` when two iterations agreed within the
    tolerance before the iteration budget ran out."""

    value: float
    layers: tuple[int, int]
    samples: int
    iterations: int
    converged: bool

    def to_dict(self) -> dict[str, object]:
        return {"curvature": round(self.value, 4), "layers": list(self.layers),
                "samples": self.samples, "iterations": self.iterations,
                "converged": self.converged}


def top_curvature(layers: Sequence[nn.Module], x: np.ndarray, y: np.ndarray,
                  block: tuple[int, int], iterations: int = 20, tolerance: float = 1e-2,
                  seed: int = 0,
                  weights: Mapping[int, Mapping[str, np.ndarray]] | None = None,
                  budget_s: float | None = None,
                  clock: Callable[[], float] = time.thread_time) -> Curvature | None:
    """The largest curvature of the loss on (``x``, ``y``) along the trainable parameters of
    ``layers[block[0]:block[1]]``, with every layer at ``weights`` (layer -> state) where
    given; None when that block has no trainable parameter. With ``budget_s``, no iteration
    starts once the probe has taken that many seconds of ``clock`` (the thread's CPU time by
    default; at least one iteration runs): the reading so far, not converged.

    Each Hessian-vector product is autograd's double backward (Pearlmutter's trick), exact for
    the network as autograd differentiates it. A central difference of two gradients would cost
    less, but ReLU's and max-pooling's kinks make it wrong (the digits CNN: 2.07 where the
    Hessian's top eigenvalue is 0.17, 11.4 where it is 16.3, in float64 with a step of 1e-6 of
    the weights). Dropout is off in the copy; deterministic for a seed (the start vector is
    drawn from it). Costs one backward with its graph kept, then about six forward and backward
    passes' worth an iteration on CPU."""
    started = clock()
    first, end = block
    model = [copy.deepcopy(layer) for layer in layers]
    for index, state in (weights or {}).items():
        model[index].load_state_dict({k: torch.from_numpy(np.array(v)) for k, v in
                                      state.items()})
    params = [p for layer in model[first:end] for p in layer.parameters() if p.requires_grad]
    if not params:
        return None
    for layer in model:
        layer.train()
        for module in layer.modules():
            if isinstance(module, nn.modules.dropout._DropoutNd):
                module.eval()
    h = torch.from_numpy(np.asarray(x))
    for layer in model:
        h = layer(h)
    loss = nn.functional.cross_entropy(h, torch.from_numpy(np.asarray(y)))
    grads = torch.autograd.grad(loss, params, create_graph=True)
    generator = torch.Generator().manual_seed(seed)
    vector = [torch.randn(p.shape, generator=generator, dtype=p.dtype) for p in params]
    vector = [v / _norm(vector) for v in vector]
    value, previous, done = 0.0, math.nan, 0
    for done in range(1, iterations + 1):
        product = torch.autograd.grad(grads, params, grad_outputs=vector, retain_graph=True)
        if not all(torch.isfinite(p).all() for p in product):
            break
        value = float(sum(torch.sum(p * v) for p, v in zip(product, vector)))
        norm = _norm(product)
        if norm == 0.0:
            return Curvature(0.0, block, len(x), done, True)
        vector = [p / norm for p in product]
        if abs(abs(value) - abs(previous)) <= tolerance * abs(value):
            return Curvature(abs(value), block, len(x), done, True)
        previous = value
        if budget_s is not None and clock() - started >= budget_s:
            break
    return Curvature(abs(value), block, len(x), done, False)


def _norm(tensors: Sequence[torch.Tensor]) -> float:
    return math.sqrt(float(sum(torch.sum(t * t) for t in tensors)))
