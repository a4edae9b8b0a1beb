"""Hugging Face reader and writer of `pipe convert`: exact round trips of sharded safetensors
directories saved by transformers itself, logits parity of our model built from the reader, and
the errors users hit (pickled weights, truncated shards, unsupported models). CPU, fp32."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from pipeline.weights.hf_config import config_from_hf, config_to_hf
from pipeline.weights.hf_reader import HFSource
from pipeline.weights.hf_writer import plan_hf_shards, write_hf
from pipeline.weights.source import InMemorySource, TensorInfo
from tests.builders import (
    SEQ,
    SHARD_BYTES,
    VOCAB,
    cli_hf_round_trip,
    disk_tensors,
    hf_case,
    hf_config_dict,
    load_from_source,
    save_hf,
)

transformers = pytest.importorskip("transformers")

NAMES = ["llama_untied", "llama_tied", "mistral", "qwen2", "mixtral"]


@pytest.fixture(scope="module", params=NAMES)
def hf_dir(request, tmp_path_factory) -> tuple[Path, object, str]:
    """(directory saved by transformers in several shards, the HF model, the case name)."""
    path, hf = save_hf(request.param, tmp_path_factory.mktemp(request.param) / "hf")
    return path, hf, request.param


def test_trained_checkpoint_gives_its_eod_as_eos(tmp_path) -> None:
    """A training run records its tokenizer's end-of-document id as `eod_id`: the HF config and
    generation config name it as EOS, so generation stops there."""
    source = HFSource(save_hf("llama_untied", tmp_path / "hf")[0])
    state = {n: source.read(n) for n in source.tensors()}
    trained = InMemorySource(source.model_config, state, {"tokenizer": {"eod_id": 7}})
    out = write_hf(trained, tmp_path / "out")
    assert hf_config_dict(out)["eos_token_id"] == 7
    assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] == 7


def test_round_trip_is_bit_identical(hf_dir, tmp_path) -> None:
    """HF -> our source (in memory) -> HF: same tensor names, dtypes and bytes; same config."""
    path, _, name = hf_dir
    source = HFSource(path)
    assert len(list(path.glob("*.safetensors"))) > 1
    memory = InMemorySource(
        source.model_config, {n: source.read(n) for n in source.tensors()}, source.metadata
    )
    out = write_hf(memory, tmp_path / "out", max_shard_bytes=SHARD_BYTES)

    original, written = disk_tensors(path), disk_tensors(out)
    assert sorted(original) == sorted(written)
    for tensor_name, tensor in original.items():
        assert written[tensor_name].dtype == tensor.dtype, tensor_name
        assert torch.equal(written[tensor_name], tensor), tensor_name
    assert ("lm_head.weight" in written) == (name != "llama_tied")
    assert hf_config_dict(out) == hf_config_dict(path)

    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(written)
    assert index["metadata"]["total_size"] == sum(t.nbytes for t in written.values())
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temp dir left


def test_logits_match_transformers(hf_dir, tmp_path) -> None:
    """Our model built from the reader, and transformers loading what the writer wrote, both
    give the original HF model's logits (fp32, 1e-4)."""
    path, hf, _ = hf_dir
    source = HFSource(path)
    tokens = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = hf(input_ids=tokens).logits
        assert (load_from_source(source).logits(tokens) - expected).abs().max() < 1e-4

        out = write_hf(source, tmp_path / "out", max_shard_bytes=SHARD_BYTES)
        reloaded = transformers.AutoModelForCausalLM.from_pretrained(
            out, attn_implementation="eager"
        ).eval()
        assert (reloaded(input_ids=tokens).logits - expected).abs().max() < 1e-4


class _CountingSource(InMemorySource):
    """Records reads, to check the writer streams each tensor exactly once."""

    reads: list[str]

    def read(self, name: str) -> torch.Tensor:
        self.reads.append(name)
        return super().read(name)


def test_single_file_dtype_progress_and_tokenizer(tmp_path) -> None:
    """One shard -> model.safetensors with a well-formed header; bf16 cast; each tensor read
    once; cumulative progress ends at the data size; tokenizer files copied."""
    path, _ = save_hf("llama_tied", tmp_path / "hf")
    hf_source = HFSource(path)
    state = {n: hf_source.read(n) for n in hf_source.tensors()}
    state["output.weight"] = state["tok_embeddings.weight"]  # listed anyway: must be skipped
    source = _CountingSource(hf_source.model_config, state, {"bos_token_id": 7})
    source.reads = []
    tok = tmp_path / "tok"
    tok.mkdir()
    (tok / "tokenizer.json").write_text("{}")
    (tok / "tokenizer_config.json").write_text("{}")
    seen: list[int] = []

    out = write_hf(
        source, tmp_path / "out", dtype=torch.bfloat16, tokenizer_dir=tok, progress=seen.append
    )

    assert sorted(source.reads) == sorted(n for n in state if n != "output.weight")
    assert sorted(p.name for p in out.iterdir()) == [
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    raw = (out / "model.safetensors").read_bytes()
    header_len = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8 : 8 + header_len])
    assert header_len % 8 == 0 and header["__metadata__"] == {"format": "pt"}
    assert "lm_head.weight" not in header
    data_size = len(raw) - 8 - header_len
    assert seen == sorted(seen) and seen[-1] == data_size
    total = sum(s.nbytes for s in plan_hf_shards(source, dtype=torch.bfloat16))
    assert total == data_size
    written = disk_tensors(out)
    embed = written["model.embed_tokens.weight"]
    assert embed.dtype == torch.bfloat16
    assert torch.equal(embed, state["tok_embeddings.weight"].to(torch.bfloat16))
    config = json.loads((out / "config.json").read_text())
    assert config["torch_dtype"] == "bfloat16" and config["bos_token_id"] == 7
    assert config["rope_scaling"]["rope_type"] == "llama3" and config["rope_theta"] == 500000.0
    assert "rope_parameters" not in config and "lm_head.weight" not in written
    with pytest.raises(FileExistsError):
        write_hf(source, out)


def test_config_round_trip_both_spellings() -> None:
    """4.x (`rope_theta`/`rope_scaling`/`torch_dtype`) and 5.x (`rope_parameters`/`dtype`)
    spellings read to the same ModelConfig, and writing then reading is the identity."""
    _, hf_config, ours = hf_case("llama_tied")
    v5 = hf_config.to_dict() | {"architectures": ["LlamaForCausalLM"]}
    assert "rope_parameters" in v5
    parsed = config_from_hf(v5)
    assert parsed == ours
    v4 = config_to_hf(ours, dtype=torch.float32)
    assert "rope_parameters" not in v4 and v4["torch_dtype"] == "float32"
    assert config_from_hf(v4) == ours


def test_pickled_weights_refused_unless_allowed(tmp_path) -> None:
    _, hf_config, _ = hf_case("qwen2")
    hf = transformers.Qwen2ForCausalLM(hf_config)
    hf.config.save_pretrained(tmp_path)
    state = {n: t.contiguous() for n, t in hf.state_dict().items()}
    torch.save(state, tmp_path / "pytorch_model.bin")
    with pytest.raises(ValueError, match="pytorch_model.bin.*allow_pickle=True"):
        HFSource(tmp_path)
    source = HFSource(tmp_path, allow_pickle=True)
    assert torch.equal(
        source.read("layers.1.attention.wq.bias"), state["model.layers.1.self_attn.q_proj.bias"]
    )


def test_truncated_shard_names_the_file(tmp_path) -> None:
    broken, _ = save_hf("mixtral", tmp_path / "broken")
    shard = sorted(broken.glob("model-*.safetensors"))[1]
    shard.write_bytes(shard.read_bytes()[:-100])
    with pytest.raises(ValueError, match=shard.name):
        HFSource(broken)


def test_unsupported_architecture_lists_supported(tmp_path) -> None:
    config = {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="GPT2LMHeadModel.*LlamaForCausalLM.*MixtralForCausalLM"):
        HFSource(tmp_path)


def test_sliding_window_refused_clearly() -> None:
    _, hf_config, _ = hf_case("mistral")
    hf = hf_config.to_dict() | {"architectures": ["MistralForCausalLM"], "sliding_window": 32}
    with pytest.raises(ValueError, match="sliding-window"):
        config_from_hf(hf)
    assert config_from_hf(hf, ignore_sliding_window=True).head_dim == 24


def test_shard_plan_keeps_expert_stacks_whole() -> None:
    """An expert stack is read once, so its per-expert pieces share a shard."""
    _, _, config = hf_case("mixtral")
    state = {
        "tok_embeddings.weight": torch.zeros(VOCAB, config.hidden_size),
        "layers.0.moe.experts.w1": torch.zeros(4, config.ffn_hidden_size, config.hidden_size),
        "norm.weight": torch.zeros(config.hidden_size),
        "output.weight": torch.zeros(VOCAB, config.hidden_size),
    }
    source = InMemorySource(config, state)
    shards = plan_hf_shards(source, max_shard_bytes=1)
    assert [len(s.pieces) for s in shards] == [1, 4, 1, 1]
    assert shards[1].pieces[3].hf_name == "model.layers.0.block_sparse_moe.experts.3.w1.weight"
    assert source.tensors()["norm.weight"] == TensorInfo((config.hidden_size,), torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cli_round_trip_through_a_pipe_checkpoint(hf_dir, dtype, tmp_path) -> None:
    """`pipe convert --from hf` then `--to hf` with default flags: the files transformers saved
    (fp32 or bf16) come back bit-identical in their own dtype, config.json says that dtype, and
    each step verifies itself (tensors, and logits against transformers)."""
    directory, hf, _ = hf_dir
    if dtype != torch.float32:
        directory = tmp_path / "hf"
        hf.to(dtype).save_pretrained(directory, max_shard_size=SHARD_BYTES)
        hf.float()  # the module-scoped fixture's model stays fp32 for the other tests
    back, output = cli_hf_round_trip(directory, tmp_path)
    assert {t.dtype for t in disk_tensors(back).values()} == {dtype}
    name = str(dtype).removeprefix("torch.")
    assert f"in {name}, as the Hugging Face weights it came from" in output
    assert hf_config_dict(back) == hf_config_dict(directory)
    assert transformers.AutoConfig.from_pretrained(back).dtype == dtype
    assert json.loads((back / "config.json").read_text())["torch_dtype"] == name


def test_fp8_scales_per_tensor_per_channel_and_per_block() -> None:
    """How each FP8 layout scales a float8 weight (`weights/hf_quantized.py`)."""
    from pipeline.weights.hf_quantized import FP8Layout

    weight = (torch.randn(5, 3) * 10).to(torch.float8_e4m3fn)
    modelopt = FP8Layout("ModelOpt FP8", ".weight_scale")
    per_tensor = modelopt.dequantize(weight, torch.tensor(0.5), "w")
    assert torch.equal(per_tensor, weight.float() * 0.5)
    channels = torch.arange(1.0, 6.0)
    per_channel = modelopt.dequantize(weight, channels.reshape(5, 1), "w")
    assert torch.equal(per_channel, weight.float() * channels[:, None])
    with pytest.raises(ValueError, match="w: weight scale of shape \\(3,\\) fits neither"):
        modelopt.dequantize(weight, torch.ones(3), "w")
    blocks = FP8Layout("block FP8", ".weight_scale_inv", block=(2, 2))
    grid = torch.tensor([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]])  # partial last row and column
    expected = weight.float() * grid.repeat_interleave(2, 0)[:5].repeat_interleave(2, 1)[:, :3]
    assert torch.equal(blocks.dequantize(weight, grid, "w"), expected)
    with pytest.raises(ValueError, match="w: block scales \\(2, 2\\), expected \\(3, 2\\)"):
        blocks.dequantize(weight, torch.ones(2, 2), "w")
