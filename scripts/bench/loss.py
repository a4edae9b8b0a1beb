"""The output layer and its loss, forward and backward, with the chunk scoring eager and compiled.

`pipeline.core.kernels.cross_entropy` scores each chunk of logits between two matmuls: eager,
op by op, that reads and writes the chunk about ten times; compiled (what pipe runs on a GPU),
one reduction pass and one pass writing the gradient. This times `chunked_linear_cross_entropy`
forward and backward at a model's output shape (default Llama 3.2 1B's: 8,192 tokens, hidden
2048, 128,256 tokens of vocabulary, bf16) both ways, checks that they agree, and prints the time
of each, the compiled one's ratio to eager, and what the saving is worth per training token.

    python scripts/bench/loss.py [--tokens 8192] [--hidden 2048] [--vocab 128256]
        [--device cuda] [--repeat 10] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))


def _time(fn, repeat: int, device: str) -> float:
    """Mean seconds of `fn()` over `repeat` calls after two untimed ones (compile, caches)."""
    import torch

    for _ in range(2):
        fn()
    if device == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(repeat):
        fn()
    if device == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - start) / repeat


def measure(args: argparse.Namespace) -> dict:
    """Both scorers' forward+backward milliseconds, their ratio and their largest differences."""
    import torch

    from pipeline.core.kernels import cross_entropy
    from pipeline.core.kernels.attention_choice import device_name

    device, dtype = args.device, torch.bfloat16 if args.device == "cuda" else torch.float32
    torch.manual_seed(0)
    hidden = torch.randn(args.tokens, args.hidden, device=device, dtype=dtype)
    hidden.requires_grad_()
    weight = torch.randn(args.vocab, args.hidden, device=device, dtype=dtype) * 0.02
    weight.requires_grad_()
    labels = torch.randint(0, args.vocab, (args.tokens,), device=device)
    scorers = {
        "eager": cross_entropy.CompiledScorer(devices=()),
        "compiled": cross_entropy.CompiledScorer(devices=(device,)),
    }
    name = device_name(torch.device(device))
    shape = [args.tokens, args.hidden, args.vocab]
    record: dict = {"device": name, "dtype": str(dtype), "shape": shape}
    outputs = {}
    for name, scorer in scorers.items():
        cross_entropy._score_full_vocab_fast = scorer

        def step() -> None:
            hidden.grad = weight.grad = None
            loss_sum, _ = cross_entropy.chunked_linear_cross_entropy(hidden, weight, labels)
            loss_sum.backward()

        record[f"{name}_ms"] = _time(step, args.repeat, device) * 1e3
        outputs[name] = (hidden.grad.float(), weight.grad.float())
        if scorer.failed:
            record["compile_failed"] = True
    record["compiled_over_eager"] = record["compiled_ms"] / record["eager_ms"]
    record["saved_us_per_token"] = (record["eager_ms"] - record["compiled_ms"]) * 1e3 / args.tokens
    for index, name in enumerate(("grad_hidden", "grad_weight")):
        difference = outputs["eager"][index] - outputs["compiled"][index]
        record[f"max_abs_diff_{name}"] = difference.abs().max().item()
    return record


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--vocab", type=int, default=128256)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--repeat", type=int, default=10)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    record = measure(args)
    print(
        f"output layer + loss fwd+bwd on {record['device']} ({record['dtype']}), tokens x hidden "
        f"x vocab = {' x '.join(map(str, record['shape']))}"
    )
    print(f"  eager chunk scoring     {record['eager_ms']:9.2f} ms")
    print(
        f"  compiled chunk scoring  {record['compiled_ms']:9.2f} ms   "
        f"{record['compiled_over_eager']:.2f}x eager's time, "
        f"{record['saved_us_per_token']:.3f} us saved per token"
    )
    if record.get("compile_failed"):
        print("  (compiling failed: the compiled row ran eager)")
    if args.json:
        args.json.write_text(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()
