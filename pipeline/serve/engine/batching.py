"""One engine step's forward pass: its rows (request, new tokens) made into a batch, run through
the model, and the logits of the rows whose prompt is done.

A step's decode rows go through the static-shape decoder when the engine has one
(`pipeline.serve.engine.static_decode`: padded to a bucket, replayed from a CUDA graph on a GPU);
otherwise, and for prompt chunks always, the rows become one batch here: one row each, the
decode rows of a group packed (`pipeline.serve.engine.packing`), or decode rows over their
resident rows (`pipeline.serve.engine.resident_rows`, on a CPU), run eagerly.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from pipeline.core.model.transformer import Transformer
from pipeline.serve.engine.decode import CachedBatch, MixedBatch, forward_cached
from pipeline.serve.engine.kv_cache import BlockKVCache
from pipeline.serve.engine.packing import batch_row_slots, packed_decode_batch
from pipeline.serve.engine.resident_rows import ResidentRows
from pipeline.serve.engine.sampling import TokenLogprobs, token_logprobs

if TYPE_CHECKING:
    from pipeline.serve.engine.lora_slots import LoRASlots
    from pipeline.serve.engine.static_decode import StaticDecoder

Rows = Sequence[tuple[Any, int]]  # (the engine's `Request`, its new tokens this step)


def forward_rows(
    model: Transformer,
    cache: BlockKVCache,
    rows: Rows,
    adapters: LoRASlots | None = None,
    decoder: StaticDecoder | None = None,
    pack: bool = True,
    resident: ResidentRows | None = None,
    mixed: int = 0,
) -> tuple[torch.Tensor, list[int], dict[int, list[TokenLogprobs]]]:
    """Run `rows` through the model, writing their keys and values to `cache`. Returns the float
    logits `[ready, vocab]` of the rows whose prompt is done after this step (they sample a
    token), those rows' indices, and the prompt log-probabilities of the rows that ask, by row
    index. Decode rows (each with one token left to run, so every one samples and none has a
    prompt token left to score) go through `decoder` when given; a one-token prompt chunk
    (`prefill_chunk=1`) has more to run, so it never does. `pack`: decode rows of a group may
    be packed into one batch row (`batch_of`); `resident`: decode rows otherwise attend over
    their resident rows, in those rows' order; `mixed`: the first `mixed` rows are decode rows
    and the rest prompt chunks, all run in one pass (`mixed_batch`; see `can_mix`)."""
    if decoder is not None and all(
        r.computed + n == len(r.tokens) == r.computed + 1 for r, n in rows
    ):
        return (
            decoder.logits([request for request, _ in rows], adapters),
            list(range(len(rows))),
            {},
        )
    device = cache.pools[0][0].device
    if mixed:
        batch, where, order = mixed_batch(rows, mixed, resident, cache.scratch_slot, device)
    else:
        batch, where, order = batch_of(rows, cache, device, pack, resident)
    in_batch = rows if order is None else [rows[i] for i in order]
    if adapters is not None:
        adapters.select(
            batch_row_slots(
                [request.lora_slot for request, _ in in_batch], where[0], batch.tokens.shape[0]
            )
        )
    hidden = forward_cached(model, cache, batch)
    logits = model.output(hidden[where]).float()
    ready = [
        i
        for i, (request, new) in enumerate(in_batch)
        if request.computed + new == len(request.tokens)
    ]
    if len(ready) < len(rows):
        logits = logits[ready]
    # (resident and mixed rows never ask for prompt log-probabilities)
    found = {} if order is not None else prompt_logprobs(model, in_batch, hidden)
    if order is not None:
        ready = [order[i] for i in ready]
    return logits, ready, found


def prompt_logprobs(
    model: Transformer, rows: Rows, hidden: torch.Tensor
) -> dict[int, list[TokenLogprobs]]:
    """The log-probabilities of the prompt tokens that this chunk's positions predict, for
    the rows that ask (only their positions are projected to the vocabulary)."""
    found = {}
    for index, (request, new) in enumerate(rows):
        top = request.params.prompt_logprobs
        if top is None:
            continue
        start = request.computed
        targets = request.prompt[start + 1 : start + new + 1]  # position p predicts p + 1
        if not targets:
            continue
        logits = model.output(hidden[index, : len(targets)]).float()
        found[index] = token_logprobs(
            logits.log_softmax(-1), targets, [top] * len(targets), request.params.logprob_ranks
        )
    return found


def batch_of(
    rows: Rows,
    cache: BlockKVCache,
    device: torch.device,
    pack: bool = True,
    resident: ResidentRows | None = None,
) -> tuple[CachedBatch, tuple, list[int] | None]:
    """The batch of `rows`, where each row's last new token is in it, and the order of `rows`
    in it (None: as given): one row each, (with `pack`) decode rows of a group packed
    (`pipeline.serve.engine.packing`), or (with `resident`) decode rows over their resident
    rows (`pipeline.serve.engine.resident_rows`)."""
    decoding = all(n == 1 for _, n in rows) and cache.states is None  # state: per sequence
    if pack and decoding:
        packed = packed_decode_batch(
            [r for r, _ in rows], cache.block_size, cache.scratch_slot, device
        )
        if packed is not None:
            return packed[0], packed[1:], None
    order = None
    if resident is not None and decoding:
        order = resident.arrange([request for request, _ in rows])
    if order is not None:
        batch = resident_batch([rows[i][0] for i in order], resident, device)
        first = torch.zeros(len(rows), dtype=torch.long, device=device)
        return batch, (torch.arange(len(rows), device=device), first), order
    lengths = torch.tensor([n for _, n in rows], device=device)
    return (
        plain_batch(rows, cache.scratch_slot, device, cache.states is not None),
        (torch.arange(len(rows), device=device), lengths - 1),
        None,
    )


def can_mix(decoding: Rows, prefill: Rows, resident: ResidentRows | None, plain: bool) -> bool:
    """Whether a step's decode rows and prompt chunks can run as one pass (`mixed_batch`):
    with resident rows (a CPU engine) that fit, no group's decode rows to pack, no prompt
    asking for its log-probabilities, and `plain` (the model's attention is grouped-query
    attention throughout, and no adapters are served)."""
    if not (plain and decoding and prefill and resident is not None):
        return False
    requests = [request for request, _ in decoding]
    return (
        len({request.group for request in requests}) == len(requests)
        and not any(request.params.prompt_logprobs is not None for request, _ in prefill)
        and resident.fits(requests)
    )


def mixed_batch(
    rows: Rows, decoding: int, resident: ResidentRows, scratch: int, device: torch.device
) -> tuple[MixedBatch, tuple, list[int]]:
    """The first `decoding` rows (decode rows, over their resident rows) and each later one (a
    prompt chunk, a batch of its own) as one row of tokens; where each row's last token is in
    it; the rows' order in it (the resident rows' order, then the chunks')."""
    order = resident.arrange([request for request, _ in rows[:decoding]])  # fits: `can_mix`
    order += range(decoding, len(rows))
    parts = [resident_batch([rows[i][0] for i in order[:decoding]], resident, device)]
    parts += [plain_batch([rows[i]], scratch, device) for i in order[decoding:]]
    chunks = torch.tensor([n for _, n in rows[decoding:]])
    columns = torch.cat([torch.arange(decoding), decoding + chunks.cumsum(0) - 1])
    first = torch.zeros(len(rows), dtype=torch.long, device=device)
    return MixedBatch(parts), (first, columns.to(device)), order


def resident_batch(
    requests: Sequence[Any], resident: ResidentRows, device: torch.device
) -> CachedBatch:
    """One decode token per request, in `resident`'s row order, attending over those rows."""
    tokens = [request.tokens[request.computed] for request in requests]
    positions = [request.computed for request in requests]
    write = torch.stack([request.slots[request.computed] for request in requests])
    return CachedBatch(
        torch.tensor(tokens, device=device)[:, None],
        torch.tensor(positions, device=device)[:, None],
        write.to(device)[:, None],
        None,
        resident=resident,
        key_length=resident.length,
    )


def plain_batch(
    rows: Rows, scratch: int, device: torch.device, states: bool = False
) -> CachedBatch:
    """One batch row per request: its new tokens and its whole history's slots, padded (to
    the longest row) with the cache's `scratch` slot; with `states` (a hybrid model), each
    row's state slot and which of its new tokens are real."""
    new = max(n for _, n in rows)
    length = max(r.computed + n for r, n in rows)
    tokens = torch.zeros(len(rows), new, dtype=torch.long)
    positions = torch.zeros(len(rows), new, dtype=torch.long)
    write = torch.full((len(rows), new), scratch, dtype=torch.long)
    read = torch.full((len(rows), length), scratch, dtype=torch.long)
    for i, (request, n) in enumerate(rows):
        start = request.computed
        tokens[i, :n] = torch.tensor(request.tokens[start : start + n])
        positions[i, :n] = torch.arange(start, start + n)
        every = request.slots[: start + n]
        write[i, :n] = every[start:]
        read[i, : start + n] = every
    to = device
    batch = CachedBatch(tokens.to(to), positions.to(to), write.to(to), read.to(to))
    if states:
        batch.state_slots = torch.tensor([r.state_slot for r, _ in rows], device=to)
        counts = torch.tensor([n for _, n in rows])
        if bool((counts < new).any()):
            batch.valid = (torch.arange(new)[None, :] < counts[:, None]).to(to)
    return batch
