"""`pipe checkpoint ...`: command-line tools for checkpoints (torch is imported only when run)."""

from __future__ import annotations

import sys

import click


@click.group("checkpoint")
def checkpoint() -> None:
    """Inspect and check pipe checkpoints."""


@checkpoint.command("verify")
@click.argument("directory", type=click.Path(exists=True, file_okay=False))
@click.option(
    "--all",
    "all_checkpoints",
    is_flag=True,
    help="Verify every iter_* checkpoint, not just latest.",
)
def verify_command(directory: str, all_checkpoints: bool) -> None:
    """Check that checkpoints are complete and every file matches its recorded SHA-256.

    DIRECTORY is a save directory (its latest checkpoint, or all with --all) or one iter_*
    directory. Prints one verdict line per checkpoint; exits 1 if any fails.
    """
    from pipeline.checkpoint.integrity import verify_save_dir

    reports = verify_save_dir(directory, all_checkpoints=all_checkpoints)
    for report in reports:
        click.echo(report.verdict())
        for problem in report.problems[1:]:
            click.echo(f"     {problem}")
    if not all(report.ok for report in reports):
        sys.exit(1)
