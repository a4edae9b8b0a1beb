"""FSDP2 / replicated data parallelism against the single-process reference (gloo, world 2, fp32).

Each rank builds the model on `meta`, applies `apply_fsdp`, materialises it, loads the
reference's initial weights and takes one AdamW step on its half of the global batch; the
single-process reference takes the same step on the whole batch with the real `train_step`.
The two ranks hold different numbers of loss tokens on purpose: only a denominator that is the
*global* token count (`global_token_count`) makes dp=2 equal dp=1.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from pipeline.checkpoint import (
    load,
    load_model_and_optimizer_state,
    model_and_optimizer_state,
    save,
)
from pipeline.core.model.config import ModelConfig
from pipeline.core.model.transformer import Transformer
from tests.builders import lm_runner, micro_model_config
from tests.distributed import run_distributed

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

TOL = 1e-6  # state tolerance: parameters, optimizer state, loss
LR = 1e-3
SEQ = 8
GLOBAL_BATCH = 4  # sequences; each rank gets 2, as 2 micro-batches of 1


def _config(tied: bool) -> ModelConfig:
    return micro_model_config(max_position_embeddings=SEQ, tie_word_embeddings=tied)


def _reference_model(tied: bool) -> Transformer:
    """The plain single-process model, with weights fixed by the seed."""
    torch.manual_seed(0)
    model = Transformer(_config(tied))
    model.init_weights()
    return model


def _global_batch() -> list[dict[str, torch.Tensor]]:
    """GLOBAL_BATCH one-sequence micro-batches; the loss masks give the ranks unequal token
    counts (rank 0: 8 + 7, rank 1: 3 + 8), so a local denominator would be wrong."""
    generator = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 128, (GLOBAL_BATCH, SEQ + 1), generator=generator)
    kept = [8, 7, 3, 8]
    batches = []
    for row, keep in enumerate(kept):
        mask = torch.zeros(1, SEQ)
        mask[0, :keep] = 1.0
        batches.append(
            {
                "tokens": tokens[row : row + 1, :-1],
                "labels": tokens[row : row + 1, 1:],
                "loss_mask": mask,
                "position_ids": torch.arange(SEQ).unsqueeze(0),
            }
        )
    return batches


def _optimizer(model: torch.nn.Module) -> tuple[torch.optim.Optimizer, Any]:
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, betas=(0.9, 0.95), weight_decay=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    return optimizer, scheduler


def _full(value: Any) -> Any:
    """A nested state with every DTensor replaced by its full (gathered) plain tensor."""
    from torch.distributed.tensor import DTensor

    if isinstance(value, dict):
        return {key: _full(item) for key, item in value.items()}
    if isinstance(value, DTensor):
        return value.full_tensor().detach().clone()
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    return value


def _assert_state_close(actual: dict, expected: dict, where: str) -> None:
    assert actual.keys() == expected.keys(), where
    for key, value in expected.items():
        if isinstance(value, dict):
            _assert_state_close(actual[key], value, f"{where}.{key}")
        elif isinstance(value, torch.Tensor):
            torch.testing.assert_close(
                actual[key], value, rtol=0, atol=TOL, msg=lambda m, k=key: f"{where}.{k}: {m}"
            )
        else:
            assert actual[key] == value, f"{where}.{key}"


def _dp_step(model, optimizer, scheduler, micro_batches, dp_group):
    """The real `train_step` under data parallelism: (global loss, grad norm)."""
    from pipeline.train.loop.train_step import train_step

    step = train_step(
        model,
        optimizer,
        scheduler,
        micro_batches,
        clip_grad=1.0,
        dp_group=dp_group,
        runner=lm_runner(model),
    )
    return step.loss, step.grad_norm


def _fsdp_model(tied: bool, mesh, **kwargs) -> Transformer:
    """Meta build -> apply_fsdp -> to_empty -> init_weights."""
    from pipeline.core.parallel.fsdp import apply_fsdp

    with torch.device("meta"):
        model = Transformer(_config(tied))
    apply_fsdp(model, mesh, **kwargs)
    model.to_empty(device="cpu")
    model.init_weights()
    return model


def _parity_worker(rank: int, world_size: int, tmp: Path) -> list[str]:
    """Every layout against the single-process step; returns the layouts checked."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    from pipeline.core.parallel.fsdp import copy_full_weights_
    from pipeline.train.loop.train_step import train_step

    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("dp",))
    group = mesh.get_group()
    batches = _global_batch()
    mine = batches[rank * 2 : rank * 2 + 2]
    checked = []
    for tied in (True, False):
        reference = _reference_model(tied)
        initial = {k: v.clone() for k, v in reference.state_dict().items()}
        ref_opt, ref_sched = _optimizer(reference)
        expected = train_step(
            reference, ref_opt, ref_sched, batches, clip_grad=1.0, runner=lm_runner(reference)
        )
        layouts = [("fsdp", True), ("fsdp", False), ("replicate", True)]
        for mode, reshard in layouts:
            model = _fsdp_model(tied, mesh, mode=mode, reshard_after_forward=reshard)
            weight = model.tok_embeddings.weight
            assert isinstance(weight, DTensor) and weight.device.type == "cpu"
            assert (model.output.weight is weight) == tied, "tying changed by sharding"
            copy_full_weights_(model, initial)
            optimizer, scheduler = _optimizer(model)
            loss, norm = _dp_step(model, optimizer, scheduler, mine, group)
            name = f"tied={tied} mode={mode} reshard={reshard}"
            assert abs(loss - expected.loss) < TOL, (name, loss, expected.loss)
            assert abs(norm - expected.grad_norm) < 1e-5, (name, norm, expected.grad_norm)
            _assert_state_close(_full(model.state_dict()), reference.state_dict(), name)
            assert (model.output.weight is model.tok_embeddings.weight) == tied, name
            checked.append(name)
        # Without the dp group the denominator is the local token count: the wrong gradient
        # (here its norm is off by tens of percent), which is what dp_group is for.
        model = _fsdp_model(tied, mesh)
        copy_full_weights_(model, initial)
        optimizer, scheduler = _optimizer(model)
        unchanged = train_step(
            model, optimizer, scheduler, mine, clip_grad=1.0, runner=lm_runner(model)
        )
        assert abs(unchanged.grad_norm - expected.grad_norm) > 0.1 * expected.grad_norm
    dist.barrier()
    return checked


@pytest.mark.dist
def test_fsdp_step_equals_single_process(tmp_path: Path) -> None:
    results = run_distributed(_parity_worker, 2, tmp_path)
    assert results[0] == results[1] and len(results[0]) == 6


def _trained_single(tied: bool) -> tuple[Transformer, torch.optim.Optimizer]:
    """A plain model and AdamW after one step on the whole batch (non-trivial optimizer state)."""
    from pipeline.train.loop.train_step import train_step

    model = _reference_model(tied)
    optimizer, scheduler = _optimizer(model)
    train_step(model, optimizer, scheduler, _global_batch(), clip_grad=1.0, runner=lm_runner(model))
    return model, optimizer


def _checkpoint_worker(rank: int, world_size: int, tmp: Path) -> None:
    """Load the single-process checkpoint into FSDP, then train one FSDP step from it and save
    under FSDP; each rank writes both states, gathered, to `rank<r>.pt` (tensors do not travel
    back through the harness's queue once the process has exited)."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("dp",))
    model = _fsdp_model(True, mesh)
    optimizer, scheduler = _optimizer(model)
    state = model_and_optimizer_state(model, optimizer)
    load(tmp / "single", state=state)
    load_model_and_optimizer_state(model, optimizer, state)
    loaded = _full(model_and_optimizer_state(model, optimizer))
    _dp_step(
        model,
        optimizer,
        scheduler,
        _global_batch()[rank::2],
        mesh.get_group(),
    )
    state = model_and_optimizer_state(model, optimizer)
    save(tmp / "fsdp", 2, state, {"layout": {"dp_shard": world_size}})
    torch.save({"loaded": loaded, "saved": _full(state)}, tmp / f"rank{rank}.pt")


@pytest.mark.dist
def test_checkpoint_relayout_single_to_fsdp_and_back(tmp_path: Path) -> None:
    model, optimizer = _trained_single(True)
    single_state = _full(model_and_optimizer_state(model, optimizer))
    save(tmp_path / "single", 1, model_and_optimizer_state(model, optimizer), {})

    run_distributed(_checkpoint_worker, 2, tmp_path)
    results = [torch.load(tmp_path / f"rank{rank}.pt") for rank in range(2)]
    assert single_state["optimizer"]  # AdamW state is there to compare
    for result in results:  # single process -> FSDP world 2: identical model and AdamW state
        _assert_state_close(result["loaded"], single_state, "single->fsdp")

    fresh = _reference_model(True)
    fresh_optimizer, _ = _optimizer(fresh)
    state = model_and_optimizer_state(fresh, fresh_optimizer)
    assert load(tmp_path / "fsdp", state=state)["layout"] == {"dp_shard": 2}
    load_model_and_optimizer_state(fresh, fresh_optimizer, state)
    _assert_state_close(
        _full(model_and_optimizer_state(fresh, fresh_optimizer)),
        results[0]["saved"],
        "fsdp->single",
    )
    assert fresh.output.weight is fresh.tok_embeddings.weight


def test_global_token_count_and_mode_check_single_process() -> None:
    from pipeline.core.parallel.fsdp import apply_fsdp, global_token_count

    assert global_token_count(torch.tensor(7.0), None) == 7.0
    assert global_token_count(3, None) == 3.0
    with pytest.raises(ValueError, match="mode"):
        apply_fsdp(torch.nn.Linear(2, 2), None, mode="ddp")  # type: ignore[arg-type]
