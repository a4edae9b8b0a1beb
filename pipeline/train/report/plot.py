"""`pipe plot`: training curves of one or more runs, read from their `metrics.jsonl`.

Four panels against step (loss with train and valid, learning rate, gradient norm, tokens/s),
one colour per run, so several runs compare side by side. matplotlib is optional
(`pip install 'pipe-llm[plot]'`) and imported only here, inside the functions, through its
object-oriented API on the Agg canvas: no pyplot, no global backend switch, no display needed.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import TYPE_CHECKING

from pipeline.common.atomic import atomic_path
from pipeline.train.report.metrics import MetricsError, read_metrics

if TYPE_CHECKING:
    from matplotlib.figure import Figure

__all__ = ["PANELS", "PlotError", "load_series", "plot_runs"]

PLOT_HINT = "pipe plot needs matplotlib: pip install 'pipe-llm[plot]'"

# (title, metric key, splits drawn in that panel)
PANELS: list[tuple[str, str, tuple[str, ...]]] = [
    ("loss", "loss", ("train", "valid")),
    ("learning rate", "lr", ("train",)),
    ("grad norm", "grad_norm", ("train",)),
    ("tokens/s", "tokens_per_s", ("train",)),
]

# split -> metric key -> (steps, values), steps increasing
Series = dict[str, dict[str, tuple[list[int], list[float]]]]


class PlotError(RuntimeError):
    """A plot cannot be drawn: matplotlib missing, or a run directory without metrics."""


def plot_runs(run_dirs: list[str | Path], output: str | Path | None = None) -> Path:
    """Draw the runs' curves into `output` (default `FIRST_RUN_DIR/metrics.png`) and return it.

    The file is written atomically: a temporary file beside it, renamed over it when complete.
    """
    if not run_dirs:
        raise PlotError("pipe plot needs at least one run directory")
    runs = [(name, load_series(path)) for name, path in zip(_run_names(run_dirs), run_dirs)]
    figure = build_figure(runs)
    target = Path(output) if output is not None else Path(run_dirs[0]) / "metrics.png"
    _save_atomically(figure, target)
    return target


def load_series(run_dir: str | Path) -> Series:
    """The run's metrics as curves per split and key.

    A resumed run logs some steps twice (those after the checkpoint it restarted from); the last
    value of a step wins, since it is the one the surviving run produced.
    """
    try:
        records = read_metrics(run_dir)
    except MetricsError as err:
        raise PlotError(str(err)) from None
    latest: dict[str, dict[str, dict[int, float]]] = defaultdict(lambda: defaultdict(dict))
    for record in records:
        split, step = record.get("split", "train"), int(record["step"])
        for key, value in record.items():
            if key not in ("step", "split", "time") and _is_number(value):
                latest[split][key][step] = float(value)
    return {
        split: {key: _sorted_curve(points) for key, points in keys.items()}
        for split, keys in latest.items()
    }


def build_figure(runs: list[tuple[str, Series]]) -> Figure:
    """A 2x2 grid of panels (see `PANELS`) with one colour per run and a legend by run name."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        raise PlotError(PLOT_HINT) from None
    figure = Figure(figsize=(12, 8), layout="constrained")
    FigureCanvasAgg(figure)
    axes = figure.subplots(2, 2).flatten()
    colours = [f"C{i % 10}" for i in range(len(runs))]
    for ax, (title, key, splits) in zip(axes, PANELS):
        _draw_panel(ax, title, key, splits, runs, colours)
    return figure


def _draw_panel(ax, title: str, key: str, splits: tuple[str, ...], runs, colours) -> None:
    """One panel: the `key` curve of each run and split (valid dashed with markers)."""
    for (name, series), colour in zip(runs, colours):
        for split in splits:
            steps, values = series.get(split, {}).get(key, ([], []))
            if not steps:
                continue
            style = {"linestyle": "--", "marker": "o", "markersize": 3} if split != "train" else {}
            label = name if len(splits) == 1 else f"{name} {split}"
            ax.plot(steps, values, color=colour, label=label, **style)
    ax.set_title(title)
    ax.set_xlabel("step")
    ax.grid(True, alpha=0.3)
    if ax.lines:
        ax.legend(fontsize="small")
    else:
        ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes)


def _save_atomically(figure: Figure, target: Path) -> None:
    """Save `figure` to `target` through a temporary file in the same folder and a rename."""
    fmt = target.suffix.lstrip(".").lower() or "png"
    with atomic_path(target) as temporary:
        figure.savefig(temporary, format=fmt, dpi=100)


def _run_names(run_dirs: list[str | Path]) -> list[str]:
    """Legend names: each run directory's name, or its full path where two names clash."""
    names = [Path(path).resolve().name or str(path) for path in run_dirs]
    return [str(path) if names.count(name) > 1 else name for name, path in zip(names, run_dirs)]


def _sorted_curve(points: dict[int, float]) -> tuple[list[int], list[float]]:
    """(steps, values) in increasing step order."""
    steps = sorted(points)
    return steps, [points[step] for step in steps]


def _is_number(value: object) -> bool:
    """True for ints and floats (NaN included, which matplotlib leaves as a gap), not bools."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)
