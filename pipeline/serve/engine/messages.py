"""What `pipe serve`'s engine process and HTTP process say to each other, as types.

The HTTP process (`pipeline.serve.http.engine_client`) sends `ToEngine` messages down the pipe; the
engine process (`pipeline.serve.engine.process`) answers with `FromEngine` ones. Every message is
a frozen dataclass of ints, strings and other such dataclasses, so it pickles across the process
boundary as it is; a receiver tells them apart by type, and a field has a name instead of a
position in a tuple. `Delta` is what the engine client hands on to the HTTP routes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pipeline.serve.engine.sampling import SamplingParams, TokenLogprobs

# ---- to the engine process ----------------------------------------------------------------------


@dataclass(frozen=True)
class AddGroup:
    """Queue one generation per `params` entry on one prompt, prefilled once
    (`Engine.add_group`: a body's n completions; a single request is a group of one).
    `request_ids[i]` is the HTTP process's own number for the i-th: every answer about a
    request names it, so the engine's `Request` objects never cross the pipe."""

    request_ids: list[int]
    prompt: list[int]
    params: list[SamplingParams]
    lora_name: str | None = None  # the adapter to run with (`pipeline.serve.engine.lora_slots`)


@dataclass(frozen=True)
class AbortRequest:
    """Stop a request now (its client went away or a stop string ended it), so its batch slot
    and cache blocks are free at the next step."""

    request_id: int


@dataclass(frozen=True)
class StopEngine:
    """Exit the engine process: the HTTP server has drained its requests."""


@dataclass(frozen=True)
class UpdateWeights:
    """Replace the model's weights in place (the HTTP process has drained the engine first):
    from the checkpoint or Hugging Face directory at `path`, or from the tensors a training
    process wrote into the shared-memory segment `shm_name` (tensor i: `names[i]`, of
    `dtype_names[i]` and `shapes[i]`, at byte `offsets[i]`). Answered by `ControlDone`."""

    path: str | None = None
    shm_name: str | None = None
    names: tuple[str, ...] = ()
    dtype_names: tuple[str, ...] = ()
    shapes: tuple[tuple[int, ...], ...] = ()
    offsets: tuple[int, ...] = ()


@dataclass(frozen=True)
class ResetPrefixCache:
    """Forget every cached prompt block (`Engine.reset_prefix_cache`). Answered by `ControlDone`."""


@dataclass(frozen=True)
class LoadLoRA:
    """Serve the LoRA adapter at `path` as `name` (vLLM's /v1/load_lora_adapter). Answered by
    `ControlDone`."""

    name: str
    path: str


@dataclass(frozen=True)
class UnloadLoRA:
    """Stop serving the adapter `name` to new requests (vLLM's /v1/unload_lora_adapter).
    Answered by `ControlDone`."""

    name: str


ToEngine = (
    AddGroup | AbortRequest | StopEngine | UpdateWeights | ResetPrefixCache | LoadLoRA | UnloadLoRA
)


# ---- from the engine process --------------------------------------------------------------------


@dataclass(frozen=True)
class Ready:
    """The engine is loaded: what the HTTP process needs to know of it to admit requests and to
    make their text (the engine process sends it once, first)."""

    name: str
    tokenizer_path: str | None
    eos_ids: frozenset[int]
    max_context: int
    cache_blocks: int
    block_size: int
    max_batch: int
    vocab_size: int


@dataclass(frozen=True)
class Failed:
    """The model could not be loaded (one line naming the path); sent instead of `Ready`, and
    the engine process exits."""

    message: str


@dataclass(frozen=True)
class TokenOutput:
    """One token of one request. Only ids travel: the HTTP process makes the text, off the
    engine's path. `finish_reason` is the engine's ("stop" at a stop token, "length");
    `prompt_logprobs`, `queue_time` (seconds the request waited for the batch) and
    `cached_tokens` (prompt tokens read from the cache, not computed) come with a request's
    first token, `logprobs` with every token of a request that asked."""

    request_id: int
    token: int
    finish_reason: str | None
    logprobs: TokenLogprobs | None = None
    prompt_logprobs: tuple[TokenLogprobs | None, ...] | None = None
    queue_time: float | None = None
    cached_tokens: int | None = None


@dataclass(frozen=True)
class StepOutputs:
    """What one engine step produced, for the whole batch in one message (one pickle a step, not
    one a token), and how many requests the engine is running after it."""

    outputs: list[TokenOutput]
    running: int
    waiting: int


@dataclass(frozen=True)
class LoadReport:
    """The engine's request counts after a message changed them while it was idle (an abort), so
    the HTTP process's /health does not wait for a step that will not come."""

    running: int
    waiting: int


@dataclass(frozen=True)
class Rejected:
    """The engine refused a request the HTTP process had let through (it should not happen: the
    HTTP process checks the same limits first)."""

    request_id: int
    message: str


@dataclass(frozen=True)
class StepFailed:
    """A step raised: the engine aborted every request in flight and goes on serving new ones."""

    message: str


@dataclass(frozen=True)
class EngineExited:
    """The pipe closed: the engine process is gone. Never sent; the HTTP process's reader makes
    it, so that the end reaches the event loop as one more message."""


@dataclass(frozen=True)
class ControlDone:
    """The answer to `UpdateWeights`, `ResetPrefixCache`, `LoadLoRA` or `UnloadLoRA`: `error` is
    None when it was done, else one line naming the tensor or path at fault (and nothing was
    changed)."""

    error: str | None = None


FromEngine = (
    Ready | Failed | StepOutputs | LoadReport | Rejected | StepFailed | EngineExited | ControlDone
)


# ---- to the HTTP routes -------------------------------------------------------------------------


@dataclass
class Delta:
    """What one request gained since its consumer last looked: every token that arrived
    meanwhile (several per streamed chunk for a slow client) and the text they released."""

    token_ids: list[int]
    text: str
    logprobs: list[TokenLogprobs] = field(default_factory=list)  # one per token, when asked
    prompt_logprobs: tuple[TokenLogprobs | None, ...] | None = None  # on the first delta
    finish_reason: str | None = None  # "stop", "length", "abort"
    prompt_tokens: int = 0
    completion_tokens: int = 0  # so far
    queue_time: float | None = None  # seconds queued in the engine, on the first delta
    cached_tokens: int | None = None  # prompt tokens read from the cache, on the first delta
