"""Prefix caching: time to first token of a repeated long prompt, cache cold against cache warm.

Builds the small random Llama-shaped model of `generate.py` (default: 8 layers, hidden 512,
vocabulary 32,000), opens it with pipe's loader and times, on one engine, the first token of a
`--prompt-len`-token prompt (default 1,500) the first time (nothing cached: the whole prompt is
prefilled) and then again `--repeats` times (every full block read from the prefix cache: only
the tokens after the last full block are run). It prints both times (the warm one the median)
and their ratio, and checks that the warm requests' greedy tokens equal the cold one's. An
engine without prefix caching gives the cold time on every repeat, as a control.

    python scripts/bench/prefix_cache.py [--device cpu|cuda] [--prompt-len 1500] [--json F]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts" / "bench"))

from generate import build_hf  # noqa: E402 - the same model as the generation benchmark


def first_token_seconds(engine, prompt: list[int], params) -> tuple[float, object]:
    """Seconds from queuing `prompt` to its first token, and its request."""
    import torch

    start = time.perf_counter()
    request = engine.add(prompt, params)
    while not request.output:
        engine.step()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    while engine.busy:
        engine.step()
    return seconds, request


def measure(model, prompt: list[int], repeats: int, caching: bool) -> dict:
    """Cold and warm first-token times of `prompt` on a fresh engine."""
    from pipeline.serve.engine.core import Engine
    from pipeline.serve.engine.sampling import SamplingParams

    params = SamplingParams(max_new_tokens=4, greedy=True)
    engine = Engine(
        model,
        max_batch=1,
        cache_blocks=len(prompt) // 16 + 8,
        block_size=16,
        prefill_chunk=4096,
        prefix_caching=caching,
    )
    first_token_seconds(engine, prompt[::-1], params)  # warm the kernels on another prompt
    cold, first = first_token_seconds(engine, prompt, params)
    warm, outputs = [], []
    for _ in range(repeats):
        seconds, request = first_token_seconds(engine, prompt, params)
        warm.append(seconds)
        outputs.append(request.output)
    assert all(out == first.output for out in outputs), "warm tokens differ from cold ones"
    return {
        "cold_s": cold,
        "warm_s": statistics.median(warm),
        "cached_tokens": request.cached_tokens,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--prompt-len", type=int, default=1500)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--json", type=Path, help="also write the figures to this JSON file")
    args = parser.parse_args()

    import torch

    from pipeline.serve.engine.loading import open_generator

    dtype = torch.bfloat16 if args.device.startswith("cuda") else torch.float32
    with tempfile.TemporaryDirectory() as directory:
        build_hf(Path(directory), args)
        model = open_generator(directory, device=args.device, dtype=dtype).model
    rng = random.Random(0)
    prompt = [rng.randrange(3, 32000) for _ in range(args.prompt_len)]
    with torch.inference_mode():
        figures = {
            "cached": measure(model, prompt, args.repeats, True),
            "uncached": measure(model, prompt, args.repeats, False),
        }
    on, off = figures["cached"], figures["uncached"]
    figures["speedup"] = on["cold_s"] / on["warm_s"]
    print(f"{args.prompt_len}-token prompt on {args.device}, time to first token:")
    print(
        f"  cache cold {on['cold_s'] * 1e3:8.1f} ms   warm {on['warm_s'] * 1e3:8.1f} ms "
        f"({on['cached_tokens']} tokens cached)   speedup {figures['speedup']:.1f}x"
    )
    print(
        f"  no prefix cache: first {off['cold_s'] * 1e3:8.1f} ms   repeated "
        f"{off['warm_s'] * 1e3:8.1f} ms"
    )
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2))


if __name__ == "__main__":
    main()
