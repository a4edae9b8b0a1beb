"""ParallelDims: degree inference and every validation error (pure Python), and the mesh it
builds on two gloo ranks."""

from __future__ import annotations

import pytest

from pipeline.core.model.config import ModelConfig, MoEConfig
from pipeline.core.parallel.dims import ParallelDims
from tests.distributed import run_distributed


def test_dp_is_inferred_from_the_world_size():
    dims = ParallelDims(tp=2, pp=2, world_size=16)
    assert dims.dp == 4
    assert dims.fsdp_degree == 4
    assert (dims.tp_enabled, dims.pp_enabled, dims.dp_enabled) == (True, True, True)
    assert (dims.cp_enabled, dims.ep_enabled) == (False, False)
    assert ParallelDims(world_size=1).dp == 1
    assert not ParallelDims(world_size=1).dp_enabled
    assert ParallelDims(cp=2, tp=2, world_size=8).fsdp_degree == 4


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"tp": 3, "world_size": 8}, r"world size 8 is not divisible by tp\*pp\*cp"),
        ({"tp": 2, "dp": 3, "world_size": 8}, r"tp\*pp\*cp\*dp = 6 does not match world size 8"),
        ({"tp": 0, "world_size": 8}, "tp must be >= 1, got 0"),
        ({"dp": 0, "world_size": 8}, r"dp must be >= 1 or -1 \(inferred\), got 0"),
        ({"ep": 3, "world_size": 8}, r"parallel.ep \(3\) must divide dp \* cp \(8\)"),
    ],
)
def test_bad_degrees_are_rejected(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ParallelDims(**kwargs)


def test_ep_borrows_data_and_context_parallel_ranks_only():
    assert ParallelDims(cp=2, ep=4, world_size=4).ep == 4  # dp 2 * cp 2
    # Experts are whole on every tensor-parallel rank: ep takes the dp ranks of one tp index.
    assert ParallelDims(tp=2, ep=2, world_size=4).ep == 2
    with pytest.raises(ValueError, match=r"ep \(4\) must divide dp \* cp \(2\)"):
        ParallelDims(tp=2, ep=4, world_size=4)


def _config(**overrides) -> ModelConfig:
    base = dict(
        vocab_size=128,
        hidden_size=64,
        num_layers=4,
        num_attention_heads=8,
        num_kv_heads=4,
        ffn_hidden_size=128,
    )
    return ModelConfig(**{**base, **overrides})


def test_a_fitting_model_passes():
    ParallelDims(tp=4, pp=4, cp=2, world_size=32).validate_for_model(_config(), 64)
    moe = _config(moe=MoEConfig(num_experts=8, top_k=2))
    ParallelDims(ep=8, world_size=8).validate_for_model(moe, 16)
    # num_layers 4 over 3 stages is uneven but allowed; seq 5 is fine without SP or CP.
    ParallelDims(pp=3, world_size=3).validate_for_model(_config(), 5)
    ParallelDims(tp=2, world_size=2).validate_for_model(_config(), 5, sequence_parallel=False)


@pytest.mark.parametrize(
    ("dims", "config", "seq", "message"),
    [
        (
            {"tp": 16},
            {"num_attention_heads": 8, "num_kv_heads": 8, "hidden_size": 64},
            64,
            r"tp \(16\) must divide num_attention_heads \(8\)",
        ),
        ({"tp": 8}, {}, 64, r"tp \(8\) must divide num_kv_heads \(4\)"),
        ({"tp": 2}, {"ffn_hidden_size": 129}, 64, r"tp \(2\) must divide ffn_hidden_size \(129\)"),
        ({"pp": 8}, {}, 64, r"pp \(8\) x 1 stage\(s\) per rank exceeds the model's 4 layers"),
        ({"ep": 2}, {}, 64, "ep = 2 needs a MoE model; the model is dense"),
        (
            {"ep": 4},
            {"moe": MoEConfig(num_experts=6, top_k=2)},
            64,
            r"ep \(4\) must divide num_experts \(6\)",
        ),
        ({"cp": 2}, {}, 18, r"seq_length \(18\) must be divisible by 2 \* cp = 4"),
        ({"tp": 4}, {}, 18, r"seq_length \(18\) must be divisible by tp \(4\) = 4"),
        ({"tp": 2, "cp": 2}, {}, 20, r"\(20\) must be divisible by tp \(2\) \* 2 \* cp \(2\) = 8"),
    ],
)
def test_model_mismatches_are_rejected(dims, config, seq, message):
    world = dims.get("tp", 1) * dims.get("pp", 1) * dims.get("cp", 1) * dims.get("ep", 1)
    with pytest.raises(ValueError, match=message):
        ParallelDims(**dims, world_size=world).validate_for_model(_config(**config), seq)


def test_all_mismatches_are_reported_together():
    with pytest.raises(ValueError, match="num_kv_heads.*; .*4 layers"):
        ParallelDims(tp=8, pp=8, world_size=64).validate_for_model(_config(), 64)


def test_meshes_need_build_mesh_first():
    with pytest.raises(RuntimeError, match="build_mesh"):
        ParallelDims(world_size=1).get_mesh("tp")


def _mesh_shapes(rank, world_size, tmp):
    dims = ParallelDims(ep=2, world_size=world_size)
    mesh = dims.build_mesh("cpu")
    out = {
        "names": mesh.mesh_dim_names,
        "shape": tuple(mesh.shape),
        "sizes": {
            n: dims.get_mesh(n).size() for n in ("pp", "dp", "cp", "tp", "dp_cp", "ep", "edp")
        },
        "dp_rank": dims.dp_rank,
    }
    try:
        dims.get_mesh("nope")
    except ValueError as e:
        out["error"] = str(e)
    data = ParallelDims(world_size=world_size)  # pure data parallel over the same ranks
    data.build_mesh("cpu")
    out["dp_sizes"] = (data.get_mesh("dp").size(), data.get_mesh("dp_cp").size())
    return out


@pytest.mark.dist
def test_build_mesh_names_every_dimension(tmp_path):
    results = run_distributed(_mesh_shapes, 2, tmp_path)
    for rank, out in enumerate(results):
        assert out["names"] == ("pp", "dp", "cp", "tp")
        assert out["shape"] == (1, 2, 1, 1)
        assert out["sizes"] == {"pp": 1, "dp": 2, "cp": 1, "tp": 1, "dp_cp": 2, "ep": 2, "edp": 1}
        assert out["dp_rank"] == rank
        assert "unknown mesh 'nope'" in out["error"]
        assert out["dp_sizes"] == (2, 2)


def _expert_groups(rank, world_size, tmp):
    import torch.distributed as dist

    dims = ParallelDims(tp=2, ep=2, world_size=world_size)
    dims.build_mesh("cpu")
    ranks = {n: dist.get_process_group_ranks(dims.get_mesh(n).get_group()) for n in ("ep", "tp")}
    ranks["micro_batch"] = dist.get_process_group_ranks(dims.micro_batch_group(True))
    ranks["micro_batch_without_sp"] = dims.micro_batch_group(False)
    return ranks


@pytest.mark.dist
def test_ep_beside_tp_groups_the_data_parallel_ranks_of_one_tp_index(tmp_path):
    results = run_distributed(_expert_groups, 4, tmp_path)
    for rank, out in enumerate(results):  # ranks (dp, tp): 0 (0, 0), 1 (0, 1), 2 (1, 0), 3 (1, 1)
        assert out["ep"] == [rank % 2, rank % 2 + 2]
        assert out["tp"] == [rank - rank % 2, rank - rank % 2 + 1]
        # Under sequence parallelism a micro-batch's tokens are split over tp (x cp).
        assert out["micro_batch"] == out["tp"]
        assert out["micro_batch_without_sp"] is None
