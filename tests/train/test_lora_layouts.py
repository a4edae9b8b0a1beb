"""A LoRA run equals one device under tp2 (with and without sequence parallelism), fsdp dp2,
pp2, ep2 and cp2 (gloo, fp32, CPU): the losses of every step and the adapters' gradients of one
more global batch. One spawn of 2 processes for all layouts, on `tiny_moe` shrunk to the layout
tests' micro model with adapters on every projection, experts included; and DeepSeek-V3's
latent attention under tp2 with sequence parallelism."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.builders import layout_sets
from tests.distributed import run_distributed

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

REL = 1e-4
MLA = "tiny_deepseek_v3"  # latent attention: adapters on q_a, q_b, kv_a, kv_b and shared experts
LORA = ["lora.enabled=true", "lora.rank=4", "lora.alpha=8", "optimizer.lr=0.01"]
LAYOUTS = {
    "tp2": ["parallel.tp=2", "parallel.sequence_parallel=false"],
    "tp2_sp": ["parallel.tp=2"],
    "dp2": ["parallel.dp=2"],
    "pp2": ["parallel.pp=2"],
    "ep2": ["parallel.ep=2"],
    "cp2": ["parallel.cp=2"],
}


def _train_and_probe(run: Path, *extra: str, recipe: str = "tiny_moe") -> dict:
    """Train the LoRA micro run, then the adapters' gradients of the first batch again (full
    tensors; every rank calls this, gathering DTensors)."""
    from torch.distributed.tensor import DTensor

    from pipeline.train.assembly.run_config import resolve_config
    from pipeline.train.loop.trainer import Trainer
    from tests.builders import _probe_gradients

    trainer = Trainer(
        resolve_config(recipe, layout_sets(recipe, run, *LORA, *extra, save=False)), console=False
    )
    losses = trainer.train().losses
    _probe_gradients(trainer)
    grads = {}
    for name, param in trainer.model.named_parameters():
        if param.requires_grad:
            grad = param.grad
            grads[name] = (grad.full_tensor() if isinstance(grad, DTensor) else grad).clone()
        else:
            assert param.grad is None, name
    keep = trainer.layout.rank == trainer.layout.first_rank_of_stage
    return {"losses": losses, "grads": grads if keep else {}}


def _worker(rank: int, world_size: int, tmp: Path) -> dict:
    out = {name: _train_and_probe(tmp / name, *extra) for name, extra in LAYOUTS.items()}
    out["mla_tp2_sp"] = _train_and_probe(tmp / "mla", "parallel.tp=2", recipe=MLA)
    return out


@pytest.mark.dist
def test_lora_layouts_equal_one_device(tmp_path: Path) -> None:
    reference = _train_and_probe(tmp_path / "single")
    assert any("experts.lora" in n for n in reference["grads"])
    mla = _train_and_probe(tmp_path / "mla_single", recipe=MLA)
    assert any("wkv_a.lora_A" in n for n in mla["grads"])
    per_rank = run_distributed(_worker, 2, tmp_path)
    for name in [*LAYOUTS, "mla_tp2_sp"]:
        ref = mla if name == "mla_tp2_sp" else reference
        grads = {}
        for result in (r[name] for r in per_rank):
            for step, loss in ref["losses"].items():
                assert result["losses"][step] == pytest.approx(loss, rel=REL), (name, step)
            grads.update(result["grads"])
        assert grads.keys() == ref["grads"].keys(), name
        for param, grad in ref["grads"].items():
            torch.testing.assert_close(
                grads[param], grad, atol=1e-6, rtol=1e-4, msg=f"{name} {param}"
            )
