"""The run's parallel layout, built once: process group, `ParallelDims` and its meshes; what
follows from it before anything is built (the micro-batches per step, the seeds).

`build_layout` is the trainer's first step. One process gets a layout of degree 1 everywhere
(no process group, no mesh); a run launched by torchrun (`pipe train --nproc-per-node N`) or
asking for any parallel degree > 1 initialises the default process group (gloo on CPU, nccl on
CUDA) and every mesh. The config is validated here, once, against the real world size.
"""

from __future__ import annotations

import logging
import os
import random
from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.distributed as dist

from pipeline.core.parallel.dims import ParallelDims
from pipeline.core.parallel.layout_rules import canonical_dp_mode
from pipeline.core.parallel.process_group import (
    NoCudaDevice,
    choose_device,
    rank_device,
    start_process_group,
)
from pipeline.train.assembly.run_config import check_config

if TYPE_CHECKING:
    from pipeline.train.config.schema import TrainConfig

__all__ = [
    "build_layout",
    "init_distributed",
    "micro_batches_per_step",
    "resolve_device",
    "seed_everything",
    "wants_distributed",
    "zero1_active",
]

log = logging.getLogger("pipeline.train")


def build_layout(cfg: TrainConfig, device: torch.device) -> tuple[ParallelDims, torch.device]:
    """(the layout, this rank's device): `cfg` validated for the world size, meshes built."""
    world_size = 1
    if wants_distributed(cfg):
        device = init_distributed(device)
        world_size = dist.get_world_size()
    check_config(cfg, world_size=world_size)
    layout = ParallelDims.from_config(cfg.parallel, world_size).build(device.type)
    if layout.distributed:
        log.info("parallel layout: %s", layout.describe())
    return layout, device


def zero1_active(cfg: TrainConfig, layout: ParallelDims) -> bool:
    """Whether the run is ZeRO-1 (`parallel.dp_mode = "zero1"` or an alias) over more than one
    data-parallel rank: its steps defer the gradient reduction to the last micro-batch and
    gather the parameters after the optimizer step (`pipeline.core.parallel.fsdp`)."""
    return layout.fsdp_degree > 1 and canonical_dp_mode(cfg.parallel.dp_mode) == "zero1"


def micro_batches_per_step(cfg: TrainConfig, layout: ParallelDims) -> int:
    """Micro-batches each data-parallel rank runs per optimizer step (gradient accumulation)."""
    t = cfg.training
    return t.global_batch_size // (t.micro_batch_size * layout.dp)


def seed_everything(seed: int, deterministic: bool) -> None:
    """Seed Python, numpy and torch (all devices); with `deterministic`, refuse
    nondeterministic torch kernels (used on CPU, where resumed runs must match bit for bit)."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
    if deterministic:
        torch.use_deterministic_algorithms(True)


def resolve_device(name: str) -> torch.device:
    """`training.device`: `auto` -> CUDA when available, else CPU; `cuda` without a GPU is a
    clear error."""
    try:
        return choose_device(name)
    except NoCudaDevice:
        from pipeline.train.config.schema import ConfigError

        raise ConfigError("training.device = cuda, but torch sees no CUDA device") from None


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
    device = rank_device(device)
    if dist.is_initialized():
        return device
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        from pipeline.train.config.schema import ConfigError

        raise ConfigError(
            "parallel training needs one process per rank: launch with "
            "`pipe train --nproc-per-node N` (torchrun), not a single process"
        )
    start_process_group(device)
    return device
