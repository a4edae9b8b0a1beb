"""The attention options the 2026 families brought: their defaults keep the earlier model, and a
value the model cannot run is one line naming the field."""

from __future__ import annotations

import pytest
import torch

from pipeline.core.model.config import ModelConfig, YarnScaling
from pipeline.core.model.rope import RotaryEmbedding, apply_rope
from tests.builders import build_model, micro_model_config


def test_defaults_rotate_whole_heads_norm_per_head_and_scale_no_query() -> None:
    config = ModelConfig()
    assert config.partial_rotary_factor == 1.0 and config.rope_dim == config.head_dim
    assert config.qk_norm_scope == "head" and config.query_scale_beta == 0.0
    rope = RotaryEmbedding(micro_model_config())
    rope.init_weights(torch.device("cpu"))
    assert len(rope(torch.arange(4)[None])) == 2  # cos and sin only


def test_partial_rope_turns_the_first_dimensions_and_keeps_the_rest() -> None:
    """A quarter of a 16-wide head rotated: dimensions 4.. pass through unchanged; the first 4
    are the whole-head rotation of a 4-wide head."""
    config = micro_model_config(head_dim=16, partial_rotary_factor=0.25)
    assert config.rope_dim == 4
    rope = RotaryEmbedding(config)
    rope.init_weights(torch.device("cpu"))
    cos, sin = rope(torch.arange(6)[None])
    x = torch.randn(1, 2, 6, 16, generator=torch.Generator().manual_seed(0))
    out = apply_rope(x, cos, sin)
    assert torch.equal(out[..., 4:], x[..., 4:])
    assert torch.equal(out[..., :4], apply_rope(x[..., :4].contiguous(), cos, sin))
    assert not torch.allclose(out[..., :4], x[..., :4])


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"partial_rotary_factor": 0.0}, "partial_rotary_factor 0.0 must be in (0, 1]"),
        ({"partial_rotary_factor": 1.5}, "partial_rotary_factor 1.5 must be in (0, 1]"),
        ({"head_dim": 10, "partial_rotary_factor": 0.5}, "RoPE needs an even count"),
        ({"qk_norm_scope": "layer"}, "qk_norm_scope 'layer': head or projection"),
        ({"query_scale_beta": 0.1}, "query_scale_beta needs rope_scaling"),
    ],
)
def test_values_the_model_cannot_run_are_one_line(fields, message) -> None:
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        micro_model_config(**fields)


def test_query_scale_is_one_inside_the_original_context() -> None:
    """Llama 4's scale is 1 + beta * ln(1 + floor(p / original)): 1 for p < original."""
    config = micro_model_config(
        query_scale_beta=0.5,
        rope_scaling=YarnScaling(factor=2.0, original_max_position_embeddings=4),
    )
    rope = RotaryEmbedding(config)
    rope.init_weights(torch.device("cpu"))
    scale = rope(torch.arange(12)[None])[2].flatten()
    expected = 1 + 0.5 * torch.log1p(torch.tensor([0.0] * 4 + [1.0] * 4 + [2.0] * 4))
    torch.testing.assert_close(scale, expected)
    model = build_model(config)  # the model runs with it
    assert model.logits(torch.arange(12)[None]).shape == (1, 12, config.vocab_size)
