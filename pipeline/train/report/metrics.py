"""Training metrics: one JSON line per log call in `RUN_DIR/metrics.jsonl`, plus optional sinks.

The JSONL file is the record of a run and is always written (by rank 0 only): it needs no extra
package, survives a kill (each line is flushed as it is written) and is what `pipe plot` reads.
TensorBoard and Weights & Biases are optional (`pip install 'pipe-llm[track]'`) and imported only
when enabled, so `import pipeline.train.report.metrics` never pulls in torch, tensorboard or wandb.

A line looks like `{"step": 100, "split": "train", "time": 1718000000.0, "loss": 4.12, ...}`.
Known metric keys, which the console line shows when present (others are written but not shown):

    loss, ppl       loss (nats per token) and perplexity
    lr              learning rate
    grad_norm       gradient norm before clipping
    tokens_per_s    training throughput, tokens per second (all ranks)
    tflops          achieved TFLOP/s per device
    mfu             model FLOPs utilisation as a *fraction* of peak (0.004 is shown as "MFU 0.4%")
    mem_gib         peak device memory, GiB
    skipped         iterations skipped so far (non-finite gradients)
    iters           total iterations of the run; shown as the denominator of "step 100/300"
"""

from __future__ import annotations

import json
import math
import netrc
import os
import sys
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

__all__ = [
    "METRICS_FILE",
    "MetricsError",
    "MetricsLogger",
    "format_console_line",
    "read_metrics",
    "router_statistics",
]

METRICS_FILE = "metrics.jsonl"
TRACK_HINT = "pip install 'pipe-llm[track]'"


class MetricsError(RuntimeError):
    """A metrics sink cannot be used (a missing optional package, an unreadable metrics file)."""


class MetricsLogger:
    """Writes metrics to `run_dir/metrics.jsonl`, the console and, if enabled, TensorBoard and W&B.

    Only rank 0 logs: on any other rank every method is a no-op, so callers need no rank checks.
    A resumed run appends to the same file; steps logged again after the resume simply follow the
    earlier ones (readers keep the last value of a step, see `pipeline.train.report.plot`).
    """

    def __init__(
        self,
        run_dir: str | Path,
        *,
        tensorboard: bool = False,
        wandb_project: str | None = None,
        config: dict | None = None,
        rank: int = 0,
        console: bool = True,
    ) -> None:
        self.run_dir = Path(run_dir)
        self.enabled = rank == 0
        self.console = console and self.enabled
        self.total_iters = _total_iters(config)
        self._file = None
        self._tb = None
        self._wandb = None
        if not self.enabled:
            return
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self._file = _open_for_append(self.run_dir / METRICS_FILE)
        try:
            if tensorboard:
                self._tb = _tensorboard_writer(self.run_dir / "tensorboard")
            if wandb_project:
                self._wandb = _wandb_run(self.run_dir, wandb_project, config)
        except BaseException:
            self.close()
            raise

    def log(self, step: int, metrics: dict[str, float], *, split: str = "train") -> None:
        """Record `metrics` at `step` for `split` ("train", "valid", ...) in every enabled sink."""
        if not self.enabled or self._file is None:
            return
        values = {key: _scalar(value) for key, value in metrics.items()}
        record = {"step": int(step), "split": split, "time": time.time(), **values}
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        if self._tb is not None:
            for key, value in values.items():
                if isinstance(value, (int, float)):
                    self._tb.add_scalar(f"{split}/{key}", value, global_step=int(step))
                elif isinstance(value, str):  # generated samples
                    self._tb.add_text(f"{split}/{key}", value, global_step=int(step))
        if self._wandb is not None:
            self._wandb.log({f"{split}/{key}": value for key, value in values.items()}, step=step)
        if self.console:
            line = format_console_line(step, values, split=split, total_iters=self.total_iters)
            texts = [
                f"  {key}: {value!r}" for key, value in values.items() if isinstance(value, str)
            ]
            print("\n".join([line, *texts]), file=sys.stdout, flush=True)

    def close(self) -> None:
        """Flush and close every sink; safe to call twice."""
        if self._file is not None:
            self._file.close()
            self._file = None
        if self._tb is not None:
            self._tb.close()
            self._tb = None
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None

    def __enter__(self) -> MetricsLogger:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def read_metrics(run_dir: str | Path) -> list[dict]:
    """The records of `run_dir/metrics.jsonl`, in file order.

    A last line that does not parse is the tail of a run killed mid-write and is skipped; a bad
    line anywhere else is corruption and raises `MetricsError` naming the file and line.
    """
    path = Path(run_dir) / METRICS_FILE
    if not path.is_file():
        raise MetricsError(f"{path}: no such metrics file (is {run_dir} a run directory?)")
    lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
    records = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            if number == len(lines):
                break  # truncated by a kill
            raise MetricsError(f"{path}:{number}: not a JSON line ({err.msg})") from None
        if not isinstance(record, dict) or "step" not in record:
            raise MetricsError(f"{path}:{number}: not a metrics record (no 'step')")
        records.append(record)
    return records


def router_statistics(model: Any) -> dict[str, float]:
    """MoE router statistics of the last forward over this rank's MoE layers (empty when
    dense): `moe_max_load`, the busiest expert's share of assignments relative to a perfectly
    balanced router (1.0 is balanced), and `moe_dropped`, the fraction of assignments dropped
    over capacity. Under expert parallelism the counts are those of the whole ep group."""
    layers = model.moe_layers().values()
    loads, dropped, total = [], 0.0, 0.0
    for moe in layers:
        counts = moe.tokens_per_expert
        if counts is None or counts.sum() == 0:
            continue
        counts = counts.float()
        loads.append(float(counts.max() / counts.mean()))
        total += float(counts.sum())
        dropped += float(moe.num_dropped) if moe.num_dropped is not None else 0.0
    if not loads:
        return {}
    return {"moe_max_load": max(loads), "moe_dropped": dropped / total}


# ----------------------------------------------------------------------------- console line


def format_console_line(
    step: int, metrics: dict[str, Any], *, split: str = "train", total_iters: int | None = None
) -> str:
    """One tidy line from whichever known keys are present, e.g.

    `step    100/300 | loss 4.1234 | lr 9.98e-04 | grad 1.23 | 12,345 tok/s | MFU 0.4%` for
    training and `valid step 100 | loss 3.9000 | ppl 49.4` for any other split.
    """
    if split == "train":
        total = metrics.get("iters", total_iters)
        head = f"step {step:>6}" + (f"/{int(total)}" if total is not None else "")
    else:
        head = f"{split} step {step}"
    parts = [head]
    for key, render in _CONSOLE_FIELDS:
        value = metrics.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            parts.append(render(value))
    return " | ".join(parts)


def _float(fmt: str, template: str, scale: float = 1.0):
    """A renderer printing `value * scale` with `fmt` into `template`; NaN and inf print as is."""

    def render(value: float) -> str:
        value = value * scale
        text = format(value, fmt) if math.isfinite(value) else str(value)
        return template.format(text)

    return render


# Order of the console fields; `iters` is shown in the step head instead.
_CONSOLE_FIELDS = [
    ("loss", _float(".4f", "loss {}")),
    ("ppl", _float(".1f", "ppl {}")),
    ("reward/mean", _float(".3f", "reward {}")),  # GRPO
    ("accuracy", _float(".3f", "accuracy {}")),  # DPO's pairs, GRPO's answers
    ("lr", _float(".2e", "lr {}")),
    ("grad_norm", _float(".3g", "grad {}")),
    ("tokens_per_s", _float(",.0f", "{} tok/s")),
    ("tflops", _float(".1f", "{} TFLOP/s")),
    ("mfu", _float(".1f", "MFU {}%", scale=100.0)),
    ("mem_gib", _float(".1f", "mem {} GiB")),
    ("skipped", _float(".0f", "skipped {}")),
]


# ----------------------------------------------------------------------------- helpers


def _scalar(value: Any) -> Any:
    """A plain JSON value: tensors and numpy scalars become Python numbers via `.item()`."""
    if hasattr(value, "item") and not isinstance(value, (int, float)):
        value = value.item()
    return value


def _total_iters(config: dict | None) -> int | None:
    """`training.iters` from the resolved config, for the "step N/TOTAL" head of console lines."""
    training = (config or {}).get("training")
    if isinstance(training, dict) and isinstance(training.get("iters"), int):
        return training["iters"]
    return None


def _open_for_append(path: Path):
    """Open `path` for appending, first cutting a partial last line left by a killed run, so the
    first new record starts on a line of its own."""
    if path.exists() and path.stat().st_size > 0:
        data = path.read_bytes()
        if not data.endswith(b"\n"):
            with open(path, "r+b") as handle:
                handle.truncate(data.rfind(b"\n") + 1)
    return open(path, "a", encoding="utf-8")


def _tensorboard_writer(log_dir: Path):
    """A torch `SummaryWriter` on `log_dir`, or a one-line error when tensorboard is missing."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        raise MetricsError(f"TensorBoard logging needs tensorboard: {TRACK_HINT}") from None
    return SummaryWriter(log_dir=str(log_dir))


def _wandb_run(run_dir: Path, project: str, config: dict | None):
    """A W&B run for `run_dir`, resumed across restarts via an id kept in `run_dir/wandb_id`.

    Offline unless the user chose a mode (WANDB_MODE) or has an API key, so a run never waits on
    the network for a login.
    """
    try:
        import wandb
    except ImportError:
        raise MetricsError(f"W&B logging needs wandb: {TRACK_HINT}") from None
    from pipeline.common.atomic import write_text

    id_file = run_dir / "wandb_id"
    run_id = id_file.read_text().strip() if id_file.exists() else wandb.util.generate_id()
    write_text(id_file, run_id + "\n")
    return wandb.init(
        project=project,
        name=run_dir.name,
        id=run_id,
        resume="allow",
        dir=str(run_dir),
        config=config,
        mode=wandb_mode(),
    )


def wandb_mode(environ: dict[str, str] | None = None) -> str | None:
    """The W&B mode to pass to `wandb.init`: None (wandb decides) when WANDB_MODE is set or an API
    key is known (WANDB_API_KEY or ~/.netrc), otherwise "offline"."""
    env = os.environ if environ is None else environ
    if env.get("WANDB_MODE") or env.get("WANDB_API_KEY"):
        return None
    host = urlparse(env.get("WANDB_BASE_URL", "https://api.wandb.ai")).hostname or ""
    try:
        if netrc.netrc(env.get("NETRC")).authenticators(host):
            return None
    except (OSError, netrc.NetrcParseError):
        pass
    return "offline"
