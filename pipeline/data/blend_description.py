"""What a blend will draw from each dataset, told before any index is built (`pipe inspect
--data BLEND`): per dataset its tokens, requested and effective weight, samples and tokens
drawn, the passes over it and the epochs its index holds, planned exactly as
`blended.build_datasets` plans them.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from pipeline.data.blend_spec import Blend, check_prefixes_exist
from pipeline.data.blended import (
    DEFAULT_MID_LEVEL_DATASET_SURPLUS,
    check_unweighted_size,
    normalize_weights,
    samples_per_dataset,
)
from pipeline.data.blending_indices import build_blending_indices
from pipeline.data.gpt_dataset import parse_split, split_sequence_indices
from pipeline.data.indexed import IndexedDataset, normalize_prefix
from pipeline.data.sample_index import count_samples, plan_epochs

__all__ = ["describe_blend", "format_blend_description"]


def describe_blend(
    blend: Blend,
    sequence_length: int,
    num_samples: int | None,
    *,
    split: str | None = None,
    add_extra_token_to_sequence: bool = True,
    mid_level_dataset_surplus: float = DEFAULT_MID_LEVEL_DATASET_SURPLUS,
) -> list[dict[str, Any]]:
    """What each dataset contributes to `num_samples` training samples of `sequence_length`.

    Per dataset: its tokens (in the train part of `split`, or all of it with `split` None), the
    requested and effective weight, the samples and tokens drawn, how many passes over the
    dataset that is (`epochs`), and how many whole epochs its index holds. With `num_samples`
    None an unweighted blend is drawn exhaustively (each dataset once). Draws are exact up to
    16M samples; above, they are the builder's targets (within two samples of the draw).
    """
    if sequence_length < 1:
        raise ValueError(f"sequence_length must be >= 1, not {sequence_length}")
    prefixes = [normalize_prefix(p) for p in blend.prefixes]
    check_prefixes_exist(prefixes)
    bounds = (0.0, 1.0) if split is None else parse_split(split)[0]
    if bounds is None:
        raise ValueError(f"split {split!r} leaves nothing for training")
    add_extra = int(add_extra_token_to_sequence)
    rows: list[dict[str, Any]] = []
    for prefix in prefixes:
        dataset = IndexedDataset(prefix)
        indices = split_sequence_indices([bounds], len(dataset))[0]
        tokens = int(dataset.sequence_lengths[indices].sum(dtype=np.int64)) if len(indices) else 0
        rows.append(
            {
                "prefix": prefix,
                "dtype": str(dataset.dtype),
                "sequences": len(indices),
                "tokens_per_epoch": tokens,
                "samples_per_epoch": count_samples(1, tokens, sequence_length, True, add_extra),
            }
        )
    per_epoch = [row["samples_per_epoch"] for row in rows]
    weights, drawn, buffers, exact = _planned_draws(
        blend, per_epoch, num_samples, mid_level_dataset_surplus
    )
    total = sum(drawn) or 1
    for row, weight, samples, buffer in zip(rows, weights, drawn, buffers):
        tokens = row["tokens_per_epoch"]
        row["weight"] = weight
        row["effective_weight"] = samples / total
        row["samples"] = samples
        row["tokens"] = samples * sequence_length
        row["epochs"] = samples * sequence_length / tokens if tokens else math.inf
        row["index_epochs"] = (
            plan_epochs(tokens, buffer, sequence_length, add_extra).num_epochs if tokens else 0
        )
        row["exact"] = exact
    return rows


# Above this many blended samples, describe_blend reports targets instead of running the
# schedule (which takes about 10 ns a sample).
_EXACT_DRAWS_UP_TO = 1 << 24


def _planned_draws(
    blend: Blend, per_epoch: list[int], num_samples: int | None, surplus: float
) -> tuple[list[float], list[int], list[int | None], bool]:
    """As the builder plans them: the blend weights, the samples drawn from each dataset, the
    samples each dataset's index is built for, and whether the draws are exact."""
    n = len(per_epoch)
    if blend.weights is None and n == 1:
        # A single unweighted prefix is a plain GPTDataset of num_samples (one epoch if None).
        samples = per_epoch[0] if num_samples is None else num_samples
        return [1.0], [samples], [num_samples], True
    if blend.weights is None:
        if 0 in per_epoch:
            raise ValueError(
                f"{blend.prefixes[per_epoch.index(0)]} holds less than one sample at this "
                "sequence length, so an unweighted blend cannot include it"
            )
        weights = normalize_weights(per_epoch)
        buffers: list[int | None] = [None] * n
        if num_samples is None:  # exhaustive: every sample of every dataset once
            return weights, per_epoch, buffers, True
        check_unweighted_size("train", num_samples, sum(per_epoch))
        size = num_samples
        estimate = [int(math.ceil(size * w)) for w in weights]
    else:
        if num_samples is None:
            raise ValueError("a weighted blend needs a number of samples (--samples)")
        weights = normalize_weights(blend.weights)
        estimate, buffer_sizes = samples_per_dataset(weights, num_samples, surplus)
        buffers = list(buffer_sizes)
        size = sum(estimate)
    if size > _EXACT_DRAWS_UP_TO:
        return weights, estimate, buffers, False
    dataset_index, _ = build_blending_indices(weights, size)
    return weights, np.bincount(dataset_index, minlength=n).tolist(), buffers, True


def format_blend_description(rows: list[dict[str, Any]], sequence_length: int) -> list[str]:
    """`describe_blend` rows as aligned text lines: a header, one line per dataset, a total."""
    header = ("dataset", "weight", "effective", "samples", "tokens", "epochs", "index epochs")
    table = [header]
    for row in rows:
        cells = (
            row["prefix"],
            f"{row['weight']:.4f}",
            f"{row['effective_weight']:.4f}",
            f"{row['samples']:,}",
            f"{row['tokens']:,}",
            f"{row['epochs']:.3f}",
            str(row["index_epochs"]),
        )
        table.append(cells)
    samples = sum(row["samples"] for row in rows)
    tokens = samples * sequence_length
    table.append(("total", "1.0000", "1.0000", f"{samples:,}", f"{tokens:,}", "", ""))
    widths = [max(len(line[i]) for line in table) for i in range(len(header))]
    lines = []
    for line in table:
        cells = [line[0].ljust(widths[0])] + [c.rjust(w) for c, w in zip(line[1:], widths[1:])]
        lines.append("  ".join(cells).rstrip())
    if rows and not rows[0]["exact"]:
        lines.append("(samples are the builder's targets; the schedule draws within 2 of each)")
    return lines
