"""AdamW with Megatron's weight-decay rule, and the learning-rate scheduler that drives it."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch.optim.lr_scheduler import LambdaLR

from pipeline.train.schedules import LRSchedule

if TYPE_CHECKING:
    from pipeline.train.config import TrainConfig

__all__ = ["MegatronLR", "build_optimizer", "build_scheduler", "param_groups"]


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
        if name.endswith(".bias") or param.ndim < 2:
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


def build_optimizer(model: torch.nn.Module, cfg: TrainConfig) -> torch.optim.AdamW:
    """AdamW over `param_groups(model)` with `cfg.optimizer`'s hyper-parameters.

    Always the fused kernel (CUDA and CPU, plain and DTensor parameters): it reads the
    optimizer's `found_inf` tensor on the device and leaves weights, moments and step count
    untouched when it is 1, so a non-finite step is skipped without waiting for the device
    (`train_step`).
    """
    o = cfg.optimizer
    return torch.optim.AdamW(
        param_groups(model, o.weight_decay),
        lr=o.lr,
        betas=(o.beta1, o.beta2),
        eps=o.eps,
        weight_decay=o.weight_decay,
        fused=True,
    )


class MegatronLR(LambdaLR):
    """`LambdaLR` driven by an `LRSchedule`; every param group gets `schedule.lr(step)`.

    Its state dict holds only the step count and learning rates (the schedule itself comes from
    the config, so a resumed run follows the config it was started with now), and loading one
    re-applies the learning rate at the loaded step so optimizer and scheduler agree at once.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, schedule: LRSchedule) -> None:
        self.schedule = schedule

        # A plain function, not a callable object: LambdaLR then leaves it out of state_dict().
        def factor(step: int) -> float:
            return schedule.factor(step)

        super().__init__(optimizer, lr_lambda=factor)

    def rewind(self, steps: int) -> None:
        """Take back the last `steps` steps (skipped optimizer steps, learnt at a log step):
        the learning rate returns to where the applied steps put it."""
        if steps <= 0:
            return
        self._set_step(self.last_epoch - steps)

    def _set_step(self, step: int) -> None:
        """Stand at `step`: every param group's learning rate is `schedule.lr(step)`."""
        self.last_epoch = step
        lrs = [base * self.schedule.factor(step) for base in self.base_lrs]
        for group, lr in zip(self.optimizer.param_groups, lrs):
            group["lr"] = lr
        self._last_lr = lrs

    def state_dict(self) -> dict[str, Any]:
        state = super().state_dict()
        state.pop("schedule", None)
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        # The saving layout may have grouped the parameters differently (see `param_groups`).
        self.base_lrs = [group["initial_lr"] for group in self.optimizer.param_groups]
        self._set_step(self.last_epoch)


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: TrainConfig) -> MegatronLR:
    """The learning-rate scheduler for `cfg`; call `.step()` after each `optimizer.step()`."""
    return MegatronLR(optimizer, LRSchedule.from_config(cfg))
