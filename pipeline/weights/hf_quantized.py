"""FP8 Hugging Face checkpoints read back as plain weights: which quantization a directory
declares, which of its tensors are scales, and each float8 weight dequantized.

Two FP8 formats are read, the two `pipe export` writes (docs/file_layouts.md):
- NVIDIA ModelOpt's (`quant_method: modelopt`, or only an `hf_quant_config.json`, with
  `quant_algo` FP8): each quantized linear `M` has `M.weight_scale`, one fp32 scale for the
  tensor, or one per output channel; weight = fp8 x scale. The activation scales
  (`M.input_scale`) and KV-cache scales (`k_scale`, `v_scale`) matter only to an FP8 engine:
  a model running in bf16 or fp32 ignores them.
- The block format of DeepSeek-V3 and transformers' `quant_method: fp8`: `M.weight_scale_inv`,
  one scale per `weight_block_size` block (the last row and column of blocks may be partial).

- MXFP4 (`quant_method: mxfp4`, gpt-oss's experts): `M_blocks` `[E, out, in / 32, 16]`
  uint8, two 4-bit e2m1 codes a byte (the low nibble first), and `M_scales` `[E, out, in / 32]`
  uint8, one power of two per 32 values (biased by 127); `dequantize_mxfp4`. Every such value
  is exact in bfloat16, which it is read as.

compressed-tensors' pack-quantized INT4 (Kimi's experts) is `hf_int4.py`'s. Anything else that
declares a quantization (NVFP4, INT4 AWQ, GPTQ, ...) is refused in one line naming it: its
weights are not floats pipe can compute with.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

__all__ = [
    "MXFP4_BLOCKS",
    "MXFP4_SCALES",
    "FP8Layout",
    "dequantize_mxfp4",
    "fp8_layout",
    "is_fp8",
    "is_mxfp4",
]

MODELOPT_QUANT_FILE = "hf_quant_config.json"
_MODELOPT_FP8 = ("FP8", "FP8_PER_CHANNEL_PER_TOKEN")
_FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


@dataclass(frozen=True)
class FP8Layout:
    """How a directory's float8 weights are scaled (see the module docstring)."""

    name: str  # the format, in words: "ModelOpt FP8", "block FP8"
    scale_suffix: str  # `M.weight` is scaled by `M{scale_suffix}`
    ignored_suffixes: tuple[str, ...] = ()  # scales only an FP8 engine uses
    block: tuple[int, int] | None = None  # rows x columns a block scale covers

    def is_scale(self, hf_name: str) -> bool:
        return hf_name.endswith(self.scale_suffix)

    def is_ignored(self, hf_name: str) -> bool:
        return hf_name.endswith(self.ignored_suffixes)

    def scale_name(self, weight_name: str) -> str:
        return weight_name.removesuffix(".weight") + self.scale_suffix

    def dequantize(self, weight: torch.Tensor, scale: torch.Tensor, name: str) -> torch.Tensor:
        """`weight` (float8) times its scale, in fp32; a scale of the wrong shape names
        `name`."""
        value, scale = weight.float(), scale.float()
        if self.block is not None:
            rows, cols = value.shape[-2:]
            grid = (math.ceil(rows / self.block[0]), math.ceil(cols / self.block[1]))
            if tuple(scale.shape) != grid:
                raise ValueError(f"{name}: block scales {tuple(scale.shape)}, expected {grid}")
            full = scale.repeat_interleave(self.block[0], 0).repeat_interleave(self.block[1], 1)
            return value * full[:rows, :cols]
        if scale.numel() == 1:
            return value * scale.reshape(())
        if scale.numel() == value.shape[0]:  # one per output channel
            return value * scale.reshape(-1, *([1] * (value.dim() - 1)))
        raise ValueError(
            f"{name}: weight scale of shape {tuple(scale.shape)} fits neither the whole tensor "
            f"nor each of its {value.shape[0]} output channels"
        )


MXFP4_BLOCKS, MXFP4_SCALES = "_blocks", "_scales"
# The 16 values of an e2m1 code: sign bit 3, then 0, 0.5, 1, 1.5, 2, 3, 4, 6.
_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
_E2M1_VALUES = torch.tensor(_E2M1 + tuple(-v for v in _E2M1))


def is_mxfp4(hf_config: dict[str, Any]) -> bool:
    """Whether config.json declares MXFP4 weights (gpt-oss's published checkpoints)."""
    config = hf_config.get("quantization_config")
    return isinstance(config, dict) and config.get("quant_method") == "mxfp4"


def dequantize_mxfp4(
    blocks: torch.Tensor, scales: torch.Tensor, name: str = "tensor"
) -> torch.Tensor:
    """MXFP4 `blocks` `[..., rows, groups, 16]` (uint8, two codes a byte, low nibble first)
    and `scales` `[..., rows, groups]` (uint8 exponents biased by 127) -> bfloat16
    `[..., rows, groups * 32]`, one leading index (expert) at a time to bound memory."""
    if blocks.shape[:-1] != scales.shape or blocks.shape[-1] != 16:
        raise ValueError(
            f"{name}: MXFP4 blocks {tuple(blocks.shape)} do not fit scales {tuple(scales.shape)}"
        )
    lead_shape = blocks.shape[:-3]
    lead = int(torch.tensor(lead_shape).prod()) if lead_shape else 1
    blocks, scales = blocks.reshape(lead, *blocks.shape[-3:]), scales.reshape(lead, -1, 1)
    rows, groups = blocks.shape[1], blocks.shape[2]
    out = torch.empty(lead, rows, groups * 32, dtype=torch.bfloat16)
    for i in range(lead):
        codes = blocks[i].reshape(rows * groups, 16).to(torch.int64)
        values = torch.stack((_E2M1_VALUES[codes & 0x0F], _E2M1_VALUES[codes >> 4]), dim=-1)
        exponents = scales[i].to(torch.int32) - 127
        values = torch.ldexp(values.reshape(rows * groups, 32), exponents.float())
        out[i] = values.reshape(rows, groups * 32).to(torch.bfloat16)
    return out.reshape(*lead_shape, rows, groups * 32)


def is_fp8(dtype: torch.dtype) -> bool:
    """Whether `dtype` is one of the float8 formats checkpoints store."""
    return dtype in _FP8_DTYPES


def fp8_layout(directory: Path, hf_config: dict[str, Any]) -> FP8Layout | None:
    """The FP8 layout `directory` declares (config.json's `quantization_config`, else
    ModelOpt's `hf_quant_config.json`); None when it declares no quantization. A quantization
    pipe cannot dequantize is a ValueError naming it."""
    config = hf_config.get("quantization_config")
    nested = _modelopt_file(directory / MODELOPT_QUANT_FILE)
    if config is None and nested is None:
        return None
    config = config if isinstance(config, dict) else {}
    method = config.get("quant_method", "modelopt" if nested is not None else None)
    if method == "mxfp4":
        return None  # not FP8: `dequantize_mxfp4`, for the tensors that have blocks and scales
    if method == "modelopt":
        algo = config.get("quant_algo") or (nested or {}).get("quant_algo")
        if algo in _MODELOPT_FP8:
            return FP8Layout(
                "ModelOpt FP8", ".weight_scale", (".input_scale", ".k_scale", ".v_scale")
            )
        _refuse(directory, f"ModelOpt {algo}")
    if method == "compressed-tensors":
        return None  # INT4 pack-quantized: `hf_int4.py` reads it (or refuses another format)
    if method == "fp8":
        block = config.get("weight_block_size")
        if isinstance(block, list) and len(block) == 2 and all(isinstance(b, int) for b in block):
            return FP8Layout("block FP8", ".weight_scale_inv", (".input_scale",), tuple(block))
        _refuse(directory, "fp8 without a weight_block_size")
    _refuse(directory, str(method))


def _refuse(directory: Path, what: str) -> None:
    raise ValueError(
        f"{directory}: weights quantized as {what}, which pipe cannot turn back into floats "
        "(it reads ModelOpt FP8, block FP8 and pack-quantized INT4); give it the unquantized "
        "model"
    )


def _modelopt_file(path: Path) -> dict[str, Any] | None:
    """The `quantization` section of ModelOpt's hf_quant_config.json, None without the file."""
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as error:
        raise ValueError(f"{path}: not a readable JSON file ({error})") from None
    quantization = data.get("quantization") if isinstance(data, dict) else None
    if not isinstance(quantization, dict):
        raise ValueError(f"{path}: no quantization object")
    return quantization
