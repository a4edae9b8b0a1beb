"""Where a training step's time goes, from a `torch.profiler` trace: what `scripts/bench/train.py
--profile` prints when a speed target is missed.

The device's kernels (on a CPU: the top-level operators) are sorted into attention, GEMMs, the
loss, the optimizer, communication and the rest by their names (`category`); the summary gives
each category's share of the profiled wall time, the idle share (wall time no kernel covers: the
host not keeping the device fed), the top kernels, and the host synchronisations (each stalls
the host until the device catches up: `.item()`, a device-to-host copy, an explicit sync).
"""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass

CATEGORIES = (
    ("attention", r"flash|fmha|attention|sdpa|softmax_fwd|cudnn.*(fprop|bprop|dgrad)"),
    ("communication", r"nccl|all_?reduce|all_?gather|reduce_?scatter|c10d"),
    ("optimizer", r"adam|multi_tensor|foreach|muon|newton|_fused_sgd|lerp"),
    ("loss", r"cross_entropy|log_softmax|nll_loss|logsumexp"),
    (
        "gemm",
        r"gemm|xmma|nvjet|cutlass|cublas|matmul|aten::mm|aten::addmm|aten::bmm|linear|"
        r"scaled_mm|_mm_",
    ),
)
"""(category, regular expression on the lower-cased kernel name), first match wins: attention
before GEMM (flash kernels hold GEMMs), the loss before GEMM (a fused loss holds its matmul)."""

SYNC_NAMES = re.compile(
    r"cuda(Stream|Device|Event)Synchronize|aten::_local_scalar_dense|cudaMemcpy(Async)?$"
)
"""Host events that wait for the device (`.item()` is `_local_scalar_dense`)."""


@dataclass(frozen=True)
class Kernel:
    """One kernel (or top-level CPU operator) run: its name and its start and end in us."""

    name: str
    start: float
    end: float


def category(name: str) -> str:
    """The category of a kernel by its name (`CATEGORIES`), "other" when none matches."""
    lowered = name.lower()
    for label, pattern in CATEGORIES:
        if re.search(pattern, lowered):
            return label
    return "other"


def busy_us(kernels: Iterable[Kernel]) -> float:
    """Microseconds covered by at least one kernel (overlapping streams counted once)."""
    total, end = 0.0, float("-inf")
    for k in sorted(kernels, key=lambda k: k.start):
        if k.end <= end:
            continue
        total += k.end - max(k.start, end)
        end = k.end
    return total


def summarise(
    kernels: list[Kernel], host_events: list[str], wall_us: float, steps: int, top: int = 12
) -> dict:
    """The profile's figures (module docstring): shares of the wall time by category and idle,
    the `top` kernels by time, host synchronisations per step."""
    by_category: dict[str, float] = defaultdict(float)
    by_name: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for k in kernels:
        by_category[category(k.name)] += k.end - k.start
        by_name[k.name][0] += k.end - k.start
        by_name[k.name][1] += 1
    busy = busy_us(kernels)
    shares = {
        label: by_category.get(label, 0.0) / wall_us
        for label in [c for c, _ in CATEGORIES] + ["other"]
    }
    shares["idle"] = max(wall_us - busy, 0.0) / wall_us
    ranked = sorted(by_name.items(), key=lambda item: -item[1][0])[:top]
    syncs = sum(1 for name in host_events if SYNC_NAMES.search(name))
    return {
        "steps": steps,
        "wall_ms_per_step": wall_us / steps / 1e3,
        "shares": shares,
        "top_kernels": [
            {
                "name": name[:120],
                "ms_per_step": us / steps / 1e3,
                "calls_per_step": n / steps,
                "category": category(name),
            }
            for name, (us, n) in ranked
        ],
        "host_syncs_per_step": syncs / steps,
    }


def profile_steps(step, sync, steps: int, cuda: bool) -> dict:
    """Run `step` `steps` times under `torch.profiler` and summarise the trace (kernels on a
    GPU; top-level operators on a CPU)."""
    import time

    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        sync()
        start = time.perf_counter()
        for _ in range(steps):
            step()
        sync()
        wall_us = (time.perf_counter() - start) * 1e6
    events = prof.events()
    if cuda:
        device = [e for e in events if e.device_type == DeviceType.CUDA]
    else:  # operators not called from another operator (backward ones under autograd nodes)
        device = [e for e in events if e.name.startswith("aten::") and not _nested(e)]
    kernels = [Kernel(e.name, e.time_range.start, e.time_range.end) for e in device]
    host = [e.name for e in events if e.device_type == DeviceType.CPU]
    return summarise(kernels, host, wall_us, steps)


def _nested(event) -> bool:
    """Whether a CPU operator event was called from another operator."""
    parent = event.cpu_parent
    return parent is not None and parent.name.startswith("aten::")


def format_summary(summary: dict) -> list[str]:
    """The summary as printed lines."""
    shares = "  ".join(f"{label} {100 * share:.1f}%" for label, share in summary["shares"].items())
    lines = [
        f"profile of {summary['steps']} steps ({summary['wall_ms_per_step']:.1f} ms/step): "
        f"{shares}; host syncs {summary['host_syncs_per_step']:.1f}/step",
    ]
    for k in summary["top_kernels"]:
        lines.append(
            f"  {k['ms_per_step']:9.2f} ms/step  x{k['calls_per_step']:<6.0f} "
            f"{k['category']:13s} {k['name']}"
        )
    return lines
