"""Attention kernels with document masking: forward + backward time of each backend, one run.

A packed training sequence holds several documents, and a token may attend only to earlier
tokens of its own document (Megatron's `reset_attention_mask`). This benchmark times, on the
same q/k/v and the same documents, every way pipe and torch (and flash-attn, where installed)
offer to compute that:

- `pipe:<backend>` for each of pipe's backends (sdpa, flex, flash_attn), through pipe's
  `attention(...)`, as the model calls it. They run first: they are what `--record` needs.
- `sdpa:<kernel>` for each of SDPA's kernels (cuDNN, flash, memory-efficient, math) forced with
  `sdpa_kernel`, given the boolean document mask pipe's `sdpa` backend builds. A kernel that
  refuses the mask (flash takes none) is listed with torch's reason, not left out.
- `flex`: pipe's compiled `flex_attention` with its block mask built from the document ids on
  every call, where `pipe:flex` builds it once per batch (the same kernel: no second compile).
- `flash_attn:varlen`: flash-attn's variable-length kernel on the documents' cumulative lengths.
- `sdpa:causal` (plain causal, no document mask): the speed bound the masked kernels chase.

Every masked kernel's output and q/k/v gradients are checked against `pipe:sdpa`'s
(`max_rel_err`: the largest difference over the largest value). Each is warmed up, then timed
over `--repeat` forward + backward passes; printed in ms and as the ratio to the fastest masked
kernel. Shapes default to Llama 3 8B's attention (32 query heads, 8 kv heads, head dim 128) at
sequence 8192 in bf16 on CUDA. `--record` writes the fastest of pipe's backends (among those that
agree with sdpa) for this GPU and shape into pipe's cache, where `training.attention_backend =
auto` reads it (`pipeline.core.kernels.attention_choice`).

    python scripts/bench/attention.py [--seq 8192] [--heads 32 --kv-heads 8 --head-dim 128]
        [--doc-len 1024] [--device cuda|cpu] [--record [FILE]] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))


def document_ids(seq: int, mean_len: int, device: torch.device) -> torch.Tensor:
    """`[1, seq]` ids of documents with lengths drawn around `mean_len` (seeded)."""
    import torch

    generator = torch.Generator().manual_seed(0)
    lengths: list[int] = []
    while sum(lengths) < seq:
        lengths.append(int(torch.randint(mean_len // 4, 2 * mean_len, (1,), generator=generator)))
    lengths[-1] -= sum(lengths) - seq
    ids = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    return ids[None].to(device)


def _sdpa_kernel(kernel_name: str, masked: bool) -> Callable:
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from pipeline.core.kernels.attention import document_causal_mask

    kernel = getattr(SDPBackend, kernel_name)

    def run(q, k, v, docs):
        with sdpa_kernel([kernel]):
            if not masked:
                return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
            mask = document_causal_mask(docs)
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)

    return run


def _flex() -> Callable:
    from pipeline.core.kernels.flex_attention import clear_block_masks, flex_attention

    def run(q, k, v, docs):
        clear_block_masks()  # built on every call: what pipe:flex's once-per-batch mask saves
        return flex_attention(q, k, v, docs)

    return run


def _flash_attn_varlen() -> Callable:
    import torch
    from flash_attn import flash_attn_varlen_func

    def run(q, k, v, docs):
        lengths = torch.unique_consecutive(docs[0], return_counts=True)[1]
        cu = torch.nn.functional.pad(lengths.cumsum(0), (1, 0)).to(torch.int32)
        longest = int(lengths.max())
        out = flash_attn_varlen_func(
            q[0].transpose(0, 1),
            k[0].transpose(0, 1),
            v[0].transpose(0, 1),
            cu,
            cu,
            longest,
            longest,
            causal=True,
        )
        return out.transpose(0, 1)[None]

    return run


def _pipe(backend: str) -> Callable:
    from pipeline.core.kernels.attention import attention

    def run(q, k, v, docs):
        return attention(q, k, v, document_ids=docs, backend=backend)

    return run


def pipe_candidates() -> dict[str, Callable[[], Callable]]:
    """pipe's own backends, `pipe:sdpa` (the reference the others are checked against) first."""
    from pipeline.core.kernels.attention import BACKENDS

    return {f"pipe:{name}": (lambda n=name: _pipe(n)) for name in BACKENDS}


def candidates() -> dict[str, Callable[[], Callable]]:
    """Name -> a factory of `run(q, k, v, document_ids)`; a factory or run may raise."""
    kernels = ("CUDNN_ATTENTION", "FLASH_ATTENTION", "EFFICIENT_ATTENTION", "MATH")
    found: dict[str, Callable[[], Callable]] = {
        f"sdpa:{name.split('_')[0].lower()}": (lambda n=name: _sdpa_kernel(n, masked=True))
        for name in kernels
    }
    found["flex"] = _flex
    found["flash_attn:varlen"] = _flash_attn_varlen
    found["sdpa:causal (no document mask)"] = lambda: _sdpa_kernel("FLASH_ATTENTION", False)
    return found


def time_one(run: Callable, q, k, v, docs, repeat: int, warmup: int = 2) -> float:
    """Seconds per forward + backward, after `warmup` untimed passes."""
    import torch

    def once() -> None:
        out = run(q, k, v, docs)
        out.backward(torch.ones_like(out))

    for _ in range(warmup):
        once()
    if q.device.type == "cuda":
        torch.cuda.synchronize(q.device)
    start = time.perf_counter()
    for _ in range(repeat):
        once()
    if q.device.type == "cuda":
        torch.cuda.synchronize(q.device)
    return (time.perf_counter() - start) / repeat


def _outputs(run: Callable, q, k, v, docs) -> list:
    """One forward + backward: the output and q/k/v gradients, in fp32."""
    import torch

    q.grad = k.grad = v.grad = None
    out = run(q, k, v, docs)
    out.backward(torch.ones_like(out))
    found = [t.detach().float() for t in (out, q.grad, k.grad, v.grad)]
    q.grad = k.grad = v.grad = None
    return found


def _max_rel_err(got: list, expected: list) -> float:
    return max(
        float((a - b).abs().max() / b.abs().max().clamp_min(1e-30)) for a, b in zip(got, expected)
    )


def measure(name: str, factory: Callable, inputs: tuple, repeat: int, reference: list | None):
    """`name`'s figures: ms per forward + backward (and, given `reference` outputs, its
    max_rel_err against them), or the error that stopped it. Returns (figures, outputs)."""
    q, k, v, _ = inputs
    try:
        run = factory()
        outputs = _outputs(run, *inputs) if reference is not None or name == "pipe:sdpa" else None
        # the outputs' pass was the first warm-up (a compile's included)
        warmup = 2 if outputs is None else 1
        figures = {"ms": time_one(run, *inputs, repeat, warmup) * 1e3}
        if reference is not None:
            figures["max_rel_err"] = _max_rel_err(outputs, reference)
        return figures, outputs
    except Exception as e:  # a backend that cannot run here is reported, not skipped
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        return {"error": f"{type(e).__name__}: {reason}"[:300]}, None
    finally:
        q.grad = k.grad = v.grad = None


def record(args: argparse.Namespace, results: dict, device, dtype) -> dict:
    """Write the fastest of pipe's backends that agree with `pipe:sdpa` as `auto`'s choice."""
    from pipeline.core.kernels.attention_choice import AttentionShape, device_name, record_choice

    tolerance = 2e-2 if str(dtype) == "torch.bfloat16" else 1e-4
    agrees = {
        name: name == "pipe:sdpa" or r.get("max_rel_err", math.inf) <= tolerance
        for name, r in results.items()
    }
    timings = {
        name.removeprefix("pipe:"): r["ms"]
        for name, r in results.items()
        if name.startswith("pipe:") and "ms" in r and agrees[name]
    }
    if not timings:
        return {"error": "none of pipe's backends ran: nothing recorded"}
    shape = AttentionShape(
        args.seq,
        args.heads,
        args.kv_heads,
        args.head_dim,
        str(dtype).removeprefix("torch."),
        document_masking=True,
    )
    gpu = device_name(device)
    entry = record_choice(gpu, shape, timings, Path(args.record))
    return {"backend": entry["backend"], "key": shape.key(gpu), "file": str(args.record)}


def main() -> None:
    args = parse_args()

    import torch

    from pipeline.core.kernels.attention_choice import cache_path, device_name

    if args.record == "":
        args.record = cache_path()
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    generator = torch.Generator().manual_seed(0)

    def tensor(heads: int) -> torch.Tensor:
        shape = (1, heads, args.seq, args.head_dim)
        return torch.randn(shape, generator=generator, dtype=dtype).to(device).requires_grad_()

    docs = document_ids(args.seq, args.doc_len, device)
    inputs = (tensor(args.heads), tensor(args.kv_heads), tensor(args.kv_heads), docs)
    print(
        f"attention fwd+bwd on {device_name(device)} ({dtype}): seq {args.seq}, "
        f"{args.heads}/{args.kv_heads} heads, head dim {args.head_dim}, "
        f"{int(docs.max()) + 1} documents (mean length {args.doc_len})"
    )
    figures: dict = {"device": str(device), "dtype": str(dtype), "results": {}}
    results, reference = figures["results"], None
    for name, factory in pipe_candidates().items():
        results[name], outputs = measure(name, factory, inputs, args.repeat, reference)
        reference = outputs if name == "pipe:sdpa" else reference
        _save(args, figures)
    if args.record is not None:  # pipe's backends are timed: what --record needs
        figures["recorded"] = record(args, results, device, dtype)
    for name, factory in candidates().items():
        checked = None if "no document" in name else reference  # that one computes another thing
        results[name], _ = measure(name, factory, inputs, args.repeat, checked)
        _save(args, figures)
    report(results, figures.get("recorded"))


def report(results: dict, recorded: dict | None) -> None:
    """Print each kernel's time against the fastest masked one, and what was recorded."""
    masked = [r["ms"] for n, r in results.items() if "ms" in r and "no document" not in n]
    best = min(masked) if masked else None
    for name, r in results.items():
        if "ms" in r:
            ratio = f"{r['ms'] / best:6.2f}x the fastest masked" if best else ""
            err = f"  max rel err {r['max_rel_err']:.1e}" if "max_rel_err" in r else ""
            print(f"  {name:32s} {r['ms']:10.2f} ms  {ratio}{err}")
        else:
            print(f"  {name:32s} unavailable: {r['error']}")
    if recorded and "error" in recorded:
        print(f"--record: {recorded['error']}")
    elif recorded:
        print(f"recorded for attention_backend = auto: {recorded['backend']} ({recorded['file']})")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seq", type=int, default=8192)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--doc-len", type=int, default=1024, help="mean document length")
    parser.add_argument("--repeat", type=int, default=10)
    parser.add_argument("--device", default="cuda")
    parser.add_argument(
        "--record",
        nargs="?",
        const="",
        default=None,
        type=str,
        metavar="FILE",
        help="write the fastest of pipe's backends for this GPU and shape as auto's choice, into "
        "pipe's cache ($PIPE_CACHE_DIR or ~/.cache/pipe/attention_backends.json) or FILE",
    )
    parser.add_argument("--json", type=Path, help="also write the figures to this JSON file")
    return parser.parse_args()


def _save(args: argparse.Namespace, figures: dict) -> None:
    """Write the arguments and the figures so far to `--json`, if given (after every kernel:
    a run stopped part-way keeps what it timed)."""
    if not args.json:
        return
    record = {**vars(args), **figures, "json": str(args.json), "record": str(args.record)}
    args.json.write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
