"""Model configuration: one dataclass covers Llama 3 / 3.1 / 3.2, Mistral, Qwen2 and Mixtral-style
mixture of experts. Field names follow Megatron's arguments (`hidden_size`, `num_query_groups` is
`num_kv_heads` here), so recipes read naturally to its users.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass
class RopeScaling:
    """Llama 3.1-style RoPE frequency scaling (`rope_type: llama3` in Hugging Face configs)."""

    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass
class MoEConfig:
    """Mixture of experts in every layer (Mixtral style): a top-k softmax router over experts."""

    num_experts: int = 8
    top_k: int = 2
    ffn_hidden_size: int | None = None  # per expert; None: the dense ffn_hidden_size
    aux_loss_coeff: float = 0.01  # load-balancing loss (Switch/Megatron formulation)
    z_loss_coeff: float = 0.0  # router z-loss (ST-MoE)
    capacity_factor: float | None = None  # None: dropless; else tokens over capacity are dropped


@dataclass
class ModelConfig:
    """Shape and numerics of a decoder-only transformer."""

    vocab_size: int = 32000
    hidden_size: int = 4096
    num_layers: int = 32
    num_attention_heads: int = 32
    num_kv_heads: int | None = None  # None: multi-head attention (= num_attention_heads)
    head_dim: int | None = None  # None: hidden_size // num_attention_heads (Mistral sets it)
    ffn_hidden_size: int = 14336
    norm_eps: float = 1e-5
    rope_theta: float = 500000.0
    rope_scaling: RopeScaling | None = None
    max_position_embeddings: int = 8192
    tie_word_embeddings: bool = False
    qkv_bias: bool = False  # Qwen2
    moe: MoEConfig | None = None
    init_method_std: float = 0.02
    # Megatron's scaled init: output projections of each block use std / sqrt(2 * num_layers).
    use_scaled_init: bool = True

    def __post_init__(self) -> None:
        if self.num_kv_heads is None:
            self.num_kv_heads = self.num_attention_heads
        if self.head_dim is None:
            if self.hidden_size % self.num_attention_heads:
                raise ValueError(
                    f"hidden_size {self.hidden_size} is not divisible by num_attention_heads "
                    f"{self.num_attention_heads}; set head_dim explicitly"
                )
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.num_attention_heads % self.num_kv_heads:
            raise ValueError(
                f"num_attention_heads {self.num_attention_heads} must be a multiple of "
                f"num_kv_heads {self.num_kv_heads}"
            )
        if self.moe is not None and self.moe.top_k > self.moe.num_experts:
            raise ValueError(f"moe.top_k {self.moe.top_k} > moe.num_experts {self.moe.num_experts}")

    @property
    def is_moe(self) -> bool:
        return self.moe is not None

    @property
    def expert_ffn_hidden_size(self) -> int:
        if self.moe is None or self.moe.ffn_hidden_size is None:
            return self.ffn_hidden_size
        return self.moe.ffn_hidden_size


def model_config_from_dict(values: dict[str, Any]) -> ModelConfig:
    """A `ModelConfig` from `dataclasses.asdict` output (as checkpoints record it)."""
    values = dict(values)
    if values.get("moe") is not None:
        values["moe"] = MoEConfig(**values["moe"])
    if values.get("rope_scaling") is not None:
        values["rope_scaling"] = RopeScaling(**values["rope_scaling"])
    return ModelConfig(**values)
