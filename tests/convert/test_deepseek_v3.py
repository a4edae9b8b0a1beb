"""DeepSeek-V3 against transformers (the oracle): multi-head latent attention with and without
the q low-rank projection, YaRN RoPE scaling with its mscale corrections, the interleaved RoPE
layout, DeepSeekMoE (first dense layers, shared experts, sigmoid grouped top-k with a non-zero
correction bias, routed scaling). CPU, fp32."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pipeline.core.model.config import MLAConfig, ModelConfig, MoEConfig, YarnScaling
from pipeline.core.model.hf_names import from_hf_state_dict
from tests.builders import SEQ, VOCAB
from tests.builders import build_model as build

transformers = pytest.importorskip("transformers")

HIDDEN, FFN, HEADS, MOE_FFN = 64, 96, 4, 16
MLA_CASES = ["q_lora_yarn", "no_q_lora", "q_lora_not_interleaved"]
MOE_CASES = ["moe_q_lora_yarn", "moe_no_q_lora"]


def _case(name: str) -> tuple[object, ModelConfig]:
    """(HF config, our config written out by hand) for a tiny dense DeepSeek-V3 of `name`.

    q_lora_yarn: q down/up projections and YaRN (factor 4 over 32 original positions, mscale
    0.9 and mscale_all_dim 0.7 so both corrections differ from 1); no_q_lora: one q projection
    (V2-Lite's shape) and plain RoPE; q_lora_not_interleaved: RoPE dimensions in halves.
    moe_*: three layers, the first dense, then 8 routed experts in 4 groups (top-2 of the best
    2 groups) and 2 shared experts, routed weights renormalised and scaled by 2.5."""
    q_lora = None if name.endswith("no_q_lora") else 48
    interleave = name != "q_lora_not_interleaved"
    mla = MLAConfig(
        kv_lora_rank=32, q_lora_rank=q_lora, qk_nope_head_dim=16, qk_rope_head_dim=8,
        v_head_dim=12, rope_interleave=interleave,
    )  # fmt: skip
    rope = {"rope_type": "default", "rope_theta": 10000.0}
    scaling = None
    if name.endswith("q_lora_yarn"):
        scaling = YarnScaling(
            factor=4.0, original_max_position_embeddings=32, mscale=0.9, mscale_all_dim=0.7
        )
        rope |= {
            "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32,
            "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 0.9, "mscale_all_dim": 0.7,
        }  # fmt: skip
    is_moe = name.startswith("moe")
    layers, dense = (3, 1) if is_moe else (2, 2)
    hf = transformers.DeepseekV3Config(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=layers,
        num_attention_heads=HEADS, num_key_value_heads=HEADS, kv_lora_rank=32,
        q_lora_rank=q_lora, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12,
        first_k_dense_replace=dense, max_position_embeddings=128, rms_norm_eps=1e-6,
        rope_parameters=rope, rope_interleave=interleave, tie_word_embeddings=False,
        num_nextn_predict_layers=0, n_routed_experts=8, num_experts_per_tok=2, n_group=4,
        topk_group=2, n_shared_experts=2, moe_intermediate_size=MOE_FFN,
        routed_scaling_factor=2.5, norm_topk_prob=True,
    )  # fmt: skip
    moe = MoEConfig(
        num_experts=8, top_k=2, ffn_hidden_size=MOE_FFN, aux_loss_coeff=0.0,
        dense_layers=list(range(dense)), score_function="sigmoid", num_groups=4, topk_groups=2,
        routed_scaling_factor=2.5, num_shared_experts=2, expert_bias=True,
    )  # fmt: skip
    ours = ModelConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, ffn_hidden_size=FFN, num_layers=layers,
        num_attention_heads=HEADS, max_position_embeddings=128, norm_eps=1e-6,
        rope_theta=10000.0, rope_scaling=scaling, mla=mla, moe=moe if is_moe else None,
    )  # fmt: skip
    return hf, ours


def _hf_model(hf_config):
    """The HF model, every weight perturbed so norms are not all ones, and correction biases
    large enough to change which experts are chosen."""
    hf_config._attn_implementation = "eager"
    torch.manual_seed(0)
    hf = transformers.DeepseekV3ForCausalLM(hf_config).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(torch.randn_like(p) * 0.05)
        for name, buffer in hf.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.copy_(torch.randn_like(buffer) * 0.1)
    return hf


def _assert_logits_and_grads_equal(hf, model) -> None:
    """Logits and every parameter's gradient of the CE loss agree with transformers to 1e-4
    on 40 positions (past YaRN's 32 original positions)."""
    seq = max(SEQ, 40)
    tokens = torch.randint(0, VOCAB, (2, seq), generator=torch.Generator().manual_seed(1))
    labels = torch.randint(0, VOCAB, (2, seq), generator=torch.Generator().manual_seed(2))
    hf_logits = hf(input_ids=tokens).logits
    logits = model.logits(tokens)
    assert (logits - hf_logits).abs().max() < 1e-4
    F.cross_entropy(hf_logits.flatten(0, 1), labels.flatten()).backward()
    F.cross_entropy(logits.flatten(0, 1), labels.flatten()).backward()
    hf_grads = from_hf_state_dict({n: p.grad for n, p in hf.named_parameters()})
    for pname, p in model.named_parameters():
        assert (p.grad - hf_grads[pname]).abs().max() < 1e-4, pname


@pytest.mark.parametrize("name", MLA_CASES + MOE_CASES)
def test_logits_and_gradients_equal_transformers(name: str) -> None:
    hf_config, config = _case(name)
    hf = _hf_model(hf_config)
    model = build(config)
    model.load_state_dict(from_hf_state_dict(hf.state_dict()), strict=True)
    assert {block.attention.kind for block in model.layers.values()} == {"mla"}
    hf_kinds = ["moe" if hasattr(layer.mlp, "experts") else "dense" for layer in hf.model.layers]
    assert [block.mlp_kind for block in model.layers.values()] == hf_kinds
    _assert_logits_and_grads_equal(hf, model)


def test_correction_bias_changes_the_choice_not_the_weights() -> None:
    """The bias decides which experts a token gets: zeroing it moves the logits. Scores are
    in (0, 1), so a bias of 10 on expert 3 makes every token choose it, and its weight is still
    its plain sigmoid score (renormalised and scaled, never biased)."""
    hf_config, config = _case("moe_no_q_lora")
    hf = _hf_model(hf_config)
    model = build(config)
    model.load_state_dict(from_hf_state_dict(hf.state_dict()), strict=True)
    tokens = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = model.logits(tokens)
        moe = model.layers["1"].moe
        moe.expert_bias.zero_()
        assert (model.logits(tokens) - expected).abs().max() > 1e-3
        moe.expert_bias[3] = 10.0
        logits = torch.randn(20, 8, generator=torch.Generator().manual_seed(3))
        _, weights, chosen = moe.route(logits)
    assert (chosen == 3).any(dim=-1).all()
    scores = torch.sigmoid(logits).gather(1, chosen)
    torch.testing.assert_close(weights, 2.5 * scores / scores.sum(-1, keepdim=True))


def test_yarn_corrections_matter() -> None:
    """Without YaRN (or with the layout flag flipped) the logits move: neither is ignored."""
    hf_config, config = _case("q_lora_yarn")
    hf = _hf_model(hf_config)
    tokens = torch.randint(0, VOCAB, (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = hf(input_ids=tokens).logits
    for change in ("no_yarn", "not_interleaved"):
        _, changed = _case("q_lora_yarn")
        if change == "no_yarn":
            changed.rope_scaling = None
        else:
            changed.mla.rope_interleave = False
        model = build(changed)
        model.load_state_dict(from_hf_state_dict(hf.state_dict()), strict=True)
        with torch.no_grad():
            assert (model.logits(tokens) - expected).abs().max() > 1e-3, change
