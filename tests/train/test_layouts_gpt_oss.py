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


def _worker(rank: int, world_size: int, tmp: Path) -> dict:
    out = {}
    for name, extra in LAYOUTS.items():
        result = train_and_probe(RECIPE, layout_sets(RECIPE, tmp / name, *extra))
        if not result.pop("first_of_stage"):
            result.pop("grads")
        out[name] = result
    return out


def test_gpt_oss_layouts_equal_one_device(tmp_path: Path) -> None:
    reference = train_and_probe(RECIPE, layout_sets(RECIPE, tmp_path / "single"))
    names = set(reference["grads"])
    for name in ("layers.0.attention.sinks", "layers.3.moe.experts.b2", "layers.1.moe.router.bias"):
        assert name in names, name
    per_rank = run_distributed(_worker, 2, tmp_path)
    for layout in LAYOUTS:
        grads: dict[str, torch.Tensor] = {}
        for result in (r[layout] for r in per_rank):
            for step, loss in reference["losses"].items():
                assert result["losses"][step] == pytest.approx(loss, rel=REL), (layout, step)
            assert result["probe"] == pytest.approx(reference["probe"], rel=REL), layout
            for param, grad in result.get("grads", {}).items():
                assert param not in grads, f"{layout}: {param} reported by two stages"
                grads[param] = grad
        assert grads.keys() == names, layout
        for param, grad in reference["grads"].items():
            torch.testing.assert_close(
                grads[param], grad, atol=GRAD_ATOL, rtol=GRAD_RTOL, msg=f"{layout} {param}"
            )
