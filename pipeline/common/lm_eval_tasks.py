"""lm-eval's index of tasks, as `pipe eval` and training's in-loop evaluation both build it."""

from __future__ import annotations

__all__ = ["task_manager"]


def task_manager(tasks: list[str], include_path: str | None):
    """lm-eval's index of tasks: those under `include_path` alone when they hold every task
    asked for (indexing the harness's thousands of built-in tasks takes seconds), else both."""
    from lm_eval.tasks import TaskManager

    if include_path is not None:
        local = TaskManager(include_path=include_path, include_defaults=False)
        if all(task in local.all_tasks for task in tasks):
            return local
    return TaskManager(include_path=include_path)
