"""The share of a training run's time spent in in-loop lm-eval (`[eval] lm_eval_tasks`).

Trains a small model (the `tiny` recipe, made small and fp32 on a CPU) on a corpus and tokenizer
made here, with a local multiple-choice task (`--docs` documents, four choices each) scored
every `--interval` iterations, for `--steps` iterations, and prints the seconds spent scoring
against the run's whole time: the loop, and the loading of the tasks when the run starts
(counted as evaluation); the model's building and the data's set-up are left out.

    python scripts/bench/inloop_eval.py [--steps 200] [--interval 100] [--docs 100]
        [--device cpu] [--set model.num_layers=4 ...]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path
from unittest import mock

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

TASK_YAML = """task: bench_inloop_mc
dataset_path: json
dataset_kwargs:
  data_files: {{test: {data}}}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: answer
metric_list:
  - metric: acc
"""


def write_inputs(directory: Path, docs: int, seed: int = 0) -> tuple[Path, Path, Path]:
    """A corpus of sums (a .bin/.idx prefix), its tokenizer and a task folder asking for the
    sums as a four-way choice; returns (prefix, tokenizer directory, task folder)."""
    import numpy as np

    from pipeline.data.indexed import IndexedDatasetWriter
    from pipeline.examples.stdlib_corpus import train_tokenizer
    from pipeline.tokenizer.tokenizer import load_tokenizer

    rng = random.Random(seed)
    sums = [(rng.randint(0, 99), rng.randint(0, 99)) for _ in range(4000)]
    texts = [f"{a} plus {b} is {a + b}." for a, b in sums]
    tokenizer_dir = train_tokenizer(texts, directory / "tokenizer", vocab_size=512)
    tokenizer = load_tokenizer(tokenizer_dir)
    prefix = directory / "corpus_text_document"
    with IndexedDatasetWriter(prefix, np.uint16) as writer:
        for ids in tokenizer.encode_batch(texts):
            writer.add_document(np.array(ids, dtype=np.uint16), [len(ids)])
        writer.finalize()
    tasks = directory / "tasks"
    tasks.mkdir()
    lines = []
    for a, b in sums[:docs]:
        choices = [str(a + b + shift) for shift in (0, 1, -1, 10)]
        rng.shuffle(choices)
        question = f"{a} plus {b} is"
        lines.append(
            {"question": question, "choices": choices, "answer": choices.index(str(a + b))}
        )
    data = tasks / "mc.jsonl"
    data.write_text("".join(json.dumps(line) + "\n" for line in lines))
    (tasks / "mc.yaml").write_text(TASK_YAML.format(data=data))
    return prefix, tokenizer_dir, tasks


def measure(args: argparse.Namespace, work: Path) -> dict:
    """The run's loop time and the part of it spent in lm-eval, in seconds."""
    from pipeline.train.assembly.run_config import resolve_config
    from pipeline.train.loop.trainer import Trainer
    from pipeline.train.report import lm_eval_scores

    prefix, tokenizer, tasks = write_inputs(work, args.docs)
    small = [
        "training.dtype=fp32",
        "model.num_layers=4",
        "model.hidden_size=256",
        "model.num_attention_heads=4",
        "model.num_kv_heads=2",
        "model.ffn_hidden_size=768",
        "model.vocab_size=512",
    ]
    sets = [
        *(small if args.device == "cpu" else []),
        "data.mock=false",
        f"data.blend={prefix}",
        f"data.tokenizer={tokenizer}",
        "data.seq_length=128",
        "data.num_workers=0",
        "training.global_batch_size=8",
        "training.micro_batch_size=4",
        "training.eval_interval=0",
        f"training.iters={args.steps}",
        f"training.device={args.device}",
        "training.log_interval=50",
        "checkpoint.save_interval=0",
        f"scheduler.warmup_iters={min(30, args.steps // 10)}",
        'eval.lm_eval_tasks=["bench_inloop_mc"]',
        f"eval.lm_eval_interval={args.interval}",
        f"eval.lm_eval_include_path={tasks}",
        f"logging.run_dir={work / 'run'}",
        *args.sets,
    ]
    # loading the tasks (when the run starts) counts as evaluation, and as run time
    spent = {"lm_eval": 0.0, "loading": 0.0}
    evaluation = lm_eval_scores.InLoopEvaluation

    def timed(method, key):
        def run(self, *a, **k):
            start = time.perf_counter()
            try:
                return method(self, *a, **k)
            finally:
                spent[key] += time.perf_counter() - start

        return run

    with (
        mock.patch.object(evaluation, "__init__", timed(evaluation.__init__, "loading")),
        mock.patch.object(evaluation, "scores", timed(evaluation.scores, "lm_eval")),
    ):
        trainer = Trainer(resolve_config("tiny", sets), console=False)
        start = time.perf_counter()
        trainer.train()
        total = time.perf_counter() - start + spent["loading"]
    spent["lm_eval"] += spent["loading"]
    return {
        "total_s": total,
        "lm_eval_s": spent["lm_eval"],
        "loading_s": spent["loading"],
        "share": spent["lm_eval"] / total,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--interval", type=int, default=100)
    parser.add_argument("--docs", type=int, default=100)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--set", dest="sets", action="append", default=[])
    args = parser.parse_args()
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    with tempfile.TemporaryDirectory() as tmp:
        figures = measure(args, Path(tmp))
    print(
        f"{args.steps} steps, lm-eval ({args.docs} documents) every {args.interval}: "
        f"run {figures['total_s']:.1f} s, lm-eval {figures['lm_eval_s']:.1f} s "
        f"(loading the tasks {figures['loading_s']:.1f} s), "
        f"share {100 * figures['share']:.1f}%"
    )


if __name__ == "__main__":
    main()
