"""Linear layers with weights laid out ahead of time for oneDNN, for serving on a CPU.

A decode step multiplies a few rows (one per running request) by every weight of the model. With
a plain weight the GEMM library repacks the whole weight matrix into its blocked layout on each
call: for a batch of 8 that costs more than the product itself, and a step takes about 1.7x the
time of the same products on weights packed once (measured on the 60M-parameter benchmark model,
fp32, one thread: 30.5 ms against 17.5 ms over the model's linears at 8 rows). A single row is no
exception: alone, a small weight that stays in cache multiplies faster through the plain
matrix-vector path, but a whole step streams every weight from memory, and there the packed one
reads faster (the same model's decode step at one request, one thread: 13.6 ms plain, 8.4 ms
packed; most of it the 32,000-row output head, 4.3 ms plain against 1.8 ms packed). So
`prepack_linears` packs each weight once, at load, and every product reads the packed copy. The
copy doubles the linears' memory; it is made only for fp32 models on a CPU, where oneDNN is
present, and the plain weights stay what everything else reads (tied embeddings, checkpoints,
tests).
"""

from __future__ import annotations

import torch
from torch import nn

PACKED_FOR_ROWS = 8  # oneDNN's layout hint; measured as good for 1 to 64 rows


class PrepackedLinear(nn.Module):
    """An `nn.Linear` for inference on a CPU whose products read oneDNN's packed copy of the
    weight (module docstring); `weight` stays the plain one. One of a `StackedLinears` it holds
    no copy of its own: the stack's product serves it."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.weight = linear.weight
        self.bias = linear.bias
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.stacked: StackedLinears | None = None
        self.repack()

    def repack(self) -> None:
        """Pack the plain weight again: after it was overwritten in place (new weights)."""
        if self.stacked is not None:
            self.stacked.repack()
        else:
            self.packed = pack(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.stacked is not None:  # called alone (an adapter's base): the stack's share
            return self.stacked(x)[self.stacked.linears.index(self)]
        bias = None if self.bias is None else self.bias.detach()
        return product(x, self.packed, bias)


class StackedLinears:
    """`PrepackedLinear`s that read one input (`pipeline.core.model.shared_input`), multiplied
    as one: their weights stacked row-wise and packed once. A decode step of the serving
    benchmark's model (8 layers, one thread) makes 33 products instead of 57 and takes 3-4%
    less time at 1 and 8 running requests (`scripts/bench/engine_step.py`, "unstacked"); each
    output is bit for bit the separate product's (oneDNN reduces each output column alone).
    Without the stack's copy, the linears' own packed weights are dropped."""

    def __init__(self, linears: tuple[PrepackedLinear, ...]) -> None:
        self.linears = linears
        self.sizes = [linear.out_features for linear in linears]
        for linear in linears:
            linear.stacked, linear.packed = self, None
        self.repack()

    @staticmethod
    def can_stack(linears: tuple[nn.Module, ...]) -> bool:
        """Whether `linears` are plain `PrepackedLinear`s of one input size, all with a bias or
        none, on plain tensors (not split by tensor parallelism)."""
        return (
            all(type(linear) is PrepackedLinear for linear in linears)
            and len({linear.in_features for linear in linears}) == 1
            and len({linear.bias is None for linear in linears}) == 1
            and all(type(linear.weight.data) is torch.Tensor for linear in linears)
        )

    def repack(self) -> None:
        """Stack and pack the plain weights again (after they were overwritten in place)."""
        self.packed = pack(torch.cat([linear.weight for linear in self.linears]))
        biases = [linear.bias for linear in self.linears]
        self.bias = None if biases[0] is None else torch.cat(biases).detach()

    def serves(self, linears: tuple[nn.Module, ...]) -> bool:
        """Whether `linears` are this stack's, each still a plain `PrepackedLinear` without
        hooks (an adapter re-classes a linear; calibration hooks one)."""
        return len(linears) == len(self.linears) and all(
            given is mine
            and type(given) is PrepackedLinear
            and not (given._forward_hooks or given._forward_pre_hooks)
            for given, mine in zip(linears, self.linears)
        )

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return product(x, self.packed, self.bias).split(self.sizes, dim=-1)


def pack(weight: torch.Tensor) -> torch.Tensor:
    """oneDNN's packed copy of a linear's `weight` `[out, in]`."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), PACKED_FOR_ROWS)


def product(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """`x @ weight.T + bias` over oneDNN's packed weight."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def can_prepack(model: nn.Module) -> bool:
    """Whether `prepack_linears` applies: an fp32 model on a CPU, with torch's oneDNN."""
    param = next(model.parameters())
    return (
        param.device.type == "cpu"
        and param.dtype == torch.float32
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
    )


def prepack_linears(model: nn.Module, stack: bool = True) -> int:
    """Replace every `nn.Linear` of an inference-only `model` by a `PrepackedLinear` (module
    docstring) and, with `stack`, multiply the linears of one input as one (`StackedLinears`:
    attention's wq/wk/wv, a gated MLP's w1/w3); returns how many linears were replaced. A no-op
    (0) where `can_prepack` is false."""
    if not can_prepack(model):
        return 0
    swapped = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear:
                setattr(parent, name, PrepackedLinear(child))
                swapped += 1
    if stack:
        for linears in shared_input_linears(model):
            if StackedLinears.can_stack(linears):
                StackedLinears(linears)
    return swapped


def shared_input_linears(model: nn.Module) -> list[tuple[nn.Module, ...]]:
    """The linears of `model` that its forward applies to one input through
    `pipeline.core.model.shared_input.project`, module by module."""
    from pipeline.core.model.block import Attention
    from pipeline.core.model.feed_forward import FeedForward

    found = []
    for module in model.modules():
        if type(module) is Attention:
            found.append((module.wq, module.wk, module.wv))
        elif type(module) is FeedForward and module.gated:
            found.append((module.w1, module.w3))
    return found


def repack_linears(model: nn.Module) -> int:
    """Pack again every `PrepackedLinear` of `model` whose plain weight was overwritten in place
    (`pipe serve` taking new weights without a restart), each stack once; returns how many
    linears."""
    linears = [module for module in model.modules() if isinstance(module, PrepackedLinear)]
    packs = {id(linear.stacked or linear): linear.stacked or linear for linear in linears}
    for packed in packs.values():
        packed.repack()
    return len(linears)
