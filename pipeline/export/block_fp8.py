"""FP8 in DeepSeek-V3's own block format, which TensorRT-LLM, vLLM, SGLang and transformers read
for `DeepseekV3ForCausalLM` (docs/file_layouts.md, "DeepSeek-V3 block FP8").

Each quantized linear `M` stores `M.weight` in float8_e4m3fn and `M.weight_scale_inv`, an fp32
grid of shape [ceil(out / 128), ceil(in / 128)]: one dequantization scale per 128 x 128 block
(the last row and column of blocks may be partial), weight = fp8 x scale of its block. A block's
scale is its largest |value| / 448, so nothing saturates. Activations are quantized by the
engine at run time (`activation_scheme: dynamic`), so no calibration is needed.

Quantized, as in DeepSeek's release: every projection of attention (`q_proj` or `q_a_proj` /
`q_b_proj`, `kv_a_proj_with_mqa`, `kv_b_proj`, `o_proj`) and of the MLPs (dense, each routed
expert, the shared experts). Kept in the export dtype: embeddings, `lm_head`, the norms, the
router (`mlp.gate`); its `e_score_correction_bias` stays fp32. config.json's
`quantization_config` is DeepSeek's (`QUANT_CONFIG`): engines know the unquantized modules by
their kind, so there is no ignore list.
"""

from __future__ import annotations

import math
import re

import torch

from pipeline.export.fp8 import FP8_MAX
from pipeline.export.options import ExportOptions
from pipeline.weights.hf_config import choose_architecture
from pipeline.weights.hf_writer import HFPiece
from pipeline.weights.source import TensorSource

__all__ = [
    "BLOCK",
    "QUANT_CONFIG",
    "DeepSeekBlockFP8",
    "block_amax",
    "block_grid",
    "block_scales",
    "check_block_options",
    "is_block_quantized",
    "quantize_blocks",
    "uses_block_fp8",
]

BLOCK = 128
QUANT_CONFIG = {
    "quant_method": "fp8",
    "fmt": "e4m3",
    "activation_scheme": "dynamic",
    "weight_block_size": [BLOCK, BLOCK],
}
_TINY = 1e-12  # an all-zero block still gets a positive scale
# Projections of attention and MLPs (dense, routed and shared experts): the linears DeepSeek
# quantizes. Embeddings, lm_head, norms and the router `mlp.gate` do not match.
_QUANTIZED = re.compile(r"model\.layers\.\d+\.(self_attn|mlp)\..*_proj(_with_mqa)?\.weight")


def uses_block_fp8(source: TensorSource) -> bool:
    """Whether `--fp8` writes `source` in this format (a DeepSeek-V3 model), not ModelOpt's."""
    architecture = source.metadata.get("hf_architecture")
    return choose_architecture(source.model_config, architecture) == "DeepseekV3ForCausalLM"


def check_block_options(options: ExportOptions) -> None:
    """ValueError for an FP8 option the block format has no place for."""
    format_ = "DeepSeek's block FP8 format"
    if options.fp8_kv_cache:
        raise ValueError(
            f"--fp8-kv-cache: {format_} stores no KV-cache scales (choose an FP8 KV "
            "cache when serving, e.g. vllm serve --kv-cache-dtype fp8)"
        )
    if "lm_head" not in options.exclude_modules:
        raise ValueError(f"--fp8-lm-head: {format_} keeps lm_head unquantized")
    extra = [p for p in options.exclude_modules if p != "lm_head"]
    if extra:
        raise ValueError(
            f"--fp8-exclude {extra[0]}: {format_} quantizes every projection "
            "(engines read no list of exceptions from it)"
        )


def is_block_quantized(hf_name: str) -> bool:
    """Whether the Hugging Face tensor `hf_name` is one DeepSeek's block format quantizes."""
    return _QUANTIZED.fullmatch(hf_name) is not None


def block_grid(shape: tuple[int, ...], block: tuple[int, int] = (BLOCK, BLOCK)) -> tuple[int, int]:
    """The scale grid of an [out, in] weight: (ceil(out / block rows), ceil(in / block cols))."""
    return math.ceil(shape[0] / block[0]), math.ceil(shape[1] / block[1])


def block_amax(weight: torch.Tensor, block: tuple[int, int] = (BLOCK, BLOCK)) -> torch.Tensor:
    """The largest |value| of each block of the 2-D `weight`, fp32 [rows, cols] of blocks
    (partial edge blocks padded with zeros)."""
    rows, cols = block_grid(tuple(weight.shape), block)
    padded = weight.new_zeros(rows * block[0], cols * block[1], dtype=torch.float32)
    padded[: weight.shape[0], : weight.shape[1]] = weight.float().abs()
    return padded.view(rows, block[0], cols, block[1]).amax(dim=(1, 3))


def block_scales(weight: torch.Tensor) -> torch.Tensor:
    """`weight_scale_inv` of the 2-D `weight`: each block's amax / 448, fp32."""
    return (block_amax(weight) / FP8_MAX).clamp(min=_TINY)


def quantize_blocks(weight: torch.Tensor) -> torch.Tensor:
    """The 2-D `weight` as float8_e4m3fn under its `block_scales`."""
    scales = block_scales(weight).repeat_interleave(BLOCK, 0).repeat_interleave(BLOCK, 1)
    scale = scales[: weight.shape[0], : weight.shape[1]]
    return (weight.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)


class DeepSeekBlockFP8:
    """Rewrites the HF writer's pieces into the block format (see the module docstring): each
    quantized weight becomes an fp8 piece and a `weight_scale_inv` piece, in separate groups
    (the fp32 scales sort ahead of the fp8 weights, keeping every tensor aligned), so each
    quantized source tensor is read twice; everything else is left as planned."""

    def __call__(self, groups: list[list[HFPiece]]) -> list[list[HFPiece]]:
        out: list[list[HFPiece]] = []
        for group in groups:
            if not is_block_quantized(group[0].hf_name):
                out.append(group)
                continue
            scales = [self._scale_piece(p) for p in group]
            weights = [self._weight_piece(p) for p in group]
            out += [scales, weights]
        return out

    @staticmethod
    def _scale_piece(piece: HFPiece) -> HFPiece:
        name = piece.hf_name.removesuffix(".weight") + ".weight_scale_inv"
        grid = block_grid(piece.shape)
        return HFPiece(name, piece.source_name, piece.index, grid, torch.float32, block_scales)

    @staticmethod
    def _weight_piece(piece: HFPiece) -> HFPiece:
        fp8 = torch.float8_e4m3fn
        return HFPiece(
            piece.hf_name, piece.source_name, piece.index, piece.shape, fp8, quantize_blocks
        )
