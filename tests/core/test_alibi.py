"""ALiBi (`pipeline.core.model.alibi`): the slopes against the paper's formula as transformers
computes it (BLOOM's and MPT's code), the attention of every CPU backend against the written-out
softmax with the bias, and cached decoding against the whole sequence in one forward."""

from __future__ import annotations

import math

import pytest
import torch

from pipeline.core.kernels.attention import attention
from pipeline.core.model.alibi import alibi_slopes
from pipeline.core.model.block import ModelOptions
from pipeline.core.model.config import MLAConfig, ModelConfig
from pipeline.core.model.transformer import Transformer


@pytest.mark.parametrize("heads", [8, 12])
def test_slopes_equal_transformers(heads: int) -> None:
    """BLOOM's `_get_alibi_slopes` and MPT's `build_mpt_alibi_tensor` (bias max 8) give the
    paper's slopes; for 8 heads they are 1/2, 1/4, ... 1/256."""
    pytest.importorskip("transformers")
    from transformers.models.bloom.modeling_bloom import _get_alibi_slopes
    from transformers.models.mpt.modeling_mpt import build_mpt_alibi_tensor

    ours = torch.tensor(alibi_slopes(heads))
    bloom = _get_alibi_slopes(heads, torch.device("cpu"))
    # MPT's tensor is slope * (key - last position) for keys 0 and 1 of two: -slope, 0.
    mpt = -build_mpt_alibi_tensor(heads, 2)[:, 0, 0]
    torch.testing.assert_close(ours, bloom, rtol=1e-6, atol=0)
    torch.testing.assert_close(ours, mpt, rtol=1e-6, atol=0)
    if heads == 8:
        assert alibi_slopes(8) == [2.0**-i for i in range(1, 9)]
    else:  # 8 of the power of two below, then the odd ones of 16: 2^-0.5, 2^-1.5, ...
        assert alibi_slopes(12)[8:] == pytest.approx([2 ** -(i + 0.5) for i in range(4)])


def test_mpt_bias_max_other_than_8() -> None:
    """MPT's `alibi_bias_max` generalises the paper's 8: its code's slopes for 12 heads, 4."""
    pytest.importorskip("transformers")
    from transformers.models.mpt.modeling_mpt import build_mpt_alibi_tensor

    mpt = -build_mpt_alibi_tensor(12, 2, alibi_bias_max=4)[:, 0, 0]
    torch.testing.assert_close(torch.tensor(alibi_slopes(12, 4.0)), mpt, rtol=1e-6, atol=0)


def _written_out(q, k, v, slopes, allowed) -> torch.Tensor:
    """softmax(q k^T / sqrt(d) + slope * (j - i)) v over the `allowed` keys, head by head."""
    heads, kv_heads = q.shape[1], k.shape[1]
    k = k.repeat_interleave(heads // kv_heads, dim=1)
    v = v.repeat_interleave(heads // kv_heads, dim=1)
    queries, keys = q.shape[2], k.shape[2]
    distance = torch.arange(keys)[None, :] - torch.arange(queries)[:, None]
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    scores = scores + slopes[None, :, None, None] * distance
    scores = scores.masked_fill(~allowed, float("-inf"))
    return scores.softmax(-1) @ v


@pytest.mark.parametrize("backend", ["sdpa", "flex"])
@pytest.mark.parametrize("documents", [False, True])
def test_backends_equal_the_written_out_attention(backend: str, documents: bool) -> None:
    torch.manual_seed(0)
    q, k, v = torch.randn(2, 6, 10, 8), torch.randn(2, 3, 10, 8), torch.randn(2, 3, 10, 8)
    slopes = torch.tensor(alibi_slopes(6))
    allowed = torch.ones(10, 10, dtype=torch.bool).tril()[None, None]
    document_ids = None
    if documents:
        document_ids = torch.tensor([[0] * 4 + [1] * 6, [0] * 7 + [1] * 3])
        same = document_ids[:, :, None] == document_ids[:, None, :]
        allowed = allowed & same[:, None]
    out = attention(q, k, v, document_ids=document_ids, backend=backend, alibi_slopes=slopes)
    torch.testing.assert_close(out, _written_out(q, k, v, slopes, allowed))


def test_explicit_positions_shift_nothing() -> None:
    """Only differences of positions count: queries at 7..9 over keys 0..9 under a mask equal
    the last three rows of the whole causal attention."""
    torch.manual_seed(1)
    q, k, v = torch.randn(1, 4, 10, 8), torch.randn(1, 4, 10, 8), torch.randn(1, 4, 10, 8)
    slopes = torch.tensor(alibi_slopes(4))
    whole = attention(q, k, v, alibi_slopes=slopes)
    positions = (torch.arange(7, 10)[None], torch.arange(10)[None])
    mask = (torch.arange(10)[None, :] <= torch.arange(7, 10)[:, None])[None, None]
    tail = attention(
        q[:, :, 7:], k, v, causal=False, mask=mask, alibi_slopes=slopes, positions=positions
    )
    torch.testing.assert_close(tail, whole[:, :, 7:])


def _alibi_config(**overrides) -> ModelConfig:
    values = dict(
        vocab_size=64,
        hidden_size=48,
        num_layers=2,
        num_attention_heads=6,
        ffn_hidden_size=192,
        norm_type="layernorm",
        norm_bias=True,
        activation="gelu_pytorch_tanh",
        gated_mlp=False,
        mlp_bias=True,
        qkv_bias=True,
        attention_out_bias=True,
        embedding_norm=True,
        position_embedding="alibi",
    )
    return ModelConfig(**(values | overrides))


def _model(config: ModelConfig, backend: str = "sdpa") -> Transformer:
    torch.manual_seed(0)
    model = Transformer(config, ModelOptions(attention_backend=backend))
    model.init_weights()
    with torch.no_grad():  # biases and norms off their init
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return model.eval()


class _GrowingCache:
    """A `KVCache` for `new` tokens after `start` cached ones, every row as long, with the
    positions ALiBi asks for."""

    def __init__(self, store: dict, start: int, new: int) -> None:
        self.store = store
        queries = torch.arange(start, start + new)
        self.mask = (torch.arange(start + new)[None, :] <= queries[:, None])[None, None]
        self.positions = (queries[None], torch.arange(start + new)[None])

    def layer(self, index: int) -> _GrowingCache:
        self.index = index
        return self

    def update(self, *new: torch.Tensor) -> list[torch.Tensor]:
        old = self.store.get(self.index)
        both = list(new) if old is None else [torch.cat(p, dim=1) for p in zip(old, new)]
        self.store[self.index] = both
        return both


def test_cached_decoding_equals_full_forward() -> None:
    model = _model(_alibi_config())
    tokens = torch.randint(0, 64, (2, 9))
    store: dict = {}
    with torch.no_grad():
        whole = model(tokens)
        steps = [model(tokens[:, :5], cache=_GrowingCache(store, 0, 5))]
        for p in range(5, 9):
            cache = _GrowingCache(store, p, 1)
            steps.append(model(tokens[:, p : p + 1], torch.full((2, 1), p), cache=cache))
    torch.testing.assert_close(torch.cat(steps, dim=1), whole, rtol=1e-5, atol=1e-5)


def test_flex_model_equals_sdpa_model() -> None:
    config = _alibi_config(clip_qkv=0.5)
    sdpa, flex = _model(config), _model(config, "flex")
    tokens = torch.randint(0, 64, (2, 12))
    documents = torch.tensor([[0] * 5 + [1] * 7, [0] * 12])
    with torch.no_grad():
        torch.testing.assert_close(
            flex.logits(tokens, None, documents), sdpa.logits(tokens, None, documents)
        )


def test_the_positions_matter() -> None:
    """A check that can fail: without the biases the logits differ."""
    config = _alibi_config()
    alibi, none = _model(config), _model(_alibi_config(position_embedding="none"))
    none.load_state_dict(alibi.state_dict())
    tokens = torch.randint(0, 64, (1, 12))
    with torch.no_grad():
        assert not torch.allclose(alibi.logits(tokens), none.logits(tokens), atol=1e-3)


def test_defaults_and_bad_options() -> None:
    config = ModelConfig()
    assert (config.position_embedding, config.norm_type, config.activation) == (
        "rope",
        "rmsnorm",
        "silu",
    )
    assert config.gated_mlp and not (config.mlp_bias or config.embedding_norm)
    with pytest.raises(ValueError, match="position_embedding 'sinusoid'"):
        ModelConfig(position_embedding="sinusoid")
    with pytest.raises(ValueError, match="norm_type"):
        ModelConfig(norm_type="batchnorm")
    with pytest.raises(ValueError, match="activation"):
        ModelConfig(activation="swish")
    with pytest.raises(ValueError, match="latent attention"):
        ModelConfig(position_embedding="alibi", mla=MLAConfig())


def test_parameter_counts_of_published_models() -> None:
    """bigscience/bloom-560m and mosaicml/mpt-7b, from their configs: 559,214,592 and
    6,649,286,656 parameters, as their model cards and safetensors headers count them."""
    from pipeline.core.model.flavors import get_flavor, num_parameters
    from pipeline.weights.hf_config import config_from_hf

    bloom = {"vocab_size": 250880, "hidden_size": 1024, "n_layer": 24, "n_head": 16}
    mpt = {"vocab_size": 50432, "d_model": 4096, "n_layers": 32, "n_heads": 32}
    assert num_parameters(config_from_hf({"architectures": ["BloomForCausalLM"]} | bloom)) == (
        559_214_592
    )
    assert num_parameters(config_from_hf({"architectures": ["MptForCausalLM"]} | mpt)) == (
        6_649_286_656
    )
    for name in ("tiny_bloom", "tiny_mpt"):
        config = get_flavor(name)
        with torch.device("meta"):
            model = Transformer(config)
        assert sum(p.numel() for p in model.parameters()) == num_parameters(config)


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.gpu
@needs_cuda
def test_flash_attn_alibi_equals_sdpa() -> None:
    """flash-attn's own alibi_slopes against sdpa's additive bias (bf16, 6 heads over 2)."""
    pytest.importorskip("flash_attn")
    torch.manual_seed(0)
    q = torch.randn(2, 6, 128, 64, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(2, 2, 128, 64, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(2, 2, 128, 64, device="cuda", dtype=torch.bfloat16)
    slopes = torch.tensor(alibi_slopes(6), device="cuda")
    reference = attention(q, k, v, backend="sdpa", alibi_slopes=slopes).float()
    flash = attention(q, k, v, backend="flash_attn", alibi_slopes=slopes).float()
    torch.testing.assert_close(flash, reference, atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("documents", [False, True])
def test_compiled_flex_alibi_gradients_equal_sdpa(documents: bool) -> None:
    """fp32 on CUDA, flex compiled: output and q/k/v gradients against sdpa."""
    torch.manual_seed(0)
    q = torch.randn(2, 6, 256, 32, device="cuda", requires_grad=True)
    k = torch.randn(2, 3, 256, 32, device="cuda", requires_grad=True)
    v = torch.randn(2, 3, 256, 32, device="cuda", requires_grad=True)
    slopes = torch.tensor(alibi_slopes(6), device="cuda")
    ids = torch.tensor([[0] * 100 + [1] * 156, [0] * 256], device="cuda") if documents else None
    results = []
    for backend in ("sdpa", "flex"):
        out = attention(q, k, v, document_ids=ids, backend=backend, alibi_slopes=slopes)
        results.append((out, *torch.autograd.grad(out, (q, k, v), torch.ones_like(out))))
    for got, expected in zip(results[1], results[0]):
        torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("name", ["tiny_bloom", "tiny_mpt"])
def test_tiny_flavors_are_their_family(name: str) -> None:
    """The flavors go out as the Hugging Face family they are named after."""
    from pipeline.core.model.flavors import get_flavor
    from pipeline.weights.hf_config import choose_architecture

    expected = "BloomForCausalLM" if name == "tiny_bloom" else "MptForCausalLM"
    assert choose_architecture(get_flavor(name)) == expected
