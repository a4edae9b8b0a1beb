"""`RunState`'s record hook: what a part of the run records under its name in every
checkpoint's metadata is handed back to it on a resume (and on `--finetune`, as not resumed),
and a resumed run that no longer matches it is refused in one line."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from pipeline.checkpoint import read_checkpoint_record
from pipeline.train.assembly.run_config import resolve_config
from pipeline.train.config.schema import ConfigError
from pipeline.train.loop.trainer import Trainer
from pipeline.train.objectives.language_model.objective import LanguageModelling
from tests.builders import micro_sets


class Probe:
    """A `RunRecord` holding one value; a resumed run must have the recorded one."""

    name = "probe"

    def __init__(self, value: int) -> None:
        self.value = value
        self.seen: list[tuple[dict[str, Any] | None, bool]] = []

    def record(self) -> dict[str, Any]:
        return {"value": self.value}

    def check(self, recorded: dict[str, Any] | None, resuming: bool) -> None:
        self.seen.append((recorded, resuming))
        if resuming and recorded is not None and recorded != self.record():
            raise ConfigError(f"probe: recorded {recorded['value']}, this run has {self.value}")


def _trainer(monkeypatch, probe: Probe, sets: list[str]) -> Trainer:
    """A trainer whose objective (language modelling) records `probe`."""
    monkeypatch.setattr(LanguageModelling, "records", lambda self: [probe])
    return Trainer(resolve_config(None, sets), console=False)


def test_a_record_is_saved_handed_back_and_a_mismatch_refused(tmp_path: Path, monkeypatch):
    first = Probe(1)
    _trainer(monkeypatch, first, micro_sets(tmp_path, iters=2)).train()
    assert first.seen == [(None, False)]  # a new run: nothing recorded yet
    saved = tmp_path / "checkpoints" / "iter_0000002"
    assert read_checkpoint_record(saved)["metadata"]["probe"] == {"value": 1}

    load = f"checkpoint.load={tmp_path / 'checkpoints'}"
    same = Probe(1)
    assert _trainer(monkeypatch, same, micro_sets(tmp_path, load, iters=4)).iteration == 2
    assert same.seen == [({"value": 1}, True)]

    other = Probe(2)
    with pytest.raises(ConfigError, match=r"^probe: recorded 1, this run has 2$"):
        _trainer(monkeypatch, other, micro_sets(tmp_path, load, iters=4))

    weights_only = Probe(2)
    sets = micro_sets(tmp_path / "finetune", load, "checkpoint.finetune=true", iters=4)
    assert _trainer(monkeypatch, weights_only, sets).iteration == 0
    assert weights_only.seen == [({"value": 1}, False)]
