"""Mistral 4 (`Mistral4ForCausalLM`) against transformers (the oracle): DeepSeek-V3's latent
attention with YaRN and Llama 4's query scale (queries times 1 + beta * ln(1 + floor(position /
original context))), the first layer dense, then routed experts chosen by softmax scores with
grouped top-k (no correction bias), renormalised and scaled, beside a shared expert. CPU,
fp32."""

from __future__ import annotations

import pytest
import torch

from pipeline.core.model.config import MLAConfig, ModelConfig, MoEConfig, YarnScaling
from pipeline.core.model.hf_names import from_hf_state_dict
from pipeline.weights.hf_config import config_from_hf, config_to_hf
from pipeline.weights.hf_reader import HFSource
from tests.builders import (
    SHARD_BYTES,
    VOCAB,
    assert_hf_round_trip,
    cli_hf_round_trip,
    hf_config_dict,
    perturbed,
)
from tests.builders import build_model as build
from tests.convert.test_deepseek_v3 import _assert_logits_and_grads_equal

transformers = pytest.importorskip("transformers")

HIDDEN, FFN, MOE_FFN = 64, 96, 16


def _case(beta: float = 0.5) -> tuple[object, ModelConfig]:
    """(HF config, our config written out by hand): three layers, the first dense, 8 routed
    experts in 4 groups (top-2 from the best 2) and one shared, weights scaled by 1.5; YaRN x4
    over 8 original positions, so the query scale changes every 8 tokens of the 40 checked."""
    yarn = {
        "rope_type": "yarn",
        "rope_theta": 10000.0,
        "factor": 4.0,
        "original_max_position_embeddings": 8,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "mscale": 0.9,
        "mscale_all_dim": 0.7,
        "llama_4_scaling_beta": beta,
    }
    hf = transformers.Mistral4Config(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=FFN,
        moe_intermediate_size=MOE_FFN,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=4,
        kv_lora_rank=32,
        q_lora_rank=48,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=12,
        n_routed_experts=8,
        num_experts_per_tok=2,
        n_group=4,
        topk_group=2,
        n_shared_experts=1,
        routed_scaling_factor=1.5,
        first_k_dense_replace=1,
        max_position_embeddings=128,
        rms_norm_eps=1e-6,
        rope_parameters=yarn,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=None,  # transformers would freeze its embedding row
    )
    moe = MoEConfig(
        num_experts=8,
        top_k=2,
        ffn_hidden_size=MOE_FFN,
        aux_loss_coeff=0.0,
        dense_layers=[0],
        num_groups=4,
        topk_groups=2,
        routed_scaling_factor=1.5,
        num_shared_experts=1,
    )
    ours = ModelConfig(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        ffn_hidden_size=FFN,
        num_layers=3,
        num_attention_heads=4,
        max_position_embeddings=128,
        norm_eps=1e-6,
        rope_theta=10000.0,
        rope_scaling=YarnScaling(
            factor=4.0, original_max_position_embeddings=8, mscale=0.9, mscale_all_dim=0.7
        ),
        query_scale_beta=beta,
        mla=MLAConfig(
            kv_lora_rank=32, q_lora_rank=48, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12
        ),
        moe=moe,
    )
    return hf, ours


def _hf_model(hf_config):
    hf_config._attn_implementation = "eager"
    torch.manual_seed(0)
    return perturbed(transformers.Mistral4ForCausalLM(hf_config).eval())


def test_logits_and_gradients_equal_transformers() -> None:
    hf_config, config = _case()
    hf = _hf_model(hf_config)
    model = build(config)
    model.load_state_dict(from_hf_state_dict(hf.state_dict()), strict=True)
    hf_kinds = ["moe" if hasattr(layer.mlp, "experts") else "dense" for layer in hf.model.layers]
    assert [block.mlp_kind for block in model.layers.values()] == hf_kinds
    _assert_logits_and_grads_equal(hf, model)


def test_query_scale_matters() -> None:
    """Without the query scale the logits move past the original context: it is used."""
    hf_config, config = _case()
    hf = _hf_model(hf_config)
    config.query_scale_beta = 0.0
    model = build(config)
    model.load_state_dict(from_hf_state_dict(hf.state_dict()), strict=True)
    tokens = torch.randint(0, VOCAB, (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert (model.logits(tokens) - hf(input_ids=tokens).logits).abs().max() > 1e-3


def test_config_from_transformers_saved_dict_and_back() -> None:
    hf_config, expected = _case()
    hf = hf_config.to_dict() | {"architectures": ["Mistral4ForCausalLM"]}
    assert config_from_hf(hf) == expected
    written = config_to_hf(expected, dtype=torch.float32)
    assert written["architectures"] == ["Mistral4ForCausalLM"]
    assert "scoring_func" not in written
    assert config_from_hf(written) == expected


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    """A perturbed tiny Mistral 4 saved by transformers (fused experts) in several shards."""
    hf_config, _ = _case()
    hf = _hf_model(hf_config)
    directory = tmp_path_factory.mktemp("mistral4") / "hf"
    hf.save_pretrained(directory, max_shard_size=SHARD_BYTES)
    return directory, hf


def test_hf_round_trip_is_bit_identical_and_loads_in_transformers(hf_dir, tmp_path) -> None:
    """transformers writes Mistral 4's experts fused (`mlp.experts.gate_up_proj` [E, 2F, H],
    `mlp.experts.down_proj`): they read as our w1 / w3 halves and w2, and write back fused,
    byte for byte, with the same config."""
    path, hf = hf_dir
    names = HFSource(path).tensors()
    assert names["layers.1.moe.experts.w1"].shape == (8, MOE_FFN, HIDDEN)
    assert names["layers.1.moe.experts.w3"].shape == (8, MOE_FFN, HIDDEN)
    written = assert_hf_round_trip(path, hf, tmp_path / "out")
    assert written["model.layers.2.mlp.experts.gate_up_proj"].shape == (8, 2 * MOE_FFN, HIDDEN)
    assert _without_pad(hf_config_dict(tmp_path / "out")) == _without_pad(hf_config_dict(path))


def test_cli_round_trip_through_a_pipe_checkpoint(hf_dir, tmp_path) -> None:
    directory, _ = hf_dir
    back, _ = cli_hf_round_trip(directory, tmp_path)
    assert _without_pad(hf_config_dict(back)) == _without_pad(hf_config_dict(directory))


def _without_pad(hf: dict) -> dict:
    """`hf` less pad_token_id, which pipe does not carry (it changes no logit; Mistral4Config
    defaults it to 11)."""
    return {k: v for k, v in hf.items() if k != "pad_token_id"}
