"""Context parallelism: split one long sequence over `cp_size` ranks and attend over all of it.

Layout (Megatron's causal load balancing): the sequence is cut into `2 * cp_size` equal chunks
and cp rank r holds chunks r and `2 * cp_size - 1 - r`. Under a causal mask the early chunks are
cheap and the late ones expensive, so pairing them gives every rank the same attention work.
Everything outside attention (embeddings, norms, MLPs, the loss) is per token and needs no
communication; RoPE needs each token's *global* position, which `cp_position_ids` gives, and
so does ALiBi, whose biases the attention builds from the global positions of its queries and of
the gathered keys.

Attention is exact: each rank all-gathers K and V from the cp group (an autograd-aware gather
whose backward sends each rank the summed gradient of its own K/V shard) and runs SDPA for its
local queries against every key, with a mask built from global positions. This is simple, runs on
CPU with gloo, and costs one full K/V per rank in memory; a ring (overlapped, O(local) memory)
variant is not written yet. It is a hand-written collective because torch has no CPU-capable
context-parallel attention; `torch.distributed.tensor.experimental`'s
`context_parallel` is CUDA-only.

Parameter gradients of a cp rank are partial sums over its tokens: all-reduce them over the cp
group (in Megatron, over data x context parallel ranks together) before the optimizer step.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from pipeline.core.kernels.attention import alibi_sdpa, masked_sdpa, window_mask
from pipeline.core.model.block import Attention, LatentAttention


def _chunk_ids(cp_rank: int, cp_size: int) -> tuple[int, int]:
    """The two of the `2 * cp_size` sequence chunks that cp rank `cp_rank` holds."""
    if not 0 <= cp_rank < cp_size:
        raise ValueError(f"cp_rank {cp_rank} is outside 0..{cp_size - 1}")
    return cp_rank, 2 * cp_size - 1 - cp_rank


def _check_divisible(seq_len: int, cp_size: int) -> int:
    """Chunk length; the sequence must split into `2 * cp_size` equal chunks."""
    if seq_len % (2 * cp_size):
        raise ValueError(
            f"sequence length {seq_len} is not divisible by 2 * cp_size = {2 * cp_size}"
        )
    return seq_len // (2 * cp_size)


def shard_sequence(tensor: torch.Tensor, cp_rank: int, cp_size: int, dim: int = 1) -> torch.Tensor:
    """This cp rank's part of `tensor` along `dim`: chunks r and 2*cp-1-r, concatenated.

    Use it on tokens, labels, loss masks, position and document ids alike (dim 1 of `[b, s]`).
    """
    if cp_size == 1:
        return tensor
    _check_divisible(tensor.shape[dim], cp_size)
    chunks = tensor.chunk(2 * cp_size, dim=dim)
    first, second = _chunk_ids(cp_rank, cp_size)
    return torch.cat((chunks[first], chunks[second]), dim=dim)


def unshard_sequence(shards: Sequence[torch.Tensor], cp_size: int, dim: int = 1) -> torch.Tensor:
    """Inverse of `shard_sequence`: the full tensor from every rank's shard, in cp rank order."""
    if len(shards) != cp_size:
        raise ValueError(f"need {cp_size} shards, got {len(shards)}")
    if cp_size == 1:
        return shards[0]
    chunks: list[torch.Tensor | None] = [None] * (2 * cp_size)
    for rank, shard in enumerate(shards):
        first, second = _chunk_ids(rank, cp_size)
        chunks[first], chunks[second] = shard.chunk(2, dim=dim)
    return torch.cat(chunks, dim=dim)  # type: ignore[arg-type]


def cp_position_ids(
    seq_len: int, cp_rank: int, cp_size: int, device: torch.device | str | None = None
) -> torch.Tensor:
    """Global positions `[seq_len // cp_size]` of this rank's tokens in a `seq_len` sequence.

    Pass them (expanded to `[batch, local_seq]`) as the model's `position_ids` so RoPE rotates
    each token by its place in the whole sequence, not in the local shard.
    """
    return shard_sequence(torch.arange(seq_len, device=device), cp_rank, cp_size, dim=0)


class _AllGatherSeq(torch.autograd.Function):
    """All-gather along the sequence dim (2) in cp rank order; backward sums the gradients of
    the gathered tensor over ranks and returns each rank the slice of its own shard."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:  # type: ignore[override]
        ctx.group = group
        ctx.rank = dist.get_rank(group)
        ctx.local = x.shape[2]
        parts = [
            torch.empty_like(x, memory_format=torch.contiguous_format)
            for _ in range(dist.get_world_size(group))
        ]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim=2)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        grad = grad.contiguous()
        # gloo has no reduce_scatter: sum everything, keep our slice (exact, more traffic).
        dist.all_reduce(grad, group=ctx.group)
        start = ctx.rank * ctx.local
        return grad.narrow(2, start, ctx.local).contiguous(), None


def all_gather_sequence(x: torch.Tensor, cp_group: dist.ProcessGroup | None) -> torch.Tensor:
    """`[b, h, local, d]` from every cp rank -> `[b, h, cp * local, d]` in rank order (autograd)."""
    return _AllGatherSeq.apply(x, cp_group)


def _gather_document_ids(
    document_ids: torch.Tensor, cp_group: dist.ProcessGroup | None, cp_size: int
) -> torch.Tensor:
    """Local `[b, local]` document ids -> `[b, cp * local]` in cp rank order (no gradient)."""
    parts = [torch.empty_like(document_ids) for _ in range(cp_size)]
    dist.all_gather(parts, document_ids.contiguous(), group=cp_group)
    return torch.cat(parts, dim=1)


def context_parallel_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cp_group: dist.ProcessGroup | None,
    cp_rank: int,
    cp_size: int,
    *,
    causal: bool = True,
    document_ids: torch.Tensor | None = None,
    window: int | None = None,
    sinks: torch.Tensor | None = None,
    alibi_slopes: torch.Tensor | None = None,
) -> torch.Tensor:
    """Exact attention of this rank's queries over the whole context (all-gather of K/V).

    q `[b, heads, local, d]`, k/v `[b, kv_heads, local, d]` hold this rank's load-balanced
    shard (see `shard_sequence`); the result `[b, heads, local, d]` is this rank's shard of
    full-sequence attention. `document_ids` `[b, local]` (sharded the same way) restricts each
    query to earlier keys of its own document; `window` to keys fewer than `window` global
    positions back; `sinks` (`[heads]`) add one softmax logit per head (gpt-oss).
    `alibi_slopes` (`[heads]`, this rank's heads): ALiBi's bias at the global positions of the
    queries and keys.
    """
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"{q.shape[1]} query heads are not a multiple of {k.shape[1]} kv heads")
    if document_ids is not None and not causal:
        raise ValueError("document masking is only defined for causal attention")
    gqa = q.shape[1] != k.shape[1]
    if cp_size == 1:
        k_all, v_all = k, v
    else:
        k_all, v_all = all_gather_sequence(k, cp_group), all_gather_sequence(v, cp_group)
    if not causal:
        if window is not None:
            raise ValueError("a sliding window is only defined for causal attention")
        if alibi_slopes is not None:
            raise ValueError("context-parallel ALiBi is defined for causal attention")
        return masked_sdpa(q, k_all, v_all, None, sinks)
    local = q.shape[2]
    seq_len = local * cp_size
    q_pos = cp_position_ids(seq_len, cp_rank, cp_size, device=q.device)
    k_pos = torch.cat(
        [cp_position_ids(seq_len, r, cp_size, device=q.device) for r in range(cp_size)]
    )
    mask = (q_pos[:, None] >= k_pos[None, :])[None, None]  # [1, 1, local, seq]
    if window is not None:
        mask = mask & window_mask(q_pos, window, k_pos)
    if document_ids is not None:
        docs_all = (
            document_ids if cp_size == 1 else _gather_document_ids(document_ids, cp_group, cp_size)
        )
        mask = mask & (document_ids[:, :, None] == docs_all[:, None, :]).unsqueeze(1)
    if sinks is not None:
        return masked_sdpa(q, k_all, v_all, mask, sinks)
    if alibi_slopes is not None:
        return alibi_sdpa(q, k_all, v_all, mask, alibi_slopes, (q_pos[None], k_pos[None]))
    return F.scaled_dot_product_attention(q, k_all, v_all, attn_mask=mask, enable_gqa=gqa)


class ContextParallelAttention(nn.Module):
    """The attention kernel of a context-parallel model (`context_parallel_attention` over
    `cp_group`); `apply_context_parallel` puts one at each `Attention.kernel`, keeping the
    layer's sliding `window`."""

    def __init__(
        self,
        cp_group: dist.ProcessGroup | None,
        cp_rank: int,
        cp_size: int,
        window: int | None = None,
    ) -> None:
        super().__init__()
        self.cp_group, self.cp_rank, self.cp_size = cp_group, cp_rank, cp_size
        self.window = window

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        document_ids: torch.Tensor | None,
        sinks: torch.Tensor | None = None,
        alibi_slopes: torch.Tensor | None = None,
    ) -> torch.Tensor:
        return context_parallel_attention(
            q,
            k,
            v,
            self.cp_group,
            self.cp_rank,
            self.cp_size,
            document_ids=document_ids,
            window=self.window,
            sinks=sinks,
            alibi_slopes=alibi_slopes,
        )

    def extra_repr(self) -> str:
        return f"cp_rank={self.cp_rank}, cp_size={self.cp_size}"


def apply_context_parallel(
    model: nn.Module, cp_group: dist.ProcessGroup | None, cp_rank: int, cp_size: int
) -> nn.Module:
    """Make every attention module in `model` (grouped-query or latent: each calls its
    `kernel`) attend over the whole cp-sharded context, in place, by swapping its kernel for a
    `ContextParallelAttention`.

    The model's inputs must then be this rank's shards (`shard_sequence`) with global
    `position_ids` (`cp_position_ids`).
    """
    for module in model.modules():
        if isinstance(module, (Attention, LatentAttention)):
            window = getattr(module.kernel, "window", None)
            module.kernel = ContextParallelAttention(cp_group, cp_rank, cp_size, window)
    return model
