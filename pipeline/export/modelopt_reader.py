"""Read an FP8 ModelOpt Hugging Face checkpoint back, from the format's description alone
(docs/file_layouts.md, "FP8 Hugging Face export"), check it, and run it.

`ModelOptCheckpoint(directory)` parses both quantization configs and every safetensors header
and refuses, with a one-line `ValueError`, a checkpoint an engine would misread: the two configs
disagree; a float8 weight lacks a positive fp32 scalar `weight_scale` or `input_scale`, or holds
a NaN; q/k/v or gate/up (per expert) do not share both scales; a module left in high precision
is not in the ignore list, or a quantized one is; KV scales are missing or unasked for.
`dequantized()` gives every weight in fp32 under the Hugging Face names, and `logits` runs our
model on them with each quantized linear's input (and, with an FP8 KV cache, keys and values)
rounded through fp8 with the stored scales, as an FP8 engine computes.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors import safe_open

from pipeline.export.fp8 import fake_quantize

__all__ = ["ModelOptCheckpoint", "our_names"]

_SCALES = ("weight_scale", "input_scale", "k_scale", "v_scale")
# Linears an engine fuses into one GEMM: same layer (and expert), these projections.
_FUSED = re.compile(r"(.*\.)(q_proj|k_proj|v_proj|gate_proj|up_proj|w1|w3)$")
_FUSED_WITH = {"q_proj": "qkv", "k_proj": "qkv", "v_proj": "qkv"} | dict.fromkeys(
    ("gate_proj", "up_proj", "w1", "w3"), "gate_up"
)


class ModelOptCheckpoint:
    """An FP8 ModelOpt checkpoint directory, checked on opening (see the module docstring)."""

    def __init__(self, directory: str | Path) -> None:
        self.directory = Path(directory)
        self.config = json.loads((self.directory / "config.json").read_text())
        nested_path = self.directory / "hf_quant_config.json"
        self.nested = json.loads(nested_path.read_text())
        self.flat = self.config.get("quantization_config") or {}
        self.tensors: dict[str, torch.Tensor] = {}
        for file in sorted(self.directory.glob("*.safetensors")):
            with safe_open(str(file), framework="pt") as f:
                self.tensors |= {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118
        self.kv_cache = self._check_configs()
        self.quantized = sorted(
            n.removesuffix(".weight")
            for n, t in self.tensors.items()
            if t.dtype == torch.float8_e4m3fn
        )
        self._check_scales()
        self._check_ignore()

    def _fail(self, message: str) -> None:
        raise ValueError(f"{self.directory}: {message}")

    def _check_configs(self) -> bool:
        quant = self.nested.get("quantization") or {}
        if quant.get("quant_algo") != "FP8" or self.flat.get("quant_algo") != "FP8":
            self._fail("quant_algo is not FP8 in both hf_quant_config.json and config.json")
        if self.flat.get("quant_method") != "modelopt":
            self._fail("config.json quantization_config.quant_method is not 'modelopt'")
        if quant.get("exclude_modules") != self.flat.get("ignore"):
            self._fail("exclude_modules (hf_quant_config.json) differs from ignore (config.json)")
        kv = quant.get("kv_cache_quant_algo")
        scheme = self.flat.get("kv_cache_scheme")
        if kv not in (None, "FP8") or (kv == "FP8") != (scheme is not None):
            self._fail(f"kv_cache_quant_algo {kv!r} and kv_cache_scheme {scheme!r} disagree")
        if scheme is not None and (scheme.get("type"), scheme.get("num_bits")) != ("float", 8):
            self._fail(f"kv_cache_scheme {scheme} is not 8-bit float")
        return kv == "FP8"

    def scale(self, module: str, kind: str) -> torch.Tensor:
        """The fp32 scalar `{module}.{kind}`, checked positive and finite."""
        name = f"{module}.{kind}"
        value = self.tensors.get(name)
        if value is None:
            self._fail(f"{name} is missing")
        if value.dtype != torch.float32 or value.numel() != 1:
            self._fail(f"{name} is {value.dtype} {tuple(value.shape)}, not an fp32 scalar")
        if not (torch.isfinite(value).all() and float(value) > 0):
            self._fail(f"{name} = {float(value)} is not a positive number")
        return value

    def _check_scales(self) -> None:
        groups: dict[tuple[str, str], list[str]] = {}
        for module in self.quantized:
            for kind in ("weight_scale", "input_scale"):
                self.scale(module, kind)
            if torch.isnan(self.tensors[f"{module}.weight"].float()).any():
                self._fail(f"{module}.weight holds NaN")
            m = _FUSED.fullmatch(module)
            if m:
                groups.setdefault((m.group(1), _FUSED_WITH[m.group(2)]), []).append(module)
            for kind, proj in (("k_scale", "k_proj"), ("v_scale", "v_proj")):
                if module.endswith(f"self_attn.{proj}") and self.kv_cache:
                    self.scale(module, kind)
        for members in groups.values():
            for kind in ("weight_scale", "input_scale"):
                values = {float(self.scale(m, kind)) for m in members}
                if len(values) > 1:
                    self._fail(f"{', '.join(members)} do not share one {kind}")
        stray = [n for n in self.tensors if n.endswith(("k_scale", "v_scale"))]
        if stray and not self.kv_cache:
            self._fail(f"{stray[0]} present but kv_cache_quant_algo is not FP8")

    def _check_ignore(self) -> None:
        ignore = set(self.flat.get("ignore") or [])
        kept = {
            n.removesuffix(".weight")
            for n, t in self.tensors.items()
            if n.endswith(".weight") and t.dtype != torch.float8_e4m3fn
        }
        if kept - ignore:
            self._fail(f"{sorted(kept - ignore)[0]} is not quantized but not in the ignore list")
        if ignore & set(self.quantized):
            self._fail(f"{sorted(ignore & set(self.quantized))[0]} is quantized but ignored")

    def dequantized(self) -> dict[str, torch.Tensor]:
        """Every weight and bias in fp32 under its Hugging Face name (fp8 * weight_scale)."""
        out = {}
        for name, tensor in self.tensors.items():
            if name.endswith(_SCALES):
                continue
            value = tensor.float()
            if tensor.dtype == torch.float8_e4m3fn:
                value = value * self.scale(name.removesuffix(".weight"), "weight_scale")
            out[name] = value
        return out

    def model(self) -> torch.nn.Module:
        """Our fp32 `Transformer` on the dequantized weights, rounding the inputs of quantized
        linears (and the KV cache) through fp8 as the stored scales say."""
        from pipeline.weights.hf_config import config_from_hf
        from pipeline.weights.model import model_from_source
        from pipeline.weights.source import InMemorySource

        config = config_from_hf(self.config)
        model = model_from_source(InMemorySource(config, our_names(self.dequantized())))
        for i, layer in model.layers.items():
            self._quantize_inputs(int(i), layer)
        return model

    def _input(self, module: str) -> torch.Tensor | None:
        return self.tensors.get(f"{module}.input_scale")

    def _quantize_inputs(self, i: int, layer: torch.nn.Module) -> None:
        prefix = f"model.layers.{i}"
        attention = layer.attention
        pairs = [
            (attention.wq, "self_attn.q_proj"),
            (attention.wk, "self_attn.k_proj"),
            (attention.wv, "self_attn.v_proj"),
            (attention.wo, "self_attn.o_proj"),
        ]
        if not layer.is_moe:
            mlp = layer.feed_forward
            pairs += [(mlp.w1, "mlp.gate_proj"), (mlp.w3, "mlp.up_proj"), (mlp.w2, "mlp.down_proj")]
        for linear, name in pairs:
            scale = self._input(f"{prefix}.{name}")
            if scale is not None:
                linear.register_forward_pre_hook(_rounding(scale))
        if layer.is_moe:
            experts = [n for n in self.quantized if n.startswith(f"{prefix}.") and ".experts." in n]
            fc = [self._input(n) for n in experts if n.endswith(("gate_proj", "w1"))]
            proj = [self._input(n) for n in experts if n.endswith(("down_proj", "w2"))]
            layer.moe.experts.forward = _fp8_experts(layer.moe.experts, fc, proj)
        if self.kv_cache:
            k = self.scale(f"{prefix}.self_attn.k_proj", "k_scale")
            v = self.scale(f"{prefix}.self_attn.v_proj", "v_scale")
            attention.kernel.register_forward_pre_hook(_kv_rounding(k, v))


def _rounding(scale: torch.Tensor):
    def hook(module: torch.nn.Module, args: tuple) -> tuple:
        return (fake_quantize(args[0], scale), *args[1:])

    return hook


def _kv_rounding(k_scale: torch.Tensor, v_scale: torch.Tensor):
    def hook(module: torch.nn.Module, args: tuple) -> tuple:
        q, k, v, *rest = args
        return (q, fake_quantize(k, k_scale), fake_quantize(v, v_scale), *rest)

    return hook


def _fp8_experts(experts: torch.nn.Module, fc: list, proj: list):
    """The experts' forward with the fc and proj inputs rounded through fp8 (an engine's fused
    MoE GEMM takes one input scale per layer: the largest of the experts')."""
    import torch.nn.functional as F

    fc_scale = torch.stack(fc).amax() if fc else None
    proj_scale = torch.stack(proj).amax() if proj else None

    def maybe(x: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
        return x if scale is None else fake_quantize(x, scale)

    def forward(x: torch.Tensor, tokens_per_expert: torch.Tensor) -> torch.Tensor:
        out = []
        for e, group in enumerate(torch.split(x, tokens_per_expert.tolist())):
            g = maybe(group, fc_scale)
            hidden = F.silu(g @ experts.w1[e].t()) * (g @ experts.w3[e].t())
            out.append(maybe(hidden, proj_scale) @ experts.w2[e].t())
        return torch.cat(out) if out else x.new_empty(0, experts.w2.shape[1])

    return forward


def our_names(hf: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A Hugging Face on-disk state dict under our names, expert tensors stacked."""
    from pipeline.core.model.hf_names import hf_expert_piece, hf_to_pipe_name

    out: dict[str, torch.Tensor] = {}
    experts: dict[str, dict[int, torch.Tensor]] = {}
    for name, tensor in hf.items():
        piece = hf_expert_piece(name)
        if piece is not None:
            experts.setdefault(piece[0], {})[piece[1]] = tensor
        else:
            out[hf_to_pipe_name(name)] = tensor
    for name, pieces in experts.items():
        out[name] = torch.stack([pieces[e] for e in sorted(pieces)])
    return out
