"""Expert parallelism (tier B): an ep=2 MoE against the single-process reference, on gloo."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from pipeline.core.model.config import MoEConfig
from pipeline.core.model.moe import MoE
from pipeline.core.parallel.expert_parallel import ExpertParallelMoE, apply_expert_parallel
from tests.distributed import run_distributed

HIDDEN, FFN, TOKENS = 16, 32, 24
TOL = dict(rtol=1e-5, atol=1e-5)


def _reference(config: MoEConfig) -> MoE:
    torch.manual_seed(0)
    moe = MoE(HIDDEN, FFN, config)
    moe.init_weights(0.2, 0.2)
    return moe


def _tokens(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs [2, TOKENS/2, HIDDEN] and a fixed cotangent (the loss is sum(out * cotangent))."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2, TOKENS // 2, HIDDEN, generator=g)
    return x, torch.randn(x.shape, generator=g)


def _compare(
    ref: MoE, ep: ExpertParallelMoE, inputs: list[tuple[torch.Tensor, torch.Tensor]], rank: int
) -> None:
    """Rank r feeds inputs[r] to the ep MoE; the reference runs every rank's inputs. Outputs,
    data-parallel-summed router grads, gathered expert grads and counts must agree."""
    ref.zero_grad(), ep.zero_grad()
    ref_counts, ref_dropped = [], []
    for x, cot in inputs:
        (ref(x) * cot).sum().backward()
        ref_counts.append(ref.tokens_per_expert.clone())
        ref_dropped.append(int(ref.num_dropped))
    x, cot = inputs[rank]
    out = ep(x)
    torch.testing.assert_close(out, ref(x), **TOL)
    (out * cot).sum().backward()

    router_grad = ep.router.weight.grad.clone()
    dist.all_reduce(router_grad)  # the data-parallel reduction of a replicated parameter
    torch.testing.assert_close(router_grad, ref.router.weight.grad, **TOL)
    for name in ("w1", "w3", "w2"):
        # Expert shards already hold every rank's contribution: gather, do not sum.
        grad = getattr(ep.experts, name).grad.full_tensor()
        torch.testing.assert_close(grad, getattr(ref.experts, name).grad, **TOL)

    assert torch.equal(ep.local_tokens_per_expert, ref_counts[rank])
    assert torch.equal(ep.tokens_per_expert, sum(ref_counts))
    assert int(ep.local_num_dropped) == ref_dropped[rank]
    assert int(ep.num_dropped) == sum(ref_dropped)


def _check_matches_reference(rank: int, world_size: int, tmp: Path) -> None:
    ref = _reference(MoEConfig(num_experts=4, top_k=2))
    ep = apply_expert_parallel(copy.deepcopy(ref), dist.group.WORLD, rank, world_size)
    assert isinstance(ep, ExpertParallelMoE) and ep.expert_range == (2 * rank, 2 * rank + 2)
    # Canonical names and global shapes; the local shard is this rank's experts.
    sd, ref_sd = ep.state_dict(), ref.state_dict()
    assert list(sd) == list(ref_sd)
    assert all(sd[k].shape == ref_sd[k].shape for k in sd)
    torch.testing.assert_close(ep.experts.w2.to_local(), ref.experts.w2[2 * rank : 2 * rank + 2])

    same = _tokens(1)
    _compare(ref, ep, [same] * world_size, rank)
    _compare(ref, ep, [_tokens(10 + r) for r in range(world_size)], rank)


def _check_uneven(rank: int, world_size: int, tmp: Path) -> None:
    for capacity_factor in (None, 1.0):
        ref = _reference(MoEConfig(num_experts=4, top_k=1, capacity_factor=capacity_factor))
        with torch.no_grad():  # every token to expert 3 (on rank 1): rank 0's experts idle
            ref.router.weight.zero_()
            ref.router.weight[3, 0] = 1.0
        ep = apply_expert_parallel(copy.deepcopy(ref), dist.group.WORLD)
        inputs = []
        for r in range(world_size):
            x, cot = _tokens(20 + r)
            x[..., 0] = x[..., 0].abs() + 1
            inputs.append((x, cot))
        _compare(ref, ep, inputs, rank)
        assert int(ep.tokens_per_expert[3]) == TOKENS * world_size
        assert (int(ep.num_dropped) > 0) == (capacity_factor is not None)


@pytest.mark.dist
def test_expert_parallel_matches_reference(tmp_path: Path) -> None:
    run_distributed(_check_matches_reference, 2, tmp_path)


@pytest.mark.dist
def test_expert_parallel_uneven_routing(tmp_path: Path) -> None:
    run_distributed(_check_uneven, 2, tmp_path)
