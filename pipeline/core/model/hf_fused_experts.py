"""Expert tensors that Hugging Face holds fused <-> our stacked experts, in either layout.

Ours are output-major stacks: w1 (gate) and w3 (up) `[E, ffn, hidden]`, w2 `[E, hidden, ffn]`,
biases b1, b3 `[E, ffn]` and b2 `[E, hidden]` (`pipeline.core.model.moe.GroupedExperts`).
Two families store gate and up as one tensor, `model.layers.{i}.mlp.experts.gate_up_proj`,
and differ in how the two share its `2 * ffn` output channels (`layout_of`):

- `INTERLEAVED`, gpt-oss (`GptOssForCausalLM`; the same on disk and in memory): gate in the
  even channels, up in the odd ones; its projections are input-major (`gate_up_proj`
  `[E, hidden, 2 * ffn]`, `down_proj` `[E, ffn, hidden]`), `gate_up_proj_bias` `[E, 2 * ffn]`
  is interleaved the same way, and its router is `mlp.router.weight` / `.bias`.
- `HALVES`, transformers >= 5's in-memory experts, and Mistral 4's files (`FUSED_EXPERTS`):
  gate's channels, then up's (`gate_up_proj` `[E, 2 * ffn, hidden]`, output-major).

One of their tensors makes one or two of ours (`split`), and one or two of ours make one of
theirs (`fused_parts`, `fuse`): every step is a slice, a transpose or a join, so a round trip
gives back the same bytes. Both the in-memory name map (`hf_names.from_hf_state_dict`) and the
weight files (`pipeline.weights.fused_experts`) use it.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from functools import partial

import torch

__all__ = [
    "FUSED_EXPERTS",
    "FUSED_GATE_UP",
    "GPT_OSS",
    "HALVES",
    "INTERLEAVED",
    "fuse",
    "fused_parts",
    "layout_of",
    "split",
]

GPT_OSS = "GptOssForCausalLM"
# Architectures whose expert files hold transformers >= 5's fused experts (Mistral 4): one
# `mlp.experts.gate_up_proj` and one `mlp.experts.down_proj` `[E, hidden, ffn]` a layer; no
# per-expert spelling exists for them.
FUSED_EXPERTS = ("Mistral4ForCausalLM",)
# Our name of the [E, 2 * ffn, hidden] stack of w1 and w3 that such a layer is written from.
FUSED_GATE_UP = "w13"
INTERLEAVED = "interleaved"
HALVES = "halves"

_HF = re.compile(r"model\.layers\.(\d+)\.mlp\.((?:experts|router)\.\w+)")
_OURS = re.compile(r"(layers|mtp)\.(\d+)\.moe\.((?:experts|router)\.\w+)")

# Per layout: their tensor (after `model.layers.{i}.mlp.`) -> (our tensors it holds, after
# `layers.{i}.moe.`, gate before up; whether theirs is input-major).
_TENSORS: dict[str, dict[str, tuple[tuple[str, ...], bool]]] = {
    INTERLEAVED: {
        "experts.gate_up_proj": (("experts.w1", "experts.w3"), True),
        "experts.gate_up_proj_bias": (("experts.b1", "experts.b3"), False),
        "experts.down_proj": (("experts.w2",), True),
        "experts.down_proj_bias": (("experts.b2",), False),
        "router.weight": (("router.weight",), False),
        "router.bias": (("router.bias",), False),
    },
    HALVES: {"experts.gate_up_proj": (("experts.w1", "experts.w3"), False)},
}
# Per layout: ours -> their tensor it is a part of.
_THEIRS = {
    layout: {ours: theirs for theirs, (parts, _) in tensors.items() for ours in parts}
    for layout, tensors in _TENSORS.items()
}


def layout_of(architecture: str | None) -> str:
    """How `architecture` lays gate and up out in its fused tensor: gpt-oss interleaves them,
    every other fused tensor holds them as two halves."""
    return INTERLEAVED if architecture == GPT_OSS else HALVES


def _take(tensor: torch.Tensor, which: int | None, transposed: bool, layout: str) -> torch.Tensor:
    """Part `which` (0 gate, 1 up; None for a tensor that holds one of ours) of their tensor."""
    t = tensor.transpose(-1, -2) if transposed else tensor
    if which is None:
        return t
    return t[:, which::2] if layout == INTERLEAVED else t.chunk(2, dim=1)[which]


def split(
    hf_name: str, layout: str
) -> list[tuple[str, Callable[[torch.Tensor], torch.Tensor]]] | None:
    """For a fused tensor of `layout`, [(our name, how to take it from the tensor)]; None for
    any other name."""
    m = _HF.fullmatch(hf_name)
    if m is None or m.group(2) not in _TENSORS[layout]:
        return None
    layer, theirs = m.groups()
    parts, transposed = _TENSORS[layout][theirs]
    return [
        (
            f"layers.{layer}.moe.{ours}",
            partial(
                _take, which=which if len(parts) > 1 else None, transposed=transposed, layout=layout
            ),
        )
        for which, ours in enumerate(parts)
    ]


def fused_parts(name: str, layout: str) -> tuple[str, list[str]] | None:
    """For our tensor `name` that `layout` writes fused: (their tensor, our tensors it is made
    of, in order; `name` among them); None for any other name."""
    m = _OURS.fullmatch(name)
    if m is None or m.group(3) not in _THEIRS[layout]:
        return None
    kind, layer, ours = m.groups()
    theirs = _THEIRS[layout][ours]
    parts = _TENSORS[layout][theirs][0]
    return f"model.layers.{layer}.mlp.{theirs}", [f"{kind}.{layer}.moe.{p}" for p in parts]


def fuse(hf_name: str, tensors: list[torch.Tensor], layout: str) -> torch.Tensor:
    """Their tensor `hf_name` from ours (in `fused_parts`' order)."""
    parts, transposed = _TENSORS[layout][hf_name.split(".mlp.", 1)[1]]
    if len(parts) == 1:
        (t,) = tensors
    elif layout == INTERLEAVED:
        t = torch.stack(tensors, dim=2).flatten(1, 2)
    else:
        t = torch.cat(tensors, dim=1)
    return t.transpose(-1, -2).contiguous() if transposed else t.contiguous()
