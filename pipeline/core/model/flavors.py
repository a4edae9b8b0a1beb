"""Named model sizes ("flavors") and the arithmetic that goes with them: parameter count and
training FLOPs per token (for MFU)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from pipeline.core.model.config import MLAConfig, ModelConfig, MoEConfig, RopeScaling, YarnScaling
from pipeline.core.model.hybrid_flavors import HYBRID_FLAVORS


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


def qwen3_8b() -> ModelConfig:
    """Qwen3-8B (Qwen/Qwen3-8B-Base config.json): q/k norms, head_dim 128, untied."""
    return ModelConfig(
        vocab_size=151936,
        hidden_size=4096,
        num_layers=36,
        num_attention_heads=32,
        num_kv_heads=8,
        head_dim=128,
        ffn_hidden_size=12288,
        norm_eps=1e-6,
        rope_theta=1e6,
        max_position_embeddings=40960,
        qk_norm=True,
    )


def qwen3_30b_a3b() -> ModelConfig:
    """Qwen3-30B-A3B (Qwen/Qwen3-30B-A3B-Base config.json): 128 experts of width 768, top-8
    renormalised, in every layer; head_dim 128 (twice hidden / heads)."""
    return ModelConfig(
        vocab_size=151936,
        hidden_size=2048,
        num_layers=48,
        num_attention_heads=32,
        num_kv_heads=4,
        head_dim=128,
        ffn_hidden_size=6144,
        norm_eps=1e-6,
        rope_theta=1e6,
        max_position_embeddings=40960,
        qk_norm=True,
        moe=MoEConfig(
            num_experts=128, top_k=8, ffn_hidden_size=768, aux_loss_coeff=1e-3, norm_topk_prob=True
        ),
    )


def _deepseek_moe(**fields) -> MoEConfig:
    """DeepSeekMoE routing: sigmoid scores, renormalised top-k, the balancing bias, one shared
    expert; the sequence-wise balance loss at the weight of DeepSeek-V3's config.json
    (`aux_loss_alpha`, `seq_aux`)."""
    values = dict(
        score_function="sigmoid",
        norm_topk_prob=True,
        expert_bias=True,
        num_shared_experts=1,
        aux_loss_coeff=1e-3,
        aux_loss_type="sequence",
    )
    return MoEConfig(**(values | fields))


def deepseek_v3() -> ModelConfig:
    """DeepSeek-V3 (deepseek-ai/DeepSeek-V3 config.json) without its multi-token prediction
    module: 671B parameters, 37B active; 61 layers, the first 3 dense; 256 routed experts in 8
    groups (top-8 from the best 4 groups) plus one shared; latent attention with YaRN x40."""
    return ModelConfig(
        vocab_size=129280,
        hidden_size=7168,
        num_layers=61,
        num_attention_heads=128,
        ffn_hidden_size=18432,
        norm_eps=1e-6,
        rope_theta=10000.0,
        rope_scaling=YarnScaling(
            factor=40.0,
            original_max_position_embeddings=4096,
            beta_fast=32.0,
            beta_slow=1.0,
            mscale=1.0,
            mscale_all_dim=1.0,
        ),
        max_position_embeddings=163840,
        mla=MLAConfig(
            kv_lora_rank=512,
            q_lora_rank=1536,
            qk_nope_head_dim=128,
            qk_rope_head_dim=64,
            v_head_dim=128,
        ),
        moe=_deepseek_moe(
            num_experts=256,
            top_k=8,
            ffn_hidden_size=2048,
            num_groups=8,
            topk_groups=4,
            routed_scaling_factor=2.5,
            dense_layers=[0, 1, 2],
        ),
    )


def moonlight_16b_a3b() -> ModelConfig:
    """Moonlight-16B-A3B (moonshotai/Moonlight-16B-A3B config.json, a DeepseekV3ForCausalLM):
    27 layers, the first dense; 64 routed experts top-6 plus 2 shared; latent attention without
    the q low-rank projection (as DeepSeek-V2-Lite), no RoPE scaling."""
    return ModelConfig(
        vocab_size=163840,
        hidden_size=2048,
        num_layers=27,
        num_attention_heads=16,
        ffn_hidden_size=11264,
        norm_eps=1e-5,
        rope_theta=50000.0,
        max_position_embeddings=8192,
        mla=MLAConfig(
            kv_lora_rank=512,
            q_lora_rank=None,
            qk_nope_head_dim=128,
            qk_rope_head_dim=64,
            v_head_dim=128,
        ),
        moe=_deepseek_moe(
            num_experts=64,
            top_k=6,
            ffn_hidden_size=1408,
            num_shared_experts=2,
            routed_scaling_factor=2.446,
            dense_layers=[0],
        ),
    )


def kimi_k2() -> ModelConfig:
    """Kimi K2's text model (moonshotai/Kimi-K2-Thinking config.json; Kimi K2.5's text_config):
    DeepSeek-V3's design at 1.03T parameters, 32B active: 61 layers, the first dense; 384
    routed experts top-8 in one group plus one shared, scaled by 2.827; 64 latent-attention
    heads; YaRN x64 over 4096 positions with beta_fast = beta_slow = 1."""
    base = deepseek_v3()
    return dataclasses.replace(
        base,
        vocab_size=163840,
        num_attention_heads=64,
        num_kv_heads=None,  # re-derived from the heads, as is head_dim
        head_dim=None,
        norm_eps=1e-5,
        rope_theta=50000.0,
        rope_scaling=dataclasses.replace(base.rope_scaling, factor=64.0, beta_fast=1.0),
        max_position_embeddings=262144,
        moe=dataclasses.replace(
            base.moe,
            num_experts=384,
            num_groups=1,
            topk_groups=1,
            routed_scaling_factor=2.827,
            dense_layers=[0],
        ),
    )


def glm4_5_air() -> ModelConfig:
    """GLM-4.5-Air (zai-org/GLM-4.5-Air config.json) without its multi-token prediction layer:
    46 layers, the first dense; 128 routed experts top-8 plus one shared; 96 query heads over
    8 kv heads of width 128 with q/k/v biases, RoPE over half of each head. The balance loss is
    off, as the config.json says nothing of one (the correction bias balances the load)."""
    return ModelConfig(
        vocab_size=151552,
        hidden_size=4096,
        num_layers=46,
        num_attention_heads=96,
        num_kv_heads=8,
        head_dim=128,
        ffn_hidden_size=10944,
        rope_theta=1e6,
        max_position_embeddings=131072,
        qkv_bias=True,
        partial_rotary_factor=0.5,
        moe=_deepseek_moe(
            num_experts=128, top_k=8, ffn_hidden_size=1408, aux_loss_coeff=0.0, dense_layers=[0]
        ),
    )


def _gpt_oss(num_layers: int, num_experts: int) -> ModelConfig:
    """gpt-oss (openai/gpt-oss-20b and -120b config.json): 64 query heads of 64 over 8 kv heads
    with q/k/v/o biases and sinks, sliding (128 tokens) and full attention alternating, YaRN
    (factor 32 over 4096 positions, ramp not truncated), experts of width 2880 with biases and
    the clamped SwiGLU, top-4 under a biased router."""
    return ModelConfig(
        vocab_size=201088,
        hidden_size=2880,
        num_layers=num_layers,
        num_attention_heads=64,
        num_kv_heads=8,
        head_dim=64,
        ffn_hidden_size=2880,
        norm_eps=1e-5,
        rope_theta=150000.0,
        rope_scaling=YarnScaling(
            factor=32.0,
            original_max_position_embeddings=4096,
            mscale=0.0,
            mscale_all_dim=0.0,
            truncate=False,
        ),
        max_position_embeddings=131072,
        qkv_bias=True,
        attention_out_bias=True,
        attention_sinks=True,
        layer_types=["sliding_attention", "full_attention"] * (num_layers // 2),
        sliding_window=128,
        moe=MoEConfig(
            num_experts=num_experts,
            top_k=4,
            ffn_hidden_size=2880,
            aux_loss_coeff=0.9,
            router_bias=True,
            expert_biases=True,
            activation="swiglu_clamped",
        ),
    )


def glm4_5() -> ModelConfig:
    """GLM-4.5 (zai-org/GLM-4.5 config.json; GLM-4.6 and 4.7 share the shape) without its
    multi-token prediction layer: GLM-4.5-Air's design at 92 layers, the first 3 dense, hidden
    5120, 160 routed experts of width 1536 scaled by 2.5, and per-head q/k norms."""
    config = glm4_5_air()
    config.hidden_size = 5120
    config.num_layers = 92
    config.ffn_hidden_size = 12288
    config.qk_norm = True
    config.moe = _deepseek_moe(
        num_experts=160,
        top_k=8,
        ffn_hidden_size=1536,
        routed_scaling_factor=2.5,
        aux_loss_coeff=0.0,
        dense_layers=[0, 1, 2],
    )
    return config


def minimax_m2() -> ModelConfig:
    """MiniMax-M2 (MiniMaxAI/MiniMax-M2 config.json) without its multi-token prediction
    modules: 62 layers of 256 experts (width 1536, top-8) routed by sigmoid scores with the
    balancing bias, no shared expert; 48 query heads over 8 kv heads of width 128, q/k norms
    over the whole projection, RoPE over 64 of each head's 128 dimensions."""
    return ModelConfig(
        vocab_size=200064,
        hidden_size=3072,
        num_layers=62,
        num_attention_heads=48,
        num_kv_heads=8,
        head_dim=128,
        ffn_hidden_size=1536,
        norm_eps=1e-6,
        rope_theta=5e6,
        max_position_embeddings=196608,
        qk_norm=True,
        qk_norm_scope="projection",
        partial_rotary_factor=0.5,
        moe=MoEConfig(
            num_experts=256,
            top_k=8,
            ffn_hidden_size=1536,
            aux_loss_coeff=1e-3,
            score_function="sigmoid",
            expert_bias=True,
        ),
    )


def gpt_oss_20b() -> ModelConfig:
    """gpt-oss-20b: 24 layers, 32 experts (20.9B parameters, 3.6B active)."""
    return _gpt_oss(24, 32)


def gpt_oss_120b() -> ModelConfig:
    """gpt-oss-120b: 36 layers, 128 experts (116.8B parameters, 5.1B active)."""
    return _gpt_oss(36, 128)


def smollm3_3b() -> ModelConfig:
    """SmolLM3-3B (HuggingFaceTB/SmolLM3-3B config.json): Llama's block with no RoPE in every
    fourth layer, tied embeddings."""
    return ModelConfig(
        vocab_size=128256,
        hidden_size=2048,
        num_layers=36,
        num_attention_heads=16,
        num_kv_heads=4,
        ffn_hidden_size=11008,
        norm_eps=1e-6,
        rope_theta=5e6,
        max_position_embeddings=65536,
        tie_word_embeddings=True,
        no_rope_layers=list(range(3, 36, 4)),
    )


def seed_oss_36b() -> ModelConfig:
    """Seed-OSS-36B (ByteDance-Seed/Seed-OSS-36B-Base config.json): q/k/v biases, no o_proj
    bias, 80 query heads of 128 over 8 kv heads."""
    return ModelConfig(
        vocab_size=155136,
        hidden_size=5120,
        num_layers=64,
        num_attention_heads=80,
        num_kv_heads=8,
        head_dim=128,
        ffn_hidden_size=27648,
        norm_eps=1e-6,
        rope_theta=1e7,
        max_position_embeddings=524288,
        qkv_bias=True,
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


def tiny_qwen3() -> ModelConfig:
    """CPU-sized Qwen3: q/k norms, head_dim 64 (not hidden / heads = 32). Untied, as Qwen3-8B
    (the small Qwen3s tie theirs; tied embeddings do not split over pipeline stages)."""
    config = tiny()
    config.head_dim = 64
    config.qk_norm = True
    config.norm_eps = 1e-6
    config.rope_theta = 1e6
    return config


def tiny_qwen3_moe() -> ModelConfig:
    """CPU-sized Qwen3-MoE: 8 small experts (width 64), top-2 renormalised, in every layer but
    the first (HF `mlp_only_layers=[0]`), which keeps a dense MLP."""
    config = tiny_qwen3()
    config.moe = MoEConfig(
        num_experts=8, top_k=2, ffn_hidden_size=64, aux_loss_coeff=1e-3, dense_layers=[0]
    )
    return config


def tiny_deepseek_v3() -> ModelConfig:
    """CPU-sized DeepSeek-V3: latent attention with the q low-rank projection, the first layer
    dense, then 8 routed experts (width 64) in 4 groups, top-2 from the best 2, one shared."""
    config = tiny()
    config.norm_eps = 1e-6
    config.rope_theta = 10000.0
    config.num_kv_heads = config.num_attention_heads
    config.mla = MLAConfig(
        kv_lora_rank=64, q_lora_rank=96, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32
    )
    config.moe = _deepseek_moe(
        num_experts=8,
        top_k=2,
        ffn_hidden_size=64,
        num_groups=4,
        topk_groups=2,
        routed_scaling_factor=2.5,
        dense_layers=[0],
    )
    return config


def tiny_gpt_oss() -> ModelConfig:
    """CPU-sized gpt-oss: sinks, q/k/v/o biases, sliding (window 8) and full layers alternating,
    YaRN without truncation, 8 experts (width 64) with biases and the clamped SwiGLU, top-2."""
    config = tiny()
    config.head_dim = 16
    config.rope_theta = 150000.0
    config.rope_scaling = YarnScaling(
        factor=4.0,
        original_max_position_embeddings=64,
        mscale=0.0,
        mscale_all_dim=0.0,
        truncate=False,
    )
    config.qkv_bias = config.attention_out_bias = config.attention_sinks = True
    config.layer_types = ["sliding_attention", "full_attention"] * (config.num_layers // 2)
    config.sliding_window = 8
    config.moe = MoEConfig(
        num_experts=8,
        top_k=2,
        ffn_hidden_size=64,
        aux_loss_coeff=1e-3,
        router_bias=True,
        expert_biases=True,
        activation="swiglu_clamped",
    )
    return config


def tiny_smollm3() -> ModelConfig:
    """CPU-sized SmolLM3 with every option its config can set: no RoPE in layers 1 and 3, which
    also slide over 8 tokens, q/k/v/o biases (untied, so pipeline stages may split it)."""
    config = tiny()
    config.no_rope_layers = [1, 3]
    config.layer_types = ["full_attention", "sliding_attention"] * 2
    config.sliding_window = 8
    config.qkv_bias = config.attention_out_bias = True
    return config


def tiny_seed_oss() -> ModelConfig:
    """CPU-sized Seed-OSS: q/k/v biases without an o_proj bias, head_dim 16 (not hidden /
    heads), Seed-OSS-36B's norm epsilon and RoPE base; untied, so pipeline stages may split it."""
    config = tiny()
    config.head_dim = 16
    config.qkv_bias = True
    config.norm_eps = 1e-6
    config.rope_theta = 1e7
    return config


def tiny_bloom() -> ModelConfig:
    """CPU-sized BLOOM: ALiBi over 6 heads (not a power of two), LayerNorms with biases (one
    after the embedding too), a plain tanh-GeLU MLP of 4 x hidden, biases on every linear,
    tied embeddings."""
    return ModelConfig(
        vocab_size=8192,
        hidden_size=96,
        num_layers=4,
        num_attention_heads=6,
        ffn_hidden_size=384,
        max_position_embeddings=256,
        tie_word_embeddings=True,
        qkv_bias=True,
        attention_out_bias=True,
        mlp_bias=True,
        activation="gelu_pytorch_tanh",
        gated_mlp=False,
        norm_type="layernorm",
        norm_bias=True,
        embedding_norm=True,
        position_embedding="alibi",
    )


def tiny_mpt() -> ModelConfig:
    """CPU-sized MPT: ALiBi, LayerNorms without biases, a plain exact-GeLU MLP of 4 x hidden,
    no biases, q/k/v clamped to +-6 (MPT's clip_qkv)."""
    return ModelConfig(
        vocab_size=8192,
        hidden_size=128,
        num_layers=4,
        num_attention_heads=4,
        ffn_hidden_size=512,
        max_position_embeddings=256,
        tie_word_embeddings=True,
        activation="gelu",
        gated_mlp=False,
        norm_type="layernorm",
        position_embedding="alibi",
        clip_qkv=6.0,
    )


def tiny_glm4_moe() -> ModelConfig:
    """CPU-sized GLM-4.5: q/k/v biases, per-head q/k norms, RoPE over half of each head
    (head_dim 64: 32 rotated), the first layer dense, then 8 routed experts (width 64) in 4
    groups, top-2 from the best 2, one shared."""
    config = tiny()
    config.head_dim = 64
    config.qkv_bias = True
    config.qk_norm = True
    config.partial_rotary_factor = 0.5
    config.rope_theta = 1e6
    config.moe = tiny_deepseek_v3().moe  # DeepSeek-V3's MoE, as the tiny DeepSeek has it
    return config


def tiny_minimax_m2() -> ModelConfig:
    """CPU-sized MiniMax-M2: q/k norms over the whole projection, RoPE over half of each head
    (head_dim 64: 32 rotated), 8 experts (width 64) top-2 in every layer, sigmoid scores with
    the balancing bias."""
    config = tiny()
    config.head_dim = 64
    config.qk_norm = True
    config.qk_norm_scope = "projection"
    config.partial_rotary_factor = 0.5
    config.norm_eps = 1e-6
    config.rope_theta = 5e6
    config.moe = MoEConfig(
        num_experts=8,
        top_k=2,
        ffn_hidden_size=64,
        aux_loss_coeff=1e-3,
        score_function="sigmoid",
        expert_bias=True,
    )
    return config


def tiny_mistral4() -> ModelConfig:
    """CPU-sized Mistral 4: tiny_deepseek_v3's latent attention with YaRN x4 over 16 positions
    and Llama 4's query scale (beta 0.1: a micro run of 32 tokens sees it change), the first
    layer dense, then 8 routed experts chosen by softmax scores in 4 groups (top-2 from the
    best 2), one shared."""
    config = tiny_deepseek_v3()
    config.rope_scaling = YarnScaling(factor=4.0, original_max_position_embeddings=16)
    config.query_scale_beta = 0.1
    config.moe = MoEConfig(
        num_experts=8,
        top_k=2,
        ffn_hidden_size=64,
        aux_loss_coeff=1e-3,
        dense_layers=[0],
        num_groups=4,
        topk_groups=2,
        num_shared_experts=1,
    )
    return config


FLAVORS: dict[str, Callable[[], ModelConfig]] = {
    "llama3_8b": llama3_8b,
    "llama3_70b": llama3_70b,
    "llama3_2_1b": llama3_2_1b,
    "mixtral_8x7b": mixtral_8x7b,
    "qwen3_8b": qwen3_8b,
    "qwen3_30b_a3b": qwen3_30b_a3b,
    "deepseek_v3": deepseek_v3,
    "moonlight_16b_a3b": moonlight_16b_a3b,
    "kimi_k2": kimi_k2,
    "glm4_5_air": glm4_5_air,
    "glm4_5": glm4_5,
    "minimax_m2": minimax_m2,
    "tiny": tiny,
    "tiny_moe": tiny_moe,
    "tiny_qwen3": tiny_qwen3,
    "tiny_qwen3_moe": tiny_qwen3_moe,
    "tiny_deepseek_v3": tiny_deepseek_v3,
    "gpt_oss_20b": gpt_oss_20b,
    "gpt_oss_120b": gpt_oss_120b,
    "smollm3_3b": smollm3_3b,
    "seed_oss_36b": seed_oss_36b,
    "tiny_gpt_oss": tiny_gpt_oss,
    "tiny_smollm3": tiny_smollm3,
    "tiny_seed_oss": tiny_seed_oss,
    "tiny_bloom": tiny_bloom,
    "tiny_mpt": tiny_mpt,
    "tiny_glm4_moe": tiny_glm4_moe,
    "tiny_minimax_m2": tiny_minimax_m2,
    "tiny_mistral4": tiny_mistral4,
}


FLAVORS |= HYBRID_FLAVORS


def get_flavor(name: str) -> ModelConfig:
    """A fresh `ModelConfig` for a named flavor (fresh, so callers may modify it)."""
    try:
        return FLAVORS[name]()
    except KeyError:
        raise ValueError(f"unknown model flavor {name!r}; known: {sorted(FLAVORS)}") from None


def num_parameters(config: ModelConfig) -> int:
    """Total parameter count (all experts included; tied embeddings counted once)."""
    h, c = config.hidden_size, config
    if c.mla is None:
        q_dim = c.num_attention_heads * c.head_dim
        kv_dim = c.num_kv_heads * c.head_dim
        attn = h * q_dim * (2 if c.attention_output_gate else 1) + 2 * h * kv_dim + q_dim * h
        if c.qkv_bias:
            attn += q_dim + 2 * kv_dim
        attn += c.num_attention_heads * c.attention_sinks
        if c.attention_out_bias:
            attn += h
        if c.qk_norm:
            attn += q_dim + kv_dim if c.qk_norm_scope == "projection" else 2 * c.head_dim
    else:
        attn = _mla_linear_parameters(c) + c.mla.kv_lora_rank + (c.mla.q_lora_rank or 0)
    up = 2 if c.gated_mlp else 1  # gate and up, or up alone
    dense_mlp = (up + 1) * h * c.ffn_hidden_size
    if c.mlp_bias:
        dense_mlp += up * c.ffn_hidden_size + h
    moe_mlp = 0
    if c.moe is not None:
        moe_mlp = c.moe.num_experts * (expert_parameters(c) + h + c.moe.router_bias)
        shared_width = c.moe.shared_expert_ffn_hidden_size or (
            c.expert_ffn_hidden_size * c.moe.num_shared_experts
        )
        moe_mlp += 3 * h * shared_width + (h if c.moe.shared_expert_gate else 0)
    moe_layers = c.num_moe_layers
    mlp = moe_layers * moe_mlp + (c.num_layers - moe_layers) * dense_mlp
    linear_layers = sum(c.layer_type(i) == "linear_attention" for i in range(c.num_layers))
    mixers = (c.num_layers - linear_layers) * attn
    if linear_layers:
        mixers += linear_layers * _linear_attention_parameters(c)
    norm = h * (2 if c.norm_type == "layernorm" and c.norm_bias else 1)
    embeddings = c.vocab_size * h * (1 if c.tie_word_embeddings else 2)
    embeddings += norm if c.embedding_norm else 0
    return embeddings + mixers + c.num_layers * 2 * norm + mlp + norm  # two norms a layer


def expert_parameters(config: ModelConfig) -> int:
    """Parameters of one routed expert: its three projections, and their biases (gpt-oss)."""
    h, ffn = config.hidden_size, config.expert_ffn_hidden_size
    biases = 2 * ffn + h if config.moe is not None and config.moe.expert_biases else 0
    return 3 * h * ffn + biases


def _linear_attention_parameters(config: ModelConfig) -> int:
    """One gated DeltaNet layer's parameters: q/k/v/z/b/a projections, conv, A_log, dt_bias,
    the gated norm and the output projection."""
    s, h = config.linear_attention, config.hidden_size
    projections = h * (s.conv_dim + s.value_dim + 2 * s.num_value_heads)
    conv = s.conv_dim * s.conv_kernel_size
    return projections + conv + 2 * s.num_value_heads + s.value_head_dim + s.value_dim * h


def _hybrid_mixer_macs(config: ModelConfig, seq_len: int) -> float:
    """Multiply-adds per token of the token mixer, the mean over a hybrid model's layers. Full
    attention: its projections (the output gate's rows in `wq` too) and the two causal matmuls
    over seq_len / 2 keys on average. Gated DeltaNet: its projections, the conv, and per value
    head the delta rule's three key x value products per token (decay and read, write, output)
    plus the chunked form's scores within a chunk (64 / 2 keys on average)."""
    c, h = config, config.hidden_size
    q_dim, kv_dim = c.num_attention_heads * c.head_dim, c.num_kv_heads * c.head_dim
    gate = 2 if c.attention_output_gate else 1
    full = h * q_dim * gate + 2 * h * kv_dim + q_dim * h + q_dim * seq_len
    s = c.linear_attention
    projections = h * (s.conv_dim + s.value_dim + 2 * s.num_value_heads) + s.value_dim * h
    rule = s.num_value_heads * (
        3 * s.key_head_dim * s.value_head_dim + 32 * (s.key_head_dim + s.value_head_dim)
    )
    linear = projections + s.conv_dim * s.conv_kernel_size + rule
    kinds = [c.layer_type(i) for i in range(c.num_layers)]
    share = kinds.count("linear_attention") / len(kinds)
    return share * linear + (1 - share) * full


def _mla_linear_parameters(config: ModelConfig) -> int:
    """Weights of latent attention's projections (norms excluded)."""
    h, heads, mla = config.hidden_size, config.num_attention_heads, config.mla
    q_out = heads * mla.qk_head_dim
    q = h * q_out if mla.q_lora_rank is None else mla.q_lora_rank * (h + q_out)
    kv = h * (mla.kv_lora_rank + mla.qk_rope_head_dim)
    kv += mla.kv_lora_rank * heads * (mla.qk_nope_head_dim + mla.v_head_dim)
    return q + kv + heads * mla.v_head_dim * h


def flops_per_token(config: ModelConfig, seq_len: int) -> float:
    """Training FLOPs (forward + backward) per token, Megatron-LM's count with causal attention.

    Megatron's `num_floating_point_operations` divided by batch * seq_len:

        12 * L * H^2 * [ (1 + G/A + (S/H) / 2) * (A * D / H)      attention
                         + (F/H) * K * 3/2                          SwiGLU MLP, K experts per token
                         + V / (2 * L * H) ]                        output projection

    with L layers, H hidden, A query heads, G kv heads, D head_dim, S = seq_len, F the (expert)
    ffn size, K the router's top-k (1 when dense), V vocab. With dense and MoE layers mixed
    (Qwen3-MoE's `mlp_only_layers`), the MLP term is the mean over layers of each one's F * K;
    shared experts add their width to F * K. Latent attention's term is, in the same units,
    (its projection weights + A * (qk_head_dim + v_head_dim) * S / 2) / (2 * H^2): each weight
    is one multiply-add per token, and the two attention matmuls are as wide as q.k and v.
    12 = 3 (forward, weight grad, input grad) * 2 (multiply-add) * 2 (projections come in
    pairs). The S/H term is the two attention matmuls QK^T and AV, halved because a causal mask
    skips half of them (Megatron's causal-FLOPs accounting). Router matmuls and elementwise
    work are not counted.
    """
    c = config
    h, layers = c.hidden_size, c.num_layers
    if c.mla is None:
        q_ratio = c.num_attention_heads * c.head_dim / h
        attn = (1 + c.num_kv_heads / c.num_attention_heads + seq_len / h / 2) * q_ratio
    else:
        scores = c.num_attention_heads * (c.mla.qk_head_dim + c.mla.v_head_dim) * seq_len / 2
        attn = (_mla_linear_parameters(c) + scores) / (2 * h * h)
    if c.linear_attention is not None:
        attn = _hybrid_mixer_macs(c, seq_len) / (2 * h * h)
    moe_width = 0
    if c.moe is not None:
        moe_width = c.expert_ffn_hidden_size * (c.moe.top_k + c.moe.num_shared_experts)
        if c.moe.shared_expert_ffn_hidden_size:
            moe_width += c.moe.shared_expert_ffn_hidden_size - c.expert_ffn_hidden_size
    moe_layers = c.num_moe_layers
    mean_width = (moe_layers * moe_width + (layers - moe_layers) * c.ffn_hidden_size) / layers
    mlp = mean_width / h * (1.5 if c.gated_mlp else 1.0)  # three matrices, or two
    logit = c.vocab_size / (2 * layers * h)
    return 12 * layers * h * h * (attn + mlp + logit)
