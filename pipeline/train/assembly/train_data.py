"""The trainer's data: which tokenizer ids the samples use, the three split datasets, loaders.

Tokenizer ids (EOD, vocabulary size) come, in this order, from the preprocess manifest beside
the first dataset of the blend (`pipeline.data.manifest`), from `data.tokenizer` when set, or,
for mock data, from the model: EOD = vocab_size - 1. The manifest records no pad id, and a pad
id only matters for partial samples, so `pad_id` is None (Megatron's GPT tokenizers have none
either). Sample counts per split follow Megatron's rule: train iters * gbs, valid
(iters // eval_interval + 1) * eval_iters * gbs, test eval_iters * gbs.

What a sample is depends on the objective: its registry entry (`pipeline.train.objectives`)
names the function that builds its datasets (GPT samples, packed conversations, preference
pairs, prompts: each objective's `data.py`), the dataset beside which the manifest lies, and
whether documents are told apart at EOD tokens; this module names none of them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from pipeline.data import manifest
from pipeline.data.blend_spec import (
    Blend,
    MockData,
    PerSplitBlend,
    all_prefixes,
    parse_blend,
    parse_per_split_blend,
)
from pipeline.data.loader import build_data_loader
from pipeline.train.config.registry import call_target
from pipeline.train.config.schema import ConfigError, TrainConfig
from pipeline.train.objectives import objective_spec

__all__ = [
    "TokenizerInfo",
    "build_loader",
    "build_split_datasets",
    "long_conversations",
    "tokenizer_info",
]


@dataclass(frozen=True)
class TokenizerInfo:
    """The ids training needs from the tokenizer, and where they came from."""

    eod_id: int
    vocab_size: int
    source: str
    """"manifest:<path>", "tokenizer:<path>" or "mock"."""
    fingerprint: dict[str, Any] | None = None
    """The manifest's tokenizer record (kind, files with SHA-256), for checkpoint metadata."""

    def to_metadata(self) -> dict[str, Any]:
        return {
            "eod_id": self.eod_id,
            "vocab_size": self.vocab_size,
            "source": self.source,
            "fingerprint": self.fingerprint,
        }


def data_spec(cfg: TrainConfig, model_vocab: int) -> Blend | PerSplitBlend | MockData:
    """The blend `cfg.data` describes (one blend, per-split blends, or mock data)."""
    d = cfg.data
    try:
        if d.mock:
            return MockData(vocab_size=model_vocab)
        if d.blend is not None:
            return parse_blend(d.blend, source="data.blend")
        return parse_per_split_blend(d.train_blend, d.valid_blend, d.test_blend)
    except ValueError as e:
        raise ConfigError(str(e)) from e


def tokenizer_info(cfg: TrainConfig, spec: Blend | PerSplitBlend | MockData) -> TokenizerInfo:
    """EOD id and vocabulary size of the data's tokenizer (see the module docstring)."""
    if isinstance(spec, MockData):
        return TokenizerInfo(spec.vocab_size - 1, spec.vocab_size, "mock")
    first = all_prefixes(spec)[0]
    beside = objective_spec(cfg.data.kind).manifest_dataset
    first = beside(first) if beside is not None else first
    path = manifest.find_for_dataset(first)
    record = manifest.read(path) if path is not None else None
    tok = (record or {}).get("tokenizer") or {}
    if tok.get("eod") is not None and tok.get("vocab_size") is not None:
        return TokenizerInfo(int(tok["eod"]), int(tok["vocab_size"]), f"manifest:{path}", tok)
    if cfg.data.tokenizer is not None:
        from pipeline.tokenizer.tokenizer import load_tokenizer

        loaded = load_tokenizer(cfg.data.tokenizer)
        if loaded.eod is None:
            raise ConfigError(
                f"data.tokenizer {cfg.data.tokenizer}: the tokenizer has no EOD token"
            )
        return TokenizerInfo(
            int(loaded.eod),
            int(loaded.vocab_size),
            f"tokenizer:{cfg.data.tokenizer}",
            loaded.fingerprint(),
        )
    raise ConfigError(
        f"cannot tell the end-of-document token of {first}: no preprocess manifest beside it; "
        "set data.tokenizer to the tokenizer the data was made with"
    )


def build_split_datasets(
    cfg: TrainConfig, spec: Blend | PerSplitBlend | MockData, tok: TokenizerInfo
) -> list[Any]:
    """Train, valid and test datasets (None for a split without data), built as the objective's
    registry entry says."""
    return call_target(objective_spec(cfg.data.kind).datasets, cfg, spec, tok)


def long_conversations(cfg: TrainConfig, datasets: Sequence[Any]) -> str | None:
    """One line saying what the objective's data building left out (conversations longer than
    a sample, dropped or truncated; prompts with no room for a completion), per split (None:
    nothing)."""
    note = objective_spec(cfg.data.kind).data_note
    return call_target(note, cfg, datasets) if note is not None else None


def build_loader(
    dataset: Any, cfg: TrainConfig, consumed_samples: int, dp_rank: int = 0, dp_size: int = 1
) -> Any:
    """A resumable loader for one split on data-parallel rank `dp_rank` of `dp_size` (None
    without data). `consumed_samples` counts the samples of all ranks (Megatron's rule)."""
    if dataset is None or len(dataset) == 0:
        return None
    return build_data_loader(
        dataset,
        cfg.training.micro_batch_size,
        data_parallel_rank=dp_rank,
        data_parallel_size=dp_size,
        consumed_samples=consumed_samples,
        num_workers=cfg.data.num_workers,
    )


@dataclass
class RunData:
    """What a run trains on: the tokenizer's ids, the three split datasets (None when a split
    is empty) and, with `data.reset_attention_mask`, the end-of-document id that separates
    documents in attention (else None)."""

    tokenizer: TokenizerInfo
    datasets: tuple[Any, Any, Any]
    eod_for_documents: int | None


def build_run_data(cfg: TrainConfig, model_config: Any) -> RunData:
    """The blend, the tokenizer (checked against the model's vocabulary) and the datasets."""
    vocab = model_config.vocab_size
    spec = data_spec(cfg, vocab)
    tokenizer = tokenizer_info(cfg, spec)
    if tokenizer.vocab_size > vocab:
        raise ConfigError(
            f"the tokenizer has {tokenizer.vocab_size} tokens ({tokenizer.source}) "
            f"but the model's vocabulary is {vocab}; set model.vocab_size"
        )
    datasets = build_split_datasets(cfg, spec, tokenizer)
    if datasets[0] is None or len(datasets[0]) == 0:
        raise ConfigError("the training split is empty: check data.split and the blend")
    # Packed samples carry their document ids; GPT samples find them at EOD tokens.
    at_eod = cfg.data.reset_attention_mask and objective_spec(cfg.data.kind).documents_at_eod
    eod = tokenizer.eod_id if at_eod else None
    return RunData(tokenizer, tuple(datasets), eod)
