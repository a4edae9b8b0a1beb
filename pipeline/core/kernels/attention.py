"""Scaled dot-product attention behind one function, so the model never names a backend.

Layout is SDPA's: q `[batch, heads, seq, head_dim]`, k/v `[batch, kv_heads, seq, head_dim]`.
Grouped-query attention is handled here (kv heads are shared by groups of query heads), and so is
document masking: with `document_ids` (one id per token) a token attends only to earlier tokens of
the same document, which is how Megatron's `reset_attention_mask` treats packed sequences.

Backends: "sdpa" (torch's `scaled_dot_product_attention`, which itself picks flash /
memory-efficient / math kernels; the reference, on CPU and GPU), "flex" (torch's `flex_attention`
over a block mask of the documents, compiled on CUDA; `pipeline.core.kernels.flex_attention`) and
"flash_attn" (the flash-attn package, CUDA, fp16/bf16, no document masking yet). Each backend
imports its package inside its function, so its absence costs nothing until it is asked for, and
each has a test against "sdpa" (flex's backward and flash-attn's run on a GPU). `auto` chooses
by measurement (`pipeline.core.kernels.attention_choice`). Transformer Engine attention joins
with the FP8 work.

ALiBi (`alibi_slopes`, one slope a head: `pipeline.core.model.alibi`) reaches every backend:
SDPA adds the bias to its mask (a float mask, -inf where the boolean one says no), flex as a
score modifier, flash-attn through its own `alibi_slopes`. The bias is built from `positions`
(queries', keys'), by default the indices of the sequence.

Two per-layer options reach every backend too: a sliding `window` (a query sees itself and the
`window - 1` tokens before it, as Hugging Face's sliding-window layers do) and attention `sinks`
(gpt-oss: one learned logit per head, an extra softmax column whose value is dropped). SDPA
serves sinks as one more key of zeros whose additive mask is the head's sink logit
(`masked_sdpa`); flex from its log-sum-exp (`pipeline.core.kernels.flex_attention`); flash-attn
takes the window itself and leaves sinks to SDPA (its log-sum-exp carries no gradient). No
family has ALiBi with either, and the two are refused together.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from pipeline.core.kernels import cpu_decode_attention
from pipeline.core.kernels.attention_choice import (
    AttentionShape,
    BackendChoice,
    auto_backend,
    cache_path,
)
from pipeline.core.model.alibi import alibi_bias

Positions = tuple[torch.Tensor, torch.Tensor]


def document_causal_mask(document_ids: torch.Tensor) -> torch.Tensor:
    """Boolean mask `[batch, 1, seq, seq]`: True where query i may attend to key j, that is
    j <= i and both tokens belong to the same document."""
    seq_len = document_ids.shape[-1]
    same_doc = document_ids[:, :, None] == document_ids[:, None, :]
    causal = torch.ones(seq_len, seq_len, dtype=torch.bool, device=document_ids.device).tril()
    return (same_doc & causal).unsqueeze(1)


def training_mask(
    seq_len: int,
    document_ids: torch.Tensor | None,
    window: int | None,
    device: torch.device,
) -> torch.Tensor:
    """Boolean mask `[batch or 1, 1, seq, seq]` of causal attention within documents (when
    `document_ids` is given) and within `window` tokens (when set)."""
    if document_ids is not None:
        mask = document_causal_mask(document_ids)
    else:
        mask = torch.ones(seq_len, seq_len, dtype=torch.bool, device=device).tril()[None, None]
    if window is not None:
        mask = mask & window_mask(torch.arange(seq_len, device=device), window)
    return mask


def window_mask(positions: torch.Tensor, window: int, keys: torch.Tensor | None = None):
    """True where a query at `positions[i]` may see a key at `keys[j]` (default: the same
    positions) under a sliding window: the key is fewer than `window` tokens back."""
    keys = positions if keys is None else keys
    return (positions[..., :, None] - keys[..., None, :]) < window


def masked_sdpa(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """SDPA under a boolean `mask` (None: every key), with attention `sinks` (`[heads]`, one
    logit per query head) as an extra key of zeros whose additive mask is the sink logit: the
    softmax then has the sink's column, and its zero value adds nothing to the output."""
    gqa = q.shape[1] != k.shape[1]
    if sinks is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)
    batch, heads, queries, _ = q.shape
    k = torch.cat((k, k.new_zeros(*k.shape[:2], 1, k.shape[3])), dim=2)
    v = torch.cat((v, v.new_zeros(*v.shape[:2], 1, v.shape[3])), dim=2)
    keys = k.shape[2] - 1
    if mask is None:
        bias = q.new_zeros(1, 1, queries, keys)
    else:
        bias = q.new_zeros(mask.shape).masked_fill(~mask, float("-inf"))
    bias = bias.expand(batch, heads, queries, keys)
    sink = sinks.to(q.dtype).view(1, heads, 1, 1).expand(batch, heads, queries, 1)
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=torch.cat((bias, sink), dim=-1), enable_gqa=gqa
    )


def sequence_positions(q: torch.Tensor, k: torch.Tensor) -> Positions:
    """Query and key positions `[1, seq]` when both are the indices of one sequence."""
    return (
        torch.arange(q.shape[2], device=q.device)[None],
        torch.arange(k.shape[2], device=k.device)[None],
    )


def alibi_sdpa(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    allowed: torch.Tensor | None,
    slopes: torch.Tensor,
    positions: Positions | None = None,
) -> torch.Tensor:
    """SDPA with ALiBi: the bias of `slopes` at `positions` (default: the indices) as a float
    mask, -inf where the boolean mask `allowed` (None: everywhere allowed) says no."""
    query_positions, key_positions = positions or sequence_positions(q, k)
    bias = alibi_bias(slopes, query_positions, key_positions)
    if allowed is not None:
        bias = bias.masked_fill(~allowed, float("-inf"))
    gqa = q.shape[1] != k.shape[1]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=bias.to(q.dtype), enable_gqa=gqa)


def _sdpa(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool,
    document_ids: torch.Tensor | None,
    mask: torch.Tensor | None,
    alibi_slopes: torch.Tensor | None = None,
    positions: Positions | None = None,
    window: int | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    gqa = q.shape[1] != k.shape[1]
    # One query per row over a cache, on a CPU: pipe's own kernel (its module says when).
    if cpu_decode_attention.serves(
        q, k, v, mask, causal=causal, document_ids=document_ids, alibi_slopes=alibi_slopes,
        window=window,
    ):  # fmt: skip
        return cpu_decode_attention.decode_attention(q, k, v, mask, sinks)
    if alibi_slopes is not None and (window is not None or sinks is not None):
        raise ValueError("ALiBi with sliding windows or sinks is not supported")
    if window is not None or sinks is not None:
        if mask is None and causal:
            mask = training_mask(q.shape[2], document_ids, window, q.device)
        elif mask is None and (document_ids is not None or window is not None):
            raise ValueError("document masking and windows are only defined for causal attention")
        return masked_sdpa(q, k, v, mask, sinks)
    if alibi_slopes is not None:
        if mask is None and document_ids is not None:
            if not causal:
                raise ValueError("document masking is only defined for causal attention")
            mask = document_causal_mask(document_ids)
        elif mask is None and causal:
            mask = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool, device=q.device).tril()
        return alibi_sdpa(q, k, v, mask, alibi_slopes, positions)
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
    alibi_slopes: torch.Tensor | None = None,
    positions: Positions | None = None,
    window: int | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    if sinks is not None:  # flash-attn's log-sum-exp has no backward: SDPA's exact path
        return _sdpa(
            q,
            k,
            v,
            causal=causal,
            document_ids=document_ids,
            mask=mask,
            window=window,
            sinks=sinks,
        )
    if alibi_slopes is not None and positions is not None:
        raise ValueError("attention backend flash_attn takes no explicit positions; use sdpa")
    try:
        from flash_attn import flash_attn_func
    except ImportError as e:
        raise ImportError("attention backend flash_attn needs: pip install 'pipe-llm[gpu]'") from e
    if document_ids is not None:
        raise ValueError("attention backend flash_attn has no document masking yet; use sdpa")
    if mask is not None:
        raise ValueError("attention backend flash_attn takes no explicit mask; use sdpa")
    # flash-attn takes [batch, seq, heads, head_dim] and handles grouped kv heads itself; its
    # ALiBi adds -slope * |i - j|, which is slope * (j - i) for the keys a causal query sees.
    slopes = None if alibi_slopes is None else alibi_slopes.float()
    # A window of w: each query sees w - 1 keys back and none ahead.
    window_size = (-1, -1) if window is None else (window - 1, 0)
    out = flash_attn_func(
        q.transpose(1, 2),
        k.transpose(1, 2),
        v.transpose(1, 2),
        causal=causal,
        alibi_slopes=slopes,
        window_size=window_size,
    )
    return out.transpose(1, 2)


def _flex(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool,
    document_ids: torch.Tensor | None,
    mask: torch.Tensor | None,
    alibi_slopes: torch.Tensor | None = None,
    positions: Positions | None = None,
    window: int | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    # Cached decoding (an explicit mask or positions) and latent attention (values narrower
    # than keys) are sdpa's: flex here serves causal training attention.
    if mask is not None or not causal or q.shape[-1] != v.shape[-1] or positions is not None:
        return _sdpa(
            q,
            k,
            v,
            causal=causal,
            document_ids=document_ids,
            mask=mask,
            alibi_slopes=alibi_slopes,
            positions=positions,
            window=window,
            sinks=sinks,
        )
    from pipeline.core.kernels.flex_attention import flex_attention

    if alibi_slopes is not None and (window is not None or sinks is not None):
        raise ValueError("ALiBi with sliding windows or sinks is not supported")
    extra = {"window": window, "sinks": sinks, "alibi_slopes": alibi_slopes}
    return flex_attention(
        q, k, v, document_ids, **{k: v for k, v in extra.items() if v is not None}
    )


_BACKENDS: dict[str, Callable[..., torch.Tensor]] = {
    "sdpa": _sdpa,
    "flex": _flex,
    "flash_attn": _flash_attn,
}
BACKENDS = tuple(_BACKENDS)


def choose_backend(
    name: str,
    *,
    device: torch.device,
    document_masking: bool,
    shape: AttentionShape | None = None,
) -> BackendChoice:
    """The backend a run uses and why: an explicit name as given; `auto` the measured choice for
    this GPU and `shape`, else the default rule (`pipeline.core.kernels.attention_choice`)."""
    if name != "auto":
        if name not in _BACKENDS:
            raise ValueError(
                f"unknown attention backend {name!r}; have auto, {', '.join(BACKENDS)}"
            )
        return BackendChoice(name, "asked for")
    choice = auto_backend(device, document_masking, shape)
    if choice.backend not in _BACKENDS:
        raise ValueError(
            f"{cache_path()}: unknown attention backend {choice.backend!r} recorded; delete it"
        )
    return choice


def resolve_backend(name: str, *, device: torch.device, document_masking: bool) -> str:
    """The name of `choose_backend`'s backend (no shape: `auto`'s default rule)."""
    return choose_backend(name, device=device, document_masking=document_masking).backend


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = True,
    document_ids: torch.Tensor | None = None,
    mask: torch.Tensor | None = None,
    backend: str = "sdpa",
    alibi_slopes: torch.Tensor | None = None,
    positions: Positions | None = None,
    window: int | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Softmax attention with 1/sqrt(head_dim) scaling; returns `[batch, heads, seq, head_dim]`.

    `document_ids` (`[batch, seq]`, any integer ids) restricts attention to tokens of the same
    document; without it the mask is plain causal (or none when `causal=False`). An explicit
    boolean `mask` (`[batch, 1, q_seq, k_seq]`, True: may attend) replaces both: cached decoding,
    where the queries are the last of the keys and rows have their own lengths.
    `alibi_slopes` (`[heads]`): ALiBi's bias at `positions` (queries' `[batch or 1, q_seq]`,
    keys' `[batch or 1, k_seq]`; default: the indices of one sequence). `window`: each query
    sees keys fewer than `window` tokens back (with an explicit `mask`, the mask's business);
    `sinks` (`[heads]`): one extra softmax logit per head (see the module docstring).
    """
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"{q.shape[1]} query heads are not a multiple of {k.shape[1]} kv heads")
    try:
        fn = _BACKENDS[backend]
    except KeyError:
        raise ValueError(
            f"unknown attention backend {backend!r}; have {sorted(_BACKENDS)}"
        ) from None
    # Only the options given, so each backend keeps the call it took before they existed.
    options = {"alibi_slopes": alibi_slopes, "window": window, "sinks": sinks}
    options = {name: value for name, value in options.items() if value is not None}
    if alibi_slopes is not None:
        options["positions"] = positions
    return fn(q, k, v, causal=causal, document_ids=document_ids, mask=mask, **options)
