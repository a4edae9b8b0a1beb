"""Choosing the next token: greedy, or temperature / top-k / top-p sampling from a request's own
random generator, so a seed gives the same text whatever else shares the batch.

Before the choice, a request may adjust its logits (its constraints: allowed token ids, bad words,
stop tokens masked before `min_tokens`; then logit bias, repetition, frequency and presence
penalties, in vLLM's order) and ask for log-probabilities (the model's raw log-softmax,
before any adjustment or temperature, as vLLM reports them by default). `choose` does both for a
batch of rows, touching only the rows that ask, so plain requests take the plain path."""

from __future__ import annotations

import functools
import math
import operator
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import torch

from pipeline.core.model.greedy import first_argmax, greedy_token

if TYPE_CHECKING:
    from pipeline.serve.engine.structured_output import StructuredOutput


class BadSamplingValue(ValueError):
    """A sampling parameter out of range (the message names it)."""


MAX_LOGPROBS = 20  # OpenAI's bound on the alternatives reported per token
MAX_PENALTY = 2.0  # OpenAI's bound on presence and frequency penalties (either sign)
MAX_BIAS = 100.0  # OpenAI's bound on a logit bias (either sign)


@dataclass(frozen=True)
class TokenLogprobs:
    """A token's log-probability under the model and the `top` most likely tokens at its
    position, best first, as (token id, log-probability) pairs; `rank`: how many tokens are at
    least as likely as it (1: the best), as vLLM reports it."""

    token_logprob: float
    top: tuple[tuple[int, float], ...] = ()
    rank: int | None = None


@dataclass(frozen=True)
class SamplingParams:
    """How one request generates. temperature 0 (or `greedy`) takes the most likely token;
    top_k 0 and top_p 1 keep every token; `seed` None draws a fresh seed; generation stops after
    `max_new_tokens`, at a token of `stop_token_ids` (EOS) or at any of the `stop` strings.

    Penalties (OpenAI's and vLLM's meaning): `frequency_penalty` x count + `presence_penalty` x
    (count > 0) is taken from a token's logit, count being how often the request has generated
    it; `repetition_penalty` divides a positive logit (multiplies a negative one) of every token
    seen in the prompt or output. `logit_bias`: (token id, bias) pairs added to the logits (a
    mapping is accepted and stored as pairs). `logprobs` / `prompt_logprobs`: report each
    generated / prompt token's log-probability and that many most likely alternatives.
    `structured_output`: the output held to a JSON schema, regex, choice or grammar
    (`pipeline.serve.engine.structured_output`).

    vLLM's constraints: `min_p` drops tokens less likely than min_p x the best one (after the
    temperature); `min_tokens` masks the stop tokens until that many are generated (stop strings
    are looked for after it too); `allowed_token_ids` (None: all) masks every other token;
    `bad_words` (token id sequences) masks a sequence's last token wherever the output ends with
    the rest of it. The text: `skip_special_tokens` leaves special tokens out of it,
    `include_stop_str_in_output` keeps the stop string (or a stop token's text) in it."""

    max_new_tokens: int = 16
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    greedy: bool = False
    stop: tuple[str, ...] = ()
    stop_token_ids: frozenset[int] = field(default_factory=frozenset)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    structured_output: StructuredOutput | None = None
    min_p: float = 0.0
    min_tokens: int = 0
    allowed_token_ids: tuple[int, ...] | None = None
    bad_words: tuple[tuple[int, ...], ...] = ()
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    cache_salt: str | None = None  # the prefix cache shares blocks only within one salt
    logprob_ranks: bool = False  # prompt logprobs carry each token's rank (vLLM's object)

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise BadSamplingValue(f"max_new_tokens must be at least 1, not {self.max_new_tokens}")
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise BadSamplingValue(f"temperature must be >= 0, not {self.temperature}")
        if self.top_k < 0:
            raise BadSamplingValue(f"top_k must be >= 0 (0: off), not {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise BadSamplingValue(f"top_p must be in (0, 1], not {self.top_p}")
        if self.seed is not None and not 0 <= self.seed < 2**63:
            raise BadSamplingValue(f"seed must be in [0, 2**63), not {self.seed}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not (math.isfinite(value) and -MAX_PENALTY <= value <= MAX_PENALTY):
                raise BadSamplingValue(f"{name} must be in [-2, 2], not {value}")
        if not (math.isfinite(self.repetition_penalty) and self.repetition_penalty > 0):
            raise BadSamplingValue(f"repetition_penalty must be > 0, not {self.repetition_penalty}")
        object.__setattr__(self, "logit_bias", _bias_pairs(self.logit_bias))
        for name in ("logprobs", "prompt_logprobs"):
            _check_count(name, getattr(self, name))
        if not 0 <= self.min_p <= 1:
            raise BadSamplingValue(f"min_p must be in [0, 1], not {self.min_p}")
        if not 0 <= self.min_tokens <= self.max_new_tokens:
            raise BadSamplingValue(
                f"min_tokens must be in [0, max_tokens ({self.max_new_tokens})], "
                f"not {self.min_tokens}"
            )
        if self.allowed_token_ids is not None and (
            not self.allowed_token_ids or min(self.allowed_token_ids) < 0
        ):
            raise BadSamplingValue("allowed_token_ids must be a non-empty list of token ids")
        if any(not word for word in self.bad_words):
            raise BadSamplingValue("bad_words: a bad word has no tokens")

    @property
    def is_greedy(self) -> bool:
        return self.greedy or self.temperature == 0

    @functools.cached_property  # read for every row of every step
    def adjusts_logits(self) -> bool:
        """Whether a bias or penalty changes the logits before the choice."""
        return bool(
            self.constrains
            or self.logit_bias
            or self.presence_penalty
            or self.frequency_penalty
            or self.repetition_penalty != 1
        )

    @functools.cached_property
    def constrains(self) -> bool:
        """Whether vLLM's token constraints (min_tokens, allowed ids, bad words) mask logits."""
        return bool(self.min_tokens or self.allowed_token_ids is not None or self.bad_words)


def _bias_pairs(bias: Mapping[int, float] | Sequence[tuple[int, float]]) -> tuple:
    """`logit_bias` as checked (token id, bias) pairs: ids >= 0 and distinct, bias in range."""
    pairs = bias.items() if isinstance(bias, Mapping) else bias
    out, seen = [], set()
    for pair in pairs:
        try:
            token, value = pair
            token, value = operator.index(token), float(value)
        except (TypeError, ValueError):
            raise BadSamplingValue(
                f"logit_bias maps integer token ids to numbers, not {pair!r}"
            ) from None
        if token < 0 or token in seen:
            raise BadSamplingValue(f"logit_bias token ids must be distinct and >= 0, not {token}")
        if not (math.isfinite(value) and -MAX_BIAS <= value <= MAX_BIAS):
            raise BadSamplingValue(
                f"logit_bias of token {token} must be in [-100, 100], not {value}"
            )
        seen.add(token)
        out.append((token, value))
    return tuple(out)


def _check_count(name: str, value: int | None) -> None:
    """`logprobs` and `prompt_logprobs`: None (off) or an int in [0, MAX_LOGPROBS]."""
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_LOGPROBS:
        raise BadSamplingValue(f"{name} must be None or an integer in [0, 20], not {value!r}")


def make_generator(params: SamplingParams, device: torch.device) -> torch.Generator | None:
    """The request's generator (None for greedy): seeded by `params.seed` or freshly."""
    if params.is_greedy:
        return None
    generator = torch.Generator(device=device)
    if params.seed is None:
        generator.seed()
    else:
        generator.manual_seed(params.seed)
    return generator


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """The next token from one row of logits `[vocab]`."""
    if params.is_greedy:
        return greedy_token(logits)
    logits = logits.float() / params.temperature
    if params.min_p > 0:
        probs = logits.softmax(-1)
        logits = logits.masked_fill(probs < params.min_p * probs.max(), -math.inf)
    if 0 < params.top_k < logits.numel():
        threshold = torch.topk(logits, params.top_k).values[-1]
        logits = logits.masked_fill(logits < threshold, -math.inf)
    if params.top_p < 1:
        ordered, order = logits.sort(descending=True)
        before = ordered.softmax(-1).cumsum(-1) - ordered.softmax(-1)  # mass of better tokens
        drop = torch.zeros_like(logits, dtype=torch.bool)
        drop[order] = before >= params.top_p  # the best token always stays
        logits = logits.masked_fill(drop, -math.inf)
    return draw(logits.softmax(-1), generator)


def draw(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    """A token of `probs` `[vocab]` by inverse transform: one uniform number from the request's
    own `generator` (a seeded request's tokens do not depend on its batch), the first token
    whose cumulative probability exceeds it. Over 10x faster than `torch.multinomial` on a CPU,
    which draws a number per vocabulary entry."""
    return draw_rows(probs[None], [generator])[0]


class Row(Protocol):
    """What `choose` reads of a request (the engine's `Request` is one)."""

    params: SamplingParams
    prompt: list[int]
    output: list[int]
    generator: torch.Generator | None


def choose(logits: torch.Tensor, rows: Sequence[Row]) -> list[tuple[int, TokenLogprobs | None]]:
    """The next token of each row of `logits` `[rows, vocab]` (modified in place), with its
    log-probabilities for rows that ask. Only rows whose parameters adjust the logits or want
    log-probabilities pay for it; the others are sampled from their logits as they are."""
    asking = [i for i, row in enumerate(rows) if row.params.logprobs is not None]
    raw = logits[asking].log_softmax(-1) if asking else None  # before any adjustment
    adjusting = [i for i, row in enumerate(rows) if row.params.adjusts_logits]
    if adjusting:
        logits[adjusting] = adjust_logits(logits[adjusting], [rows[i] for i in adjusting])
    tokens = _sample_rows(logits, rows)
    chosen: list[TokenLogprobs | None] = [None] * len(rows)
    if raw is not None:
        found = token_logprobs(
            raw, [tokens[i] for i in asking], [rows[i].params.logprobs for i in asking]
        )
        for i, logprobs in zip(asking, found):
            chosen[i] = logprobs
    return list(zip(tokens, chosen))


def _sample_rows(logits: torch.Tensor, rows: Sequence[Row]) -> list[int]:
    """Each row's token (`sample`); the greedy rows in one go, and the rows sampled at their
    temperature alone (no top-k or top-p: an RL rollout's) in one go, each still from its own
    generator."""
    plain = [i for i, row in enumerate(rows) if _plain(row.params, logits.shape[-1])]
    plain = plain if len(plain) > 1 else []
    tokens = [0] * len(rows)
    greedy = [i for i, row in enumerate(rows) if row.params.is_greedy]
    greedy = greedy if len(greedy) > 1 else []
    if greedy:  # one argmax and one read back for all (the first on a tie, as `greedy_token`)
        chosen = logits if len(greedy) == len(rows) else logits[greedy]  # no copy when all are
        for i, token in zip(greedy, first_argmax(chosen).tolist()):
            tokens[i] = token
    if plain:
        temperatures = torch.tensor(
            [rows[i].params.temperature for i in plain], device=logits.device
        )
        probs = (logits[plain].float() / temperatures[:, None]).softmax(-1)
        drawn = draw_rows(probs, [rows[i].generator for i in plain])
        for i, token in zip(plain, drawn):
            tokens[i] = token
    done = set(plain) | set(greedy)
    for i, row in enumerate(rows):
        if i not in done:
            tokens[i] = sample(logits[i], row.params, row.generator)
    return tokens


def _plain(params: SamplingParams, vocab: int) -> bool:
    return (
        not params.is_greedy
        and not 0 < params.top_k < vocab
        and params.top_p >= 1
        and not params.min_p
    )


def draw_rows(probs: torch.Tensor, generators: Sequence[torch.Generator | None]) -> list[int]:
    """`draw` for each row of `probs` `[rows, vocab]`, row i from `generators[i]`."""
    cumulative = probs.cumsum(-1)
    points = torch.cat([torch.rand(1, generator=g, device=probs.device) for g in generators])
    points = points * cumulative[:, -1]
    tokens = torch.searchsorted(cumulative, points[:, None], right=True)[:, 0].tolist()
    for i, token in enumerate(tokens):
        if token >= probs.shape[-1]:  # the point rounded up to the total
            tokens[i] = int(probs[i].nonzero()[-1])
    return tokens


def adjust_logits(logits: torch.Tensor, rows: Sequence[Row]) -> torch.Tensor:
    """`logits` `[rows, vocab]` (float) after each row's constraints (`constrained`), logit
    bias, repetition penalty, then frequency and presence penalties (vLLM's order)."""
    for i, row in enumerate(rows):
        if row.params.constrains:
            logits[i] = constrained(logits[i], row)
    logits = _add_bias(logits, [row.params.logit_bias for row in rows])
    penalties = [row.params.repetition_penalty for row in rows]
    if any(p != 1 for p in penalties):
        seen = _token_counts([row.prompt + row.output for row in rows], logits) > 0
        logits = repetition_penalized(logits, seen, penalties)
    frequency = [row.params.frequency_penalty for row in rows]
    presence = [row.params.presence_penalty for row in rows]
    if any(frequency) or any(presence):
        counts = _token_counts([row.output for row in rows], logits)
        logits = count_penalized(logits, counts, frequency, presence)
    return logits


def constrained(logits: torch.Tensor, row: Row) -> torch.Tensor:
    """One row's logits `[vocab]` with the tokens its constraints rule out at -inf: all but
    `allowed_token_ids`; each bad word's last token where the output ends with the rest of the
    word (a one-token word: always); the stop tokens while fewer than `min_tokens` are out."""
    params, banned = row.params, []
    if params.allowed_token_ids is not None:
        keep = torch.full_like(logits, -math.inf)
        allowed = torch.tensor(params.allowed_token_ids, device=logits.device)
        logits = keep.index_copy(0, allowed, logits[allowed])
    for word in params.bad_words:
        head = list(word[:-1])
        if not head or (len(row.output) >= len(head) and row.output[-len(head) :] == head):
            banned.append(word[-1])
    if len(row.output) < params.min_tokens:
        banned += params.stop_token_ids
    if banned:
        logits = logits.index_fill(0, torch.tensor(banned, device=logits.device), -math.inf)
    return logits


def repetition_penalized(
    logits: torch.Tensor, seen: torch.Tensor, penalties: Sequence[float]
) -> torch.Tensor:
    """A seen token's logit divided by its row's penalty when positive, else multiplied by it
    (transformers' `RepetitionPenaltyLogitsProcessor`, per row)."""
    penalty = _column(penalties, logits)
    penalized = torch.where(logits < 0, logits * penalty, logits / penalty)
    return torch.where(seen, penalized, logits)


def count_penalized(
    logits: torch.Tensor,
    counts: torch.Tensor,
    frequency: Sequence[float],
    presence: Sequence[float],
) -> torch.Tensor:
    """logits - frequency x count - presence x (count > 0), per row (OpenAI's penalties)."""
    return logits - _column(frequency, logits) * counts - _column(presence, logits) * (counts > 0)


def _column(values: Sequence[float], like: torch.Tensor) -> torch.Tensor:
    """One value per row, `[rows, 1]`, to broadcast over the vocabulary."""
    return torch.tensor(values, dtype=like.dtype, device=like.device)[:, None]


def _add_bias(
    logits: torch.Tensor, biases: Sequence[tuple[tuple[int, float], ...]]
) -> torch.Tensor:
    rows = [i for i, bias in enumerate(biases) for _ in bias]
    if not rows:
        return logits
    ids = [token for bias in biases for token, _ in bias]
    values = [value for bias in biases for _, value in bias]
    to = {"device": logits.device}
    index = (torch.tensor(rows, **to), torch.tensor(ids, **to))
    return logits.index_put(index, torch.tensor(values, dtype=logits.dtype, **to), accumulate=True)


def _token_counts(sequences: Sequence[list[int]], like: torch.Tensor) -> torch.Tensor:
    """`[rows, vocab]` (like `like`): how often each token occurs in each row's sequence."""
    counts = torch.zeros_like(like)
    rows = [i for i, tokens in enumerate(sequences) for _ in tokens]
    if rows:
        index = (
            torch.tensor(rows, device=like.device),
            torch.tensor([t for tokens in sequences for t in tokens], device=like.device),
        )
        counts.index_put_(index, torch.ones(len(rows), dtype=like.dtype, device=like.device), True)
    return counts


def token_logprobs(
    logprobs: torch.Tensor, tokens: Sequence[int], tops: Sequence[int], ranks: bool = False
) -> list[TokenLogprobs]:
    """For each row of `logprobs` `[rows, vocab]`: `tokens[i]`'s log-probability and the
    `tops[i]` most likely tokens (read back to the host in one go); with `ranks`, its rank too
    (a pass over the vocabulary: over twice a log-softmax's time on a CPU, so only on ask)."""
    index = torch.tensor(tokens, device=logprobs.device)[:, None]
    chosen = logprobs.gather(1, index)
    ranks = (logprobs >= chosen).sum(-1).tolist() if ranks else [None] * len(tokens)
    chosen = chosen[:, 0].tolist()
    width = min(max(tops, default=0), logprobs.shape[-1])
    if width == 0:
        return [TokenLogprobs(value, rank=rank) for value, rank in zip(chosen, ranks)]
    values, ids = logprobs.topk(width, dim=-1)
    values, ids = values.tolist(), ids.tolist()
    return [
        TokenLogprobs(value, tuple(zip(ids[i][:top], values[i][:top])), ranks[i])
        for i, (value, top) in enumerate(zip(chosen, tops))
    ]
