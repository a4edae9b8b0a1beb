"""Keep other libraries' warnings, log lines and progress bars out of pipe's output.

pipe's commands print their own one-line summaries; what torch, torchao and transformers say on
import or while loading (optional C++ kernels that do not load on this machine, deprecations
meant for library authors, per-file progress bars) is not actionable for a pipe user. Each heavy
optional library is imported through a function here, which sets the filters first: a library
logs most of this while it is being imported, so setting them afterwards is too late.

This module imports nothing heavy itself, so any package of pipe may use it.
"""

from __future__ import annotations

import io
import logging
import sys
import warnings
from collections.abc import Iterator
from contextlib import contextmanager, redirect_stderr
from types import ModuleType

# Loggers whose warnings are addressed to library developers, not to pipe's users:
# torchao reports each optional kernel library that does not load for this torch/GPU, and torch's
# pytree warns that torchao registers its enums in a deprecated way.
_LIBRARY_LOGGERS = ("torchao", "torch.utils._pytree")


def quiet_library_logs() -> None:
    """Raise the level of the library loggers above to ERROR (idempotent; call before import)."""
    for name in _LIBRARY_LOGGERS:
        logging.getLogger(name).setLevel(logging.ERROR)


def import_transformers() -> ModuleType:
    """`transformers`, imported with its logs at error level and its progress bars off.

    Raises ImportError when it is not installed; callers turn that into their install hint.
    transformers imports torchao when present, hence the library loggers first.
    """
    quiet_library_logs()
    import transformers
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    return transformers


def import_torchao_float8() -> ModuleType:
    """`torchao.float8`, imported without torchao's kernel-loading log lines.

    Raises ImportError when torchao is not installed.
    """
    quiet_library_logs()
    import torchao.float8

    return torchao.float8


# DCP warns so on every save or load without a process group (a converter, one device).
_DCP_SINGLE_PROCESS = "torch.distributed is disabled"


@contextmanager
def quiet_dcp() -> Iterator[None]:
    """Inside: torch.distributed.checkpoint's warning that it runs without a process group.

    A converter or a single-device run saves and loads without one on purpose.
    """
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_DCP_SINGLE_PROCESS)
        yield


def ignore_dcp_single_process_warning() -> None:
    """Process-wide form of `quiet_dcp`, for an asynchronous save: it warns on its own thread,
    after any `catch_warnings` block of the caller has ended."""
    warnings.filterwarnings("ignore", message=_DCP_SINGLE_PROCESS)


# DTensor logs, once per process and mesh, that gathering a tensor sharded twice along one
# dimension (FSDP's strided shard under tensor parallelism) takes two all-gathers in a row and
# that it cannot merge them. pipe gathers such tensors on purpose (a Hugging Face save, Muon's
# whole-matrix update), and the hint names no setting a user could change.
_REDISTRIBUTE_LOGGER = "torch.distributed.tensor._redistribute"
_UNMERGEABLE_GATHER = "not possible to merge non-ascending order"


class _DropMessagesWith(logging.Filter):
    """Drops the records whose message contains `text`; lets every other one through."""

    def __init__(self, text: str) -> None:
        super().__init__()
        self.text = text

    def filter(self, record: logging.LogRecord) -> bool:
        return self.text not in record.getMessage()


def quiet_unmergeable_gather_hints() -> None:
    """Keep DTensor's hint that a twice-sharded tensor's gather cannot be one collective out of
    the output, process-wide (idempotent). Its other redistribution warnings (collectives that
    a flattened mesh would merge) still show: those point at a fix in pipe."""
    logger = logging.getLogger(_REDISTRIBUTE_LOGGER)
    if not any(isinstance(f, _DropMessagesWith) for f in logger.filters):
        logger.addFilter(_DropMessagesWith(_UNMERGEABLE_GATHER))


# lm-eval logs each task's defaults as warnings ("metric acc is defined, but aggregation is
# not") and HF datasets logs its cache; both are addressed to whoever writes the task.
_EVALUATION_LOGGERS = ("lm_eval", "datasets")


@contextmanager
def quiet_lm_eval() -> Iterator[None]:
    """Inside: lm-eval's and HF datasets' log lines and progress bars, for lm-eval run by a pipe
    command whose console is pipe's own (in-loop evaluation in `pipe train`, `pipe eval`).

    Some of lm-eval's bars take no switch (building a task's requests), so standard error is
    held in a buffer for the block; it is written out after all if the block raises.
    """
    loggers = [logging.getLogger(name) for name in _EVALUATION_LOGGERS]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.ERROR)
    held = io.StringIO()
    try:
        with redirect_stderr(held):
            yield
    except BaseException:
        sys.stderr.write(held.getvalue())
        raise
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)
