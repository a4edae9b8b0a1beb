"""Build this rank's model for a run: options from the config, FP8 backend, stages, parallelism,
materialisation and initialisation; each a function returning what it built.

On a CPU with a multi-process layout DTensor has no RNG tracker (every rank would draw the same
shard), so `init_weights` replays the single-process initialisation one unit (embedding, block,
norm, output) at a time on a plain module and copies each rank's shard from it: every layout
starts from one device's weights, the RNG ends where one device leaves it, and at most one
block is ever held in full. On CUDA `init_weights` runs on the parallel model directly (DTensor's
RNG tracker; pipeline ranks offset the seed so stages do not repeat each other's draws).
"""

from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from pipeline.core.kernels.attention import choose_backend
from pipeline.core.kernels.attention_choice import AttentionShape, BackendChoice
from pipeline.core.kernels.fp8 import Fp8Training, build_fp8
from pipeline.core.model.block import ModelOptions
from pipeline.core.model.config import ModelConfig
from pipeline.core.model.transformer import Transformer
from pipeline.core.parallel.dims import ParallelDims
from pipeline.core.parallel.fsdp import copy_full_weights_
from pipeline.core.parallel.layout_rules import canonical_dp_mode
from pipeline.train.assembly.model_parts import StageUnion, TrainableModel
from pipeline.train.assembly.parallelize import build_model_parts, parallelize
from pipeline.train.config.schema import ConfigError
from pipeline.train.objectives import objective_spec

if TYPE_CHECKING:
    from pipeline.train.config.schema import TrainConfig

__all__ = [
    "BuiltModel",
    "attention_choice",
    "build_fp8_backend",
    "build_model",
    "init_weights",
    "model_options",
]

log = logging.getLogger("pipeline.train")

_TORCH_DTYPE_NAMES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
"""`training.dtype` as the attention-backend cache names its shapes' dtypes."""


@dataclass
class BuiltModel:
    """This rank's model: `model` (a `Transformer`, or a `StageUnion` of its stages) for the
    optimizer and checkpoints, `parts` for schedules (the stages `stage_indices` of
    `num_stages`), and `runner`, which runs micro-batches through it: the loop's to give
    (`pipeline.train.loop.step_runner.build_runner`), None until then."""

    model: TrainableModel
    parts: list[Transformer]
    stage_indices: list[int]
    num_stages: int
    runner: Any = None


def model_options(
    cfg: TrainConfig, layout: ParallelDims, device: torch.device, num_micro_batches: int
) -> ModelOptions:
    """What the run chooses about the model: attention kernel, recomputation, and the MoE
    aux-loss weight (one micro-batch's share of the global batch) and micro-batch group."""
    choice = attention_choice(cfg, layout, device)
    log.info("%s", choice.describe())
    return ModelOptions(
        attention_backend=choice.backend,
        activation_checkpointing=cfg.training.activation_checkpointing,
        moe_aux_loss_scale=1.0 / (num_micro_batches * layout.dp),
        moe_micro_batch_group=layout.micro_batch_group(cfg.parallel.sequence_parallel),
    )


def attention_choice(cfg: TrainConfig, layout: ParallelDims, device: torch.device) -> BackendChoice:
    """`training.attention_backend` resolved for this run's attention shape (this rank's heads);
    read from the measured choices, never measured here: every rank must agree."""
    config = cfg.model_config()
    document_masking = (
        cfg.data.reset_attention_mask or objective_spec(cfg.data.kind).document_masking
    )
    shape = None
    if config.mla is None:  # latent attention: flex leaves it to sdpa, no shape is measured
        shape = AttentionShape(
            seq_length=cfg.data.seq_length,
            heads=config.num_attention_heads // layout.tp,
            kv_heads=max(1, config.num_kv_heads // layout.tp),
            head_dim=config.head_dim,
            dtype=_TORCH_DTYPE_NAMES[cfg.training.dtype],
            document_masking=document_masking,
        )
    name = cfg.training.attention_backend
    choice = choose_backend(name, device=device, document_masking=document_masking, shape=shape)
    if shape is None and name == "auto" and choice.backend == "flex":
        choice = BackendChoice("sdpa", "default: latent attention, which flex leaves to sdpa")
    if choice.backend == "flex" and device.type != "cuda":
        raise ConfigError(
            "training.attention_backend = flex trains on CUDA only (torch's flex_attention has "
            "no backward on a CPU); use sdpa"
        )
    return choice


def build_fp8_backend(
    cfg: TrainConfig, layout: ParallelDims, device: torch.device
) -> Fp8Training | None:
    """The run's FP8 backend (None without `fp8.recipe`), told the layout it must fit."""
    f, p = cfg.fp8, cfg.parallel
    try:
        return build_fp8(
            f.recipe,
            device,
            emulate=f.emulate,
            linear_filter=f.linear_filter,
            fsdp=layout.fsdp_degree > 1 and canonical_dp_mode(p.dp_mode) in ("fsdp", "zero1"),
            fsdp_float8_all_gather=f.fsdp_float8_all_gather,
            tp=p.tp,
            amax_group=layout.batch_group,
        )
    except ValueError as e:
        raise ConfigError(str(e)) from e


def build_model(
    cfg: TrainConfig,
    config: ModelConfig,
    options: ModelOptions,
    layout: ParallelDims,
    device: torch.device,
    fp8: Fp8Training | None,
) -> BuiltModel:
    """Built on `meta`, split into this rank's pipeline stages, parallelised, materialised on
    `device` and initialised (fp32)."""

    def build() -> Transformer:
        with torch.device("meta"):
            return Transformer(config, options)

    try:
        parts, stage_indices, num_stages = build_model_parts(build, layout, cfg, config.num_layers)
        parts = [parallelize(part, layout, cfg, fp8=fp8) for part in parts]
    except (ValueError, NotImplementedError) as e:  # a layout or recipe we cannot build
        raise ConfigError(str(e)) from e
    if fp8 is not None:
        log.info("%s", fp8.describe())
    for part in parts:
        part.to_empty(device=device)
    init_weights(parts, config, layout, device, cfg.training.seed)
    if cfg.lora.enabled:
        from pipeline.core.model.lora import init_adapters

        for part in parts:
            init_adapters(part, cfg.training.seed)
    model = StageUnion(parts) if num_stages > 1 else parts[0]
    model.train()
    if device.type == "cpu" and cfg.training.dtype == "bf16" and layout.rank == 0:
        log.warning("training.dtype = bf16 on a CPU: real bf16 compute, slower than fp32 here")
    if device.type == "cpu" and cfg.training.dtype == "fp16" and layout.rank == 0:
        log.warning(
            "training.dtype = fp16 on a CPU: fp16 autocast with emulated fp16 GEMMs "
            "(fp16-rounded inputs and outputs, fp32 products); slower than fp32 here"
        )
    return BuiltModel(model, parts, stage_indices, num_stages)


def init_weights(
    parts: list[Transformer],
    config: ModelConfig,
    layout: ParallelDims,
    device: torch.device,
    seed: int,
) -> None:
    """Initialise materialised `parts` as the module docstring says."""
    if not (layout.distributed and device.type == "cpu"):
        if layout.pp_rank:  # stages must not repeat each other's draws
            torch.manual_seed(seed + layout.pp_rank)
        for part in parts:
            part.init_weights(buffer_device=device)
        return
    for part in parts:
        part.tie_weights()
        part.rope.init_weights(device)
    with torch.device("meta"):
        plain = Transformer(config)
    for prefix, unit, init in plain.init_units():
        unit.to_empty(device=device)
        init()
        tensors = itertools.chain(unit.named_parameters(), unit.named_buffers())
        full = {f"{prefix}.{name}": tensor for name, tensor in tensors}
        for part in parts:
            copy_full_weights_(part, full)
        unit.to_empty(device="meta")  # free it: at most one unit is held in full
