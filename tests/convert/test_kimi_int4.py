"""Kimi K2.5's text model: a DeepseekV3ForCausalLM inside a multimodal `kimi_k25` checkpoint, its
routed experts stored as INT4 in groups of 32 by compressed-tensors ("pack-quantized"). The
oracle of the dequantization is compressed-tensors itself: a tiny checkpoint is packed with its
compressor, and what pipe reads equals what the package decompresses, bit for bit; the model
pipe reads gives the logits transformers gives with those decompressed weights. CPU, fp32."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from pipeline.core.model.flavors import get_flavor, num_parameters
from pipeline.core.model.hf_names import from_hf_state_dict
from pipeline.weights.hf_config import config_from_hf, text_model
from pipeline.weights.hf_reader import HFSource
from tests.builders import SEQ, VOCAB, disk_tensors, load_from_source, perturbed_with_bias

transformers = pytest.importorskip("transformers")
compressed_tensors = pytest.importorskip("compressed_tensors")

HIDDEN, FFN, MOE_FFN, GROUP = 64, 96, 32, 32
EXPERT = "mlp.experts."
# moonshotai/Kimi-K2-Thinking's quantization_config (Kimi K2.5 publishes the same scheme).
QUANTIZATION = {
    "config_groups": {
        "group_0": {
            "input_activations": None,
            "output_activations": None,
            "targets": ["Linear"],
            "weights": {
                "actorder": None,
                "block_structure": None,
                "dynamic": False,
                "group_size": 32,
                "num_bits": 4,
                "observer": "minmax",
                "observer_kwargs": {},
                "strategy": "group",
                "symmetric": True,
                "type": "int",
            },
        }
    },
    "format": "pack-quantized",
    "ignore": [
        "lm_head",
        "re:.*self_attn.*",
        "re:.*shared_experts.*",
        "re:.*mlp\\.(gate|up|gate_up|down)_proj.*",
    ],
    "kv_cache_scheme": None,
    "quant_method": "compressed-tensors",
    "quantization_status": "compressed",
}


def _scheme():
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    weights = QuantizationArgs(
        num_bits=4, type="int", symmetric=True, strategy="group", group_size=GROUP
    )
    return QuantizationScheme(targets=["Linear"], weights=weights)


def _pack(weight: torch.Tensor) -> dict[str, torch.Tensor]:
    """compressed-tensors' pack-quantized tensors of `weight` (bf16 scales from each group's
    largest magnitude, as its minmax observer chooses them)."""
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor

    groups = weight.unflatten(-1, (-1, GROUP))
    scale = (groups.abs().amax(-1) / 7.5).to(torch.bfloat16)
    state = {"weight": weight.to(torch.bfloat16), "weight_scale": scale}
    return PackedQuantizationCompressor.compress(state, _scheme())


def _unpack(packed: dict[str, torch.Tensor]) -> torch.Tensor:
    """compressed-tensors' own dequantization of `_pack`'s tensors."""
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor

    return PackedQuantizationCompressor.decompress(packed, _scheme())["weight"]


def _text_config(vocab_size: int = VOCAB):
    """A tiny Kimi K2: latent attention, the first layer dense, 8 routed experts top-2 in one
    group plus one shared, scaled by 2.827, YaRN."""
    return transformers.DeepseekV3Config(
        vocab_size=vocab_size,
        hidden_size=HIDDEN,
        intermediate_size=FFN,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=4,
        kv_lora_rank=32,
        q_lora_rank=48,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=16,
        first_k_dense_replace=1,
        max_position_embeddings=128,
        rms_norm_eps=1e-5,
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 50000.0,
            "factor": 4.0,
            "original_max_position_embeddings": 32,
            "beta_fast": 1.0,
            "beta_slow": 1.0,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
        },
        tie_word_embeddings=False,
        num_nextn_predict_layers=0,
        n_routed_experts=8,
        num_experts_per_tok=2,
        n_group=1,
        topk_group=1,
        n_shared_experts=1,
        moe_intermediate_size=MOE_FFN,
        routed_scaling_factor=2.827,
        norm_topk_prob=True,
    )


@pytest.fixture(scope="module")
def kimi(tmp_path_factory) -> tuple[Path, object]:
    return kimi_checkpoint(tmp_path_factory.mktemp("kimi") / "hf")


def kimi_checkpoint(directory: Path, vocab_size: int = VOCAB) -> tuple[Path, object]:
    """A Kimi K2.5-shaped directory (`kimi_k25` config with a `text_config`, text weights under
    `language_model.`, a vision tower and projector beside them, two files) whose routed
    experts compressed-tensors packed; and transformers' text model holding the weights
    compressed-tensors decompresses from it."""
    from safetensors.torch import save_file

    config = _text_config(vocab_size)
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    hf = perturbed_with_bias(transformers.DeepseekV3ForCausalLM(config).eval())
    hf.save_pretrained(directory)
    files: list[dict[str, torch.Tensor]] = [{}, {}]
    for name, tensor in disk_tensors(directory).items():
        shard = files[0] if ".layers.0." in name or "embed" in name else files[1]
        if EXPERT in name and name.endswith("_proj.weight"):
            packed = _pack(tensor)
            stem = name.removesuffix(".weight")
            for key, value in packed.items():
                shard[f"language_model.{stem}.{key}"] = value
            dequantized = _unpack(packed).float()
            _set_expert(hf, name, dequantized)
        else:
            shard[f"language_model.{name}"] = tensor
    files[1]["vision_tower.patch_embed.proj.weight"] = torch.randn(8, 3, 2, 2)
    files[1]["mm_projector.proj.0.weight"] = torch.randn(HIDDEN, 8)
    for path in directory.glob("*.safetensors"):
        path.unlink()
    weight_map = {}
    for k, tensors in enumerate(files, start=1):
        file = f"model-{k:05d}-of-00002.safetensors"
        save_file(tensors, str(directory / file))
        weight_map |= dict.fromkeys(tensors, file)
    index = {"metadata": {}, "weight_map": weight_map}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index))
    text = config.to_dict() | {"model_type": "kimi_k2", "architectures": ["DeepseekV3ForCausalLM"]}
    wrapper = {
        "architectures": ["KimiK25ForConditionalGeneration"],
        "model_type": "kimi_k25",
        "text_config": text,
        "vision_config": {"model_type": "kimi_k25_vision"},
        "quantization_config": QUANTIZATION,
    }
    (directory / "config.json").write_text(json.dumps(wrapper))
    return directory, hf


def _set_expert(hf, disk_name: str, weight: torch.Tensor) -> None:
    """Put one expert's weight (`model.layers.L.mlp.experts.E.{gate,up,down}_proj.weight`)
    into transformers' fused expert tensors."""
    parts = disk_name.split(".")
    layer, expert, proj = int(parts[2]), int(parts[5]), parts[6]
    experts = hf.model.layers[layer].mlp.experts
    with torch.no_grad():
        if proj == "down_proj":
            experts.down_proj[expert].copy_(weight)
        else:
            half = 0 if proj == "gate_proj" else 1
            experts.gate_up_proj[expert].chunk(2, dim=0)[half].copy_(weight)


def test_int4_experts_read_as_compressed_tensors_decompresses_them(kimi) -> None:
    """Every routed expert reads back as compressed-tensors' own dequantization (bf16 scales,
    products in bf16, as it computes them), upcast to fp32, bit for bit; the vision tower and
    projector are not listed; the source names the quantization."""
    directory, hf = kimi
    source = HFSource(directory)
    assert source.metadata["quantization"] == "compressed-tensors INT4"
    assert source.metadata["hf_architecture"] == "DeepseekV3ForCausalLM"
    names = source.tensors()
    assert not any("vision" in n or "projector" in n for n in names)
    assert names["layers.1.moe.experts.w1"].shape == (8, MOE_FFN, HIDDEN)
    assert names["layers.1.moe.experts.w1"].dtype == torch.float32
    ours = from_hf_state_dict(hf.state_dict())
    for layer in ("1", "2"):
        for w in ("w1", "w2", "w3"):
            name = f"layers.{layer}.moe.experts.{w}"
            assert torch.equal(source.read(name), ours[name]), name
    # The experts are stored packed: what was read was dequantized.
    original = disk_tensors(directory)
    assert "language_model.model.layers.1.mlp.experts.0.gate_proj.weight_packed" in original


def test_logits_equal_transformers_with_the_dequantized_experts(kimi) -> None:
    directory, hf = kimi
    model = load_from_source(HFSource(directory))
    tokens = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert (model.logits(tokens) - hf(input_ids=tokens).logits).abs().max() < 1e-4


def test_convert_to_pipe_and_back_writes_bf16_transformers_loads(kimi, tmp_path) -> None:
    """`pipe convert --from hf` reads the INT4 checkpoint (verified against it), and `--to hf
    --dtype bf16` writes a plain DeepseekV3ForCausalLM without quantization_config whose
    routed experts are the dequantized values (exact in bf16: each is a 4-bit integer times a
    bf16 scale, rounded once, as compressed-tensors rounds it) and which transformers loads to
    our logits."""
    from click.testing import CliRunner

    from pipeline.convert.commands import convert

    directory, hf = kimi
    ckpt, back = tmp_path / "ckpt", tmp_path / "back"
    result = CliRunner().invoke(convert, [str(directory), "--from", "hf", "-o", str(ckpt), "-q"])
    assert result.exit_code == 0, result.output
    assert "bit-identical" in result.output
    assert "logits not compared (transformers builds kimi_k25 as a multimodal" in result.output
    result = CliRunner().invoke(
        convert, [str(ckpt), "--to", "hf", "-o", str(back), "--dtype", "bf16", "-q"]
    )
    assert result.exit_code == 0, result.output
    assert "logits match transformers" in result.output
    config = json.loads((back / "config.json").read_text())
    assert config["architectures"] == ["DeepseekV3ForCausalLM"]
    assert "quantization_config" not in config
    written = disk_tensors(back)
    expert = written["model.layers.2.mlp.experts.5.down_proj.weight"]
    assert expert.dtype == torch.bfloat16
    assert torch.equal(expert.float(), hf.model.layers[2].mlp.experts.down_proj[5])
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(
        back, attn_implementation="eager", dtype=torch.float32
    ).eval()
    ours = load_from_source(HFSource(back))
    tokens = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert (reloaded(input_ids=tokens).logits - ours.logits(tokens)).abs().max() < 1e-4


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"num_bits": 8}, "num_bits is 8"),
        ({"symmetric": False}, "symmetric is False"),
        ({"strategy": "channel"}, "strategy is 'channel'"),
    ],
)
def test_other_compressed_tensors_schemes_are_refused_in_one_line(
    kimi, tmp_path, change, message
) -> None:
    directory, _ = kimi
    config = json.loads((directory / "config.json").read_text())
    weights = config["quantization_config"]["config_groups"]["group_0"]["weights"]
    weights.update(change)
    other = tmp_path / "other"
    other.mkdir()
    (other / "config.json").write_text(json.dumps(config))
    for path in directory.glob("*.safetensors*"):
        (other / path.name).symlink_to(path)
    (other / "model.safetensors.index.json").write_text(
        (directory / "model.safetensors.index.json").read_text()
    )
    with pytest.raises(ValueError, match=message) as error:
        HFSource(other)
    assert "\n" not in str(error.value)


# moonshotai/Kimi-K2.5's text_config (Kimi K2's DeepseekV3ForCausalLM shape).
KIMI_K25_TEXT_JSON = dict(
    architectures=["DeepseekV3ForCausalLM"],
    model_type="kimi_k2",
    aux_loss_alpha=0.001,
    bos_token_id=163584,
    eos_token_id=163585,
    first_k_dense_replace=1,
    hidden_act="silu",
    hidden_size=7168,
    initializer_range=0.02,
    intermediate_size=18432,
    kv_lora_rank=512,
    max_position_embeddings=262144,
    moe_intermediate_size=2048,
    moe_layer_freq=1,
    n_group=1,
    n_routed_experts=384,
    n_shared_experts=1,
    norm_topk_prob=True,
    num_attention_heads=64,
    num_experts_per_tok=8,
    num_hidden_layers=61,
    num_key_value_heads=64,
    num_nextn_predict_layers=0,
    pretraining_tp=1,
    q_lora_rank=1536,
    qk_nope_head_dim=128,
    qk_rope_head_dim=64,
    rms_norm_eps=1e-05,
    rope_scaling={
        "beta_fast": 1.0,
        "beta_slow": 1.0,
        "factor": 64.0,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
        "original_max_position_embeddings": 4096,
        "type": "yarn",
    },
    rope_theta=50000.0,
    routed_scaling_factor=2.827,
    scoring_func="sigmoid",
    seq_aux=True,
    tie_word_embeddings=False,
    topk_group=1,
    topk_method="noaux_tc",
    torch_dtype="bfloat16",
    use_cache=True,
    v_head_dim=128,
    vocab_size=163840,
)


def test_published_text_config_gives_its_size() -> None:
    """Kimi K2.5's config.json (its text_config inside the kimi_k25 wrapper) reads as our
    `kimi_k2` flavor, whose parameter count is transformers' DeepseekV3ForCausalLM's of the
    same config and the published 1T total (1.03T), 32B active."""
    from pipeline.train.report.estimates import parameter_counts

    wrapper = {
        "architectures": ["KimiK25ForConditionalGeneration"],
        "model_type": "kimi_k25",
        "text_config": KIMI_K25_TEXT_JSON,
        "quantization_config": QUANTIZATION,
    }
    hf, prefix = text_model(wrapper)
    assert prefix == "language_model."
    ours = config_from_hf(hf)
    assert ours == get_flavor("kimi_k2")
    kwargs = {k: v for k, v in KIMI_K25_TEXT_JSON.items() if k not in ("architectures",)}
    kwargs.pop("model_type")
    with torch.device("meta"):
        theirs = transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(**kwargs))
    assert num_parameters(ours) == sum(p.numel() for p in theirs.parameters())
    assert abs(num_parameters(ours) - 1.03e12) < 0.01e12
    assert abs(parameter_counts(ours).active - 32e9) < 1e9
