"""`pipe eval`: score a checkpoint with lm-evaluation-harness, through pipe's own engine.

    pipe eval CKPT --tasks hellaswag,arc_easy [--num-fewshot 5] [--limit 100] [--output r.json]
    pipe eval CKPT --tasks mytask --include-path tasks/     (task YAMLs of your own)
    pipe eval CKPT --tasks gsm8k --chat                     (through the chat template)

The engine serves on a free loopback port for the run and the harness's `local-completions`
model scores against it with its default settings (`pipeline.serve.http.harness`). lm-eval is an
optional extra: `pip install 'pipe-llm[eval]'`. click is the only import at module level.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import click

from pipeline.serve.commands import engine_options, engine_spec, model_options


@click.command(name="eval")
@model_options
@click.option("--tasks", required=True, help="lm-eval task names, comma-separated.")
@click.option(
    "--num-fewshot",
    type=click.IntRange(min=0),
    default=None,
    help="Examples in each prompt (default: each task's own).",
)
@click.option(
    "--limit", type=float, default=None, help="Documents per task (below 1: that fraction of them)."
)
@click.option(
    "--include-path",
    type=click.Path(exists=True, file_okay=False),
    help="A folder of task YAMLs beside lm-eval's own.",
)
@click.option(
    "--output",
    type=click.Path(dir_okay=False, path_type=Path),
    help="Write the harness's results (JSON) here.",
)
@click.option(
    "--log-samples", is_flag=True, help="With --output: every request and answer too, per document."
)
@click.option(
    "--chat",
    is_flag=True,
    help="Prompts through the chat template (local-chat-completions; generation tasks only).",
)
@click.option(
    "--batch-size",
    type=click.IntRange(min=1),
    default=1,
    show_default=True,
    help="Prompts per scoring request.",
)
@click.option(
    "--num-concurrent",
    type=click.IntRange(min=1),
    default=8,
    show_default=True,
    help="Requests in flight at once.",
)
@engine_options
def evaluate(checkpoint: str, **options: Any) -> None:
    """Evaluate CHECKPOINT (a pipe checkpoint or a Hugging Face directory) on lm-eval tasks,
    the model served by pipe's engine for the run."""
    try:
        import lm_eval  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError:
        raise click.ClickException("pipe eval needs: pip install 'pipe-llm[eval]'") from None
    from pipeline.common.quiet import quiet_lm_eval
    from pipeline.serve.engine.loading import LoadError
    from pipeline.serve.http.harness import run_harness, serving

    run = _harness_run(options)
    output = options.pop("output")
    spec = engine_spec(checkpoint, options)
    try:
        # lm-eval's warnings and bars held back; pipe's own bar counts the requests answered
        with serving(spec, checkpoint, progress=True) as (base_url, max_length), quiet_lm_eval():
            results = run_harness(run, base_url, checkpoint, max_length)
    except (LoadError, ValueError) as error:
        raise click.ClickException(str(error)) from None
    from lm_eval.utils import make_table

    click.echo(make_table(results))
    if output is not None:
        output.write_text(json.dumps(results, indent=2, default=str), encoding="utf-8")
        click.echo(f"results: {output}")


def _harness_run(options: dict[str, Any]):
    """The `HarnessRun` of the command's options (popped), the task names checked first."""
    from pipeline.common.lm_eval_tasks import task_manager
    from pipeline.serve.http.harness import HarnessRun

    tasks = [t.strip() for t in options.pop("tasks").split(",") if t.strip()]
    include_path = options.pop("include_path")
    manager = task_manager(tasks, include_path)
    unknown = [t for t in tasks if t not in manager.all_tasks]
    if unknown or not tasks:
        raise click.BadParameter(
            f"unknown task {unknown[0] if unknown else '(none given)'}", param_hint="--tasks"
        )
    return HarnessRun(
        tasks=tasks,
        num_fewshot=options.pop("num_fewshot"),
        limit=options.pop("limit"),
        task_manager=manager,
        chat=options.pop("chat"),
        batch_size=options.pop("batch_size"),
        num_concurrent=options.pop("num_concurrent"),
        log_samples=options.pop("log_samples"),
    )
