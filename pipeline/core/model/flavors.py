"""Named model sizes ("flavors") and the arithmetic that goes with them: parameter count and
training FLOPs per token (for MFU)."""

from __future__ import annotations

from collections.abc import Callable

from pipeline.core.model.config import ModelConfig, MoEConfig, RopeScaling


def llama3_8b() -> ModelConfig:
    return ModelConfig(
        vocab_size=128256,
        hidden_size=4096,
        num_layers=32,
        num_attention_heads=32,
        num_kv_heads=8,
        ffn_hidden_size=14336,
        rope_theta=500000.0,
        max_position_embeddings=8192,
    )


def llama3_70b() -> ModelConfig:
    return ModelConfig(
        vocab_size=128256,
        hidden_size=8192,
        num_layers=80,
        num_attention_heads=64,
        num_kv_heads=8,
        ffn_hidden_size=28672,
        rope_theta=500000.0,
        max_position_embeddings=8192,
    )


def llama3_2_1b() -> ModelConfig:
    return ModelConfig(
        vocab_size=128256,
        hidden_size=2048,
        num_layers=16,
        num_attention_heads=32,
        num_kv_heads=8,
        ffn_hidden_size=8192,
        rope_theta=500000.0,
        rope_scaling=RopeScaling(factor=32.0, original_max_position_embeddings=8192),
        max_position_embeddings=131072,
        tie_word_embeddings=True,
    )


def mixtral_8x7b() -> ModelConfig:
    return ModelConfig(
        vocab_size=32000,
        hidden_size=4096,
        num_layers=32,
        num_attention_heads=32,
        num_kv_heads=8,
        ffn_hidden_size=14336,
        rope_theta=1e6,
        max_position_embeddings=32768,
        moe=MoEConfig(num_experts=8, top_k=2),
    )


def tiny() -> ModelConfig:
    """CPU-sized Llama for tests and the quickstart (vocab fits the quickstart tokenizer)."""
    return ModelConfig(
        vocab_size=8192,
        hidden_size=128,
        num_layers=4,
        num_attention_heads=4,
        num_kv_heads=2,
        ffn_hidden_size=352,
        max_position_embeddings=256,
    )


def tiny_moe() -> ModelConfig:
    config = tiny()
    config.moe = MoEConfig(num_experts=4, top_k=2)
    return config


FLAVORS: dict[str, Callable[[], ModelConfig]] = {
    "llama3_8b": llama3_8b,
    "llama3_70b": llama3_70b,
    "llama3_2_1b": llama3_2_1b,
    "mixtral_8x7b": mixtral_8x7b,
    "tiny": tiny,
    "tiny_moe": tiny_moe,
}


def get_flavor(name: str) -> ModelConfig:
    """A fresh `ModelConfig` for a named flavor (fresh, so callers may modify it)."""
    try:
        return FLAVORS[name]()
    except KeyError:
        raise ValueError(f"unknown model flavor {name!r}; known: {sorted(FLAVORS)}") from None


def num_parameters(config: ModelConfig) -> int:
    """Total parameter count (all experts included; tied embeddings counted once)."""
    h, c = config.hidden_size, config
    q_dim = c.num_attention_heads * c.head_dim
    kv_dim = c.num_kv_heads * c.head_dim
    attn = h * q_dim + 2 * h * kv_dim + q_dim * h
    if c.qkv_bias:
        attn += q_dim + 2 * kv_dim
    if c.moe is None:
        mlp = 3 * h * c.ffn_hidden_size
    else:
        mlp = c.moe.num_experts * 3 * h * c.expert_ffn_hidden_size + h * c.moe.num_experts
    per_layer = attn + mlp + 2 * h  # two RMSNorm weights
    embeddings = c.vocab_size * h * (1 if c.tie_word_embeddings else 2)
    return embeddings + c.num_layers * per_layer + h


def flops_per_token(config: ModelConfig, seq_len: int) -> float:
    """Training FLOPs (forward + backward) per token, Megatron-LM's count with causal attention.

    Megatron's `num_floating_point_operations` divided by batch * seq_len:

        12 * L * H^2 * [ (1 + G/A + (S/H) / 2) * (A * D / H)      attention
                         + (F/H) * K * 3/2                          SwiGLU MLP, K experts per token
                         + V / (2 * L * H) ]                        output projection

    with L layers, H hidden, A query heads, G kv heads, D head_dim, S = seq_len, F the (expert)
    ffn size, K the router's top-k (1 when dense), V vocab. 12 = 3 (forward, weight grad, input
    grad) * 2 (multiply-add) * 2 (projections come in pairs). The S/H term is the two attention
    matmuls QK^T and AV, halved because a causal mask skips half of them (Megatron's
    causal-FLOPs accounting). Router matmuls and elementwise work are not counted.
    """
    c = config
    h, layers = c.hidden_size, c.num_layers
    top_k = 1 if c.moe is None else c.moe.top_k
    q_ratio = c.num_attention_heads * c.head_dim / h
    attn = (1 + c.num_kv_heads / c.num_attention_heads + seq_len / h / 2) * q_ratio
    mlp = c.expert_ffn_hidden_size / h * top_k * 1.5
    logit = c.vocab_size / (2 * layers * h)
    return 12 * layers * h * h * (attn + mlp + logit)
