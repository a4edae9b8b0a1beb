"""`pipe train`: resolve the run's configuration and train it (or describe it with --dry-run).

Configuration layers: defaults < recipe < `--set` < first-class flags, and only flags the user
actually typed override anything (click's parameter source tells us), so a flag's default never
silently replaces a recipe's value. click is the only import at module level; torch is imported
inside the callback, so `pipe train --help` stays instant.
"""

from __future__ import annotations

import sys
from pathlib import Path

import click
from click.core import ParameterSource

PARALLEL_FLAGS = ("tp", "pp", "cp", "ep", "dp")
EXIT_SIGINT = 130  # the shell's convention for "interrupted by Ctrl-C"


def _reject_parallel(cfg: object) -> None:
    """Refuse layouts with more than one device: single-device training only, for now."""
    p = cfg.parallel  # type: ignore[attr-defined]
    wanted = {name: getattr(p, name) for name in PARALLEL_FLAGS if getattr(p, name) > 1}
    if wanted:
        layout = ", ".join(f"{k}={v}" for k, v in wanted.items())
        raise click.UsageError(
            f"parallel layouts are not implemented yet ({layout}): pipe train runs on one "
            "device (CPU or one GPU) until the parallel work lands; use the default degrees of 1"
        )


def _default_run_dir(recipe: str | None) -> str:
    return f"runs/{Path(recipe).stem if recipe else 'run'}"


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--recipe", metavar="NAME_OR_PATH", help="Shipped recipe name or a .toml file.")
@click.option(
    "--set", "sets", multiple=True, metavar="SECTION.KEY=VALUE",
    help="Override any config field (repeatable), e.g. --set training.eval_interval=50.",
)  # fmt: skip
@click.option("--data", metavar="BLEND", help='Data blend: "PREFIX" or "W1 PREFIX1 W2 PREFIX2".')
@click.option("--iters", type=click.IntRange(min=1), help="Optimizer steps.")
@click.option("--seq-length", type=click.IntRange(min=1), help="Tokens per sample.")
@click.option("--micro-batch-size", type=click.IntRange(min=1), help="Samples per forward pass.")
@click.option("--global-batch-size", type=click.IntRange(min=1), help="Samples per step.")
@click.option("--lr", type=float, help="Peak learning rate.")
@click.option("--device", type=click.Choice(["auto", "cpu", "cuda"]), help="Where to train.")
@click.option("--save", metavar="DIR", help="Checkpoint directory (default: RUN_DIR/checkpoints).")
@click.option(
    "--load", metavar="DIR", help="Resume from DIR's latest checkpoint (or an iter_ dir)."
)
@click.option("--tp", type=int, default=1, show_default=True, help="Tensor parallel (reserved).")
@click.option("--pp", type=int, default=1, show_default=True, help="Pipeline parallel (reserved).")
@click.option("--cp", type=int, default=1, show_default=True, help="Context parallel (reserved).")
@click.option("--ep", type=int, default=1, show_default=True, help="Expert parallel (reserved).")
@click.option("--dp", type=int, default=-1, show_default=True, help="Data parallel (reserved).")
@click.option("--finetune", is_flag=True, help="With --load: take weights only, start at step 0.")
@click.option("--run-dir", metavar="DIR", help="Run directory (default: runs/<recipe or 'run'>).")
@click.option("--dry-run", is_flag=True, help="Print the resolved run and its cost; build nothing.")
@click.pass_context
def train(
    ctx: click.Context,
    recipe: str | None,
    sets: tuple[str, ...],
    finetune: bool,
    run_dir: str | None,
    dry_run: bool,
    **flags: object,
) -> None:
    """Train a model from a recipe, with --set overrides and a few first-class flags.

    Exit codes: 0 when finished or after SIGTERM (a checkpoint was saved: Slurm can requeue
    with --load), 130 after SIGINT (also saved), 1 on errors or a diverged run (saved).
    """
    from pipeline.train.config import ConfigError, LoggingSection
    from pipeline.train.config_loader import resolve_config

    given = {
        name: value
        for name, value in flags.items()
        if ctx.get_parameter_source(name) == ParameterSource.COMMANDLINE
    }
    try:
        cfg = resolve_config(recipe, sets, given, validate=False)
        if finetune:
            cfg.checkpoint.finetune = True
        if run_dir is not None:
            cfg.set("logging.run_dir", run_dir, source="--run-dir")
        elif cfg.logging.run_dir == LoggingSection().run_dir:
            cfg.logging.run_dir = _default_run_dir(recipe)
        _reject_parallel(cfg)
        cfg.validate(world_size=1)
    except ConfigError as e:
        raise click.UsageError(str(e)) from None
    if dry_run:
        from pipeline.train.estimates import dry_run_report

        click.echo("# resolved config (what the run writes to config.toml)")
        click.echo(cfg.to_toml())
        click.echo("\n".join(dry_run_report(cfg, world_size=1)))
        return
    _run(cfg)


def _run(cfg: object) -> None:
    """Build and train; map how the run ended to an exit code."""
    import logging

    from pipeline.checkpoint import CheckpointError
    from pipeline.train.config import ConfigError
    from pipeline.train.guards import NonFiniteStop
    from pipeline.train.trainer import Trainer

    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    try:
        result = Trainer(cfg).train()  # type: ignore[arg-type]
    except (ConfigError, CheckpointError, NonFiniteStop) as e:
        raise click.ClickException(str(e)) from None
    if result.stop_reason == "SIGINT":
        click.echo(
            f"interrupted at iteration {result.iteration}; saved {result.checkpoint}", err=True
        )
        sys.exit(EXIT_SIGINT)
    if result.stop_reason != "finished":
        click.echo(
            f"{result.stop_reason} at iteration {result.iteration}; saved {result.checkpoint} "
            "(resume with --load)",
            err=True,
        )


if __name__ == "__main__":  # `python -m pipeline.train.commands ...` (tests, debugging)
    train()
