"""Opening a model for generation: weights from a pipe checkpoint (any layout) or a Hugging Face
directory, the tokenizer recorded with it (or given), and the token ids that end a text."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from pipeline.core.model.transformer import Transformer
from pipeline.tokenizer.chat_template import ChatTemplate, ChatTemplateError, load_chat_template
from pipeline.tokenizer.tokenizer import TextTokenizer, load_tokenizer


class LoadError(RuntimeError):
    """The model or its tokenizer cannot be opened (the message names the path)."""


@dataclass
class Generator:
    """A model ready to generate, with its tokenizer and end-of-text ids."""

    model: Transformer
    tokenizer: TextTokenizer | None
    eos_ids: frozenset[int]
    name: str
    chat_template: ChatTemplate | None = None
    tp: int = 1  # tensor-parallel ranks the model is split over
    tokenizer_path: Path | None = None  # where `tokenizer` was loaded from

    def encode(self, text: str) -> list[int]:
        if self.tokenizer is None:
            raise LoadError("no tokenizer: pass --tokenizer DIR")
        return self.tokenizer.encode_batch([text])[0]

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        if self.tokenizer is None:
            return ""
        return self.tokenizer.decode(ids, skip_special_tokens)


def default_dtype(device: torch.device) -> torch.dtype:
    """bf16 on a GPU, fp32 on a CPU."""
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def open_generator(
    path: str | Path,
    *,
    tokenizer: str | Path | None = None,
    device: str | torch.device = "cpu",
    dtype: torch.dtype | None = None,
    tp_mesh=None,
    lora_adapter: str | Path | None = None,
) -> Generator:
    """Load `path` (pipe checkpoint or Hugging Face directory) for generation (module doc),
    split over `tp_mesh` when given (`pipeline.serve.engine.tensor_parallel`), with the LoRA
    adapters at `lora_adapter` (a pipe adapter checkpoint or a peft directory) run beside the base
    weights, unmerged."""
    from pipeline.common.quiet import quiet_dcp
    from pipeline.weights import ConversionError, detect_format, model_from_source, open_source
    from pipeline.weights.hf_writer import recorded_tokenizer_dir

    path, device = Path(path), torch.device(device)
    if not path.exists():
        raise LoadError(f"{path}: no such checkpoint or directory")
    fmt = detect_format(path)
    if fmt == "megatron":
        raise LoadError(f"{path}: a Megatron save; `pipe convert --from megatron` it first")
    try:
        with quiet_dcp():
            source = open_source(path, fmt)
            model = model_from_source(source)
    except (ConversionError, OSError, ValueError, RuntimeError) as error:
        raise LoadError(f"{path}: {error}") from None
    if lora_adapter is not None:
        if tp_mesh is not None and tp_mesh.size() > 1:
            raise LoadError("--lora-adapter runs on one process; merge it (pipe export) for tp")
        attach_adapters(model, lora_adapter)
    model = dropless(model).to(device=device, dtype=dtype or default_dtype(device))
    model.rope.init_weights(device)
    tp = 1 if tp_mesh is None else tp_mesh.size()
    if tp > 1:
        from pipeline.serve.engine.tensor_parallel import shard_for_generation

        try:
            model = shard_for_generation(model, tp_mesh)
        except ValueError as error:
            raise LoadError(f"{path}: {error}") from None
    tokenizer_path = tokenizer or _tokenizer_beside(path)
    tokenizer_path = tokenizer_path or recorded_tokenizer_dir(source.metadata.get("tokenizer"))
    tok = _tokenizer(tokenizer_path) if tokenizer_path is not None else None
    eos = _eos_ids(source.metadata, tok)
    template = _chat_template(tokenizer_path)
    return Generator(model, tok, eos, path.name, template, tp, _path_or_none(tokenizer_path))


def _path_or_none(path: str | Path | None) -> Path | None:
    return None if path is None else Path(path)


def open_tokenizer(path: str | Path) -> tuple[TextTokenizer, str | None]:
    """The tokenizer at `path` and its chat template: what `pipe serve`'s HTTP process needs
    while the model lives in the engine process."""
    return _tokenizer(path), _chat_template(path)


def attach_adapters(model: Transformer, adapter: str | Path) -> None:
    """Add the LoRA adapters at `adapter` to `model` (`apply_lora`), unmerged; LoadError
    naming the path when they do not fit the model."""
    from pipeline.common.quiet import quiet_dcp
    from pipeline.core.model.lora import LoRASpec, apply_lora, targets_of
    from pipeline.weights.lora_files import read_adapters

    try:
        with quiet_dcp():
            record, tensors = read_adapters(adapter, model.config)
        spec = LoRASpec(record["rank"], record["alpha"], 0.0, targets_of(list(tensors)))
        apply_lora(model, spec)
        missing, unexpected = model.load_state_dict(tensors, strict=False)
    except (OSError, ValueError, KeyError, RuntimeError) as error:
        raise LoadError(f"{adapter}: {error}") from None
    unloaded = [name for name in missing if ".lora" in name]
    if unexpected or unloaded:
        raise LoadError(
            f"{adapter}: adapters do not fit the model ({len(unexpected)} unknown, e.g. "
            f"{(unexpected or unloaded)[0]})"
        )
    model.eval()


def dropless(model: Transformer) -> Transformer:
    """Every MoE layer routes every token (generation must not depend on the batch)."""
    for moe in model.moe_layers().values():
        if moe.config.capacity_factor is not None:
            moe.config = dataclasses.replace(moe.config, capacity_factor=None)
    return model


def _tokenizer_beside(directory: Path) -> Path | None:
    """`directory` itself when it holds tokenizer files (a Hugging Face directory)."""
    names = ("tokenizer.json", "tokenizer.model", "vocab.json")
    return directory if any((directory / name).is_file() for name in names) else None


def _tokenizer(path: str | Path) -> TextTokenizer:
    from pipeline.tokenizer.tokenizer import TokenizerError

    try:
        return load_tokenizer(path)
    except TokenizerError as error:
        raise LoadError(str(error)) from None


def _eos_ids(metadata: dict[str, Any], tokenizer: TextTokenizer | None) -> frozenset[int]:
    """The ids that end a generation: the model's end-of-text ids (config.json's, else the
    end-of-document id a pipe checkpoint's data recorded, else the tokenizer's), together with
    generation_config.json's, as transformers and vLLM stop on both."""
    eos = metadata.get("eos_token_id")
    recorded = metadata.get("tokenizer") or {}
    if eos is None:  # a pipe checkpoint records the data's end-of-document id
        eos = recorded.get("eod_id", recorded.get("eod"))
    if eos is None and tokenizer is not None:
        eos = tokenizer.eod
    ids = set() if eos is None else set(eos if isinstance(eos, list) else [eos])
    return frozenset(ids | set(metadata.get("generation_eos_token_id", [])))


def _chat_template(tokenizer_path: str | Path | None) -> ChatTemplate | None:
    """The chat template (with its special tokens) of the tokenizer at `tokenizer_path`, if any."""
    if tokenizer_path is None:
        return None
    try:
        return load_chat_template(tokenizer_path)
    except ChatTemplateError as error:
        raise LoadError(str(error)) from None
