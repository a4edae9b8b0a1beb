"""The `flex` attention backend against `sdpa` (CPU, fp32, eager, forward: torch's flex attention
has no backward on a CPU; the gradients and a training step are `gpu` tests), its block mask
built once per batch, and what `auto` chooses (measured choice per GPU and shape, else the
default rule)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from pipeline.core.kernels import attention_choice, flex_attention
from pipeline.core.kernels.attention import attention, choose_backend
from pipeline.core.kernels.attention_choice import AttentionShape, record_choice
from tests.builders import micro_model_config

# Three documents per row, crossing the 128-token tiles flex attention's block mask is made of.
SEQ = 200


def _documents(batch: int = 2) -> torch.Tensor:
    first = torch.repeat_interleave(torch.arange(3), torch.tensor([90, 60, 50]))
    second = torch.repeat_interleave(torch.arange(2), torch.tensor([150, 50])) + 7
    return torch.stack([first, second])[:batch]


def _model(config, backend: str):
    from pipeline.core.model.block import ModelOptions
    from pipeline.core.model.transformer import Transformer

    model = Transformer(config, ModelOptions(attention_backend=backend))
    model.init_weights()
    return model


@pytest.fixture
def builds(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts the block masks built (one entry per `create_block_mask` call)."""
    flex_attention.clear_block_masks()
    calls: list[int] = []
    real = flex_attention.create_block_mask

    def counting(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(flex_attention, "create_block_mask", counting)
    yield calls
    flex_attention.clear_block_masks()


@pytest.mark.parametrize("documents", [False, True])
@pytest.mark.parametrize("kv_heads", [4, 2, 1])
def test_flex_equals_sdpa(kv_heads: int, documents: bool, builds: list[int]) -> None:
    torch.manual_seed(0)
    q = torch.randn(2, 4, SEQ, 16)
    k, v = torch.randn(2, kv_heads, SEQ, 16), torch.randn(2, kv_heads, SEQ, 16)
    ids = _documents() if documents else None
    expected = attention(q, k, v, document_ids=ids, backend="sdpa")
    with torch.no_grad():
        got = attention(q, k, v, document_ids=ids, backend="flex")
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    assert len(builds) == 1


def test_the_model_builds_one_block_mask_per_batch(builds: list[int]) -> None:
    """Every layer of a forward reuses the first layer's mask; a new batch (a new tensor, or
    the same one changed in place) gets its own; the memo stays bounded."""
    torch.manual_seed(0)
    config = micro_model_config(num_layers=3)
    models = {name: _model(config, name) for name in ("sdpa", "flex")}
    models["flex"].load_state_dict(models["sdpa"].state_dict())
    tokens, ids = torch.randint(0, 128, (2, SEQ)), _documents()
    with torch.no_grad():
        expected = models["sdpa"](tokens, document_ids=ids)
        got = models["flex"](tokens, document_ids=ids)
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
        assert len(builds) == 1
        models["flex"](tokens, document_ids=ids)
        assert len(builds) == 1
        models["flex"](tokens, document_ids=ids.clone())
        assert len(builds) == 2
        ids[1, -1] = 99  # in place: a different batch in the same tensor
        models["flex"](tokens, document_ids=ids)
        assert len(builds) == 3
        for _ in range(flex_attention.MEMO_SIZE + 2):
            flex_attention.block_mask(ids.clone(), SEQ, ids.device)
    assert len(flex_attention._memo) == flex_attention.MEMO_SIZE


def test_flex_leaves_cached_decoding_and_latent_attention_to_sdpa(builds: list[int]) -> None:
    torch.manual_seed(0)
    q, k = torch.randn(1, 4, 3, 16), torch.randn(1, 2, 9, 16)
    v = torch.randn(1, 2, 9, 16)
    mask = torch.rand(1, 1, 3, 9) > 0.3
    mask[..., 0] = True
    for kwargs in ({"causal": False, "mask": mask}, {"causal": False}):
        torch.testing.assert_close(
            attention(q, k, v, backend="flex", **kwargs), attention(q, k, v, **kwargs)
        )
    q, k, v = torch.randn(1, 4, 9, 24), torch.randn(1, 4, 9, 24), torch.randn(1, 4, 9, 16)
    torch.testing.assert_close(attention(q, k, v, backend="flex"), attention(q, k, v))
    assert not builds


def test_flex_refuses_a_backward_on_a_cpu() -> None:
    q = torch.randn(1, 2, 8, 16, requires_grad=True)
    with pytest.raises(ValueError, match="^attention backend flex has no backward on a CPU"):
        attention(q, q, q, backend="flex")


# ---- auto: measured per GPU and shape, else the default rule ---------------------------------

H200 = "NVIDIA H200"
SHAPE = AttentionShape(8192, 32, 8, 128, "bfloat16", document_masking=True)
CUDA = torch.device("cuda")


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("PIPE_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(attention_choice, "device_name", lambda device: H200)
    return tmp_path / "attention_backends.json"


def _auto(shape: AttentionShape | None = SHAPE, device: torch.device = CUDA):
    masking = shape.document_masking if shape else True
    return choose_backend("auto", device=device, document_masking=masking, shape=shape)


def test_auto_takes_the_choice_measured_for_this_gpu_and_shape(cache: Path) -> None:
    assert _auto().backend == "flex" and _auto().reason.startswith("default")
    record_choice(H200, SHAPE, {"sdpa": 9.5, "flex": 10.68})
    other = AttentionShape(4096, 32, 8, 128, "bfloat16", document_masking=True)
    record_choice(H200, other, {"sdpa": 7.0, "flex": 5.0})
    record_choice("NVIDIA H100 80GB HBM3", SHAPE, {"flex": 11.0})
    choices = json.loads(cache.read_text())["choices"]
    assert len(choices) == 3 and choices[SHAPE.key(H200)]["backend"] == "sdpa"
    choice = _auto()
    assert choice.backend == "sdpa"
    assert choice.describe() == (
        "attention backend: sdpa (measured on NVIDIA H200 at seq 8192, 32/8 heads, head dim "
        "128, bfloat16, document masking: 9.50 ms)"
    )
    assert _auto(other).backend == "flex"
    unmeasured = AttentionShape(8192, 16, 8, 128, "bfloat16", document_masking=True)
    assert _auto(unmeasured).reason.startswith("default")
    assert _auto(device=torch.device("cpu")).backend == "sdpa"  # a CPU reads no GPU's choice


def test_the_default_rule(cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    causal = AttentionShape(8192, 32, 8, 128, "bfloat16", document_masking=False)
    for installed, expected in ((True, "flash_attn"), (False, "sdpa")):
        monkeypatch.setattr(attention_choice, "_flash_attn_installed", lambda i=installed: i)
        assert _auto(causal).backend == expected
        assert _auto(SHAPE).backend == "flex"
        assert _auto(SHAPE, torch.device("cpu")).backend == "sdpa"
    # A recorded flash_attn without flash-attn installed falls back to the default.
    record_choice(H200, causal, {"flash_attn": 5.0, "sdpa": 6.0})
    assert _auto(causal).reason == "default: causal on CUDA, flash-attn not installed"


def test_a_damaged_choice_file_is_named_in_one_line(cache: Path) -> None:
    cache.write_text("{not json")
    with pytest.raises(ValueError, match=f"^{cache}: not a readable attention choice file"):
        _auto()
    cache.write_text(json.dumps({"choices": {SHAPE.key(H200): {"backend": "xformers"}}}))
    with pytest.raises(ValueError, match="unknown attention backend 'xformers' recorded"):
        _auto()


def test_a_run_resolves_auto_for_its_shape_per_rank(cache: Path) -> None:
    """`training.attention_backend` through the run's config: the shape is this rank's heads
    (tensor parallelism divides them), and flex is refused on a CPU in one line."""
    from pipeline.core.parallel.dims import ParallelDims
    from pipeline.train.assembly.model_build import attention_choice as run_choice
    from pipeline.train.assembly.run_config import resolve_config
    from pipeline.train.config.schema import ConfigError

    sets = [
        "data.mock=true",
        "data.reset_attention_mask=true",
        "data.seq_length=64",
        "training.dtype=fp32",
    ]
    cfg = resolve_config(None, sets)
    config = cfg.model_config()
    shape = AttentionShape(
        64,
        config.num_attention_heads // 2,
        config.num_kv_heads // 2,
        config.head_dim,
        "float32",
        document_masking=True,
    )
    record_choice(H200, shape, {"sdpa": 1.0, "flex": 2.0})
    assert run_choice(cfg, ParallelDims(tp=2, world_size=2), CUDA).backend == "sdpa"
    assert run_choice(cfg, ParallelDims(), CUDA).backend == "flex"
    cfg = resolve_config(None, [*sets, "training.attention_backend=flex"])
    with pytest.raises(ConfigError, match="^training.attention_backend = flex trains on CUDA only"):
        run_choice(cfg, ParallelDims(), torch.device("cpu"))


# ---- on a GPU: gradients and a training step -------------------------------------------------
# Eager flex attention (its dense reference path): compiling it would cost the kit's bring-up
# budget; the attention benchmark checks the compiled kernel against sdpa at seq 8192.

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
quiet = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")


@pytest.fixture
def eager_flex(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(flex_attention, "_compiled_flex", flex_attention._flex_attention)


@pytest.mark.gpu
@needs_cuda
@quiet
@pytest.mark.usefixtures("eager_flex")
@pytest.mark.parametrize("documents", [False, True])
def test_flex_gradients_equal_sdpa_on_cuda(documents: bool) -> None:
    """fp32: output and q/k/v gradients against sdpa."""
    torch.manual_seed(0)
    q = torch.randn(2, 4, SEQ, 32, device="cuda", requires_grad=True)
    k = torch.randn(2, 2, SEQ, 32, device="cuda", requires_grad=True)
    v = torch.randn(2, 2, SEQ, 32, device="cuda", requires_grad=True)
    ids = _documents().cuda() if documents else None
    results = []
    for backend in ("sdpa", "flex"):
        out = attention(q, k, v, document_ids=ids, backend=backend)
        results.append((out, *torch.autograd.grad(out, (q, k, v), torch.ones_like(out))))
    for got, expected in zip(results[1], results[0]):
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.gpu
@needs_cuda
@quiet
@pytest.mark.usefixtures("eager_flex")
def test_the_model_trains_a_step_with_flex_as_with_sdpa() -> None:
    """One SGD step of the micro model on packed documents, fp32: the loss and every updated
    weight equal sdpa's."""
    from pipeline.core.kernels.cross_entropy import chunked_linear_cross_entropy

    torch.manual_seed(0)
    config = micro_model_config()
    tokens, labels = torch.randint(0, 128, (2, SEQ)), torch.randint(0, 128, (2, SEQ))
    ids, state, after = _documents().cuda(), None, {}
    for backend in ("sdpa", "flex"):
        model = _model(config, backend).cuda()
        if state is None:
            state = model.state_dict()
        model.load_state_dict(state)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
        hidden = model(tokens.cuda(), document_ids=ids)
        loss_sum, count = chunked_linear_cross_entropy(hidden, model.output.weight, labels.cuda())
        (loss_sum / count).backward()
        optimizer.step()
        after[backend] = (loss_sum.item(), model.state_dict())
    assert after["flex"][0] == pytest.approx(after["sdpa"][0], rel=1e-6)
    for name, weight in after["sdpa"][1].items():
        torch.testing.assert_close(after["flex"][1][name], weight, atol=1e-5, rtol=1e-5)
