"""How TensorRT-LLM lays a model out over ranks: pure functions, both directions.

A TRT-LLM checkpoint holds one safetensors file per rank, rank = pp_rank * tp + tp_rank. Each
pipeline stage owns a contiguous run of layers (`torch.tensor_split` of the layer range, so the
first `L % pp` stages get one layer more) and numbers them from 0. Within a stage:

- column-parallel weights (q/k/v, `mlp.fc`, `mlp.gate`, `lm_head`) are split on dim 0 and
  row-parallel ones (`attention.dense`, `mlp.proj`) on dim 1, in equal contiguous chunks;
- rank r's `attention.qkv` is cat(q_r, k_r, v_r): its own query heads, then its key heads, then
  its value heads (not Megatron's group interleave). With fewer kv heads than ranks each kv head
  is replicated, so rank r holds kv head r * nkv // tp;
- `lm_head` rows are zero-padded to a multiple of tp;
- MoE experts are split over `moe_ep` ranks (expert ranges) and `moe_tp` ranks (the expert FFN
  dimension); `mlp.fc` is the fused cat(up, gate) per expert, `[E_local, 2 F / moe_tp, H]`.

The split functions build the files (`writer.py`); the merge functions undo them for the
reference forward (`reference.py`). They are each other's inverse, which the tests check, and
the tests also check the split side against layouts built by hand, so a mistake made twice
cannot cancel out.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = [
    "TrtllmMapping",
    "merge_dim",
    "merge_experts",
    "merge_qkv",
    "pad_rows",
    "qkv_for_rank",
    "split_dim",
    "experts_for_rank",
]


@dataclass(frozen=True)
class TrtllmMapping:
    """Tensor, pipeline and MoE parallel degrees of an export (TRT-LLM's `Mapping`).

    `moe_tp * moe_ep` must equal `tp`: the experts are spread over the tensor-parallel ranks,
    by expert range (`moe_ep`), by slices of each expert (`moe_tp`), or both.
    """

    tp: int = 1
    pp: int = 1
    moe_tp: int | None = None  # None: tp // moe_ep
    moe_ep: int = 1

    def __post_init__(self) -> None:
        if self.tp < 1 or self.pp < 1 or self.moe_ep < 1:
            raise ValueError(f"tp, pp and moe_ep must be >= 1 (got {self})")
        if self.moe_tp is None:
            if self.tp % self.moe_ep:
                raise ValueError(f"moe_ep {self.moe_ep} does not divide tp {self.tp}")
            object.__setattr__(self, "moe_tp", self.tp // self.moe_ep)
        if self.moe_tp * self.moe_ep != self.tp:
            raise ValueError(
                f"moe_tp * moe_ep must equal tp: {self.moe_tp} * {self.moe_ep} != {self.tp}"
            )

    @property
    def world_size(self) -> int:
        return self.tp * self.pp

    def rank(self, pp_rank: int, tp_rank: int) -> int:
        return pp_rank * self.tp + tp_rank

    def stage_ranks(self, pp_rank: int) -> range:
        """The world ranks of pipeline stage `pp_rank` (its tp group)."""
        return range(pp_rank * self.tp, (pp_rank + 1) * self.tp)

    def stage_layers(self, num_layers: int, pp_rank: int) -> range:
        """The global layers stage `pp_rank` owns; the first `num_layers % pp` get one more."""
        if self.pp > num_layers:
            raise ValueError(f"pp {self.pp} is larger than the model's {num_layers} layers")
        base, extra = divmod(num_layers, self.pp)
        start = pp_rank * base + min(pp_rank, extra)
        return range(start, start + base + (pp_rank < extra))

    def stage_of_layer(self, num_layers: int, layer: int) -> tuple[int, int]:
        """(pp_rank, stage-local index) of global `layer`."""
        for pp_rank in range(self.pp):
            layers = self.stage_layers(num_layers, pp_rank)
            if layer in layers:
                return pp_rank, layer - layers.start
        raise ValueError(f"layer {layer} is not in a {num_layers}-layer model")

    def moe_ranks(self, tp_rank: int) -> tuple[int, int]:
        """(moe_tp_rank, moe_ep_rank) of tensor-parallel rank `tp_rank`, as TRT-LLM numbers
        them: consecutive tp ranks hold consecutive expert ranges."""
        return tp_rank // self.moe_ep, tp_rank % self.moe_ep

    def to_dict(self, *, moe: bool) -> dict[str, int]:
        """The config.json `mapping` (MoE degrees only for MoE models)."""
        out = {"world_size": self.world_size, "tp_size": self.tp, "pp_size": self.pp}
        if moe:
            out |= {"moe_tp_size": self.moe_tp, "moe_ep_size": self.moe_ep}
        return out


def split_dim(tensor: torch.Tensor, parts: int, index: int, dim: int, what: str) -> torch.Tensor:
    """Equal contiguous chunk `index` of `parts` along `dim`; ValueError naming `what` when the
    size does not divide."""
    size = tensor.shape[dim]
    if size % parts:
        raise ValueError(f"{what}: dimension {dim} of size {size} does not split into {parts}")
    return tensor.narrow(dim, index * (size // parts), size // parts)


def merge_dim(parts: list[torch.Tensor], dim: int) -> torch.Tensor:
    """Inverse of `split_dim` over all indices."""
    return torch.cat(parts, dim=dim)


def pad_rows(tensor: torch.Tensor, multiple: int) -> torch.Tensor:
    """`tensor` with zero rows appended so dim 0 is a multiple of `multiple`."""
    extra = -tensor.shape[0] % multiple
    if not extra:
        return tensor
    return torch.cat([tensor, tensor.new_zeros(extra, *tensor.shape[1:])])


def _kv_heads_of_rank(num_kv_heads: int, tp: int, tp_rank: int) -> slice:
    """The kv heads rank `tp_rank` holds: its share, or its one replicated head."""
    if num_kv_heads >= tp:
        if num_kv_heads % tp:
            raise ValueError(f"num_key_value_heads {num_kv_heads} does not split over tp {tp}")
        per_rank = num_kv_heads // tp
        return slice(tp_rank * per_rank, (tp_rank + 1) * per_rank)
    if tp % num_kv_heads:
        raise ValueError(f"tp {tp} is not a multiple of num_key_value_heads {num_kv_heads}")
    head = tp_rank * num_kv_heads // tp
    return slice(head, head + 1)


def qkv_for_rank(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    num_heads: int,
    num_kv_heads: int,
    tp: int,
    tp_rank: int,
) -> torch.Tensor:
    """Rank `tp_rank`'s `attention.qkv` weight (`[heads * d, H]`) or bias (`[heads * d]`):
    cat(its query heads, its key heads, its value heads)."""
    if num_heads % tp:
        raise ValueError(f"num_attention_heads {num_heads} does not split over tp {tp}")
    head_dim = q.shape[0] // num_heads
    q_part = split_dim(q, tp, tp_rank, 0, "attention q")
    heads = _kv_heads_of_rank(num_kv_heads, tp, tp_rank)
    rows = slice(heads.start * head_dim, heads.stop * head_dim)
    return torch.cat([q_part, k[rows], v[rows]])


def merge_qkv(
    parts: list[torch.Tensor], *, num_heads: int, num_kv_heads: int, head_dim: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inverse of `qkv_for_rank` over all ranks: the full q, k, v. Replicated kv heads must be
    identical on every rank that holds them (ValueError otherwise)."""
    tp = len(parts)
    q_rows = num_heads // tp * head_dim
    kv_rows = max(num_kv_heads // tp, 1) * head_dim
    qs, ks, vs = zip(*(p.split([q_rows, kv_rows, kv_rows]) for p in parts), strict=True)
    if num_kv_heads >= tp:
        return torch.cat(qs), torch.cat(ks), torch.cat(vs)
    copies = tp // num_kv_heads
    for r in range(tp):
        first = r - r % copies
        if not (torch.equal(ks[r], ks[first]) and torch.equal(vs[r], vs[first])):
            raise ValueError(f"kv head {r // copies} differs between ranks {first} and {r}")
    return torch.cat(qs), torch.cat(ks[::copies]), torch.cat(vs[::copies])


def experts_for_rank(
    w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor, mapping: TrtllmMapping, tp_rank: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank `tp_rank`'s (`mlp.fc`, `mlp.proj`) expert weights from our stacked w1 (gate),
    w3 (up) `[E, F, H]` and w2 (down) `[E, H, F]`: fc = cat(up, gate) `[E_local, 2 F/moe_tp, H]`,
    proj `[E_local, H, F/moe_tp]`."""
    moe_tp_rank, moe_ep_rank = mapping.moe_ranks(tp_rank)
    w1, w3, w2 = (split_dim(w, mapping.moe_ep, moe_ep_rank, 0, "experts") for w in (w1, w3, w2))
    gate = split_dim(w1, mapping.moe_tp, moe_tp_rank, 1, "expert gate")
    up = split_dim(w3, mapping.moe_tp, moe_tp_rank, 1, "expert up")
    down = split_dim(w2, mapping.moe_tp, moe_tp_rank, 2, "expert down")
    return torch.cat([up, gate], dim=1), down


def merge_experts(
    fc: list[torch.Tensor], proj: list[torch.Tensor], mapping: TrtllmMapping
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inverse of `experts_for_rank` over a stage's tp ranks: full (w1, w3, w2)."""
    w1s, w3s, w2s = [], [], []
    for moe_ep_rank in range(mapping.moe_ep):
        ranks = [t * mapping.moe_ep + moe_ep_rank for t in range(mapping.moe_tp)]
        ups, gates = zip(*(fc[r].chunk(2, dim=1) for r in ranks), strict=True)
        w3s.append(torch.cat(ups, dim=1))
        w1s.append(torch.cat(gates, dim=1))
        w2s.append(torch.cat([proj[r] for r in ranks], dim=2))
    return torch.cat(w1s), torch.cat(w3s), torch.cat(w2s)
