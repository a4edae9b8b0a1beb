"""The bf16 states' rounding seeds read each DTensor shard's offset in the whole tensor
(`adamw_bf16._offset`); it is computed once per parameter, not at every step, and is the
offset DTensor's own helper gives."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.distributed import run_distributed


def _offset_worker(rank: int, world_size: int, tmp: Path) -> dict:
    import torch
    import torch.distributed.tensor._utils as dtensor_utils
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from pipeline.train.optimizers.adamw_bf16 import AdamWBF16, _offset

    helper, calls = dtensor_utils.compute_local_shape_and_global_offset, []

    def counted(*args, **kwargs):
        calls.append(1)
        return helper(*args, **kwargs)

    dtensor_utils.compute_local_shape_and_global_offset = counted
    mesh = init_device_mesh("cpu", (world_size,))
    torch.manual_seed(0)
    params = [
        torch.nn.Parameter(distribute_tensor(torch.randn(4, 3), mesh, [Shard(0)])) for _ in range(2)
    ]
    optimizer = AdamWBF16(params, lr=1e-2, seed=7)
    for _ in range(3):
        for p in params:
            p.grad = distribute_tensor(torch.randn(4, 3), mesh, [Shard(0)])
        optimizer.step()
    offsets = [_offset(p) for p in params]
    expected = [tuple(helper(p.shape, p.device_mesh, p.placements)[1]) for p in params]
    return {"calls": len(calls), "offsets": offsets, "expected": expected}


@pytest.mark.dist
def test_a_shard_offset_is_computed_once_per_parameter(tmp_path: Path) -> None:
    for rank, result in enumerate(run_distributed(_offset_worker, 2, tmp_path)):
        assert result["calls"] == 2  # two parameters, three steps each
        assert result["offsets"] == result["expected"] == [(2 * rank, 0)] * 2
