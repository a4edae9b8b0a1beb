"""The CPU engine's step, alone: a decode step at 1, 8 and 32 running requests, and a step that
also runs a 64-token prompt, each with the engine's defaults and with resident rows or mixed
passes off, with each linear multiplying alone instead of the stacked products of one input,
with long rows' keys kept position by position instead of head by head, or with torch's SDPA
for the decode rows' attention instead of pipe's C kernel (the baselines, measured in the same
run, alternating), printed as ms and ratios.

Uses the serving benchmark's model (`serve.py --build-only` writes it), one thread, greedy
requests on random token prompts of `--prompt-len` tokens (64), after every prompt has run and
30 decode steps more; each figure is the median of alternating blocks of 10 steps. Rows of more
than 256 positions keep their keys and values head by head
(`pipeline.serve.engine.resident_rows`); `--prompt-len 800` measures that against rows kept
position by position ("keys by position").

    python scripts/bench/serve.py --model-dir /tmp/serve-bench --build-only
    python scripts/bench/engine_step.py --model-dir /tmp/serve-bench [--prompt-len 800]
"""

from __future__ import annotations

import argparse
import contextlib
import random
import statistics
import sys
import time
from contextlib import nullcontext
from pathlib import Path
from unittest import mock

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

SETTINGS = {
    "defaults": {},
    "gathering": {"resident_decode": False},  # no resident rows (nor mixed passes)
    "two passes": {"mix_prompts": False},
    "unstacked": {},  # the defaults, each linear multiplying alone (`stacks_off`)
    "keys by position": {},  # the defaults, long rows' keys not kept head by head
    "torch's attention": {},  # the defaults, decode attention in SDPA instead of pipe's C kernel
}


def engines(model, rows: int, prompt_len: int) -> dict:
    """One engine per setting, each with `rows` requests decoding (prompts of `prompt_len`)."""
    out = {}
    for name, options in SETTINGS.items():
        with keys_by_position() if name == "keys by position" else nullcontext():
            out[name] = running_engine(model, rows, prompt_len, **options)
    return out


def running_engine(model, rows: int, prompt_len: int = 64, **options):
    """An `Engine` of `model` (`options` its settings) with `rows` greedy requests on random
    token prompts of `prompt_len`, every prompt run and 30 decode steps taken."""
    from pipeline.serve.engine.core import Engine
    from pipeline.serve.engine.sampling import SamplingParams

    random.seed(0)
    engine = Engine(model, max_batch=rows + 1, cache_blocks=4096, **options)
    requests = []
    for _ in range(rows):
        prompt = [random.randrange(100, 30000) for _ in range(prompt_len)]
        new_tokens = min(1900, 2000 - prompt_len)  # within the model's 2,048
        params = SamplingParams(max_new_tokens=new_tokens, greedy=True)
        requests.append(engine.add(prompt, params))
    # every prompt run (long ones take many steps of `prefill_chunk` tokens), then 30
    while any(request.computed < len(request.prompt) for request in requests):
        engine.step()
    for _ in range(30):
        engine.step()
    return engine


def keys_by_position():
    """Resident rows allocated inside the block keep each position's heads together at any
    length, as before long rows were kept head by head. The rows keep their layout until they
    grow again: measure fewer steps than their capacity has left."""
    from pipeline.serve.engine import resident_rows

    return mock.patch.object(resident_rows, "BY_HEAD_CAPACITY", 1 << 62)


def torch_attention():
    """Decode attention in torch's SDPA, as without a C compiler (`cpu_decode_attention`)."""
    from pipeline.core.kernels import cpu_decode_attention

    return mock.patch.object(cpu_decode_attention, "serves", lambda *a, **k: False)


@contextlib.contextmanager
def stacks_off(packs: dict):
    """Each linear of a `StackedLinears` multiplies alone, on its own packed weight (`packs`:
    `own_packs`), as before stacking; the stacks again after."""
    for linear, (_, packed) in packs.items():
        linear.stacked, linear.packed = None, packed
    try:
        yield
    finally:
        for linear, (stack, _) in packs.items():
            linear.stacked, linear.packed = stack, None


def own_packs(model) -> dict:
    """Each stacked linear of `model`: its stack, and its weight packed alone (for `stacks_off`)."""
    from pipeline.serve.engine.cpu_linear import pack

    return {
        module: (module.stacked, pack(module.weight))
        for module in model.modules()
        if getattr(module, "stacked", None) is not None
    }


def decode_ms(engine) -> float:
    """The mean time of 10 steps of `engine`, in ms."""
    start = time.perf_counter()
    for _ in range(10):
        engine.step()
    return (time.perf_counter() - start) / 10 * 1e3


def prompt_ms(engine) -> float:
    """A step that also runs a new 64-token prompt (a one-token request), then its own step."""
    from pipeline.serve.engine.sampling import SamplingParams

    took = []
    for _ in range(5):
        prompt = [random.randrange(100, 30000) for _ in range(64)]
        engine.add(prompt, SamplingParams(max_new_tokens=1))
        start = time.perf_counter()
        engine.step()
        took.append(time.perf_counter() - start)
    return statistics.median(took) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model-dir", type=Path, default=Path("/tmp/pipe-serve-bench"))
    parser.add_argument("--rows", default="1,8,32")
    parser.add_argument("--blocks", type=int, default=6, help="alternating blocks per figure")
    parser.add_argument(
        "--prompt-len",
        type=int,
        default=64,
        help="each request's prompt (800: a history past the keys kept head by head)",
    )
    args = parser.parse_args()

    import torch

    from pipeline.serve.engine.cpu_linear import prepack_linears
    from pipeline.serve.engine.loading import open_generator

    torch.set_num_threads(1)
    model = open_generator(args.model_dir).model
    prepack_linears(model)
    packs = own_packs(model)
    # what each setting switches on around its own measurements
    during = {"unstacked": lambda: stacks_off(packs), "torch's attention": torch_attention}
    for rows in (int(r) for r in args.rows.split(",")):
        running = engines(model, rows, args.prompt_len)
        for label, measure in (("decode step", decode_ms), ("+ a 64-token prompt", prompt_ms)):
            times = {name: [] for name in running}
            with torch.inference_mode():
                for _ in range(args.blocks):
                    for name, engine in running.items():
                        with during.get(name, nullcontext)():
                            times[name].append(measure(engine))
            median = {name: statistics.median(t) for name, t in times.items()}
            base = median["defaults"]
            others = ", ".join(
                f"{name} {ms:.1f} ms ({ms / base:.2f}x the defaults' time)"
                for name, ms in median.items()
                if name != "defaults"
            )
            print(f"{rows:3d} rows, {label}: defaults {base:.1f} ms; {others}", flush=True)


if __name__ == "__main__":
    main()
