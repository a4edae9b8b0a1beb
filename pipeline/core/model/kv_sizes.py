"""A KV cache's per-token shapes and bytes (and linear attention's per-sequence states) from a
model's config alone, torch-free: the
serving cache (`pipeline.serve.engine.kv_cache`) allocates by them and `pipe train --dry-run` sizes
GRPO's rollout engine by them without importing torch."""

from __future__ import annotations

import math

from pipeline.core.model.config import ModelConfig

__all__ = ["kv_bytes_per_token", "slot_shapes", "state_bytes_per_sequence", "state_shapes"]


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
    return per_layer * _attention_layers(config) * element_size


def _attention_layers(config: ModelConfig) -> int:
    """Layers with a KV cache: all but linear attention's (which keep a state instead)."""
    kinds = [config.layer_type(i) for i in range(config.num_layers)]
    return len(kinds) - kinds.count("linear_attention")


def state_shapes(config: ModelConfig, tp: int = 1) -> list[tuple[int, ...]]:
    """What one linear-attention layer keeps per sequence on one of `tp` ranks, in fp32: the
    conv window (its last `width - 1` inputs) and the delta rule's state per value head; []
    for a model without linear attention."""
    s = config.linear_attention
    if s is None:
        return []
    return [
        (s.conv_dim // tp, s.conv_kernel_size - 1),
        (s.num_value_heads // tp, s.key_head_dim, s.value_head_dim),
    ]


def state_bytes_per_sequence(config: ModelConfig, tp: int = 1) -> int:
    """The fp32 state bytes one sequence takes over all linear-attention layers (one rank)."""
    linear = config.num_layers - _attention_layers(config)
    return linear * sum(math.prod(shape) for shape in state_shapes(config, tp)) * 4
