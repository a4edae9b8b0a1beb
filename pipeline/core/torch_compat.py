"""Where the supported torch releases (2.11 through 2.13) differ, and what pipe does about it.

Every version-dependent workaround lives here, so the rest of pipe is written against one API:

- Pipeline schedules. torch 2.13's `schedule.step` takes `loss_kwargs`; 2.11's passes every
  unknown keyword to the first stage's model. pipe never uses it: the loss function is told the
  batch's token count around the call (`pipeline.core.parallel.pipeline.TokenNormalisedLoss`,
  the training objective's `pipeline.train.loop.pipeline_step.ObjectiveLoss`), which both
  releases accept.
- Pipeline warm-up. Before its first step, torch 2.11's multi-stage schedules exchange a dummy
  tensor between every pair of neighbouring stages, also when both stages sit on the same rank
  (the "V" placement of ZBVZeroBubble puts stages r and 2*pp-1-r together, so the middle pair
  is local). NCCL accepts a send to oneself; gloo does not ("Pair is not connected"). 2.13
  warms up without those self-exchanges; `drop_self_p2p_warmup` does the same on 2.11.
- Zero-bubble backward. The zero-bubble schedules split a backward into an input part (B) and
  a weight part (W) that runs later. torch 2.11 detaches the stage output (or loss) after B and
  keeps only the autograd nodes where the two parts meet; a node of a custom
  `autograd.Function` (pipe's fused cross-entropy, the MoE auxiliary loss, the expert all-to-all)
  is not kept alive by its Python handle, so W fails with "Attribute '_input_metadata' is
  invalid". `keep_graph_until_weight_backward` holds a view of each output until W is done.
- Shape inference. Before its first step a stage runs its forward once to learn its output
  shapes: `_forward_metadata_inference` on 2.13, `_shape_inference` on 2.11 (both private).
  `stage_shape_inference_name` says which one a stage has, for the code that must keep that
  forward's side effects (MoE expert loads) out of the run. 2.13 then infers gradient shapes
  by calling the loss function on that forward's outputs (`_backward_metadata_inference`; 2.11
  has no such call): `stage_loss_inference_name` names it, so that call keeps an objective's
  running figures out.
- Compiled expert dispatch. Under `torch.compile`, torch 2.11 loses the expert weights'
  gradients through expert parallelism's token exchange (all-to-all in an `autograd.Function`,
  DTensor expert shards): they come out zero, while the same code runs right eagerly and
  compiled on 2.13. `eager_before_2_13` runs such a function outside the compiled graph there
  (the dispatch already breaks the graph for its host sync, so little is lost).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch
import torch.distributed as dist

__all__ = [
    "TORCH_VERSION",
    "drop_self_p2p_warmup",
    "eager_before_2_13",
    "keep_graph_until_weight_backward",
    "stage_shape_inference_name",
]


def _release(version: str) -> tuple[int, int]:
    """(major, minor) of a torch version string such as '2.11.0+cu130'."""
    major, minor = version.split("+")[0].split(".")[:2]
    return int(major), int(minor)


TORCH_VERSION = _release(torch.__version__)

_F = TypeVar("_F", bound=Callable)


def eager_before_2_13(fn: _F) -> _F:
    """`fn` itself on torch 2.13 and later; before, `fn` run eagerly even inside a compiled
    module (a graph break), where torch's compiler gets its gradients wrong (see above)."""
    if TORCH_VERSION >= (2, 13):
        return fn
    return torch._dynamo.disable(fn)  # type: ignore[return-value]


def stage_shape_inference_name(stage: object) -> str | None:
    """The name of the method a pipeline stage runs its shape-inference forward in (torch 2.13,
    then 2.11), or None if it has neither."""
    for name in ("_forward_metadata_inference", "_shape_inference"):
        if hasattr(stage, name):
            return name
    return None


def stage_loss_inference_name(stage: object) -> str | None:
    """The name of the method in which a last pipeline stage calls the loss function on its
    metadata-inference outputs (torch 2.13's backward metadata inference; torch 2.11 calls no
    loss there), or None."""
    name = "_backward_metadata_inference"
    return name if hasattr(stage, name) else None


def drop_self_p2p_warmup(stage: object) -> None:
    """Leave out of `stage`'s warm-up exchange the sends and receives to its own rank (torch
    before 2.13 only; later releases neither call nor need this private hook)."""
    warmup_ops = getattr(stage, "_get_init_p2p_neighbors_ops", None)
    if TORCH_VERSION >= (2, 13) or warmup_ops is None:
        return
    own_rank = dist.get_rank(stage.group)  # type: ignore[attr-defined]

    def without_self_exchanges() -> list[dist.P2POp]:
        return [op for op in warmup_ops() if op.group_peer != own_rank]

    stage._get_init_p2p_neighbors_ops = without_self_exchanges  # type: ignore[attr-defined]


def keep_graph_until_weight_backward() -> None:
    """On torch before 2.13, make the pipeline stages' input backward (B) keep the autograd graph
    of the outputs it differentiates until the weight backward (W) of the same micro-batch has
    run: a view of each output rides along with the parameter groups that W consumes and frees.
    Idempotent; a no-op on later releases."""
    if TORCH_VERSION >= (2, 13):
        return
    from torch.distributed.pipelining import stage as stage_module

    backward_input = stage_module.stage_backward_input
    if getattr(backward_input, "keeps_graph", False):
        return

    def backward_input_keeping_graph(stage_outputs_or_loss, *args, **kwargs):
        views = [t.view_as(t) for t in stage_outputs_or_loss if t.grad_fn is not None]
        dinputs, param_groups = backward_input(stage_outputs_or_loss, *args, **kwargs)
        for group in param_groups:
            group["pipe_graph_keepalive"] = views
        return dinputs, param_groups

    backward_input_keeping_graph.keeps_graph = True  # type: ignore[attr-defined]
    stage_module.stage_backward_input = backward_input_keeping_graph
