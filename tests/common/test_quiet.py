"""Other libraries stay out of pipe's output: commands that import transformers (and, through
it, torchao) or torchao itself print pipe's own lines only, with no kernel-loading log lines,
deprecation warnings or progress bars. Each command runs in a fresh process, as a user runs it,
because these libraries speak once, when they are first imported."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.builders import ROOT

# What each library prints when nothing silences it: torchao's optional kernels that do not load,
# torch's pytree deprecation (triggered by torchao), torchao's Triton notice, Python warnings,
# and the progress bars of transformers' loading and saving (tqdm draws "NN%|").
NOISE = (
    "Failed to load",
    "_pytree",
    "Detected no triton",
    "Warning:",
    "warnings.warn",
    "Loading weights",
    "Writing model shards",
    "%|",
)


def run_pipe(*args: str) -> str:
    """Run `pipe ARGS` in a fresh interpreter; its stdout and stderr together."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("PYTHONWARNINGS", None)
    proc = subprocess.run(
        [sys.executable, "-m", "pipeline", *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
        timeout=300,
    )
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output
    return output


def assert_quiet(output: str) -> None:
    noisy = [line for line in output.splitlines() if any(mark in line for mark in NOISE)]
    assert not noisy, "third-party noise in pipe's output:\n" + "\n".join(noisy)


def test_convert_to_hf_with_transformers_verification_is_quiet(tmp_path) -> None:
    """`pipe convert --to hf` loads the written model in transformers to compare logits."""
    pytest.importorskip("transformers")
    from pipeline.convert.run import run_conversion
    from tests.builders import save_hf as _save_hf

    hf_dir, _ = _save_hf("llama_tied", tmp_path / "hf")
    ckpt, back = tmp_path / "ckpt", tmp_path / "back"
    run_conversion(hf_dir, ckpt, "hf", "pipe", verify="off", quiet=True)
    output = run_pipe("convert", str(ckpt), "--to", "hf", "-o", str(back))
    assert "logits match transformers" in output
    assert_quiet(output)


def test_fp8_training_with_torchao_is_quiet(tmp_path) -> None:
    """`pipe train --fp8 torchao` imports torchao (emulated FP8 on a CPU, one step)."""
    pytest.importorskip("torchao")
    settings = {
        "fp8.emulate": "true",
        "fp8.linear_filter": "all",
        "data.mock": "true",
        "data.seq_length": "64",
        "model.num_layers": "1",
        "scheduler.warmup_iters": "0",
    }
    sets = [arg for key, value in settings.items() for arg in ("--set", f"{key}={value}")]
    output = run_pipe(
        "train",
        "--recipe",
        "tiny",
        "--iters",
        "1",
        "--device",
        "cpu",
        "--fp8",
        "torchao",
        "--run-dir",
        str(tmp_path / "run"),
        *sets,
    )
    assert "linears in fp8" in output
    assert_quiet(output)


def test_dtensor_hints_about_unmergeable_gathers_are_dropped_and_others_kept(caplog) -> None:
    """`pipe train` under FSDP with tensor parallelism gathers twice-sharded tensors on purpose
    (a Hugging Face save, Muon's update), which DTensor says it cannot merge: that line is
    dropped. Its hint that a flattened mesh would merge collectives points at a fix in pipe
    and still shows (tests/train/test_layouts.py asserts no layout gives one)."""
    import logging

    from pipeline.common.quiet import quiet_unmergeable_gather_hints

    logger = logging.getLogger("torch.distributed.tensor._redistribute")
    quiet_unmergeable_gather_hints()
    filters = list(logger.filters)
    quiet_unmergeable_gather_hints()  # idempotent: no second filter
    assert logger.filters == filters
    unmergeable = "2 sequential all_gather ... it is not possible to merge non-ascending order"
    mergeable = "2 sequential all_reduce ... To optimize, flatten mesh dimensions"
    with caplog.at_level(logging.WARNING, logger=logger.name):
        logger.warning("While redistributing: %s", unmergeable)
        logger.warning("While redistributing: %s", mergeable)
    assert [record.getMessage() for record in caplog.records] == [
        f"While redistributing: {mergeable}"
    ]
