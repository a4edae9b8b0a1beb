"""A lazy `TensorSource` over a Hugging Face model directory (safetensors, sharded or not).

Only headers are read up front; `read` copies one tensor out of the memory-mapped file (for a
Mixtral expert stack, the E per-expert tensors, stacked as our `[E, ...]` layout). Pickled
weights (`pytorch_model.bin`, `*.pt`) can run code when loaded, so they are refused unless the
caller opts in, and then loaded with `torch.load(weights_only=True)`.

BLOOM's and MPT's fused q/k/v projections are listed and read as our three (`wq`, `wk`, `wv`;
`pipeline.weights.fused_qkv`), each cut from the fused tensor when read.

Tied embeddings: when the config ties them, the source lists `tok_embeddings.weight` only (an
`lm_head.weight` some checkpoints store anyway is not listed); consumers tie `output.weight`.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from pipeline.common.safetensors_io import SAFETENSORS_DTYPES
from pipeline.core.model.config import ModelConfig
from pipeline.core.model.hf_fused_experts import layout_of, split
from pipeline.core.model.hf_names import (
    hf_expert_piece,
    hf_to_pipe_name,
    is_reordered,
    mtp_name,
    mtp_shared_copy,
    reorder_from_hf,
)
from pipeline.tokenizer.tokenizer import directory_record
from pipeline.weights.fused_qkv import FUSED_QKV_LAYOUTS, split_infos, split_qkv
from pipeline.weights.hf_config import (
    config_from_hf,
    dtype_from_hf,
    hf_architecture,
    text_model,
)
from pipeline.weights.hf_int4 import packed_int4_layout
from pipeline.weights.hf_quantized import (
    MXFP4_BLOCKS,
    MXFP4_SCALES,
    dequantize_mxfp4,
    fp8_layout,
    is_fp8,
    is_mxfp4,
)
from pipeline.weights.source import TensorInfo

__all__ = ["HFSource"]

log = logging.getLogger(__name__)

_FROM_SAFETENSORS = {code: dtype for dtype, code in SAFETENSORS_DTYPES.items()}
_PICKLE_SUFFIXES = (".bin", ".pt", ".pth")
# Buffers older checkpoints saved alongside the weights; recomputed by the model, never needed.
_IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)


def _order(name: str) -> tuple:
    """Embeddings, then layers in numeric order, then the final norm and the output."""
    if name.startswith(("layers.", "mtp.")):
        kind, layer, rest = name.split(".", 2)
        return (1 if kind == "layers" else 4, int(layer), rest)
    return ({"tok_embeddings.weight": 0, "norm.weight": 2}.get(name, 3), 0, name)


class HFSource:
    """Weights and config of a Hugging Face Llama / Mistral / Qwen2 / Mixtral directory.

    `metadata` holds `source` (the directory), `hf_architecture` (so writing back picks the
    same architecture), `hf_dtype` (the declared dtype's name, e.g. `bfloat16`, or the stored
    embedding's when the config declares none), `bos_token_id` / `eos_token_id` when the
    config has them, and `generation_eos_token_id`: the end-of-turn ids of
    `generation_config.json` when it names any (an instruct model's `<|eot_id|>` or
    `<|im_end|>`: transformers and vLLM stop generation on them as well as on the config's),
    and `tokenizer`: the tokenizer files beside the weights with their SHA-256, when there are
    any, so a checkpoint converted from the directory still finds them.

    An FP8 checkpoint (ModelOpt's, or block FP8; `hf_quantized.py`) is read dequantized: its
    float8 weights come back in fp32, scaled, its scales are not listed, and `quantization`
    names the format; a quantization that cannot be dequantized is refused on opening.
    """

    def __init__(
        self,
        directory: str | os.PathLike,
        *,
        allow_pickle: bool = False,
        ignore_sliding_window: bool = False,
    ) -> None:
        self.directory = Path(directory)
        config_path = self.directory / "config.json"
        if not config_path.is_file():
            raise FileNotFoundError(f"{config_path} not found: not a Hugging Face model directory")
        wrapper = _json_object(config_path)
        text, self._prefix = text_model(wrapper)
        # A wrapper whose text weights carry a prefix (Kimi K2.5) is read from its text model;
        # Qwen3.5's, whose names need none, as it is: its own ids, dtype and quantization
        # (`config_from_hf` and `hf_architecture` see its text model through it).
        hf_config = text if self._prefix else wrapper
        self.hf_config = hf_config
        self.model_config: ModelConfig = config_from_hf(
            hf_config, ignore_sliding_window=ignore_sliding_window
        )
        self.metadata: dict[str, Any] = {
            "source": str(self.directory),
            "hf_architecture": hf_architecture(hf_config),
        }
        if self._prefix:  # the text model of a multimodal checkpoint
            self.metadata["text_model_of"] = wrapper.get("model_type")
        for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
            if hf_config.get(key) is not None:
                self.metadata[key] = hf_config[key]
        generation_eos = _generation_eos_ids(self.directory / "generation_config.json")
        if generation_eos:
            self.metadata["generation_eos_token_id"] = generation_eos
        tokenizer = directory_record(self.directory)
        if tokenizer is not None:
            self.metadata["tokenizer"] = tokenizer
        self._quantization_layouts(hf_config)
        self._handles: dict[Path, Any] = {}
        # our name -> [(file, hf name)]: one entry, or one per expert for stacked experts
        self._locations: dict[str, list[tuple[Path, str]]] = {}
        self._infos: dict[str, TensorInfo] = {}
        self._pickled = False
        files = self._weight_files(allow_pickle)
        self.weight_files: list[Path] = files
        """The files the weights are read from (an index's, in its order, or every shard)."""
        pieces = self._scan(files)
        self._assemble(pieces)
        self._fused: dict[str, tuple[str, int]] = {}  # our q/k/v name -> (fused name, part)
        self._last_fused: tuple[str, torch.Tensor] | None = None
        self._split_fused_qkv()
        # Layers past num_hidden_layers are DeepSeek's multi-token prediction modules: the
        # files say how many there are (transformers' configs name one that is never saved).
        mtp = {name.split(".")[1] for name in self._infos if name.startswith("mtp.")}
        self.model_config = dataclasses.replace(self.model_config, mtp_num_layers=len(mtp))
        # What the weights are in: the config's declaration, else the stored embedding's.
        embedding = self._infos.get("tok_embeddings.weight")
        dtype = dtype_from_hf(hf_config) or (embedding.dtype if embedding else None)
        self.metadata["hf_dtype"] = str(dtype).removeprefix("torch.") if dtype else None

    def _quantization_layouts(self, hf_config: dict[str, Any]) -> None:
        """How quantized weights are laid out (FP8 scales, INT4 packs, MXFP4 blocks), and the
        state the reads keep for them."""
        self._fp8 = fp8_layout(self.directory, hf_config)
        if self._fp8 is not None:
            self.metadata["quantization"] = self._fp8.name
        self._int4 = packed_int4_layout(hf_config)
        if self._int4 is not None:
            self.metadata["quantization"] = self._int4.name
        self._scales: dict[str, Path] = {}  # FP8 or INT4 scales (and shapes): HF name -> file
        self._packed: dict[str, Path] = {}  # INT4 packed weights: HF name -> file
        self._mxfp4 = is_mxfp4(hf_config)
        if self._mxfp4:
            self.metadata["quantization"] = "MXFP4"
        # MXFP4 tensors (gpt-oss's experts): HF name -> (blocks file, scales file)
        self._mxfp4_packed: dict[str, tuple[Path, Path | None]] = {}
        # our name -> how it is taken out of the HF tensor (fused experts: gpt-oss, Mistral 4)
        self._takes: dict[str, Any] = {}

    # -- discovery ---------------------------------------------------------------------------

    def _weight_files(self, allow_pickle: bool) -> list[Path]:
        d = self.directory
        index = d / "model.safetensors.index.json"
        if index.is_file():
            weight_map = _json_object(index).get("weight_map")
            if not isinstance(weight_map, dict):
                raise ValueError(f"{index}: no weight_map object")
            files = [d / f for f in dict.fromkeys(weight_map.values())]
            for f in files:
                if not f.is_file():
                    raise FileNotFoundError(f"{f} is listed in {index.name} but missing")
            return files
        files = sorted(d.glob("*.safetensors"))
        if files:
            return files
        pickled = sorted(p for p in d.iterdir() if p.suffix in _PICKLE_SUFFIXES)
        if not pickled:
            raise FileNotFoundError(f"no *.safetensors (or pytorch_model.bin) weights in {d}")
        if not allow_pickle:
            raise ValueError(
                f"{d} holds pickled weights ({', '.join(p.name for p in pickled)}), which can "
                f"execute code when loaded; convert them to safetensors, or pass "
                f"allow_pickle=True to load them with torch.load(weights_only=True)"
            )
        self._pickled = True
        return pickled

    def _open(self, path: Path) -> Any:
        handle = self._handles.get(path)
        if handle is not None:
            return handle
        try:
            if self._pickled:
                handle = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
            else:
                handle = safe_open(str(path), framework="pt")
        except (SafetensorError, OSError, RuntimeError, ValueError) as e:
            raise ValueError(f"cannot read weights file {path}: {e}") from e
        self._handles[path] = handle
        return handle

    def _header(self, path: Path) -> dict[str, TensorInfo]:
        infos = self._stored_header(path)
        if not self._mxfp4:
            return infos
        out = {}
        for name, info in infos.items():
            if name.endswith(MXFP4_SCALES):
                weight = name.removesuffix(MXFP4_SCALES)
                blocks = self._mxfp4_packed.get(weight, (None, None))[0]
                self._mxfp4_packed[weight] = (blocks, path)
            elif name.endswith(MXFP4_BLOCKS):
                weight = name.removesuffix(MXFP4_BLOCKS)
                self._mxfp4_packed[weight] = (path, self._mxfp4_packed.get(weight, (None, None))[1])
                # [E, out, in / 32, 16] packed: [E, in, out] when dequantized (HF's layout)
                experts, rows, groups, _ = info.shape
                out[weight] = TensorInfo((experts, groups * 32, rows), torch.bfloat16)
            else:
                out[name] = info
        return out

    def _stored_header(self, path: Path) -> dict[str, TensorInfo]:
        handle = self._open(path)
        if self._pickled:
            return {n: TensorInfo(tuple(t.shape), t.dtype) for n, t in handle.items()}
        infos = {}
        for name in handle.keys():  # noqa: SIM118 (safe_open handles are not mappings)
            sl = handle.get_slice(name)
            code = sl.get_dtype()
            if code not in _FROM_SAFETENSORS:
                raise ValueError(f"{path}: tensor {name} has unsupported dtype {code}")
            infos[name] = TensorInfo(tuple(sl.get_shape()), _FROM_SAFETENSORS[code])
        return infos

    def _scan(self, files: list[Path]) -> dict[str, dict[int | None, tuple[Path, str, TensorInfo]]]:
        """our name -> {expert index or None: (file, hf name, info)}."""
        tied = self.model_config.tie_word_embeddings
        num_layers = self.model_config.num_layers
        layout = layout_of(self.metadata["hf_architecture"])
        pieces: dict[str, dict[int | None, tuple[Path, str, TensorInfo]]] = {}
        skipped: dict[str, int] = {}
        for path in files:
            for disk_name, info in self._header(path).items():
                # A multimodal model's text weights carry a prefix; its other towers are skipped.
                hf_name = disk_name.removeprefix(self._prefix)
                if self._prefix and hf_name == disk_name:
                    continue
                if hf_name.endswith(_IGNORED_SUFFIXES) or (tied and hf_name == "lm_head.weight"):
                    continue
                part = _skipped_part(hf_name)
                if part is not None:
                    skipped[part] = skipped.get(part, 0) + 1
                    continue
                if mtp_shared_copy(hf_name) is not None:
                    continue  # an MTP layer's copy of the shared embedding or output layer
                if self._fp8 is not None and self._fp8.is_scale(hf_name):
                    self._scales[disk_name] = path
                    continue
                if self._fp8 is not None and self._fp8.is_ignored(hf_name):
                    continue
                fused = split(hf_name, layout)
                if fused is not None:  # one tensor, read as the parts of ours it holds
                    self._add_fused(pieces, fused, path, disk_name, info)
                    continue
                if self._int4 is not None and self._int4.is_aux(hf_name):
                    self._scales[disk_name] = path
                    continue
                if self._int4 is not None and self._int4.is_packed(hf_name):
                    info = self._packed_info(path, disk_name)
                    hf_name = self._int4.weight_name(hf_name)
                    disk_name = self._int4.weight_name(disk_name)
                expert = hf_expert_piece(hf_name)
                if expert is not None:
                    name, index = expert
                else:
                    try:
                        name, index = hf_to_pipe_name(hf_name), None
                    except KeyError:
                        raise ValueError(
                            f"{path}: tensor {hf_name!r} has no counterpart in pipe models"
                        ) from None
                name = mtp_name(name, num_layers)
                pieces.setdefault(name, {})[index] = (path, disk_name, info)
        if skipped:
            counts = ", ".join(f"{n} {part} tensors" for part, n in skipped.items())
            log.warning("%s: skipping %s; pipe reads the language model", self.directory, counts)
        return pieces

    def _add_fused(
        self, pieces: dict, fused: list, path: Path, disk_name: str, info: TensorInfo
    ) -> None:
        """A fused expert tensor (gpt-oss's, Mistral 4's gate_up), listed as the parts of ours
        it holds (`split`'s)."""
        meta = torch.empty(info.shape, dtype=info.dtype, device="meta")
        for name, take in fused:
            name = mtp_name(name, self.model_config.num_layers)
            self._takes[name] = take
            part = TensorInfo(tuple(take(meta).shape), info.dtype)
            pieces.setdefault(name, {})[None] = (path, disk_name, part)

    def _assemble(self, pieces: dict[str, dict[int | None, tuple[Path, str, TensorInfo]]]) -> None:
        moe = self.model_config.moe
        for name in sorted(pieces, key=_order):
            parts = pieces[name]
            if None in parts:
                path, hf_name, info = parts[None]
                self._locations[name] = [(path, hf_name)]
                self._infos[name] = info
                continue
            expected = list(range(moe.num_experts if moe is not None else 0))
            if sorted(parts) != expected:
                raise ValueError(
                    f"{name}: found experts {sorted(parts)}, config says {len(expected)} experts"
                )
            first = parts[0][2]
            if any(parts[e][2] != first for e in expected):
                raise ValueError(f"{name}: experts differ in shape or dtype")
            self._locations[name] = [(parts[e][0], parts[e][1]) for e in expected]
            self._infos[name] = TensorInfo((len(expected), *first.shape), first.dtype)
        self._dequantized_infos()
        if not self.model_config.tie_word_embeddings and "output.weight" not in self._infos:
            raise ValueError(
                f"{self.directory}: no lm_head.weight and tie_word_embeddings is false"
            )

    def _split_fused_qkv(self) -> None:
        """List each fused q/k/v projection (BLOOM, MPT) as our `wq`, `wk`, `wv`, in its place
        (Qwen3.5's linear attention keeps its own `wqkv`)."""
        if self.metadata["hf_architecture"] not in FUSED_QKV_LAYOUTS:
            return
        parts = split_infos(self._infos)
        if not parts:
            return
        by_fused: dict[str, dict[str, TensorInfo]] = {}
        for name, (fused, _, info) in parts.items():
            by_fused.setdefault(fused, {})[name] = info
        infos: dict[str, TensorInfo] = {}
        for name, info in self._infos.items():
            infos |= by_fused.get(name, {name: info})
        self._infos = infos
        self._fused = {name: (fused, index) for name, (fused, index, _) in parts.items()}

    def _packed_info(self, path: Path, packed_name: str) -> TensorInfo:
        """The fp32 `[rows, cols]` a packed INT4 weight reads as (its `weight_shape`, which
        sits in the same file in compressed-tensors' saves)."""
        _, shape_name = self._int4.aux_names(packed_name)
        try:
            shape = self._tensor(path, shape_name)
        except ValueError:
            raise ValueError(f"{path}: {packed_name} has no {shape_name} beside it") from None
        self._packed[packed_name] = path
        return TensorInfo(tuple(int(n) for n in shape.tolist()), torch.float32)

    def _dequantized_infos(self) -> None:
        """float8 weights are read dequantized, in fp32; each must have its scale."""
        for name, info in self._infos.items():
            if not is_fp8(info.dtype):
                continue
            hf_name = self._locations[name][0][1]
            if self._fp8 is None:
                raise ValueError(
                    f"{self.directory}: {hf_name} is {info.dtype} but config.json declares "
                    "no quantization_config"
                )
            for _, part in self._locations[name]:
                if self._fp8.scale_name(part) not in self._scales:
                    raise ValueError(
                        f"{self.directory}: {part} is float8 but "
                        f"{self._fp8.scale_name(part)} is missing"
                    )
            self._infos[name] = TensorInfo(info.shape, torch.float32)

    # -- TensorSource ------------------------------------------------------------------------

    def tensors(self) -> dict[str, TensorInfo]:
        """Our parameter name -> shape and dtype, embeddings first, layers in order."""
        return dict(self._infos)

    def read(self, name: str) -> torch.Tensor:
        """The full tensor `name`, a fresh CPU tensor (expert stacks are read expert by expert)."""
        if name in self._fused:
            return self._fused_part(name)
        if name not in self._locations:
            raise KeyError(f"{name!r} is not in {self.directory}")
        parts = []
        for path, hf_name in self._locations[name]:
            packed_name = hf_name.removesuffix(".weight") + ".weight_packed"
            if self._int4 is not None and packed_name in self._packed:
                parts.append(self._dequantized_int4(packed_name))
                continue
            t = self._tensor(path, hf_name)
            if is_fp8(t.dtype) and self._fp8 is not None:
                scale_name = self._fp8.scale_name(hf_name)
                scale = self._tensor(self._scales[scale_name], scale_name)
                t = self._fp8.dequantize(t, scale, hf_name)
            parts.append(t)
        if len(parts) == 1:
            take = self._takes.get(name)
            # safe_open and mmap'd torch.load tensors view the file mapping: copy them out.
            if take is not None:
                return take(parts[0]).contiguous()
            if is_reordered(name, self.model_config):  # indexing copies
                return reorder_from_hf(name, parts[0], self.model_config)
            return parts[0].clone()
        return torch.stack(parts)

    def _fused_part(self, name: str) -> torch.Tensor:
        """Our q, k or v tensor `name`, cut from its fused projection (read once for the three)."""
        fused, index = self._fused[name]
        if self._last_fused is None or self._last_fused[0] != fused:
            self._last_fused = (fused, self.read(fused))
        layout = FUSED_QKV_LAYOUTS[self.metadata["hf_architecture"]]
        heads = self.model_config.num_attention_heads
        return split_qkv(self._last_fused[1], layout, heads)[index]

    def _dequantized_int4(self, packed_name: str) -> torch.Tensor:
        """One packed INT4 weight, dequantized to fp32 (its scale may sit in another file)."""
        scale_name, shape_name = self._int4.aux_names(packed_name)
        if scale_name not in self._scales:
            raise ValueError(f"{self.directory}: {packed_name} has no {scale_name}")
        packed = self._tensor(self._packed[packed_name], packed_name)
        scale = self._tensor(self._scales[scale_name], scale_name)
        shape = self._tensor(self._packed[packed_name], shape_name)
        return self._int4.dequantize(packed, scale, shape, packed_name)

    def close(self) -> None:
        """Drop the open files (their memory mappings); a later `read` opens them again."""
        self._handles.clear()
        self._last_fused = None

    def _tensor(self, path: Path, hf_name: str) -> torch.Tensor:
        if hf_name in self._mxfp4_packed:
            blocks_path, scales_path = self._mxfp4_packed[hf_name]
            blocks = self._stored(blocks_path, hf_name + MXFP4_BLOCKS)
            scales = self._stored(scales_path, hf_name + MXFP4_SCALES)
            return dequantize_mxfp4(blocks, scales, hf_name).transpose(1, 2)
        return self._stored(path, hf_name)

    def _stored(self, path: Path | None, hf_name: str) -> torch.Tensor:
        if path is None:
            raise ValueError(f"{self.directory}: {hf_name} is missing (MXFP4 needs both halves)")
        handle = self._open(path)
        try:
            return handle[hf_name] if self._pickled else handle.get_tensor(hf_name)
        except SafetensorError as e:
            raise ValueError(f"cannot read {hf_name} from {path}: {e}") from e


def _skipped_part(hf_name: str) -> str | None:
    """What a tensor of Qwen3.5's image-text checkpoints is when pipe does not read it: the
    vision tower (`model.visual.*`) or the multi-token prediction head (`mtp.*`); else None."""
    if hf_name.startswith("model.visual."):
        return "vision-tower"
    if hf_name.startswith("mtp."):
        return "multi-token-prediction"
    return None


def _generation_eos_ids(path: Path) -> list[int]:
    """The `eos_token_id` (one id or a list) of a `generation_config.json`, [] without one; a
    damaged file is a ValueError naming it, an id that is no integer names the field."""
    if not path.is_file():
        return []
    eos = _json_object(path).get("eos_token_id")
    ids = [] if eos is None else eos if isinstance(eos, list) else [eos]
    if not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise ValueError(f"{path}: eos_token_id must be an integer or a list of them, got {eos!r}")
    return ids


def _json_object(path: Path) -> dict[str, Any]:
    """A JSON object file (config, shard index); a damaged one is a ValueError naming it."""
    try:
        data = json.loads(path.read_bytes().decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as e:
        raise ValueError(f"{path}: not a readable JSON file ({e})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: not a JSON object")
    return data
