"""The one rule for the dtype `pipe convert --to hf` and `pipe export` write when no --dtype is
given: the dtype of weights that came from Hugging Face, else bfloat16."""

from __future__ import annotations

import torch

from pipeline.core.model.config import ModelConfig
from pipeline.export.options import ExportOptions
from pipeline.export.run import _resolved
from pipeline.weights.dtype_choice import choose_dtype, default_dtype
from pipeline.weights.source import CastSource, InMemorySource

CONFIG = ModelConfig(vocab_size=8, hidden_size=4, num_layers=1, num_attention_heads=1)


def _source(dtype: torch.dtype, **metadata) -> InMemorySource:
    return InMemorySource(
        CONFIG, {"tok_embeddings.weight": torch.zeros(8, 4, dtype=dtype)}, metadata
    )


def test_hf_weights_keep_their_dtype_trained_ones_become_bf16() -> None:
    hf = _source(torch.float32, hf_architecture="LlamaForCausalLM", hf_dtype="float32")
    assert default_dtype(hf).name == "float32"
    assert default_dtype(hf).describe() == (
        "float32, as the Hugging Face weights it came from (--dtype to change)"
    )
    # Converted before the dtype was recorded: the stored dtype, which the import kept.
    older = _source(torch.float16, hf_architecture="LlamaForCausalLM")
    assert default_dtype(older).name == "float16"
    trained = _source(torch.float32)
    assert default_dtype(trained).describe() == (
        "bfloat16, the default for a trained checkpoint (--dtype to change)"
    )
    assert choose_dtype("float16", hf).describe() == "float16, as --dtype asked"


def test_a_cast_on_import_is_what_goes_back() -> None:
    """`--from hf --dtype bf16` of fp32 weights: the checkpoint's weights are bf16, and so is
    what `--to hf` writes back by default."""
    cast = CastSource(_source(torch.float32, hf_dtype="float32"), torch.bfloat16)
    assert default_dtype(cast).name == "bfloat16"
    assert "hf_dtype" not in CastSource(_source(torch.float32), torch.bfloat16).metadata


def test_fp8_exports_of_fp32_weights_compute_in_bf16() -> None:
    source = _source(torch.float32, hf_dtype="float32")
    options, note = _resolved(ExportOptions(dtype=None), source)
    assert options.dtype == "float32" and note.startswith("float32, as the Hugging Face")
    options, note = _resolved(ExportOptions(dtype=None, fp8=True), source)
    assert options.dtype == "bfloat16" and "FP8" in note
    options, _ = _resolved(ExportOptions(dtype="float32", fp8=True), source)
    assert options.dtype == "float32"
