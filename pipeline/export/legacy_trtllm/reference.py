"""A reference forward over an exported TensorRT-LLM checkpoint, in plain torch.

TensorRT-LLM cannot be installed here, so this is how an export is proven: `ReferenceModel.load`
reads `config.json` and every `rank{r}.safetensors`, merges the tensor-parallel pieces and
pipeline stages back into whole tensors (`layout.py`'s merge functions; replicated tensors
must agree across ranks), and `logits` computes the model as TRT-LLM defines it: the SiLU branch
is `mlp.fc`, `mlp.gate` the linear one, the fused expert `fc` is cat(up, gate), the router
renormalises its top-k softmax weights. Compared with transformers on the source model, this
catches every layout mistake that changes the function.

FP8 exports are dequantised (fp8 * weights_scaling_factor, per rank) and, as an FP8 GEMM does,
each quantized linear's input is rounded through fp8 with its activation_scaling_factor; with
an FP8 KV cache, keys (after RoPE) and values are rounded through fp8 too. Everything else runs
in fp32 on the stored values. The whole model is held in memory: this is a check for exports
that fit, not an inference engine.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from pipeline.core.model.rope import apply_rope, rope_inv_freq
from pipeline.export.fp8 import dequantize, fake_quantize
from pipeline.export.legacy_trtllm.config import LegacyExportOptions, read_trtllm_config
from pipeline.export.legacy_trtllm.layout import merge_dim, merge_experts, merge_qkv

__all__ = ["ReferenceModel", "read_rank_files"]


@dataclass
class Linear:
    """y = fq(x) @ weight.T + bias, where fq rounds x through fp8 when `input_scale` is set.
    Linears that share an input (q, k, v; fc, gate) round it once: `quantize_input`, then
    `project` each."""

    weight: torch.Tensor
    bias: torch.Tensor | None = None
    input_scale: torch.Tensor | None = None

    def quantize_input(self, x: torch.Tensor) -> torch.Tensor:
        return x if self.input_scale is None else fake_quantize(x, self.input_scale)

    def project(self, x_quantized: torch.Tensor) -> torch.Tensor:
        y = x_quantized @ self.weight.t()
        return y if self.bias is None else y + self.bias

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.project(self.quantize_input(x))


@dataclass
class Experts:
    """Stacked experts (w1 the SiLU branch, w3 the linear one, w2 down) and their fp8 input
    scales (None when not quantized)."""

    w1: torch.Tensor
    w3: torch.Tensor
    w2: torch.Tensor
    fc_scale: torch.Tensor | None
    proj_scale: torch.Tensor | None


@dataclass
class Layer:
    input_norm: torch.Tensor
    q: Linear
    k: Linear
    v: Linear
    dense: Linear
    post_norm: torch.Tensor
    kv_scale: torch.Tensor | None
    fc: Linear | None = None  # dense MLP
    gate: Linear | None = None
    proj: Linear | None = None
    router: torch.Tensor | None = None  # MoE
    experts: Experts | None = None


def read_rank_files(directory: str | os.PathLike, world_size: int) -> list[dict]:
    """Every rank file's tensors (fresh CPU copies), by rank; a missing file is named."""
    from safetensors import safe_open

    out = []
    for rank in range(world_size):
        path = Path(directory) / f"rank{rank}.safetensors"
        if not path.is_file():
            raise FileNotFoundError(f"{path} is missing (mapping.world_size is {world_size})")
        with safe_open(str(path), framework="pt") as f:
            out.append({name: f.get_tensor(name).clone() for name in f.keys()})  # noqa: SIM118
    return out


class _Ranks:
    """Reads one stage's tensors across its ranks, dequantising per rank."""

    def __init__(self, files: list[dict], ranks: range, options: LegacyExportOptions) -> None:
        self.files = [files[r] for r in ranks]
        self.ranks = ranks
        self.options = options

    def _get(self, file: dict, name: str) -> torch.Tensor:
        if name not in file:
            rank = self.ranks[next(k for k, f in enumerate(self.files) if f is file)]
            raise KeyError(f"rank{rank}.safetensors has no {name}")
        return file[name]

    def same(self, name: str) -> torch.Tensor:
        """A tensor every rank holds whole; it must be identical on all of them."""
        first = self._get(self.files[0], name)
        for k, file in enumerate(self.files[1:], start=1):
            if not torch.equal(self._get(file, name), first):
                raise ValueError(f"{name} differs between tp ranks 0 and {k}")
        return first.float()

    def weights(self, prefix: str) -> list[torch.Tensor]:
        """`{prefix}.weight` of every rank, dequantised with that rank's scale when fp8."""
        out = []
        for file in self.files:
            weight = self._get(file, f"{prefix}.weight")
            if weight.dtype == torch.float8_e4m3fn:
                scale = self._get(file, f"{prefix}.weights_scaling_factor")
                weight = dequantize(weight, scale.reshape(-1, *[1] * (weight.dim() - 1)))
            out.append(weight.float())
        return out

    def input_scale(self, prefix: str) -> torch.Tensor | None:
        name = f"{prefix}.activation_scaling_factor"
        return self.same(name) if name in self.files[0] else None

    def optional(self, name: str, merge) -> torch.Tensor | None:
        if name not in self.files[0]:
            return None
        return merge([self._get(f, name).float() for f in self.files])


class ReferenceModel:
    """The model an exported directory describes (see the module docstring)."""

    def __init__(self, directory: str | os.PathLike) -> None:
        directory = Path(directory)
        raw = json.loads((directory / "config.json").read_text(encoding="utf-8"))
        self.config, self.options = read_trtllm_config(raw)
        mapping = self.options.mapping
        files = read_rank_files(directory, mapping.world_size)
        c = self.config
        self.layers: list[Layer] = []
        for pp_rank in range(mapping.pp):
            stage = _Ranks(files, mapping.stage_ranks(pp_rank), self.options)
            for j in range(len(mapping.stage_layers(c.num_layers, pp_rank))):
                self.layers.append(self._layer(stage, f"transformer.layers.{j}"))
        first = _Ranks(files, mapping.stage_ranks(0), self.options)
        last = _Ranks(files, mapping.stage_ranks(mapping.pp - 1), self.options)
        self.embedding = self._embedding(first)
        self.final_norm = last.same("transformer.ln_f.weight")
        lm_head = merge_dim(last.weights("lm_head"), 0)
        if lm_head[c.vocab_size :].any():
            raise ValueError("lm_head: the padding rows past vocab_size are not zero")
        self.lm_head = Linear(lm_head[: c.vocab_size], None, last.input_scale("lm_head"))
        self.inv_freq = rope_inv_freq(c.head_dim, c.rope_theta, c.rope_scaling)

    def _embedding(self, first: _Ranks) -> torch.Tensor:
        name = "transformer.vocab_embedding.weight"
        if not self.options.use_parallel_embedding:
            return first.same(name)
        dim = self.options.embedding_sharding_dim
        table = merge_dim([f[name].float() for f in first.files], dim)
        return table[: self.config.vocab_size]

    def _layer(self, stage: _Ranks, prefix: str) -> Layer:
        c = self.config
        attn = f"{prefix}.attention"
        shape = dict(num_heads=c.num_attention_heads, num_kv_heads=c.num_kv_heads)
        q, k, v = merge_qkv(stage.weights(f"{attn}.qkv"), head_dim=c.head_dim, **shape)
        biases = stage.optional(
            f"{attn}.qkv.bias", lambda parts: merge_qkv(parts, head_dim=c.head_dim, **shape)
        )
        qb, kb, vb = biases if biases is not None else (None, None, None)
        qkv_scale = stage.input_scale(f"{attn}.qkv")
        kv_name = f"{attn}.kv_cache_scaling_factor"
        layer = Layer(
            input_norm=stage.same(f"{prefix}.input_layernorm.weight"),
            q=Linear(q, qb, qkv_scale),
            k=Linear(k, kb, qkv_scale),
            v=Linear(v, vb, qkv_scale),
            dense=self._split_linear(stage, f"{attn}.dense", 1),
            post_norm=stage.same(f"{prefix}.post_layernorm.weight"),
            kv_scale=stage.same(kv_name) if kv_name in stage.files[0] else None,
        )
        mlp = f"{prefix}.mlp"
        if c.is_moe:
            layer.router = stage.same(f"{mlp}.router.weight")
            w1, w3, w2 = merge_experts(
                stage.weights(f"{mlp}.fc"), stage.weights(f"{mlp}.proj"), self.options.mapping
            )
            fc_scale, proj_scale = stage.input_scale(f"{mlp}.fc"), stage.input_scale(f"{mlp}.proj")
            layer.experts = Experts(w1, w3, w2, fc_scale, proj_scale)
        else:
            layer.fc = self._split_linear(stage, f"{mlp}.fc", 0)
            layer.gate = self._split_linear(stage, f"{mlp}.gate", 0)
            layer.proj = self._split_linear(stage, f"{mlp}.proj", 1)
        return layer

    @staticmethod
    def _split_linear(stage: _Ranks, prefix: str, dim: int) -> Linear:
        return Linear(merge_dim(stage.weights(prefix), dim), None, stage.input_scale(prefix))

    # --- forward ------------------------------------------------------------------------------

    def _norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.config.norm_eps) * weight

    def _attention(self, layer: Layer, x: torch.Tensor, rope: tuple) -> torch.Tensor:
        batch, seq, _ = x.shape
        d = self.config.head_dim

        def heads(t: torch.Tensor) -> torch.Tensor:
            return t.view(batch, seq, -1, d).transpose(1, 2)

        x = layer.q.quantize_input(x)  # one input scale covers the fused qkv
        q, k, v = (heads(linear.project(x)) for linear in (layer.q, layer.k, layer.v))
        q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        if layer.kv_scale is not None:
            k, v = fake_quantize(k, layer.kv_scale), fake_quantize(v, layer.kv_scale)
        repeat = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return layer.dense(out.transpose(1, 2).reshape(batch, seq, -1))

    def _moe(self, layer: Layer, x: torch.Tensor) -> torch.Tensor:
        e = layer.experts
        flat = x.reshape(-1, x.shape[-1])
        probs = torch.softmax(flat @ layer.router.t(), dim=-1)
        weights, chosen = probs.topk(self.config.moe.top_k, dim=-1)
        weights = weights / weights.sum(-1, keepdim=True)
        inputs = Linear(e.w1, None, e.fc_scale).quantize_input(flat)  # one scale, every expert
        out = torch.zeros_like(flat)
        for expert in range(e.w1.shape[0]):
            token, slot = (chosen == expert).nonzero(as_tuple=True)
            if not len(token):
                continue
            h = inputs[token] @ e.w1[expert].t()
            u = inputs[token] @ e.w3[expert].t()
            y = Linear(e.w2[expert], None, e.proj_scale)(F.silu(h) * u)
            out.index_add_(0, token, y * weights[token, slot, None])
        return out.view_as(x)

    def _mlp(self, layer: Layer, x: torch.Tensor) -> torch.Tensor:
        """TRT-LLM's gated MLP: proj(silu(fc(x)) * gate(x)), fc and gate sharing one input."""
        x = layer.fc.quantize_input(x)
        return layer.proj(F.silu(layer.fc.project(x)) * layer.gate.project(x))

    @torch.no_grad()
    def logits(self, tokens: torch.Tensor) -> torch.Tensor:
        """fp32 logits `[batch, seq, vocab]` for token ids `[batch, seq]` (positions 0..seq-1)."""
        h = self.embedding[tokens]
        angles = torch.arange(tokens.shape[1]).float()[:, None] * self.inv_freq
        angles = torch.cat((angles, angles), dim=-1)
        rope = (angles.cos(), angles.sin())
        for layer in self.layers:
            h = h + self._attention(layer, self._norm(h, layer.input_norm), rope)
            x = self._norm(h, layer.post_norm)
            h = h + (self._moe(layer, x) if layer.experts is not None else self._mlp(layer, x))
        return self.lm_head(self._norm(h, self.final_norm))
