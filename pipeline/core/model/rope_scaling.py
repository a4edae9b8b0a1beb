"""YaRN RoPE scaling (DeepSeek-V3's long-context extension): the inverse frequencies and the two
attention-scale corrections ("mscale") that go with them. Llama 3.1's frequency scaling is
`pipeline.core.model.rope.rope_inv_freq`, which dispatches here for `YarnScaling`."""

from __future__ import annotations

import math

import torch

from pipeline.core.model.config import YarnScaling


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's attention-scale correction 0.1 * mscale * ln(factor) + 1 (1 when not extending)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def yarn_cos_sin_factor(scaling: YarnScaling) -> float:
    """What cos and sin are multiplied by: `attention_factor` when set, else
    mscale(factor, mscale) / mscale(factor, all_dim)."""
    if scaling.attention_factor is not None:
        return scaling.attention_factor
    if scaling.mscale and scaling.mscale_all_dim:
        return yarn_mscale(scaling.factor, scaling.mscale) / yarn_mscale(
            scaling.factor, scaling.mscale_all_dim
        )
    return yarn_mscale(scaling.factor)


def yarn_softmax_factor(scaling: YarnScaling | None) -> float:
    """What latent attention multiplies its 1/sqrt(qk_head_dim) softmax scale by."""
    if not isinstance(scaling, YarnScaling) or not scaling.mscale_all_dim:
        return 1.0
    return yarn_mscale(scaling.factor, scaling.mscale_all_dim) ** 2


def _correction_dim(rotations: float, dim: int, theta: float, max_positions: int) -> float:
    """The dimension whose frequency turns `rotations` times over `max_positions` tokens."""
    return dim * math.log(max_positions / (rotations * 2 * math.pi)) / (2 * math.log(theta))


def yarn_inv_freq(dim: int, theta: float, scaling: YarnScaling) -> torch.Tensor:
    """Inverse frequencies `[dim // 2]`: the original ones for the fast dimensions (more than
    `beta_fast` turns over the original context), divided by `factor` for the slow ones (fewer
    than `beta_slow`), blended linearly in between (ramp bounds rounded outwards, unless
    `truncate` is false: gpt-oss keeps them fractional)."""
    orig = scaling.original_max_position_embeddings
    low = _correction_dim(scaling.beta_fast, dim, theta, orig)
    high = _correction_dim(scaling.beta_slow, dim, theta, orig)
    if scaling.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # keep the ramp's slope finite
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    wavelength_factors = theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)
    original = 1.0 / wavelength_factors
    interpolated = 1.0 / (scaling.factor * wavelength_factors)
    keep_original = 1 - ramp
    return interpolated * (1 - keep_original) + original * keep_original
