"""Training throughput of a recipe with FP8 against the same recipe in bf16, one invocation.

Each run (bf16 first, then each FP8 recipe) builds the recipe's model through the trainer
(parallelize, compile, FP8 conversion: exactly what `pipe train` runs) in its own child process,
so peak memory and compile caches are its own, then times `--warmup` untimed + `--steps` timed
optimizer steps on mock data (the trainer's loader). Printed per run:

- tokens/s: global batch x sequence length x timed steps / timed seconds;
- model TFLOP/s: tokens/s x Megatron-LM's training FLOPs per token with causal attention
  (`flops_per_token`: 12·L·H²·[(1 + G/A + S/2H)·(A·D/H) + 1.5·K·F/H + V/(2·L·H)], i.e. forward
  + both backward GEMMs of every projection, QK^T and AV halved for the causal mask, the output
  layer; FP8 runs are credited the same FLOPs as bf16);
- MFU: model TFLOP/s / the detected GPU's dense bf16 peak (`pipeline.train.report.perf`; n/a on a
  CPU or an unlisted GPU);
- peak memory: CUDA max allocated, or on a CPU the process's peak RSS;

and then each FP8/bf16 tokens/s ratio. One process, one device (multi-GPU layouts: not yet).

    python scripts/bench/train.py --recipe llama3_8b --fp8 torchao[,torchao:rowwise] [--warmup 5]
        [--steps 20] [--set model.num_layers=8 ...] [--device cpu] [--json FILE]

`--fp8` takes several recipes, comma-separated, each timed in its own child against the one bf16
run, or `none` for bf16 alone; `--json FILE` writes every figure to FILE as well, rewritten after
each run, so a benchmark stopped part-way keeps the runs it finished.

`--profile N` then runs N more steps of each run under `torch.profiler` and prints where their
time goes (`profile_summary.py`: attention, GEMMs, loss, optimizer, communication, other and
idle shares of the wall time, the top kernels, host syncs per step), for a target that is
missed; the run's figures are kept before the profile starts.

`--device cpu` is a smoke run: it sets `fp8.emulate=true` and
`fp8.linear_filter=all` (torchao's emulated FP8 on every aligned linear), so it checks the path,
not FP8 speed.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts" / "bench"))


def _measure(args: argparse.Namespace, emit) -> None:
    """Child: build one run and time it; `emit` its figures (a dict), then, with `--profile`,
    the profile's summary (`{"profile": ...}`)."""
    import torch

    from pipeline.core.model.flavors import flops_per_token
    from pipeline.train.assembly.run_config import resolve_config
    from pipeline.train.loop.trainer import Trainer
    from pipeline.train.report.perf import memory_gib, peak_tflops

    iters = args.warmup + args.steps
    sets = [
        "training.dtype=bf16",  # both runs compute in bf16 (FP8 GEMMs on top); --set may change
        *args.sets,
        "data.mock=true",
        f"training.iters={iters}",
        "scheduler.warmup_iters=0",  # the learning rate does not change the step's cost
        f"scheduler.decay_iters={iters}",
        "scheduler.decay_style=constant",
        "training.eval_interval=0",
        f"training.device={args.device}",
        f"logging.run_dir={args.run_dir}",
    ]
    if args.fp8:
        sets.append(f"fp8.recipe={args.fp8}")
        if args.device == "cpu":
            sets += ["fp8.linear_filter=all", "fp8.emulate=true"]
    cfg = resolve_config(args.recipe, sets)
    trainer = Trainer(cfg, console=False)
    device = trainer.device
    batches = iter(trainer.train_loader)

    def step() -> None:
        trainer.train_one_step(batches)

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    for _ in range(args.warmup):
        step()
    sync()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    start = time.perf_counter()
    for _ in range(args.steps):
        step()
    sync()
    seconds = time.perf_counter() - start
    tokens = cfg.training.global_batch_size * cfg.data.seq_length * args.steps
    tflops = flops_per_token(trainer.model_config, cfg.data.seq_length) * tokens / seconds / 1e12
    peak = peak_tflops(device)
    emit(
        {
            "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "fp8": trainer.fp8.describe() if trainer.fp8 is not None else "off",
            "tokens_per_s": tokens / seconds,
            "tflops": tflops,
            "mfu": tflops / peak if peak else None,
            "peak_gib": memory_gib(device),
            "step_s": seconds / args.steps,
        }
    )
    if args.profile:
        from profile_summary import profile_steps

        emit({"profile": profile_steps(step, sync, args.profile, device.type == "cuda")})


def _run_child(argv: list[str], fp8: str | None, keep) -> dict:
    """One run in a child process; `keep(figures)` each time more of its figures arrive (the
    timing, then the profile), so a run cut short keeps what it measured."""
    record: dict = {}
    with tempfile.TemporaryDirectory(prefix="pipe_bench_") as run_dir:
        command = [sys.executable, __file__, *argv, "--child", "--run-dir", run_dir]
        if fp8:
            command += ["--child-fp8", fp8]
        log = Path(run_dir) / "stderr.txt"
        with (
            log.open("w") as sink,
            subprocess.Popen(command, stdout=subprocess.PIPE, stderr=sink, text=True) as child,
        ):
            for line in child.stdout:
                if line.startswith("{"):
                    record.update(json.loads(line))
                    keep(record)
        stderr = log.read_text().strip()
    if child.returncode != 0 and "tokens_per_s" not in record:
        print(f"benchmark run ({fp8 or 'bf16'}) failed:\n{stderr[-4000:]}", file=sys.stderr)
        return {"error": stderr.splitlines()[-1] if stderr else "failed"}
    return record


def _line(name: str, r: dict) -> str:
    if "error" in r:
        return f"{name:28s} failed: {r['error']}"
    mfu = f"{100 * r['mfu']:.1f}%" if r["mfu"] is not None else "n/a"
    return (
        f"{name:28s} {r['tokens_per_s']:12,.0f} tokens/s  {r['tflops']:8.3f} model TFLOP/s  "
        f"MFU {mfu:>6s}  peak mem {r['peak_gib']:.2f} GiB  ({r['step_s'] * 1e3:.0f} ms/step)"
    )


def _fp8_recipes(value: str) -> list[str]:
    """The `--fp8` list: comma-separated recipes, or `none` for the bf16 run alone."""
    recipes = [r.strip() for r in value.split(",") if r.strip()]
    return [] if recipes in ([], ["none"]) else recipes


def _child_argv(argv: list[str]) -> list[str]:
    """The parent's arguments less `--fp8` and `--json` (the parent's alone)."""
    kept, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg in ("--fp8", "--json"):
            skip = True
        elif not arg.startswith(("--fp8=", "--json=")):
            kept.append(arg)
    return kept


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--recipe", default="tiny", help="shipped recipe name or .toml")
    parser.add_argument(
        "--fp8",
        default="torchao",
        help="FP8 recipe(s) to time against bf16, comma-separated (torchao[:rowwise], "
        "te[:current], ...), or none for bf16 alone",
    )
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--json", type=Path, help="also write every figure to this JSON file")
    parser.add_argument(
        "--profile",
        type=int,
        default=0,
        metavar="N",
        help="then profile N more steps of each run (where the time goes)",
    )
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--child-fp8", help=argparse.SUPPRESS)
    parser.add_argument("--run-dir", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        import logging

        logging.basicConfig(level=logging.WARNING)
        args.fp8 = args.child_fp8
        _measure(args, lambda figures: print(json.dumps(figures), flush=True))
        return

    argv = _child_argv(sys.argv[1:])
    print(
        f"recipe {args.recipe} on {args.device}: {args.warmup} warm-up + {args.steps} timed "
        f"steps, mock data; {' '.join(args.sets) or 'no overrides'}"
    )
    if args.device == "cpu" and _fp8_recipes(args.fp8):
        print("CPU smoke run: emulated FP8 (fp8.emulate, linear_filter=all): not FP8 speed")
    print("model FLOPs: Megatron's causal count (flops_per_token), the same for FP8 and bf16")
    record: dict = {"recipe": args.recipe, "sets": args.sets, "fp8": {}}

    def keep(name: str, recipe: str | None = None):
        def store(figures: dict) -> None:
            if recipe is None:
                record[name] = figures
            else:
                record[name][recipe] = figures
            _save(args.json, record)

        return store

    bf16 = record["bf16"] = _run_child(argv, None, keep("bf16"))
    _save(args.json, record)
    print(_line("bf16", bf16), flush=True)
    _print_profile(bf16)
    for recipe in _fp8_recipes(args.fp8):
        figures = record["fp8"][recipe] = _run_child(argv, recipe, keep("fp8", recipe))
        if "error" not in figures and "error" not in bf16:
            figures["ratio_to_bf16"] = figures["tokens_per_s"] / bf16["tokens_per_s"]
        _save(args.json, record)
        print(f"{recipe}: {figures.get('fp8', 'failed')}")
        ratio = f"  {figures['ratio_to_bf16']:.2f}x bf16" if "ratio_to_bf16" in figures else ""
        print(_line(recipe, figures) + ratio, flush=True)
        _print_profile(figures)
    if any("error" in r for r in [bf16, *record["fp8"].values()]):
        sys.exit(1)


def _print_profile(figures: dict) -> None:
    if "profile" in figures:
        from profile_summary import format_summary

        print("\n".join(format_summary(figures["profile"])), flush=True)


def _save(path: Path | None, record: dict) -> None:
    """Write the figures so far to `--json`, if given (after every run)."""
    if path is not None:
        path.write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
