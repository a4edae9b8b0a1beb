"""The model's forward pass over new tokens with the rest of each sequence read from a KV cache.

It reuses the weights and sub-modules of `pipeline.core.model.transformer.Transformer` (norms,
projections, RoPE, MLP / MoE) and only re-orders the attention so that keys and values come from
`BlockKVCache`: the new tokens' entries are written to their slots first, then each row's whole
history is read back and attended to with a causal mask by position. The training model stays
untouched; `tests/serve` checks this path against transformers' `generate` for every family.

A batch is `[batch, new]` tokens, each row one sequence: a prompt chunk (prefill) or one token
(decode). Rows shorter than the longest are padded; padded positions write to the cache's scratch
slot and are never read.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pipeline.core.model.transformer import (
    Attention,
    LatentAttention,
    Transformer,
    apply_rope,
    deinterleave,
)
from pipeline.serve.kv_cache import BlockKVCache


@dataclass
class CachedBatch:
    """Where a batch's tokens go and what they see.

    tokens, positions, write_slots: `[batch, new]`; read_slots `[batch, length]`: the slots of
    positions 0..length-1 of each row (padded with any slot; the mask hides them)."""

    tokens: torch.Tensor
    positions: torch.Tensor
    write_slots: torch.Tensor
    read_slots: torch.Tensor

    def mask(self) -> torch.Tensor | None:
        """`[batch, 1, new, length]`: query at position p sees keys at positions <= p; None when
        that is every key (one new token per row, all rows as long: the common decode step)."""
        length = self.read_slots.shape[1]
        if self.positions.shape[1] == 1 and bool((self.positions == length - 1).all()):
            return None
        keys = torch.arange(length, device=self.positions.device)
        return (keys[None, None, :] <= self.positions[:, :, None]).unsqueeze(1)


@torch.no_grad()
def forward_cached(model: Transformer, cache: BlockKVCache, batch: CachedBatch) -> torch.Tensor:
    """Hidden states `[batch, new, hidden]` after the final norm, updating the cache."""
    h = model.tok_embeddings(batch.tokens)
    rope = model.rope(batch.positions)
    mask = batch.mask()
    for index, layer in enumerate(model.layers.values()):
        x = layer.attention_norm(h)
        attention = layer.attention
        if isinstance(attention, LatentAttention):
            out = _latent_attention(attention, x, rope, cache, index, batch, mask)
        else:
            out = _gqa_attention(attention, x, rope, cache, index, batch, mask)
        h = h + out
        h = h + layer.mlp(layer.ffn_norm(h))
    return model.norm(h)


def _gqa_attention(
    att: Attention,
    x: torch.Tensor,
    rope: tuple[torch.Tensor, torch.Tensor],
    cache: BlockKVCache,
    layer: int,
    batch: CachedBatch,
    mask: torch.Tensor,
) -> torch.Tensor:
    size, new, _ = x.shape
    q = att.wq(x).view(size, new, -1, att.head_dim)
    k = att.wk(x).view(size, new, -1, att.head_dim)
    v = att.wv(x).view(size, new, -1, att.head_dim)
    if att.qk_norm:
        q, k = att.q_norm(q), att.k_norm(k)
    q, k = apply_rope(q.transpose(1, 2), *rope), apply_rope(k.transpose(1, 2), *rope)
    cache.write(layer, batch.write_slots, k.transpose(1, 2), v)
    keys, values = (t.transpose(1, 2).to(q.dtype) for t in cache.read(layer, batch.read_slots))
    out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=True)
    return att.wo(out.transpose(1, 2).reshape(size, new, -1))


def _latent_attention(
    att: LatentAttention,
    x: torch.Tensor,
    rope: tuple[torch.Tensor, torch.Tensor],
    cache: BlockKVCache,
    layer: int,
    batch: CachedBatch,
    mask: torch.Tensor,
) -> torch.Tensor:
    mla = att.mla
    size, new, _ = x.shape
    q = att.wq(x) if mla.q_lora_rank is None else att.wq_b(att.q_a_norm(att.wq_a(x)))
    q = q.view(size, new, -1, mla.qk_head_dim).transpose(1, 2)
    q_nope, q_rope = q.split([mla.qk_nope_head_dim, mla.qk_rope_head_dim], dim=-1)
    latent, k_rope = att.wkv_a(x).split([mla.kv_lora_rank, mla.qk_rope_head_dim], dim=-1)
    k_rope = k_rope.unsqueeze(1)
    if mla.rope_interleave:
        q_rope, k_rope = deinterleave(q_rope), deinterleave(k_rope)
    q = torch.cat((q_nope, apply_rope(q_rope, *rope)), dim=-1)
    cache.write(layer, batch.write_slots, att.kv_a_norm(latent), apply_rope(k_rope, *rope)[:, 0])
    latents, rope_keys = (t.to(q.dtype) for t in cache.read(layer, batch.read_slots))
    length = latents.shape[1]
    kv = att.wkv_b(latents).view(size, length, -1, mla.qk_nope_head_dim + mla.v_head_dim)
    k_nope, v = kv.transpose(1, 2).split([mla.qk_nope_head_dim, mla.v_head_dim], dim=-1)
    k = torch.cat((k_nope, rope_keys.unsqueeze(1).expand(-1, k_nope.shape[1], -1, -1)), dim=-1)
    if att.q_scale != 1.0:
        q = q * att.q_scale
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    return att.wo(out.transpose(1, 2).reshape(size, new, -1))
