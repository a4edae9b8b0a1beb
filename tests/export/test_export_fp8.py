"""Legacy TensorRT-LLM FP8 export on real text: the tiny Llama 3 and Mixtral models the Hugging
Face export tests train briefly on the shared corpus (Python docs; tests/export/conftest.py),
exported with `--fp8
--fp8-kv-cache` (calibrated on a prefix of the tokenized corpus) at tp2, and the reference
forward over the FP8 rank files is compared with transformers on held-out text: the top-1 next
token must agree on at least 95% of positions, and the logits stay within the stated FP8
tolerance. A trained model is needed: an untrained one has near-flat logits whose top-1 any
rounding flips."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pipeline.export.calibration import calibration_sequences
from pipeline.export.fp8 import FP8_MAX, dequantize, quantize
from pipeline.export.legacy_trtllm.config import LegacyExportOptions
from pipeline.export.legacy_trtllm.layout import TrtllmMapping
from pipeline.export.legacy_trtllm.reference import ReferenceModel, read_rank_files
from pipeline.export.run import CalibrationSettings, run_export

transformers = pytest.importorskip("transformers")
transformers.utils.logging.disable_progress_bar()

CALIB_SEQUENCES, CALIB_LEN = 64, 64
# Largest |logit difference| against the unquantized model, relative to max |logit|: FP8
# e4m3 keeps 3 mantissa bits (relative rounding up to 1/16) on weights, activations and KV.
FP8_LOGIT_TOLERANCE = 0.15
MIN_TOP1 = 0.95


@pytest.fixture(scope="module", params=["llama3", "mixtral"])
def trained_hf(request, trained_family) -> Path:
    """A dense and a MoE model, trained once per session with the Hugging Face export tests."""
    return trained_family(request.param)[1]


def test_fp8_export_agrees_with_transformers_on_real_text(trained_hf, corpus_prefix, tmp_path):
    out = tmp_path / "trt_fp8"
    options = LegacyExportOptions(
        dtype="bfloat16", mapping=TrtllmMapping(tp=2), fp8=True, fp8_kv_cache=True
    )
    calibration = CalibrationSettings(corpus_prefix, CALIB_SEQUENCES, CALIB_LEN)
    summary = run_export(
        trained_hf, out, options, calibration=calibration, quiet=True, target="legacy"
    )
    assert "held-out tokens" in summary, summary

    held_out = calibration_sequences(
        corpus_prefix, 16, 128, skip_tokens=CALIB_SEQUENCES * CALIB_LEN
    )
    hf = transformers.AutoModelForCausalLM.from_pretrained(trained_hf, dtype=torch.float32)
    with torch.no_grad():
        expected = hf(held_out).logits
    actual = ReferenceModel(out).logits(held_out)
    # The model predicts text, not one frequent token everywhere (which FP8 could not flip).
    assert expected.argmax(-1).unique().numel() >= 50
    top1 = float((actual.argmax(-1) == expected.argmax(-1)).float().mean())
    relative = float((actual - expected).abs().max() / expected.abs().max())
    print(f"FP8 vs transformers: top-1 {top1:.2%}, max relative logit difference {relative:.3f}")
    assert top1 >= MIN_TOP1
    assert relative < FP8_LOGIT_TOLERANCE


def test_fp8_files_are_quantized_as_documented(trained_hf, corpus_prefix, tmp_path):
    """fp8 weights with dequantization scales amax/448: one per fused tensor (qkv; fc with
    gate), one per expert for MoE; activation and KV scales from the calibration amax."""
    out = tmp_path / "trt_fp8"
    options = LegacyExportOptions(dtype="bfloat16", fp8=True, fp8_kv_cache=True)
    calibration = CalibrationSettings(corpus_prefix, 8, CALIB_LEN)
    run_export(
        trained_hf,
        out,
        options,
        calibration=calibration,
        verify="off",
        quiet=True,
        target="legacy",
    )
    (rank,) = read_rank_files(out, 1)
    hf = transformers.AutoModelForCausalLM.from_pretrained(trained_hf).state_dict()
    p, t = "model.layers.1", "transformer.layers.1"
    qkv = [hf[f"{p}.self_attn.{w}_proj.weight"] for w in "qkv"]
    scale = max(float(w.abs().max()) for w in qkv) / FP8_MAX
    assert torch.allclose(rank[f"{t}.attention.qkv.weights_scaling_factor"], torch.tensor([scale]))
    weight = rank[f"{t}.attention.qkv.weight"]
    assert weight.dtype == torch.float8_e4m3fn
    assert torch.equal(weight, quantize(torch.cat(qkv), torch.tensor([scale])))
    assert float(dequantize(weight, torch.tensor([scale])).abs().max()) == pytest.approx(
        scale * FP8_MAX, rel=1e-6
    )
    if f"{t}.mlp.router.weight" in rank:
        experts = rank[f"{t}.mlp.fc.weights_scaling_factor"]
        assert experts.shape == (4, 1) and len(set(experts.flatten().tolist())) == 4
        assert rank[f"{t}.mlp.router.weight"].dtype == torch.float32
    else:
        fc, gate = (
            rank[f"{t}.mlp.fc.weights_scaling_factor"],
            rank[f"{t}.mlp.gate.weights_scaling_factor"],
        )
        both = max(float(hf[f"{p}.mlp.{w}_proj.weight"].abs().max()) for w in ("gate", "up"))
        assert torch.equal(fc, gate) and float(fc) == pytest.approx(both / FP8_MAX, rel=1e-6)
    for name in ("attention.qkv", "attention.dense", "mlp.fc", "mlp.proj"):
        act = rank[f"{t}.{name}.activation_scaling_factor"]
        assert act.dtype == torch.float32 and act.shape == (1,) and float(act) > 0
    assert rank[f"{t}.attention.kv_cache_scaling_factor"].shape == (1,)
    assert rank["lm_head.weight"].dtype == torch.bfloat16  # excluded by default
