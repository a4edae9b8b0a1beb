"""Scaled dot-product attention behind one function, so the model never names a backend.

Layout is SDPA's: q `[batch, heads, seq, head_dim]`, k/v `[batch, kv_heads, seq, head_dim]`.
Grouped-query attention is handled here (kv heads are shared by groups of query heads), and so is
document masking: with `document_ids` (one id per token) a token attends only to earlier tokens of
the same document, which is how Megatron's `reset_attention_mask` treats packed sequences.

Backends: "sdpa" (torch's `scaled_dot_product_attention`, which itself picks flash /
memory-efficient / math kernels; the reference, on CPU and GPU) and "flash_attn" (the flash-attn
package, CUDA, fp16/bf16, no document masking yet). Each backend imports its package inside its
function, so its absence costs nothing until it is asked for, and each has a test against "sdpa"
(the flash-attn one runs on a GPU). Transformer Engine attention joins with the FP8 work.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F


def document_causal_mask(document_ids: torch.Tensor) -> torch.Tensor:
    """Boolean mask `[batch, 1, seq, seq]`: True where query i may attend to key j, that is
    j <= i and both tokens belong to the same document."""
    seq_len = document_ids.shape[-1]
    same_doc = document_ids[:, :, None] == document_ids[:, None, :]
    causal = torch.ones(seq_len, seq_len, dtype=torch.bool, device=document_ids.device).tril()
    return (same_doc & causal).unsqueeze(1)


def _sdpa(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool,
    document_ids: torch.Tensor | None,
    mask: torch.Tensor | None,
) -> torch.Tensor:
    gqa = q.shape[1] != k.shape[1]
    if mask is not None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)
    if document_ids is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=gqa)
    if not causal:
        raise ValueError("document masking is only defined for causal attention")
    mask = document_causal_mask(document_ids)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)


def _flash_attn(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool,
    document_ids: torch.Tensor | None,
    mask: torch.Tensor | None,
) -> torch.Tensor:
    try:
        from flash_attn import flash_attn_func
    except ImportError as e:
        raise ImportError("attention backend flash_attn needs: pip install 'pipe-llm[gpu]'") from e
    if document_ids is not None:
        raise ValueError("attention backend flash_attn has no document masking yet; use sdpa")
    if mask is not None:
        raise ValueError("attention backend flash_attn takes no explicit mask; use sdpa")
    # flash-attn takes [batch, seq, heads, head_dim] and handles grouped kv heads itself.
    out = flash_attn_func(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=causal)
    return out.transpose(1, 2)


_BACKENDS: dict[str, Callable[..., torch.Tensor]] = {"sdpa": _sdpa, "flash_attn": _flash_attn}
BACKENDS = tuple(_BACKENDS)


def resolve_backend(name: str, *, device: torch.device, document_masking: bool) -> str:
    """The backend a run uses: `auto` picks flash_attn on CUDA when it is installed and no
    document masking is asked for, else sdpa; an explicit name is kept as given."""
    if name != "auto":
        if name not in _BACKENDS:
            raise ValueError(
                f"unknown attention backend {name!r}; have auto, {', '.join(BACKENDS)}"
            )
        return name
    if device.type != "cuda" or document_masking:
        return "sdpa"
    try:
        import flash_attn  # noqa: F401
    except ImportError:
        return "sdpa"
    return "flash_attn"


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = True,
    document_ids: torch.Tensor | None = None,
    mask: torch.Tensor | None = None,
    backend: str = "sdpa",
) -> torch.Tensor:
    """Softmax attention with 1/sqrt(head_dim) scaling; returns `[batch, heads, seq, head_dim]`.

    `document_ids` (`[batch, seq]`, any integer ids) restricts attention to tokens of the same
    document; without it the mask is plain causal (or none when `causal=False`). An explicit
    boolean `mask` (`[batch, 1, q_seq, k_seq]`, True: may attend) replaces both: cached decoding,
    where the queries are the last of the keys and rows have their own lengths.
    """
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"{q.shape[1]} query heads are not a multiple of {k.shape[1]} kv heads")
    try:
        fn = _BACKENDS[backend]
    except KeyError:
        raise ValueError(
            f"unknown attention backend {backend!r}; have {sorted(_BACKENDS)}"
        ) from None
    return fn(q, k, v, causal=causal, document_ids=document_ids, mask=mask)
