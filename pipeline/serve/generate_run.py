"""What `pipe generate` does once the model is loaded: run the prompts through the engine and
write the text to the terminal as it comes (one prompt), or each text when done (several).

The text is made as `pipe serve` makes it (`pipeline.serve.engine.text.RequestText`): the engine
hands out token ids, and a request that reaches a stop string is aborted there."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from pipeline.serve.engine.core import Engine
from pipeline.serve.engine.loading import Generator
from pipeline.serve.engine.sampling import SamplingParams
from pipeline.serve.engine.text import RequestText


def run_generation(
    gen: Generator,
    prompts: list[str],
    params: SamplingParams,
    echo: Callable[..., None],
    shown: list[str] | None = None,
    cuda_graphs: bool | None = None,
) -> list[str]:
    """Generate a continuation of each prompt; returns the texts (without their prompts).
    Each text is printed after its `shown` text (default: its prompt; a chat shows none).
    `cuda_graphs`: the engine's (None: on a CUDA device)."""
    shown = prompts if shown is None else shown
    params = dataclasses.replace(params, stop_token_ids=params.stop_token_ids | gen.eos_ids)
    encoded = [gen.encode(prompt) for prompt in prompts]
    block_size = 16
    blocks = sum(-(-(len(ids) + params.max_new_tokens) // block_size) for ids in encoded)
    engine = Engine(
        gen.model,
        max_batch=len(prompts),
        cache_blocks=max(blocks, 1),
        block_size=block_size,
        max_waiting=len(prompts),
        tp=gen.tp,
        cuda_graphs=cuda_graphs,
    )
    # The whole output's `tokenizer.decode` text, a character cut at the end included (what
    # transformers prints); `pipe serve` writes vLLM's text, which leaves that one out.
    texts = {
        engine.add(ids, params): RequestText(gen.decode, params, ids, keep_partial=True)
        for ids in encoded
    }
    streaming = len(prompts) == 1
    if streaming:
        echo(shown[0], nl=False)
    for event in engine.run():
        text = texts[event.request]
        piece = text.add(event.token, event.request.finish_reason if event.finished else None)
        if text.stopped_by_text:
            engine.abort(event.request)
        if streaming:
            echo(piece, nl=False)
    if streaming:
        echo("")
    else:
        for index, (prompt, text) in enumerate(zip(shown, texts.values())):
            echo(f"--- {index} ---\n{prompt}{text.text}")
    return [text.text for text in texts.values()]
