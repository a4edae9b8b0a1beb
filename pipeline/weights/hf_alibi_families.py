"""BLOOM and MPT configs: our `ModelConfig` <-> their Hugging Face `config.json` dicts.

Both families use ALiBi for positions, LayerNorm, a plain (not gated) GeLU MLP four times the
hidden size, multi-head attention and a fused q/k/v projection (`pipeline.weights.fused_qkv`).
BLOOM adds a LayerNorm after the embeddings and biases on every linear and norm, and uses the
tanh GeLU; MPT has no biases anywhere (its norms neither), the exact GeLU, and may clamp q, k
and v (`attn_config.clip_qkv`).

What transformers' `BloomForCausalLM` / `MptForCausalLM` do not compute is refused in one line
rather than read and dropped: BLOOM's residual after the norm, MPT's learned positions, q/k
LayerNorms, prefix LM, multi-query attention, biases, another MLP width, a logit scale or
softmax scale, and an `alibi_bias_max` other than 8 (transformers builds MPT's slopes with 8
whatever the config says).
"""

from __future__ import annotations

import math
from typing import Any

from pipeline.core.model.config import ModelConfig

__all__ = [
    "ALIBI_ARCHITECTURES",
    "alibi_architecture",
    "alibi_config_from_hf",
    "alibi_config_to_hf",
]

BLOOM, MPT = "BloomForCausalLM", "MptForCausalLM"
ALIBI_ARCHITECTURES: dict[str, str] = {BLOOM: "bloom", MPT: "mpt"}
_MPT_BIAS_MAX = 8  # what transformers' MptModel builds its slopes with
_FFN_RATIO = 4  # both families' MLP width, fixed by transformers' modules


def _refuse(condition: bool, what: str) -> None:
    if condition:
        raise ValueError(f"unsupported Hugging Face config: {what}")


def alibi_config_from_hf(hf: dict[str, Any], arch: str) -> ModelConfig:
    """Our `ModelConfig` for a BLOOM or MPT `config.json` dict (ValueError naming what it
    cannot reproduce)."""
    return _bloom_from_hf(hf) if arch == BLOOM else _mpt_from_hf(hf)


def _bloom_from_hf(hf: dict[str, Any]) -> ModelConfig:
    _refuse(
        bool(hf.get("apply_residual_connection_post_layernorm")),
        "BLOOM's apply_residual_connection_post_layernorm",
    )
    hidden = hf.get("hidden_size", hf.get("n_embed", 64))
    heads = hf.get("n_head", hf.get("num_attention_heads", 8))
    return ModelConfig(
        vocab_size=hf.get("vocab_size", 250880),
        hidden_size=hidden,
        num_layers=hf.get("n_layer", hf.get("num_hidden_layers", 2)),
        num_attention_heads=heads,
        num_kv_heads=heads,
        ffn_hidden_size=_FFN_RATIO * hidden,
        norm_eps=float(hf.get("layer_norm_epsilon", 1e-5)),
        max_position_embeddings=hf.get("seq_length") or 2048,
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", True)),
        qkv_bias=True,
        attention_out_bias=True,
        activation="gelu_pytorch_tanh",
        gated_mlp=False,
        mlp_bias=True,
        norm_type="layernorm",
        norm_bias=True,
        embedding_norm=True,
        position_embedding="alibi",
        init_method_std=float(hf.get("initializer_range", 0.02)),
    )


def _mpt_from_hf(hf: dict[str, Any]) -> ModelConfig:
    attn = hf.get("attn_config") or {}
    hidden = hf.get("d_model", hf.get("hidden_size", 2048))
    heads = hf.get("n_heads", hf.get("num_attention_heads", 16))
    _refuse(not attn.get("alibi", True), "MPT without ALiBi (learned positions)")
    _refuse(
        attn.get("attn_type", "multihead_attention") != "multihead_attention",
        f"MPT attn_type {attn.get('attn_type')!r}",
    )
    _refuse(bool(attn.get("qk_ln")), "MPT's qk_ln (transformers' MptForCausalLM ignores it)")
    _refuse(bool(attn.get("prefix_lm")), "MPT's prefix_lm")
    scale = attn.get("softmax_scale")
    _refuse(
        scale is not None and not math.isclose(scale, (hidden / heads) ** -0.5),
        f"MPT softmax_scale {scale}",
    )
    bias_max = attn.get("alibi_bias_max", _MPT_BIAS_MAX)
    _refuse(
        bias_max != _MPT_BIAS_MAX,
        f"MPT alibi_bias_max {bias_max} (transformers' MptForCausalLM builds its slopes with 8)",
    )
    _refuse(not hf.get("no_bias", True), "MPT with biases (no_bias=false)")
    _refuse(hf.get("expansion_ratio", _FFN_RATIO) != _FFN_RATIO, "MPT expansion_ratio != 4")
    _refuse(hf.get("logit_scale") is not None, "MPT logit_scale")
    clip = attn.get("clip_qkv")
    return ModelConfig(
        vocab_size=hf.get("vocab_size", 50368),
        hidden_size=hidden,
        num_layers=hf.get("n_layers", hf.get("num_hidden_layers", 24)),
        num_attention_heads=heads,
        num_kv_heads=heads,
        ffn_hidden_size=_FFN_RATIO * hidden,
        norm_eps=float(hf.get("layer_norm_epsilon", 1e-5)),
        max_position_embeddings=hf.get("max_seq_len", 2048),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", True)),
        activation="gelu",
        gated_mlp=False,
        norm_type="layernorm",
        position_embedding="alibi",
        alibi_bias_max=float(_MPT_BIAS_MAX),
        clip_qkv=None if clip is None else float(clip),
        init_method_std=float(hf.get("initializer_range", 0.02)),
    )


def _shape_problems(config: ModelConfig) -> list[str]:
    """What neither BLOOM nor MPT can hold, whichever the family."""
    c = config
    checks = {
        "grouped-query attention": c.num_kv_heads != c.num_attention_heads,
        "head_dim != hidden / heads": c.head_dim != c.hidden_size // c.num_attention_heads,
        f"an MLP width other than {_FFN_RATIO} x hidden": c.ffn_hidden_size
        != _FFN_RATIO * c.hidden_size,
        "a gated MLP": c.gated_mlp,
        "RMSNorm": c.norm_type != "layernorm",
        "mixture of experts, latent attention, q/k norms or MTP": c.is_moe
        or c.mla is not None
        or c.qk_norm
        or bool(c.mtp_num_layers),
        "alibi_bias_max != 8": c.alibi_bias_max != _MPT_BIAS_MAX,
    }
    return [what for what, bad in checks.items() if bad]


def _family_problems(config: ModelConfig, arch: str) -> list[str]:
    c = config
    if arch == BLOOM:
        checks = {
            "an activation other than the tanh GeLU": c.activation
            not in ("gelu_pytorch_tanh", "gelu_new"),
            "missing biases": not (c.norm_bias and c.mlp_bias and c.qkv_bias)
            or not c.attention_out_bias,
            "no embedding norm": not c.embedding_norm,
            "clip_qkv": c.clip_qkv is not None,
        }
    else:
        checks = {
            "an activation other than the exact GeLU": c.activation != "gelu",
            "biases": c.norm_bias or c.mlp_bias or c.qkv_bias or c.attention_out_bias,
            "an embedding norm": c.embedding_norm,
        }
    return [what for what, bad in checks.items() if bad]


def alibi_architecture(config: ModelConfig, preferred: str | None = None) -> str:
    """BLOOM or MPT, whichever holds the ALiBi `config` exactly (`preferred` first); a
    ValueError naming what neither can hold."""
    shape = _shape_problems(config)
    _refuse(bool(shape), f"an ALiBi model with {', '.join(shape)} is neither BLOOM nor MPT")
    order = [preferred] if preferred in ALIBI_ARCHITECTURES else []
    order += [a for a in ALIBI_ARCHITECTURES if a not in order]
    problems = {arch: _family_problems(config, arch) for arch in order}
    for arch in order:
        if not problems[arch]:
            return arch
    details = "; ".join(f"{arch}: {', '.join(p)}" for arch, p in problems.items())
    raise ValueError(f"unsupported Hugging Face config: an ALiBi model that is not ({details})")


def alibi_config_to_hf(config: ModelConfig, arch: str, dtype_name: str) -> dict[str, Any]:
    """The `config.json` dict of `arch` (BLOOM or MPT, from `alibi_architecture`)."""
    c = config
    common = {
        "architectures": [arch],
        "model_type": ALIBI_ARCHITECTURES[arch],
        "vocab_size": c.vocab_size,
        "layer_norm_epsilon": c.norm_eps,
        "initializer_range": c.init_method_std,
        "tie_word_embeddings": c.tie_word_embeddings,
        "use_cache": True,
        "torch_dtype": dtype_name,
    }
    if arch == BLOOM:
        return common | {
            "hidden_size": c.hidden_size,
            "n_layer": c.num_layers,
            "n_head": c.num_attention_heads,
            "seq_length": c.max_position_embeddings,
            "apply_residual_connection_post_layernorm": False,
            "hidden_dropout": 0.0,
            "attention_dropout": 0.0,
            "pretraining_tp": 1,
            "slow_but_exact": False,
        }
    return common | {
        "d_model": c.hidden_size,
        "n_layers": c.num_layers,
        "n_heads": c.num_attention_heads,
        "expansion_ratio": _FFN_RATIO,
        "max_seq_len": c.max_position_embeddings,
        "no_bias": True,
        "learned_pos_emb": False,
        "norm_type": "low_precision_layernorm",
        "attn_config": {
            "attn_type": "multihead_attention",
            "attn_pdrop": 0,  # an int: transformers 5 checks the type
            "attn_impl": "torch",
            "alibi": True,
            "alibi_bias_max": _MPT_BIAS_MAX,
            "clip_qkv": c.clip_qkv,
            "softmax_scale": None,
            "qk_ln": False,
            "prefix_lm": False,
            "attn_uses_sequence_id": False,
        },
    }
