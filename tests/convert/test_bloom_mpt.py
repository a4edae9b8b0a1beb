"""BLOOM and MPT (ALiBi, LayerNorm, GeLU, fused q/k/v) against transformers, their oracle: tiny
models made by transformers convert with `pipe convert --from hf` to logits equal to
transformers' (fp32, 1e-4), and back to bit-identical files; what transformers' modules do not
compute is refused in one line. CPU, fp32."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from pipeline.weights.hf_config import choose_architecture, config_from_hf
from pipeline.weights.hf_reader import HFSource
from pipeline.weights.model import model_from_source
from tests.builders import cli_hf_round_trip, hf_config_dict, perturbed, run_pipe

transformers = pytest.importorskip("transformers")

VOCAB, HIDDEN, LAYERS, SEQ = 96, 48, 2, 24
# Six heads: not a power of two, so the slopes of the paper's second sequence are used too.
HEADS = 6
FAMILIES = ["bloom", "mpt", "mpt_untied"]


def hf_alibi_model(name: str):
    """A perturbed tiny transformers model of `name` (MPT with a clip_qkv that clamps)."""
    torch.manual_seed(0)
    if name == "bloom":
        config = transformers.BloomConfig(
            vocab_size=VOCAB, hidden_size=HIDDEN, n_layer=LAYERS, n_head=HEADS, seq_length=64
        )
        model = transformers.BloomForCausalLM(config)
    else:
        config = transformers.MptConfig(
            vocab_size=VOCAB,
            d_model=HIDDEN,
            n_layers=LAYERS,
            n_heads=HEADS,
            max_seq_len=64,
            attn_config={"clip_qkv": 0.3},
            tie_word_embeddings=name != "mpt_untied",
        )
        model = transformers.MptForCausalLM(config)
    return perturbed(model.eval())


@pytest.fixture(scope="module", params=FAMILIES)
def hf_dir(request, tmp_path_factory) -> tuple[str, Path, object]:
    directory = tmp_path_factory.mktemp(request.param)
    model = hf_alibi_model(request.param)
    model.save_pretrained(directory)
    return request.param, directory, model


def test_converted_logits_equal_transformers(hf_dir, tmp_path) -> None:
    name, directory, hf = hf_dir
    run_pipe("convert", directory, "--from", "hf", "--output", tmp_path / "ckpt", "-q")
    from pipeline.weights.pipe_checkpoint import PipeCheckpointSource

    ours = model_from_source(PipeCheckpointSource(tmp_path / "ckpt"))
    config = ours.config
    assert config.position_embedding == "alibi" and config.norm_type == "layernorm"
    assert config.embedding_norm == (name == "bloom") and not config.gated_mlp
    tokens = torch.randint(0, VOCAB, (2, SEQ))
    with torch.no_grad():
        expected = hf(tokens).logits
        actual = ours.logits(tokens)
    torch.testing.assert_close(actual, expected, rtol=1e-4, atol=1e-4)


def test_clip_qkv_clamps(hf_dir) -> None:
    """MPT's clip_qkv is read and used: without it the logits differ (so the test above saw it)."""
    name, directory, hf = hf_dir
    if name == "bloom":
        pytest.skip("BLOOM has no clip_qkv")
    source = HFSource(directory)
    assert source.model_config.clip_qkv == pytest.approx(0.3)
    model = model_from_source(source)
    tokens = torch.randint(0, VOCAB, (1, SEQ))
    with torch.no_grad():
        clipped = model.logits(tokens)
        for layer in model.layers.values():
            layer.attention.clip_qkv = None
        assert not torch.allclose(model.logits(tokens), clipped, atol=1e-4)


def test_round_trip_is_bit_exact(hf_dir, tmp_path) -> None:
    """`pipe convert --from hf` then `--to hf`: the same tensors bit for bit (the fused q/k/v
    split into three and fused again) and the same config, each step checked against
    transformers."""
    _, directory, _ = hf_dir
    back, _ = cli_hf_round_trip(directory, tmp_path)
    # Keys transformers' MPT does not read, which pipe writes as what the files hold: no
    # learned position table, and a cache for generation.
    unread = ("learned_pos_emb", "use_cache")
    written, original = hf_config_dict(back), hf_config_dict(directory)
    assert written.get("learned_pos_emb", False) is False
    assert {k: v for k, v in written.items() if k not in unread} == {
        k: v for k, v in original.items() if k not in unread
    }


def test_hub_bloom_names_without_prefix(tmp_path) -> None:
    """Hub BLOOM checkpoints store `h.0...`, not `transformer.h.0...`: both read the same."""
    from safetensors.torch import load_file, save_file

    hf_alibi_model("bloom").save_pretrained(tmp_path / "prefixed")
    (tmp_path / "bare").mkdir()
    state = load_file(tmp_path / "prefixed" / "model.safetensors")
    save_file(
        {k.removeprefix("transformer."): v for k, v in state.items()},
        tmp_path / "bare" / "model.safetensors",
    )
    config = (tmp_path / "prefixed" / "config.json").read_text()
    (tmp_path / "bare" / "config.json").write_text(config)
    prefixed, bare = HFSource(tmp_path / "prefixed"), HFSource(tmp_path / "bare")
    assert prefixed.tensors() == bare.tensors()
    for name in prefixed.tensors():
        assert torch.equal(prefixed.read(name), bare.read(name)), name


@pytest.mark.parametrize(
    ("family", "change", "message"),
    [
        ("bloom", {"apply_residual_connection_post_layernorm": True}, "post_layernorm"),
        ("mpt", {"attn_config": {"alibi_bias_max": 4}}, "alibi_bias_max 4"),
        ("mpt", {"attn_config": {"qk_ln": True}}, "qk_ln"),
        ("mpt", {"attn_config": {"alibi": False}}, "learned positions"),
        ("mpt", {"no_bias": False}, "no_bias=false"),
        ("mpt", {"expansion_ratio": 2}, "expansion_ratio"),
    ],
)
def test_what_transformers_does_not_compute_is_refused(family, change, message) -> None:
    hf = {"architectures": ["BloomForCausalLM" if family == "bloom" else "MptForCausalLM"]}
    with pytest.raises(ValueError, match=message):
        config_from_hf(hf | change)


def test_our_alibi_models_choose_their_family_or_are_refused() -> None:
    """An ALiBi config goes out as the family that holds it exactly; one neither holds (grouped
    kv heads, RMSNorm) and a RoPE model with BLOOM's blocks are refused, naming why."""
    bloom = config_from_hf({"architectures": ["BloomForCausalLM"], "n_head": 4, "hidden_size": 32})
    mpt = config_from_hf({"architectures": ["MptForCausalLM"], "n_heads": 4, "d_model": 32})
    assert choose_architecture(bloom) == "BloomForCausalLM"
    assert choose_architecture(mpt) == "MptForCausalLM"
    import dataclasses

    with pytest.raises(ValueError, match="grouped-query attention"):
        choose_architecture(dataclasses.replace(bloom, num_kv_heads=2))
    with pytest.raises(ValueError, match="no embedding norm"):
        choose_architecture(dataclasses.replace(bloom, embedding_norm=False))
    with pytest.raises(ValueError, match="norm_type 'layernorm'"):
        choose_architecture(dataclasses.replace(bloom, position_embedding="rope"))


def test_bad_config_named_in_one_line(tmp_path) -> None:
    model = hf_alibi_model("mpt")
    model.save_pretrained(tmp_path / "hf")
    path = tmp_path / "hf" / "config.json"
    config = json.loads(path.read_text())
    config["attn_config"]["alibi_bias_max"] = 16
    path.write_text(json.dumps(config))
    result = run_pipe(
        "convert", tmp_path / "hf", "--from", "hf", "-o", tmp_path / "ckpt", expect_ok=False
    )
    assert result.exit_code != 0
    assert "alibi_bias_max 16" in result.output and "Traceback" not in result.output
