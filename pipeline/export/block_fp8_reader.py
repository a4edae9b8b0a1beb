"""Read a DeepSeek-V3 block-FP8 checkpoint back, from the format's description alone
(docs/file_layouts.md, "DeepSeek-V3 block FP8"), check it, and run it.

`BlockFP8Checkpoint(directory)` reads config.json's `quantization_config` and every tensor and
refuses, with a one-line `ValueError`, what an engine would misread: a quantization_config that
is not DeepSeek's (`quant_method: fp8`, `fmt: e4m3`, dynamic activations, a two-integer
`weight_block_size`); a float8 weight without an fp32 `weight_scale_inv` of shape
[ceil(out / block), ceil(in / block)], whose every entry is positive and finite; a weight holding
NaN; a scale with no weight; a module DeepSeek leaves unquantized (embeddings, lm_head, the
router `mlp.gate`) stored in fp8, or any other 2-D weight left in high precision.
`dequantized()` multiplies each block by its scale (partial edge blocks included); `model()`
runs our model on the result.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import torch
from safetensors import safe_open

__all__ = ["BlockFP8Checkpoint"]

_SCALE = ".weight_scale_inv"
# What DeepSeek-V3 keeps in high precision among its 2-D weights (norms and the correction
# bias are 1-D): the embeddings, the output projection and each MoE router.
_UNQUANTIZED = re.compile(r"model\.embed_tokens\.weight|lm_head\.weight|.*\.mlp\.gate\.weight")


class BlockFP8Checkpoint:
    """A DeepSeek block-FP8 checkpoint directory, checked on opening (see the module
    docstring)."""

    def __init__(self, directory: str | Path) -> None:
        self.directory = Path(directory)
        self.config = json.loads((self.directory / "config.json").read_text())
        self.block = self._check_config(self.config.get("quantization_config") or {})
        self.tensors: dict[str, torch.Tensor] = {}
        for file in sorted(self.directory.glob("*.safetensors")):
            with safe_open(str(file), framework="pt") as f:
                self.tensors |= {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118
        self.quantized = sorted(
            n.removesuffix(".weight")
            for n, t in self.tensors.items()
            if t.dtype == torch.float8_e4m3fn
        )
        self._check_kinds()
        self._scales = {module: self._checked_scale(module) for module in self.quantized}

    def _fail(self, message: str) -> None:
        raise ValueError(f"{self.directory}: {message}")

    def _check_config(self, quant: dict) -> tuple[int, int]:
        expected = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic"}
        for key, value in expected.items():
            if quant.get(key) != value:
                self._fail(f"quantization_config.{key} is {quant.get(key)!r}, not {value!r}")
        block = quant.get("weight_block_size")
        if not (
            isinstance(block, list)
            and len(block) == 2
            and all(isinstance(b, int) and b > 0 for b in block)
        ):
            self._fail(f"quantization_config.weight_block_size {block!r} is not two positive ints")
        return block[0], block[1]

    def scale(self, module: str) -> torch.Tensor:
        """`{module}.weight_scale_inv` (checked on opening: fp32, one entry per block, positive,
        finite)."""
        return self._scales[module]

    def _checked_scale(self, module: str) -> torch.Tensor:
        weight = self.tensors[f"{module}.weight"]
        scale = self.tensors.get(module + _SCALE)
        if scale is None:
            self._fail(f"{module}.weight is fp8 but {module}{_SCALE} is missing")
        grid = tuple(math.ceil(n / b) for n, b in zip(weight.shape, self.block, strict=True))
        if scale.dtype != torch.float32 or tuple(scale.shape) != grid:
            self._fail(
                f"{module}{_SCALE} is {scale.dtype} {tuple(scale.shape)}, not float32 "
                f"{grid} for a {tuple(weight.shape)} weight"
            )
        if not (torch.isfinite(scale).all() and bool((scale > 0).all())):
            self._fail(f"{module}{_SCALE} holds a value that is not a positive number")
        if torch.isnan(weight.float()).any():
            self._fail(f"{module}.weight holds NaN")
        return scale

    def _check_kinds(self) -> None:
        for name, tensor in self.tensors.items():
            if name.endswith(_SCALE):
                if self.tensors.get(name.removesuffix(_SCALE) + ".weight") is None:
                    self._fail(f"{name} has no weight")
                continue
            fp8 = tensor.dtype == torch.float8_e4m3fn
            kept = _UNQUANTIZED.fullmatch(name) is not None
            if fp8 and kept:
                self._fail(f"{name} is fp8; DeepSeek-V3 keeps it in high precision")
            if not fp8 and not kept and tensor.dim() == 2:
                self._fail(f"{name} is {tensor.dtype}; the block format quantizes it")

    def dequantized(self) -> dict[str, torch.Tensor]:
        """Every weight, bias and norm in fp32 under its Hugging Face name: each fp8 block
        times its scale."""
        out = {}
        for name, tensor in self.tensors.items():
            if name.endswith(_SCALE):
                continue
            if tensor.dtype == torch.float8_e4m3fn:
                out[name] = self.dequantize(name.removesuffix(".weight"))
            else:
                out[name] = tensor.float()
        return out

    def dequantize(self, module: str) -> torch.Tensor:
        """The fp32 weight of the quantized `module`, block by block (edge blocks partial)."""
        weight = self.tensors[f"{module}.weight"].float()
        rows, cols = self.block
        scale = self.scale(module).repeat_interleave(rows, 0).repeat_interleave(cols, 1)
        return weight * scale[: weight.shape[0], : weight.shape[1]]

    def model(self) -> torch.nn.Module:
        """Our fp32 `Transformer` on the dequantized weights (activations unrounded: the
        engine quantizes them at run time, per token and 128 channels)."""
        from pipeline.export.modelopt_reader import our_names
        from pipeline.weights.hf_config import config_from_hf
        from pipeline.weights.model import model_from_source
        from pipeline.weights.source import InMemorySource

        config = config_from_hf(self.config)
        return model_from_source(InMemorySource(config, our_names(self.dequantized())))
