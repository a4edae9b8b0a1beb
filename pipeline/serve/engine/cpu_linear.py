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
    weight (module docstring); `weight` stays the plain one."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.weight = linear.weight
        self.bias = linear.bias
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.repack()

    def repack(self) -> None:
        """Pack the plain weight again: after it was overwritten in place (new weights)."""
        self.packed = torch.ops.mkldnn._reorder_linear_weight(self.weight.detach(), PACKED_FOR_ROWS)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = None if self.bias is None else self.bias.detach()
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, bias, "none", [], "")


def can_prepack(model: nn.Module) -> bool:
    """Whether `prepack_linears` applies: an fp32 model on a CPU, with torch's oneDNN."""
    param = next(model.parameters())
    return (
        param.device.type == "cpu"
        and param.dtype == torch.float32
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
    )


def prepack_linears(model: nn.Module) -> int:
    """Replace every `nn.Linear` of an inference-only `model` by a `PrepackedLinear` (module
    docstring); returns how many. A no-op (0) where `can_prepack` is false."""
    if not can_prepack(model):
        return 0
    swapped = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear:
                setattr(parent, name, PrepackedLinear(child))
                swapped += 1
    return swapped


def repack_linears(model: nn.Module) -> int:
    """Pack again every `PrepackedLinear` of `model` whose plain weight was overwritten in place
    (`pipe serve` taking new weights without a restart); returns how many."""
    linears = [module for module in model.modules() if isinstance(module, PrepackedLinear)]
    for linear in linears:
        linear.repack()
    return len(linears)
