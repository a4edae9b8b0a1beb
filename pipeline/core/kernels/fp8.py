"""The FP8 hook: the one place a model's linear layers become FP8 training layers.

The backends (torchao float8, Transformer Engine) arrive with the FP8 performance work. Until
then this hook checks a requested FP8 run up front and refuses it with the reason, so a recipe
that asks for FP8 never silently trains in bf16.
"""

from __future__ import annotations

from typing import Any

import torch

FP8_BACKENDS = ("torchao", "te")


def apply_fp8(model: Any, recipe: str | None, device: torch.device) -> Any:
    """Convert `model` for FP8 training per `recipe` ("torchao:tensorwise", "te:delayed", ...);
    None leaves it unchanged."""
    if recipe is None:
        return model
    backend = recipe.split(":", 1)[0]
    if backend not in FP8_BACKENDS:
        raise ValueError(f"fp8.recipe {recipe!r}: unknown backend {backend!r}; have {FP8_BACKENDS}")
    if device.type != "cuda":
        raise ValueError(
            f"fp8.recipe {recipe!r}: FP8 training needs a CUDA GPU; this run is on {device.type}"
        )
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) < (8, 9):
        raise ValueError(
            f"fp8.recipe {recipe!r}: {torch.cuda.get_device_name(device)} has no FP8 "
            f"(compute capability {major}.{minor}; FP8 needs 8.9 or newer)"
        )
    raise NotImplementedError(
        f"fp8.recipe {recipe!r}: the FP8 backends are not in this version yet; unset fp8.recipe "
        "to train in bf16"
    )
