"""Pipeline parallelism on `torch.distributed.pipelining`: split the model, build the schedule.

The transformer is split by layer ranges (layers keep their global index, so
parameter names do not depend on the split). Each rank builds one stage module per (virtual)
stage it holds, wraps it in a `PipelineStage`, and hands the stages to one of torch's schedules
(no home-made pipeline engine):

    ranges = stage_layer_ranges(cfg.num_layers, num_stages)
    indices = local_stage_indices(pp_rank, pp_size, "Interleaved1F1B")
    modules = [split_model(copy.deepcopy(meta_model), i, num_stages, ranges) for i in indices]
    ... materialise and initialise `modules` ...
    stages = build_stages(modules, indices, num_stages, device, pp_group)
    loss_fn = make_loss_fn(modules)
    schedule = build_schedule(stages, n_microbatches, loss_fn, "Interleaved1F1B")
    with loss_fn.normalised_by(global_loss_tokens):
        schedule.step(tokens, position_ids=pos, target=masked_labels(labels, loss_mask),
                      losses=losses)

The last stage returns hidden states after the final norm; the loss function owns the output
projection through the chunked linear cross-entropy (its vocabulary-parallel form under tensor
parallelism), so full logits are never materialised. It divides each micro-batch's loss sum by
the global loss-token count (stated with `normalised_by`), so the micro-batch losses add up to
the single-device, token-normalised loss; build the schedule with `scale_grads=False` for that
(`scale_grads=True` would divide the gradients again by the number of micro-batches).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import (
    PipelineScheduleMulti,
    PipelineScheduleSingle,
    get_schedule_class,
)

from pipeline.core.kernels.cross_entropy import DEFAULT_CHUNK_TOKENS
from pipeline.core.parallel.stage_placement import (  # noqa: F401 (re-exported)
    KNOWN_SCHEDULES,
    local_stage_indices,
    stage_layer_ranges,
    stages_per_rank,
)
from pipeline.core.parallel.tensor_parallel import tp_linear_cross_entropy
from pipeline.core.torch_compat import (
    drop_self_p2p_warmup,
    keep_graph_until_weight_backward,
    stage_shape_inference_name,
)

# Label value for positions that do not count in the loss (the loss mask travels inside the
# target tensor, since a schedule's loss function receives exactly one target per micro-batch).
IGNORE_INDEX = -100


def split_model(
    model: nn.Module,
    stage_index: int,
    num_stages: int,
    ranges: Sequence[tuple[int, int]],
) -> nn.Module:
    """Turn `model` (a `Transformer`) into pipeline stage `stage_index`, in place, and return it.

    Keeps only the layers in `ranges[stage_index]` (still named by their global index), the
    embedding only on the first stage and the final norm and output only on the last. Pass a
    copy (cheap on the `meta` device) when a rank builds several stages from one model.
    """
    if len(ranges) != num_stages:
        raise ValueError(f"{len(ranges)} layer ranges for {num_stages} stages")
    if not 0 <= stage_index < num_stages:
        raise ValueError(f"stage_index {stage_index} not in [0, {num_stages})")
    if num_stages > 1 and getattr(model.config, "tie_word_embeddings", False):
        raise NotImplementedError(
            "tied embeddings across pipeline stages are not supported (the first and last "
            "stage would need to share and all-reduce the embedding gradient)"
        )
    start, stop = ranges[stage_index]
    for name in list(model.layers.keys()):
        if not start <= int(name) < stop:
            del model.layers[name]
    if stage_index != 0:
        model.tok_embeddings = None
        if getattr(model, "embedding_norm", None) is not None:
            model.embedding_norm = None
    if stage_index != num_stages - 1:
        model.norm = None
        model.output = None
    return model


def build_stages(
    modules: Sequence[nn.Module],
    stage_indices: Sequence[int],
    num_stages: int,
    device: torch.device,
    group: dist.ProcessGroup | None = None,
) -> list[PipelineStage]:
    """Wrap this rank's stage modules as `PipelineStage`s; shapes are inferred on the first step
    by a metadata exchange, so micro-batch shapes may change between runs of `build_schedule`."""
    if len(modules) != len(stage_indices):
        raise ValueError(f"{len(modules)} modules for {len(stage_indices)} stage indices")
    stages = [
        PipelineStage(module, index, num_stages, device, group=group)
        for module, index in zip(modules, stage_indices, strict=True)
    ]
    keep_graph_until_weight_backward()
    for stage in stages:
        _keep_expert_loads_out_of_metadata_inference(stage)
        drop_self_p2p_warmup(stage)
    return stages


def _keep_expert_loads_out_of_metadata_inference(stage: PipelineStage) -> None:
    """The first step's metadata inference runs each stage's forward once more, on the first
    micro-batch or (later stages) on uninitialised tensors of the right shape. Its routing must
    not count in the expert loads that move DeepSeek's balancing bias: each MoE's load is put
    back as it was before that forward. (A private torch method, named by torch_compat; without
    it nothing is done.)"""
    name = stage_shape_inference_name(stage)
    moes = [m for m in stage.submod.modules() if hasattr(m, "expert_load")]
    if name is None or not moes:
        return
    infer = getattr(stage, name)

    def without_loads(*args, **kwargs):
        saved = [m.expert_load for m in moes]
        try:
            return infer(*args, **kwargs)
        finally:
            for moe, load in zip(moes, saved, strict=True):
                moe.expert_load = load

    setattr(stage, name, without_loads)


def masked_labels(labels: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """The schedule's `target`: labels with `IGNORE_INDEX` where the loss mask is zero (the
    mask is 0/1, as the data loader produces it)."""
    return torch.where(loss_mask > 0, labels, torch.full_like(labels, IGNORE_INDEX))


class TokenNormalisedLoss:
    """The schedule's loss function: `loss_fn(hidden, target)` -> the chunked linear
    cross-entropy of the last stage's hidden states against `target` (see `masked_labels`),
    summed over the micro-batch and divided by the loss tokens of the whole batch.

    That count changes every step, so the caller states it around the schedule's call:
    `with loss_fn.normalised_by(n): schedule.step(...)`. (torch 2.13's `step` also takes
    `loss_kwargs` for this; torch 2.11's passes every unknown keyword to the model, so pipe
    does not use it, and one code path serves both.) The output weight is looked up among
    `modules` (the rank's stage modules) when called; only the rank holding the last stage
    ever calls it.
    """

    def __init__(
        self, modules: Sequence[nn.Module], chunk_tokens: int = DEFAULT_CHUNK_TOKENS
    ) -> None:
        self.modules = list(modules)
        self.chunk_tokens = chunk_tokens
        self.num_tokens: float | torch.Tensor | None = None

    @contextlib.contextmanager
    def normalised_by(self, num_tokens: float | torch.Tensor) -> Iterator[None]:
        """Divide every micro-batch's loss sum by `num_tokens` inside this block."""
        self.num_tokens = num_tokens
        try:
            yield
        finally:
            self.num_tokens = None

    def __call__(
        self,
        hidden: torch.Tensor,
        target: torch.Tensor,
        num_tokens: float | torch.Tensor | None = None,
    ) -> torch.Tensor:
        num_tokens = self.num_tokens if num_tokens is None else num_tokens
        if num_tokens is None:
            raise RuntimeError("the pipeline loss was called outside `normalised_by(n)`")
        output = next((m.output for m in self.modules if m.output is not None), None)
        if output is None:
            raise RuntimeError("loss_fn called on a rank that does not hold the output layer")
        # The tensor-parallel loss falls back to the plain one for a plain weight.
        loss_sum, _ = tp_linear_cross_entropy(
            hidden, output.weight, target, target != IGNORE_INDEX, self.chunk_tokens
        )
        return loss_sum / num_tokens  # the caller clamps it to >= 1 (a tensor: no host sync)


def make_loss_fn(
    modules: Sequence[nn.Module], chunk_tokens: int = DEFAULT_CHUNK_TOKENS
) -> TokenNormalisedLoss:
    """The schedule's token-normalised loss function over this rank's stage `modules`."""
    return TokenNormalisedLoss(modules, chunk_tokens)


def build_schedule(
    stages: Sequence[PipelineStage],
    n_microbatches: int,
    loss_fn: Callable[..., torch.Tensor] | None,
    schedule: str = "1F1B",
    scale_grads: bool = True,
) -> PipelineScheduleSingle | PipelineScheduleMulti:
    """A torch pipeline schedule by name ("1F1B", "GPipe", "Interleaved1F1B",
    "InterleavedZeroBubble", "ZBVZeroBubble", ... as `get_schedule_class` knows them) over this
    rank's stages. Pass `scale_grads=False` with `make_loss_fn`'s token-normalised loss.
    Micro-batch count constraints (e.g. interleaved: a multiple of the rounds) are torch's."""
    cls = get_schedule_class(schedule)
    expected = stages_per_rank(schedule)
    if len(stages) != expected:
        raise ValueError(
            f"schedule {schedule} needs {expected} stage(s) per rank, got {len(stages)}"
        )
    target = stages[0] if expected == 1 else list(stages)
    return cls(target, n_microbatches=n_microbatches, loss_fn=loss_fn, scale_grads=scale_grads)
