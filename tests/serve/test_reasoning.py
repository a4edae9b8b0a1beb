"""`pipe serve --reasoning-parser`: the reply's thinking apart from its content, as vLLM's parsers
of the same names split it.

The parsers' rules are checked on replies written out (each expectation is what vLLM 0.32's
parser returned for the same text: scripts/bench/vllm_reasoning_oracle.py); the server on a tiny
Llama trained here to answer with a `<think>` block under Qwen3's own chat template (from trl),
through the official `openai` client, whole and streamed; and, where vLLM's CPU build is
installed (`PIPE_VLLM_PYTHON`, default /work/venv-vllm/bin/python), against vLLM's parser run
on the very token ids the model wrote.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from pipeline.tokenizer.reasoning import REASONING_FORMATS, ReasoningServing
from tests.builders import llama_answering, with_think_tokens

REPLY = "<think>\nline 3 value\n</think>\n\nthe answer"
THINKING, ANSWER = "\nline 3 value\n", "\n\nthe answer"
QUESTION = [{"role": "user", "content": "line 7"}]
ROOT = Path(__file__).resolve().parents[2]
VLLM_PYTHON = os.environ.get("PIPE_VLLM_PYTHON", "/work/venv-vllm/bin/python")

# (parser, chat_template_kwargs, reply) -> vLLM 0.32's (reasoning, content) of the whole reply
VLLM_SPLITS = [
    ("qwen3", {}, REPLY, (THINKING, ANSWER)),
    ("qwen3", {}, "line 3 value\n</think>\n\nthe answer", ("line 3 value\n", ANSWER)),
    ("qwen3", {}, "<think>\nline 3 value", ("\nline 3 value", None)),
    ("qwen3", {}, "no think here", ("no think here", None)),
    ("qwen3", {}, "<think></think>", (None, None)),
    ("qwen3", {}, "</think>abc", (None, "abc")),
    ("qwen3", {}, "<think>a</think>", ("a", None)),
    ("qwen3", {"enable_thinking": False}, REPLY, (None, REPLY)),
    ("deepseek_r1", {}, REPLY, (THINKING, ANSWER)),
    ("deepseek_r1", {"enable_thinking": False}, REPLY, (THINKING, ANSWER)),
    ("deepseek_r1", {}, "<think></think>", ("", None)),
    ("deepseek_r1", {}, "</think>abc", ("", "abc")),
    ("glm45", {}, REPLY, ("\nline 3 value", ANSWER)),
    ("glm45", {}, "<think>\nline 3 value", ("\nline 3 value", None)),
    ("glm45", {"enable_thinking": False}, REPLY, (None, REPLY)),
    ("mistral", {}, REPLY, (None, REPLY)),
    # special markers left out of the text split nothing (vLLM's, on a Hugging Face tokenizer)
    ("mistral", {}, "[THINK]line 3[/THINK]the answer", (None, "line 3the answer")),
]


@pytest.fixture(scope="module")
def think_tokenizer(tiny_tokenizer_dir, tmp_path_factory) -> Path:
    """The tiny tokenizer with Qwen3's markers (`<think>` and `</think>` as plain added tokens,
    as Qwen3 has them) and special tokens, and Qwen3's chat template from trl."""
    pytest.importorskip("tokenizers")
    trl = pytest.importorskip("trl")
    template = Path(trl.__file__).parent / "chat_templates" / "qwen3.jinja"
    if not template.exists():
        pytest.skip("trl ships no Qwen3 chat template")
    directory = with_think_tokens(tiny_tokenizer_dir, tmp_path_factory.mktemp("think_tok"))
    config = json.loads((directory / "tokenizer_config.json").read_text())
    config.update(chat_template=template.read_text(), eos_token="<|im_end|>")
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return directory


def _encoder(directory: Path):
    import tokenizers

    tok = tokenizers.Tokenizer.from_file(str(directory / "tokenizer.json"))
    return tok, lambda text: tok.encode(text, add_special_tokens=False).ids


@pytest.mark.parametrize("parser, kwargs, reply, expected", VLLM_SPLITS)
def test_whole_and_streamed_splits_are_vllms(think_tokenizer, parser, kwargs, reply, expected):
    tok, encode = _encoder(think_tokenizer)
    serving = ReasoningServing.of(parser, encode)
    ids = encode(reply)
    text = tok.decode(ids, skip_special_tokens=True)
    reasoning, content = serving.reader(kwargs).whole(text, ids)
    assert (reasoning, content or None) == expected
    reader, streamed, done = serving.reader(kwargs), ["", ""], ""
    for n in range(len(ids)):  # one token a delta, as the engine streams
        now = tok.decode(ids[: n + 1], skip_special_tokens=True)
        piece = reader.push(now[len(done) :], ids[n : n + 1])
        streamed = [streamed[0] + piece[0], streamed[1] + piece[1]]
        done = now
    assert streamed == [expected[0] or "", expected[1] or ""]


def test_a_parser_needs_its_markers_in_the_vocabulary(tiny_tokenizer_dir) -> None:
    _, encode = _encoder(tiny_tokenizer_dir)
    with pytest.raises(ValueError, match="no <think> / </think> token"):
        ReasoningServing.of("qwen3", encode)
    with pytest.raises(ValueError, match="choose from"):
        ReasoningServing.of("nope", encode)


def test_the_cli_offers_every_format() -> None:
    from pipeline.serve.commands import REASONING_PARSERS

    assert tuple(REASONING_FORMATS) == REASONING_PARSERS


def _render(directory: Path, messages: list[dict], **kwargs) -> str:
    transformers = pytest.importorskip("transformers")
    tok = transformers.PreTrainedTokenizerFast(tokenizer_file=str(directory / "tokenizer.json"))
    template = json.loads((directory / "tokenizer_config.json").read_text())["chat_template"]
    return tok.apply_chat_template(
        messages, chat_template=template, tokenize=False, add_generation_prompt=True, **kwargs
    )


@pytest.fixture(scope="module")
def thinking_model(think_tokenizer, tmp_path_factory) -> Path:
    """A tiny Llama that answers QUESTION (under Qwen3's template) with REPLY: trained on that
    one conversation until greedy decoding writes it back."""
    pytest.importorskip("transformers")
    tok, encode = _encoder(think_tokenizer)
    prompt = encode(_render(think_tokenizer, QUESTION))
    reply = encode(REPLY + "<|im_end|>")
    model = llama_answering(prompt, reply, tok.get_vocab_size(), encode("<|im_end|>")[0])
    directory = tmp_path_factory.mktemp("thinking_model")
    model.save_pretrained(directory)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (directory / name).write_bytes((think_tokenizer / name).read_bytes())
    return directory


@pytest.fixture(scope="module")
def reasoning_server(thinking_model, tmp_path_factory):
    from tests.serve.test_server import Server

    log = tmp_path_factory.mktemp("reasoning_server") / "stderr.txt"
    server = Server(thinking_model, log, "--dtype", "fp32", "--reasoning-parser", "qwen3")
    yield server
    server.stop()


@pytest.fixture(scope="module")
def client(reasoning_server):
    openai = pytest.importorskip("openai")
    return openai.OpenAI(
        base_url=f"http://127.0.0.1:{reasoning_server.port}/v1",
        api_key="x",
        max_retries=0,
        timeout=120,
    )


def _ask(client, stream: bool = False, **extra):
    return client.chat.completions.create(
        model=client.models.list().data[0].id,
        messages=QUESTION,
        max_tokens=24,
        temperature=0,
        stream=stream,
        extra_body={"return_token_ids": True, **extra},
    )


def test_the_openai_client_reads_reasoning_apart_from_content(client) -> None:
    answer = _ask(client)
    message = answer.choices[0].message
    assert message.reasoning_content == THINKING and message.reasoning == THINKING
    assert message.content == ANSWER
    assert answer.choices[0].finish_reason == "stop"


def test_streamed_reasoning_then_content(client) -> None:
    chunks = list(_ask(client, stream=True))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    thinking = "".join(getattr(d, "reasoning_content", None) or "" for d in deltas)
    content = "".join(d.content or "" for d in deltas)
    assert (thinking, content) == (THINKING, ANSWER)
    # vLLM's order: every reasoning delta before the first content one (a slow reader may get
    # both in one delta, the reasoning first)
    kinds = []
    for d in deltas:
        kinds += ["r"] if getattr(d, "reasoning_content", None) else []
        kinds += ["c"] if d.content else []
    assert kinds == sorted(kinds, reverse=True) and "r" in kinds and "c" in kinds


def test_include_reasoning_false_hides_it(client) -> None:
    message = _ask(client, include_reasoning=False).choices[0].message
    assert message.reasoning_content is None and message.content == ANSWER


def test_enable_thinking_reaches_the_template(client, think_tokenizer) -> None:
    answer = _ask(
        client,
        chat_template_kwargs={"enable_thinking": False},
        return_prompt_text=True,
    )
    expected = _render(think_tokenizer, QUESTION, enable_thinking=False)
    assert answer.model_extra["prompt_text"] == expected
    assert expected.endswith("<think>\n\n</think>\n\n")
    message = answer.choices[0].message
    assert message.reasoning_content is None  # thinking off: the whole reply is content
    assert message.content


@pytest.mark.skipif(not Path(VLLM_PYTHON).exists(), reason="vLLM's CPU build is not installed")
def test_the_split_equals_vllms_parser_on_the_models_tokens(client, think_tokenizer) -> None:
    answer = _ask(client)
    ids = answer.choices[0].token_ids
    streamed = [
        c.choices[0]
        for c in _ask(client, stream=True)
        if c.choices and getattr(c.choices[0], "token_ids", None)
    ]
    chunk_sizes = [len(choice.token_ids) for choice in streamed]
    case = {"parser": "qwen3", "token_ids": ids, "chunks": chunk_sizes}
    run = subprocess.run(
        [VLLM_PYTHON, str(ROOT / "scripts/bench/vllm_reasoning_oracle.py"), str(think_tokenizer)],
        input=json.dumps([case]),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    vllm = json.loads(run.stdout)[0]
    message = answer.choices[0].message
    assert [message.reasoning_content, message.content] == vllm["whole"]
    ours = [
        (getattr(choice.delta, "reasoning_content", None), choice.delta.content or None)
        for choice in streamed
    ]
    theirs = [tuple(x or None for x in d) if d else (None, None) for d in vllm["stream"]]
    assert ours == theirs


def test_the_responses_api_gives_a_reasoning_item(client) -> None:
    response = client.responses.create(
        model=client.models.list().data[0].id, input=QUESTION, temperature=0
    )
    assert [item.type for item in response.output] == ["reasoning", "message"]
    assert response.output[0].content[0].text == THINKING
    assert response.output_text == ANSWER
    assert response.usage.output_tokens_details.reasoning_tokens > 0
    events = list(
        client.responses.create(model=response.model, input=QUESTION, temperature=0, stream=True)
    )
    thinking = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert (thinking, text) == (THINKING, ANSWER)
    done = [e.item.type for e in events if e.type == "response.output_item.done"]
    assert done == ["reasoning", "message"]
    cut = client.responses.create(
        model=response.model, input=QUESTION, temperature=0, max_output_tokens=3
    )
    assert cut.status == "incomplete" and cut.incomplete_details.reason == "max_output_tokens"
    assert cut.usage.output_tokens == 3
