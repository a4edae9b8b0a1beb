"""Where a CPU decode step's time goes besides streaming the weights: the packed product's
per-call set-up, torch's attention for one query per row, and the forward compiled by inductor,
each against a baseline measured in the same run (docs/benchmarks.md, "Serving").

- products: a product on oneDNN's packed weight (what `pipe serve` runs on a CPU) and
  `F.linear` on the plain weight, both on a 64x64 weight that stays in cache, so what is left is
  each call's fixed cost; times the number of products in one decode step of the model.
- attention: one layer's attention of `rows` single queries over `keys` cached keys, with the
  model's heads, each layer after a read of 16 MB (a different 16 MB of 128 MB each time: a
  real step streams the weights between two layers' attention, so its keys are not in cache):
  torch's SDPA over resident rows kept position by position (`[rows, capacity, kv_heads,
  head_dim]`, the engine's layout up to 256 positions; the baseline), over rows kept head by
  head (`[rows, kv_heads, capacity, head_dim]`, the engine's layout beyond), the grouped
  product over the latter (the query heads of one key head as one matrix: `torch.matmul`,
  softmax, `torch.matmul`; measured, not used), and pipe's C kernel over either layout (what
  the engine runs for float32 models: `pipeline.core.kernels.cpu_decode_attention`).
- `--compiled`: the model's forward compiled by inductor (freezing, the C++ wrapper, dynamic
  shapes; the output head packed as in serving) against the eager packed model, decode steps
  of the two engines alternating in one process (minutes: it compiles).

    python scripts/bench/serve.py --model-dir /tmp/serve-bench --build-only
    python scripts/bench/decode_costs.py --model-dir /tmp/serve-bench [--compiled]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))


def per_call_us(call, calls: int = 20000) -> float:
    """Microseconds per call of `call`, after a warm-up."""
    for _ in range(calls // 20):
        call()
    start = time.perf_counter()
    for _ in range(calls):
        call()
    return (time.perf_counter() - start) / calls * 1e6


def medians(took: dict[str, list[float]]) -> dict[str, float]:
    """Each variant's median of its alternating measurements."""
    return {name: statistics.median(times) for name, times in took.items()}


def products(model) -> None:
    """The packed product's fixed cost per call against `F.linear`'s, and the step's count."""
    import torch
    import torch.nn.functional as F

    from pipeline.serve.engine.cpu_linear import PrepackedLinear, pack, product

    weight, x = torch.randn(64, 64), torch.randn(1, 64)
    packed = pack(weight)
    linears = [m for m in model.modules() if isinstance(m, PrepackedLinear)]
    count = len({id(m.stacked or m) for m in linears})  # each stack is one product
    took = {"packed": [], "F.linear": []}
    for _ in range(3):
        took["packed"].append(per_call_us(lambda: product(x, packed, None)))
        took["F.linear"].append(per_call_us(lambda: F.linear(x, weight)))
    fixed = medians(took)
    print(
        f"products: a 64x64 product takes {fixed['packed']:.1f} us packed, "
        f"{fixed['F.linear']:.1f} us with F.linear ({fixed['packed'] / fixed['F.linear']:.1f}x); "
        f"{count} products a decode step: {count * fixed['packed'] / 1e3:.2f} ms of packed calls",
        flush=True,
    )


def attention_variants(config, rows: int, keys: int, layers: int = 8) -> dict:
    """One callable per variant, each attending `rows` queries over layer i's keys."""
    import torch
    import torch.nn.functional as F

    from pipeline.core.kernels.cpu_decode_attention import decode_attention

    heads, kv_heads = config.num_attention_heads, config.num_kv_heads or config.num_attention_heads
    dim = config.head_dim or config.hidden_size // heads
    group, capacity = heads // kv_heads, keys + 256
    q = torch.randn(rows, heads, 1, dim)
    by_position = [
        [torch.randn(rows, capacity, kv_heads, dim) for _ in "kv"] for _ in range(layers)
    ]
    by_head = [[t.transpose(1, 2).contiguous() for t in kv] for kv in by_position]

    def sdpa_by_position(i):
        k, v = (t[:, :keys].transpose(1, 2) for t in by_position[i])
        return F.scaled_dot_product_attention(q, k, v, enable_gqa=group > 1)

    def sdpa_by_head(i):
        k, v = (t[:, :, :keys] for t in by_head[i])
        return F.scaled_dot_product_attention(q, k, v, enable_gqa=group > 1)

    def grouped_by_head(i):
        k, v = (t[:, :, :keys] for t in by_head[i])
        scores = torch.matmul(q.view(rows, kv_heads, group, dim), k.transpose(-1, -2))
        weights = (scores * dim**-0.5).softmax(-1)
        return torch.matmul(weights, v).view(rows, heads, 1, dim)

    def kernel_by_position(i):
        k, v = (t[:, :keys].transpose(1, 2) for t in by_position[i])
        return decode_attention(q, k, v, None)

    def kernel_by_head(i):
        k, v = (t[:, :, :keys] for t in by_head[i])
        return decode_attention(q, k, v, None)

    variants = {
        "SDPA, rows by position": sdpa_by_position,
        "SDPA, rows by head": sdpa_by_head,
        "grouped product, rows by head": grouped_by_head,
        "pipe's C kernel, rows by position": kernel_by_position,
        "pipe's C kernel, rows by head": kernel_by_head,
    }
    reference = sdpa_by_position(0)
    for name, attend in variants.items():
        torch.testing.assert_close(attend(0), reference, rtol=1e-4, atol=1e-5, msg=name)
    return variants


def attention(config, rows_list: list[int], keys_list: list[int], repeats: int) -> None:
    """Each variant's time per layer, keys out of cache, against SDPA over rows by position."""
    import torch

    stream = torch.randn(8, 4_000_000)  # 8 x 16 MB, one read before each layer
    for rows in rows_list:
        for keys in keys_list:
            variants = attention_variants(config, rows, keys, layers=stream.shape[0])
            took = {name: [] for name in variants}
            for _ in range(repeats):
                for name, attend in variants.items():
                    total = 0.0
                    for layer in range(stream.shape[0]):
                        stream[layer].sum()
                        start = time.perf_counter()
                        attend(layer)
                        total += time.perf_counter() - start
                    took[name].append(total / stream.shape[0] * 1e6)
            median = medians(took)
            base = median["SDPA, rows by position"]
            cells = ", ".join(
                f"{name} {us:.0f} us ({us / base:.2f}x)" for name, us in median.items()
            )
            print(f"attention, {rows:2d} rows x {keys:4d} keys, per layer: {cells}", flush=True)


def compiled(model_dir: Path, rows_list: list[int], blocks: int) -> None:
    """Decode steps of the forward compiled by inductor against the eager packed model."""
    import torch
    import torch._inductor.config as inductor
    from engine_step import decode_ms, running_engine  # scripts/bench/, beside this script

    from pipeline.serve.engine.cpu_linear import PrepackedLinear, prepack_linears
    from pipeline.serve.engine.loading import open_generator

    inductor.freezing = True
    inductor.cpp_wrapper = True
    eager = open_generator(model_dir).model
    prepack_linears(eager)
    fused = open_generator(model_dir).model
    fused.forward = torch.compile(fused.forward, dynamic=True)
    fused.output = PrepackedLinear(fused.output)  # the head runs outside the forward

    with torch.inference_mode():
        for rows in rows_list:
            engines = {
                "eager": running_engine(eager, rows),
                "compiled": running_engine(fused, rows),
            }
            took = {name: [] for name in engines}
            for _ in range(blocks):
                for name, running in engines.items():
                    took[name].append(decode_ms(running))
            median = medians(took)
            print(
                f"compiled forward, {rows:2d} rows: decode step {median['compiled']:.1f} ms "
                f"against {median['eager']:.1f} ms eager "
                f"({median['compiled'] / median['eager']:.2f}x the eager step's time)",
                flush=True,
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model-dir", type=Path, default=Path("/tmp/pipe-serve-bench"))
    parser.add_argument("--rows", default="1,8,32")
    parser.add_argument("--keys", default="100,300,1000")
    parser.add_argument("--repeats", type=int, default=12, help="alternating attention rounds")
    parser.add_argument("--compiled", action="store_true", help="also the inductor comparison")
    parser.add_argument("--blocks", type=int, default=12, help="alternating blocks of 10 steps")
    args = parser.parse_args()

    import torch

    from pipeline.serve.engine.cpu_linear import prepack_linears
    from pipeline.serve.engine.loading import open_generator

    torch.set_num_threads(1)  # the engine's thread on the 2-core benchmark machine
    rows = [int(r) for r in args.rows.split(",")]
    model = open_generator(args.model_dir).model
    prepack_linears(model)
    with torch.inference_mode():
        products(model)
        attention(model.config, rows, [int(k) for k in args.keys.split(",")], args.repeats)
    if args.compiled:
        compiled(args.model_dir, rows, args.blocks)


if __name__ == "__main__":
    main()
