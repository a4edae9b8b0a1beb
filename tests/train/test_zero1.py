"""ZeRO-1 (`parallel.dp_mode = "zero1"`, Megatron's distributed optimizer) equals one device
under dp2, dp2 x tp2, dp2 x pp2, dp2 x cp2 and, for experts, ep2 over dp4 (the layout tests'
micro runs and comparison, `tests/train/test_layouts.py`); its checkpoint resumes in one
process; its optimizer state per rank is half of plain replication's at dp2, as the dry run's
estimate says; and it communicates once a step (one reduce-scatter, one all-gather)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pipeline.train.assembly.run_config import resolve_config
from pipeline.train.loop.trainer import Trainer
from tests.builders import layout_sets as _sets
from tests.builders import train_and_probe as _train_and_probe
from tests.distributed import run_distributed
from tests.train.test_layouts import (
    _assert_equal_to_reference,
    _assert_resumes_in_one_process,
    _layout_worker,
)

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

ZERO1 = "parallel.dp_mode=zero1"
LAYOUTS = {
    2: [("tiny", "dp2_zero1", ["parallel.dp=2", ZERO1])],
    4: [
        ("tiny", "dp2_tp2_zero1", ["parallel.dp=2", "parallel.tp=2", ZERO1]),
        # Megatron's name for the mode.
        (
            "tiny",
            "dp2_pp2_zero1",
            ["parallel.dp=2", "parallel.pp=2", "parallel.dp_mode=distributed_optimizer"],
        ),
        ("tiny", "dp2_cp2_zero1", ["parallel.dp=2", "parallel.cp=2", ZERO1]),
        ("tiny_moe", "ep2_dp4_zero1", ["parallel.ep=2", ZERO1]),
    ],
}


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    """The single-process runs of the recipes the layouts use."""
    tmp = tmp_path_factory.mktemp("single")
    out = {}
    for recipe in ("tiny", "tiny_moe"):
        result = _train_and_probe(recipe, _sets(recipe, tmp / recipe))
        result.pop("first_of_stage")
        out[recipe] = result
    return out


@pytest.mark.dist
@pytest.mark.parametrize("world_size", [2, 4])
def test_zero1_equals_one_device(tmp_path: Path, reference: dict, world_size: int) -> None:
    layouts = LAYOUTS[world_size]
    per_rank = run_distributed(_zero1_worker, world_size, tmp_path, layouts)
    assert len(_assert_equal_to_reference([r["layouts"] for r in per_rank], reference)) == len(
        layouts
    )
    if world_size == 2:
        _assert_resumes_in_one_process(tmp_path, "tiny", "dp2_zero1")
        _assert_half_the_optimizer_state(per_rank)


def _zero1_worker(rank: int, world_size: int, tmp: Path, layouts: list) -> dict:
    out = {"layouts": _layout_worker(rank, world_size, tmp, layouts, {("tiny", "dp2_zero1")})}
    if world_size == 2:
        for mode in ("replicate", "zero1"):
            out[mode] = _optimizer_state_bytes(tmp / f"bytes_{mode}", mode)
    return out


def _optimizer_state_bytes(run_dir: Path, mode: str) -> tuple[int, float]:
    """(bytes of this rank's optimizer state after a step, the dry run's estimate) of the micro
    `tiny` run under dp2 in `mode`. The state counted is AdamW's two moments (the tensors of a
    parameter's shape; the step counters are not state bytes per parameter)."""
    from torch.distributed.tensor import DTensor

    from pipeline.train.report.estimates import estimate_memory

    sets = _sets("tiny", run_dir, "parallel.dp=2", f"parallel.dp_mode={mode}", "training.iters=1")
    sets.append("checkpoint.enable=false")
    cfg = resolve_config("tiny", sets)
    trainer = Trainer(cfg, console=False)
    trainer.train()
    measured = 0
    for state in trainer.optimizer.state.values():
        for key in ("exp_avg", "exp_avg_sq"):
            value = state[key]
            local = value.to_local() if isinstance(value, DTensor) else value
            measured += local.numel() * local.element_size()
    return measured, estimate_memory(cfg, cfg.model_config(), world_size=2).optimizer_state


def _assert_half_the_optimizer_state(per_rank: list[dict]) -> None:
    for result in per_rank:
        replicated, replicated_estimate = result["replicate"]
        zero1, zero1_estimate = result["zero1"]
        assert zero1 * 2 == replicated
        assert (zero1, replicated) == (zero1_estimate, replicated_estimate)


def _collectives_per_step(run_dir: Path) -> dict[str, int]:
    """The reduce-scatters and all-gathers of one ZeRO-1 step of 2 micro-batches a rank after
    the first (which gathers the initial weights in its forward): one of each per FSDP unit."""
    import torch.distributed as dist

    sets = _sets("tiny", run_dir, "parallel.dp=2", ZERO1, "training.iters=2")
    sets.append("checkpoint.enable=false")
    trainer = Trainer(resolve_config("tiny", sets), console=False)
    iterator = iter(trainer.train_loader)
    trainer.train_one_step(iterator)
    counts = {"reduce_scatter": 0, "all_gather": 0}
    # FSDP2's collectives (torch.distributed.fsdp._fully_shard._fsdp_collectives).
    originals = {
        "reduce_scatter": dist.reduce_scatter_single,
        "all_gather": dist.all_gather_single,
    }

    def counting(name):
        def call(*args, **kwargs):
            counts[name] += 1
            return originals[name](*args, **kwargs)

        return call

    dist.reduce_scatter_single = counting("reduce_scatter")
    dist.all_gather_single = counting("all_gather")
    try:
        trainer.train_one_step(iterator)
    finally:
        dist.reduce_scatter_single = originals["reduce_scatter"]
        dist.all_gather_single = originals["all_gather"]
    from torch.distributed.fsdp import FSDPModule

    units = sum(isinstance(m, FSDPModule) for m in trainer.model.modules())
    return {**counts, "units": units}


@pytest.mark.dist
def test_zero1_communicates_once_a_step(tmp_path: Path) -> None:
    """Two micro-batches a rank: each FSDP unit reduce-scatters once (the last backward) and
    all-gathers once (after the optimizer step); plain FSDP does both per micro-batch."""
    per_rank = run_distributed(_count_worker, 2, tmp_path)
    for counts in per_rank:
        assert counts["units"] > 1
        assert counts["reduce_scatter"] == counts["units"], counts
        assert counts["all_gather"] == counts["units"], counts


def _count_worker(rank: int, world_size: int, tmp: Path) -> dict[str, int]:
    return _collectives_per_step(tmp)


def test_dp_mode_names() -> None:
    """zero1 and Megatron's distributed_optimizer are accepted; anything else is refused in one
    line naming the modes."""
    from pipeline.core.parallel.layout_rules import canonical_dp_mode
    from pipeline.train.config.schema import ConfigError

    assert canonical_dp_mode("distributed_optimizer") == "zero1"
    assert canonical_dp_mode("zero1") == "zero1"
    assert canonical_dp_mode("fsdp") == "fsdp"
    sets = ["data.mock=true", "parallel.dp_mode=zero3"]
    with pytest.raises(ConfigError, match="parallel.dp_mode must be one of fsdp, replicate, zero1"):
        resolve_config("tiny", sets).validate(world_size=1)


def test_dry_run_knows_zero1() -> None:
    """The estimate: ZeRO-1 shards the optimizer state as FSDP does (half at dp2), replication
    none; ZeRO-1 holds whole compute weights and fp32 gradients beside its shards."""
    from pipeline.train.report.estimates import estimate_memory

    states = {}
    for mode in ("fsdp", "replicate", "zero1"):
        cfg = resolve_config("tiny", ["data.mock=true", f"parallel.dp_mode={mode}"])
        mem = estimate_memory(cfg, cfg.model_config(), world_size=2)
        states[mode] = (mem.optimizer_state, mem.state)
    params = sum(
        p.numel() for p in _meta_model(resolve_config("tiny", ["data.mock=true"])).parameters()
    )
    assert states["replicate"][0] == pytest.approx(8 * params)
    assert states["zero1"][0] == states["fsdp"][0] == pytest.approx(4 * params)
    # fsdp: 16 B/param over 2; replicate: 16; zero1: 16 over 2, plus 4 + 4 whole (fp32 compute).
    assert states["fsdp"][1] == pytest.approx(8 * params)
    assert states["replicate"][1] == pytest.approx(16 * params)
    assert states["zero1"][1] == pytest.approx(16 * params)


def _meta_model(cfg):
    from pipeline.core.model.transformer import Transformer

    with torch.device("meta"):
        return Transformer(cfg.model_config())
