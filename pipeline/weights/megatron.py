"""Read a megatron-core `torch_dist` checkpoint (GPT/Llama) as a `TensorSource`, without Megatron.

A torch_dist checkpoint (described in this repository's docs/file_layouts.md, section "Megatron
torch_dist checkpoints") is a DCP directory whose keys are TP- and PP-independent global tensors:
per-layer weights are stacked on a leading layer axis
(`decoder.layers.self_attention.linear_qkv.weight` is `[L, rows, hidden]`), attention's q/k/v are
fused group by group, SwiGLU's gate and up are fused as `[gate; up]`, and the embedding and output
rows are padded to a multiple of 128 * TP. `MegatronSource` reads `.metadata` with a restricted
unpickler, derives our `ModelConfig` from the tensor shapes plus Megatron's stored `args`, and
reads one layer's box of one key at a time with DCP (`no_dist=True`), so memory stays near one
layer's tensor rather than the `[L, ...]` stack. DCP reads every saved item overlapping the box
whole (pytorch#76331); Megatron saves one item per layer and TP shard, so that is at most one
layer's tensor, and for the embedding one vocabulary shard per TP rank. Un-fusing q/k/v or gate/up
keeps the last layer's fused parts, so each fused tensor is read once.

Handled keys (TE names; the local spec saves its norms under the same keys):
`embedding.word_embeddings.weight`, `decoder.layers.self_attention.linear_qkv.layer_norm_weight`
(or `decoder.layers.input_layernorm.weight`), `…linear_qkv.weight` and `.bias`,
`…self_attention.linear_proj.weight`, `…self_attention.q_layernorm.weight` and
`…k_layernorm.weight` (Qwen3's per-head norms, `--qk-layernorm`),
`decoder.layers.mlp.linear_fc1.layer_norm_weight`
(or `decoder.layers.pre_mlp_layernorm.weight`), `…mlp.linear_fc1.weight` (or the
`_w`/`_v` pair of singleton-shard checkpoints), `…mlp.linear_fc2.weight`,
`decoder.final_layernorm.weight`, `output_layer.weight`. Layer keys may also carry the global
layer index instead of the layer axis (`decoder.layers.3.…`, Megatron's non-homogeneous mode).
"""

from __future__ import annotations

import os
import re
import warnings
from dataclasses import dataclass
from typing import Any

import torch

from pipeline.checkpoint.safe_reader import safe_file_system_reader
from pipeline.common.quiet import quiet_dcp
from pipeline.core.model.config import ModelConfig, RopeScaling
from pipeline.weights.megatron_files import (
    MegatronCheckpointError,
    check_torch_dist,
    find_iteration_dir,
    load_megatron_metadata,
    read_megatron_args,
)
from pipeline.weights.megatron_layout import fuse_fc1, fuse_qkv, split_fc1, split_qkv
from pipeline.weights.source import TensorInfo

__all__ = [
    "MegatronCheckpointError",
    "MegatronSource",
    "check_torch_dist",
    "find_iteration_dir",
    "fuse_fc1",
    "fuse_qkv",
    "load_megatron_metadata",
    "read_megatron_args",
    "split_fc1",
    "split_qkv",
]

LAYERS = "decoder.layers"
# Our per-layer name -> the Megatron per-layer suffixes that may hold it, in order of preference.
_INPUT_NORM = ("self_attention.linear_qkv.layer_norm_weight", "input_layernorm.weight")
_MLP_NORM = ("mlp.linear_fc1.layer_norm_weight", "pre_mlp_layernorm.weight")
_QKV_W, _QKV_B = "self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias"
_PROJ, _FC1, _FC2 = (
    "self_attention.linear_proj.weight",
    "mlp.linear_fc1.weight",
    "mlp.linear_fc2.weight",
)
_Q_NORM, _K_NORM = "self_attention.q_layernorm.weight", "self_attention.k_layernorm.weight"
_KNOWN_SUFFIXES = {*_INPUT_NORM, *_MLP_NORM, _QKV_W, _QKV_B, _PROJ, _FC1, _FC2, _Q_NORM, _K_NORM}
_KNOWN_SUFFIXES |= {f"{_FC1}_w", f"{_FC1}_v"}
_GLOBAL_KEYS = {
    "embedding.word_embeddings.weight",
    "decoder.final_layernorm.weight",
    "output_layer.weight",
}
# Megatron's own defaults, used when neither its args nor the caller say otherwise.
_MEGATRON_DEFAULTS = {"norm_eps": 1e-5, "rope_theta": 10000.0, "max_position_embeddings": 4096}


# ---------------------------------------------------------------------------------------------
# Reading boxes of a key with DCP
# ---------------------------------------------------------------------------------------------


def _box_planner(boxes: dict[str, Any]) -> Any:
    """A DCP load planner that reads, for each key, only the box `ChunkStorageMetadata` given
    (into a tensor of the box's shape) instead of the whole global tensor."""
    from torch.distributed.checkpoint import DefaultLoadPlanner
    from torch.distributed.checkpoint.planner import LoadPlan
    from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

    class BoxLoadPlanner(DefaultLoadPlanner):
        def create_local_plan(self) -> LoadPlan:
            items = []
            for key, box in boxes.items():
                stored = self.metadata.state_dict_metadata[key]
                items += create_read_items_for_chunk_list(key, stored, [box])
            return LoadPlan(items)

        def lookup_tensor(self, index: Any) -> torch.Tensor:
            return self.state_dict[index.fqn]

    return BoxLoadPlanner()


@dataclass(frozen=True)
class _Slot:
    """Where one of our tensors lives: a DCP key, an optional layer index on its leading axis,
    and a transform of the loaded tensor (`qkv:i`, `fc1:i`, `vocab`, or None)."""

    key: str
    layer: int | None
    part: str | None = None


# ---------------------------------------------------------------------------------------------
# The source
# ---------------------------------------------------------------------------------------------


class MegatronSource:
    """Our-named tensors of a megatron-core torch_dist GPT/Llama checkpoint (see module docstring).

    `directory`: a Megatron save directory (with `latest_checkpointed_iteration.txt`) or an
    `iter_XXXXXXX` directory. `model_config`: needed only when Megatron's args are absent and the
    head counts cannot be inferred; when given it wins over the args and is checked against the
    tensor shapes. Dense RMSNorm + SwiGLU + RoPE models only; MoE checkpoints are refused.
    """

    def __init__(
        self, directory: str | os.PathLike, *, model_config: ModelConfig | None = None
    ) -> None:
        self.iter_dir, iteration = find_iteration_dir(directory)
        check_torch_dist(self.iter_dir)
        self._metadata = load_megatron_metadata(self.iter_dir / ".metadata")
        self._stored = {
            key: item
            for key, item in self._metadata.state_dict_metadata.items()
            if hasattr(item, "size")  # TensorStorageMetadata; bytes items are never read
        }
        self.args = read_megatron_args(self.iter_dir, self._metadata)
        self._refuse_unsupported()
        self.padded_vocab_size = self._shape("embedding.word_embeddings.weight")[0]
        self.model_config = self._build_config(model_config)
        self._slots = self._plan()
        self._storage = safe_file_system_reader(self.iter_dir, self._metadata)
        # The un-fused parts of the last fused tensors read, so wq, wk, wv (and w1, w3) of a
        # layer cost one read of linear_qkv (linear_fc1), not three (two).
        self._cache: dict[_Slot, tuple[torch.Tensor, ...]] = {}
        self.metadata: dict[str, Any] = {
            "source": f"megatron torch_dist {self.iter_dir}",
            "iteration": iteration,
            "padded_vocab_size": self.padded_vocab_size,
        }
        tokenizer = {
            k: self.args[k]
            for k in ("tokenizer_type", "tokenizer_model", "vocab_file", "merge_file")
            if self.args.get(k) is not None
        }
        if tokenizer:
            self.metadata["tokenizer"] = tokenizer

    # -- TensorSource --------------------------------------------------------------------------

    def tensors(self) -> dict[str, TensorInfo]:
        """Our parameter name -> shape and dtype, layers in order (nothing is read)."""
        return {name: self._info(slot) for name, slot in self._slots.items()}

    def read(self, name: str) -> torch.Tensor:
        """The full tensor `name`: one layer's box of its Megatron key, un-fused and un-padded."""
        slot = self._slots[name]
        if slot.part is None or slot.part == "vocab":
            return self._load(slot.key, slot.layer, rows=self._rows(slot))
        kind, index = slot.part.split(":")
        whole = _Slot(slot.key, slot.layer, kind)
        if whole not in self._cache:
            fused = self._load(slot.key, slot.layer)
            if kind == "qkv":
                cfg = self.model_config
                parts = split_qkv(fused, cfg.num_attention_heads, cfg.num_kv_heads)
            else:
                parts = split_fc1(fused)
            while len(self._cache) >= 2:  # a layer's qkv weight and bias; then forget
                self._cache.pop(next(iter(self._cache)))
            self._cache[whole] = parts
        return self._cache[whole][int(index)].clone()

    # -- internals -----------------------------------------------------------------------------

    def _shape(self, key: str) -> tuple[int, ...]:
        return tuple(self._stored[key].size)

    def _rows(self, slot: _Slot) -> int | None:
        return self.model_config.vocab_size if slot.part == "vocab" else None

    def _info(self, slot: _Slot) -> TensorInfo:
        stored = self._stored[slot.key]
        shape = list(stored.size[1:] if slot.layer is not None else stored.size)
        cfg = self.model_config
        if slot.part == "vocab":
            shape[0] = cfg.vocab_size
        elif slot.part is not None:
            kind, index = slot.part.split(":")
            if kind == "fc1":
                shape[0] //= 2
            else:
                shape[0] = cfg.num_attention_heads if index == "0" else cfg.num_kv_heads
                shape[0] *= cfg.head_dim
        return TensorInfo(tuple(shape), stored.properties.dtype)

    def _load(self, key: str, layer: int | None, rows: int | None = None) -> torch.Tensor:
        """Read `key[layer]` (or the whole key), keeping only the first `rows` rows if given."""
        from torch.distributed.checkpoint import load
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

        stored = self._stored[key]
        size = list(stored.size)
        offsets = [0] * len(size)
        if layer is not None:
            offsets[0], size[0] = layer, 1
        if rows is not None:
            size[-2 if layer is not None else 0] = rows
        box = ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(size))
        out = torch.empty(size, dtype=stored.properties.dtype)
        with quiet_dcp():  # "assuming ... a single process": yes, on purpose
            planner = _box_planner({key: box})
            load({key: out}, storage_reader=self._storage, planner=planner, no_dist=True)
        return out[0] if layer is not None else out

    def _layer_key(self, suffixes: tuple[str, ...], layer: int) -> _Slot | None:
        """The slot of layer `layer` under the first suffix present, stacked or indexed."""
        for suffix in suffixes:
            if f"{LAYERS}.{suffix}" in self._stored:
                return _Slot(f"{LAYERS}.{suffix}", layer)
            if f"{LAYERS}.{layer}.{suffix}" in self._stored:
                return _Slot(f"{LAYERS}.{layer}.{suffix}", None)
        return None

    def _refuse_unsupported(self) -> None:
        """Fail loudly on checkpoints whose weights we would otherwise drop or misread."""
        model_keys = [
            k
            for k in self._stored
            if (k.startswith(("decoder.", "embedding.", "output_layer.")))
            and "_extra_state" not in k
        ]
        if "embedding.word_embeddings.weight" not in self._stored:
            raise MegatronCheckpointError(
                f"{self.iter_dir}: no embedding.word_embeddings.weight; not a GPT checkpoint "
                "saved by the first pipeline stage?"
            )
        if any(".experts." in k or ".router." in k for k in model_keys) or self.args.get(
            "num_experts"
        ):
            raise MegatronCheckpointError(
                f"{self.iter_dir}: mixture-of-experts checkpoints are not supported yet"
            )
        unknown = []
        for key in model_keys:
            if key in _GLOBAL_KEYS:
                continue
            suffix = re.sub(rf"^{re.escape(LAYERS)}\.(\d+\.)?", "", key)
            if not key.startswith(f"{LAYERS}.") or suffix not in _KNOWN_SUFFIXES:
                unknown.append(key)
        if unknown:
            raise MegatronCheckpointError(
                f"{self.iter_dir}: unsupported Megatron weights {unknown[:6]} (only RMSNorm, "
                "SwiGLU, RoPE GPT models without linear biases other than qkv are supported)"
            )
        if self.args.get("normalization", "RMSNorm") != "RMSNorm" or not self.args.get(
            "swiglu", True
        ):
            raise MegatronCheckpointError(
                f"{self.iter_dir}: needs normalization RMSNorm and swiglu (args say "
                f"{self.args.get('normalization')!r}, swiglu={self.args.get('swiglu')})"
            )

    def _build_config(self, given: ModelConfig | None) -> ModelConfig:
        """Our config from shapes (layers, hidden, ffn, vocab, bias, tying) plus args/caller."""
        args = self.args
        hidden = self._shape("embedding.word_embeddings.weight")[1]
        num_layers = self._count_layers()
        qkv = self._shape_of(_QKV_W)
        proj_in = self._shape_of(_PROJ)[-1]
        ffn = self._shape_of(_FC2)[-1]
        tied = "output_layer.weight" not in self._stored
        qkv_bias = self._layer_key((_QKV_B,), 0) is not None
        qk_norm = self._layer_key((_Q_NORM,), 0) is not None
        heads = args.get("num_attention_heads")
        kv_heads = args.get("num_query_groups") if args.get("group_query_attention") else heads
        if given is not None:
            heads, kv_heads = given.num_attention_heads, given.num_kv_heads
        if heads is None or kv_heads is None:
            raise MegatronCheckpointError(
                f"{self.iter_dir}: the checkpoint stores no Megatron args, so the attention and "
                "query-group head counts cannot be inferred; pass a model_config"
            )
        head_dim = proj_in // heads
        expected_qkv = (heads + 2 * kv_heads) * head_dim
        if proj_in % heads or qkv[-2] != expected_qkv:
            raise MegatronCheckpointError(
                f"{self.iter_dir}: {heads} heads / {kv_heads} query groups do not fit the shapes "
                f"(linear_proj in-features {proj_in}, linear_qkv rows {qkv[-2]}; expected "
                f"(nq + 2*ng) * head_dim = {expected_qkv})"
            )
        vocab = given.vocab_size if given is not None else args.get("vocab_size")
        if vocab is None:
            vocab = self.padded_vocab_size
            warnings.warn(
                f"{self.iter_dir}: true vocabulary size unknown (no args.vocab_size, no "
                f"model_config); keeping all {vocab} padded rows",
                stacklevel=3,
            )
        shapes = dict(
            vocab_size=vocab,
            hidden_size=hidden,
            num_layers=num_layers,
            num_attention_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            ffn_hidden_size=ffn,
            tie_word_embeddings=tied,
            qkv_bias=qkv_bias,
            qk_norm=qk_norm,
        )
        if given is not None:
            self._check_given(given, shapes)
            return given
        return ModelConfig(**shapes, **self._scalars_from_args())

    def _check_given(self, given: ModelConfig, shapes: dict[str, Any]) -> None:
        wrong = {
            name: (getattr(given, name), value)
            for name, value in shapes.items()
            if name != "vocab_size" and getattr(given, name) != value
        }
        if wrong:
            detail = ", ".join(f"{n}={g} but the checkpoint has {v}" for n, (g, v) in wrong.items())
            raise MegatronCheckpointError(f"{self.iter_dir}: model_config disagrees: {detail}")
        if given.vocab_size > self.padded_vocab_size:
            raise MegatronCheckpointError(
                f"{self.iter_dir}: model_config.vocab_size {given.vocab_size} exceeds the "
                f"checkpoint's {self.padded_vocab_size} embedding rows"
            )
        if given.moe is not None:
            raise MegatronCheckpointError(f"{self.iter_dir}: dense checkpoint, MoE model_config")

    def _scalars_from_args(self) -> dict[str, Any]:
        """Numerics Megatron keeps only in its args (Megatron's defaults when absent)."""
        args = self.args
        out = dict(_MEGATRON_DEFAULTS)
        for ours, theirs in (
            ("norm_eps", "norm_epsilon"),
            ("rope_theta", "rotary_base"),
            ("max_position_embeddings", "max_position_embeddings"),
        ):
            if args.get(theirs) is not None:
                out[ours] = args[theirs]
        if args.get("use_rope_scaling"):
            out["rope_scaling"] = RopeScaling(factor=args.get("rope_scaling_factor", 8.0))
        if args.get("position_embedding_type", "rope") != "rope":
            raise MegatronCheckpointError(
                f"{self.iter_dir}: position_embedding_type {args['position_embedding_type']!r} "
                "(only rope is supported)"
            )
        return out

    def _count_layers(self) -> int:
        stacked = f"{LAYERS}.{_QKV_W}"
        if stacked in self._stored:
            return self._shape(stacked)[0]
        indices = {
            int(m.group(1)) for k in self._stored if (m := re.match(rf"{LAYERS}\.(\d+)\.", k))
        }
        if not indices:
            raise MegatronCheckpointError(f"{self.iter_dir}: no transformer layers found")
        return max(indices) + 1

    def _shape_of(self, suffix: str) -> tuple[int, ...]:
        slot = self._layer_key((suffix,), 0)
        if slot is None:
            raise MegatronCheckpointError(f"{self.iter_dir}: missing {LAYERS}.{suffix}")
        return self._shape(slot.key)

    def _plan(self) -> dict[str, _Slot]:
        """Our name -> where it is stored, in our canonical order."""
        cfg = self.model_config
        slots = {"tok_embeddings.weight": _Slot("embedding.word_embeddings.weight", None, "vocab")}
        for i in range(cfg.num_layers):
            prefix = f"layers.{i}"
            qkv = self._required((_QKV_W,), i)
            fc1 = self._layer_key((_FC1,), i)
            bias = self._required((_QKV_B,), i) if cfg.qkv_bias else None
            mine = {"attention_norm.weight": self._required(_INPUT_NORM, i)}
            for index, proj in enumerate("qkv"):  # the model's order: wq.weight, wq.bias, wk...
                mine[f"attention.w{proj}.weight"] = _Slot(qkv.key, qkv.layer, f"qkv:{index}")
                if bias is not None:
                    mine[f"attention.w{proj}.bias"] = _Slot(bias.key, bias.layer, f"qkv:{index}")
            mine["attention.wo.weight"] = self._required((_PROJ,), i)
            if cfg.qk_norm:
                mine["attention.q_norm.weight"] = self._required((_Q_NORM,), i)
                mine["attention.k_norm.weight"] = self._required((_K_NORM,), i)
            mine["ffn_norm.weight"] = self._required(_MLP_NORM, i)
            if fc1 is not None:
                mine["feed_forward.w1.weight"] = _Slot(fc1.key, fc1.layer, "fc1:0")
                mine["feed_forward.w3.weight"] = _Slot(fc1.key, fc1.layer, "fc1:1")
            else:  # singleton local shards: gate and up under separate keys
                mine["feed_forward.w1.weight"] = self._required((f"{_FC1}_w",), i)
                mine["feed_forward.w3.weight"] = self._required((f"{_FC1}_v",), i)
            mine["feed_forward.w2.weight"] = self._required((_FC2,), i)
            slots |= {f"{prefix}.{name}": slot for name, slot in mine.items()}
        slots["norm.weight"] = _Slot("decoder.final_layernorm.weight", None)
        if not cfg.tie_word_embeddings:
            slots["output.weight"] = _Slot("output_layer.weight", None, "vocab")
        for slot in slots.values():
            if slot.key not in self._stored:
                raise MegatronCheckpointError(f"{self.iter_dir}: missing {slot.key}")
        return slots

    def _required(self, suffixes: tuple[str, ...], layer: int) -> _Slot:
        slot = self._layer_key(suffixes, layer)
        if slot is None:
            raise MegatronCheckpointError(
                f"{self.iter_dir}: layer {layer} has none of {[f'{LAYERS}.{s}' for s in suffixes]}"
            )
        return slot
