"""The one place that changes a built model: `parallelize` (docs/architecture.md).

A model is built on `meta` from its config and `ModelOptions` (attention kernel, activation
recomputation, MoE aux-loss weight and micro-batch group: chosen at construction), cut into this
rank's pipeline stages by `build_model_parts`, and each stage is then changed here, in the open
and in torchtitan's order:

1. FP8: block linears swapped for the FP8 backend's (before parallelism, so tensor parallelism
   can use torchao's float8 styles and FSDP2 the fp8 all-gather);
   then LoRA (`[lora] enabled`): the model frozen and adapters added to its projections
   (`pipeline.core.model.lora`; an FP8 base keeps its fp8 matmuls, the adapters stay in high
   precision), before any parallelism, so each later step lays the adapters out with their
   base layer;
2. expert parallelism: each `MoE` swapped for an `ExpertParallelMoE` (before tensor
   parallelism, whose plan then hooks the swapped-in module);
3. tensor (+ sequence) parallelism: DTensor `ParallelStyle` plans (`tensor_parallel`), and
   the pipeline stage boundaries' input/output styles;
4. context parallelism: each attention kernel swapped for a `ContextParallelAttention`;
5. compile: `nn.Module.compile` of each block;
6. FSDP2 (or replication, or ZeRO-1 on FSDP2) over dp x cp; experts over the
   expert-data-parallel ranks.

Every step keeps parameter names (the checkpoint's names): layers keep their global index, swaps
keep the swapped module's children, and TP, EP and FSDP2 turn parameters into DTensors of the
same global shape.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from pipeline.core.parallel.dims import ParallelDims
from pipeline.core.parallel.layout_rules import canonical_dp_mode
from pipeline.train.config.compile_setting import compile_enabled

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from pipeline.core.model.transformer import Transformer
    from pipeline.train.config.schema import TrainConfig

__all__ = ["build_model_parts", "compile_enabled", "parallelize"]


def _fsdp_param_dtype(cfg: TrainConfig) -> torch.dtype:
    """Compute dtype of the gathered parameters: bf16 or fp16 for bf16 and fp16 runs (on any
    device; gradients are still reduced in fp32), else fp32."""
    return {"bf16": torch.bfloat16, "fp16": torch.float16}.get(cfg.training.dtype, torch.float32)


def build_model_parts(
    build: Callable[[], Transformer], layout: ParallelDims, cfg: TrainConfig, num_layers: int
) -> tuple[list[Transformer], list[int], int]:
    """This rank's pipeline stages of a `num_layers` model, each cut from a fresh `build()` (a
    model on `meta`): (parts, stage indices, number of stages). Without pipeline parallelism:
    ([build()], [0], 1)."""
    if not layout.pp_enabled:
        return [build()], [0], 1
    from pipeline.core.parallel.pipeline import (
        local_stage_indices,
        split_model,
        stage_layer_ranges,
        stages_per_rank,
    )

    p = cfg.parallel
    num_stages = layout.pp * stages_per_rank(p.pipeline_schedule)
    ranges = stage_layer_ranges(
        num_layers,
        num_stages,
        first_stage_layers=p.first_stage_layers,
        last_stage_layers=p.last_stage_layers,
    )
    indices = local_stage_indices(layout.pp_rank, layout.pp, p.pipeline_schedule)
    parts = [split_model(build(), i, num_stages, ranges) for i in indices]
    return parts, indices, num_stages


def parallelize(
    model: Transformer, layout: ParallelDims, cfg: TrainConfig, *, fp8: Any = None
) -> Transformer:
    """Apply FP8 (`fp8`, an `Fp8Training`, or None) and the layout to a model or pipeline stage
    still on `meta`, in place and in the order of the module docstring; returns it."""
    if fp8 is not None:
        model = fp8.convert(model)
    if cfg.lora.enabled:
        from pipeline.core.model.lora import apply_lora
        from pipeline.train.state.lora_run import lora_spec

        if fp8 is not None and not fp8.recipe.startswith("torchao"):
            raise ValueError("LoRA with FP8 runs on torchao's float8 linears; use --fp8 torchao")
        apply_lora(model, lora_spec(cfg))
    frozen = {name for name, param in model.named_parameters() if not param.requires_grad}
    _apply_model_parallel(model, cfg, layout)
    for name, param in model.named_parameters():  # some styles re-create parameters trainable
        if name in frozen:
            param.requires_grad_(False)
    if compile_enabled(cfg.training.compile, layout.device_type):
        for block in model.layers.values():
            block.compile()
    if layout.fsdp_degree > 1:
        _apply_data_parallel(model, cfg, layout)
    return model


def _apply_model_parallel(model: Transformer, cfg: TrainConfig, layout: ParallelDims) -> None:
    """Expert, tensor (+ sequence) and context parallelism, in that order."""
    from pipeline.core.parallel.context_parallel import apply_context_parallel
    from pipeline.core.parallel.expert_parallel import apply_expert_parallel
    from pipeline.core.parallel.tensor_parallel import apply_tensor_parallel

    sequence_parallel = cfg.parallel.sequence_parallel
    if layout.ep_enabled:
        apply_expert_parallel(model, layout.get_mesh("ep"))
    if layout.tp_enabled:
        tp_mesh = layout.get_mesh("tp")
        apply_tensor_parallel(model, tp_mesh, sequence_parallel=sequence_parallel)
        if layout.pp_enabled and sequence_parallel:
            _local_stage_boundaries(model, tp_mesh)
    if layout.cp_enabled:
        apply_context_parallel(model, layout.context_group, layout.cp_rank, layout.cp)


def _local_stage_boundaries(stage: Transformer, tp_mesh: DeviceMesh) -> None:
    """Under sequence parallelism the residual stream is a DTensor; pipeline stages exchange
    plain tensors. A stage without the embedding takes its input as this rank's sequence shard
    and one without the output layer hands on its local shard."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import (
        PrepareModuleInput,
        PrepareModuleOutput,
        parallelize_module,
    )

    if stage.tok_embeddings is None:
        style = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Shard(1),))
        parallelize_module(stage, tp_mesh, style)
    if stage.output is None:
        style = PrepareModuleOutput(
            output_layouts=(Shard(1),), desired_output_layouts=(Shard(1),), use_local_output=True
        )
        parallelize_module(stage, tp_mesh, style)
        # `to_local` returns a view; FSDP2 (applied later) warns about views it hooks, since an
        # in-place op on one would skip its backward hook. One copy of a hidden shard is cheap.
        stage.register_forward_hook(lambda module, args, output: output.clone())


def _apply_data_parallel(model: Transformer, cfg: TrainConfig, layout: ParallelDims) -> None:
    """FSDP2 (or replication) over dp x cp. Experts under expert parallelism are already split
    over the ep ranks; they are sharded over the expert-data-parallel ranks (edp) on their own,
    or left out of FSDP when edp is 1 (their gradients are complete after the all-to-all)."""
    from torch.distributed.fsdp import fully_shard

    from pipeline.core.parallel.fsdp import apply_fsdp, mixed_precision_policy

    p = cfg.parallel
    mode = canonical_dp_mode(p.dp_mode)
    mesh = layout.fsdp_mesh
    param_dtype = _fsdp_param_dtype(cfg)
    ignored: set[torch.nn.Parameter] = set()
    if layout.ep_enabled:
        edp_mesh = layout.get_mesh("edp")
        for moe in model.moe_layers().values():
            if edp_mesh.size() > 1:
                policy = mixed_precision_policy(param_dtype, torch.float32)
                keep = mode == "zero1"  # ZeRO-1: whole between the step's all-gather and backward
                fully_shard(
                    moe.experts, mesh=edp_mesh, mp_policy=policy, reshard_after_forward=not keep
                )
            else:
                ignored.update(moe.experts.parameters())
    apply_fsdp(
        model,
        mesh,
        param_dtype=param_dtype,
        reshard_after_forward=p.reshard_after_forward,
        mode=mode,
        ignored_params=ignored or None,
    )
