"""gpt-oss against transformers (the oracle): attention sinks, q/k/v/o biases, sliding and full
layers alternating (prompts longer than the window), YaRN with `truncate: false`, experts with
biases and the clamped SwiGLU in gpt-oss's fused interleaved layout, a biased router; MXFP4
experts dequantized as transformers dequantizes them; the published configs' sizes. CPU, fp32.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from pipeline.core.model.config import ModelConfig, MoEConfig, YarnScaling
from pipeline.core.model.flavors import get_flavor, num_parameters
from pipeline.core.model.hf_names import from_hf_state_dict
from pipeline.weights.hf_reader import HFSource
from pipeline.weights.hf_writer import write_hf
from pipeline.weights.source import InMemorySource
from tests.builders import (
    SHARD_BYTES,
    VOCAB,
    cli_hf_round_trip,
    disk_tensors,
    hf_config_dict,
    load_from_source,
)
from tests.builders import build_model as build

transformers = pytest.importorskip("transformers")

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, EXPERTS, FFN, LAYERS, WINDOW = 64, 4, 2, 16, 4, 32, 4, 5
SEQ = 40  # longer than the window (5)
ROPE = {
    "rope_type": "yarn",
    "rope_theta": 150000.0,
    "factor": 4.0,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "truncate": False,
    "original_max_position_embeddings": 64,
}


def _case(vocab: int = VOCAB):
    """(HF config, our config written out by hand) for a tiny gpt-oss over `vocab` tokens."""
    hf = transformers.GptOssConfig(
        vocab_size=vocab,
        hidden_size=HIDDEN,
        intermediate_size=FFN,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        head_dim=HEAD_DIM,
        num_local_experts=EXPERTS,
        num_experts_per_tok=2,
        sliding_window=WINDOW,
        max_position_embeddings=256,
        rope_parameters=dict(ROPE),
        router_aux_loss_coef=0.01,
    )
    ours = ModelConfig(
        vocab_size=vocab,
        hidden_size=HIDDEN,
        num_layers=LAYERS,
        num_attention_heads=HEADS,
        num_kv_heads=KV_HEADS,
        head_dim=HEAD_DIM,
        ffn_hidden_size=FFN,
        norm_eps=1e-5,
        rope_theta=150000.0,
        rope_scaling=YarnScaling(
            factor=4.0,
            original_max_position_embeddings=64,
            mscale=0.0,
            mscale_all_dim=0.0,
            truncate=False,
        ),
        max_position_embeddings=256,
        qkv_bias=True,
        attention_out_bias=True,
        attention_sinks=True,
        layer_types=["sliding_attention", "full_attention"] * (LAYERS // 2),
        sliding_window=WINDOW,
        moe=MoEConfig(
            num_experts=EXPERTS,
            top_k=2,
            ffn_hidden_size=FFN,
            aux_loss_coeff=0.01,
            router_bias=True,
            expert_biases=True,
            activation="swiglu_clamped",
        ),
    )
    return hf, ours


def _hf_model(hf_config):
    """The HF model with every weight perturbed (biases and sinks not zero), and the experts'
    projections scaled up so the SwiGLU clamps (at 7) do bite."""
    hf_config._attn_implementation = "eager"
    torch.manual_seed(0)
    hf = transformers.GptOssForCausalLM(hf_config).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            p.add_(torch.randn_like(p) * 0.05)
            if "experts.gate_up_proj" in name and not name.endswith("bias"):
                p.mul_(60.0)
    return hf


def _tokens(seed: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(seed))


def test_config_from_transformers_saved_dict() -> None:
    from pipeline.weights.hf_config import config_from_hf

    hf_config, expected = _case()
    hf = hf_config.to_dict() | {"architectures": ["GptOssForCausalLM"]}
    assert config_from_hf(hf) == expected


def test_logits_and_gradients_equal_transformers() -> None:
    """Logits and every parameter's gradient of the CE loss agree with transformers to 1e-4 on
    40 positions (window 5), and the clamps are reached."""
    hf_config, config = _case()
    hf = _hf_model(hf_config)
    model = build(config)
    model.load_state_dict(from_hf_state_dict(hf.state_dict()), strict=True)
    assert [block.attention.kernel.window for block in model.layers.values()] == [5, None] * 2
    tokens, labels = _tokens(1), _tokens(2)
    gate_ups = []
    hook = hf.model.layers[0].mlp.experts.register_forward_hook(
        lambda m, args, out: gate_ups.append(args[0] @ m.gate_up_proj[0] + m.gate_up_proj_bias[0])
    )
    hf_logits = hf(input_ids=tokens).logits
    hook.remove()
    assert gate_ups[0].abs().max() > 7.0  # the clamped SwiGLU differs from a plain one here
    logits = model.logits(tokens)
    assert (logits - hf_logits).abs().max() < 1e-4
    F.cross_entropy(hf_logits.flatten(0, 1), labels.flatten()).backward()
    F.cross_entropy(logits.flatten(0, 1), labels.flatten()).backward()
    hf_grads = from_hf_state_dict({n: p.grad for n, p in hf.named_parameters()})
    for pname, p in model.named_parameters():
        scale = max(1.0, float(hf_grads[pname].abs().max()))
        assert (p.grad - hf_grads[pname]).abs().max() < 1e-4 * scale, pname


@pytest.mark.parametrize("change", ["no_sinks", "no_window", "truncate", "plain_swiglu"])
def test_each_option_changes_the_logits(change: str) -> None:
    """Each option, turned off, moves the logits away from transformers': none is ignored."""
    hf_config, config = _case()
    hf = _hf_model(hf_config)
    state = from_hf_state_dict(hf.state_dict())
    if change == "no_sinks":
        state = {
            n: t.new_full(t.shape, -1e4) if n.endswith("sinks") else t for n, t in state.items()
        }
    elif change == "no_window":
        config.layer_types, config.sliding_window = None, None
    elif change == "truncate":
        config.rope_scaling.truncate = True
    else:
        config.moe.activation = "swiglu"
    model = build(config)
    model.load_state_dict(state, strict=True)
    tokens = _tokens()
    with torch.no_grad():
        assert (model.logits(tokens) - hf(input_ids=tokens).logits).abs().max() > 1e-3


@pytest.mark.parametrize("backend", ["sdpa", "flex"])
def test_attention_backends_agree_with_sinks_and_windows(backend: str) -> None:
    """Sinks and windows in SDPA and flex attention equal the eager softmax with an extra
    column (transformers' formula), with and without packed documents."""
    from pipeline.core.kernels.attention import attention

    torch.manual_seed(0)
    q, k, v = torch.randn(2, 4, 33, 8), torch.randn(2, 2, 33, 8), torch.randn(2, 2, 33, 8)
    sinks = torch.randn(4)
    documents = torch.tensor([[0] * 20 + [1] * 13, [0] * 33])
    for window in (None, 6):
        for docs in (None, documents):
            out = attention(q, k, v, document_ids=docs, window=window, sinks=sinks, backend=backend)
            kk, vv = k.repeat_interleave(2, 1), v.repeat_interleave(2, 1)
            scores = q @ kk.transpose(-1, -2) / 8**0.5
            i = torch.arange(33)
            mask = i[:, None] >= i[None, :]
            if window is not None:
                mask = mask & (i[:, None] - i[None, :] < window)
            mask = mask[None, None]
            if docs is not None:
                mask = mask & (docs[:, None, :, None] == docs[:, None, None, :])
            scores = scores.masked_fill(~mask, float("-inf"))
            column = sinks.view(1, 4, 1, 1).expand(2, 4, 33, 1)
            probs = torch.cat((scores, column), -1).softmax(-1)[..., :-1]
            assert (out - probs @ vv).abs().max() < 1e-5, (window, docs is None)


# ---------------------------------------------------------------------------------------------
# `pipe convert` to and from Hugging Face
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> tuple[Path, object]:
    """A perturbed tiny gpt-oss saved by transformers in several shards, and the model."""
    hf_config, _ = _case()
    hf = _hf_model(hf_config)
    directory = tmp_path_factory.mktemp("gpt_oss") / "hf"
    hf.save_pretrained(directory, max_shard_size=SHARD_BYTES)
    return directory, hf


def test_hf_round_trip_is_bit_identical_and_loads_in_transformers(hf_dir, tmp_path) -> None:
    """HF -> our source -> HF: the same fused tensor names and bytes, the same config; our
    model from the reader and transformers from the written files give the original logits."""
    path, hf = hf_dir
    source = HFSource(path)
    names = source.tensors()
    for name in ("layers.1.moe.experts.w1", "layers.1.moe.experts.b3", "layers.0.attention.sinks"):
        assert name in names, name
    assert names["layers.0.moe.experts.w1"].shape == (EXPERTS, FFN, HIDDEN)
    memory = InMemorySource(
        source.model_config, {n: source.read(n) for n in names}, source.metadata
    )
    out = write_hf(memory, tmp_path / "out", max_shard_bytes=SHARD_BYTES)
    original, written = disk_tensors(path), disk_tensors(out)
    assert sorted(original) == sorted(written)
    assert "model.layers.3.mlp.experts.gate_up_proj_bias" in written
    for tensor_name, tensor in original.items():
        assert torch.equal(written[tensor_name], tensor), tensor_name
    assert hf_config_dict(out) == hf_config_dict(path)

    tokens = _tokens()
    with torch.no_grad():
        expected = hf(input_ids=tokens).logits
        assert (load_from_source(source).logits(tokens) - expected).abs().max() < 1e-4
        reloaded = transformers.AutoModelForCausalLM.from_pretrained(
            out, attn_implementation="eager"
        ).eval()
        assert (reloaded(input_ids=tokens).logits - expected).abs().max() < 1e-4


def test_cli_round_trip_through_a_pipe_checkpoint(hf_dir, tmp_path) -> None:
    """`pipe convert --from hf` then `--to hf` with default flags: bit-identical files, and
    each step verifies its logits against transformers."""
    directory, _ = hf_dir
    back, _ = cli_hf_round_trip(directory, tmp_path)
    assert hf_config_dict(back) == hf_config_dict(directory)


def test_verifying_the_first_layers_cuts_the_per_layer_lists(hf_dir, tmp_path) -> None:
    """`--verify layers=2` (a model too large to check whole) keeps the first two entries of
    `layer_types` on both sides, and the logits of those layers match."""
    from tests.builders import run_pipe

    path, _ = hf_dir
    args = ["--from", "hf", "-o", tmp_path / "ckpt", "--verify", "layers=2"]
    out = run_pipe("convert", path, *args).output
    assert "logits match transformers (first 2 layers)" in out


def test_bf16_export_loads_in_transformers(hf_dir, tmp_path) -> None:
    """`--to hf` in bfloat16 (what a converted MXFP4 checkpoint is written as) loads in
    transformers as gpt-oss with our bf16 logits."""
    path, _ = hf_dir
    source = HFSource(path)
    out = write_hf(source, tmp_path / "bf16", dtype=torch.bfloat16)
    written = disk_tensors(out)
    assert written["model.layers.0.mlp.experts.gate_up_proj"].dtype == torch.bfloat16
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(
        out, attn_implementation="eager", dtype=torch.float32
    ).eval()
    ours = load_from_source(HFSource(out))
    tokens = _tokens()
    with torch.no_grad():
        assert (reloaded(input_ids=tokens).logits - ours.logits(tokens)).abs().max() < 1e-4


# ---------------------------------------------------------------------------------------------
# MXFP4 experts
# ---------------------------------------------------------------------------------------------


def _packed(shape: tuple[int, ...], generator: torch.Generator):
    """Random MXFP4 blocks `[..., groups, 16]` and scales `[..., groups]` (exponents within
    2^-8 .. 2^3, as trained weights are)."""
    blocks = torch.randint(0, 256, (*shape, 16), dtype=torch.uint8, generator=generator)
    scales = torch.randint(119, 130, shape, dtype=torch.uint8, generator=generator)
    return blocks, scales


def test_mxfp4_dequantization_equals_transformers() -> None:
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    from pipeline.weights.hf_quantized import dequantize_mxfp4

    generator = torch.Generator().manual_seed(0)
    blocks, scales = _packed((3, 24, 4), generator)
    theirs = convert_moe_packed_tensors(blocks, scales, dtype=torch.bfloat16)
    ours = dequantize_mxfp4(blocks, scales).transpose(1, 2)
    assert ours.dtype == torch.bfloat16 and torch.equal(ours, theirs)
    # Exact in bf16: transformers' fp32 dequantization gives the same values.
    assert torch.equal(
        ours.float(), convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
    )


def test_mxfp4_checkpoint_reads_dequantized(hf_dir, tmp_path) -> None:
    """A tiny packed checkpoint as gpt-oss publishes it (experts as `_blocks` / `_scales`,
    `quant_method: mxfp4`): our source lists plain expert stacks, each equal to transformers'
    dequantization of the packed tensors, and our model from it equals transformers' model
    holding those dequantized experts."""
    from safetensors.torch import save_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    path, hf = hf_dir
    tensors = disk_tensors(path)
    generator = torch.Generator().manual_seed(3)
    packed, dequantized = {}, {}
    for layer in range(LAYERS):
        for proj, (rows, cols) in {
            "gate_up_proj": (2 * FFN, HIDDEN),
            "down_proj": (HIDDEN, FFN),
        }.items():
            name = f"model.layers.{layer}.mlp.experts.{proj}"
            blocks, scales = _packed((EXPERTS, rows, cols // 32), generator)
            del tensors[name]
            packed[name + "_blocks"], packed[name + "_scales"] = blocks, scales
            dequantized[name] = convert_moe_packed_tensors(blocks, scales, dtype=torch.bfloat16)
    directory = tmp_path / "mxfp4"
    directory.mkdir()
    save_file({**tensors, **packed}, str(directory / "model.safetensors"))
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "mxfp4",
        "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router"],
    }
    (directory / "config.json").write_text(json.dumps(config))

    source = HFSource(directory)
    assert source.metadata["quantization"] == "MXFP4"
    assert not any("blocks" in n or "scales" in n for n in source.tensors())
    gate_up = dequantized["model.layers.2.mlp.experts.gate_up_proj"]
    assert torch.equal(source.read("layers.2.moe.experts.w1"), gate_up[..., 0::2].transpose(1, 2))
    assert torch.equal(source.read("layers.2.moe.experts.w3"), gate_up[..., 1::2].transpose(1, 2))
    down = dequantized["model.layers.2.mlp.experts.down_proj"]
    assert torch.equal(source.read("layers.2.moe.experts.w2"), down.transpose(1, 2))

    with torch.no_grad():
        for name, tensor in dequantized.items():
            hf.get_parameter(name).copy_(tensor.float())
        tokens = _tokens()
        expected = hf(input_ids=tokens).logits
        assert (load_from_source(source).logits(tokens) - expected).abs().max() < 1e-4

    # `--to hf` writes the dequantized experts unquantized (here bf16: exact), which
    # transformers loads as plain gpt-oss to the same logits.
    out = write_hf(source, tmp_path / "bf16", dtype=torch.bfloat16)
    written = disk_tensors(out)
    for name, tensor in dequantized.items():
        assert torch.equal(written[name], tensor), name
    assert "quantization_config" not in json.loads((out / "config.json").read_text())
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(
        out, attn_implementation="eager", dtype=torch.float32
    ).eval()
    with torch.no_grad():
        theirs = reloaded(input_ids=tokens).logits
        assert (load_from_source(HFSource(out)).logits(tokens) - theirs).abs().max() < 1e-4


# ---------------------------------------------------------------------------------------------
# Published configs
# ---------------------------------------------------------------------------------------------


def gpt_oss_json(layers: int, experts: int) -> dict:
    """openai/gpt-oss-20b's (24 layers, 32 experts) or -120b's (36, 128) config.json."""
    return dict(
        architectures=["GptOssForCausalLM"],
        attention_bias=True,
        attention_dropout=0.0,
        eos_token_id=200002,
        experts_per_token=4,
        head_dim=64,
        hidden_act="silu",
        hidden_size=2880,
        initial_context_length=4096,
        initializer_range=0.02,
        intermediate_size=2880,
        layer_types=["sliding_attention", "full_attention"] * (layers // 2),
        max_position_embeddings=131072,
        model_type="gpt_oss",
        num_attention_heads=64,
        num_experts_per_tok=4,
        num_hidden_layers=layers,
        num_key_value_heads=8,
        num_local_experts=experts,
        output_router_logits=False,
        pad_token_id=199999,
        quantization_config={
            "modules_to_not_convert": [
                "model.layers.*.self_attn",
                "model.layers.*.mlp.router",
                "model.embed_tokens",
                "lm_head",
            ],
            "quant_method": "mxfp4",
        },
        rms_norm_eps=1e-05,
        rope_scaling={
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "factor": 32.0,
            "original_max_position_embeddings": 4096,
            "rope_type": "yarn",
            "truncate": False,
        },
        rope_theta=150000,
        router_aux_loss_coef=0.9,
        sliding_window=128,
        swiglu_limit=7.0,
        tie_word_embeddings=False,
        use_cache=True,
        vocab_size=201088,
    )


def _hf_parameters(hf: dict) -> int:
    """Parameters of transformers' GptOssForCausalLM for a config.json dict, on meta (the
    unquantized model: MXFP4 is how the weights are stored, not what they are)."""
    skip = ("architectures", "model_type", "quantization_config")
    kwargs = {k: v for k, v in hf.items() if k not in skip}
    with torch.device("meta"):
        model = transformers.GptOssForCausalLM(transformers.GptOssConfig(**kwargs))
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize(
    ("flavor", "layers", "experts", "published"),
    [("gpt_oss_20b", 24, 32, 20.91e9), ("gpt_oss_120b", 36, 128, 116.83e9)],
)
def test_published_config_gives_the_flavor_and_its_size(flavor, layers, experts, published):
    """The published config.json reads as our flavor, whose parameter count is transformers'
    and OpenAI's (20.91B, 116.83B); the dry run reports that count."""
    from pipeline.weights.hf_config import config_from_hf

    hf = gpt_oss_json(layers, experts)
    ours = get_flavor(flavor)
    assert config_from_hf(hf) == ours
    assert num_parameters(ours) == _hf_parameters(hf)
    assert abs(num_parameters(ours) - published) < 0.005e9


@pytest.mark.parametrize("recipe", ["gpt_oss_20b", "gpt_oss_120b"])
def test_dry_run_reports_the_published_size(recipe: str) -> None:
    from tests.builders import run_pipe

    out = run_pipe("train", "--recipe", recipe, "--dry-run", "--nproc-per-node", "64").output
    count = num_parameters(get_flavor(recipe))
    assert f"parameters   {count:,} total" in out
    assert "window 128 in" in out and "sinks" in out


def test_biases_and_sinks_are_neither_decayed_nor_muon_matrices() -> None:
    """The expert biases are 2-D stacks `[E, ffn]`, yet biases: AdamW does not decay them and
    Muon does not orthogonalise them; the expert weights stay Muon's."""
    from pipeline.core.model.transformer import Transformer
    from pipeline.train.optimizers.adamw import param_groups
    from pipeline.train.optimizers.muon import is_hidden_matrix

    with torch.device("meta"):
        model = Transformer(get_flavor("tiny_gpt_oss"))
    names = {id(p): n for n, p in model.named_parameters()}
    groups = {g["name"]: {names[id(p)] for p in g["params"]} for g in param_groups(model, 0.1)}
    for name in ("experts.b1", "experts.b2", "router.bias", "attention.sinks", "wo.bias"):
        assert any(n.endswith(name) for n in groups["no_decay"]), name
        assert not any(n.endswith(name) for n in groups["decay"]), name
    hidden = {n for n, p in model.named_parameters() if is_hidden_matrix(n, p)}
    assert "layers.0.moe.experts.w1" in hidden and "layers.0.moe.experts.b1" not in hidden


@pytest.mark.parametrize(
    "flavor", ["tiny_gpt_oss", "tiny_smollm3", "gpt_oss_20b", "smollm3_3b", "seed_oss_36b"]
)
def test_parameter_count_is_the_modules(flavor: str) -> None:
    """`num_parameters` (what the dry run reports) counts what the model holds: sinks, o_proj
    and expert biases, the router bias."""
    from pipeline.core.model.transformer import Transformer

    config = get_flavor(flavor)
    with torch.device("meta"):
        model = Transformer(config)
    assert sum(p.numel() for p in model.parameters()) == num_parameters(config)


def test_export_for_vllm_and_the_formats_it_refuses(hf_dir, tmp_path) -> None:
    """`pipe export --vllm` writes gpt-oss as transformers loads it; FP8 and the legacy
    TensorRT-LLM format, which cannot hold it yet, are refused in one line."""
    from tests.builders import run_pipe

    path, _ = hf_dir
    out = run_pipe("export", path, "--vllm", "--output", tmp_path / "vllm", "--dtype", "float32")
    assert "transformers loads it" in out.output
    for args, message in (
        (["--vllm", "--fp8", "--calib-data", tmp_path / "none"], "FP8 export of gpt-oss"),
        (["--trtllm", "--trtllm-format", "legacy"], "legacy TensorRT-LLM format has no"),
    ):
        result = run_pipe("export", path, *args, "--output", tmp_path / "x", expect_ok=False)
        assert result.exit_code != 0 and message in result.output, result.output
        assert "Traceback" not in result.output


def test_a_layer_count_override_keeps_the_per_layer_pattern() -> None:
    """`--set model.num_layers=N` on a flavor with per-layer lists repeats its attention kinds
    and keeps the layers without RoPE that still exist."""
    from pipeline.train.assembly.run_config import resolve_config

    config = resolve_config("tiny_gpt_oss", ["model.num_layers=3"]).model_config()
    assert config.layer_types == ["sliding_attention", "full_attention", "sliding_attention"]
    config = resolve_config("tiny_smollm3", ["model.num_layers=2"]).model_config()
    assert (config.layer_types, config.no_rope_layers) == (
        ["full_attention", "sliding_attention"],
        [1],
    )
    assert resolve_config("tiny", ["model.num_layers=3"]).model_config().layer_types is None
