"""GRPO's rewards: verifiable scores of completions, chosen by name in `[grpo] reward_funcs`.

Built in:
- `accuracy`: 1.0 when the completion's final answer equals the prompt's `answer` field, both
  normalised (`normalize_answer`), else 0.0. The final answer is the content of the last
  `\\boxed{...}`, else what follows the last `####`, else the last number (`extract_final_answer`);
- `format`: 1.0 when the whole completion matches `grpo.format_pattern` (`re.fullmatch`);
- `length`: `-(tokens past the target) / max_completion_length`, the target being
  `grpo.length_target` (0: max_completion_length itself).

A user's own function is named "module:function" (or "path/file.py:function"). This is the one
place pipe imports user code, and only when a name asks for it. It is called as TRL's GRPO
trainer calls one: `func(prompts=..., completions=..., completion_ids=..., **fields)`, one entry
per completion; a prompt is handed as written in the file, a completion as its text (or, for a
prompt given as messages, `[{"role": "assistant", "content": text}]`), and each other field of
the prompts' lines as a list. It returns one float per completion, or None for one it cannot
score (NaN here). A function that raises or returns something else is a `RewardError` naming
the prompt's file:line. The weighted sum of the rewards is the objective's to take.

A thinking policy (`grpo.reasoning_parser`, vLLM's names as in `pipe serve --reasoning-parser`)
has each completion split as the server splits a reply: the rewards score the content without
the reasoning (a built-in accuracy does not read a number from the thinking), a user's function
with a `reasoning` parameter (or `**kwargs`) also gets each completion's reasoning (None where
there is none), and the rewards named in `grpo.reasoning_rewards` see the whole completion.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import math
import numbers
import re
import sys
from collections.abc import Callable, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation
from pathlib import Path
from typing import Any

import numpy as np

from pipeline.data.prompt_dataset import PromptRecord
from pipeline.tokenizer.reasoning import ReasoningServing
from pipeline.train.config.schema import ConfigError
from pipeline.train.objectives.grpo.settings import GRPOSection

__all__ = [
    "BUILTIN_REWARDS",
    "RewardError",
    "RewardSet",
    "answer_matches",
    "build_rewards",
    "extract_final_answer",
    "normalize_answer",
]

BUILTIN_REWARDS = ("accuracy", "format", "length")

_BOXED = re.compile(r"\\boxed\s*\{")
_HASHES = re.compile(r"####[ \t]*([^\n]*)")
# A number: digits grouped by commas ("1,000") or not, a decimal part, a sign not glued to a
# preceding word or number ("5-3" holds 5 and 3, not -3).
_NUMBER = re.compile(r"(?:(?<![\w.])[-+])?(?:\d{1,3}(?:,\d{3})+(?!\d)|\d+)(?:\.\d+)?|(?<!\d)\.\d+")
_PLAIN_NUMBER = re.compile(r"[-+]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d*)?|[-+]?\.\d+")
_TEXT_WRAPPER = re.compile(r"\\(?:text|textbf|mathrm|mbox)\s*\{([^{}]*)\}")


class RewardError(ValueError):
    """A reward that cannot score a completion; the message is one line naming the prompt's
    file:line and the reward."""


# ------------------------------------------------------------------------------ answers


def extract_final_answer(text: str) -> str | None:
    """The final answer of a completion: the content of the last `\\boxed{...}` whose braces
    balance, else the rest of the line after the last `####`, else the last number; None when
    there is none."""
    boxed = _last_boxed(text)
    if boxed is not None:
        return boxed
    marked = [m.group(1).strip() for m in _HASHES.finditer(text)]
    if marked and marked[-1]:
        return marked[-1]
    numbers_ = _NUMBER.findall(text)
    return numbers_[-1] if numbers_ else None


def _last_boxed(text: str) -> str | None:
    for match in reversed(list(_BOXED.finditer(text))):
        depth, start = 1, match.end()
        for i in range(start, len(text)):
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            if depth == 0:
                return text[start:i].strip()
    return None


def normalize_answer(answer: str) -> str:
    """An answer in a canonical form for comparison: `\\text{}`-style wrappers, `$` and a
    trailing period dropped; a number written canonically ("+1,000.50" -> "1000.5",
    "3.0" -> "3"); anything else lowercased with its spaces collapsed."""
    text = str(answer)
    while True:
        unwrapped = _TEXT_WRAPPER.sub(r"\1", text)
        if unwrapped == text:
            break
        text = unwrapped
    text = text.replace("$", "").strip().rstrip(".").strip()
    if _PLAIN_NUMBER.fullmatch(text):
        try:
            number = Decimal(text.replace(",", ""))
        except InvalidOperation:  # pragma: no cover - the pattern admits only numbers
            return text
        return "0" if number == 0 else format(number.normalize(), "f")
    return " ".join(text.lower().split())


def answer_matches(completion: str, answer: Any) -> bool:
    """Whether the final answer of `completion` equals `answer` after normalisation."""
    found = extract_final_answer(completion)
    return found is not None and normalize_answer(found) == normalize_answer(str(answer))


# ------------------------------------------------------------------------------ the rewards


@dataclass(frozen=True)
class Completions:
    """The completions one scoring pass sees: completion i answers `records[i]`."""

    records: Sequence[PromptRecord]
    texts: Sequence[str]
    tokens: Sequence[Sequence[int]]
    reasoning: Sequence[str | None] | None = None  # with grpo.reasoning_parser: each one's
    messages: Sequence[list[dict]] | None = None
    """With tools: each completion as its messages (assistant turns and tool results)."""
    environments: Sequence[Any] | None = None
    """With an environment: each completion's instance."""


Reward = Callable[[Completions], list]


@dataclass
class RewardSet:
    """The rewards of a run: their names (as `grpo.reward_funcs` spells them), weights, and the
    functions that score them."""

    names: list[str]
    weights: list[float]
    funcs: list[Reward]
    reasoning: Any = None  # grpo.reasoning_parser's ReasoningServing (None: no split)
    whole_rewards: frozenset[str] = frozenset()  # grpo.reasoning_rewards

    def score(
        self,
        records: Sequence[PromptRecord],
        completions: Sequence[str],
        completion_tokens: Sequence[Sequence[int]],
        messages: Sequence[list[dict]] | None = None,
        environments: Sequence[Any] | None = None,
    ) -> np.ndarray:
        """`[N, F]` float64 rewards of N completions (completion i answers `records[i]`) by each
        of the F rewards; NaN where a function returned None. Raises RewardError (one line).
        With tools, `messages` are the completions as messages (what a user's function gets,
        as TRL hands them) and `environments` each one's environment instance."""
        if not len(records) == len(completions) == len(completion_tokens):
            raise ValueError(
                f"{len(records)} prompts, {len(completions)} completions and "
                f"{len(completion_tokens)} token lists: one each per completion"
            )
        whole = Completions(
            records, completions, completion_tokens, messages=messages, environments=environments
        )
        batch = whole
        if self.reasoning is not None:
            splits = [
                self.reasoning.reader(None).whole(text, list(ids))
                for text, ids in zip(completions, completion_tokens)
            ]
            batch = dataclasses.replace(
                whole, texts=[c for _, c in splits], reasoning=[r for r, _ in splits]
            )
        out = np.empty((len(records), len(self.funcs)), dtype=np.float64)
        for column, (name, func) in enumerate(zip(self.names, self.funcs)):
            seen = whole if name in self.whole_rewards else batch
            out[:, column] = _checked(name, func(seen), records)
        return out


def build_rewards(
    section: GRPOSection,
    has_answers: bool,
    encode_batch: Callable[[list[str]], list[list[int]]] | None = None,
    environment: type | None = None,
    decode: Callable[[list[int]], str] | None = None,
) -> RewardSet:
    """The rewards `section` names (none named: accuracy when the prompts have an `answer`),
    with their weights; a ConfigError (one line naming the field) for an unknown name, a user
    function that cannot be imported, a bad format pattern or weights that do not fit.
    `has_answers`: whether the prompts carry an `answer` field; `encode_batch`: the tokenizer's,
    which `grpo.reasoning_parser` finds its markers with (and `decode`, which gpt-oss's harmony
    parser reads message bodies with). An `environment` class with a
    `get_reward` method adds its reward, named after the class, weight 1 (as TRL)."""
    names = list(section.reward_funcs)
    if environment is not None and callable(getattr(environment, "get_reward", None)):
        own = _environment_reward(environment.__name__)
        if not (names or has_answers):
            return RewardSet([environment.__name__], [1.0], [own])
        rewards = build_rewards(section, has_answers, encode_batch, decode=decode)
        rewards.names.append(environment.__name__)
        rewards.weights.append(1.0)
        rewards.funcs.append(own)
        return rewards
    if not names:
        if not has_answers:
            raise ConfigError(
                "grpo.reward_funcs is empty and the prompts have no 'answer' field: name the "
                f"rewards in [grpo] reward_funcs ({', '.join(BUILTIN_REWARDS)} or module:function)"
            )
        names = ["accuracy"]
    repeated = next((n for i, n in enumerate(names) if n in names[:i]), None)
    if repeated is not None:
        raise ConfigError(f"grpo.reward_funcs names {repeated!r} twice")
    if "accuracy" in names and not has_answers:
        raise ConfigError(
            "grpo.reward_funcs: accuracy compares with the prompts' 'answer' field, "
            "and the prompts have none"
        )
    rewards = RewardSet(names, _weights(section, names), [_reward(section, n) for n in names])
    rewards.reasoning = _reasoning(section, names, encode_batch, decode)
    rewards.whole_rewards = frozenset(section.reasoning_rewards)
    return rewards


def _reasoning(section: GRPOSection, names: list[str], encode_batch, decode=None) -> Any:
    """grpo.reasoning_parser's splitter (None when unset); a ConfigError naming the field."""
    unknown = [n for n in section.reasoning_rewards if n not in names]
    if unknown:
        raise ConfigError(f"grpo.reasoning_rewards names {unknown[0]!r}, not in reward_funcs")
    if not section.reasoning_parser:
        if section.reasoning_rewards:
            raise ConfigError("grpo.reasoning_rewards needs grpo.reasoning_parser")
        return None
    if encode_batch is None:
        raise ConfigError("grpo.reasoning_parser needs the data's tokenizer")
    try:
        encode = lambda text: encode_batch([text])[0]  # noqa: E731
        return ReasoningServing.of(section.reasoning_parser, encode, decode)
    except ValueError as e:
        message = str(e).replace("--reasoning-parser ", "")
        raise ConfigError(f"grpo.reasoning_parser: {message}") from None


def _weights(section: GRPOSection, names: list[str]) -> list[float]:
    weights = [float(w) for w in section.reward_weights] or [1.0] * len(names)
    if len(weights) != len(names):
        raise ConfigError(
            f"grpo.reward_weights has {len(weights)} weights for {len(names)} rewards "
            f"({', '.join(names)})"
        )
    if not all(math.isfinite(w) for w in weights):
        raise ConfigError(f"grpo.reward_weights {weights}: each weight must be a finite number")
    return weights


def _reward(section: GRPOSection, name: str) -> Reward:
    if name == "accuracy":
        return _accuracy
    if name == "format":
        return _format_reward(section.format_pattern)
    if name == "length":
        return _length_reward(section.length_target, section.max_completion_length)
    if ":" not in name:
        raise ConfigError(
            f"grpo.reward_funcs: unknown reward {name!r} (built in: "
            f"{', '.join(BUILTIN_REWARDS)}; or a function of yours as module:function)"
        )
    return _user_reward(name, import_function(name))


def _accuracy(batch: Completions) -> list[float]:
    scores = []
    for record, text in zip(batch.records, batch.texts):
        answer = record.fields.get("answer")
        if answer is None:
            raise RewardError(f"{record.source}: reward accuracy: the prompt has no 'answer'")
        scores.append(1.0 if answer_matches(text, answer) else 0.0)
    return scores


def _format_reward(pattern: str) -> Reward:
    try:
        compiled = re.compile(pattern)
    except re.error as e:
        raise ConfigError(
            f"grpo.format_pattern {pattern!r}: not a regular expression ({e})"
        ) from None

    def format_reward(batch: Completions) -> list[float]:
        return [1.0 if compiled.fullmatch(text) else 0.0 for text in batch.texts]

    return format_reward


def _length_reward(length_target: int, max_completion_length: int) -> Reward:
    if length_target < 0:
        raise ConfigError(f"grpo.length_target {length_target}: must be >= 0 (0: the limit)")
    target = length_target or max_completion_length

    def length_reward(batch: Completions) -> list[float]:
        return [-max(0, len(ids) - target) / max_completion_length for ids in batch.tokens]

    return length_reward


# ------------------------------------------------------------------------------ user functions


def import_function(name: str, field: str = "grpo.reward_funcs") -> Callable:
    """The function (or class) "module:function" (or "file.py:function") names, imported now;
    a dotted function name walks attributes. A ConfigError naming it and `field` when it cannot
    be had."""
    module_name, _, attribute = name.rpartition(":")
    try:
        with _cwd_on_path():
            if module_name.endswith(".py"):
                module = _module_from_file(Path(module_name))
            else:
                module = importlib.import_module(module_name)
        func: Any = module
        for part in attribute.split("."):
            func = getattr(func, part)
    except Exception as e:  # noqa: BLE001 - whatever importing user code raises is its error
        message = " ".join(str(e).split())
        raise ConfigError(
            f"{field}: cannot import {name!r} ({type(e).__name__}: {message})"
        ) from None
    if not callable(func):
        raise ConfigError(f"{field}: {name!r} is {type(func).__name__}, not a function")
    return func


def _module_from_file(path: Path) -> Any:
    if not path.is_file():
        raise FileNotFoundError(f"no file {path}")
    spec = importlib.util.spec_from_file_location(f"pipe_rewards_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@contextmanager
def _cwd_on_path():
    """The working directory on sys.path while importing, so a module beside the user's config
    is found as `python -c` would find it (`pipe` is a console script, whose path lacks it)."""
    added = "" not in sys.path and str(Path.cwd()) not in sys.path
    if added:
        sys.path.append(str(Path.cwd()))
    try:
        yield
    finally:
        if added:
            sys.path.remove(str(Path.cwd()))


def _environment_reward(name: str) -> Reward:
    """The reward of an environment class `name`: each completion's instance's `get_reward()`."""

    def environment_reward(batch: Completions) -> list:
        try:
            return [e.get_reward() for e in batch.environments]
        except Exception as e:  # noqa: BLE001 - the user's environment's own failure
            message = " ".join(str(e).split())
            raise RewardError(
                f"{_first_source(batch.records)}: reward {name}.get_reward raised "
                f"{type(e).__name__}: {message}"
            ) from None

    return environment_reward


def _user_reward(name: str, func: Callable) -> Reward:
    def user_reward(batch: Completions) -> list:
        prompts = [r.prompt for r in batch.records]
        completions = [
            [{"role": "assistant", "content": t}] if isinstance(p, list) else t
            for p, t in zip(prompts, batch.texts)
        ]
        if batch.messages is not None:
            completions = [list(m) for m in batch.messages]
        keys = list(dict.fromkeys(k for r in batch.records for k in r.fields))
        fields = {k: [r.fields.get(k) for r in batch.records] for k in keys}
        if batch.environments is not None:
            fields["environments"] = list(batch.environments)
        ids = [list(t) for t in batch.tokens]
        if batch.reasoning is not None and _takes(func, "reasoning"):
            fields["reasoning"] = list(batch.reasoning)
        try:
            return func(prompts=prompts, completions=completions, completion_ids=ids, **fields)
        except Exception as e:  # noqa: BLE001 - a user's function's own failure, named as such
            message = " ".join(str(e).split())
            raise RewardError(
                f"{_first_source(batch.records)}: reward {name} raised "
                f"{type(e).__name__}: {message}"
            ) from None

    return user_reward


def _takes(func: Callable, name: str) -> bool:
    """Whether `func` has a parameter `name` (a `**kwargs` takes it too)."""
    import inspect

    try:
        parameters = inspect.signature(func).parameters.values()
    except (TypeError, ValueError):
        return False
    return any(p.name == name or p.kind is p.VAR_KEYWORD for p in parameters)


def _first_source(records: Sequence[PromptRecord]) -> str:
    return records[0].source if records else "(no prompt)"


def _checked(name: str, scores: Any, records: Sequence[PromptRecord]) -> list[float]:
    """`scores` as floats (None: NaN); a RewardError unless one number or None per completion."""
    if not isinstance(scores, (list, tuple, np.ndarray)):
        raise RewardError(
            f"{_first_source(records)}: reward {name} returned {type(scores).__name__}, "
            "not a list with one reward per completion"
        )
    if len(scores) != len(records):
        raise RewardError(
            f"{_first_source(records)}: reward {name} returned {len(scores)} rewards for "
            f"{len(records)} completions"
        )
    out = []
    for record, score in zip(records, scores):
        if score is not None and not isinstance(score, numbers.Real):
            raise RewardError(
                f"{record.source}: reward {name} returned {score!r} ({type(score).__name__}), "
                "not a number or None"
            )
        out.append(math.nan if score is None else float(score))
    return out
