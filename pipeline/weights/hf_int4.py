"""INT4 weights packed by compressed-tensors ("pack-quantized"), read back as floats: how Kimi
K2-Thinking and Kimi K2.5 publish their routed experts.

A quantized linear `M` is stored as three tensors instead of `M.weight`:
- `M.weight_packed`, int32 `[rows, cols / 8]`: eight signed 4-bit values per word, value j of
  a word in bits 4j..4j+3, each stored as q + 8 (so 0..15 holds -8..7);
- `M.weight_scale`, `[rows, cols / group_size]` (bf16 in the published models): one scale per
  group of `group_size` consecutive inputs of a row;
- `M.weight_shape`, int64 `[2]`: `[rows, cols]`.

The weight is q * scale, symmetric (no zero point), computed in the scale's dtype as
compressed-tensors computes it, then returned in fp32. `config.json`'s `quantization_config`
must say `quant_method: compressed-tensors`, `format: pack-quantized` and, for every config
group, 4-bit symmetric integer weights quantized per group; anything else is refused in one
line. Layers the config's `ignore` list leaves out are stored as plain `M.weight` and read as is.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["PackedInt4", "packed_int4_layout"]

PACKED_SUFFIX = ".weight_packed"
SCALE_SUFFIX = ".weight_scale"
SHAPE_SUFFIX = ".weight_shape"
_VALUES_PER_WORD = 8


@dataclass(frozen=True)
class PackedInt4:
    """compressed-tensors' pack-quantized INT4 with one scale per `group_size` inputs."""

    group_size: int
    name: str = "compressed-tensors INT4"

    @staticmethod
    def is_packed(hf_name: str) -> bool:
        return hf_name.endswith(PACKED_SUFFIX)

    @staticmethod
    def is_aux(hf_name: str) -> bool:
        """A scale or shape tensor, read only with its packed weight."""
        return hf_name.endswith((SCALE_SUFFIX, SHAPE_SUFFIX))

    @staticmethod
    def weight_name(hf_name: str) -> str:
        """`M.weight` for `M.weight_packed`."""
        return hf_name.removesuffix(PACKED_SUFFIX) + ".weight"

    @staticmethod
    def aux_names(packed_name: str) -> tuple[str, str]:
        """(scale, shape) tensor names of the packed weight `packed_name`."""
        stem = packed_name.removesuffix(PACKED_SUFFIX)
        return stem + SCALE_SUFFIX, stem + SHAPE_SUFFIX

    def dequantize(
        self, packed: torch.Tensor, scale: torch.Tensor, shape: torch.Tensor, name: str
    ) -> torch.Tensor:
        """The fp32 weight `[rows, cols]` of one packed tensor; a tensor of the wrong dtype or
        shape is a ValueError naming `name`."""
        rows, cols = (int(n) for n in shape.tolist())
        if packed.dtype != torch.int32:
            raise ValueError(f"{name}: packed weight is {packed.dtype}, expected torch.int32")
        words = -(-cols // _VALUES_PER_WORD)
        if tuple(packed.shape) != (rows, words):
            raise ValueError(
                f"{name}: packed shape {tuple(packed.shape)} does not hold [{rows}, {cols}] "
                f"as 4-bit values (expected ({rows}, {words}))"
            )
        if cols % self.group_size or tuple(scale.shape) != (rows, cols // self.group_size):
            raise ValueError(
                f"{name}: scales {tuple(scale.shape)} do not give one per {self.group_size} "
                f"inputs of [{rows}, {cols}]"
            )
        shifts = torch.arange(0, 32, 4, dtype=torch.int32)
        nibbles = (packed.unsqueeze(-1) >> shifts) & 0xF  # arithmetic shift, then masked
        values = (nibbles.reshape(rows, -1)[:, :cols] - 8).to(scale.dtype)
        weight = values * scale.repeat_interleave(self.group_size, dim=-1)
        return weight.float()


def packed_int4_layout(hf_config: dict[str, Any]) -> PackedInt4 | None:
    """The pack-quantized INT4 layout `config.json` declares, None for another quantization
    (or none); a compressed-tensors scheme other than symmetric 4-bit integer groups is a
    ValueError naming what it is."""
    config = hf_config.get("quantization_config")
    if not isinstance(config, dict) or config.get("quant_method") != "compressed-tensors":
        return None
    fmt = config.get("format")
    if fmt != "pack-quantized":
        raise ValueError(
            f"config.json: compressed-tensors format {fmt!r}, which pipe cannot turn back "
            "into floats (it reads pack-quantized INT4)"
        )
    groups = config.get("config_groups") or {}
    sizes = {_group_size(name, group) for name, group in groups.items()}
    if len(sizes) != 1:
        raise ValueError(
            "config.json: quantization_config.config_groups must hold INT4 groups of one size, "
            f"found {sorted(sizes) or 'none'}"
        )
    return PackedInt4(sizes.pop())


def _group_size(name: str, group: Any) -> int:
    """The group size of one config group of 4-bit symmetric integer group weights."""
    weights = group.get("weights") if isinstance(group, dict) else None
    where = f"config.json: quantization_config.config_groups.{name}.weights"
    if not isinstance(weights, dict):
        raise ValueError(f"{where} is missing")
    wanted = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group"}
    for key, value in wanted.items():
        if weights.get(key) != value:
            raise ValueError(
                f"{where}.{key} is {weights.get(key)!r}; pipe reads {key} {value!r} only"
            )
    size = weights.get("group_size")
    if not isinstance(size, int) or size < 1:
        raise ValueError(f"{where}.group_size must be a positive integer, got {size!r}")
    return size
