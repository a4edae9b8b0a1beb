"""`pipe export --vllm` (and --trtllm / --sglang) of a DeepSeek-V3 model: the bf16 Hugging Face
checkpoint, and `--fp8` in DeepSeek's own block format, with transformers as the oracle.

One tiny DeepSeek-V3 (latent attention with the q low-rank projection, a dense first layer, then
4 routed experts, one shared, sigmoid grouped routing with a non-zero correction bias) is trained
briefly on the shared corpus, so top-1 comparisons mean something. Its linears are 256 wide in
places (whole 128-blocks) and 64, 80 or 96 in others (one partial block). transformers 5's CPU
dequantization reads those shapes right; a second, untrained model with partial blocks after
whole ones (160, 192) checks the reader block by block against the source by hand.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file, save_file

from pipeline.cli import cli
from pipeline.core.model.config import MLAConfig, ModelConfig, MoEConfig
from pipeline.export.block_fp8 import BLOCK, QUANT_CONFIG
from pipeline.export.block_fp8_reader import BlockFP8Checkpoint
from pipeline.export.calibration import calibration_sequences
from pipeline.export.fp8 import FP8_MAX
from pipeline.export.hf_export import write_hf_export
from pipeline.export.options import ExportOptions
from pipeline.export.run import CalibrationSettings, ExportError, run_export
from pipeline.export.verify_hf import (
    check_no_saturation,
    transformers_misread,
    verify_hf_export,
)
from pipeline.weights.hf_writer import write_hf
from pipeline.weights.source import InMemorySource
from tests.builders import FP8_VOCAB, build_model, train_briefly

transformers = pytest.importorskip("transformers")
transformers.utils.logging.disable_progress_bar()
transformers.utils.logging.set_verbosity_error()

HELD_OUT_SKIP = 64 * 64  # verification text starts after what a calibration would have read
MIN_TOP1 = 0.95
BIAS = "mlp.gate.e_score_correction_bias"


def _config(hidden: int, mla: MLAConfig, ffn: int, vocab: int = FP8_VOCAB) -> ModelConfig:
    moe = MoEConfig(
        num_experts=4,
        top_k=2,
        ffn_hidden_size=64,
        aux_loss_coeff=0.0,
        dense_layers=[0],
        score_function="sigmoid",
        num_groups=2,
        topk_groups=1,
        routed_scaling_factor=2.5,
        num_shared_experts=1,
        expert_bias=True,
    )
    return ModelConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        ffn_hidden_size=ffn,
        num_layers=2,
        num_attention_heads=4,
        num_kv_heads=4,
        max_position_embeddings=256,
        norm_eps=1e-6,
        rope_theta=1e4,
        mla=mla,
        moe=moe,
    )


# q_b 4 x (48 + 16) = 256 and kv_b 4 x (48 + 16) = 256 rows: two whole blocks; hidden and the
# dense ffn 128: one whole block; kv_a 64 + 16 = 80, q_a 96, o_proj 64 inputs: one partial block.
TRAINED = _config(
    128,
    MLAConfig(
        kv_lora_rank=64, q_lora_rank=96, qk_nope_head_dim=48, qk_rope_head_dim=16, v_head_dim=16
    ),
    ffn=128,
)
# hidden 160 and q_b 4 x (32 + 16) = 192: a whole block, then a partial one.
EDGES = _config(
    160,
    MLAConfig(
        kv_lora_rank=64, q_lora_rank=96, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32
    ),
    ffn=200,
    vocab=250,
)


def _with_bias(state: dict) -> dict:
    """Non-zero correction biases (fp32, small steps) so routing depends on them."""
    generator = torch.Generator().manual_seed(3)
    for name, tensor in state.items():
        if name.endswith("moe.expert_bias"):
            state[name] = torch.randn(tensor.shape, generator=generator) * 0.05
    return state


@pytest.fixture(scope="module")
def trained(corpus_prefix, tmp_path_factory) -> Path:
    tokens = calibration_sequences(corpus_prefix, 10**9, 1).flatten()
    model = train_briefly(TRAINED, tokens, steps=60)  # enough to predict text
    state = _with_bias({n: t.detach() for n, t in model.state_dict().items()})
    source = InMemorySource(TRAINED, state, {"hf_architecture": "DeepseekV3ForCausalLM"})
    return write_hf(source, tmp_path_factory.mktemp("deepseek") / "hf")


@pytest.fixture(scope="module")
def fp8_export(trained, corpus_prefix, tmp_path_factory) -> tuple[Path, str]:
    out = tmp_path_factory.mktemp("deepseek_fp8") / "out"
    options = ExportOptions(dtype="bfloat16", fp8=True)
    calibration = CalibrationSettings(corpus_prefix)  # verification text only
    return out, run_export(trained, out, options, calibration=calibration, quiet=True)


def _held_out(corpus_prefix: Path) -> torch.Tensor:
    return calibration_sequences(corpus_prefix, 8, 128, skip_tokens=HELD_OUT_SKIP)


def _logits(model, tokens: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model.float().eval()(tokens).logits


def test_bf16_export_loads_in_transformers_with_the_source_logits(trained, corpus_prefix, tmp_path):
    """The source rounded to bf16, the correction bias kept fp32 (as exported and as
    transformers keeps it)."""
    out = tmp_path / "bf16"
    summary = run_export(trained, out, ExportOptions(dtype="bfloat16"), verify="on", quiet=True)
    assert "transformers loads it" in summary, summary
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["DeepseekV3ForCausalLM"]
    assert "quantization_config" not in config
    assert load_file(out / "model.safetensors")[f"model.layers.1.{BIAS}"].dtype == torch.float32
    source = transformers.AutoModelForCausalLM.from_pretrained(trained, dtype=torch.float32)
    rounded = {
        n: t if n.endswith(BIAS) else t.to(torch.bfloat16).float()
        for n, t in source.state_dict().items()
    }
    source.load_state_dict(rounded)
    export = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    tokens = _held_out(corpus_prefix)
    expected, actual = _logits(source, tokens), _logits(export, tokens)
    assert float((actual - expected).abs().max()) <= 1e-4 * max(1.0, float(expected.abs().max()))


def test_block_fp8_export_loads_in_transformers_with_the_top1_bar(
    fp8_export, trained, corpus_prefix
):
    pytest.importorskip("accelerate", reason="transformers' FP8 loader needs accelerate")
    out, summary = fp8_export
    assert "DeepSeek block FP8" in summary and "format checks passed" in summary, summary
    assert "transformers' dequantized model" in summary and "held-out tokens" in summary, summary
    dequantize = transformers.FineGrainedFP8Config(dequantize=True)
    export = transformers.AutoModelForCausalLM.from_pretrained(out, quantization_config=dequantize)
    source = transformers.AutoModelForCausalLM.from_pretrained(trained, dtype=torch.float32)
    tokens = _held_out(corpus_prefix)
    expected, actual = _logits(source, tokens), _logits(export, tokens)
    assert expected.argmax(-1).unique().numel() >= 50  # it predicts text, not one token
    top1 = float((actual.argmax(-1) == expected.argmax(-1)).float().mean())
    print(f"DeepSeek-V3 block FP8 vs transformers on the source: top-1 {top1:.2%}")
    assert top1 >= MIN_TOP1


def _expected_blocks(weight: torch.Tensor) -> torch.Tensor:
    """Each 128 x 128 block's |max| / 448, block by block with plain slicing."""
    rows, cols = -(-weight.shape[0] // BLOCK), -(-weight.shape[1] // BLOCK)
    scales = torch.empty(rows, cols)
    for r in range(rows):
        for c in range(cols):
            block = weight[r * BLOCK : (r + 1) * BLOCK, c * BLOCK : (c + 1) * BLOCK]
            scales[r, c] = block.float().abs().max() / FP8_MAX
    return scales


def _check_quantized(files: dict, source: dict, module: str) -> None:
    """fp8 weight, fp32 scales = block amax / 448 on the ceil grid, and every dequantized value
    within e4m3's rounding (3 mantissa bits: half a step is 1/16 of the value) of the source."""
    weight, scale = files[f"{module}.weight"], files[f"{module}.weight_scale_inv"]
    original = source[f"{module}.weight"].float()
    assert weight.dtype == torch.float8_e4m3fn and scale.dtype == torch.float32
    torch.testing.assert_close(scale, _expected_blocks(original), rtol=1e-6, atol=0)
    full = scale.repeat_interleave(BLOCK, 0).repeat_interleave(BLOCK, 1)
    values = weight.float() * full[: weight.shape[0], : weight.shape[1]]
    tolerance = original.abs() / 16 + full[: weight.shape[0], : weight.shape[1]] * 2**-9
    assert bool(((values - original).abs() <= tolerance).all()), module


def test_block_fp8_files_hold_what_the_format_says(fp8_export, trained):
    out, _ = fp8_export
    config = json.loads((out / "config.json").read_text())
    assert config["quantization_config"] == QUANT_CONFIG
    assert QUANT_CONFIG == {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": [128, 128],
    }
    files, source = load_file(out / "model.safetensors"), load_file(trained / "model.safetensors")
    p = "model.layers.1"
    for module in (
        "self_attn.q_a_proj",
        "self_attn.q_b_proj",
        "self_attn.kv_a_proj_with_mqa",
        "self_attn.kv_b_proj",
        "self_attn.o_proj",
        "mlp.experts.3.down_proj",
        "mlp.shared_experts.gate_proj",
    ):
        _check_quantized(files, source, f"{p}.{module}")
    _check_quantized(files, source, "model.layers.0.mlp.up_proj")
    assert files[f"{p}.self_attn.q_b_proj.weight_scale_inv"].shape == (2, 1)
    assert files[f"{p}.self_attn.kv_a_proj_with_mqa.weight_scale_inv"].shape == (1, 1)
    kept = [
        "model.embed_tokens",
        "lm_head",
        "model.norm",
        f"{p}.input_layernorm",
        f"{p}.self_attn.q_a_layernorm",
        f"{p}.self_attn.kv_a_layernorm",
        f"{p}.mlp.gate",
    ]
    for name in kept:
        assert files[f"{name}.weight"].dtype == torch.bfloat16, name
        assert f"{name}.weight_scale_inv" not in files
    assert files[f"{p}.{BIAS}"].dtype == torch.float32
    assert torch.equal(files[f"{p}.{BIAS}"], source[f"{p}.{BIAS}"])
    assert not [n for n in files if n.endswith(("input_scale", "weight_scale", "k_scale"))]


@pytest.fixture(scope="module")
def edges(tmp_path_factory) -> tuple[InMemorySource, Path]:
    """An untrained model with partial blocks after whole ones, exported to block FP8."""
    torch.manual_seed(0)
    model = build_model(EDGES)
    state = _with_bias({n: t.detach() for n, t in model.state_dict().items()})
    source = InMemorySource(EDGES, state, {"hf_architecture": "DeepseekV3ForCausalLM"})
    out = tmp_path_factory.mktemp("edges") / "fp8"
    return source, write_hf_export(source, out, ExportOptions(dtype="bfloat16", fp8=True))


def test_partial_blocks_after_whole_ones_read_back_block_by_block(edges):
    """q_b_proj [192, 96], o_proj [160, 128], the dense up_proj [200, 160]: the reader's
    dequantized weight is the source's within e4m3 rounding, the scale grid is ceil-shaped
    and each scale is its block's |max| / 448, edge blocks included."""
    source, out = edges
    files, checkpoint = load_file(out / "model.safetensors"), BlockFP8Checkpoint(out)
    ours = {
        "layers.0.attention.wq_b.weight": "model.layers.0.self_attn.q_b_proj",
        "layers.1.attention.wo.weight": "model.layers.1.self_attn.o_proj",
        "layers.0.feed_forward.w3.weight": "model.layers.0.mlp.up_proj",
    }
    hf_source = {f"{m}.weight": source.read(n) for n, m in ours.items()}
    for module in ours.values():
        _check_quantized(files, hf_source, module)
        original = hf_source[f"{module}.weight"].float()
        deq = checkpoint.dequantize(module)
        assert bool(((deq - original).abs() <= original.abs() / 16 + 1e-6).all()), module
    assert files["model.layers.0.self_attn.q_b_proj.weight_scale_inv"].shape == (2, 1)
    assert files["model.layers.0.mlp.up_proj.weight_scale_inv"].shape == (2, 2)
    check_no_saturation(source, checkpoint)
    # transformers 5 takes the block size to be 192 / 2 = 96 rows here: pipe notices, says so,
    # and verifies with its own reader instead.
    assert transformers_misread(checkpoint) is not None
    summary = verify_hf_export(source, out, ExportOptions(dtype="bfloat16", fp8=True))
    assert "pipe's dequantized model (transformers cannot dequantize" in summary, summary


def _rewrite(directory: Path, edit_tensors=None, edit_quant=None) -> None:
    if edit_tensors is not None:
        tensors = load_file(directory / "model.safetensors")
        edit_tensors(tensors)
        save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})
    if edit_quant is not None:
        config = json.loads((directory / "config.json").read_text())
        edit_quant(config["quantization_config"])
        (directory / "config.json").write_text(json.dumps(config))


def _scale_grid(tensors: dict) -> None:
    name = "model.layers.0.self_attn.q_b_proj.weight_scale_inv"
    tensors[name] = tensors[name][:1]


def _zero_scale(tensors: dict) -> None:
    tensors["model.layers.1.mlp.experts.2.up_proj.weight_scale_inv"][0, 0] = 0.0


def _fp8_router(tensors: dict) -> None:
    name = "model.layers.1.mlp.gate.weight"
    tensors[name] = tensors[name].float().to(torch.float8_e4m3fn)


def _bf16_projection(tensors: dict) -> None:
    name = "model.layers.1.self_attn.o_proj"
    tensors[f"{name}.weight"] = tensors[f"{name}.weight"].to(torch.bfloat16)
    del tensors[f"{name}.weight_scale_inv"]


def _per_tensor(quant: dict) -> None:
    quant["weight_block_size"] = None


def _static(quant: dict) -> None:
    quant["activation_scheme"] = "static"


@pytest.mark.parametrize(
    ("tensors", "quant", "message"),
    [
        (
            _scale_grid,
            None,
            r"q_b_proj.weight_scale_inv is torch.float32 \(1, 1\), not float32 "
            r"\(2, 1\) for a \(192, 96\) weight",
        ),
        (_zero_scale, None, "experts.2.up_proj.weight_scale_inv holds a value that is not a pos"),
        (_fp8_router, None, "mlp.gate.weight is fp8; DeepSeek-V3 keeps it in high precision"),
        (_bf16_projection, None, "o_proj.weight is torch.bfloat16; the block format quantizes"),
        (None, _per_tensor, "weight_block_size None is not two positive ints"),
        (None, _static, "activation_scheme is 'static', not 'dynamic'"),
    ],
)
def test_reader_refuses_what_an_engine_would_misread(edges, tmp_path, tensors, quant, message):
    out = shutil.copytree(edges[1], tmp_path / "copy")
    _rewrite(out, tensors, quant)
    with pytest.raises(ValueError, match=message):
        BlockFP8Checkpoint(out)


def test_a_block_scale_too_small_for_its_block_is_caught(edges, tmp_path):
    """Halving one edge block's scale keeps the files valid but would clip the source."""
    source, written = edges
    out = shutil.copytree(written, tmp_path / "copy")

    def halve(tensors: dict) -> None:
        tensors["model.layers.0.mlp.up_proj.weight_scale_inv"][1, 1] /= 2

    _rewrite(out, halve)
    with pytest.raises(ValueError, match=r"model.layers.0.mlp.up_proj.weight saturates"):
        check_no_saturation(source, BlockFP8Checkpoint(out))


def test_options_the_block_format_has_no_place_for_are_refused(edges, tmp_path):
    source, _ = edges
    hf_dir = write_hf(source, tmp_path / "hf")
    refusals = {
        ("--fp8-kv-cache",): "--fp8-kv-cache: DeepSeek's block FP8 format stores no KV-cache",
        ("--fp8-lm-head",): "--fp8-lm-head: DeepSeek's block FP8 format keeps lm_head",
        ("--fp8-exclude", "model.layers.0.*"): "--fp8-exclude model.layers.0.*: DeepSeek's",
    }
    for flags, message in refusals.items():
        args = ["export", str(hf_dir), "--vllm", "--fp8", *flags, "-o", str(tmp_path / "x")]
        result = CliRunner().invoke(cli, args)
        assert result.exit_code != 0 and message in result.output, (flags, result.output)
        assert "Traceback" not in result.output
    assert not (tmp_path / "x").exists()
    with pytest.raises(ExportError, match="stores no KV-cache scales"):
        run_export(hf_dir, tmp_path / "y", ExportOptions(fp8=True, fp8_kv_cache=True))
    with pytest.raises(ExportError, match="legacy TensorRT-LLM format has no latent attention"):
        run_export(hf_dir, tmp_path / "y", ExportOptions(), target="legacy")
