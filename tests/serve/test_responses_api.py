"""`POST /v1/responses` through the official `openai` client (`client.responses.create`), on pipe
serve's routes with a scripted engine (the reply a test sets, as in test_tool_calls_client.py):
text and instructions, function tools and a call's round trip through `previous_response_id`,
`store: false`, and the streamed events in vLLM's order. The reasoning item on a model that
thinks is in test_reasoning.py."""

from __future__ import annotations

import json

import pytest

from pipeline.serve.http.tool_calls import ToolServing
from tests.serve.test_tool_calls_client import scripted_server
from tests.serve.test_tool_parsers import CASES, WEATHER

openai = pytest.importorskip("openai")

TOOLS = [
    {
        "type": "function",
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
    {"type": "function", "name": "now", "parameters": {"type": "object", "properties": {}}},
]
TEXT_EVENTS = [
    "response.created",
    "response.in_progress",
    "response.output_item.added",
    "response.content_part.added",
    "response.output_text.delta",
    "response.output_text.done",
    "response.content_part.done",
    "response.output_item.done",
    "response.completed",
]


@pytest.fixture(scope="module")
def tokenizer(tiny_tokenizer_dir):
    from pipeline.tokenizer.tokenizer import load_tokenizer

    return load_tokenizer(tiny_tokenizer_dir)


@pytest.fixture(scope="module")
def served(tokenizer):
    with scripted_server(tokenizer, ToolServing("hermes", True)) as (client, engine):
        yield client, engine


def test_text_with_instructions(served) -> None:
    client, engine = served
    engine.reply = "It is sunny in Zürich."
    response = client.responses.create(
        model="m", input="Weather in Zürich?", instructions="Be brief."
    )
    assert response.status == "completed" and response.object == "response"
    assert response.output_text == "It is sunny in Zürich."
    assert [item.type for item in response.output] == ["message"]
    assert engine.prompts[-1].startswith("<|system|>Be brief.\n<|user|>Weather in Zürich?")
    assert response.usage.output_tokens == len(engine.reply) // 3 + 1  # scripted: 3 chars a delta
    assert client.responses.retrieve(response.id).output_text == response.output_text


def test_streamed_events_in_vllms_order(served) -> None:
    client, engine = served
    engine.reply = "It is sunny in Zürich."
    events = list(client.responses.create(model="m", input="Weather?", stream=True))
    kinds = [e.type for e in events]
    collapsed = [k for i, k in enumerate(kinds) if i == 0 or k != kinds[i - 1]]
    assert collapsed == TEXT_EVENTS
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == engine.reply == events[-1].response.output_text


def test_a_function_call_round_trip(served) -> None:
    client, engine = served
    _, engine.reply, _, content = next(c for c in CASES if c[0] == "hermes" and len(c[2]) == 2)
    first = client.responses.create(model="m", input="Weather in Zürich?", tools=TOOLS)
    calls = [item for item in first.output if item.type == "function_call"]
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", WEATHER),
        ("now", {}),
    ]
    assert first.output[0].type == "message" and first.output_text == content
    assert '"name": "get_weather"' in engine.prompts[-1]  # the tools reached the template
    engine.reply = "It is 3 degrees."
    outputs = [
        {"type": "function_call_output", "call_id": c.call_id, "output": '{"temp": 3}'}
        for c in calls
    ]
    second = client.responses.create(
        model="m", input=outputs, tools=TOOLS, previous_response_id=first.id
    )
    assert second.output_text == "It is 3 degrees."
    prompt = engine.prompts[-1]
    assert "</tools><|user|>Weather in Zürich?\n<|assistant|>" in prompt  # the first turn
    assert prompt.count('<|tool|>{"temp": 3}') == 2


def test_streamed_function_calls(served) -> None:
    client, engine = served
    engine.reply = next(r for n, r, c, _ in CASES if n == "hermes" and len(c) == 2)
    events = list(client.responses.create(model="m", input="Weather?", tools=TOOLS, stream=True))
    done = [e.item for e in events if e.type == "response.output_item.done"]
    assert [item.type for item in done] == ["message", "function_call", "function_call"]
    arguments = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert [(e.name, json.loads(e.arguments)) for e in arguments][0] == ("get_weather", WEATHER)
    assert events[-1].type == "response.completed"
    assert [i.type for i in events[-1].response.output] == [i.type for i in done]


def test_store_false_and_unknown_ids(served) -> None:
    client, engine = served
    engine.reply = "ok"
    kept = client.responses.create(model="m", input="hi", store=False)
    with pytest.raises(openai.NotFoundError) as caught:
        client.responses.create(model="m", input="more", previous_response_id=kept.id)
    assert caught.value.body["param"] == "previous_response_id"
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve("resp_nope")


def test_refused_inputs_name_the_field(served) -> None:
    client, _ = served
    with pytest.raises(openai.BadRequestError) as caught:
        client.responses.create(model="m", input="x", tools=[{"type": "web_search"}])
    assert caught.value.body["param"] == "tools"
    with pytest.raises(openai.BadRequestError) as caught:
        client.responses.create(model="m", input=[{"type": "image_generation_call", "id": "x"}])
    assert caught.value.body["param"] == "input"
