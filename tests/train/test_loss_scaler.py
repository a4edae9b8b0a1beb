"""fp16 loss scaling against megatron-core's grad scalers, the oracle: the same overflow
sequence gives the same scales, and a step skips exactly when its gradients overflowed."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from pipeline.train.config.schema import TrainConfig
from pipeline.train.optimizers.loss_scaler import (
    ConstantLossScaler,
    DynamicLossScaler,
    build_loss_scaler,
)


class _CpuTorch:
    """torch, with the tensors megatron-core's scalers put on 'cuda' made on the CPU."""

    def __getattr__(self, name):
        return getattr(torch, name)

    @staticmethod
    def tensor(*args, device=None, **kwargs):
        return torch.tensor(*args, **kwargs)


@pytest.fixture(scope="module")
def megatron_scalers():
    """megatron-core's grad_scaler module, loaded from its file alone (the optimizer package
    imports half of megatron-core) with its CUDA tensors made on the CPU."""
    spec = importlib.util.find_spec("megatron")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("megatron-core is not installed")
    path = Path(next(iter(spec.submodule_search_locations))) / "core/optimizer/grad_scaler.py"
    module_spec = importlib.util.spec_from_file_location("megatron_grad_scaler", path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    module.torch = _CpuTorch()
    return module


def _overflow_sequences():
    """Overflow patterns: the start of an fp16 run (overflows until the scale fits), runs long
    enough to grow, isolated overflows that hysteresis absorbs, and random ones."""
    generator = torch.Generator().manual_seed(0)
    random = (torch.rand(400, generator=generator) < 0.3).tolist()
    start = [True] * 20 + [False] * 12 + [True, False, True, True, True] + [False] * 9
    floor = [True] * 40 + [False] * 3  # down to the minimum scale and staying there
    return {"start": start, "random": random, "floor": floor}


@pytest.mark.parametrize("pattern", ["start", "random", "floor"])
@pytest.mark.parametrize("window,hysteresis", [(4, 2), (1, 1), (7, 3), (1000, 2)])
def test_dynamic_scale_equals_megatron(megatron_scalers, pattern, window, hysteresis):
    ours = DynamicLossScaler(2.0**32, 2.0**10, window, hysteresis)
    theirs = megatron_scalers.DynamicGradScaler(
        initial_scale=2.0**32,
        min_scale=2.0**10,
        growth_factor=2.0,
        backoff_factor=0.5,
        growth_interval=window,
        hysteresis=hysteresis,
    )
    scales = []
    for found_inf in _overflow_sequences()[pattern]:
        ours.update(torch.tensor(found_inf))
        theirs.update(found_inf)
        assert float(ours.scale) == float(theirs.scale.item())
        scales.append(float(ours.scale))
        assert ours.state_dict()["growth_tracker"] == theirs._growth_tracker
        assert ours.state_dict()["hysteresis_tracker"] == theirs._hysteresis_tracker
    assert len(set(scales)) > 1  # the pattern moved the scale


def test_constant_scale_equals_megatron(megatron_scalers):
    ours, theirs = ConstantLossScaler(1024.0), megatron_scalers.ConstantGradScaler(1024.0)
    for found_inf in _overflow_sequences()["random"][:50]:
        ours.update(torch.tensor(found_inf))
        theirs.update(found_inf)
        assert float(ours.scale) == float(theirs.scale.item()) == 1024.0
    assert float(ours.inv_scale) == float(theirs.inv_scale.item())


def test_scaler_state_round_trip():
    scaler = DynamicLossScaler(2.0**16, 1.0, 3, 2)
    for found_inf in (True, False, False, True, True, False):
        scaler.update(torch.tensor(found_inf))
    copy = DynamicLossScaler(2.0**16, 1.0, 3, 2)
    copy.load_state_dict(scaler.state_dict())
    assert (
        copy.state_dict()
        == scaler.state_dict()
        == {
            "scale": 2.0**14,  # halved at the 2nd overflow in a row and at the 3rd
            "growth_tracker": 1,
            "hysteresis_tracker": -1,
        }
    )


def test_build_loss_scaler_defaults_are_megatrons():
    """The defaults are Megatron's: dynamic, from 2**32, floor 1, window 1000, hysteresis 2;
    no scaler outside fp16; a constant one with training.loss_scale."""
    cfg = TrainConfig()
    assert build_loss_scaler(cfg, "cpu") is None  # bf16, the default dtype
    cfg.training.dtype = "fp16"
    scaler = build_loss_scaler(cfg, "cpu")
    assert isinstance(scaler, DynamicLossScaler)
    assert (float(scaler.scale), float(scaler.min_scale)) == (2.0**32, 1.0)
    assert (scaler.window, scaler.hysteresis) == (1000, 2)
    cfg.training.loss_scale = 128.0
    scaler = build_loss_scaler(cfg, "cpu")
    assert type(scaler) is ConstantLossScaler and float(scaler.scale) == 128.0


@pytest.mark.parametrize(
    "sets,message",
    [
        ({"training.loss_scale": 8.0}, "training.loss_scale is set but training.dtype is fp32"),
        (
            {
                "training.dtype": "fp16",
                "training.min_loss_scale": 4.0,
                "training.initial_loss_scale": 2.0,
            },
            "need 0 < training.min_loss_scale (4.0) <= training.initial_loss_scale (2.0)",
        ),
        (
            {"training.dtype": "fp16", "fp8.recipe": "torchao:tensorwise"},
            "fp8.recipe trains beside bf16, not fp16",
        ),
        (
            {"training.dtype": "fp16", "lora.enabled": True, "lora.base_dtype": "bf16"},
            "lora.base_dtype = bf16 under training.dtype = fp16",
        ),
    ],
)
def test_fp16_settings_refused_in_one_line(sets, message):
    from pipeline.train.config.schema import ConfigError

    cfg = TrainConfig()
    cfg.data.mock = True
    cfg.training.dtype = "fp32"
    for key, value in sets.items():
        cfg.set(key, value)
    with pytest.raises(ConfigError) as error:
        cfg.validate(world_size=1)
    lines = [line for line in str(error.value).splitlines() if message in line]
    assert len(lines) == 1, str(error.value)


def test_expected_overflows_do_not_stop_a_run():
    """An overflow (finite loss) the dynamic scale can still back off from is counted but not
    towards the stop; one at the minimum scale, under a constant scale or with a non-finite
    loss is a non-finite step like any other."""
    from pipeline.train.loop.guards import NonFiniteGuard
    from pipeline.train.loop.loop_state import ReadStep

    dynamic = DynamicLossScaler(2.0**16, 2.0**10, 1000, 2)
    guard = NonFiniteGuard(max_consecutive=2)
    for iteration in range(1, 5):
        guard.account(iteration, ReadStep(3.0, float("inf"), True, 2.0**12), dynamic)
    assert (guard.total, guard.consecutive, guard.should_stop) == (4, 0, False)
    guard.account(5, ReadStep(3.0, float("inf"), True, 2.0**10), dynamic)  # at the floor
    guard.account(6, ReadStep(float("nan"), float("nan"), True, 2.0**12), dynamic)
    assert (guard.total, guard.consecutive, guard.should_stop) == (6, 2, True)

    guard = NonFiniteGuard(max_consecutive=2)
    for iteration in (1, 2):
        guard.account(iteration, ReadStep(3.0, float("inf"), True, 8.0), ConstantLossScaler(8.0))
    assert guard.should_stop
    guard.account(3, ReadStep(3.0, 0.5, False, 8.0), ConstantLossScaler(8.0))
    assert (guard.total, guard.consecutive) == (2, 0)
