"""torchao float8 training: the `torchao:tensorwise` and `torchao:rowwise` recipes.

`convert` swaps the chosen `nn.Linear`s for torchao's `Float8Linear` on the `meta` model, before
any parallelism (torchtitan's order), so that:

- tensor parallelism can shard them with torchao's `Float8ColwiseParallel` /
  `Float8RowwiseParallel` / `PrepareFloat8ModuleInput` (tensorwise only; see
  `float8_tp_styles`): activations are cast to fp8 before the sequence-parallel all-gather, so
  it moves half the bytes. Rowwise runs under the plain DTensor styles (bf16 communication).
- FSDP2 all-gathers the weights in fp8 (tensorwise, `enable_fsdp_float8_all_gather`); the
  weight scales are then computed for all layers in one all-reduce after each optimizer step
  (`precompute_float8_dynamic_scale_for_fsdp`, `after_optimizer_step`).

Parameter names and shapes do not change (`Float8Linear` is an `nn.Linear`), so checkpoints
move freely between fp8 and bf16 runs. `emulate` runs torchao's emulated fp8 matmuls (real fp8
casts and scales, high-precision GEMM) so the numerics can be tested on a CPU; it is never
chosen implicitly.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Iterable
from typing import TYPE_CHECKING

from pipeline.common.quiet import import_torchao_float8
from pipeline.core.kernels.fp8 import Fp8Training
from pipeline.core.kernels.fp8_gloo import gather_cpu_float8_as_bytes

if TYPE_CHECKING:
    from torch import nn

__all__ = ["TorchaoFloat8", "float8_tp_styles", "is_tensorwise_float8"]

INSTALL_HINT = "pip install 'pipe-llm[fp8]' (torchao)"


def _import_torchao_float8():
    try:
        float8 = import_torchao_float8()
    except ImportError as e:
        raise ValueError(f"FP8 with torchao needs torchao: {INSTALL_HINT}") from e
    return float8


class TorchaoFloat8(Fp8Training):
    """torchao float8 training for one recipe (see the module docstring)."""

    def __init__(
        self, recipe: str, linear_filter: str, *, emulate: bool, fsdp_float8_all_gather: bool
    ) -> None:
        super().__init__(recipe, linear_filter)
        self.float8 = _import_torchao_float8()  # fail at build time, not mid-run
        gather_cpu_float8_as_bytes()  # gloo (CPU) has no float8 collectives
        self.emulate = emulate
        # torchao's fp8 all-gather supports tensorwise scaling only.
        self.fsdp_float8_all_gather = fsdp_float8_all_gather and self.scaling == "tensorwise"

    def config(self):
        """torchao's `Float8LinearConfig` for this run."""
        config = self.float8.Float8LinearConfig.from_recipe_name(self.scaling)
        return dataclasses.replace(
            config,
            emulate=self.emulate,
            enable_fsdp_float8_all_gather=self.fsdp_float8_all_gather,
        )

    def convert(self, model: nn.Module) -> nn.Module:
        """Swap the linears the filter chooses for `Float8Linear`, in place."""
        return self.float8.convert_to_float8_training(
            model, config=self.config(), module_filter_fn=self.wants_fp8
        )

    def after_optimizer_step(self, parts: Iterable[nn.Module]) -> None:
        """With fp8 all-gather: precompute every fp8 weight's scale (one all-reduce) so FSDP2's
        next all-gather casts the freshly updated shards without a reduction per layer."""
        if not self.fsdp_float8_all_gather:
            return
        for part in parts:
            self.float8.precompute_float8_dynamic_scale_for_fsdp(part)


def is_tensorwise_float8(module: nn.Module) -> bool:
    """True for a torchao `Float8Linear` with tensorwise (dynamic) scaling, the case torchao's
    float8 TP styles support. Imports nothing: without torchao loaded there are none."""
    linear_mod = sys.modules.get("torchao.float8.float8_linear")
    if linear_mod is None or not isinstance(module, linear_mod.Float8Linear):
        return False
    from torchao.float8.config import ScalingGranularity

    granularity = module.config.cast_config_weight.scaling_granularity
    return granularity is ScalingGranularity.TENSORWISE


def float8_tp_styles(modules: Iterable[nn.Module]) -> tuple[type, type, type] | None:
    """torchao's (colwise, rowwise, prepare-input) float8 TP styles when every one of `modules`
    is a tensorwise `Float8Linear`, else None (use the plain DTensor styles)."""
    modules = list(modules)
    if not modules or not all(is_tensorwise_float8(m) for m in modules):
        return None
    from torchao.float8.float8_tensor_parallel import (
        Float8ColwiseParallel,
        Float8RowwiseParallel,
        PrepareFloat8ModuleInput,
    )

    return Float8ColwiseParallel, Float8RowwiseParallel, PrepareFloat8ModuleInput
