"""The step between building the model on `meta` and materialising it (DESIGN principle 2).

Single device for now: no tensor, pipeline or data parallelism yet, so `parallelize` applies only
what a single device has, in the order the parallel version will keep: (TP ->) activation
checkpointing -> compile (-> FSDP2). Both are applied per transformer block and in place, by
replacing the block's `forward`, so parameter names (the checkpoint's names) do not change.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

import torch
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

if TYPE_CHECKING:
    from pipeline.core.model.transformer import Transformer
    from pipeline.train.config import TrainConfig

__all__ = ["apply_activation_checkpointing", "parallelize"]

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


def parallelize(model: Transformer, cfg: TrainConfig) -> Transformer:
    """Apply the configured layout to a model still on `meta`; returns the model to train.

    Identity for the parallel degrees (all 1 until the parallel work lands); activation
    checkpointing and per-block `torch.compile` as configured.
    """
    p = cfg.parallel
    if max(p.tp, p.pp, p.cp, p.ep) > 1 or p.dp > 1:
        raise NotImplementedError("parallel layouts are not implemented yet (single device only)")
    apply_activation_checkpointing(model, cfg.training.activation_checkpointing)
    if cfg.training.compile:
        for block in model.layers.values():
            block.compile()
    return model
