"""`pipe plot`: curves from metrics.jsonl, duplicate steps, PNG output, missing matplotlib, CLI."""

from __future__ import annotations

import sys

import pytest
from click.testing import CliRunner

from pipeline.train.plot_command import plot
from pipeline.train.report.metrics import MetricsLogger
from pipeline.train.report.plot import PLOT_HINT, PlotError, build_figure, load_series, plot_runs

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _write_run(run_dir, steps=range(1, 6), valid_every=2, offset=0.0):
    with MetricsLogger(run_dir, console=False) as logger:
        for step in steps:
            logger.log(
                step,
                {
                    "loss": 5.0 - 0.1 * step + offset,
                    "lr": 1e-3,
                    "grad_norm": 1.0,
                    "tokens_per_s": 1000.0,
                },
            )
            if step % valid_every == 0:
                logger.log(step, {"loss": 5.1 - 0.1 * step + offset}, split="valid")
    return run_dir


def _line_counts(figure) -> list[int]:
    return [len(ax.lines) for ax in figure.axes]


def test_duplicate_steps_keep_the_last_value(tmp_path):
    _write_run(tmp_path, steps=range(1, 5))
    _write_run(tmp_path, steps=range(3, 7), offset=1.0)  # resumed from step 2
    series = load_series(tmp_path)
    steps, losses = series["train"]["loss"]
    assert steps == [1, 2, 3, 4, 5, 6]
    assert losses[2] == pytest.approx(5.0 - 0.3 + 1.0)  # step 3 from the resumed run
    assert series["valid"]["loss"][0] == [2, 4, 6]


def test_plot_one_run(tmp_path):
    pytest.importorskip("matplotlib")
    run_dir = _write_run(tmp_path / "run-a")
    figure = build_figure([("run-a", load_series(run_dir))])
    assert len(figure.axes) == 4
    assert _line_counts(figure) == [2, 1, 1, 1]  # loss panel: train and valid
    assert [ax.get_title() for ax in figure.axes] == [
        "loss",
        "learning rate",
        "grad norm",
        "tokens/s",
    ]
    output = plot_runs([run_dir])
    assert output == run_dir / "metrics.png"
    assert output.read_bytes()[:8] == PNG_SIGNATURE
    assert [p.name for p in run_dir.iterdir() if p.name.startswith(".")] == []  # no temp left


def test_plot_two_runs_side_by_side(tmp_path):
    pytest.importorskip("matplotlib")
    runs = [_write_run(tmp_path / "a"), _write_run(tmp_path / "b", offset=0.5)]
    figure = build_figure([(p.name, load_series(p)) for p in runs])
    assert _line_counts(figure) == [4, 2, 2, 2]
    labels = [text.get_text() for text in figure.axes[0].get_legend().get_texts()]
    assert labels == ["a train", "a valid", "b train", "b valid"]
    assert [t.get_text() for t in figure.axes[1].get_legend().get_texts()] == ["a", "b"]
    output = plot_runs(runs, tmp_path / "out" / "cmp.png")
    assert output.read_bytes()[:8] == PNG_SIGNATURE


def test_panels_without_data_still_drawn(tmp_path):
    pytest.importorskip("matplotlib")
    with MetricsLogger(tmp_path, console=False) as logger:
        logger.log(1, {"loss": 3.0})
    figure = build_figure([("x", load_series(tmp_path))])
    assert _line_counts(figure) == [1, 0, 0, 0]


def test_missing_matplotlib_is_one_line(tmp_path, monkeypatch):
    run_dir = _write_run(tmp_path)
    for name in ("matplotlib", "matplotlib.figure", "matplotlib.backends.backend_agg"):
        monkeypatch.setitem(sys.modules, name, None)
    with pytest.raises(PlotError) as info:
        plot_runs([run_dir])
    assert str(info.value) == "pipe plot needs matplotlib: pip install 'pipe-llm[plot]'"
    result = CliRunner().invoke(plot, [str(run_dir)])
    assert result.exit_code == 1
    assert result.output == f"Error: {PLOT_HINT}\n"


def test_run_dir_without_metrics(tmp_path):
    with pytest.raises(PlotError, match="no such metrics file"):
        plot_runs([tmp_path])


def test_plot_help():
    result = CliRunner().invoke(plot, ["--help"])
    assert result.exit_code == 0
    assert "RUN_DIRS" in result.output and "--output" in result.output


def test_plot_command_writes_png(tmp_path):
    pytest.importorskip("matplotlib")
    run_dir = _write_run(tmp_path / "run")
    output = tmp_path / "curves.png"
    result = CliRunner().invoke(plot, [str(run_dir), "--output", str(output)])
    assert result.exit_code == 0, result.output
    assert result.output == f"wrote {output}\n"
    assert output.read_bytes()[:8] == PNG_SIGNATURE
