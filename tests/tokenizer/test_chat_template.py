"""Chat templates render as transformers' `apply_chat_template(tokenize=False)` renders them:
the real Llama 3 tokenizer, and small templates exercising each feature templates use."""

from __future__ import annotations

import json
import shutil
from datetime import datetime
from pathlib import Path

import pytest

from pipeline.tokenizer.chat_template import (
    ChatTemplate,
    ChatTemplateError,
    load_chat_template,
    special_tokens,
)

CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hi, café?"},
    {"role": "assistant", "content": "Yes."},
    {"role": "user", "content": "  And tea?  "},
]


def hf_tokenizer(directory: Path):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(str(directory))


def with_template(tokenizer_dir: Path, out: Path, template, **config) -> Path:
    """A copy of `tokenizer_dir` whose tokenizer_config.json has `template` (and `config`)."""
    out.mkdir(parents=True, exist_ok=True)
    shutil.copy(tokenizer_dir / "tokenizer.json", out / "tokenizer.json")
    tokenizer_config = json.loads((tokenizer_dir / "tokenizer_config.json").read_text())
    tokenizer_config.pop("chat_template", None)
    if template is not None:
        tokenizer_config["chat_template"] = template
    (out / "tokenizer_config.json").write_text(json.dumps({**tokenizer_config, **config}))
    return out


def assert_renders_as_transformers(directory: Path, messages, **kwargs) -> str:
    ours = load_chat_template(directory)
    theirs = hf_tokenizer(directory)
    for prompt in (False, True):
        expected = theirs.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=prompt, **kwargs
        )
        assert ours.render(messages, add_generation_prompt=prompt, **kwargs).text == expected
    return expected


def test_llama3_template_renders_as_transformers(llama3_dir) -> None:
    text = assert_renders_as_transformers(llama3_dir, CONVERSATION)
    assert text.startswith("<|begin_of_text|><|start_header_id|>system")  # its bos_token


FEATURES = {
    "special_tokens": "{{ bos_token }}{% for m in messages %}{{ m.content }}{{ eos_token }}"
    "{% endfor %}{{ unk_token }}|{{ pad_token }}|{{ image_token }}",
    "loop_controls": "{% for m in messages %}{% if m.role == 'system' %}{% continue %}{% endif %}"
    "{% if loop.index > 3 %}{% break %}{% endif %}[{{ m.role }}]{{ m.content }}\n{% endfor %}",
    "tojson": "{{ messages | tojson }}|{{ messages[0] | tojson(indent=2, sort_keys=True) }}"
    "|{{ tools | tojson }}|{{ documents | tojson }}",
    "namespace_and_dict": "{% set ns = namespace(n=0) %}{% for m in messages %}"
    "{% set ns.n = ns.n + m.content | length %}{% endfor %}{{ ns.n }}"
    "{{ dict(a=1) | tojson }}{{ extra_flag }}",
    "whitespace": "{% for m in messages %}\n    {% if m.role == 'user' %}\n"
    "  <u>{{ m.content | trim }}</u>\n    {% endif %}\n{% endfor %}"
    "{% if add_generation_prompt %}\n<a>{% endif %}",
    "missing_keys": "{% for m in messages %}{% if m.name is defined %}{{ m.name }}:{% endif %}"
    "{{ m.content }}{% if m.reasoning_content %}<think>{{ m.reasoning_content }}</think>"
    "{% endif %}{% endfor %}",
}


@pytest.mark.parametrize("feature", sorted(FEATURES))
def test_feature_renders_as_transformers(feature, tiny_tokenizer_dir, tmp_path) -> None:
    directory = with_template(
        tiny_tokenizer_dir,
        tmp_path,
        FEATURES[feature],
        bos_token="<s>",
        pad_token="<pad>",
        eos_token={"__type": "AddedToken", "content": "</s>", "special": True},
        extra_special_tokens={"image_token": "<image>"},
    )
    messages = [*CONVERSATION, {"role": "assistant", "content": "ok", "name": None}]
    messages[2] = {**messages[2], "name": "bot", "reasoning": "thought about it"}
    tools = [{"type": "function", "function": {"name": "f", "description": "ünïcode"}}]
    documents = [{"title": "T", "text": "body"}]
    kwargs = {"tools": tools, "documents": documents, "extra_flag": "!"}
    assert_renders_as_transformers(directory, messages, **kwargs)


def test_special_tokens_accept_added_token_dicts(tmp_path) -> None:
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "bos_token": {"content": "<s>", "lstrip": False},
                "eos_token": "</s>",
                "additional_special_tokens": ["<a>", {"content": "<b>"}],
            }
        )
    )
    (tmp_path / "special_tokens_map.json").write_text(json.dumps({"unk_token": "<unk>"}))
    assert special_tokens(tmp_path) == {
        "bos_token": "<s>",
        "eos_token": "</s>",
        "unk_token": "<unk>",
        "additional_special_tokens": ["<a>", "<b>"],
    }


def test_raise_exception_is_one_error(tiny_tokenizer_dir, tmp_path) -> None:
    template = (
        "{% for m in messages %}{% if (m.role == 'user') != (loop.index0 % 2 == 0) %}"
        "{{ raise_exception('Conversation roles must alternate\nuser/assistant') }}"
        "{% endif %}{{ m.content }}{% endfor %}"
    )
    directory = with_template(tiny_tokenizer_dir, tmp_path, template)
    bad = [{"role": "assistant", "content": "first"}]
    with pytest.raises(Exception, match="roles must alternate"):
        hf_tokenizer(directory).apply_chat_template(bad, tokenize=False)
    with pytest.raises(ChatTemplateError) as caught:
        load_chat_template(directory).render(bad)
    assert str(caught.value) == "Conversation roles must alternate user/assistant"
    good = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]
    assert load_chat_template(directory).render(good).text == "ab"


@pytest.mark.parametrize(
    ("template", "message"),
    [
        ("{{ messages[0].content + 1 }}", "can only concatenate str"),
        ("{% for m in messages %}{{ m.content }}", "line 1: Unexpected end of template"),
        ("{{ messages | no_such_filter }}", "No filter named 'no_such_filter'"),
    ],
)
def test_template_errors_are_one_line(template, message) -> None:
    with pytest.raises(ChatTemplateError, match=message) as caught:
        ChatTemplate.from_string(template).render([{"role": "user", "content": "x"}])
    assert "\n" not in str(caught.value)


def test_strftime_now(tiny_tokenizer_dir, tmp_path) -> None:
    template = "Year {{ strftime_now('%Y') }}: {{ messages[0].content }}"
    directory = with_template(tiny_tokenizer_dir, tmp_path, template)
    text = assert_renders_as_transformers(directory, CONVERSATION[:1])
    assert text == f"Year {datetime.now().year}: Be brief."


GENERATION = (
    "{% for m in messages %}<|{{ m.role }}|>\n"
    "{% if m.role == 'assistant' %}{% generation %}{{ m.content }}<|end|>{% endgeneration %}"
    "{% else %}{{ m.content }}<|end|>{% endif %}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def test_generation_spans_match_transformers_mask(tiny_tokenizer_dir, tmp_path) -> None:
    directory = with_template(tiny_tokenizer_dir, tmp_path, GENERATION)
    messages = [*CONVERSATION, {"role": "assistant", "content": "Tea, too."}]
    rendered = load_chat_template(directory).render(messages)
    assert [rendered.text[a:b] for a, b in rendered.generation_spans] == [
        "Yes.<|end|>",
        "Tea, too.<|end|>",
    ]
    tokenizer = hf_tokenizer(directory)
    assert rendered.text == tokenizer.apply_chat_template(messages, tokenize=False)
    encoded = tokenizer.apply_chat_template(
        messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
    )
    encoding = tokenizer(rendered.text, add_special_tokens=False, return_offsets_mapping=True)
    assert encoded["input_ids"] == encoding["input_ids"]
    ours = [
        int(any(start < b and end > a for a, b in rendered.generation_spans))
        for start, end in encoding["offset_mapping"]
    ]
    assert ours == encoded["assistant_masks"] and any(ours)


def test_named_templates_and_the_jinja_file(tiny_tokenizer_dir, tmp_path) -> None:
    named = [
        {"name": "default", "template": "D{{ messages[0].content }}"},
        {"name": "tool_use", "template": "T{{ tools | length }}"},
    ]
    directory = with_template(tiny_tokenizer_dir, tmp_path / "named", named)
    assert_renders_as_transformers(directory, CONVERSATION)
    assert_renders_as_transformers(directory, CONVERSATION, tools=[{"name": "f"}])
    ours = load_chat_template(directory)
    assert ours.render(CONVERSATION, template_name="tool_use", tools=[]).text == "T0"
    with pytest.raises(ChatTemplateError, match="no chat template named 'x'"):
        ours.render(CONVERSATION, template_name="x")

    jinja_dir = with_template(tiny_tokenizer_dir, tmp_path / "jinja", "ignored {{ 1 }}")
    (jinja_dir / "chat_template.jinja").write_text("{{ messages[-1].content }}|{{ bos_token }}")
    assert_renders_as_transformers(jinja_dir, CONVERSATION)
    assert load_chat_template(jinja_dir).render(CONVERSATION).text.startswith("  And tea?")


def test_no_template_is_none(tiny_tokenizer_dir, tmp_path) -> None:
    assert load_chat_template(with_template(tiny_tokenizer_dir, tmp_path, None)) is None


@pytest.mark.parametrize(
    "template",
    [
        "{{ messages.__class__.__mro__ }}",
        "{{ ''.__class__.__base__.__subclasses__() }}",
        "{{ raise_exception.__globals__ }}",
        "{{ dict.__class__ }}",
        "{% set ns = namespace() %}{% set ns._x = 1 %}{{ ns._x }}",
        "{{ namespace(__init__=1) }}",
        "{% set x = messages.append(1) %}{{ x }}",
        "{{ cycler.__init__.__globals__ }}",
        "{% for m in messages %}{{ loop.__class__.__mro__ }}{% endfor %}",
        "{% for m in messages %}{{ loop._iterator }}{{ loop.cycle.__func__ }}{% endfor %}",
    ],
)
def test_templates_cannot_reach_python_internals(template) -> None:
    messages = [{"role": "user", "content": "x"}]
    try:
        text = ChatTemplate.from_string(template).render(messages).text
    except ChatTemplateError:
        return
    assert "class" not in text and "function" not in text and "module" not in text
    assert messages == [{"role": "user", "content": "x"}]
