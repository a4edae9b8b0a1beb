"""Generation speed: pipe's engine against transformers' `generate` on the same model, same run.

Builds a small random Llama-shaped model with transformers (default: 8 layers, hidden 512, 8 heads
over 4 kv heads, vocabulary 32,000, about 60M parameters), saves it as a Hugging Face directory,
opens it with `pipe`'s loader, then times greedy generation of `--new-tokens` tokens

1. at batch 1 (one prompt of `--prompt-len` tokens), and
2. at a full batch (`--batch` prompts of mixed lengths up to `--prompt-len`; transformers gets
   them left-padded with an attention mask, the engine runs them with continuous batching),

with each side warmed up once first. It prints tokens/s per side and the ratio pipe / transformers,
and checks that both sides produce the same tokens at batch 1. CPU in fp32 by default; on a GPU
(`--device cuda`) both run in bf16.

    python scripts/bench/generate.py [--device cpu|cuda] [--batch 16] [--new-tokens 64] [--json F]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))


def build_hf(directory: Path, args: argparse.Namespace) -> None:
    import torch

    from pipeline.common.quiet import import_transformers

    transformers = import_transformers()
    config = transformers.LlamaConfig(
        vocab_size=32000,
        hidden_size=args.hidden,
        intermediate_size=args.hidden * 11 // 4,
        num_hidden_layers=args.layers,
        num_attention_heads=8,
        num_key_value_heads=4,
        max_position_embeddings=4096,
        eos_token_id=None,
        bos_token_id=None,
    )
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(directory)


def timed(fn) -> tuple[float, object]:
    import torch

    fn()  # warm-up
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    start = time.perf_counter()
    out = fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter() - start, out


def hf_generate(model, prompts: list[list[int]], new: int):
    import torch

    width = max(len(p) for p in prompts)
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts], device=model.device)
    mask = torch.tensor(
        [[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=model.device
    )
    with torch.no_grad():
        out = model.generate(
            ids,
            attention_mask=mask,
            max_new_tokens=new,
            min_new_tokens=new,
            do_sample=False,
            pad_token_id=0,
        )
    return out[:, width:].tolist()


def pipe_generate(model, prompts: list[list[int]], new: int):
    from pipeline.serve.engine.core import Engine
    from pipeline.serve.engine.sampling import SamplingParams

    blocks = len(prompts) * (-(-(max(map(len, prompts)) + new) // 16))
    engine = Engine(
        model,
        max_batch=len(prompts),
        cache_blocks=blocks,
        block_size=16,
        max_waiting=len(prompts),
        prefill_chunk=4096,
    )
    requests = engine.generate(prompts, SamplingParams(max_new_tokens=new, greedy=True))
    return [r.output for r in requests]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--json", type=Path, help="also write the figures to this JSON file")
    args = parser.parse_args()

    import torch

    from pipeline.common.quiet import import_transformers
    from pipeline.serve.engine.loading import open_generator

    transformers = import_transformers()
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    with tempfile.TemporaryDirectory() as tmp:
        build_hf(Path(tmp), args)
        ours = open_generator(tmp, device=device, dtype=dtype).model
        auto = transformers.AutoModelForCausalLM
        theirs = auto.from_pretrained(tmp, dtype=dtype).to(device).eval()
    generator = torch.Generator().manual_seed(0)
    lengths = [args.prompt_len] + [
        int(n) for n in torch.randint(args.prompt_len // 4, args.prompt_len + 1, (args.batch - 1,))
    ]
    prompts = [torch.randint(0, 32000, (n,), generator=generator).tolist() for n in lengths]
    params = sum(p.numel() for p in ours.parameters()) / 1e6
    print(
        f"device {device} ({dtype}), {params:.0f}M params, {args.new_tokens} new tokens, "
        f"torch threads {torch.get_num_threads()}"
    )
    figures = []
    for label, batch in (("batch 1", prompts[:1]), (f"batch {args.batch}", prompts)):
        tokens = len(batch) * args.new_tokens
        hf_s, hf_out = timed(lambda b=batch: hf_generate(theirs, b, args.new_tokens))
        pipe_s, pipe_out = timed(lambda b=batch: pipe_generate(ours, b, args.new_tokens))
        same = "same tokens" if pipe_out == hf_out else "tokens differ"
        if len(batch) > 1:
            same = f"{sum(a == b for a, b in zip(pipe_out, hf_out))}/{len(batch)} rows equal"
        print(
            f"{label:>9}: transformers {tokens / hf_s:8.1f} tok/s | pipe {tokens / pipe_s:8.1f}"
            f" tok/s | pipe / transformers {hf_s / pipe_s:5.2f}x | {same}"
        )
        figures.append(
            {
                "batch": len(batch),
                "transformers_tok_s": tokens / hf_s,
                "pipe_tok_s": tokens / pipe_s,
                "ratio": hf_s / pipe_s,
                "same": same,
            }
        )
        if args.json:  # after every batch size: a run stopped part-way keeps what it timed
            record = {
                "device": str(device),
                "dtype": str(dtype),
                "params_m": params,
                "runs": figures,
            }
            args.json.write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
