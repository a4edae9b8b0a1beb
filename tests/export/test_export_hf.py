"""`pipe export --trtllm | --vllm | --sglang`: the Hugging Face checkpoint current engines load,
per family (Llama 3, Mistral, Qwen2, Qwen3, Mixtral, Qwen3-MoE; tiny, trained briefly on the
shared corpus so top-1 comparisons mean something).

- bf16: transformers loads the export and gives the logits of the source rounded to bf16.
- FP8 (ModelOpt's format, `--fp8 --fp8-kv-cache`, calibrated on the corpus): the files pass the
  format reader's checks, hold what the format says (checked here against the source weights by
  hand), and the dequantized model agrees with transformers on the source on >= 95% of held-out
  next tokens.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file, save_file

from pipeline.cli import cli
from pipeline.export.calibration import calibration_sequences
from pipeline.export.fp8 import FP8_MAX
from pipeline.export.modelopt_reader import ModelOptCheckpoint
from pipeline.export.options import ExportOptions
from pipeline.export.run import CalibrationSettings, run_export
from pipeline.weights.hf_writer import write_hf
from pipeline.weights.source import InMemorySource
from tests.builders import EXPORT_FAMILIES, export_family

transformers = pytest.importorskip("transformers")
transformers.utils.logging.disable_progress_bar()

CALIB_SEQUENCES, CALIB_LEN = 64, 64
MIN_TOP1 = 0.95


@pytest.fixture(scope="module", params=EXPORT_FAMILIES)
def trained(request, trained_family) -> tuple[str, Path]:
    """(HF architecture, a Hugging Face directory of the family's trained tiny model)."""
    return trained_family(request.param)


def _held_out(corpus_prefix: Path) -> torch.Tensor:
    return calibration_sequences(corpus_prefix, 8, 128, skip_tokens=CALIB_SEQUENCES * CALIB_LEN)


def _hf_logits(directory: Path, tokens: torch.Tensor, round_to=None) -> torch.Tensor:
    """transformers in fp32 on `directory`'s weights (rounded through `round_to` if given)."""
    model = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    if round_to is not None:
        model.load_state_dict({n: t.to(round_to).float() for n, t in model.state_dict().items()})
    with torch.no_grad():
        return model.eval()(tokens).logits


def test_bf16_export_loads_in_transformers_with_the_source_logits(trained, corpus_prefix, tmp_path):
    architecture, hf_dir = trained
    out = tmp_path / "bf16"
    summary = run_export(hf_dir, out, ExportOptions(dtype="bfloat16"), verify="on", quiet=True)
    assert "transformers loads it" in summary, summary
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == [architecture] and "quantization_config" not in config
    tokens = _held_out(corpus_prefix)
    actual = _hf_logits(out, tokens)
    expected = _hf_logits(hf_dir, tokens, round_to=torch.bfloat16)
    assert float((actual - expected).abs().max()) <= 1e-4 * max(1.0, float(expected.abs().max()))


def _fp8_export(hf_dir: Path, corpus_prefix: Path, out: Path, **options) -> str:
    options = dict(dtype="bfloat16", fp8=True, fp8_kv_cache=True) | options
    calibration = CalibrationSettings(corpus_prefix, CALIB_SEQUENCES, CALIB_LEN)
    return run_export(hf_dir, out, ExportOptions(**options), calibration=calibration, quiet=True)


@pytest.fixture(scope="module")
def fp8_export(trained, corpus_prefix, tmp_path_factory) -> tuple[str, Path, Path, str]:
    architecture, hf_dir = trained
    out = tmp_path_factory.mktemp("fp8") / "out"
    summary = _fp8_export(hf_dir, corpus_prefix, out)
    return architecture, hf_dir, out, summary


def test_fp8_export_passes_the_format_checks_and_the_top1_bar(fp8_export, corpus_prefix):
    architecture, hf_dir, out, summary = fp8_export
    assert "format checks passed" in summary and "held-out tokens" in summary, summary
    tokens = _held_out(corpus_prefix)
    expected = _hf_logits(hf_dir, tokens)
    assert expected.argmax(-1).unique().numel() >= 50  # it predicts text, not one token
    with torch.no_grad():
        actual = ModelOptCheckpoint(out).model().logits(tokens)
    top1 = float((actual.argmax(-1) == expected.argmax(-1)).float().mean())
    print(f"{architecture} FP8 vs transformers: top-1 {top1:.2%}")
    assert top1 >= MIN_TOP1


def test_fp8_files_hold_what_the_format_says(fp8_export):
    """By hand from the source weights: fp8 weights, shared q/k/v and gate/up scales of
    amax / 448, fp32 scalars, KV scales, and the ignore list naming every unquantized module."""
    architecture, hf_dir, out, _ = fp8_export
    source = {}
    for file in hf_dir.glob("*.safetensors"):
        source |= load_file(file)
    files = {}
    for file in out.glob("*.safetensors"):
        files |= load_file(file)
    nested = json.loads((out / "hf_quant_config.json").read_text())
    flat = json.loads((out / "config.json").read_text())["quantization_config"]
    assert nested["quantization"]["quant_algo"] == flat["quant_algo"] == "FP8"
    assert nested["quantization"]["kv_cache_quant_algo"] == "FP8"
    assert flat["quant_method"] == "modelopt" and flat["kv_cache_scheme"]["num_bits"] == 8
    assert nested["quantization"]["exclude_modules"] == flat["ignore"]
    ignore = flat["ignore"]
    p = "model.layers.1"
    qkv = [source[f"{p}.self_attn.{w}_proj.weight"].float() for w in "qkv"]
    scale = max(float(w.abs().max()) for w in qkv) / FP8_MAX
    for w in "qkv":
        assert files[f"{p}.self_attn.{w}_proj.weight"].dtype == torch.float8_e4m3fn
        got = files[f"{p}.self_attn.{w}_proj.weight_scale"]
        assert got.dtype == torch.float32 and got.shape == ()
        assert float(got) == pytest.approx(scale, rel=1e-6)
        assert files[f"{p}.self_attn.{w}_proj.input_scale"].shape == ()
    assert float(files[f"{p}.self_attn.k_proj.k_scale"]) > 0
    assert float(files[f"{p}.self_attn.v_proj.v_scale"]) > 0
    moe = "Moe" in architecture or "Mixtral" in architecture
    if moe:
        module = "block_sparse_moe" if "Mixtral" in architecture else "mlp"
        gate_up = ("w1", "w3") if "Mixtral" in architecture else ("gate_proj", "up_proj")
        assert f"{p}.{module}.gate" in ignore
        assert files[f"{p}.{module}.gate.weight"].dtype == torch.bfloat16
        e = f"{p}.{module}.experts.2"
        pair = [source[f"{e}.{w}.weight"].float() for w in gate_up]
    else:
        e = f"{p}.mlp"
        gate_up = ("gate_proj", "up_proj")
        pair = [source[f"{e}.{w}_proj.weight"].float() for w in ("gate", "up")]
    both = max(float(w.abs().max()) for w in pair) / FP8_MAX
    for w in gate_up:
        assert float(files[f"{e}.{w}.weight_scale"]) == pytest.approx(both, rel=1e-6)
    for name in ("lm_head", "model.embed_tokens", "model.norm", f"{p}.input_layernorm"):
        assert name in ignore
        assert files[f"{name}.weight"].dtype == torch.bfloat16
    quantized = {n.removesuffix(".weight") for n, t in files.items() if t.dtype.itemsize == 1}
    assert not quantized & set(ignore)


def _rewrite(directory: Path, edit_tensors=None, edit_flat=None) -> None:
    if edit_tensors is not None:
        for file in directory.glob("*.safetensors"):
            tensors = load_file(file)
            edit_tensors(tensors)
            save_file(tensors, file, metadata={"format": "pt"})
    if edit_flat is not None:
        config = json.loads((directory / "config.json").read_text())
        edit_flat(config["quantization_config"])
        (directory / "config.json").write_text(json.dumps(config))


def _unshare_k(tensors: dict) -> None:
    tensors["model.layers.0.self_attn.k_proj.weight_scale"] *= 2


def _disagree(quant: dict) -> None:
    quant["ignore"] = quant["ignore"][:-1]


def _negative_input_scale(tensors: dict) -> None:
    tensors["model.layers.1.mlp.down_proj.input_scale"] = torch.tensor(-1.0)


def _random_hf(family: str, directory: Path) -> Path:
    """An untrained tiny model of `family`, saved as Hugging Face (the reader's refusals need
    no trained model)."""
    from pipeline.core.model.transformer import Transformer

    architecture, config = export_family(family)
    torch.manual_seed(0)
    model = Transformer(config)
    model.init_weights()
    source = InMemorySource(config, dict(model.state_dict()), {"hf_architecture": architecture})
    return write_hf(source, directory)


@pytest.mark.parametrize(
    ("tensors", "flat", "message"),
    [
        (_unshare_k, None, "do not share one weight_scale"),
        (None, _disagree, "differs from ignore"),
        (_negative_input_scale, None, "is not a positive number"),
    ],
)
def test_reader_refuses_what_an_engine_would_misread(
    corpus_prefix, tmp_path, tensors, flat, message
):
    out = tmp_path / "fp8"
    hf_dir = _random_hf("llama3", tmp_path / "hf")
    _fp8_export(hf_dir, corpus_prefix, out, fp8_kv_cache=False)
    ModelOptCheckpoint(out)  # as written: accepted
    _rewrite(out, tensors, flat)
    with pytest.raises(ValueError, match=message):
        ModelOptCheckpoint(out)


def test_a_scale_too_small_for_its_weight_is_caught(corpus_prefix, tmp_path):
    """Halving o_proj's weight_scale keeps every file check happy (it is still a positive fp32
    scalar) but would clip the source weight: verification names it."""
    from pipeline.export.verify_hf import check_no_saturation
    from pipeline.weights.hf_reader import HFSource

    out = tmp_path / "fp8"
    hf_dir = _random_hf("qwen3", tmp_path / "hf")
    _fp8_export(hf_dir, corpus_prefix, out)
    check_no_saturation(HFSource(hf_dir), ModelOptCheckpoint(out))

    def halve(tensors: dict) -> None:
        tensors["model.layers.1.self_attn.o_proj.weight_scale"] /= 2

    _rewrite(out, halve)
    with pytest.raises(ValueError, match=r"model.layers.1.self_attn.o_proj.weight saturates"):
        check_no_saturation(HFSource(hf_dir), ModelOptCheckpoint(out))


def test_exclude_patterns_and_an_unlisted_router(corpus_prefix, tmp_path):
    """--fp8-exclude keeps a whole layer in bf16 (listed module by module); a checkpoint whose
    ignore list omits a router (engines crash on it) is refused."""
    out = tmp_path / "fp8"
    hf_dir = _random_hf("mixtral", tmp_path / "hf")
    _fp8_export(
        hf_dir,
        corpus_prefix,
        out,
        fp8_kv_cache=False,
        exclude_modules=("lm_head", "model.layers.0.*"),
    )
    checkpoint = ModelOptCheckpoint(out)
    assert "model.layers.0.self_attn.q_proj" in checkpoint.config["quantization_config"]["ignore"]
    assert not any(n.startswith("model.layers.0.") for n in checkpoint.quantized)
    assert "model.layers.1.block_sparse_moe.experts.3.w2" in checkpoint.quantized

    def without_routers(names: list[str]) -> list[str]:
        return [n for n in names if not n.endswith("block_sparse_moe.gate")]

    _rewrite(out, edit_flat=lambda quant: quant.update(ignore=without_routers(quant["ignore"])))
    nested = json.loads((out / "hf_quant_config.json").read_text())
    quant = nested["quantization"]
    quant["exclude_modules"] = without_routers(quant["exclude_modules"])
    (out / "hf_quant_config.json").write_text(json.dumps(nested))
    with pytest.raises(ValueError, match="block_sparse_moe.gate is not quantized but not in"):
        ModelOptCheckpoint(out)


# --- the command ---------------------------------------------------------------------------


def test_engine_flags_write_the_same_checkpoint_and_conflicts_are_refused(tmp_path):
    _, config = export_family("llama3", vocab_size=128, hidden_size=32, rope_scaling=None)
    torch.manual_seed(0)
    from pipeline.core.model.transformer import Transformer

    model = Transformer(config)
    model.init_weights()
    hf_dir = write_hf(InMemorySource(config, dict(model.state_dict())), tmp_path / "hf")
    runner = CliRunner()
    for engine in ("--trtllm", "--vllm", "--sglang"):
        out = tmp_path / engine.strip("-")
        result = runner.invoke(cli, ["export", str(hf_dir), engine, "-o", str(out), "-q"])
        assert result.exit_code == 0, result.output
        assert (
            "Hugging Face checkpoint" in result.output and "transformers loads it" in result.output
        )
        assert (out / "model.safetensors").read_bytes() == (
            tmp_path / "trtllm" / "model.safetensors"
        ).read_bytes()
    refusals = {
        ("--trtllm", "--vllm"): "one of --trtllm, --vllm, --sglang (got --trtllm and --vllm)",
        (): "say which engine to export for",
        ("--vllm", "--trtllm-format", "legacy"): "legacy is a TensorRT-LLM format, not --vllm",
        ("--trtllm", "--tp", "2"): "--tp applies to --trtllm-format legacy only",
        ("--sglang", "--use-parallel-embedding"): "--use-parallel-embedding applies to",
    }
    for flags, message in refusals.items():
        result = runner.invoke(cli, ["export", str(hf_dir), *flags, "-o", str(tmp_path / "x")])
        assert result.exit_code != 0 and message in result.output, (flags, result.output)
        errors = [line for line in result.output.splitlines() if line.startswith("Error")]
        assert len(errors) == 1 and "Traceback" not in result.output
    assert not (tmp_path / "x").exists()
