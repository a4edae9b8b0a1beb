"""`pipe train --dry-run --gpu NAME`: the per-device memory estimate against a GPU's memory.

Everything runs in-process with click's CliRunner; nothing is built or launched (a dry run
returns before `--nproc-per-node` would re-launch under torchrun, so N only sets the world size).
"""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
from click.testing import CliRunner

from pipeline.train.commands import train
from pipeline.train.report.estimates import GPU_MEMORY_GIB, gpu_memory_gib


def _dry_run(*args: str) -> str:
    """The output of a successful `pipe train --dry-run ARGS`."""
    result = CliRunner().invoke(train, [*args, "--dry-run"])
    assert result.exit_code == 0, result.output
    return result.output


def _totals(output: str) -> tuple[float, float]:
    """The report's (no checkpointing, full checkpointing) totals in GiB."""
    match = re.search(r"total ~ ([\d.]+) GiB \(none\) / ([\d.]+) GiB \(full\)", output)
    assert match, output
    return float(match[1]), float(match[2])


def test_llama3_8b_on_one_h100_warns() -> None:
    """8 B parameters at 16 B each on one device is ~120 GiB of state alone: no H100 holds it."""
    output = _dry_run("--recipe", "llama3_8b", "--gpu", "h100")
    none, full = _totals(output)
    assert none > 150 and full > 120
    assert (
        f"WARNING: this layout will not fit on h100 ({none:.2f} GiB needed, "
        "79.10 GiB available, activation checkpointing none" in output
    )
    assert "try activation checkpointing full" in output and f"{full:.2f} GiB" in output
    assert "--tp, --pp" in output and "fits on" not in output


def test_full_checkpointing_uses_the_full_total() -> None:
    """With activation_checkpointing=full the comparison uses the full-checkpointing total and
    stops suggesting it."""
    output = _dry_run(
        "--recipe",
        "llama3_8b",
        "--nproc-per-node",
        "8",
        "--gpu",
        "A100-40GB",
        "--set",
        "training.activation_checkpointing=full",
    )
    none, full = _totals(output)
    assert full < 0.9 * 39.4 < none
    assert f"fits on a100-40gb: {full:.2f} GiB of 39.40 GiB" in output
    assert "activation checkpointing full)" in output


def test_llama3_8b_tp8_on_eight_h100s_fits() -> None:
    """tp 8 on 8 processes: an eighth of the state and of the activations per device."""
    output = _dry_run(
        "--recipe", "llama3_8b", "--tp", "8", "--nproc-per-node", "8", "--gpu", "h100"
    )
    none, _ = _totals(output)
    assert "tp 8 pp 1 cp 1 ep 1 dp 1 (inferred) = 8 devices" in output
    assert none < 0.9 * 79.1
    assert f"fits on h100: {none:.2f} GiB of 79.10 GiB ({none / 79.1:.0%}" in output
    assert "WARNING" not in output


def test_tiny_fits_on_the_smallest_gpu() -> None:
    output = _dry_run("--recipe", "tiny", "--gpu", "RTX4090")
    none, _ = _totals(output)
    assert f"fits on rtx4090: {none:.2f} GiB of 23.60 GiB" in output


def test_no_gpu_no_fit_line() -> None:
    output = _dry_run("--recipe", "tiny")
    assert "fits on" not in output and "WARNING" not in output


def test_unknown_gpu_is_a_usage_error_listing_the_known_ones() -> None:
    result = CliRunner().invoke(train, ["--recipe", "tiny", "--dry-run", "--gpu", "v100"])
    assert result.exit_code == 2
    assert "unknown GPU 'v100'" in result.output
    assert all(name in result.output for name in GPU_MEMORY_GIB)


def test_gpu_without_dry_run_is_refused(tmp_path) -> None:
    result = CliRunner().invoke(
        train, ["--recipe", "tiny", "--gpu", "h100", "--run-dir", str(tmp_path / "run")]
    )
    assert result.exit_code == 2
    assert "--gpu is for --dry-run" in result.output
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("name", ["h200", "H200", "h200 "])
def test_gpu_names_are_case_insensitive(name: str) -> None:
    if name.strip() != name:
        with pytest.raises(ValueError, match="unknown GPU"):
            gpu_memory_gib(name)
    else:
        assert gpu_memory_gib(name) == 139.8


def test_gpu_check_does_not_import_torch() -> None:
    """The fit check is arithmetic on the estimate: `--dry-run --gpu` stays torch-free."""
    code = (
        "import sys\n"
        "from click.testing import CliRunner\n"
        "from pipeline.train.commands import train\n"
        "r = CliRunner().invoke(train, ['--recipe', 'tiny', '--dry-run', '--gpu', 'h100'])\n"
        "assert r.exit_code == 0 and 'fits on h100' in r.output, r.output\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
