"""Checkpoint conversion: `pipe convert --to hf` of a full-size model against a plain file copy.

Writes a randomly initialised pipe checkpoint of a flavor's full shape (default llama3_8b,
bf16: about 16 GB) with the streaming writer, then in the same run:

1. copies the checkpoint's data files to a new directory (the baseline: the fastest any
   conversion could move these bytes on this disk);
2. runs `pipe convert CKPT --to hf --verify off` in a child process and reads its peak RSS.

It prints seconds, GB/s and peak RSS, and the ratios the issue sets as targets: conversion
throughput within 2x of the copy (copy seconds / convert seconds >= 0.5), peak RSS under 4 GB.

    python scripts/bench/convert.py [--flavor llama3_8b] [--workdir DIR] [--keep]
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

GB = 1e9


class RandomSource:
    """A `TensorSource` of a flavor's shape whose tensors are drawn when read (bf16)."""

    def __init__(self, flavor: str) -> None:
        import torch

        from pipeline.convert.source import TensorInfo
        from pipeline.core.model.flavors import get_flavor
        from pipeline.core.model.transformer import Transformer

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


def convert_in_child(checkpoint: Path, output: Path) -> tuple[float, float]:
    """(seconds, peak RSS in GB) of `pipe convert --to hf` in a fresh process."""
    command = [sys.executable, "-m", "pipeline", "convert", str(checkpoint), "--to", "hf",
               "-o", str(output), "--verify", "off", "--quiet"]  # fmt: skip
    start = time.perf_counter()
    result = subprocess.run(command, capture_output=True, text=True, cwd=ROOT)
    seconds = time.perf_counter() - start
    if result.returncode != 0:
        raise SystemExit(f"pipe convert failed:\n{result.stdout}\n{result.stderr}")
    print(result.stdout.strip())
    os.sync()
    peak_kb = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    return seconds, peak_kb * 1024 / GB


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--flavor", default="llama3_8b")
    parser.add_argument("--workdir", type=Path, default=None, help="default: a temp dir")
    parser.add_argument("--keep", action="store_true", help="keep the files written")
    args = parser.parse_args()

    from pipeline.convert.pipe_checkpoint import write_pipe_checkpoint

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
        convert_s, peak_gb = convert_in_child(checkpoint, workdir / "hf")
        hf_bytes = sum(p.stat().st_size for p in (workdir / "hf").glob("*.safetensors"))
        print(f"pipe convert --to hf: {convert_s:.1f} s, {size / convert_s / GB:.2f} GB/s, "
              f"wrote {hf_bytes / GB:.2f} GB, peak RSS {peak_gb:.2f} GB")  # fmt: skip
        print(f"copy: {size / copy_s / GB:.2f} GB/s")
        ratio = copy_s / convert_s
        print(f"throughput ratio (convert / copy) = {ratio:.2f}  (target >= 0.5)")
        print(f"peak RSS = {peak_gb:.2f} GB  (target < 4 GB)")
    finally:
        if args.keep:
            print(f"kept {workdir}")
        else:
            shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
