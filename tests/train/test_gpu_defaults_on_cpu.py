"""The GPU's defaults (torch.compile, bf16; FP8 on request) under the parallel layouts, on a CPU.

A GPU session is short, so what a CPU can find must be found here: each layout below trains the
micro model of the layout tests (`tests.builders.layout_sets`, `train_and_probe`) with
`training.compile=true` and `training.dtype=bf16` (real CPU bf16 autocast; FSDP2 gathers bf16
parameters and reduces fp32 gradients) on gloo processes, and is compared with the
single-process run under the same settings: tp2 with sequence parallelism, fsdp dp2, cp2, ep2
(`tiny_moe`), tp2 x pp2, and torchao FP8 (emulated on the CPU) under fsdp dp2 and tp2.

Tolerances. In fp32 layouts differ only in summation order (1e-5 in `test_layouts.py`). In bf16
every matmul output and every attention / MLP activation is rounded to 8 significant bits
(relative step 2**-8 = 0.4%), and a different summation order can move a value across a
rounding boundary, after which the one-ulp difference propagates through the later layers and
three optimizer steps. Losses (means over 256 tokens, where such differences average out)
agree to LOSS_REL = 1e-2; gradients, which are sums of bf16-rounded products, agree to
GRAD_ATOL = 2e-3 absolute (gradients here are of order 1e-2 to 1) plus GRAD_RTOL = 5e-2
relative. A real layout bug (a missing reduction, a gradient lost at a compile boundary) moves
losses by tens of percent and gradients by their own size, far outside these bounds.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import torch

from tests.builders import layout_sets, train_and_probe
from tests.distributed import run_distributed

pytest.importorskip("torchao")

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

LOSS_REL = 1e-2
GRAD_ATOL = 2e-3
GRAD_RTOL = 5e-2

BACKEND = "aot_eager"
GPU_DEFAULTS = ["training.compile=true", "training.dtype=bf16"]
FP8 = ["fp8.recipe=torchao:tensorwise", "fp8.linear_filter=all", "fp8.emulate=true"]

# (recipe, name, extra settings); names starting with "fp8" run under CPU FP8 emulation.
LAYOUTS = {
    2: [
        ("tiny", "tp2", ["parallel.tp=2", "parallel.sequence_parallel=false"]),
        ("tiny", "tp2_sp", ["parallel.tp=2"]),
        ("tiny", "dp2", ["parallel.dp=2"]),
        ("tiny", "cp2", ["parallel.cp=2"]),
        ("tiny_moe", "ep2", ["parallel.ep=2"]),
        ("tiny", "fp8_dp2", [*FP8, "parallel.dp=2"]),
        ("tiny", "fp8_tp2_sp", [*FP8, "parallel.tp=2"]),
    ],
    4: [("tiny", "tp2_pp2", ["parallel.tp=2", "parallel.pp=2"])],
}
REFERENCES = {"tiny": [], "tiny_moe": [], "fp8": FP8}


def _reference_key(recipe: str, name: str) -> str:
    return "fp8" if name.startswith("fp8") else recipe


@contextlib.contextmanager
def _compile_backend(backend: str) -> Iterator[None]:
    """Make `nn.Module.compile` (what `parallelize` calls on each block) use `backend`."""
    compile_module = torch.nn.Module.compile

    def compile_with_backend(module: torch.nn.Module, *args: Any, **kwargs: Any) -> None:
        compile_module(module, *args, **{"backend": backend, **kwargs})

    with mock.patch.object(torch.nn.Module, "compile", compile_with_backend):
        yield


def _run(recipe: str, name: str, run_dir: Path, extra: list[str]) -> dict:
    """Train one layout with the GPU defaults; a fresh dynamo cache so every layout compiles
    (rather than hitting the recompile limit and silently running eager)."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    with _compile_backend(BACKEND):
        result = train_and_probe(
            recipe, layout_sets(recipe, run_dir, *GPU_DEFAULTS, *extra, save=False)
        )
    result["compiled_graphs"] = counters["stats"]["unique_graphs"]
    torch._dynamo.reset()
    return result


def _fsdp_gathered_dtype(run_dir: Path) -> torch.dtype:
    """The dtype FSDP2 gathers a block's weights in, for a bf16 dp2 run."""
    from pipeline.train.assembly.run_config import resolve_config
    from pipeline.train.loop.trainer import Trainer

    sets = layout_sets("tiny", run_dir, "training.dtype=bf16", "parallel.dp=2")
    block = Trainer(resolve_config("tiny", sets), console=False).model.layers["0"]
    block.unshard()
    dtype = block.attention.wq.weight.dtype
    block.reshard()
    return dtype


def _worker(rank: int, world_size: int, tmp: Path, layouts: list) -> dict:
    out: dict = {}
    if world_size == 2:
        out["fsdp_gathered_dtype"] = _fsdp_gathered_dtype(tmp / "gather")
    for recipe, name, extra in layouts:
        result = _run(recipe, name, tmp / name, extra)
        if not result.pop("first_of_stage"):
            result.pop("grads")
        out[name] = result
    return out


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    """The single-process run of each recipe under the GPU defaults (and with FP8)."""
    tmp = tmp_path_factory.mktemp("single_gpu_defaults")
    out = {}
    for key, extra in REFERENCES.items():
        recipe = "tiny_moe" if key == "tiny_moe" else "tiny"
        name = key if key == "fp8" else "single"
        result = _run(recipe, name, tmp / key, extra)
        result.pop("first_of_stage")
        out[key] = result
    return out


def _assert_close_to_reference(per_rank: list[dict], reference: dict, layouts: list) -> None:
    for result in per_rank:  # bf16 runs gather bf16 parameters (gradients reduce in fp32)
        assert result.get("fsdp_gathered_dtype", torch.bfloat16) == torch.bfloat16
    for recipe, name, _ in layouts:
        ref = reference[_reference_key(recipe, name)]
        grads: dict[str, torch.Tensor] = {}
        for result in (r[name] for r in per_rank):
            assert result["compiled_graphs"] > 0, f"{name}: nothing was compiled"
            assert result["losses"].keys() == ref["losses"].keys(), name
            for step, loss in ref["losses"].items():
                assert result["losses"][step] == pytest.approx(loss, rel=LOSS_REL), (name, step)
            assert result["probe"] == pytest.approx(ref["probe"], rel=LOSS_REL), name
            grads.update(result.get("grads", {}))
        assert grads.keys() == ref["grads"].keys(), name
        for param, grad in ref["grads"].items():
            torch.testing.assert_close(
                grads[param], grad, atol=GRAD_ATOL, rtol=GRAD_RTOL, msg=f"{name} {param}"
            )


@pytest.mark.dist
@pytest.mark.parametrize("world_size", [2, 4])
def test_gpu_defaults_match_one_device(tmp_path: Path, reference: dict, world_size: int) -> None:
    layouts = LAYOUTS[world_size]
    per_rank = run_distributed(_worker, world_size, tmp_path, layouts)
    _assert_close_to_reference(per_rank, reference, layouts)


def test_bf16_on_a_cpu_is_real_and_says_so(tmp_path: Path, caplog) -> None:
    """training.dtype = bf16 on a CPU computes in bf16 (its loss is not the fp32 one), with a
    one-line warning; fp32 stays what the CPU recipes ask for."""
    import logging

    from pipeline.train.assembly.run_config import resolve_config
    from pipeline.train.loop.trainer import Trainer

    def first_loss(dtype: str) -> float:
        sets = layout_sets("tiny", tmp_path / dtype, f"training.dtype={dtype}", "training.iters=1")
        return Trainer(resolve_config("tiny", sets), console=False).train().losses[1]

    with caplog.at_level(logging.WARNING, logger="pipeline.train"):
        bf16 = first_loss("bf16")
    notices = [r.getMessage() for r in caplog.records if "bf16" in r.getMessage()]
    assert notices == ["training.dtype = bf16 on a CPU: real bf16 compute, slower than fp32 here"]
    fp32 = first_loss("fp32")
    assert bf16 != fp32
    assert bf16 == pytest.approx(fp32, rel=LOSS_REL)
    assert resolve_config("tiny", []).training.dtype == "fp32"
