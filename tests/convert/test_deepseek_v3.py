"""DeepSeek-V3 against transformers (the oracle): multi-head latent attention with and without
the q low-rank projection, YaRN RoPE scaling with its mscale corrections, the interleaved RoPE
layout, DeepSeekMoE (first dense layers, shared experts, sigmoid grouped top-k with a non-zero
correction bias, routed scaling). CPU, fp32."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from pipeline.core.model.config import MLAConfig, ModelConfig, MoEConfig, YarnScaling
from pipeline.core.model.flavors import get_flavor, num_parameters
from pipeline.core.model.hf_names import from_hf_state_dict
from pipeline.weights.hf_reader import HFSource
from pipeline.weights.hf_writer import write_hf
from pipeline.weights.source import InMemorySource
from tests.builders import (
    SEQ,
    SHARD_BYTES,
    VOCAB,
    cli_hf_round_trip,
    disk_tensors,
    hf_config_dict,
    load_from_source,
)
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
        kv_lora_rank=32,
        q_lora_rank=q_lora,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=12,
        rope_interleave=interleave,
    )
    rope = {"rope_type": "default", "rope_theta": 10000.0}
    scaling = None
    if name.endswith("q_lora_yarn"):
        scaling = YarnScaling(
            factor=4.0, original_max_position_embeddings=32, mscale=0.9, mscale_all_dim=0.7
        )
        rope |= {
            "rope_type": "yarn",
            "factor": 4.0,
            "original_max_position_embeddings": 32,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "mscale": 0.9,
            "mscale_all_dim": 0.7,
        }
    is_moe = name.startswith("moe")
    layers, dense = (3, 1) if is_moe else (2, 2)
    hf = transformers.DeepseekV3Config(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=FFN,
        num_hidden_layers=layers,
        num_attention_heads=HEADS,
        num_key_value_heads=HEADS,
        kv_lora_rank=32,
        q_lora_rank=q_lora,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=12,
        first_k_dense_replace=dense,
        max_position_embeddings=128,
        rms_norm_eps=1e-6,
        rope_parameters=rope,
        rope_interleave=interleave,
        tie_word_embeddings=False,
        num_nextn_predict_layers=0,
        n_routed_experts=8,
        num_experts_per_tok=2,
        n_group=4,
        topk_group=2,
        n_shared_experts=2,
        moe_intermediate_size=MOE_FFN,
        routed_scaling_factor=2.5,
        norm_topk_prob=True,
    )
    moe = MoEConfig(
        num_experts=8,
        top_k=2,
        ffn_hidden_size=MOE_FFN,
        aux_loss_coeff=0.0,
        dense_layers=list(range(dense)),
        score_function="sigmoid",
        num_groups=4,
        topk_groups=2,
        routed_scaling_factor=2.5,
        num_shared_experts=2,
        expert_bias=True,
        aux_loss_type="sequence",  # DeepSeek's seq_aux, true unless a config says otherwise
    )
    ours = ModelConfig(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        ffn_hidden_size=FFN,
        num_layers=layers,
        num_attention_heads=HEADS,
        max_position_embeddings=128,
        norm_eps=1e-6,
        rope_theta=10000.0,
        rope_scaling=scaling,
        mla=mla,
        moe=moe if is_moe else None,
    )
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


# deepseek-ai/DeepSeek-V3's config.json (the model's keys; quantization_config left out).
DEEPSEEK_V3_JSON = dict(
    architectures=["DeepseekV3ForCausalLM"],
    model_type="deepseek_v3",
    attention_bias=False,
    aux_loss_alpha=0.001,
    ep_size=1,
    first_k_dense_replace=3,
    hidden_act="silu",
    hidden_size=7168,
    initializer_range=0.02,
    intermediate_size=18432,
    kv_lora_rank=512,
    max_position_embeddings=163840,
    moe_intermediate_size=2048,
    moe_layer_freq=1,
    n_group=8,
    n_routed_experts=256,
    n_shared_experts=1,
    norm_topk_prob=True,
    num_attention_heads=128,
    num_experts_per_tok=8,
    num_hidden_layers=61,
    num_key_value_heads=128,
    num_nextn_predict_layers=1,
    pretraining_tp=1,
    q_lora_rank=1536,
    qk_nope_head_dim=128,
    qk_rope_head_dim=64,
    rms_norm_eps=1e-06,
    rope_scaling={
        "beta_fast": 32,
        "beta_slow": 1,
        "factor": 40,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
        "original_max_position_embeddings": 4096,
        "type": "yarn",
    },
    rope_theta=10000,
    routed_scaling_factor=2.5,
    scoring_func="sigmoid",
    seq_aux=True,
    tie_word_embeddings=False,
    topk_group=4,
    topk_method="noaux_tc",
    torch_dtype="bfloat16",
    v_head_dim=128,
    vocab_size=129280,
)


def _hf_parameters(hf: dict) -> int:
    """Parameters of transformers' DeepseekV3ForCausalLM for a config.json dict, on meta."""
    kwargs = {k: v for k, v in hf.items() if k not in ("architectures", "model_type")}
    with torch.device("meta"):
        model = transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(**kwargs))
    return sum(p.numel() for p in model.parameters())


def test_published_config_gives_the_flavor_and_its_size() -> None:
    """DeepSeek-V3's config.json reads as our `deepseek_v3` flavor, whose parameter count is
    transformers' (no MTP module: 671B) and 37B active per token; our `moonlight_16b_a3b`
    written out as a config.json has transformers' count too, about 16B total and 3B active."""
    from pipeline.train.report.estimates import parameter_counts
    from pipeline.weights.hf_config import config_from_hf, config_to_hf

    ours = get_flavor("deepseek_v3")
    assert config_from_hf(DEEPSEEK_V3_JSON) == ours
    assert num_parameters(ours) == _hf_parameters(DEEPSEEK_V3_JSON)
    assert abs(num_parameters(ours) - 671e9) < 0.5e9
    assert abs(parameter_counts(ours).active - 37e9) < 1e9
    moonlight = get_flavor("moonlight_16b_a3b")
    hf = config_to_hf(moonlight, dtype=torch.bfloat16)
    assert config_from_hf(hf) == moonlight
    assert num_parameters(moonlight) == _hf_parameters(hf)
    assert abs(num_parameters(moonlight) - 16e9) < 0.5e9
    assert abs(parameter_counts(moonlight).active - 3e9) < 0.5e9


def test_config_from_transformers_saved_dicts() -> None:
    """config.json dicts as transformers writes them (5.x rope_parameters, head_dim set to
    qk_rope_head_dim) read back as our hand-written configs."""
    from pipeline.weights.hf_config import config_from_hf

    for name in MLA_CASES + MOE_CASES:
        hf_config, expected = _case(name)
        hf = hf_config.to_dict() | {"architectures": ["DeepseekV3ForCausalLM"]}
        if expected.moe is not None:
            expected.moe.aux_loss_coeff = hf.get("aux_loss_alpha", 0.0)
        assert config_from_hf(hf) == expected, name
    # DeepSeek's seq_aux: the sequence-wise balance loss unless a config turns it off.
    batch_wise = DEEPSEEK_V3_JSON | {"seq_aux": False}
    assert config_from_hf(batch_wise).moe.aux_loss_type == "micro_batch"
    assert config_from_hf(DEEPSEEK_V3_JSON).moe.aux_loss_type == "sequence"


# ---------------------------------------------------------------------------------------------
# `pipe convert` to and from Hugging Face
# ---------------------------------------------------------------------------------------------


def _without_hub_keys(hf: dict) -> dict:
    """`hf` less the keys we write as the hub's config.json has them (vLLM reads scoring_func
    and topk_method) and transformers does not keep."""
    hub_only = ("aux_loss_alpha", "seq_aux", "scoring_func", "topk_method")
    return {k: v for k, v in hf.items() if k not in hub_only}


@pytest.fixture(scope="module", params=["moe_q_lora_yarn", "moe_no_q_lora"])
def hf_dir(request, tmp_path_factory) -> tuple[Path, object]:
    """A perturbed tiny DeepSeek-V3 saved by transformers in several shards, and the model."""
    hf_config, _ = _case(request.param)
    hf = _hf_model(hf_config)
    directory = tmp_path_factory.mktemp(request.param) / "hf"
    hf.save_pretrained(directory, max_shard_size=SHARD_BYTES)
    return directory, hf


def test_hf_round_trip_is_bit_identical_and_loads_in_transformers(hf_dir, tmp_path) -> None:
    """HF -> our source -> HF: the same tensor names (per-expert on disk, the correction bias
    in fp32) and bytes, the same config; our model from the reader and transformers from the
    written files both give the original logits."""
    path, hf = hf_dir
    source = HFSource(path)
    assert source.tensors()["layers.1.moe.expert_bias"].dtype == torch.float32
    memory = InMemorySource(
        source.model_config, {n: source.read(n) for n in source.tensors()}, source.metadata
    )
    out = write_hf(memory, tmp_path / "out", max_shard_bytes=SHARD_BYTES)
    original, written = disk_tensors(path), disk_tensors(out)
    assert sorted(original) == sorted(written)
    assert "model.layers.2.mlp.gate.e_score_correction_bias" in written
    for tensor_name, tensor in original.items():
        assert torch.equal(written[tensor_name], tensor), tensor_name
    assert _without_hub_keys(hf_config_dict(out)) == hf_config_dict(path)

    tokens = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = hf(input_ids=tokens).logits
        assert (load_from_source(source).logits(tokens) - expected).abs().max() < 1e-4
        reloaded = transformers.AutoModelForCausalLM.from_pretrained(
            out, attn_implementation="eager"
        ).eval()
        assert (reloaded(input_ids=tokens).logits - expected).abs().max() < 1e-4


def test_cli_round_trip_through_a_pipe_checkpoint(hf_dir, tmp_path) -> None:
    """`pipe convert --from hf` then `--to hf` with default flags: bit-identical files, and
    each step verifies its logits against transformers."""
    directory, _ = hf_dir
    back, _ = cli_hf_round_trip(directory, tmp_path)
    assert _without_hub_keys(hf_config_dict(back)) == hf_config_dict(directory)


def test_our_tiny_deepseek_v3_writes_hub_keys(tmp_path) -> None:
    """A model made by us writes DeepSeek-V3's hub spelling, which transformers loads to our
    logits."""
    config = get_flavor("tiny_deepseek_v3")
    model = build(config)
    with torch.no_grad():
        for moe in model.moe_layers().values():
            moe.expert_bias.copy_(torch.randn_like(moe.expert_bias) * 0.1)
    source = InMemorySource(config, {n: t.detach() for n, t in model.state_dict().items()})
    bf16 = disk_tensors(write_hf(source, tmp_path / "bf16", dtype=torch.bfloat16))
    assert bf16["model.layers.1.mlp.gate.e_score_correction_bias"].dtype == torch.float32
    assert bf16["model.layers.1.mlp.gate.weight"].dtype == torch.bfloat16
    out = write_hf(source, tmp_path / "hf")
    hf = json.loads((out / "config.json").read_text())
    assert hf["architectures"] == ["DeepseekV3ForCausalLM"]
    assert (hf["first_k_dense_replace"], hf["n_group"], hf["n_shared_experts"]) == (1, 4, 1)
    assert (hf["q_lora_rank"], hf["kv_lora_rank"], hf["scoring_func"]) == (96, 64, "sigmoid")
    names = disk_tensors(out)
    assert "model.layers.1.mlp.experts.7.down_proj.weight" in names
    assert "model.layers.1.mlp.shared_experts.up_proj.weight" in names
    assert "model.layers.0.self_attn.kv_a_proj_with_mqa.weight" in names
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(
        out, attn_implementation="eager"
    ).eval()
    tokens = torch.randint(0, config.vocab_size, (2, SEQ), generator=torch.Generator())
    with torch.no_grad():
        assert (reloaded(input_ids=tokens).logits - model.logits(tokens)).abs().max() < 1e-4


def _with_mtp_layer(path: Path, out: Path) -> Path:
    """`path` (a saved transformers DeepSeek-V3 of 3 layers) plus one multi-token prediction
    layer as DeepSeek publishes it: `model.layers.3.*` (a MoE block, here layer 2's weights
    perturbed), its enorm / hnorm / eh_proj / shared_head.norm, and copies of the embedding
    and lm_head (`embed_tokens`, `shared_head.head`)."""
    from safetensors.torch import save_file

    tensors = disk_tensors(path)
    generator = torch.Generator().manual_seed(2)
    mtp = {
        name.replace("model.layers.2.", "model.layers.3.", 1): tensor
        + 0.01 * torch.randn(tensor.shape, generator=generator).to(tensor.dtype)
        for name, tensor in tensors.items()
        if name.startswith("model.layers.2.")
    }
    for norm in ("enorm", "hnorm", "shared_head.norm"):
        mtp[f"model.layers.3.{norm}.weight"] = 1 + 0.1 * torch.randn(HIDDEN, generator=generator)
    mtp["model.layers.3.eh_proj.weight"] = torch.randn(HIDDEN, 2 * HIDDEN, generator=generator)
    mtp["model.layers.3.embed_tokens.weight"] = tensors["model.embed_tokens.weight"].clone()
    mtp["model.layers.3.shared_head.head.weight"] = tensors["lm_head.weight"].clone()
    out.mkdir()
    save_file({**tensors, **mtp}, str(out / "model.safetensors"))
    config = json.loads((path / "config.json").read_text()) | {"num_nextn_predict_layers": 1}
    (out / "config.json").write_text(json.dumps(config))
    return out


def test_multi_token_prediction_layers_convert_both_ways_bit_exactly(tmp_path) -> None:
    """DeepSeek's MTP layer (`model.layers.{num_hidden_layers}.*`) reads into our `mtp.3.*`
    (the files say how many MTP layers there are), writes back under the same names and bytes
    with num_nextn_predict_layers, and transformers still loads the written model (it builds
    no MTP module) to the original logits."""
    hf_config, _ = _case("moe_q_lora_yarn")
    hf = _hf_model(hf_config)
    hf.save_pretrained(tmp_path / "plain")
    path = _with_mtp_layer(tmp_path / "plain", tmp_path / "hf")
    source = HFSource(path)
    assert source.model_config.mtp_num_layers == 1
    names = source.tensors()
    for name in (
        "mtp.3.eh_proj.weight",
        "mtp.3.head_norm.weight",
        "mtp.3.moe.expert_bias",
        "mtp.3.moe.experts.w1",
        "mtp.3.attention.wkv_b.weight",
    ):
        assert name in names, name
    assert not any(name.startswith("layers.3.") for name in names)
    model = load_from_source(source)  # every name is a parameter or buffer of our MTP model
    assert list(model.mtp) == ["3"]

    memory = InMemorySource(source.model_config, {n: source.read(n) for n in names})
    out = write_hf(memory, tmp_path / "out")
    original, written = disk_tensors(path), disk_tensors(out)
    assert sorted(original) == sorted(written)
    for tensor_name, tensor in original.items():
        assert torch.equal(written[tensor_name], tensor), tensor_name
    assert json.loads((out / "config.json").read_text())["num_nextn_predict_layers"] == 1

    tokens = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(1))
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(
        out, attn_implementation="eager"
    ).eval()
    with torch.no_grad():
        expected = hf(input_ids=tokens).logits
        assert (reloaded(input_ids=tokens).logits - expected).abs().max() < 1e-4
        assert (model.logits(tokens) - expected).abs().max() < 1e-4
