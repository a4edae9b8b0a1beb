"""Dataset index building: pipe's blended GPT indices against megatron-core's, in one run.

Writes three synthetic indexed datasets (log-normal sequence lengths, all tokens zero: only the
lengths matter to the indices) totalling --tokens tokens, then builds the train/valid/test
datasets of the blend "0.5 a 0.3 b 0.2 c" at --seq-length with --samples training samples, once
with megatron-core's `BlendedMegatronDatasetBuilder` and once with `pipeline.data.blended.
build_datasets`, each into its own fresh cache directory (both write their .npy caches), and
checks that every index array (document, sample and shuffle indices of every dataset and split,
and the blended dataset and sample indices) is identical. It then times the blending step
alone, ours against megatron-core's C++ helper, on --blend-samples samples.

    python scripts/bench/indices.py [--tokens 210e6] [--samples 2000000] [--seq-length 4096]
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import tempfile
import time
import warnings
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from pipeline.data.indexed import IndexedDatasetWriter  # noqa: E402

WEIGHTS = (0.5, 0.3, 0.2)
SPLIT = "969,30,1"
SEED = 1234


def write_synthetic(prefix: Path, tokens: int, seed: int) -> int:
    """An indexed dataset of about `tokens` zero tokens in log-normal-length sequences
    (median ~660, mean ~1,100 tokens); returns the sequence count."""
    rng = np.random.default_rng(seed)
    lengths_parts, total = [], 0
    while total < tokens:
        part = np.clip(rng.lognormal(6.5, 1.0, 1 << 16), 1, 100_000).astype(np.int32)
        lengths_parts.append(part)
        total += int(part.sum())
    lengths = np.concatenate(lengths_parts)
    lengths = lengths[: int(np.searchsorted(np.cumsum(lengths, dtype=np.int64), tokens)) + 1]
    with IndexedDatasetWriter(prefix, np.uint16) as writer:
        for begin in range(0, len(lengths), 1 << 18):
            chunk = lengths[begin : begin + (1 << 18)]
            zeros = np.zeros(int(chunk.sum(dtype=np.int64)), np.uint16)
            writer.add_documents(zeros, chunk, np.ones(len(chunk), np.int64))
        writer.finalize()
    return len(lengths)


class StubTokenizer:
    """What megatron-core's GPTDataset reads from a tokenizer."""

    vocab_size = 32000
    eod = 0
    pad = 1
    unique_identifiers = {"class": "StubTokenizer"}


def build_megatron(prefixes: list[str], sizes: list[int], seq_length: int, cache: Path):
    from megatron.core.datasets.blended_megatron_dataset_builder import (
        BlendedMegatronDatasetBuilder,
    )
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig

    config = GPTDatasetConfig(
        random_seed=SEED,
        sequence_length=seq_length,
        blend=(prefixes, list(WEIGHTS)),
        split=SPLIT,
        path_to_cache=str(cache),
        tokenizer=StubTokenizer(),
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=False,
    )
    return BlendedMegatronDatasetBuilder(GPTDataset, sizes, lambda: True, config).build()


def build_ours(prefixes: list[str], sizes: list[int], seq_length: int, cache: Path):
    from pipeline.data.blend_spec import Blend
    from pipeline.data.blended import build_datasets
    from pipeline.data.gpt_dataset import GPTDatasetConfig

    config = GPTDatasetConfig(
        random_seed=SEED,
        sequence_length=seq_length,
        eod_id=StubTokenizer.eod,
        pad_id=StubTokenizer.pad,
        tokenizer_id="StubTokenizer",
        split=SPLIT,
        path_to_cache=str(cache),
    )
    return build_datasets(Blend(prefixes, list(WEIGHTS)), config, sizes)


def compare(ours, theirs) -> list[str]:
    """Names of the index arrays that differ (empty when all are identical)."""
    differences = []
    for split, (a, b) in enumerate(zip(ours, theirs)):
        if (a is None) != (b is None):
            differences.append(f"split {split}: built by one side only")
            continue
        if a is None:
            continue
        pairs = [("dataset_index", a.dataset_index, b.dataset_index)]
        pairs.append(("dataset_sample_index", a.dataset_sample_index, b.dataset_sample_index))
        for d, (x, y) in enumerate(zip(a.datasets, b.datasets)):
            for name in ("document_index", "sample_index", "shuffle_index"):
                pairs.append((f"dataset {d} {name}", getattr(x, name), getattr(y, name)))
        for name, x, y in pairs:
            if x.dtype != y.dtype or not np.array_equal(x, y):
                differences.append(f"split {split} {name}")
    return differences


def time_blending(samples: int) -> tuple[float, float, bool]:
    from megatron.core.datasets import helpers_cpp

    from pipeline.data.blended import normalize_weights
    from pipeline.data.blending_indices import build_blending_indices

    weights = normalize_weights(WEIGHTS)
    start = time.perf_counter()
    ours = build_blending_indices(weights, samples)
    ours_s = time.perf_counter() - start
    start = time.perf_counter()
    dataset_index = np.zeros(samples, np.int16)
    sample_index = np.zeros(samples, np.int64)
    helpers_cpp.build_blending_indices(
        dataset_index, sample_index, np.array(weights), len(weights), samples, False
    )
    theirs_s = time.perf_counter() - start
    same = np.array_equal(ours[0], dataset_index) and np.array_equal(ours[1], sample_index)
    return ours_s, theirs_s, same


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=float, default=210e6, help="tokens in all (>= 200e6)")
    parser.add_argument("--samples", type=int, default=2_000_000, help="training samples")
    parser.add_argument("--seq-length", type=int, default=4096)
    parser.add_argument("--blend-samples", type=int, default=50_000_000)
    parser.add_argument("--workdir", type=Path, default=None, help="default: a temporary dir")
    args = parser.parse_args()

    warnings.simplefilter("ignore")
    logging.disable(logging.WARNING)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    import torch.distributed as dist

    with tempfile.TemporaryDirectory(dir=args.workdir) as tmp:
        work = Path(tmp)
        # megatron-core 0.16.1 needs a process group to cache its blended indices.
        dist.init_process_group("gloo", init_method=f"file://{work / 'pg'}", rank=0, world_size=1)
        start = time.perf_counter()
        prefixes, sequences = [], 0
        for i, weight in enumerate(WEIGHTS):
            prefix = work / f"synthetic_{i}_text_document"
            sequences += write_synthetic(prefix, int(args.tokens * weight), seed=i)
            prefixes.append(str(prefix))
        print(
            f"data: 3 datasets, {args.tokens / 1e6:.0f}M tokens, {sequences:,} sequences "
            f"(written in {time.perf_counter() - start:.1f} s); blend {WEIGHTS}, split {SPLIT}, "
            f"seq length {args.seq_length}"
        )
        train = args.samples
        sizes = [train, max(1, train // 100), max(1, train // 1000)]
        print(f"requested samples train/valid/test: {sizes}")

        start = time.perf_counter()
        theirs = build_megatron(prefixes, sizes, args.seq_length, work / "cache_megatron")
        megatron_s = time.perf_counter() - start
        start = time.perf_counter()
        ours = build_ours(prefixes, sizes, args.seq_length, work / "cache_pipe")
        ours_s = time.perf_counter() - start

        differences = compare(ours, theirs)
        # A second build of each finds its cache: what every rank pays at start-up once built.
        start = time.perf_counter()
        build_megatron(prefixes, sizes, args.seq_length, work / "cache_megatron")
        megatron_hit_s = time.perf_counter() - start
        start = time.perf_counter()
        build_ours(prefixes, sizes, args.seq_length, work / "cache_pipe")
        ours_hit_s = time.perf_counter() - start
        print(f"megatron-core BlendedMegatronDatasetBuilder: {megatron_s:8.3f} s")
        print(f"pipe build_datasets:                         {ours_s:8.3f} s")
        print(
            f"time ratio pipe / megatron-core:             {ours_s / megatron_s:8.3f} (< 1: faster)"
        )
        print(
            f"start-up from a built cache: pipe {ours_hit_s:.3f} s, "
            f"megatron-core {megatron_hit_s:.3f} s"
        )
        print(
            "index arrays identical: "
            + ("yes (all splits, datasets and arrays)" if not differences else "NO: ")
            + ", ".join(differences)
        )
        ours_b, theirs_b, same = time_blending(args.blend_samples)
        print(
            f"blending indices alone, {args.blend_samples:,} samples: pipe {ours_b:.3f} s, "
            f"megatron-core C++ {theirs_b:.3f} s, ratio {ours_b / theirs_b:.3f}, "
            f"identical: {'yes' if same else 'NO'}"
        )
        dist.destroy_process_group()
    return 0 if not differences and same else 1


if __name__ == "__main__":
    sys.exit(main())
