"""Click command `pipe plot`: training curves of one or more runs as a PNG.

Thin on purpose: only click is imported at module level; matplotlib is imported when it runs.
"""

from __future__ import annotations

from pathlib import Path

import click


@click.command("plot")
@click.argument(
    "run_dirs",
    nargs=-1,
    required=True,
    type=click.Path(exists=True, file_okay=False, path_type=Path),
)
@click.option(
    "--output",
    "-o",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="Image to write (default: FIRST_RUN_DIR/metrics.png).",
)
def plot(run_dirs: tuple[Path, ...], output: Path | None) -> None:
    """Plot loss (train and valid), learning rate, grad norm and tokens/s against step.

    Give several RUN_DIRS to compare runs in the same panels. Reads each RUN_DIR/metrics.jsonl;
    needs matplotlib (pip install 'pipe-llm[plot]').
    """
    from pipeline.train.report.plot import PlotError, plot_runs

    try:
        path = plot_runs(list(run_dirs), output)
    except PlotError as err:
        raise click.ClickException(str(err)) from None
    click.echo(f"wrote {path}")
