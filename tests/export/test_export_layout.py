"""TensorRT-LLM rank layout (docs/file_layouts.md, "Rank files"), checked against layouts built by
hand here, not by the functions' own inverses: q then k then v per rank (never Megatron's group
interleave), kv heads replicated when fewer than tp, zero padding rows, TRT-LLM's layer split
and MoE rank numbering, and the fused expert fc as cat(up, gate)."""

from __future__ import annotations

import pytest
import torch

from pipeline.export.legacy_trtllm.layout import (
    TrtllmMapping,
    experts_for_rank,
    merge_experts,
    merge_qkv,
    pad_rows,
    qkv_for_rank,
)

HIDDEN = 3


def _heads(count: int, head_dim: int, base: float) -> torch.Tensor:
    """`[count * head_dim, HIDDEN]`: every row names its head (base + head) and row."""
    rows = torch.arange(count * head_dim, dtype=torch.float32)
    head = rows // head_dim
    return base + head[:, None] + rows[:, None] / 1000 + torch.arange(HIDDEN) / 10**6


def _rows(t: torch.Tensor, heads: list[int], head_dim: int) -> torch.Tensor:
    return torch.cat([t[h * head_dim : (h + 1) * head_dim] for h in heads])


def test_qkv_rank_holds_its_q_then_its_k_then_its_v() -> None:
    nq, nkv, d, tp = 8, 4, 2, 2
    q, k, v = _heads(nq, d, 100), _heads(nkv, d, 200), _heads(nkv, d, 300)
    for r in range(tp):
        got = qkv_for_rank(q, k, v, num_heads=nq, num_kv_heads=nkv, tp=tp, tp_rank=r)
        want = torch.cat(
            [
                _rows(q, list(range(r * 4, r * 4 + 4)), d),
                _rows(k, [2 * r, 2 * r + 1], d),
                _rows(v, [2 * r, 2 * r + 1], d),
            ]
        )
        assert torch.equal(got, want)
        # Megatron's group interleave [q of group g; k_g; v_g] per group is a different
        # tensor of the same shape: a writer producing it must fail the check above.
        groups = [r * 2, r * 2 + 1]
        interleaved = torch.cat(
            [
                torch.cat([_rows(q, [2 * g, 2 * g + 1], d), _rows(k, [g], d), _rows(v, [g], d)])
                for g in groups
            ]
        )
        assert interleaved.shape == got.shape and not torch.equal(interleaved, got)


def test_kv_heads_replicated_when_fewer_than_tp() -> None:
    nq, nkv, d, tp = 8, 2, 2, 4
    q, k, v = _heads(nq, d, 100), _heads(nkv, d, 200), _heads(nkv, d, 300)
    parts = [
        qkv_for_rank(q, k, v, num_heads=nq, num_kv_heads=nkv, tp=tp, tp_rank=r) for r in range(tp)
    ]
    for r, part in enumerate(parts):
        head = r * nkv // tp  # ranks 0, 1 -> kv head 0; ranks 2, 3 -> kv head 1
        want = torch.cat(
            [_rows(q, [2 * r, 2 * r + 1], d), _rows(k, [head], d), _rows(v, [head], d)]
        )
        assert torch.equal(part, want)
    assert torch.equal(parts[0][4:], parts[1][4:]) and not torch.equal(parts[1][4:], parts[2][4:])
    merged = merge_qkv(parts, num_heads=nq, num_kv_heads=nkv, head_dim=d)
    assert all(torch.equal(a, b) for a, b in zip(merged, (q, k, v)))
    parts[1] = parts[1].clone()
    parts[1][-1] += 1  # the replicas of a kv head disagree
    with pytest.raises(ValueError, match="kv head 0 differs between ranks 0 and 1"):
        merge_qkv(parts, num_heads=nq, num_kv_heads=nkv, head_dim=d)


def test_mha_qkv_equals_splitting_the_stacked_tensor() -> None:
    """With nkv == nq the layout is [3, nq*d, H] split on axis 1."""
    nq, d, tp = 4, 2, 2
    q, k, v = _heads(nq, d, 1), _heads(nq, d, 2), _heads(nq, d, 3)
    stacked = torch.stack([q, k, v])
    for r in range(tp):
        want = stacked.chunk(tp, dim=1)[r].reshape(-1, HIDDEN)
        assert torch.equal(
            qkv_for_rank(q, k, v, num_heads=nq, num_kv_heads=nq, tp=tp, tp_rank=r), want
        )


def test_qkv_bias_follows_the_weight_rule() -> None:
    nq, nkv, d, tp = 4, 1, 2, 2
    q, k, v = (
        torch.arange(n * d, dtype=torch.float32) + base
        for n, base in ((nq, 0), (nkv, 100), (nkv, 200))
    )
    for r in range(tp):
        got = qkv_for_rank(q, k, v, num_heads=nq, num_kv_heads=nkv, tp=tp, tp_rank=r)
        assert torch.equal(got, torch.cat([q[r * 4 : r * 4 + 4], k, v]))


def test_uneven_heads_are_refused() -> None:
    q = k = v = torch.zeros(6, HIDDEN)
    with pytest.raises(ValueError, match="num_attention_heads 3 does not split over tp 2"):
        qkv_for_rank(q, k, v, num_heads=3, num_kv_heads=3, tp=2, tp_rank=0)
    with pytest.raises(ValueError, match="tp 4 is not a multiple of num_key_value_heads 3"):
        qkv_for_rank(torch.zeros(24, 3), k, v, num_heads=12, num_kv_heads=3, tp=4, tp_rank=0)


def test_pad_rows_appends_zero_rows_only() -> None:
    t = torch.ones(10, 3)
    padded = pad_rows(t, 4)
    assert padded.shape == (12, 3) and torch.equal(padded[:10], t) and not padded[10:].any()
    assert pad_rows(t, 5) is t


@pytest.mark.parametrize(("layers", "pp"), [(3, 2), (5, 2), (7, 3), (4, 4), (8, 2)])
def test_stage_layers_follow_tensor_split(layers: int, pp: int) -> None:
    """TRT-LLM's `Mapping.pp_layers`: torch.tensor_split, the first stages get the extra."""
    mapping = TrtllmMapping(pp=pp)
    for pp_rank, want in enumerate(torch.tensor_split(torch.arange(layers), pp)):
        got = mapping.stage_layers(layers, pp_rank)
        assert list(got) == want.tolist()
        for j, layer in enumerate(got):
            assert mapping.stage_of_layer(layers, layer) == (pp_rank, j)
    with pytest.raises(ValueError, match="pp 3 is larger"):
        TrtllmMapping(pp=3).stage_layers(2, 0)


def test_rank_numbering_and_mapping_checks() -> None:
    mapping = TrtllmMapping(tp=4, pp=2, moe_ep=2)
    assert mapping.world_size == 8 and mapping.moe_tp == 2
    assert mapping.rank(pp_rank=1, tp_rank=2) == 6 and list(mapping.stage_ranks(1)) == [4, 5, 6, 7]
    # Consecutive tp ranks take consecutive expert ranges (TRT-LLM's moe_ep_rank = tp % ep).
    assert [mapping.moe_ranks(t) for t in range(4)] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert mapping.to_dict(moe=True) == {
        "world_size": 8,
        "tp_size": 4,
        "pp_size": 2,
        "moe_tp_size": 2,
        "moe_ep_size": 2,
    }
    assert mapping.to_dict(moe=False) == {"world_size": 8, "tp_size": 4, "pp_size": 2}
    with pytest.raises(ValueError, match="moe_ep 3 does not divide tp 4"):
        TrtllmMapping(tp=4, moe_ep=3)


def test_expert_fc_is_up_then_gate_split_by_ep_and_tp() -> None:
    experts, ffn, hidden = 4, 4, 3
    w1 = torch.randn(experts, ffn, hidden)  # gate_proj (the SiLU branch)
    w3 = torch.randn(experts, ffn, hidden)  # up_proj
    w2 = torch.randn(experts, hidden, ffn)  # down_proj
    mapping = TrtllmMapping(tp=4, moe_ep=2)  # moe_tp 2
    fcs, projs = [], []
    for tp_rank in range(4):
        fc, proj = experts_for_rank(w1, w3, w2, mapping, tp_rank)
        moe_tp_rank, ep_rank = tp_rank // 2, tp_rank % 2
        mine = slice(ep_rank * 2, ep_rank * 2 + 2)
        half = slice(moe_tp_rank * 2, moe_tp_rank * 2 + 2)
        assert torch.equal(fc, torch.cat([w3[mine, half], w1[mine, half]], dim=1))
        assert torch.equal(proj, w2[mine, :, half])
        fcs.append(fc)
        projs.append(proj)
    merged = merge_experts(fcs, projs, mapping)
    assert all(torch.equal(a, b) for a, b in zip(merged, (w1, w3, w2)))
