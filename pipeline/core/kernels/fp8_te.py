"""Transformer Engine FP8: the `te:delayed` and `te:current` recipes.

`convert` replaces the chosen `nn.Linear`s by `transformer_engine.pytorch.Linear` (same
`weight` / `bias` parameter names, so checkpoints keep their names; TE adds an `_extra_state`
entry per module with its FP8 scaling state) and `autocast` wraps each forward in
`fp8_autocast` with the recipe object:

- `te:delayed`: `DelayedScaling(fp8_format=HYBRID, amax_history_len=1024, amax_compute_algo=
  "max")`, Megatron-LM's Llama 3 FP8 settings (e4m3 forward, e5m2 gradients, the scale from the
  largest amax of the last 1024 steps). The amax is all-reduced over `amax_group` (the
  data-parallel ranks) at the end of each autocast so every replica uses the same scales.
- `te:current`: `Float8CurrentScaling(fp8_format=HYBRID)` (Transformer Engine >= 2.2): each
  tensor's scale from its own amax, like torchao tensorwise.

Parallel layouts: single device, FSDP2 / replicated data parallelism, pipeline, context and
expert parallelism (the linears are replaced before any of them; experts are not linears and stay
high precision). Tensor parallelism is refused: our TP is a DTensor plan, and TE's linears shard
through their own `tp_group`/`parallel_mode` instead of DTensor parameters (use `torchao:*` for
tp > 1). The package is imported only when a `te:*` recipe is built; without it the run stops
with the install line.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any

from pipeline.core.kernels.fp8 import Fp8Training, swap_linears

if TYPE_CHECKING:
    from torch import nn

__all__ = ["TransformerEngineFp8", "te_recipe"]

INSTALL_HINT = "pip install 'transformer-engine[pytorch]'"


def _import_te() -> Any:
    try:
        import transformer_engine.pytorch as te
    except ImportError as e:
        raise ValueError(f"FP8 with Transformer Engine needs the package: {INSTALL_HINT}") from e
    return te


def te_recipe(scaling: str) -> Any:
    """Transformer Engine's recipe object for `scaling` (delayed or current)."""
    from transformer_engine.common import recipe

    if scaling == "delayed":
        return recipe.DelayedScaling(
            fp8_format=recipe.Format.HYBRID, amax_history_len=1024, amax_compute_algo="max"
        )
    if scaling == "current":
        if not hasattr(recipe, "Float8CurrentScaling"):
            raise ValueError("te:current needs Transformer Engine >= 2.2 (Float8CurrentScaling)")
        return recipe.Float8CurrentScaling(fp8_format=recipe.Format.HYBRID)
    raise ValueError(f"Transformer Engine has no {scaling!r} scaling here; use delayed or current")


class TransformerEngineFp8(Fp8Training):
    """Transformer Engine FP8 training for one recipe (see the module docstring)."""

    def __init__(self, recipe: str, linear_filter: str, *, tp: int, amax_group: Any) -> None:
        super().__init__(recipe, linear_filter)
        if tp > 1:
            raise ValueError(
                f"fp8.recipe {recipe!r} with tp={tp}: Transformer Engine linears do not take our "
                "DTensor tensor parallelism; use a torchao recipe (torchao:tensorwise) for tp > 1"
            )
        self.te = _import_te()  # fail at build time, not mid-run
        self.fp8_recipe = te_recipe(self.scaling)
        self.amax_group = amax_group

    def convert(self, model: nn.Module) -> nn.Module:
        """Replace the chosen linears by `te.Linear` on the same device and dtype (on `meta`
        they are materialised later by `to_empty` and initialised by the model's
        `init_weights`, like any linear; a materialised linear's values are copied)."""
        swap_linears(model, self.wants_fp8, self._te_linear)
        return model

    def _te_linear(self, linear: nn.Module) -> nn.Module:
        import torch

        weight = linear.weight
        has_bias = linear.bias is not None
        new = self.te.Linear(
            linear.in_features,
            linear.out_features,
            bias=has_bias,
            params_dtype=weight.dtype,
            device=weight.device,
        )
        if weight.device.type != "meta":
            with torch.no_grad():
                new.weight.copy_(weight)
                if has_bias:
                    new.bias.copy_(linear.bias)
        return new

    def autocast(self) -> contextlib.AbstractContextManager:
        """`fp8_autocast` with this run's recipe (and amax reduction group)."""
        return self.te.fp8_autocast(
            enabled=True, fp8_recipe=self.fp8_recipe, fp8_group=self.amax_group
        )
