"""Differential privacy on the device part with Opacus: per-sample gradients (``GradSampleModule``),
clipping and Gaussian noise (``DPOptimizer``) and the RDP accountant's epsilon
(docs/design.md §13). PiPar's code has no DP; this design is ours.

What it covers: every update of the layers a data device holds (the front and the head in the
collaborative split, the whole model in fedavg mode) is DP-SGD, so the device part it publishes
at a round's end is differentially private with respect to the device's records. What it does not
cover: the server replica is trained on the gradients of the device's loss, and the smashed data
and cut gradients travel in the clear; those are outside this guarantee (the design document
says so too).

Micro-batching and Opacus: Opacus stacks one set of per-sample gradients per backward pass and
the optimizer concatenates them, so a mini-batch of N micro-batches is clipped per sample and
noised once, like a batch of B. Two adjustments make that exact: the pipeline's loss of a
micro-batch is its mean over b samples divided by N, so per-sample gradients arrive divided by N
and are multiplied back before clipping; and ``expected_batch_size`` is b, because the optimizer
divides by it times the number of accumulated passes (N), i.e. by B.

Opacus is imported when DP is used: importing it configures the root logger (``basicConfig``),
which would silence the process's own logging set up after it, and it costs a second at start.
"""

from __future__ import annotations

import copy
import warnings
import zlib
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from ftpipe_iot.errors import PrivacyError
from ftpipe_iot.protocol.collab import PrivacySettings


def check_private_layers(layers: Sequence[nn.Module], first_index: Sequence[int]) -> None:
    """Refuse layers Opacus cannot train privately (BatchNorm mixes samples of a batch, so a
    per-sample gradient does not exist), naming the layer."""
    from opacus.validators import ModuleValidator

    for layer, index in zip(layers, first_index):
        container = nn.Sequential(layer).train()
        errors = ModuleValidator.validate(container, strict=False)
        if errors:
            reasons = "; ".join(sorted({str(e) for e in errors}))
            raise PrivacyError(
                f"differential privacy cannot train layer {index} ({type(layer).__name__}) on "
                f"the device: {reasons}. Use a model without BatchNorm in the device part "
                "(e.g. --model cnn or mlp), or turn DP off")


def _noise_seed(seed: int, device: str) -> int:
    return (seed * 1_000_003 + zlib.crc32(device.encode())) % (2**63)


class DevicePrivacy:
    """DP-SGD for one device's part: wraps its modules for per-sample gradients and its optimizer
    for clipping and noise, and accounts the privacy spent per optimizer step."""

    def __init__(self, settings: PrivacySettings, modules: Sequence[nn.Module],
                 optimizer: torch.optim.Optimizer, micro_batch_size: int, micro_batches: int,
                 samples: int, seed: int, device: str) -> None:
        from opacus.accountants import RDPAccountant
        from opacus.grad_sample import GradSampleModule
        from opacus.optimizers import DPOptimizer

        settings.check_samples(device, samples)
        # Opacus' hooks on the first layer see an input that needs no gradient and torch warns
        # at every backward; per-sample gradients of the parameters are unaffected.
        warnings.filterwarnings("ignore", message="Full backward hook is firing",
                                category=UserWarning)
        self.settings = settings
        self.micro_batches = micro_batches
        self.sample_rate = min(1.0, micro_batch_size * micro_batches / samples)
        try:
            self.wrapped = [GradSampleModule(m, loss_reduction="mean") for m in modules]
        except NotImplementedError as exc:
            raise PrivacyError(f"Opacus cannot compute per-sample gradients of the device "
                               f"part: {exc}") from exc
        self.generator = torch.Generator().manual_seed(_noise_seed(seed, device))
        self.optimizer = DPOptimizer(optimizer, noise_multiplier=settings.noise_multiplier,
                                     max_grad_norm=settings.max_grad_norm,
                                     expected_batch_size=micro_batch_size,
                                     generator=self.generator)
        self.accountant = RDPAccountant()
        self.steps = 0

    def state(self) -> dict[str, Any]:
        """The noise generator's state and the privacy spent so far. A round redone from here
        draws the same noise, so it publishes the same update: nothing more is spent."""
        return {"generator": self.generator.get_state().clone(),
                "accountant": self.accountant.state_dict(), "steps": self.steps}

    def restore(self, state: dict[str, Any]) -> None:
        """Back to ``state`` (see ``state``)."""
        self.generator.set_state(state["generator"].clone())
        self.accountant.load_state_dict(copy.deepcopy(state["accountant"]))
        self.steps = int(state["steps"])

    def step(self) -> None:
        """Clip, noise and apply the accumulated mini-batch; account one step."""
        if self.micro_batches > 1:
            for group in self.optimizer.param_groups:
                for p in group["params"]:
                    samples = p.grad_sample if isinstance(p.grad_sample, list) \
                        else [p.grad_sample]
                    for g in samples:
                        g.mul_(self.micro_batches)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.accountant.step(noise_multiplier=self.settings.noise_multiplier,
                             sample_rate=self.sample_rate)
        self.steps += 1

    @property
    def epsilon(self) -> float:
        """Epsilon spent so far at the configured delta (0 before the first step)."""
        if self.steps == 0:
            return 0.0
        with warnings.catch_warnings():
            # "optimal order is the smallest alpha": the bound is looser than it could be
            # at very small epsilon, never optimistic.
            warnings.simplefilter("ignore", UserWarning)
            return float(self.accountant.get_epsilon(delta=self.settings.delta))
