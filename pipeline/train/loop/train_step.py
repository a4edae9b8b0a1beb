"""One optimizer step over a global batch, and one evaluation pass.

The loss of a step is the sum of the objective's losses over all its micro-batches divided by
the objective's count over the whole global batch (loss tokens, or pairs of sequences; not a
mean of per-micro-batch means), so a step gives the same loss and gradients
whatever the micro-batch size: 1 x 8 == 8 x 1 up to floating-point summation order. MoE
auxiliary losses are per forward pass; each MoE layer attaches its own gradient with the weight
the model was built with (`ModelOptions`), so they are not added here.

Under a parallel layout the same function runs on every rank: `dp_group` is the group whose
ranks hold different tokens of the global batch (data x context parallel), the step runner
(`pipeline.train.loop.step_runner`: the whole model, or this rank's pipeline stages under a
schedule) does the forward and backward work, and `pp_group` makes the gradient norm and the
reported loss those of the whole model.

A step never waits for the device: loss, gradient norm, token count and the skip decision stay
tensors (`StepResult`), and a non-finite step is skipped where the optimizer's registry entry
says (`pipeline.train.optimizers.nonfinite`: AdamW's fused kernel reads `found_inf` on the
device). The trainer reads them on log steps.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from pipeline.core.parallel.fsdp import global_token_count
from pipeline.core.parallel.grad_norm import clip_grad_norm_
from pipeline.core.parallel.tensor_parallel import sum_moe_gradients
from pipeline.train.assembly.model_parts import TrainableModel
from pipeline.train.loop.expert_bias import update_expert_biases
from pipeline.train.loop.step_runner import Batch, StepRunner, prepare_micro_batches
from pipeline.train.optimizers.nonfinite import step_unless_nonfinite

if TYPE_CHECKING:
    from pipeline.core.kernels.fp8 import Fp8Training
    from pipeline.core.parallel.dims import ParallelDims
    from pipeline.train.optimizers.loss_scaler import LossScaler
    from pipeline.train.optimizers.lr_scheduler import MegatronLR

__all__ = [
    "StepResult",
    "autocast_context",
    "forward_backward",
    "global_mean",
    "reduce_loss_sum",
    "train_step",
]


@dataclass(frozen=True)
class StepResult:
    """What one step did, as 0-dim device tensors (reading one waits for the device): its loss
    (CE only, token-normalised), gradient norm, loss-token count, and whether it was skipped
    (a non-finite loss or gradient norm)."""

    loss: torch.Tensor
    grad_norm: torch.Tensor
    num_tokens: torch.Tensor
    skipped: torch.Tensor
    loss_scale: torch.Tensor | None = None
    """fp16: the loss scale this step ran with (None without one)."""


def autocast_context(
    device: torch.device, dtype: str, fp8: Fp8Training | None = None
) -> contextlib.AbstractContextManager:
    """bf16 or fp16 autocast on `device` (CUDA or CPU) when `dtype` is bf16 or fp16 (weights,
    grads and optimizer state stay fp32); plain fp32 otherwise. fp16 on a CPU emulates its
    matrix products (`EmulatedFp16Gemms`: a CPU's fp16 GEMMs are some 60x slower than fp32).
    With an FP8 backend (`Fp8Training`) its own context (Transformer Engine's fp8_autocast) is
    entered inside, afresh on every use."""
    if dtype == "bf16":
        base: contextlib.AbstractContextManager = torch.autocast(device.type, torch.bfloat16)
    elif dtype == "fp16":
        base = torch.autocast(device.type, torch.float16)
        if device.type == "cpu":
            from pipeline.core.kernels.fp16_emulation import EmulatedFp16Gemms

            base = _Nested(base, EmulatedFp16Gemms)
    else:
        base = contextlib.nullcontext()
    if fp8 is None:
        return base
    return _Nested(base, fp8.autocast)


class _Nested(contextlib.AbstractContextManager):
    """`base` and then a fresh `inner()` context on each `with` (reusable, unlike ExitStack)."""

    def __init__(
        self,
        base: contextlib.AbstractContextManager,
        inner: Callable[[], contextlib.AbstractContextManager],
    ) -> None:
        self.base, self.inner = base, inner
        self._stacks: list[contextlib.ExitStack] = []

    def __enter__(self) -> None:
        stack = contextlib.ExitStack()
        stack.enter_context(self.base)
        stack.enter_context(self.inner())
        self._stacks.append(stack)

    def __exit__(self, *exc: Any) -> bool | None:
        return self._stacks.pop().__exit__(*exc)


def train_step(
    model: TrainableModel,
    optimizer: torch.optim.Optimizer,
    scheduler: MegatronLR,
    micro_batches: Sequence[Batch],
    *,
    clip_grad: float,
    autocast: contextlib.AbstractContextManager | None = None,
    dp_group: dist.ProcessGroup | None = None,
    runner: StepRunner,
    pp_group: dist.ProcessGroup | None = None,
    after_optimizer_step: Callable[[], None] | None = None,
    loss_scaler: LossScaler | None = None,
) -> StepResult:
    """Forward/backward every micro-batch, clip, and step unless the loss or norm is NaN/Inf.

    A non-finite step leaves weights and optimizer state untouched (`step_unless_nonfinite`:
    a fused AdamW skips it on the device; any other optimizer costs a host sync) and reports
    `skipped`; the caller counts it and holds the learning rate back (`MegatronLR.rewind`).
    Every rank divides by the loss tokens of the whole global batch (summed over `dp_group`,
    whose gradients are summed as `apply_fsdp` does) and reports the global loss, so every rank
    takes the same skip decision and any layout equals one device. `runner` does the forward
    and backward work with the run's objective.

    With a `loss_scaler` (fp16) the loss is multiplied by its scale before backward and the
    gradients divided by it before clipping; an overflow (a non-finite gradient norm) skips the
    step like any non-finite one, and the scaler then updates (backs off or grows).
    """
    optimizer.zero_grad(set_to_none=True)
    scale = loss_scaler.scale.clone() if loss_scaler is not None else None
    loss_sum, global_tokens = forward_backward(
        model, micro_batches, autocast=autocast, dp_group=dp_group, runner=runner, loss_scale=scale
    )
    max_norm = clip_grad if clip_grad > 0 else float("inf")
    inv_scale = loss_scaler.inv_scale if loss_scaler is not None else None
    grad_norm = clip_grad_norm_(model.parameters(), max_norm, pp_group, inv_scale=inv_scale)
    reduce_loss_sum(loss_sum, dp_group, pp_group)
    loss = loss_sum / global_tokens.clamp(min=1.0).to(loss_sum)
    finite_grads = torch.isfinite(grad_norm.to(loss.device))
    finite = torch.isfinite(loss) & finite_grads
    step_unless_nonfinite(optimizer, finite)
    if loss_scaler is not None:
        loss_scaler.update(~finite_grads)
    _balance_experts(model, finite)
    if after_optimizer_step is not None:  # e.g. FP8 weight scales for the next all-gather
        after_optimizer_step()
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    return StepResult(
        loss.detach(), grad_norm.detach(), global_tokens, skipped=~finite, loss_scale=scale
    )


def _balance_experts(model: TrainableModel, finite: torch.Tensor) -> None:
    """DeepSeek-V3's expert-bias update after the step (`pipeline.train.loop.expert_bias`), unless
    the step was skipped; the loads are summed over every rank of the run."""
    config = getattr(model, "config", None)
    if config is None or config.moe is None or not config.moe.expert_bias:
        return
    if not all(p.requires_grad for p in model.parameters()):
        return  # a frozen base under trained adapters keeps its routers' biases
    layers = model.moe_layers()
    world = dist.group.WORLD if dist.is_available() and dist.is_initialized() else None
    update_expert_biases(config, layers, world, apply=finite)


def global_mean(loss_sum: float, count: float, layout: ParallelDims, device: torch.device) -> float:
    """The loss normalised by its count over every rank's evaluation batches: counts are summed
    over the ranks holding different tokens, loss sums also over pipeline stages (only the last
    one has them)."""
    sums = torch.tensor([loss_sum, count], dtype=torch.float64)
    batch_group, pipeline_group = layout.batch_group, layout.pipeline_group
    if batch_group is not None or pipeline_group is not None:
        on_gpu = dist.get_backend() == "nccl"
        sums = sums.to(device if on_gpu else "cpu")
        if batch_group is not None:
            dist.all_reduce(sums, group=batch_group)
        if pipeline_group is not None:
            dist.all_reduce(sums[:1], group=pipeline_group)
    return float(sums[0] / sums[1].clamp(min=1.0))


def reduce_loss_sum(
    loss_sum: torch.Tensor,
    dp_group: dist.ProcessGroup | None,
    pp_group: dist.ProcessGroup | None,
) -> torch.Tensor:
    """Sum a rank's loss sum, in place, over the ranks holding other tokens (`dp_group`) and
    other pipeline stages (`pp_group`; only the last one has a loss); tensor-parallel ranks
    already hold the same value."""
    for group in (dp_group, pp_group):
        if group is not None:
            dist.all_reduce(loss_sum, group=group)
    return loss_sum


def forward_backward(
    model: TrainableModel,
    micro_batches: Sequence[Batch],
    *,
    autocast: contextlib.AbstractContextManager | None = None,
    dp_group: dist.ProcessGroup | None = None,
    runner: StepRunner,
    loss_scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Accumulate the gradients of one global batch (this rank's share) through `runner`:
    returns this rank's loss sum (0 on pipeline stages without the loss) and the global count
    the loss is normalised by (the objective's: loss tokens, pairs), both 0-dim tensors. With
    `loss_scale` the gradients are those of the loss times it (the loss sum returned is not)."""
    prepare_micro_batches(runner, micro_batches, autocast)
    local_tokens = sum(runner.objective.count(mb) for mb in micro_batches)
    global_tokens = global_token_count(local_tokens, dp_group)
    denominator = global_tokens.clamp(min=1.0).float()
    if loss_scale is not None:  # loss / (count / scale): both runners give back the plain sum
        denominator = denominator / loss_scale.to(denominator.device)
    loss_sum = runner.forward_backward(micro_batches, denominator, autocast)
    sum_moe_gradients(model)  # MoE layers that routed this tp rank's tokens only
    return loss_sum, global_tokens
