"""Launching: the Slurm script parses and runs torchrun on `-m pipeline train`, and a rank that
fails under torchrun takes the whole job down with its own error instead of leaving the others
waiting in a collective.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from tests.builders import ROOT, free_port, micro_sets

SBATCH = ROOT / "scripts" / "slurm" / "train.sbatch"
LAUNCH_TIMEOUT_S = 120


def _logical_lines(text: str) -> list[str]:
    """Shell lines with backslash continuations joined."""
    return text.replace("\\\n", " ").splitlines()


def test_slurm_script_parses_and_launches_pipeline_train() -> None:
    subprocess.run(["bash", "-n", str(SBATCH)], check=True)
    lines = _logical_lines(SBATCH.read_text())
    torchrun = [line for line in lines if re.match(r"\s*srun\b.*\btorchrun\b", line)]
    assert len(torchrun) == 1, torchrun
    command = " ".join(torchrun[0].split())
    assert '-m pipeline train "$@"' in command
    assert '--save "$CKPT_DIR" --load "$CKPT_DIR"' in command
    for flag in ("--nnodes", "--nproc-per-node", "--rdzv-backend c10d", "--rdzv-id"):
        assert flag in command
    directives = {line.split()[1] for line in lines if line.startswith("#SBATCH")}
    assert {"--ntasks-per-node=1", "--gpus-per-node=8", "--requeue"} <= directives
    assert "--signal=B:TERM@120" in directives


# Run by each torchrun rank: `pipe train` exactly as the CLI runs it, except that rank 1's
# Trainer.train raises at once, while rank 0 goes on into the first step's collectives.
BROKEN_RANK = """
    import os
    import sys

    from pipeline.train.loop import trainer
    from pipeline.train.commands import train

    if os.environ["RANK"] == "1":
        def broken(self):
            raise RuntimeError("rank 1 broke on purpose")

        trainer.Trainer.train = broken
    train.main(sys.argv[1:], standalone_mode=True)
"""


def test_failing_rank_ends_the_job_with_its_message(tmp_path: Path) -> None:
    """Two gloo ranks of the real `pipe train --dp 2`; rank 1 raises before its first step.

    Rank 0 is then blocked in the first step's all-reduce; gloo sees the closed connection and
    raises, torchrun SIGTERMs what is left and exits non-zero, naming rank 1 as the root cause.
    (A rank blocked where no error arrives, e.g. in an NCCL collective, keeps running through
    SIGTERM because `pipe train` turns it into "finish the step and save"; torchrun SIGKILLs it
    30 s later.) The run is bounded by LAUNCH_TIMEOUT_S; in practice it takes seconds."""
    script = tmp_path / "broken_rank.py"
    script.write_text(textwrap.dedent(BROKEN_RANK))
    run_dir = tmp_path / "run"
    args = [f"--set={s}" for s in micro_sets(run_dir, "training.eval_interval=0", iters=50)]
    args += ["--dp", "2", "--device", "cpu", "--run-dir", str(run_dir)]
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        "2",
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        str(free_port()),
        str(script),
        *args,
    ]
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "GLOO_SOCKET_IFNAME": "lo",
        "OMP_NUM_THREADS": "1",
    }
    start = time.monotonic()
    proc = subprocess.Popen(
        command,
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        output, _ = proc.communicate(timeout=LAUNCH_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # torchrun and both ranks
        output, _ = proc.communicate()
        pytest.fail(f"torchrun still running after {LAUNCH_TIMEOUT_S} s:\n{output[-4000:]}")
    elapsed = time.monotonic() - start
    print(f"failing rank took the job down in {elapsed:.1f} s")
    assert proc.returncode != 0, output
    assert "RuntimeError: rank 1 broke on purpose" in output
    root_cause = output[output.rindex("Root Cause") :]
    assert re.search(r"rank\s*: 1 \(local_rank: 1\)", root_cause), root_cause
    # Rank 0 did not carry on alone: no checkpoint was ever committed.
    assert not (run_dir / "checkpoints" / "latest").exists()
