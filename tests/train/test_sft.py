"""Supervised fine-tuning: packed chat samples, the masked loss and `pipe train --sft`.

Chat datasets are written here directly with pipe's indexed-dataset writer, as `pipe preprocess
--chat` writes them: tokens in `X_messages_document`, the loss mask (uint8, 1 on assistant
tokens) in `X_messages_loss_mask_document`. The CLI run renders its conversations with
transformers' `apply_chat_template(..., return_assistant_tokens_mask=True)`; the others use
hand-made token and mask lists.

The oracle: the loss of packed batches equals the mean, over all mask-1 tokens, of the
cross-entropies transformers computes on each conversation alone (fp32, 1e-5), so packing,
document masking, restarted positions, the label shift and the normalisation are all checked
at once; tp2, cp2 and pp2 give the losses and gradients of one process.
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from pipeline.data.blend_spec import parse_blend, parse_per_split_blend
from pipeline.data.blended import build_datasets
from pipeline.data.chat_shards import ChatIndexedDataset, loss_mask_prefix
from pipeline.data.indexed import IndexedDatasetWriter, IndexFormatError
from pipeline.data.loader import collate_numpy
from pipeline.data.sft_dataset import SFTDataset, SFTDatasetConfig
from pipeline.data.sft_packing import first_fit_decreasing
from pipeline.train.assembly.run_config import resolve_config
from pipeline.train.config.schema import ConfigError
from pipeline.train.report.samples import TrainingSamples
from tests.builders import layout_sets, records, run_pipe, train_and_probe
from tests.distributed import run_distributed

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

EOD = 2


# ---- writing chat datasets --------------------------------------------------------------------


def write_chat(prefix: Path, conversations: list, vocab_size: int) -> str:
    """`{prefix}` and its loss mask from (tokens, mask) pairs, with a manifest naming the EOD id
    and vocabulary size as preprocess records them."""
    prefix = str(prefix)
    with (
        IndexedDatasetWriter(prefix, np.uint16) as tokens,
        IndexedDatasetWriter(loss_mask_prefix(prefix), np.uint8) as masks,
    ):
        for ids, mask in conversations:
            tokens.add_document(ids)
            masks.add_document(mask)
        tokens.finalize()
        masks.finalize()
    stem = prefix.removesuffix("_messages_document")
    manifest = {
        "format": "pipe-preprocess-manifest/1",
        "outputs": {"messages": {"prefix": prefix}},
        "tokenizer": {"eod": EOD, "vocab_size": vocab_size},
    }
    Path(f"{stem}.json").write_text(json.dumps(manifest))
    return prefix


def hand_made(lengths: list[int], vocab_size: int, seed: int = 0) -> list:
    """Conversations of the given lengths: BOS, a user turn, then an assistant turn whose tokens
    (through its closing EOD) have mask 1."""
    rng = np.random.default_rng(seed)
    out = []
    for n in lengths:
        ids = rng.integers(3, vocab_size, n)
        ids[0], ids[-1] = 1, EOD
        mask = np.zeros(n, np.uint8)
        mask[max(1, n // 2) :] = 1
        out.append((ids, mask))
    return out


# ---- packing ---------------------------------------------------------------------------------


def naive_ffd(lengths: list[int], capacity: int) -> list[list[int]]:
    """First-fit decreasing, written the obvious quadratic way."""
    bins: list[list[int]] = []
    free: list[int] = []
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    for i in order:
        if lengths[i] > capacity:
            continue
        for b, room in enumerate(free):
            if room >= lengths[i]:
                bins[b].append(i)
                free[b] -= lengths[i]
                break
        else:
            bins.append([i])
            free.append(capacity - lengths[i])
    return bins


def test_first_fit_decreasing() -> None:
    packed = first_fit_decreasing(np.array([6, 5, 4, 3, 2, 2, 1, 9]), 8)
    assert [packed.sequence(b).tolist() for b in range(len(packed))] == [[0, 4], [1, 3], [2, 5, 6]]
    assert packed.dropped.tolist() == [7] and packed.truncated.tolist() == []
    kept = first_fit_decreasing(np.array([6, 5, 4, 3, 2, 2, 1, 9]), 8, truncate=True)
    assert kept.sequence(0).tolist() == [7] and kept.truncated.tolist() == [7]
    rng = np.random.default_rng(0)
    for capacity in (16, 64, 100):
        lengths = rng.integers(1, 120, 400)
        ids = np.arange(10, 390)  # a split's range
        packed = first_fit_decreasing(lengths, capacity, ids)
        expected = naive_ffd(
            [int(x) if i in ids else 10**9 for i, x in enumerate(lengths)], capacity
        )
        assert [packed.sequence(b).tolist() for b in range(len(packed))] == expected
        placed = packed.documents.tolist()
        assert sorted(placed + packed.dropped.tolist()) == ids.tolist()  # each exactly once
        assert all(lengths[packed.sequence(b)].sum() <= capacity for b in range(len(packed)))
        assert (lengths[packed.dropped] > capacity).all()


def test_packed_samples_hold_whole_conversations_once(tmp_path: Path, monkeypatch) -> None:
    lengths = [int(n) for n in np.random.default_rng(1).integers(3, 40, 60)]
    conversations = hand_made(lengths, 100)
    prefix = write_chat(tmp_path / "chat_messages_document", conversations, 100)
    config = SFTDatasetConfig(sequence_length=32, eod_id=EOD, tokenizer_id="t", split="80,20,0")
    train, valid, test = build_datasets(
        parse_blend(prefix), config, [None, None, 0], dataset_class=SFTDataset
    )
    assert test is None and isinstance(train, SFTDataset)
    train_ids = range(48)  # round(0.8 * 60)
    long = [i for i in train_ids if lengths[i] > 32]
    assert train.dropped == len(long) > 0 and valid.dropped == sum(n > 32 for n in lengths[48:])
    seen = []
    for k in range(len(train)):
        sample = train[k]
        docs = sample["document_ids"]
        for d in np.unique(docs):
            at = np.flatnonzero(docs == d)
            assert (np.diff(at) == 1).all()  # contiguous
            assert (sample["position_ids"][at] == np.arange(len(at))).all()
            match = [
                i
                for i in train_ids
                if lengths[i] == len(at) and (conversations[i][0] == sample["tokens"][at]).all()
            ]
            if not match:  # padding: its own document, no loss
                assert d == docs.max() and sample["loss_mask"][at].sum() == 0
                continue
            i = match[0]
            seen.append(i)
            ids, mask = conversations[i]
            assert (sample["labels"][at[:-1]] == ids[1:]).all()
            assert (sample["loss_mask"][at[:-1]] == mask[1:]).all() and sample["loss_mask"][
                at[-1]
            ] == 0
    assert sorted(seen) == sorted(set(train_ids) - set(long))  # every kept conversation, once

    # The packing and order are cached beside the data and reused: no second packing.
    cache = Path(prefix) / "cache" / "SFTDataset_indices"
    assert len(list(cache.glob("*-SFTDataset-train-*.npy"))) == 5

    def no_packing(*args, **kwargs):
        raise AssertionError("packed again instead of reading the cache")

    monkeypatch.setattr("pipeline.data.sft_dataset.first_fit_decreasing", no_packing)
    again = build_datasets(parse_blend(prefix), config, [None, None, 0], dataset_class=SFTDataset)
    assert len(again[0]) == len(train)
    for key, value in train[3].items():
        assert (again[0][3][key] == value).all()


def test_sft_blends_and_per_split_blends(tmp_path: Path) -> None:
    a = write_chat(tmp_path / "a_messages_document", hand_made([5, 9, 12, 20] * 5, 50), 50)
    b = write_chat(tmp_path / "b_messages_document", hand_made([7, 30, 3] * 5, 50, 1), 50)
    config = SFTDatasetConfig(sequence_length=32, eod_id=EOD, tokenizer_id="t", split="80,20,0")
    train, valid, _ = build_datasets(
        parse_blend(f"0.7 {a} 0.3 {b}"), config, [40, 10, 0], dataset_class=SFTDataset
    )
    assert len(train) == 40 and len(valid) == 10
    assert all(isinstance(d, SFTDataset) for d in train.datasets)
    drawn = np.bincount(train.dataset_index)
    assert drawn.tolist() == [28, 12]
    assert {"document_ids", "loss_mask"} <= train[5].keys()
    per_split = parse_per_split_blend(train=f"{a} {b}", valid=b)
    train, valid, test = build_datasets(
        per_split, config, [None, None, None], dataset_class=SFTDataset
    )
    assert test is None and valid.dataset_path == b and valid.split == "valid"
    assert len(train) == sum(len(d) for d in train.datasets)


def test_mask_file_must_match_the_tokens(tmp_path: Path) -> None:
    prefix = write_chat(tmp_path / "a_messages_document", hand_made([5, 6], 50), 50)
    with IndexedDatasetWriter(loss_mask_prefix(prefix), np.uint8) as masks:
        masks.add_document(np.ones(5, np.uint8))
        masks.add_document(np.ones(7, np.uint8))
        masks.finalize()
    with pytest.raises(
        IndexFormatError,
        match=r"a_messages_loss_mask_document.idx: conversation 1 "
        r"has 7 mask values but 6 tokens",
    ):
        ChatIndexedDataset(prefix)
    assert loss_mask_prefix("out/x_messages_document") == "out/x_messages_loss_mask_document"
    with pytest.raises(ConfigError, match="data.kind = sft .* mock data has none"):
        resolve_config("tiny_sft", ["data.mock=true"])
    # Data without its loss mask (pre-training shards) is refused in one line.
    plain = write_chat(tmp_path / "b_messages_document", hand_made([5, 6], 50), 50)
    for path in Path(loss_mask_prefix(plain)).parent.glob("b_messages_loss_mask_document.*"):
        path.unlink()
    result = run_pipe(
        "train",
        "--recipe",
        "tiny_sft",
        "--data",
        plain,
        "--device",
        "cpu",
        "--run-dir",
        tmp_path / "run",
        expect_ok=False,
    )
    assert result.exit_code == 1 and "Traceback" not in result.output
    assert "b_messages_loss_mask_document.idx: no such file" in result.output
    assert "SFT data needs the loss mask beside the tokens" in result.output


# ---- the loss against transformers -----------------------------------------------------------


def test_packed_loss_equals_transformers_per_conversation(tmp_path: Path) -> None:
    """Packed micro-batches through pipe's loss (forward_backward: accumulation and the global
    token count) against transformers' loss on each conversation alone."""
    from pipeline.train.loop.train_step import forward_backward
    from pipeline.train.objectives.base import batch_to_device
    from pipeline.weights.hf_reader import HFSource
    from tests.builders import VOCAB, lm_runner, load_from_source, save_hf

    directory, hf = save_hf("llama_untied", tmp_path / "hf")
    model = load_from_source(HFSource(directory)).float()
    lengths = [5, 14, 9, 20, 3, 11, 7, 16, 12, 6, 25, 8, 40]  # 40 > 32: dropped
    conversations = hand_made(lengths, VOCAB)
    prefix = write_chat(tmp_path / "chat_messages_document", conversations, VOCAB)
    config = SFTDatasetConfig(sequence_length=32, eod_id=EOD, tokenizer_id="t", split="1")
    (train, _, _) = build_datasets(
        parse_blend(prefix), config, [None, 0, 0], dataset_class=SFTDataset
    )
    samples = [train[k] for k in range(len(train))]
    assert max(s["document_ids"].max() for s in samples) >= 2  # several conversations a sample
    micro_batches = [
        batch_to_device(collate_numpy(samples[i : i + 2]), torch.device("cpu"))
        for i in range(0, len(samples), 2)
    ]
    loss_sum, tokens = forward_backward(model, micro_batches, runner=lm_runner(model))
    ours = float(loss_sum) / float(tokens)

    total, count = 0.0, 0
    with torch.no_grad():
        for ids, mask in conversations[:-1]:
            ids = torch.tensor(ids, dtype=torch.long)[None]
            labels = torch.where(torch.tensor(mask, dtype=torch.bool)[None], ids, -100)
            n = int(mask[1:].sum())
            total += float(hf(input_ids=ids, labels=labels).loss) * n
            count += n
    assert float(tokens) == count
    assert ours == pytest.approx(total / count, abs=1e-5, rel=1e-5)


# ---- parallel layouts ------------------------------------------------------------------------

LAYOUTS = {
    "tp2": ["parallel.tp=2", "parallel.sequence_parallel=false"],
    "cp2": ["parallel.cp=2"],
    "pp2": ["parallel.pp=2"],
}


def _layout_chat(directory: Path) -> str:
    """Long conversations (one a sample) and short ones packed beside them, two too long."""
    rng = np.random.default_rng(3)
    lengths = [*rng.integers(17, 31, 44), *rng.integers(3, 12, 40), 33, 40]
    return write_chat(directory / "chat_messages_document", hand_made(lengths, 128, 3), 128)


def _sft_sets(run_dir: Path, prefix: str, *extra: str) -> list[str]:
    return [*layout_sets("tiny_sft", run_dir, *extra), "data.mock=false", f"data.blend={prefix}"]


def _sft_layout_worker(rank: int, world_size: int, tmp: Path, prefix: str) -> dict:
    out = {}
    for name, extra in LAYOUTS.items():
        result = train_and_probe("tiny_sft", _sft_sets(tmp / name, prefix, *extra))
        keep = result.pop("first_of_stage")
        out[name] = result if keep else {k: v for k, v in result.items() if k != "grads"}
    return out


@pytest.mark.dist
def test_sft_layouts_equal_one_process(tmp_path: Path) -> None:
    prefix = _layout_chat(tmp_path / "data")
    reference = train_and_probe("tiny_sft", _sft_sets(tmp_path / "single", prefix))
    per_rank = run_distributed(_sft_layout_worker, 2, tmp_path / "dist", prefix)
    for name in LAYOUTS:
        grads = {}
        for result in (r[name] for r in per_rank):
            assert result["losses"].keys() == reference["losses"].keys()
            for step, loss in reference["losses"].items():
                assert result["losses"][step] == pytest.approx(loss, rel=1e-5), (name, step)
            assert result["probe"] == pytest.approx(reference["probe"], rel=1e-5), name
            if result["valid"] is not None:
                assert result["valid"] == pytest.approx(reference["valid"], rel=1e-5), name
            grads |= result.get("grads", {})
        assert grads.keys() == reference["grads"].keys(), name
        for param, grad in reference["grads"].items():
            torch.testing.assert_close(grads[param], grad, atol=1e-6, rtol=1e-4, msg=name)


# ---- pipe train --sft ------------------------------------------------------------------------

TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<{{ m['role'] }}>"
    "{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] }}{{ eos_token }}"
    "{% endgeneration %}{% else %}{{ m['content'] }}{{ eos_token }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)
WORDS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"]


def _rendered_chat(tokenizer_dir: Path, prefix: Path, long: int) -> str:
    """Arithmetic conversations rendered by transformers, the first `long` made too long."""
    transformers = pytest.importorskip("transformers")
    tokenizer = transformers.PreTrainedTokenizerFast.from_pretrained(str(tokenizer_dir))
    rng = np.random.default_rng(0)
    conversations = []
    for i in range(240):
        a, b = (int(x) for x in rng.integers(0, 5, 2))
        question = f"what is {WORDS[a]} plus {WORDS[b]}?" * (40 if i < long else 1)
        messages = [
            {"role": "user", "content": question},
            {"role": "assistant", "content": f"{WORDS[a]} plus {WORDS[b]} is {WORDS[a + b]}."},
        ]
        out = tokenizer.apply_chat_template(
            messages,
            chat_template=TEMPLATE,
            tokenize=True,
            return_dict=True,
            return_assistant_tokens_mask=True,
        )
        conversations.append((out["input_ids"], out["assistant_masks"]))
    assert all(0 < sum(m) < len(t) for t, m in conversations)
    assert all(len(t) > 128 for t, _ in conversations[:long])
    return write_chat(prefix, conversations, len(tokenizer))


def _chat_tokenizer(tokenizer_dir: Path, directory: Path) -> Path:
    """A copy of the tiny tokenizer with `TEMPLATE` as its chat template."""
    shutil.copytree(tokenizer_dir, directory)
    config_path = directory / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config_path.write_text(json.dumps(config | {"chat_template": TEMPLATE}))
    return directory


def test_pipe_train_sft_tiny(tmp_path: Path, tiny_tokenizer_dir: Path, caplog) -> None:
    tokenizer = _chat_tokenizer(tiny_tokenizer_dir, tmp_path / "tok")
    prefix = _rendered_chat(tokenizer, tmp_path / "chat_messages_document", long=3)
    run_dir = tmp_path / "run"
    prompt = "what is two plus two?"
    with caplog.at_level(logging.WARNING, logger="pipeline.train"):
        run_pipe(
            "train",
            "--recipe",
            "tiny_sft",
            "--sft",
            "--data",
            prefix,
            "--device",
            "cpu",
            "--iters",
            20,
            "--seq-length",
            128,
            "--run-dir",
            run_dir,
            "--set",
            "training.eval_interval=10",
            "--set",
            "model.vocab_size=640",
            "--set",
            f"data.tokenizer={tokenizer}",
            "--set",
            f'training.sample_prompts=["{prompt}"]',
            "--set",
            "training.sample_interval=20",
            "--set",
            "training.sample_tokens=8",
        )
    assert "dropped conversations longer than 128 tokens: 3 in train;" in caplog.text
    losses = [r["loss"] for r in records(run_dir).values()]
    assert losses[-1] < 0.7 * losses[0], losses
    valid = [r["loss"] for r in records(run_dir, "valid").values()]
    assert len(valid) == 2 and valid[-1] < valid[0]
    saved = json.loads(
        (run_dir / "checkpoints" / "iter_0000020" / "pipe_metadata.json").read_text()
    )
    assert saved["metadata"]["data"]["kind"] == "sft"
    # The sample prompt was asked as a user's turn, rendered as transformers renders it.
    assert records(run_dir, "sample")[20]["sample_0"].startswith(prompt + "\n")
    samples = TrainingSamples([prompt], tokenizer, 4, chat=True)
    hf = pytest.importorskip("transformers").PreTrainedTokenizerFast.from_pretrained(str(tokenizer))
    messages = [{"role": "user", "content": prompt}]
    expected = hf.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=True
    )
    assert samples.encoded == [list(expected["input_ids"])] and hf.eos_token_id in samples.ends
