"""A GRPO step's time split into its parts, and the rollouts' speed against the engine alone.

Builds a GRPO run through the trainer (what `pipe train --grpo` runs) on prompts made here
(sums of two numbers, with their answers) and a small tokenizer trained on them, times
`--warmup` untimed + `--steps` timed optimizer steps, and prints each part's share of the step:

- rollout: the engine's generation of every completion (and, on a sharded layout, gathering
  the weights into the copy the engine runs on);
- rewards: decoding the completions and scoring them;
- reference: the log-probabilities of the frozen start (beta > 0) and of the sampling weights
  (num_iterations > 1), none by default;
- policy forward/backward: the loss's passes over the rows;
- optimizer: the optimizer step;
- other: what is left of the step (loading prompts, laying out rows, clipping).

Then every step's requests run again on a fresh `Engine` over the same model, outside
training, each with the weights that generated it: the warm-up steps' requests untimed, the timed
steps' requests timed, so the engine alone is as warm as the step's own engine was (same shapes
seen before, none seen twice). The rollouts' generated tokens/s in the timed steps against that
run's: the ratio should be close to 1, the step adding nothing to generation.

    python scripts/bench/grpo.py [--recipe tiny] [--steps 4] [--warmup 1] [--device cpu]
        [--set model.num_layers=4 ...] [--json FILE]

On a CPU the default is a small model in fp32; `--device cuda` keeps the recipe's dtype.

With `--async` it measures rollouts ahead of training instead: a `pipe serve` started here on
the run's starting weights generates the rollouts (`grpo.rollout_server`), and the same run is
timed synchronously (`grpo.max_staleness = 0`: each batch generated, then trained on) and one
batch ahead (`max_staleness = 1`: the next batch generated while the current one trains);
it prints both runs' steps per hour and their ratio. The server and the trainer share the
machine: on a CPU they share its cores, so the overlap gains only what idle cores allow.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

PARTS = ("rollout", "rewards", "reference", "policy forward/backward", "optimizer")


def write_task(directory: Path, count: int = 512, seed: int = 0) -> tuple[Path, Path]:
    """Prompts asking for a sum (with the `answer` the accuracy reward reads), and a tokenizer
    trained on their text; returns (prompts file, tokenizer directory)."""
    from pipeline.examples.stdlib_corpus import train_tokenizer

    rng = random.Random(seed)
    lines = []
    for _ in range(count):
        a, b = rng.randint(0, 99), rng.randint(0, 99)
        lines.append({"prompt": f"What is {a} + {b}?", "answer": str(a + b)})
    prompts = directory / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(line) + "\n" for line in lines))
    texts = [f"{line['prompt']} {line['answer']} #### {line['answer']}" for line in lines]
    return prompts, train_tokenizer(texts * 4, directory / "tokenizer", vocab_size=400)


class PartTimer:
    """Seconds spent in each part of the step, by wrapping the functions that do them (the
    device is synchronised around each on a GPU, so the work is counted where it is done)."""

    def __init__(self, device) -> None:
        self.device = device
        self.seconds: dict[str, float] = defaultdict(float)

    def _sync(self) -> None:
        import torch

        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def wrap(self, owner, name: str, part: str) -> None:
        original = getattr(owner, name)

        def timed(*args, **kwargs):
            self._sync()
            start = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                self._sync()
                self.seconds[part] += time.perf_counter() - start

        setattr(owner, name, timed)


def _measure(args: argparse.Namespace, work: Path) -> dict:
    import torch

    from pipeline.serve.engine.core import Engine
    from pipeline.train.assembly.run_config import resolve_config
    from pipeline.train.loop import train_step
    from pipeline.train.loop.trainer import Trainer
    from pipeline.train.objectives.grpo import objective as grpo
    from pipeline.train.objectives.grpo import rollout as grpo_rollout

    prompts, tokenizer = write_task(work)
    iters = args.warmup + args.steps
    sets = [*_cpu_sets(args, prompts, tokenizer, work, iters), f"logging.run_dir={work / 'run'}"]
    trainer = Trainer(resolve_config(args.recipe, sets), console=False)
    objective, timer = trainer.objective, PartTimer(trainer.device)
    captured: list[dict] = []
    _capture_generation(grpo_rollout.RolloutModel, captured)
    timer.wrap(grpo_rollout.RolloutModel, "generate", "rollout")
    timer.wrap(grpo_rollout.RolloutModel, "refresh", "rollout")
    timer.wrap(grpo.GRPO, "_rewards", "rewards")
    timer.wrap(grpo.GRPO, "_add_logps", "reference")
    timer.wrap(trainer.step_runner, "forward_backward", "policy forward/backward")
    timer.wrap(train_step, "step_unless_nonfinite", "optimizer")
    batches = iter(trainer.train_loader)
    for _ in range(args.warmup):
        trainer.train_one_step(batches)
    timer.seconds.clear()
    timer._sync()
    start = time.perf_counter()
    for _ in range(args.steps):
        trainer.train_one_step(batches)
    timer._sync()
    step_s = (time.perf_counter() - start) / args.steps
    shares = {part: timer.seconds[part] / args.steps / step_s for part in PARTS}
    shares["other"] = 1.0 - sum(shares.values())
    warm, timed = captured[: len(captured) - args.steps], captured[len(captured) - args.steps :]
    in_step = sum(c["tokens"] for c in timed) / sum(c["seconds"] for c in timed)
    alone, alone_seconds = _engine_alone(Engine, objective.rollout.module, warm, timed)
    return {
        "device": torch.cuda.get_device_name() if trainer.device.type == "cuda" else "cpu",
        "step_s": step_s,
        "shares": shares,
        "rollout_tokens_per_s_in_step": in_step,
        "rollout_tokens_per_s_engine_alone": alone,
        "in_step_over_alone": in_step / alone,
        # where a gap comes from: each timed step's rollout seconds both ways, and whether the
        # step's engine was built anew (a bigger batch or longer prompts than before)
        "rollout_seconds_in_step": [c["seconds"] for c in timed],
        "rollout_seconds_alone": alone_seconds,
        "engines_built_in_timed_steps": sum(c["new_engine"] for c in timed),
        "completions_per_step": len(timed[-1]["rows"]),
    }


def _capture_generation(cls, captured: list[dict]) -> None:
    """Keep each step's requests, the weights that generated them, and the generated tokens
    and seconds."""
    original = cls.generate

    def generate(self, prompts, params):
        weights = {k: v.detach().clone() for k, v in self.module.state_dict().items()}
        engine = self.engine
        outs = original(self, prompts, params)
        captured.append(
            dict(
                prompts=prompts,
                params=params,
                rows=outs.completions,
                weights=weights,
                tokens=outs.generated_tokens,
                seconds=outs.seconds,
                new_engine=self.engine is not engine,
            )
        )
        return outs

    cls.generate = generate


def _engine_alone(
    engine_class, module, warm: list[dict], timed: list[dict]
) -> tuple[float, list[float]]:
    """Generated tokens/s of the `timed` steps' requests on a fresh engine over the same model,
    each with the weights that generated it (so the same completions come out), after the
    `warm` steps' requests untimed: the engine has then seen what the step's engine had. Also
    each timed step's seconds."""
    import torch

    from pipeline.train.objectives.grpo import ROLLOUT_BLOCK

    everything = warm + timed
    rows = max(sum(len(group) for group in c["params"]) for c in everything)
    longest = max(
        max(len(p) for p in c["prompts"]) + c["params"][0][0].max_new_tokens for c in everything
    )
    blocks = rows * -(-longest // ROLLOUT_BLOCK)
    engine = engine_class(
        module,
        max_batch=rows,
        cache_blocks=blocks,
        block_size=ROLLOUT_BLOCK,
        prefill_chunk=4096,
        max_waiting=rows,
    )
    module.eval()
    tokens, seconds = 0, []
    with torch.no_grad():
        for index, capture in enumerate(everything):
            module.load_state_dict(capture["weights"])
            engine.weights_changed()  # as the step's engine does at each refresh
            start = time.perf_counter()
            requests = engine.generate_groups(capture["prompts"], capture["params"])
            if module.output.weight.is_cuda:
                torch.cuda.synchronize()
            if index >= len(warm):  # a timed step's requests
                seconds.append(time.perf_counter() - start)
                tokens += sum(len(r.output) for group in requests for r in group)
    return tokens / sum(seconds), seconds


def _cpu_sets(args: argparse.Namespace, prompts: Path, tokenizer: Path, work: Path, iters: int):
    """The bench run's settings (a small fp32 model on a CPU, as `_measure` runs)."""
    small = [
        "training.dtype=fp32",
        "model.num_layers=4",
        "model.hidden_size=256",
        "model.num_attention_heads=4",
        "model.num_kv_heads=2",
        "model.ffn_hidden_size=768",
        "model.vocab_size=512",
        "data.seq_length=128",
        "grpo.max_completion_length=64",
        "training.global_batch_size=8",
        "training.micro_batch_size=4",
    ]
    return [
        *(small if args.device == "cpu" else []),
        *args.sets,
        "data.mock=false",
        "data.kind=grpo",
        f"data.blend={prompts}",
        f"data.tokenizer={tokenizer}",
        "data.split=100,0,0",
        "data.num_workers=0",
        "training.eval_interval=0",
        f"training.iters={iters}",
        "scheduler.warmup_iters=0",
        f"scheduler.decay_iters={iters}",
        f"training.device={args.device}",
        "checkpoint.save_interval=1000",
        'grpo.reward_funcs=["accuracy", "format"]',
    ]


def _measure_async(args: argparse.Namespace, work: Path) -> dict:
    """Steps per hour with the rollouts on a server, synchronous and one batch ahead."""
    import subprocess
    import urllib.request

    from pipeline.train.assembly.run_config import resolve_config
    from pipeline.train.loop.trainer import Trainer

    prompts, tokenizer = write_task(work)
    iters = args.warmup + args.steps
    start_sets = _cpu_sets(args, prompts, tokenizer, work, 1)
    start_sets += [f"logging.run_dir={work / 'start'}", "checkpoint.save_hf=final"]
    Trainer(resolve_config(args.recipe, start_sets), console=False).train()
    (start,) = (work / "start" / "checkpoints" / "hf").iterdir()
    port = _free_port()
    with open(work / "serve.log", "w") as log:
        server = subprocess.Popen(
            [sys.executable, "-m", "pipeline", "serve", str(start), "--port", str(port)]
            + ["--max-batch", "64", "--engine-threads", "1"],
            stderr=log,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
        )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                urllib.request.urlopen(url + "/health", timeout=2)
                break
            except OSError:
                if time.monotonic() > deadline or server.poll() is not None:
                    raise RuntimeError(
                        f"pipe serve did not start: see {work / 'serve.log'}"
                    ) from None
                time.sleep(0.3)
        seconds = {}
        for staleness in (0, 1):
            sets = _cpu_sets(args, prompts, tokenizer, work, iters)
            sets += [
                f"logging.run_dir={work / f'run{staleness}'}",
                f"checkpoint.load={start}",
                f"grpo.rollout_server={url}",
                f"grpo.max_staleness={staleness}",
            ]
            trainer = Trainer(resolve_config(args.recipe, sets), console=False)
            batches = iter(trainer.train_loader)
            for _ in range(args.warmup):
                trainer.train_one_step(batches)
            began = time.perf_counter()
            for _ in range(args.steps):
                trainer.train_one_step(batches)
            seconds[staleness] = (time.perf_counter() - began) / args.steps
            if trainer.objective.ahead is not None:
                trainer.objective.ahead.drain()
    finally:
        server.terminate()
        server.wait(30)
    return {
        "steps_per_hour_sync": 3600 / seconds[0],
        "steps_per_hour_async": 3600 / seconds[1],
        "async_over_sync": seconds[0] / seconds[1],
    }


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipe", default="tiny")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--json", type=Path)
    parser.add_argument(
        "--async",
        dest="ahead",
        action="store_true",
        help="time rollouts on a server, synchronous against one batch ahead",
    )
    args = parser.parse_args()
    if args.ahead:
        with (
            tempfile.TemporaryDirectory(prefix="pipe_bench_grpo_") as work,
            contextlib.redirect_stdout(sys.stderr),
        ):
            result = _measure_async(args, Path(work))
        print(
            f"steps/hour synchronous {result['steps_per_hour_sync']:,.0f}, one batch ahead "
            f"{result['steps_per_hour_async']:,.0f}: {result['async_over_sync']:.2f}x"
        )
        if args.json:
            args.json.write_text(json.dumps(result, indent=2))
        return
    with (
        tempfile.TemporaryDirectory(prefix="pipe_bench_grpo_") as work,
        contextlib.redirect_stdout(sys.stderr),  # the trainer's own lines stay off stdout
    ):
        result = _measure(args, Path(work))
    print(
        f"device {result['device']}: {result['step_s'] * 1e3:.0f} ms per GRPO step, "
        f"{result['completions_per_step']} completions"
    )
    for part, share in result["shares"].items():
        print(f"  {part:26s} {100 * share:5.1f}%")
    print(
        f"rollout tokens/s in the step {result['rollout_tokens_per_s_in_step']:,.0f}, engine "
        f"alone {result['rollout_tokens_per_s_engine_alone']:,.0f}: "
        f"{result['in_step_over_alone']:.2f}x"
    )
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
