"""`pipe serve` through the official `openai` client: each field OpenAI documents (and the vLLM
extras pipe accepts), whole and streamed; errors as the client types them; vLLM's /tokenize,
/detokenize and /version; Prometheus' /metrics. One server process for the module."""

from __future__ import annotations

import http.client
import json

import pytest

from tests.builders import served_text
from tests.serve.test_server import Server

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")
parser = pytest.importorskip("prometheus_client.parser")

PROMPT = "line 3: value"
NO_EOS = {"ignore_eos": True}  # vLLM's extra: exactly max_tokens, whatever is sampled


@pytest.fixture(scope="module")
def server(tiny_hf_dir, tmp_path_factory):
    log = tmp_path_factory.mktemp("openai_server") / "stderr.txt"
    server = Server(
        tiny_hf_dir,
        log,
        "--max-batch",
        "8",
        "--block-size",
        "8",
        "--served-model-name",
        "tiny_hf0",
        "--access-log",
    )
    yield server
    server.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(
        base_url=f"http://127.0.0.1:{server.port}/v1", api_key="x", max_retries=0, timeout=120
    )


@pytest.fixture(scope="module")
def tokenizer(tiny_hf_dir):
    from pipeline.tokenizer.tokenizer import load_tokenizer

    return load_tokenizer(tiny_hf_dir)


def encode(tokenizer, text: str) -> list[int]:
    return tokenizer.encode_batch([text])[0]


def raw(server, method: str, path: str, body: dict | None = None) -> tuple[int, dict]:
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    data = None if body is None else json.dumps(body)
    conn.request(method, path, data, {"Content-Type": "application/json"})
    response = conn.getresponse()
    return response.status, json.loads(response.read())


# ---- models and errors ------------------------------------------------------------------------


def test_models_and_an_unknown_model(client) -> None:
    assert [m.id for m in client.models.list().data] == ["tiny_hf0"]
    with pytest.raises(openai.NotFoundError) as caught:
        client.completions.create(model="nope", prompt=PROMPT, max_tokens=2)
    error = caught.value.body
    assert error["param"] == "model" and error["code"] == 404 and "`nope`" in error["message"]
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}])
    answer = client.completions.create(model="tiny_hf0", prompt=PROMPT, max_tokens=2)
    assert answer.model == "tiny_hf0"


def test_startup_line_and_access_log(server, client) -> None:
    client.models.list()
    log = server.log.read_text()
    assert f"pipe serve: listening on http://127.0.0.1:{server.port}, model tiny_hf0\n" in log
    assert '"GET /v1/models HTTP/1.1" 200' in log


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"temperature": 2.5}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"presence_penalty": 3}, "presence_penalty"),
        ({"frequency_penalty": -2.5}, "frequency_penalty"),
        ({"logit_bias": {"7": 101}}, "logit_bias"),
        ({"logit_bias": {"x": 1}}, "logit_bias"),
        ({"logit_bias": {"999999": 1}}, "logit_bias"),
        ({"logprobs": 21}, "logprobs"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"n": 0}, "n"),
        ({"best_of": 1, "n": 2}, "best_of"),
        ({"best_of": 2, "stream": True}, "best_of"),
        ({"stream_options": {"include_usage": True}}, "stream_options"),
        ({"extra_body": {"repetition_penalty": 0}}, "repetition_penalty"),
        ({"prompt": [[]]}, "prompt"),
        ({"prompt": [10**6]}, "prompt"),
        ({"prompt": ""}, "prompt"),
        ({"prompt": "word " * 1500, "max_tokens": 8}, "prompt"),
    ],
)
def test_bad_completion_values_name_their_field(client, fields, param) -> None:
    fields = {"prompt": PROMPT, "max_tokens": 2, **fields}
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model="tiny_hf0", **fields)
    error = caught.value.body
    assert error["param"] == param and error["code"] == 400, error
    assert error["type"] == "BadRequestError" and error["message"]


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"top_logprobs": 2}, "top_logprobs"),
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ({"max_completion_tokens": 0}, "max_completion_tokens"),
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "bot", "content": "x"}]}, "messages"),
        (
            {
                "messages": [
                    {
                        "role": "user",
                        "content": [{"type": "image_url", "image_url": {"url": "http://x/y.png"}}],
                    }
                ]
            },
            "messages",
        ),
    ],
)
def test_bad_chat_values_name_their_field(client, fields, param) -> None:
    fields = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, **fields}
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model="tiny_hf0", **fields)
    error = caught.value.body
    assert error["param"] == param and error["code"] == 400, error
    if "image_url" in json.dumps(fields):
        assert "image_url" in error["message"]


def test_unknown_paths_and_methods_answer_in_the_error_shape(server) -> None:
    status, body = raw(server, "GET", "/v1/nothing")
    assert status == 404 and body["error"]["code"] == 404 and body["error"]["message"]
    status, body = raw(server, "GET", "/v1/completions")
    assert status == 405 and body["error"]["type"] == "MethodNotAllowedError"


# ---- completions ------------------------------------------------------------------------------


def test_null_fields_mean_their_defaults(client) -> None:
    answer = client.completions.create(
        model=None,
        prompt=PROMPT,
        max_tokens=3,
        temperature=None,
        top_p=None,
        seed=None,
        stop=None,
        n=None,
        presence_penalty=None,
        logprobs=None,
        echo=None,
        user="someone",
    )
    assert answer.usage.completion_tokens == 3 and len(answer.choices) == 1


def test_null_max_tokens_runs_to_a_stop(client) -> None:
    """max_tokens null: up to the context, here ended by a stop token the bias makes certain."""
    answer = client.completions.create(
        model="tiny_hf0",
        prompt=PROMPT,
        max_tokens=None,
        temperature=0,
        logit_bias={"7": 100},
        extra_body={"stop_token_ids": [7]},
    )
    assert answer.choices[0].finish_reason == "stop" and answer.usage.completion_tokens == 1


def test_logit_bias_and_penalties(client, tokenizer) -> None:
    biased = client.completions.create(
        model="tiny_hf0", prompt=PROMPT, max_tokens=4, temperature=0, logit_bias={"42": 100}
    )
    assert biased.choices[0].text == tokenizer.decode([42] * 4)
    plain = client.completions.create(model="tiny_hf0", prompt=PROMPT, max_tokens=12, temperature=0)
    penalised = client.completions.create(
        model="tiny_hf0",
        prompt=PROMPT,
        max_tokens=12,
        temperature=0,
        presence_penalty=2,
        frequency_penalty=2,
        extra_body={"repetition_penalty": 1.5, "top_k": 5},
    )
    assert penalised.usage.completion_tokens == 12
    assert penalised.choices[0].text != plain.choices[0].text


def test_n_choices_with_a_seed_differ_and_repeat(client) -> None:
    fields = {
        "model": "tiny_hf0",
        "prompt": PROMPT,
        "max_tokens": 8,
        "temperature": 1.0,
        "seed": 3,
        "n": 3,
        "extra_body": NO_EOS,
    }
    first = client.completions.create(**fields)
    assert [c.index for c in first.choices] == [0, 1, 2]
    assert len({c.text for c in first.choices}) > 1
    assert [c.text for c in client.completions.create(**fields).choices] == [
        c.text for c in first.choices
    ]
    assert first.usage.completion_tokens == 24


def test_completion_logprobs_in_the_legacy_shape(client) -> None:
    answer = client.completions.create(
        model="tiny_hf0", prompt=PROMPT, max_tokens=4, temperature=0, logprobs=2
    )
    logprobs = answer.choices[0].logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == 4
    assert "".join(logprobs.tokens) == answer.choices[0].text
    assert logprobs.text_offset == [0] + [sum(map(len, logprobs.tokens[: i + 1])) for i in range(3)]
    for token, logprob, top in zip(logprobs.tokens, logprobs.token_logprobs, logprobs.top_logprobs):
        assert logprob <= 0 and 2 <= len(top) <= 3 and top[token] == logprob
        assert logprob == pytest.approx(max(top.values()))  # greedy took the best


def test_echo_with_and_without_logprobs(client, tokenizer) -> None:
    plain = client.completions.create(model="tiny_hf0", prompt=PROMPT, max_tokens=2, temperature=0)
    echoed = client.completions.create(
        model="tiny_hf0", prompt=PROMPT, max_tokens=2, temperature=0, echo=True
    )
    assert echoed.choices[0].text == PROMPT + plain.choices[0].text
    # with return_token_ids vLLM leaves the prompt's text out (its ids come back instead)
    for stream in (False, True):
        answer = client.completions.create(
            model="tiny_hf0",
            prompt=PROMPT,
            max_tokens=2,
            temperature=0,
            echo=True,
            stream=stream,
            extra_body={"return_token_ids": True},
        )
        chunks = list(answer) if stream else [answer]
        assert "".join(c.choices[0].text for c in chunks) == plain.choices[0].text
        assert chunks[0].choices[0].prompt_token_ids == encode(tokenizer, PROMPT)
    scored = client.completions.create(
        model="tiny_hf0", prompt=PROMPT, max_tokens=2, temperature=0, echo=True, logprobs=1
    )
    logprobs = scored.choices[0].logprobs
    prompt_ids = encode(tokenizer, PROMPT)
    assert len(logprobs.tokens) == len(prompt_ids) + 2
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    assert all(lp <= 0 for lp in logprobs.token_logprobs[1:])
    assert scored.usage.prompt_tokens == len(prompt_ids)
    # max_tokens 0: the prompt scored alone, its logprobs those of the longer answer
    alone = client.completions.create(
        model="tiny_hf0", prompt=PROMPT, max_tokens=0, echo=True, logprobs=20
    )
    choice = alone.choices[0]
    assert choice.text == PROMPT and alone.usage.completion_tokens == 0
    assert choice.logprobs.token_logprobs == logprobs.token_logprobs[: len(prompt_ids)]
    # up to 20 alternatives (by text: tokens that decode alike, byte pieces, share an entry)
    tops = choice.logprobs.top_logprobs[1:]
    assert 5 < max(map(len, tops)) <= 21
    assert all(set(few) <= set(many) for few, many in zip(logprobs.top_logprobs[1:], tops))
    chunks = list(
        client.completions.create(
            model="tiny_hf0", prompt=PROMPT, max_tokens=0, echo=True, stream=True
        )
    )
    assert "".join(c.choices[0].text for c in chunks) == PROMPT


def test_best_of_keeps_the_most_likely(client) -> None:
    answer = client.completions.create(
        model="tiny_hf0",
        prompt=PROMPT,
        max_tokens=6,
        temperature=1.0,
        seed=1,
        n=2,
        best_of=4,
        logprobs=0,
        extra_body=NO_EOS,
    )
    assert [c.index for c in answer.choices] == [0, 1]
    totals = [sum(c.logprobs.token_logprobs) for c in answer.choices]
    assert totals == sorted(totals, reverse=True)
    assert answer.usage.completion_tokens == 4 * 6  # every generated token counts
    alone = client.completions.create(
        model="tiny_hf0",
        prompt=PROMPT,
        max_tokens=6,
        temperature=1.0,
        seed=1,
        n=4,
        logprobs=0,
        extra_body=NO_EOS,
    )
    best = max(sum(c.logprobs.token_logprobs) for c in alone.choices)
    assert totals[0] == pytest.approx(best)  # the same four, seeded alike


def test_prompt_lists_and_token_ids(client, tokenizer) -> None:
    prompts = [PROMPT, "line 9: value"]
    with pytest.raises(openai.BadRequestError, match="n must be 1 when using greedy"):
        client.completions.create(
            model="tiny_hf0", prompt=prompts, max_tokens=3, temperature=0, n=2
        )
    # top_k 1 samples greedily without being greedy sampling, which vLLM allows n > 1 of
    answer = client.completions.create(
        model="tiny_hf0", prompt=prompts, max_tokens=3, n=2, extra_body={"top_k": 1}
    )
    assert [c.index for c in answer.choices] == [0, 1, 2, 3]
    texts = [c.text for c in answer.choices]
    assert texts[0] == texts[1] and texts[2] == texts[3]  # top_k 1: the most likely token
    ids = [encode(tokenizer, p) for p in prompts]
    assert answer.usage.prompt_tokens == sum(map(len, ids))
    by_ids = client.completions.create(model="tiny_hf0", prompt=ids, max_tokens=3, temperature=0)
    assert [c.text for c in by_ids.choices] == [texts[0], texts[2]]
    one = client.completions.create(model="tiny_hf0", prompt=ids[1], max_tokens=3, temperature=0)
    assert one.choices[0].text == texts[2]
    echoed = client.completions.create(
        model="tiny_hf0", prompt=ids[0], max_tokens=1, temperature=0, echo=True
    )
    assert echoed.choices[0].text.startswith(PROMPT)


def test_streamed_completions_match_whole_ones(client) -> None:
    fields = {
        "model": "tiny_hf0",
        "prompt": [PROMPT, "x"],
        "max_tokens": 5,
        "n": 2,  # top_k 1: the most likely token, without vLLM's refusal of greedy n > 1
        "extra_body": {"top_k": 1},
        "logprobs": 1,
    }
    whole = client.completions.create(**fields)
    chunks = list(
        client.completions.create(**fields, stream=True, stream_options={"include_usage": True})
    )
    texts, tokens, finish = {}, {}, {}
    for chunk in chunks[:-1]:
        (choice,) = chunk.choices
        texts[choice.index] = texts.get(choice.index, "") + choice.text
        tokens[choice.index] = tokens.get(choice.index, []) + choice.logprobs.tokens
        finish[choice.index] = choice.finish_reason or finish.get(choice.index)
    for choice in whole.choices:
        assert texts[choice.index] == choice.text
        assert tokens[choice.index] == choice.logprobs.tokens
        assert finish[choice.index] == choice.finish_reason == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 20
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens


# ---- chat -------------------------------------------------------------------------------------


def test_chat_accepts_what_clients_send(client, tokenizer) -> None:
    from pipeline.serve.http.openai_api import chat_prompt
    from tests.serve.conftest import CHAT_TEMPLATE

    messages = [
        {"role": "developer", "content": "Be brief."},
        {
            "role": "user",
            "content": [{"type": "text", "text": "Hi "}, {"type": "text", "text": "there"}],
            "name": "ann",
        },
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "clock", "arguments": "{}"},
                }
            ],
        },
        {"role": "tool", "content": "noon", "tool_call_id": "call_1"},
    ]
    answer = client.chat.completions.create(
        model="tiny_hf0", messages=messages, max_completion_tokens=3, temperature=0, user="ann"
    )
    assert answer.choices[0].message.role == "assistant"
    assert answer.usage.completion_tokens == 3
    # developer is system for a template that does not name it; parts are joined
    prompt = chat_prompt(
        [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Hi there"},
            {"role": "assistant", "content": ""},
            {"role": "tool", "content": "noon"},
        ],
        CHAT_TEMPLATE,
    )
    assert answer.usage.prompt_tokens == len(encode(tokenizer, prompt))


def test_chat_n_and_logprobs(client, tiny_hf_dir, hf_tokenizer) -> None:
    answer = client.chat.completions.create(
        model="tiny_hf0",
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=3,
        n=2,
        logprobs=True,
        top_logprobs=2,
        # top_k 1: the most likely token (vLLM refuses greedy n > 1)
        extra_body={"top_k": 1, "return_token_ids": True},
    )
    assert [c.index for c in answer.choices] == [0, 1]
    content = answer.choices[0].logprobs.content
    ids = answer.choices[0].token_ids
    assert len(content) == 3 and len(ids) == 3
    # each token's own text, and the reply's as vLLM writes the ids (a character left
    # incomplete at the end is not written)
    assert [t.token for t in content] == [hf_tokenizer.decode([token]) for token in ids]
    expected = served_text(tiny_hf_dir, answer.prompt_token_ids, ids)
    assert answer.choices[0].message.content == expected
    for entry in content:
        assert entry.logprob <= 0 and len(entry.top_logprobs) == 2
        assert entry.bytes == list(entry.token.encode())
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob)
    assert (
        client.chat.completions.create(
            model="tiny_hf0",
            messages=[{"role": "user", "content": "Hi"}],
            max_tokens=2,
            logprobs=False,
        )
        .choices[0]
        .logprobs
        is None
    )


def test_streamed_chat_deltas(client) -> None:
    fields = {
        "model": "tiny_hf0",
        "messages": [{"role": "user", "content": "Hi"}],
        "max_tokens": 4,
        "n": 2,
        "extra_body": {"top_k": 1},  # the most likely token; vLLM refuses greedy n > 1
    }
    whole = client.chat.completions.create(**fields)
    usage = {"include_usage": True}
    chunks = list(client.chat.completions.create(**fields, stream=True, stream_options=usage))
    by_index: dict[int, list] = {0: [], 1: []}
    for chunk in chunks[:-1]:
        (choice,) = chunk.choices
        by_index[choice.index].append(choice)
    for index, choices in by_index.items():
        assert choices[0].delta.role == "assistant" and choices[0].delta.content == ""
        assert all(c.delta.role is None for c in choices[1:])
        assert all(c.finish_reason is None for c in choices[:-1])
        assert choices[-1].finish_reason == "length"
        text = "".join(c.delta.content or "" for c in choices)
        assert text == whole.choices[index].message.content
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 8
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens


# ---- vLLM's extra routes and /metrics ---------------------------------------------------------


def test_tokenize_detokenize_and_version(server, tokenizer) -> None:
    from pipeline import __version__
    from pipeline.serve.http.openai_api import chat_prompt
    from tests.serve.conftest import CHAT_TEMPLATE

    status, body = raw(server, "POST", "/tokenize", {"model": "tiny_hf0", "prompt": PROMPT})
    ids = encode(tokenizer, PROMPT)
    assert status == 200 and body == {
        "count": len(ids),
        "max_model_len": 2048,
        "tokens": ids,
        "token_strs": None,
    }
    # lm-eval's remote tokenizer: no special tokens, the EOS token's text as its one id
    request = {"prompt": "<|end_of_text|>", "add_special_tokens": False, "return_token_strs": True}
    status, body = raw(server, "POST", "/tokenize", request)
    assert status == 200 and body["tokens"] == [tokenizer.eod]
    assert body["token_strs"] == ["<|end_of_text|>"]
    status, body = raw(server, "POST", "/detokenize", {"model": "tiny_hf0", "tokens": ids})
    assert status == 200 and body == {"prompt": PROMPT}
    messages = [{"role": "user", "content": "Hi"}]
    for generation in (True, False):
        request = {"messages": messages, "add_generation_prompt": generation}
        status, body = raw(server, "POST", "/tokenize", request)
        expected = encode(tokenizer, chat_prompt(messages, CHAT_TEMPLATE, generation))
        assert status == 200 and body["tokens"] == expected
    reply = [*messages, {"role": "assistant", "content": "Hel"}]
    request = {"messages": reply, "continue_final_message": True, "add_generation_prompt": False}
    status, body = raw(server, "POST", "/tokenize", request)
    expected = chat_prompt(reply, CHAT_TEMPLATE, False).removesuffix("\n")
    assert status == 200 and body["tokens"] == encode(tokenizer, expected)
    both = {"messages": reply, "continue_final_message": True, "add_generation_prompt": True}
    assert raw(server, "POST", "/tokenize", both)[1]["error"]["param"] == "continue_final_message"
    status, info = raw(server, "GET", "/tokenizer_info")
    assert status == 200 and info["eos_token"] == "<|end_of_text|>"
    assert info["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert info["chat_template"] == CHAT_TEMPLATE
    assert raw(server, "POST", "/tokenize", {"model": "nope", "prompt": "x"})[0] == 404
    status, body = raw(server, "POST", "/detokenize", {"tokens": [10**6]})
    assert status == 400 and body["error"]["param"] == "tokens"
    assert raw(server, "GET", "/version") == (200, {"version": __version__})


def metrics(server) -> dict[str, float]:
    """Every sample of /metrics by name and labels."""
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    conn.request("GET", "/metrics")
    response = conn.getresponse()
    assert response.status == 200 and response.getheader("content-type").startswith("text/plain")
    samples = {}
    for family in parser.text_string_to_metric_families(response.read().decode()):
        for sample in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()) if k != "le")
            if "le" not in sample.labels:
                samples[f"{sample.name}{{{labels}}}"] = sample.value
    return samples


def test_metrics_move_with_requests(server, client) -> None:
    model = "model_name=tiny_hf0"
    before = metrics(server)
    assert before[f"pipe:num_requests_running{{{model}}}"] >= 0
    assert f"pipe:num_requests_waiting{{{model}}}" in before
    client.completions.create(
        model="tiny_hf0", prompt=PROMPT, max_tokens=5, n=2, extra_body={"top_k": 1}
    )
    after = metrics(server)

    def moved(name: str) -> float:
        return after[f"{name}{{{model}}}"] - before.get(f"{name}{{{model}}}", 0)

    success = f"pipe:request_success_total{{finished_reason=length,{model}}}"
    assert after[success] - before.get(success, 0) == 2
    assert moved("pipe:generation_tokens_total") == 10
    assert moved("pipe:prompt_tokens_total") > 0
    assert moved("pipe:time_to_first_token_seconds_count") == 2
    assert moved("pipe:e2e_request_latency_seconds_count") == 2
    assert moved("pipe:request_queue_time_seconds_count") == 2
    assert moved("pipe:inter_token_latency_seconds_count") == 8


# ---- prefix caching ---------------------------------------------------------------------------


def test_usage_reports_cached_prompt_tokens(client, tokenizer) -> None:
    """A repeated prompt reads its full blocks of 8 from the prefix cache (never its last
    token's); the usage says how many, whole and streamed, in completions and chat."""
    prompt = "line 41: value of the cache " * 4
    size = len(encode(tokenizer, prompt))
    assert size > 17
    fields = {"model": "tiny_hf0", "prompt": prompt, "max_tokens": 2, "temperature": 0}
    first = client.completions.create(**fields)
    again = client.completions.create(**fields)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert again.usage.prompt_tokens_details.cached_tokens == (size - 1) // 8 * 8
    streamed = list(
        client.completions.create(**fields, stream=True, stream_options={"include_usage": True})
    )
    assert streamed[-1].usage.prompt_tokens_details.cached_tokens == (size - 1) // 8 * 8
    chat = {
        "model": "tiny_hf0",
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": 2,
        "temperature": 0,
    }
    client.chat.completions.create(**chat)
    answer = client.chat.completions.create(**chat)
    cached = answer.usage.prompt_tokens_details.cached_tokens
    assert cached == (answer.usage.prompt_tokens - 1) // 8 * 8 and cached > 0
    usage = {"include_usage": True}
    chunks = list(client.chat.completions.create(**chat, stream=True, stream_options=usage))
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == cached


def test_n_completions_prefill_their_prompt_once(server, client, tokenizer) -> None:
    """n = 8 is one engine group: the first completion computes the prompt, the other 7 read
    all of it but its last token (the metrics count the prompt tokens looked up and found)."""
    model = "model_name=tiny_hf0"
    prompt = "line 97: a prompt never sent before, " * 3
    size = len(encode(tokenizer, prompt))
    before = metrics(server)
    answer = client.completions.create(
        model="tiny_hf0", prompt=prompt, max_tokens=2, n=8, temperature=1.0, seed=3
    )
    after = metrics(server)

    def moved(name: str) -> float:
        return after[f"{name}{{{model}}}"] - before.get(f"{name}{{{model}}}", 0)

    assert len(answer.choices) == 8 and answer.usage.prompt_tokens == size
    assert answer.usage.prompt_tokens_details.cached_tokens == 0  # the first completion's
    assert moved("pipe:prefix_cache_queries_total") == 8 * size
    assert moved("pipe:prefix_cache_hits_total") == 7 * (size - 1)


# ---- vLLM's request fields (pipeline.serve.http.vllm_fields) ---------------------------------

BODIES = {
    "chat": ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}]}),
    "completion": ("/v1/completions", {"prompt": PROMPT}),
}


@pytest.fixture(scope="module")
def hf_tokenizer(tiny_hf_dir):
    """transformers' own tokenizer of the served model: the text oracle."""
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(tiny_hf_dir)


def _text(body: dict) -> str:
    choice = body["choices"][0]
    return choice["text"] if "text" in choice else choice["message"]["content"]


@pytest.mark.parametrize("kind", sorted(BODIES))
def test_refused_fields_are_a_400_naming_them_unless_at_vllms_default(server, kind) -> None:
    """Every field the inventory refuses, sent with a value that asks for something, is a 400
    naming it; sent at vLLM's default (clients send defaults) it is served; an ignored field
    changes nothing of the answer."""
    from pipeline.serve.http.vllm_fields import FIELDS, fields_with

    path, base = BODIES[kind]
    base = {**base, "max_tokens": 3, "temperature": 0}
    status, plain = raw(server, "POST", path, base)
    assert status == 200, plain
    for name in fields_with(kind, "refused"):
        rule = FIELDS[kind][name]
        status, body = raw(server, "POST", path, {**base, name: rule.example})
        assert status == 400 and body["error"]["param"] == name, (name, body)
        assert name in body["error"]["message"]
        status, body = raw(server, "POST", path, {**base, name: rule.default})
        assert status == 200 and _text(body) == _text(plain), (name, body)
    for name in fields_with(kind, "ignored"):
        status, body = raw(server, "POST", path, {**base, name: FIELDS[kind][name].example})
        assert status == 200 and _text(body) == _text(plain), (name, body)


def test_special_tokens_are_left_out_of_the_text_unless_asked(server, hf_tokenizer) -> None:
    """vLLM's default `skip_special_tokens: true`, whole and streamed, chat and completions:
    the text is what transformers decodes from the same ids."""
    special = hf_tokenizer.all_special_ids
    words = hf_tokenizer.encode("line value", add_special_tokens=False)
    fields = {
        "prompt": PROMPT,
        "max_tokens": 12,
        "temperature": 1.0,
        "seed": 5,
        "ignore_eos": True,
        "return_token_ids": True,
        "allowed_token_ids": sorted(set(special + words)),
    }
    for skip in (None, True, False):
        asked = fields if skip is None else {**fields, "skip_special_tokens": skip}
        status, body = raw(server, "POST", "/v1/completions", asked)
        ids = body["choices"][0]["token_ids"]
        assert status == 200 and set(ids) <= set(fields["allowed_token_ids"])
        assert set(ids) & set(special) and set(ids) - set(special)  # both kinds are there
        expected = hf_tokenizer.decode(ids, skip_special_tokens=skip is not False)
        assert body["choices"][0]["text"] == expected
        streamed = raw_stream(server, "/v1/completions", {**asked, "return_token_ids": False})
        assert "".join(c["choices"][0]["text"] for c in streamed if c["choices"]) == expected
    only = {
        "messages": [{"role": "user", "content": "Hi"}],
        "max_tokens": 3,
        "allowed_token_ids": special[:1],
        "ignore_eos": True,
    }
    bos = hf_tokenizer.convert_ids_to_tokens(special[0])
    for skip, expected in ((None, ""), (False, bos * 3)):
        asked = only if skip is None else {**only, "skip_special_tokens": skip}
        status, body = raw(server, "POST", "/v1/chat/completions", asked)
        assert status == 200 and body["choices"][0]["message"]["content"] == expected
        streamed = raw_stream(server, "/v1/chat/completions", asked)
        deltas = [c["choices"][0]["delta"].get("content") or "" for c in streamed if c["choices"]]
        assert "".join(deltas) == expected
    status, body = raw(
        server,
        "POST",
        "/v1/completions",
        {**fields, "skip_special_tokens": False, "spaces_between_special_tokens": False},
    )
    assert status == 400 and body["error"]["param"] == "spaces_between_special_tokens"
    status, _ = raw(
        server, "POST", "/v1/completions", {**fields, "spaces_between_special_tokens": False}
    )
    assert status == 200  # special tokens skipped: nothing to space


def raw_stream(server, path: str, body: dict) -> list[dict]:
    """The chunks of a streamed answer, as JSON."""
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    conn.request(
        "POST", path, json.dumps({**body, "stream": True}), {"Content-Type": "application/json"}
    )
    lines = conn.getresponse().read().decode().splitlines()
    return [json.loads(line[6:]) for line in lines if line.startswith("data: {")]


def test_min_tokens_masks_the_stop_tokens_until_that_count(server) -> None:
    fields = {
        "prompt": PROMPT,
        "max_tokens": 10,
        "temperature": 0,
        "logit_bias": {"7": 100},
        "stop_token_ids": [7],
        "return_token_ids": True,
    }
    status, body = raw(server, "POST", "/v1/completions", {**fields, "min_tokens": 5})
    ids = body["choices"][0]["token_ids"]
    assert status == 200 and 7 not in ids[:5] and ids[5:] == [7]
    assert body["choices"][0]["finish_reason"] == "stop"
    assert raw(server, "POST", "/v1/completions", fields)[1]["choices"][0]["token_ids"] == [7]
    status, body = raw(server, "POST", "/v1/completions", {**fields, "min_tokens": 11})
    assert status == 400 and body["error"]["param"] == "min_tokens"


def _contains(ids: list[int], part: list[int]) -> bool:
    return any(ids[i : i + len(part)] == part for i in range(len(ids) - len(part) + 1))


def test_bad_words_never_appear(server, hf_tokenizer) -> None:
    """A word the greedy answer writes, banned: none of the token sequences it is written as
    (alone, and after a space) appears any more."""
    fields = {
        "prompt": PROMPT,
        "max_tokens": 12,
        "temperature": 0,
        "ignore_eos": True,
        "return_token_ids": True,
    }
    plain = raw(server, "POST", "/v1/completions", fields)[1]["choices"][0]
    word = hf_tokenizer.decode(plain["token_ids"][2:4]).strip()
    assert word and word in plain["text"]
    banned = raw(server, "POST", "/v1/completions", {**fields, "bad_words": [word]})[1]
    ids = banned["choices"][0]["token_ids"]
    alone = hf_tokenizer.encode(word, add_special_tokens=False)
    spaced = hf_tokenizer.encode(" " + word, add_special_tokens=False)
    assert not _contains(ids, alone)
    assert len(spaced) != len(alone) or not _contains(ids, spaced)
    assert ids != plain["token_ids"]


def test_include_stop_str_in_output(server) -> None:
    fields = {"prompt": PROMPT, "max_tokens": 12, "temperature": 0, "ignore_eos": True}
    text = raw(server, "POST", "/v1/completions", fields)[1]["choices"][0]["text"]
    stop = text[4:7]
    at = text.find(stop)
    stopped = {**fields, "stop": [stop]}
    assert _text(raw(server, "POST", "/v1/completions", stopped)[1]) == text[:at]
    kept = {**stopped, "include_stop_str_in_output": True}
    assert _text(raw(server, "POST", "/v1/completions", kept)[1]) == text[: at + len(stop)]
    streamed = raw_stream(server, "/v1/completions", kept)
    assert (
        "".join(c["choices"][0]["text"] for c in streamed if c["choices"]) == text[: at + len(stop)]
    )


def test_truncate_prompt_tokens_keeps_the_last_tokens(server, tokenizer) -> None:
    ids = encode(tokenizer, PROMPT)
    fields = {"max_tokens": 4, "temperature": 0, "return_token_ids": True}
    for side, kept in ((None, ids[-3:]), ("left", ids[-3:]), ("right", ids[:3])):
        asked = {**fields, "prompt": PROMPT, "truncate_prompt_tokens": 3}
        if side is not None:
            asked["truncation_side"] = side
        cut = raw(server, "POST", "/v1/completions", asked)[1]
        direct = raw(server, "POST", "/v1/completions", {**fields, "prompt": kept})[1]
        assert cut["choices"][0]["prompt_token_ids"] == kept and cut["usage"]["prompt_tokens"] == 3
        assert cut["choices"][0]["text"] == direct["choices"][0]["text"]
    whole = raw(
        server,
        "POST",
        "/v1/completions",
        {**fields, "prompt": PROMPT, "truncate_prompt_tokens": -1},
    )[1]
    assert whole["choices"][0]["prompt_token_ids"] == ids
    status, body = raw(
        server,
        "POST",
        "/v1/completions",
        {**fields, "prompt": PROMPT, "truncate_prompt_tokens": 10**6},
    )
    assert status == 400 and body["error"]["param"] == "truncate_prompt_tokens"


def test_chat_template_fields_reach_the_template(server) -> None:
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "line 3"}]
    for extra in (
        {"add_generation_prompt": False},
        {"add_generation_prompt": False, "continue_final_message": True},
    ):
        count = raw(server, "POST", "/tokenize", {"messages": messages, **extra})[1]["count"]
        status, body = raw(
            server, "POST", "/v1/chat/completions", {"messages": messages, "max_tokens": 1, **extra}
        )
        assert status == 200 and body["usage"]["prompt_tokens"] == count
    plain = raw(server, "POST", "/tokenize", {"messages": messages})[1]["count"]
    assert count != plain
    status, body = raw(
        server,
        "POST",
        "/v1/chat/completions",
        {"messages": messages, "continue_final_message": True},
    )
    assert status == 400 and body["error"]["param"] == "continue_final_message"
    status, body = raw(
        server,
        "POST",
        "/v1/chat/completions",
        {"messages": messages, "chat_template_kwargs": {"chat_template": "x"}},
    )
    assert status == 400 and body["error"]["param"] == "chat_template_kwargs"


def test_request_id_names_the_response(server) -> None:
    for path, base in BODIES.values():
        body = raw(server, "POST", path, {**base, "max_tokens": 1, "request_id": "abc"})[1]
        assert body["id"].endswith("-abc")


def test_chat_token_ids_echo_and_token_id_names(server, hf_tokenizer, tiny_hf_dir) -> None:
    """Chat's `return_token_ids` (the ids decode to the reply, the prompt's are /tokenize's),
    `echo` (the last message's text first, when the reply takes its role) and
    `return_tokens_as_token_ids`, whole and streamed."""
    messages = [{"role": "user", "content": "Hi"}]
    fields = {"messages": messages, "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    status, body = raw(server, "POST", "/v1/chat/completions", {**fields, "return_token_ids": True})
    choice = body["choices"][0]
    assert status == 200 and len(choice["token_ids"]) == 4
    expected = served_text(tiny_hf_dir, body["prompt_token_ids"], choice["token_ids"])
    assert choice["message"]["content"] == expected
    tokenized = raw(server, "POST", "/tokenize", {"messages": messages})[1]["tokens"]
    assert body["prompt_token_ids"] == tokenized and "prompt_text" not in body
    with_text = {**fields, "return_prompt_text": True}
    rendered = raw(server, "POST", "/v1/chat/completions", with_text)[1]["prompt_text"]
    assert rendered == "<|user|>Hi\n<|assistant|>"  # conftest's CHAT_TEMPLATE
    assert raw_stream(server, "/v1/chat/completions", with_text)[0]["prompt_text"] == rendered
    chunks = raw_stream(server, "/v1/chat/completions", {**fields, "return_token_ids": True})
    assert chunks[0]["prompt_token_ids"] == tokenized
    assert (
        sum((c["choices"][0].get("token_ids") or [] for c in chunks if c["choices"]), [])
        == choice["token_ids"]
    )
    open_turn = {**fields, "add_generation_prompt": False}
    reply = _text(raw(server, "POST", "/v1/chat/completions", open_turn)[1])
    last_user = {**open_turn, "echo": True}
    echoed = raw(server, "POST", "/v1/chat/completions", last_user)[1]["choices"][0]["message"]
    assert echoed["role"] == "user" and echoed["content"] == "Hi" + reply
    streamed = raw_stream(server, "/v1/chat/completions", last_user)
    deltas = [c["choices"][0]["delta"].get("content") or "" for c in streamed if c["choices"]]
    assert "".join(deltas) == echoed["content"]
    assistant = [*messages, {"role": "assistant", "content": "line"}]
    not_same_role = {**fields, "messages": assistant, "echo": True}
    answer = raw(server, "POST", "/v1/chat/completions", not_same_role)[1]["choices"][0]
    prefill = {**fields, "messages": assistant}
    assert answer["message"]["content"] == "line" + _text(
        raw(server, "POST", "/v1/chat/completions", prefill)[1]
    )
    named = raw(
        server,
        "POST",
        "/v1/chat/completions",
        {**fields, "logprobs": True, "return_tokens_as_token_ids": True, "return_token_ids": True},
    )[1]["choices"][0]
    assert [e["token"] for e in named["logprobs"]["content"]] == [
        f"token_id:{t}" for t in named["token_ids"]
    ]
    completion = raw(
        server,
        "POST",
        "/v1/completions",
        {
            "prompt": PROMPT,
            "max_tokens": 3,
            "temperature": 0,
            "logprobs": 1,
            "return_tokens_as_token_ids": True,
            "return_token_ids": True,
        },
    )[1]
    choice = completion["choices"][0]
    assert choice["logprobs"]["tokens"] == [f"token_id:{t}" for t in choice["token_ids"]]


def test_prompt_logprobs_as_transformers_computes_them(server, tiny_hf_dir, tokenizer) -> None:
    """vLLM's `prompt_logprobs`: per prompt token its logprob and rank, then the best
    alternatives, against transformers' model on the same weights; chat has them at the
    answer's level (and with echo, as vLLM does); not streamed."""
    transformers = pytest.importorskip("transformers")
    import torch

    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_hf_dir).eval()
    ids = encode(tokenizer, PROMPT)
    with torch.no_grad():
        expected = model(torch.tensor([ids])).logits[0].float().log_softmax(-1)
    fields = {"prompt": PROMPT, "max_tokens": 1, "prompt_logprobs": 2}
    found = raw(server, "POST", "/v1/completions", fields)[1]["choices"][0]["prompt_logprobs"]
    assert found[0] is None and len(found) == len(ids)
    for position, (token, entry) in enumerate(zip(ids[1:], found[1:])):
        row = expected[position]
        own = entry[str(token)]
        assert own["logprob"] == pytest.approx(row[token].item(), abs=1e-4)
        assert own["rank"] == int((row >= row[token]).sum())
        assert own["decoded_token"] == tokenizer.decode([token])
        best = row.topk(2).indices.tolist()
        assert list(entry) == [str(t) for t in dict.fromkeys([token, *best])]
        for rank, other in enumerate(best, 1):
            assert entry[str(other)]["rank"] == rank
            assert entry[str(other)]["logprob"] == pytest.approx(row[other].item(), abs=1e-4)
    chat = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}
    answer = raw(server, "POST", "/v1/chat/completions", {**chat, "prompt_logprobs": 1})[1]
    assert len(answer["prompt_logprobs"]) == answer["usage"]["prompt_tokens"]
    assert all(len(e) in (1, 2) for e in answer["prompt_logprobs"][1:])
    echoed = raw(server, "POST", "/v1/chat/completions", {**chat, "echo": True})[1]
    assert all(len(e) == 1 for e in echoed["prompt_logprobs"][1:])
    assert "prompt_logprobs" not in raw(server, "POST", "/v1/chat/completions", chat)[1]
    status, body = raw(server, "POST", "/v1/completions", {**fields, "stream": True})
    assert status == 400 and body["error"]["param"] == "prompt_logprobs"
    # blocks a scoring request cached (without ranks) do not serve a request for ranks
    long = {"prompt": "line 12: value of ranks " * 4, "max_tokens": 1}
    for _ in range(2):
        scored = raw(server, "POST", "/v1/completions", {**long, "echo": True, "logprobs": 1})[1]
        assert "prompt_logprobs" not in scored["choices"][0]  # not asked: no ranks computed
    ranked = raw(server, "POST", "/v1/completions", {**long, "prompt_logprobs": 1})[1]
    entries = ranked["choices"][0]["prompt_logprobs"][1:]
    assert all(isinstance(e[k]["rank"], int) for e in entries for k in e)


def test_cache_salt_shares_cached_blocks_only_within_a_salt(server, tokenizer) -> None:
    prompt = "line 77: a salted value " * 4
    full = (len(encode(tokenizer, prompt)) - 1) // 8 * 8
    fields = {"prompt": prompt, "max_tokens": 2, "temperature": 0}

    def cached(**extra) -> int:
        body = raw(server, "POST", "/v1/completions", {**fields, **extra})[1]
        return body["usage"]["prompt_tokens_details"]["cached_tokens"]

    assert [cached(cache_salt="a"), cached(cache_salt="a")] == [0, full]
    salted_b = [cached(cache_salt="b"), cached(), cached(), cached(cache_salt="b")]
    assert salted_b == [0, 0, full, full]
    status, body = raw(server, "POST", "/v1/completions", {**fields, "cache_salt": ""})
    assert status == 400
