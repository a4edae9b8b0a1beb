"""`GET /metrics`: the server's counters, gauges and latency histograms in Prometheus' text format.

Named like vLLM's (`vllm:num_requests_running` is `pipe:num_requests_running` here) so existing
dashboards need only the prefix changed. Each engine request is counted on its own (a body with
n = 4 is four requests). `pipe:prefix_cache_queries` and `pipe:prefix_cache_hits` (vLLM's names)
count prompt tokens looked up and those found in the cache (a group's leader's, or the prefix
cache), when a request's first token comes: the prompt tokens computed are their difference.
Every app has its own registry, so several apps in one process (tests) do not collide.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

# seconds; vLLM's buckets, shortened at the ends
_TTFT = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
_ITL = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0)
_E2E = (
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
)


class ServeMetrics:
    """The metrics of one served model; `load` gives (running, waiting) at scrape time."""

    content_type = CONTENT_TYPE_LATEST

    def __init__(self, model_name: str, load: Callable[[], tuple[int, int]]) -> None:
        self.registry = CollectorRegistry()
        self._model = {"model_name": model_name}
        for name, doc, pick in (
            ("pipe:num_requests_running", "Requests in the running batch.", 0),
            ("pipe:num_requests_waiting", "Requests waiting for a batch slot.", 1),
        ):
            gauge = Gauge(name, doc, ["model_name"], registry=self.registry)
            gauge.labels(**self._model).set_function(lambda pick=pick: load()[pick])
        self.success = Counter(
            "pipe:request_success",
            "Finished requests by finish reason.",
            ["model_name", "finished_reason"],
            registry=self.registry,
        )
        self.prompt_tokens = self._counter("pipe:prompt_tokens", "Prompt tokens processed.")
        self.cache_queries = self._counter(
            "pipe:prefix_cache_queries", "Prompt tokens looked up in the prefix cache."
        )
        self.cache_hits = self._counter(
            "pipe:prefix_cache_hits", "Prompt tokens read from the cache, not computed."
        )
        self.generation_tokens = self._counter("pipe:generation_tokens", "Tokens generated.")
        self.ttft = self._histogram(
            "pipe:time_to_first_token_seconds", "From arrival to the first generated token.", _TTFT
        )
        self.itl = self._histogram(
            "pipe:inter_token_latency_seconds", "Between two generated tokens of a request.", _ITL
        )
        self.e2e = self._histogram(
            "pipe:e2e_request_latency_seconds", "From arrival to the last token.", _E2E
        )
        self.queue = self._histogram(
            "pipe:request_queue_time_seconds", "From arrival to joining the running batch.", _E2E
        )

    def _counter(self, name: str, doc: str):
        """A counter of this model's, registered."""
        counter = Counter(name, doc, ["model_name"], registry=self.registry)
        return counter.labels(**self._model)

    def _histogram(self, name: str, doc: str, buckets: tuple[float, ...]):
        """A latency histogram of this model's, registered, with `buckets` (seconds)."""
        histogram = Histogram(name, doc, ["model_name"], buckets=buckets, registry=self.registry)
        return histogram.labels(**self._model)

    def finished(self, reason: str, prompt_tokens: int, completion_tokens: int) -> None:
        self.success.labels(finished_reason=reason, **self._model).inc()
        self.prompt_tokens.inc(prompt_tokens)
        self.generation_tokens.inc(completion_tokens)

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def track(self, stream):
        """`stream` (a request's deltas) with its latencies and outcome recorded."""
        return TrackedStream(stream, self)


class TrackedStream:
    """A request's stream of deltas that records its latencies and outcome on the way."""

    def __init__(self, stream, metrics: ServeMetrics) -> None:
        self._stream, self._metrics = stream, metrics
        self._start = self._last = time.monotonic()
        self._tokens = self._prompt = 0
        self._done = False

    def __aiter__(self):
        return self

    async def __anext__(self):
        delta = await self._stream.__anext__()
        now, metrics = time.monotonic(), self._metrics
        new = len(delta.token_ids)
        if new:
            if self._tokens == 0:
                metrics.ttft.observe(now - self._start)
                queued = getattr(delta, "queue_time", None)
                if queued is not None:
                    metrics.queue.observe(queued)
                metrics.cache_queries.inc(delta.prompt_tokens)
                metrics.cache_hits.inc(getattr(delta, "cached_tokens", None) or 0)
                new -= 1  # the first token has no gap before it
            for _ in range(new):  # tokens that came together share the gap
                metrics.itl.observe((now - self._last) / max(new, 1))
            self._last = now
        self._tokens, self._prompt = delta.completion_tokens, delta.prompt_tokens
        if delta.finish_reason is not None and not self._done:
            self._done = True
            metrics.e2e.observe(now - self._start)
            metrics.finished(delta.finish_reason, self._prompt, self._tokens)
        return delta

    def abort(self) -> None:
        """Stop the request (its consumer is gone); counted as aborted if it had not finished."""
        self._stream.abort()
        if not self._done:
            self._done = True
            self._metrics.finished("abort", self._prompt, self._tokens)
