"""Golden listings of every tensor (name, shape, safetensors dtype) of fixed tiny exports, read
from the files' own headers: the legacy TensorRT-LLM rank files of two exports, reviewed against
docs/file_layouts.md, "TensorRT-LLM export (legacy)" (names, splits, stage-local numbering,
first/last stage ownership, FP8 scale tensors), and one ModelOpt FP8 Hugging Face export with
its ignore list, reviewed against "FP8 Hugging Face export" (HF names, one tensor per expert,
fp8 weights with fp32 scalar weight_scale / input_scale, k_scale / v_scale, routers and norms
unquantized and listed), and one DeepSeek-V3 block FP8 export, reviewed against "DeepSeek-V3
block FP8" (every attention and MLP projection fp8 with an fp32 weight_scale_inv on the
[ceil(out/128), ceil(in/128)] grid; embeddings, lm_head, norms and routers in bf16, the
correction bias fp32; no other scales). Regenerate with PIPE_UPDATE_GOLDEN=1 and review the
diff."""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import torch

from pipeline.core.model.config import MLAConfig, ModelConfig, MoEConfig
from pipeline.core.model.transformer import Transformer
from pipeline.export.hf_export import write_hf_export
from pipeline.export.legacy_trtllm.config import LegacyExportOptions
from pipeline.export.legacy_trtllm.layout import TrtllmMapping
from pipeline.export.legacy_trtllm.writer import write_trtllm
from pipeline.export.options import ExportOptions
from pipeline.weights.source import InMemorySource

GOLDEN = Path(__file__).parent / "golden" / "trtllm_rank_files.txt"
GOLDEN_FP8 = Path(__file__).parent / "golden" / "modelopt_fp8.txt"
GOLDEN_BLOCK_FP8 = Path(__file__).parent / "golden" / "deepseek_block_fp8.txt"


def _source(config: ModelConfig) -> InMemorySource:
    torch.manual_seed(0)
    model = Transformer(config)
    model.init_weights()
    state = {n: t for n, t in model.state_dict().items()}
    if config.tie_word_embeddings:
        del state["output.weight"]
    return InMemorySource(config, state)


def _header(path: Path) -> dict:
    """The safetensors JSON header, parsed by hand (not through our writer or safetensors)."""
    with open(path, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(length))
    header.pop("__metadata__", None)
    return header


def _listing(directory: Path, title: str) -> list[str]:
    config = json.loads((directory / "config.json").read_text())
    lines = [f"# {title}"]
    for rank in range(config["mapping"]["world_size"]):
        header = _header(directory / f"rank{rank}.safetensors")
        for name in sorted(header):
            entry = header[name]
            shape = "x".join(str(s) for s in entry["shape"])
            lines.append(f"rank{rank} {name} {shape} {entry['dtype']}")
    return lines


def _exports(tmp_path: Path) -> list[str]:
    dense = ModelConfig(
        vocab_size=250,
        hidden_size=64,
        num_layers=3,
        num_attention_heads=4,
        num_kv_heads=2,
        ffn_hidden_size=96,
        qkv_bias=True,
    )
    out = write_trtllm(
        _source(dense),
        tmp_path / "dense",
        LegacyExportOptions(dtype="bfloat16", mapping=TrtllmMapping(tp=2, pp=2)),
    )
    lines = _listing(
        out, "Qwen2-style (qkv bias), 3 layers, 4 q / 2 kv heads, vocab 250, bf16, tp2 pp2"
    )
    moe = ModelConfig(
        vocab_size=250,
        hidden_size=64,
        num_layers=2,
        num_attention_heads=4,
        num_kv_heads=1,
        ffn_hidden_size=96,
        tie_word_embeddings=True,
        moe=MoEConfig(num_experts=4, top_k=2),
    )
    amax = {f"{i}.{k}": 1.0 for i in range(2) for k in ("qkv", "dense", "fc", "proj", "kv")}
    options = LegacyExportOptions(
        dtype="bfloat16",
        mapping=TrtllmMapping(tp=2, pp=1, moe_ep=2),
        fp8=True,
        fp8_kv_cache=True,
    )
    out = write_trtllm(_source(moe), tmp_path / "moe", options, amax=amax)
    title = "Mixtral-style, tied, 2 layers, 4 q / 1 kv head, 4 experts, FP8 + FP8 KV, tp2 moe_ep2"
    return lines + _listing(out, title)


def _check_golden(lines: list[str], golden: Path) -> None:
    text = "\n".join(lines) + "\n"
    if os.environ.get("PIPE_UPDATE_GOLDEN"):
        golden.parent.mkdir(exist_ok=True)
        golden.write_text(text)
    assert text == golden.read_text(), f"{golden.name} changed; PIPE_UPDATE_GOLDEN=1 and review"


def test_rank_file_listing_matches_golden(tmp_path) -> None:
    _check_golden(_exports(tmp_path), GOLDEN)


def test_modelopt_fp8_listing_matches_golden(tmp_path) -> None:
    config = ModelConfig(
        vocab_size=250,
        hidden_size=64,
        num_layers=2,
        num_attention_heads=4,
        num_kv_heads=2,
        head_dim=32,
        ffn_hidden_size=96,
        qk_norm=True,
        moe=MoEConfig(num_experts=3, top_k=2, ffn_hidden_size=48, dense_layers=[0]),
    )
    amax = {f"{i}.{k}": 1.0 for i in range(2) for k in ("qkv", "dense", "fc", "proj", "kv")}
    options = ExportOptions(dtype="bfloat16", fp8=True, fp8_kv_cache=True)
    out = write_hf_export(_source(config), tmp_path / "fp8", options, amax=amax)
    lines = ["# Qwen3-MoE-style, 2 layers (0 dense), 3 experts, FP8 + FP8 KV, bf16"]
    lines += _hf_listing(out)
    quant = json.loads((out / "config.json").read_text())["quantization_config"]
    lines += ["# ignore"] + quant["ignore"]
    _check_golden(lines, GOLDEN_FP8)


def _hf_listing(directory: Path) -> list[str]:
    lines = []
    for name, entry in sorted(_header(directory / "model.safetensors").items()):
        shape = "x".join(str(s) for s in entry["shape"]) or "scalar"
        lines.append(f"{name} {shape} {entry['dtype']}")
    return lines


def test_deepseek_block_fp8_listing_matches_golden(tmp_path) -> None:
    mla = MLAConfig(
        kv_lora_rank=64, q_lora_rank=96, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32
    )
    moe = MoEConfig(
        num_experts=3,
        top_k=2,
        ffn_hidden_size=64,
        dense_layers=[0],
        score_function="sigmoid",
        num_shared_experts=1,
        expert_bias=True,
    )
    config = ModelConfig(
        vocab_size=250,
        hidden_size=160,
        num_layers=2,
        num_attention_heads=4,
        num_kv_heads=4,
        ffn_hidden_size=200,
        mla=mla,
        moe=moe,
    )
    options = ExportOptions(dtype="bfloat16", fp8=True)
    out = write_hf_export(_source(config), tmp_path / "fp8", options)
    lines = [
        "# DeepSeek-V3-style, hidden 160, q_b 192 rows, 2 layers (0 dense), 3 experts + 1 "
        "shared, block FP8, bf16"
    ]
    lines += _hf_listing(out)
    quant = json.loads((out / "config.json").read_text())["quantization_config"]
    lines += ["# quantization_config", json.dumps(quant, sort_keys=True)]
    _check_golden(lines, GOLDEN_BLOCK_FP8)
