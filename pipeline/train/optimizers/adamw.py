"""AdamW with Megatron's weight-decay rule: the registry's `adamw` (`pipeline.train.optimizers`)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from pipeline.core.model.moe import is_bias

if TYPE_CHECKING:
    from pipeline.train.config.schema import TrainConfig

__all__ = ["build_adamw", "param_groups"]


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """Two groups: decayed (>=2-D weights) and not decayed (biases and 1-D params such as norms).

    This is Megatron's rule (`name.endswith(".bias") or param.ndim == 1` -> no decay), so
    embeddings and the output layer are decayed. Frozen parameters (LoRA's base) are left out,
    and so is a group left empty by that.

    A parallel model may mix plain tensors and DTensors of different meshes (e.g. replicated
    experts beside tensor-parallel attention, or expert-parallel experts beside FSDP shards);
    the multi-tensor kernels take one kind per call, so each kind gets its own pair of groups
    (named `decay:<mesh>`, ...). Checkpoints key optimizer state by parameter name, so the
    grouping may differ between the layout that saved and the one that loads.
    """
    kinds: dict[str, tuple[list[torch.nn.Parameter], list[torch.nn.Parameter]]] = {}
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        decay, no_decay = kinds.setdefault(_kind(param), ([], []))
        if is_bias(name) or param.ndim < 2:
            no_decay.append(param)
        else:
            decay.append(param)
    if not kinds:
        kinds[""] = ([], [])
    suffix = len(kinds) > 1
    groups = []
    for kind, (decay, no_decay) in kinds.items():
        tag = f":{kind}" if suffix else ""
        groups.append({"params": decay, "weight_decay": weight_decay, "name": f"decay{tag}"})
        groups.append({"params": no_decay, "weight_decay": 0.0, "name": f"no_decay{tag}"})
    # An empty group cannot be restored from a name-keyed state dict (torch's unflattening reads
    # each group's first parameter); only a LoRA run (adapters are all 2-D) has one.
    return [g for g in groups if g["params"]] or groups[:1]


def _kind(param: torch.Tensor) -> str:
    """ "tensor" for a plain parameter, the mesh's dimension names for a DTensor."""
    from torch.distributed.tensor import DTensor

    if not isinstance(param, DTensor):
        return "tensor"
    mesh = param.device_mesh
    return "x".join(mesh.mesh_dim_names or ()) or f"mesh{tuple(mesh.mesh.shape)}"


def build_adamw(model: torch.nn.Module, cfg: TrainConfig) -> torch.optim.Optimizer:
    """AdamW over `param_groups(model)` with `cfg.optimizer`'s hyper-parameters.

    fp32 states (the default): always torch's fused kernel (CUDA and CPU, plain and DTensor
    parameters): it reads the optimizer's `found_inf` tensor on the device and leaves weights,
    moments and step count untouched when it is 1, so a non-finite step is skipped without
    waiting for the device (`pipeline.train.optimizers.nonfinite`). `optimizer.state_dtype =
    "bf16"`: `AdamWBF16` (bf16 moments, stochastically rounded). `optimizer.cpu_offload`: either
    of them stepping in host memory (`OffloadedOptimizer`, torchao's CPU offload).
    """
    o = cfg.optimizer
    hyper = dict(lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps, weight_decay=o.weight_decay)
    if o.state_dtype == "bf16":
        from pipeline.train.optimizers.adamw_bf16 import AdamWBF16

        optimizer_class, extra = AdamWBF16, {"seed": cfg.training.seed}
    else:
        optimizer_class, extra = torch.optim.AdamW, {"fused": True}
    groups = param_groups(model, o.weight_decay)
    if o.cpu_offload:
        from pipeline.train.optimizers.cpu_offload import OffloadedOptimizer

        return OffloadedOptimizer(groups, optimizer_class, **hyper, **extra)
    return optimizer_class(groups, **hyper, **extra)
