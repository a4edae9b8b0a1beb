"""Our `ModelConfig` <-> a Hugging Face `config.json` dict (Llama, Mistral, Qwen2, Qwen3,
Mixtral, Qwen3-MoE, DeepSeek-V3).

Reading accepts both transformers 4.x keys (`rope_theta` + `rope_scaling`, `torch_dtype`) and the
5.x ones (`rope_parameters`, `dtype`). Writing emits the 4.x spelling, which vLLM, TensorRT-LLM
and older transformers read, and which transformers 5 still loads. Anything our model cannot
represent exactly (o_proj or MLP biases, another activation, linear RoPE scaling, YaRN outside
DeepSeek-V3, a sliding window shorter than the context) is refused rather than silently dropped.
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
    "Qwen3_5ForCausalLM": "qwen3_5_text",
    "Qwen3_5MoeForCausalLM": "qwen3_5_moe_text",
    "Qwen3NextForCausalLM": "qwen3_next",
}
# Multimodal wrappers whose language model we read (`text_config`), and the text architecture
# it is: the published Qwen3.5 checkpoints are image-text models.
_TEXT_OF_MULTIMODAL = {
    "Qwen3_5ForConditionalGeneration": "Qwen3_5ForCausalLM",
    "Qwen3_5MoeForConditionalGeneration": "Qwen3_5MoeForCausalLM",
}
_HYBRID = ("Qwen3_5ForCausalLM", "Qwen3_5MoeForCausalLM", "Qwen3NextForCausalLM")
# Architectures whose configs say `use_sliding_window` (the window is off unless it is true).
_OPTIONAL_WINDOW = ("Qwen2ForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM")
_QWEN3 = ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM")
_DEEPSEEK = "DeepseekV3ForCausalLM"
_DEFAULT_ROPE_THETA = 10000.0


def _supported() -> str:
    return ", ".join(f"{a} ({t})" for a, t in SUPPORTED_ARCHITECTURES.items())


def text_model_config(hf: dict[str, Any]) -> dict[str, Any]:
    """The language model's config.json dict: `hf` itself, or a multimodal wrapper's
    `text_config` named with its text architecture (the wrapper's tie_word_embeddings kept)."""
    archs = hf.get("architectures") or []
    wrapper = next((a for a in archs if a in _TEXT_OF_MULTIMODAL), None)
    if wrapper is None or not isinstance(hf.get("text_config"), dict):
        return hf
    text = dict(hf["text_config"])
    text["architectures"] = [_TEXT_OF_MULTIMODAL[wrapper]]
    if "tie_word_embeddings" not in text and "tie_word_embeddings" in hf:
        text["tie_word_embeddings"] = hf["tie_word_embeddings"]
    return text


def hf_architecture(hf: dict[str, Any]) -> str:
    """The supported architecture a config.json dict names (a multimodal wrapper's text
    architecture for Qwen3.5's image-text checkpoints); ValueError listing them if none."""
    archs = hf.get("architectures") or []
    for arch in archs:
        if arch in SUPPORTED_ARCHITECTURES:
            return arch
        if arch in _TEXT_OF_MULTIMODAL:
            return _TEXT_OF_MULTIMODAL[arch]
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
    _refuse(scaling.get("attention_factor") is not None, "yarn attention_factor")
    _refuse(scaling.get("truncate", True) is False, "yarn truncate=false")
    original = int(scaling["original_max_position_embeddings"])
    factor = scaling.get("factor") or hf["max_position_embeddings"] / original
    return YarnScaling(
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
    hf = text_model_config(hf)
    arch = hf_architecture(hf)
    if arch in _HYBRID:
        return _hybrid_from_hf(hf, arch)
    _refuse(hf.get("hidden_act", "silu") != "silu", f"hidden_act {hf.get('hidden_act')!r}")
    _refuse(bool(hf.get("attention_bias")), "attention_bias (o_proj bias) is not supported")
    _refuse(bool(hf.get("mlp_bias")), "mlp_bias is not supported")
    _refuse(hf.get("pretraining_tp", 1) != 1, "pretraining_tp != 1")
    _check_sliding_window(hf, arch, ignore_sliding_window)
    theta, scaling = rope_from_hf(hf)
    _refuse(isinstance(scaling, YarnScaling) and arch != _DEEPSEEK, f"yarn RoPE in {arch}")
    heads = hf["num_attention_heads"]
    head_dim = hf.get("head_dim")
    if head_dim is None and arch == "Qwen3ForCausalLM":
        head_dim = 128  # Qwen3Config's default (Qwen3-MoE's is hidden_size / heads)
    if arch == _DEEPSEEK:
        head_dim = None  # transformers writes qk_rope_head_dim there; latent attention's own
    return ModelConfig(
        vocab_size=hf["vocab_size"],
        hidden_size=hf["hidden_size"],
        num_layers=hf["num_hidden_layers"],
        num_attention_heads=heads,
        num_kv_heads=heads if arch == _DEEPSEEK else hf.get("num_key_value_heads") or heads,
        head_dim=head_dim,
        ffn_hidden_size=hf["intermediate_size"],
        norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        rope_scaling=scaling,
        max_position_embeddings=hf.get("max_position_embeddings", 2048),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        qkv_bias=arch == "Qwen2ForCausalLM",
        qk_norm=arch in _QWEN3,
        moe=_deepseek_moe_from_hf(hf) if arch == _DEEPSEEK else _moe_from_hf(hf, arch),
        mla=_mla_from_hf(hf) if arch == _DEEPSEEK else None,
        init_method_std=float(hf.get("initializer_range", 0.02)),
    )


def _moe_from_hf(hf: dict[str, Any], arch: str) -> MoEConfig | None:
    """Mixtral: experts in every layer; Qwen3-MoE: in the layers `decoder_sparse_step` and
    `mlp_only_layers` say, of width `moe_intermediate_size`, top-k renormalised only with
    `norm_topk_prob`. The aux-loss coefficient is carried over as is
    (docs/models.md, "The MoE load-balancing loss")."""
    aux = float(hf.get("router_aux_loss_coef", MoEConfig.aux_loss_coeff))
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


def _deepseek_moe_from_hf(hf: dict[str, Any]) -> MoEConfig | None:
    """DeepSeekMoE: the first `first_k_dense_replace` layers dense, then sigmoid-scored routed
    experts chosen with the correction bias (`topk_method` noaux_tc) plus shared experts. The
    hub configs' `aux_loss_alpha` becomes our balance-loss coefficient, sequence-wise unless
    `seq_aux` is false (DeepSeek's reference code defaults it to true)."""
    _refuse(hf.get("scoring_func", "sigmoid") != "sigmoid", "scoring_func other than sigmoid")
    _refuse(hf.get("topk_method", "noaux_tc") != "noaux_tc", "topk_method other than noaux_tc")
    _refuse(hf.get("moe_layer_freq", 1) != 1, "moe_layer_freq != 1")
    _refuse(not hf.get("n_shared_experts"), "DeepSeek-V3 without shared experts")
    dense = hf.get("first_k_dense_replace", 3)
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
        num_shared_experts=hf["n_shared_experts"],
        expert_bias=True,
    )


def choose_architecture(config: ModelConfig, preferred: str | None = None) -> str:
    """The HF architecture that represents `config` exactly: `preferred` (e.g. the one a model
    was read from) when it can, else Qwen3 / Qwen3-MoE for q/k norms, Mixtral for MoE, Qwen2
    for q/k/v biases, Mistral for an explicit head_dim, Llama otherwise."""
    default_head_dim = config.head_dim == config.hidden_size // config.num_attention_heads
    if config.linear_attention is not None or config.norm_unit_offset:
        candidates = [_hybrid_architecture(config)]
    elif config.mla is not None:
        _check_deepseek(config)
        candidates = [_DEEPSEEK]
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
        _refuse(not default_head_dim, "Qwen2 with head_dim != hidden_size / heads")
        candidates = ["Qwen2ForCausalLM"]
    else:
        candidates = ["LlamaForCausalLM", "MistralForCausalLM"]
        if not default_head_dim:
            candidates.reverse()
    return preferred if preferred in candidates else candidates[0]


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
    moe = config.moe
    if moe is None:
        return
    _refuse(
        moe.dense_layers != list(range(len(moe.dense_layers))) or moe.layer_step != 1,
        "DeepSeek-V3 keeps dense exactly its first layers (first_k_dense_replace)",
    )
    _refuse(
        moe.score_function != "sigmoid" or not moe.expert_bias or not moe.num_shared_experts,
        "DeepSeek-V3 routes with sigmoid scores, the correction bias and shared experts",
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
) -> dict[str, Any]:
    """A Hugging Face `config.json` dict (transformers 4.x keys) for `config`.

    `architecture` is a preference (see `choose_architecture`); `dtype` is what the weights are
    stored in.
    """
    arch = choose_architecture(config, architecture)
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
    if arch in _HYBRID:
        hf["head_dim"] = config.head_dim
        del hf["rope_theta"]
        hf |= _hybrid_to_hf(config, arch)
    elif arch == _DEEPSEEK:
        hf |= _deepseek_to_hf(config)
    else:
        hf |= _moe_to_hf(config, arch)
    if arch not in _HYBRID:
        hf["rope_scaling"] = rope_scaling_to_hf(config.rope_scaling)
    if bos_token_id is not None:
        hf["bos_token_id"] = bos_token_id
    if eos_token_id is not None:
        hf["eos_token_id"] = eos_token_id
    return dict(sorted(hf.items()))


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


def _deepseek_to_hf(config: ModelConfig) -> dict[str, Any]:
    """DeepseekV3ForCausalLM's latent-attention and MoE keys (a dense model: every layer in
    first_k_dense_replace, with transformers' default expert shapes)."""
    mla, moe = config.mla, config.moe
    out: dict[str, Any] = {
        "kv_lora_rank": mla.kv_lora_rank,
        "q_lora_rank": mla.q_lora_rank,
        "qk_nope_head_dim": mla.qk_nope_head_dim,
        "qk_rope_head_dim": mla.qk_rope_head_dim,
        "v_head_dim": mla.v_head_dim,
        "rope_interleave": mla.rope_interleave,
        "attention_bias": False,
        "num_nextn_predict_layers": config.mtp_num_layers,
        "first_k_dense_replace": config.num_layers,
    }
    if moe is None:
        return out
    return out | {
        "first_k_dense_replace": len(moe.dense_layers),
        "n_routed_experts": moe.num_experts,
        "num_experts_per_tok": moe.top_k,
        "moe_intermediate_size": config.expert_ffn_hidden_size,
        "n_shared_experts": moe.num_shared_experts,
        "n_group": moe.num_groups,
        "topk_group": moe.topk_groups,
        "routed_scaling_factor": moe.routed_scaling_factor,
        "norm_topk_prob": moe.norm_topk_prob,
        "scoring_func": "sigmoid",
        "topk_method": "noaux_tc",
        "aux_loss_alpha": moe.aux_loss_coeff,
        "seq_aux": moe.aux_loss_type == "sequence",
    }


def rope_scaling_to_hf(scaling: RopeScaling | YarnScaling | None) -> dict[str, Any] | None:
    """The 4.x `rope_scaling` dict for Llama 3.1-style or YaRN scaling (None without)."""
    if scaling is None:
        return None
    if isinstance(scaling, YarnScaling):
        return {
            "rope_type": "yarn",
            "factor": scaling.factor,
            "original_max_position_embeddings": scaling.original_max_position_embeddings,
            "beta_fast": scaling.beta_fast,
            "beta_slow": scaling.beta_slow,
            "mscale": scaling.mscale,
            "mscale_all_dim": scaling.mscale_all_dim,
        }
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
