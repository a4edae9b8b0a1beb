"""`--reasoning-parser openai_gptoss`: gpt-oss's harmony reply split as vLLM 0.32 splits it.

The oracle is vLLM's own harmony parser (`vllm.parser.harmony.HarmonyParser`, which vLLM uses for
gpt-oss with the `openai_gptoss` reasoning parser) run on gpt-oss's own tokenizer (o200k_harmony,
from `openai_harmony`): its answers for the replies in data/gptoss_reasoning_cases.json are
recorded in data/gptoss_reasoning_vllm.json by scripts/bench/vllm_reasoning_oracle.py (the ids,
each id's bytes, the whole split, the split of every streamed delta and the reasoning token
count), so these tests need no vLLM. Where vLLM's CPU build is installed (`PIPE_VLLM_PYTHON`)
the recording is checked to be what vLLM answers today. The server is checked on a tiny Llama
trained to answer in harmony, through the official `openai` client.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from pipeline.tokenizer.harmony import HARMONY_MARKERS, HarmonyServing
from pipeline.tokenizer.reasoning import REASONING_FORMATS, ReasoningServing
from tests.builders import llama_answering

DATA = Path(__file__).parent / "data"
ROOT = Path(__file__).resolve().parents[2]
CASES = json.loads((DATA / "gptoss_reasoning_cases.json").read_text())
ANSWERS = json.loads((DATA / "gptoss_reasoning_vllm.json").read_text())
VLLM_PYTHON = os.environ.get("PIPE_VLLM_PYTHON", "/work/venv-vllm/bin/python")


def _tokenizer(answer: dict):
    """encode (of a marker's text) and decode over the recorded bytes of gpt-oss's tokens."""
    pieces = {int(t): bytes.fromhex(b) for t, b in answer["tokens"].items()}
    by_text = {piece.decode("utf-8", "replace"): token for token, piece in pieces.items()}

    def encode(text: str) -> list[int]:
        return [by_text[text]] if text in by_text else [-1, -1]

    def decode(ids: list[int]) -> str:
        return b"".join(pieces[t] for t in ids).decode("utf-8", errors="replace")

    return encode, decode


def _sizes(case: dict, ids: list[int]) -> list[int]:
    return case.get("chunks") or [1] * len(ids)


@pytest.mark.parametrize("case, answer", list(zip(CASES, ANSWERS)), ids=[c["name"] for c in CASES])
def test_whole_and_streamed_splits_are_vllms(case, answer) -> None:
    encode, decode = _tokenizer(answer)
    serving = ReasoningServing.of(case["parser"], encode, decode)
    ids = answer["token_ids"]
    text = decode(ids)  # pipe's reader ignores the text: the markers are not in it
    reader = serving.reader({})
    reasoning, content = reader.whole(text, ids)
    assert [reasoning, content or None] == answer["whole"]
    assert reader.reasoning_tokens == answer["reasoning_tokens"]
    reader, done, streamed = serving.reader({}), 0, []
    sizes = _sizes(case, ids)
    for n, size in enumerate(sizes):
        delta = ids[done : done + size]
        thinking, said = reader.push(decode(delta), delta)
        done += size
        if n == len(sizes) - 1:
            said += reader.finish()
        streamed.append([thinking or None, said or None] if thinking or said else None)
    assert streamed == answer["stream"]


def test_the_alias_reads_as_vllms_name() -> None:
    answer = ANSWERS[0]
    encode, decode = _tokenizer(answer)
    ids = answer["token_ids"]
    for name in ("openai_gptoss", "gpt_oss"):
        reader = ReasoningServing.of(name, encode, decode).reader(None)
        assert list(reader.whole(decode(ids), ids)) == answer["whole"]
    assert REASONING_FORMATS["gpt_oss"] == REASONING_FORMATS["openai_gptoss"]


def test_the_parser_needs_the_harmony_markers_and_decode() -> None:
    encode, decode = _tokenizer(ANSWERS[0])
    with pytest.raises(ValueError, match="no <\\|start\\|> token"):
        ReasoningServing.of("openai_gptoss", lambda text: [1, 2], decode)
    with pytest.raises(ValueError, match="needs the tokenizer's decode"):
        ReasoningServing.of("openai_gptoss", encode)
    assert isinstance(ReasoningServing.of("openai_gptoss", encode, decode), HarmonyServing)


@pytest.mark.skipif(not Path(VLLM_PYTHON).exists(), reason="vLLM's CPU build is not installed")
def test_the_recorded_answers_are_what_vllm_answers() -> None:
    run = subprocess.run(
        [VLLM_PYTHON, str(ROOT / "scripts/bench/vllm_reasoning_oracle.py"), "harmony"],
        input=json.dumps(CASES),
        capture_output=True,
        text=True,
        timeout=600,
    )
    if run.returncode != 0 and "openai_harmony" in run.stderr:
        pytest.skip("vLLM's venv has no openai_harmony")
    assert run.returncode == 0, run.stderr[-2000:]
    assert json.loads(run.stdout) == ANSWERS


def test_grpo_rewards_score_the_final_channel() -> None:
    from dataclasses import replace

    from pipeline.data.prompt_dataset import PromptRecord
    from pipeline.train.config.schema import ConfigError
    from pipeline.train.objectives.grpo.rewards import build_rewards
    from pipeline.train.objectives.grpo.settings import GRPOSection

    named = {c["name"]: a for c, a in zip(CASES, ANSWERS)}
    answer, cut = named["complete"], named["analysis_only_truncated"]
    encode, decode = _tokenizer({"tokens": {**cut["tokens"], **answer["tokens"]}})
    grpo = replace(GRPOSection(), reward_funcs=["accuracy"], reasoning_parser="openai_gptoss")
    encode_batch = lambda texts: [encode(t) for t in texts]  # noqa: E731
    rewards = build_rewards(grpo, True, encode_batch, decode=decode)
    ids = [answer["token_ids"], cut["token_ids"]]
    records = [PromptRecord((1,), {"answer": "4"}, f"p:{i}", "text", "2+2?") for i in range(2)]
    # the content "2 + 2 = 4." is read; the cut reply has only reasoning, so no answer
    assert rewards.score(records, [decode(i) for i in ids], ids)[:, 0].tolist() == [1.0, 0.0]
    with pytest.raises(ConfigError, match="grpo.reasoning_parser: openai_gptoss: needs"):
        build_rewards(grpo, True, encode_batch)


# the served model: a tiny Llama over the tiny tokenizer with the harmony markers added
QUESTION = [{"role": "user", "content": "line 7"}]
THINKING, ANSWER = "line 3 value", "the answer"
REPLY = (
    f"<|channel|>analysis<|message|>{THINKING}<|end|><|start|>assistant"
    f"<|channel|>final<|message|>{ANSWER}<|return|>"
)
TEMPLATE = (
    "{% for m in messages %}<|start|>{{ m.role }}<|message|>{{ m.content }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|start|>assistant{% endif %}"
)


@pytest.fixture(scope="module")
def harmony_model(tiny_tokenizer_dir, tmp_path_factory) -> Path:
    """A tiny Llama that answers QUESTION with REPLY in harmony (trained on that one
    conversation until greedy decoding writes it back), its tokenizer with the harmony markers
    as special tokens, as gpt-oss's has them."""
    tokenizers = pytest.importorskip("tokenizers")
    pytest.importorskip("transformers")
    tok = tokenizers.Tokenizer.from_file(str(tiny_tokenizer_dir / "tokenizer.json"))
    markers = [f"<|{m}|>" for m in HARMONY_MARKERS]
    tok.add_special_tokens([tokenizers.AddedToken(m, normalized=False) for m in markers])
    directory = tmp_path_factory.mktemp("harmony_model")
    tok.save(str(directory / "tokenizer.json"))
    config = json.loads((tiny_tokenizer_dir / "tokenizer_config.json").read_text())
    config.update(chat_template=TEMPLATE, eos_token="<|return|>")
    (directory / "tokenizer_config.json").write_text(json.dumps(config))

    def encode(text: str) -> list[int]:
        return tok.encode(text, add_special_tokens=False).ids

    prompt = encode("<|start|>user<|message|>line 7<|end|><|start|>assistant")
    reply = encode(REPLY)
    model = llama_answering(prompt, reply, tok.get_vocab_size(), encode("<|return|>")[0])
    model.save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def client(harmony_model, tmp_path_factory):
    openai = pytest.importorskip("openai")
    from tests.serve.test_server import Server

    log = tmp_path_factory.mktemp("harmony_server") / "stderr.txt"
    server = Server(harmony_model, log, "--dtype", "fp32", "--reasoning-parser", "openai_gptoss")
    yield openai.OpenAI(
        base_url=f"http://127.0.0.1:{server.port}/v1", api_key="x", max_retries=0, timeout=120
    )
    server.stop()


def _ask(client, stream: bool = False, max_tokens: int = 40, **extra):
    return client.chat.completions.create(
        model=client.models.list().data[0].id,
        messages=QUESTION,
        max_tokens=max_tokens,
        temperature=0,
        stream=stream,
        extra_body=extra,
    )


def test_the_openai_client_reads_gpt_oss_reasoning_apart(client) -> None:
    answer = _ask(client)
    message = answer.choices[0].message
    assert message.reasoning_content == THINKING and message.reasoning == THINKING
    assert message.content == ANSWER
    assert answer.choices[0].finish_reason == "stop"
    deltas = [c.choices[0].delta for c in _ask(client, stream=True) if c.choices]
    thinking = "".join(getattr(d, "reasoning_content", None) or "" for d in deltas)
    assert (thinking, "".join(d.content or "" for d in deltas)) == (THINKING, ANSWER)
    hidden = _ask(client, include_reasoning=False).choices[0].message
    assert hidden.reasoning_content is None and hidden.content == ANSWER


def test_the_responses_api_counts_gpt_oss_reasoning(client, harmony_model) -> None:
    import tokenizers

    tok = tokenizers.Tokenizer.from_file(str(harmony_model / "tokenizer.json"))
    thinking_tokens = len(tok.encode(THINKING, add_special_tokens=False).ids)
    response = client.responses.create(
        model=client.models.list().data[0].id, input=QUESTION, temperature=0
    )
    assert [item.type for item in response.output] == ["reasoning", "message"]
    assert response.output[0].content[0].text == THINKING
    assert response.output_text == ANSWER
    # the analysis body's tokens, as vLLM counts them (the markers and headers left out)
    assert response.usage.output_tokens_details.reasoning_tokens == thinking_tokens


def test_a_reply_cut_inside_a_header_comes_back_raw(client, harmony_model) -> None:
    import tokenizers

    tok = tokenizers.Tokenizer.from_file(str(harmony_model / "tokenizer.json"))
    written = f"<|channel|>analysis<|message|>{THINKING}<|end|><|start|>assistant"
    cut = len(tok.encode(written, add_special_tokens=False).ids)
    # vLLM's recovery: the unfinished message's tokens, as text with the markers, are content
    answer = _ask(client, max_tokens=cut)
    message = answer.choices[0].message
    assert (message.reasoning_content, message.content) == (THINKING, "<|start|>assistant")
    assert answer.choices[0].finish_reason == "length"
    chunks = [c.choices[0] for c in _ask(client, stream=True, max_tokens=cut) if c.choices]
    assert chunks[-1].delta.content == "<|start|>assistant"
    assert chunks[-1].finish_reason == "length"
    thinking = "".join(getattr(c.delta, "reasoning_content", None) or "" for c in chunks)
    assert thinking == THINKING
    response = client.responses.create(
        model=answer.model, input=QUESTION, temperature=0, max_output_tokens=cut
    )
    assert response.output_text == "<|start|>assistant"
    events = list(
        client.responses.create(
            model=answer.model, input=QUESTION, temperature=0, max_output_tokens=cut, stream=True
        )
    )
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == "<|start|>assistant"
