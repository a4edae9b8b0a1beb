"""The step between building the model on `meta` and materialising it (see docs/architecture.md).

`build_model_parts` cuts the model into this rank's pipeline stages (one part without pipeline
parallelism) and `parallelize` applies the layout to each part, in torchtitan's order:
tensor (+ sequence) parallel -> expert parallel -> context parallel -> activation
checkpointing -> compile -> FSDP2 (over dp x cp; experts over the expert-data-parallel ranks).
Every step keeps parameter names (the checkpoint's names): layers keep their global index,
checkpointing and compile replace a block's `forward` in place, and TP, EP and FSDP2 turn
parameters into DTensors of the same global shape.

`init_distributed` and `build_parallel_dims` set up the process group and the device mesh of a
run launched by torchrun (`pipe train --nproc-per-node N`).
"""

from __future__ import annotations

import copy
import functools
import os
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

from pipeline.core.parallel.dims import ParallelDims

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from pipeline.core.model.transformer import Transformer
    from pipeline.train.config import TrainConfig

__all__ = [
    "apply_activation_checkpointing",
    "build_model_parts",
    "build_parallel_dims",
    "compile_enabled",
    "init_distributed",
    "parallelize",
    "wants_distributed",
]

# Selective recomputation keeps the outputs of matmuls and attention (expensive to recompute)
# and recomputes everything elementwise (norms, activations, RoPE), which is cheap.
_SAVE_OPS = {
    torch.ops.aten.mm.default,
    torch.ops.aten.addmm.default,
    torch.ops.aten.bmm.default,
    torch.ops.aten._scaled_dot_product_efficient_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
    torch.ops.aten._scaled_dot_product_cudnn_attention.default,
}


def _selective_policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in _SAVE_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def apply_activation_checkpointing(model: Transformer, mode: str) -> None:
    """Recompute each block's activations in backward: `full` keeps only block inputs,
    `selective` also keeps matmul and attention outputs; `none` leaves the model alone."""
    if mode == "none":
        return
    if mode not in ("full", "selective"):
        raise ValueError(f"unknown activation checkpointing mode {mode!r}")
    context_fn = None
    if mode == "selective":
        context_fn = functools.partial(create_selective_checkpoint_contexts, _selective_policy)
    for block in model.layers.values():
        inner = block.forward

        def checkpointed(*args: Any, _inner: Any = inner, **kwargs: Any) -> Any:
            extra = {"context_fn": context_fn} if context_fn is not None else {}
            return checkpoint(_inner, *args, use_reentrant=False, **extra, **kwargs)

        block.forward = checkpointed


def wants_distributed(cfg: TrainConfig) -> bool:
    """True when the run is (or must be) multi-process: a process group exists, torchrun
    launched us with WORLD_SIZE > 1, or a parallel degree is > 1."""
    if dist.is_available() and dist.is_initialized():
        return True
    p = cfg.parallel
    degrees = (p.tp, p.pp, p.cp, p.ep, p.dp)
    return int(os.environ.get("WORLD_SIZE", "1")) > 1 or max(degrees) > 1


def init_distributed(device: torch.device) -> torch.device:
    """Initialise the default process group if needed (gloo on CPU, nccl on CUDA); returns this
    rank's device (`cuda:LOCAL_RANK` on GPUs). Needs torchrun's RANK / WORLD_SIZE variables
    when no group exists yet."""
    if device.type == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    if dist.is_initialized():
        return device
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        raise RuntimeError(
            "parallel training needs one process per rank: launch with "
            "`pipe train --nproc-per-node N` (torchrun), not a single process"
        )
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    return device


def build_parallel_dims(cfg: TrainConfig, device_type: str) -> ParallelDims:
    """`ParallelDims` for the initialised world from `cfg.parallel` (dp -1: inferred), checked
    against the model and sequence, with its meshes built."""
    p = cfg.parallel
    dims = ParallelDims(
        tp=p.tp, pp=p.pp, cp=p.cp, ep=p.ep, dp=p.dp, world_size=dist.get_world_size()
    )
    dims.validate_for_model(
        cfg.model_config(), cfg.data.seq_length, sequence_parallel=p.sequence_parallel
    )
    dims.build_mesh(device_type)
    return dims


def _fsdp_param_dtype(cfg: TrainConfig, device_type: str) -> torch.dtype:
    """Compute dtype of the gathered parameters: bf16 only for bf16 runs on CUDA."""
    bf16 = device_type == "cuda" and cfg.training.dtype == "bf16"
    return torch.bfloat16 if bf16 else torch.float32


def build_model_parts(
    model: Transformer, cfg: TrainConfig, dims: ParallelDims | None
) -> tuple[list[Transformer], list[int], int]:
    """This rank's pipeline stages of `model` (still on `meta`): (parts, stage indices, number
    of stages). Without pipeline parallelism: ([model], [0], 1)."""
    if dims is None or not dims.pp_enabled:
        return [model], [0], 1
    from pipeline.core.parallel.pipeline import (
        local_stage_indices,
        split_model,
        stage_layer_ranges,
        stages_per_rank,
    )

    p = cfg.parallel
    num_stages = dims.pp * stages_per_rank(p.pipeline_schedule)
    ranges = stage_layer_ranges(
        model.config.num_layers,
        num_stages,
        first_stage_layers=p.first_stage_layers,
        last_stage_layers=p.last_stage_layers,
    )
    pp_rank = dims.get_mesh("pp").get_local_rank()
    indices = local_stage_indices(pp_rank, dims.pp, p.pipeline_schedule)
    parts = [split_model(copy.deepcopy(model), i, num_stages, ranges) for i in indices]
    return parts, indices, num_stages


def compile_enabled(setting: bool | None, device_type: str) -> bool:
    """`training.compile`: True/False as given; unset (None) compiles on CUDA only (on a CPU
    compiling costs more time than a short run saves, and tests want eager numerics)."""
    return device_type == "cuda" if setting is None else setting


def parallelize(
    model: Transformer,
    cfg: TrainConfig,
    dims: ParallelDims | None = None,
    *,
    device_type: str | None = None,
) -> Transformer:
    """Apply the configured layout to a model (or pipeline stage) still on `meta`, in place.

    Without `dims` (one process) any parallel degree > 1 is refused. `device_type` decides the
    default of `training.compile` (unset: the data-parallel mesh's device, else cpu). FP8
    conversion (`pipeline.core.kernels.fp8`) happens before this, so tensor parallelism can use
    torchao's float8 styles and FSDP2 the fp8 all-gather.
    """
    if dims is None:
        p = cfg.parallel
        wanted = {n: getattr(p, n) for n in ("tp", "pp", "cp", "ep", "dp") if getattr(p, n) > 1}
        if wanted:
            layout = ", ".join(f"{k}={v}" for k, v in wanted.items())
            raise NotImplementedError(
                f"{layout} needs one process per rank (pipe train --nproc-per-node N)"
            )
    else:
        _apply_model_parallel(model, cfg, dims)
    apply_activation_checkpointing(model, cfg.training.activation_checkpointing)
    if device_type is None:
        device_type = dims.get_mesh("dp_cp").device_type if dims is not None else "cpu"
    if compile_enabled(cfg.training.compile, device_type):
        for block in model.layers.values():
            block.compile()
    if dims is not None and dims.fsdp_degree > 1:
        _apply_data_parallel(model, cfg, dims)
    return model


def _apply_model_parallel(model: Transformer, cfg: TrainConfig, dims: ParallelDims) -> None:
    """Tensor (+ sequence), expert and context parallelism, in that order."""
    from pipeline.core.parallel.context_parallel import apply_context_parallel
    from pipeline.core.parallel.expert_parallel import apply_expert_parallel
    from pipeline.core.parallel.tensor_parallel import apply_tensor_parallel

    sequence_parallel = cfg.parallel.sequence_parallel
    if dims.tp_enabled:
        apply_tensor_parallel(model, dims.get_mesh("tp"), sequence_parallel=sequence_parallel)
        if dims.pp_enabled and sequence_parallel:
            _local_stage_boundaries(model, dims.get_mesh("tp"))
    if dims.ep_enabled:
        apply_expert_parallel(model, dims.get_mesh("ep"))
    if dims.cp_enabled:
        cp_mesh = dims.get_mesh("cp")
        apply_context_parallel(model, cp_mesh.get_group(), cp_mesh.get_local_rank(), dims.cp)
        for moe in model.moe_layers().values():
            moe.token_group = cp_mesh.get_group()


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


def _apply_data_parallel(model: Transformer, cfg: TrainConfig, dims: ParallelDims) -> None:
    """FSDP2 (or replication) over dp x cp. Experts under expert parallelism are already split
    over the ep ranks; they are sharded over the expert-data-parallel ranks (edp) on their own,
    or left out of FSDP when edp is 1 (their gradients are complete after the all-to-all)."""
    from torch.distributed.fsdp import fully_shard

    from pipeline.core.parallel.fsdp import apply_fsdp, mixed_precision_policy

    p = cfg.parallel
    mesh = dims.get_mesh("dp_cp")
    param_dtype = _fsdp_param_dtype(cfg, mesh.device_type)
    ignored: set[torch.nn.Parameter] = set()
    if dims.ep_enabled:
        edp_mesh = dims.get_mesh("edp")
        for moe in model.moe_layers().values():
            if edp_mesh.size() > 1:
                policy = mixed_precision_policy(param_dtype, torch.float32)
                fully_shard(moe.experts, mesh=edp_mesh, mp_policy=policy)
            else:
                ignored.update(moe.experts.parameters())
    apply_fsdp(
        model,
        mesh,
        param_dtype=param_dtype,
        reshard_after_forward=p.reshard_after_forward,
        mode=p.dp_mode,
        ignored_params=ignored or None,
    )
