"""Attention of one new token per row over its cached keys on a CPU, in pipe's own C kernel.

A decode step attends each row's one query over that row's history. torch's CPU attention does
this head by head, two small matrix products each with a fixed set-up cost, and over a 32-row
step of the serving benchmark's model it ran at about a quarter of what memory allows (0.75 ms a
layer for 32 rows of 100 keys, near a third of the step; docs/benchmarks.md, "Serving").
Written with torch's own operations instead (a batched product of each key head's query heads,
broadcast products) it was no faster, and torch exports no lower-level kernel. vLLM's CPU build
has its own. So this one is C (`cpu_decode_attention.c`, built for the machine on first use by
`pipeline.common.native_library`): it streams each row's keys once for all heads, then its
values, and takes about half torch's time there (0.53x at 32 rows of 100 keys).

The kernel runs on the calling thread alone, so it is used only where torch computes on one
thread (`pipe serve`'s engine on a 2-core machine, where the other core serves HTTP): on N
threads SDPA spreads the rows and heads over them and takes about 1/N of its one-thread time,
which beats the kernel's half from two threads on.

`serves` says when it applies: float32 tensors on a CPU, one query per row, no gradient, no
ALiBi, one torch thread, under torch's eager mode (a compiled graph keeps torch's attention).
Otherwise, or when no library could be built, `pipeline.core.kernels.attention` runs SDPA as
before. Its results differ from SDPA's in the last bits (another order of summation), and a
row's are the same whatever else is in the batch.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from pipeline.common import native_library

SOURCE = Path(__file__).with_name("cpu_decode_attention.c")

_i64, _ptr, _f32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float
_ARGUMENTS = (
    [_i64] * 6  # rows, heads, kv_heads, qk_dim, v_dim, length
    + [_ptr, _i64, _i64]  # q and its row and head strides
    + [_ptr, _i64, _i64, _i64] * 2  # k, v and their row, position and head strides
    + [_ptr, _i64, _i64]  # mask and its row and position strides
    + [_ptr, _f32]  # sinks, scale
    + [_ptr, _i64, _i64]  # out and its row and head strides
    + [_ptr] * 4  # scratch: scores, acc, top, total
)


def kernel():
    """The compiled C function, or None (no compiler, or native kernels switched off)."""
    library = native_library.load(SOURCE)
    if library is None:
        return None
    function = library.pipe_decode_attention_f32
    if function.argtypes is None:
        function.argtypes, function.restype = _ARGUMENTS, None
    return function


def serves(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    *,
    causal: bool,
    document_ids: torch.Tensor | None,
    alibi_slopes: torch.Tensor | None,
    window: int | None,
) -> bool:
    """Whether `decode_attention` takes this call (module docstring): queries `[rows, heads, 1,
    head_dim]` over keys and values `[rows, kv_heads, length, *]`, under a boolean `mask`
    `[rows or 1, 1, 1, length]` or none, without causal or document masking."""
    # Plain checks in sequence: this runs for every attention call of a decode step.
    if causal or document_ids is not None or alibi_slopes is not None or window is not None:
        return False
    if q.dim() != 4 or q.shape[2] != 1 or q.shape[-1] != k.shape[-1]:
        return False
    for t in (q, k, v):  # not a DTensor or fake tensor; on a CPU; float32
        if type(t) is not torch.Tensor or not t.is_cpu or t.dtype != torch.float32:
            return False
    if mask is not None and (
        mask.dtype != torch.bool or mask.dim() != 4 or mask.shape[1] != 1 or mask.shape[2] != 1
    ):
        return False
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        return False
    if torch.get_num_threads() != 1:  # SDPA spreads rows and heads over the threads
        return False
    return not torch.compiler.is_compiling() and kernel() is not None


def decode_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """softmax(q k^T / sqrt(head_dim)) v for `q` `[rows, heads, 1, head_dim]` over `k`, `v`
    `[rows, kv_heads, length, *]` (any strides), under a boolean `mask` broadcast to `[rows, 1,
    1, length]` (None: every key) and with `sinks` (`[heads]`, extra softmax logits); what
    `masked_sdpa` computes, as `[rows, heads, 1, v_dim]`."""
    function = kernel()
    if function is None:
        raise RuntimeError(f"{SOURCE.name} is not built; check `serves` first")
    rows, heads, _, qk_dim = q.shape
    _, kv_heads, length, v_dim = v.shape
    if k.shape[:3] != (rows, kv_heads, length) or v.shape[0] != rows or heads % kv_heads:
        raise ValueError(f"shapes q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    if q.stride(3) != 1 or k.stride(3) != 1 or v.stride(3) != 1:
        q, k, v = (t.contiguous() for t in (q, k, v))
    out = q.new_empty(rows, heads, 1, v_dim)
    if rows == 0 or length == 0:
        return out.zero_()
    if mask is None:
        mask_args = (None, 0, 0)
    else:
        if mask.dtype != torch.bool:
            raise ValueError(f"the mask is {mask.dtype}, not torch.bool")
        mask = mask.expand(rows, 1, 1, length)
        mask_args = (mask.data_ptr(), mask.stride(0), mask.stride(3))
    if sinks is not None:
        sinks = sinks.detach().to(torch.float32).contiguous()
        if sinks.shape != (heads,):
            raise ValueError(f"sinks {tuple(sinks.shape)} for {heads} heads")
    padded = -(-length // 16) * 16  # the kernel's `score_stride`: whole vectors of scores
    scratch = q.new_empty(heads * (padded + v_dim + 2))
    # scores, acc, top and total, end to end (addresses: cheaper than four views)
    scores = scratch.data_ptr()
    acc = scores + 4 * heads * padded
    top = acc + 4 * heads * v_dim
    total = top + 4 * heads
    function(
        rows, heads, kv_heads, qk_dim, v_dim, length,
        q.data_ptr(), q.stride(0), q.stride(1),
        k.data_ptr(), k.stride(0), k.stride(2), k.stride(1),
        v.data_ptr(), v.stride(0), v.stride(2), v.stride(1),
        *mask_args,
        None if sinks is None else sinks.data_ptr(), qk_dim**-0.5,
        out.data_ptr(), out.stride(0), out.stride(1),
        scores, acc, top, total,
    )  # fmt: skip
    return out
