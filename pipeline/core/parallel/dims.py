"""Parallel degrees of a run and the DeviceMesh they describe.

`ParallelDims` holds the degrees of pipeline (pp), data (dp), context (cp), tensor (tp) and expert
(ep) parallelism. `dp=-1` is inferred from the world size. The mesh is laid out ("pp", "dp", "cp",
"tp"), tp innermost, so that a tensor-parallel group is a block of consecutive ranks (one node
with NVLink on a GPU cluster) and pipeline stages are the outermost split. Every dimension is
built, degree-1 ones included, so callers never branch on whether a name exists:
`dims.get_mesh("tp")` always works.

Expert parallelism borrows ranks rather than adding a mesh dimension: as in Megatron-LM with an
expert tensor-parallel size of 1, the dp x cp x tp ranks of one pipeline stage are regrouped into
(edp, ep), ep innermost, so `ep` must divide dp * cp * tp. That regrouping is a second mesh over
the same ranks, named ("pp", "edp", "ep").
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

MESH_DIMS = ("pp", "dp", "cp", "tp")


@dataclass(kw_only=True)
class ParallelDims:
    """Degrees of each kind of parallelism; their product (ep aside) is the world size."""

    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    dp: int = -1  # -1: world_size // (tp * pp * cp)
    world_size: int
    _meshes: dict[str, DeviceMesh] = field(
        default_factory=dict, init=False, repr=False, compare=False
    )

    def __post_init__(self) -> None:
        for name in ("tp", "pp", "cp", "ep", "world_size"):
            value = getattr(self, name)
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        others = self.tp * self.pp * self.cp
        if self.dp == -1:
            if self.world_size % others:
                raise ValueError(
                    f"world_size {self.world_size} is not divisible by tp * pp * cp = "
                    f"{self.tp} * {self.pp} * {self.cp} = {others}, so dp cannot be inferred"
                )
            self.dp = self.world_size // others
        elif self.dp < 1:
            raise ValueError(f"dp must be >= 1 or -1 (inferred), got {self.dp}")
        if self.dp * others != self.world_size:
            raise ValueError(
                f"pp * dp * cp * tp = {self.pp} * {self.dp} * {self.cp} * {self.tp} = "
                f"{self.dp * others} != world_size {self.world_size}"
            )
        if (self.dp * self.cp * self.tp) % self.ep:
            raise ValueError(
                f"ep {self.ep} must divide dp * cp * tp = {self.dp} * {self.cp} * {self.tp} = "
                f"{self.dp * self.cp * self.tp} (experts are spread over one stage's ranks)"
            )

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

    # -- checks against a model ------------------------------------------------------------

    def validate_for_model(
        self, model_config: Any, seq_length: int, *, sequence_parallel: bool = True
    ) -> None:
        """Raise ValueError, naming the values, when the model or sequence cannot be split this way.

        `model_config` is a `pipeline.core.model.config.ModelConfig` (duck-typed so this module
        need not import the model). Heads, kv heads and the MLP width are split by tp; layers
        over pp stages (uneven splits are allowed, empty stages are not); experts over ep; the
        sequence over 2 * cp chunks (load-balanced causal context parallelism gives each rank
        one early and one late chunk) and, with sequence parallelism, over tp.
        """
        c = model_config
        errors = []
        if c.num_attention_heads % self.tp:
            errors.append(
                f"num_attention_heads {c.num_attention_heads} is not divisible by tp {self.tp}"
            )
        if c.num_kv_heads % self.tp:
            errors.append(f"num_kv_heads {c.num_kv_heads} is not divisible by tp {self.tp}")
        if c.ffn_hidden_size % self.tp:
            errors.append(f"ffn_hidden_size {c.ffn_hidden_size} is not divisible by tp {self.tp}")
        if c.num_layers < self.pp:
            errors.append(f"num_layers {c.num_layers} < pp {self.pp}: a stage would hold no layer")
        if self.ep > 1:
            if c.moe is None:
                errors.append(f"ep {self.ep} > 1 but the model has no experts (moe is None)")
            elif c.moe.num_experts % self.ep:
                errors.append(
                    f"moe.num_experts {c.moe.num_experts} is not divisible by ep {self.ep}"
                )
        if self.cp > 1 and seq_length % (2 * self.cp):
            errors.append(f"seq_length {seq_length} is not divisible by 2 * cp = {2 * self.cp}")
        if sequence_parallel and self.tp > 1:
            seq_split = self.tp * (2 * self.cp if self.cp > 1 else 1)
            if seq_length % seq_split:
                errors.append(
                    f"seq_length {seq_length} is not divisible by tp {self.tp}"
                    + (f" * 2 * cp {self.cp}" if self.cp > 1 else "")
                    + f" = {seq_split} (sequence parallelism splits the sequence over tp)"
                )
        if errors:
            raise ValueError("parallel layout does not fit the model: " + "; ".join(errors))

    # -- meshes ------------------------------------------------------------------------------

    def build_mesh(self, device_type: str) -> DeviceMesh:
        """The ("pp", "dp", "cp", "tp") mesh over all ranks, plus the flattened "dp_cp" mesh
        (FSDP shards over it) and, with ep > 1, the ("pp", "edp", "ep") expert mesh.

        Needs an initialised default process group of `world_size` ranks; every rank must call it.
        """
        mesh = init_device_mesh(
            device_type, (self.pp, self.dp, self.cp, self.tp), mesh_dim_names=MESH_DIMS
        )
        self._meshes = {"world": mesh}
        self._meshes["dp_cp"] = mesh["dp", "cp"]._flatten("dp_cp")
        if self.ep > 1:
            edp = self.dp * self.cp * self.tp // self.ep
            ranks = mesh.mesh.reshape(self.pp, edp, self.ep)
            self._meshes["expert"] = DeviceMesh(
                device_type, ranks, mesh_dim_names=("pp", "edp", "ep")
            )
        return mesh

    @property
    def world_mesh(self) -> DeviceMesh:
        if "world" not in self._meshes:
            raise RuntimeError("call build_mesh(device_type) first")
        return self._meshes["world"]

    def get_mesh(self, name: str) -> DeviceMesh:
        """The 1-D mesh named "pp", "dp", "cp", "tp", "dp_cp", or (ep > 1) "ep" / "edp"."""
        world = self.world_mesh
        if name in MESH_DIMS:
            return world[name]
        if name == "dp_cp":
            return self._meshes["dp_cp"]
        if name in ("ep", "edp"):
            if "expert" not in self._meshes:
                raise ValueError(f"no {name!r} mesh: ep is {self.ep}")
            return self._meshes["expert"][name]
        raise ValueError(f"unknown mesh {name!r}; have {', '.join(MESH_DIMS)}, dp_cp, ep, edp")

    @property
    def non_data_parallel_size(self) -> int:
        return math.prod((self.pp, self.cp, self.tp))
