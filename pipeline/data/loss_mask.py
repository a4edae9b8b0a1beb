"""Loss masks of supervised fine-tuning data: a second indexed dataset beside the token one,
one uint8 per token (1: trained on, the assistant's tokens; 0: not), with the same sequence
lengths and document boundaries. `pipe preprocess --chat` writes `{prefix}_messages_document`
and `{prefix}_messages_loss_mask_document`; a reader finds one from the other by name.
"""

from __future__ import annotations

import os

import numpy as np

from pipeline.data.indexed import IndexedDataset, IndexFormatError, normalize_prefix

LOSS_MASK_DTYPE = np.dtype(np.uint8)
_DOCUMENT = "_document"


def loss_mask_prefix(prefix: str | os.PathLike) -> str:
    """The loss mask dataset of token dataset `prefix`: `X_document` -> `X_loss_mask_document`
    (another name: `{prefix}_loss_mask`). `.bin`/`.idx` suffixes are dropped."""
    text = normalize_prefix(prefix)
    if text.endswith(_DOCUMENT):
        return f"{text[: -len(_DOCUMENT)]}_loss_mask{_DOCUMENT}"
    return f"{text}_loss_mask"


def open_loss_mask(tokens: IndexedDataset) -> IndexedDataset:
    """The loss mask beside `tokens`, checked to fit it (uint8, the same sequence lengths and
    document boundaries); IndexFormatError names the file otherwise."""
    mask = IndexedDataset(loss_mask_prefix(tokens.prefix))
    where = f"{mask.prefix}.idx"
    if mask.dtype != LOSS_MASK_DTYPE:
        raise IndexFormatError(f"{where}: a loss mask is uint8, this one is {mask.dtype}")
    ours, theirs = tokens.sequence_lengths, mask.sequence_lengths
    if len(ours) != len(theirs):
        raise IndexFormatError(
            f"{where}: {len(theirs)} conversations, but {tokens.prefix}.idx has {len(ours)} "
            "(a mask of other data)"
        )
    differ = np.flatnonzero(ours != theirs)
    if len(differ):
        i = int(differ[0])
        raise IndexFormatError(
            f"{where}: conversation {i} has {int(theirs[i])} mask values but {int(ours[i])} "
            f"tokens in {tokens.prefix}.idx (a mask of other data)"
        )
    if not np.array_equal(mask.document_indices, tokens.document_indices):
        raise IndexFormatError(f"{where}: document boundaries differ from {tokens.prefix}.idx")
    return mask
