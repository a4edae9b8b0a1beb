"""The dense MLP (every dense layer, and DeepSeekMoE's shared experts): SwiGLU by default, or
another activation, gated or not, with or without biases (BLOOM, MPT); and the linear
initialisation the model's blocks share."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pipeline.core.model.activations import activation_fn
from pipeline.core.model.shared_input import project


def init_linear(linear: nn.Module, std: float) -> None:
    """normal(0, std) weight, zero bias. Duck-typed: FP8 backends may have replaced the
    `nn.Linear` (Transformer Engine's `Linear` keeps an empty or no `bias` when bias-free)."""
    nn.init.normal_(linear.weight, mean=0.0, std=std)
    bias = getattr(linear, "bias", None)
    if bias is not None and bias.numel():
        nn.init.zeros_(bias)


class FeedForward(nn.Module):
    """SwiGLU MLP: w2(silu(w1 x) * w3 x); w1 is the gate, w3 the up and w2 the down projection.

    `activation` replaces silu (a `ModelConfig.activation` name); without `gated` there is no
    w3 and the MLP is w2(act(w1 x)), w1 the up projection (BLOOM's and MPT's); `bias` gives
    every linear a bias (BLOOM's)."""

    def __init__(
        self,
        hidden_size: int,
        ffn_hidden_size: int,
        *,
        activation: str = "silu",
        gated: bool = True,
        bias: bool = False,
    ) -> None:
        super().__init__()
        self.act = F.silu if activation == "silu" else activation_fn(activation)
        self.gated = gated
        self.w1 = nn.Linear(hidden_size, ffn_hidden_size, bias=bias)
        if gated:
            self.w3 = nn.Linear(hidden_size, ffn_hidden_size, bias=bias)
        self.w2 = nn.Linear(ffn_hidden_size, hidden_size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.gated:
            return self.w2(self.act(self.w1(x)))
        gate, up = project(x, self.w1, self.w3)
        return self.w2(self.act(gate) * up)

    def init_weights(self, std: float, out_std: float) -> None:
        init_linear(self.w1, std)
        if self.gated:
            init_linear(self.w3, std)
        init_linear(self.w2, out_std)
