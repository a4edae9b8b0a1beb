"""Which layers and stages each pipeline rank holds: pure Python, no torch.

Kept apart from `pipeline.py` so configuration checks (`pipe train --dry-run`, `--help`) can
validate a pipeline layout without importing torch.
"""

from __future__ import annotations

# The schedules `build_schedule` accepts, by lower-case name (torch's spelling as the value).
KNOWN_SCHEDULES = {
    name.lower(): name
    for name in (
        "1F1B",
        "GPipe",
        "Interleaved1F1B",
        "LoopedBFS",
        "InterleavedZeroBubble",
        "ZBVZeroBubble",
    )
}
# Schedules whose ranks hold one stage each; every other schedule holds two stages per rank.
SINGLE_STAGE_SCHEDULES = frozenset({"1f1b", "gpipe"})
# Schedules that place a rank's two stages in a "V" (rank r: stages r and 2*pp - 1 - r).
V_SCHEDULES = frozenset({"zbvzerobubble", "dualpipev"})


def _split_evenly(num_layers: int, num_stages: int) -> list[int]:
    """Layer counts of `num_stages` stages differing by at most one; the earlier stages get the
    extra layers, since the last stage also pays for the output projection and the loss."""
    base, extra = divmod(num_layers, num_stages)
    return [base + (1 if i < extra else 0) for i in range(num_stages)]


def stage_layer_ranges(
    num_layers: int,
    num_stages: int,
    *,
    first_stage_layers: int | None = None,
    last_stage_layers: int | None = None,
) -> list[tuple[int, int]]:
    """Contiguous `[start, stop)` layer ranges, one per (virtual) stage, covering all layers.

    By default balanced. `first_stage_layers` / `last_stage_layers` fix the first and last
    stage's counts (Megatron's `--decoder-first/last-pipeline-num-layers`, to make room for the
    embedding and the output + loss; either may be 0) and the rest are spread evenly over the
    middle stages, each of which must get at least one layer.
    """
    if num_stages < 1:
        raise ValueError(f"num_stages must be >= 1, got {num_stages}")
    if num_layers < 1:
        raise ValueError(f"num_layers must be >= 1, got {num_layers}")
    for name, value in (("first", first_stage_layers), ("last", last_stage_layers)):
        if value is not None and not 0 <= value <= num_layers:
            raise ValueError(f"{name}_stage_layers must be in [0, {num_layers}], got {value}")
    if num_stages == 1:
        fixed = {v for v in (first_stage_layers, last_stage_layers) if v is not None}
        if fixed and fixed != {num_layers}:
            raise ValueError(
                f"with one stage, first/last_stage_layers must equal num_layers {num_layers}"
            )
        return [(0, num_layers)]

    first = first_stage_layers
    last = last_stage_layers
    middle_stages = num_stages - (first is not None) - (last is not None)
    middle_layers = num_layers - (first or 0) - (last or 0)
    if middle_layers < middle_stages or (middle_stages == 0 and middle_layers != 0):
        raise ValueError(
            f"cannot place {num_layers} layers on {num_stages} stages with "
            f"first_stage_layers={first}, last_stage_layers={last}: the other "
            f"{middle_stages} stage(s) would get {middle_layers} layer(s) "
            "(each needs at least one, and all layers must be placed)"
        )
    counts = _split_evenly(middle_layers, middle_stages) if middle_stages else []
    if first is not None:
        counts.insert(0, first)
    if last is not None:
        counts.append(last)
    ranges, start = [], 0
    for count in counts:
        ranges.append((start, start + count))
        start += count
    return ranges


def local_stage_indices(pp_rank: int, pp_size: int, schedule: str) -> list[int]:
    """The global stage indices rank `pp_rank` holds: `[r]` for single-stage schedules,
    `[r, r + pp]` for interleaved ones (looping placement), `[r, 2 * pp - 1 - r]` for V ones."""
    name = schedule.lower()
    if name in SINGLE_STAGE_SCHEDULES:
        return [pp_rank]
    if name in V_SCHEDULES:
        return [pp_rank, 2 * pp_size - 1 - pp_rank]
    return [pp_rank, pp_rank + pp_size]


def stages_per_rank(schedule: str) -> int:
    """How many (virtual) stages each rank holds under `schedule` (1 or 2)."""
    return 1 if schedule.lower() in SINGLE_STAGE_SCHEDULES else 2
