"""Muon's orthogonalisation: the Newton-Schulz iteration on whole, sharded or gathered matrices.

`NewtonSchulz.whole(x)` is torch's `_zeropower_via_newtonschulz` (torch/optim/_muon.py) op for
op, on a matrix or a stack of them (`[..., m, n]`, e.g. experts): in the chosen dtype, the
matrix taken wide (transposed when m > n), scaled to unit Frobenius norm, then `steps` times

    G = X X^T;   X <- a X + (b G + c G G) X          (a, b, c: the coefficients)

`orthogonalize(items, ns, tp_mode)` runs it on each Muon parameter of any parallel layout:

* a plain tensor, or a DTensor whose shards hold whole matrices (experts split over ranks
  by expert parallelism, a stack split on its expert dimension): locally;
* a DTensor sharded over tensor parallelism (a 1-D `tp` mesh), as `tp_mode` says:
  `duplicated` gathers the matrix and every rank orthogonalises it, keeping its shard (exact);
  `distributed` keeps the shards and all-reduces a Gram matrix inside every iteration (exact up
  to summation order, see `NewtonSchulz.sharded`); `blockwise` orthogonalises each shard as a
  matrix of its own, which is *another optimizer*: the update differs from one device's;
* a DTensor sharded by FSDP2 (any other 1-D mesh, a matrix dimension split): the update is
  gathered, each matrix orthogonalised by one owner rank only (owners given greedily, largest
  matrix first, to the least-loaded rank, so the work spreads evenly), and broadcast back;
* a DTensor on a mesh of several dimensions (FSDP2 x TP): gathered and orthogonalised on every
  rank (as `duplicated`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = ["TP_MODES", "NewtonSchulz", "orthogonalize", "shard_layout"]

TP_MODES = ("duplicated", "distributed", "blockwise")
Layout = Literal["local", "duplicated", "distributed", "blockwise", "owner"]


@dataclass(frozen=True)
class NewtonSchulz:
    """The quintic Newton-Schulz iteration with torch's defaults (Keller Jordan's constants)."""

    coefficients: tuple[float, float, float] = (3.4445, -4.7750, 2.0315)
    steps: int = 5
    eps: float = 1e-7
    dtype: torch.dtype = torch.bfloat16

    def whole(self, g: Tensor) -> Tensor:
        """The orthogonalised `g` (`[..., m, n]`, each matrix whole), in `dtype`."""
        a, b, c = self.coefficients
        tall = g.size(-2) > g.size(-1)
        x = g.to(self.dtype)
        if tall:
            x = x.mT
        x = x / _frobenius(x).clamp(min=self.eps)
        for _ in range(self.steps):
            gram = x @ x.mT
            x = _addmm(x, _addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
        return x.mT if tall else x

    def sharded(self, g: Tensor, shard_dim: int, group: dist.ProcessGroup, tall: bool) -> Tensor:
        """`whole` of the matrix whose shard along `shard_dim` (-2 rows, -1 columns) this rank
        holds in `g`, without gathering it: this rank's shard of the result. `tall`: the whole
        matrix has more rows than columns.

        With X taken wide (r <= c) and split by columns, X = [X1 X2]: X X^T = sum_i Xi Xi^T
        is all-reduced (r x r) and each rank updates its columns. Split by rows, X = [X1; X2]:
        the iteration is rewritten as X <- X (a I + b H + c H H) with H = X^T X = sum_i Xi^T Xi
        (c x c), all-reduced, since p(X X^T) X = X p(X^T X). Both equal `whole` up to the order
        of the sums (and the rewrite's rounding)."""
        a, b, c = self.coefficients
        x = g.to(self.dtype)
        if tall:
            x, shard_dim = x.mT, -1 if shard_dim == -2 else -2
        squares = _all_reduce(x.float().square().sum((-2, -1), keepdim=True), group)
        x = x / squares.sqrt().to(self.dtype).clamp(min=self.eps)
        by_columns = shard_dim == -1
        for _ in range(self.steps):
            gram = _all_reduce(x @ x.mT if by_columns else x.mT @ x, group)
            poly = _addmm(gram, gram, gram, beta=b, alpha=c)
            x = _addmm(x, poly, x, beta=a) if by_columns else _addmm(x, x, poly, beta=a)
        return x.mT if tall else x


def _frobenius(x: Tensor) -> Tensor:
    """Each matrix's Frobenius norm (`x.norm()` for one matrix, as torch computes it)."""
    if x.ndim == 2:
        return x.norm()
    return torch.linalg.vector_norm(x, dim=(-2, -1), keepdim=True)


def _addmm(input: Tensor, m1: Tensor, m2: Tensor, *, beta: float, alpha: float = 1.0) -> Tensor:
    """`beta * input + alpha * m1 @ m2` for matrices (`torch.addmm`) or stacks (`baddbmm`)."""
    if input.ndim == 2:
        return torch.addmm(input, m1, m2, beta=beta, alpha=alpha)
    flat = (-1, *input.shape[-2:])
    out = torch.baddbmm(
        input.reshape(flat),
        m1.reshape(-1, *m1.shape[-2:]),
        m2.reshape(-1, *m2.shape[-2:]),
        beta=beta,
        alpha=alpha,
    )
    return out.reshape(input.shape[:-2] + out.shape[-2:])


def _all_reduce(x: Tensor, group: dist.ProcessGroup) -> Tensor:
    """The sum of `x` over `group`, added in fp32 and returned in `x`'s dtype."""
    total = x.float()
    dist.all_reduce(total, group=group)
    return total.to(x.dtype)


def shard_layout(param: Tensor, tp_mode: str) -> Layout:
    """How `param` (a Muon parameter) is orthogonalised; see the module docstring."""
    from torch.distributed.tensor import DTensor

    if not isinstance(param, DTensor):
        return "local"
    matrix_dims = {param.ndim - 2, param.ndim - 1}
    if not any(p.is_shard() and p.dim % param.ndim in matrix_dims for p in param.placements):
        return "local"
    mesh = param.device_mesh
    if mesh.ndim > 1:
        return "duplicated"
    if mesh.mesh_dim_names == ("tp",):
        return tp_mode  # type: ignore[return-value]
    return "owner"


def orthogonalize(
    items: list[tuple[Tensor, Tensor]], ns: NewtonSchulz, tp_mode: str
) -> list[Tensor]:
    """For each `(param, update)` (the update this rank's local part of the parameter), this
    rank's part of the orthogonalised update. Every rank of a mesh must call it with the same
    parameters in the same order (the collectives pair up by order)."""
    out: list[Tensor | None] = [None] * len(items)
    owned: dict[tuple[int, ...], list[int]] = {}
    for i, (param, update) in enumerate(items):
        layout = shard_layout(param, tp_mode)
        if layout in ("local", "blockwise"):
            out[i] = ns.whole(update)
        elif layout == "distributed":
            (placement,) = param.placements
            tall = param.shape[-2] > param.shape[-1]
            group = param.device_mesh.get_group()
            out[i] = ns.sharded(update, placement.dim % param.ndim - param.ndim, group, tall)
        elif layout == "duplicated":
            out[i] = _shard_of(ns.whole(_gathered(param, update)), param)
        else:
            owned.setdefault(tuple(param.device_mesh.mesh.flatten().tolist()), []).append(i)
    for indices in owned.values():
        for i, value in zip(indices, _by_owners([items[i] for i in indices], ns)):
            out[i] = value
    return out  # type: ignore[return-value]


def _by_owners(items: list[tuple[Tensor, Tensor]], ns: NewtonSchulz) -> list[Tensor]:
    """FSDP2: every matrix gathered, orthogonalised by its owner, broadcast from it."""
    mesh = items[0][0].device_mesh
    group, me = mesh.get_group(), mesh.get_local_rank()
    owners = _owners([param.numel() for param, _ in items], mesh.size())
    fulls = [_gathered(param, update) for param, update in items]
    # Contiguous: a tall matrix's result is a transposed view, and collectives send memory.
    results = [
        ns.whole(full).contiguous() if owner == me else torch.empty_like(full, dtype=ns.dtype)
        for full, owner in zip(fulls, owners)
    ]
    # Broadcast as bytes: bit-exact on every backend (gloo has no int16 kernel).
    works = [
        dist.broadcast(_as_bytes(r), group=group, group_src=owner, async_op=True)
        for r, owner in zip(results, owners)
    ]
    for work in works:
        work.wait()
    return [_shard_of(r, param) for r, (param, _) in zip(results, items)]


def _owners(sizes: list[int], ranks: int) -> list[int]:
    """The owner of each matrix: largest first, each to the rank with the least work so far
    (ties to the lowest rank), so every rank of the mesh computes about the same."""
    load = [0] * ranks
    owners = [0] * len(sizes)
    for i in sorted(range(len(sizes)), key=lambda i: -sizes[i]):
        owners[i] = min(range(ranks), key=lambda r: load[r])
        load[owners[i]] += sizes[i]
    return owners


def _as_bytes(x: Tensor) -> Tensor:
    """`x`'s memory as a uint8 tensor (contiguous `x`), for a broadcast that must copy its bits:
    every backend moves uint8 (gloo has no int16 kernel, so a bf16 result viewed as int16 fails
    there), and NCCL sends the same bytes as for any other dtype (a broadcast does no math)."""
    return x.view(torch.uint8)


def _gathered(param: Tensor, update: Tensor) -> Tensor:
    """The whole of `update`, whose local part this rank holds as `param`'s shard."""
    from torch.distributed.tensor import DTensor

    spread = DTensor.from_local(
        update,
        param.device_mesh,
        param.placements,
        run_check=False,
        shape=param.shape,
        stride=param.stride(),
    )
    return spread.full_tensor()


def _shard_of(full: Tensor, param: Tensor) -> Tensor:
    """This rank's part of `full`, sharded as `param` is (no communication)."""
    from torch.distributed.tensor import distribute_tensor

    return distribute_tensor(
        full, param.device_mesh, param.placements, src_data_rank=None
    ).to_local()
