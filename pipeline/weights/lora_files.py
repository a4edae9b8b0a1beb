"""LoRA adapter checkpoints as weights: merged into their base, or written as peft files.

A `pipe train --lora` checkpoint holds adapters only (`layers.N.attention.wq.lora_A` `[r, in]`,
`...lora_B` `[out, r]`, and per-expert `layers.N.moe.experts.lora.w1_A` `[E, r, in]`, `w1_B`
`[E, out, r]`) and records under `lora` in its metadata the adapter settings and its base
checkpoint. `MergedLoRASource` presents base plus adapters as one model whose adapted weights
are `W + B A * alpha / r` (what `pipe convert --to hf` and `pipe export` write by default), and
`write_peft` writes the Hugging Face PEFT files (`adapter_config.json`,
`adapter_model.safetensors`, keys `base_model.model.<transformers module>.lora_A.weight`; an
expert stack's adapters one expert at a time, under the on-disk expert modules) that `peft`
and vLLM load onto the base model.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pipeline.weights.source import TensorInfo, TensorSource

if TYPE_CHECKING:
    import torch

    from pipeline.core.model.config import ModelConfig

__all__ = [
    "MergedLoRASource",
    "adapter_base",
    "lora_record",
    "peft_tensors",
    "read_adapters",
    "write_peft",
]

_LINEAR = re.compile(r"(?P<base>.+)\.lora_(?P<ab>[AB])")
_EXPERT = re.compile(r"(?P<base>.+\.moe\.experts)\.lora\.(?P<w>w[123])_(?P<ab>[AB])")


def lora_record(directory: str | Path, iteration: int | None = None) -> dict[str, Any] | None:
    """The `lora` record of a pipe checkpoint (None for a full checkpoint)."""
    from pipeline.checkpoint.loader import resolve_checkpoint

    _, record = resolve_checkpoint(Path(directory), iteration)
    return (record.get("metadata") or {}).get("lora")


def adapter_base(name: str) -> tuple[str, str]:
    """(the base weight an adapter parameter adapts, "A" or "B")."""
    m = _EXPERT.fullmatch(name)
    if m:
        return f"{m['base']}.{m['w']}", m["ab"]
    m = _LINEAR.fullmatch(name)
    if m:
        return f"{m['base']}.weight", m["ab"]
    raise KeyError(f"{name!r} is not a LoRA adapter parameter")


class MergedLoRASource:
    """`base` with the adapters of `adapters` (an adapter checkpoint's source) folded in."""

    def __init__(self, base: TensorSource, adapters: TensorSource, record: dict[str, Any]) -> None:
        self.base, self.adapters = base, adapters
        self.model_config = base.model_config
        self.metadata = {**base.metadata, "lora_adapters": adapters.metadata.get("source")}
        self.scaling = float(record["alpha"]) / int(record["rank"])
        self._pairs: dict[str, dict[str, str]] = {}
        for name in adapters.tensors():
            weight, ab = adapter_base(name)
            self._pairs.setdefault(weight, {})[ab] = name

    def tensors(self) -> dict[str, TensorInfo]:
        return self.base.tensors()

    def read(self, name: str) -> torch.Tensor:
        from pipeline.core.model.lora import merged_weight

        tensor = self.base.read(name)
        pair = self._pairs.get(name)
        if pair is None:
            return tensor
        a, b = self.adapters.read(pair["A"]), self.adapters.read(pair["B"])
        return merged_weight(tensor, a, b, self.scaling)


def peft_tensors(
    adapters: dict[str, torch.Tensor],
    num_experts: int | None,
    architecture: str,
    config: ModelConfig | None = None,
) -> dict[str, torch.Tensor]:
    """Adapter tensors under peft's names for the transformers model of `architecture`
    (`base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight`); expert adapters one
    per expert (`...mlp.experts.3.gate_proj.lora_A.weight`), as the per-expert modules of the
    on-disk checkpoint spell them. With the model's `config`, linear attention's output
    projections are named as such and the B rows of its q/k/v projection put back in
    Hugging Face's order (`hf_names.reorder_to_hf`)."""
    from pipeline.core.model.hf_names import (
        is_reordered,
        linear_attention_layers,
        pipe_to_hf_names,
        reorder_to_hf,
    )

    linear = linear_attention_layers(config) if config is not None else frozenset()
    out = {}
    for name, tensor in adapters.items():
        weight, ab = adapter_base(name)
        if ab == "B" and config is not None and is_reordered(weight, config):
            tensor = reorder_to_hf(weight, tensor, config).contiguous()
        hf_names = pipe_to_hf_names(weight, num_experts, architecture, linear)
        # An expert stack's adapters are written one expert at a time, as the on-disk
        # per-expert modules (`mlp.experts.{e}.gate_proj`) they adapt.
        pieces = [tensor] if len(hf_names) == 1 else list(tensor.unbind(0))
        for hf, piece in zip(hf_names, pieces, strict=True):
            out[f"base_model.model.{hf.removesuffix('.weight')}.lora_{ab}.weight"] = piece
    return out


def _target_modules(names: list[str]) -> list[str]:
    """peft's `target_modules`: the transformers module names adapted (`q_proj`, ...)."""
    return sorted({n.split(".lora_")[0].rsplit(".", 1)[-1] for n in names})


def write_peft(
    adapters: TensorSource,
    record: dict[str, Any],
    output: Path,
    architecture: str,
    base_name: str | None = None,
) -> list[str]:
    """Write `adapter_config.json` and `adapter_model.safetensors` into `output` (each
    atomically); returns the peft tensor names written."""
    from safetensors.torch import save_file

    from pipeline.common.atomic import atomic_path, write_json

    names = list(adapters.tensors())
    tensors = peft_tensors(
        {n: adapters.read(n).contiguous() for n in names},
        getattr(adapters.model_config.moe, "num_experts", None),
        architecture,
        adapters.model_config,
    )
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_name,
        "r": int(record["rank"]),
        "lora_alpha": record["alpha"],
        "lora_dropout": record["dropout"],
        "target_modules": _target_modules(list(tensors)),
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "modules_to_save": None,
        "inference_mode": True,
        "init_lora_weights": True,
    }
    output.mkdir(parents=True, exist_ok=True)
    with atomic_path(output / "adapter_model.safetensors") as temporary:
        save_file(tensors, str(temporary), metadata={"format": "pt"})
    write_json(output / "adapter_config.json", config, indent=2)
    return sorted(tensors)


_PEFT_KEY = re.compile(r"base_model\.model\.(?P<module>.+)\.lora_(?P<ab>[AB])(\.\w+)?\.weight")


def read_adapters(
    path: str | Path, config: ModelConfig | None = None
) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """(settings: `rank`, `alpha`; adapter tensors under our names) of a LoRA adapter: a pipe
    adapter checkpoint, or a peft directory (`adapter_config.json` + safetensors) as
    `write_peft` writes it (`config`, the model's, reorders linear attention's q/k/v rows).
    ValueError naming the file for anything else."""
    path = Path(path)
    if (path / "adapter_config.json").is_file():
        return _read_peft(path, config)
    from pipeline.weights.pipe_checkpoint import PipeCheckpointSource

    source = PipeCheckpointSource(path)
    record = lora_record(source.directory)
    if record is None:
        raise ValueError(f"{source.directory} is a full checkpoint, not LoRA adapters")
    return record, {name: source.read(name) for name in source.tensors()}


def _read_peft(
    path: Path, model: ModelConfig | None = None
) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    import json

    import torch
    from safetensors.torch import load_file

    from pipeline.core.model.hf_names import hf_expert_piece, hf_to_pipe_name, reorder_from_hf

    config = json.loads((path / "adapter_config.json").read_text())
    if config.get("peft_type") != "LORA" or config.get("use_dora") or config.get("use_rslora"):
        raise ValueError(f"{path / 'adapter_config.json'}: only plain LoRA adapters are read")
    weights = path / "adapter_model.safetensors"
    if not weights.is_file():
        raise ValueError(f"{path}: no adapter_model.safetensors")
    tensors, experts = {}, {}
    for key, tensor in load_file(str(weights)).items():
        m = _PEFT_KEY.fullmatch(key)
        if m is None:
            raise ValueError(f"{weights}: {key!r} is not a LoRA A/B weight")
        piece = hf_expert_piece(f"{m['module']}.weight")
        if piece is not None:  # one expert's adapter: stacked below
            experts.setdefault((piece[0], m["ab"]), {})[piece[1]] = tensor
            continue
        weight_name = hf_to_pipe_name(f"{m['module']}.weight")
        if m["ab"] == "B":
            tensor = reorder_from_hf(weight_name, tensor, model)
        tensors[f"{weight_name.removesuffix('.weight')}.lora_{m['ab']}"] = tensor
    for (stack, ab), by_expert in experts.items():
        prefix, w = stack.rsplit(".", 1)
        tensors[f"{prefix}.lora.{w}_{ab}"] = torch.stack([by_expert[e] for e in sorted(by_expert)])
    return {"rank": int(config["r"]), "alpha": float(config["lora_alpha"])}, tensors
