"""Tool calls through the official `openai` client, against pipe serve's routes with a scripted
engine: every request's reply is a text the test sets (what a model would write), so the route
is checked end to end (fields accepted, tools to the template, the reply read into
`tool_calls`, whole and streamed) without a model that writes tool calls. The parsers'
outputs are checked against vLLM's rules in test_tool_parsers.py. Also here: vLLM's leniency
(unknown fields, `continuous_usage_stats`, the API's field names in a limit error)."""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field

import pytest

from pipeline.serve.engine.messages import Delta, Ready
from pipeline.serve.http.tool_calls import AUTO_NEEDS_FLAGS, ToolServing
from tests.serve.test_tool_parsers import CASES, WEATHER
from tests.serve.test_tool_templates import ARGUMENTS, TOOLS

openai = pytest.importorskip("openai")
uvicorn = pytest.importorskip("uvicorn")

TEMPLATE = (
    "{% if tools %}<tools>{{ tools | tojson }}</tools>{% endif %}"
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
ASK = [{"role": "user", "content": "Weather in Zürich?"}]


class ScriptedStream:
    """A request's deltas: the scripted reply in pieces of three characters."""

    def __init__(self, reply: str, prompt_tokens: int) -> None:
        pieces = [reply[i : i + 3] for i in range(0, len(reply), 3)] or [""]
        self._deltas = [
            Delta(
                [7],
                piece,
                finish_reason="stop" if n == len(pieces) - 1 else None,
                prompt_tokens=prompt_tokens,
                completion_tokens=n + 1,
            )
            for n, piece in enumerate(pieces)
        ]

    def __aiter__(self):
        return self

    async def __anext__(self) -> Delta:
        if not self._deltas:
            raise StopAsyncIteration
        await asyncio.sleep(0)
        return self._deltas.pop(0)

    def abort(self) -> None:
        self._deltas.clear()


@dataclass
class ScriptedEngine:
    """What the routes use of an `EngineClient`, answering every request with `reply`."""

    tokenizer: object
    chat_template: object
    reply: str = ""
    prompts: list[str] = field(default_factory=list)
    ready: Ready = None
    spec: object = None
    paused: bool = False
    failure: object = None
    load: tuple = (0, 0)
    finish_counts: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.ready = Ready("scripted", None, frozenset(), 512, 64, 16, 8, 10**6)
        self.spec = type("Spec", (), {"checkpoint": "scripted", "lora_modules": ()})()

    def attach(self, _loop) -> None:
        pass

    def stop(self) -> None:
        pass

    def submit_group(self, prompt: list[int], params, _lora_name=None) -> list[ScriptedStream]:
        self.prompts.append(self.tokenizer.decode(prompt))
        return [ScriptedStream(self.reply, len(prompt)) for _ in params]


@contextmanager
def scripted_server(tokenizer, tools: ToolServing):
    """The app on a free loopback port in a thread; yields (openai client, engine)."""
    from pipeline.serve.http.server import create_app
    from pipeline.serve.http.startup import bind_socket
    from pipeline.tokenizer.chat_template import ChatTemplate

    engine = ScriptedEngine(tokenizer, ChatTemplate.from_string(TEMPLATE))
    sock = bind_socket("127.0.0.1", 0)
    server = uvicorn.Server(uvicorn.Config(create_app(engine, "m", tools), log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.02)
    port = sock.getsockname()[1]
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0)
    try:
        yield client, engine
    finally:
        server.should_exit = True
        thread.join()
        sock.close()


@pytest.fixture(scope="module")
def tokenizer(tiny_tokenizer_dir):
    from pipeline.tokenizer.tokenizer import load_tokenizer

    return load_tokenizer(tiny_tokenizer_dir)


@pytest.fixture(scope="module", params=["hermes", "llama3_json", "pythonic"])
def auto_server(request, tokenizer):
    with scripted_server(tokenizer, ToolServing(request.param, True)) as (client, engine):
        yield request.param, client, engine


@pytest.fixture(scope="module")
def plain_server(tokenizer):
    with scripted_server(tokenizer, ToolServing()) as served:
        yield served


def as_calls(tool_calls) -> list[tuple[str, dict]]:
    return [(c.function.name, json.loads(c.function.arguments)) for c in tool_calls or []]


def streamed(client, **request) -> tuple[str, list[tuple[str, dict]], str, list]:
    """Content, calls (deltas joined by index), last finish reason and the chunks."""
    chunks = list(client.chat.completions.create(model="m", stream=True, **request))
    content, calls, finish = "", {}, None
    for chunk in chunks:
        for choice in chunk.choices:
            content += choice.delta.content or ""
            finish = choice.finish_reason or finish
            for delta in choice.delta.tool_calls or []:
                entry = calls.setdefault(delta.index, {"name": "", "arguments": ""})
                entry["name"] += delta.function.name or ""
                entry["arguments"] += delta.function.arguments or ""
    joined = [(c["name"], json.loads(c["arguments"])) for _, c in sorted(calls.items())]
    return content, joined, finish, chunks


def test_auto_tool_calls_whole_and_streamed(auto_server) -> None:
    parser, client, engine = auto_server
    for name, reply, calls, content in CASES:
        if name != parser:
            continue
        engine.reply = reply
        answer = client.chat.completions.create(model="m", messages=ASK, tools=TOOLS)
        choice = answer.choices[0]
        assert as_calls(choice.message.tool_calls) == calls
        assert choice.message.content == content
        assert choice.finish_reason == ("tool_calls" if calls else "stop")
        got_content, got_calls, finish, _ = streamed(client, messages=ASK, tools=TOOLS)
        assert got_calls == calls and finish == choice.finish_reason
        assert got_content == (content or "")
    assert '"name": "get_weather"' in engine.prompts[0]  # the tools reached the template


def test_a_call_sent_back_with_its_result(auto_server) -> None:
    parser, client, engine = auto_server
    engine.reply = next(r for n, r, c, _ in CASES if n == parser and c)
    message = client.chat.completions.create(model="m", messages=ASK, tools=TOOLS).choices[0]
    call = message.message.tool_calls[0]
    engine.reply = "It is 3 degrees."
    history = [
        *ASK,
        message.message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": '{"temp": 3}'},
    ]
    answer = client.chat.completions.create(model="m", messages=history, tools=TOOLS)
    assert answer.choices[0].message.content == "It is 3 degrees."
    assert '<|tool|>{"temp": 3}' in engine.prompts[-1]


def test_parallel_tool_calls_false(auto_server) -> None:
    parser, client, engine = auto_server
    engine.reply = next(r for n, r, c, _ in CASES if n == parser and len(c) == 2)
    answer = client.chat.completions.create(
        model="m", messages=ASK, tools=TOOLS, parallel_tool_calls=False
    )
    assert len(answer.choices[0].message.tool_calls) == 1


def test_none_needs_no_flag_and_is_not_parsed(plain_server) -> None:
    client, engine = plain_server
    engine.reply = CASES[0][1]
    answer = client.chat.completions.create(
        model="m", messages=ASK, tools=TOOLS, tool_choice="none"
    )
    assert answer.choices[0].message.content == CASES[0][1]
    assert not answer.choices[0].message.tool_calls
    assert answer.choices[0].finish_reason == "stop"
    assert "get_weather" in engine.prompts[-1]  # as vLLM: the tools still reach the template


@pytest.mark.parametrize("choice", ["auto", None])
def test_auto_without_the_flag_is_refused_as_vllm(plain_server, choice) -> None:
    client, _ = plain_server
    extra = {} if choice is None else {"tool_choice": choice}
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model="m", messages=ASK, tools=TOOLS, **extra)
    assert caught.value.body["message"] == AUTO_NEEDS_FLAGS


@pytest.mark.parametrize(
    ("fields", "words"),
    [
        ({"tool_choice": "required"}, "`tools` must be set"),
        (
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "does not match",
        ),
        ({"tools": TOOLS, "tool_choice": {"type": "function"}}, "Invalid value for `function`"),
        ({"tools": [{"type": "function"}], "tool_choice": "required"}, "tools[0]"),
    ],
)
def test_bad_tool_fields_name_the_field(plain_server, fields, words) -> None:
    client, _ = plain_server
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model="m", messages=ASK, **fields)
    assert words in caught.value.body["message"]
    assert caught.value.body["param"] in ("tools", "tool_choice")


def test_named_and_required_choices_read_json(plain_server) -> None:
    client, engine = plain_server
    named = {"type": "function", "function": {"name": "get_weather"}}
    engine.reply = json.dumps(WEATHER)
    answer = client.chat.completions.create(model="m", messages=ASK, tools=TOOLS, tool_choice=named)
    assert as_calls(answer.choices[0].message.tool_calls) == [("get_weather", WEATHER)]
    assert answer.choices[0].finish_reason == "stop"  # vLLM's, for a named function
    _, calls, _, _ = streamed(client, messages=ASK, tools=TOOLS, tool_choice=named)
    assert calls == [("get_weather", WEATHER)]
    engine.reply = json.dumps(
        [{"name": "now", "parameters": {}}, {"name": "get_weather", "parameters": WEATHER}]
    )
    answer = client.chat.completions.create(
        model="m", messages=ASK, tools=TOOLS, tool_choice="required"
    )
    assert as_calls(answer.choices[0].message.tool_calls) == [("now", {}), ("get_weather", WEATHER)]
    assert answer.choices[0].finish_reason == "tool_calls"
    _, calls, finish, _ = streamed(client, messages=ASK, tools=TOOLS, tool_choice="required")
    assert calls == [("now", {}), ("get_weather", WEATHER)] and finish == "tool_calls"


# ---- vLLM's leniency --------------------------------------------------------------------------


def test_unknown_fields_are_ignored_and_logged_once(plain_server, caplog) -> None:
    client, engine = plain_server
    engine.reply = "fine"
    caplog.set_level(logging.WARNING, logger="pipeline.serve.http.lenient")
    for _ in range(2):
        answer = client.chat.completions.create(
            model="m",
            messages=[{"role": "user", "content": "x", "weight": 1}],
            extra_body={"temprature": 0.5, "chat_template_kwargs_x": {}},
        )
        assert answer.choices[0].message.content == "fine"
    logged = [r.getMessage() for r in caplog.records]
    for name in ("temprature", "chat_template_kwargs_x", "weight"):
        assert sum(name in line for line in logged) == 1, logged


def test_response_format_text_is_accepted_others_are_not_ignored(plain_server) -> None:
    client, engine = plain_server
    engine.reply = "fine"
    answer = client.chat.completions.create(
        model="m", messages=ASK, response_format={"type": "text"}
    )
    assert answer.choices[0].message.content == "fine"
    from pipeline.serve.http.openai_api import ChatBody

    if "response_format" not in ChatBody.model_fields:  # until structured output serves it
        with pytest.raises(openai.BadRequestError) as caught:
            client.chat.completions.create(
                model="m", messages=ASK, response_format={"type": "json_object"}
            )
        assert caught.value.body["param"] == "response_format"


def test_continuous_usage_stats(plain_server) -> None:
    client, engine = plain_server
    engine.reply = "abcdefgh"  # three deltas
    options = {"include_usage": True, "continuous_usage_stats": True}
    chunks = list(
        client.chat.completions.create(model="m", messages=ASK, stream=True, stream_options=options)
    )
    counts = [c.usage.completion_tokens for c in chunks]
    assert counts == [0, 1, 2, 3, 3]  # the role chunk, each delta, the closing usage chunk
    assert len({c.usage.prompt_tokens for c in chunks}) == 1
    usage_last = {"include_usage": True}
    plain = list(
        client.chat.completions.create(
            model="m", messages=ASK, stream=True, stream_options=usage_last
        )
    )
    assert [c.usage is not None for c in plain] == [False] * (len(plain) - 1) + [True]


@pytest.mark.parametrize("param", ["max_tokens", "max_completion_tokens"])
def test_a_limit_error_names_the_field_asked(plain_server, param) -> None:
    client, _ = plain_server
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model="m", messages=ASK, **{param: 600})
    error = caught.value.body
    assert error["param"] == param and param in error["message"]
    assert "max_new_tokens" not in error["message"]


def test_the_json_schema_of_required_and_named_choices() -> None:
    jsonschema = pytest.importorskip("jsonschema")
    from pipeline.serve.http.tool_calls import required_calls, tool_choice_json_schema

    assert tool_choice_json_schema(TOOLS, "auto") is None
    assert tool_choice_json_schema(TOOLS, "none") is None
    choice = {"type": "function", "function": {"name": "get_weather"}}
    named = tool_choice_json_schema(TOOLS, choice)
    assert named == TOOLS[0]["function"]["parameters"]
    required = tool_choice_json_schema(TOOLS, "required")
    good = [{"name": "now", "parameters": {}}, {"name": "get_weather", "parameters": ARGUMENTS}]
    jsonschema.validate(good, required)
    assert [c.name for c in required_calls(json.dumps(good))] == ["now", "get_weather"]
    for bad in (
        [],
        [{"name": "nope", "parameters": {}}],
        [{"name": "get_weather"}],
        [{"name": "get_weather", "parameters": {"days": 2}}],
    ):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, required)
