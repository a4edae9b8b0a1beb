"""Gradient clipping for a model whose gradients live on several meshes and pipeline stages.

`torch.nn.utils.clip_grad_norm_` computes one norm over a list of gradients, which must all be
plain tensors or DTensors of one mesh. A parallel model mixes them: FSDP/TP DTensors on the
dense mesh, expert DTensors on the expert mesh, and each pipeline stage holds only its own
layers. `clip_grad_norm_` here groups the gradients by mesh and placements, takes each group's
global norm (a DTensor norm is reduced over its mesh), adds the squares over the groups and
over the pipeline stages, and scales every gradient by the same factor (torchtitan does the
same). Plain tensors are replicated wherever they are (e.g. under tensor parallelism), so their
local norm is already the global one and is counted once.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

__all__ = ["clip_grad_norm_", "total_grad_norm"]


def _groups(grads: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    """Gradients grouped by (mesh, placements), in first-seen order (the same on every rank
    of a stage, so the collectives line up)."""
    groups: dict[object, list[torch.Tensor]] = {}
    for grad in grads:
        key = (grad.device_mesh, grad.placements) if isinstance(grad, DTensor) else None
        groups.setdefault(key, []).append(grad)
    return list(groups.values())


def total_grad_norm(
    parameters: Iterable[torch.Tensor], pp_group: dist.ProcessGroup | None = None
) -> torch.Tensor:
    """The L2 norm of all gradients of the whole model (every shard, every stage), fp32."""
    return _total_norm(_groups([p.grad for p in parameters if p.grad is not None]), pp_group)


def _total_norm(
    groups: list[list[torch.Tensor]], pp_group: dist.ProcessGroup | None
) -> torch.Tensor:
    device = groups[0][0].device if groups else torch.device("cpu")
    square = torch.zeros((), dtype=torch.float32, device=device)
    for group in groups:
        norm = torch.nn.utils.get_total_norm(group, norm_type=2.0, foreach=True)
        if isinstance(norm, DTensor):
            norm = norm.full_tensor()
        square = square + norm.float().square()
    if pp_group is not None and dist.get_world_size(pp_group) > 1:
        if dist.get_backend(pp_group) == "nccl" and square.device.type != "cuda":
            square = square.cuda()
        dist.all_reduce(square, group=pp_group)
    return square.sqrt()


def clip_grad_norm_(
    parameters: Iterable[torch.Tensor],
    max_norm: float,
    pp_group: dist.ProcessGroup | None = None,
    inv_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Scale all gradients so their global norm is at most `max_norm`; returns the norm before
    clipping (`inf` max_norm: measure only). `inv_scale` (a 0-dim tensor): the gradients are
    those of a loss multiplied by 1 / inv_scale (fp16's loss scale); they are unscaled in the
    same multiplication, and the norm returned and clipped is the unscaled one."""
    groups = _groups([p.grad for p in parameters if p.grad is not None])
    norm = _total_norm(groups, pp_group)
    if inv_scale is not None:
        norm = norm * inv_scale.to(norm.device)
    if max_norm != float("inf") or inv_scale is not None:
        for group in groups:
            coefficient = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
            if inv_scale is not None:
                coefficient = coefficient * inv_scale.to(coefficient.device)
            torch._foreach_mul_(group, coefficient.to(group[0].device))
    return norm
