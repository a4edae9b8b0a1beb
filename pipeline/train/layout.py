"""`RunLayout`: where this process sits in the parallel layout of a run, and what follows.

The trainer asks it which samples to load (the data-parallel rank: tensor, pipeline and context
parallel ranks of one data-parallel replica read the same micro-batches), which part of each
sequence to keep (context parallelism: two load-balanced chunks per rank), and over which
groups the step's token counts, losses and gradient norms are summed: the "token" group of the
ranks that hold different tokens (dp x cp) and the pipeline group (different layers).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from pipeline.core.parallel.context_parallel import shard_sequence
from pipeline.core.parallel.dims import ParallelDims

__all__ = ["RunLayout"]

# Batch fields laid out [batch, seq]: context parallelism keeps this rank's chunks of each.
SEQUENCE_FIELDS = ("tokens", "labels", "loss_mask", "position_ids", "document_ids")


@dataclass
class RunLayout:
    """This process's coordinates in the layout (all zeros and ones for a single process)."""

    dims: ParallelDims | None = None
    rank: int = 0
    dp_rank: int = 0
    dp_size: int = 1
    cp_rank: int = 0
    cp_size: int = 1
    pp_rank: int = 0
    token_group: Any = None
    """dp x cp ranks (different tokens of the global batch); None when there is one."""
    pp_group: Any = None
    """Pipeline ranks (different layers); None without pipeline parallelism."""
    world_group: Any = None

    @classmethod
    def from_dims(cls, dims: ParallelDims) -> RunLayout:
        """The layout of this rank in `dims` (its meshes built)."""
        dp, cp, pp = dims.get_mesh("dp"), dims.get_mesh("cp"), dims.get_mesh("pp")
        return cls(
            dims=dims,
            rank=dist.get_rank(),
            dp_rank=dp.get_local_rank(),
            dp_size=dims.dp,
            cp_rank=cp.get_local_rank(),
            cp_size=dims.cp,
            pp_rank=pp.get_local_rank(),
            token_group=dims.get_mesh("dp_cp").get_group() if dims.fsdp_degree > 1 else None,
            pp_group=pp.get_group() if dims.pp_enabled else None,
            world_group=dist.group.WORLD,
        )

    @property
    def world_size(self) -> int:
        return self.dims.world_size if self.dims is not None else 1

    def shard_batch(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """This context-parallel rank's part of every sequence of a micro-batch (positions stay
        global, so RoPE and the causal mask see each token's place in the whole sequence)."""
        if self.cp_size == 1:
            return batch
        return {
            key: shard_sequence(value, self.cp_rank, self.cp_size)
            if key in SEQUENCE_FIELDS
            else value
            for key, value in batch.items()
        }

    def describe(self) -> dict[str, int]:
        """The degrees, for checkpoint metadata and logs."""
        d = self.dims
        if d is None:
            return {"tp": 1, "pp": 1, "cp": 1, "ep": 1, "dp": 1, "world_size": 1}
        return {
            "tp": d.tp,
            "pp": d.pp,
            "cp": d.cp,
            "ep": d.ep,
            "dp": d.dp,
            "world_size": self.world_size,
        }
