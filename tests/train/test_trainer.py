"""The single-device trainer: accumulation, exact resume, guards, signals, evaluation, CLI.

Every run uses a micro model (2 layers, width 32) on CPU so the file stays well under two
minutes. Runs that must be killed (SIGKILL, SIGTERM) are subprocesses; the rest run in-process.
"""

from __future__ import annotations

import math
import signal
import time
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from pipeline.checkpoint import read_checkpoint_record, verify
from pipeline.train.assembly.run_config import resolve_config
from pipeline.train.config import toml_io
from pipeline.train.loop.guards import NonFiniteStop
from pipeline.train.loop.trainer import Trainer
from tests.builders import (
    MICRO_MODEL,
    kill_after_save,
    micro_sets,
    nan_loss,
    records,
    run_python,
    write_jsonl,
)


def test_accumulation_equivalence(tmp_path: Path) -> None:
    """One micro-batch of 8 and eight of 1 give the same loss and parameters after two steps.

    The loss is normalised by the global token count, so only the summation order differs:
    fp32 agreement to 1e-6 relative on the loss and 1e-6 absolute on the weights."""
    runs = []
    for mbs in (8, 1):
        cfg = resolve_config(None, micro_sets(tmp_path / f"mbs{mbs}", iters=2, mbs=mbs))
        trainer = Trainer(cfg, console=False)
        result = trainer.train()
        runs.append((result.losses, dict(trainer.model.named_parameters())))
    (losses_a, params_a), (losses_b, params_b) = runs
    for step in (1, 2):
        assert losses_a[step] == pytest.approx(losses_b[step], rel=1e-6)
    for name, param in params_a.items():
        torch.testing.assert_close(param, params_b[name], rtol=0, atol=1e-6, msg=name)


def test_exact_resume_after_sigkill(tmp_path: Path) -> None:
    """A run SIGKILLed right after saving iteration 4 and resumed gives bit-identical train and
    valid losses to an uninterrupted run; evaluation logs valid loss and perplexity."""
    run_a, run_b = tmp_path / "a", tmp_path / "b"
    Trainer(resolve_config(None, micro_sets(run_a)), console=False).train()

    proc = kill_after_save(4, None, micro_sets(run_b))
    output, _ = proc.communicate(timeout=90)
    assert proc.returncode == -signal.SIGKILL, output
    assert max(records(run_b)) == 4
    resumed = micro_sets(run_b, f"checkpoint.load={run_b / 'checkpoints'}")
    Trainer(resolve_config(None, resumed), console=False).train()

    a, b = records(run_a), records(run_b)
    assert [a[s]["loss"] for s in range(5, 9)] == [b[s]["loss"] for s in range(5, 9)]
    assert [a[s]["grad_norm"] for s in range(5, 9)] == [b[s]["grad_norm"] for s in range(5, 9)]
    valid_a, valid_b = records(run_a, "valid"), records(run_b, "valid")
    assert sorted(valid_a) == [4, 8]
    assert valid_a[8]["loss"] == valid_b[8]["loss"]
    assert valid_a[8]["ppl"] == pytest.approx(math.exp(valid_a[8]["loss"]))
    meta = read_checkpoint_record(run_b / "checkpoints" / "iter_0000008")["metadata"]
    assert meta["consumed_samples"] == 64 and meta["layout"]["tp"] == 1
    assert meta["tokenizer"]["source"] == "mock"


def test_nan_step_is_skipped_and_counted(tmp_path: Path, monkeypatch) -> None:
    sets = micro_sets(tmp_path, "training.eval_interval=0", iters=3, mbs=8)
    trainer = Trainer(resolve_config(None, sets), console=False)
    nan_loss(monkeypatch, bad_calls={2})  # the one micro-batch of iteration 2
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    train = records(tmp_path)
    assert math.isnan(train[2]["loss"]) and train[2]["skipped"] == 1
    assert train[3]["skipped"] == 1 and math.isfinite(train[3]["loss"])
    assert any(not torch.equal(before[n], p) for n, p in trainer.model.named_parameters())


def test_nan_in_a_row_saves_and_stops(tmp_path: Path, monkeypatch) -> None:
    sets = micro_sets(tmp_path, "training.eval_interval=0", iters=20, mbs=8)
    trainer = Trainer(resolve_config(None, sets), console=False, max_consecutive_skips=3)
    nan_loss(monkeypatch, bad_calls=None)
    with pytest.raises(NonFiniteStop, match="stopping at iteration 3") as stop:
        trainer.train()
    assert "iter_0000003" in str(stop.value)
    assert verify(tmp_path / "checkpoints" / "iter_0000003").ok


def test_checkpoints_off_save_nothing(tmp_path: Path) -> None:
    """`checkpoint.enable=false` (benchmarks, smoke runs): a finished run with a save due on
    the way writes no checkpoint; the same run with it on writes both; save_hf is refused."""
    for enable, expected in ((False, []), (True, ["iter_0000002", "iter_0000003"])):
        run_dir = tmp_path / str(enable)
        sets = micro_sets(run_dir, f"checkpoint.enable={str(enable).lower()}", iters=3, mbs=8)
        sets += ["checkpoint.save_interval=2", "training.eval_interval=0"]
        result = Trainer(resolve_config(None, sets), console=False).train()
        saved = sorted(p.name for p in (run_dir / "checkpoints").glob("iter_*"))
        assert saved == expected and (result.checkpoint is None) == (not enable)
        assert len(records(run_dir)) == 3
    refused = micro_sets(tmp_path / "hf", "checkpoint.enable=false", "checkpoint.save_hf=final")
    with pytest.raises(Exception, match="checkpoint.save_hf writes with the checkpoints"):
        Trainer(resolve_config(None, refused), console=False)


def test_sigterm_saves_and_exits_zero(tmp_path: Path) -> None:
    """SIGTERM mid-run: the step finishes, a checkpoint is saved and verifies, exit code 0."""
    args = ["--set=" + s for s in micro_sets(tmp_path, "training.eval_interval=0")]
    args += ["--iters", "100000", "--set", "checkpoint.save_interval=0"]
    proc = run_python("from pipeline.train.commands import train; train()", *args)
    deadline = time.monotonic() + 60
    metrics = tmp_path / "metrics.jsonl"
    while not (metrics.exists() and metrics.read_text().count("\n") >= 2):
        assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read()
        time.sleep(0.1)
    proc.send_signal(signal.SIGTERM)
    output, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0, output
    assert "SIGTERM" in output
    latest = (tmp_path / "checkpoints" / "latest").read_text().strip()
    assert verify(tmp_path / "checkpoints" / latest).ok
    assert int(latest.removeprefix("iter_")) >= 2


SIGTERM_DURING_EVALUATION = """
    import os, signal, sys
    from pipeline.train.commands import train
    from pipeline.train.loop.step_runner import LocalStepRunner

    original = LocalStepRunner.evaluate
    calls = []

    def evaluate_then_signal(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == 2:  # the scheduler's SIGTERM, in the middle of a long evaluation
            os.kill(os.getpid(), signal.SIGTERM)
        return original(self, *args, **kwargs)

    LocalStepRunner.evaluate = evaluate_then_signal
    try:
        train()
    finally:
        print(f"evaluation batches: {len(calls)}")
"""


def test_sigterm_during_evaluation_saves_and_exits_before_it_ends(tmp_path: Path) -> None:
    """SIGTERM during a 1000-batch evaluation is noticed at the next batch: the evaluation
    stops there (unlogged), the iteration is saved and the run exits 0."""
    sets = micro_sets(tmp_path, "training.eval_interval=2", "training.eval_iters=1000")
    args = [*("--set=" + s for s in sets), "--iters", "100", "--set", "checkpoint.save_interval=0"]
    proc = run_python(SIGTERM_DURING_EVALUATION, *args)
    output, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, output
    assert "SIGTERM received: evaluation stopped" in output and "evaluation batches: 2" in output
    assert (tmp_path / "checkpoints" / "latest").read_text().strip() == "iter_0000002"
    assert verify(tmp_path / "checkpoints" / "iter_0000002").ok
    assert not records(tmp_path, "valid")  # an interrupted evaluation is no figure


def test_help_and_dry_run_do_not_import_torch() -> None:
    code = """
        import sys
        from click.testing import CliRunner
        from pipeline.train.commands import train
        help = CliRunner().invoke(train, ["--help"])
        assert help.exit_code == 0 and "--dry-run" in help.output, help.output
        dry = CliRunner().invoke(train, ["--recipe", "tiny", "--dry-run"])
        assert dry.exit_code == 0, dry.output
        print(dry.output)
        assert "torch" not in sys.modules, "torch was imported"
    """
    proc = run_python(code)
    output, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0, output
    assert "parameters" in output and "FLOP/token" in output


def test_cli_flags_and_layout_check(tmp_path: Path) -> None:
    from pipeline.train.commands import train

    # tp=2 needs two processes: a usage error naming the sizes, before anything is built.
    result = CliRunner().invoke(train, ["--recipe", "tiny", "--tp", "2"])
    assert result.exit_code == 2
    assert "world size 1 is not divisible by tp*pp*cp = 2" in result.output
    # Only typed flags override: the recipe's global batch (16) survives the flag defaults.
    result = CliRunner().invoke(train, ["--recipe", "tiny", "--iters", "50", "--dry-run"])
    assert result.exit_code == 0, result.output
    assert "global 16 samples" in result.output and "50 iters" in result.output
    # The resolved config is printed whole, as config.toml will hold it, flags applied.
    printed = result.output.split("# resolved config (what the run writes to config.toml)\n")[1]
    resolved = toml_io.loads(printed[: printed.index("model   ")])
    assert resolved["training"]["iters"] == 50 and resolved["model"]["flavor"] == "tiny"


def test_short_real_data_run_learns(tmp_path: Path, tiny_tokenizer_dir: Path) -> None:
    """Preprocess a small JSONL with a 600-token BPE, train ~30 steps: the loss goes down."""
    from pipeline.cli import cli

    docs = [{"text": f"line {i}: value={i * 7} {'abc' * (i % 5)} the end."} for i in range(400)]
    src = write_jsonl(tmp_path / "docs.jsonl", docs)
    prefix = tmp_path / "data" / "corpus"
    result = CliRunner().invoke(
        cli,
        [
            "preprocess",
            "-i",
            str(src),
            "--tokenizer",
            str(tiny_tokenizer_dir),
            "-o",
            str(prefix),
            "--append-eod",
            "--workers",
            "1",
            "--quiet",
        ],
    )
    assert result.exit_code == 0, result.output
    run_dir = tmp_path / "run"
    sets = [
        *MICRO_MODEL[:-1],
        "model.vocab_size=640",
        f"data.blend={prefix}_text_document",
        "data.split=90,10,0",
        "data.seq_length=32",
        "data.num_workers=0",
        "training.iters=30",
        "training.micro_batch_size=4",
        "training.global_batch_size=8",
        "training.eval_interval=15",
        "training.eval_iters=2",
        "training.log_interval=1",
        "training.device=cpu",
        "optimizer.lr=3e-3",
        "optimizer.min_lr=3e-4",
        "scheduler.warmup_iters=3",
        "checkpoint.save_interval=0",
        f"logging.run_dir={run_dir}",
    ]
    result = Trainer(resolve_config(None, sets), console=False).train()
    losses = [result.losses[s] for s in range(1, 31)]
    print("loss curve:", " ".join(f"{x:.3f}" for x in losses))
    assert sum(losses[-5:]) / 5 < losses[0] - 1.0
    valid = records(run_dir, "valid")
    assert valid[30]["loss"] < valid[15]["loss"]
    meta = read_checkpoint_record(run_dir / "checkpoints" / "iter_0000030")["metadata"]
    assert meta["tokenizer"]["source"].startswith("manifest:")
    assert meta["data"]["blend"] == f"{prefix}_text_document"
    assert (run_dir / "config.toml").is_file()


def test_activation_checkpointing_keeps_losses(tmp_path: Path) -> None:
    """Full and selective recomputation change memory, not numerics: identical losses."""
    losses = {}
    for mode in ("none", "full", "selective"):
        sets = micro_sets(
            tmp_path / mode, f"training.activation_checkpointing={mode}", "training.eval_interval=0"
        )
        losses[mode] = Trainer(resolve_config(None, sets[:]), console=False).train().losses
    assert losses["none"] == losses["full"] == losses["selective"]


def test_fp8_recipe_on_cpu_is_refused_before_training(tmp_path):
    from click.testing import CliRunner

    from pipeline.train.commands import train

    result = CliRunner().invoke(
        train,
        [
            "--recipe",
            "tiny",
            "--iters",
            "40",
            "--run-dir",
            str(tmp_path / "run"),
            "--set",
            "fp8.recipe=torchao:tensorwise",
        ],
    )
    assert result.exit_code == 1
    assert "FP8 training needs a CUDA GPU" in result.output
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_moe_model_trains_with_its_aux_loss(tmp_path: Path) -> None:
    """A micro Mixtral-style model trains on the same path; its router losses are added."""
    moe = ["model.num_experts=4", "model.moe_top_k=2", "model.moe_aux_loss_coeff=0.01"]
    cfg = resolve_config(None, micro_sets(tmp_path / "moe", *moe, iters=4))
    trainer = Trainer(cfg, console=False)
    assert len(trainer.model.moe_layers()) == 2
    result = trainer.train()
    assert result.stop_reason == "finished" and len(result.losses) == 4
    assert all(math.isfinite(loss) for loss in result.losses.values())
    aux = trainer.model.moe_aux_loss()
    assert aux is not None and float(aux) > 0
