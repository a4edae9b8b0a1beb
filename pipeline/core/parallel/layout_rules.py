"""Every rule a parallel layout must obey, in one place and without torch.

`ParallelDims` (the run's layout object) raises `degree_problems` when built and
`model_problems` from `validate_for_model`; `TrainConfig.validate` lists `layout_problems`, the
union of both with the config-level rules (schedule names, stage sizes, data-parallel mode,
batch divisibility), among its other problems. Messages name the config fields to change.

The expert-parallel rule: experts are spread over the ranks holding different tokens (dp x cp)
of one tensor-parallel index, so ep must divide dp * cp; experts are never split over tp (an
expert tensor-parallel size of 1, as in Megatron): this is what `ExpertParallelMoE` and the
FSDP grouping implement and the layout tests prove.
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "DP_MODES",
    "DP_MODE_ALIASES",
    "canonical_dp_mode",
    "degree_problems",
    "layout_problems",
    "model_problems",
    "resolve_dp",
]


def degree_problems(
    *, tp: int, pp: int, cp: int, ep: int, dp: int, world_size: int | None
) -> list[str]:
    """What is wrong with the degrees alone (`world_size` None: not known yet)."""
    problems = [
        f"parallel.{name} must be >= 1, got {value}"
        for name, value in (("tp", tp), ("pp", pp), ("cp", cp), ("ep", ep))
        if value < 1
    ]
    if dp == 0 or dp < -1:
        problems.append(f"parallel.dp must be >= 1 or -1 (inferred), got {dp}")
    if world_size is not None and world_size < 1:
        problems.append(f"world size must be >= 1, got {world_size}")
    if problems:
        return problems  # the checks below divide by these
    model_parallel = tp * pp * cp
    if world_size is not None:
        if dp == -1 and world_size % model_parallel:
            problems.append(
                f"world size {world_size} is not divisible by tp*pp*cp = {model_parallel}, "
                "so dp cannot be inferred"
            )
        elif dp != -1 and dp * model_parallel != world_size:
            problems.append(
                f"tp*pp*cp*dp = {dp * model_parallel} does not match world size {world_size}"
            )
    if ep > 1 and (world_size is not None or dp != -1):
        token_ranks = resolve_dp(dp, tp * pp * cp, world_size) * cp
        if token_ranks % ep:
            problems.append(
                f"parallel.ep ({ep}) must divide dp * cp ({token_ranks}): experts are spread "
                "over the ranks holding different tokens"
            )
    return problems


def model_problems(
    *,
    tp: int,
    pp: int,
    cp: int,
    ep: int,
    model: Any,
    seq_length: int,
    sequence_parallel: bool = True,
    stages_per_rank: int = 1,
    model_name: str = "the model",
) -> list[str]:
    """What stops the model (a `ModelConfig`, duck-typed) or sequence from being split so.

    Heads, kv heads and the MLP width are split by tp; layers over pp * stages_per_rank stages
    (uneven splits are allowed, empty stages are not); experts over ep; the sequence over
    2 * cp chunks (load-balanced causal context parallelism gives each rank one early and one
    late chunk) and, with sequence parallelism, over tp.
    """
    problems = []
    for name in ("num_attention_heads", "num_kv_heads", "ffn_hidden_size"):
        if getattr(model, name) % tp:
            problems.append(f"parallel.tp ({tp}) must divide {name} ({getattr(model, name)})")
    stages = pp * stages_per_rank
    if stages > model.num_layers:
        problems.append(
            f"parallel.pp ({pp}) x {stages_per_rank} stage(s) per rank exceeds the model's "
            f"{model.num_layers} layers"
        )
    if ep > 1:
        if model.moe is None:
            problems.append(f"parallel.ep = {ep} needs a MoE model; {model_name} is dense")
        elif model.moe.num_experts % ep:
            problems.append(f"parallel.ep ({ep}) must divide num_experts ({model.moe.num_experts})")
    if getattr(model, "mtp_num_layers", 0) and (tp > 1 or pp > 1 or cp > 1):
        problems.append(
            "model.mtp_num_layers > 0 (multi-token prediction) runs with dp and ep only; "
            "set parallel.tp, pp and cp to 1"
        )
    problems += _linear_attention_problems(model, tp, cp)
    if cp > 1 and seq_length % (2 * cp):
        problems.append(f"data.seq_length ({seq_length}) must be divisible by 2 * cp = {2 * cp}")
    if sequence_parallel and tp > 1:
        split = tp * (2 * cp if cp > 1 else 1)
        if seq_length % split:
            problems.append(
                f"data.seq_length ({seq_length}) must be divisible by tp ({tp})"
                + (f" * 2 * cp ({cp})" if cp > 1 else "")
                + f" = {split} (sequence parallelism splits the sequence over tp)"
            )
    return problems


def _linear_attention_problems(model: Any, tp: int, cp: int) -> list[str]:
    """Gated DeltaNet layers split their key heads (and the value heads each serves) over tp;
    context parallelism would have to pass each layer's state from rank to rank in sequence
    order, which pipe does not do."""
    linear = getattr(model, "linear_attention", None)
    if linear is None:
        return []
    problems = []
    if linear.num_key_heads % tp:
        problems.append(
            f"parallel.tp ({tp}) must divide linear_attention.num_key_heads "
            f"({linear.num_key_heads})"
        )
    if cp > 1:
        problems.append(
            "parallel.cp > 1 is not supported with linear attention: each rank's chunk of the "
            "sequence needs the recurrent state left by the chunks before it; use tp or pp"
        )
    return problems


def layout_problems(
    parallel: Any,
    *,
    world_size: int | None,
    model: Any,
    seq_length: int,
    micro_batch_size: int,
    global_batch_size: int,
    model_name: str = "the model",
) -> list[str]:
    """Every layout rule of a run: `parallel` is the config's `ParallelSection` (duck-typed);
    `model` the resolved `ModelConfig`, or None when it could not be resolved."""
    from pipeline.core.parallel.stage_placement import KNOWN_SCHEDULES, stages_per_rank

    p = parallel
    degrees = dict(tp=p.tp, pp=p.pp, cp=p.cp, ep=p.ep)
    problems = degree_problems(**degrees, dp=p.dp, world_size=world_size)
    known_schedule = p.pipeline_schedule.lower() in KNOWN_SCHEDULES
    if not known_schedule:
        problems.append(
            f"parallel.pipeline_schedule {p.pipeline_schedule!r} is not one of "
            f"{', '.join(sorted(KNOWN_SCHEDULES.values()))}"
        )
    if (p.first_stage_layers is not None or p.last_stage_layers is not None) and p.pp == 1:
        problems.append("parallel.first/last_stage_layers need pp > 1")
    dp_mode = canonical_dp_mode(p.dp_mode)
    if dp_mode not in DP_MODES:
        problems.append(
            f"parallel.dp_mode must be one of {', '.join(DP_MODES)} (or "
            f"{', '.join(DP_MODE_ALIASES)}), got {p.dp_mode!r}"
        )
    elif dp_mode == "replicate" and (p.cp > 1 or p.tp > 1 or p.ep > 1):
        problems.append("parallel.dp_mode = replicate works with dp only (tp, cp and ep of 1)")
    if min(p.tp, p.pp, p.cp, p.ep) < 1 or p.dp == 0 or p.dp < -1:
        return problems  # the checks below divide by the degrees
    dp = resolve_dp(p.dp, p.tp * p.pp * p.cp, world_size)
    if micro_batch_size > 0 and global_batch_size % (micro_batch_size * dp):
        problems.append(
            f"training.global_batch_size ({global_batch_size}) must be divisible by "
            f"micro_batch_size * dp ({micro_batch_size} * {dp})"
        )
    if model is not None and seq_length > 0:
        problems += model_problems(
            **degrees,
            model=model,
            seq_length=seq_length,
            sequence_parallel=p.sequence_parallel,
            stages_per_rank=stages_per_rank(p.pipeline_schedule) if p.pp > 1 else 1,
            model_name=model_name,
        )
    return problems


DP_MODES = ("fsdp", "replicate", "zero1")
"""`parallel.dp_mode`: FSDP2's ZeRO-3 (or ZeRO-2-like), plain replication, or ZeRO-1."""
DP_MODE_ALIASES = {"distributed_optimizer": "zero1", "distributed-optimizer": "zero1"}
"""Other names of a mode: Megatron's `--use-distributed-optimizer` is ZeRO-1."""


def canonical_dp_mode(name: str) -> str:
    """`parallel.dp_mode` under its own name (an alias such as Megatron's
    `distributed_optimizer` becomes `zero1`); an unknown name comes back as it is."""
    return DP_MODE_ALIASES.get(name, name)


def resolve_dp(dp: int, model_parallel: int, world_size: int | None) -> int:
    """`dp`, inferring -1 from the world size (1 when the world size is not known)."""
    if dp != -1:
        return dp
    return max(world_size // model_parallel, 1) if world_size is not None else 1
