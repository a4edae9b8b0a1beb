"""`pipe preprocess --preference`: each side of a pair equals transformers'
`apply_chat_template(prompt + reply, return_assistant_tokens_mask=True)`, pair i being document
i of both outputs; the input forms; bad lines named file:line or skipped whole pairs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pipeline.data.indexed import IndexedDataset
from pipeline.data.loss_mask import open_loss_mask
from tests.builders import run_pipe, write_jsonl
from tests.preprocess.test_chat import (
    LLAMA3_MARKED,
    conversations_from,
    tokenizer_with_template,
    transformers_side,
)

pytestmark = pytest.mark.usefixtures("private_proof_cache")


def preprocess_pairs(src: Path, tokenizer: Path, out: Path, *extra, expect_ok: bool = True):
    args = ["preprocess", "--preference", "-i", src, "--tokenizer", tokenizer, "-o", out, "-q"]
    return run_pipe(*args, *extra, expect_ok=expect_ok)


def read_side(out: Path, side: str) -> tuple[list[list[int]], list[list[int]]]:
    tokens = IndexedDataset(f"{out}_{side}_document")
    mask = open_loss_mask(tokens)
    assert mask.prefix == f"{out}_{side}_loss_mask_document"
    return [t.tolist() for t in tokens.documents()], [m.tolist() for m in mask.documents()]


def pairs_from(conversations: list[list[dict]]) -> list[dict]:
    """Pairs from real multi-turn conversations: the prompt is all but the last reply, chosen
    is the last reply, rejected the last reply of the next conversation; the input forms in
    turn (string prompt and replies, message lists, `messages` for the prompt)."""
    pairs = []
    for k, messages in enumerate(conversations):
        other = conversations[(k + 1) % len(conversations)][-1]["content"]
        prompt, last = messages[:-1], messages[-1]["content"]
        if k % 3 == 0:  # the last question alone, as a string
            pairs.append({"prompt": prompt[-1]["content"], "chosen": last, "rejected": other})
        elif k % 3 == 1:
            pairs.append(
                {
                    "prompt": prompt,
                    "chosen": [{"role": "assistant", "content": last}],
                    "rejected": [{"role": "assistant", "content": other}],
                }
            )
        else:
            pairs.append({"messages": prompt, "chosen": last, "rejected": other})
    return pairs


def as_messages(pair: dict, side: str) -> list[dict]:
    prompt = pair.get("prompt", pair.get("messages"))
    prompt = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
    reply = pair[side]
    reply = [{"role": "assistant", "content": reply}] if isinstance(reply, str) else reply
    return prompt + reply


def test_both_sides_equal_transformers(tmp_path, llama3_dir, corpus_texts) -> None:
    marked = tokenizer_with_template(llama3_dir, tmp_path / "marked", LLAMA3_MARKED)
    conversations = [c for c in conversations_from(corpus_texts, 60) if c[-1]["content"]]
    pairs = pairs_from(conversations)
    src = write_jsonl(tmp_path / "pairs.jsonl", pairs)
    preprocess_pairs(src, marked, tmp_path / "out", "--workers", "2")
    assert {type(p.get("prompt")) for p in pairs} >= {str, list}
    assert any("messages" in p for p in pairs)
    for side in ("chosen", "rejected"):
        tokens, masks = read_side(tmp_path / "out", side)
        expected = transformers_side(marked, [as_messages(p, side) for p in pairs])
        assert len(tokens) == len(pairs) > 30
        assert (tokens, masks) == expected
    manifest = json.loads((tmp_path / "out.json").read_text())
    assert manifest["flags"]["preference"] is True
    assert manifest["counts"]["documents"] == len(pairs)


GOOD = {"prompt": "q", "chosen": "yes", "rejected": "no"}
BAD_LINES = [
    ('{"prompt": ', "malformed JSON"),
    (json.dumps({"prompt": "q", "chosen": "a"}), "no 'rejected' key"),
    (json.dumps({"chosen": "a", "rejected": "b"}), "no 'prompt' or 'messages' key"),
    (json.dumps({"prompt": "q", "chosen": 3, "rejected": "b"}), "'chosen' is a number"),
    (
        json.dumps({"prompt": "q", "chosen": "a", "rejected": [{"role": "user", "content": "x"}]}),
        "rejected: no assistant message",
    ),
    (
        json.dumps({"messages": [{"role": "bot", "content": "q"}], "chosen": "a", "rejected": "b"}),
        "messages[0]: unknown role 'bot'",
    ),
]


@pytest.mark.parametrize(("line", "problem"), BAD_LINES)
def test_bad_line_is_named_or_skipped(tmp_path, tiny_tokenizer_dir, line, problem) -> None:
    src = tmp_path / "pairs.jsonl"
    src.write_text(f"{json.dumps(GOOD)}\n{line}\n{json.dumps(GOOD)}\n")
    flags = ()  # the tiny tokenizer carries the example chat template
    out = tmp_path / "out"
    result = preprocess_pairs(src, tiny_tokenizer_dir, out, *flags, expect_ok=False)
    assert result.exit_code == 1
    assert result.output.startswith(f"Error: {src}:2: ") and problem in result.output
    assert not list(tmp_path.glob("out*"))
    preprocess_pairs(src, tiny_tokenizer_dir, out, *flags, "--skip-bad-lines")
    assert len(read_side(out, "chosen")[0]) == len(read_side(out, "rejected")[0]) == 2
    assert json.loads((tmp_path / "out.json").read_text())["counts"]["bad_lines"] == 1


def test_chat_and_preference_refused_together(tmp_path, tiny_tokenizer_dir) -> None:
    src = write_jsonl(tmp_path / "pairs.jsonl", [GOOD])
    result = preprocess_pairs(src, tiny_tokenizer_dir, tmp_path / "o", "--chat", expect_ok=False)
    assert result.exit_code == 2 and "--chat and --preference" in result.output


def test_stdlib_example_pairs_preprocess(tmp_path, tiny_tokenizer_dir) -> None:
    """The example of docs/fine-tuning.md: `stdlib_chat --preference` pairs (the right docstring
    chosen, another name's rejected) go through `pipe preprocess --preference` with the
    example tokenizer's own chat template."""
    from pipeline.examples.stdlib_chat import preference_pairs

    docs = {"json.py": ["dumps", "loads", "JSONDecoder"], "os/path.py": ["join", "split"]}
    corpus = write_jsonl(
        tmp_path / "docs.jsonl",
        [
            {"id": module, "text": "\n\n".join(f"{n}\nThe docstring of {n}." for n in names)}
            for module, names in docs.items()
        ],
    )
    pairs = list(preference_pairs(corpus))
    assert len(pairs) == 5 and all(p["chosen"] != p["rejected"] for p in pairs)
    assert pairs[0]["chosen"] == "The docstring of dumps." and "json.dumps" in pairs[0]["prompt"]
    src = write_jsonl(tmp_path / "pairs.jsonl", pairs)
    preprocess_pairs(src, tiny_tokenizer_dir, tmp_path / "out")
    chosen, rejected = (
        read_side(tmp_path / "out", "chosen"),
        read_side(tmp_path / "out", "rejected"),
    )
    assert len(chosen[0]) == len(rejected[0]) == 5
    expected = transformers_side(tiny_tokenizer_dir, [as_messages(p, "chosen") for p in pairs])
    assert chosen == expected
