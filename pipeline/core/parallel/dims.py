"""The parallel layout of a run: its degrees, every rule they must obey, and its process groups.

`ParallelDims` is the one layout object of a run, present for one process too (every degree 1,
no process group). It holds the degrees of pipeline (pp), data (dp), context (cp), tensor (tp)
and expert (ep) parallelism (`dp=-1` is inferred from the world size), this process's place in
them, and, once `build_mesh` ran, every mesh and process group, each named for what it is for.

The mesh is laid out ("pp", "dp", "cp", "tp"), tp innermost, so that a tensor-parallel group is a
block of consecutive ranks (one node with NVLink on a GPU cluster) and pipeline stages are the
outermost split. Every dimension is built, degree-1 ones included, so callers never branch on
whether a name exists.

Expert parallelism borrows ranks rather than adding a mesh dimension: as in Megatron-LM with an
expert tensor-parallel size of 1, the dp x cp ranks of one pipeline stage and one tensor-parallel
index (those holding different tokens) are regrouped into (edp, ep), ep innermost, so `ep` must
divide dp * cp; experts are whole on every rank, never split over tp. That regrouping is a
second mesh over the same ranks, named ("pp", "edp", "ep", "tp").

Every rule lives in `pipeline.core.parallel.layout_rules` (torch-free, so the config can check
a layout without importing torch): the constructor and `validate_for_model` raise its
`degree_problems` and `model_problems`, and the training config calls its `layout_problems`
once with the whole run, so one error lists every problem.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from pipeline.core.parallel.context_parallel import shard_sequence
from pipeline.core.parallel.layout_rules import (
    degree_problems,
    layout_problems,
    model_problems,
    resolve_dp,
)

__all__ = ["MESH_DIMS", "ParallelDims", "degree_problems", "layout_problems", "model_problems"]

MESH_DIMS = ("pp", "dp", "cp", "tp")
# Batch fields laid out [batch, seq]: context parallelism keeps this rank's chunks of each.
SEQUENCE_FIELDS = ("tokens", "labels", "loss_mask", "position_ids", "document_ids")


# ---- the layout ----------------------------------------------------------------------------------


@dataclass(kw_only=True)
class ParallelDims:
    """Degrees of each kind of parallelism (their product, ep aside, is the world size), this
    process's place in them and, after `build_mesh`, the meshes and process groups."""

    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    dp: int = -1  # -1: world_size // (tp * pp * cp)
    world_size: int = 1
    device_type: str = field(default="cpu", init=False)
    """Where the run computes; set by `build`."""
    _meshes: dict[str, DeviceMesh] = field(
        default_factory=dict, init=False, repr=False, compare=False
    )

    def __post_init__(self) -> None:
        degrees = dict(tp=self.tp, pp=self.pp, cp=self.cp, ep=self.ep, dp=self.dp)
        problems = degree_problems(**degrees, world_size=self.world_size)
        if problems:
            raise ValueError("invalid parallel layout: " + "; ".join(problems))
        self.dp = resolve_dp(self.dp, self.non_data_parallel_size, self.world_size)

    @classmethod
    def from_config(cls, parallel: Any, world_size: int) -> ParallelDims:
        """The layout of a `ParallelSection` (duck-typed) over `world_size` processes."""
        p = parallel
        return cls(tp=p.tp, pp=p.pp, cp=p.cp, ep=p.ep, dp=p.dp, world_size=world_size)

    # -- what is on ------------------------------------------------------------------------

    @property
    def tp_enabled(self) -> bool:
        return self.tp > 1

    @property
    def pp_enabled(self) -> bool:
        return self.pp > 1

    @property
    def cp_enabled(self) -> bool:
        return self.cp > 1

    @property
    def ep_enabled(self) -> bool:
        return self.ep > 1

    @property
    def dp_enabled(self) -> bool:
        return self.dp > 1

    @property
    def fsdp_degree(self) -> int:
        """Ranks a parameter is sharded over by FSDP: dp x cp (cp ranks hold the same weights)."""
        return self.dp * self.cp

    @property
    def non_data_parallel_size(self) -> int:
        return math.prod((self.pp, self.cp, self.tp))

    @property
    def distributed(self) -> bool:
        """More than one process: the meshes and groups exist once `build_mesh` ran."""
        return self.world_size > 1

    def validate_for_model(
        self,
        model_config: Any,
        seq_length: int,
        *,
        sequence_parallel: bool = True,
        stages_per_rank: int = 1,
    ) -> None:
        """Raise one ValueError naming every reason the model or sequence cannot be split so
        (see `model_problems`)."""
        problems = model_problems(
            tp=self.tp,
            pp=self.pp,
            cp=self.cp,
            ep=self.ep,
            model=model_config,
            seq_length=seq_length,
            sequence_parallel=sequence_parallel,
            stages_per_rank=stages_per_rank,
        )
        if problems:
            raise ValueError("parallel layout does not fit the model: " + "; ".join(problems))

    # -- meshes ------------------------------------------------------------------------------

    def build(self, device_type: str) -> ParallelDims:
        """Record the device type and, for more than one process, build every mesh (each rank
        must call it then); returns self."""
        self.device_type = device_type
        if self.distributed:
            self.build_mesh(device_type)
        return self

    def build_mesh(self, device_type: str) -> DeviceMesh:
        """The ("pp", "dp", "cp", "tp") mesh over all ranks, and beside it:

        - the flattened "dp_cp" mesh (FSDP shards over it);
        - with tp > 1, the flattened "cp_tp" mesh (the ranks one micro-batch's tokens are split
          over under sequence parallelism) and, when dp or cp is > 1 too, the flattened
          "dp_cp_tp" mesh (a reduction over a parameter's whole sharding in one collective);
        - with ep > 1, the ("pp", "edp", "ep", "tp") expert mesh, and its "edp" and "ep"
          flattened as "edp_ep" when both are > 1 (for the same reason).

        Needs an initialised default process group of `world_size` ranks; every rank must call it.
        """
        self.device_type = device_type
        mesh = init_device_mesh(
            device_type, (self.pp, self.dp, self.cp, self.tp), mesh_dim_names=MESH_DIMS
        )
        self._meshes = {"world": mesh}
        self._meshes["dp_cp"] = mesh["dp", "cp"]._flatten("dp_cp")
        if self.tp > 1:
            self._meshes["cp_tp"] = mesh["cp", "tp"]._flatten("cp_tp")
        if self.tp > 1 and self.dp * self.cp > 1:
            # A parameter sharded over ("dp_cp", "tp") reduces its gradient norm over both in
            # one all-reduce when this flattened mesh exists (DTensor looks it up among the
            # root mesh's flattened ones); without it torch runs two in a row and logs a
            # warning from every rank. Nothing of pipe's asks for it by name.
            mesh["dp", "cp", "tp"]._flatten("dp_cp_tp")
        if self.ep > 1:
            edp = self.dp * self.cp // self.ep
            ranks = mesh.mesh.reshape(self.pp, edp, self.ep, self.tp)
            expert = DeviceMesh(device_type, ranks, mesh_dim_names=("pp", "edp", "ep", "tp"))
            self._meshes["expert"] = expert
            if edp > 1:  # experts sharded over both: their gradient norm in one all-reduce
                expert["edp", "ep"]._flatten("edp_ep")
        return mesh

    @property
    def world_mesh(self) -> DeviceMesh:
        if "world" not in self._meshes:
            raise RuntimeError("call build_mesh(device_type) first (a multi-process layout)")
        return self._meshes["world"]

    def get_mesh(self, name: str) -> DeviceMesh:
        """The 1-D mesh named "pp", "dp", "cp", "tp", "dp_cp", (tp > 1) "cp_tp", or (ep > 1)
        "ep" / "edp"."""
        world = self.world_mesh
        if name in MESH_DIMS:
            return world[name]
        if name in ("dp_cp", "cp_tp") and name in self._meshes:
            return self._meshes[name]
        if name in ("ep", "edp"):
            if "expert" not in self._meshes:
                raise ValueError(f"no {name!r} mesh: ep is {self.ep}")
            return self._meshes["expert"][name]
        raise ValueError(
            f"unknown mesh {name!r}; have {', '.join(MESH_DIMS)}, dp_cp, cp_tp, ep, edp"
        )

    # -- this process's place, and the groups named for their use ---------------------------

    def _local_rank(self, name: str) -> int:
        return self.get_mesh(name).get_local_rank() if self.distributed else 0

    def _group(self, name: str, degree: int) -> dist.ProcessGroup | None:
        """The process group of mesh `name`, or None when its degree is 1 (nothing to reduce)."""
        return self.get_mesh(name).get_group() if degree > 1 else None

    @property
    def rank(self) -> int:
        return dist.get_rank() if self.distributed else 0

    @property
    def dp_rank(self) -> int:
        """Which slice of each global batch this process loads (tp, pp and cp ranks of one
        data-parallel replica read the same micro-batches)."""
        return self._local_rank("dp")

    @property
    def cp_rank(self) -> int:
        return self._local_rank("cp")

    @property
    def pp_rank(self) -> int:
        return self._local_rank("pp")

    @property
    def batch_group(self) -> dist.ProcessGroup | None:
        """The dp x cp ranks holding different tokens of the global batch: token counts, loss
        sums and gradients are summed over them (None for one such rank)."""
        return self._group("dp_cp", self.fsdp_degree)

    @property
    def tensor_group(self) -> dist.ProcessGroup | None:
        """The tp ranks one model's weights are split over, holding the same micro-batches
        (None without tensor parallelism)."""
        return self._group("tp", self.tp)

    @property
    def context_group(self) -> dist.ProcessGroup | None:
        """The cp ranks one micro-batch's sequences are split over (None without cp)."""
        return self._group("cp", self.cp)

    def micro_batch_group(self, sequence_parallel: bool) -> dist.ProcessGroup | None:
        """The ranks one micro-batch's tokens are split over: cp, and under sequence
        parallelism tp too (each tp rank's MoE layers route only its share of the sequence);
        None when this rank holds whole micro-batches."""
        if sequence_parallel and self.tp > 1:
            return self.get_mesh("cp_tp").get_group()
        return self.context_group

    @property
    def pipeline_group(self) -> dist.ProcessGroup | None:
        """The pp ranks holding the other layers (None without pipeline parallelism)."""
        return self._group("pp", self.pp)

    @property
    def world_group(self) -> dist.ProcessGroup | None:
        """Every process, for collective checkpoint I/O (None for one process)."""
        return dist.group.WORLD if self.distributed else None

    @property
    def fsdp_mesh(self) -> DeviceMesh:
        """The dp x cp mesh FSDP2 shards parameters over."""
        return self.get_mesh("dp_cp")

    @property
    def first_rank_of_stage(self) -> int:
        """The lowest global rank holding this process's pipeline stage."""
        if not self.distributed:
            return 0
        return int(self.world_mesh.mesh[self.pp_rank].min())

    def shard_batch(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """This context-parallel rank's part of every sequence of a micro-batch (positions stay
        global, so RoPE and the causal mask see each token's place in the whole sequence)."""
        if self.cp == 1:
            return batch
        return {
            key: shard_sequence(value, self.cp_rank, self.cp) if key in SEQUENCE_FIELDS else value
            for key, value in batch.items()
        }

    def describe(self) -> dict[str, int]:
        """The degrees, for checkpoint metadata and logs."""
        return {
            "tp": self.tp,
            "pp": self.pp,
            "cp": self.cp,
            "ep": self.ep,
            "dp": self.dp,
            "world_size": self.world_size,
        }
