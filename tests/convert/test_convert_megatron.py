"""`MegatronSource` against megatron-core 0.16.1 as the format oracle.

A tiny GQA Llama (4 heads / 2 kv heads, vocab 200 padded to 256) is built in transformers,
rewritten into Megatron's runtime layout here (grouped-interleave QKV, `[gate; up]` fc1, padded
vocab), and saved by megatron-core's `dist_checkpointing.save` twice, from one pair of gloo
processes: at TP1 by a real `GPTModel` (local spec; its own sharded state dict, DP replicas, TE
`_extra_state` items, no args stored, so the caller gives the config), and at TP2 from hand-made
ShardedTensors with the layer axis prepended, as the GPT model describes them (each rank its TP
shard; megatron's SwiGLU factory splits fc1; Megatron args in common.pt). The source's tensors,
loaded into our Transformer, must give the transformers logits (fp32, 1e-4). Plus exact
fuse/split round trips, other layouts written with plain DCP, and the refusals. Qwen3's
`qk_layernorm` weights get the same treatment at the end (a GPTModel with qk_layernorm=True).
"""

from __future__ import annotations

import argparse
import dataclasses
import warnings

import pytest
import torch

from pipeline.core.model.config import ModelConfig
from pipeline.core.model.hf_names import from_hf_state_dict
from pipeline.core.model.transformer import Transformer
from pipeline.weights.megatron import (
    MegatronCheckpointError,
    MegatronSource,
    fuse_fc1,
    fuse_qkv,
    split_fc1,
    split_qkv,
)
from tests.distributed import run_distributed

VOCAB, PADDED, HIDDEN, LAYERS, HEADS, KV_HEADS, FFN = 200, 256, 64, 2, 4, 2, 96
ITERATION = 7


# ---------------------------------------------------------------------------------------------
# Pure layout functions
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("heads", "kv_heads"), [(4, 2), (4, 4), (8, 1)])
def test_qkv_fuse_split_are_inverses(heads: int, kv_heads: int) -> None:
    """Weights and biases survive fuse -> split and split -> fuse bit for bit, and the fused
    rows follow the grouped interleave (group g: its q heads, then k head g, then v head g)."""
    d, hidden = 8, 16
    q = torch.randn(heads * d, hidden)
    k, v = torch.randn(kv_heads * d, hidden), torch.randn(kv_heads * d, hidden)
    fused = fuse_qkv(q, k, v, kv_heads)
    assert fused.shape == ((heads + 2 * kv_heads) * d, hidden)
    for got, want in zip(split_qkv(fused, heads, kv_heads), (q, k, v)):
        assert torch.equal(got, want)
    assert torch.equal(fuse_qkv(*split_qkv(fused, heads, kv_heads), kv_heads), fused)
    block = (heads // kv_heads + 2) * d
    last = fused[(kv_heads - 1) * block : kv_heads * block]
    assert torch.equal(last[-d:], v[-d:]) and torch.equal(last[-2 * d : -d], k[-d:])
    bias = [torch.randn(t.shape[0]) for t in (q, k, v)]
    fused_bias = fuse_qkv(*bias, kv_heads)
    for got, want in zip(split_qkv(fused_bias, heads, kv_heads), bias):
        assert torch.equal(got, want)


def test_fc1_fuse_split_are_inverses() -> None:
    gate, up = torch.randn(12, 5), torch.randn(12, 5)
    fused = fuse_fc1(gate, up)
    assert torch.equal(fused[:12], gate) and torch.equal(fused[12:], up)
    assert all(torch.equal(a, b) for a, b in zip(split_fc1(fused), (gate, up)))
    assert torch.equal(fuse_fc1(*split_fc1(fused)), fused)


# ---------------------------------------------------------------------------------------------
# The oracle: megatron-core writes the checkpoint
# ---------------------------------------------------------------------------------------------


def _hf_model():
    transformers = pytest.importorskip("transformers")
    hf_config = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=FFN,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        max_position_embeddings=128,
        rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        tie_word_embeddings=False,
    )
    hf_config._attn_implementation = "eager"
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(hf_config).eval()
    with torch.no_grad():  # move norms off ones so a swapped norm would show
        for p in hf.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return hf


def _our_config() -> ModelConfig:
    return ModelConfig(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        num_layers=LAYERS,
        num_attention_heads=HEADS,
        num_kv_heads=KV_HEADS,
        ffn_hidden_size=FFN,
        norm_eps=1e-5,
        rope_theta=10000.0,
        max_position_embeddings=128,
    )


def _megatron_layout(ours: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Our state dict -> Megatron's TP1 runtime tensors, layers stacked on a leading axis."""

    def pad(t: torch.Tensor) -> torch.Tensor:
        return torch.cat([t, t[-1:].expand(PADDED - VOCAB, -1)])  # Megatron repeats the last row

    def stack(fn) -> torch.Tensor:
        return torch.stack([fn(f"layers.{i}.") for i in range(LAYERS)])

    return {
        "embedding.word_embeddings.weight": pad(ours["tok_embeddings.weight"]),
        "qkv_norm": stack(lambda p: ours[p + "attention_norm.weight"]),
        "qkv": stack(
            lambda p: fuse_qkv(*(ours[f"{p}attention.w{x}.weight"] for x in "qkv"), KV_HEADS)
        ),
        "proj": stack(lambda p: ours[p + "attention.wo.weight"]),
        "fc1_norm": stack(lambda p: ours[p + "ffn_norm.weight"]),
        "fc1": [  # (gate, up) per layer, so each TP rank can take its own slices
            (ours[f"layers.{i}.feed_forward.w1.weight"], ours[f"layers.{i}.feed_forward.w3.weight"])
            for i in range(LAYERS)
        ],
        "fc2": stack(lambda p: ours[p + "feed_forward.w2.weight"]),
        "decoder.final_layernorm.weight": ours["norm.weight"],
        "output_layer.weight": pad(ours["output.weight"]),
    }


def _stub_cuda() -> None:
    """megatron-core 0.16.1 saves on CPU once these two CUDA calls are harmless."""
    torch.cuda.synchronize = lambda *args, **kwargs: None
    torch.cuda.current_device = lambda: "cpu"


def _save_tp_shards(rank: int, tp: int, tensors: dict, args: dict, save_dir) -> None:
    """One rank's part of a TP save: its TP shard of every tensor, as Megatron's GPT model
    describes it (layer axis prepended; replicated norms carry replica_id = tp rank)."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.mapping import ShardedTensor
    from megatron.core.transformer.mlp import apply_swiglu_sharded_factory

    def shard(t: torch.Tensor, axis: int) -> torch.Tensor:
        return t.chunk(tp, dim=axis)[rank].clone()

    def vocab(key: str) -> ShardedTensor:
        return ShardedTensor.from_rank_offsets(key, shard(tensors[key], 0), (0, rank, tp))

    state: dict = {
        "embedding": vocab("embedding.word_embeddings.weight"),
        "output": vocab("output_layer.weight"),
        "final_norm": ShardedTensor.from_rank_offsets(
            "decoder.final_layernorm.weight",
            tensors["decoder.final_layernorm.weight"].clone(),
            replica_id=rank,
        ),
    }
    prefix = "decoder.layers."
    for i in range(LAYERS):
        layer = (0, i, LAYERS)

        def sharded(
            key: str, local: torch.Tensor, *axes, replica: int = 0, layer=layer
        ) -> ShardedTensor:
            return ShardedTensor.from_rank_offsets(
                prefix + key, local, layer, *axes, replica_id=replica, prepend_axis_num=1
            )

        gate, up = tensors["fc1"][i]
        fc1_local = torch.cat([shard(gate, 0), shard(up, 0)])  # each rank: [gate_r; up_r]
        fc1 = sharded("mlp.linear_fc1.weight", fc1_local, (1, rank, tp))
        state[f"{i}"] = {
            "qkv_norm": sharded(
                "self_attention.linear_qkv.layer_norm_weight",
                tensors["qkv_norm"][i].clone(),
                replica=rank,
            ),
            "qkv": sharded(
                "self_attention.linear_qkv.weight", shard(tensors["qkv"][i], 0), (1, rank, tp)
            ),
            "proj": sharded(
                "self_attention.linear_proj.weight", shard(tensors["proj"][i], 1), (2, rank, tp)
            ),
            "fc1_norm": sharded(
                "mlp.linear_fc1.layer_norm_weight", tensors["fc1_norm"][i].clone(), replica=rank
            ),
            "fc1": apply_swiglu_sharded_factory(fc1, (layer,)),
            "fc2": sharded("mlp.linear_fc2.weight", shard(tensors["fc2"][i], 1), (2, rank, tp)),
        }
    from megatron.core.transformer.enums import AttnBackend

    # What real args hold besides plain values: enums, dtypes.
    extra = {"attention_backend": AttnBackend.auto, "params_dtype": torch.float32}
    state["args"] = argparse.Namespace(**args, **extra)
    state["iteration"] = ITERATION
    out = save_dir / f"iter_{ITERATION:07d}"
    out.mkdir(parents=True, exist_ok=True)
    dist_checkpointing.save(state, str(out))
    if rank == 0:
        (save_dir / "latest_checkpointed_iteration.txt").write_text(str(ITERATION))


def _save_gpt_model(tensors: dict, out) -> None:
    """TP1 (DP = world size) save through a real megatron-core `GPTModel` (local spec, CPU): its
    own sharded state dict decides keys, replica ids, the fc1 factory, `_extra_state` items."""
    from megatron.core import dist_checkpointing, parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    parallel_state.initialize_model_parallel(1, 1)
    config = TransformerConfig(
        num_layers=LAYERS,
        hidden_size=HIDDEN,
        num_attention_heads=HEADS,
        num_query_groups=KV_HEADS,
        ffn_hidden_size=FFN,
        gated_linear_unit=True,
        activation_func=torch.nn.functional.silu,
        normalization="RMSNorm",
        add_bias_linear=False,
        use_cpu_initialization=True,
    )
    model = GPTModel(
        config,
        get_gpt_layer_local_spec(normalization="RMSNorm"),
        vocab_size=PADDED,
        max_sequence_length=128,
        share_embeddings_and_output_weights=False,
        position_embedding_type="rope",
    )
    runtime = {k: tensors[k] for k in ("embedding.word_embeddings.weight", "output_layer.weight")}
    runtime["decoder.final_layernorm.weight"] = tensors["decoder.final_layernorm.weight"]
    for i in range(LAYERS):
        p = f"decoder.layers.{i}."
        runtime[p + "input_layernorm.weight"] = tensors["qkv_norm"][i]
        runtime[p + "self_attention.linear_qkv.weight"] = tensors["qkv"][i]
        runtime[p + "self_attention.linear_proj.weight"] = tensors["proj"][i]
        runtime[p + "pre_mlp_layernorm.weight"] = tensors["fc1_norm"][i]
        runtime[p + "mlp.linear_fc1.weight"] = fuse_fc1(*tensors["fc1"][i])
        runtime[p + "mlp.linear_fc2.weight"] = tensors["fc2"][i]
    missing, unexpected = model.load_state_dict(runtime, strict=False)
    assert not unexpected and all(k.endswith("_extra_state") for k in missing), missing
    out.mkdir(parents=True, exist_ok=True)
    dist_checkpointing.save(model.sharded_state_dict(), str(out))
    parallel_state.destroy_model_parallel()


def _save_both(rank: int, world_size: int, tmp, tensors: dict, args: dict) -> None:
    """Both oracle checkpoints from one pair of processes (megatron's import dominates)."""
    import warnings

    warnings.simplefilter("ignore")
    _stub_cuda()
    _save_gpt_model(tensors, tmp / "tp1" / f"iter_{ITERATION:07d}")
    _save_tp_shards(rank, world_size, tensors, args, tmp / "tp2")


@pytest.fixture(scope="module")
def megatron_saves(tmp_path_factory):
    """(HF model, TP1 iteration dir, TP2 save dir), written once by megatron-core."""
    pytest.importorskip("megatron.core", reason="megatron-core is the format oracle")
    pytest.importorskip("psutil", reason="megatron-core's checkpoint writer needs psutil")
    hf = _hf_model()
    with torch.no_grad():
        fused = _megatron_layout(from_hf_state_dict(hf.state_dict()))
    tmp = tmp_path_factory.mktemp("megatron")
    run_distributed(_save_both, 2, tmp, fused, _fake_megatron_args())
    return hf, tmp / "tp1" / f"iter_{ITERATION:07d}", tmp / "tp2"


def _assert_logits_match(source: MegatronSource, hf) -> None:
    with torch.device("meta"):
        model = Transformer(source.model_config)
    model.to_empty(device="cpu")
    model.init_weights()  # buffers (RoPE); every parameter is overwritten below
    infos = source.tensors()
    state = {}
    for name, info in infos.items():
        state[name] = source.read(name)
        assert tuple(state[name].shape) == info.shape and state[name].dtype == info.dtype, name
    model.load_state_dict(state, strict=True)
    tokens = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        diff = (model.logits(tokens) - hf(input_ids=tokens).logits).abs().max()
    assert diff < 1e-4, diff


def _fake_megatron_args() -> dict:
    """The subset of Megatron's training args the reader uses (`megatron/training` names)."""
    return dict(
        num_layers=LAYERS,
        hidden_size=HIDDEN,
        ffn_hidden_size=FFN,
        num_attention_heads=HEADS,
        group_query_attention=True,
        num_query_groups=KV_HEADS,
        norm_epsilon=1e-5,
        rotary_base=10000,
        max_position_embeddings=128,
        position_embedding_type="rope",
        normalization="RMSNorm",
        swiglu=True,
        vocab_size=VOCAB,
        padded_vocab_size=PADDED,
        tokenizer_type="HuggingFaceTokenizer",
        tokenizer_model="/tokenizers/tiny",
        tensor_model_parallel_size=2,
    )


@pytest.mark.dist
def test_tp2_checkpoint_with_args_matches_transformers(megatron_saves) -> None:
    """TP2 save with args in common.pt: the config comes from shapes + args alone."""
    hf, _, save_dir = megatron_saves
    source = MegatronSource(save_dir)
    assert source.model_config == _our_config()
    assert source.metadata["iteration"] == ITERATION
    assert source.metadata["tokenizer"]["tokenizer_model"] == "/tokenizers/tiny"
    assert source.tensors()["tok_embeddings.weight"].shape == (VOCAB, HIDDEN)
    stored = source._stored["decoder.layers.self_attention.linear_qkv.weight"]
    assert len(stored.chunks) == LAYERS * 2  # really written as TP2 shards, one per layer

    read_offsets = []
    read_data = source._storage.read_data

    def spy(plan, planner):
        read_offsets.extend(tuple(item.storage_index.offset) for item in plan.items)
        return read_data(plan, planner)

    source._storage.read_data = spy
    source.read("layers.1.attention.wk.weight")
    assert sorted(read_offsets) == [(1, 0, 0), (1, 64, 0)]  # layer 1's two TP chunks only
    _assert_logits_match(source, hf)


@pytest.mark.dist
def test_tp1_checkpoint_without_args_needs_and_checks_config(megatron_saves) -> None:
    """TP1 save by a real GPTModel, no args stored: heads come from the caller, and a config that
    does not fit the shapes (GQA mistaken for MHA) is refused by name."""
    hf, iter_dir, _ = megatron_saves
    with pytest.raises(MegatronCheckpointError, match="pass a model_config"):
        MegatronSource(iter_dir)
    with pytest.raises(MegatronCheckpointError, match="query groups do not fit"):
        wrong = ModelConfig(**{**vars(_our_config()), "num_kv_heads": HEADS})
        MegatronSource(iter_dir, model_config=wrong)
    source = MegatronSource(iter_dir, model_config=_our_config())
    assert source.metadata["iteration"] == ITERATION
    assert list(source.tensors())[:2] == ["tok_embeddings.weight", "layers.0.attention_norm.weight"]
    _assert_logits_match(source, hf)


def test_not_a_checkpoint(tmp_path) -> None:
    with pytest.raises(MegatronCheckpointError, match="neither a torch_dist"):
        MegatronSource(tmp_path)
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("12")
    with pytest.raises(MegatronCheckpointError, match="no .metadata"):
        MegatronSource(tmp_path)


# ---------------------------------------------------------------------------------------------
# Layout variants and refusals, on checkpoints written with plain DCP (no megatron-core needed)
# ---------------------------------------------------------------------------------------------


def _random_ours(config: ModelConfig) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    with torch.device("meta"):
        model = Transformer(config)
    return {n: torch.randn(p.shape) for n, p in model.named_parameters()}


def _write_dcp(directory, state: dict[str, torch.Tensor]):
    """A torch_dist-looking directory: DCP items under Megatron keys, plus metadata.json."""
    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(state, checkpoint_id=str(directory), no_dist=True)
    (directory / "metadata.json").write_text('{"sharded_backend": "torch_dist"}')
    return directory


def _megatron_keys(ours: dict, config: ModelConfig, *, indexed: bool) -> dict[str, torch.Tensor]:
    """Our tensors under Megatron keys: layer-stacked, or per global layer index (`indexed`,
    with fc1 saved as singleton `_w`/`_v` halves) as Megatron's non-homogeneous mode does."""
    pad_rows = PADDED - config.vocab_size
    out = {
        "embedding.word_embeddings.weight": torch.cat(
            [ours["tok_embeddings.weight"], torch.zeros(pad_rows, config.hidden_size)]
        ),
        "decoder.final_layernorm.weight": ours["norm.weight"],
    }
    per_layer: dict[str, list[torch.Tensor]] = {}
    for i in range(config.num_layers):
        p = f"layers.{i}."
        parts = {
            "self_attention.linear_qkv.layer_norm_weight": ours[p + "attention_norm.weight"],
            "self_attention.linear_qkv.weight": fuse_qkv(
                *(ours[f"{p}attention.w{x}.weight"] for x in "qkv"), config.num_kv_heads
            ),
            "self_attention.linear_proj.weight": ours[p + "attention.wo.weight"],
            "mlp.linear_fc1.layer_norm_weight": ours[p + "ffn_norm.weight"],
            "mlp.linear_fc2.weight": ours[p + "feed_forward.w2.weight"],
        }
        if config.qkv_bias:
            parts["self_attention.linear_qkv.bias"] = fuse_qkv(
                *(ours[f"{p}attention.w{x}.bias"] for x in "qkv"), config.num_kv_heads
            )
        gate, up = ours[p + "feed_forward.w1.weight"], ours[p + "feed_forward.w3.weight"]
        if indexed:
            parts |= {"mlp.linear_fc1.weight_w": gate, "mlp.linear_fc1.weight_v": up}
            out |= {f"decoder.layers.{i}.{k}": v for k, v in parts.items()}
        else:
            parts["mlp.linear_fc1.weight"] = fuse_fc1(gate, up)
            for k, v in parts.items():
                per_layer.setdefault(f"decoder.layers.{k}", []).append(v)
    out |= {k: torch.stack(v) for k, v in per_layer.items()}
    if not config.tie_word_embeddings:
        out["output_layer.weight"] = torch.cat(
            [ours["output.weight"], torch.zeros(pad_rows, config.hidden_size)]
        )
    return {k: v.contiguous() for k, v in out.items()}


@pytest.mark.parametrize("indexed", [False, True], ids=["stacked", "indexed"])
def test_qkv_bias_tied_and_indexed_layouts_read_exactly(tmp_path, indexed: bool) -> None:
    """Qwen2-style qkv biases and tied embeddings, layer-stacked or per-index keys: every tensor
    read back equals ours bit for bit, with padding stripped and no output weight listed."""
    config = ModelConfig(**{**vars(_our_config()), "qkv_bias": True, "tie_word_embeddings": True})
    ours = _random_ours(config)
    directory = _write_dcp(tmp_path / "iter_0000003", _megatron_keys(ours, config, indexed=indexed))
    source = MegatronSource(directory, model_config=config)
    assert source.metadata["iteration"] == 3
    assert list(source.tensors()) == list(ours)  # same names, same (canonical) order
    for name, tensor in ours.items():
        assert torch.equal(source.read(name), tensor), name


def _refused(tmp_path, match: str, *, extra=None, drop=(), **config_changes) -> None:
    config = _our_config()
    state = _megatron_keys(_random_ours(config), config, indexed=False)
    state = {k: v for k, v in state.items() if k not in drop} | (extra or {})
    directory = _write_dcp(tmp_path / "ckpt", state)
    given = ModelConfig(**{**vars(config), **config_changes})
    with pytest.raises(MegatronCheckpointError, match=match):
        MegatronSource(directory, model_config=given)


def test_refuses_moe_unknown_weights_and_mismatched_config(tmp_path) -> None:
    router = {"decoder.layers.mlp.router.weight": torch.zeros(LAYERS, 4, HIDDEN)}
    _refused(tmp_path / "a", "mixture-of-experts", extra=router)
    # LayerNorm (not RMSNorm) biases: q_layernorm was the example here before Qwen3's q/k norms
    # became supported (the Qwen3 tests at the end of this file).
    norm_bias = {
        "decoder.layers.self_attention.linear_qkv.layer_norm_bias": torch.zeros(LAYERS, HIDDEN)
    }
    _refused(tmp_path / "b", "unsupported Megatron weights", extra=norm_bias)
    _refused(tmp_path / "c", "ffn_hidden_size=128 but the checkpoint has 96", ffn_hidden_size=128)
    _refused(tmp_path / "d", "exceeds the checkpoint's 256", vocab_size=300)
    _refused(
        tmp_path / "e", "missing decoder.final_layernorm", drop={"decoder.final_layernorm.weight"}
    )


def test_refuses_incomplete_saves_and_unsafe_metadata(tmp_path) -> None:
    from pipeline.checkpoint.safe_reader import UnsafeCheckpointError

    config = _our_config()
    directory = _write_dcp(
        tmp_path / "ckpt", _megatron_keys(_random_ours(config), config, indexed=False)
    )
    (directory / "metadata.json").unlink()
    with pytest.raises(MegatronCheckpointError, match="incomplete save"):
        MegatronSource(directory, model_config=config)
    (directory / "metadata.json").write_text('{"sharded_backend": "torch_dist"}')
    (directory / ".metadata").write_bytes(b"cos\nsystem\n(S'echo owned'\ntR.")
    with pytest.raises(UnsafeCheckpointError, match="os.system"):
        MegatronSource(directory, model_config=config)


@pytest.mark.dist
def test_cli_converts_tp2_checkpoint_to_pipe(megatron_saves, tmp_path) -> None:
    """`pipe convert --from megatron` writes a pipe checkpoint that reads back bit-identical
    and still gives transformers' logits."""
    from click.testing import CliRunner

    from pipeline.convert.commands import convert
    from pipeline.weights.pipe_checkpoint import PipeCheckpointSource

    hf, _, save_dir = megatron_saves
    args = [str(save_dir), "--from", "megatron", "-o", str(tmp_path / "ckpt"), "--quiet"]
    result = CliRunner().invoke(convert, args)
    assert result.exit_code == 0, result.output
    assert "bit-identical" in result.output
    _assert_logits_match(PipeCheckpointSource(tmp_path / "ckpt"), hf)


# ---------------------------------------------------------------------------------------------
# Qwen3: Megatron's qk_layernorm. The oracle is a real GPTModel with qk_layernorm=True (local
# spec, one gloo process) holding a perturbed transformers Qwen3's weights; our model built from
# what MegatronSource reads must give transformers' logits.
# ---------------------------------------------------------------------------------------------

QWEN3_HEAD_DIM = 24  # not HIDDEN / HEADS = 16: Megatron's --kv-channels


def _qwen3_config() -> ModelConfig:
    return ModelConfig(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        num_layers=LAYERS,
        num_attention_heads=HEADS,
        num_kv_heads=KV_HEADS,
        head_dim=QWEN3_HEAD_DIM,
        ffn_hidden_size=FFN,
        norm_eps=1e-6,
        rope_theta=1e6,
        max_position_embeddings=128,
        qk_norm=True,
    )


def _hf_qwen3():
    transformers = pytest.importorskip("transformers")
    config = transformers.Qwen3Config(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=FFN,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        head_dim=QWEN3_HEAD_DIM,
        max_position_embeddings=128,
        rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6},
        tie_word_embeddings=False,
    )
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
    from megatron.core import dist_checkpointing, parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    warnings.simplefilter("ignore")
    _stub_cuda()
    parallel_state.initialize_model_parallel(1, 1)
    config = TransformerConfig(
        num_layers=LAYERS,
        hidden_size=HIDDEN,
        num_attention_heads=HEADS,
        num_query_groups=KV_HEADS,
        kv_channels=QWEN3_HEAD_DIM,
        ffn_hidden_size=FFN,
        gated_linear_unit=True,
        activation_func=torch.nn.functional.silu,
        normalization="RMSNorm",
        layernorm_epsilon=1e-6,
        qk_layernorm=True,
        add_bias_linear=False,
        use_cpu_initialization=True,
    )
    model = GPTModel(
        config,
        get_gpt_layer_local_spec(normalization="RMSNorm", qk_layernorm=True),
        vocab_size=PADDED,
        max_sequence_length=128,
        share_embeddings_and_output_weights=False,
        position_embedding_type="rope",
        rotary_base=1000000,
    )
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
    source = MegatronSource(tmp_path / f"iter_{ITERATION:07d}", model_config=_qwen3_config())
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
    config = _qwen3_config()
    ours = _random_ours(config)
    directory = _write_dcp(tmp_path / "iter_0000003", _qwen3_megatron_keys(ours, config))
    source = MegatronSource(directory, model_config=config)
    assert list(source.tensors()) == list(ours)
    for name, tensor in ours.items():
        assert torch.equal(source.read(name), tensor), name
    with pytest.raises(MegatronCheckpointError, match="qk_norm=False but the checkpoint has True"):
        MegatronSource(directory, model_config=dataclasses.replace(config, qk_norm=False))
