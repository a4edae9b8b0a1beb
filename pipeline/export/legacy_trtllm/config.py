"""The `config.json` of a legacy TensorRT-LLM checkpoint, written from our `ModelConfig` and
read back; `LegacyExportOptions`, the export options with the rank layout this target adds.

The keys (this repository's docs/file_layouts.md, section "TensorRT-LLM export (legacy)") are
those of TRT-LLM's `PretrainedConfig` and `LLaMAConfig` / `QWenConfig`: `architecture` picks the
model class (Llama, Mistral and Mixtral share LLaMA's; Qwen2 is QWen's, with `qwen_type` and q/k/v
biases),
`vocab_size` is the true size (the padded `lm_head` rows are the builder's business),
`rotary_scaling` is the Hugging Face `rope_scaling` dict verbatim, and `mapping` / `quantization`
say how the rank files were cut and quantized."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from fnmatch import fnmatch
from typing import Any

from pipeline.core.model.config import ModelConfig, MoEConfig
from pipeline.export.legacy_trtllm.layout import TrtllmMapping
from pipeline.export.options import ExportOptions
from pipeline.weights.hf_config import choose_architecture, rope_from_hf, rope_scaling_to_hf

__all__ = [
    "LegacyExportOptions",
    "MOE_RENORMALIZE",
    "read_trtllm_config",
    "trtllm_config",
]

# MoeConfig.ExpertScaleNormalizationMode.RENORMALIZE: softmax over all experts, then the top-k
# weights renormalised to sum to one (Mixtral's routing, and ours).
MOE_RENORMALIZE = 1


@dataclass(frozen=True)
class LegacyExportOptions(ExportOptions):
    """`ExportOptions` plus how the rank files are cut: the tensor/pipeline/expert mapping and
    whether the embedding table is split too."""

    mapping: TrtllmMapping = field(default_factory=TrtllmMapping)
    use_parallel_embedding: bool = False
    embedding_sharding_dim: int = 0  # 0: split the vocabulary, 1: split the hidden size

    def __post_init__(self) -> None:
        self._check_dtype()
        if self.embedding_sharding_dim not in (0, 1):
            raise ValueError("embedding_sharding_dim must be 0 (vocabulary) or 1 (hidden)")
        self._check_fp8()

    @classmethod
    def from_options(cls, options: ExportOptions) -> LegacyExportOptions:
        """`options` as legacy options (one rank file unless `options` already says more)."""
        if isinstance(options, cls):
            return options
        return cls(**{f.name: getattr(options, f.name) for f in dataclasses.fields(options)})

    def excluded(self, module: str) -> bool:
        """Whether `module` (e.g. `lm_head`, `transformer.layers.0.mlp.fc`) stays unquantized:
        `exclude_modules` entries are fnmatch patterns, as TRT-LLM reads them."""
        return any(fnmatch(module, pattern) for pattern in self.exclude_modules)


def _quantization(options: LegacyExportOptions, moe: bool) -> dict[str, Any]:
    if not options.fp8:
        return {"quant_algo": None, "kv_cache_quant_algo": None}
    exclude = list(options.exclude_modules)
    if moe and "*router" not in exclude:
        exclude.append("*router")  # the router runs in fp32, never quantized
    return {
        "quant_algo": "FP8",
        "kv_cache_quant_algo": "FP8" if options.fp8_kv_cache else None,
        "exclude_modules": exclude,
    }


# What the legacy rank-file format holds (frozen at TensorRT-LLM 1.3's families).
_LEGACY_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "MixtralForCausalLM",
)


def trtllm_config(config: ModelConfig, options: LegacyExportOptions) -> dict[str, Any]:
    """The config.json dict of an export of `config` with `options`."""
    architecture = choose_architecture(config, options.architecture)
    if architecture in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM"):
        raise ValueError(
            f"TensorRT-LLM export of {architecture} (per-head q/k norms) is not supported yet; "
            "export Llama, Mistral, Qwen2 or Mixtral models, or convert to Hugging Face instead"
        )
    if architecture not in _LEGACY_ARCHITECTURES:
        raise ValueError(
            f"the legacy TensorRT-LLM format has no {architecture} (sinks, windows, biases or "
            "layers without RoPE); export with --trtllm alone, or convert to Hugging Face"
        )
    out: dict[str, Any] = {
        "architecture": architecture,
        "dtype": options.dtype,
        "logits_dtype": "float32",
        "vocab_size": config.vocab_size,
        "max_position_embeddings": config.max_position_embeddings,
        "hidden_size": config.hidden_size,
        "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_kv_heads,
        "head_size": config.head_dim,
        "intermediate_size": config.expert_ffn_hidden_size,
        "hidden_act": "swiglu" if config.is_moe else "silu",
        "norm_epsilon": config.norm_eps,
        "position_embedding_type": "rope_gpt_neox",
        "rotary_base": config.rope_theta,
        "rotary_scaling": rope_scaling_to_hf(config.rope_scaling),
        "use_parallel_embedding": options.use_parallel_embedding,
        "embedding_sharding_dim": options.embedding_sharding_dim,
        "share_embedding_table": False,
        "tie_word_embeddings": config.tie_word_embeddings,
        "attn_bias": config.qkv_bias,
        "mlp_bias": False,
        "residual_mlp": False,
        "mapping": options.mapping.to_dict(moe=config.is_moe),
        "quantization": _quantization(options, config.is_moe),
    }
    if architecture == "Qwen2ForCausalLM":
        out |= {"qwen_type": "qwen2", "use_logn_attn": False}
    if config.moe is not None:
        out["moe"] = {
            "num_experts": config.moe.num_experts,
            "top_k": config.moe.top_k,
            "normalization_mode": MOE_RENORMALIZE,
        }
    return out


def read_trtllm_config(raw: dict[str, Any]) -> tuple[ModelConfig, LegacyExportOptions]:
    """Our `ModelConfig` and the export options a TRT-LLM config.json dict describes.

    Raises ValueError for what our reference forward cannot compute (another activation, RoPE
    kind, MoE normalisation or quantization algorithm).
    """
    act = raw.get("hidden_act", "silu")
    moe_raw = raw.get("moe") or {}
    is_moe = moe_raw.get("num_experts", 0) > 1
    if act != ("swiglu" if is_moe else "silu"):
        raise ValueError(f"config.json: hidden_act {act!r} is not supported here")
    if raw.get("position_embedding_type", "rope_gpt_neox") != "rope_gpt_neox":
        raise ValueError(f"config.json: position_embedding_type {raw['position_embedding_type']!r}")
    moe = None
    if is_moe:
        if moe_raw.get("normalization_mode", MOE_RENORMALIZE) != MOE_RENORMALIZE:
            raise ValueError("config.json: only moe.normalization_mode 1 (renormalize)")
        moe = MoEConfig(num_experts=moe_raw["num_experts"], top_k=moe_raw["top_k"])
    theta, scaling = rope_from_hf(
        {"rope_theta": raw.get("rotary_base", 10000.0), "rope_scaling": raw.get("rotary_scaling")}
    )
    heads = raw["num_attention_heads"]
    config = ModelConfig(
        vocab_size=raw["vocab_size"],
        hidden_size=raw["hidden_size"],
        num_layers=raw["num_hidden_layers"],
        num_attention_heads=heads,
        num_kv_heads=raw.get("num_key_value_heads") or heads,
        head_dim=raw.get("head_size"),
        ffn_hidden_size=raw["intermediate_size"],
        norm_eps=float(raw.get("norm_epsilon", 1e-5)),
        rope_theta=theta,
        rope_scaling=scaling,
        max_position_embeddings=raw.get("max_position_embeddings") or 2048,
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        qkv_bias=bool(raw.get("attn_bias", False)),
        moe=moe,
    )
    options = LegacyExportOptions(
        dtype=raw["dtype"],
        mapping=_read_mapping(raw.get("mapping") or {}),
        use_parallel_embedding=bool(raw.get("use_parallel_embedding", False)),
        embedding_sharding_dim=int(raw.get("embedding_sharding_dim", 0)),
        **_read_quantization(raw.get("quantization") or {}),
        architecture=raw.get("architecture"),
    )
    return config, options


def _read_mapping(mapping: dict[str, Any]) -> TrtllmMapping:
    tp, pp = mapping.get("tp_size", 1), mapping.get("pp_size", 1)
    if mapping.get("world_size", tp * pp) != tp * pp or mapping.get("cp_size", 1) != 1:
        raise ValueError(f"config.json: mapping {mapping} is not world_size = tp_size * pp_size")
    moe_tp, moe_ep = mapping.get("moe_tp_size", -1), mapping.get("moe_ep_size", -1)
    if moe_ep in (-1, None):
        moe_ep = tp // moe_tp if moe_tp not in (-1, None) else 1
    return TrtllmMapping(tp=tp, pp=pp, moe_ep=moe_ep)


def _read_quantization(quant: dict[str, Any]) -> dict[str, Any]:
    algo, kv_algo = quant.get("quant_algo"), quant.get("kv_cache_quant_algo")
    if algo not in (None, "FP8") or kv_algo not in (None, "FP8"):
        raise ValueError(f"config.json: quantization {algo!r} / kv cache {kv_algo!r}")
    return {
        "fp8": algo == "FP8",
        "fp8_kv_cache": kv_algo == "FP8",
        "exclude_modules": tuple(quant.get("exclude_modules") or ()),
    }
