"""A chat request's `tools`, its assistant `tool_calls` and `tool` messages reach the chat template
as transformers' `apply_chat_template(messages, tools=tools)` renders them: Meta's Llama 3.1
template and Qwen 2.5's Hermes-style one (as TRL ships them), over the real Llama 3 tokenizer.

The client sends `arguments` as JSON text (OpenAI's form); transformers' documented form, which
these templates are written for, is an object: pipe turns one into the other, as vLLM does."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pipeline.serve.http.codec import Codec
from pipeline.serve.http.openai_api import ChatBody
from pipeline.tokenizer.chat_template import load_chat_template
from tests.tokenizer.test_chat_template import hf_tokenizer, with_template

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city.",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                "required": ["city"],
            },
        },
    },
    {"type": "function", "function": {"name": "now", "description": "The time."}},
]
ARGUMENTS = {"city": "Zürich", "days": 2}


def conversation(arguments) -> list[dict]:
    """A user turn, the assistant's call (`arguments` as given), the tool's answer."""
    call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": arguments},
    }
    return [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Zürich?"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 3}'},
    ]


def trl_template(name: str) -> str:
    trl = pytest.importorskip("trl")
    path = Path(trl.__file__).parent / "chat_templates" / f"{name}.jinja"
    if not path.is_file():
        pytest.skip(f"this trl has no {name} chat template")
    return path.read_text()


@pytest.mark.parametrize("template", ["llama3_1", "qwen2_5"])
def test_tools_render_as_transformers(template, llama3_dir, tmp_path) -> None:
    directory = with_template(llama3_dir, tmp_path / template, trl_template(template))
    kwargs = {"date_string": "26 Jul 2024"}  # Llama 3.1's template prints today's date
    expected = hf_tokenizer(directory).apply_chat_template(
        conversation(ARGUMENTS), tools=TOOLS, tokenize=False, add_generation_prompt=True, **kwargs
    )
    body = ChatBody(messages=conversation(json.dumps(ARGUMENTS)), tools=TOOLS)
    codec = Codec(None, load_chat_template(directory), vocab_size=1)
    ours = codec.chat(body.messages, tools=body.tools, extra=kwargs)
    assert ours == expected
    assert '"name": "now"' in ours and '"Zürich"' in ours  # the tools and the call are there
