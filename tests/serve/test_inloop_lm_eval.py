"""`[eval] lm_eval_tasks`: lm-eval tasks scored on the training model during `pipe train`, logged
to metrics.jsonl, equal (1e-4, per request too) to `pipe eval` on the last checkpoint exported to
Hugging Face's format (`pipe export --vllm`); local task files, no network. The tasks, loaded
once, ask what `simple_evaluate` asks at every evaluation; an evaluation leaves the global random
generators alone and prints nothing."""

from __future__ import annotations

import json
import random
import shutil
from unittest import mock

import numpy as np
import pytest
import torch

from pipeline.train.assembly.run_config import resolve_config
from pipeline.train.config.schema import ConfigError
from pipeline.train.loop.trainer import Trainer
from pipeline.train.report.lm_eval_scores import flat_scores
from tests.builders import micro_sets, records, run_pipe, tokenized_corpus
from tests.serve.test_lm_eval import MC_DOCS, MC_YAML, TASKS, offline, task_dir  # noqa: F401

pytest.importorskip("lm_eval")
pytest.importorskip("fastapi")

TEXTS = [f"line {i}: value={i * 7} {'abc' * (i % 5)}" for i in range(600)]


def run_sets(tmp_path, tasks_folder, tasks: list[str]) -> list[str]:
    """A micro run on a corpus of `TEXTS` with its tokenizer, scoring `tasks` every 4
    iterations from the task files in `tasks_folder`."""
    prefix = tokenized_corpus(TEXTS, tmp_path)
    return micro_sets(
        tmp_path / "run",
        "data.mock=false",
        f"data.blend={prefix}",
        f"data.tokenizer={tmp_path / 'tok'}",
        "model.vocab_size=512",
        f"eval.lm_eval_tasks={json.dumps(tasks)}",
        "eval.lm_eval_interval=4",
        f"eval.lm_eval_include_path={tasks_folder}",
    )


def test_inloop_scores_equal_pipe_eval(tmp_path, task_dir) -> None:  # noqa: F811
    run_dir = tmp_path / "run"
    trainer = Trainer(resolve_config(None, run_sets(tmp_path, task_dir, TASKS)), console=False)
    trainer.train()
    valid = records(run_dir, "valid")
    scores = {k: v for k, v in valid[8].items() if k.startswith("lm_eval/")}
    assert set(scores) >= {"lm_eval/pipe_tiny_mc/acc", "lm_eval/pipe_tiny_gen/exact_match"}
    assert "lm_eval/pipe_tiny_mc/acc" in valid[4]

    output = tmp_path / "eval.json"
    args = ["--tasks", ",".join(TASKS), "--include-path", task_dir, "--output", output]
    exported = tmp_path / "hf"
    run_pipe("export", run_dir / "checkpoints", "--vllm", "-o", exported, "--dtype", "float32")
    run_pipe("eval", exported, *args, "--log-samples")
    served = json.loads(output.read_text())
    for name, value in scores.items():
        _, task, metric = name.split("/")
        assert value == pytest.approx(served["results"][task][f"{metric},none"], abs=1e-4), name
    # each request's answer too: the loglikelihoods (1e-4) and the greedy texts
    in_loop = _in_loop_samples(trainer)
    for task in TASKS:
        ours = sorted(in_loop[task], key=lambda s: s["doc_id"])
        theirs = sorted(served["samples"][task], key=lambda s: s["doc_id"])
        assert len(ours) == len(theirs) > 0
        for mine, other in zip(ours, theirs):
            for a, b in zip(mine["filtered_resps"], other["filtered_resps"]):
                if isinstance(a, str):
                    assert a == b
                else:
                    assert a[0] == pytest.approx(float(b[0]), abs=1e-4) and a[1] == b[1]


def _in_loop_samples(trainer: Trainer) -> dict:
    """The in-loop harness model's answers per document, on the trained model (iteration 8)."""
    import lm_eval

    from pipeline.train.report.lm_eval_scores import _harness_model_class

    hook = trainer.lm_eval
    model = _harness_model_class()(trainer.model, hook.tokenizer, trainer.device, hook.max_length)
    trainer.model.eval()
    results = lm_eval.simple_evaluate(
        model=model, tasks=TASKS, task_manager=hook.manager, log_samples=True
    )
    return results["samples"]


def test_inloop_eval_is_off_by_default(tmp_path) -> None:
    cfg = resolve_config(None, micro_sets(tmp_path))
    assert cfg.eval.lm_eval_tasks == [] and cfg.eval.lm_eval_interval == 0
    assert Trainer(cfg, console=False).lm_eval is None


def test_unknown_task_is_refused(tmp_path, task_dir) -> None:  # noqa: F811
    sets = run_sets(tmp_path, task_dir, ["no_such_task_here"])
    with pytest.raises(ConfigError, match="unknown lm-eval task 'no_such_task_here'"):
        Trainer(resolve_config(None, sets), console=False)


def test_a_task_whose_documents_cannot_be_read_is_refused(tmp_path, task_dir) -> None:  # noqa: F811
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    missing = tmp_path / "missing.jsonl"
    (tasks / "mc.yaml").write_text(MC_YAML.format(data=missing))
    sets = run_sets(tmp_path, tasks, ["pipe_tiny_mc"])
    with pytest.raises(ConfigError, match="eval.lm_eval_tasks: cannot load the tasks: .*missing"):
        Trainer(resolve_config(None, sets), console=False)


def test_inloop_eval_needs_a_tokenizer(tmp_path) -> None:
    sets = micro_sets(tmp_path, 'eval.lm_eval_tasks=["x"]', "eval.lm_eval_interval=2")
    with pytest.raises(ConfigError, match="eval.lm_eval_tasks needs the data's tokenizer"):
        Trainer(resolve_config(None, sets), console=False)


FEWSHOT_YAML = MC_YAML.replace("task: pipe_tiny_mc", "task: pipe_tiny_fewshot") + (
    "fewshot_split: test\nnum_fewshot: 2\n"
)


@pytest.fixture
def untrained(tmp_path, task_dir):  # noqa: F811
    """A run's untrained model, and the in-loop tasks plus a two-shot one drawn at random."""
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    for yaml in task_dir.glob("*.yaml"):
        shutil.copy(yaml, tasks)
    (tasks / "fewshot.yaml").write_text(FEWSHOT_YAML.format(data=task_dir / "mc.jsonl"))
    sets = run_sets(tmp_path, tasks, [*TASKS, "pipe_tiny_fewshot"])
    return Trainer(resolve_config(None, sets), console=False)


def test_every_evaluation_asks_what_pipe_eval_asks(untrained) -> None:
    """The tasks are loaded once and scored again and again: each evaluation gets the requests
    (the same two few-shot examples too) and the scores of `simple_evaluate`, what `pipe eval`
    runs, on tasks loaded afresh."""
    import lm_eval

    from pipeline.common.lm_eval_tasks import task_manager
    from pipeline.train.report.lm_eval_scores import _harness_model_class, _TrainingModelAnswers

    hook, model, device = untrained.lm_eval, untrained.model, untrained.device
    asked: list[list] = []
    answer = _TrainingModelAnswers._loglikelihood_tokens

    def recorded(self, requests, **kwargs):
        asked[-1].extend((context, continuation) for _, context, continuation in requests)
        return answer(self, requests, **kwargs)

    with mock.patch.object(_TrainingModelAnswers, "_loglikelihood_tokens", recorded):
        in_loop = []
        for _ in range(2):
            asked.append([])
            in_loop.append(hook.scores(model, device))
        asked.append([])
        fresh = task_manager(hook.tasks, untrained.cfg.eval.lm_eval_include_path)
        harness_model = _harness_model_class()(model, hook.tokenizer, device, hook.max_length)
        results = lm_eval.simple_evaluate(model=harness_model, tasks=hook.tasks, task_manager=fresh)
    assert asked[0] == asked[1] == asked[2] and len(asked[0]) == 2 * 3 * len(MC_DOCS)
    shots = [c for c, _ in asked[0] if len(c) > 3 * min(len(c) for c, _ in asked[0])]
    assert shots, "the two-shot task's contexts hold its examples"
    assert in_loop[0] == in_loop[1] == flat_scores(results["results"])
    assert "lm_eval/pipe_tiny_fewshot/acc" in in_loop[0]


def test_evaluation_leaves_the_random_generators_alone(untrained) -> None:
    """Training's random state (dropout, LoRA's dropout) is the same after an evaluation:
    lm-eval's `simple_evaluate` would have reseeded Python's, NumPy's and torch's generators."""
    before = random.getstate(), np.random.get_state()[1].copy(), torch.get_rng_state()
    untrained.lm_eval.scores(untrained.model, untrained.device)
    after = random.getstate(), np.random.get_state()[1], torch.get_rng_state()
    assert before[0] == after[0]
    assert np.array_equal(before[1], after[1]) and torch.equal(before[2], after[2])


def test_evaluation_prints_nothing(untrained, capfd) -> None:
    """lm-eval's warnings about the tasks' defaults, its progress bars and those of HF datasets
    stay out of `pipe train`'s output, from loading the tasks to the scores."""
    from pipeline.train.report.lm_eval_scores import InLoopEvaluation

    hook = untrained.lm_eval
    capfd.readouterr()
    include_path = untrained.cfg.eval.lm_eval_include_path
    evaluation = InLoopEvaluation(
        hook.tasks, untrained.cfg.data.tokenizer, hook.max_length, include_path=include_path
    )
    scores = evaluation.scores(untrained.model, untrained.device)
    assert scores["lm_eval/pipe_tiny_mc/acc"] >= 0
    assert capfd.readouterr() == ("", "")
