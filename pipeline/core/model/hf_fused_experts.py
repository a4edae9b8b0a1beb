"""gpt-oss's fused expert tensors (Hugging Face `GptOssForCausalLM`) <-> our stacked experts.

gpt-oss stores each layer's experts as four tensors, the same on disk and in memory:
`mlp.experts.gate_up_proj` `[E, hidden, 2 * ffn]` (input-major, gate and up interleaved: gate
in the even columns, up in the odd ones), `gate_up_proj_bias` `[E, 2 * ffn]` (interleaved the
same way), `down_proj` `[E, ffn, hidden]` and `down_proj_bias` `[E, hidden]`; its router is
`mlp.router.weight` / `.bias`. Ours are output-major stacks: w1 (gate) and w3 (up)
`[E, ffn, hidden]`, w2 `[E, hidden, ffn]`, biases b1, b3 `[E, ffn]` and b2 `[E, hidden]`
(`pipeline.core.model.moe.GroupedExperts`).

One of their tensors makes one or two of ours (`split`), and one or two of ours make one of
theirs (`FUSED`, `fuse`): every step is a slice, a transpose or an interleave, so a round trip
gives back the same bytes.
"""

from __future__ import annotations

import re
from collections.abc import Callable

import torch

__all__ = ["FUSED", "GPT_OSS", "fuse", "fused_hf_name", "split", "split_state_dict"]

GPT_OSS = "GptOssForCausalLM"

_HF = re.compile(
    r"model\.layers\.(\d+)\.mlp\.(experts\.gate_up_proj|experts\.gate_up_proj_bias|"
    r"experts\.down_proj|experts\.down_proj_bias|router\.weight|router\.bias)"
)
_OURS = re.compile(r"(layers|mtp)\.(\d+)\.moe\.(experts\.w[123]|experts\.b[123]|router\.\w+)")


def _even(t: torch.Tensor) -> torch.Tensor:
    return t[..., 0::2]


def _odd(t: torch.Tensor) -> torch.Tensor:
    return t[..., 1::2]


def _output_major(t: torch.Tensor) -> torch.Tensor:
    return t.transpose(-1, -2)


def _same(t: torch.Tensor) -> torch.Tensor:
    return t


# Their tensor (after `model.layers.{i}.mlp.`) -> [(our tensor after `layers.{i}.moe.`, how it
# is taken out of theirs)].
_SPLITS: dict[str, list[tuple[str, Callable[[torch.Tensor], torch.Tensor]]]] = {
    "experts.gate_up_proj": [
        ("experts.w1", lambda t: _output_major(_even(t))),
        ("experts.w3", lambda t: _output_major(_odd(t))),
    ],
    "experts.gate_up_proj_bias": [("experts.b1", _even), ("experts.b3", _odd)],
    "experts.down_proj": [("experts.w2", _output_major)],
    "experts.down_proj_bias": [("experts.b2", _same)],
    "router.weight": [("router.weight", _same)],
    "router.bias": [("router.bias", _same)],
}
# Ours -> (theirs, every one of ours it is made of, in order).
FUSED: dict[str, tuple[str, tuple[str, ...]]] = {
    ours: (theirs, tuple(name for name, _ in parts))
    for theirs, parts in _SPLITS.items()
    for ours, _ in parts
}


def split(hf_name: str) -> list[tuple[str, Callable[[torch.Tensor], torch.Tensor]]] | None:
    """For a gpt-oss expert or router tensor, [(our name, how to take it from the tensor)];
    None for any other name."""
    m = _HF.fullmatch(hf_name)
    if m is None:
        return None
    layer, theirs = m.groups()
    return [(f"layers.{layer}.moe.{ours}", take) for ours, take in _SPLITS[theirs]]


def fused_hf_name(name: str) -> tuple[str, list[str]] | None:
    """For our expert or router tensor `name` of a gpt-oss model: (their tensor, our tensors it
    is made of, in order; `name` among them); None for any other name."""
    m = _OURS.fullmatch(name)
    if m is None or m.group(3) not in FUSED:
        return None
    kind, layer, ours = m.groups()
    theirs, parts = FUSED[ours]
    return f"model.layers.{layer}.mlp.{theirs}", [f"{kind}.{layer}.moe.{p}" for p in parts]


def fuse(hf_name: str, tensors: list[torch.Tensor]) -> torch.Tensor:
    """Their tensor `hf_name` from ours (in `fused_hf_name`'s order): gate and up interleaved,
    projections input-major."""
    theirs = hf_name.split(".mlp.", 1)[1]
    if theirs in ("experts.gate_up_proj", "experts.gate_up_proj_bias"):
        gate, up = tensors
        if theirs == "experts.gate_up_proj":
            gate, up = _output_major(gate), _output_major(up)
        return torch.stack((gate, up), dim=-1).flatten(-2).contiguous()
    (tensor,) = tensors
    return _output_major(tensor).contiguous() if theirs == "experts.down_proj" else tensor


def split_state_dict(hf_state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The gpt-oss expert and router tensors of an in-memory state dict, as ours."""
    out = {}
    for name, tensor in hf_state.items():
        for ours, take in split(name) or []:
            out[ours] = take(tensor)
    return out
