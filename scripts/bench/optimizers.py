"""Loss against tokens for each optimizer on the stdlib corpus, and its step's share of a step.

Builds the embedded default corpus and tokenizer (`pipeline.examples.stdlib_corpus`, as the
quickstart does), preprocesses it once, then trains the `tiny` recipe with each optimizer of
`--optimizers` over the same samples in the same order, at each of its learning rates
(`--lrs NAME=LR,LR,...`: a small sweep; the best final loss is the optimizer's tuned run).
Printed: the tuned runs' loss every `--every` steps against tokens seen, a table of each run's
final loss, and the optimizer step's time as a share of the training step (the optimizer step
wrapped and timed). `--plot FILE` draws the tuned curves (needs matplotlib); `--json FILE` keeps
every figure; `--runs FILE` (repeatable) adds the runs of an earlier `--json` to the table and
the choice of tuned runs, so a sweep can be widened without running it again.

    python scripts/bench/optimizers.py [--optimizers adamw,muon] [--steps 300]
        [--lrs adamw=1e-3,3e-3 --lrs muon=1e-3,3e-3] [--plot curves.png] [--json out.json]
        [--runs earlier.json]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

DEFAULT_LRS = {"adamw": [1e-3, 3e-3], "muon": [1e-3, 3e-3]}


def build_corpus(work: Path) -> str:
    """The stdlib corpus, its tokenizer and its preprocessed prefix (returned)."""
    data = work / "data"
    corpus = [sys.executable, "-m", "pipeline.examples.stdlib_corpus", "--output", str(data)]
    subprocess.run(corpus, check=True, capture_output=True)
    prefix = data / "stdlib"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pipeline",
            "preprocess",
            "--input",
            str(data / "stdlib_docs.jsonl"),
            "--tokenizer",
            str(data / "tokenizer"),
            "--output-prefix",
            str(prefix),
            "--append-eod",
            "--workers",
            "2",
        ],
        check=True,
        capture_output=True,
    )
    return f"{prefix}_text_document"


def train(name: str, lr: float, prefix: str, steps: int, work: Path, sets: list[str]) -> dict:
    """One run of the `tiny` recipe with optimizer `name` at `lr`: its losses by step, tokens
    per step, and the share of step time the optimizer step took."""
    from pipeline.train.assembly.run_config import resolve_config
    from pipeline.train.loop import train_step
    from pipeline.train.loop.trainer import Trainer

    run_dir = work / f"{name}_{lr:g}"
    config = resolve_config(
        "tiny",
        [
            f"data.blend={prefix}",
            "data.mock=false",
            "data.num_workers=0",
            f"training.iters={steps}",
            "training.device=cpu",
            "training.eval_interval=0",
            "training.log_interval=1",
            f"optimizer.name={name}",
            f"optimizer.lr={lr}",
            f"optimizer.min_lr={lr / 10}",
            f"scheduler.warmup_iters={max(steps // 10, 1)}",
            "checkpoint.save_interval=100000",
            f"logging.run_dir={run_dir}",
            *sets,
        ],
    )
    trainer = Trainer(config, console=False)
    timed = {"optimizer": 0.0}
    original = train_step.step_unless_nonfinite

    def timed_step(*args, **kwargs):
        start = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            timed["optimizer"] += time.perf_counter() - start

    train_step.step_unless_nonfinite = timed_step
    try:
        start = time.perf_counter()
        result = trainer.train()
        seconds = time.perf_counter() - start
    finally:
        train_step.step_unless_nonfinite = original
    t = config.training
    return {
        "optimizer": name,
        "lr": lr,
        "losses": {int(k): v for k, v in result.losses.items()},
        "tokens_per_step": t.global_batch_size * config.data.seq_length,
        "optimizer_share": timed["optimizer"] / seconds,
        "step_seconds": seconds / steps,
    }


def _final(run: dict, window: int = 10) -> float:
    """The mean loss of the last `window` steps (one step is noisy)."""
    losses = [run["losses"][k] for k in sorted(run["losses"])][-window:]
    return sum(losses) / len(losses)


def report(runs: list[dict], every: int) -> dict[str, dict]:
    """Print the sweep's table and the tuned runs' curves; returns the tuned run per optimizer."""
    print(f"{'optimizer':10s} {'lr':>8s} {'final loss':>11s} {'step':>8s} {'optimizer step':>15s}")
    for run in runs:
        print(
            f"{run['optimizer']:10s} {run['lr']:8.0e} {_final(run):11.4f} "
            f"{run['step_seconds']:7.3f}s {100 * run['optimizer_share']:14.1f}%"
        )
    tuned: dict[str, dict] = {}
    for run in runs:
        best = tuned.get(run["optimizer"])
        if best is None or _final(run) < _final(best):
            tuned[run["optimizer"]] = run
    names = list(tuned)
    print(
        "\nloss against tokens (tuned learning rates: "
        + ", ".join(f"{n} {tuned[n]['lr']:g}" for n in names)
        + ")"
    )
    print(f"{'tokens':>10s} " + " ".join(f"{n:>10s}" for n in names))
    steps = sorted(tuned[names[0]]["losses"])
    for step in steps[every - 1 :: every]:
        tokens = step * tuned[names[0]]["tokens_per_step"]
        print(f"{tokens:10,d} " + " ".join(f"{tuned[n]['losses'][step]:10.4f}" for n in names))
    return tuned


def plot(tuned: dict[str, dict], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("--plot needs matplotlib: pip install 'pipe-llm[plot]'", file=sys.stderr)
        return
    figure, axes = plt.subplots(figsize=(6, 4))
    for name, run in tuned.items():
        steps = sorted(run["losses"])
        axes.plot(
            [s * run["tokens_per_step"] for s in steps],
            [run["losses"][s] for s in steps],
            label=f"{name} (lr {run['lr']:g})",
        )
    axes.set_xlabel("tokens")
    axes.set_ylabel("training loss")
    axes.legend()
    figure.tight_layout()
    figure.savefig(path)


def _lrs(values: list[str]) -> dict[str, list[float]]:
    lrs = dict(DEFAULT_LRS)
    for value in values:
        name, _, rates = value.partition("=")
        lrs[name] = [float(r) for r in rates.split(",")]
    return lrs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--optimizers", default="adamw,muon")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--every", type=int, default=25)
    parser.add_argument("--lrs", action="append", default=[], metavar="NAME=LR,LR")
    parser.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--plot", type=Path)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--runs", type=Path, action="append", default=[], metavar="FILE")
    args = parser.parse_args()
    lrs = _lrs(args.lrs)
    runs = [run for path in args.runs for run in json.loads(path.read_text())]
    names = [name for name in args.optimizers.split(",") if name]
    with tempfile.TemporaryDirectory(prefix="pipe_bench_optim_") as work:
        prefix = build_corpus(Path(work)) if names else ""
        for name in names:
            for lr in lrs.get(name, [1e-3]):
                with contextlib.redirect_stdout(sys.stderr):
                    runs.append(train(name, lr, prefix, args.steps, Path(work), args.sets))
    for run in runs:  # JSON keys are strings
        run["losses"] = {int(step): loss for step, loss in run["losses"].items()}
    tuned = report(runs, args.every)
    if args.plot:
        plot(tuned, args.plot)
    if args.json:
        args.json.write_text(json.dumps(runs, indent=2))


if __name__ == "__main__":
    main()
