"""The optimizer step alone, per optimizer, on a recipe's model: its time and its state's bytes.

Builds the recipe's model on the device in fp32 (pipe's weights are the fp32 masters whatever
the compute dtype), gives every parameter a random gradient, and times `--warmup` untimed and
`--steps` timed `optimizer.step()` calls of each optimizer in `--optimizers` (`NAME` or
`NAME:bf16` for `optimizer.state_dtype = "bf16"`), built by the registry as a run builds it.
The step runs eagerly, as in pipe's train step (only the model's forward and backward are
compiled). Printed and written (`--json`): the mean step time, its ratio to the first
optimizer's, and the state's measured bytes against the dry-run estimate's.

    python scripts/bench/optimizer_step.py [--recipe llama3_2_1b] [--optimizers adamw,muon]
        [--warmup 1] [--steps 3] [--device cuda] [--set KEY=VALUE ...] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))


def _sync(device: str) -> None:
    import torch

    if device == "cuda":
        torch.cuda.synchronize()


def measure(name: str, model, args: argparse.Namespace) -> dict:
    """One optimizer (`name[:bf16]`) over `model`: mean step seconds and state GiB, measured
    and estimated."""
    import torch

    from pipeline.train.assembly.run_config import resolve_config
    from pipeline.train.optimizers import build_optimizer, state_bytes_per_param

    optimizer_name, _, dtype = name.partition(":")
    cfg = resolve_config(
        args.recipe,
        [
            *args.sets,
            f"optimizer.name={optimizer_name}",
            f"optimizer.state_dtype={dtype or 'fp32'}",
            f"training.device={args.device}",
        ],
        world_size=1,
    )
    optimizer = build_optimizer(model, cfg)
    for _ in range(args.warmup):
        optimizer.step()
    _sync(args.device)
    start = time.perf_counter()
    for _ in range(args.steps):
        optimizer.step()
    _sync(args.device)
    seconds = (time.perf_counter() - start) / args.steps
    state = sum(
        t.nbytes
        for s in optimizer.state.values()
        for k, t in s.items()
        if isinstance(t, torch.Tensor) and k != "step"
    )
    params = sum(p.numel() for p in model.parameters())
    estimate = params * state_bytes_per_param(cfg, cfg.model_config(), resident=False)
    del optimizer
    return {"step_s": seconds, "state_gib": state / 2**30, "estimate_gib": estimate / 2**30}


def build_model(args: argparse.Namespace):
    """The recipe's model (with `--set`'s model fields) on the device, fp32, a random
    gradient on every parameter."""
    import torch

    from pipeline.core.model.transformer import Transformer
    from pipeline.train.assembly.run_config import resolve_config

    cfg = resolve_config(args.recipe, [*args.sets, f"training.device={args.device}"], world_size=1)
    torch.manual_seed(0)
    with torch.device(args.device):
        model = Transformer(cfg.model_config())
        model.init_weights()
        for p in model.parameters():
            p.grad = torch.randn_like(p).mul_(1e-3)
    return model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--recipe", default="llama3_2_1b")
    parser.add_argument("--optimizers", default="adamw,muon")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    model = build_model(args)
    params = sum(p.numel() for p in model.parameters())
    record = {"recipe": args.recipe, "device": args.device, "parameters": params, "runs": {}}
    print(
        f"{args.recipe} ({params / 1e9:.3g} B parameters) on {args.device}: "
        f"{args.warmup} + {args.steps} steps each"
    )
    first = None
    for name in args.optimizers.split(","):
        figures = record["runs"][name] = measure(name, model, args)
        first = first or figures["step_s"]
        figures["over_first"] = figures["step_s"] / first
        print(
            f"{name:12s} step {1e3 * figures['step_s']:9.2f} ms ({figures['over_first']:.2f}x)"
            f"  state {figures['state_gib']:.3f} GiB (estimate {figures['estimate_gib']:.3f})",
            flush=True,
        )
        if args.json:  # after every optimizer: a run cut short keeps what it measured
            args.json.write_text(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()
