"""Checkpoint conversion and export of a full-size model against a plain file copy.

Writes a randomly initialised pipe checkpoint of a flavor's full shape (default llama3_8b,
bf16: about 16 GB) with the streaming writer, then in the same run:

1. copies the checkpoint's data files to a new directory (the baseline: the fastest any
   conversion could move these bytes on this disk);
2. runs `pipe convert CKPT --to hf --verify off` in a child process and reads its peak RSS,
   once as users run it (every file checked against its recorded SHA-256 while it is read)
   and once with `--no-verify-checksums`, to show what the verification costs;
3. with `--export`, also `pipe export CKPT --trtllm --verify off` (and with `--trtllm-format
   legacy --tp 2`) the same way.

It prints seconds, GB/s and peak RSS, and the ratios the issue sets as targets: conversion
throughput within 2x of the copy (copy seconds / convert seconds >= 0.5) with checksums
verified, peak RSS under 4 GB (the export is held to the same bar).

    python scripts/bench/convert.py [--flavor llama3_8b] [--workdir DIR] [--export] [--keep]
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

GB = 1e9
MEASURED_RUN = Path(__file__).with_name("measured_run.py")  # wall seconds, peak RSS
NO_VERIFY = ["--no-verify-checksums"]


class RandomSource:
    """A `TensorSource` of a flavor's shape whose tensors are drawn when read (bf16)."""

    def __init__(self, flavor: str) -> None:
        import torch

        from pipeline.core.model.flavors import get_flavor
        from pipeline.core.model.transformer import Transformer
        from pipeline.weights.source import TensorInfo

        self.model_config = get_flavor(flavor)
        self.metadata = {"source": f"random {flavor}"}
        with torch.device("meta"):
            model = Transformer(self.model_config)
        self._infos = {
            name: TensorInfo(tuple(p.shape), torch.bfloat16) for name, p in model.named_parameters()
        }

    def tensors(self) -> dict:
        return dict(self._infos)

    def read(self, name: str):
        import torch

        info = self._infos[name]
        return torch.randn(info.shape, dtype=torch.float32).mul_(0.02).to(info.dtype)


def timed(label: str, fn) -> float:
    start = time.perf_counter()
    fn()
    seconds = time.perf_counter() - start
    print(f"{label}: {seconds:.1f} s", flush=True)
    return seconds


def data_bytes(directory: Path) -> int:
    return sum(p.stat().st_size for p in directory.iterdir() if p.suffix == ".distcp")


def copy_files(source: Path, target: Path) -> None:
    target.mkdir(parents=True)
    for path in sorted(source.iterdir()):
        if path.is_file():
            shutil.copyfile(path, target / path.name)
    os.sync()


def run_child(what: str, arguments: list[str]) -> tuple[float, float]:
    """(seconds, peak RSS in GB) of `python -m pipeline ARGUMENTS` in a fresh process."""
    with tempfile.TemporaryFile("w+") as output:
        command = [sys.executable, "-m", "pipeline", *arguments]
        launcher = subprocess.run(
            [sys.executable, MEASURED_RUN, *command],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=output,
            text=True,
        )
        output.seek(0)
        text = output.read().strip()
    if launcher.returncode != 0:
        raise SystemExit(f"{what} failed:\n{text}")
    print(text)
    os.sync()
    seconds, rss_kib = launcher.stdout.split()
    return float(seconds), int(rss_kib) * 1024 / GB


def report(what: str, seconds: float, peak_gb: float, size: int, copy_s: float) -> None:
    print(f"{what}: {seconds:.1f} s, {size / seconds / GB:.2f} GB/s, peak RSS {peak_gb:.2f} GB")
    print(f"  throughput ratio ({what} / copy) = {copy_s / seconds:.2f}  (target >= 0.5)")
    print(f"  peak RSS = {peak_gb:.2f} GB  (target < 4 GB)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--flavor", default="llama3_8b")
    parser.add_argument("--workdir", type=Path, default=None, help="default: a temp dir")
    parser.add_argument("--export", action="store_true", help="also time pipe export --trtllm")
    parser.add_argument("--keep", action="store_true", help="keep the files written")
    args = parser.parse_args()

    from pipeline.weights.pipe_checkpoint import write_pipe_checkpoint

    workdir = Path(tempfile.mkdtemp(prefix="pipe-bench-convert-", dir=args.workdir))
    try:
        source = RandomSource(args.flavor)
        config = dataclasses.asdict(source.model_config)
        print(f"{args.flavor}: {config['num_layers']} layers, hidden {config['hidden_size']}")
        checkpoint = workdir / "ckpt"
        timed("write random checkpoint", lambda: write_pipe_checkpoint(source, checkpoint))
        iteration_dir = next(checkpoint.glob("iter_*"))
        size = data_bytes(iteration_dir)
        print(f"checkpoint data: {size / GB:.2f} GB")

        copy_s = timed("plain copy (baseline)", lambda: copy_files(iteration_dir, workdir / "copy"))
        shutil.rmtree(workdir / "copy")
        print(f"copy: {size / copy_s / GB:.2f} GB/s")
        convert = ["convert", str(checkpoint), "--to", "hf", "-o", str(workdir / "hf")]
        convert += ["--verify", "off", "--quiet"]
        timings = {}
        for label, flags in (("checksums verified", []), ("--no-verify-checksums", NO_VERIFY)):
            seconds, peak_gb = run_child("pipe convert", convert + flags)
            report(f"pipe convert --to hf ({label})", seconds, peak_gb, size, copy_s)
            shutil.rmtree(workdir / "hf")
            timings[label] = seconds
        overhead = timings["checksums verified"] / timings["--no-verify-checksums"]
        print(f"verification on read costs x{overhead:.2f} the unverified conversion time")
        if args.export:
            export = ["export", str(checkpoint), "--trtllm", "--verify", "off", "-q"]
            seconds, peak_gb = run_child("pipe export", export + ["-o", str(workdir / "hf_export")])
            report("pipe export --trtllm", seconds, peak_gb, size, copy_s)
            legacy = ["--trtllm-format", "legacy", "--tp", "2", "-o", str(workdir / "trt")]
            seconds, peak_gb = run_child("pipe export", export + legacy)
            report(
                "pipe export --trtllm --trtllm-format legacy --tp 2", seconds, peak_gb, size, copy_s
            )
    finally:
        if args.keep:
            print(f"kept {workdir}")
        else:
            shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
