"""Write a `TensorSource` as a TensorRT-LLM checkpoint: `config.json` + `rank{r}.safetensors`.

The export is a list of `ExportItem`s, each reading a few of our tensors (a layer's q/k/v, or its
gate and up projections) and producing every rank's TRT-LLM tensors from them
(`layout.py` says how). Each item's output shapes are learnt by running it once on `meta`
tensors, so all rank files' headers are written before any weight is read. The weights then
stream: each item reads its sources once and writes its pieces at their planned offsets in every
rank file, so peak memory is a few source tensors, whatever the model size. Within a file the
tensors are laid out by element size (fp32, then bf16/fp16, then fp8), as `safetensors`' own
writer does, so every tensor's data is aligned to its element size.

FP8 (`options.fp8`): every quantized linear gets `weight` in float8_e4m3fn plus fp32 `[1]`
`weights_scaling_factor` and `activation_scaling_factor` (MoE experts: one weight scale per
expert, `[E_local, 1]`); the activation scales come from `calibration.calibrate`.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from pipeline.common.atomic import staged_directory, write_json
from pipeline.common.safetensors_io import (
    require_little_endian,
    tensor_bytes,
    write_safetensors_header,
)
from pipeline.core.model.config import ModelConfig
from pipeline.export.fp8 import fp8_scale, quantize, scales_from_amax
from pipeline.export.legacy_trtllm.config import LegacyExportOptions, trtllm_config
from pipeline.export.legacy_trtllm.layout import (
    experts_for_rank,
    pad_rows,
    qkv_for_rank,
    split_dim,
)
from pipeline.weights.source import TensorInfo, TensorSource

__all__ = ["ROUTER_SUFFIX", "ExportItem", "export_items", "plan_rank_files", "write_trtllm"]

ROUTER_SUFFIX = "moe.router.weight"  # exported in fp32 whatever the export dtype

RankTensors = dict[int, dict[str, torch.Tensor]]  # world rank -> TRT-LLM name -> tensor


@dataclass(frozen=True)
class ExportItem:
    """`build` turns the full source tensors `sources` (our names) into every rank's tensors."""

    sources: tuple[str, ...]
    build: Callable[[dict[str, torch.Tensor]], RankTensors]


class _Builder:
    """Makes the `ExportItem`s of one export (see `export_items`)."""

    def __init__(
        self, config: ModelConfig, options: LegacyExportOptions, amax: dict[str, float] | None
    ) -> None:
        if options.fp8 and amax is None:
            raise ValueError("an FP8 export needs calibrated activation ranges (amax)")
        self.config = config
        self.options = options
        self.mapping = options.mapping
        self.dtype = getattr(torch, options.dtype)
        self.amax = amax or {}

    # --- one linear, quantized or not ---------------------------------------------------------

    def _activation_scale(self, key: str) -> torch.Tensor:
        if key not in self.amax:
            raise ValueError(f"no calibrated activation range for {key!r}")
        return scales_from_amax(torch.tensor([self.amax[key]]))

    def quantized(self, prefix: str) -> bool:
        """Whether the linear `prefix` is exported in fp8 (FP8 on, module not excluded)."""
        return self.options.fp8 and not self.options.excluded(prefix)

    def linear(
        self, prefix: str, weight: torch.Tensor, weight_scale: torch.Tensor | None, amax_key: str
    ) -> dict[str, torch.Tensor]:
        """`{prefix}.weight` in the export dtype, or (FP8, module not excluded) quantized with
        `weight_scale` and both scaling factors."""
        if not self.quantized(prefix):
            return {f"{prefix}.weight": weight.to(self.dtype)}
        scale = weight_scale.reshape(-1, *[1] * (weight.dim() - 1))
        return {
            f"{prefix}.weight": quantize(weight, scale),
            f"{prefix}.weights_scaling_factor": weight_scale.float(),
            f"{prefix}.activation_scaling_factor": self._activation_scale(amax_key),
        }

    # --- items ---------------------------------------------------------------------------------

    def replicated(self, source: str, name: str, ranks: range, dtype=None) -> ExportItem:
        def build(t: dict[str, torch.Tensor]) -> RankTensors:
            value = t[source].to(dtype or self.dtype)
            return {r: {name: value} for r in ranks}

        return ExportItem((source,), build)

    def column_or_row(
        self, source: str, prefix: str, ranks: range, dim: int, amax_key: str
    ) -> ExportItem:
        """A linear split on `dim` (0: column-parallel, 1: row-parallel) over a stage."""

        def build(t: dict[str, torch.Tensor]) -> RankTensors:
            w = t[source]
            scale = fp8_scale(w) if self.quantized(prefix) else None
            return {
                r: self.linear(prefix, split_dim(w, len(ranks), k, dim, source), scale, amax_key)
                for k, r in enumerate(ranks)
            }

        return ExportItem((source,), build)

    def qkv(self, layer: int, prefix: str, ranks: range) -> ExportItem:
        c = self.config
        names = [f"layers.{layer}.attention.{w}.weight" for w in ("wq", "wk", "wv")]
        biases = [n.replace(".weight", ".bias") for n in names] if c.qkv_bias else []

        def per_rank(tensors: list[torch.Tensor], k: int) -> torch.Tensor:
            return qkv_for_rank(
                *tensors,
                num_heads=c.num_attention_heads,
                num_kv_heads=c.num_kv_heads,
                tp=len(ranks),
                tp_rank=k,
            )

        def build(t: dict[str, torch.Tensor]) -> RankTensors:
            weights = [t[n] for n in names]
            scale = fp8_scale(*weights) if self.quantized(f"{prefix}.qkv") else None
            out = {}
            for k, r in enumerate(ranks):
                out[r] = self.linear(f"{prefix}.qkv", per_rank(weights, k), scale, f"{layer}.qkv")
                if biases:
                    bias = per_rank([t[n] for n in biases], k).to(self.dtype)
                    out[r][f"{prefix}.qkv.bias"] = bias
                if self.options.fp8_kv_cache:
                    kv_scale = self._activation_scale(f"{layer}.kv")
                    out[r][f"{prefix}.kv_cache_scaling_factor"] = kv_scale
            return out

        return ExportItem(tuple(names + biases), build)

    def gated_mlp(self, layer: int, prefix: str, ranks: range) -> ExportItem:
        """fc = gate_proj (w1, the SiLU branch) and gate = up_proj (w3), with one weight scale
        between them (TRT-LLM fuses the two at build time)."""
        w1, w3 = (f"layers.{layer}.feed_forward.{w}.weight" for w in ("w1", "w3"))

        def build(t: dict[str, torch.Tensor]) -> RankTensors:
            either = self.quantized(f"{prefix}.fc") or self.quantized(f"{prefix}.gate")
            scale = fp8_scale(t[w1], t[w3]) if either else None
            out = {}
            for k, r in enumerate(ranks):
                fc = split_dim(t[w1], len(ranks), k, 0, w1)
                gate = split_dim(t[w3], len(ranks), k, 0, w3)
                out[r] = self.linear(f"{prefix}.fc", fc, scale, f"{layer}.fc")
                out[r] |= self.linear(f"{prefix}.gate", gate, scale, f"{layer}.fc")
            return out

        return ExportItem((w1, w3), build)

    def experts(self, layer: int, prefix: str, ranks: range) -> ExportItem:
        """Fused expert weights; FP8 weight scales are per expert."""
        names = tuple(f"layers.{layer}.moe.experts.{w}" for w in ("w1", "w3", "w2"))

        def build(t: dict[str, torch.Tensor]) -> RankTensors:
            w1, w3, w2 = (t[n] for n in names)
            fc_scale = proj_scale = None
            if self.quantized(f"{prefix}.fc"):
                fc_amax = torch.maximum(expert_amax(w1), expert_amax(w3))
                fc_scale = scales_from_amax(fc_amax).reshape(-1, 1)
            if self.quantized(f"{prefix}.proj"):
                proj_scale = scales_from_amax(expert_amax(w2)).reshape(-1, 1)
            local = w1.shape[0] // self.mapping.moe_ep
            out = {}
            for k, r in enumerate(ranks):
                fc, proj = experts_for_rank(w1, w3, w2, self.mapping, k)
                ep_rank = self.mapping.moe_ranks(k)[1]
                mine = slice(ep_rank * local, (ep_rank + 1) * local)
                fc_s = fc_scale[mine] if fc_scale is not None else None
                proj_s = proj_scale[mine] if proj_scale is not None else None
                out[r] = self.linear(f"{prefix}.fc", fc, fc_s, f"{layer}.fc")
                out[r] |= self.linear(f"{prefix}.proj", proj, proj_s, f"{layer}.proj")
            return out

        return ExportItem(names, build)

    def vocab_embedding(self, source: str, tied_lm_head: bool) -> ExportItem:
        """The embedding on the first stage (split when `use_parallel_embedding`), and for tied
        models the `lm_head` made from it on the last stage."""
        first = self.mapping.stage_ranks(0)
        dim = self.options.embedding_sharding_dim
        lm_head = self.lm_head(source) if tied_lm_head else None

        def build(t: dict[str, torch.Tensor]) -> RankTensors:
            table = t[source].to(self.dtype)
            out: RankTensors = lm_head.build(t) if lm_head else {}
            for k, r in enumerate(first):
                piece = table
                if self.options.use_parallel_embedding:
                    padded = pad_rows(table, len(first)) if dim == 0 else table
                    piece = split_dim(padded, len(first), k, dim, "vocab_embedding")
                out.setdefault(r, {})["transformer.vocab_embedding.weight"] = piece
            return out

        return ExportItem((source,), build)

    def lm_head(self, source: str) -> ExportItem:
        """Rows zero-padded to a multiple of tp, split over the last stage."""
        last = self.mapping.stage_ranks(self.mapping.pp - 1)

        def build(t: dict[str, torch.Tensor]) -> RankTensors:
            w = pad_rows(t[source], len(last))
            scale = fp8_scale(w) if self.quantized("lm_head") else None
            return {
                r: self.linear("lm_head", split_dim(w, len(last), k, 0, source), scale, "lm_head")
                for k, r in enumerate(last)
            }

        return ExportItem((source,), build)

    def layer_items(self, layer: int) -> Iterator[ExportItem]:
        pp_rank, j = self.mapping.stage_of_layer(self.config.num_layers, layer)
        ranks = self.mapping.stage_ranks(pp_rank)
        prefix = f"transformer.layers.{j}"
        ours = f"layers.{layer}"
        yield self.replicated(
            f"{ours}.attention_norm.weight", f"{prefix}.input_layernorm.weight", ranks
        )
        yield self.qkv(layer, f"{prefix}.attention", ranks)
        yield self.column_or_row(
            f"{ours}.attention.wo.weight", f"{prefix}.attention.dense", ranks, 1, f"{layer}.dense"
        )
        yield self.replicated(f"{ours}.ffn_norm.weight", f"{prefix}.post_layernorm.weight", ranks)
        if self.config.is_moe:
            router = f"{ours}.{ROUTER_SUFFIX}"
            yield self.replicated(router, f"{prefix}.mlp.router.weight", ranks, torch.float32)
            yield self.experts(layer, f"{prefix}.mlp", ranks)
        else:
            yield self.gated_mlp(layer, f"{prefix}.mlp", ranks)
            yield self.column_or_row(
                f"{ours}.feed_forward.w2.weight", f"{prefix}.mlp.proj", ranks, 1, f"{layer}.proj"
            )


def expert_amax(weights: torch.Tensor) -> torch.Tensor:
    """`[E]` absolute maxima of stacked expert weights `[E, ...]`."""
    return weights.detach().abs().flatten(1).amax(1)


def export_items(
    config: ModelConfig, options: LegacyExportOptions, amax: dict[str, float] | None = None
) -> list[ExportItem]:
    """Every item of an export, embedding first, layers in order, then the final norm and head.

    `amax` (FP8 only) is `calibration.calibrate`'s activation ranges."""
    builder = _Builder(config, options, amax)
    last = options.mapping.stage_ranks(options.mapping.pp - 1)
    tied = config.tie_word_embeddings
    items = [builder.vocab_embedding("tok_embeddings.weight", tied_lm_head=tied)]
    for layer in range(config.num_layers):
        items.extend(builder.layer_items(layer))
    items.append(builder.replicated("norm.weight", "transformer.ln_f.weight", last))
    if not tied:
        items.append(builder.lm_head("output.weight"))
    return items


@dataclass(frozen=True)
class _Entry:
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    item: int


def _meta(info: TensorInfo) -> torch.Tensor:
    return torch.empty(info.shape, dtype=info.dtype, device="meta")


def plan_rank_files(source: TensorSource, items: list[ExportItem], world_size: int) -> list:
    """Per rank, the `_Entry`s of its file in on-disk order (element size descending, then
    item order): shapes and dtypes come from building each item on `meta` tensors."""
    infos = source.tensors()
    entries: list[list[_Entry]] = [[] for _ in range(world_size)]
    for index, item in enumerate(items):
        missing = [n for n in item.sources if n not in infos]
        if missing:
            raise ValueError(f"the source has no {', '.join(missing)}")
        built = item.build({n: _meta(infos[n]) for n in item.sources})
        for rank, tensors in built.items():
            entries[rank] += [
                _Entry(name, tuple(t.shape), t.dtype, index) for name, t in tensors.items()
            ]
    for rank, rank_entries in enumerate(entries):
        names = [e.name for e in rank_entries]
        if len(set(names)) != len(names):
            raise ValueError(f"rank {rank}: a tensor name is produced twice")
        rank_entries.sort(key=lambda e: -e.dtype.itemsize)  # stable: item order within a size
    return entries


class _RankFile:
    """One `rank{r}.safetensors`: header written up front, tensors written at their offsets."""

    def __init__(self, path: Path, entries: list[_Entry]) -> None:
        self.handle = open(path, "wb")  # noqa: SIM115 - closed by close()
        write_safetensors_header(self.handle, [(e.name, e.dtype, e.shape) for e in entries])
        self.data_start = self.handle.tell()
        self.offsets: dict[str, tuple[int, _Entry]] = {}
        offset = 0
        for e in entries:
            self.offsets[e.name] = (offset, e)
            offset += TensorInfo(e.shape, e.dtype).nbytes
        self.unwritten = set(self.offsets)

    def write(self, name: str, tensor: torch.Tensor) -> int:
        offset, entry = self.offsets[name]
        if (tuple(tensor.shape), tensor.dtype) != (entry.shape, entry.dtype):
            raise ValueError(
                f"{name}: built {tuple(tensor.shape)} {tensor.dtype}, "
                f"planned {entry.shape} {entry.dtype}"
            )
        self.handle.seek(self.data_start + offset)
        self.handle.write(tensor_bytes(tensor))
        self.unwritten.discard(name)
        return tensor.numel() * tensor.dtype.itemsize

    def close(self) -> None:
        self.handle.close()


def write_trtllm(
    source: TensorSource,
    output_dir: str | os.PathLike,
    options: LegacyExportOptions,
    *,
    amax: dict[str, float] | None = None,
    progress: Callable[[int], None] | None = None,
    overwrite: bool = False,
) -> Path:
    """Export `source` to `output_dir` as a TRT-LLM checkpoint (see the module docstring).

    `progress` is called with the bytes written after each item. The directory appears only
    when complete; an existing non-empty one is refused unless `overwrite`.
    """
    config = source.model_config
    items = export_items(config, options, amax)
    plans = plan_rank_files(source, items, options.mapping.world_size)
    require_little_endian()
    with staged_directory(output_dir, overwrite=overwrite) as tmp:
        files = [_RankFile(tmp / f"rank{r}.safetensors", plan) for r, plan in enumerate(plans)]
        try:
            for item in items:
                tensors = {name: source.read(name) for name in item.sources}
                written = 0
                for rank, built in item.build(tensors).items():
                    for name, tensor in built.items():
                        written += files[rank].write(name, tensor)
                if progress is not None:
                    progress(written)
        finally:
            for f in files:
                f.close()
        for rank, f in enumerate(files):
            if f.unwritten:
                raise RuntimeError(f"rank {rank}: {sorted(f.unwritten)[:3]} never written")
        write_json(tmp / "config.json", trtllm_config(config, options))
    return Path(output_dir)
