"""GRPO's rollouts generated ahead of training (`grpo.max_staleness` >= 1, with a rollout
server): while a step trains on its batch, the server generates the next step's, from the
weights the trainer had when that step began (pushed before it was sent).

A batch is tagged with the version of the weights that generated it (the optimizer steps taken
before the push); it is used at a step whose weights are `staleness` versions newer (1 here,
one batch ahead), and a batch older than `max_staleness` is dropped, counted, and generated
again from the current weights. The loss's old log-probabilities are then the engine's of
the sampled tokens (`engine_logps`): the ratio the clip bounds is the current policy over the
one that sampled, which covers both the staleness and the rollout/trainer mismatch (TRL's and
verl's asynchronous GRPO do the same), so the importance-sampling correction is not applied
again.

The next batch's prompts are those of the samples one global batch on (the prompt dataset is
read in order); if the step's samples turn out to be others, the batch ahead is dropped. A
checkpoint holds no batch ahead: a resumed run generates its first batch afresh.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

__all__ = ["Ahead", "RolloutsAhead"]


@dataclass
class Ahead:
    """A batch being generated: its samples, the weights' version, the work."""

    samples: tuple[int, ...]
    version: int
    future: Future


class RolloutsAhead:
    """One batch of rollouts generated on a background thread (module docstring)."""

    def __init__(self, max_staleness: int) -> None:
        self.max_staleness = max_staleness
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="pipe-grpo-ahead")
        self.pending: Ahead | None = None

    def launch(self, samples: tuple[int, ...], version: int, generate: Callable[[], Any]) -> None:
        """Start generating the batch of `samples` from weights of `version` now."""
        self.pending = Ahead(samples, version, self.pool.submit(generate))

    def take(self, samples: tuple[int, ...], version: int) -> tuple[Any, int, int]:
        """(rollouts, their version, completions dropped) of the batch of `samples` for a step
        on weights of `version`: (None, version, dropped) when none was generated ahead for
        them, or it is staler than `max_staleness` (dropped, its completions counted)."""
        pending, self.pending = self.pending, None
        if pending is None:
            return None, version, 0
        outs = pending.future.result()  # a failed generation raises here, in the step
        if pending.samples != samples:
            return None, version, len(outs.completions)
        if version - pending.version > self.max_staleness:
            return None, version, len(outs.completions)
        return outs, pending.version, 0

    def drain(self) -> None:
        """Wait until the batch in flight is done (before the weights are pushed again)."""
        if self.pending is not None:
            self.pending.future.exception()
