"""MiniMax-M2 (`MiniMaxM2ForCausalLM`) against transformers (the oracle): q/k RMSNorm over the
whole projection (all heads' q together, all kv heads' k together), RoPE over part of each head
(`rotary_dim`), experts in every layer routed by sigmoid scores plus the correction bias (kept on
the MoE block, `block_sparse_moe.e_score_correction_bias` on disk), no shared expert. CPU,
fp32."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pipeline.core.model.config import ModelConfig, MoEConfig
from pipeline.core.model.flavors import get_flavor, num_parameters
from pipeline.core.model.hf_names import from_hf_state_dict
from pipeline.weights.hf_config import config_from_hf, config_to_hf
from tests.builders import (
    SEQ,
    SHARD_BYTES,
    VOCAB,
    assert_hf_round_trip,
    cli_hf_round_trip,
    hf_config_dict,
    perturbed_with_bias,
)
from tests.builders import build_model as build
from tests.convert.test_deepseek_v3 import _assert_logits_and_grads_equal

transformers = pytest.importorskip("transformers")

HIDDEN, HEAD_DIM, MOE_FFN = 64, 24, 32


def _case(rotary_dim: int = 12) -> tuple[object, ModelConfig]:
    """(HF config, our config written out by hand): two layers of 8 experts, top-2."""
    hf = transformers.MiniMaxM2Config(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=MOE_FFN,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=HEAD_DIM,
        max_position_embeddings=128,
        rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 5e6},
        rotary_dim=rotary_dim,
        num_local_experts=8,
        num_experts_per_tok=2,
        router_aux_loss_coef=0.001,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
    )
    moe = MoEConfig(
        num_experts=8,
        top_k=2,
        ffn_hidden_size=MOE_FFN,
        aux_loss_coeff=0.001,
        score_function="sigmoid",
        expert_bias=True,
    )
    ours = ModelConfig(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        ffn_hidden_size=MOE_FFN,
        num_layers=2,
        num_attention_heads=4,
        num_kv_heads=2,
        head_dim=HEAD_DIM,
        max_position_embeddings=128,
        norm_eps=1e-6,
        rope_theta=5e6,
        qk_norm=True,
        qk_norm_scope="projection",
        partial_rotary_factor=rotary_dim / HEAD_DIM,
        moe=moe,
    )
    return hf, ours


def _hf_model(hf_config):
    """The HF model, every weight perturbed and correction biases large enough to change which
    experts are chosen."""
    hf_config._attn_implementation = "eager"
    torch.manual_seed(0)
    return perturbed_with_bias(transformers.MiniMaxM2ForCausalLM(hf_config).eval())


def _tokens(seed: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("rotary_dim", [12, 8])
def test_logits_and_gradients_equal_transformers(rotary_dim: int) -> None:
    """Same weights and tokens: logits and every parameter's gradient of the CE loss agree to
    1e-4 on 40 positions (half, then a third of each head rotated)."""
    hf_config, config = _case(rotary_dim)
    hf = _hf_model(hf_config)
    model = build(config)
    model.load_state_dict(from_hf_state_dict(hf.state_dict()), strict=True)
    assert model.layers["0"].attention.q_norm.weight.shape == (4 * HEAD_DIM,)
    _assert_logits_and_grads_equal(hf, model)


def test_per_head_norms_differ() -> None:
    """The same weights normalised per head (Qwen3's scope) give other logits: the scope is
    used. (Per head the norm weight is one head wide, so only its first head_dim entries fit.)"""
    hf_config, config = _case()
    hf = _hf_model(hf_config)
    state = from_hf_state_dict(hf.state_dict())
    config.qk_norm_scope = "head"
    for name in list(state):
        if name.endswith(("q_norm.weight", "k_norm.weight")):
            state[name] = state[name][:HEAD_DIM]
    model = build(config)
    model.load_state_dict(state, strict=True)
    with torch.no_grad():
        assert (model.logits(_tokens()) - hf(input_ids=_tokens()).logits).abs().max() > 1e-3


def test_config_from_transformers_saved_dict_and_back() -> None:
    hf_config, expected = _case()
    hf = hf_config.to_dict() | {"architectures": ["MiniMaxM2ForCausalLM"]}
    assert config_from_hf(hf) == expected
    written = config_to_hf(expected, dtype=torch.float32)
    assert written["rotary_dim"] == 12 and written["architectures"] == ["MiniMaxM2ForCausalLM"]
    assert config_from_hf(written) == expected


# MiniMaxAI/MiniMax-M2's config.json (the model's keys; quantization_config left out).
MINIMAX_M2_JSON = dict(
    architectures=["MiniMaxM2ForCausalLM"],
    model_type="minimax_m2",
    attention_dropout=0.0,
    bos_token_id=None,
    eos_token_id=None,
    head_dim=128,
    hidden_act="silu",
    hidden_size=3072,
    initializer_range=0.02,
    intermediate_size=1536,
    max_position_embeddings=196608,
    num_attention_heads=48,
    num_experts_per_tok=8,
    num_hidden_layers=62,
    num_key_value_heads=8,
    num_local_experts=256,
    output_router_logits=False,
    qk_norm_type="per_layer",
    rms_norm_eps=1e-06,
    rope_theta=5000000,
    rotary_dim=64,
    router_aux_loss_coef=0.001,
    router_jitter_noise=0.0,
    scoring_func="sigmoid",
    shared_intermediate_size=0,
    tie_word_embeddings=False,
    torch_dtype="bfloat16",
    use_cache=True,
    use_qk_norm=True,
    use_routing_bias=True,
    vocab_size=200064,
)


def test_published_config_gives_the_flavor_and_its_size() -> None:
    """MiniMax-M2's config.json reads as our `minimax_m2` flavor, whose parameter count is
    transformers' model's of that config (on meta) and the published 230B total, 10B active
    (without the embedding and output layers)."""
    from pipeline.train.report.estimates import parameter_counts

    ours = get_flavor("minimax_m2")
    assert config_from_hf(MINIMAX_M2_JSON) == ours
    kwargs = {k: v for k, v in MINIMAX_M2_JSON.items() if k not in ("architectures", "model_type")}
    with torch.device("meta"):
        theirs = transformers.MiniMaxM2ForCausalLM(transformers.MiniMaxM2Config(**kwargs))
    assert num_parameters(ours) == sum(p.numel() for p in theirs.parameters())
    counts = parameter_counts(ours)
    assert abs(num_parameters(ours) - 230e9) < 0.01 * 230e9
    assert abs(counts.active - counts.embedding - 10e9) < 0.5e9


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> tuple[Path, object]:
    hf_config, _ = _case()
    hf = _hf_model(hf_config)
    directory = tmp_path_factory.mktemp("minimax_m2") / "hf"
    hf.save_pretrained(directory, max_shard_size=SHARD_BYTES)
    return directory, hf


def _without_written_keys(hf: dict) -> dict:
    """`hf` less the hub keys we write that transformers' config does not keep."""
    extra = ("qk_norm_type", "scoring_func", "use_qk_norm", "use_routing_bias")
    return {k: v for k, v in hf.items() if k not in extra}


def test_hf_round_trip_is_bit_identical_and_loads_in_transformers(hf_dir, tmp_path) -> None:
    """HF -> our source -> HF: the same tensor names (per-expert `block_sparse_moe.experts.E.w1`,
    the bias on the block) and bytes, the same config; both sides give the original logits."""
    path, hf = hf_dir
    written = assert_hf_round_trip(path, hf, tmp_path / "out")
    assert "model.layers.1.block_sparse_moe.e_score_correction_bias" in written
    assert "model.layers.1.block_sparse_moe.experts.7.w2.weight" in written
    assert _without_written_keys(hf_config_dict(tmp_path / "out")) == hf_config_dict(path)


def test_cli_round_trip_through_a_pipe_checkpoint(hf_dir, tmp_path) -> None:
    directory, _ = hf_dir
    back, _ = cli_hf_round_trip(directory, tmp_path)
    assert _without_written_keys(hf_config_dict(back)) == hf_config_dict(directory)
