"""Batched LoRA on a CPU: the two ways `pipeline.serve.engine.lora_slots` can compute each row's
adapter update (`gathered_lora`, `grouped_lora`), timed on one decode step's shapes.

"gather" makes one batched product over every row's gathered A and B; "grouped" one product per
adapter over the rows that use it. For each width (the 60M serving-benchmark model's 512 and an
8B's 4096 -> 14336), rows per step and adapters in the batch (rows spread round-robin, one row in
four on the base), it prints the median microseconds of each and grouped / gather.

    OMP_NUM_THREADS=1 python scripts/bench/lora_slots.py [--rank 16] [--threads 1]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from pipeline.serve.engine.lora_slots import gathered_lora, grouped_lora


def timed(fn, repeats: int) -> float:
    """Median microseconds of `fn()` over `repeats` calls, after warming up."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def case(width: tuple[int, int], rows: int, adapters: int, rank: int, tokens: int) -> tuple:
    """(gather us, grouped us) for one shape."""
    inp, out = width
    slots = adapters + 1  # the last: the base's zero slot
    generator = torch.Generator().manual_seed(0)
    a = torch.randn(slots, rank, inp, generator=generator)
    b = torch.randn(slots, out, rank, generator=generator)
    x = torch.randn(rows, tokens, inp, generator=generator)
    chosen = [adapters if i % 4 == 3 else i % adapters for i in range(rows)]
    index = torch.tensor(chosen)
    groups = {
        s: torch.tensor([i for i, c in enumerate(chosen) if c == s])
        for s in sorted(set(chosen) - {adapters})
    }
    repeats = 200 if inp < 2048 else 30
    return (
        timed(lambda: gathered_lora(x, a, b, index), repeats),
        timed(lambda: grouped_lora(x, a, b, groups), repeats),
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--tokens", type=int, default=1, help="tokens per row (1: decode)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"rank {args.rank}, {args.threads} thread(s), {args.tokens} token(s) per row")
    print(f"{'in->out':>12} {'rows':>5} {'loras':>5} {'gather us':>10} {'grouped us':>11} ratio")
    for width in ((512, 512), (4096, 14336)):
        for rows in (1, 4, 8, 16):
            for adapters in (1, 2, 4):
                if adapters > rows:
                    continue
                gather, grouped = case(width, rows, adapters, args.rank, args.tokens)
                print(
                    f"{width[0]:>5}->{width[1]:<6} {rows:>5} {adapters:>5} {gather:>10.1f} "
                    f"{grouped:>11.1f} {grouped / gather:5.2f}"
                )


if __name__ == "__main__":
    main()
