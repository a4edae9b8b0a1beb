"""The trainer's data: which tokenizer ids the samples use, the three split datasets, loaders.

Tokenizer ids (EOD, vocabulary size) come, in this order, from the preprocess manifest beside
the first dataset of the blend (`pipeline.data.manifest`), from `data.tokenizer` when set, or,
for mock data, from the model: EOD = vocab_size - 1. The manifest records no pad id, and a pad
id only matters for partial samples, so `pad_id` is None (Megatron's GPT tokenizers have none
either). Sample counts per split follow Megatron's rule: train iters * gbs, valid
(iters // eval_interval + 1) * eval_iters * gbs, test eval_iters * gbs.

With `data.kind = "sft"` each prefix is a chat dataset and a sample is whole conversations
packed together (`pipeline.data.sft_dataset`), built through the same blends and splits; the
samples carry their own document ids, so no EOD id is needed to separate them. With
`data.kind = "dpo"` each prefix is the output prefix of `pipe preprocess --preference` and a
sample is one chosen/rejected pair (`pipeline.data.preference_dataset`).
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
from pipeline.data.blended import build_datasets
from pipeline.data.gpt_dataset import GPTDataset, GPTDatasetConfig
from pipeline.data.loader import build_data_loader
from pipeline.data.preference_dataset import PreferenceDataset, preference_prefix
from pipeline.data.sft_dataset import SFTDataset, SFTDatasetConfig
from pipeline.train.config.schema import ConfigError, TrainConfig

__all__ = [
    "TokenizerInfo",
    "build_loader",
    "build_split_datasets",
    "long_conversations",
    "split_sizes",
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
    if cfg.data.kind == "dpo":  # the manifest of a preference prefix names its chosen side
        first = f"{preference_prefix(first)}_chosen_document"
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
            int(loaded.eod), int(loaded.vocab_size), f"tokenizer:{cfg.data.tokenizer}",
            loaded.fingerprint(),
        )  # fmt: skip
    raise ConfigError(
        f"cannot tell the end-of-document token of {first}: no preprocess manifest beside it; "
        "set data.tokenizer to the tokenizer the data was made with"
    )


def split_sizes(cfg: TrainConfig) -> tuple[int, int, int]:
    """Samples wanted per split, by Megatron's rule (valid is 0 when evaluation is off)."""
    t = cfg.training
    gbs = t.global_batch_size
    if t.eval_interval == 0 or t.eval_iters == 0:
        return t.iters * gbs, 0, 0
    return t.iters * gbs, (t.iters // t.eval_interval + 1) * t.eval_iters * gbs, t.eval_iters * gbs


def build_split_datasets(
    cfg: TrainConfig, spec: Blend | PerSplitBlend | MockData, tok: TokenizerInfo
) -> list[Any]:
    """Train, valid and test datasets (None for a split without data)."""
    d = cfg.data
    identity = (tok.fingerprint or {}).get("files") or tok.source
    sft = d.kind == "sft"
    config_class, extra = (
        (SFTDatasetConfig, {"truncate": d.sft_truncate}) if sft else (GPTDatasetConfig, {})
    )
    config = config_class(
        sequence_length=d.seq_length,
        eod_id=tok.eod_id,
        tokenizer_id=str(identity),
        random_seed=cfg.training.seed,
        split=None if isinstance(spec, PerSplitBlend) else d.split,
        add_extra_token_to_sequence=d.add_extra_token_to_sequence,
        reset_position_ids=d.reset_position_ids,
        reset_attention_mask=d.reset_attention_mask,
        eod_mask_loss=d.eod_mask_loss,
        create_attention_mask=False,  # the model takes document ids instead of a dense mask
        path_to_cache=d.data_cache_path,
        pad_id=None,
        **extra,
    )
    if d.kind == "grpo":
        return prompt_datasets(cfg)
    dataset_class = {"sft": SFTDataset, "dpo": PreferenceDataset}.get(d.kind, GPTDataset)
    try:
        return build_datasets(spec, config, split_sizes(cfg), dataset_class=dataset_class)
    except (ValueError, OSError) as e:
        raise ConfigError(f"building the datasets: {e}") from e


def prompt_datasets(cfg: TrainConfig) -> list[Any]:
    """GRPO's prompts per split (`pipeline.data.prompt_dataset`), rendered with the tokenizer's
    chat template, whole epochs of them; prompts that leave no room for
    `grpo.max_completion_length` are skipped and counted. With `grpo.num_iterations` > 1 each
    global batch of the train split comes back that many times (the rollouts of its first pass
    serve the others)."""
    from pipeline.data.prompt_dataset import PromptDataset
    from pipeline.preprocess.prompts import PromptFileError, read_prompt_splits
    from pipeline.tokenizer.chat_template import ChatTemplateError, load_chat_template
    from pipeline.tokenizer.tokenizer import load_tokenizer

    d, t, passes = cfg.data, cfg.training, cfg.grpo.num_iterations
    try:
        sets = read_prompt_splits(
            d.blend, d.split, (d.train_blend, d.valid_blend, d.test_blend),
            load_tokenizer(d.tokenizer), load_chat_template(d.tokenizer),
            d.seq_length - cfg.grpo.max_completion_length,
        )  # fmt: skip
    except (PromptFileError, ChatTemplateError, OSError) as e:
        raise ConfigError(str(e)) from None
    datasets: list[Any] = []
    for index, (found, wanted) in enumerate(zip(sets, split_sizes(cfg))):
        if found is None or not wanted or not found.records:
            datasets.append(None)
            continue
        repeat, per_epoch = (passes if index == 0 else 1), len(found.records)
        epochs = -(-wanted // (repeat * per_epoch))  # whole epochs over the prompts
        dataset = PromptDataset(found.records, epochs * per_epoch, t.seed + index)
        dataset = RepeatedBatches(dataset, t.global_batch_size, repeat) if repeat > 1 else dataset
        dataset.skipped = found.skipped
        datasets.append(dataset)
    return datasets


class RepeatedBatches:
    """A dataset whose every run of `batch` samples comes back `times` times in a row: sample i
    is sample `(i // (batch * times)) * batch + i % batch` of `dataset`."""

    def __init__(self, dataset: Any, batch: int, times: int) -> None:
        self.dataset, self.batch, self.times = dataset, batch, times
        self.records = dataset.records

    def __len__(self) -> int:
        return len(self.dataset) * self.times

    def __getitem__(self, index: int) -> Any:
        group, offset = divmod(index, self.batch * self.times)
        return self.dataset[group * self.batch + offset % self.batch]


def long_conversations(cfg: TrainConfig, datasets: Sequence[Any]) -> str | None:
    """One line saying how many SFT conversations were longer than a sample and so dropped or
    truncated, per split (None when none were, or for GPT data)."""
    if cfg.data.kind == "grpo":
        return _skipped_prompts(cfg, datasets)
    counts = []
    for name, dataset in zip(("train", "valid", "test"), datasets):
        members = getattr(dataset, "datasets", [dataset])  # a blend's members, or the dataset
        n = sum(getattr(m, "truncated" if cfg.data.sft_truncate else "dropped", 0) for m in members)
        if n:
            counts.append(f"{n} in {name}")
    if not counts:
        return None
    seq = cfg.data.seq_length
    if cfg.data.sft_truncate:
        return f"truncated conversations longer than {seq} tokens to {seq}: {', '.join(counts)}"
    return (
        f"dropped conversations longer than {seq} tokens: {', '.join(counts)}; "
        "data.sft_truncate = true keeps their first tokens instead"
    )


def _skipped_prompts(cfg: TrainConfig, datasets: Sequence[Any]) -> str | None:
    """One line counting the GRPO prompts skipped for their length, per split (None: none)."""
    counts = [
        f"{sum(dataset.skipped.values())} in {name}"
        for name, dataset in zip(("train", "valid", "test"), datasets)
        if dataset is not None and dataset.skipped
    ]
    if not counts:
        return None
    room = cfg.data.seq_length - cfg.grpo.max_completion_length
    return (
        f"skipped prompts longer than {room} tokens (data.seq_length - "
        f"grpo.max_completion_length): {', '.join(counts)}"
    )


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
    # Packed SFT samples carry their document ids; GPT samples find them at EOD tokens.
    eod = tokenizer.eod_id if cfg.data.reset_attention_mask and cfg.data.kind == "gpt" else None
    return RunData(tokenizer, tuple(datasets), eod)
