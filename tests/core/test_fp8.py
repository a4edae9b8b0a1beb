"""FP8 training: recipe names, the linear filter, the refusals, and torchao's float8 numerics on
a CPU (`emulate`, `fp8.emulate = true`: real fp8 casts and scales, emulated GEMMs) against fp32,
on one device,
under tensor parallelism (torchao's float8 TP styles) and under FSDP2 with fp8 all-gather.

Tolerance: fp8 (e4m3 forward, e5m2 gradients) moves the micro model's loss (init std 0.2, so
activations are not tiny; four SGD steps on one batch, loss 5.3 -> 3.3) by 0.4% at the first
step and up to 1.2% at the fourth (measured, tensorwise); `FP8_RTOL` = 3e-2 leaves room for that,
while a wrong scale is off by far more (or NaN) and a dropped conversion is bit-equal to fp32,
which each test rules out (the fp8 losses must differ from fp32's). The parallel fp8 runs match the
single-device fp8 run to `PARALLEL_RTOL` under tensor parallelism (the same casts, only fp32
sums reordered; measured 1e-7). Under FSDP2 each rank casts its own half batch, so activation
scales differ from one device's (measured 0.6%, within `FP8_RTOL`); the fp8 all-gather of the
weights (one amax over the shards: the full weight's) must equal FSDP2's bf16-style gather of
the same fp8 model to `PARALLEL_RTOL`.
Transformer Engine is not installable here; its tests cover the refusals only.
"""

from __future__ import annotations

import sys

import pytest
import torch

from pipeline.core.kernels.fp8 import (
    FP8_RECIPES,
    build_fp8,
    check_fp8_device,
    high_precision_reason,
    normalize_recipe,
)
from tests.builders import micro_model_config
from tests.distributed import run_distributed

FP8_RTOL = 3e-2
PARALLEL_RTOL = 1e-4
STEPS, LR = 4, 0.1
SMALL = "small GEMM (faster in bf16)"

needs_torchao = pytest.mark.skipif(
    __import__("importlib").util.find_spec("torchao") is None,
    reason="torchao is not installed (pip install 'pipe-llm[fp8]'); the dev extra pins it",
)


def test_recipe_names_and_defaults():
    assert FP8_RECIPES == (
        "torchao:tensorwise",
        "torchao:rowwise",
        "torchao:rowwise_with_gw_hp",
        "te:delayed",
        "te:current",
    )
    assert normalize_recipe("torchao") == "torchao:tensorwise"
    assert normalize_recipe("te") == "te:delayed"
    assert normalize_recipe("torchao:rowwise") == "torchao:rowwise"
    with pytest.raises(ValueError, match="torchao has no 'delayed' scaling"):
        normalize_recipe("torchao:delayed")
    with pytest.raises(ValueError, match="unknown backend 'fp16'"):
        normalize_recipe("fp16")


@pytest.mark.parametrize(
    ("fqn", "shape", "scaling", "linear_filter", "expected"),
    [
        ("output", (4096, 128256), "tensorwise", "all", "output layer"),
        ("layers.0.moe.router", (4096, 16), "tensorwise", "all", "router"),
        ("layers.0.attention.wq", (4096, 4100), "tensorwise", "all", "dims not multiples of 16"),
        ("layers.0.attention.wq", (32, 32), "tensorwise", "all", None),
        # Llama 3 8B under "auto": tensorwise keeps k/v (in 4096, out 1024) in bf16 only.
        ("layers.0.attention.wk", (4096, 1024), "tensorwise", "auto", SMALL),
        ("layers.0.attention.wq", (4096, 4096), "tensorwise", "auto", None),
        ("layers.0.feed_forward.w2", (14336, 4096), "tensorwise", "auto", None),
        ("layers.0.attention.wq", (4096, 4096), "rowwise", "auto", None),
        ("layers.0.attention.wq", (2048, 2048), "rowwise", "auto", SMALL),
        ("layers.0.attention.wk", (4096, 1024), "rowwise", "auto", SMALL),
    ],
)
def test_filter_decisions(fqn, shape, scaling, linear_filter, expected):
    in_features, out_features = shape
    reason = high_precision_reason(
        fqn, in_features, out_features, scaling=scaling, linear_filter=linear_filter
    )
    assert reason == expected


def test_refusals_name_the_fix(monkeypatch):
    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)
    with pytest.raises(ValueError, match=r"needs a CUDA GPU; this run is on cpu \(fp8.emulate"):
        build_fp8("torchao:tensorwise", cpu)
    with pytest.raises(ValueError, match="FP8 emulation is for torchao recipes"):
        check_fp8_device("te:delayed", cpu, emulate=True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100-SXM4-80GB")
    with pytest.raises(ValueError, match=r"A100-SXM4-80GB has no FP8 \(compute capability 8.0"):
        build_fp8("torchao:rowwise", cuda)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    check_fp8_device("te:current", cuda)  # Hopper passes
    with pytest.raises(ValueError, match="Transformer Engine linears do not take our DTensor"):
        build_fp8("te:delayed", cuda, tp=2)
    # A missing backend package: one line with the install command.
    monkeypatch.setitem(sys.modules, "torchao.float8", None)
    with pytest.raises(ValueError, match=r"needs torchao: pip install 'pipe-llm\[fp8\]'"):
        build_fp8("torchao:tensorwise", cuda)
    monkeypatch.setitem(sys.modules, "transformer_engine.pytorch", None)
    with pytest.raises(ValueError, match=r"pip install 'transformer-engine\[pytorch\]'"):
        build_fp8("te:delayed", cuda)


def test_compile_is_on_by_default_on_cuda_only():
    from pipeline.train.assembly.parallelize import compile_enabled
    from pipeline.train.config.schema import TrainConfig

    assert TrainConfig().training.compile is None
    assert compile_enabled(None, "cuda") and not compile_enabled(None, "cpu")
    assert not compile_enabled(False, "cuda") and compile_enabled(True, "cpu")


# ---- numerics ------------------------------------------------------------------------------


def _batches(vocab: int, world_rank: int | None = None, world_size: int = 1):
    """One batch of 4 sequences x 16 tokens, STEPS times (so the loss must fall); a
    data-parallel rank takes its rows."""
    tokens = torch.randint(0, vocab, (4, 17), generator=torch.Generator().manual_seed(7))
    if world_rank is not None:
        tokens = tokens.chunk(world_size)[world_rank]
    return [(tokens[:, :-1], tokens[:, 1:])] * STEPS


def _build(recipe: str | None, config, *, fsdp: bool = False):
    """A materialised micro model (seeded init), converted for `recipe` first when given."""
    from pipeline.core.model.transformer import Transformer

    fp8 = build_fp8(recipe, torch.device("cpu"), emulate=True, linear_filter="all", fsdp=fsdp)
    with torch.device("meta"):
        model = Transformer(config)
    if fp8 is not None:
        fp8.convert(model)
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    model.init_weights()
    return model, fp8


def _train(model, fp8, batches, dp_group=None) -> list[float]:
    """SGD steps of the fused loss; the loss is normalised by the global token count."""
    import torch.distributed as dist

    from pipeline.core.parallel.fsdp import global_token_count
    from pipeline.core.parallel.tensor_parallel import tp_linear_cross_entropy

    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    for tokens, labels in batches:
        loss_sum, count = tp_linear_cross_entropy(model(tokens), model.output.weight, labels)
        total = global_token_count(count, dp_group)
        (loss_sum / total).backward()
        optimizer.step()
        optimizer.zero_grad()
        if fp8 is not None:
            fp8.after_optimizer_step([model])
        loss_sum = loss_sum.detach().clone()
        if dp_group is not None:
            dist.all_reduce(loss_sum, group=dp_group)
        losses.append(loss_sum.item() / total.item())
    return losses


@needs_torchao
@pytest.mark.parametrize(
    "recipe", ["torchao:tensorwise", "torchao:rowwise", "torchao:rowwise_with_gw_hp"]
)
def test_torchao_training_tracks_fp32(recipe):
    from torch import nn
    from torchao.float8.float8_linear import Float8Linear

    config = micro_model_config(init_method_std=0.2)
    model, fp8 = _build(recipe, config)
    assert type(model.output) is nn.Linear
    assert all(isinstance(m, Float8Linear) for n, m in model.named_modules() if ".w" in n[-3:])
    assert "14 linears in fp8, 1 high precision (1 output layer)" in fp8.describe()
    reference, _ = _build(None, config)
    fp8_losses = _train(model, fp8, _batches(config.vocab_size))
    fp32_losses = _train(reference, None, _batches(config.vocab_size))
    assert fp8_losses == pytest.approx(fp32_losses, rel=FP8_RTOL)
    assert fp8_losses != fp32_losses  # fp8 really ran
    assert fp8_losses[-1] < fp8_losses[0]


@needs_torchao
def test_router_and_output_stay_high_precision():
    from torch import nn

    from pipeline.core.model.config import MoEConfig
    from pipeline.core.model.transformer import Transformer

    config = micro_model_config(moe=MoEConfig(num_experts=4, top_k=2))
    fp8 = build_fp8("torchao:tensorwise", torch.device("cpu"), emulate=True, linear_filter="all")
    with torch.device("meta"):
        model = fp8.convert(Transformer(config))
    assert type(model.output) is nn.Linear
    assert type(model.layers["0"].moe.router) is nn.Linear
    assert type(model.layers["0"].attention.wq).__name__ == "Float8Linear"
    assert fp8.decisions["layers.1.moe.router"] == "router"


@needs_torchao
@pytest.mark.parametrize("recipe", ["torchao:tensorwise", "torchao:rowwise"])
def test_tensor_parallel_picks_float8_styles_for_tensorwise_only(recipe):
    """torchao's float8 TP styles (fp8 casts before the communication) need dynamic tensorwise
    scaling; rowwise and any high-precision linear use the plain DTensor styles."""
    from torch.distributed.tensor.parallel import ColwiseParallel

    from pipeline.core.model.transformer import Transformer
    from pipeline.core.parallel.tensor_parallel import _styles

    fp8 = build_fp8(recipe, torch.device("cpu"), emulate=True, linear_filter="all")
    with torch.device("meta"):
        block = fp8.convert(Transformer(micro_model_config())).layers["0"]
    colwise, rowwise, prepare = _styles(block, "attention.wq", "attention.wk", "attention.wv")
    if recipe.endswith("tensorwise"):
        assert (colwise.__name__, rowwise.__name__, prepare.__name__) == (
            "Float8ColwiseParallel",
            "Float8RowwiseParallel",
            "PrepareFloat8ModuleInput",
        )
    else:
        assert colwise is ColwiseParallel
    with torch.device("meta"):
        plain = Transformer(micro_model_config()).layers["0"]
    assert _styles(plain, "attention.wq")[0] is ColwiseParallel


def _parallel_worker(rank, world_size, tmp, recipes):
    """Per recipe: single-device fp8 losses, tp2 (sequence parallel) fp8 losses, and (tensorwise)
    dp2 FSDP2 with fp8 all-gather; plus what the parallel models were made of."""
    import copy

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    from pipeline.core.parallel.fsdp import apply_fsdp
    from pipeline.core.parallel.tensor_parallel import apply_tensor_parallel

    config = micro_model_config(init_method_std=0.2)
    mesh = init_device_mesh("cpu", (world_size,))
    out = {}
    for recipe in recipes:
        single, fp8 = _build(recipe, config)
        # gloo cannot all-gather fp8 ("Invalid scalar type"), which the float8 styles do for
        # the sequence-parallel gather; tensorwise runs without SP here (the float8 styles still
        # cast inputs and output gradients), rowwise (plain styles, no fp8 comms) with it.
        sp = not recipe.endswith("tensorwise")
        tp_model = apply_tensor_parallel(copy.deepcopy(single), mesh, sequence_parallel=sp)
        out[(recipe, "single")] = _train(single, fp8, _batches(config.vocab_size))
        out[(recipe, "tp2")] = _train(tp_model, fp8, _batches(config.vocab_size))
        if not recipe.endswith("tensorwise"):
            continue
        # Data parallelism changes the activations' tensorwise scales (each rank casts its own
        # half batch), so FSDP2 is compared with and without the fp8 all-gather of the weights.
        batches = _batches(config.vocab_size, rank, world_size)
        for name, fp8_all_gather in (("fsdp2_fp8_gather", True), ("fsdp2", False)):
            sharded, fsdp_fp8 = _build(recipe, config, fsdp=fp8_all_gather)
            apply_fsdp(sharded, mesh)
            weight = sharded.layers["0"].attention.wq.weight
            out[(name, "wrapped")] = isinstance(weight, DTensor) and (
                type(weight._local_tensor).__name__ == "WeightWithDynamicFloat8CastTensor"
            )
            out[(recipe, name)] = _train(sharded, fsdp_fp8, batches, mesh.get_group())
    return out


@needs_torchao
@pytest.mark.dist
def test_torchao_fp8_under_tp2_and_fsdp2_matches_one_device(tmp_path):
    recipes = ("torchao:tensorwise", "torchao:rowwise")
    results = run_distributed(_parallel_worker, 2, tmp_path, recipes)
    for out in results:
        assert out[("fsdp2_fp8_gather", "wrapped")] and not out[("fsdp2", "wrapped")]
        for recipe in recipes:
            single = out[(recipe, "single")]
            assert out[(recipe, "tp2")] == pytest.approx(single, rel=PARALLEL_RTOL), recipe
        single = out[("torchao:tensorwise", "single")]
        fsdp2 = out[("torchao:tensorwise", "fsdp2")]
        fp8_gather = out[("torchao:tensorwise", "fsdp2_fp8_gather")]
        assert fp8_gather == pytest.approx(fsdp2, rel=PARALLEL_RTOL)
        assert fp8_gather == pytest.approx(single, rel=FP8_RTOL)


@needs_torchao
def test_pipe_train_fp8_flag_trains_on_cpu_emulation(tmp_path):
    """`pipe train --fp8 torchao:rowwise` reaches the trainer: fp8 linears, finite falling loss."""
    import json

    from click.testing import CliRunner

    from pipeline.train.commands import train

    sets = [
        "model.num_layers=2",
        "model.hidden_size=32",
        "model.num_attention_heads=2",
        "model.num_kv_heads=2",
        "model.ffn_hidden_size=64",
        "model.vocab_size=128",
        "data.mock=true",
        "data.seq_length=32",
        "data.num_workers=0",
        "training.dtype=fp32",
        "training.global_batch_size=4",
        "training.micro_batch_size=4",
        "training.eval_interval=0",
        "training.log_interval=1",
        "scheduler.warmup_iters=0",
        "checkpoint.save_interval=0",
        "fp8.linear_filter=all",
        "fp8.emulate=true",
    ]
    args = ["--fp8", "torchao:rowwise", "--iters", "3", "--device", "cpu"]
    args += ["--run-dir", str(tmp_path / "run")]
    for assignment in sets:
        args += ["--set", assignment]
    result = CliRunner().invoke(train, args)
    assert result.exit_code == 0, result.output
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    losses = [json.loads(line)["loss"] for line in lines if '"train"' in line]
    assert len(losses) == 3 and all(0 < loss < 10 for loss in losses)
    config = (tmp_path / "run" / "config.toml").read_text()
    assert 'recipe = "torchao:rowwise"' in config
