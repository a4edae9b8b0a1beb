"""The gated delta rule (gated DeltaNet's linear attention): the chunked torch form against the
recurrent one, by sequence length, and on a GPU flash-linear-attention's Triton kernel against
the chunked torch reference.

For each length the same q, k, v, decays and step sizes (seeded; q and k L2-normalised, as the
layer feeds them) go through `chunk_gated_delta_rule` and `recurrent_gated_delta_rule` (pipe's
torch forms, `pipeline.core.kernels.gated_delta`), forward only, each warmed up then timed over
`--repeat` runs. Printed: tokens/s of each and the chunked form's speed as a ratio to the
recurrent one's measured in the same run, with the largest difference of their outputs. The
recurrent form runs a Python loop over the tokens, so it is timed up to `--recurrent-max`
tokens only.

With `--fla`, flash-linear-attention's `chunk_gated_delta_rule` runs on the same inputs (CUDA
only; on a CPU, or without the package, the reason is reported instead): its largest relative
difference from the torch chunked form (outputs and final state) and its speed as a ratio to
it.

    python scripts/bench/linear_attention.py [--lengths 256,1024,4096] [--heads 8]
        [--key-dim 64 --value-dim 64] [--device cpu|cuda] [--dtype fp32|bf16] [--fla]
        [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))


def inputs(length: int, args: argparse.Namespace):
    """(q, k, v, g, beta) of one sequence of `length` tokens, seeded, on the device."""
    import torch
    import torch.nn.functional as F

    from pipeline.core.kernels.gated_delta import l2_normalize

    gen = torch.Generator().manual_seed(length)
    shape = (args.batch, length, args.heads)
    q = l2_normalize(torch.randn(*shape, args.key_dim, generator=gen))
    k = l2_normalize(torch.randn(*shape, args.key_dim, generator=gen))
    v = torch.randn(*shape, args.value_dim, generator=gen)
    g = -F.softplus(torch.randn(*shape, generator=gen)) * 0.1
    beta = torch.rand(*shape, generator=gen)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    return [t.to(args.device, dtype if t.dim() == 4 else torch.float32) for t in (q, k, v, g, beta)]


def timed(fn: Callable[[], object], repeat: int, device: str) -> float:
    """Seconds per call of `fn`, after one warm-up call."""
    import torch

    fn()
    if device == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(repeat):
        fn()
    if device == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - start) / repeat


def fla_kernel():
    """flash-linear-attention's chunked kernel, or the reason it cannot run here."""
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    except ImportError as error:
        return None, f"flash-linear-attention not installed ({error})"
    return chunk_gated_delta_rule, None


def relative(a, b) -> float:
    return float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-12))


def measure(length: int, args: argparse.Namespace) -> dict:
    """One length's figures (see the module docstring)."""
    import torch

    from pipeline.core.kernels.gated_delta import (
        chunk_gated_delta_rule,
        fla_gated_delta_rule,
        recurrent_gated_delta_rule,
    )

    q, k, v, g, beta = inputs(length, args)
    tokens = args.batch * length
    out: dict[str, object] = {"tokens": tokens}
    with torch.no_grad():
        chunked, state = chunk_gated_delta_rule(q, k, v, g, beta)
        seconds = timed(lambda: chunk_gated_delta_rule(q, k, v, g, beta), args.repeat, args.device)
        out["chunked_tok_s"] = tokens / seconds
        if length <= args.recurrent_max:
            reference, _ = recurrent_gated_delta_rule(q, k, v, g, beta)
            seconds = timed(lambda: recurrent_gated_delta_rule(q, k, v, g, beta), 1, args.device)
            out["recurrent_tok_s"] = tokens / seconds
            out["chunked_over_recurrent"] = out["chunked_tok_s"] / out["recurrent_tok_s"]
            out["max_rel_diff"] = relative(chunked, reference)
        if args.fla:
            out |= _fla_figures(
                length, args, (q, k, v, g, beta), chunked, state, fla_gated_delta_rule
            )
    return out


def _fla_figures(length, args, tensors, chunked, state, fla_rule) -> dict:
    """The Triton kernel against the torch chunked form: differences and speed ratio."""
    if args.device != "cuda":
        return {"fla": "not on a CPU: the Triton kernels need CUDA"}
    kernel, reason = fla_kernel()
    if kernel is None:
        return {"fla": reason}
    from pipeline.core.kernels.gated_delta import chunk_gated_delta_rule

    out, fla_state = fla_rule(*tensors)
    seconds = timed(lambda: fla_rule(*tensors), args.repeat, args.device)
    torch_seconds = timed(lambda: chunk_gated_delta_rule(*tensors), args.repeat, args.device)
    return {
        "fla_tok_s": args.batch * length / seconds,
        "fla_over_torch": torch_seconds / seconds,
        "fla_max_rel_diff": relative(out, chunked),
        "fla_state_max_rel_diff": relative(fla_state, state),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--lengths", default="256,1024,4096")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--key-dim", type=int, default=64)
    parser.add_argument("--value-dim", type=int, default=64)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--recurrent-max", type=int, default=4096)
    parser.add_argument("--fla", action="store_true", help="also flash-linear-attention's kernel")
    parser.add_argument("--json", type=Path, help="write the figures here after every length")
    args = parser.parse_args(argv)
    import torch

    torch.manual_seed(0)
    report = {"settings": vars(args) | {"json": str(args.json)}, "results": {}}
    print(f"{'tokens':>8} {'chunked tok/s':>14} {'recurrent tok/s':>16} {'ratio':>7} {'diff':>9}")
    for length in (int(n) for n in args.lengths.split(",")):
        figures = measure(length, args)
        report["results"][str(length)] = figures
        recurrent = figures.get("recurrent_tok_s")
        print(
            f"{length:>8} {figures['chunked_tok_s']:>14,.0f} "
            + (
                f"{recurrent:>16,.0f} {figures['chunked_over_recurrent']:>6.1f}x "
                f"{figures['max_rel_diff']:>9.1e}"
                if recurrent
                else f"{'(not timed)':>16}"
            )
        )
        if "fla_tok_s" in figures:
            print(
                f"{'':>8} fla {figures['fla_tok_s']:,.0f} tok/s, "
                f"{figures['fla_over_torch']:.1f}x torch chunked, "
                f"rel diff {figures['fla_max_rel_diff']:.1e}"
            )
        elif "fla" in figures:
            print(f"{'':>8} fla: {figures['fla']}")
        if args.json is not None:
            args.json.write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
