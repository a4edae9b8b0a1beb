"""What `pipe generate` does once the model is loaded: run the prompts through the engine and
write the text to the terminal as it comes (one prompt), or each text when done (several)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from pipeline.serve.engine import Engine
from pipeline.serve.loading import Generator
from pipeline.serve.sampling import SamplingParams


def run_generation(
    gen: Generator,
    prompts: list[str],
    params: SamplingParams,
    echo: Callable[..., None],
    shown: list[str] | None = None,
) -> list[str]:
    """Generate a continuation of each prompt; returns the texts (without their prompts).
    Each text is printed after its `shown` text (default: its prompt; a chat shows none)."""
    shown = prompts if shown is None else shown
    params = dataclasses.replace(params, stop_token_ids=params.stop_token_ids | gen.eos_ids)
    encoded = [gen.encode(prompt) for prompt in prompts]
    block_size = 16
    blocks = sum(-(-(len(ids) + params.max_new_tokens) // block_size) for ids in encoded)
    engine = Engine(
        gen.model, max_batch=len(prompts), cache_blocks=max(blocks, 1), block_size=block_size,
        max_waiting=len(prompts), decode=gen.decode, tp=gen.tp,
    )  # fmt: skip
    requests = [engine.add(ids, params) for ids in encoded]
    if len(prompts) == 1:
        echo(shown[0], nl=False)
        for event in engine.run():
            echo(event.text, nl=False)
        echo("")
    else:
        for _ in engine.run():
            pass
        for index, (prompt, request) in enumerate(zip(shown, requests)):
            echo(f"--- {index} ---\n{prompt}{request.text.text}")
    return [request.text.text for request in requests]
