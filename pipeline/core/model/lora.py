"""LoRA: low-rank adapters on a frozen model (Hu et al., 2021), applied in one place.

`apply_lora(model, spec)` changes a built model (on `meta`, after an FP8 backend swapped its
linears and before any parallelism): every targeted linear becomes a `LoRAAdapted` one (the
same module re-classed: its `weight` and `bias` keep the checkpoint's names, and it gains
`lora_A` `[rank, in]` and `lora_B` `[out, rank]`), each
targeted expert stack of a MoE gets an `ExpertAdapters` (`experts.lora`: one A and B per
expert), and every other parameter is frozen. The output of an adapted projection is

    base(x) + (dropout(x) @ A^T @ B^T) * alpha / rank

as in `peft`. B starts at zero, so an adapted model computes what its base computes; A is drawn
as peft draws it (kaiming-uniform with a = sqrt(5): uniform(+-1/sqrt(in))) from a generator
seeded by the run's seed and the parameter's name, so every layout starts from the same
adapters (`init_adapters`).

Targets are the names users know: q, k, v, o (attention), gate, up, down (dense MLPs and
shared experts), q_a, q_b, kv_a, kv_b (latent attention's down and up projections; `q` is
latent attention's `wq` when it has no query compression), qkv, z, qkvz, ba (gated DeltaNet's
input projections; its output projection is `o`) and expert_gate, expert_up, expert_down (the
grouped experts of MoE layers). Routers, embeddings and the output layer are
never adapted (peft's "all-linear" leaves the output layer out too).
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

__all__ = [
    "adapters_off",
    "ALL_TARGETS",
    "ExpertAdapters",
    "LoRAAdapted",
    "LoRALinear",
    "LoRASpec",
    "adapted_class",
    "adapter_names",
    "apply_lora",
    "find_linear",
    "init_adapters",
    "is_adapter_name",
    "merged_weight",
    "targets_of",
]

# User-facing target -> the module paths (inside a block) it adapts.
LINEAR_TARGETS: dict[str, tuple[str, ...]] = {
    "q": ("attention.wq",),
    "k": ("attention.wk",),
    "v": ("attention.wv",),
    "o": ("attention.wo",),
    "q_a": ("attention.wq_a",),
    "q_b": ("attention.wq_b",),
    "kv_a": ("attention.wkv_a",),
    "kv_b": ("attention.wkv_b",),
    # Gated DeltaNet's input projections (its output projection is `o`'s `attention.wo`):
    # Qwen3.5's in_proj_qkv and in_proj_z, Qwen3-Next's fused in_proj_qkvz, and the b/a
    # projections of the step sizes and decays.
    "qkv": ("attention.wqkv",),
    "z": ("attention.wz",),
    "qkvz": ("attention.wqkvz",),
    "ba": ("attention.wb", "attention.wa", "attention.wba"),
    "gate": ("feed_forward.w1", "moe.shared_experts.w1"),
    "up": ("feed_forward.w3", "moe.shared_experts.w3"),
    "down": ("feed_forward.w2", "moe.shared_experts.w2"),
}
EXPERT_TARGETS: dict[str, str] = {"expert_gate": "w1", "expert_up": "w3", "expert_down": "w2"}
ALL_TARGETS: tuple[str, ...] = (*LINEAR_TARGETS, *EXPERT_TARGETS)
ADAPTER_MARK = "lora"  # every adapter parameter's name has a component starting with this


@dataclass(frozen=True)
class LoRASpec:
    """What `apply_lora` adds: `rank`, `alpha` (the update is scaled by alpha / rank),
    `dropout` on the adapters' input, `targets` (names from `ALL_TARGETS`) and `base_dtype`
    (the frozen base's storage dtype; None keeps the model's)."""

    rank: int = 16
    alpha: float = 32.0
    dropout: float = 0.0
    targets: tuple[str, ...] = ALL_TARGETS
    base_dtype: torch.dtype | None = None

    def __post_init__(self) -> None:
        unknown = [t for t in self.targets if t not in ALL_TARGETS]
        if unknown:
            raise ValueError(
                f"unknown LoRA target(s) {', '.join(unknown)}; choose from {', '.join(ALL_TARGETS)}"
            )
        if self.rank <= 0 or not 0.0 <= self.dropout < 1.0:
            raise ValueError(
                f"LoRA needs rank > 0 and 0 <= dropout < 1, got {self.rank}, {self.dropout}"
            )

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank


class LoRAAdapted:
    """What a linear becomes when adapted: its own forward (the frozen base) plus a trainable
    low-rank update (see the module docstring). A mix-in: `apply_lora` re-classes the linear
    in place (`nn.Linear` -> `LoRALinear`, an FP8 backend's linear -> a subclass of its own),
    so its parameters, hooks and name stay, and tensor-parallel styles still take it for what
    it was. The adapters run in their own dtype (fp32), their update cast to the output's."""

    lora_A: nn.Parameter
    lora_B: nn.Parameter

    def add_adapters(self, rank: int, scaling: float, dropout: float) -> None:
        device = self.weight.device
        self.lora_A = nn.Parameter(torch.empty(rank, self.in_features, device=device))
        self.lora_B = nn.Parameter(torch.empty(self.out_features, rank, device=device))
        self.scaling = scaling
        # A rate, not an `nn.Dropout` child: tensor-parallel styles treat every submodule of
        # the linear they shard as a linear.
        self.dropout = dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.base_forward(x)
        if getattr(self, "adapters_off", False):  # `adapters_off`: the base alone
            return out
        x = x.to(self.lora_A.dtype)  # a no-op unless the base (and so the stream) is bf16
        x = F.dropout(x, self.dropout, self.training) if self.dropout else x
        delta = F.linear(F.linear(x, self.lora_A), self.lora_B) * self.scaling
        return out + delta.to(out.dtype)

    def base_forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x)  # type: ignore[misc]

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, rank={self.lora_A.shape[0]}, scaling={self.scaling}"  # type: ignore[misc]


class LoRALinear(LoRAAdapted, nn.Linear):
    """An adapted `nn.Linear`. Its weight may be stored in another dtype than the input's
    (`LoRASpec.base_dtype`): it is cast per call."""

    def base_forward(self, x: torch.Tensor) -> torch.Tensor:
        weight, bias = self.weight, self.bias
        if weight.dtype != x.dtype and not torch.is_autocast_enabled(x.device.type):
            weight = weight.to(x.dtype)
            bias = bias.to(x.dtype) if bias is not None else None
        return F.linear(x, weight, bias)


_ADAPTED: dict[tuple[type, type], type] = {(LoRAAdapted, nn.Linear): LoRALinear}


def adapted_class(cls: type, mixin: type = LoRAAdapted, prefix: str = "LoRA") -> type:
    """The subclass of a linear class `cls` with `mixin` first (named `prefix` + its name; one
    per pair, made on first use): a linear re-classed to it keeps its weights and their names."""
    if (mixin, cls) not in _ADAPTED:
        _ADAPTED[mixin, cls] = type(f"{prefix}{cls.__name__}", (mixin, cls), {})
    return _ADAPTED[mixin, cls]


class ExpertAdapters(nn.Module):
    """One low-rank update per expert for some of a `GroupedExperts`' stacks: for each adapted
    stack `w` (`w1`, `w3`, `w2`: `[E, out, in]`), `{w}_A` `[E, rank, in]` and `{w}_B`
    `[E, out, rank]`. `GroupedExperts` adds `delta(w, e, x)` to expert e's projection."""

    def __init__(
        self, experts: nn.Module, stacks: tuple[str, ...], rank: int, scaling: float, dropout: float
    ) -> None:
        super().__init__()
        self.stacks = stacks
        self.scaling = scaling
        self.rate = dropout
        for w in stacks:
            num, out, inp = getattr(experts, w).shape
            device = getattr(experts, w).device
            setattr(self, f"{w}_A", nn.Parameter(torch.empty(num, rank, inp, device=device)))
            setattr(self, f"{w}_B", nn.Parameter(torch.empty(num, out, rank, device=device)))

    def dropout(self, x: torch.Tensor) -> torch.Tensor:
        return F.dropout(x, self.rate, self.training) if self.rate else x

    def local(self) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """{stack: (A, B)} as the tensors this rank runs (the local shards under expert
        parallelism, where the rows are this rank's experts)."""
        from torch.distributed.tensor import DTensor

        def plain(t: torch.Tensor) -> torch.Tensor:
            return t.to_local() if isinstance(t, DTensor) else t

        if getattr(self, "adapters_off", False):  # `adapters_off`: the base alone
            return {}
        return {
            w: (plain(getattr(self, f"{w}_A")), plain(getattr(self, f"{w}_B"))) for w in self.stacks
        }

    def extra_repr(self) -> str:
        return f"stacks={self.stacks}, scaling={self.scaling}"


@contextmanager
def adapters_off(model: nn.Module) -> Iterator[nn.Module]:
    """`model` without its adapters' updates for the duration: the frozen base it was adapted
    from, at no extra memory (DPO's reference in a LoRA run). A no-op on a model without
    adapters."""
    adapted = [m for m in model.modules() if isinstance(m, (LoRAAdapted, ExpertAdapters))]
    for module in adapted:
        module.adapters_off = True
    try:
        yield model
    finally:
        for module in adapted:
            module.adapters_off = False


def apply_lora(model: nn.Module, spec: LoRASpec) -> nn.Module:
    """Freeze `model` (a `Transformer` or a pipeline stage of one) and add `spec`'s adapters,
    in place (see the module docstring); returns it. Call it on `meta`, before parallelism."""
    for param in model.parameters():
        param.requires_grad_(False)
        if spec.base_dtype is not None and param.is_floating_point():
            param.data = param.data.to(spec.base_dtype)
    layers = {**model.layers, **(getattr(model, "mtp", None) or {})}
    for block in layers.values():
        for target in spec.targets:
            for path in LINEAR_TARGETS.get(target, ()):
                _wrap_linear(block, path, spec)
        stacks = tuple(EXPERT_TARGETS[t] for t in spec.targets if t in EXPERT_TARGETS)
        moe = getattr(block, "moe", None)
        if stacks and moe is not None:
            moe.experts.lora = ExpertAdapters(
                moe.experts, stacks, spec.rank, spec.scaling, spec.dropout
            )
    return model


def find_linear(block: nn.Module, path: str) -> nn.Module | None:
    """The module at `path` in `block` when it has a weight; None when the block has no such
    projection (dense vs MoE, GQA vs MLA)."""
    try:
        linear = block.get_submodule(path)
    except AttributeError:
        return None
    return linear if hasattr(linear, "weight") else None


def _wrap_linear(block: nn.Module, path: str, spec: LoRASpec) -> None:
    linear = find_linear(block, path)
    if linear is None or isinstance(linear, LoRAAdapted):
        return
    linear.__class__ = adapted_class(type(linear))
    linear.add_adapters(spec.rank, spec.scaling, spec.dropout)


def is_adapter_name(name: str) -> bool:
    """Whether a parameter (or checkpoint) name is a LoRA adapter's: `*.lora_A`, `*.lora_B`,
    `*.experts.lora.*`."""
    return any(part.startswith(ADAPTER_MARK) for part in name.split("."))


def adapter_names(model: nn.Module) -> list[str]:
    """The names of `model`'s adapter parameters."""
    return [name for name, _ in model.named_parameters() if is_adapter_name(name)]


def _draw(name: str, shape: torch.Size, fan_in: int, seed: int) -> torch.Tensor:
    """peft's kaiming-uniform(a=sqrt(5)) for an A matrix, from a generator keyed by `name`."""
    generator = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
    bound = 1.0 / math.sqrt(fan_in)
    return (torch.rand(shape, generator=generator, dtype=torch.float32) * 2 - 1) * bound


def initial_adapters(model: nn.Module, seed: int) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, full initial value) of each adapter parameter of `model`: A drawn as peft draws
    it, B zero. The values depend on the seed and the name only, not on the layout."""
    for name, param in model.named_parameters():
        if not is_adapter_name(name):
            continue
        shape = param.shape
        if name.endswith("_B"):
            yield name, torch.zeros(shape)
        else:
            yield name, _draw(name, shape, shape[-1], seed)


def init_adapters(model: nn.Module, seed: int) -> None:
    """Give every adapter parameter its initial value (`initial_adapters`), whatever its
    sharding (each rank keeps its shard of the full value)."""
    from pipeline.core.parallel.fsdp import copy_full_weights_

    copy_full_weights_(model, dict(initial_adapters(model, seed)))


def merged_weight(
    weight: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scaling: float
) -> torch.Tensor:
    """The base weight with its adapter folded in (`[out, in]`, or `[E, out, in]` for expert
    stacks), computed in fp32 and returned in the weight's dtype."""
    delta = torch.matmul(b.float(), a.float()) * scaling
    return (weight.float() + delta).to(weight.dtype)


def targets_of(names: list[str]) -> tuple[str, ...]:
    """The targets (`ALL_TARGETS` names) whose adapters `names` (adapter parameters) hold."""
    found = set()
    for name in names:
        for target, paths in LINEAR_TARGETS.items():
            if any(f".{path}.lora_" in name for path in paths):
                found.add(target)
        for target, stack in EXPERT_TARGETS.items():
            if f".experts.lora.{stack}_" in name:
                found.add(target)
    return tuple(t for t in ALL_TARGETS if t in found)
