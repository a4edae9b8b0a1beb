"""The seam through which cached decoding feeds attention: where keys and values come from.

Training passes no cache: each attention module attends over the keys and values of the tokens it
is given. A generation engine (`pipeline.serve`) passes a `KVCache` through
`Transformer.forward`: each attention module then hands its layer's cache what it keeps per token
for the new tokens, gets back every token's entries for each row so far (the new ones included),
and attends over those under the cache's mask. Grouped-query attention hands over its queries and
its kernel too (`attend`), so that a cache whose batch is not a rectangle (an engine's decode rows
and a prompt chunk run as one row of tokens) can call the kernel on each part: such a cache has
an `attend` method of its own. The model's own
modules run either way; the cache only stores and gathers tensors and picks the parts, so
decoding holds no second copy of the attention math.

What a layer keeps per token is the attention's business: grouped-query attention its keys (after
RoPE) and values, `[kv_heads, head_dim]` each; latent attention its normalised latent
`[kv_lora_rank]` and its shared RoPE key `[qk_rope_head_dim]` (DeepSeek's memory saving).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

import torch


class LayerKVCache(Protocol):
    """One layer's view of a `KVCache` for one batch of new tokens."""

    @property
    def mask(self) -> torch.Tensor | None:
        """`[batch, 1, new, length]`, True where a new token may attend to a cached one; None
        when each sees every one (one new token per row, all rows as long)."""
        ...

    @property
    def positions(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(the new tokens' positions `[batch, new]`, the positions of the entries `update`
        returns `[batch or 1, length]`): what attention biased by position (ALiBi) needs."""
        ...

    def update(self, *new: torch.Tensor) -> Sequence[torch.Tensor]:
        """Store the new tokens' entries (`[batch, new, *entry_shape]` each) and return each
        kind's entries for every token so far, `[batch, length, *entry_shape]`, in the dtype of
        `new`."""
        ...


class KVCache(Protocol):
    """Cached keys and values of the model's layers for one batch (module docstring)."""

    def layer(self, index: int) -> LayerKVCache:
        """The view of layer `index` (its global layer index)."""
        ...


def attend(
    cache: LayerKVCache,
    kernel: Callable[..., torch.Tensor],
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    **extra: torch.Tensor,
) -> torch.Tensor:
    """The new tokens' attention over every token so far: store the new keys and values `k`,
    `v` (`[batch, kv_heads, new, head_dim]`) in `cache`, then `kernel` (the layer's
    `AttentionKernel.over_cache`) of the queries `q` `[batch, heads, new, head_dim]` over them
    under the cache's mask, with the layer's `extra` options (ALiBi's slopes, sinks; ALiBi's
    `positions` added here). A cache with an `attend` method of its own (one that runs its
    batch in parts) is handed the whole call."""
    own = getattr(cache, "attend", None)
    if own is not None:
        return own(kernel, q, k, v, **extra)
    k, v = (t.transpose(1, 2) for t in cache.update(k.transpose(1, 2), v.transpose(1, 2)))
    if "alibi_slopes" in extra:
        extra["positions"] = cache.positions
    return kernel(q, k, v, cache.mask, **extra)
