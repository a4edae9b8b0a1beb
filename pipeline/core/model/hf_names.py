"""Hugging Face (Llama / Mistral / Qwen2 / Mixtral) parameter names -> ours, for in-memory
transformers modules. The full converter (files, shards, configs, the reverse direction) lives in
`pipeline.convert`; this is the name map it and the parity tests share."""

from __future__ import annotations

import re

import torch

# (HF regex, our template); {i} is the layer index.
_NAME_MAP: list[tuple[str, str]] = [
    (r"model\.embed_tokens\.weight", "tok_embeddings.weight"),
    (r"model\.norm\.weight", "norm.weight"),
    (r"lm_head\.weight", "output.weight"),
    (r"model\.layers\.(\d+)\.input_layernorm\.weight", "layers.{i}.attention_norm.weight"),
    (r"model\.layers\.(\d+)\.post_attention_layernorm\.weight", "layers.{i}.ffn_norm.weight"),
    (r"model\.layers\.(\d+)\.self_attn\.q_proj\.(weight|bias)", "layers.{i}.attention.wq.{p}"),
    (r"model\.layers\.(\d+)\.self_attn\.k_proj\.(weight|bias)", "layers.{i}.attention.wk.{p}"),
    (r"model\.layers\.(\d+)\.self_attn\.v_proj\.(weight|bias)", "layers.{i}.attention.wv.{p}"),
    (r"model\.layers\.(\d+)\.self_attn\.o_proj\.weight", "layers.{i}.attention.wo.weight"),
    (r"model\.layers\.(\d+)\.mlp\.gate_proj\.weight", "layers.{i}.feed_forward.w1.weight"),
    (r"model\.layers\.(\d+)\.mlp\.up_proj\.weight", "layers.{i}.feed_forward.w3.weight"),
    (r"model\.layers\.(\d+)\.mlp\.down_proj\.weight", "layers.{i}.feed_forward.w2.weight"),
    (r"model\.layers\.(\d+)\.mlp\.gate\.weight", "layers.{i}.moe.router.weight"),
    (r"model\.layers\.(\d+)\.mlp\.experts\.down_proj", "layers.{i}.moe.experts.w2"),
]
# HF Mixtral (transformers >= 5) fuses gate and up: gate_up_proj [E, 2 * ffn, hidden].
_GATE_UP = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.gate_up_proj")


def hf_to_pipe_name(hf_name: str) -> str:
    """Our name for a Hugging Face parameter name; KeyError if it has none."""
    for pattern, template in _NAME_MAP:
        m = re.fullmatch(pattern, hf_name)
        if m:
            groups = m.groups()
            return template.format(i=groups[0] if groups else "", p=groups[-1] if groups else "")
    raise KeyError(f"no pipe name for Hugging Face parameter {hf_name!r}")


def from_hf_state_dict(hf_state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Rename (and split fused expert gate/up) a Hugging Face state dict into ours."""
    out: dict[str, torch.Tensor] = {}
    for name, tensor in hf_state.items():
        m = _GATE_UP.fullmatch(name)
        if m:
            gate, up = tensor.chunk(2, dim=1)
            out[f"layers.{m.group(1)}.moe.experts.w1"] = gate
            out[f"layers.{m.group(1)}.moe.experts.w3"] = up
        else:
            out[hf_to_pipe_name(name)] = tensor
    return out
