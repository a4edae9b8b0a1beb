"""Pause, resume and new weights for a running `pipe serve`, as vLLM's weight-transfer routes
drive them (`pipeline.serve.http.weight_routes`).

A pause refuses new requests (503 with Retry-After) and either aborts what runs (mode "abort",
vLLM's default: each ends with finish reason "abort") or lets it finish (mode "wait"). New weights
are never mixed with the old in one request: a push pauses in mode "wait" (unless already
paused), has the engine process copy the weights in place (`pipeline.serve.engine.weight_update`)
and drop its cached prompt blocks, then resumes. vLLM's "keep" mode (requests frozen across the
update) would mix them, so it is refused. A trainer may group several pushes between
/start_weight_update and /finish_weight_update (TRL's `weight_update()`): the engine stays paused
between them and the weights get one new version at the finish.

The weights' version (0 at start, then 1, 2, ... or what the trainer names) is in /v1/models and
/weight_info, and the responses' `system_fingerprint` changes with it.
"""

from __future__ import annotations

import asyncio
import hashlib

from pipeline.serve.engine.messages import ResetPrefixCache, UpdateWeights
from pipeline.serve.http.engine_client import EngineClient
from pipeline.serve.http.openai_api import APIError

PAUSE_MODES = ("abort", "wait")


class WeightControl:
    """The pause state and the weights' version of the server behind `client` (module doc)."""

    def __init__(self, client: EngineClient) -> None:
        self.client = client
        self.version = "0"
        self.updates = 0  # weight updates so far: the fingerprint changes even if a name repeats
        self._lock = asyncio.Lock()
        self._session: bool | None = None  # in a start/finish session: whether it loaded any
        self._paused_before_session = False

    @property
    def paused(self) -> bool:
        return self.client.paused

    @property
    def fingerprint(self) -> str:
        """`system_fingerprint`: which weights answered (changes with every update)."""
        key = f"{self.client.spec.checkpoint}|{self.updates}|{self.version}"
        return "fp_" + hashlib.sha256(key.encode()).hexdigest()[:12]

    async def pause(self, mode: str = "abort", clear_cache: bool = True) -> None:
        """Refuse new requests, abort or finish those in flight (`mode`), and return once none
        is; `clear_cache` drops the engine's cached prompt blocks too."""
        if mode not in PAUSE_MODES:
            raise APIError(
                f"mode {mode!r}: use abort or wait (keep would run requests on old and new "
                "weights)",
                param="mode",
            )
        self.client.paused = True
        if mode == "abort":
            self.client.cancel_all()
        await self.client.drained()
        if clear_cache:
            await self.reset_prefix_cache()

    def resume(self) -> None:
        """Accept requests again."""
        self.client.paused = False

    async def reset_prefix_cache(self) -> None:
        """Drop the engine's cached prompt blocks (`Engine.reset_prefix_cache`)."""
        await self.client.control(ResetPrefixCache())

    async def start_update(self) -> None:
        """Open a session of several pushes: pause (mode wait) until `finish_update`."""
        async with self._lock:
            if self._session is not None:
                raise APIError("a weight update is already under way", 409)
            self._paused_before_session = self.paused
            await self.pause("wait", clear_cache=False)
            self._session = False

    async def update(self, message: UpdateWeights, version: str | None = None) -> str:
        """Load new weights (a 400 naming the tensor when they do not fit; the old ones keep
        serving); outside a session pause first, take a new version and resume after.
        Returns the weights' version."""
        async with self._lock:
            alone = self._session is None
            resume = alone and not self.paused
            try:
                if alone:
                    await self.pause("wait", clear_cache=False)
                done = await self.client.control(message)
                if done.error is not None:
                    raise APIError(done.error, param="update_info")
                if alone:
                    self._new_version(version)
                else:
                    self._session = True
            finally:
                if resume:
                    self.resume()
            return self.version

    async def finish_update(self, version: str | None = None) -> str:
        """Close the session `start_update` opened: a new version if it loaded any weights,
        then resume (unless paused before it). Returns the weights' version."""
        async with self._lock:
            if self._session is None:
                raise APIError("no weight update under way: POST /start_weight_update first")
            if self._session:
                self._new_version(version)
            self._session = None
            if not self._paused_before_session:
                self.resume()
            return self.version

    def set_version(self, version: str) -> None:
        """Name the weights' version without new weights (vLLM's /update_weight_version)."""
        self.updates += 1
        self.version = version

    def _new_version(self, version: str | None) -> None:
        self.updates += 1
        self.version = version if version is not None else str(self.updates)
