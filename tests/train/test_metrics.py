"""MetricsLogger and read_metrics: the JSONL record, resume, kills, ranks, console lines, sinks."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from pipeline.train.report.metrics import (
    METRICS_FILE,
    MetricsError,
    MetricsLogger,
    format_console_line,
    read_metrics,
    wandb_mode,
)


def _lines(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / METRICS_FILE).read_text().splitlines()]


def test_log_writes_one_flushed_json_line_per_call(tmp_path):
    run_dir = tmp_path / "run"
    logger = MetricsLogger(run_dir, console=False)
    logger.log(10, {"loss": 4.5, "lr": 1e-3})
    # Flushed: readable before close.
    first = _lines(run_dir)
    assert len(first) == 1
    assert first[0]["step"] == 10 and first[0]["split"] == "train"
    assert first[0]["loss"] == 4.5 and first[0]["lr"] == 1e-3
    assert isinstance(first[0]["time"], float)
    logger.log(10, {"loss": 4.4}, split="valid")
    logger.close()
    logger.close()  # idempotent
    records = read_metrics(run_dir)
    assert [(r["step"], r["split"]) for r in records] == [(10, "train"), (10, "valid")]
    assert list(records[0])[:3] == ["step", "split", "time"]


def test_scalars_with_item_are_converted(tmp_path):
    class FakeTensor:
        def item(self):
            return 2.5

    with MetricsLogger(tmp_path, console=False) as logger:
        logger.log(1, {"loss": FakeTensor(), "skipped": 0})
    assert read_metrics(tmp_path)[0]["loss"] == 2.5


def test_resume_appends_to_the_same_file(tmp_path):
    with MetricsLogger(tmp_path, console=False) as logger:
        logger.log(1, {"loss": 5.0})
        logger.log(2, {"loss": 4.0})
    with MetricsLogger(tmp_path, console=False) as logger:
        logger.log(2, {"loss": 3.9})
        logger.log(3, {"loss": 3.5})
    assert [(r["step"], r["loss"]) for r in read_metrics(tmp_path)] == [
        (1, 5.0),
        (2, 4.0),
        (2, 3.9),
        (3, 3.5),
    ]


def test_truncated_last_line_is_skipped_and_cut_on_resume(tmp_path):
    with MetricsLogger(tmp_path, console=False) as logger:
        logger.log(1, {"loss": 5.0})
    path = tmp_path / METRICS_FILE
    with open(path, "a") as handle:
        handle.write('{"step": 2, "split": "train", "lo')  # killed mid-write
    assert [r["step"] for r in read_metrics(tmp_path)] == [1]
    with MetricsLogger(tmp_path, console=False) as logger:
        logger.log(2, {"loss": 4.0})
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2]
    assert len(_lines(tmp_path)) == 2  # the partial line is gone, every line parses


def test_corrupt_middle_line_names_file_and_line(tmp_path):
    (tmp_path / METRICS_FILE).write_text('{"step": 1}\nnot json\n{"step": 3}\n')
    with pytest.raises(MetricsError, match=r"metrics.jsonl:2:"):
        read_metrics(tmp_path)


def test_read_metrics_missing_file(tmp_path):
    with pytest.raises(MetricsError, match="no such metrics file"):
        read_metrics(tmp_path)


def test_nonzero_rank_writes_nothing(tmp_path, capsys):
    run_dir = tmp_path / "run"
    logger = MetricsLogger(run_dir, rank=1, tensorboard=True, wandb_project="p")
    logger.log(1, {"loss": 1.0})
    logger.close()
    assert not run_dir.exists()
    assert capsys.readouterr().out == ""


def test_console_line_train(tmp_path, capsys):
    metrics = {
        "loss": 4.12341,
        "lr": 9.98e-4,
        "grad_norm": 1.234,
        "tokens_per_s": 12345.4,
        "tflops": 1.234,
        "mfu": 0.004,
        "mem_gib": 1.21,
        "iters": 300,
        "unknown_key": 7.0,
    }
    with MetricsLogger(tmp_path) as logger:
        logger.log(100, metrics)
    out = capsys.readouterr().out
    assert out == (
        "step    100/300 | loss 4.1234 | lr 9.98e-04 | grad 1.23 | 12,345 tok/s"
        " | 1.2 TFLOP/s | MFU 0.4% | mem 1.2 GiB\n"
    )


def test_console_line_variants():
    assert format_console_line(5, {"loss": 3.9, "ppl": 49.43}, split="valid") == (
        "valid step 5 | loss 3.9000 | ppl 49.4"
    )
    # Total from the config, skipped iterations, missing keys left out, NaN shown as such.
    line = format_console_line(7, {"loss": float("nan"), "skipped": 2}, total_iters=20)
    assert line == "step      7/20 | loss nan | skipped 2"
    assert format_console_line(7, {}) == "step      7"


def test_total_iters_from_config(tmp_path, capsys):
    with MetricsLogger(tmp_path, config={"training": {"iters": 50}}) as logger:
        logger.log(3, {"loss": 1.0})
    assert capsys.readouterr().out.startswith("step      3/50 | loss 1.0000")


def test_console_off(tmp_path, capsys):
    with MetricsLogger(tmp_path, console=False) as logger:
        logger.log(1, {"loss": 1.0})
    assert capsys.readouterr().out == ""


def test_tensorboard_event_file(tmp_path):
    pytest.importorskip("tensorboard")
    with MetricsLogger(tmp_path, tensorboard=True, console=False) as logger:
        logger.log(1, {"loss": 2.0, "lr": 1e-3})
        logger.log(1, {"loss": 1.9}, split="valid")
    events = list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))
    assert len(events) == 1 and events[0].stat().st_size > 0

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accumulator = EventAccumulator(str(tmp_path / "tensorboard"))
    accumulator.Reload()
    assert set(accumulator.Tags()["scalars"]) == {"train/loss", "train/lr", "valid/loss"}


def test_missing_tensorboard_is_one_line(tmp_path, monkeypatch):
    pytest.importorskip("torch")
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)
    with pytest.raises(MetricsError) as info:
        MetricsLogger(tmp_path, tensorboard=True)
    assert str(info.value) == "TensorBoard logging needs tensorboard: pip install 'pipe-llm[track]'"


def test_missing_wandb_is_one_line(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)
    with pytest.raises(MetricsError, match=r"pip install 'pipe-llm\[track\]'"):
        MetricsLogger(tmp_path, wandb_project="proj")


def test_wandb_offline_without_credentials(tmp_path):
    no_netrc = {"NETRC": str(tmp_path / "absent")}
    assert wandb_mode(no_netrc) == "offline"
    assert wandb_mode({**no_netrc, "WANDB_API_KEY": "x"}) is None
    assert wandb_mode({**no_netrc, "WANDB_MODE": "online"}) is None
    netrc_file = tmp_path / "netrc"
    netrc_file.write_text("machine api.wandb.ai login user password secret\n")
    netrc_file.chmod(0o600)
    assert wandb_mode({"NETRC": str(netrc_file)}) is None


def test_import_is_light():
    """Importing the metrics and plot modules pulls in neither torch nor matplotlib."""
    code = (
        "import sys, pipeline.train.report.metrics, pipeline.train.report.plot\n"
        "import pipeline.train.plot_command\n"
        "heavy = [m for m in ('torch', 'matplotlib', 'tensorboard', 'wandb') if m in sys.modules]\n"
        "assert not heavy, heavy\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
