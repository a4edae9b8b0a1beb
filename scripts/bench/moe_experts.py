"""The experts of one MoE layer where no gradient flows (serving, rollouts, evaluation): one
grouped product per projection (`torch._grouped_mm`, what pipe runs there) against the loop
over the experts (`looped_swiglu`, what training runs and what ran there before; the baseline),
measured in the same run, alternating, for a few numbers of tokens.

The experts' shape is a flavor's (default Qwen3-30B-A3B's: 128 experts of width 768 over
hidden 2048, top-8), with random weights; the tokens' experts are drawn uniformly. On a GPU
(bf16) the loop also waits for the host once a layer (each expert's number of tokens), which a
decode step captured in a CUDA graph cannot do; this measures the products alone.

    python scripts/bench/moe_experts.py [--device cuda] [--flavor qwen3_30b_a3b]
        [--tokens 1,8,64,512] [--repeats 10]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))


def experts_and_rows(flavor: str, tokens: int, device: str, dtype):
    """(x sorted by expert, tokens per expert, w1, w3, w2) for `tokens` tokens of `flavor`."""
    import torch

    from pipeline.core.model.flavors import get_flavor
    from pipeline.core.model.moe import expert_counts

    config = get_flavor(flavor)
    moe = config.moe
    width = moe.ffn_hidden_size or config.ffn_hidden_size
    generator = torch.Generator().manual_seed(0)
    experts = torch.randint(0, moe.num_experts, (tokens * moe.top_k,), generator=generator)
    counts = expert_counts(experts, moe.num_experts)
    x = torch.randn(tokens * moe.top_k, config.hidden_size, generator=generator)
    stacks = [
        torch.randn(moe.num_experts, *shape, generator=generator) * 0.02
        for shape in ((width, config.hidden_size),) * 2 + ((config.hidden_size, width),)
    ]
    return [t.to(device) for t in (x.to(dtype), counts)] + [s.to(device, dtype) for s in stacks]


def seconds(call, device: str, repeats: int) -> float:
    """The median wall time of `call` over `repeats` runs, after two warm-up runs."""
    import torch

    def sync() -> None:
        if device == "cuda":
            torch.cuda.synchronize()

    times = []
    for i in range(repeats + 2):
        sync()
        start = time.perf_counter()
        call()
        sync()
        if i >= 2:
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def loop_and_grouped(x, counts, stacks, device: str, repeats: int) -> tuple[float, float]:
    """The best of three medians of the loop and of the grouped products, alternating, so that
    drift of the machine falls on both."""
    import torch

    from pipeline.core.model.moe import grouped_swiglu, looped_swiglu

    # with no gradient, grouped_swiglu runs the grouped products (main checks that they serve)
    runs = (lambda: looped_swiglu(x, counts, *stacks), lambda: grouped_swiglu(x, counts, *stacks))
    times: tuple[list[float], list[float]] = ([], [])
    with torch.no_grad():
        for _ in range(3):
            for run, kept in zip(runs, times):
                kept.append(seconds(run, device, repeats))
    return min(times[0]), min(times[1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--flavor", default="qwen3_30b_a3b", help="a MoE flavor (pipe's names)")
    parser.add_argument("--tokens", default="1,8,64,512")
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args()

    import torch

    from pipeline.core.model.moe import grouped_mm_serves

    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    print(f"{args.flavor} experts, {args.device}, {dtype}: grouped products vs the loop")
    for tokens in (int(n) for n in args.tokens.split(",")):
        x, counts, *stacks = experts_and_rows(args.flavor, tokens, args.device, dtype)
        with torch.no_grad():
            if not grouped_mm_serves(x, *stacks):
                print(f"tokens {tokens:5d}: grouped products do not run here")
                continue
        theirs, mine = loop_and_grouped(x, counts, stacks, args.device, args.repeats)
        print(
            f"tokens {tokens:5d}: loop {theirs * 1e3:8.3f} ms | grouped {mine * 1e3:8.3f} ms "
            f"| x{theirs / mine:.2f}"
        )


if __name__ == "__main__":
    main()
