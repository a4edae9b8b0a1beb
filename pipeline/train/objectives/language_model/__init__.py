"""Language modelling, the registry's entries `gpt` (pre-training: next-token cross-entropy over
every token) and `sft` (supervised fine-tuning: the same loss over the assistant's tokens of
packed conversations, `pipe train --sft`). Torch-free: the class is `objective.py`, the data
`data.py`."""

from __future__ import annotations

from typing import TYPE_CHECKING

from pipeline.train.objectives import ObjectiveSpec

if TYPE_CHECKING:
    from pipeline.train.config.schema import TrainConfig

__all__ = ["SPECS"]

_CLASS = "pipeline.train.objectives.language_model.objective:LanguageModelling"
_DATA = "pipeline.train.objectives.language_model.data"


def _sft_problems(cfg: TrainConfig) -> list[str]:
    if cfg.data.mock:
        return [
            "data.kind = sft trains on chat data with a loss mask; mock data has none: pass "
            "--data PREFIX_messages_document (made by `pipe preprocess --chat`)"
        ]
    return []


def _sft_data_line(cfg: TrainConfig) -> str:
    """How conversations are packed, for the dry run's data line."""
    long = "truncated" if cfg.data.sft_truncate else "dropped"
    return f" (SFT: conversations packed per sample, longer ones {long})"


SPECS = (
    ObjectiveSpec(
        "gpt",
        _CLASS,
        "pre-training: next-token cross-entropy over every token",
        datasets=f"{_DATA}:gpt_datasets",
        data_note=f"{_DATA}:long_conversations",
        documents_at_eod=True,
    ),
    ObjectiveSpec(
        "sft",
        _CLASS,
        "supervised fine-tuning: cross-entropy over the assistant's tokens",
        datasets=f"{_DATA}:sft_datasets",
        data_note=f"{_DATA}:long_conversations",
        document_masking=True,
        chat_prompts=True,
        problems=_sft_problems,
        data_line=_sft_data_line,
        flag_help="Supervised fine-tuning on chat data (pipe preprocess --chat): packed "
        "conversations, loss on assistant tokens (data.kind=sft).",
    ),
)
