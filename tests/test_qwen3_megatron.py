"""`pipe convert --from megatron` for Qwen3: Megatron's `qk_layernorm` weights.

The format oracle is megatron-core 0.16.1: a real `GPTModel` with `qk_layernorm=True` (local
spec, CPU, one gloo process) holds a tiny perturbed transformers Qwen3 model's weights in its
runtime layout and saves them with its own sharded state dict. `MegatronSource` must find the
per-head q/k norms, and our model built from it must give transformers' logits (fp32, 1e-4).
Plus a plain-DCP layout read bit-exactly and the config check.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from distributed import run_distributed

from pipeline.convert.megatron import MegatronCheckpointError, MegatronSource, fuse_fc1, fuse_qkv
from pipeline.core.model.config import ModelConfig
from pipeline.core.model.hf_names import from_hf_state_dict
from tests.test_convert_megatron import (
    FFN,
    HEADS,
    HIDDEN,
    ITERATION,
    KV_HEADS,
    LAYERS,
    PADDED,
    VOCAB,
    _assert_logits_match,
    _megatron_keys,
    _random_ours,
    _stub_cuda,
    _write_dcp,
)

HEAD_DIM = 24  # not HIDDEN / HEADS = 16: Megatron's --kv-channels


def _our_config() -> ModelConfig:
    return ModelConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, num_layers=LAYERS, num_attention_heads=HEADS,
        num_kv_heads=KV_HEADS, head_dim=HEAD_DIM, ffn_hidden_size=FFN, norm_eps=1e-6,
        rope_theta=1e6, max_position_embeddings=128, qk_norm=True,
    )  # fmt: skip


def _hf_qwen3():
    transformers = pytest.importorskip("transformers")
    config = transformers.Qwen3Config(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=LAYERS,
        num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM,
        max_position_embeddings=128, rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6}, tie_word_embeddings=False,
    )  # fmt: skip
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    hf = transformers.Qwen3ForCausalLM(config).eval()
    with torch.no_grad():  # norms off ones, so a q/k norm left out or swapped would show
        for p in hf.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return hf


def _runtime_state(ours: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Our tensors as a TP1 megatron-core GPTModel (local spec) names them at runtime."""

    def pad(t: torch.Tensor) -> torch.Tensor:
        return torch.cat([t, t[-1:].expand(PADDED - VOCAB, -1)])

    state = {
        "embedding.word_embeddings.weight": pad(ours["tok_embeddings.weight"]),
        "output_layer.weight": pad(ours["output.weight"]),
        "decoder.final_layernorm.weight": ours["norm.weight"],
    }
    for i in range(LAYERS):
        p, m = f"layers.{i}.", f"decoder.layers.{i}."
        qkv = fuse_qkv(*(ours[f"{p}attention.w{x}.weight"] for x in "qkv"), KV_HEADS)
        state |= {
            m + "input_layernorm.weight": ours[p + "attention_norm.weight"],
            m + "self_attention.linear_qkv.weight": qkv,
            m + "self_attention.q_layernorm.weight": ours[p + "attention.q_norm.weight"],
            m + "self_attention.k_layernorm.weight": ours[p + "attention.k_norm.weight"],
            m + "self_attention.linear_proj.weight": ours[p + "attention.wo.weight"],
            m + "pre_mlp_layernorm.weight": ours[p + "ffn_norm.weight"],
            m + "mlp.linear_fc1.weight": fuse_fc1(
                ours[p + "feed_forward.w1.weight"], ours[p + "feed_forward.w3.weight"]
            ),
            m + "mlp.linear_fc2.weight": ours[p + "feed_forward.w2.weight"],
        }
    return state


def _save_qwen3_gpt_model(rank: int, world_size: int, tmp, runtime: dict) -> None:
    """megatron-core's GPTModel with qk_layernorm saves `runtime` with its own state dict."""
    import warnings

    from megatron.core import dist_checkpointing, parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    warnings.simplefilter("ignore")
    _stub_cuda()
    parallel_state.initialize_model_parallel(1, 1)
    config = TransformerConfig(
        num_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=HEADS,
        num_query_groups=KV_HEADS, kv_channels=HEAD_DIM, ffn_hidden_size=FFN,
        gated_linear_unit=True, activation_func=torch.nn.functional.silu,
        normalization="RMSNorm", layernorm_epsilon=1e-6, qk_layernorm=True,
        add_bias_linear=False, use_cpu_initialization=True,
    )  # fmt: skip
    model = GPTModel(
        config,
        get_gpt_layer_local_spec(normalization="RMSNorm", qk_layernorm=True),
        vocab_size=PADDED, max_sequence_length=128, share_embeddings_and_output_weights=False,
        position_embedding_type="rope", rotary_base=1000000,
    )  # fmt: skip
    missing, unexpected = model.load_state_dict(runtime, strict=False)
    assert not unexpected, unexpected
    assert all(k.endswith("_extra_state") for k in missing), missing
    out = tmp / f"iter_{ITERATION:07d}"
    out.mkdir(parents=True, exist_ok=True)
    dist_checkpointing.save(model.sharded_state_dict(), str(out))
    parallel_state.destroy_model_parallel()


@pytest.mark.dist
def test_megatron_core_qk_layernorm_checkpoint_matches_transformers(tmp_path) -> None:
    pytest.importorskip("megatron.core", reason="megatron-core is the format oracle")
    pytest.importorskip("psutil", reason="megatron-core's checkpoint writer needs psutil")
    hf = _hf_qwen3()
    with torch.no_grad():
        runtime = _runtime_state(from_hf_state_dict(hf.state_dict()))
    run_distributed(_save_qwen3_gpt_model, 1, tmp_path, runtime)
    source = MegatronSource(tmp_path / f"iter_{ITERATION:07d}", model_config=_our_config())
    assert "layers.1.attention.k_norm.weight" in source.tensors()
    _assert_logits_match(source, hf)


def _qwen3_megatron_keys(ours: dict, config: ModelConfig) -> dict[str, torch.Tensor]:
    """`_megatron_keys` (layer-stacked) plus the stacked q/k layernorm weights."""
    out = _megatron_keys(ours, config, indexed=False)
    for ours_name, key in (("q_norm", "q_layernorm"), ("k_norm", "k_layernorm")):
        stacked = [ours[f"layers.{i}.attention.{ours_name}.weight"] for i in range(LAYERS)]
        out[f"decoder.layers.self_attention.{key}.weight"] = torch.stack(stacked)
    return out


def test_stacked_qk_layernorm_reads_exactly_and_is_checked(tmp_path) -> None:
    """Layer-stacked q/k layernorms read back bit for bit in our canonical order; a given config
    that says no q/k norms is refused, naming the field."""
    config = _our_config()
    ours = _random_ours(config)
    directory = _write_dcp(tmp_path / "iter_0000003", _qwen3_megatron_keys(ours, config))
    source = MegatronSource(directory, model_config=config)
    assert list(source.tensors()) == list(ours)
    for name, tensor in ours.items():
        assert torch.equal(source.read(name), tensor), name
    with pytest.raises(MegatronCheckpointError, match="qk_norm=False but the checkpoint has True"):
        MegatronSource(directory, model_config=dataclasses.replace(config, qk_norm=False))
