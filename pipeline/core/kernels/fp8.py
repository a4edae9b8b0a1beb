"""The FP8 interface: recipe names, the checks a run passes before FP8, which linear layers
convert, and the backend object the trainer drives.

A recipe is `backend:scaling` (`fp8.recipe`; `--fp8 torchao` takes the backend's default):

- `torchao:tensorwise`, `torchao:rowwise`, `torchao:rowwise_with_gw_hp` (rowwise, with the weight
  gradient's GEMM kept in high precision): torchao float8 training (`fp8_torchao.py`). Composes
  with DTensor tensor parallelism (torchao's float8 TP styles for tensorwise) and FSDP2 (fp8
  all-gather of the weights for tensorwise).
- `te:delayed`, `te:current`: Transformer Engine linears under `fp8_autocast` with delayed or
  current scaling (`fp8_te.py`).

The output layer, MoE routers and small or misaligned GEMMs stay in high precision
(`high_precision_reason`); experts (stacked weights, not linears) and attention itself are not
converted. This module imports no torch at load time, so the config can use its names.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
    from torch import nn

__all__ = [
    "DEFAULT_SCALING",
    "FP8_BACKENDS",
    "FP8_RECIPES",
    "Fp8Training",
    "build_fp8",
    "check_fp8_device",
    "high_precision_reason",
    "normalize_recipe",
]

FP8_BACKENDS = ("torchao", "te")
DEFAULT_SCALING = {"torchao": "tensorwise", "te": "delayed"}
_SCALINGS = {
    "torchao": ("tensorwise", "rowwise", "rowwise_with_gw_hp"),
    "te": ("delayed", "current"),
}
FP8_RECIPES = tuple(f"{b}:{s}" for b in FP8_BACKENDS for s in _SCALINGS[b])
LINEAR_FILTERS = ("auto", "all")
# Linears that always keep high precision, by the last part of their name: the output layer
# (its logits feed the loss; a 128k-wide fp8 GEMM loses accuracy where it matters most) and
# MoE routers (tiny GEMMs whose argmax decides the routing).
_ALWAYS_HIGH_PRECISION = ("output", "router")


def normalize_recipe(recipe: str) -> str:
    """`backend` or `backend:scaling` -> the canonical `backend:scaling`; ValueError otherwise."""
    backend, _, scaling = recipe.partition(":")
    if backend not in FP8_BACKENDS:
        raise ValueError(f"fp8.recipe {recipe!r}: unknown backend {backend!r}; have {FP8_BACKENDS}")
    scaling = scaling or DEFAULT_SCALING[backend]
    if scaling not in _SCALINGS[backend]:
        raise ValueError(
            f"fp8.recipe {recipe!r}: {backend} has no {scaling!r} scaling; "
            f"have {', '.join(FP8_RECIPES)}"
        )
    return f"{backend}:{scaling}"


def check_fp8_device(recipe: str, device: torch.device, *, emulate: bool = False) -> None:
    """Refuse FP8 where it cannot run: not on CUDA (unless `emulate`: torchao only, emulated
    matmuls on a CPU) or on a GPU without FP8 tensor cores (compute capability below 8.9)."""
    import torch

    if emulate:
        if not recipe.startswith("torchao:"):
            raise ValueError(f"FP8 emulation is for torchao recipes; {recipe!r} needs a real GPU")
        return
    if device.type != "cuda":
        raise ValueError(
            f"fp8.recipe {recipe!r}: FP8 training needs a CUDA GPU; this run is on {device.type} "
            "(fp8.emulate=true emulates torchao's FP8 on a CPU, slowly)"
        )
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) < (8, 9):
        raise ValueError(
            f"fp8.recipe {recipe!r}: {torch.cuda.get_device_name(device)} has no FP8 "
            f"(compute capability {major}.{minor}; FP8 needs 8.9 or newer: Ada, Hopper, "
            "Blackwell); unset fp8.recipe to train in bf16"
        )


def high_precision_reason(
    fqn: str, in_features: int, out_features: int, *, scaling: str, linear_filter: str
) -> str | None:
    """Why the linear `fqn` (weight `[out, in]`) keeps high precision, or None to convert it.

    Always kept: the output layer, routers, and GEMMs whose dims are not multiples of 16 (the
    FP8 tensor-core kernels need that). With `linear_filter="auto"` also small GEMMs, by the
    thresholds torchao measured on an H100 (torchao/float8 README; `_auto_filter_for_*`), where
    the casts cost more than the faster GEMM saves: tensorwise (and TE's per-tensor scalings)
    keeps in <= 4096 and out <= 1024; rowwise (either form) keeps out <= 2048, in <= 1024, or
    out <= 4096 with in <= 2048. `"all"` converts every aligned linear (tests; or where measured
    faster).
    """
    if fqn.rsplit(".", 1)[-1] in _ALWAYS_HIGH_PRECISION:
        return "output layer" if fqn.endswith("output") else "router"
    if in_features % 16 or out_features % 16:
        return "dims not multiples of 16"
    if linear_filter == "all":
        return None
    if linear_filter != "auto":
        raise ValueError(f"fp8.linear_filter must be one of {LINEAR_FILTERS}: {linear_filter!r}")
    n, k = out_features, in_features
    if scaling.startswith("rowwise"):
        small = n <= 2048 or k <= 1024 or (n <= 4096 and k <= 2048)
    else:
        small = k <= 4096 and n <= 1024
    return "small GEMM (faster in bf16)" if small else None


class Fp8Training:
    """One backend's FP8 training: `convert` swaps linears (on the `meta` model, before any
    parallelism), `autocast` wraps each forward, `after_optimizer_step` runs after every
    optimizer step. `decisions` maps each linear's name to None (converted) or the reason it
    kept high precision; `describe` is the one-line summary the trainer logs."""

    recipe: str

    def __init__(self, recipe: str, linear_filter: str) -> None:
        self.recipe = recipe
        self.scaling = recipe.split(":", 1)[1]
        self.linear_filter = linear_filter
        self.decisions: dict[str, str | None] = {}

    def wants_fp8(self, linear: nn.Module, fqn: str) -> bool:
        """The module filter (torchao's argument order): records and returns whether `linear`,
        named `fqn` in the model, converts."""
        reason = high_precision_reason(
            fqn,
            linear.in_features,
            linear.out_features,
            scaling=self.scaling,
            linear_filter=self.linear_filter,
        )
        self.decisions[fqn] = reason
        return reason is None

    def convert(self, model: nn.Module) -> nn.Module:  # pragma: no cover - abstract
        raise NotImplementedError

    def autocast(self) -> contextlib.AbstractContextManager:
        """The context every forward runs in (Transformer Engine's fp8_autocast; else none)."""
        return contextlib.nullcontext()

    def after_optimizer_step(self, parts: Iterable[nn.Module]) -> None:
        """Work due after each optimizer step (torchao: the fp8 all-gather's weight scales)."""

    def describe(self) -> str:
        kept = Counter(r for r in self.decisions.values() if r is not None)
        converted = len(self.decisions) - sum(kept.values())
        why = ", ".join(f"{n} {r}" for r, n in sorted(kept.items()))
        return (
            f"fp8 {self.recipe}: {converted} linears in fp8, "
            f"{sum(kept.values())} high precision ({why or 'none'})"
        )


def build_fp8(
    recipe: str | None,
    device: torch.device,
    *,
    emulate: bool = False,
    linear_filter: str = "auto",
    fsdp: bool = False,
    fsdp_float8_all_gather: bool = True,
    tp: int = 1,
    amax_group: Any = None,
) -> Fp8Training | None:
    """The FP8 backend for `recipe` on `device`, checked and ready to `convert` a meta model;
    None when `recipe` is None (bf16 training). Every refusal is a one-line ValueError.

    fsdp: the model will be sharded by FSDP2 (torchao tensorwise then all-gathers fp8 weights
    when `fsdp_float8_all_gather`). tp: the tensor-parallel degree (Transformer Engine refuses
    tp > 1). amax_group: the process group Transformer Engine's delayed scaling reduces its
    amax over (the data-parallel ranks).
    """
    if recipe is None:
        return None
    recipe = normalize_recipe(recipe)
    check_fp8_device(recipe, device, emulate=emulate)
    if recipe.startswith("torchao:"):
        from pipeline.core.kernels.fp8_torchao import TorchaoFloat8

        return TorchaoFloat8(
            recipe,
            linear_filter,
            emulate=emulate,
            fsdp_float8_all_gather=fsdp and fsdp_float8_all_gather,
        )
    from pipeline.core.kernels.fp8_te import TransformerEngineFp8

    return TransformerEngineFp8(recipe, linear_filter, tp=tp, amax_group=amax_group)


def swap_linears(
    model: nn.Module, wants: Callable[[nn.Module, str], bool], make: Callable[[nn.Module], Any]
) -> int:
    """Replace each `nn.Linear` of `model` for which `wants(linear, fqn)` by `make(linear)`, in
    place; returns how many were replaced. (torchao has its own swap; Transformer Engine not.)"""
    from torch import nn

    swapped = 0
    for fqn, module in list(model.named_modules()):
        if not isinstance(module, nn.Linear) or not wants(module, fqn):
            continue
        parent_name, _, child = fqn.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, make(module))
        swapped += 1
    return swapped
