"""LoRA on the hybrid linear-attention models: three steps of `pipe train --lora` from a Qwen3.5 or
Qwen3-Next base adapt the linear layers' projections too; `pipe export --peft` gives adapters
that peft, on the base model in transformers, runs to our logits; the merged checkpoint and
`pipe generate`'s unmerged loader (pipe and peft files) give them as well."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from pipeline.core.model.config import LinearAttentionConfig, ModelConfig, MoEConfig
from pipeline.train.assembly.run_config import resolve_config
from pipeline.train.loop.trainer import Trainer
from pipeline.weights.formats import open_source
from pipeline.weights.model import model_from_source
from tests.train.test_lora_train import _base, _lora_sets

LINEAR = '["q", "k", "v", "o", "qkv", "z", "qkvz", "ba", "gate", "up", "down"]'
# peft 0.21 also wraps transformers 5's fused experts when "gate_proj"/"down_proj" are targeted
# (the shared expert's names), which moves its logits: the MoE family adapts attention only.
TARGETS = {"qwen3_5": LINEAR, "qwen3_next": '["q", "k", "v", "o", "qkvz", "ba"]'}


def _config(family: str) -> tuple[str, ModelConfig]:
    """(architecture, config): four layers, linear, linear, linear, full."""
    moe = None
    if family == "qwen3_next":
        moe = MoEConfig(
            num_experts=4,
            top_k=2,
            ffn_hidden_size=32,
            num_shared_experts=1,
            shared_expert_ffn_hidden_size=48,
            shared_expert_gate=True,
        )
    config = ModelConfig(
        vocab_size=512,
        hidden_size=64,
        num_layers=4,
        num_attention_heads=4,
        num_kv_heads=2,
        head_dim=16,
        ffn_hidden_size=96,
        norm_eps=1e-6,
        max_position_embeddings=256,
        qk_norm=True,
        layer_types=["linear_attention"] * 3 + ["full_attention"],
        partial_rotary_factor=0.25,
        norm_unit_offset=True,
        attention_output_gate=True,
        linear_attention=LinearAttentionConfig(
            num_key_heads=2,
            num_value_heads=4,
            key_head_dim=8,
            value_head_dim=12,
            interleaved_projections=family == "qwen3_next",
        ),
        moe=moe,
    )
    return ("Qwen3NextForCausalLM" if moe else "Qwen3_5ForCausalLM"), config


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_next"])
def test_peft_runs_the_exported_adapters_of_linear_layers(family: str, tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    from safetensors import safe_open

    from pipeline.convert.commands import convert
    from pipeline.export.commands import export
    from pipeline.serve.engine.loading import open_generator

    architecture, config = _config(family)
    base, _ = _base(config, tmp_path / "base", architecture)
    trainer = Trainer(
        resolve_config(None, _lora_sets(tmp_path / "run", base, f"lora.targets={TARGETS[family]}")),
        console=False,
    )
    trainer.train()
    linear = trainer.model.layers["0"].attention
    adapted = ["wqkvz", "wba"] if family == "qwen3_next" else ["wqkv", "wz", "wb", "wa"]
    for name in [*adapted, "wo"]:
        assert getattr(linear, name).lora_B.abs().max() > 0, name

    runner = CliRunner()
    adapters = tmp_path / "run" / "checkpoints"
    result = runner.invoke(export, [str(adapters), "--peft", "-o", str(tmp_path / "peft")])
    assert result.exit_code == 0, result.output
    with safe_open(str(tmp_path / "peft" / "adapter_model.safetensors"), "pt") as f:
        names = list(f.keys())  # noqa: SIM118
    assert any(".linear_attn.out_proj.lora_B" in n for n in names)
    result = runner.invoke(convert, [str(base), "--to", "hf", "-o", str(tmp_path / "hf"), "-q"])
    assert result.exit_code == 0, result.output

    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32)
    hf = peft.PeftModel.from_pretrained(hf.eval(), tmp_path / "peft")
    tokens = torch.randint(0, 512, (2, 70), generator=torch.Generator().manual_seed(1))
    trainer.model.eval()
    with torch.no_grad():
        theirs = hf(input_ids=tokens).logits
        ours = trainer.model.logits(tokens)
        merged = model_from_source(open_source(adapters, "pipe")).logits(tokens)
        assert (ours - theirs).abs().max() < 1e-4
        assert (merged - theirs).abs().max() < 1e-4
        for adapter in (adapters, tmp_path / "peft"):  # unmerged, beside the base weights
            model = open_generator(base, lora_adapter=adapter).model
            assert (model.logits(tokens) - ours).abs().max() < 1e-4, adapter
