"""Our `ModelConfig` <-> a Hugging Face `config.json` dict (Llama, Mistral, Qwen2, Qwen3,
Mixtral, Qwen3-MoE, DeepSeek-V3, GLM-4.5, MiniMax-M2, Mistral 4; BLOOM and MPT in
`hf_alibi_families.py`).

Reading accepts both transformers 4.x keys (`rope_theta` + `rope_scaling`, `torch_dtype`) and the
5.x ones (`rope_parameters`, `dtype`). Writing emits the 4.x spelling, which vLLM, TensorRT-LLM
and older transformers read, and which transformers 5 still loads. Anything our model cannot
represent exactly (o_proj or MLP biases, another activation, linear RoPE scaling, YaRN outside
latent attention, a sliding window shorter than the context, partial RoPE outside GLM-4.5 and
MiniMax-M2) is refused rather than silently dropped.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from pipeline.core.model.config import (
    LinearAttentionConfig,
    MLAConfig,
    ModelConfig,
    MoEConfig,
    RopeScaling,
    YarnScaling,
)
from pipeline.weights.hf_alibi_families import (
    ALIBI_ARCHITECTURES,
    alibi_architecture,
    alibi_config_from_hf,
    alibi_config_to_hf,
)

__all__ = [
    "SUPPORTED_ARCHITECTURES",
    "choose_architecture",
    "config_from_hf",
    "config_to_hf",
    "hf_architecture",
    "dtype_from_hf",
    "generation_config",
    "rope_from_hf",
    "rope_scaling_to_hf",
    "text_model",
]

log = logging.getLogger(__name__)

SUPPORTED_ARCHITECTURES: dict[str, str] = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "MixtralForCausalLM": "mixtral",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "DeepseekV3ForCausalLM": "deepseek_v3",
    "Glm4MoeForCausalLM": "glm4_moe",
    "MiniMaxM2ForCausalLM": "minimax_m2",
    "Mistral4ForCausalLM": "mistral4",
    "GptOssForCausalLM": "gpt_oss",
    "SmolLM3ForCausalLM": "smollm3",
    "SeedOssForCausalLM": "seed_oss",
    **ALIBI_ARCHITECTURES,
    "Qwen3_5ForCausalLM": "qwen3_5_text",
    "Qwen3_5MoeForCausalLM": "qwen3_5_moe_text",
    "Qwen3NextForCausalLM": "qwen3_next",
}
_HYBRID = ("Qwen3_5ForCausalLM", "Qwen3_5MoeForCausalLM", "Qwen3NextForCausalLM")
# Architectures whose configs say `use_sliding_window` (the window is off unless it is true).
_OPTIONAL_WINDOW = ("Qwen2ForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM")
_QWEN3 = ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM")
_DEEPSEEK = "DeepseekV3ForCausalLM"
# GLM-4.5/4.6/4.7: grouped-query attention (q/k/v biases, optional per-head q/k norms, half the
# head rotated) in front of DeepSeek-V3's MoE.
_GLM = "Glm4MoeForCausalLM"
_DEEPSEEK_MOE = (_DEEPSEEK, _GLM)  # DeepSeek-V3's MoE keys and layout
# MiniMax-M2: q/k norms over the whole projection, partial RoPE (`rotary_dim`), experts in every
# layer routed by sigmoid scores with the correction bias, no shared expert.
_MINIMAX = "MiniMaxM2ForCausalLM"
# Mistral 4: DeepSeek-V3's latent attention with Llama 4's query scale, and a MoE of softmax
# scores (grouped top-k, no correction bias) with shared experts.
_MISTRAL4 = "Mistral4ForCausalLM"
_LATENT = (_DEEPSEEK, _MISTRAL4)  # multi-head latent attention
_GPT_OSS = "GptOssForCausalLM"
_SMOLLM3 = "SmolLM3ForCausalLM"
_SEED_OSS = "SeedOssForCausalLM"
# Architectures whose configs list each layer's attention (`layer_types`, `sliding_window`).
_LAYER_TYPED = (_GPT_OSS, _SMOLLM3)
_DEFAULT_ROPE_THETA = 10000.0


# Multimodal wrappers whose text model (`text_config`) pipe reads, by the wrapper's architecture
# or model_type: (the text model's architecture, the prefix of its weights' names on disk,
# the wrapper's keys its config takes when it has none of its own). Kimi K2.5 keeps the whole
# text model, lm_head too, under `language_model.` (its vision tower and projector are left
# out). Qwen3.5's image-text checkpoints keep it under `model.language_model.` with `lm_head`
# at the top: names the Hugging Face name map reads as they are (`hf_names.hf_to_pipe_name`),
# so there is no prefix to strip, and its wrapper config reads as its text model's.
_TEXT_MODELS: dict[str, tuple[str, str, tuple[str, ...]]] = {
    "kimi_k25": ("DeepseekV3ForCausalLM", "language_model.", ("quantization_config",)),
    "Qwen3_5ForConditionalGeneration": ("Qwen3_5ForCausalLM", "", ("tie_word_embeddings",)),
    "Qwen3_5MoeForConditionalGeneration": ("Qwen3_5MoeForCausalLM", "", ("tie_word_embeddings",)),
}


def text_model(hf: dict[str, Any]) -> tuple[dict[str, Any], str]:
    """(config.json dict of the model pipe reads, the prefix its weights' names carry on disk):
    the dict itself and "" for a text model; for a multimodal wrapper (`_TEXT_MODELS`), its
    `text_config` named with the text architecture and taking the wrapper's keys it lacks."""
    archs = hf.get("architectures") or []
    wrapper = next((a for a in archs if a in _TEXT_MODELS), hf.get("model_type"))
    if wrapper not in _TEXT_MODELS:
        return hf, ""
    architecture, prefix, inherited = _TEXT_MODELS[wrapper]
    text = hf.get("text_config")
    if not isinstance(text, dict):
        raise ValueError(f"config.json: a {wrapper} config without a text_config")
    text = dict(text, architectures=[architecture])
    for key in inherited:
        if key in hf:
            text.setdefault(key, hf[key])
    return text, prefix


def _supported() -> str:
    return ", ".join(f"{a} ({t})" for a, t in SUPPORTED_ARCHITECTURES.items())


def hf_architecture(hf: dict[str, Any]) -> str:
    """The supported architecture a config.json dict names (a multimodal wrapper's text
    architecture for Qwen3.5's image-text checkpoints); ValueError listing them if none."""
    archs = hf.get("architectures") or []
    for arch in archs:
        if arch in SUPPORTED_ARCHITECTURES:
            return arch
        if arch in _TEXT_MODELS:
            return _TEXT_MODELS[arch][0]
    model_type = hf.get("model_type")
    for arch, mtype in SUPPORTED_ARCHITECTURES.items():
        if not archs and model_type == mtype:
            return arch
    raise ValueError(
        f"unsupported Hugging Face model: architectures={archs}, model_type={model_type!r}; "
        f"supported: {_supported()}"
    )


def rope_from_hf(hf: dict[str, Any]) -> tuple[float, RopeScaling | YarnScaling | None]:
    """rope_theta and scaling from either spelling (5.x `rope_parameters` or 4.x keys)."""
    params = hf.get("rope_parameters")
    if params:
        theta = params.get("rope_theta", hf.get("rope_theta", _DEFAULT_ROPE_THETA))
        scaling = params
    else:
        theta = hf.get("rope_theta", _DEFAULT_ROPE_THETA)
        scaling = hf.get("rope_scaling") or {}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return float(theta), None
    if kind == "yarn":
        return float(theta), _yarn_from_hf(scaling, hf)
    if kind != "llama3":
        raise ValueError(f"unsupported rope scaling {kind!r}; supported: default, llama3, yarn")
    defaults = RopeScaling()
    return float(theta), RopeScaling(
        factor=float(scaling.get("factor", defaults.factor)),
        low_freq_factor=float(scaling.get("low_freq_factor", defaults.low_freq_factor)),
        high_freq_factor=float(scaling.get("high_freq_factor", defaults.high_freq_factor)),
        original_max_position_embeddings=int(
            scaling.get(
                "original_max_position_embeddings", defaults.original_max_position_embeddings
            )
        ),
    )


def _yarn_from_hf(scaling: dict[str, Any], hf: dict[str, Any]) -> YarnScaling:
    """YaRN as transformers reads it: a missing `mscale` or `mscale_all_dim` is 0 (off), a
    missing `factor` is max_position_embeddings / original_max_position_embeddings."""
    original = int(scaling["original_max_position_embeddings"])
    factor = scaling.get("factor") or hf["max_position_embeddings"] / original
    attention_factor = scaling.get("attention_factor")
    return YarnScaling(
        truncate=bool(scaling.get("truncate", True)),
        attention_factor=None if attention_factor is None else float(attention_factor),
        factor=float(factor),
        original_max_position_embeddings=original,
        beta_fast=float(scaling.get("beta_fast") or 32.0),
        beta_slow=float(scaling.get("beta_slow") or 1.0),
        mscale=float(scaling.get("mscale") or 0.0),
        mscale_all_dim=float(scaling.get("mscale_all_dim") or 0.0),
    )


def _check_sliding_window(hf: dict[str, Any], arch: str, ignore: bool) -> None:
    """Our attention is full causal: a window shorter than the context changes the model."""
    window = hf.get("sliding_window")
    if arch in _OPTIONAL_WINDOW and not hf.get("use_sliding_window", False):
        window = None
    if window is None or window >= hf.get("max_position_embeddings", 0):
        return
    if not ignore:
        raise ValueError(
            f"{arch} uses sliding-window attention (window {window} < max_position_embeddings "
            f"{hf.get('max_position_embeddings')}), which pipe models do not implement; outputs "
            f"match only for sequences up to {window} tokens. Pass ignore_sliding_window=True "
            f"to convert anyway with full attention."
        )
    log.warning("ignoring sliding_window=%s: pipe models use full causal attention", window)


def _refuse(condition: bool, what: str) -> None:
    if condition:
        raise ValueError(f"unsupported Hugging Face config: {what}")


def config_from_hf(hf: dict[str, Any], *, ignore_sliding_window: bool = False) -> ModelConfig:
    """Our `ModelConfig` for a Hugging Face `config.json` dict.

    Raises ValueError naming the supported architectures for any other model, and for settings
    our model cannot reproduce exactly.
    """
    hf, _prefix = text_model(hf)
    arch = hf_architecture(hf)
    if arch in ALIBI_ARCHITECTURES:
        return alibi_config_from_hf(hf, arch)
    if arch in _HYBRID:
        return _hybrid_from_hf(hf, arch)
    _refuse(hf.get("hidden_act", "silu") != "silu", f"hidden_act {hf.get('hidden_act')!r}")
    biased = arch in (_GPT_OSS, _SMOLLM3, _SEED_OSS, _GLM)  # GLM: q/k/v biases only
    _refuse(bool(hf.get("attention_bias")) and not biased, "attention_bias (o_proj bias)")
    _refuse(bool(hf.get("mlp_bias")), "mlp_bias is not supported")
    _refuse(hf.get("pretraining_tp", 1) != 1, "pretraining_tp != 1")
    if arch not in _LAYER_TYPED:
        _check_sliding_window(hf, arch, ignore_sliding_window)
    theta, scaling = rope_from_hf(hf)
    heads = hf["num_attention_heads"]
    head_dim = hf.get("head_dim")
    if head_dim is None and arch == "Qwen3ForCausalLM":
        head_dim = 128  # Qwen3Config's default (Qwen3-MoE's is hidden_size / heads)
    if arch in _LATENT:
        head_dim = None  # transformers writes qk_rope_head_dim there; latent attention's own
    if arch == _SEED_OSS and head_dim is None:
        head_dim = 128  # SeedOssConfig's default
    layer_types, window = _layer_types_from_hf(hf, arch)
    return ModelConfig(
        vocab_size=hf["vocab_size"],
        hidden_size=hf["hidden_size"],
        num_layers=hf["num_hidden_layers"],
        num_attention_heads=heads,
        num_kv_heads=heads if arch in _LATENT else hf.get("num_key_value_heads") or heads,
        head_dim=head_dim,
        ffn_hidden_size=hf["intermediate_size"],
        norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        rope_scaling=scaling,
        max_position_embeddings=hf.get("max_position_embeddings", 2048),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", arch == _SMOLLM3)),
        qkv_bias=arch == "Qwen2ForCausalLM" or (biased and bool(hf.get("attention_bias"))),
        qk_norm=arch in (*_QWEN3, _MINIMAX) or (arch == _GLM and bool(hf.get("use_qk_norm"))),
        qk_norm_scope="projection" if arch == _MINIMAX else "head",
        partial_rotary_factor=_partial_rotary_from_hf(hf, arch),
        query_scale_beta=_query_scale_beta(hf, arch),
        moe=_moe_of(hf, arch),
        mla=_mla_from_hf(hf) if arch in _LATENT else None,
        init_method_std=float(hf.get("initializer_range", 0.02)),
        layer_types=layer_types,
        sliding_window=window,
        attention_out_bias=_out_bias_from_hf(hf, arch),
        attention_sinks=arch == _GPT_OSS,
        no_rope_layers=_no_rope_layers_from_hf(hf, arch),
    )


def _query_scale_beta(hf: dict[str, Any], arch: str) -> float:
    """Mistral 4's `llama_4_scaling_beta` (in `rope_parameters`, or 4.x `rope_scaling`)."""
    params = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    beta = params.get("llama_4_scaling_beta")
    _refuse(beta is not None and arch != _MISTRAL4, f"llama_4_scaling_beta in {arch}")
    return float(beta or 0.0)


def _moe_of(hf: dict[str, Any], arch: str) -> MoEConfig | None:
    if arch == _MISTRAL4:
        return _mistral4_moe_from_hf(hf)
    if arch in _DEEPSEEK_MOE:
        return _deepseek_moe_from_hf(hf, arch)
    if arch == _MINIMAX:
        return _minimax_moe_from_hf(hf)
    return _moe_from_hf(hf, arch)


def _partial_rotary_from_hf(hf: dict[str, Any], arch: str) -> float:
    """The share of each head RoPE rotates: `partial_rotary_factor` at the top (4.x) or in
    `rope_parameters` (5.x), or MiniMax-M2's `rotary_dim` over head_dim; GLM-4.5's default is
    a half, every other family's the whole."""
    if arch in _LATENT:
        return 1.0  # latent attention rotates its own qk_rope_head_dim part (Mistral 4 says so)
    params = hf.get("rope_parameters") or {}
    default = 0.5 if arch == _GLM else 1.0
    if arch == _MINIMAX and hf.get("rotary_dim") is not None:
        default = hf["rotary_dim"] / hf.get("head_dim", 128)
    factor = params.get("partial_rotary_factor", hf.get("partial_rotary_factor", default))
    _refuse(factor != 1.0 and arch not in _PARTIAL_ROTARY, f"partial_rotary_factor in {arch}")
    return float(factor)


# Families whose transformers code rotates only part of each head (rotate-half within it).
_PARTIAL_ROTARY = (_GLM, _MINIMAX)


def _out_bias_from_hf(hf: dict[str, Any], arch: str) -> bool:
    """gpt-oss and SmolLM3 bias o_proj with `attention_bias`; Seed-OSS has its own key."""
    if arch == _SEED_OSS:
        return bool(hf.get("attention_out_bias", False))
    return arch in (_GPT_OSS, _SMOLLM3) and bool(hf.get("attention_bias", arch == _GPT_OSS))


def _layer_types_from_hf(hf: dict[str, Any], arch: str) -> tuple[list[str] | None, int | None]:
    """(layer_types, sliding_window) of gpt-oss (sliding and full layers alternating unless the
    config lists them) and SmolLM3 (sliding only with `use_sliding_window`); None, None when
    every layer is full attention."""
    if arch not in _LAYER_TYPED:
        return None, None
    layers = hf["num_hidden_layers"]
    window = hf.get("sliding_window", 128 if arch == _GPT_OSS else None)
    if arch == _SMOLLM3 and not (hf.get("use_sliding_window") and window is not None):
        return None, None  # SmolLM3 slides only with use_sliding_window, whatever layer_types say
    kinds = hf.get("layer_types")
    if kinds is None and arch == _GPT_OSS:
        kinds = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)]
    if kinds is None:  # SmolLM3's default: the layers without RoPE slide
        no_rope = set(_no_rope_layers_from_hf(hf, arch))
        kinds = ["sliding_attention" if i in no_rope else "full_attention" for i in range(layers)]
    if len(kinds) != layers:
        raise ValueError(f"unsupported Hugging Face config: layer_types has {len(kinds)} entries")
    if all(kind == "full_attention" for kind in kinds):
        return None, None
    return list(kinds), window


def _no_rope_layers_from_hf(hf: dict[str, Any], arch: str) -> list[int]:
    """SmolLM3's layers without RoPE: the zeros of `no_rope_layers`, by default every
    `no_rope_layer_interval`-th layer."""
    if arch != _SMOLLM3:
        return []
    flags = hf.get("no_rope_layers")
    if flags is None:
        interval = hf.get("no_rope_layer_interval", 4)
        flags = [int((i + 1) % interval != 0) for i in range(hf["num_hidden_layers"])]
    return [i for i, use_rope in enumerate(flags) if not use_rope]


def _moe_from_hf(hf: dict[str, Any], arch: str) -> MoEConfig | None:
    """Mixtral: experts in every layer; Qwen3-MoE: in the layers `decoder_sparse_step` and
    `mlp_only_layers` say, of width `moe_intermediate_size`, top-k renormalised only with
    `norm_topk_prob`. The aux-loss coefficient is carried over as is
    (docs/models.md, "The MoE load-balancing loss")."""
    aux = float(hf.get("router_aux_loss_coef", MoEConfig.aux_loss_coeff))
    if arch == _GPT_OSS:
        return _gpt_oss_moe_from_hf(hf, aux)
    if arch == "MixtralForCausalLM":
        return MoEConfig(
            num_experts=hf["num_local_experts"], top_k=hf["num_experts_per_tok"], aux_loss_coeff=aux
        )
    if arch != "Qwen3MoeForCausalLM":
        return None
    num_experts = hf.get("num_experts", hf.get("num_local_experts", 128))
    if not num_experts:
        return None  # transformers builds every layer dense then
    return MoEConfig(
        num_experts=num_experts,
        top_k=hf.get("num_experts_per_tok", 8),
        ffn_hidden_size=hf.get("moe_intermediate_size", 768),
        aux_loss_coeff=aux,
        norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
        layer_step=hf.get("decoder_sparse_step", 1),
        dense_layers=list(hf.get("mlp_only_layers") or []),
    )


def _mistral4_moe_from_hf(hf: dict[str, Any]) -> MoEConfig | None:
    """Mistral 4: the first `first_k_dense_replace` layers dense (none by default), then
    softmax-scored routed experts, grouped top-k, renormalised and scaled, plus shared ones."""
    dense = hf.get("first_k_dense_replace") or 0
    if dense >= hf["num_hidden_layers"]:
        return None
    shared = hf.get("n_shared_experts", 1)
    _refuse(not shared, "Mistral 4 without shared experts")
    return MoEConfig(
        num_experts=hf.get("n_routed_experts", hf.get("num_local_experts", 128)),
        top_k=hf.get("num_experts_per_tok") or 4,
        ffn_hidden_size=hf.get("moe_intermediate_size", 2048),
        aux_loss_coeff=0.0,
        norm_topk_prob=bool(hf.get("norm_topk_prob", True)),
        dense_layers=list(range(dense)),
        num_groups=hf.get("n_group") or 1,
        topk_groups=hf.get("topk_group") or 1,
        routed_scaling_factor=float(hf.get("routed_scaling_factor", 1.0)),
        num_shared_experts=shared,
    )


def _minimax_moe_from_hf(hf: dict[str, Any]) -> MoEConfig:
    """MiniMax-M2: `num_local_experts` experts of width `intermediate_size` in every layer,
    chosen by sigmoid scores plus the correction bias, weighed by their renormalised scores."""
    _refuse(hf.get("scoring_func", "sigmoid") != "sigmoid", "scoring_func other than sigmoid")
    _refuse(bool(hf.get("shared_intermediate_size")), "MiniMax-M2 with a shared expert")
    return MoEConfig(
        num_experts=hf.get("num_local_experts", 256),
        top_k=hf.get("num_experts_per_tok", 8),
        ffn_hidden_size=hf["intermediate_size"],
        aux_loss_coeff=float(hf.get("router_aux_loss_coef", 0.001)),
        score_function="sigmoid",
        expert_bias=True,
    )


def _gpt_oss_moe_from_hf(hf: dict[str, Any], aux: float) -> MoEConfig:
    """gpt-oss: experts in every layer, of width `intermediate_size`, with biases and the
    clamped SwiGLU; a biased router whose top-k logits are softmaxed, which is the softmax over
    all experts renormalised over the chosen ones (`norm_topk_prob`)."""
    return MoEConfig(
        num_experts=hf.get("num_local_experts", 128),
        top_k=hf.get("num_experts_per_tok", 4),
        ffn_hidden_size=hf["intermediate_size"],
        aux_loss_coeff=aux,
        norm_topk_prob=True,
        router_bias=True,
        expert_biases=True,
        activation="swiglu_clamped",
        swiglu_limit=float(hf.get("swiglu_limit", 7.0)),
        swiglu_alpha=float(hf.get("swiglu_alpha", 1.702)),
    )


def _hybrid_from_hf(hf: dict[str, Any], arch: str) -> ModelConfig:
    """Qwen3-Next and Qwen3.5 (dense or MoE): gated DeltaNet layers and gated full attention
    (`layer_types`, or every `full_attention_interval`-th layer full), (1 + w) norms, q/k
    norms, partial RoPE. Multimodal RoPE sections (`mrope_section`) are plain RoPE for text,
    whose three position ids are equal."""
    _refuse(hf.get("hidden_act", "silu") != "silu", f"hidden_act {hf.get('hidden_act')!r}")
    _refuse(bool(hf.get("attention_bias")), "attention_bias (q/k/v/o biases) in " + arch)
    params = dict(hf.get("rope_parameters") or {})
    for key in ("mrope_section", "mrope_interleaved"):
        params.pop(key, None)
    theta, scaling = rope_from_hf({**hf, "rope_parameters": params})
    _refuse(scaling is not None, f"RoPE scaling in {arch}")
    factor = params.get("partial_rotary_factor", hf.get("partial_rotary_factor", 0.25))
    layers = hf["num_hidden_layers"]
    kinds = hf.get("layer_types")
    if not kinds:
        interval = hf.get("full_attention_interval", 4)
        kinds = [
            "full_attention" if (i + 1) % interval == 0 else "linear_attention"
            for i in range(layers)
        ]
    unknown = sorted(set(kinds) - {"full_attention", "linear_attention"})
    _refuse(bool(unknown), f"layer_types {unknown} in {arch}")
    linear = LinearAttentionConfig(
        num_key_heads=hf.get("linear_num_key_heads", 16),
        num_value_heads=hf.get("linear_num_value_heads", 32),
        key_head_dim=hf.get("linear_key_head_dim", 128),
        value_head_dim=hf.get("linear_value_head_dim", 128),
        conv_kernel_size=hf.get("linear_conv_kernel_dim", 4),
        interleaved_projections=arch == "Qwen3NextForCausalLM",
    )
    heads = hf["num_attention_heads"]
    return ModelConfig(
        vocab_size=hf["vocab_size"],
        hidden_size=hf["hidden_size"],
        num_layers=layers,
        num_attention_heads=heads,
        num_kv_heads=hf.get("num_key_value_heads") or heads,
        head_dim=hf.get("head_dim") or 256,
        # Qwen3.5-MoE has experts in every layer and no dense width: the experts' stands in.
        ffn_hidden_size=hf.get("intermediate_size") or hf.get("moe_intermediate_size", 5632),
        norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        max_position_embeddings=hf.get("max_position_embeddings", 32768),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        qk_norm=True,
        moe=_hybrid_moe_from_hf(hf, arch),
        init_method_std=float(hf.get("initializer_range", 0.02)),
        layer_types=list(kinds),
        partial_rotary_factor=float(factor),
        norm_unit_offset=True,
        attention_output_gate=True,
        linear_attention=linear,
    )


def _hybrid_moe_from_hf(hf: dict[str, Any], arch: str) -> MoEConfig | None:
    """Qwen3-Next's and Qwen3.5-MoE's experts: softmax top-k plus one shared expert of width
    shared_expert_intermediate_size weighed by a sigmoid gate. Qwen3.5-MoE has experts in every
    layer and always renormalises the top k; Qwen3-Next reads decoder_sparse_step,
    mlp_only_layers and norm_topk_prob as Qwen3-MoE does."""
    if arch == "Qwen3_5ForCausalLM" or not hf.get("num_experts", 512):
        return None
    next_model = arch == "Qwen3NextForCausalLM"
    return MoEConfig(
        num_experts=hf.get("num_experts", 512),
        top_k=hf.get("num_experts_per_tok", 10),
        ffn_hidden_size=hf.get("moe_intermediate_size", 512),
        aux_loss_coeff=float(hf.get("router_aux_loss_coef", 0.001)),
        norm_topk_prob=bool(hf.get("norm_topk_prob", True)) if next_model else True,
        layer_step=hf.get("decoder_sparse_step", 1) if next_model else 1,
        dense_layers=list(hf.get("mlp_only_layers") or []) if next_model else [],
        num_shared_experts=1,
        shared_expert_ffn_hidden_size=hf.get("shared_expert_intermediate_size", 512),
        shared_expert_gate=True,
    )


def _mla_from_hf(hf: dict[str, Any]) -> MLAConfig:
    return MLAConfig(
        kv_lora_rank=hf["kv_lora_rank"],
        q_lora_rank=hf.get("q_lora_rank"),
        qk_nope_head_dim=hf["qk_nope_head_dim"],
        qk_rope_head_dim=hf["qk_rope_head_dim"],
        v_head_dim=hf["v_head_dim"],
        rope_interleave=bool(hf.get("rope_interleave", True)),
    )


def _deepseek_moe_from_hf(hf: dict[str, Any], arch: str = _DEEPSEEK) -> MoEConfig | None:
    """DeepSeekMoE: the first `first_k_dense_replace` layers dense, then sigmoid-scored routed
    experts chosen with the correction bias (`topk_method` noaux_tc) plus shared experts. The
    hub configs' `aux_loss_alpha` becomes our balance-loss coefficient, sequence-wise unless
    `seq_aux` is false (DeepSeek's reference code defaults it to true). GLM-4.5 has the same MoE
    with transformers' defaults of one first dense layer and one shared expert."""
    _refuse(hf.get("scoring_func", "sigmoid") != "sigmoid", "scoring_func other than sigmoid")
    _refuse(hf.get("topk_method", "noaux_tc") != "noaux_tc", "topk_method other than noaux_tc")
    _refuse(hf.get("moe_layer_freq", 1) != 1, "moe_layer_freq != 1")
    glm = arch == _GLM
    shared = hf.get("n_shared_experts", 1 if glm else None)
    _refuse(not shared, f"{arch} without shared experts")
    dense = hf.get("first_k_dense_replace", 1 if glm else 3)
    if dense >= hf["num_hidden_layers"]:
        return None  # every layer dense
    return MoEConfig(
        num_experts=hf["n_routed_experts"],
        top_k=hf["num_experts_per_tok"],
        ffn_hidden_size=hf["moe_intermediate_size"],
        aux_loss_coeff=float(hf.get("aux_loss_alpha", 0.0)),
        aux_loss_type="sequence" if hf.get("seq_aux", True) else "micro_batch",
        norm_topk_prob=bool(hf.get("norm_topk_prob", True)),
        dense_layers=list(range(dense)),
        score_function="sigmoid",
        num_groups=hf.get("n_group") or 1,
        topk_groups=hf.get("topk_group") or 1,
        routed_scaling_factor=float(hf.get("routed_scaling_factor", 1.0)),
        num_shared_experts=shared,
        expert_bias=True,
    )


def choose_architecture(config: ModelConfig, preferred: str | None = None) -> str:
    """The HF architecture that represents `config` exactly: `preferred` (e.g. the one a model
    was read from) when it can, else Qwen3 / Qwen3-MoE for q/k norms, Mixtral for MoE, Qwen2
    for q/k/v biases, Mistral for an explicit head_dim, Llama otherwise."""
    default_head_dim = config.head_dim == config.hidden_size // config.num_attention_heads
    if config.position_embedding == "alibi":
        return alibi_architecture(config, preferred)
    _check_llama_block(config)
    if config.linear_attention is not None or config.norm_unit_offset:
        candidates = [_hybrid_architecture(config)]
    elif config.mla is not None and (config.query_scale_beta or not _deepseek_routed(config)):
        _check_mistral4(config)
        candidates = [_MISTRAL4]
    elif config.mla is not None:
        _check_deepseek(config)
        candidates = [_DEEPSEEK]
    elif config.qk_norm and config.qk_norm_scope == "projection":
        _check_minimax(config)
        candidates = [_MINIMAX]
    elif config.partial_rotary_factor != 1.0 or _deepseek_routed(config):
        _check_deepseek_moe(config, _GLM)
        candidates = [_GLM]
    elif config.attention_sinks or (config.moe is not None and config.moe.expert_biases):
        _check_gpt_oss(config)
        candidates = [_GPT_OSS]
    elif config.layer_types is not None or config.no_rope_layers:
        _refuse(
            config.qk_norm or config.is_moe or not default_head_dim,
            "per-layer windows or RoPE need SmolLM3's shape (dense, no q/k norms)",
        )
        _refuse(config.qkv_bias != config.attention_out_bias, "SmolLM3 biases q/k/v/o together")
        candidates = [_SMOLLM3]
    elif config.attention_out_bias and not config.attention_sinks:
        _refuse(config.qk_norm or config.is_moe, "an o_proj bias with q/k norms or experts")
        candidates = [_SEED_OSS]
    elif config.qk_norm:
        _refuse(config.qkv_bias, "q/k norms with q/k/v biases have no supported HF architecture")
        candidates = ["Qwen3MoeForCausalLM" if config.is_moe else "Qwen3ForCausalLM"]
    elif config.is_moe:
        _refuse(config.qkv_bias, "MoE with q/k/v biases has no supported HF architecture")
        moe = config.moe
        _refuse(
            not (config.every_layer_moe and moe.norm_topk_prob),
            "a MoE without q/k norms must be Mixtral-shaped (every layer MoE, top-k renormalised)",
        )
        candidates = ["MixtralForCausalLM"]
    elif config.qkv_bias:
        candidates = ["Qwen2ForCausalLM", _SEED_OSS] if default_head_dim else [_SEED_OSS]
    else:
        candidates = ["LlamaForCausalLM", "MistralForCausalLM"]
        if not default_head_dim:
            candidates.reverse()
        candidates += [_SEED_OSS] + ([_SMOLLM3] if default_head_dim else [])
    return preferred if preferred in candidates else candidates[0]


def _check_gpt_oss(config: ModelConfig) -> None:
    """Refuse models GptOssForCausalLM cannot hold exactly."""
    moe = config.moe
    _refuse(
        moe is None or not config.every_layer_moe or not moe.norm_topk_prob,
        "gpt-oss has experts in every layer, their top-k weights renormalised",
    )
    _refuse(
        not (moe.router_bias and moe.expert_biases and moe.activation == "swiglu_clamped"),
        "gpt-oss's experts have a biased router, biases and the clamped SwiGLU",
    )
    _refuse(
        not (config.attention_sinks and config.qkv_bias and config.attention_out_bias),
        "gpt-oss's attention has sinks and q/k/v/o biases",
    )
    _refuse(config.qk_norm or config.no_rope_layers, "gpt-oss has no q/k norms and RoPE in all")


def _check_llama_block(config: ModelConfig) -> None:
    """Refuse block options the RoPE architectures above cannot hold (BLOOM's and MPT's; an
    o_proj bias goes out as gpt-oss, SmolLM3 or Seed-OSS)."""
    c = config
    others = {
        f"norm_type {c.norm_type!r}": c.norm_type != "rmsnorm",
        f"activation {c.activation!r}": c.activation != "silu",
        "a plain (not gated) MLP": not c.gated_mlp,
        "MLP biases": c.mlp_bias,
        "an embedding norm": c.embedding_norm,
        "clip_qkv": c.clip_qkv is not None,
        f"position_embedding {c.position_embedding!r}": c.position_embedding != "rope",
    }
    found = [what for what, present in others.items() if present]
    _refuse(bool(found), f"{', '.join(found)} in a RoPE model has no supported HF architecture")


def _deepseek_routed(config: ModelConfig) -> bool:
    """Whether `config` routes as DeepSeek-V3 does (sigmoid scores, the correction bias)."""
    moe = config.moe
    return moe is not None and moe.score_function == "sigmoid" and moe.expert_bias


def _check_minimax(config: ModelConfig) -> None:
    """Refuse whole-projection q/k norm models MiniMaxM2ForCausalLM cannot hold exactly."""
    moe = config.moe
    _refuse(config.qkv_bias, "MiniMax-M2 with q/k/v biases")
    _refuse(
        moe is None
        or not config.every_layer_moe
        or moe.score_function != "sigmoid"
        or not moe.expert_bias
        or moe.num_shared_experts
        or moe.num_groups != 1
        or moe.routed_scaling_factor != 1.0
        or not moe.norm_topk_prob,
        "MiniMax-M2 routes every layer by renormalised sigmoid scores with the correction bias, "
        "without shared experts, groups or scaling",
    )


def _check_mistral4(config: ModelConfig) -> None:
    """Refuse latent-attention models Mistral4ForCausalLM cannot hold exactly."""
    _refuse(config.qk_norm or config.qkv_bias, "latent attention with q/k norms or biases")
    moe = config.moe
    _refuse(
        moe is not None
        and (
            moe.dense_layers != list(range(len(moe.dense_layers)))
            or moe.layer_step != 1
            or moe.score_function != "softmax"
            or moe.expert_bias
            or not moe.num_shared_experts
        ),
        "Mistral 4 keeps dense exactly its first layers and routes by softmax scores, without "
        "a correction bias, beside shared experts",
    )


def _hybrid_architecture(config: ModelConfig) -> str:
    """Qwen3-Next for head-grouped linear-attention projections, else Qwen3.5 (MoE or dense);
    refuses what those cannot hold."""
    _refuse(
        not (config.norm_unit_offset and config.qk_norm and config.attention_output_gate),
        "hybrid linear-attention models need (1 + w) norms, q/k norms and the attention gate",
    )
    _refuse(config.qkv_bias or config.rope_scaling is not None, "hybrid with biases or scaling")
    _refuse(config.linear_attention is None, "(1 + w) norms without linear attention")
    moe = config.moe
    if config.linear_attention.interleaved_projections:
        _refuse(moe is None, "Qwen3-Next without experts")
        return "Qwen3NextForCausalLM"
    if moe is None:
        return "Qwen3_5ForCausalLM"
    _refuse(
        not (config.every_layer_moe and moe.norm_topk_prob),
        "Qwen3.5-MoE has experts in every layer with the top k renormalised",
    )
    return "Qwen3_5MoeForCausalLM"


def _hybrid_to_hf(config: ModelConfig, arch: str) -> dict[str, Any]:
    """The hybrid families' keys: layer kinds, linear-attention shape, RoPE (5.x's
    rope_parameters, where partial_rotary_factor lives) and the experts."""
    linear = config.linear_attention
    out: dict[str, Any] = {
        "layer_types": list(config.layer_types or []),
        "linear_num_key_heads": linear.num_key_heads,
        "linear_num_value_heads": linear.num_value_heads,
        "linear_key_head_dim": linear.key_head_dim,
        "linear_value_head_dim": linear.value_head_dim,
        "linear_conv_kernel_dim": linear.conv_kernel_size,
        "attention_bias": False,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": config.rope_theta,
            "partial_rotary_factor": config.partial_rotary_factor,
        },
    }
    moe = config.moe
    if moe is None:
        return out
    out |= {
        "num_experts": moe.num_experts,
        "num_experts_per_tok": moe.top_k,
        "moe_intermediate_size": config.expert_ffn_hidden_size,
        "shared_expert_intermediate_size": moe.shared_expert_ffn_hidden_size,
        "router_aux_loss_coef": moe.aux_loss_coeff,
        "output_router_logits": False,
    }
    if arch == "Qwen3NextForCausalLM":
        out |= {
            "norm_topk_prob": moe.norm_topk_prob,
            "decoder_sparse_step": moe.layer_step,
            "mlp_only_layers": list(moe.dense_layers),
        }
    return out


def _check_deepseek(config: ModelConfig) -> None:
    """Refuse latent-attention models DeepseekV3ForCausalLM cannot hold exactly."""
    _refuse(config.qk_norm or config.qkv_bias, "latent attention with q/k norms or biases")
    _check_deepseek_moe(config, _DEEPSEEK)


def _check_deepseek_moe(config: ModelConfig, arch: str) -> None:
    """Refuse MoE layers `arch` (DeepSeek-V3 or GLM-4.5, whose MoE is DeepSeek's) cannot hold."""
    name = "DeepSeek-V3" if arch == _DEEPSEEK else "GLM-4.5"
    moe = config.moe
    if moe is None:
        return
    _refuse(
        moe.dense_layers != list(range(len(moe.dense_layers))) or moe.layer_step != 1,
        f"{name} keeps dense exactly its first layers (first_k_dense_replace)",
    )
    _refuse(
        moe.score_function != "sigmoid" or not moe.expert_bias or not moe.num_shared_experts,
        f"{name} routes with sigmoid scores, the correction bias and shared experts",
    )


def _hf_dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def dtype_from_hf(hf: dict[str, Any]) -> torch.dtype | None:
    """The `torch_dtype` / `dtype` a config declares, or None."""
    name = hf.get("dtype") or hf.get("torch_dtype")
    dtype = getattr(torch, name, None) if isinstance(name, str) else None
    return dtype if isinstance(dtype, torch.dtype) else None


def config_to_hf(
    config: ModelConfig,
    *,
    dtype: torch.dtype,
    architecture: str | None = None,
    bos_token_id: int | None = None,
    eos_token_id: int | list[int] | None = None,
    pad_token_id: int | None = None,
) -> dict[str, Any]:
    """A Hugging Face `config.json` dict (transformers 4.x keys) for `config`.

    `architecture` is a preference (see `choose_architecture`); `dtype` is what the weights are
    stored in.
    """
    arch = choose_architecture(config, architecture)
    if arch in ALIBI_ARCHITECTURES:
        hf = alibi_config_to_hf(config, arch, _hf_dtype_name(dtype))
        ids = {"bos_token_id": bos_token_id, "eos_token_id": eos_token_id}
        return dict(sorted((hf | {k: v for k, v in ids.items() if v is not None}).items()))
    hf: dict[str, Any] = {
        "architectures": [arch],
        "model_type": SUPPORTED_ARCHITECTURES[arch],
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.ffn_hidden_size,
        "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_kv_heads,
        "hidden_act": "silu",
        "max_position_embeddings": config.max_position_embeddings,
        "rms_norm_eps": config.norm_eps,
        "rope_theta": config.rope_theta,
        "tie_word_embeddings": config.tie_word_embeddings,
        "initializer_range": config.init_method_std,
        "attention_dropout": 0.0,
        "use_cache": True,
        "torch_dtype": _hf_dtype_name(dtype),
    }
    default_head_dim = config.head_dim == config.hidden_size // config.num_attention_heads
    # Llama, Mistral and Qwen3 configs always carry head_dim; Mixtral's only when it is not
    # the default; Qwen2 has no such key (choose_architecture refused a non-default one).
    if arch in ("LlamaForCausalLM", "MistralForCausalLM", *_QWEN3) or not default_head_dim:
        hf["head_dim"] = config.head_dim
    if arch == "LlamaForCausalLM":
        hf |= {"attention_bias": False, "mlp_bias": False, "pretraining_tp": 1}
    if arch in ("MistralForCausalLM", "MixtralForCausalLM"):
        hf["sliding_window"] = None
    if arch in _OPTIONAL_WINDOW:
        hf |= {"use_sliding_window": False, "sliding_window": None}
    if arch in _QWEN3:
        hf["attention_bias"] = False
    # Qwen3's max_window_layers only matters with a sliding window (refused), so it is left
    # to transformers' default.
    _add_architecture_keys(config, arch, hf)
    ids = {"bos_token_id": bos_token_id, "eos_token_id": eos_token_id, "pad_token_id": pad_token_id}
    # SmolLM3's and Seed-OSS's config classes default these to their tokenizers' ids: an
    # unknown id is written as null there, and left out elsewhere.
    keep_null = arch in (_SMOLLM3, _SEED_OSS)
    hf |= {key: value for key, value in ids.items() if value is not None or keep_null}
    return dict(sorted(hf.items()))


def _add_architecture_keys(config: ModelConfig, arch: str, hf: dict[str, Any]) -> None:
    """Add to `hf` the keys of `arch`'s own family: its attention, experts and RoPE."""
    if arch in _HYBRID:
        hf["head_dim"] = config.head_dim
        del hf["rope_theta"]
        hf |= _hybrid_to_hf(config, arch)
    elif arch in _LATENT:
        hf |= _deepseek_to_hf(config)
    elif arch == _GLM:
        hf |= _glm_to_hf(config)
    elif arch == _MINIMAX:
        hf |= _minimax_to_hf(config)
    else:
        hf |= _family_to_hf(config, arch)
    if arch not in _HYBRID:
        hf["rope_scaling"] = rope_scaling_to_hf(config.rope_scaling)
    if arch == _MISTRAL4:
        _mistral4_keys(config, hf)


def _family_to_hf(config: ModelConfig, arch: str) -> dict[str, Any]:
    """The keys of gpt-oss, SmolLM3, Seed-OSS, and the MoE keys of the others."""
    if arch == _GPT_OSS:
        return _gpt_oss_to_hf(config)
    hf = _moe_to_hf(config, arch)
    if arch == _SMOLLM3:
        hf |= _smollm3_to_hf(config)
    if arch == _SEED_OSS:
        hf |= {
            "attention_bias": config.qkv_bias,
            "attention_out_bias": config.attention_out_bias,
            "head_dim": config.head_dim,
            "mlp_bias": False,
            "residual_dropout": 0.0,
        }
    return hf


def _moe_to_hf(config: ModelConfig, arch: str) -> dict[str, Any]:
    """The MoE keys of `arch` for `config.moe` (none for a dense model)."""
    moe = config.moe
    if moe is None:
        return {}
    common = {
        "num_experts_per_tok": moe.top_k,
        "router_aux_loss_coef": moe.aux_loss_coeff,
        "output_router_logits": False,
    }
    if arch == "MixtralForCausalLM":
        # Every layer is MoE, so the experts' size is the only FFN size.
        return common | {
            "num_local_experts": moe.num_experts,
            "intermediate_size": config.expert_ffn_hidden_size,
        }
    return common | {
        "num_experts": moe.num_experts,
        "moe_intermediate_size": config.expert_ffn_hidden_size,
        "norm_topk_prob": moe.norm_topk_prob,
        "decoder_sparse_step": moe.layer_step,
        "mlp_only_layers": list(moe.dense_layers),
    }


def _layer_types_to_hf(config: ModelConfig) -> list[str]:
    return list(config.layer_types or ["full_attention"] * config.num_layers)


def _gpt_oss_to_hf(config: ModelConfig) -> dict[str, Any]:
    """GptOssForCausalLM's keys: every layer's attention kind, its window, the experts."""
    moe = config.moe
    return {
        "head_dim": config.head_dim,
        "attention_bias": True,
        "layer_types": _layer_types_to_hf(config),
        "sliding_window": config.sliding_window,
        "num_local_experts": moe.num_experts,
        "num_experts_per_tok": moe.top_k,
        "intermediate_size": config.expert_ffn_hidden_size,
        "router_aux_loss_coef": moe.aux_loss_coeff,
        "output_router_logits": False,
        "swiglu_limit": moe.swiglu_limit,
        "swiglu_alpha": moe.swiglu_alpha,
    }


def _smollm3_to_hf(config: ModelConfig) -> dict[str, Any]:
    """SmolLM3ForCausalLM's keys: which layers use RoPE (1) or not (0), each layer's kind."""
    sliding = config.layer_types is not None and "sliding_attention" in config.layer_types
    flags = [int(i not in config.no_rope_layers) for i in range(config.num_layers)]
    # The interval that gives these flags, when one does (transformers reads only the flags).
    intervals = [
        n
        for n in range(1, config.num_layers + 2)
        if flags == [int((i + 1) % n != 0) for i in range(config.num_layers)]
    ]
    return {
        "no_rope_layers": flags,
        "no_rope_layer_interval": intervals[0] if intervals else 4,
        "layer_types": _layer_types_to_hf(config),
        "use_sliding_window": sliding,
        "sliding_window": config.sliding_window,
        "attention_bias": config.qkv_bias,
        "mlp_bias": False,
    }


def _deepseek_to_hf(config: ModelConfig) -> dict[str, Any]:
    """DeepseekV3ForCausalLM's latent-attention and MoE keys (a dense model: every layer in
    first_k_dense_replace, with transformers' default expert shapes)."""
    mla = config.mla
    out: dict[str, Any] = {
        "kv_lora_rank": mla.kv_lora_rank,
        "q_lora_rank": mla.q_lora_rank,
        "qk_nope_head_dim": mla.qk_nope_head_dim,
        "qk_rope_head_dim": mla.qk_rope_head_dim,
        "v_head_dim": mla.v_head_dim,
        "rope_interleave": mla.rope_interleave,
        "attention_bias": False,
    }
    return out | _deepseek_moe_to_hf(config)


def _glm_to_hf(config: ModelConfig) -> dict[str, Any]:
    """Glm4MoeForCausalLM's attention keys (`attention_bias` is its q/k/v biases) and
    DeepSeek's MoE keys."""
    out = {
        "head_dim": config.head_dim,
        "attention_bias": config.qkv_bias,
        "use_qk_norm": config.qk_norm,
        "partial_rotary_factor": config.partial_rotary_factor,
    }
    return out | _deepseek_moe_to_hf(config)


def _mistral4_keys(config: ModelConfig, hf: dict[str, Any]) -> None:
    """Mistral4ForCausalLM's changes to DeepSeek-V3's keys in `hf`: no multi-token prediction
    key, and a RoPE dict that says the rotated share and the query scale (Mistral4Config builds
    YaRN x128 when given no RoPE dict, and keeps a given one's rotated share only when the
    dict says it)."""
    if not config.mtp_num_layers:
        del hf["num_nextn_predict_layers"]
    mla = config.mla
    rope = hf["rope_scaling"] or {"rope_type": "default"}
    rope["partial_rotary_factor"] = mla.qk_rope_head_dim / mla.qk_head_dim
    if config.query_scale_beta:
        rope["llama_4_scaling_beta"] = config.query_scale_beta
    hf["rope_scaling"] = rope


def _minimax_to_hf(config: ModelConfig) -> dict[str, Any]:
    """MiniMaxM2ForCausalLM's keys: the expert width is `intermediate_size`; partial RoPE is
    written both as the hub's `rotary_dim` and as `partial_rotary_factor`."""
    moe = config.moe
    return {
        "head_dim": config.head_dim,
        "rotary_dim": config.rope_dim,
        "partial_rotary_factor": config.partial_rotary_factor,
        "use_qk_norm": True,
        "qk_norm_type": "per_layer",
        "intermediate_size": config.expert_ffn_hidden_size,
        "num_local_experts": moe.num_experts,
        "num_experts_per_tok": moe.top_k,
        "router_aux_loss_coef": moe.aux_loss_coeff,
        "scoring_func": "sigmoid",
        "use_routing_bias": True,
        "output_router_logits": False,
    }


def _deepseek_moe_to_hf(config: ModelConfig) -> dict[str, Any]:
    """DeepSeek-V3's MoE and multi-token prediction keys (GLM-4.5 and Mistral 4 share them;
    the routing and balance-loss keys only where the routing is DeepSeek-V3's)."""
    moe = config.moe
    out: dict[str, Any] = {
        "num_nextn_predict_layers": config.mtp_num_layers,
        "first_k_dense_replace": config.num_layers,
    }
    if moe is None:
        return out
    shapes = {
        "first_k_dense_replace": len(moe.dense_layers),
        "n_routed_experts": moe.num_experts,
        "num_experts_per_tok": moe.top_k,
        "moe_intermediate_size": config.expert_ffn_hidden_size,
        "n_shared_experts": moe.num_shared_experts,
        "n_group": moe.num_groups,
        "topk_group": moe.topk_groups,
        "routed_scaling_factor": moe.routed_scaling_factor,
        "norm_topk_prob": moe.norm_topk_prob,
    }
    if not moe.expert_bias:
        return out | shapes
    return (
        out
        | shapes
        | {
            "scoring_func": "sigmoid",
            "topk_method": "noaux_tc",
            "aux_loss_alpha": moe.aux_loss_coeff,
            "seq_aux": moe.aux_loss_type == "sequence",
        }
    )


def rope_scaling_to_hf(scaling: RopeScaling | YarnScaling | None) -> dict[str, Any] | None:
    """The 4.x `rope_scaling` dict for Llama 3.1-style or YaRN scaling (None without)."""
    if scaling is None:
        return None
    if isinstance(scaling, YarnScaling):
        out = {
            "rope_type": "yarn",
            "factor": scaling.factor,
            "original_max_position_embeddings": scaling.original_max_position_embeddings,
            "beta_fast": scaling.beta_fast,
            "beta_slow": scaling.beta_slow,
        }
        # transformers reads a missing mscale as 0 (off): gpt-oss's config has none.
        out |= {k: getattr(scaling, k) for k in ("mscale", "mscale_all_dim") if getattr(scaling, k)}
        if not scaling.truncate:
            out["truncate"] = False
        if scaling.attention_factor is not None:
            out["attention_factor"] = scaling.attention_factor
        return out
    return {
        "rope_type": "llama3",
        "factor": scaling.factor,
        "low_freq_factor": scaling.low_freq_factor,
        "high_freq_factor": scaling.high_freq_factor,
        "original_max_position_embeddings": scaling.original_max_position_embeddings,
    }


def generation_config(
    bos_token_id: int | None, eos_token_id: int | list[int] | None
) -> dict[str, Any]:
    """A minimal `generation_config.json` dict (what `save_pretrained` writes for a base model)."""
    out: dict[str, Any] = {"_from_model_config": True}
    if bos_token_id is not None:
        out["bos_token_id"] = bos_token_id
    if eos_token_id is not None:
        out["eos_token_id"] = eos_token_id
    return out
