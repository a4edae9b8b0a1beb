"""FP8 in NVIDIA Model Optimizer's "unified Hugging Face checkpoint" format, which the
TensorRT-LLM PyTorch backend, vLLM and SGLang load (this repository's docs/file_layouts.md, section
"FP8 Hugging Face export").

The checkpoint is the `pipe convert --to hf` one with the Hugging Face tensor names unchanged
(experts one tensor per expert). Each quantized linear `M` stores `M.weight` in float8_e4m3fn
and two fp32 scalars, `M.weight_scale` and `M.input_scale`, dequantization scales amax / 448
(`fp8.py`). Engines fuse q/k/v and gate/up into one GEMM, so those groups share both scales
(per expert for MoE). With an FP8 KV cache, `self_attn.k_proj.k_scale` and
`self_attn.v_proj.v_scale` hold the scales of keys (after RoPE) and values. Everything else
(embeddings, norms, routers, `lm_head`, excluded linears) stays in the export dtype and is
named, module by module, in the ignore list of both `hf_quant_config.json` and config.json's
`quantization_config`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from fnmatch import fnmatch

import torch

from pipeline.export.fp8 import quantize, scales_from_amax
from pipeline.weights.hf_writer import HFPiece
from pipeline.weights.source import TensorSource

__all__ = ["ModelOptFP8", "modelopt_configs"]

PRODUCER = "pipe"
_FP8_SCHEME = {"type": "float", "num_bits": 8, "dynamic": False}
# Our linear weight -> (calibration key of its input, fused group); {i} the layer.
_LINEARS = [
    (re.compile(r"layers\.(\d+)\.attention\.w([qkv])\.weight"), "{i}.qkv", "{i}.qkv"),
    (re.compile(r"layers\.(\d+)\.attention\.wo\.weight"), "{i}.dense", "{i}.dense"),
    (re.compile(r"layers\.(\d+)\.feed_forward\.w([13])\.weight"), "{i}.fc", "{i}.fc"),
    (re.compile(r"layers\.(\d+)\.feed_forward\.w2\.weight"), "{i}.proj", "{i}.proj"),
    (re.compile(r"layers\.(\d+)\.moe\.experts\.w([13])"), "{i}.fc", "{i}.fc"),
    (re.compile(r"layers\.(\d+)\.moe\.experts\.w2"), "{i}.proj", "{i}.proj"),
    (re.compile(r"(output)\.weight"), "lm_head", "lm_head"),
]


def _linear(name: str) -> tuple[str, str] | None:
    """(calibration key, fused group) of our weight `name`, None when it is not a linear."""
    for pattern, key, group in _LINEARS:
        m = pattern.fullmatch(name)
        if m:
            return key.format(i=m.group(1)), group.format(i=m.group(1))
    return None


def _module(piece: HFPiece) -> str:
    return piece.hf_name.removesuffix(".weight")


def _scalar(value: torch.Tensor) -> torch.Tensor:
    return value.reshape(()).float()


@dataclass
class ModelOptFP8:
    """Rewrites the HF writer's pieces into the FP8 format (see the module docstring).

    `amax`: calibrated activation maxima (`calibration.calibrate`); `exclude`: fnmatch patterns
    of HF module names kept unquantized (a match on one member excludes its fused group);
    `quantize_lm_head`: quantize an untied `lm_head` too."""

    source: TensorSource
    amax: dict[str, float]
    kv_cache: bool = False
    exclude: tuple[str, ...] = ()
    quantize_lm_head: bool = False

    def __post_init__(self) -> None:
        if self.quantize_lm_head and self.source.model_config.tie_word_embeddings:
            raise ValueError("--fp8-lm-head: a tied lm_head is the embedding, kept unquantized")

    # --- weight scales -------------------------------------------------------------------

    def _quantized(self, name: str) -> tuple[str, str] | None:
        linear = _linear(name)
        if linear is None or (linear[0] == "lm_head" and not self.quantize_lm_head):
            return None
        return linear

    def _fused_keys(self, group: list[HFPiece], fused: str) -> list[str]:
        """One key per piece: the fused group, per expert for stacked experts."""
        return [fused if p.index is None else f"{fused}.{p.index}" for p in group]

    def _weight_amax(self, groups: list[list[HFPiece]]) -> dict[str, torch.Tensor]:
        """The amax of every fused group of weights (one pass over the linears)."""
        amax: dict[str, torch.Tensor] = {}
        for group in groups:
            linear = self._quantized(group[0].source_name)
            if linear is None:
                continue
            tensor = self.source.read(group[0].source_name).float()
            for piece, key in zip(group, self._fused_keys(group, linear[1]), strict=True):
                part = tensor if piece.index is None else tensor[piece.index]
                value = part.abs().amax()
                amax[key] = value if key not in amax else torch.maximum(amax[key], value)
        return amax

    def _excluded_groups(self, groups: list[list[HFPiece]]) -> set[str]:
        excluded = set()
        for group in groups:
            linear = self._quantized(group[0].source_name)
            if linear is None:
                continue
            for piece, key in zip(group, self._fused_keys(group, linear[1]), strict=True):
                if any(fnmatch(_module(piece), pattern) for pattern in self.exclude):
                    excluded.add(key)
        return excluded

    # --- pieces --------------------------------------------------------------------------

    def _input_scale(self, key: str) -> torch.Tensor:
        if key not in self.amax:
            raise ValueError(f"no calibrated activation range for {key!r}")
        return _scalar(scales_from_amax(torch.tensor(self.amax[key])))

    def _scale_pieces(self, module: str, scales: dict[str, torch.Tensor]) -> list[list[HFPiece]]:
        """One group per scalar (so the fp32 scalars sort ahead of the weights)."""
        return [
            [HFPiece(f"{module}.{kind}", None, None, (), torch.float32, lambda _, v=value: v)]
            for kind, value in scales.items()
        ]

    def _kv_scales(self, module: str, layer: str) -> dict[str, torch.Tensor]:
        if not self.kv_cache:
            return {}
        kind = {"k_proj": "k_scale", "v_proj": "v_scale"}.get(module.rsplit(".", 1)[-1])
        return {kind: self._input_scale(f"{layer}.kv")} if kind else {}

    def _kept(self, group: list[HFPiece], excluded: set[str]) -> bool:
        """Whether `group` stays in the export dtype: not a quantized linear, or excluded."""
        linear = self._quantized(group[0].source_name)
        return linear is None or any(k in excluded for k in self._fused_keys(group, linear[1]))

    def ignored(self, groups: list[list[HFPiece]]) -> list[str]:
        """Every module left unquantized (embeddings, norms, routers, lm_head, excluded
        linears), by Hugging Face name in layer order: the formats' ignore list."""
        excluded = self._excluded_groups(groups)
        ignore = {"lm_head"} if self.source.model_config.tie_word_embeddings else set()
        for group in groups:
            if self._kept(group, excluded):
                ignore |= {_module(p) for p in group if p.hf_name.endswith(".weight")}
        return sorted(ignore, key=_natural)

    def __call__(self, groups: list[list[HFPiece]]) -> list[list[HFPiece]]:
        """The pieces of the FP8 export (reads every quantized weight once for its amax)."""
        weight_amax = self._weight_amax(groups)
        excluded = self._excluded_groups(groups)
        out: list[list[HFPiece]] = []
        for group in groups:
            if self._kept(group, excluded):
                out.append(group)
                continue
            key, fused = self._quantized(group[0].source_name)
            pieces = []
            for piece, fused_key in zip(group, self._fused_keys(group, fused), strict=True):
                scale = _scalar(scales_from_amax(weight_amax[fused_key]))
                make = lambda t, s=scale: quantize(t, s)  # noqa: E731
                pieces.append(
                    HFPiece(
                        piece.hf_name,
                        piece.source_name,
                        piece.index,
                        piece.shape,
                        torch.float8_e4m3fn,
                        make,
                    )
                )
                scales = {"weight_scale": scale, "input_scale": self._input_scale(key)}
                scales |= self._kv_scales(_module(piece), key.split(".")[0])
                out += self._scale_pieces(_module(piece), scales)
            out.append(pieces)
        return out


def _natural(name: str) -> list:
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name)]


def modelopt_configs(ignore: list[str], kv_cache: bool, version: str) -> tuple[dict, dict]:
    """(`hf_quant_config.json`, config.json's `quantization_config`) of an FP8 export that
    leaves the modules `ignore` unquantized; the two say the same thing."""
    producer = {"name": PRODUCER, "version": version}
    nested = {
        "producer": producer,
        "quantization": {
            "quant_algo": "FP8",
            "kv_cache_quant_algo": "FP8" if kv_cache else None,
            "exclude_modules": list(ignore),
        },
    }
    flat = {
        "quant_method": "modelopt",
        "quant_algo": "FP8",
        "kv_cache_quant_algo": "FP8" if kv_cache else None,
        "kv_cache_scheme": dict(_FP8_SCHEME) if kv_cache else None,
        "ignore": list(ignore),
        "producer": producer,
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": dict(_FP8_SCHEME),
                "input_activations": dict(_FP8_SCHEME),
            }
        },
    }
    return nested, flat
