"""Named sizes of the hybrid linear-attention families: Qwen3.5 (dense and MoE) and Qwen3-Next,
at the published sizes and at CPU size. `flavors.FLAVORS` includes them."""

from __future__ import annotations

from collections.abc import Callable

from pipeline.core.model.config import LinearAttentionConfig, ModelConfig, MoEConfig


def _hybrid(layers: int, **fields) -> ModelConfig:
    """Three gated DeltaNet layers then one gated full-attention layer, repeated; (1 + w)
    norms, q/k norms, a quarter of each head rotated, theta 1e7 (the published models')."""
    kinds = ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(layers)]
    defaults = dict(
        num_layers=layers,
        norm_eps=1e-6,
        rope_theta=1e7,
        max_position_embeddings=262144,
        qk_norm=True,
        layer_types=kinds,
        partial_rotary_factor=0.25,
        norm_unit_offset=True,
        attention_output_gate=True,
        linear_attention=LinearAttentionConfig(),
    )
    return ModelConfig(**(defaults | fields))


def _gated_moe(num_experts: int, top_k: int, width: int, **fields) -> MoEConfig:
    """Softmax top-k renormalised, plus one shared expert of the same width behind a sigmoid
    gate (Qwen3-Next, Qwen3.5-MoE)."""
    defaults = dict(
        num_experts=num_experts,
        top_k=top_k,
        ffn_hidden_size=width,
        aux_loss_coeff=1e-3,
        num_shared_experts=1,
        shared_expert_ffn_hidden_size=width,
        shared_expert_gate=True,
    )
    return MoEConfig(**(defaults | fields))


def qwen3_5_27b() -> ModelConfig:
    """Qwen3.5-27B's language model (Qwen/Qwen3.5-27B text_config): 64 layers, hidden 5120,
    24/4 heads of 256, linear attention 16 key heads and 48 value heads of 128, ffn 17408."""
    return _hybrid(
        64,
        vocab_size=248320,
        hidden_size=5120,
        num_attention_heads=24,
        num_kv_heads=4,
        head_dim=256,
        ffn_hidden_size=17408,
        linear_attention=LinearAttentionConfig(num_key_heads=16, num_value_heads=48),
    )


def qwen3_5_35b_a3b() -> ModelConfig:
    """Qwen3.5-35B-A3B's language model: 40 layers, hidden 2048, 16/2 heads of 256, 256
    experts of width 512 in every layer, top 8, one gated shared expert of 512."""
    return _hybrid(
        40,
        vocab_size=248320,
        hidden_size=2048,
        num_attention_heads=16,
        num_kv_heads=2,
        head_dim=256,
        ffn_hidden_size=512,
        moe=_gated_moe(256, 8, 512),
    )


def qwen3_next_80b_a3b() -> ModelConfig:
    """Qwen3-Next-80B-A3B: 48 layers, hidden 2048, 16/2 heads of 256, 512 experts of width 512,
    top 10, one gated shared expert of 512; head-grouped fused linear projections."""
    return _hybrid(
        48,
        vocab_size=151936,
        hidden_size=2048,
        num_attention_heads=16,
        num_kv_heads=2,
        head_dim=256,
        ffn_hidden_size=5120,
        moe=_gated_moe(512, 10, 512),
        linear_attention=LinearAttentionConfig(interleaved_projections=True),
    )


def tiny_qwen3_5() -> ModelConfig:
    """CPU-sized Qwen3.5: 4 layers (linear, linear, linear, full), hidden 256, 4/2 heads of
    64; linear attention 2 key heads and 4 value heads of 32."""
    return _hybrid(
        4,
        vocab_size=8192,
        hidden_size=256,
        num_attention_heads=4,
        num_kv_heads=2,
        head_dim=64,
        ffn_hidden_size=512,
        max_position_embeddings=2048,
        linear_attention=LinearAttentionConfig(
            num_key_heads=2, num_value_heads=4, key_head_dim=32, value_head_dim=32
        ),
    )


def tiny_qwen3_5_moe() -> ModelConfig:
    """tiny_qwen3_5 with 8 experts of width 64 (top 2) and a gated shared expert of 64."""
    config = tiny_qwen3_5()
    config.moe = _gated_moe(8, 2, 64)
    return config


def tiny_qwen3_next() -> ModelConfig:
    """tiny_qwen3_5_moe with Qwen3-Next's head-grouped fused linear projections."""
    config = tiny_qwen3_5_moe()
    config.linear_attention.interleaved_projections = True
    return config


HYBRID_FLAVORS: dict[str, Callable[[], ModelConfig]] = {
    "qwen3_5_27b": qwen3_5_27b,
    "qwen3_5_35b_a3b": qwen3_5_35b_a3b,
    "qwen3_next_80b_a3b": qwen3_next_80b_a3b,
    "tiny_qwen3_5": tiny_qwen3_5,
    "tiny_qwen3_5_moe": tiny_qwen3_5_moe,
    "tiny_qwen3_next": tiny_qwen3_next,
}
