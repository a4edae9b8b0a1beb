"""`pipe train --dpo`: preference samples, the reference (live or precomputed), layouts, and
a short run whose held-out margin grows.

Preference datasets are written here directly with pipe's indexed-dataset writer, as `pipe
preprocess --preference` writes them (tests/preprocess/test_preference.py checks that against
transformers): `X_chosen_document`, `X_rejected_document` and their uint8 loss masks. The
pairs share a prompt; the chosen reply is always the same few tokens (a preference a tiny
model learns in a few steps), the rejected reply is random.
"""

from __future__ import annotations

import json
import math
import os
import signal
from pathlib import Path

import numpy as np
import pytest
import torch

from pipeline.data.indexed import IndexedDatasetWriter
from pipeline.data.loss_mask import loss_mask_prefix
from pipeline.data.preference_dataset import PreferencePairs
from pipeline.train.assembly.run_config import resolve_config
from pipeline.train.config.schema import ConfigError
from tests.builders import kill_after_save, layout_sets, records, run_pipe, train_and_probe
from tests.distributed import run_distributed

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

EOD = 2


def write_pairs(prefix: Path, count: int, vocab: int, seed: int = 0, long: int = 0) -> str:
    """`count` pairs under output prefix `prefix` (both sides, masks, a manifest); the first
    `long` pairs with a chosen side longer than 40 tokens."""
    rng = np.random.default_rng(seed)
    sides = {"chosen": [], "rejected": []}
    for i in range(count):
        prompt = rng.integers(3, vocab, int(rng.integers(3, 8)))
        chosen = np.array([7, 8, 9, 10, EOD])
        if i < long:
            chosen = np.concatenate([np.tile(prompt, 8), [EOD]])
        rejected = np.concatenate([rng.integers(3, vocab, int(rng.integers(2, 9))), [EOD]])
        for side, reply in (("chosen", chosen), ("rejected", rejected)):
            ids = np.concatenate([[1], prompt, [EOD], reply]).astype(np.int64)
            mask = np.zeros(len(ids), np.uint8)
            mask[len(prompt) + 2 :] = 1
            sides[side].append((ids, mask))
    outputs = {}
    for side, items in sides.items():
        name = f"{prefix}_{side}_document"
        with (
            IndexedDatasetWriter(name, np.uint16) as tokens,
            IndexedDatasetWriter(loss_mask_prefix(name), np.uint8) as masks,
        ):
            for ids, mask in items:
                tokens.add_document(ids)
                masks.add_document(mask)
            tokens.finalize()
            masks.finalize()
        outputs[side] = {"prefix": name}
    manifest = {
        "format": "pipe-preprocess-manifest/1",
        "outputs": outputs,
        "tokenizer": {"eod": EOD, "vocab_size": vocab},
    }
    Path(f"{prefix}.json").write_text(json.dumps(manifest))
    return str(prefix)


def _dpo_sets(run_dir: Path, prefix: str, *extra: str) -> list[str]:
    return [
        *layout_sets("tiny_dpo", run_dir, *extra),
        "data.mock=false",
        f"data.blend={prefix}",
        "data.split=80,20,0",
    ]


# ---- samples ---------------------------------------------------------------------------------


def test_samples_hold_whole_pairs(tmp_path: Path) -> None:
    from pipeline.data.blend_spec import parse_blend
    from pipeline.data.blended import build_datasets
    from pipeline.data.gpt_dataset import GPTDatasetConfig
    from pipeline.data.preference_dataset import PreferenceDataset

    prefix = write_pairs(tmp_path / "pairs", 20, 100, long=2)
    config = GPTDatasetConfig(
        sequence_length=32,
        eod_id=EOD,
        tokenizer_id="t",
        random_seed=1,
        split="80,20,0",
        create_attention_mask=False,
        pad_id=None,
        path_to_cache=str(tmp_path / "cache"),
    )
    train, valid, _ = build_datasets(
        parse_blend(prefix), config, (32, 4, 0), dataset_class=PreferenceDataset
    )
    pairs = PreferencePairs(prefix)
    seen = set()
    for idx in range(16):  # one epoch of the 16 training pairs
        sample = train[idx]
        pair = int(sample["pair"])
        seen.add(pair)
        for s, side in enumerate(pairs.sides):
            ids, mask = side.get(pair), side.mask(pair)
            n = min(len(ids), 33) - 1
            assert sample["tokens"][s][:n].tolist() == ids[:n].tolist()
            assert sample["labels"][s][:n].tolist() == ids[1 : n + 1].tolist()
            assert sample["loss_mask"][s][:n].tolist() == mask[1 : n + 1].tolist()
            assert not sample["loss_mask"][s][n:].any()
    assert seen == set(range(16))  # the first 80%: pairs 0..15, each once per epoch
    assert {int(valid[i]["pair"]) for i in range(4)} == {16, 17, 18, 19}


def test_sides_of_different_lengths_are_refused(tmp_path: Path) -> None:
    prefix = write_pairs(tmp_path / "a", 4, 100)
    other = write_pairs(tmp_path / "b", 5, 100)
    for suffix in ("bin", "idx"):
        for name in ("rejected_document", "rejected_loss_mask_document"):
            Path(f"{other}_{name}.{suffix}").replace(f"{prefix}_{name}.{suffix}")
    with pytest.raises(ValueError, match="4 chosen but 5 rejected"):
        PreferencePairs(prefix)


# ---- the reference ---------------------------------------------------------------------------


def test_first_step_is_ln2_and_precomputed_equals_live(tmp_path: Path) -> None:
    prefix = write_pairs(tmp_path / "pairs", 40, 128)
    live = train_and_probe("tiny_dpo", _dpo_sets(tmp_path / "live", prefix))
    pre = _dpo_sets(tmp_path / "pre", prefix, "dpo.precompute_reference=true")
    precomputed = train_and_probe("tiny_dpo", pre)
    assert live["losses"][1] == pytest.approx(math.log(2), abs=1e-6)
    assert live["losses"].keys() == precomputed["losses"].keys()
    for step, loss in live["losses"].items():
        assert precomputed["losses"][step] == pytest.approx(loss, rel=1e-5), step
    assert live["losses"][3] != pytest.approx(math.log(2), abs=1e-4)  # the policy moved
    assert precomputed["valid"] == pytest.approx(live["valid"], rel=1e-5)
    files = list(tmp_path.glob("pairs_reference-*.npy"))
    assert len(files) == 1 and np.load(files[0]).shape == (40, 2)


# ---- layouts ---------------------------------------------------------------------------------

PRECOMPUTED = "dpo.precompute_reference=true"
LAYOUTS = {
    "tp2": ["parallel.tp=2", "parallel.sequence_parallel=false"],
    "tp2_sp": ["parallel.tp=2", "parallel.sequence_parallel=true"],
    "dp2": ["parallel.dp=2"],
    "dp2_precomputed": ["parallel.dp=2", PRECOMPUTED],  # a shared pass
    # The objective inside the pipeline schedule; the live reference walks its own stages.
    "pp2": ["parallel.pp=2"],
    "pp2_precomputed": ["parallel.pp=2", PRECOMPUTED],
    # Each rank holds half of every sequence: the per-side sums are added over the pair.
    "cp2": ["parallel.cp=2"],
    "cp2_precomputed": ["parallel.cp=2", PRECOMPUTED],
}


def _dpo_layout_worker(rank: int, world_size: int, tmp: Path, prefix: str) -> dict:
    return {
        name: train_and_probe("tiny_dpo", _dpo_sets(tmp / name, prefix, *extra))
        for name, extra in LAYOUTS.items()
    }


KEYS = ("margin", "rewards_chosen", "rewards_rejected")


def _stage_gradients(per_rank: list[dict], name: str) -> dict:
    """Every parameter's gradient from the ranks of a layout (pipeline stages report theirs)."""
    grads: dict = {}
    for result in per_rank:
        grads |= result[name]["grads"]
    return grads


@pytest.mark.dist
def test_dpo_layouts_equal_one_process(tmp_path: Path) -> None:
    prefix = write_pairs(tmp_path / "pairs", 40, 128)
    reference = train_and_probe("tiny_dpo", _dpo_sets(tmp_path / "single", prefix))
    per_rank = run_distributed(_dpo_layout_worker, 2, tmp_path / "dist", prefix)
    for name in LAYOUTS:
        for result in (r[name] for r in per_rank):
            for step, loss in reference["losses"].items():
                assert result["losses"][step] == pytest.approx(loss, rel=1e-4), (name, step)
            assert result["probe"] == pytest.approx(reference["probe"], rel=1e-4), name
            assert result["valid"] == pytest.approx(reference["valid"], rel=1e-4), name
        # Summed over stages and ranks. Accuracy is a step in the margin, which is 0 at step 1
        # (the policy is its reference), so only the held-out split's is compared.
        for split, keys in (("train", KEYS), ("valid", (*KEYS, "accuracy"))):
            figures = records(tmp_path / "dist" / name, split)
            for step, record in records(tmp_path / "single", split).items():
                for key in keys:
                    expected = pytest.approx(record[key], rel=1e-4, abs=1e-6)
                    assert figures[step][key] == expected, (name, split, step, key)
        grads = _stage_gradients(per_rank, name)
        assert grads.keys() == reference["grads"].keys(), name
        for param, grad in reference["grads"].items():
            torch.testing.assert_close(grads[param], grad, atol=1e-6, rtol=1e-4, msg=name)


# ---- resume --------------------------------------------------------------------------------


def _train(sets: list[str]):
    from pipeline.train.loop.trainer import Trainer

    return Trainer(resolve_config("tiny_dpo", sets), console=False).train()


def _start_sets(tmp_path: Path, prefix: str, start: str) -> list[str]:
    """How the run starts: its seeded initialisation, a precomputed reference, or the weights of
    another run's checkpoint (`--load CKPT --finetune`)."""
    if start == "precomputed":
        return [PRECOMPUTED]
    if start == "checkpoint":
        _train(_dpo_sets(tmp_path / "base", prefix, "training.iters=1"))
        return [f"checkpoint.load={tmp_path / 'base' / 'checkpoints'}", "checkpoint.finetune=true"]
    return []


@pytest.mark.parametrize("start", ["seeded", "precomputed", "checkpoint"])
def test_dpo_resumes_exactly_after_sigkill(tmp_path: Path, start: str) -> None:
    """A DPO run SIGKILLed after saving iteration 2 and resumed with --load of its checkpoints
    continues as the uninterrupted run (losses, valid margin bit for bit): the checkpoint records
    its reference and the resumed run rebuilds it. A changed reference is refused in one line."""
    prefix = write_pairs(tmp_path / "pairs", 40, 128)
    extra = [
        "training.iters=4",
        "checkpoint.save_interval=2",
        "training.eval_interval=2",
        *_start_sets(tmp_path, prefix, start),
    ]
    run_a, run_b = tmp_path / "a", tmp_path / "b"
    _train(_dpo_sets(run_a, prefix, *extra))
    proc = kill_after_save(2, "tiny_dpo", _dpo_sets(run_b, prefix, *extra))
    output, _ = proc.communicate(timeout=180)
    assert proc.returncode == -signal.SIGKILL, output
    again = [s for s in _dpo_sets(run_b, prefix, *extra) if not s.startswith("checkpoint.")]
    resume = [*again, f"checkpoint.load={run_b / 'checkpoints'}", "checkpoint.save_interval=2"]
    _train(resume)
    a, b = records(run_a), records(run_b)
    assert [a[s]["loss"] for s in (3, 4)] == [b[s]["loss"] for s in (3, 4)]
    assert a[4]["grad_norm"] == b[4]["grad_norm"]
    assert records(run_a, "valid")[4]["margin"] == records(run_b, "valid")[4]["margin"]
    metadata = json.loads(
        (run_b / "checkpoints" / "iter_0000004" / "pipe_metadata.json").read_text()
    )["metadata"]
    recorded = metadata["dpo_reference"]
    if start == "seeded":
        assert recorded["load"] is None
    elif start == "checkpoint":
        base = tmp_path / "base" / "checkpoints" / "iter_0000001"
        assert recorded["load"] == str(base.resolve())
        os.utime(next(base.iterdir()), (1, 1))  # the start is not what it was
        with pytest.raises(ConfigError, match="started from .* changed since"):
            _train(resume)
    else:
        (path,) = recorded["files"]
        np.save(path, np.load(path) + 1.0)
        with pytest.raises(ConfigError, match="have changed since"):
            _train(resume)


def test_resuming_a_language_model_checkpoint_as_dpo_is_refused(tmp_path: Path) -> None:
    """A checkpoint of another kind of run is no DPO run to resume: one line says to start DPO
    from it with --finetune."""
    from pipeline.train.loop.trainer import Trainer

    prefix = write_pairs(tmp_path / "pairs", 16, 128)
    lm = tmp_path / "lm"
    sets = layout_sets("tiny", lm, "training.iters=1")
    Trainer(resolve_config("tiny", sets), console=False).train()
    sets = _dpo_sets(tmp_path / "dpo", prefix, f"checkpoint.load={lm / 'checkpoints'}")
    with pytest.raises(ConfigError, match="--finetune"):
        _train(sets)


# ---- pipe train --dpo ------------------------------------------------------------------------


SMALL_MODEL = [
    "model.num_layers=2",
    "model.hidden_size=64",
    "model.num_attention_heads=4",
    "model.num_kv_heads=2",
    "model.ffn_hidden_size=128",
]


def test_pipe_train_dpo_margin_grows(tmp_path: Path) -> None:
    prefix = write_pairs(tmp_path / "pairs", 200, 256, seed=4)
    run_dir = tmp_path / "run"
    run_pipe(
        "train",
        "--recipe",
        "tiny_dpo",
        "--dpo",
        "--data",
        prefix,
        "--device",
        "cpu",
        "--iters",
        30,
        "--seq-length",
        32,
        "--run-dir",
        run_dir,
        "--set",
        "model.vocab_size=256",
        "--set",
        "training.eval_interval=10",
        "--set",
        "training.eval_iters=5",
        "--set",
        "dpo.beta=0.5",
        "--lr",
        "2e-3",
        *(arg for s in SMALL_MODEL for arg in ("--set", s)),
    )
    train = records(run_dir)
    assert {"rewards_chosen", "rewards_rejected", "margin", "accuracy"} <= train[5].keys()
    valid = records(run_dir, "valid")
    margins = [valid[i]["margin"] for i in (10, 20, 30)]
    assert margins[0] < margins[1] < margins[2] and margins[2] > 0.5, margins
    assert valid[30]["accuracy"] > 0.8 and valid[30]["loss"] < valid[10]["loss"]
    saved = json.loads(
        (run_dir / "checkpoints" / "iter_0000030" / "pipe_metadata.json").read_text()
    )
    assert saved["metadata"]["data"]["kind"] == "dpo"


def test_dpo_config_refused(tmp_path: Path) -> None:
    prefix = write_pairs(tmp_path / "pairs", 8, 128)
    for extra, problem in [
        (["--set", "dpo.loss=ipo", "--set", "dpo.label_smoothing=0.1"], "not ipo"),
        (["--set", "model.mtp_num_layers=1"], "no multi-token prediction"),
        (["--sft"], "--sft and --dpo"),
    ]:
        result = run_pipe(
            "train",
            "--recipe",
            "tiny_dpo",
            "--dpo",
            "--data",
            prefix,
            "--device",
            "cpu",
            "--run-dir",
            tmp_path / "run",
            *extra,
            expect_ok=False,
        )
        assert result.exit_code == 2 and problem in result.output, result.output
    with pytest.raises(ConfigError, match="mock data has none"):
        resolve_config("tiny_dpo", ["data.mock=true"])


def test_with_lora_the_base_is_the_reference(tmp_path: Path) -> None:
    """`pipe train --dpo --lora`: the reference is the base without adapters, live (no second
    model) or precomputed, with the same losses."""
    from pipeline.train.loop.trainer import Trainer
    from pipeline.train.objectives.frozen_start import AdaptersOffRunner

    prefix = write_pairs(tmp_path / "pairs", 40, 128)
    lora = ("lora.enabled=true", "lora.rank=4")
    runs = {}
    for name, extra in (("live", ()), ("pre", ("dpo.precompute_reference=true",))):
        sets = _dpo_sets(tmp_path / name, prefix, *lora, *extra)
        trainer = Trainer(resolve_config("tiny_dpo", sets), console=False)
        runs[name] = trainer.train().losses
        if name == "live":  # the policy's own runner, its adapters left out
            reference = trainer.objective.reference
            assert isinstance(reference, AdaptersOffRunner) and reference.policy is trainer.model
    live, precomputed = runs["live"], runs["pre"]
    assert live[1] == pytest.approx(math.log(2), abs=1e-6)
    assert live[3] != pytest.approx(math.log(2), abs=1e-4)  # the adapters moved
    for step, loss in live.items():
        assert precomputed[step] == pytest.approx(loss, rel=1e-5), step
