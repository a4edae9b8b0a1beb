"""The torch-release shims of `pipeline.core.torch_compat`, on whichever torch runs the tests.

Their effect is checked where it matters, on torch 2.11 (`scripts/test_torch.sh 2.11.0`): the
pipeline schedules, expert parallelism under compile and DeepSeek's pipeline layout equal one
device. These tests pin down what each shim does on the release at hand.
"""

from __future__ import annotations

import torch

from pipeline.core import torch_compat
from pipeline.core.torch_compat import (
    TORCH_VERSION,
    _release,
    eager_before_2_13,
    stage_shape_inference_name,
)


def test_release_parses_local_builds():
    assert _release("2.11.0+cu130") == (2, 11)
    assert _release("2.13.0+cpu") == (2, 13)
    assert _release("2.14.0a0+git1234") == (2, 14)
    assert (2, 11) <= TORCH_VERSION < (2, 14)  # pyproject.toml's supported range


def test_eager_before_2_13_keeps_the_function_on_later_releases():
    def dispatch(x: torch.Tensor) -> torch.Tensor:
        return x * 2

    wrapped = eager_before_2_13(dispatch)
    assert (wrapped is dispatch) == (TORCH_VERSION >= (2, 13))
    assert torch.equal(wrapped(torch.ones(2)), torch.full((2,), 2.0))


def test_shape_inference_name_prefers_the_newer_method():
    class Newer:
        def _forward_metadata_inference(self): ...

        def _shape_inference(self): ...

    class Older:
        def _shape_inference(self): ...

    assert stage_shape_inference_name(Newer()) == "_forward_metadata_inference"
    assert stage_shape_inference_name(Older()) == "_shape_inference"
    assert stage_shape_inference_name(object()) is None


def test_this_torch_has_the_stage_hooks_the_shims_rely_on():
    """A torch release that renames the private stage methods must fail here, not silently."""
    from torch.distributed.pipelining import PipelineStage

    assert stage_shape_inference_name(PipelineStage) is not None
    if TORCH_VERSION < (2, 13):
        assert hasattr(PipelineStage, "_get_init_p2p_neighbors_ops")
        from torch.distributed.pipelining import stage as stage_module

        assert callable(stage_module.stage_backward_input)
        torch_compat.keep_graph_until_weight_backward()
        assert stage_module.stage_backward_input.keeps_graph
