"""fp16 with loss scaling against fp32: the same recipe, seed and samples, step by step.

    OMP_NUM_THREADS=1 python scripts/fp16_vs_fp32.py --recipe tiny --iters 200 \\
        --data runs/quickstart/data/stdlib_text_document [--set training.initial_loss_scale=65536]

Trains the recipe twice (training.dtype fp32, then fp16 with Megatron's dynamic loss scale
unless `--set` says otherwise), without checkpoints, and prints each run's loss every
`--every` steps, the steps fp16 skipped for overflows, its final loss scale and the largest
relative gap between the two runs' losses, each a mean over a window of `--every` steps (a
single step's loss is noisy; the window is the log interval's). On a CPU fp16's GEMMs are
emulated (`pipeline.core.kernels.fp16_emulation`).
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np


def _run(recipe: str, sets: list[str], run_dir: Path) -> tuple[dict[int, float], int, float]:
    from pipeline.train.assembly.run_config import resolve_config
    from pipeline.train.loop.trainer import Trainer

    cfg = resolve_config(recipe, [*sets, f"logging.run_dir={run_dir}"])
    trainer = Trainer(cfg, console=False)
    result = trainer.train()
    scaler = trainer.loss_scaler
    return result.losses, result.skipped, float(scaler.scale) if scaler else float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipe", default="tiny")
    parser.add_argument("--iters", type=int, default=200)
    parser.add_argument("--data", help="a token dataset prefix (default: the recipe's data)")
    parser.add_argument("--every", type=int, default=10, help="window of steps compared")
    parser.add_argument("--set", action="append", default=[], help="section.key=value, fp16 run")
    parser.add_argument("--json", help="write the losses and figures to this file")
    parser.add_argument(
        "--fp32-from", help="take the fp32 run from an earlier --json of the same settings"
    )
    args = parser.parse_args()
    logging.basicConfig(level=logging.ERROR)

    common = [
        f"training.iters={args.iters}",
        "training.device=cpu",
        "training.eval_interval=0",
        "checkpoint.enable=false",
    ]
    if args.data:
        common += ["data.mock=false", f"data.blend={args.data}"]
    runs = {}
    tmp = Path(tempfile.mkdtemp(prefix="fp16_vs_fp32_"))
    try:
        if args.fp32_from:
            earlier = json.loads(Path(args.fp32_from).read_text())
            runs["fp32"] = ({int(k): v for k, v in earlier["fp32"].items()}, 0, 0.0, 0.0)
        for dtype, extra in (("fp32", []), ("fp16", args.set)):
            if dtype in runs:
                continue
            start = time.perf_counter()
            sets = [*common, f"training.dtype={dtype}", *extra]
            runs[dtype] = (*_run(args.recipe, sets, tmp / dtype), time.perf_counter() - start)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

    (fp32, _, _, t32), (fp16, skipped, scale, t16) = runs["fp32"], runs["fp16"]
    windows = range(1, args.iters + 1, args.every)
    gaps = []
    print(f"{'steps':>11} {'fp32':>8} {'fp16':>8} {'gap':>7}")
    for first in windows:
        steps = range(first, min(first + args.every, args.iters + 1))
        a = float(np.mean([fp32[s] for s in steps]))
        b = float(np.mean([fp16[s] for s in steps]))
        gaps.append(abs(b - a) / a)
        print(f"{first:>5}-{steps[-1]:<5} {a:8.4f} {b:8.4f} {gaps[-1]:7.2%}")
    print(
        f"fp16: {skipped} steps skipped for overflows, final loss scale {scale:g}; largest gap "
        f"{max(gaps):.2%} (window of {args.every}); final losses {fp32[args.iters]:.4f} (fp32) "
        f"{fp16[args.iters]:.4f} (fp16); {t32:.0f} s and {t16:.0f} s"
    )
    if args.json:
        figures = {"fp32": fp32, "fp16": fp16, "skipped": skipped, "scale": scale, "gaps": gaps}
        Path(args.json).write_text(json.dumps(figures, indent=1))


if __name__ == "__main__":
    main()
