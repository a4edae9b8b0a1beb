"""The rollout/trainer mismatch and its importance-sampling correction.

The engine that samples a completion and the trainer that scores it compute the same tokens'
log-probabilities in different ways: a bf16 copy outside autocast against the bf16-autocast
training pass, another process (a rollout server), a KV cache read a token at a time against
one whole-sequence pass. The completions are then drawn from a slightly different policy than
the one the loss assumes, a bias that grows with length (verl's and TRL's "rollout/trainer
mismatch"). The engine returns each sampled token's log-probability; each step logs how far
the trainer's are from them (`mismatch_figures`) and, with the correction on, weighs each token
or sequence loss by the ratio trainer / engine, truncated or masked outside
[clip_min, clip_max] (`importance_ratio`): TRL's `vllm_importance_sampling_correction` with its
four modes, equal to its code.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["CorrectionOptions", "correction_on", "importance_ratio", "mismatch_figures"]

MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")


@dataclass(frozen=True)
class CorrectionOptions:
    """TRL's `vllm_importance_sampling_mode`, `_clip_max` and `_clip_min` (None: unbounded)."""

    mode: str = "sequence_mask"
    clip_max: float | None = 3.0
    clip_min: float | None = None

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(
                f"grpo.importance_sampling_mode {self.mode!r}: one of {', '.join(MODES)}"
            )
        low, high = self.clip_min, self.clip_max
        if low is not None and high is not None and not low < high:
            raise ValueError(
                f"grpo.importance_sampling_clip_min {low}: must be below "
                f"importance_sampling_clip_max {high}"
            )

    @property
    def sequence_level(self) -> bool:
        return self.mode.startswith("sequence")

    @classmethod
    def from_section(cls, section: Any) -> CorrectionOptions:
        high = section.importance_sampling_clip_max
        return cls(
            section.importance_sampling_mode,
            None if math.isinf(high) else high,  # inf: no upper bound (a None TOML cannot hold)
            section.importance_sampling_clip_min,
        )


def correction_on(cfg: Any) -> bool:
    """Whether the run corrects: `grpo.importance_sampling_correction` on, or auto where the
    engine's log-probabilities can differ from the trainer's (bf16 training, whose rollouts
    run a bf16 copy outside autocast; a rollout server) and not where they cannot (fp32 with
    the engine in the trainer)."""
    setting = cfg.grpo.importance_sampling_correction
    if setting != "auto":
        return setting == "on"
    return cfg.training.dtype == "bf16" or bool(cfg.grpo.rollout_server)


def importance_ratio(
    trainer_logps: torch.Tensor,
    engine_logps: torch.Tensor,
    mask: torch.Tensor,
    options: CorrectionOptions,
) -> torch.Tensor:
    """The correction's weights: `exp(trainer - engine)` per token `[B, T]` (token modes; 1 off
    the mask) or of the masked sum per completion `[B, 1]` (sequence modes); a NaN difference
    (a token the engine could not score) counts 0. Truncate modes clamp them to
    [clip_min, clip_max]; mask modes set those outside to 0."""
    diff = torch.nan_to_num((trainer_logps - engine_logps) * mask, nan=0.0)
    if options.sequence_level:
        diff = diff.sum(dim=-1, keepdim=True)
    ratio = torch.exp(diff)
    if options.mode.endswith("truncate"):
        return torch.clamp(ratio, min=options.clip_min, max=options.clip_max)
    low = -math.inf if options.clip_min is None else options.clip_min
    high = math.inf if options.clip_max is None else options.clip_max
    return ratio.masked_fill((ratio < low) | (ratio > high), 0.0)


def mismatch_figures(
    trainer_logps: torch.Tensor,
    engine_logps: torch.Tensor,
    mask: torch.Tensor,
    ratio: torch.Tensor | None,
) -> tuple[dict[str, tuple[torch.Tensor, torch.Tensor]], dict[str, torch.Tensor]]:
    """(means as name -> (sum, count), extremes as name -> value) of one micro-batch over its
    mask tokens whose difference is a number: `sampling/sampling_logp_difference/mean` and
    `/max` (|trainer - engine|, TRL's names), `sampling/kl` (the k3 estimate of
    KL(engine || trainer) on the engine's samples, `exp(d) - d - 1` with d = trainer - engine:
    never negative, 0 only where they agree), and with a correction `ratio` TRL's
    `sampling/importance_sampling_ratio/mean`, `/min` and `/max` (over mask tokens, or over
    completions at sequence level)."""
    diff = (trainer_logps - engine_logps).double()
    seen = mask.bool() & ~torch.isnan(diff)
    d = diff[seen]
    count = d.new_tensor(float(d.numel()))
    means = {
        "sampling/sampling_logp_difference/mean": (d.abs().sum(), count),
        "sampling/kl": ((torch.exp(d) - d - 1).sum(), count),
    }
    extremes = {
        "sampling/sampling_logp_difference/max": d.abs().max() if d.numel() else d.new_zeros(())
    }
    if ratio is not None:
        flat = ratio.flatten() if ratio.shape[1] == 1 else ratio[mask.bool()]
        flat = flat.double()
        means["sampling/importance_sampling_ratio/mean"] = (
            flat.sum(),
            flat.new_tensor(float(flat.numel())),
        )
        if flat.numel():
            extremes["sampling/importance_sampling_ratio/min"] = flat.min()
            extremes["sampling/importance_sampling_ratio/max"] = flat.max()
    return means, extremes
