"""`pipe export --trtllm` against transformers: tiny Hugging Face models of every supported
architecture are exported at tp1, tp2, tp4 and tp2·pp2 and the reference forward over the rank
files must give transformers' logits. The files themselves are checked against tensors taken
from the HF model by hand (fc = gate_proj, gate = up_proj, q/k/v per rank, zero padding), and a
tampered export must be caught by the reference forward. CPU, fp32 unless stated."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from safetensors import safe_open

from pipeline.cli import cli
from pipeline.export.legacy_trtllm.config import (
    LegacyExportOptions,
    read_trtllm_config,
    trtllm_config,
)
from pipeline.export.legacy_trtllm.layout import TrtllmMapping
from pipeline.export.legacy_trtllm.reference import ReferenceModel, read_rank_files
from pipeline.export.legacy_trtllm.writer import write_trtllm
from pipeline.weights.hf_reader import HFSource
from tests.builders import EXPORT_VOCAB as VOCAB
from tests.builders import export_hf_model as hf_model

transformers = pytest.importorskip("transformers")

ARCHS = ["llama3", "llama32_tied", "mistral", "qwen2", "mixtral"]
LAYOUTS = {"tp1": (1, 1), "tp2": (2, 1), "tp4": (4, 1), "tp2pp2": (2, 2)}
TOLERANCE = 1e-4  # fp32 export, relative to max(1, |logits|)


@pytest.fixture(scope="module", params=ARCHS)
def hf_case(request, tmp_path_factory) -> tuple[str, Path, object]:
    directory = tmp_path_factory.mktemp(request.param) / "hf"
    model = hf_model(request.param)
    model.save_pretrained(directory)
    return request.param, directory, model


TOKENS = torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(1))


def _hf_logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(TOKENS).logits


def _export(hf_dir: Path, out: Path, **options) -> Path:
    return write_trtllm(HFSource(hf_dir), out, LegacyExportOptions(**options))


def _max_rel_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max()) / max(1.0, float(b.abs().max()))


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_fp32_export_gives_transformers_logits(hf_case, layout, tmp_path) -> None:
    arch, hf_dir, model = hf_case
    tp, pp = LAYOUTS[layout]
    out = _export(hf_dir, tmp_path / "trt", dtype="float32", mapping=TrtllmMapping(tp=tp, pp=pp))
    assert sorted(p.name for p in out.iterdir()) == sorted(
        ["config.json"] + [f"rank{r}.safetensors" for r in range(tp * pp)]
    )
    assert _max_rel_diff(ReferenceModel(out).logits(TOKENS), _hf_logits(model)) < TOLERANCE


def test_mixtral_expert_parallel_layouts(tmp_path) -> None:
    """Experts by range (moe_ep 4), by slices (moe_tp 4, the default) and mixed (2 x 2)."""
    model = hf_model("mixtral")
    model.save_pretrained(tmp_path / "hf")
    expected = _hf_logits(model)
    for ep in (1, 2, 4):
        mapping = TrtllmMapping(tp=4, pp=1, moe_ep=ep)
        out = _export(tmp_path / "hf", tmp_path / f"ep{ep}", dtype="float32", mapping=mapping)
        config = json.loads((out / "config.json").read_text())
        assert (
            config["mapping"]["moe_ep_size"] == ep and config["mapping"]["moe_tp_size"] == 4 // ep
        )
        with safe_open(str(out / "rank0.safetensors"), framework="pt") as f:
            assert f.get_slice("transformer.layers.0.mlp.fc.weight").get_shape() == [
                4 // ep,
                2 * 96 // (4 // ep),
                64,
            ]
            assert f.get_slice("transformer.layers.0.mlp.router.weight").get_dtype() == "F32"
        assert _max_rel_diff(ReferenceModel(out).logits(TOKENS), expected) < TOLERANCE


def _rounded_hf_logits(model, dtype: torch.dtype) -> torch.Tensor:
    """transformers in fp32 on weights rounded to `dtype`, the router kept (as exported)."""
    rounded = type(model)(model.config).eval()
    state = {
        name: t if name.endswith("mlp.gate.weight") else t.to(dtype).float()
        for name, t in model.state_dict().items()
    }
    rounded.load_state_dict(state)
    with torch.no_grad():
        return rounded(TOKENS).logits


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_export(hf_case, dtype, tmp_path) -> None:
    """The rank files hold the weights rounded to the export dtype and nothing else changes:
    the reference forward equals transformers on the same rounded weights; against the fp32
    model the difference is bf16/fp16 rounding (dense models; a router can flip a near-tie)."""
    arch, hf_dir, model = hf_case
    name = str(dtype).removeprefix("torch.")
    out = _export(hf_dir, tmp_path / "trt", dtype=name, mapping=TrtllmMapping(tp=2, pp=2))
    files = read_rank_files(out, 4)
    assert files[0]["transformer.layers.0.attention.qkv.weight"].dtype == dtype
    actual = ReferenceModel(out).logits(TOKENS)
    assert _max_rel_diff(actual, _rounded_hf_logits(model, dtype)) < TOLERANCE
    if arch != "mixtral":
        assert _max_rel_diff(actual, _hf_logits(model)) < (
            2e-2 if dtype == torch.bfloat16 else 3e-3
        )


# --- the files, against tensors taken from the HF model by hand -----------------------------


def test_rank_files_hold_the_documented_tensors(tmp_path) -> None:
    """tp4 of Llama 3 with 2 kv heads: per rank q (1 head), then the replicated kv head;
    fc = gate_proj rows, gate = up_proj rows, dense/proj column blocks; lm_head padded with
    zero rows to 252; stage-local names; embedding whole on every rank."""
    model = hf_model("llama3")
    model.save_pretrained(tmp_path / "hf")
    out = _export(tmp_path / "hf", tmp_path / "trt", dtype="float32", mapping=TrtllmMapping(tp=4))
    hf = model.state_dict()
    files = read_rank_files(out, 4)
    d = 16
    for r, f in enumerate(files):
        p = "model.layers.1"
        kv = r * 2 // 4
        qkv = torch.cat(
            [
                hf[f"{p}.self_attn.q_proj.weight"][r * d : (r + 1) * d],
                hf[f"{p}.self_attn.k_proj.weight"][kv * d : (kv + 1) * d],
                hf[f"{p}.self_attn.v_proj.weight"][kv * d : (kv + 1) * d],
            ]
        )
        t = "transformer.layers.1"
        assert torch.equal(f[f"{t}.attention.qkv.weight"], qkv)
        assert torch.equal(
            f[f"{t}.attention.dense.weight"],
            hf[f"{p}.self_attn.o_proj.weight"][:, r * d : (r + 1) * d],
        )
        ffn = slice(r * 24, (r + 1) * 24)
        assert torch.equal(f[f"{t}.mlp.fc.weight"], hf[f"{p}.mlp.gate_proj.weight"][ffn])
        assert torch.equal(f[f"{t}.mlp.gate.weight"], hf[f"{p}.mlp.up_proj.weight"][ffn])
        assert torch.equal(f[f"{t}.mlp.proj.weight"], hf[f"{p}.mlp.down_proj.weight"][:, ffn])
        assert torch.equal(f[f"{t}.input_layernorm.weight"], hf[f"{p}.input_layernorm.weight"])
        assert torch.equal(
            f[f"{t}.post_layernorm.weight"], hf[f"{p}.post_attention_layernorm.weight"]
        )
        assert torch.equal(f["transformer.vocab_embedding.weight"], hf["model.embed_tokens.weight"])
        assert torch.equal(f["transformer.ln_f.weight"], hf["model.norm.weight"])
        head = f["lm_head.weight"]
        assert head.shape == (63, 64)  # ceil(250 / 4)
        rows = torch.cat([hf["lm_head.weight"], torch.zeros(2, 64)])[r * 63 : (r + 1) * 63]
        assert torch.equal(head, rows)
    assert not files[3]["lm_head.weight"][-2:].any()


def test_pipeline_stages_own_their_layers_and_ends(tmp_path) -> None:
    """tp2·pp2, 3 layers: stage 0 has layers 0-1 (+ embedding), stage 1 layer 2 renamed 0
    (+ ln_f, lm_head); tied models still get an lm_head (from the embedding)."""
    model = hf_model("llama32_tied")
    model.save_pretrained(tmp_path / "hf")
    out = _export(
        tmp_path / "hf", tmp_path / "trt", dtype="float32", mapping=TrtllmMapping(tp=2, pp=2)
    )
    files = read_rank_files(out, 4)
    layers = [
        {int(n.split(".")[2]) for n in f if n.startswith("transformer.layers.")} for f in files
    ]
    assert layers == [{0, 1}, {0, 1}, {0}, {0}]
    for r in (0, 1):
        assert "transformer.vocab_embedding.weight" in files[r] and "lm_head.weight" not in files[r]
    for r in (2, 3):
        assert {"transformer.ln_f.weight", "lm_head.weight"} <= files[r].keys()
        assert "transformer.vocab_embedding.weight" not in files[r]
    hf = model.state_dict()
    assert torch.equal(
        files[2]["transformer.layers.0.mlp.fc.weight"],
        hf["model.layers.2.mlp.gate_proj.weight"][:48],
    )
    assert torch.equal(files[3]["lm_head.weight"], hf["model.embed_tokens.weight"][125:])


@pytest.mark.parametrize("dim", [0, 1])
def test_parallel_embedding(dim, tmp_path) -> None:
    model = hf_model("llama3")
    model.save_pretrained(tmp_path / "hf")
    mapping = TrtllmMapping(tp=4)
    out = _export(
        tmp_path / "hf",
        tmp_path / "trt",
        dtype="float32",
        mapping=mapping,
        use_parallel_embedding=True,
        embedding_sharding_dim=dim,
    )
    shape = read_rank_files(out, 4)[0]["transformer.vocab_embedding.weight"].shape
    assert tuple(shape) == ((63, 64) if dim == 0 else (250, 16))
    assert _max_rel_diff(ReferenceModel(out).logits(TOKENS), _hf_logits(model)) < TOLERANCE


def _tamper(directory: Path, edit) -> None:
    """Rewrite every rank file with `edit(rank, tensors)` applied."""
    from safetensors.torch import save_file

    config = json.loads((directory / "config.json").read_text())
    files = read_rank_files(directory, config["mapping"]["world_size"])
    for rank, tensors in enumerate(files):
        edit(rank, tensors)
        save_file(tensors, str(directory / f"rank{rank}.safetensors"))


def _swap_fc_gate(rank: int, tensors: dict) -> None:
    for name in [n for n in tensors if n.endswith("mlp.fc.weight")]:
        gate = name.replace("mlp.fc", "mlp.gate")
        tensors[name], tensors[gate] = tensors[gate], tensors[name]


def _interleave_qkv(rank: int, tensors: dict) -> None:
    """Megatron's order on each rank: [q of group; k; v] per kv group (1 q head per group)."""
    d = 16
    for name in [n for n in tensors if n.endswith("qkv.weight")]:
        q, k, v = tensors[name].split([2 * d, d, d])  # tp2: 2 q heads, 1 kv head per rank
        tensors[name] = torch.cat([q[:d], k, v, q[d:]])


def _unpad(rank: int, tensors: dict) -> None:
    if "lm_head.weight" in tensors and rank == 3:
        tensors["lm_head.weight"][-1] = 1.0  # a non-zero padding row


@pytest.mark.parametrize("edit", [_swap_fc_gate, _interleave_qkv])
def test_reference_forward_catches_layout_mistakes(edit, tmp_path) -> None:
    """gate and up have the same shape, and so do interleaved and per-rank q/k/v: only the
    function tells them apart. The reference forward must see the difference."""
    model = hf_model("llama3")
    model.save_pretrained(tmp_path / "hf")
    out = _export(tmp_path / "hf", tmp_path / "trt", dtype="float32", mapping=TrtllmMapping(tp=2))
    assert _max_rel_diff(ReferenceModel(out).logits(TOKENS), _hf_logits(model)) < TOLERANCE
    _tamper(out, edit)
    assert _max_rel_diff(ReferenceModel(out).logits(TOKENS), _hf_logits(model)) > 100 * TOLERANCE


def test_reference_refuses_non_zero_padding_and_unreplicated_kv(tmp_path) -> None:
    model = hf_model("llama3")
    model.save_pretrained(tmp_path / "hf")
    out = _export(tmp_path / "hf", tmp_path / "trt", dtype="float32", mapping=TrtllmMapping(tp=4))
    _tamper(out, _unpad)
    with pytest.raises(ValueError, match="padding rows past vocab_size are not zero"):
        ReferenceModel(out)
    out = _export(tmp_path / "hf", tmp_path / "trt2", dtype="float32", mapping=TrtllmMapping(tp=4))

    def break_replica(rank: int, tensors: dict) -> None:
        if rank == 1:
            tensors["transformer.layers.0.attention.qkv.weight"][-1] += 1

    _tamper(out, break_replica)
    with pytest.raises(ValueError, match="kv head 0 differs between ranks 0 and 1"):
        ReferenceModel(out)


# --- config.json ---------------------------------------------------------------------------


def test_config_keys_follow_the_spec(tmp_path) -> None:
    """docs/file_layouts.md's config.json keys one by one, for a Llama 3.1-style model, tp2 bf16."""
    model = hf_model("llama3")
    model.save_pretrained(tmp_path / "hf")
    source = HFSource(tmp_path / "hf")
    config = trtllm_config(source.model_config, LegacyExportOptions(mapping=TrtllmMapping(tp=2)))
    assert config == {
        "architecture": "LlamaForCausalLM",
        "dtype": "bfloat16",
        "logits_dtype": "float32",
        "vocab_size": 250,
        "max_position_embeddings": 128,
        "hidden_size": 64,
        "num_hidden_layers": 3,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_size": 16,
        "intermediate_size": 96,
        "hidden_act": "silu",
        "norm_epsilon": 1e-05,
        "position_embedding_type": "rope_gpt_neox",
        "rotary_base": 500000.0,
        "rotary_scaling": {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 16,
        },
        "use_parallel_embedding": False,
        "embedding_sharding_dim": 0,
        "share_embedding_table": False,
        "tie_word_embeddings": False,
        "attn_bias": False,
        "mlp_bias": False,
        "residual_mlp": False,
        "mapping": {"world_size": 2, "tp_size": 2, "pp_size": 1},
        "quantization": {"quant_algo": None, "kv_cache_quant_algo": None},
    }
    back, options = read_trtllm_config(config)
    assert back.rope_scaling == source.model_config.rope_scaling
    assert (back.num_kv_heads, back.head_dim, options.mapping.tp) == (2, 16, 2)


def test_config_of_qwen2_mixtral_and_fp8(tmp_path) -> None:
    qwen = HFSource(_saved("qwen2", tmp_path / "qwen")).model_config
    mixtral = HFSource(_saved("mixtral", tmp_path / "mixtral")).model_config
    q = trtllm_config(qwen, LegacyExportOptions(architecture="Qwen2ForCausalLM"))
    assert (q["architecture"], q["qwen_type"], q["attn_bias"], q["rotary_scaling"]) == (
        "Qwen2ForCausalLM",
        "qwen2",
        True,
        None,
    )
    fp8 = LegacyExportOptions(mapping=TrtllmMapping(tp=2, moe_ep=2), fp8=True, fp8_kv_cache=True)
    m = trtllm_config(mixtral, fp8)
    assert m["architecture"] == "MixtralForCausalLM" and m["hidden_act"] == "swiglu"
    assert m["moe"] == {"num_experts": 4, "top_k": 2, "normalization_mode": 1}
    assert m["mapping"] == {
        "world_size": 2,
        "tp_size": 2,
        "pp_size": 1,
        "moe_tp_size": 1,
        "moe_ep_size": 2,
    }
    assert m["quantization"] == {
        "quant_algo": "FP8",
        "kv_cache_quant_algo": "FP8",
        "exclude_modules": ["lm_head", "*router"],
    }
    assert m["dtype"] == "bfloat16"  # the compute dtype stays; weights are fp8


def _saved(arch: str, directory: Path) -> Path:
    hf_model(arch).save_pretrained(directory)
    return directory


# --- the command ---------------------------------------------------------------------------


def test_cli_exports_verifies_and_refuses_bad_input(tmp_path) -> None:
    hf_dir = _saved("qwen2", tmp_path / "hf")
    runner = CliRunner()
    out = tmp_path / "trt"
    legacy = ["export", str(hf_dir), "--trtllm", "--trtllm-format", "legacy"]
    result = runner.invoke(cli, [*legacy, "-o", str(out), "--tp", "2", "--pp", "2", "-q"])
    assert result.exit_code == 0, result.output
    assert "tp 2 x pp 2 = 4 rank files" in result.output
    assert "reference forward matches the source: max |logit difference|" in result.output
    # An fp32 Hugging Face model exports in fp32 unless --dtype says otherwise.
    assert "float32, as the Hugging Face weights it came from" in result.output
    assert json.loads((out / "config.json").read_text())["dtype"] == "float32"

    again = runner.invoke(cli, [*legacy, "-o", str(out)])
    assert again.exit_code != 0 and "exists and is not empty" in again.output
    no_format = runner.invoke(cli, ["export", str(hf_dir), "-o", str(tmp_path / "x")])
    assert no_format.exit_code != 0 and "--trtllm" in no_format.output
    no_calib = runner.invoke(
        cli, ["export", str(hf_dir), "--trtllm", "--fp8", "-o", str(tmp_path / "y")]
    )
    assert no_calib.exit_code != 0 and "--calib-data" in no_calib.output
    bad_tp = runner.invoke(cli, [*legacy, "--tp", "8", "-o", str(tmp_path / "z")])
    assert (
        bad_tp.exit_code != 0 and "num_attention_heads 4 does not split over tp 8" in bad_tp.output
    )
    assert not (tmp_path / "z").exists() and not list(tmp_path.glob(".z.tmp-*"))


def test_failed_export_leaves_nothing_under_the_final_name(tmp_path) -> None:
    hf_dir = _saved("llama3", tmp_path / "hf")
    source = HFSource(hf_dir)
    real_read = source.read

    def failing_read(name: str) -> torch.Tensor:
        if name.startswith("layers.2."):
            raise OSError("disk went away")
        return real_read(name)

    source.read = failing_read
    with pytest.raises(OSError, match="disk went away"):
        write_trtllm(source, tmp_path / "trt", LegacyExportOptions(mapping=TrtllmMapping(tp=2)))
    assert list(tmp_path.iterdir()) == [hf_dir]


def test_export_from_a_sharded_pipe_checkpoint(tmp_path) -> None:
    """Our training checkpoints export too (format detected): a tp2-cut Mixtral checkpoint
    to a tp2 moe_ep2 export, verified by the reference forward against the source."""
    from pipeline.export.run import run_export
    from pipeline.weights.pipe_checkpoint import TargetLayout, write_pipe_checkpoint

    model = hf_model("mixtral")
    hf_dir = _saved("mixtral", tmp_path / "hf")
    source = HFSource(hf_dir)
    ckpt = tmp_path / "ckpt"
    write_pipe_checkpoint(source, ckpt, layout=TargetLayout(tp=2, ep=2), iteration=7)
    options = LegacyExportOptions(dtype="float32", mapping=TrtllmMapping(tp=2, moe_ep=2))
    summary = run_export(ckpt, tmp_path / "trt", options, verify="on", quiet=True, target="legacy")
    assert "reference forward matches the source" in summary
    assert (
        _max_rel_diff(ReferenceModel(tmp_path / "trt").logits(TOKENS), _hf_logits(model))
        < TOLERANCE
    )
