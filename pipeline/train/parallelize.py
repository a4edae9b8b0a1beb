"""The step between building the model on `meta` and materialising it (DESIGN principle 2).

Data parallelism (FSDP2) is the one parallel layout wired in so far; tensor, pipeline, context
and expert parallelism are refused. `parallelize` applies, in torchtitan's order: (TP ->)
activation checkpointing -> compile -> FSDP2. Checkpointing and compile are applied per
transformer block and in place, by replacing the block's `forward`, so parameter names (the
checkpoint's names) do not change; FSDP2 keeps them too (its parameters are DTensors).

`init_distributed` and `build_parallel_dims` set up the process group and the device mesh of a
run launched by torchrun (`pipe train --nproc-per-node N`).
"""

from __future__ import annotations

import functools
import os
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

from pipeline.core.parallel.dims import ParallelDims

if TYPE_CHECKING:
    from pipeline.core.model.transformer import Transformer
    from pipeline.train.config import TrainConfig

__all__ = [
    "apply_activation_checkpointing",
    "build_parallel_dims",
    "init_distributed",
    "parallelize",
    "refuse_unsupported_layout",
    "wants_distributed",
]

UNSUPPORTED = ("tp", "pp", "cp", "ep")

# Selective recomputation keeps the outputs of matmuls and attention (expensive to recompute)
# and recomputes everything elementwise (norms, activations, RoPE), which is cheap.
_SAVE_OPS = {
    torch.ops.aten.mm.default,
    torch.ops.aten.addmm.default,
    torch.ops.aten.bmm.default,
    torch.ops.aten._scaled_dot_product_efficient_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
    torch.ops.aten._scaled_dot_product_cudnn_attention.default,
}


def _selective_policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in _SAVE_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def apply_activation_checkpointing(model: Transformer, mode: str) -> None:
    """Recompute each block's activations in backward: `full` keeps only block inputs,
    `selective` also keeps matmul and attention outputs; `none` leaves the model alone."""
    if mode == "none":
        return
    if mode not in ("full", "selective"):
        raise ValueError(f"unknown activation checkpointing mode {mode!r}")
    context_fn = None
    if mode == "selective":
        context_fn = functools.partial(create_selective_checkpoint_contexts, _selective_policy)
    for block in model.layers.values():
        inner = block.forward

        def checkpointed(*args: Any, _inner: Any = inner, **kwargs: Any) -> Any:
            extra = {"context_fn": context_fn} if context_fn is not None else {}
            return checkpoint(_inner, *args, use_reentrant=False, **extra, **kwargs)

        block.forward = checkpointed


def refuse_unsupported_layout(cfg: TrainConfig) -> None:
    """Raise NotImplementedError naming the degrees > 1 that are not wired in (all but dp)."""
    p = cfg.parallel
    wanted = {name: getattr(p, name) for name in UNSUPPORTED if getattr(p, name) > 1}
    if wanted:
        layout = ", ".join(f"{k}={v}" for k, v in wanted.items())
        raise NotImplementedError(
            f"parallel layouts are not implemented yet ({layout}): only data parallelism "
            "(parallel.dp) is; use degrees of 1 for tp, pp, cp and ep"
        )


def wants_distributed(cfg: TrainConfig) -> bool:
    """True when the run is (or must be) multi-process: a process group exists, torchrun
    launched us with WORLD_SIZE > 1, or `parallel.dp` > 1."""
    if dist.is_available() and dist.is_initialized():
        return True
    return int(os.environ.get("WORLD_SIZE", "1")) > 1 or cfg.parallel.dp > 1


def init_distributed(device: torch.device) -> torch.device:
    """Initialise the default process group if needed (gloo on CPU, nccl on CUDA); returns this
    rank's device (`cuda:LOCAL_RANK` on GPUs). Needs torchrun's RANK / WORLD_SIZE variables
    when no group exists yet."""
    if device.type == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    if dist.is_initialized():
        return device
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        raise RuntimeError(
            "data parallel training needs one process per rank: launch with "
            "`pipe train --nproc-per-node N` (torchrun), not a single process"
        )
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    return device


def build_parallel_dims(cfg: TrainConfig, device_type: str) -> ParallelDims:
    """`ParallelDims` for the initialised world (dp from `parallel.dp`, -1 inferred) with its
    mesh built; refuses layouts other than pure data parallelism."""
    refuse_unsupported_layout(cfg)
    dims = ParallelDims(dp=cfg.parallel.dp, world_size=dist.get_world_size())
    dims.build_mesh(device_type)
    return dims


def _fsdp_param_dtype(cfg: TrainConfig, device_type: str) -> torch.dtype:
    """Compute dtype of the gathered parameters: bf16 only for bf16 runs on CUDA."""
    bf16 = device_type == "cuda" and cfg.training.dtype == "bf16"
    return torch.bfloat16 if bf16 else torch.float32


def parallelize(
    model: Transformer, cfg: TrainConfig, dims: ParallelDims | None = None
) -> Transformer:
    """Apply the configured layout to a model still on `meta`; returns the model to train.

    Activation checkpointing and per-block `torch.compile` as configured, then, with `dims`
    and dp > 1, FSDP2 over the "dp_cp" mesh (gradients summed, see `apply_fsdp`). Without
    `dims` (one process) any parallel degree > 1 is refused.
    """
    from pipeline.core.parallel.fsdp import apply_fsdp

    refuse_unsupported_layout(cfg)
    if dims is None and cfg.parallel.dp > 1:
        raise NotImplementedError(
            f"parallel.dp = {cfg.parallel.dp} needs that many processes "
            "(pipe train --nproc-per-node N)"
        )
    apply_activation_checkpointing(model, cfg.training.activation_checkpointing)
    if cfg.training.compile:
        for block in model.layers.values():
            block.compile()
    if dims is not None and dims.dp_enabled:
        mesh = dims.get_mesh("dp_cp")
        apply_fsdp(model, mesh, param_dtype=_fsdp_param_dtype(cfg, mesh.device_type))
    return model
