"""Sharded (FSDP2), ZeRO-1 and replicated data parallelism for `Transformer`, plus the
loss-token count that data parallelism needs.

`apply_fsdp` wraps each transformer block, then the root, with FSDP2's `fully_shard` (or, for
`mode="replicate"`, with the FSDP2-based `replicate`, i.e. DDP whose parameters are `Replicate()`
DTensors; for `mode="zero1"`, with `fully_shard` kept unsharded between steps, see below). It
runs on a `meta`-device model; afterwards call `model.to_empty(device=...)` and
`model.init_weights()`. The parameters become DTensors whose names and global shapes are those
of the plain model, so DCP checkpoints re-lay out freely.

Gradients are **summed** over the data-parallel ranks, not averaged: the train step divides the
loss by the number of loss tokens in the *global* batch (`global_token_count`), so the sum of
the ranks' gradients is exactly the single-process gradient of the whole batch, whatever each
rank's share of loss tokens. With FSDP's default average, dp=2 would differ from dp=1 unless
every rank held the same number of loss tokens.

ZeRO-1 (Megatron's distributed optimizer) on FSDP2's engine: the fp32 parameters FSDP2 shards
are the master weights, and the optimizer's state is made for them, so each rank steps its
shard of both; the compute copies (in the compute dtype) are whole on every rank. The units never
reshard after forward; while a step's micro-batches run, their gradients accumulate whole on
every rank (`defer_gradient_sync`: no reduction, no reshard after backward) and the last
backward reduce-scatters them once, in fp32, onto the shards. After the optimizer step
`gather_parameters` all-gathers the updated parameters once, and they stay whole until the next
step's last backward. One reduce-scatter and one all-gather a step, however many micro-batches;
the optimizer state (and its checkpoint, under the parameters' names) is FSDP2's, sharded as the
parameters are.

Why the tied embedding stays tied: `tok_embeddings` and `output` both belong to the root's
parameter group, where FSDP2 registers one sharded parameter for both modules; `to_empty`
swaps DTensor parameters in place, so `output.weight is tok_embeddings.weight` still holds.
The train step reads `model.output.weight` outside `output.forward` (the fused chunked loss);
that works because `apply_fsdp` gives the root `reshard_after_forward=False`, so its gathered
parameters stay registered from the root's forward until its gradients are reduced.
"""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING, Literal

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from torch import nn
    from torch.distributed.device_mesh import DeviceMesh

__all__ = [
    "DataParallelMode",
    "apply_fsdp",
    "copy_full_weights_",
    "default_param_dtype",
    "defer_gradient_sync",
    "gather_parameters",
    "global_token_count",
    "mixed_precision_policy",
]

DataParallelMode = Literal["fsdp", "replicate", "zero1"]


def default_param_dtype(device_type: str) -> torch.dtype | None:
    """bf16 compute parameters on GPUs; None (keep fp32, no cast) on CPU, where bf16 is slow
    and fp32 is the reference numerics."""
    return torch.bfloat16 if device_type == "cuda" else None


def mixed_precision_policy(
    param_dtype: torch.dtype | None, reduce_dtype: torch.dtype | None
) -> object:
    """FSDP2's policy: cast all-gathered parameters to `param_dtype`, reduce gradients in
    `reduce_dtype` (fp32 by default, so bf16 training still sums gradients in fp32)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    return MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)


def _blocks(model: nn.Module) -> list[nn.Module]:
    """The transformer blocks, in layer order (a pipeline stage holds only some of them)."""
    return list(model.layers.values())


def _sum_gradients(model: nn.Module) -> None:
    """Make every FSDP/replicate unit sum its gradients over the data-parallel ranks (divide
    factor 1) because the loss is already normalised by the global token count. Forcing plain
    SUM collectives avoids NCCL's PREMUL_SUM, which gloo lacks (and a divide by 1 is skipped)."""
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)


def apply_fsdp(
    model: nn.Module,
    dp_mesh: DeviceMesh,
    *,
    param_dtype: torch.dtype | None = None,
    reduce_dtype: torch.dtype | None = torch.float32,
    reshard_after_forward: bool = True,
    mode: DataParallelMode = "fsdp",
    ignored_params: set[nn.Parameter] | None = None,
) -> nn.Module:
    """Shard (or replicate) `model` over `dp_mesh`, one unit per block and then the root.

    mode="fsdp": FSDP2 `fully_shard`. A 1-D mesh is ZeRO-3 (`reshard_after_forward=True`:
    parameters are freed after each block's forward and gathered again in backward) or
    ZeRO-2-like (`False`: gathered parameters stay until backward; gradients and optimizer
    state are still sharded). A 2-D mesh `(replicate, shard)` is HSDP: sharded over the last
    dimension, replicated over the first.
    mode="replicate": `torch.distributed._composable.replicate_with_fsdp.replicate`, i.e. DDP
    on the FSDP2 engine: parameters are `Replicate()` DTensors and gradients are all-reduced;
    it needs a 1-D mesh.
    mode="zero1": `fully_shard` with no unit resharding after forward (`reshard_after_forward`
    is ignored); with `defer_gradient_sync` and `gather_parameters` around each step it is
    ZeRO-1 (module docstring).

    `ignored_params` stay out of FSDP (e.g. experts already split over every data-parallel
    rank by expert parallelism). `param_dtype` None means
    `default_param_dtype(dp_mesh.device_type)` (pass torch.float32 for fp32 compute on a GPU).
    Call on the `meta` model before `to_empty` + `init_weights`. Returns `model` (modified in
    place).
    """
    if mode not in ("fsdp", "replicate", "zero1"):
        raise ValueError(f"mode must be 'fsdp', 'replicate' or 'zero1', got {mode!r}")
    if param_dtype is None:
        param_dtype = default_param_dtype(dp_mesh.device_type)
    policy = mixed_precision_policy(param_dtype, reduce_dtype)
    if mode != "replicate":
        keep = reshard_after_forward and mode == "fsdp"
        _shard(model, dp_mesh, policy, keep, ignored_params)
    else:
        if ignored_params:
            raise ValueError("mode='replicate' takes no ignored_params")
        _replicate(model, dp_mesh, policy)
    _sum_gradients(model)
    return model


def _shard(
    model: nn.Module,
    dp_mesh: DeviceMesh,
    policy: object,
    reshard_after_forward: bool,
    ignored_params: set[nn.Parameter] | None = None,
) -> None:
    """fully_shard each block, then the root (which takes the embeddings, final norm and
    output head: they are used at the two ends of the step, so one unit suffices).
    `reshard_after_forward` applies to the blocks; the root keeps its gathered parameters
    from forward until its gradients are reduced in backward."""
    from torch.distributed.fsdp import fully_shard

    blocks = _blocks(model)
    for index, block in enumerate(blocks):
        # The last block's parameters would be gathered again at once when backward starts,
        # so keeping them is free (the same choice as torchtitan's default).
        last = index == len(blocks) - 1
        fully_shard(
            block,
            mesh=dp_mesh,
            mp_policy=policy,
            reshard_after_forward=reshard_after_forward and not last,
            ignored_params=ignored_params,
        )
    # The root never reshards after forward: its parameters are needed again at once by the
    # loss and backward, and the fused loss reads `model.output.weight` outside any forward
    # (it must see the gathered tensor, not the shard).
    fully_shard(
        model,
        mesh=dp_mesh,
        mp_policy=policy,
        reshard_after_forward=False,
        ignored_params=ignored_params,
    )


def _replicate(model: nn.Module, dp_mesh: DeviceMesh, policy: object) -> None:
    """replicate each block, then the root: per-block units give per-block all-reduce buckets
    that overlap with the rest of backward."""
    from torch.distributed._composable.replicate_with_fsdp import replicate

    if dp_mesh.ndim != 1:
        raise ValueError(f"mode='replicate' needs a 1-D data-parallel mesh, got {dp_mesh.ndim}-D")
    for block in _blocks(model):
        replicate(block, mesh=dp_mesh, mp_policy=policy)
    replicate(model, mesh=dp_mesh, mp_policy=policy)


def _fsdp_units(module: nn.Module) -> list[nn.Module]:
    from torch.distributed.fsdp import FSDPModule

    return [m for m in module.modules() if isinstance(m, FSDPModule)]


def defer_gradient_sync(model: nn.Module, last: bool) -> None:
    """ZeRO-1's gradient accumulation: before a micro-batch's backward, tell every FSDP2 unit of
    `model` whether it is the step's last. Before the last, gradients accumulate whole (fp32)
    and parameters stay gathered; the last reduce-scatters the sum and reshards."""
    for unit in _fsdp_units(model):
        unit.set_requires_gradient_sync(last, recurse=False)
        unit.set_reshard_after_backward(last, recurse=False)


def gather_parameters(model: nn.Module) -> None:
    """ZeRO-1's all-gather after the optimizer step: every FSDP2 unit of `model` gathers its
    updated shards into whole parameters, which stay until the step's last backward."""
    for unit in _fsdp_units(model):
        unit.unshard()


def global_token_count(
    local_count: torch.Tensor | float | int, dp_group: dist.ProcessGroup | None
) -> torch.Tensor:
    """Loss tokens in the whole global batch: the sum of every data-parallel rank's count, as a
    0-dim float64 tensor on the count's device (no host sync).

    Each rank divides its loss sum by this number; summed gradients (see `apply_fsdp`) then
    equal the single-process gradient of the global batch. With `dp_group` None or no process
    group initialised it is the local count (single process).
    """
    if isinstance(local_count, torch.Tensor):
        count = local_count.detach().to(torch.float64).reshape(())
    else:
        count = torch.tensor(float(local_count), dtype=torch.float64)
    if dp_group is None or not dist.is_initialized() or dist.get_world_size(dp_group) == 1:
        return count
    if dist.get_backend(dp_group) == "nccl":
        count = count.cuda()
    dist.all_reduce(count, op=dist.ReduceOp.SUM, group=dp_group)
    return count


@torch.no_grad()
def copy_full_weights_(model: nn.Module, full_state: dict[str, torch.Tensor]) -> None:
    """Fill the parameters and buffers (e.g. DeepSeek's expert bias) of a sharded/replicated
    model named in `full_state` (all of them, or some) from full (unsharded) tensors; each rank
    keeps its own shard. Every rank of a parameter's mesh must pass the same tensor for it.

    Why: on a CPU mesh DTensor has no RNG tracker (torch supports it only on CUDA-like
    devices), so `init_weights()` after `to_empty` draws every rank's shard from the same
    stream: the shards come out identical and the weights differ from a single-process init.
    On CPU, initialise a plain model with the run's seed and copy it in with this function.
    """
    from torch.distributed.tensor import DTensor, distribute_tensor

    for name, param in itertools.chain(model.named_parameters(), model.named_buffers()):
        if name not in full_state:
            continue
        full = full_state[name].to(device=param.device, dtype=param.dtype)
        if isinstance(param, DTensor):
            full = distribute_tensor(full, param.device_mesh, param.placements)
        param.copy_(full)
