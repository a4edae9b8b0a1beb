"""`pipe train`: resolve the run's configuration and train it (or describe it with --dry-run).

Configuration layers: defaults < recipe < `--set` < first-class flags, and only flags the user
actually typed override anything (click's parameter source tells us), so a flag's default never
silently replaces a recipe's value. click is the only import at module level; torch is imported
inside the callback, so `pipe train --help` stays instant.

`--nproc-per-node N` (N > 1) re-launches the same command under torchrun
(`python -m torch.distributed.run --nproc-per-node N -m pipeline train ARGS`,
`pipeline.core.parallel.process_group`) unless this process already is one of torchrun's;
each rank then builds its share of the run.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import click
from click.core import ParameterSource

from pipeline.core.kernels.fp8 import FP8_BACKENDS, FP8_RECIPES
from pipeline.core.parallel.process_group import (
    destroy_process_group,
    launched_by_torchrun,
    launched_world_size,
    relaunch_under_torchrun,
)
from pipeline.train.objectives import OBJECTIVES, ObjectiveOption, ObjectiveSpec

EXIT_SIGINT = 130  # the shell's convention for "interrupted by Ctrl-C"


def _world_size(nproc_per_node: int) -> int:
    """The run's world size: torchrun's WORLD_SIZE inside a launched rank, else N."""
    return launched_world_size() if launched_by_torchrun() else nproc_per_node


def _default_run_dir(recipe: str | None) -> str:
    return f"runs/{Path(recipe).stem if recipe else 'run'}"


_Command = TypeVar("_Command", bound=Callable[..., Any])


def _flagged() -> list[ObjectiveSpec]:
    """The registered objectives that bring a `--KIND` flag of their own."""
    return [spec for spec in OBJECTIVES.values() if spec.flag_help is not None]


def _option_param(option: ObjectiveOption) -> str:
    """The click parameter name of an objective's option ("--rollout-server": rollout_server)."""
    return option.name.removeprefix("--").replace("-", "_")


def objective_options(command: _Command) -> _Command:
    """`--objective NAME`, and each registered objective's `--KIND` flag and options, in the
    registry's order: `pipe train` names no objective, the registry does."""
    decorators = [
        click.option(
            "--objective",
            type=click.Choice(list(OBJECTIVES)),
            help="The training objective by its registry name (data.kind): "
            + "; ".join(f"{kind}: {spec.description}" for kind, spec in OBJECTIVES.items())
            + ". The objective flags below are shorthands for it.",
        )
    ]
    for spec in _flagged():
        decorators.append(click.option(f"--{spec.kind}", is_flag=True, help=spec.flag_help))
    for spec in OBJECTIVES.values():
        for option in spec.options:
            decorators.append(
                click.option(
                    option.name,
                    _option_param(option),
                    multiple=option.multiple,
                    metavar=option.metavar,
                    help=option.help,
                )
            )
    for decorator in reversed(decorators):
        command = decorator(command)
    return command


def objective_choice(
    given: dict[str, Any], objective: str | None
) -> tuple[list[tuple[str, str]], list[tuple[ObjectiveSpec, ObjectiveOption, Any]]]:
    """Take the objective flags and options out of the typed flags `given`: the objectives
    chosen, each as (kind, the flag that chose it: `--objective NAME`, `--KIND`), and each
    objective option given with its value."""
    chosen = [(objective, f"--objective {objective}")] if objective is not None else []
    for spec in _flagged():
        if given.pop(spec.kind, False):
            chosen.append((spec.kind, f"--{spec.kind}"))
    options = []
    for spec in OBJECTIVES.values():
        for option in spec.options:
            value = given.pop(_option_param(option), None)
            if value:  # a flag left out is None, a repeatable one an empty tuple
                options.append((spec, option, value))
    return chosen, options


def set_objective(
    cfg: Any,
    chosen: list[tuple[str, str]],
    options: list[tuple[ObjectiveSpec, ObjectiveOption, Any]],
) -> None:
    """`data.kind` from `--objective NAME` or a `--KIND` flag (one at most), then the objectives'
    options, each refused for a run of another objective."""
    from pipeline.train.config.schema import ConfigError

    if len(chosen) > 1:
        raise ConfigError(f"{' and '.join(flag for _, flag in chosen)}: choose one")
    if chosen:
        kind, flag = chosen[0]
        cfg.set("data.kind", kind, source=flag)
    current = OBJECTIVES.get(cfg.data.kind)
    brought = current.options if current is not None else ()
    for spec, option, value in options:
        if option not in brought:  # an option of another objective
            flag = f"--{spec.kind}" if spec.flag_help else f"--objective {spec.kind}"
            raise ConfigError(f"{option.name} is for {flag} (data.kind = {spec.kind})")
        if option.multiple:
            section, _, key = option.field.partition(".")
            value = [*getattr(getattr(cfg, section), key), *value]
        cfg.set(option.field, value, source=option.name)


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--recipe", metavar="NAME_OR_PATH", help="Shipped recipe name or a .toml file.")
@click.option(
    "--set",
    "sets",
    multiple=True,
    metavar="SECTION.KEY=VALUE",
    help="Override any config field (repeatable), e.g. --set training.eval_interval=50.",
)
@click.option("--data", metavar="BLEND", help='Data blend: "PREFIX" or "W1 PREFIX1 W2 PREFIX2".')
@click.option("--iters", type=click.IntRange(min=1), help="Optimizer steps.")
@click.option("--seq-length", type=click.IntRange(min=1), help="Tokens per sample.")
@click.option("--micro-batch-size", type=click.IntRange(min=1), help="Samples per forward pass.")
@click.option("--global-batch-size", type=click.IntRange(min=1), help="Samples per step.")
@click.option("--lr", type=float, help="Peak learning rate.")
@click.option("--device", type=click.Choice(["auto", "cpu", "cuda"]), help="Where to train.")
@click.option("--save", metavar="DIR", help="Checkpoint directory (default: RUN_DIR/checkpoints).")
@click.option(
    "--load",
    metavar="DIR",
    help="Resume from DIR's latest checkpoint (or an iter_ dir), or start from a Hugging Face "
    "model directory (its config.json and weights; iteration 0).",
)
@click.option("--tp", type=int, default=1, show_default=True, help="Tensor (+ sequence) parallel.")
@click.option("--pp", type=int, default=1, show_default=True, help="Pipeline parallel.")
@click.option("--cp", type=int, default=1, show_default=True, help="Context parallel.")
@click.option("--ep", type=int, default=1, show_default=True, help="Expert parallel (MoE).")
@click.option(
    "--dp",
    type=int,
    default=-1,
    show_default=True,
    help="Data parallel (FSDP2) degree; -1: the world size.",
)
@click.option(
    "--nproc-per-node",
    type=click.IntRange(min=1),
    default=1,
    show_default=True,
    help="Processes on this node: N > 1 re-launches under torchrun.",
)
@click.option(
    "--fp8",
    type=click.Choice(list(FP8_BACKENDS + FP8_RECIPES)),
    help="FP8 training backend (torchao or te), optionally with its scaling (torchao:rowwise).",
)
@click.option(
    "--lora",
    is_flag=True,
    default=None,
    help="Train LoRA adapters ([lora] section) on a frozen base; checkpoints hold adapters only.",
)
@click.option(
    "--lora-base",
    metavar="CKPT",
    help="With --lora: the pipe checkpoint holding the frozen base (else --load's full one or "
    "Hugging Face directory).",
)
@click.option("--finetune", is_flag=True, help="With --load: take weights only, start at step 0.")
@objective_options
@click.option(
    "--no-verify-checksums",
    "verify_checksums",
    is_flag=True,
    default=True,
    flag_value=False,
    help="With --load: skip checking each file against its recorded SHA-256 while reading.",
)
@click.option("--run-dir", metavar="DIR", help="Run directory (default: runs/<recipe or 'run'>).")
@click.option("--dry-run", is_flag=True, help="Print the resolved run and its cost; build nothing.")
@click.option(
    "--gpu",
    metavar="NAME",
    help="With --dry-run: say whether the memory per device fits this GPU (e.g. h100, a100-40gb).",
)
@click.pass_context
def train(
    ctx: click.Context,
    recipe: str | None,
    sets: tuple[str, ...],
    finetune: bool,
    objective: str | None,
    verify_checksums: bool,
    run_dir: str | None,
    dry_run: bool,
    gpu: str | None,
    nproc_per_node: int,
    **flags: object,
) -> None:
    """Train a model from a recipe, with --set overrides and a few first-class flags.

    Exit codes: 0 when finished or after SIGTERM (a checkpoint was saved: Slurm can requeue
    with --load), 130 after SIGINT (also saved), 1 on errors or a diverged run (saved).
    """
    from pipeline.train.assembly.run_config import check_config, resolve_config
    from pipeline.train.config.schema import ConfigError, LoggingSection

    _check_gpu(gpu, dry_run)
    given = {
        name: value
        for name, value in flags.items()
        if ctx.get_parameter_source(name) == ParameterSource.COMMANDLINE
    }
    chosen, options = objective_choice(given, objective)
    world_size = _world_size(nproc_per_node)
    try:
        cfg = resolve_config(recipe, sets, given, validate=False)
        if finetune:
            cfg.checkpoint.finetune = True
        set_objective(cfg, chosen, options)
        if not verify_checksums:
            cfg.checkpoint.verify_checksums = False
        if run_dir is not None:
            cfg.set("logging.run_dir", run_dir, source="--run-dir")
        elif cfg.logging.run_dir == LoggingSection().run_dir:
            cfg.logging.run_dir = _default_run_dir(recipe)
        check_config(cfg, world_size=world_size)
    except ConfigError as e:
        raise click.UsageError(str(e)) from None
    if dry_run:
        from pipeline.train.report.estimates import dry_run_report

        click.echo("# resolved config (what the run writes to config.toml)")
        click.echo(cfg.to_toml())
        click.echo("\n".join(dry_run_report(cfg, world_size=world_size, gpu=gpu)))
        return
    if nproc_per_node > 1 and not launched_by_torchrun():
        relaunch_under_torchrun(nproc_per_node, "train")
    _run(cfg)


def _check_gpu(gpu: str | None, dry_run: bool) -> None:
    """Refuse `--gpu` without `--dry-run` or with a GPU the memory table does not know."""
    if gpu is None:
        return
    if not dry_run:
        raise click.UsageError("--gpu is for --dry-run (it checks the memory estimate)")
    from pipeline.train.report.estimates import gpu_memory_gib

    try:
        gpu_memory_gib(gpu)
    except ValueError as e:
        raise click.UsageError(f"--gpu: {e}") from None


def _run(cfg: object) -> None:
    """Build and train; map how the run ended to an exit code."""
    import logging

    from pipeline.checkpoint import CheckpointError
    from pipeline.train.config.schema import ConfigError
    from pipeline.train.loop.guards import NonFiniteStop
    from pipeline.train.loop.trainer import Trainer

    rank0 = os.environ.get("RANK", "0") == "0"
    level = logging.INFO if rank0 else logging.WARNING
    logging.basicConfig(level=level, format="%(message)s", stream=sys.stderr)
    try:
        result = Trainer(cfg).train()  # type: ignore[arg-type]
    except (ConfigError, CheckpointError, NonFiniteStop) as e:
        raise click.ClickException(str(e)) from None
    finally:
        destroy_process_group()
    saved = f"saved {result.checkpoint}" if result.checkpoint else "nothing saved"
    if result.stop_reason == "SIGINT":
        click.echo(f"interrupted at iteration {result.iteration}; {saved}", err=True)
        sys.exit(EXIT_SIGINT)
    if result.stop_reason not in ("finished", "evaluated"):
        resume = " (resume with --load)" if result.checkpoint else ""
        click.echo(
            f"{result.stop_reason} at iteration {result.iteration}; {saved}{resume}", err=True
        )


if __name__ == "__main__":  # `python -m pipeline.train.commands ...` (tests, debugging)
    train()
