"""How fast an idle device computes the job's model, measured before it holds any layers.

The controller learns a device's speed from the steps it computes. A device the plan leaves
idle computes nothing, so the planner could only guess its speed (the slowest measured device's,
for a voluntary move) and never learned whether it would pay to give it work: on a mixed fleet
the first plan, made before anyone was measured, stayed the only one. An idle device therefore
trains the whole model as a one-stage plan for a few micro-batches of random data, on its own
copy of the layers and with its profile's emulated slow-down (as its stage would), and reports
each measured micro-batch's seconds in the three clocks a step reports (wall, the compute
thread's CPU, the emulated sleep); the controller folds them into its capacity estimate as
steps of their own (``control.controller``, ``planning.capacity``): their median is the
estimate and their spread its noise band, so a move onto the device must pay at the slow end
of what the probe saw, as a move onto a running device must.

What it costs: one warm-up micro-batch and ``MEASURED`` measured ones of the whole model, once
per model in the device's life (a new plan that leaves it idle again reports the same figures).
Nothing of it reaches training: its layers, optimizer and random data are its own, and the
random number generators are forked around it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch
from torch import nn

from ftpipe_iot.core.outputs import StepDone
from ftpipe_iot.core.stage import Stage
from ftpipe_iot.protocol.plan import Plan
from ftpipe_iot.protocol.results import CapacityProbed

#: Micro-batches timed after the warm-up one (each is reported: the controller takes their
#: median as the factor and their spread as its noise band).
MEASURED = 3


def probe_key(plan: Plan) -> str:
    """What a probe's figures depend on: the model, its input and the micro-batch size."""
    model = plan.train.model
    return repr((model.name, model.width, sorted(model.options.items()),
                 tuple(plan.input_shape), plan.num_classes, plan.train.micro_batch_size,
                 plan.train.frozen_layers))


def probe_capacity(plan: Plan, layers: Sequence[nn.Module], shapes: Sequence[tuple[int, ...]],
                   compute_hook: Callable[[float], float] | None = None,
                   measured: int = MEASURED) -> CapacityProbed:
    """Train ``layers`` (the whole model, built from the plan's seed) as a one-stage plan on
    random micro-batches of the plan's size: one to warm up without ``compute_hook`` (the
    emulated slow-down), then ``measured`` with it, each a step of its own; returns each
    measured step's seconds (their spread is the device's noise band for the controller)."""
    config = plan.train
    rows = config.micro_batch_size
    generator = np.random.default_rng(0)
    x = generator.standard_normal((rows, *shapes[0])).astype(np.float32)
    y = generator.integers(0, plan.num_classes, rows).astype(np.int64)
    done: list[StepDone] = []
    with torch.random.fork_rng(devices=[]):
        stage = Stage(index=0, n_stages=1, layers=layers, first_layer=0, config=config,
                      expected_shape=tuple(shapes[0]), num_classes=plan.num_classes)
        for step in range(1 + measured):
            stage.compute_hook = compute_hook if step > 0 else None
            outputs = stage.forward(step, 0, x, y, True, expected=1)
            done += [o for o in outputs if isinstance(o, StepDone) and step > 0]
    return CapacityProbed(0, len(layers), tuple(d.typical_s for d in done),
                          tuple(d.typical_cpu_s for d in done),
                          tuple(d.typical_emulated_s for d in done))
