"""Chat (SFT) shards: the token dataset of a conversation prefix read together with its loss mask.

`pipe preprocess --chat` writes two parallel Megatron indexed datasets per output prefix, one
document (one sequence) per conversation: the token ids in `{prefix}_messages_document` and, in
`{prefix}_messages_loss_mask_document`, one uint8 per token, 1 where the token belongs to an
assistant message (docs/file_layouts.md, "SFT samples"). `ChatIndexedDataset` opens both and
refuses a pair whose sequence lengths differ, so a sample never pairs tokens with another
conversation's mask.
"""

from __future__ import annotations

import os

import numpy as np

from pipeline.data.indexed import IndexedDataset, IndexFormatError, idx_path, normalize_prefix

__all__ = ["LOSS_MASK_DTYPE", "ChatIndexedDataset", "loss_mask_prefix"]

LOSS_MASK_DTYPE = np.dtype(np.uint8)
_DOCUMENT = "_document"


def loss_mask_prefix(prefix: str) -> str:
    """The loss-mask dataset of a data prefix: `P_document` -> `P_loss_mask_document`
    (`out/chat_messages_document` -> `out/chat_messages_loss_mask_document`)."""
    prefix = normalize_prefix(prefix)
    if prefix.endswith(_DOCUMENT):
        return prefix[: -len(_DOCUMENT)] + "_loss_mask" + _DOCUMENT
    return prefix + "_loss_mask"


class ChatIndexedDataset:
    """The conversations of a chat prefix: `get(i, offset, length)` reads tokens, `mask(i,
    offset, length)` the loss mask of the same tokens. Pickles as its two prefixes."""

    def __init__(self, prefix: str | os.PathLike):
        self.prefix = normalize_prefix(prefix)
        self.tokens = IndexedDataset(self.prefix)
        mask_prefix = loss_mask_prefix(self.prefix)
        try:
            self.masks = IndexedDataset(mask_prefix)
        except FileNotFoundError as err:
            raise FileNotFoundError(
                f"{err}; SFT data needs the loss mask beside the tokens (made by "
                "`pipe preprocess --chat`)"
            ) from None
        self._check(mask_prefix)
        self.sequence_lengths = self.tokens.sequence_lengths

    def _check(self, mask_prefix: str) -> None:
        where = idx_path(mask_prefix)
        if self.masks.dtype != LOSS_MASK_DTYPE:
            raise IndexFormatError(f"{where}: loss mask dtype {self.masks.dtype}, expected uint8")
        ours, theirs = self.tokens.sequence_lengths, self.masks.sequence_lengths
        if len(ours) != len(theirs):
            raise IndexFormatError(
                f"{where}: {len(theirs)} conversations, but {idx_path(self.prefix)} has "
                f"{len(ours)}; the two files are not one chat dataset"
            )
        differ = np.flatnonzero(ours != theirs)
        if len(differ):
            i = int(differ[0])
            raise IndexFormatError(
                f"{where}: conversation {i} has {int(theirs[i])} mask values but "
                f"{int(ours[i])} tokens in {idx_path(self.prefix)}"
            )

    def __getstate__(self) -> str:
        return self.prefix

    def __setstate__(self, prefix: str) -> None:
        self.__init__(prefix)

    def __len__(self) -> int:
        return len(self.tokens)

    def get(self, i: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        return self.tokens.get(i, offset, length)

    def mask(self, i: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        return self.masks.get(i, offset, length)
