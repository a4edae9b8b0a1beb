"""Group relative policy optimisation: the arithmetic of advantages and of the clipped loss.

Pure torch, equal to TRL 1.16's `GRPOTrainer` (its `sum_then_normalize` advantages and its
`_compute_loss` for the grpo, bnpo, dr_grpo, dapo, cispo, sapo, luspo and vespo losses); the GRPO
objective (`pipeline.train.objectives.grpo.objective`) gathers the log-probabilities and calls
these.

- rewards: the weighted sum of the reward functions, NaN where every function gave none
  (`weighted_rewards`); advantages relative to the prompt's group of `num_generations`
  completions, scaled by the group's standard deviation, the batch's, or not at all
  (`group_advantages`);
- per token, with `r = exp(logps - old_logps)` (token level) or the exponent of the masked
  mean of the log-ratios of the completion (sequence level, GSPO):
  `-min(r' A, clip(r, 1 - epsilon_low, 1 + epsilon_high) A)` where `r' = min(r, delta)` with
  two-sided clipping, else `r` (grpo, bnpo, dr_grpo, dapo, luspo); `-sg(min(r, epsilon_high)) A
  logps` (cispo: the ratio clipped and detached, the gradient through the log-probability);
  `-4 sigmoid(tau (r - 1)) / tau A` with tau by the advantage's sign (sapo); `-sg(phi) A logps`
  with phi a gamma weight of the completion's whole ratio (vespo); each times the rollout
  correction's importance ratio when one is given (not vespo, which folds it into phi); plus
  `beta * kl` with the k3 estimator
  `exp(ref - logps) - (ref - logps) - 1`, times `r` with `use_bias_correction_kl`
  (`per_token_loss`);
- the loss: a (sum, count) pair per micro-batch whose sums over micro-batches and ranks divide
  to TRL's loss (`reduce_loss`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

__all__ = [
    "GRPOLossOptions",
    "gamma_weights",
    "group_advantages",
    "loss_count",
    "nanstd",
    "per_token_loss",
    "reduce_loss",
    "weighted_rewards",
]

LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo")
CLIPPED_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "luspo")  # PPO's clipped surrogate
ROW_MEAN_TYPES = ("grpo", "sapo")  # each row's masked mean, then the mean over rows
TOKEN_SUM_TYPES = ("dapo", "cispo", "vespo")  # the sum over the global batch's mask tokens
LEVELS = ("token", "sequence")
SCALES = ("group", "batch", "none")
CLIP_STATS = ("clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean")
SHAPE_OPTIONS = (  # the sapo and vespo options, named as the section's fields
    "sapo_temperature_neg",
    "sapo_temperature_pos",
    "vespo_k_pos",
    "vespo_lambda_pos",
    "vespo_k_neg",
    "vespo_lambda_neg",
)


@dataclass(frozen=True)
class GRPOLossOptions:
    """The `[grpo]` loss settings, named as TRL's `GRPOConfig` (`epsilon_low` is its
    `epsilon`; `epsilon_high` is resolved: never None here)."""

    loss_type: str = "dapo"
    importance_sampling_level: str = "token"
    epsilon_low: float = 0.2
    epsilon_high: float = 0.2
    delta: float | None = None
    beta: float = 0.0
    use_bias_correction_kl: bool = True
    max_completion_length: int = 256
    sapo_temperature_neg: float = 1.05
    sapo_temperature_pos: float = 1.0
    vespo_k_pos: float = 2.0
    vespo_lambda_pos: float = 3.0
    vespo_k_neg: float = 3.0
    vespo_lambda_neg: float = 2.0

    def __post_init__(self) -> None:
        if self.loss_type not in LOSS_TYPES:
            raise ValueError(f"grpo.loss_type {self.loss_type!r}: one of {', '.join(LOSS_TYPES)}")
        if self.importance_sampling_level not in LEVELS:
            raise ValueError(
                f"grpo.importance_sampling_level {self.importance_sampling_level!r}: one of "
                f"{', '.join(LEVELS)}"
            )
        if not 0.0 <= self.epsilon_low < 1.0:
            raise ValueError(f"grpo.epsilon {self.epsilon_low}: must be in [0, 1)")
        if not self.epsilon_high >= 0.0:
            raise ValueError(f"grpo.epsilon_high {self.epsilon_high}: must be >= 0")
        if self.delta is not None and not self.delta > 0.0:
            raise ValueError(f"grpo.delta {self.delta}: must be > 0 (or unset)")
        if not self.beta >= 0.0:
            raise ValueError(f"grpo.beta {self.beta}: must be >= 0")
        if self.max_completion_length < 1:
            raise ValueError(
                f"grpo.max_completion_length {self.max_completion_length}: must be >= 1"
            )
        for name in ("sapo_temperature_neg", "sapo_temperature_pos"):
            if not getattr(self, name) > 0.0:
                raise ValueError(f"grpo.{name} {getattr(self, name)}: must be > 0")

    def warnings(self) -> list[str]:
        """TRL's warnings on settings that run but miss their paper's setup."""
        level, kind = self.importance_sampling_level, self.loss_type
        out = []
        if kind == "luspo" and level != "sequence":
            out.append("grpo.loss_type luspo: importance_sampling_level sequence is the paper's")
        if kind == "vespo" and level != "token":
            out.append(
                "grpo.loss_type vespo weighs whole sequences itself: importance_sampling_level "
                "token (the default) is meant"
            )
        if level == "sequence" and kind in ("bnpo", "dr_grpo", "dapo", "cispo"):
            out.append(
                f"grpo.loss_type {kind} sums token losses: at sequence level each completion "
                "weighs by its length (GSPO's setup is loss_type grpo)"
            )
        return out

    @classmethod
    def from_section(cls, section: Any) -> GRPOLossOptions:
        """The options of a `GRPOSection` (`epsilon_high` None: `epsilon`, as TRL)."""
        high = section.epsilon if section.epsilon_high is None else section.epsilon_high
        return cls(
            loss_type=section.loss_type,
            importance_sampling_level=section.importance_sampling_level,
            epsilon_low=section.epsilon,
            epsilon_high=high,
            delta=section.delta,
            beta=section.beta,
            use_bias_correction_kl=section.use_bias_correction_kl,
            max_completion_length=section.max_completion_length,
            **{name: getattr(section, name) for name in SHAPE_OPTIONS},
        )


def nanstd(values: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """The standard deviation (Bessel-corrected) ignoring NaNs, as `trl.trainer.utils.nanstd`:
    NaN where fewer than two values are present."""
    dims = tuple(range(values.dim())) if dim is None else dim
    mean = torch.nanmean(values, dim=dims, keepdim=True)
    variance = torch.nanmean((values - mean) ** 2, dim=dims, keepdim=True)
    count = torch.sum(~torch.isnan(values), dim=dims, keepdim=True)
    nan = torch.full_like(variance, float("nan"))
    correction = torch.where(count > 1, count / (count - 1), nan)
    std = torch.sqrt(variance * correction)
    return std.squeeze() if dim is None else std.squeeze(dim)


def weighted_rewards(per_func: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """`[N]` rewards from the `[N, F]` rewards of F functions (NaN: the function gave none):
    their weighted sum ignoring NaNs, NaN where every function gave none (an unscorable
    completion, which `group_advantages` leaves out)."""
    rewards = (per_func * weights.to(per_func.device).unsqueeze(0)).nansum(dim=1)
    return rewards.masked_fill(torch.isnan(per_func).all(dim=1), float("nan"))


def group_advantages(
    rewards: torch.Tensor, num_generations: int, scale_rewards: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """`[N]` advantages of `[N]` rewards in consecutive groups of `num_generations` (one
    prompt's completions): the reward less its group's mean, divided by the standard deviation
    of the group's rewards (`group`) or of all N (`batch`) plus 1e-4, or not divided (`none`).
    NaN rewards are left out of the means and deviations, and their advantages are 0.

    Also `[N]` booleans: whether that standard deviation is 0 (with `none`, the group's),
    TRL's `frac_reward_zero_std`."""
    if scale_rewards not in SCALES:
        raise ValueError(f"grpo.scale_rewards {scale_rewards!r}: one of {', '.join(SCALES)}")
    if num_generations < 1 or rewards.numel() % num_generations:
        raise ValueError(
            f"grpo.num_generations {num_generations}: the {rewards.numel()} rewards are not "
            "whole groups"
        )
    groups = rewards.view(-1, num_generations)
    mean = torch.nanmean(groups, dim=1).repeat_interleave(num_generations, dim=0)
    if scale_rewards == "batch":
        single = rewards.numel() == 1
        std = torch.zeros_like(rewards) if single else nanstd(rewards).expand_as(rewards)
    elif num_generations > 1:
        std = nanstd(groups, dim=1).repeat_interleave(num_generations, dim=0)
    else:
        std = torch.zeros_like(rewards)
    advantages = rewards - mean
    if scale_rewards != "none":
        advantages = advantages / (std + 1e-4)
    std_is_zero = torch.isclose(std, torch.zeros_like(std))
    return torch.nan_to_num(advantages, nan=0.0), std_is_zero


def per_token_loss(
    logps: torch.Tensor,
    old_logps: torch.Tensor | None,
    ref_logps: torch.Tensor | None,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    options: GRPOLossOptions,
    is_ratio: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """`[B, T]` token losses of completions with log-probabilities `logps` `[B, T]` under the
    policy (with gradient), `old_logps` under the rollouts' weights (None: `logps.detach()`,
    TRL's shortcut with one iteration), `ref_logps` under the reference (needed only when
    `beta != 0`), `advantages` `[B]` and `mask` `[B, T]` (1: a completion token), and
    `is_ratio` the rollout correction's importance ratios (`[B, T]` or `[B, 1]`,
    `correction.importance_ratio`; None: no correction).

    And TRL's logged figures as `[sum, count]` pairs, so they add over micro-batches and ranks
    (the mean is `sum / count.clamp(min=1)`): for the clipped losses `clip_ratio/low_mean`
    (ratio below `1 - epsilon_low` with a negative advantage), `clip_ratio/high_mean` (above
    `1 + epsilon_high`, positive advantage; after the delta cap, as TRL),
    `clip_ratio/region_mean` (either), over mask tokens (sequence level: over rows, all
    counted); `cispo_clip_ratio` (ratio above `epsilon_high`, positive advantage) for cispo;
    `vespo/phi_seq_mean` for vespo; and `kl` (the KL term before beta, over mask tokens) when
    `beta != 0`."""
    mask = mask.to(logps.dtype)
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(1)
    old_logps = logps.detach() if old_logps is None else old_logps
    log_ratio = logps - old_logps
    if options.importance_sampling_level == "sequence":
        log_weights = ((log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).unsqueeze(-1)
    else:
        log_weights = log_ratio
    ratio = torch.exp(log_weights)  # [B, T], or [B, 1] at sequence level
    kind = options.loss_type
    if kind == "cispo":
        losses = -torch.clamp(ratio, max=options.epsilon_high).detach() * advantages * logps
        clipped = _cispo_clipped(ratio, advantages, options)
        stats = {"cispo_clip_ratio": _masked_total(clipped, mask)}
    elif kind == "sapo":
        pos, neg = options.sapo_temperature_pos, options.sapo_temperature_neg
        temperatures = torch.where(advantages > 0, pos, neg)
        losses = -torch.sigmoid(temperatures * (ratio - 1)) * 4 / temperatures * advantages
        stats = {}
    elif kind == "vespo":
        phi = gamma_weights(advantages, log_ratio, mask, is_ratio, options)
        losses = -phi * advantages * logps
        stats = {"vespo/phi_seq_mean": _masked_total(phi, mask)}
    else:
        clipped = torch.clamp(ratio, 1 - options.epsilon_low, 1 + options.epsilon_high)
        capped = ratio if options.delta is None else torch.clamp(ratio, max=options.delta)
        losses = -torch.min(capped * advantages, clipped * advantages)
        stats = _clip_stats(capped.detach(), advantages, mask, options)
    if is_ratio is not None and kind != "vespo":
        losses = losses * is_ratio
    if options.beta != 0.0:
        if ref_logps is None:
            raise ValueError("grpo.beta != 0 needs the reference's log-probabilities (ref_logps)")
        kl = torch.exp(ref_logps - logps) - (ref_logps - logps) - 1
        if options.use_bias_correction_kl:
            kl = kl * ratio
        losses = losses + options.beta * kl
        stats["kl"] = _masked_total(kl.detach(), mask)
    return losses.expand(mask.shape), stats


def _cispo_clipped(ratio, advantages, options: GRPOLossOptions) -> torch.Tensor:
    return ((ratio.detach() > options.epsilon_high) & (advantages > 0)).to(ratio.dtype)


@torch.no_grad()
def gamma_weights(
    advantages: torch.Tensor,
    log_ratio: torch.Tensor,
    mask: torch.Tensor,
    is_ratio: torch.Tensor | None,
    options: GRPOLossOptions,
) -> torch.Tensor:
    """VESPO's `[B, 1]` weights (no gradient): with `w` the completion's whole importance
    ratio (the product of its token ratios, each log-ratio clamped to [-20, 20], times the
    rollout correction's token ratios when given; log w clamped to [log 1e-8, 20]),
    `phi(w) = exp(lambda) w^k exp(-lambda w)` (so phi(1) = 1), with k and lambda by the sign of
    the advantage (a zero advantage takes the positive ones); a non-finite phi is 0."""
    floor = math.log(1e-8)
    log_w = (torch.clamp(log_ratio, -20.0, 20.0) * mask).sum(-1, keepdim=True)
    if is_ratio is not None:
        log_w = log_w + torch.clamp(torch.log(is_ratio), floor, 20.0).sum(-1, keepdim=True)
    log_w = torch.clamp(log_w, floor, 20.0)
    positive = advantages >= 0
    k = torch.where(positive, options.vespo_k_pos, options.vespo_k_neg)
    lam = torch.where(positive, options.vespo_lambda_pos, options.vespo_lambda_neg).clamp(min=1e-4)
    phi = torch.exp(lam + k * log_w - lam * torch.exp(log_w))
    return phi.nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)


def _clip_stats(ratio, advantages, mask, options: GRPOLossOptions) -> dict[str, torch.Tensor]:
    low = (ratio < 1 - options.epsilon_low) & (advantages < 0)
    high = (ratio > 1 + options.epsilon_high) & (advantages > 0)
    flags = (low, high, low | high)
    return {name: _masked_total(flag.to(mask.dtype), mask) for name, flag in zip(CLIP_STATS, flags)}


def _masked_total(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """`[sum, count]` of `values` over the mask tokens; a `[B, 1]` (sequence-level) value
    counts once per row, every row (TRL's `global_masked_mean`)."""
    if values.shape[1] == 1:
        return torch.stack([values.sum(), values.new_tensor(float(values.shape[0]))])
    return torch.stack([(values * mask).sum(), mask.sum()])


def reduce_loss(
    losses: torch.Tensor, mask: torch.Tensor, options: GRPOLossOptions
) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss sum, count) of a micro-batch's `[B, T]` token losses: the training step divides
    the sum of the loss sums over all micro-batches and ranks by the sum of the counts. With
    G micro-batches per rank (gradient accumulation), P ranks and equal micro-batches of B rows,
    that is TRL's loss (its gradient is the sum over accumulation steps of each call's loss,
    averaged over ranks):

    - grpo, sapo: the sum over rows of each row's masked mean, count B. TRL takes the mean over
      the rows of each micro-batch divided by G, averaged over ranks: the mean over all G P B
      rows.
    - bnpo: the micro-batch's masked mean, count 1. TRL divides each micro-batch's masked mean
      by G and averages over ranks: the mean over the G P micro-batches of their means.
    - dr_grpo: the masked sum divided by `max_completion_length` L, count B. TRL divides the
      masked sum by B L and by G, averaged over ranks: the total over G P B L.
    - luspo: the masked sum, count B (TRL: the mean over rows of each row's masked sum, over G).
    - dapo, cispo, vespo: the masked sum, count the mask tokens. TRL divides the masked sum by
      the global batch's mask tokens (`num_items_in_batch`) over P, scaled to one accumulation
      window, and averages over ranks: the total over the global batch's mask tokens.

    With unequal micro-batches grpo and dr_grpo here stay means over all rows (TRL's weigh
    each micro-batch alike); a step whose counts sum to 0 has nothing to learn from."""
    mask = mask.to(losses.dtype)
    masked = losses * mask
    count = loss_count(mask, options.loss_type)
    if options.loss_type in ROW_MEAN_TYPES:
        return (masked.sum(-1) / mask.sum(-1).clamp(min=1.0)).sum(), count
    if options.loss_type == "bnpo":
        return masked.sum() / mask.sum().clamp(min=1.0), count
    if options.loss_type == "dr_grpo":
        return masked.sum() / options.max_completion_length, count
    return masked.sum(), count


def loss_count(mask: torch.Tensor, loss_type: str) -> torch.Tensor:
    """The count `reduce_loss` gives a micro-batch with loss mask `mask` `[B, T]`: its mask
    tokens (dapo, cispo, vespo), 1 (bnpo) or its rows (the others)."""
    if loss_type in TOKEN_SUM_TYPES:
        return mask.sum()
    if loss_type == "bnpo":
        return torch.ones((), dtype=mask.dtype, device=mask.device)
    return torch.tensor(float(mask.shape[0]), dtype=mask.dtype, device=mask.device)
