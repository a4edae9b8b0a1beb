"""The one place a step is skipped: an optimizer step taken only when the loss and the
gradient norm are finite.

The contract, for every optimizer of the registry: on a non-finite step the weights and the
optimizer state (moments, step count) stay exactly as they were; the caller reports the step as
skipped and holds the learning rate back (`MegatronLR.rewind`). How the optimizer is told is
what its entry declares (`OptimizerSpec.skips_on_device`):

* on the device: its step reads `optimizer.found_inf`, a float tensor that is 1 to skip (torch's
  fused kernels, the protocol of torch's GradScaler), so the step never waits for the device;
* on the host: `finite` is read first, one host sync per step.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

__all__ = ["reads_found_inf", "step_unless_nonfinite"]


def reads_found_inf(optimizer: torch.optim.Optimizer) -> bool:
    """Whether `optimizer.step()` reads `optimizer.found_inf` on the device and skips itself
    when it is 1: torch's fused kernels (`fused=True`) do."""
    return bool(optimizer.defaults.get("fused"))


def step_unless_nonfinite(optimizer: torch.optim.Optimizer, finite: torch.Tensor) -> None:
    """`optimizer.step()` when `finite` (a 0-dim bool tensor: this step's loss and gradient norm
    are finite) is true; otherwise nothing changes. See the module docstring for the contract."""
    if reads_found_inf(optimizer):
        optimizer.found_inf = (~finite).float()  # read by the fused kernel: skip when 1
        optimizer.step()
    elif finite.item():  # an optimizer without `found_inf` is told on the host
        optimizer.step()
