"""The MLP activations, by their Hugging Face `hidden_act` names."""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F

__all__ = ["activation_fn"]

_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "gelu": F.gelu,  # the exact (erf) GeLU: MPT's
    # The tanh approximation; BLOOM writes it out with sqrt(2/pi) rounded to 0.79788456.
    "gelu_pytorch_tanh": functools.partial(F.gelu, approximate="tanh"),
    "gelu_new": functools.partial(F.gelu, approximate="tanh"),
    "relu": F.relu,
}


def activation_fn(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """The function of the activation `name` (`ModelConfig.activation`)."""
    try:
        return _ACTIVATIONS[name]
    except KeyError:
        raise ValueError(f"unknown activation {name!r}; have {', '.join(_ACTIVATIONS)}") from None
