"""GRPO rollouts that call tools over several turns (TRL's `_tool_call_loop`, on pipe's engine).

A rollout's prompt is rendered with the tools' schemas (and, with an environment, the text its
`reset` returned appended to the last user turn). The engine generates a turn; pipe's tool-call
parser for the chat template (`pipeline.serve.http.tool_parsers`: hermes, llama3_json or
pythonic) reads the calls in it; each call runs (`tools.ToolBox`: a time limit, an exception
becomes the tool message's text); the tool messages are rendered through the chat template
after the turn, as tokens appended to the token ids so far (never re-tokenizing what the model
wrote: the suffix is what the template adds after an assistant turn with tool calls, found as
TRL finds it, from a dummy conversation); and the engine generates the next turn from the whole
sequence, its prefix cache holding the earlier turns' full blocks. This goes on until a turn
calls no tool, `max_tool_calling_iterations` rounds of calls have run, or the tool messages
would not fit in `max_completion_length` (they are dropped and the rollout ends as it is).

The whole trajectory, turns and tool messages, is one completion: one reward, one advantage.
The tool messages' tokens are not the model's: `tool_mask` is 0 on them, and the loss leaves
them out.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from pipeline.train.objectives.grpo.rollout import Rollouts, completion_seed
from pipeline.train.objectives.grpo.tools import ToolBox

__all__ = ["AgentRollouts", "Agent", "choose_parser", "tool_suffix"]

Generate = Callable[[Sequence[list[int]], Sequence[Sequence[Any]]], Rollouts]


def choose_parser(name: str, template_source: str) -> Any:
    """The tool-call parser `grpo.tool_call_parser` names, or for "auto" the one the chat
    template's text shows (hermes `<tool_call>`, llama3_json `<|python_tag|>`); a ValueError
    (one line) when none can be told."""
    from pipeline.serve.http.tool_parsers import TOOL_PARSERS

    if name == "auto":
        if "<tool_call>" in template_source:
            name = "hermes"
        elif "<|python_tag|>" in template_source or "ipython" in template_source:
            name = "llama3_json"
        else:
            raise ValueError(
                "grpo.tool_call_parser auto: the chat template shows no known tool-call format; "
                f"set one of {', '.join(TOOL_PARSERS)}"
            )
    if name not in TOOL_PARSERS:
        raise ValueError(f"grpo.tool_call_parser {name!r}: one of auto, {', '.join(TOOL_PARSERS)}")
    return TOOL_PARSERS[name]()


def tool_suffix(template: Any, tokenizer: Any, tool_messages: list[dict], eos_ids: set) -> list:
    """The token ids the chat template puts after an assistant turn with tool calls for
    `tool_messages`, up to the next assistant turn opened: the template rendered on a dummy
    conversation without and with them, the first cut after its last end-of-sequence token,
    the difference taken in tokens (TRL's `_get_tool_suffix_ids`)."""
    call = {"type": "function", "function": {"name": tool_messages[0]["name"], "arguments": {}}}
    dummy = [
        {"role": "user", "content": "dummy"},
        {"role": "assistant", "content": "", "tool_calls": [call]},
    ]
    prefix_text = template.render(dummy).text
    full_text = template.render(dummy + tool_messages, add_generation_prompt=True).text
    prefix, full = tokenizer.encode_batch([prefix_text, full_text])
    ends = [i for i, token in enumerate(prefix) if token in eos_ids]
    if ends:
        prefix = prefix[: ends[-1] + 1]
    if full[: len(prefix)] != prefix:
        raise ValueError(
            "the chat template renders an assistant turn with tool calls differently once tool "
            "messages follow it: multi-turn rollouts need a prefix-preserving template"
        )
    return list(full[len(prefix) :])


@dataclass
class _Row:
    """One rollout in progress."""

    prompt: list[int]
    params: Any
    box: ToolBox
    completion: list[int] = field(default_factory=list)
    tool_mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    messages: list[dict] = field(default_factory=list)
    truncated: bool = False
    calls: int = 0
    failures: int = 0
    last_text: str = ""
    pending: list = field(default_factory=list)  # the last turn's calls


@dataclass
class AgentRollouts:
    """The rollouts with their tool calls: `rollouts` (completions with `tool_masks`), each
    completion's last assistant turn's text (what the built-in rewards read), its messages,
    and how many tool calls it made and how many failed."""

    rollouts: Rollouts
    texts: list[str]
    messages: list[list[dict]]
    calls: list[int]
    failures: list[int]
    environments: list[Any] | None = None


class Agent:
    """Runs multi-turn rollouts (module docstring) through `generate` (the rollout source's,
    split over a tensor-parallel group as a single turn's is)."""

    def __init__(
        self,
        *,
        parser: Any,
        template: Any,
        tokenizer: Any,
        stop_ids: frozenset[int],
        max_completion_length: int,
        max_iterations: int | None,
        timeout: float,
    ) -> None:
        self.parser, self.template, self.tokenizer = parser, template, tokenizer
        self.stop_ids, self.max_length = stop_ids, max_completion_length
        self.max_iterations, self.timeout = max_iterations, timeout

    def run(
        self,
        generate: Generate,
        prompts: Sequence[list[int]],
        params: Sequence[Any],
        boxes: Sequence[ToolBox],
    ) -> AgentRollouts:
        """The rollouts of `prompts[i]` sampled with `params[i]` calling the tools of
        `boxes[i]`, one each, in order; consecutive equal prompts share their prefill."""
        rows = [_Row(list(p), each, box) for p, each, box in zip(prompts, params, boxes)]
        first = self._first_turn(generate, rows)
        seconds, computed = first.seconds, first.prompt_tokens_computed
        cached = first.prompt_tokens_cached
        active = [row for row in rows if row.pending]
        rounds = 0
        while active and (self.max_iterations is None or rounds < self.max_iterations):
            ready = [row for row in active if self._call_tools(row)]
            if not ready:
                break
            turn_prompts = [row.prompt + row.completion for row in ready]
            turn_params = [[self._turn_params(row, rounds + 1)] for row in ready]
            outs = generate(turn_prompts, turn_params)
            seconds += outs.seconds
            computed += outs.prompt_tokens_computed
            cached += outs.prompt_tokens_cached
            for index, row in enumerate(ready):
                self._take_turn(row, outs, index)
            active = [row for row in ready if row.pending]
            rounds += 1
        rollouts = Rollouts(
            prompts=[row.prompt for row in rows],
            completions=[row.completion for row in rows],
            truncated=[row.truncated for row in rows],
            seconds=seconds,
            prompt_tokens_computed=computed,
            prompt_tokens_cached=cached,
            logprobs=[row.logprobs for row in rows] if first.logprobs else [],
            tool_masks=[row.tool_mask for row in rows],
        )
        return AgentRollouts(
            rollouts,
            [row.last_text for row in rows],
            [row.messages for row in rows],
            [row.calls for row in rows],
            [row.failures for row in rows],
        )

    def _first_turn(self, generate: Generate, rows: list[_Row]) -> Rollouts:
        groups: list[list[_Row]] = []
        for row in rows:
            if groups and groups[-1][0].prompt == row.prompt:
                groups[-1].append(row)
            else:
                groups.append([row])
        outs = generate([g[0].prompt for g in groups], [[r.params for r in g] for g in groups])
        for index, row in enumerate(rows):
            self._take_turn(row, outs, index)
        return outs

    def _take_turn(self, row: _Row, outs: Rollouts, index: int) -> None:
        """Append turn `index` of `outs` to `row` and read its tool calls."""
        tokens = list(outs.completions[index])
        row.completion += tokens
        row.tool_mask += [1] * len(tokens)
        row.logprobs += list(outs.logprobs[index]) if outs.logprobs else [0.0] * len(tokens)
        row.truncated = outs.truncated[index] or len(row.completion) >= self.max_length
        body = tokens[:-1] if tokens and tokens[-1] in self.stop_ids else tokens
        text = self.tokenizer.decode(body)
        extracted = self.parser.extract(text)
        calls = list(extracted.calls) if not row.truncated else []
        content = extracted.content if calls else text
        message: dict[str, Any] = {"role": "assistant", "content": content or ""}
        if calls:
            message["tool_calls"] = [
                {"type": "function", "function": {"name": c.name, "arguments": _loads(c)}}
                for c in calls
            ]
        row.messages.append(message)
        row.last_text, row.pending = text, calls

    def _call_tools(self, row: _Row) -> bool:
        """Run the last turn's calls and append their messages' tokens; False (the tool
        messages dropped, the rollout over) when they would not fit."""
        results = []
        for call in row.pending:
            text, failed = row.box.call(call.name, call.arguments, self.timeout)
            results.append({"role": "tool", "name": call.name, "content": text})
            row.calls += 1
            row.failures += failed
        row.pending = []
        suffix = tool_suffix(self.template, self.tokenizer, results, self.stop_ids)
        if len(row.completion) + len(suffix) >= self.max_length:
            return False
        row.messages += results
        row.completion += suffix
        row.tool_mask += [0] * len(suffix)
        row.logprobs += [0.0] * len(suffix)  # not the engine's tokens; out of the loss
        return True

    def _turn_params(self, row: _Row, turn: int) -> Any:
        """The row's sampling parameters for a later turn: what room is left, its own seed."""
        seed = None if row.params.seed is None else completion_seed(row.params.seed, turn, 0)
        room = self.max_length - len(row.completion)
        return dataclasses.replace(row.params, max_new_tokens=room, seed=seed)


def _loads(call: Any) -> Any:
    try:
        return json.loads(call.arguments)
    except ValueError:
        return call.arguments
