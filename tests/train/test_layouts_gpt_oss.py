"""gpt-oss's options under every parallel layout of `pipe train` equal one device (gloo, fp32,
CPU), with the machinery of `tests/train/test_layouts.py`: the `tiny_gpt_oss` recipe shrunk to
the layout tests' micro model (4 layers, sliding window 8 over sequences of 32, sinks, q/k/v/o
biases, 8 experts with biases and the clamped SwiGLU under a biased router) trains 3 steps under
each layout, then takes the gradients of one more global batch; losses agree to REL and every
parameter's gradient (sinks and expert biases included) to GRAD_ATOL + GRAD_RTOL.

* tp2 (with and without sequence parallelism): sinks split with their heads, the o_proj bias
  added once after the row-parallel sum;
* cp2: each query's window over the global positions of the whole sequence, keys gathered from
  the other rank;
* pp2: two layers (a sliding and a full one) per stage;
* ep2: the expert biases split with their experts.

`tiny_smollm3` (no RoPE in two of the layers, which also slide, q/k/v/o biases, dense) and
`tiny_seed_oss` (q/k/v biases without an o_proj bias, head_dim 16 over a hidden size of 32 in
4 heads) run tp2, cp2 and pp2 the same way.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.builders import layout_sets, train_and_probe
from tests.distributed import run_distributed

pytestmark = [pytest.mark.filterwarnings("ignore::UserWarning"), pytest.mark.dist]

RECIPE = "tiny_gpt_oss"
REL = 1e-5
GRAD_ATOL = 1e-6
GRAD_RTOL = 1e-4
LAYOUTS = {
    "tp2": ["parallel.tp=2", "parallel.sequence_parallel=false"],
    "tp2_sp": ["parallel.tp=2"],
    "cp2": ["parallel.cp=2"],
    "pp2": ["parallel.pp=2", "parallel.pipeline_schedule=1F1B"],
    "ep2": ["parallel.ep=2"],
}


SMOLLM3 = "tiny_smollm3"
SEED_OSS = "tiny_seed_oss"
DENSE_LAYOUTS = ("tp2", "cp2", "pp2")


def _runs() -> list[tuple[str, str]]:
    dense = [(recipe, name) for recipe in (SMOLLM3, SEED_OSS) for name in DENSE_LAYOUTS]
    return [(RECIPE, name) for name in LAYOUTS] + dense


def _worker(rank: int, world_size: int, tmp: Path) -> dict:
    out = {}
    for recipe, name in _runs():
        sets = layout_sets(recipe, tmp / f"{recipe}_{name}", *LAYOUTS[name], save=False)
        result = train_and_probe(recipe, sets)
        if not result.pop("first_of_stage"):
            result.pop("grads")
        out[(recipe, name)] = result
    return out


def test_gpt_oss_smollm3_and_seed_oss_layouts_equal_one_device(tmp_path: Path) -> None:
    references = {
        recipe: train_and_probe(
            recipe, layout_sets(recipe, tmp_path / f"{recipe}_single", save=False)
        )
        for recipe in (RECIPE, SMOLLM3, SEED_OSS)
    }
    names = set(references[RECIPE]["grads"])
    for name in ("layers.0.attention.sinks", "layers.3.moe.experts.b2", "layers.1.moe.router.bias"):
        assert name in names, name
    assert "layers.3.attention.wo.bias" in references[SMOLLM3]["grads"]
    seed_oss = references[SEED_OSS]["grads"]
    assert "layers.3.attention.wq.bias" in seed_oss and "layers.3.attention.wo.bias" not in seed_oss
    assert seed_oss["layers.3.attention.wq.weight"].shape == (4 * 16, 32)
    per_rank = run_distributed(_worker, 2, tmp_path)
    for recipe, layout in _runs():
        reference = references[recipe]
        names = set(reference["grads"])
        grads: dict[str, torch.Tensor] = {}
        for result in (r[(recipe, layout)] for r in per_rank):
            for step, loss in reference["losses"].items():
                assert result["losses"][step] == pytest.approx(loss, rel=REL), (
                    recipe,
                    layout,
                    step,
                )
            assert result["probe"] == pytest.approx(reference["probe"], rel=REL), (recipe, layout)
            for param, grad in result.get("grads", {}).items():
                assert param not in grads, f"{layout}: {param} reported by two stages"
                grads[param] = grad
        assert grads.keys() == names, (recipe, layout)
        for param, grad in reference["grads"].items():
            torch.testing.assert_close(
                grads[param], grad, atol=GRAD_ATOL, rtol=GRAD_RTOL, msg=f"{recipe} {layout} {param}"
            )
