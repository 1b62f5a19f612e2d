"""Weight prediction: the asynchronous schedule's delay compensation (docs/design.md §5).

Between drains, step ``s`` of PipeDream-2BW computes its gradient at version ``s - 1`` while the
update applies to version ``s``: W(s+1) = W(s) - lr * grad f(W(s-1)). With heavy-ball momentum
that one-step lag shrinks the stable learning rates by an order of magnitude (on a quadratic of
curvature h: lr * h < 1 - momentum, against 2 (1 + momentum) in sync), and training at the
demo's settings oscillates. Weight prediction (SpecTrain, XPipe) computes the stale step at the
weights the next update is expected to reach instead: the live weights minus the update the
optimizer would make if the gradient kept its running average, read from the optimizer's own
state (SGD's momentum buffer, Adam's moments). It is a pure function of one version's weights
and optimizer state, both replicated together, so a stage, the simulator and a stage restored
from replicas predict the same tensors.
"""

from __future__ import annotations

import torch


def predicted_update(optimizer: torch.optim.Optimizer, group: dict, param: torch.Tensor
                     ) -> torch.Tensor | None:
    """The step ``optimizer`` is expected to subtract from ``param`` next (None before its first
    step, and for plain SGD, whose next step depends on the next gradient alone).

    SGD with momentum: ``lr * buf`` (the next buffer is ``momentum * buf + g``; with ``g`` at
    its running average ``(1 - momentum) * buf`` it stays ``buf``). Adam: ``lr * m_hat /
    (sqrt(v_hat) + eps)`` with the bias-corrected moments as they stand (with the next gradient
    at ``m_hat`` and its square at ``v_hat``, the next step's corrected moments are these: for a
    constant gradient the prediction is the next update exactly). ``group`` is the parameter
    group ``param`` is in (its learning rate and hyperparameters).
    """
    state = optimizer.state.get(param)
    if not state:
        return None
    if isinstance(optimizer, torch.optim.Adam):
        beta1, beta2 = group["betas"]
        step = float(state["step"])
        m_hat = state["exp_avg"] / (1 - beta1 ** step)
        v_hat = state["exp_avg_sq"] / (1 - beta2 ** step)
        return group["lr"] * m_hat / (v_hat.sqrt() + group["eps"])
    buffer = state.get("momentum_buffer")
    if buffer is None or not group.get("momentum"):
        return None
    return group["lr"] * buffer


def predicted_weights(optimizer: torch.optim.Optimizer | None) -> dict[torch.Tensor, torch.Tensor]:
    """New tensors: each parameter ``optimizer`` steps, after the step it is expected to make
    next (a copy where nothing is predicted), keyed by the parameter."""
    out: dict[torch.Tensor, torch.Tensor] = {}
    for group in optimizer.param_groups if optimizer is not None else ():
        for param in group["params"]:
            update = predicted_update(optimizer, group, param)
            weights = param.detach().clone()
            if update is not None:
                weights.sub_(update)
            out[param] = weights
    return out
