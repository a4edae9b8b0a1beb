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

from pipeline.data.indexed import IndexedDataset, normalize_prefix
from pipeline.data.loss_mask import LOSS_MASK_DTYPE, loss_mask_prefix, open_loss_mask

__all__ = ["LOSS_MASK_DTYPE", "ChatIndexedDataset", "loss_mask_prefix"]


class ChatIndexedDataset:
    """The conversations of a chat prefix: `get(i, offset, length)` reads tokens, `mask(i,
    offset, length)` the loss mask of the same tokens. Pickles as its two prefixes."""

    def __init__(self, prefix: str | os.PathLike):
        self.prefix = normalize_prefix(prefix)
        self.tokens = IndexedDataset(self.prefix)
        try:
            self.masks = open_loss_mask(self.tokens)
        except FileNotFoundError as err:
            raise FileNotFoundError(
                f"{err}; SFT data needs the loss mask beside the tokens (made by "
                "`pipe preprocess --chat`)"
            ) from None
        self.sequence_lengths = self.tokens.sequence_lengths

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
