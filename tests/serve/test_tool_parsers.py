"""The tool-call parsers read a reply as vLLM's parsers of the same name do, whole and streamed.

The expected calls were written by hand from vLLM's parsers (vllm/entrypoints/openai/
tool_parsers: llama_tool_parser.py, hermes_tool_parser.py, pythonic_tool_parser.py), applying
their rules to each text: what starts a call, `arguments` or `parameters`, the arguments
re-serialised with `json.dumps(..., ensure_ascii=False)`, the content (hermes: the text before
the first `<tool_call>`, else None once a call is found; unparseable text stays content), and
checked against vLLM 0.32.0's own parsers: `python scripts/tool_parsers_vllm_check.py
--vllm-python VENV/bin/python --tokenizer DIR` gave 12 of 12 cases equal (names, `arguments`
text, content)."""

from __future__ import annotations

import json

import pytest

from pipeline.serve.http.tool_parsers import TOOL_PARSERS, ToolCallStream

WEATHER = {"city": "Zürich", "days": [1, 2], "units": {"temp": "C"}}

# (parser, model text, expected [(name, arguments object)], expected content)
CASES = [
    (
        "hermes",
        'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": '
        + json.dumps(WEATHER)
        + '}\n</tool_call>\n<tool_call>\n{"name": "now", "arguments": {}}\n'
        "</tool_call>",
        [("get_weather", WEATHER), ("now", {})],
        "Let me check.\n",
    ),
    ("hermes", '<tool_call>\n{"name": "f", "arguments": {"a": 1}}', [("f", {"a": 1})], None),
    ("hermes", "No call: a <tool> is not one.", [], "No call: a <tool> is not one."),
    (
        "hermes",
        '<tool_call>{"name": "f", "argu</tool_call>',
        [],
        '<tool_call>{"name": "f", "argu</tool_call>',
    ),
    (
        "llama3_json",
        '<|python_tag|>{"name": "get_weather", "parameters": '
        + json.dumps(WEATHER, ensure_ascii=False)
        + "}",
        [("get_weather", WEATHER)],
        None,
    ),
    (
        "llama3_json",
        '{"name": "f", "arguments": {"a": "x"}} ; {"name": "g", "parameters": {}}',
        [("f", {"a": "x"}), ("g", {})],
        None,
    ),
    ("llama3_json", "The answer is 4.", [], "The answer is 4."),
    ("llama3_json", '{"a": 1}', [], '{"a": 1}'),
    (
        "pythonic",
        '[get_weather(city="Paris", days=3), now()]',
        [("get_weather", {"city": "Paris", "days": 3}), ("now", {})],
        None,
    ),
    (
        "pythonic",
        '[f(opts={"k": [1, "two"]}, flag=True, none=None)]',
        [("f", {"opts": {"k": [1, "two"]}, "flag": True, "none": None})],
        None,
    ),
    ("pythonic", "Sure: [f(a=1)]", [], "Sure: [f(a=1)]"),
    ("pythonic", "[1, 2]", [], "[1, 2]"),
]


def calls_of(entries) -> list[tuple[str, dict]]:
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in entries]


@pytest.mark.parametrize(("name", "text", "calls", "content"), CASES)
def test_whole_reply(name, text, calls, content) -> None:
    extracted = TOOL_PARSERS[name]().extract(text)
    got = [(c.name, json.loads(c.arguments)) for c in extracted.calls]
    assert got == calls and extracted.content == content
    for call in extracted.calls:  # vLLM's serialisation: non-ASCII kept
        assert call.arguments == json.dumps(json.loads(call.arguments), ensure_ascii=False)


def streamed(name: str, text: str, size: int) -> tuple[str, list[dict], list[int]]:
    """The joined content, the call deltas and after how many pieces each call came."""
    stream = ToolCallStream(TOOL_PARSERS[name]())
    content, deltas, when = "", [], []
    pieces = [text[i : i + size] for i in range(0, len(text), size)]
    for number, piece in enumerate(pieces):
        more, calls = stream.push(piece)
        content += more
        deltas += calls
        when += [number] * len(calls)
    more, calls = stream.finish()
    return content + more, deltas + calls, when + [len(pieces)] * len(calls)


@pytest.mark.parametrize("size", [1, 2, 7])
@pytest.mark.parametrize(("name", "text", "calls", "content"), CASES)
def test_streamed_deltas_join_to_the_whole_reply(name, text, calls, content, size) -> None:
    joined, deltas, _ = streamed(name, text, size)
    assert calls_of(deltas) == calls
    assert [d["index"] for d in deltas] == list(range(len(calls)))
    assert len({d["id"] for d in deltas}) == len(deltas)
    assert all(d["id"].startswith("chatcmpl-tool-") and d["type"] == "function" for d in deltas)
    assert joined == (content or "")


@pytest.mark.parametrize("name", ["hermes", "llama3_json", "pythonic"])
def test_a_call_is_sent_as_soon_as_it_is_complete(name) -> None:
    text = next(t for n, t, c, _ in CASES if n == name and len(c) == 2)
    _, deltas, when = streamed(name, text, 1)
    assert when[0] < len(text) - 5, "the first call waited for the end of the reply"


def test_parallel_tool_calls_false_keeps_the_first() -> None:
    text = CASES[0][1]
    stream = ToolCallStream(TOOL_PARSERS["hermes"](), max_calls=1)
    _, calls = stream.push(text)
    assert calls_of(calls + stream.finish()[1]) == [("get_weather", WEATHER)]


def test_the_cli_offers_every_parser() -> None:
    from pipeline.serve.commands import TOOL_CALL_PARSERS

    assert tuple(TOOL_PARSERS) == TOOL_CALL_PARSERS


@pytest.mark.parametrize("size", [1, 3, 4])
@pytest.mark.parametrize(
    ("name", "text"),
    [(n, t) for n, t, _, _ in CASES] + [("pythonic", "[f(x=1))"), ("pythonic", '[f(s=",]"), g()]')],
)
def test_a_call_comes_with_the_piece_that_completes_it(name, text, size) -> None:
    """The stream skips parsing pieces that cannot complete a call; parsing every prefix anew
    (the parser's `split`) must release the same calls at the same pieces."""
    parser = TOOL_PARSERS[name]()
    stream, seen = ToolCallStream(parser), 0
    for end in range(size, len(text) + size, size):
        _, calls = stream.push(text[end - size : end])
        content, expected = parser.split(text[:end])
        expected = expected[seen:] if content is None else []
        assert [c["function"]["name"] for c in calls] == [c.name for c in expected]
        seen += len(expected)
