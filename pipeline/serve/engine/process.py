"""The engine's own process: `pipe serve` runs the model where the HTTP server's interpreter lock
cannot stall it.

The process loads the model, builds the `Engine` and then loops: take every message waiting on
its pipe (add a group of requests on one prompt, abort one, stop), run one `Engine.step`, send
what the step produced as one message for the whole batch. The messages are the small
dataclasses of `pipeline.serve.engine.messages`, so a step of 32 requests costs one pickle, not 32
thread hops. Text is not made here: token ids go out and the server process detokenises them and
matches stop strings (`pipeline.serve.http.engine_client`) while the next step runs.

The process ignores SIGINT and SIGTERM: the server drains its requests first, then tells the
engine to stop; a server that dies closes the pipe, and the engine exits on that too.
"""

from __future__ import annotations

import logging
import os
import signal
from dataclasses import dataclass
from multiprocessing.connection import Connection

from pipeline.serve.engine.messages import (
    AbortRequest,
    AddGroup,
    ControlDone,
    Failed,
    LoadLoRA,
    LoadReport,
    Ready,
    Rejected,
    ResetPrefixCache,
    StepFailed,
    StepOutputs,
    StopEngine,
    TokenOutput,
    UnloadLoRA,
    UpdateWeights,
)

log = logging.getLogger(__name__)
MAX_AUTO_BATCH = 256  # vLLM's default max_num_seqs


@dataclass(frozen=True)
class EngineSpec:
    """What the engine process needs: where the model is and how to size the engine.

    max_batch 0 chooses it from the KV-cache budget (`batch_for_cache`)."""

    checkpoint: str
    tokenizer: str | None
    device: str
    dtype: str | None  # "fp32", "bf16" or None (the device's default)
    kv_cache_bytes: int
    block_size: int
    max_batch: int
    prefill_chunk: int
    threads: int = 0  # CPU threads of the engine; 0: `engine_threads()`
    lora_adapter: str | None = None  # LoRA adapters run beside the weights, unmerged
    # adapters by name (`pipeline.serve.engine.lora_slots`): max_loras 0 serves none
    lora_modules: tuple[tuple[str, str], ...] = ()  # (name, path)
    max_loras: int = 0
    max_lora_rank: int = 16
    prefix_caching: bool = True  # `Engine(prefix_caching=...)`
    cuda_graphs: bool | None = None  # `Engine(cuda_graphs=...)`: None on a CUDA device


def batch_for_cache(cache_blocks: int) -> int:
    """The default number of requests at once: as many as the cache has blocks (each running
    request holds at least one), up to `MAX_AUTO_BATCH`. Admission still waits for a request's
    whole reservation, so the cache, not this number, is what bounds the batch."""
    return max(1, min(MAX_AUTO_BATCH, cache_blocks))


def engine_threads() -> int:
    """The engine's CPU threads by default: every core this process may use but one, which is
    left to the HTTP process (as vLLM's CPU build reserves one for its front end). On a quiet
    machine a second core shortens a decode step of many requests (24.8 ms against 34.3 ms at
    32 on the serving benchmark's model; at one request it gains nothing), but with one more
    busy process on the machine every core to the engine made requests 3.5-5.7x slower at one
    client and 20-26x slower at eight than one thread on 2 cores
    (docs/serve.md, "Engine threads"): torch's threads wait for the one that shares its core
    at every product. `--engine-threads N` sets another number."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1, (cores or 1) - 1)


def build_engine(gen, *, kv_cache_bytes: int, block_size: int, max_batch: int = 0, **limits):
    """An engine for `gen` (a loaded `Generator`) whose KV cache fits `kv_cache_bytes`;
    `max_batch` 0 sizes the batch from the cache (`batch_for_cache`). The engine makes no text:
    the server process does, off the engine's path."""
    from pipeline.serve.engine.core import Engine
    from pipeline.serve.engine.kv_cache import BlockKVCache

    param = next(gen.model.parameters())
    blocks = BlockKVCache.blocks_for_budget(
        gen.model.config, kv_cache_bytes, block_size, param.dtype, gen.tp
    )
    if blocks < 1:
        raise ValueError(f"a KV cache of {kv_cache_bytes} bytes holds not one block")
    return Engine(
        gen.model,
        cache_blocks=blocks,
        block_size=block_size,
        tp=gen.tp,
        max_batch=max_batch or batch_for_cache(blocks),
        **limits,
    )


def run_engine(spec: EngineSpec, pipe: Connection) -> None:
    """The engine process's body (module docstring)."""
    import torch

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    torch.set_num_threads(spec.threads or engine_threads())
    engine, ready = _load(spec)
    pipe.send(ready)
    if engine is None:
        return
    try:
        _serve(engine, pipe)
    except (EOFError, BrokenPipeError, ConnectionResetError):
        return  # the server is gone


def _load(spec: EngineSpec):
    import torch

    from pipeline.serve.engine.cpu_linear import prepack_linears
    from pipeline.serve.engine.loading import LoadError, open_generator

    dtype = {None: None, "fp32": torch.float32, "bf16": torch.bfloat16}[spec.dtype]
    try:
        gen = open_generator(
            spec.checkpoint,
            tokenizer=spec.tokenizer,
            device=spec.device,
            dtype=dtype,
            lora_adapter=spec.lora_adapter,
        )
        # Adapter slots re-class linears, and a stack's linear then runs the stack's whole
        # product for its own share: stacks only where no adapter can come.
        prepack_linears(gen.model, stack=not spec.max_loras)
        engine = build_engine(
            gen,
            kv_cache_bytes=spec.kv_cache_bytes,
            block_size=spec.block_size,
            max_batch=spec.max_batch,
            prefill_chunk=spec.prefill_chunk,
            max_waiting=2**31,
            grammars=_grammars(gen),
            prefix_caching=spec.prefix_caching,
            cuda_graphs=spec.cuda_graphs,
        )
        param = next(gen.model.parameters())
        if param.is_cpu and param.dtype == torch.float32 and torch.get_num_threads() == 1:
            from pipeline.core.kernels.cpu_decode_attention import kernel

            # built (or found) now, not during the first request's first step; only where it
            # would serve (`cpu_decode_attention.serves`), so no other engine warns of a compiler
            kernel()
        if spec.max_loras:
            from pipeline.serve.engine.lora_slots import install_named_adapters

            engine.adapters = install_named_adapters(gen.model, spec)
    except (LoadError, ValueError) as error:
        return None, Failed(str(error))
    ready = Ready(
        name=gen.name,
        tokenizer_path=gen.tokenizer_path and str(gen.tokenizer_path),
        eos_ids=gen.eos_ids,
        max_context=engine.max_context,
        cache_blocks=engine.cache.num_blocks,
        block_size=engine.cache.block_size,
        max_batch=engine.scheduler.max_batch,
        vocab_size=gen.model.config.vocab_size,
    )
    return engine, ready


def _grammars(gen):
    """The structured-output backend over the served tokenizer (None without a tokenizer.json)."""
    from pipeline.serve.engine.structured_output import GrammarBackend

    if gen.tokenizer_path is None:
        return None
    return GrammarBackend.from_path(gen.tokenizer_path, gen.model.config.vocab_size, gen.eos_ids)


def _serve(engine, pipe: Connection) -> None:
    requests = {}  # the server's request id -> the engine's Request
    client_ids = {}  # and back
    while True:
        # Block while idle; while busy only take what has already arrived.
        wait, handled = None if not engine.busy else 0, False
        while pipe.poll(wait):
            message = pipe.recv()
            if isinstance(message, StopEngine):
                return
            _handle(engine, requests, client_ids, message, pipe)
            wait, handled = 0, True
        if engine.busy:
            _step(engine, requests, client_ids, pipe)
        elif handled:  # an abort while idle: the server's /health must see it
            pipe.send(LoadReport(*engine.load))


def _step(engine, requests: dict, client_ids: dict, pipe: Connection) -> None:
    """One engine step, its tokens sent as one message."""
    import torch

    try:
        # This process's model only serves: no tensor of a step ever meets autograd, and
        # inference mode skips its bookkeeping (a decode step 2.5-4% faster on the serving
        # benchmark's model at 1 and 8 requests).
        with torch.inference_mode():
            events = engine.step()
    except Exception as error:  # noqa: BLE001 - every waiting client must hear of it
        log.exception("generation step failed")
        engine.abort_all()
        requests.clear()
        client_ids.clear()
        pipe.send(StepFailed(str(error)))
        return
    outputs = [_output(client_ids[event.request], event) for event in events]
    pipe.send(StepOutputs(outputs, *engine.load))
    for event in events:
        if event.finished:
            requests.pop(client_ids.pop(event.request), None)


def _handle(engine, requests: dict, client_ids: dict, message, pipe: Connection) -> None:
    if isinstance(message, UpdateWeights):
        pipe.send(_update_weights(engine, message))
    elif isinstance(message, ResetPrefixCache):
        engine.reset_prefix_cache()
        pipe.send(ControlDone())
    elif isinstance(message, (LoadLoRA, UnloadLoRA)):
        from pipeline.serve.engine.lora_slots import adapter_control

        pipe.send(adapter_control(engine.adapters, message))
    elif isinstance(message, AddGroup):
        try:
            group = engine.add_group(message.prompt, message.params, message.lora_name)
        except ValueError as error:  # PromptTooLong and bad values: the server checks first
            for request_id in message.request_ids:
                pipe.send(Rejected(request_id, str(error)))
            return
        for request_id, request in zip(message.request_ids, group):
            requests[request_id] = request
            client_ids[request] = request_id
    elif isinstance(message, AbortRequest):
        request = requests.pop(message.request_id, None)
        if request is not None:
            client_ids.pop(request, None)
            engine.abort(request)


def _update_weights(engine, message: UpdateWeights) -> ControlDone:
    """New weights in place (`pipeline.serve.engine.weight_update`); the server drained the engine
    first, so no request sees both the old weights and the new."""
    from pipeline.serve.engine.weight_update import WeightUpdateError, update_weights

    try:
        update_weights(engine.model, message)
    except WeightUpdateError as error:
        return ControlDone(str(error))
    except Exception as error:  # noqa: BLE001 - the server must hear of it, not hang
        log.exception("weight update failed")
        return ControlDone(f"weight update failed: {error}")
    engine.weights_changed()
    return ControlDone()


def _output(request_id: int, event) -> TokenOutput:
    request = event.request
    first = len(request.output) == 1 and request.admitted is not None
    return TokenOutput(
        request_id,
        event.token,
        request.finish_reason if event.finished else None,
        event.logprobs,
        event.prompt_logprobs,
        request.admitted - request.arrived if first else None,
        request.cached_tokens if first else None,
    )
