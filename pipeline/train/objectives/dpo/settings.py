"""DPO's settings: its `[dpo]` section, which the registry adds to the config
(`ObjectiveSpec.section`), read as `cfg.dpo`. Torch-free."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

__all__ = ["DPOSection"]


@dataclass
class DPOSection:
    """Preference tuning (`data.kind = "dpo"`, `pipe train --dpo`): the loss and its reference,
    the starting weights frozen (pipeline.train.objectives.dpo)."""

    beta: float = 0.1
    """Strength of the pull towards the reference (the rewards are beta * log-ratios)."""
    loss: Literal["sigmoid", "ipo"] = "sigmoid"
    """sigmoid: the DPO paper's loss; ipo: IPO's squared loss on length-averaged log-ratios."""
    label_smoothing: float = 0.0
    """With sigmoid: the assumed chance a preference label is flipped (conservative DPO)."""
    precompute_reference: bool = False
    """Compute the reference's log-probabilities once, in a first pass, and store them next to
    the data, instead of keeping a frozen copy of the model beside the policy."""
