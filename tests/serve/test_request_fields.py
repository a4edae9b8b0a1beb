"""The inventory of vLLM's request fields (`pipeline.serve.http.vllm_fields`) against pipe's
bodies and docs, and the engine's side of the fields it serves: the sampling constraints
(checked as properties), the text (against transformers' decode) and the chat-template
arguments. The server's side is in test_openai_client.py (one server for both)."""

from __future__ import annotations

import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from pipeline.serve.engine.sampling import SamplingParams, choose, sample
from pipeline.serve.http import vllm_fields
from pipeline.serve.http.openai_api import ChatBody, CompletionBody

# vLLM's field names, as read at vllm_fields.VLLM_COMMIT (chat_completion/protocol.py's
# ChatCompletionRequest, completion/protocol.py's CompletionRequest): written here apart from
# the inventory, so a field the inventory loses is caught.
_SHARED = """model frequency_penalty logit_bias logprobs max_tokens n presence_penalty
response_format seed stop stream stream_options temperature top_p user use_beam_search top_k
min_p repetition_penalty watermarking length_penalty stop_token_ids include_stop_str_in_output
ignore_eos min_tokens skip_special_tokens spaces_between_special_tokens truncate_prompt_tokens
truncation_side prompt_logprobs logprob_token_ids allowed_token_ids bad_words add_special_tokens
structured_outputs priority request_id session_id return_tokens_as_token_ids return_token_ids
routed_experts_prompt_start return_token_offsets return_mm_kwargs cache_salt kv_transfer_params
ec_transfer_params vllm_xargs repetition_detection stream_interval thinking_token_budget"""
_CHAT_ONLY = """messages top_logprobs max_completion_tokens tools tool_choice reasoning_effort
include_reasoning parallel_tool_calls echo add_generation_prompt continue_final_message documents
chat_template chat_template_kwargs media_io_kwargs mm_processor_kwargs return_prompt_text"""
VLLM_FIELDS = {
    "chat": {*_SHARED.split(), *_CHAT_ONLY.split()},
    "completion": {*_SHARED.split(), "prompt", "echo", "suffix", "prompt_embeds"},
}
GUIDED = {"guided_json", "guided_regex", "guided_choice", "guided_grammar"}
PIPE_EXTRAS = {"chat": GUIDED, "completion": GUIDED | {"best_of"}}  # pipe's, not vLLM's now
# Ignored on purpose, each with why it cannot change the answer.
IGNORED = {
    "user": "an end-user id for abuse monitoring",
    "session_id": "a routing hint",
    "length_penalty": "beam search's, and beam search is refused",
    "routed_experts_prompt_start": "trims routed-expert data pipe never returns",
    "return_token_offsets": "vLLM's render endpoints only",
    "return_mm_kwargs": "vLLM's render endpoints only",
    "stream_interval": "how streamed tokens are grouped, not which",
    "priority": "vLLM's default first-come-first-served scheduler ignores it too",
}
BODY_CLASSES = {"chat": ChatBody, "completion": CompletionBody}


@pytest.mark.parametrize("kind", sorted(BODY_CLASSES))
def test_every_field_is_served_refused_or_ignored_on_purpose(kind) -> None:
    inventory = vllm_fields.FIELDS[kind]
    assert set(inventory) == VLLM_FIELDS[kind] | PIPE_EXTRAS[kind]
    declared = set(BODY_CLASSES[kind].model_fields)
    assert declared <= set(inventory), declared - set(inventory)  # every pipe field listed
    served = set(vllm_fields.fields_with(kind, "served"))
    assert served <= declared, served - declared  # a served field is one the body reads
    assert set(vllm_fields.fields_with(kind, "ignored")) <= set(IGNORED)
    for name, rule in inventory.items():
        assert rule.reason and "\n" not in rule.reason
        if rule.status != "served":
            assert not rule.is_default(rule.example), name
            assert rule.is_default(rule.default) and rule.is_default(None), name
        if rule.status == "refused":
            assert name not in declared, name  # refused by the lenient path, not read


def test_what_counts_as_vllms_default() -> None:
    watermarking = vllm_fields.rule("chat", "watermarking")
    assert all(watermarking.is_default(v) for v in (None, False))
    assert not watermarking.is_default(True)
    budget = vllm_fields.rule("completion", "thinking_token_budget")
    assert budget.is_default(None) and not budget.is_default(0)
    priority = vllm_fields.rule("chat", "priority")
    assert priority.is_default(0) and not priority.is_default(-1)
    # include_reasoning, refused before the reasoning parser, is served (test_reasoning.py)
    assert vllm_fields.rule("chat", "include_reasoning").status == "served"


@pytest.mark.parametrize("kind", sorted(BODY_CLASSES))
def test_the_lenient_body_refuses_and_ignores_by_the_inventory(kind, caplog) -> None:
    from pipeline.serve.http.openai_api import APIError

    base = {"messages": [{"role": "user", "content": "x"}]} if kind == "chat" else {"prompt": "x"}
    body_class = BODY_CLASSES[kind]
    for name in vllm_fields.fields_with(kind, "refused"):
        rule = vllm_fields.rule(kind, name)
        with pytest.raises(APIError) as caught:
            body_class.model_validate({**base, name: rule.example})
        assert caught.value.param == name and caught.value.status == 400
        body_class.model_validate({**base, name: rule.default})
    caplog.set_level("WARNING", logger="pipeline.serve.http.lenient")
    for name in vllm_fields.fields_with(kind, "ignored"):
        body_class.model_validate({**base, name: vllm_fields.rule(kind, name).example})
    assert not [r for r in caplog.records if "ignored" in r.getMessage()]


def test_the_docs_list_the_inventory() -> None:
    page = (Path(__file__).parents[2] / "docs" / "serve.md").read_text()
    found = re.search(r"<!-- request-fields[^\n]*-->\n(.*?)\n<!-- /request-fields -->", page, re.S)
    assert found and found.group(1) == vllm_fields.markdown_table()


# ---- the engine's constraints -----------------------------------------------------------------


def _row(params: SamplingParams, output=(), prompt=(1, 2)) -> SimpleNamespace:
    return SimpleNamespace(
        params=params,
        prompt=list(prompt),
        output=list(output),
        generator=torch.Generator().manual_seed(0),
    )


def test_min_tokens_masks_the_stop_tokens_until_that_count() -> None:
    params = SamplingParams(
        max_new_tokens=8, greedy=True, stop_token_ids=frozenset({3, 5}), min_tokens=2
    )
    logits = torch.zeros(3, 8)
    logits[:, 3] = 10
    rows = [_row(params), _row(params, [4]), _row(params, [4, 4])]
    tokens = [token for token, _ in choose(logits, rows)]
    assert tokens[0] not in (3, 5) and tokens[1] not in (3, 5) and tokens[2] == 3


def test_allowed_token_ids_and_bad_words() -> None:
    vocab = 16
    allowed = SamplingParams(temperature=1.0, allowed_token_ids=(2, 7, 9))
    drawn = set()
    for seed in range(40):
        row = _row(allowed)
        row.generator = torch.Generator().manual_seed(seed)
        drawn |= {token for token, _ in choose(torch.randn(1, vocab), [row])}
    assert drawn == {2, 7, 9}
    # a one-token bad word never; a two-token one's last token only where the first is not
    # just before it; plain requests beside them untouched
    bad = SamplingParams(greedy=True, bad_words=((4,), (6, 8)))
    logits = torch.zeros(4, vocab)
    logits[:, 4], logits[:, 8] = 20, 10
    rows = [_row(bad), _row(bad, [6]), _row(bad, [8]), _row(SamplingParams(greedy=True))]
    assert [token for token, _ in choose(logits, rows)] == [8, 0, 8, 4]


def test_min_p_drops_the_unlikely() -> None:
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    params = SamplingParams(temperature=1.0, min_p=0.2)  # keeps p >= 0.1
    drawn = {sample(probs.log(), params, torch.Generator().manual_seed(s)) for s in range(300)}
    assert drawn == {0, 1, 2}
    plain = SamplingParams(temperature=1.0)
    drawn = {sample(probs.log(), plain, torch.Generator().manual_seed(s)) for s in range(300)}
    assert 3 in drawn


def test_plain_requests_do_not_adjust_logits() -> None:
    assert not SamplingParams().adjusts_logits and not SamplingParams(min_p=0.1).adjusts_logits
    for field in ({"min_tokens": 1}, {"allowed_token_ids": (1,)}, {"bad_words": ((1,),)}):
        assert SamplingParams(**field).adjusts_logits


# ---- the text ---------------------------------------------------------------------------------


def test_request_text_skips_special_tokens_as_transformers_decodes(tiny_hf_dir) -> None:
    """`RequestText` (pipe serve's and pipe generate's text) with the default parameters: the
    text transformers decodes with `skip_special_tokens=True`; with it off, with them."""
    transformers = pytest.importorskip("transformers")
    from pipeline.serve.engine.text import RequestText
    from pipeline.tokenizer.tokenizer import load_tokenizer

    oracle = transformers.AutoTokenizer.from_pretrained(tiny_hf_dir)
    tokenizer = load_tokenizer(tiny_hf_dir)
    prompt = oracle.encode("line 3:", add_special_tokens=False)
    ids = oracle.encode(" value", add_special_tokens=False) + [oracle.bos_token_id]
    ids += oracle.encode("=21", add_special_tokens=False) + [oracle.eos_token_id]
    for skip in (True, False):
        params = SamplingParams(skip_special_tokens=skip)
        text = RequestText(tokenizer.decode, params, prompt)
        assert "".join(text.add(t, None) for t in ids) + text.add(ids[0], "length") == (
            oracle.decode(ids + ids[:1], skip_special_tokens=skip)
        )


def test_stop_strings_with_include_stop_str_and_min_tokens() -> None:
    from pipeline.serve.engine.text import RequestText

    pieces = {1: "a", 2: "b", 3: "c", 9: "<eos>"}

    def decode(ids, skip_special_tokens=True):
        return "".join(pieces[i] for i in ids)

    def run(**fields) -> str:
        text = RequestText(decode, SamplingParams(stop=("b",), **fields), prompt=[])
        for token in (1, 2, 3, 2, 1):
            text.add(token, None)
            if text.finish_reason:
                break
        return text.text

    assert run() == "a"
    assert run(include_stop_str_in_output=True) == "ab"
    assert run(min_tokens=2) == "abc"  # the first "b" is within min_tokens: not a stop
    stop_token = SamplingParams(stop_token_ids=frozenset({9}), include_stop_str_in_output=True)
    text = RequestText(decode, stop_token, prompt=[])
    assert text.add(1, None) + text.add(9, "stop") == "a<eos>"


def test_chat_template_kwargs_and_documents_reach_the_template() -> None:
    from pipeline.serve.http.codec import Codec
    from pipeline.tokenizer.chat_template import ChatTemplate

    template = ChatTemplate(
        {
            "default": "{{ messages[0]['content'] }}|{{ enable_thinking }}|"
            "{{ documents[0]['title'] }}"
        }
    )
    body = ChatBody.model_validate(
        {
            "messages": [{"role": "user", "content": "hi"}],
            "chat_template_kwargs": {"enable_thinking": False},
            "documents": [{"title": "T"}],
        }
    )
    codec = Codec(None, template, 10)
    assert codec.chat(body.messages, extra=body.template_kwargs()) == "hi|False|T"
    effort = ChatBody.model_validate(
        {
            "messages": [{"role": "user", "content": "hi"}],
            "reasoning_effort": "low",
            "documents": [{"title": "D"}],
        }
    )
    assert codec.chat(effort.messages, extra=effort.template_kwargs()) == "hi|True|D"
    template = ChatTemplate({"default": "{{ reasoning_effort }}|{{ enable_thinking }}"})
    none = ChatBody.model_validate(
        {"messages": [{"role": "user", "content": "hi"}], "reasoning_effort": "none"}
    )
    assert Codec(None, template, 10).chat(none.messages, extra=none.template_kwargs()) == (
        "none|False"
    )
