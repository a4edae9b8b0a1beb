"""What a checkpoint save costs the training loop, with `checkpoint.async_save` on and off.

Trains a model whose checkpoint takes over a second to write (35M parameters, mostly the
embedding and output layer: 420 MB with Adam's two moments) on mock data, one short sequence a
step on `--threads` torch threads (one by default, leaving the second core of a 2-core machine
to the writer), and saves at iteration `--save-at`. Each step is timed from its start to the
next step's start, so whatever the loop does between steps counts. Printed per mode:

- the save's own seconds (from its recorded start to its completion record);
- the iteration that calls the save (for a synchronous save, the whole write);
- the median step while the background write runs, against the median step with no save in
  flight in the same run (the ratio is the slowdown the write causes; the iteration that stages
  the save is in neither set).

A save is "in flight" while its `.tmp-` directory exists, seen from outside the trainer.

    python scripts/bench/async_save.py [--save-at 8] [--threads 1] [--modes async,sync]
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

LARGE_MODEL = [
    "model.num_layers=2",
    "model.hidden_size=256",
    "model.num_attention_heads=4",
    "model.num_kv_heads=4",
    "model.ffn_hidden_size=512",
    "model.vocab_size=65536",
]
WARM_STEPS = 2  # the first steps allocate the optimizer state
STEPS_AFTER = 4  # steps with no save in flight to time after the save


class _Enough(Exception):
    """Ends the timed run once it has what it measures."""


def run_sets(
    run_dir: Path, save_at: int, async_save: bool, *extra: str, iters: int | None = None
) -> list[str]:
    """`--set` assignments for the large model on mock data, one sequence of 16 a step, saving
    every `save_at` iterations, for `iters` iterations (default: four saves' worth); `extra`
    last."""
    return [
        *LARGE_MODEL,
        "data.mock=true",
        "data.seq_length=16",
        "data.num_workers=0",
        f"training.iters={iters or 4 * save_at}",
        "training.micro_batch_size=1",
        "training.global_batch_size=1",
        "training.eval_interval=0",
        "training.log_interval=1",
        "training.dtype=fp32",
        "training.device=cpu",
        "scheduler.warmup_iters=1",
        f"checkpoint.save_interval={save_at}",
        f"checkpoint.async_save={str(async_save).lower()}",
        f"logging.run_dir={run_dir}",
        *extra,
    ]


def writing_dirs(save_dir: Path, iteration: int) -> list[Path]:
    """The temporary directories of the save of `iteration` while it is being written."""
    from pipeline.checkpoint.layout import iteration_dir_name

    return list(save_dir.glob(f"{iteration_dir_name(iteration)}.tmp-*"))


def timed_steps(run_dir: Path, save_at: int, async_save: bool) -> list[tuple[float, bool, bool]]:
    """Train until the save at `save_at` is written and `STEPS_AFTER` steps ran after it;
    returns (start time, save in flight at start, at end) of each step."""
    from pipeline.train.assembly.run_config import resolve_config
    from pipeline.train.loop.trainer import Trainer

    config = resolve_config(None, run_sets(run_dir, save_at, async_save))
    trainer = Trainer(config, console=False)
    step, steps = trainer.train_one_step, []
    save_dir = run_dir / "checkpoints"

    def in_flight() -> bool:
        return bool(writing_dirs(save_dir, save_at))

    def timed(iterator):
        after = sum(1 for s in steps[save_at:] if not (s[1] or s[2]))
        if trainer.iteration == 2 * save_at - 1 or after >= STEPS_AFTER:
            raise _Enough
        start, at_start = time.perf_counter(), in_flight()
        result = step(iterator)
        steps.append((start, at_start, in_flight()))
        return result

    trainer.train_one_step = timed
    with contextlib.suppress(_Enough):
        trainer.train()
    return steps


def save_seconds(directory: Path) -> float:
    """From a save's recorded start (`saved_at`) to the writing of its completion record."""
    from pipeline.checkpoint import read_checkpoint_record
    from pipeline.checkpoint.layout import PIPE_METADATA

    started = datetime.datetime.fromisoformat(read_checkpoint_record(directory)["saved_at"])
    return (directory / PIPE_METADATA).stat().st_mtime - started.timestamp()


def measure(save_at: int, async_save: bool) -> dict:
    """One mode's figures: the save's seconds, the saving iteration's, the step medians."""
    with tempfile.TemporaryDirectory(prefix="pipe-bench-async-save-") as tmp:
        run_dir = Path(tmp)
        steps = timed_steps(run_dir, save_at, async_save)
        periods = [b[0] - a[0] for a, b in zip(steps, steps[1:])]
        baseline = [
            p
            for i, (p, s) in enumerate(zip(periods, steps))
            if i >= WARM_STEPS and not (s[1] or s[2]) and i != save_at - 1
        ]
        during = [p for p, s in zip(periods, steps) if s[1] or s[2]]
        return {
            "save_s": save_seconds(run_dir / "checkpoints" / f"iter_{save_at:07d}"),
            "saving_iteration_s": periods[save_at - 1],
            "baseline_s": statistics.median(baseline),
            "during_s": statistics.median(during) if during else None,
            "steps_during": len(during),
        }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--save-at", type=int, default=8)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--modes", default="async,sync", help="comma-separated: async, sync")
    args = parser.parse_args()

    import torch

    torch.set_num_threads(args.threads)
    for mode in args.modes.split(","):
        if mode not in ("async", "sync"):
            parser.error(f"--modes: unknown mode {mode!r} (async or sync)")
        figures = measure(args.save_at, mode == "async")
        line = (
            f"{mode:5s}: save {figures['save_s']:.2f} s, its iteration "
            f"{figures['saving_iteration_s']:.2f} s, steps without a save "
            f"{figures['baseline_s'] * 1e3:.0f} ms"
        )
        if figures["during_s"] is not None:
            ratio = figures["during_s"] / figures["baseline_s"]
            line += (
                f", {figures['steps_during']} steps during the write "
                f"{figures['during_s'] * 1e3:.0f} ms ({ratio:.2f}x)"
            )
        print(line, flush=True)


if __name__ == "__main__":
    main()
