"""FP8 calibration's KV cache range against the keys and values the attention kernel actually
receives (captured here with a hook on the kernel): for Qwen3, keys after their per-head norm
and RoPE. The recorded key range is the largest RoPE pair norm, an upper bound within sqrt(2) of
the largest key element; the value range is exact."""

from __future__ import annotations

import math

import pytest
import torch

from pipeline.core.model.config import ModelConfig
from pipeline.core.model.transformer import Transformer
from pipeline.export.calibration import calibrate


@pytest.mark.parametrize("qk_norm", [False, True])
def test_kv_range_covers_the_keys_the_cache_stores(qk_norm: bool) -> None:
    config = ModelConfig(
        vocab_size=64,
        hidden_size=32,
        num_layers=1,
        num_attention_heads=4,
        num_kv_heads=2,
        head_dim=16,
        ffn_hidden_size=64,
        qk_norm=qk_norm,
    )
    torch.manual_seed(0)
    model = Transformer(config)
    model.init_weights()
    if qk_norm:  # a norm weight far from 1 makes pre- and post-norm ranges differ clearly
        model.layers["0"].attention.k_norm.weight.data.fill_(8.0)
    model.eval()
    tokens = torch.randint(0, 64, (2, 24), generator=torch.Generator().manual_seed(1))
    seen = {}

    def capture(module, args) -> None:
        seen["k"], seen["v"] = args[1].abs().amax(), args[2].abs().amax()

    handle = model.layers["0"].attention.kernel.register_forward_pre_hook(capture)
    with torch.no_grad():
        model(tokens)
    handle.remove()
    amax = calibrate(model, tokens)
    true_max = max(float(seen["k"]), float(seen["v"]))
    assert true_max <= amax["0.kv"] * (1 + 1e-6)
    assert amax["0.kv"] <= math.sqrt(2) * true_max * (1 + 1e-6)
