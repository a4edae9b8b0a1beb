"""`[eval] lm_eval_tasks`: lm-eval tasks scored on the training model during `pipe train`, logged
to metrics.jsonl, equal (1e-4, per request too) to `pipe eval` on the last checkpoint exported to
Hugging Face's format (`pipe export --vllm`); local task files, no network."""

from __future__ import annotations

import json

import pytest

from pipeline.train.assembly.run_config import resolve_config
from pipeline.train.config.schema import ConfigError
from pipeline.train.loop.trainer import Trainer
from tests.builders import micro_sets, records, run_pipe, tokenized_corpus
from tests.serve.test_lm_eval import TASKS, offline, task_dir  # noqa: F401 (fixtures)

pytest.importorskip("lm_eval")
pytest.importorskip("fastapi")

TEXTS = [f"line {i}: value={i * 7} {'abc' * (i % 5)}" for i in range(600)]


def test_inloop_scores_equal_pipe_eval(tmp_path, task_dir) -> None:  # noqa: F811
    prefix = tokenized_corpus(TEXTS, tmp_path)
    run_dir = tmp_path / "run"
    sets = micro_sets(
        run_dir,
        "data.mock=false",
        f"data.blend={prefix}",
        f"data.tokenizer={tmp_path / 'tok'}",
        "model.vocab_size=512",
        f"eval.lm_eval_tasks={TASKS!r}".replace("'", '"'),
        "eval.lm_eval_interval=4",
        f"eval.lm_eval_include_path={task_dir}",
    )
    trainer = Trainer(resolve_config(None, sets), console=False)
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
    prefix = tokenized_corpus(TEXTS, tmp_path)
    sets = micro_sets(
        tmp_path / "run",
        "data.mock=false",
        f"data.blend={prefix}",
        f"data.tokenizer={tmp_path / 'tok'}",
        "model.vocab_size=512",
        'eval.lm_eval_tasks=["no_such_task_here"]',
        "eval.lm_eval_interval=4",
        f"eval.lm_eval_include_path={task_dir}",
    )
    with pytest.raises(ConfigError, match="unknown lm-eval task 'no_such_task_here'"):
        Trainer(resolve_config(None, sets), console=False)


def test_inloop_eval_needs_a_tokenizer(tmp_path) -> None:
    sets = micro_sets(tmp_path, 'eval.lm_eval_tasks=["x"]', "eval.lm_eval_interval=2")
    with pytest.raises(ConfigError, match="eval.lm_eval_tasks needs the data's tokenizer"):
        Trainer(resolve_config(None, sets), console=False)
