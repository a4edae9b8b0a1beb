"""Decoding speed of pipe's engine with and without CUDA graphs (issue 48).

Builds a model of random weights (default: Llama 3.2 1B's shape) on the device, in bf16 on a GPU
(fp32 on a CPU), then for each batch size queues that many prompts of `--prompt-len` tokens,
steps the engine until every request is decoding, runs `--warmup` untimed decode steps (the
graphs of the step's shape are captured there) and times `--steps` more: tokens/s is batch x
steps / seconds, one token per request a step, sampling and the engine's bookkeeping included.
Each batch size runs once with graphs and once eagerly (the engine's packed eager step). On a
CPU, where there are no graphs, the static-shape step runs eagerly in their place: the dry run
checks the path, not the speed.

At batch 1 it also reports the share of the memory-bandwidth limit: the weights' bytes (each read
once a step) over the step's time, against `--bandwidth-tbs` (an H200's 4.8 TB/s). With
`--small` the same runs at batch 1 on the 56M model of `scripts/bench/generate.py` (8 layers,
hidden 512), against the first H200 run's 154 tokens/s (`--small-before`).

    python scripts/bench/decode.py [--device cuda] [--batches 1,8,64,256] [--small] [--json F]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

BLOCK = 16


def small_config():
    """`scripts/bench/generate.py`'s default model: about 56M parameters."""
    from pipeline.core.model.config import ModelConfig

    return ModelConfig(
        vocab_size=32000,
        hidden_size=512,
        num_layers=8,
        num_attention_heads=8,
        num_kv_heads=4,
        ffn_hidden_size=512 * 11 // 4,
        max_position_embeddings=4096,
    )


def build(config, device, dtype):
    """A model of `config` with random weights on `device` in `dtype`, for inference."""
    import torch

    from pipeline.core.model.transformer import Transformer

    torch.manual_seed(0)
    with torch.device("meta"):
        model = Transformer(config)
    model.to_empty(device=device)
    model.init_weights()
    model.to(dtype)
    model.rope.init_weights(device)  # RoPE's buffer stays float32, as loading for serving keeps it
    return model.eval()


def weight_bytes(model) -> int:
    """The bytes of every distinct weight: what one decode step reads (tied weights once)."""
    seen = {p.data_ptr(): p.numel() * p.element_size() for p in model.parameters()}
    return sum(seen.values())


def decode_rate(model, batch: int, args, graphs: bool) -> dict:
    """Tokens/s of `--steps` timed decode steps at `batch` requests (the module docstring)."""
    import torch

    from pipeline.serve.engine.core import Engine
    from pipeline.serve.engine.sampling import SamplingParams

    new_tokens = args.warmup + args.steps + 2  # every request decodes to the end of the timing
    blocks = -(-(args.prompt_len + new_tokens) // BLOCK)
    on_cuda = next(model.parameters()).is_cuda
    engine = Engine(
        model,
        max_batch=batch,
        cache_blocks=batch * blocks,
        block_size=BLOCK,
        max_waiting=batch,
        prefill_chunk=batch * args.prompt_len,  # every prompt in the first step
        max_context=blocks * BLOCK,
        prefix_caching=False,
        cuda_graphs=graphs and on_cuda,
        static_decode=graphs,
    )
    generator = torch.Generator().manual_seed(batch)
    params = SamplingParams(max_new_tokens=new_tokens, greedy=True)
    vocab = model.config.vocab_size
    for _ in range(batch):
        prompt = torch.randint(0, vocab, (args.prompt_len,), generator=generator).tolist()
        engine.add(prompt, params)
    for _ in range(1 + args.warmup):  # the prefill, then the warm-up (where graphs are captured)
        engine.step()
    captured = len(engine.decoder._graphs) if engine.decoder is not None else 0
    if on_cuda:
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(args.steps):
        engine.step()
    if on_cuda:
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    assert engine.load == (batch, 0), f"{engine.load}: not every request decoded every step"
    late = (len(engine.decoder._graphs) if engine.decoder is not None else 0) - captured
    return {
        "tok_s": batch * args.steps / seconds,
        "step_ms": 1000 * seconds / args.steps,
        "captured_while_timed": late,
    }


def measure(model, label: str, batches: list[int], args, figures: dict) -> None:
    """Both ways at each batch size, written to `--json` after each (a run cut short keeps what
    it timed)."""
    import torch

    on_cuda = next(model.parameters()).is_cuda
    way = "graphs" if on_cuda else "static (eager on a CPU)"
    runs = figures.setdefault(
        label,
        {
            "params_m": sum(p.numel() for p in model.parameters()) / 1e6,
            "weight_gb": weight_bytes(model) / 1e9,
            "runs": [],
        },
    )
    for batch in batches:
        eager = decode_rate(model, batch, args, graphs=False)
        static = decode_rate(model, batch, args, graphs=True)
        entry = {
            "batch": batch,
            "eager": eager,
            way: static,
            "speedup": static["tok_s"] / eager["tok_s"],
        }
        if batch == 1 and on_cuda:
            for name, result in (("eager", eager), ("graphs", static)):
                limit = weight_bytes(model) / (args.bandwidth_tbs * 1e12)  # seconds a step
                entry[f"{name}_bandwidth_share"] = limit / (result["step_ms"] / 1000)
        runs["runs"].append(entry)
        print(
            f"{label} batch {batch:4d}: eager {eager['tok_s']:9.1f} tok/s "
            f"({eager['step_ms']:.2f} ms) | {way} {static['tok_s']:9.1f} tok/s "
            f"({static['step_ms']:.2f} ms) | x{entry['speedup']:.2f}",
            flush=True,
        )
        if args.json:
            args.json.write_text(json.dumps(figures, indent=1) + "\n")
        if on_cuda:
            torch.cuda.empty_cache()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--flavor", default="llama3_2_1b", help="a model flavor (pipe's names)")
    parser.add_argument("--layers", type=int, default=0, help="override the layer count")
    parser.add_argument("--batches", default="1,8,64,256")
    parser.add_argument("--prompt-len", type=int, default=160)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--small", action="store_true", help="also the 56M model at batch 1")
    parser.add_argument("--small-before", type=float, default=154.0)
    parser.add_argument("--bandwidth-tbs", type=float, default=4.8)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()

    import torch

    from pipeline.core.model.flavors import get_flavor

    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    config = get_flavor(args.flavor)
    if args.layers:
        config.num_layers = args.layers
    figures: dict = {"device": str(device), "dtype": str(dtype)}
    if device.type == "cuda":
        figures["gpu"] = torch.cuda.get_device_name(device)
    batches = [int(b) for b in args.batches.split(",")]
    measure(build(config, device, dtype), args.flavor, batches, args, figures)
    if args.small:
        measure(build(small_config(), device, dtype), "small_56m", [1], args, figures)
        small = figures["small_56m"]["runs"][0]
        best = max(small["eager"]["tok_s"], small.get("graphs", small["eager"])["tok_s"])
        figures["small_56m"]["over_first_run"] = best / args.small_before
    if args.json:
        args.json.write_text(json.dumps(figures, indent=1) + "\n")


if __name__ == "__main__":
    main()
