"""Hugging Face (Llama / Mistral / Qwen2 / Qwen3 / Mixtral / Qwen3-MoE / DeepSeek-V3 / GLM-4.5 /
MiniMax-M2 / Mistral 4) parameter names <-> ours.

Two HF spellings exist for mixtures of experts: the on-disk one, one tensor per expert (Mixtral:
`block_sparse_moe.gate`, `block_sparse_moe.experts.{e}.w1/w2/w3`; Qwen3-MoE: `mlp.gate`,
`mlp.experts.{e}.gate_proj/up_proj/down_proj`; all transformers versions) and the in-memory one
of transformers >= 5 modules (`mlp.gate`, fused 3-D `mlp.experts.gate_up_proj` / `down_proj`).
Weight files (read and written by the weights package) use the on-disk names; the parity tests
use the in-memory ones.

BLOOM and MPT name everything their own way (`_FAMILY_PAIRS`) and fuse q, k and v into one
projection, which our names call `layers.{i}.attention.wqkv` (a name of the weight files only:
`pipeline.weights.fused_qkv` splits it into `wq`, `wk`, `wv` and back). Hub BLOOM checkpoints
also come without the `transformer.` prefix that transformers writes.
"""

from __future__ import annotations

import re

import torch

from pipeline.core.model.config import ModelConfig
from pipeline.core.model.hf_fused_experts import (
    FUSED_EXPERTS,
    FUSED_GATE_UP,
    HALVES,
    INTERLEAVED,
    split,
)
from pipeline.core.model.linear_attention import grouped_channel_order

# (HF template, our template): {i} is the layer index, {p} is `weight` or `bias`. For our -> HF
# the first matching row wins, so on-disk spellings come before in-memory ones.
_NAME_PAIRS: list[tuple[str, str]] = [
    ("model.embed_tokens.weight", "tok_embeddings.weight"),
    ("model.norm.weight", "norm.weight"),
    ("lm_head.weight", "output.weight"),
    ("model.layers.{i}.input_layernorm.weight", "layers.{i}.attention_norm.weight"),
    ("model.layers.{i}.post_attention_layernorm.weight", "layers.{i}.ffn_norm.weight"),
    ("model.layers.{i}.self_attn.q_proj.{p}", "layers.{i}.attention.wq.{p}"),
    ("model.layers.{i}.self_attn.k_proj.{p}", "layers.{i}.attention.wk.{p}"),
    ("model.layers.{i}.self_attn.v_proj.{p}", "layers.{i}.attention.wv.{p}"),
    ("model.layers.{i}.self_attn.o_proj.{p}", "layers.{i}.attention.wo.{p}"),
    ("model.layers.{i}.self_attn.sinks", "layers.{i}.attention.sinks"),
    ("model.layers.{i}.self_attn.q_norm.weight", "layers.{i}.attention.q_norm.weight"),
    ("model.layers.{i}.self_attn.k_norm.weight", "layers.{i}.attention.k_norm.weight"),
    ("model.layers.{i}.self_attn.q_a_proj.weight", "layers.{i}.attention.wq_a.weight"),
    ("model.layers.{i}.self_attn.q_a_layernorm.weight", "layers.{i}.attention.q_a_norm.weight"),
    ("model.layers.{i}.self_attn.q_b_proj.weight", "layers.{i}.attention.wq_b.weight"),
    ("model.layers.{i}.self_attn.kv_a_proj_with_mqa.weight", "layers.{i}.attention.wkv_a.weight"),
    ("model.layers.{i}.self_attn.kv_a_layernorm.weight", "layers.{i}.attention.kv_a_norm.weight"),
    ("model.layers.{i}.self_attn.kv_b_proj.weight", "layers.{i}.attention.wkv_b.weight"),
    ("model.layers.{i}.mlp.gate_proj.weight", "layers.{i}.feed_forward.w1.weight"),
    ("model.layers.{i}.mlp.up_proj.weight", "layers.{i}.feed_forward.w3.weight"),
    ("model.layers.{i}.mlp.down_proj.weight", "layers.{i}.feed_forward.w2.weight"),
    ("model.layers.{i}.block_sparse_moe.gate.weight", "layers.{i}.moe.router.weight"),
    ("model.layers.{i}.mlp.gate.weight", "layers.{i}.moe.router.weight"),
    ("model.layers.{i}.mlp.experts.down_proj", "layers.{i}.moe.experts.w2"),
    ("model.layers.{i}.mlp.gate.e_score_correction_bias", "layers.{i}.moe.expert_bias"),
    # MiniMax-M2 keeps its correction bias on the MoE block: on disk, and in memory.
    ("model.layers.{i}.block_sparse_moe.e_score_correction_bias", "layers.{i}.moe.expert_bias"),
    ("model.layers.{i}.mlp.e_score_correction_bias", "layers.{i}.moe.expert_bias"),
    (
        "model.layers.{i}.mlp.shared_experts.gate_proj.weight",
        "layers.{i}.moe.shared_experts.w1.weight",
    ),
    (
        "model.layers.{i}.mlp.shared_experts.up_proj.weight",
        "layers.{i}.moe.shared_experts.w3.weight",
    ),
    (
        "model.layers.{i}.mlp.shared_experts.down_proj.weight",
        "layers.{i}.moe.shared_experts.w2.weight",
    ),
    # Gated DeltaNet linear attention (Qwen3.5's split projections, Qwen3-Next's fused ones).
    ("model.layers.{i}.linear_attn.in_proj_qkv.weight", "layers.{i}.attention.wqkv.weight"),
    ("model.layers.{i}.linear_attn.in_proj_z.weight", "layers.{i}.attention.wz.weight"),
    ("model.layers.{i}.linear_attn.in_proj_b.weight", "layers.{i}.attention.wb.weight"),
    ("model.layers.{i}.linear_attn.in_proj_a.weight", "layers.{i}.attention.wa.weight"),
    ("model.layers.{i}.linear_attn.in_proj_qkvz.weight", "layers.{i}.attention.wqkvz.weight"),
    ("model.layers.{i}.linear_attn.in_proj_ba.weight", "layers.{i}.attention.wba.weight"),
    ("model.layers.{i}.linear_attn.conv1d.weight", "layers.{i}.attention.conv_weight"),
    ("model.layers.{i}.linear_attn.A_log", "layers.{i}.attention.A_log"),
    ("model.layers.{i}.linear_attn.dt_bias", "layers.{i}.attention.dt_bias"),
    ("model.layers.{i}.linear_attn.norm.weight", "layers.{i}.attention.norm.weight"),
    ("model.layers.{i}.linear_attn.out_proj.weight", "layers.{i}.attention.wo.weight"),
    # Qwen3-Next / Qwen3.5-MoE's one gated shared expert (written so by `pipe_to_hf_names`).
    (
        "model.layers.{i}.mlp.shared_expert.gate_proj.weight",
        "layers.{i}.moe.shared_experts.w1.weight",
    ),
    (
        "model.layers.{i}.mlp.shared_expert.up_proj.weight",
        "layers.{i}.moe.shared_experts.w3.weight",
    ),
    (
        "model.layers.{i}.mlp.shared_expert.down_proj.weight",
        "layers.{i}.moe.shared_experts.w2.weight",
    ),
    ("model.layers.{i}.mlp.shared_expert_gate.weight", "layers.{i}.moe.shared_expert_gate.weight"),
    # DeepSeek-V3's multi-token prediction modules (layers past num_hidden_layers; ours are
    # `mtp.{i}.*`, see `mtp_name`).
    ("model.layers.{i}.enorm.weight", "layers.{i}.enorm.weight"),
    ("model.layers.{i}.hnorm.weight", "layers.{i}.hnorm.weight"),
    ("model.layers.{i}.eh_proj.weight", "layers.{i}.eh_proj.weight"),
    ("model.layers.{i}.shared_head.norm.weight", "layers.{i}.head_norm.weight"),
]
# Per architecture with names of its own: (HF template, our template), as `_NAME_PAIRS`.
_FAMILY_PAIRS: dict[str, list[tuple[str, str]]] = {
    "BloomForCausalLM": [
        ("transformer.word_embeddings.weight", "tok_embeddings.weight"),
        ("transformer.word_embeddings_layernorm.{p}", "embedding_norm.{p}"),
        ("transformer.h.{i}.input_layernorm.{p}", "layers.{i}.attention_norm.{p}"),
        ("transformer.h.{i}.self_attention.query_key_value.{p}", "layers.{i}.attention.wqkv.{p}"),
        ("transformer.h.{i}.self_attention.dense.{p}", "layers.{i}.attention.wo.{p}"),
        ("transformer.h.{i}.post_attention_layernorm.{p}", "layers.{i}.ffn_norm.{p}"),
        ("transformer.h.{i}.mlp.dense_h_to_4h.{p}", "layers.{i}.feed_forward.w1.{p}"),
        ("transformer.h.{i}.mlp.dense_4h_to_h.{p}", "layers.{i}.feed_forward.w2.{p}"),
        ("transformer.ln_f.{p}", "norm.{p}"),
        ("lm_head.weight", "output.weight"),
    ],
    "MptForCausalLM": [
        ("transformer.wte.weight", "tok_embeddings.weight"),
        ("transformer.blocks.{i}.norm_1.weight", "layers.{i}.attention_norm.weight"),
        ("transformer.blocks.{i}.attn.Wqkv.weight", "layers.{i}.attention.wqkv.weight"),
        ("transformer.blocks.{i}.attn.out_proj.weight", "layers.{i}.attention.wo.weight"),
        ("transformer.blocks.{i}.norm_2.weight", "layers.{i}.ffn_norm.weight"),
        ("transformer.blocks.{i}.ffn.up_proj.weight", "layers.{i}.feed_forward.w1.weight"),
        ("transformer.blocks.{i}.ffn.down_proj.weight", "layers.{i}.feed_forward.w2.weight"),
        ("transformer.norm_f.weight", "norm.weight"),
        ("lm_head.weight", "output.weight"),
    ],
}
# Hub BLOOM checkpoints name their tensors without the base model's prefix.
_UNPREFIXED_BLOOM = [
    (hf.removeprefix("transformer."), ours)
    for hf, ours in _FAMILY_PAIRS["BloomForCausalLM"]
    if hf.startswith("transformer.")
]
# What DeepSeek stores in each MTP layer as copies of the shared embedding and output layer.
MTP_SHARED_COPIES = {
    "embed_tokens.weight": "tok_embeddings.weight",
    "shared_head.head.weight": "output.weight",
}
_LAYER = re.compile(r"(layers|mtp)\.(\d+)\.(.*)")
_MTP_SHARED_COPY = re.compile(
    r"model\.layers\.\d+\.(" + "|".join(map(re.escape, MTP_SHARED_COPIES)) + ")"
)


def mtp_name(name: str, num_layers: int) -> str:
    """Our name for a layer parameter named as a main layer (`layers.{i}.*`): multi-token
    prediction modules (i >= num_layers) are `mtp.{i}.*`; other names unchanged."""
    m = _LAYER.fullmatch(name)
    if m and m.group(1) == "layers" and int(m.group(2)) >= num_layers:
        return f"mtp.{m.group(2)}.{m.group(3)}"
    return name


def as_layer_name(name: str) -> str:
    """`mtp.{i}.*` spelled as the layer `layers.{i}.*` (HF numbers MTP modules as layers)."""
    m = _LAYER.fullmatch(name)
    return f"layers.{m.group(2)}.{m.group(3)}" if m and m.group(1) == "mtp" else name


def mtp_shared_copy(hf_name: str) -> str | None:
    """For an MTP layer's copy of the embedding or output layer (`model.layers.{i}.
    embed_tokens.weight`, `...shared_head.head.weight`), the shared tensor's name; else None."""
    m = _MTP_SHARED_COPY.fullmatch(hf_name)
    return MTP_SHARED_COPIES[m.group(1)] if m else None


def _regex(template: str) -> re.Pattern[str]:
    pattern = re.escape(template)
    pattern = pattern.replace(r"\{i\}", r"(?P<i>\d+)").replace(r"\{p\}", r"(?P<p>weight|bias)")
    return re.compile(pattern)


_FAMILY_NAMES = [pair for pairs in _FAMILY_PAIRS.values() for pair in pairs]
_HF_TO_PIPE = [(_regex(hf), ours) for hf, ours in _NAME_PAIRS + _FAMILY_NAMES + _UNPREFIXED_BLOOM]
_PIPE_TO_HF = [(_regex(ours), hf) for hf, ours in _NAME_PAIRS]
_FAMILY_PIPE_TO_HF = {
    arch: [(_regex(ours), hf) for hf, ours in pairs] for arch, pairs in _FAMILY_PAIRS.items()
}
# On disk, each expert's matrices are separate tensors; ours stack them as [E, ...].
# Per architecture: (module holding router and experts, expert tensor name of our w1, w3, w2).
_EXPERT_SPELLINGS: dict[str, tuple[str, dict[str, str]]] = {
    "MixtralForCausalLM": ("block_sparse_moe", {"w1": "w1", "w3": "w3", "w2": "w2"}),
    "Qwen3MoeForCausalLM": ("mlp", {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}),
    "DeepseekV3ForCausalLM": ("mlp", {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}),
    "Glm4MoeForCausalLM": ("mlp", {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}),
    "MiniMaxM2ForCausalLM": ("block_sparse_moe", {"w1": "w1", "w3": "w3", "w2": "w2"}),
    "Mistral4ForCausalLM": ("mlp", {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}),
    "Qwen3NextForCausalLM": ("mlp", {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}),
    "Qwen3_5MoeForCausalLM": ("mlp", {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}),
}
# Architectures with one shared expert, spelled `mlp.shared_expert.*` (DeepSeek's are plural).
_ONE_SHARED_EXPERT = ("Qwen3NextForCausalLM", "Qwen3_5MoeForCausalLM")
# Qwen3.5's image-text checkpoints keep the language model under `model.language_model.`.
_LANGUAGE_MODEL_PREFIX = "model.language_model."
_DISK_EXPERT = re.compile(
    r"model\.layers\.(\d+)\.(block_sparse_moe|mlp)\.experts\.(\d+)\.(\w+)\.weight"
)
_OURS_BY_SPELLING = {
    (module, theirs): ours
    for module, names in _EXPERT_SPELLINGS.values()
    for ours, theirs in names.items()
}
_PIPE_EXPERTS = re.compile(r"layers\.(\d+)\.moe\.experts\.(w[123])")
_PIPE_ROUTER = re.compile(r"layers\.(\d+)\.moe\.router\.weight")
_PIPE_EXPERT_BIAS = re.compile(r"layers\.(\d+)\.moe\.expert_bias")
# Where an architecture keeps the correction bias, when not on the router (`mlp.gate`).
_BIAS_ON_BLOCK = ("MiniMaxM2ForCausalLM",)


_PIPE_FUSED = re.compile(r"layers\.(\d+)\.moe\.experts\.(w13|w2)")

_PIPE_LINEAR_OUT = re.compile(r"layers\.(\d+)\.attention\.wo\.weight")


def hf_to_pipe_name(hf_name: str) -> str:
    """Our name for a Hugging Face parameter name; KeyError if it has none."""
    if hf_name.startswith(_LANGUAGE_MODEL_PREFIX):
        hf_name = "model." + hf_name.removeprefix(_LANGUAGE_MODEL_PREFIX)
    for pattern, template in _HF_TO_PIPE:
        m = pattern.fullmatch(hf_name)
        if m:
            return template.format(**m.groupdict())
    raise KeyError(f"no pipe name for Hugging Face parameter {hf_name!r}")


def hf_expert_piece(hf_name: str) -> tuple[str, int] | None:
    """(our stacked expert name, expert index) for an on-disk Mixtral or Qwen3-MoE expert
    tensor, else None."""
    m = _DISK_EXPERT.fullmatch(hf_name)
    if m is None:
        return None
    layer, module, expert, theirs = m.groups()
    ours = _OURS_BY_SPELLING.get((module, theirs))
    if ours is None:
        return None
    return f"layers.{layer}.moe.experts.{ours}", int(expert)


def linear_attention_layers(config) -> frozenset[int]:
    """The layers of `config` (a `ModelConfig`) that `layer_types` makes linear attention."""
    return frozenset(
        i for i in range(config.num_layers) if config.layer_type(i) == "linear_attention"
    )


def pipe_to_hf_names(
    name: str,
    num_experts: int | None = None,
    architecture: str = "MixtralForCausalLM",
    linear_layers: frozenset[int] = frozenset(),
) -> list[str]:
    """The on-disk Hugging Face names for our parameter `name`: one name, or for a stacked
    expert tensor (`layers.N.moe.experts.w1`) one name per expert, in expert order. MoE
    tensors are spelled as `architecture` (Mixtral or Qwen3-MoE) spells them; BLOOM and MPT
    spell every name their own way. The output projection of a layer in `linear_layers`
    (`linear_attention_layers`) is the linear attention's `out_proj`."""
    family = _FAMILY_PIPE_TO_HF.get(architecture)
    if family is not None:
        for pattern, template in family:
            m = pattern.fullmatch(name)
            if m:
                return [template.format(**m.groupdict())]
        raise KeyError(f"no {architecture} name for pipe parameter {name!r}")
    m = _PIPE_LINEAR_OUT.fullmatch(name)
    if m and int(m.group(1)) in linear_layers:
        return [f"model.layers.{m.group(1)}.linear_attn.out_proj.weight"]
    m = _PIPE_FUSED.fullmatch(name)
    if m and architecture in FUSED_EXPERTS:
        fused = "gate_up_proj" if m.group(2) == FUSED_GATE_UP else "down_proj"
        return [f"model.layers.{m.group(1)}.mlp.experts.{fused}"]
    module, names = _EXPERT_SPELLINGS.get(architecture, _EXPERT_SPELLINGS["MixtralForCausalLM"])
    m = _PIPE_EXPERTS.fullmatch(name)
    if m:
        if num_experts is None:
            raise ValueError(f"{name} is an expert stack; num_experts is required")
        layer, w = m.groups()
        prefix = f"model.layers.{layer}.{module}.experts"
        return [f"{prefix}.{e}.{names[w]}.weight" for e in range(num_experts)]
    m = _PIPE_ROUTER.fullmatch(name)
    if m:
        return [f"model.layers.{m.group(1)}.{module}.gate.weight"]
    m = _PIPE_EXPERT_BIAS.fullmatch(name)
    if m and architecture in _BIAS_ON_BLOCK:
        return [f"model.layers.{m.group(1)}.{module}.e_score_correction_bias"]
    for pattern, template in _PIPE_TO_HF:
        m = pattern.fullmatch(name)
        if m:
            hf_name = template.format(**m.groupdict())
            if architecture in _ONE_SHARED_EXPERT:
                hf_name = hf_name.replace(".mlp.shared_experts.", ".mlp.shared_expert.")
            return [hf_name]
    raise KeyError(f"no Hugging Face name for pipe parameter {name!r}")


def from_hf_state_dict(
    hf_state: dict[str, torch.Tensor], config: ModelConfig | None = None
) -> dict[str, torch.Tensor]:
    """Rename (and split fused expert gate/up) an in-memory Hugging Face state dict into ours
    (`pipeline.core.model.hf_fused_experts`: gpt-oss's interleaved, others' halves); linear
    attention's conv channels and q/k/v rows are reordered (`reorder_from_hf`), which needs the
    model's `config`."""
    out: dict[str, torch.Tensor] = {}
    # Qwen3-MoE's in-memory experts share gpt-oss's names; only gpt-oss has `mlp.router`.
    gpt_oss = any(name.endswith(".mlp.router.weight") for name in hf_state)
    layout = INTERLEAVED if gpt_oss else HALVES
    for name, tensor in hf_state.items():
        pieces = split(name, layout)
        if pieces is not None:
            out |= {ours: take(tensor) for ours, take in pieces}
        else:
            ours = hf_to_pipe_name(name)
            out[ours] = reorder_from_hf(ours, tensor, config)
    return out


# Linear attention's tensors whose channels pipe groups by key head (`grouped_channel_order`).
_REORDERED = re.compile(r"layers\.(\d+)\.attention\.(wqkv\.weight|conv_weight)")


def reorder_from_hf(name: str, tensor: torch.Tensor, config: ModelConfig | None) -> torch.Tensor:
    """Our tensor `name` from Hugging Face's: linear attention's conv weight and Qwen3.5's
    in_proj_qkv rows from all-queries, all-keys, all-values order to ours, grouped by key head;
    any other tensor (BLOOM's fused q/k/v, also named `wqkv`, among them) as it is."""
    if _REORDERED.fullmatch(name) and config is None:
        raise ValueError(f"{name}: reordering linear attention's channels needs the model config")
    if not is_reordered(name, config):
        return tensor
    return tensor[grouped_channel_order(config.linear_attention)]


def reorder_to_hf(name: str, tensor: torch.Tensor, config: ModelConfig) -> torch.Tensor:
    """The inverse of `reorder_from_hf`: Hugging Face's tensor for our `name`."""
    if not is_reordered(name, config):
        return tensor
    return tensor[grouped_channel_order(config.linear_attention).argsort()]


def is_reordered(name: str, config: ModelConfig) -> bool:
    """Whether `reorder_from_hf` / `reorder_to_hf` change the tensor `name`: a linear-attention
    layer's conv weight or q/k/v projection."""
    m = _REORDERED.fullmatch(name)
    return m is not None and config.layer_type(int(m.group(1))) == "linear_attention"
