"""Qwen3.5 (dense and MoE) and Qwen3-Next against transformers (the oracle): hybrid models of
gated DeltaNet linear attention and gated full attention, (1 + w) norms, partial RoPE, the
sigmoid-gated shared expert and Qwen3-Next's head-grouped fused projections. Logits and
gradients, configs both ways, round trips through our reader and writer and through `pipe
convert`, Qwen3.5's image-text checkpoints read as their language model. CPU, fp32."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from pipeline.core.model.hf_names import from_hf_state_dict
from pipeline.weights.hf_config import config_from_hf
from pipeline.weights.hf_reader import HFSource
from tests.builders import (
    SHARD_BYTES,
    VOCAB,
    assert_hf_round_trip,
    cli_hf_round_trip,
    disk_tensors,
    hf_config_dict,
    load_from_source,
)
from tests.builders import build_model as build

transformers = pytest.importorskip("transformers")

CASES = ["qwen3_5", "qwen3_5_moe", "qwen3_next"]
# 70 tokens: more than one chunk (64) of the chunked delta rule.
SEQ = 70


def hf_case(name: str):
    """(HF class, HF config) of a tiny model of `name`: four layers, three linear then one
    full; 4 query heads over 2 kv heads of 16 (a quarter rotated); linear attention with 2 key
    heads serving 4 value heads; MoE with 4 experts, top 2, and a shared expert of width 24.
    qwen3_next: the second layer dense (`mlp_only_layers`), the top k not renormalised."""
    common = dict(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=8,
        linear_value_head_dim=12,
        max_position_embeddings=256,
        rms_norm_eps=1e-6,
    )
    experts = dict(
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=16,
        shared_expert_intermediate_size=24,
    )
    if name == "qwen3_5":
        return transformers.Qwen3_5ForCausalLM, transformers.Qwen3_5TextConfig(**common)
    if name == "qwen3_5_moe":
        config = transformers.Qwen3_5MoeTextConfig(**common, **experts)
        return transformers.Qwen3_5MoeForCausalLM, config
    config = transformers.Qwen3NextConfig(
        **common, **experts, mlp_only_layers=[1], norm_topk_prob=False
    )
    return transformers.Qwen3NextForCausalLM, config


def hf_model(name: str, **overrides):
    """The HF model of `name` (its config's fields changed as `overrides` say), every weight
    perturbed (norms off zero, decays off their init)."""
    hf_cls, hf_config = hf_case(name)
    for field, value in overrides.items():
        setattr(hf_config, field, value)
    hf_config._attn_implementation = "eager"
    torch.manual_seed(0)
    hf = hf_cls(hf_config).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return hf


def our_config(name: str):
    hf_cls, hf_config = hf_case(name)
    return config_from_hf(hf_config.to_dict() | {"architectures": [hf_cls.__name__]})


def _tokens(seed: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("name", CASES)
def test_logits_and_gradients_equal_transformers(name: str) -> None:
    """Same weights and tokens: logits and every parameter's gradient agree to 1e-4; layers are
    linear or full, dense or MoE, where transformers put them."""
    hf = hf_model(name)
    config = our_config(name)
    model = build(config)
    model.load_state_dict(from_hf_state_dict(hf.state_dict(), config), strict=True)
    kinds = [layer.block_type for layer in hf.model.layers]
    assert [block.attention.kind for block in model.layers.values()] == [
        "linear" if k == "linear_attention" else "gqa" for k in kinds
    ]
    assert kinds.count("linear_attention") == 3
    hf_mlp = ["moe" if hasattr(layer.mlp, "experts") else "dense" for layer in hf.model.layers]
    assert [block.mlp_kind for block in model.layers.values()] == hf_mlp

    tokens, labels = _tokens(1), _tokens(2)
    hf_logits = hf(input_ids=tokens).logits
    logits = model.logits(tokens)
    assert (logits - hf_logits).abs().max() < 1e-4

    F.cross_entropy(hf_logits.flatten(0, 1), labels.flatten()).backward()
    F.cross_entropy(logits.flatten(0, 1), labels.flatten()).backward()
    hf_grads = from_hf_state_dict({n: p.grad for n, p in hf.named_parameters()}, config)
    for pname, p in model.named_parameters():
        assert (p.grad - hf_grads[pname]).abs().max() < 1e-4, pname


def test_the_options_matter() -> None:
    """Each Qwen3.5 option moves the logits when turned off: the (1 + w) norm, the attention's
    output gate (its gate rows then read as a wider query: refused by shape), partial RoPE and
    the shared expert's gate."""
    hf = hf_model("qwen3_5_moe")
    tokens = _tokens()
    with torch.no_grad():
        expected = hf(input_ids=tokens).logits
    state = from_hf_state_dict(hf.state_dict(), our_config("qwen3_5_moe"))
    for field, value in (
        ("norm_unit_offset", False),
        ("partial_rotary_factor", 1.0),
        ("moe.shared_expert_gate", False),
    ):
        config = our_config("qwen3_5_moe")
        target, _, attr = field.rpartition(".")
        setattr(getattr(config, target) if target else config, attr, value)
        model = build(config)
        model.load_state_dict(state, strict=False)
        with torch.no_grad():
            assert (model.logits(tokens) - expected).abs().max() > 1e-3, field


def test_config_from_transformers_saved_dicts_and_back() -> None:
    """Each family's config.json (as transformers writes it) gives the hybrid config, and ours
    written back reads as the same in transformers."""
    for name in CASES:
        hf_cls, hf_config = hf_case(name)
        config = our_config(name)
        assert config.layer_types == hf_config.layer_types
        assert config.partial_rotary_factor == 0.25 and config.rope_dim == 4
        assert config.norm_unit_offset and config.attention_output_gate and config.qk_norm
        assert config.linear_attention.interleaved_projections == (name == "qwen3_next")
        if name != "qwen3_5":
            assert config.moe.shared_expert_gate
            assert config.moe.shared_expert_ffn_hidden_size == 24
    assert our_config("qwen3_next").moe.dense_layers == [1]
    assert not our_config("qwen3_next").moe.norm_topk_prob


# ---------------------------------------------------------------------------------------------
# Files: our reader and writer, `pipe convert`, the image-text checkpoints
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module", params=CASES)
def hf_dir(request, tmp_path_factory) -> tuple[Path, object]:
    """A perturbed tiny model saved by transformers in several shards, and the model."""
    hf = hf_model(request.param)
    directory = tmp_path_factory.mktemp(request.param) / "hf"
    hf.save_pretrained(directory, max_shard_size=SHARD_BYTES)
    return directory, hf


def test_hf_round_trip_is_bit_identical_and_loads_in_transformers(hf_dir, tmp_path) -> None:
    """HF -> our source -> HF: the same tensor names and bytes and the same config; our model
    from the reader and transformers from the written files both give the original logits."""
    path, hf = hf_dir
    tokens = _tokens()
    assert_hf_round_trip(path, hf, tmp_path / "out", tokens)


def test_cli_round_trip_through_a_pipe_checkpoint(hf_dir, tmp_path) -> None:
    """`pipe convert --from hf` then `--to hf`: bit-identical files, each step checking its
    logits against transformers."""
    directory, _ = hf_dir
    back, _ = cli_hf_round_trip(directory, tmp_path)
    assert hf_config_dict(back) == hf_config_dict(directory)


def test_image_text_checkpoint_reads_its_language_model(tmp_path, caplog) -> None:
    """A Qwen3.5 image-text checkpoint (`Qwen3_5ForConditionalGeneration`: the text config under
    `text_config`, weights under `model.language_model.`, a vision tower and an MTP head) reads
    as its language model, saying in one line what it skipped."""
    hf = hf_model("qwen3_5")
    state = {
        name.replace("model.", "model.language_model.", 1): t.contiguous()
        for name, t in hf.state_dict().items()
    }
    state["model.visual.patch_embed.proj.weight"] = torch.zeros(4, 3)
    state["mtp.fc.weight"] = torch.zeros(4, 4)
    save_file(state, str(tmp_path / "model.safetensors"))
    text = json.loads(hf.config.to_json_string())
    config = {
        "architectures": ["Qwen3_5ForConditionalGeneration"],
        "model_type": "qwen3_5",
        "text_config": text,
        "vision_config": {"depth": 2},
        "tie_word_embeddings": False,
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    with caplog.at_level(logging.WARNING):
        source = HFSource(tmp_path)
    skipped = [r.getMessage() for r in caplog.records if "skipping" in r.getMessage()]
    assert len(skipped) == 1
    assert "1 vision-tower tensors" in skipped[0] and "1 multi-token-prediction" in skipped[0]
    assert source.metadata["hf_architecture"] == "Qwen3_5ForCausalLM"
    tokens = _tokens()
    with torch.no_grad():
        expected = hf(input_ids=tokens).logits
        assert (load_from_source(source).logits(tokens) - expected).abs().max() < 1e-4


# ---------------------------------------------------------------------------------------------
# The published sizes
# ---------------------------------------------------------------------------------------------

_ROPE = {
    "rope_type": "default",
    "rope_theta": 10000000,
    "partial_rotary_factor": 0.25,
    "mrope_interleaved": True,
    "mrope_section": [11, 11, 10],
}
_TEXT = dict(
    vocab_size=248320,
    head_dim=256,
    hidden_act="silu",
    rms_norm_eps=1e-6,
    max_position_embeddings=262144,
    full_attention_interval=4,
    linear_conv_kernel_dim=4,
    linear_key_head_dim=128,
    linear_value_head_dim=128,
    linear_num_key_heads=16,
    attention_bias=False,
    initializer_range=0.02,
    rope_parameters=_ROPE,
)
# Qwen/Qwen3.5-27B's and Qwen/Qwen3.5-35B-A3B's config.json (the image-text wrapper; its
# text_config), and Qwen/Qwen3-Next-80B-A3B's.
PUBLISHED = {
    "qwen3_5_27b": (
        {
            "architectures": ["Qwen3_5ForConditionalGeneration"],
            "model_type": "qwen3_5",
            "tie_word_embeddings": False,
            "text_config": _TEXT
            | dict(
                model_type="qwen3_5_text",
                hidden_size=5120,
                intermediate_size=17408,
                num_hidden_layers=64,
                num_attention_heads=24,
                num_key_value_heads=4,
                linear_num_value_heads=48,
            ),
        },
        27e9,
    ),
    "qwen3_5_35b_a3b": (
        {
            "architectures": ["Qwen3_5MoeForConditionalGeneration"],
            "model_type": "qwen3_5_moe",
            "tie_word_embeddings": False,
            "text_config": _TEXT
            | dict(
                model_type="qwen3_5_moe_text",
                hidden_size=2048,
                num_hidden_layers=40,
                num_attention_heads=16,
                num_key_value_heads=2,
                linear_num_value_heads=32,
                num_experts=256,
                num_experts_per_tok=8,
                moe_intermediate_size=512,
                shared_expert_intermediate_size=512,
                router_aux_loss_coef=0.001,
            ),
        },
        35e9,
    ),
    "qwen3_next_80b_a3b": (
        _TEXT
        | dict(
            architectures=["Qwen3NextForCausalLM"],
            model_type="qwen3_next",
            vocab_size=151936,
            hidden_size=2048,
            intermediate_size=5120,
            num_hidden_layers=48,
            num_attention_heads=16,
            num_key_value_heads=2,
            linear_num_value_heads=32,
            num_experts=512,
            num_experts_per_tok=10,
            moe_intermediate_size=512,
            shared_expert_intermediate_size=512,
            norm_topk_prob=True,
            decoder_sparse_step=1,
            mlp_only_layers=[],
            router_aux_loss_coef=0.001,
            tie_word_embeddings=False,
            rope_parameters={
                "rope_type": "default",
                "rope_theta": 10000000,
                "partial_rotary_factor": 0.25,
            },
        ),
        80e9,
    ),
}


@pytest.mark.parametrize("flavor", sorted(PUBLISHED))
def test_published_configs_give_the_flavors_and_their_sizes(flavor: str) -> None:
    """Each published config.json gives our flavor, whose parameter count equals transformers'
    language model of that config (built on meta) and the published size (to 0.5B: the
    published figures also count the vision tower and the MTP head, which pipe does not read);
    the `--dry-run` of its recipe prints that count."""
    from pipeline.core.model.flavors import get_flavor, num_parameters
    from pipeline.train.assembly.run_config import resolve_config
    from pipeline.train.report.estimates import dry_run_report
    from pipeline.weights.hf_config import text_model

    hf, published = PUBLISHED[flavor]
    ours = get_flavor(flavor)
    assert config_from_hf(hf) == ours
    text, _prefix = text_model(hf)
    arch = text["architectures"][0]
    kwargs = {k: v for k, v in text.items() if k not in ("architectures", "model_type")}
    config_cls = {
        "Qwen3_5ForCausalLM": transformers.Qwen3_5TextConfig,
        "Qwen3_5MoeForCausalLM": transformers.Qwen3_5MoeTextConfig,
        "Qwen3NextForCausalLM": transformers.Qwen3NextConfig,
    }[arch]
    with torch.device("meta"):
        hf_model = getattr(transformers, arch)(config_cls(**kwargs))
    count = num_parameters(ours)
    assert count == sum(p.numel() for p in hf_model.parameters())
    assert abs(count - published) < 0.5e9
    report = dry_run_report(resolve_config(flavor), world_size=32)
    assert any(line.startswith(f"parameters   {count:,} total") for line in report)


REFUSED = (
    "Error: a model with linear attention (Qwen3.5, Qwen3-Next) exports to Hugging Face "
    "unquantized only"
)


def test_export_for_serving_engines_and_its_refusals(hf_dir, tmp_path) -> None:
    """`pipe export --vllm` writes the checkpoint transformers loads to the same logits; FP8 and
    the legacy TensorRT-LLM layout are refused in one line."""
    from click.testing import CliRunner

    from pipeline.export.commands import export

    directory, _ = hf_dir
    runner = CliRunner()
    out = tmp_path / "vllm"
    result = runner.invoke(export, [str(directory), "--from", "hf", "--vllm", "-o", str(out)])
    assert result.exit_code == 0, result.output
    assert "transformers loads it" in result.output
    assert disk_tensors(out).keys() == disk_tensors(directory).keys()
    for extra in (["--trtllm", "--fp8"], ["--trtllm", "--trtllm-format", "legacy"]):
        target = tmp_path / "_".join(extra).strip("-")
        args = [str(directory), "--from", "hf", *extra, "-o", str(target)]
        result = runner.invoke(export, args)
        last = result.output.strip().splitlines()[-1]
        assert result.exit_code != 0 and last.startswith(REFUSED), result.output
