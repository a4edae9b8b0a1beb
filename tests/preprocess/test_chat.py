"""`pipe preprocess --chat`: tokens and loss masks equal transformers' `apply_chat_template(...,
return_assistant_tokens_mask=True)` on multi-turn conversations made from the Python docs corpus
(real text: pages split into turns; the shared test data holds no chat corpus), with Llama 3's
template marked with {% generation %}; the unmarked template gives the same masks; megatron-core
reads both outputs; the input forms, bad lines and refused templates."""

from __future__ import annotations

import gzip
import json
import re
import shutil
from pathlib import Path

import numpy as np
import pytest

from pipeline.data.indexed import IndexedDataset
from pipeline.data.loss_mask import loss_mask_prefix, open_loss_mask
from tests.builders import megatron_builder, run_pipe, write_jsonl

pytestmark = pytest.mark.usefixtures("private_proof_cache")

# Llama 3's template (as the llama3 tokenizer of the test data has it), with the assistant's
# text and end-of-turn marker inside {% generation %}: the same text for the same messages.
LLAMA3_MARKED = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}"
    "{% set header = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' %}"
    "{% if loop.index0 == 0 %}{% set header = bos_token + header %}{% endif %}"
    "{% if message['role'] == 'assistant' %}{{ header }}{% generation %}"
    "{{ message['content'] | trim + '<|eot_id|>' }}{% endgeneration %}"
    "{% else %}{{ header + message['content'] | trim + '<|eot_id|>' }}{% endif %}{% endfor %}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}"
)
# A ChatML template that, like Qwen3's, keeps an assistant's <think> reasoning only after the
# last user message: earlier turns render differently once later turns follow.
QWEN3_LIKE = (
    "{% set ns = namespace(last=-1) %}{% for m in messages %}{% if m.role == 'user' %}"
    "{% set ns.last = loop.index0 %}{% endif %}{% endfor %}"
    "{% for m in messages %}{% set content = m.content %}"
    "{% if m.role == 'assistant' and loop.index0 < ns.last and '</think>' in content %}"
    "{% set content = content.split('</think>')[-1].lstrip('\n') %}{% endif %}"
    "{{ '<|im_start|>' + m.role + '\n' + content + '<|im_end|>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
# A small ChatML template for the tiny tokenizer (runs without the shared test data).
CHATML = (
    "{% for m in messages %}{{ '<|im_start|>' + m.role + '\n' + m.content + '<|im_end|>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def conversations_from(pages: list[str], count: int) -> list[list[dict]]:
    """Multi-turn conversations from real pages: paragraphs become alternating user and
    assistant turns (1 to 5 exchanges), with a system message on every third one."""
    conversations = []
    for k, page in enumerate(pages[:count]):
        paragraphs = [p for p in re.split(r"\n\s*\n", page) if p.strip()][: 2 * (1 + k % 5)]
        if len(paragraphs) < 2:
            continue
        messages = [{"role": "system", "content": "Answer from the Python docs."}] * (k % 3 == 0)
        for j, paragraph in enumerate(paragraphs[: len(paragraphs) // 2 * 2]):
            messages.append({"role": ("user", "assistant")[j % 2], "content": paragraph})
        conversations.append(messages)
    conversations.append(
        [
            {"role": "user", "content": "Café, 日本語, emoji 👩‍👩‍👧‍👦?"},
            {"role": "assistant", "content": "  Ja: ß, Ω, ﬁ, \u00a0 and 🎉  "},
            {"role": "user", "content": "<|eot_id|> literal?"},
            {"role": "assistant", "content": ""},
        ]
    )
    return conversations


@pytest.fixture(scope="module")
def chat_corpus(corpus_texts) -> list[list[dict]]:
    return conversations_from(corpus_texts, 120)


def tokenizer_with_template(source: Path, out: Path, template: str | None) -> Path:
    """A copy of tokenizer directory `source` whose tokenizer_config.json has `template`."""
    out.mkdir(parents=True, exist_ok=True)
    shutil.copy(source / "tokenizer.json", out / "tokenizer.json")
    config = json.loads((source / "tokenizer_config.json").read_text())
    config["chat_template"] = template
    (out / "tokenizer_config.json").write_text(json.dumps(config))
    return out


def preprocess_chat(src: Path, tokenizer: Path, out: Path, *extra, expect_ok: bool = True):
    args = ["preprocess", "--chat", "-i", src, "--tokenizer", tokenizer, "-o", out, "-q"]
    return run_pipe(*args, *extra, expect_ok=expect_ok)


def read_outputs(out: Path) -> tuple[list[list[int]], list[list[int]]]:
    tokens = IndexedDataset(f"{out}_messages_document")
    mask = open_loss_mask(tokens)
    assert mask.prefix == f"{out}_messages_loss_mask_document"
    return [t.tolist() for t in tokens.documents()], [m.tolist() for m in mask.documents()]


def transformers_side(tokenizer_dir: Path, conversations: list[list[dict]]):
    transformers = pytest.importorskip("transformers")
    tok = transformers.AutoTokenizer.from_pretrained(str(tokenizer_dir))
    ids, masks = [], []
    for messages in conversations:
        out = tok.apply_chat_template(
            messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
        )
        ids.append(list(out["input_ids"]))
        masks.append(list(out["assistant_masks"]))
    return ids, masks


def test_marked_llama3_equals_transformers(tmp_path, llama3_dir, chat_corpus) -> None:
    """Every conversation: the same tokens and the same assistant mask as transformers, through
    forked workers; the manifest records the template's hash and the generation rule."""
    marked = tokenizer_with_template(llama3_dir, tmp_path / "marked", LLAMA3_MARKED)
    src = write_jsonl(tmp_path / "chat.jsonl", [{"messages": m} for m in chat_corpus])
    preprocess_chat(src, marked, tmp_path / "out", "--workers", "2")
    tokens, masks = read_outputs(tmp_path / "out")
    expected_tokens, expected_masks = transformers_side(marked, chat_corpus)
    assert len(tokens) == len(chat_corpus) > 60
    assert max(sum(m["role"] == "assistant" for m in c) for c in chat_corpus) == 5
    assert tokens == expected_tokens
    assert masks == expected_masks
    assert all(0 < sum(m) < len(m) for m in masks)
    manifest = json.loads((tmp_path / "out.json").read_text())
    chat = manifest["flags"]["chat"]
    assert chat["mask_rule"] == "generation"
    assert (
        chat["template_sha256"] == __import__("hashlib").sha256(LLAMA3_MARKED.encode()).hexdigest()
    )
    assert manifest["counts"]["loss_tokens"] == sum(map(sum, masks))


def test_unmarked_llama3_gives_the_marked_masks(tmp_path, llama3_dir, chat_corpus) -> None:
    """The shared Llama 3 template (no {% generation %}; it appends the assistant header even
    when not asked) by the rendered-prefix rule: the marked copy's tokens and masks."""
    marked = tokenizer_with_template(llama3_dir, tmp_path / "marked", LLAMA3_MARKED)
    src = write_jsonl(tmp_path / "chat.jsonl", [{"messages": m} for m in chat_corpus])
    preprocess_chat(src, llama3_dir, tmp_path / "plain")
    preprocess_chat(src, marked, tmp_path / "marked_out")
    assert read_outputs(tmp_path / "plain") == read_outputs(tmp_path / "marked_out")
    manifest = json.loads((tmp_path / "plain.json").read_text())
    assert manifest["flags"]["chat"]["mask_rule"] == "rendered-prefix"


def test_megatron_reads_both_outputs(tmp_path, llama3_dir, chat_corpus) -> None:
    _, megatron_dataset = megatron_builder()
    src = write_jsonl(tmp_path / "chat.jsonl", [{"messages": m} for m in chat_corpus[:30]])
    preprocess_chat(src, llama3_dir, tmp_path / "out")
    ours = IndexedDataset(f"{tmp_path}/out_messages_document")
    prefix = loss_mask_prefix(ours.prefix)
    assert prefix == f"{tmp_path}/out_messages_loss_mask_document"
    tokens = megatron_dataset(ours.prefix)
    mask = megatron_dataset(prefix)
    assert mask.index.dtype == np.uint8 and tokens.index.dtype == np.int32
    assert len(tokens) == len(mask) == len(ours) == 30
    np.testing.assert_array_equal(tokens.sequence_lengths, mask.sequence_lengths)
    np.testing.assert_array_equal(tokens.document_indices, mask.document_indices)
    for i in range(len(ours)):
        np.testing.assert_array_equal(tokens[i], ours[i])
        assert set(np.unique(mask[i])) == {0, 1}


def test_template_that_rewrites_earlier_turns_is_refused(tmp_path, tiny_tokenizer_dir) -> None:
    template = tmp_path / "qwen3_like.jinja"
    template.write_text(QWEN3_LIKE)
    one_turn = [
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": "<think>r</think>a"},
    ]
    two_turns = one_turn + [
        {"role": "user", "content": "q2"},
        {"role": "assistant", "content": "b"},
    ]
    src = write_jsonl(tmp_path / "chat.jsonl", [{"messages": one_turn}, {"messages": two_turns}])
    args = ("--chat-template", template, "--skip-bad-lines")
    result = preprocess_chat(src, tiny_tokenizer_dir, tmp_path / "out", *args, expect_ok=False)
    assert result.exit_code == 1
    message = result.output.strip()
    assert "\n" not in message and message.startswith(f"Error: {src}:2: ")
    assert "{% generation %}" in message
    assert not list(tmp_path.glob("out*"))
    # One turn is rendered as it stands: nothing follows it to rewrite it.
    single = write_jsonl(tmp_path / "single.jsonl", [{"messages": one_turn}])
    preprocess_chat(single, tiny_tokenizer_dir, tmp_path / "one", "--chat-template", template)
    assert sum(read_outputs(tmp_path / "one")[1][0]) > 0


def test_sharegpt_prompt_completion_and_input_kinds(tmp_path, tiny_tokenizer_dir) -> None:
    """The three forms of a conversation give the same tokens and masks, from plain, .gz and
    Parquet inputs alike, and a sharded run merges into the same files."""
    template = tmp_path / "chatml.jinja"
    template.write_text(CHATML)
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi, café?"},
        {"role": "assistant", "content": "Yes."},
    ]
    records = [
        {"messages": messages},
        {
            "conversations": [
                {"from": f, "value": m["content"]}
                for f, m in zip(("system", "human", "gpt"), messages)
            ]
        },
        {"prompt": messages[1:2], "completion": messages[2:]},
        {"prompt": "Hi, café?", "completion": "Yes."},
    ]
    src = write_jsonl(tmp_path / "chat.jsonl", records)
    flags = ("--chat-template", template)
    preprocess_chat(src, tiny_tokenizer_dir, tmp_path / "plain", *flags)
    tokens, masks = read_outputs(tmp_path / "plain")
    assert tokens[0] == tokens[1] and masks[0] == masks[1]
    assert tokens[2] == tokens[3] and masks[2] == masks[3]
    assert len(tokens[2]) < len(tokens[0])
    gz = tmp_path / "chat.jsonl.gz"
    gz.write_bytes(gzip.compress(src.read_bytes()))
    preprocess_chat(gz, tiny_tokenizer_dir, tmp_path / "gz", *flags)
    assert read_outputs(tmp_path / "gz") == (tokens, masks)
    pq = pytest.importorskip("pyarrow.parquet")
    import pyarrow as pa

    rows = [{"messages": messages}] * 2
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "chat.parquet")
    preprocess_chat(tmp_path / "chat.parquet", tiny_tokenizer_dir, tmp_path / "pq", *flags)
    assert read_outputs(tmp_path / "pq") == ([tokens[0]] * 2, [masks[0]] * 2)
    for index in range(2):
        shard = ("--num-shards", 2, "--shard-index", index)
        preprocess_chat(src, tiny_tokenizer_dir, tmp_path / "sharded", *flags, *shard)
    run_pipe("merge", "--shards", tmp_path / "sharded")
    assert read_outputs(tmp_path / "sharded") == (tokens, masks)


GOOD = {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}
BAD_LINES = [
    ('{"messages": [', "malformed JSON"),
    (json.dumps({"messages": [{"role": "user", "content": "q"}]}), "no assistant message"),
    (
        json.dumps({"messages": [{"role": "bot", "content": "q"}]}),
        "messages[0]: unknown role 'bot'",
    ),
    (json.dumps({"messages": "hi"}), "'messages' is a string, expected a list"),
    (
        json.dumps({"messages": [{"role": "assistant", "content": 3}]}),
        "messages[0].content is a number",
    ),
    (
        json.dumps({"conversations": [{"from": "alien", "value": "x"}]}),
        "unknown role 'alien' in 'from'",
    ),
    (json.dumps({"prompt": "q"}), "completion is null, expected a string"),
    (json.dumps({"text": "q"}), "no 'messages', 'conversations' or 'prompt'/'completion' key"),
]


@pytest.mark.parametrize(("line", "problem"), BAD_LINES)
def test_bad_line_is_named_or_skipped(tmp_path, tiny_tokenizer_dir, line, problem) -> None:
    template = tmp_path / "chatml.jinja"
    template.write_text(CHATML)
    src = tmp_path / "chat.jsonl"
    src.write_text(f"{json.dumps(GOOD)}\n{line}\n{json.dumps(GOOD)}\n")
    flags = ("--chat-template", template)
    result = preprocess_chat(src, tiny_tokenizer_dir, tmp_path / "out", *flags, expect_ok=False)
    assert result.exit_code == 1
    assert result.output.startswith(f"Error: {src}:2: ") and problem in result.output
    assert not list(tmp_path.glob("out*"))
    preprocess_chat(src, tiny_tokenizer_dir, tmp_path / "out", *flags, "--skip-bad-lines")
    assert len(read_outputs(tmp_path / "out")[0]) == 2
    assert json.loads((tmp_path / "out.json").read_text())["counts"]["bad_lines"] == 1


@pytest.mark.parametrize(
    ("template", "messages", "problem"),
    [
        (
            "{% for m in messages %}{{ m.content }}{% endfor %}",
            [{"role": "assistant", "content": "only the assistant"}],
            "the loss mask covers every token",
        ),
        (
            "{% for m in messages %}{{ m.content }}{% generation %}{% endgeneration %}{% endfor %}",
            [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}],
            "the loss mask covers no token",
        ),
    ],
)
def test_all_ones_or_all_zeros_mask_is_an_error(
    tmp_path, tiny_tokenizer_dir, template, messages, problem
) -> None:
    path = tmp_path / "t.jinja"
    path.write_text(template)
    src = write_jsonl(tmp_path / "chat.jsonl", [{"messages": messages}])
    flags = ("--chat-template", path)
    result = preprocess_chat(src, tiny_tokenizer_dir, tmp_path / "out", *flags, expect_ok=False)
    assert result.exit_code == 1
    assert result.output.startswith(f"Error: {src}:1: {problem}")
    assert not list(tmp_path.glob("out*"))


def test_chat_flags_refused(tmp_path, tiny_tokenizer_dir) -> None:
    src = write_jsonl(tmp_path / "chat.jsonl", [GOOD])
    for extra in (("--append-eod",), ("--json-keys", "text")):
        result = preprocess_chat(src, tiny_tokenizer_dir, tmp_path / "o", *extra, expect_ok=False)
        assert result.exit_code == 2
    plain = shutil.copytree(tiny_tokenizer_dir, tmp_path / "no_template")
    config = json.loads((plain / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (plain / "tokenizer_config.json").write_text(json.dumps(config))
    result = preprocess_chat(src, plain, tmp_path / "o", expect_ok=False)
    assert result.exit_code == 1 and "has no chat template" in result.output


def test_loss_mask_prefix_names() -> None:
    assert loss_mask_prefix("out/sft_messages_document") == "out/sft_messages_loss_mask_document"
    assert (
        loss_mask_prefix("out/sft_messages_document.idx") == "out/sft_messages_loss_mask_document"
    )
    assert loss_mask_prefix("data/other") == "data/other_loss_mask"


def test_forked_workers_and_small_batches_write_the_same(tmp_path, llama3_dir, chat_corpus):
    """Many batches through forked encoding processes give the files one batch gives."""
    from pipeline.preprocess.chat import load_chat_setup
    from pipeline.preprocess.runner import PreprocessConfig, preprocess
    from pipeline.tokenizer.token_offsets import OffsetEncoder
    from pipeline.tokenizer.tokenizer import load_tokenizer

    assert OffsetEncoder(load_tokenizer(llama3_dir)).method == "token bytes"  # the fast path
    src = write_jsonl(tmp_path / "chat.jsonl", [{"messages": m} for m in chat_corpus])
    preprocess_chat(src, llama3_dir, tmp_path / "one", "--workers", "1")
    config = PreprocessConfig(
        inputs=[str(src)],
        output_prefix=str(tmp_path / "many"),
        workers=2,
        batch_bytes=1 << 14,
        show_progress=False,
        chat=load_chat_setup(llama3_dir, None),
    )
    preprocess(config, load_tokenizer(llama3_dir))
    for suffix in ("messages_document", "messages_loss_mask_document"):
        for ext in (".bin", ".idx"):
            one = (tmp_path / f"one_{suffix}{ext}").read_bytes()
            assert one == (tmp_path / f"many_{suffix}{ext}").read_bytes()


CHATML_MARKED = (
    "{% for m in messages %}{{ '<|im_start|>' + m.role + '\n' }}"
    "{% if m.role == 'assistant' %}{% generation %}{{ m.content + '<|im_end|>' }}"
    "{% endgeneration %}{% else %}{{ m.content + '<|im_end|>' }}{% endif %}{{ '\n' }}"
    "{% endfor %}"
)


def test_offsets_from_tokenizers_equal_transformers(tmp_path, llama2_dir, chat_corpus) -> None:
    """Llama 2's tokenizer (not byte-level: token offsets come from `tokenizers` itself), with a
    marked template given in its tokenizer_config.json: transformers' tokens and masks."""
    from pipeline.tokenizer.token_offsets import OffsetEncoder
    from pipeline.tokenizer.tokenizer import load_tokenizer

    marked = tokenizer_with_template(llama2_dir, tmp_path / "llama2", CHATML_MARKED)
    assert OffsetEncoder(load_tokenizer(marked)).method == "tokenizers offsets"
    conversations = chat_corpus[:40]
    src = write_jsonl(tmp_path / "chat.jsonl", [{"messages": m} for m in conversations])
    preprocess_chat(src, marked, tmp_path / "out")
    assert read_outputs(tmp_path / "out") == transformers_side(marked, conversations)


def test_token_mask_follows_the_overlap_rule() -> None:
    """Random tokens (some empty) and spans (some empty): a token is 1 exactly when it starts
    before a span ends and ends after it starts."""
    from pipeline.tokenizer.chat_spans import token_mask

    rng = np.random.default_rng(0)
    for _ in range(200):
        cuts = np.sort(rng.integers(0, 60, size=rng.integers(1, 30)))
        starts, ends = cuts[:-1], cuts[1:]
        points = np.sort(rng.integers(0, 60, size=2 * rng.integers(0, 5)))
        spans = [(int(a), int(b)) for a, b in zip(points[::2], points[1::2])]
        expected = [int(any(s < e2 and e > s2 for s2, e2 in spans)) for s, e in zip(starts, ends)]
        assert token_mask(starts, ends, spans).tolist() == expected


def test_conversation_opening_with_the_assistant_is_a_bad_line(tmp_path, llama3_dir) -> None:
    """Llama 3's template writes BOS with the first message, so an empty rendering is not a
    prefix of one that opens with the assistant: that conversation is skipped, not the run."""
    opening = [{"role": "assistant", "content": "Hi."}, {"role": "user", "content": "q"}]
    records = [{"messages": opening}, GOOD]
    src = write_jsonl(tmp_path / "chat.jsonl", records)
    result = preprocess_chat(src, llama3_dir, tmp_path / "out", expect_ok=False)
    assert result.exit_code == 1 and f"{src}:1: chat template:" in result.output
    preprocess_chat(src, llama3_dir, tmp_path / "out", "--skip-bad-lines")
    assert len(read_outputs(tmp_path / "out")[0]) == 1
