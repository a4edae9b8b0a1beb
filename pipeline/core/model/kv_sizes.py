"""A KV cache's per-token shapes and bytes from a model's config alone, torch-free: the
serving cache (`pipeline.serve.engine.kv_cache`) allocates by them and `pipe train --dry-run` sizes
GRPO's rollout engine by them without importing torch."""

from __future__ import annotations

import math

from pipeline.core.model.config import ModelConfig

__all__ = ["kv_bytes_per_token", "slot_shapes"]


def slot_shapes(config: ModelConfig, tp: int = 1) -> list[tuple[int, ...]]:
    """The per-token shapes cached by one layer (key, value; or latent, RoPE key) on one of `tp`
    tensor-parallel ranks (each holds its own kv heads; the latent is replicated)."""
    if config.attention_kind == "mla":
        return [(config.mla.kv_lora_rank,), (config.mla.qk_rope_head_dim,)]
    return [(config.num_kv_heads // tp, config.head_dim)] * 2


def kv_bytes_per_token(config: ModelConfig, element_size: int, tp: int = 1) -> int:
    """Cache bytes one token takes over all layers (on one of `tp` ranks), each cached value
    `element_size` bytes (2 for bf16, 4 for fp32)."""
    per_layer = sum(math.prod(shape) for shape in slot_shapes(config, tp))
    return per_layer * config.num_layers * element_size
