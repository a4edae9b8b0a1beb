"""GLM-4.5/4.6/4.7 (`Glm4MoeForCausalLM`) against transformers (the oracle): grouped-query
attention with q/k/v biases, per-head q/k norms (GLM-4.5) or none (GLM-4.5-Air), RoPE over
the first half of each head (`partial_rotary_factor` 0.5), then DeepSeek-V3's MoE (first dense
layers, sigmoid grouped top-k with the correction bias, a shared expert, routed scaling); its
multi-token prediction layer read as pipe's MTP. CPU, fp32."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from pipeline.core.model.config import ModelConfig, MoEConfig
from pipeline.core.model.flavors import get_flavor, num_parameters
from pipeline.core.model.hf_names import from_hf_state_dict
from pipeline.weights.hf_config import config_from_hf, config_to_hf
from pipeline.weights.hf_reader import HFSource
from pipeline.weights.hf_writer import write_hf
from pipeline.weights.source import InMemorySource
from tests.builders import (
    SEQ,
    SHARD_BYTES,
    VOCAB,
    assert_hf_round_trip,
    cli_hf_round_trip,
    disk_tensors,
    hf_config_dict,
    load_from_source,
    perturbed_with_bias,
)
from tests.builders import build_model as build
from tests.convert.test_deepseek_v3 import _assert_logits_and_grads_equal, _with_mtp_layer

transformers = pytest.importorskip("transformers")

HIDDEN, HEAD_DIM, FFN, MOE_FFN = 64, 24, 96, 16  # head_dim 24: q width 96 != hidden 64
# glm45: q/k norms and routed scaling (GLM-4.5's shape); air: neither (GLM-4.5-Air's);
# quarter: a quarter of each head rotated, to show the factor is read, not assumed.
CASES = ["glm45", "air", "quarter"]


def _case(name: str) -> tuple[object, ModelConfig]:
    """(HF config, our config written out by hand): three layers, the first `dense` dense, 8
    routed experts in 4 groups (top-2 of the best 2 groups) plus one shared expert."""
    qk_norm = name == "glm45"
    factor = 0.25 if name == "quarter" else 0.5
    scaling = 2.5 if name == "glm45" else 1.0
    dense = 1
    hf = transformers.Glm4MoeConfig(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=FFN,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=HEAD_DIM,
        max_position_embeddings=128,
        rms_norm_eps=1e-5,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": 10000.0,
            "partial_rotary_factor": factor,
        },
        attention_bias=True,
        use_qk_norm=qk_norm,
        tie_word_embeddings=False,
        num_nextn_predict_layers=0,
        n_routed_experts=8,
        num_experts_per_tok=2,
        n_group=4,
        topk_group=2,
        n_shared_experts=1,
        moe_intermediate_size=MOE_FFN,
        routed_scaling_factor=scaling,
        norm_topk_prob=True,
        first_k_dense_replace=dense,
    )
    moe = MoEConfig(
        num_experts=8,
        top_k=2,
        ffn_hidden_size=MOE_FFN,
        aux_loss_coeff=0.0,
        aux_loss_type="sequence",
        dense_layers=list(range(dense)),
        score_function="sigmoid",
        num_groups=4,
        topk_groups=2,
        routed_scaling_factor=scaling,
        num_shared_experts=1,
        expert_bias=True,
    )
    ours = ModelConfig(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        ffn_hidden_size=FFN,
        num_layers=3,
        num_attention_heads=4,
        num_kv_heads=2,
        head_dim=HEAD_DIM,
        max_position_embeddings=128,
        norm_eps=1e-5,
        rope_theta=10000.0,
        qkv_bias=True,
        qk_norm=qk_norm,
        partial_rotary_factor=factor,
        moe=moe,
    )
    return hf, ours


def _hf_model(hf_config):
    """The HF model, every weight perturbed (norms off one, biases off zero) and correction
    biases large enough to change which experts are chosen."""
    hf_config._attn_implementation = "eager"
    torch.manual_seed(0)
    return perturbed_with_bias(transformers.Glm4MoeForCausalLM(hf_config).eval())


def _tokens(seed: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("name", CASES)
def test_logits_and_gradients_equal_transformers(name: str) -> None:
    """Same weights and tokens: logits and every parameter's gradient of the CE loss agree to
    1e-4 (on 40 positions); the layers are dense or MoE exactly where transformers put
    them."""
    hf_config, config = _case(name)
    hf = _hf_model(hf_config)
    model = build(config)
    model.load_state_dict(from_hf_state_dict(hf.state_dict()), strict=True)
    hf_kinds = ["moe" if hasattr(layer.mlp, "experts") else "dense" for layer in hf.model.layers]
    assert (
        [block.mlp_kind for block in model.layers.values()]
        == hf_kinds
        == [
            "dense",
            "moe",
            "moe",
        ]
    )
    _assert_logits_and_grads_equal(hf, model)


def test_partial_rotary_factor_matters() -> None:
    """Rotating the whole head (the default factor 1) moves the logits: the factor is used."""
    hf_config, config = _case("air")
    hf = _hf_model(hf_config)
    config.partial_rotary_factor = 1.0
    model = build(config)
    model.load_state_dict(from_hf_state_dict(hf.state_dict()), strict=True)
    with torch.no_grad():
        assert (model.logits(_tokens()) - hf(input_ids=_tokens()).logits).abs().max() > 1e-3


def test_config_from_transformers_saved_dicts() -> None:
    """config.json dicts as transformers 5 writes them (no head_dim key when it is the default,
    the factor inside rope_parameters) read back as our hand-written configs, and ours written
    out read back unchanged."""
    for name in CASES:
        hf_config, expected = _case(name)
        hf = hf_config.to_dict() | {"architectures": ["Glm4MoeForCausalLM"]}
        assert config_from_hf(hf) == expected, name
        assert config_from_hf(config_to_hf(expected, dtype=torch.float32)) == expected, name


# zai-org/GLM-4.5-Air and zai-org/GLM-4.5 config.json (the model's keys).
GLM_45_AIR_JSON = dict(
    architectures=["Glm4MoeForCausalLM"],
    model_type="glm4_moe",
    attention_bias=True,
    attention_dropout=0.0,
    pad_token_id=151329,
    eos_token_id=[151329, 151336, 151338],
    head_dim=128,
    hidden_act="silu",
    hidden_size=4096,
    partial_rotary_factor=0.5,
    initializer_range=0.02,
    intermediate_size=10944,
    max_position_embeddings=131072,
    moe_intermediate_size=1408,
    norm_topk_prob=True,
    num_attention_heads=96,
    n_group=1,
    topk_group=1,
    n_routed_experts=128,
    n_shared_experts=1,
    routed_scaling_factor=1.0,
    num_experts_per_tok=8,
    first_k_dense_replace=1,
    num_hidden_layers=46,
    num_key_value_heads=8,
    rms_norm_eps=1e-05,
    rope_scaling=None,
    rope_theta=1000000,
    num_nextn_predict_layers=1,
    tie_word_embeddings=False,
    torch_dtype="bfloat16",
    use_cache=True,
    use_qk_norm=False,
    vocab_size=151552,
)
GLM_45_JSON = GLM_45_AIR_JSON | dict(
    hidden_size=5120,
    intermediate_size=12288,
    moe_intermediate_size=1536,
    n_routed_experts=160,
    routed_scaling_factor=2.5,
    first_k_dense_replace=3,
    num_hidden_layers=92,
    use_qk_norm=True,
)


def _hf_parameters(hf: dict) -> int:
    """Parameters of transformers' Glm4MoeForCausalLM for a config.json dict, on meta (it
    builds no multi-token prediction layer)."""
    kwargs = {k: v for k, v in hf.items() if k not in ("architectures", "model_type")}
    with torch.device("meta"):
        model = transformers.Glm4MoeForCausalLM(transformers.Glm4MoeConfig(**kwargs))
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize(
    ("hf", "flavor", "total", "active"),
    [
        (GLM_45_AIR_JSON, "glm4_5_air", 106e9, 12e9),
        (GLM_45_JSON, "glm4_5", 355e9, 32e9),
    ],
)
def test_published_configs_give_the_flavors_and_their_sizes(hf, flavor, total, active) -> None:
    """GLM-4.5-Air's and GLM-4.5's config.json read as our flavors, whose parameter counts
    (without the multi-token prediction layer, as transformers builds them) are transformers'
    and, to the published rounding, 106B / 355B total with 12B / 32B active."""
    from pipeline.train.report.estimates import parameter_counts

    ours = get_flavor(flavor)
    assert config_from_hf(hf) == ours
    assert num_parameters(ours) == _hf_parameters(hf)
    counts = parameter_counts(ours)
    assert abs(num_parameters(ours) - total) < 0.01 * total  # published rounded: 106B, 355B
    # zai-org's active count leaves out the embedding and output layers.
    assert abs(counts.active - counts.embedding - active) < 0.5e9


# ---------------------------------------------------------------------------------------------
# `pipe convert` to and from Hugging Face
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module", params=["glm45", "air"])
def hf_dir(request, tmp_path_factory) -> tuple[Path, object]:
    """A perturbed tiny GLM-4.5 saved by transformers in several shards, and the model."""
    hf_config, _ = _case(request.param)
    hf = _hf_model(hf_config)
    directory = tmp_path_factory.mktemp(request.param) / "hf"
    hf.save_pretrained(directory, max_shard_size=SHARD_BYTES)
    return directory, hf


def _without_hub_keys(hf: dict) -> dict:
    """`hf` less the DeepSeek keys we write for the MoE (transformers' GLM config keeps no
    balance-loss settings)."""
    extra = ("aux_loss_alpha", "seq_aux", "scoring_func", "topk_method")
    return {k: v for k, v in hf.items() if k not in extra}


def test_hf_round_trip_is_bit_identical_and_loads_in_transformers(hf_dir, tmp_path) -> None:
    """HF -> our source -> HF: the same tensor names (per-expert on disk, q/k/v biases, the
    correction bias in fp32) and bytes, the same config; our model from the reader and
    transformers from the written files both give the original logits."""
    path, hf = hf_dir
    assert HFSource(path).tensors()["layers.1.moe.expert_bias"].dtype == torch.float32
    written = assert_hf_round_trip(path, hf, tmp_path / "out")
    assert "model.layers.0.self_attn.k_proj.bias" in written
    assert "model.layers.2.mlp.experts.7.down_proj.weight" in written
    assert _without_hub_keys(hf_config_dict(tmp_path / "out")) == hf_config_dict(path)


def test_cli_round_trip_through_a_pipe_checkpoint(hf_dir, tmp_path) -> None:
    """`pipe convert --from hf` then `--to hf` with default flags: bit-identical files, and
    each step verifies its logits against transformers."""
    directory, _ = hf_dir
    back, _ = cli_hf_round_trip(directory, tmp_path)
    assert _without_hub_keys(hf_config_dict(back)) == hf_config_dict(directory)


def test_bf16_export_loads_in_transformers(tmp_path) -> None:
    """`--dtype bfloat16` writes bf16 weights (the correction bias kept fp32) that transformers
    loads (upcast to fp32) to the logits of our model read back from the same files."""
    hf_config, config = _case("glm45")
    hf = _hf_model(hf_config)
    source = InMemorySource(config, from_hf_state_dict(hf.state_dict()))
    out = write_hf(source, tmp_path / "bf16", dtype=torch.bfloat16)
    tensors = disk_tensors(out)
    assert tensors["model.layers.1.mlp.gate.e_score_correction_bias"].dtype == torch.float32
    assert tensors["model.layers.1.self_attn.q_proj.bias"].dtype == torch.bfloat16
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(
        out, attn_implementation="eager", dtype=torch.float32
    ).eval()
    with torch.no_grad():
        ours = load_from_source(HFSource(out)).logits(_tokens())
        assert (reloaded(input_ids=_tokens()).logits - ours).abs().max() < 1e-4


def test_multi_token_prediction_layer_converts_both_ways_bit_exactly(tmp_path) -> None:
    """GLM's MTP layer (`model.layers.{num_hidden_layers}.*`, which transformers skips on load;
    added as zai-org publishes it: a MoE block, enorm / hnorm / eh_proj / shared_head.norm, and
    copies of the embedding and lm_head) reads into our `mtp.3.*` with its q/k/v biases and q/k
    norms, writes back under the same names and bytes, and transformers loads the written model
    to the original logits."""
    hf_config, _ = _case("glm45")
    hf = _hf_model(hf_config)
    hf.save_pretrained(tmp_path / "plain")
    path = _with_mtp_layer(tmp_path / "plain", tmp_path / "hf")
    source = HFSource(path)
    assert source.model_config.mtp_num_layers == 1
    names = source.tensors()
    for name in (
        "mtp.3.eh_proj.weight",
        "mtp.3.head_norm.weight",
        "mtp.3.attention.wq.bias",
        "mtp.3.attention.q_norm.weight",
        "mtp.3.moe.expert_bias",
        "mtp.3.moe.experts.w1",
        "mtp.3.moe.shared_experts.w2.weight",
    ):
        assert name in names, name
    model = load_from_source(source)  # every name is a parameter or buffer of our MTP model
    assert list(model.mtp) == ["3"]

    memory = InMemorySource(source.model_config, {n: source.read(n) for n in names})
    out = write_hf(memory, tmp_path / "out")
    original, written = disk_tensors(path), disk_tensors(out)
    assert sorted(original) == sorted(written)
    for tensor_name, tensor in original.items():
        assert torch.equal(written[tensor_name], tensor), tensor_name
    assert json.loads((out / "config.json").read_text())["num_nextn_predict_layers"] == 1
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(
        out, attn_implementation="eager"
    ).eval()
    with torch.no_grad():
        expected = hf(input_ids=_tokens()).logits
        assert (reloaded(input_ids=_tokens()).logits - expected).abs().max() < 1e-4
        assert (model.logits(_tokens()) - expected).abs().max() < 1e-4
