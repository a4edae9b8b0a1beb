"""FP8 calibration: the largest absolute activation each exported GEMM sees on real text.

`calibrate` runs our `Transformer` over token sequences and records, per layer, the amax of the
input of every linear TensorRT-LLM quantizes, keyed by its TRT-LLM module name:

    qkv    input of attention.qkv (the normed hidden states)
    dense  input of attention.dense (the attention output)
    fc     input of mlp.fc and mlp.gate (the same normed hidden states)
    proj   input of mlp.proj (silu(fc) * gate; for MoE over every expert's tokens)
    kv     the key and value cache entries (keys after their norm, if any, and RoPE)

and `lm_head`, the input of the output projection (the final norm's output).

RoPE rotates each pair (i, i + d/2) of a key by an angle, so |rotated element| never exceeds the
pair's norm: the key amax recorded is that norm's maximum, an upper bound that holds at every
position. Sequences come from a Megatron `.bin/.idx` dataset (`calibration_sequences`).
"""

from __future__ import annotations

import os
from collections import defaultdict
from collections.abc import Iterator

import torch
from torch import nn

__all__ = ["calibrate", "calibration_sequences"]


def calibration_sequences(
    prefix: str | os.PathLike, count: int, seq_len: int, *, skip_tokens: int = 0
) -> torch.Tensor:
    """Up to `count` sequences `[n, seq_len]` of the dataset's tokens (documents concatenated
    in order), starting after the first `skip_tokens`; fewer when the dataset ends first.
    ValueError when not even one sequence fits."""
    from pipeline.data.indexed import IndexedDataset

    needed = skip_tokens + count * seq_len
    pieces, total = [], 0
    for document in IndexedDataset(prefix).documents():
        pieces.append(torch.from_numpy(document.astype("int64")))
        total += len(document)
        if total >= needed:
            break
    available = (total - skip_tokens) // seq_len
    if available < 1:
        raise ValueError(
            f"{prefix}: {total} tokens, not one sequence of {seq_len} after {skip_tokens}"
        )
    n = min(count, available)
    return torch.cat(pieces)[skip_tokens : skip_tokens + n * seq_len].view(n, seq_len)


class _AmaxRecorder:
    """Running max of |x| per key."""

    def __init__(self) -> None:
        self.amax: dict[str, float] = defaultdict(float)

    def update(self, key: str, value: torch.Tensor) -> None:
        if value.numel():
            self.amax[key] = max(self.amax[key], float(value.detach().abs().amax()))

    def input_hook(self, key: str):
        def hook(module: nn.Module, args: tuple) -> None:
            self.update(key, args[0])

        return hook

    def rope_key_hook(self, key: str, head_dim: int, rope_dim: int):
        """Records the pair norms of the key projection's output (see the module docstring);
        with partial RoPE the pairs are (i, i + rope_dim/2) of each head's first rope_dim
        dimensions, and the others, never rotated, count as they are."""

        def hook(module: nn.Module, args: tuple, output: torch.Tensor) -> None:
            heads = output.float().unflatten(-1, (-1, head_dim))
            turned, kept = heads.split([rope_dim, head_dim - rope_dim], dim=-1)
            pairs = turned.unflatten(-1, (2, rope_dim // 2))
            self.update(key, pairs.pow(2).sum(-2).sqrt())
            self.update(key, kept)

        return hook

    def output_hook(self, key: str):
        def hook(module: nn.Module, args: tuple, output: torch.Tensor) -> None:
            self.update(key, output)

        return hook

    def expert_hidden_hook(self, key: str):
        """Recomputes each expert's activation (silu(x w1) * (x w3), or gpt-oss's clamped one
        with biases) from the experts' inputs."""

        def hook(module: nn.Module, args: tuple) -> None:
            x, tokens_per_expert = args
            groups = torch.split(x, tokens_per_expert.tolist())
            for e, group in enumerate(groups):
                self.update(key, module.hidden(e, group))

        return hook


def _register(model: nn.Module, recorder: _AmaxRecorder) -> Iterator:
    head_dim = model.config.head_dim
    yield model.norm.register_forward_hook(recorder.output_hook("lm_head"))
    for i, layer in model.layers.items():
        attention = layer.attention
        yield attention.wq.register_forward_pre_hook(recorder.input_hook(f"{i}.qkv"))
        yield attention.wo.register_forward_pre_hook(recorder.input_hook(f"{i}.dense"))
        key_source = attention.k_norm if attention.qk_norm else attention.wk  # Qwen3: normed keys
        hook = recorder.rope_key_hook(f"{i}.kv", head_dim, model.config.rope_dim)
        yield key_source.register_forward_hook(hook)
        yield attention.wv.register_forward_hook(recorder.output_hook(f"{i}.kv"))
        if layer.is_moe:
            yield layer.moe.register_forward_pre_hook(recorder.input_hook(f"{i}.fc"))
            hook = recorder.expert_hidden_hook(f"{i}.proj")
            yield layer.moe.experts.register_forward_pre_hook(hook)
        else:
            mlp = layer.feed_forward
            yield mlp.w1.register_forward_pre_hook(recorder.input_hook(f"{i}.fc"))
            yield mlp.w2.register_forward_pre_hook(recorder.input_hook(f"{i}.proj"))


@torch.no_grad()
def calibrate(model: nn.Module, tokens: torch.Tensor, batch_size: int = 8) -> dict[str, float]:
    """Activation amax per `"{layer}.{module}"` (see the module docstring) of our `Transformer`
    `model` over `tokens` `[n, seq]`."""
    recorder = _AmaxRecorder()
    handles = list(_register(model, recorder))
    try:
        for batch in tokens.split(batch_size):
            model(batch)
    finally:
        for handle in handles:
            handle.remove()
    return dict(recorder.amax)
