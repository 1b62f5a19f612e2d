"""Weight prediction: the asynchronous schedule's delay compensation (docs/design.md §5).

Between drains, step ``s`` of PipeDream-2BW computes its gradient at version ``s - 1`` while the
update applies to version ``s``: W(s+1) = W(s) - lr * grad f(W(s-1)). With heavy-ball momentum
that one-step lag shrinks the stable learning rates by more than an order of magnitude (on a
quadratic of curvature h: lr * h < 1 - momentum, against 2 (1 + momentum) in sync), and training
at the demo's settings oscillates. Weight prediction (SpecTrain, XPipe) computes the stale step
at the weights the next update is expected to reach instead.

The expected update is the one the optimizer would make if the next gradient equalled the last
one it applied: with SGD's momentum ``lr * (momentum * buf + g_last)``, with Adam its next step
from the moments that gradient gives. On a quadratic of curvature h this keeps momentum 0.9
stable up to lr * h = 0.50, where predicting from the buffer alone (the gradient at its running
average, ``lr * buf``) stops at 0.27. On the digits CNN at the demo's settings, over 20 seeds,
with every layer stale 14 reach 95 % test accuracy within 8 epochs (13 from the buffer alone);
with the last stage computing at the newest weights, as it does now (``core.schedule``), all 20
do, in a median 5 epochs against sync's 4.5 (docs/design.md §5).

The last gradient is read back from the optimizer's state: the first moment after the step
minus the momentum times the one before it (``first_moment`` snapshots it before the step).
Right after a drain, and after replicas are loaded, no snapshot is taken and the prediction
falls back to the buffer alone: the replicas of a version (weights and optimizer state, taken at
drains) are then all a stage needs, and a stage, the simulator and a stage restored from
replicas predict the same tensors.
"""

from __future__ import annotations

import torch


def first_moment(optimizer: torch.optim.Optimizer, param: torch.Tensor) -> torch.Tensor:
    """A copy of the running average of ``param``'s gradients the optimizer keeps (SGD's
    momentum buffer, Adam's first moment), zeros before its first step: what the next step
    starts from. Plain SGD keeps none (zeros)."""
    state = optimizer.state.get(param) or {}
    moment = state.get("exp_avg" if isinstance(optimizer, torch.optim.Adam)
                       else "momentum_buffer")
    return torch.zeros_like(param.detach()) if moment is None else moment.detach().clone()


def _last_gradient(optimizer: torch.optim.Optimizer, group: dict, param: torch.Tensor,
                   before: torch.Tensor) -> torch.Tensor | None:
    """The gradient the optimizer's last step applied to ``param``, from its first moment
    after the step and ``before`` it (SGD without dampening: buf = momentum * before + g; Adam:
    m = beta1 * before + (1 - beta1) g)."""
    state = optimizer.state.get(param)
    if not state:
        return None
    if isinstance(optimizer, torch.optim.Adam):
        beta1 = group["betas"][0]
        return (state["exp_avg"] - beta1 * before) / (1 - beta1)
    buffer = state.get("momentum_buffer")
    if buffer is None:
        return None
    return buffer - group["momentum"] * before


def predicted_update(optimizer: torch.optim.Optimizer, group: dict, param: torch.Tensor,
                     before: torch.Tensor | None = None) -> torch.Tensor | None:
    """The step ``optimizer`` is expected to subtract from ``param`` next (None before its first
    step, and for plain SGD, whose next step depends on the next gradient alone).

    With ``before``, the first moment before the optimizer's last step (``first_moment``), the
    next gradient is taken to equal the last one: SGD ``lr * (momentum * buf + g_last)``, Adam
    its next step with both moments updated by ``g_last``. Without it the gradient is taken at
    its running average: SGD ``lr * buf`` (the next buffer stays ``buf``), Adam
    ``lr * m_hat / (sqrt(v_hat) + eps)`` with the bias-corrected moments as they stand (for a
    constant gradient either prediction is the next update exactly). ``group`` is the
    parameter group ``param`` is in (its learning rate and hyperparameters).
    """
    state = optimizer.state.get(param)
    if not state:
        return None
    last = None if before is None else _last_gradient(optimizer, group, param, before)
    if isinstance(optimizer, torch.optim.Adam):
        beta1, beta2 = group["betas"]
        step = float(state["step"])
        m, v = state["exp_avg"], state["exp_avg_sq"]
        if last is not None:
            step += 1
            m = beta1 * m + (1 - beta1) * last
            v = beta2 * v + (1 - beta2) * last * last
        m_hat = m / (1 - beta1 ** step)
        v_hat = v / (1 - beta2 ** step)
        return group["lr"] * m_hat / (v_hat.sqrt() + group["eps"])
    buffer = state.get("momentum_buffer")
    if buffer is None or not group.get("momentum"):
        return None
    if last is None:
        return group["lr"] * buffer
    return group["lr"] * (group["momentum"] * buffer + last)


def predicted_weights(optimizer: torch.optim.Optimizer | None,
                      before: dict[torch.Tensor, torch.Tensor] | None = None
                      ) -> dict[torch.Tensor, torch.Tensor]:
    """New tensors: each parameter ``optimizer`` steps, after the step it is expected to make
    next (a copy where nothing is predicted), keyed by the parameter. ``before``: each
    parameter's first moment before the last step (``first_moment``), where it was kept."""
    out: dict[torch.Tensor, torch.Tensor] = {}
    for group in optimizer.param_groups if optimizer is not None else ():
        for param in group["params"]:
            update = predicted_update(optimizer, group, param,
                                      None if before is None else before.get(param))
            weights = param.detach().clone()
            if update is not None:
                weights.sub_(update)
            out[param] = weights
    return out
