"""A lazy `TensorSource` over a Hugging Face model directory (safetensors, sharded or not).

Only headers are read up front; `read` copies one tensor out of the memory-mapped file (for a
Mixtral expert stack, the E per-expert tensors, stacked as our `[E, ...]` layout). Pickled
weights (`pytorch_model.bin`, `*.pt`) can run code when loaded, so they are refused unless the
caller opts in, and then loaded with `torch.load(weights_only=True)`.

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
from pipeline.core.model.hf_names import (
    hf_expert_piece,
    hf_to_pipe_name,
    is_reordered,
    mtp_name,
    mtp_shared_copy,
    reorder_from_hf,
)
from pipeline.tokenizer.tokenizer import directory_record
from pipeline.weights.hf_config import (
    config_from_hf,
    dtype_from_hf,
    hf_architecture,
)
from pipeline.weights.hf_quantized import fp8_layout, is_fp8
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
        hf_config = _json_object(config_path)
        self.hf_config = hf_config
        self.model_config: ModelConfig = config_from_hf(
            hf_config, ignore_sliding_window=ignore_sliding_window
        )
        self.metadata: dict[str, Any] = {
            "source": str(self.directory),
            "hf_architecture": hf_architecture(hf_config),
        }
        for key in ("bos_token_id", "eos_token_id"):
            if hf_config.get(key) is not None:
                self.metadata[key] = hf_config[key]
        generation_eos = _generation_eos_ids(self.directory / "generation_config.json")
        if generation_eos:
            self.metadata["generation_eos_token_id"] = generation_eos
        tokenizer = directory_record(self.directory)
        if tokenizer is not None:
            self.metadata["tokenizer"] = tokenizer
        self._fp8 = fp8_layout(self.directory, hf_config)
        if self._fp8 is not None:
            self.metadata["quantization"] = self._fp8.name
        self._scales: dict[str, Path] = {}  # FP8 weight scales: HF name -> file
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
        # Layers past num_hidden_layers are DeepSeek's multi-token prediction modules: the
        # files say how many there are (transformers' configs name one that is never saved).
        mtp = {name.split(".")[1] for name in self._infos if name.startswith("mtp.")}
        self.model_config = dataclasses.replace(self.model_config, mtp_num_layers=len(mtp))
        # What the weights are in: the config's declaration, else the stored embedding's.
        embedding = self._infos.get("tok_embeddings.weight")
        dtype = dtype_from_hf(hf_config) or (embedding.dtype if embedding else None)
        self.metadata["hf_dtype"] = str(dtype).removeprefix("torch.") if dtype else None

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
        pieces: dict[str, dict[int | None, tuple[Path, str, TensorInfo]]] = {}
        skipped: dict[str, int] = {}
        for path in files:
            for hf_name, info in self._header(path).items():
                if hf_name.endswith(_IGNORED_SUFFIXES) or (tied and hf_name == "lm_head.weight"):
                    continue
                part = _skipped_part(hf_name)
                if part is not None:
                    skipped[part] = skipped.get(part, 0) + 1
                    continue
                if mtp_shared_copy(hf_name) is not None:
                    continue  # an MTP layer's copy of the shared embedding or output layer
                if self._fp8 is not None and self._fp8.is_scale(hf_name):
                    self._scales[hf_name] = path
                    continue
                if self._fp8 is not None and self._fp8.is_ignored(hf_name):
                    continue
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
                pieces.setdefault(name, {})[index] = (path, hf_name, info)
        if skipped:
            counts = ", ".join(f"{n} {part} tensors" for part, n in skipped.items())
            log.warning("%s: skipping %s; pipe reads the language model", self.directory, counts)
        return pieces

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
        if name not in self._locations:
            raise KeyError(f"{name!r} is not in {self.directory}")
        parts = []
        for path, hf_name in self._locations[name]:
            t = self._tensor(path, hf_name)
            if is_fp8(t.dtype) and self._fp8 is not None:
                scale_name = self._fp8.scale_name(hf_name)
                scale = self._tensor(self._scales[scale_name], scale_name)
                t = self._fp8.dequantize(t, scale, hf_name)
            parts.append(t)
        if len(parts) == 1:
            # safe_open and mmap'd torch.load tensors view the file mapping: copy them out.
            if is_reordered(name):  # indexing copies
                return reorder_from_hf(name, parts[0], self.model_config)
            return parts[0].clone()
        return torch.stack(parts)

    def close(self) -> None:
        """Drop the open files (their memory mappings); a later `read` opens them again."""
        self._handles.clear()

    def _tensor(self, path: Path, hf_name: str) -> torch.Tensor:
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
