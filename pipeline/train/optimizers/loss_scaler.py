"""Loss scaling for fp16 training, with Megatron's settings and semantics.

fp16 has 5 exponent bits: small gradients underflow to 0 and large ones overflow to Inf. The
step multiplies the loss by `scale` before backward (so the fp16 gradients inside backward sit
in fp16's range), divides the fp32 gradients by it before clipping, and skips the optimizer
step when they overflowed (the skip-on-non-finite contract, `optimizers/nonfinite.py`). Then
`update(found_inf)` adjusts the scale:

- `ConstantLossScaler` (`training.loss_scale`, Megatron's `--loss-scale`): never changes.
- `DynamicLossScaler` (Megatron's default: `--initial-loss-scale`, `--min-loss-scale`,
  `--loss-scale-window`, `--hysteresis`): after `hysteresis` overflowing steps in a row (and
  on each further one) the scale halves, never below `min_scale`; after `window` finite steps
  in a row it doubles and the hysteresis count is restored.

The state lives in 0-dim tensors on the training device and `update` is tensor arithmetic, so a
step never waits for the device; `state_dict` (read at a checkpoint) is plain numbers.
megatron-core's `DynamicGradScaler` / `ConstantGradScaler` are the oracle
(`tests/train/test_loss_scaler.py` drives both with the same overflow sequence).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from pipeline.train.config.schema import TrainConfig

__all__ = ["ConstantLossScaler", "DynamicLossScaler", "LossScaler", "build_loss_scaler"]

GROWTH_FACTOR = 2.0
"""What the dynamic scale is multiplied by after a window of finite steps (Megatron's)."""
BACKOFF_FACTOR = 0.5
"""What it is multiplied by on an overflow once the hysteresis is used up (Megatron's)."""


class LossScaler:
    """A loss scale on `device`: `scale` (fp32, 0-dim), its reciprocal, and `update`."""

    dynamic = False

    def __init__(self, scale: float, device: torch.device | str = "cpu") -> None:
        if scale <= 0:
            raise ValueError(f"the loss scale must be positive, got {scale}")
        self.scale = torch.tensor(float(scale), dtype=torch.float32, device=device)

    @property
    def inv_scale(self) -> torch.Tensor:
        """1 / scale, computed in fp64 as Megatron does."""
        return self.scale.double().reciprocal().float()

    def update(self, found_inf: torch.Tensor) -> None:
        """Note whether this step's gradients overflowed (a 0-dim bool tensor)."""

    def can_back_off(self, scale: float) -> bool:
        """Whether an overflow at `scale` will lower the scale: the run is not stuck."""
        return False

    def state_dict(self) -> dict[str, Any]:
        """The scale as JSON numbers (one host read)."""
        return {"scale": float(self.scale)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Take back what `state_dict` gave."""
        self.scale.fill_(float(state["scale"]))


class ConstantLossScaler(LossScaler):
    """The same scale on every step; an overflowing step is still skipped."""


class DynamicLossScaler(LossScaler):
    """Megatron's dynamic scale: see the module docstring."""

    dynamic = True

    def __init__(
        self,
        initial_scale: float,
        min_scale: float,
        window: int,
        hysteresis: int,
        device: torch.device | str = "cpu",
    ) -> None:
        if not 0 < min_scale <= initial_scale:
            raise ValueError(f"need 0 < min_scale ({min_scale}) <= initial ({initial_scale})")
        if window <= 0 or hysteresis <= 0:
            raise ValueError(f"window ({window}) and hysteresis ({hysteresis}) must be positive")
        super().__init__(initial_scale, device)
        self.min_scale = torch.tensor(float(min_scale), dtype=torch.float32, device=device)
        self.window = window
        self.hysteresis = hysteresis
        self.growth_tracker = torch.zeros((), dtype=torch.int64, device=device)
        self.hysteresis_tracker = torch.full((), hysteresis, dtype=torch.int64, device=device)

    def update(self, found_inf: torch.Tensor) -> None:
        found = found_inf.to(device=self.scale.device, dtype=torch.bool).reshape(())
        # An overflow: the growth count restarts and one unit of hysteresis is used up; when
        # none is left the scale backs off (on every further overflow too).
        growth = torch.where(found, 0, self.growth_tracker + 1)
        hysteresis = torch.where(found, self.hysteresis_tracker - 1, self.hysteresis_tracker)
        backed_off = torch.maximum(self.scale * BACKOFF_FACTOR, self.min_scale)
        scale = torch.where(found & (hysteresis <= 0), backed_off, self.scale)
        # A full window of finite steps: the scale grows and the hysteresis is restored.
        grow = ~found & (growth == self.window)
        self.growth_tracker.copy_(torch.where(grow, 0, growth))
        self.hysteresis_tracker.copy_(torch.where(grow, self.hysteresis, hysteresis))
        self.scale.copy_(torch.where(grow, scale * GROWTH_FACTOR, scale))

    def can_back_off(self, scale: float) -> bool:
        return scale > float(self.min_scale)

    def state_dict(self) -> dict[str, Any]:
        return {
            "scale": float(self.scale),
            "growth_tracker": int(self.growth_tracker),
            "hysteresis_tracker": int(self.hysteresis_tracker),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.growth_tracker.fill_(int(state["growth_tracker"]))
        self.hysteresis_tracker.fill_(int(state["hysteresis_tracker"]))


def build_loss_scaler(cfg: TrainConfig, device: torch.device | str) -> LossScaler | None:
    """The run's scaler: None unless `training.dtype = "fp16"`; constant when
    `training.loss_scale` is set, else dynamic from the `training` fields of Megatron's names."""
    t = cfg.training
    if t.dtype != "fp16":
        return None
    if t.loss_scale is not None:
        return ConstantLossScaler(t.loss_scale, device)
    return DynamicLossScaler(
        t.initial_loss_scale, t.min_loss_scale, t.loss_scale_window, t.hysteresis, device
    )
