"""Structured output (`pipeline.serve.engine.structured_output`): 200 random JSON schemas on a tiny
random model, whose unconstrained text is garbage, each output parsed and validated by `jsonschema`;
the unconstrained rows of the same batch token-identical to a run without constrained rows;
regex, choice and grammar constraints; the API fields through the official `openai` client."""

from __future__ import annotations

import json
import random
import re

import pytest

from pipeline.serve.engine.core import Engine
from pipeline.serve.engine.loading import open_generator
from pipeline.serve.engine.sampling import SamplingParams
from pipeline.serve.engine.structured_output import GrammarBackend, StructuredOutput

pytest.importorskip("llguidance")
jsonschema = pytest.importorskip("jsonschema")

SCHEMAS = 200
MAX_TOKENS = 320
PATTERNS = (
    "^[a-z]{1,6}$",
    "^[A-Z][0-9]{2}$",
    "^(ab|cd){1,3}$",
    "^[0-9]{3}-[0-9]{2}$",
    "^v[0-9]\\.[0-9]$",
)
WORDS = ("red", "green", "blue", "line", "value", "x y")


def random_schema(rng: random.Random, depth: int) -> dict:
    """A bounded schema (every string, array and number has a limit, so a random model's
    output ends within `MAX_TOKENS`): nested objects, arrays, enums, numbers, patterns."""
    kinds = ["integer", "number", "string", "pattern", "enum", "boolean"]
    kinds += ["array", "object"] * (depth > 0)
    kind = rng.choice(kinds)
    if kind == "integer":
        return {"type": "integer", "minimum": rng.randint(-50, 0), "maximum": rng.randint(1, 999)}
    if kind == "number":
        # multipleOf bounds the fraction's digits, which a random model would never end
        return {
            "type": "number",
            "minimum": -5,
            "maximum": rng.choice([1, 5, 100]),
            "multipleOf": rng.choice([0.5, 0.25]),
        }
    if kind == "string":
        return {"type": "string", "minLength": rng.randint(0, 2), "maxLength": rng.randint(3, 8)}
    if kind == "pattern":
        return {"type": "string", "pattern": rng.choice(PATTERNS)}
    if kind == "enum":
        return {"enum": rng.sample([*WORDS, 3, -1, None, True], rng.randint(1, 4))}
    if kind == "boolean":
        return {"type": "boolean"}
    if kind == "array":
        items = random_schema(rng, depth - 1)
        return {
            "type": "array",
            "items": items,
            "minItems": rng.randint(0, 1),
            "maxItems": rng.randint(1, 3),
        }
    return random_object(rng, depth - 1)


def random_object(rng: random.Random, depth: int) -> dict:
    names = rng.sample(
        ["id", "name", "kind", "score", "tags", "owner", "when", "ok"], rng.randint(1, 3)
    )
    properties = {name: random_schema(rng, depth) for name in names}
    required = [name for name in names if rng.random() < 0.7]
    return {
        "type": "object",
        "properties": properties,
        "required": required,
        "additionalProperties": False,
    }


@pytest.fixture(scope="module")
def gen(tiny_hf_dir):
    return open_generator(tiny_hf_dir)


def _engine(gen, max_batch: int) -> Engine:
    grammars = GrammarBackend.from_path(
        gen.tokenizer_path, gen.model.config.vocab_size, gen.eos_ids
    )
    return Engine(
        gen.model,
        max_batch=max_batch,
        cache_blocks=8192,
        block_size=16,
        max_waiting=512,
        grammars=grammars,
    )


def _plain_rows(gen) -> list[tuple[list[int], SamplingParams]]:
    """Unconstrained requests: sampled with seeds, and greedy."""
    prompts = gen.tokenizer.encode_batch(["line 3: value", "abc abc", "value=14 line"])
    eos = frozenset(gen.eos_ids)
    return [
        (prompt, SamplingParams(max_new_tokens=24, seed=seed, greedy=seed == 0, stop_token_ids=eos))
        for seed, prompt in enumerate(prompts * 2)
    ]


def test_random_schemas_validate_and_plain_rows_are_untouched(gen) -> None:
    rng = random.Random(42)
    schemas = [random_object(rng, 2) for _ in range(SCHEMAS)]
    prompts = gen.tokenizer.encode_batch([f"line {i}: value" for i in range(SCHEMAS)])
    eos = frozenset(gen.eos_ids)
    plain = _plain_rows(gen)
    alone = _engine(gen, 8)
    expected = [alone.add(prompt, params) for prompt, params in plain]
    list(alone.run())

    engine = _engine(gen, SCHEMAS + len(plain))
    constrained, mixed = [], []
    for i, (schema, prompt) in enumerate(zip(schemas, prompts)):
        output = StructuredOutput.json_schema(schema)
        params = SamplingParams(
            max_new_tokens=MAX_TOKENS, seed=i, stop_token_ids=eos, structured_output=output
        )
        constrained.append(engine.add(prompt, params))
        if i % 40 == 0:  # the plain rows spread through the batch
            mixed.append(engine.add(*plain[len(mixed)]))
    mixed += [engine.add(*row) for row in plain[len(mixed) :]]
    list(engine.run())

    assert [r.output for r in mixed] == [r.output for r in expected]
    for schema, request in zip(schemas, constrained):
        text = gen.tokenizer.decode(request.output[:-1])
        assert request.finish_reason == "stop", (schema, text)
        jsonschema.validate(json.loads(text), schema)
    # random weights: unconstrained, the same prompts give no JSON at all
    assert not any(_parses(gen.tokenizer.decode(r.output)) for r in expected)


def _parses(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


@pytest.mark.parametrize(
    ("output", "matches"),
    [
        (StructuredOutput("regex", "[0-9]{3}-[a-z]{2}"), r"[0-9]{3}-[a-z]{2}"),
        (StructuredOutput.choice(["yes", "no way"]), r"yes|no way"),
        (StructuredOutput("grammar", 'root ::= "ab" | "cd" [0-9]'), r"ab|cd[0-9]"),
        (
            StructuredOutput("grammar", 'start: "x" DIGIT DIGIT?\n%import common.DIGIT'),
            r"x[0-9]{1,2}",
        ),
    ],
    ids=["regex", "choice", "gbnf", "lark"],
)
def test_regex_choice_and_grammars(gen, output, matches) -> None:
    engine = _engine(gen, 8)
    params = [
        SamplingParams(
            max_new_tokens=40,
            seed=seed,
            stop_token_ids=frozenset(gen.eos_ids),
            structured_output=output,
        )
        for seed in range(6)
    ]
    prompt = gen.tokenizer.encode_batch(["line 3: value"])[0]
    requests = engine.add_group(prompt, params)
    list(engine.run())
    for request in requests:
        text = gen.tokenizer.decode(request.output[:-1])
        assert request.finish_reason == "stop" and re.fullmatch(matches, text), text


def test_a_bad_constraint_is_refused_at_add(gen) -> None:
    engine = _engine(gen, 2)
    params = SamplingParams(structured_output=StructuredOutput("regex", "[a-"))
    with pytest.raises(ValueError, match="regex|parse|class"):
        engine.add([1, 2], params)
    no_tokenizer = Engine(gen.model, max_batch=2)
    with pytest.raises(ValueError, match="tokenizer.json"):
        no_tokenizer.add([1, 2], SamplingParams(structured_output=StructuredOutput("json_object")))


# ---- through the official client ---------------------------------------------------------------

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "pattern": "^[A-Z][a-z]{1,8}$"},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
    },
    "required": ["name", "age", "tags"],
    "additionalProperties": False,
}
MESSAGES = [{"role": "user", "content": "line 3: value"}]


@pytest.fixture(scope="module")
def client(tiny_hf_dir, tmp_path_factory):
    openai = pytest.importorskip("openai")
    pytest.importorskip("fastapi")
    from tests.serve.test_server import Server

    log = tmp_path_factory.mktemp("structured_server") / "stderr.txt"
    server = Server(
        tiny_hf_dir, log, "--max-batch", "8", "--served-model-name", "tiny", "--engine-threads", "1"
    )
    yield openai.OpenAI(
        base_url=f"http://127.0.0.1:{server.port}/v1", api_key="x", max_retries=0, timeout=120
    )
    server.stop()


def test_response_format_json_schema_through_the_client(client) -> None:
    schema = {"name": "person", "schema": PERSON, "strict": True}
    response_format = {"type": "json_schema", "json_schema": schema}
    answer = client.chat.completions.create(
        model="tiny",
        messages=MESSAGES,
        max_tokens=80,
        seed=5,
        n=4,
        response_format=response_format,
    )
    for choice in answer.choices:
        assert choice.finish_reason == "stop", choice.message.content
        jsonschema.validate(json.loads(choice.message.content), PERSON)
    plain = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=30, seed=5)
    assert not _parses(plain.choices[0].message.content)


def test_response_format_text_changes_nothing(client) -> None:
    asked = dict(model="tiny", messages=MESSAGES, max_tokens=12, seed=9, logprobs=True)
    plain = client.chat.completions.create(**asked)
    text = client.chat.completions.create(**asked, response_format={"type": "text"})
    assert text.choices[0].message.content == plain.choices[0].message.content
    assert text.choices[0].logprobs == plain.choices[0].logprobs


@pytest.mark.parametrize(
    ("extra", "matches"),
    [
        ({"structured_outputs": {"choice": ["alpha", "beta gamma"]}}, r"alpha|beta gamma"),
        ({"structured_outputs": {"regex": "[0-9]{2}:[a-z]{3}"}}, r"[0-9]{2}:[a-z]{3}"),
        ({"guided_choice": ["up", "down"]}, r"up|down"),  # vLLM before 0.12
        ({"response_format": {"type": "json_object"}, "max_tokens": 400}, None),
    ],
    ids=["choice", "regex", "guided_choice", "json_object"],
)
def test_vllm_fields_on_completions(client, extra, matches) -> None:
    extra = {"max_tokens": 40, **extra}
    max_tokens = extra.pop("max_tokens")
    answer = client.completions.create(
        model="tiny", prompt="line 3: value", seed=1, n=3, max_tokens=max_tokens, extra_body=extra
    )
    for choice in answer.choices:
        if matches is None:  # unbounded keys: a random model may run out of tokens first
            assert choice.text.startswith("{") and (
                choice.finish_reason == "length" or isinstance(json.loads(choice.text), dict)
            )
        else:
            assert choice.finish_reason == "stop" and re.fullmatch(matches, choice.text)


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"response_format": {"type": "xml"}}, "response_format"),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {
                        "name": "x",
                        "schema": {"type": "object", "properties": {"a": {"type": "nope"}}},
                    },
                }
            },
            "response_format",
        ),
        ({"structured_outputs": {"regex": "[a-"}}, "structured_outputs"),
        ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
        ({"guided_regex": "a", "response_format": {"type": "json_object"}}, "guided_regex"),
    ],
    ids=["type", "schema", "regex", "two_keys", "two_fields"],
)
def test_bad_constraints_are_400s_naming_the_field(client, extra, param) -> None:
    import openai

    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(
            model="tiny", messages=MESSAGES, max_tokens=4, extra_body=extra
        )
    assert caught.value.body["param"] == param
    assert "\n" not in caught.value.body["message"]


WEATHER = {
    "type": "function",
    "function": {
        "name": "weather",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "enum": ["Paris", "Rome", "Oslo"]},
                "days": {"type": "integer", "minimum": 1, "maximum": 9},
            },
            "required": ["city", "days"],
            "additionalProperties": False,
        },
    },
}


def test_a_named_tool_choice_is_held_to_its_arguments(client) -> None:
    """A named `tool_choice` constrains a random model's reply to the function's arguments (as
    vLLM does with structured output), which come back as that function's call."""
    choice = {"type": "function", "function": {"name": "weather"}}
    answer = client.chat.completions.create(
        model="tiny",
        messages=MESSAGES,
        max_tokens=60,
        seed=3,
        n=3,
        tools=[WEATHER],
        tool_choice=choice,
    )
    for reply in answer.choices:
        (call,) = reply.message.tool_calls
        assert call.function.name == "weather"
        jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])
