"""GRPO's prompt file: rendering and encoding against transformers' apply_chat_template, every
bad line named file:line, long prompts skipped and counted, splits, and the dataset's seeded
epochs through the data loader."""

from __future__ import annotations

import numpy as np
import pytest

from pipeline.data.loader import build_data_loader
from pipeline.data.prompt_dataset import PromptDataset, PromptRecord
from pipeline.preprocess.prompts import (
    PromptFileError,
    read_prompt_splits,
    read_prompts,
    split_records,
)
from pipeline.tokenizer.chat_template import load_chat_template
from pipeline.tokenizer.tokenizer import load_tokenizer
from tests.builders import write_jsonl

SYSTEM = {"role": "system", "content": "Answer with a number."}


@pytest.fixture(scope="module")
def tok(tiny_tokenizer_dir):
    return load_tokenizer(tiny_tokenizer_dir)


@pytest.fixture(scope="module")
def template(tiny_tokenizer_dir):
    template = load_chat_template(tiny_tokenizer_dir)
    assert template is not None
    return template


def test_prompts_render_and_encode_as_transformers(tmp_path, tiny_tokenizer_dir, tok, template):
    transformers = pytest.importorskip("transformers")
    hf = transformers.PreTrainedTokenizerFast.from_pretrained(str(tiny_tokenizer_dir))
    lines = [
        {"prompt": "What is 2 + 3?", "answer": "5"},
        {"prompt": [SYSTEM, {"role": "user", "content": "line 7: value=49"}], "answer": 49},
    ]
    path = write_jsonl(tmp_path / "p.jsonl", lines)
    prompts = read_prompts(path, tok, template)
    assert prompts.skipped == {}
    for record, line in zip(prompts.records, lines):
        messages = line["prompt"]
        if isinstance(messages, str):
            messages = [{"role": "user", "content": messages}]
        text = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        ids = hf(text, add_special_tokens=False)["input_ids"]
        assert record.text == text
        assert list(record.tokens) == ids
        assert record.fields == {"answer": line["answer"]}
        assert record.prompt == line["prompt"]
    assert [r.source for r in prompts.records] == [f"{path}:1", f"{path}:2"]


def test_no_template_renders_plain_lines_and_blank_lines_keep_numbering(tmp_path, tok):
    path = tmp_path / "p.jsonl"
    path.write_text(
        '\n{"prompt": "hi", "id": 3}\n\n{"prompt": [{"role": "user", "content": "yo"}]}\n'
    )
    records = read_prompts(path, tok, None).records
    assert [r.text for r in records] == ["user: hi\nassistant:", "user: yo\nassistant:"]
    assert [r.source for r in records] == [f"{path}:2", f"{path}:4"]
    assert list(records[0].tokens) == tok.encode_batch(["user: hi\nassistant:"])[0]
    assert records[0].fields == {"id": 3} and records[1].fields == {}


@pytest.mark.parametrize(
    "line, problem",
    [
        ('{"prompt": "x",', "not valid JSON"),
        ('["prompt"]', "a list, expected a JSON object"),
        ('{"question": "x"}', "no 'prompt' key"),
        ('{"prompt": 3}', "'prompt' is a number, expected a string or a list of messages"),
        ('{"prompt": ""}', "'prompt' is empty"),
        ('{"prompt": []}', "'prompt' is an empty list of messages"),
        ('{"prompt": [{"role": "bot", "content": "x"}]}', "prompt[0]: unknown role 'bot'"),
        ('{"prompt": [{"role": "user", "content": 1}]}', "prompt[0].content is a number"),
        ('{"prompt": ["x"]}', "prompt[0] is a string, expected an object"),
        (
            '{"prompt": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}',
            "prompt[1] is the assistant's",
        ),
        ('{"prompt": "x", "completions": 1}', "field 'completions' is a name reward"),
    ],
)
def test_bad_lines_are_named_by_file_and_line(tmp_path, tok, line, problem):
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "fine"}\n' + line + "\n")
    with pytest.raises(PromptFileError) as err:
        read_prompts(path, tok, None)
    message = str(err.value)
    assert message.startswith(f"{path}:2: ") and problem in message
    assert "\n" not in message


def test_template_failure_is_named_by_file_and_line(tmp_path, tok):
    path = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "a"}, {"prompt": "b"}])
    template = "{% if messages[0]['content'] == 'b' %}{{ raise_exception('no b') }}{% endif %}x"
    with pytest.raises(PromptFileError, match=rf"^{path}:2: chat template: no b$"):
        read_prompts(path, tok, template)


def test_empty_and_missing_files(tmp_path, tok):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n  \n")
    with pytest.raises(PromptFileError, match="the file is empty"):
        read_prompts(empty, tok, None)
    with pytest.raises(PromptFileError, match="not found"):
        read_prompts(tmp_path / "absent.jsonl", tok, None)


def test_long_prompts_are_skipped_and_counted(tmp_path, tok):
    texts = ["a", "line 1: value=7 " * 20, "b", "line 2: value=14 " * 30]
    path = write_jsonl(tmp_path / "p.jsonl", [{"prompt": t} for t in texts])
    lengths = [len(r.tokens) for r in read_prompts(path, tok, None).records]
    limit = max(lengths[0], lengths[2])
    assert limit < min(lengths[1], lengths[3])
    prompts = read_prompts(path, tok, None, max_prompt_tokens=limit)
    assert [r.prompt for r in prompts.records] == ["a", "b"]
    assert prompts.skipped == {f"longer than {limit} tokens": 2}
    with pytest.raises(PromptFileError, match="all 4 prompts are longer than 1 tokens"):
        read_prompts(path, tok, None, max_prompt_tokens=1)


def records(n: int, width: int = 3) -> list[PromptRecord]:
    return [
        PromptRecord(tuple(range(i + 1, i + 2 + i % width)), {"i": i}, f"f:{i + 1}", str(i), str(i))
        for i in range(n)
    ]


def test_split_records_by_proportions():
    train, valid, test = split_records(records(1000), "969,30,1")
    assert [len(train), len(valid), len(test)] == [969, 30, 1]
    assert [r.fields["i"] for r in train + valid + test] == list(range(1000))
    assert split_records(records(10), "1,0,0")[1:] == [None, None]
    assert [len(s) for s in split_records(records(10), "8,2")[:2]] == [8, 2]


def test_read_prompt_splits_one_file_or_one_per_split(tmp_path, tok):
    path = write_jsonl(tmp_path / "p.jsonl", [{"prompt": f"q{i}"} for i in range(10)])
    train, valid, test = read_prompt_splits(str(path), "8,2,0", [None] * 3, tok, None)
    assert [r.prompt for r in train.records] == [f"q{i}" for i in range(8)]
    assert [r.prompt for r in valid.records] == ["q8", "q9"] and test is None
    other = write_jsonl(tmp_path / "v.jsonl", [{"prompt": "v"}])
    train, valid, test = read_prompt_splits(None, "8,2,0", [str(path), str(other), None], tok, None)
    assert len(train.records) == 10 and valid.records[0].prompt == "v" and test is None
    with pytest.raises(PromptFileError, match="^data.valid_blend '1 a 1 b': GRPO prompts are one"):
        read_prompt_splits(None, "1", [str(path), "1 a 1 b", None], tok, None)


def test_dataset_epochs_are_seeded_permutations():
    recs = records(7)
    dataset = PromptDataset(recs, 17, seed=5)
    order = [dataset.prompt_index(i) for i in range(17)]
    assert sorted(order[:7]) == sorted(order[7:14]) == list(range(7))
    assert len(set(order[14:])) == 3
    assert order[:7] != order[7:14]  # a fresh permutation per epoch
    rng = np.random.RandomState(5)
    assert order == np.concatenate([rng.permutation(7) for _ in range(3)])[:17].tolist()
    assert order == [PromptDataset(recs, 17, seed=5).prompt_index(i) for i in range(17)]
    assert order != [PromptDataset(recs, 17, seed=6).prompt_index(i) for i in range(17)]
    sample = dataset[9]
    record = recs[order[9]]
    assert sample["prompt"].dtype == np.int64 and sample["prompt"].shape == (3,)
    assert sample["prompt"][: len(record.tokens)].tolist() == list(record.tokens)
    assert not sample["prompt"][len(record.tokens) :].any()
    assert sample["prompt_length"] == len(record.tokens)
    assert sample["prompt_index"] == order[9] and sample["sample_index"] == 9
    with pytest.raises(IndexError):
        dataset[17]
    with pytest.raises(ValueError, match="no prompts"):
        PromptDataset([], 4, seed=0)


def test_dataset_batches_through_the_loader_and_resumes():
    dataset = PromptDataset(records(5), 12, seed=1)
    loader = build_data_loader(dataset, 2, 1, 2, consumed_samples=4, pin_memory=False)
    batches = list(loader)
    assert len(batches) == 2
    for n, batch in enumerate(batches):
        wanted = [dataset[4 + 4 * n + 2 + k] for k in range(2)]  # rank 1's half
        for key in ("prompt", "prompt_length", "prompt_index", "sample_index"):
            assert batch[key].numpy().tolist() == [w[key].tolist() for w in wanted]
    assert loader.state_dict()["consumed_samples"] == 12


def test_dataset_pads_to_the_longest_record():
    recs = records(4, width=4)
    assert sorted(len(r.tokens) for r in recs) == [1, 2, 3, 4]
    dataset = PromptDataset(recs, 4, seed=0)
    assert {dataset[i]["prompt"].shape for i in range(4)} == {(4,)}
