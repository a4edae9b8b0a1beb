"""Qwen3 and Qwen3-MoE against transformers (the oracle): model numerics, config and weight
conversion both ways, `pipe convert` round trips, parameter counts of the published models, and
Megatron's `qk_layernorm` checkpoints. CPU, fp32."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from pipeline.core.model.config import ModelConfig, MoEConfig
from pipeline.core.model.flavors import get_flavor, num_parameters
from pipeline.core.model.hf_names import from_hf_state_dict
from pipeline.core.model.moe import load_balancing_loss
from pipeline.core.model.transformer import Transformer
from pipeline.weights.hf_config import config_from_hf
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
)
from tests.builders import build_model as build

transformers = pytest.importorskip("transformers")

HIDDEN, HEAD_DIM, FFN, MOE_FFN = 64, 24, 96, 32  # head_dim 24: q width 96 != hidden 64
CASES = ["qwen3_untied", "qwen3_tied", "qwen3_moe", "qwen3_moe_sparse_step"]


def _case(name: str) -> tuple[type, object, ModelConfig]:
    """(HF class, HF config, our config written out by hand) for a tiny model of `name`.

    qwen3_moe: experts in every layer but layer 0 (`mlp_only_layers`), top-k renormalised;
    qwen3_moe_sparse_step: experts in layers 1 and 3 (`decoder_sparse_step` 2), plain softmax
    weights (`norm_topk_prob` false)."""
    layers = 4 if name == "qwen3_moe_sparse_step" else 3
    common = dict(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=FFN,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=HEAD_DIM,
        max_position_embeddings=128,
        rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6},
        tie_word_embeddings=name == "qwen3_tied",
    )
    ours = dict(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        ffn_hidden_size=FFN,
        num_layers=layers,
        num_attention_heads=4,
        num_kv_heads=2,
        head_dim=HEAD_DIM,
        max_position_embeddings=128,
        norm_eps=1e-6,
        rope_theta=1e6,
        tie_word_embeddings=name == "qwen3_tied",
        qk_norm=True,
    )
    if not name.startswith("qwen3_moe"):
        hf = transformers.Qwen3Config(**common)
        return transformers.Qwen3ForCausalLM, hf, ModelConfig(**ours)
    step = 2 if name == "qwen3_moe_sparse_step" else 1
    dense = [] if step == 2 else [0]
    normalised = step == 1
    hf = transformers.Qwen3MoeConfig(
        **common,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=MOE_FFN,
        decoder_sparse_step=step,
        mlp_only_layers=dense,
        norm_topk_prob=normalised,
        router_aux_loss_coef=0.001,
    )
    moe = MoEConfig(
        num_experts=8,
        top_k=2,
        ffn_hidden_size=MOE_FFN,
        aux_loss_coeff=0.001,
        norm_topk_prob=normalised,
        layer_step=step,
        dense_layers=dense,
    )
    return transformers.Qwen3MoeForCausalLM, hf, ModelConfig(**ours, moe=moe)


def _hf_model(name: str):
    """The HF model of `name`, its weights perturbed so q/k and layer norms are not all ones."""
    hf_cls, hf_config, _ = _case(name)
    hf_config._attn_implementation = "eager"
    torch.manual_seed(0)
    hf = hf_cls(hf_config).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return hf


@pytest.mark.parametrize("name", CASES)
def test_logits_and_gradients_equal_transformers(name: str) -> None:
    """Same weights and tokens: logits and every parameter's gradient of the CE loss agree to
    1e-4; the layers are dense or MoE exactly where transformers put them."""
    hf = _hf_model(name)
    _, _, config = _case(name)
    model = build(config)
    model.load_state_dict(from_hf_state_dict(hf.state_dict()), strict=True)
    hf_kinds = ["moe" if hasattr(layer.mlp, "experts") else "dense" for layer in hf.model.layers]
    assert [block.mlp_kind for block in model.layers.values()] == hf_kinds
    if name.startswith("qwen3_moe"):
        assert {"dense", "moe"} == set(hf_kinds)

    tokens = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(1))
    labels = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(2))
    hf_logits = hf(input_ids=tokens).logits
    logits = model.logits(tokens)
    assert (logits - hf_logits).abs().max() < 1e-4

    F.cross_entropy(hf_logits.flatten(0, 1), labels.flatten()).backward()
    F.cross_entropy(logits.flatten(0, 1), labels.flatten()).backward()
    hf_grads = from_hf_state_dict({n: p.grad for n, p in hf.named_parameters()})
    for pname, p in model.named_parameters():
        assert (p.grad - hf_grads[pname]).abs().max() < 1e-4, pname


def test_normalising_top_k_matters() -> None:
    """With norm_topk_prob flipped the logits move: the flag is not silently ignored."""
    hf = _hf_model("qwen3_moe")
    _, _, config = _case("qwen3_moe")
    config.moe.norm_topk_prob = False
    model = build(config)
    model.load_state_dict(from_hf_state_dict(hf.state_dict()), strict=True)
    tokens = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert (model.logits(tokens) - hf(input_ids=tokens).logits).abs().max() > 1e-3


def test_aux_loss_is_transformers_per_layer_loss_over_top_k() -> None:
    """Our load-balancing loss (Switch/Megatron: assignment fractions summing to 1) times top_k
    is transformers' `load_balancing_loss_func` for one MoE layer (fractions summing to k)."""
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

    logits = torch.randn(40, 8, generator=torch.Generator().manual_seed(0))
    probs = torch.softmax(logits, dim=-1)
    ours = load_balancing_loss(probs, probs.topk(2, dim=-1).indices)
    theirs = load_balancing_loss_func((logits,), num_experts=8, top_k=2)
    torch.testing.assert_close(2 * ours, theirs)


def test_config_from_transformers_saved_dicts() -> None:
    """config.json dicts as transformers writes them read back as our hand-written configs."""
    for name in CASES:
        hf_cls, hf_config, expected = _case(name)
        hf = hf_config.to_dict() | {"architectures": [hf_cls.__name__]}
        expected.init_method_std = hf_config.initializer_range
        assert config_from_hf(hf) == expected, name


def test_published_configs_give_the_flavors_and_their_sizes() -> None:
    """The Qwen3-8B-Base and Qwen3-30B-A3B-Base config.json values give our full-size flavors,
    whose parameter counts equal transformers' models of those configs (built on meta) and the
    published sizes (8.2B; 30.5B total with 3.3B active)."""
    from pipeline.train.report.estimates import parameter_counts

    dense = dict(
        architectures=["Qwen3ForCausalLM"],
        vocab_size=151936,
        hidden_size=4096,
        intermediate_size=12288,
        num_hidden_layers=36,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        max_position_embeddings=40960,
        rms_norm_eps=1e-6,
        rope_theta=1000000,
        tie_word_embeddings=False,
        attention_bias=False,
        use_sliding_window=False,
        sliding_window=None,
        max_window_layers=36,
        initializer_range=0.02,
        hidden_act="silu",
    )
    moe = dense | dict(
        architectures=["Qwen3MoeForCausalLM"],
        hidden_size=2048,
        intermediate_size=6144,
        num_hidden_layers=48,
        num_key_value_heads=4,
        num_experts=128,
        num_experts_per_tok=8,
        moe_intermediate_size=768,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        router_aux_loss_coef=0.001,
    )
    for hf, flavor, published in ((dense, "qwen3_8b", 8.2e9), (moe, "qwen3_30b_a3b", 30.5e9)):
        ours = get_flavor(flavor)
        assert config_from_hf(hf) == ours, flavor
        dense_model = flavor == "qwen3_8b"
        hf_cls = transformers.Qwen3ForCausalLM if dense_model else transformers.Qwen3MoeForCausalLM
        config_cls = transformers.Qwen3Config if dense_model else transformers.Qwen3MoeConfig
        kwargs = {k: v for k, v in hf.items() if k not in ("architectures", "rope_theta")}
        with torch.device("meta"):
            hf_model = hf_cls(config_cls(**kwargs))
        assert num_parameters(ours) == sum(p.numel() for p in hf_model.parameters()), flavor
        assert abs(num_parameters(ours) - published) < 0.1e9, flavor  # published to 0.1B
    assert abs(parameter_counts(get_flavor("qwen3_30b_a3b")).active - 3.3e9) < 0.1e9


# ---------------------------------------------------------------------------------------------
# `pipe convert` to and from Hugging Face
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module", params=CASES)
def hf_dir(request, tmp_path_factory) -> tuple[Path, object]:
    """A perturbed tiny model saved by transformers in several shards, and the model."""
    hf = _hf_model(request.param)
    directory = tmp_path_factory.mktemp(request.param) / "hf"
    hf.save_pretrained(directory, max_shard_size=SHARD_BYTES)
    return directory, hf


def test_hf_round_trip_is_bit_identical_and_loads_in_transformers(hf_dir, tmp_path) -> None:
    """HF -> our source -> HF: the same tensor names (per-expert on disk) and bytes, the same
    config; our model from the reader and transformers from the written files both give the
    original logits."""
    path, hf = hf_dir
    tokens = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(1))
    assert_hf_round_trip(path, hf, tmp_path / "out", tokens)


def test_cli_round_trip_through_a_pipe_checkpoint(hf_dir, tmp_path) -> None:
    """`pipe convert --from hf` then `--to hf` with default flags: bit-identical files, and
    each step verifies its logits against transformers."""
    directory, _ = hf_dir
    back, _ = cli_hf_round_trip(directory, tmp_path)
    assert hf_config_dict(back) == hf_config_dict(directory)


def test_our_qwen3_moe_writes_hub_keys(tmp_path) -> None:
    """A model made by us (tiny_qwen3_moe) writes Qwen3-MoE's hub spelling: `num_experts`,
    `moe_intermediate_size`, `mlp_only_layers`, per-expert `gate_proj/up_proj/down_proj`."""
    config = get_flavor("tiny_qwen3_moe")
    model = build(config)
    source = InMemorySource(config, {n: t.detach() for n, t in model.state_dict().items()})
    out = write_hf(source, tmp_path / "hf")
    hf = json.loads((out / "config.json").read_text())
    assert hf["architectures"] == ["Qwen3MoeForCausalLM"]
    assert (hf["num_experts"], hf["moe_intermediate_size"], hf["mlp_only_layers"]) == (8, 64, [0])
    assert (hf["intermediate_size"], hf["head_dim"], hf["norm_topk_prob"]) == (352, 64, True)
    names = disk_tensors(out)
    assert "model.layers.1.mlp.experts.7.down_proj.weight" in names
    assert "model.layers.0.mlp.gate_proj.weight" in names  # the dense first layer
    assert "model.layers.0.self_attn.q_norm.weight" in names


def test_export_refuses_qwen3_clearly() -> None:
    from pipeline.export.legacy_trtllm.config import LegacyExportOptions, trtllm_config

    with pytest.raises(ValueError, match="Qwen3ForCausalLM .* not supported"):
        trtllm_config(get_flavor("tiny_qwen3"), LegacyExportOptions())


def test_moe_without_qk_norm_needs_mixtral_shape() -> None:
    """A MoE with dense layers but no q/k norms has no HF architecture: refused, not mangled."""
    from pipeline.weights.hf_config import choose_architecture

    config = get_flavor("tiny_moe")
    config.moe.dense_layers = [0]
    with pytest.raises(ValueError, match="Mixtral-shaped"):
        choose_architecture(config)


def test_transformer_is_built_on_meta_with_per_layer_kinds() -> None:
    with torch.device("meta"):
        model = Transformer(get_flavor("tiny_qwen3_moe"))
    assert [b.mlp_kind for b in model.layers.values()] == ["dense", "moe", "moe", "moe"]
    assert sorted(model.moe_layers()) == ["1", "2", "3"]
    assert model.layers["0"].attention.q_norm.weight.shape == (64,)
