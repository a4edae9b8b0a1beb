"""Gated DeltaNet linear attention: the chunked delta rule against the recurrent one and against
transformers' torch reference, the causal conv carried across calls, packed documents against
each document alone, cached decoding (conv windows and states carried) against one forward, the
fla backend's guard, and parameter counts."""

from __future__ import annotations

import sys

import pytest
import torch
import torch.nn.functional as F

from pipeline.core.kernels.gated_delta import (
    causal_conv1d,
    chunk_gated_delta_rule,
    fla_gated_delta_rule,
    gated_delta_rule,
    l2_normalize,
    recurrent_gated_delta_rule,
)
from pipeline.core.model.config import LinearAttentionConfig, ModelConfig, MoEConfig
from pipeline.core.model.flavors import num_parameters
from pipeline.core.model.linear_attention import DocumentRows, GatedDeltaNet
from pipeline.core.model.transformer import Transformer
from tests.builders import build_model as build


def _inputs(batch: int, tokens: int, heads: int = 3, key_dim: int = 8, value_dim: int = 6):
    gen = torch.Generator().manual_seed(0)
    q = l2_normalize(torch.randn(batch, tokens, heads, key_dim, generator=gen))
    k = l2_normalize(torch.randn(batch, tokens, heads, key_dim, generator=gen))
    v = torch.randn(batch, tokens, heads, value_dim, generator=gen)
    g = -F.softplus(torch.randn(batch, tokens, heads, generator=gen))
    beta = torch.rand(batch, tokens, heads, generator=gen)
    state = torch.randn(batch, heads, key_dim, value_dim, generator=gen)
    return q, k, v, g, beta, state


@pytest.mark.parametrize("tokens", [1, 5, 64, 130])
def test_chunked_rule_equals_recurrent_rule(tokens: int) -> None:
    """Whole chunks, a partial last chunk and a single token, from a given state: outputs and
    final state agree to 1e-5."""
    q, k, v, g, beta, state = _inputs(2, tokens)
    out, final = chunk_gated_delta_rule(q, k, v, g, beta, state)
    ref_out, ref_final = recurrent_gated_delta_rule(q, k, v, g, beta, state)
    assert (out - ref_out).abs().max() < 1e-5
    assert (final - ref_final).abs().max() < 1e-5
    assert final.dtype == torch.float32


def test_chunked_rule_equals_transformers_reference() -> None:
    """Our chunked rule against transformers' torch_chunk_gated_delta_rule (an independent
    implementation), L2 normalisation included."""
    tf = pytest.importorskip("transformers.models.qwen3_next.modeling_qwen3_next")
    q, k, v, g, beta, state = _inputs(2, 100)
    raw_q, raw_k = q * 3.0, k * 0.5  # their kernel normalises
    theirs, their_state = tf.torch_chunk_gated_delta_rule(
        raw_q,
        raw_k,
        v,
        g=g,
        beta=beta,
        initial_state=state,
        output_final_state=True,
        use_qk_l2norm_in_kernel=True,
    )
    ours, our_state = chunk_gated_delta_rule(
        l2_normalize(raw_q), l2_normalize(raw_k), v, g, beta, state
    )
    assert (ours - theirs).abs().max() < 1e-5
    assert (our_state - their_state).abs().max() < 1e-5


def test_conv_window_carries_across_calls() -> None:
    """The conv over 9 tokens equals the conv over 4 then 5 with the window handed on, and
    the first call's zero window is a causal zero padding."""
    gen = torch.Generator().manual_seed(0)
    x, weight = torch.randn(2, 9, 5, generator=gen), torch.randn(5, 1, 4, generator=gen)
    whole, last = causal_conv1d(x, weight)
    first, window = causal_conv1d(x[:, :4], weight)
    second, window = causal_conv1d(x[:, 4:], weight, window)
    assert torch.allclose(torch.cat((first, second), dim=1), whole, atol=1e-6)
    assert torch.equal(window, last) and window.shape == (2, 5, 3)
    padded = F.conv1d(F.pad(x.transpose(1, 2), (3, 0)), weight, groups=5)
    assert torch.allclose(whole, F.silu(padded).transpose(1, 2), atol=1e-6)


def test_fla_backend_is_guarded() -> None:
    """Without flash-linear-attention the fla backend says what to install; on CPU tensors it
    refuses; "auto" uses the torch rule on a CPU."""
    q, k, v, g, beta, state = _inputs(1, 4)
    saved = sys.modules.get("fla")
    sys.modules["fla"] = None  # import fails as when it is not installed
    try:
        with pytest.raises(ImportError, match="pip install flash-linear-attention"):
            fla_gated_delta_rule(q, k, v, g, beta, state)
    finally:
        if saved is None:
            del sys.modules["fla"]
        else:
            sys.modules["fla"] = saved
    with pytest.raises(ValueError, match="CUDA tensors"):
        gated_delta_rule(q, k, v, g, beta, state, backend="fla")
    with pytest.raises(ValueError, match="unknown gated delta backend"):
        gated_delta_rule(q, k, v, g, beta, state, backend="triton")
    config = hybrid_config()
    layer = GatedDeltaNet(config)
    assert layer.backend == "auto" and layer._backend(torch.zeros(1)) == "torch"


# ---------------------------------------------------------------------------------------------
# The model: packed documents and cached decoding
# ---------------------------------------------------------------------------------------------


def hybrid_config(**overrides) -> ModelConfig:
    """A tiny Qwen3.5-shaped model: layers linear, linear, full, linear."""
    fields = dict(
        vocab_size=64,
        hidden_size=32,
        num_layers=4,
        num_attention_heads=4,
        num_kv_heads=2,
        head_dim=16,
        ffn_hidden_size=48,
        norm_eps=1e-6,
        qk_norm=True,
        layer_types=["linear_attention", "linear_attention", "full_attention", "linear_attention"],
        partial_rotary_factor=0.25,
        norm_unit_offset=True,
        attention_output_gate=True,
        linear_attention=LinearAttentionConfig(
            num_key_heads=2, num_value_heads=4, key_head_dim=8, value_head_dim=8
        ),
    )
    return ModelConfig(**(fields | overrides))


def _perturbed(model: Transformer) -> Transformer:
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return model


@pytest.mark.parametrize("interleaved", [False, True])
def test_packed_documents_equal_each_document_alone(interleaved: bool) -> None:
    """Three documents packed in a row (one crossing the 64-token chunk boundary) and a second
    row of one document: each token's hidden state equals its document's alone (1e-5), the
    conv window and the state starting afresh at every boundary."""
    config = hybrid_config()
    config.linear_attention.interleaved_projections = interleaved
    torch.manual_seed(0)
    model = _perturbed(build(config))
    lengths = [40, 37, 3]
    gen = torch.Generator().manual_seed(1)
    docs = [torch.randint(0, 64, (1, n), generator=gen) for n in lengths]
    second = torch.randint(0, 64, (1, sum(lengths)), generator=gen)
    packed = torch.cat((torch.cat(docs, dim=1), second))
    document_ids = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)])
    document_ids = torch.stack((document_ids, torch.full_like(document_ids, 7)))
    positions = torch.cat([torch.arange(n) for n in lengths])
    positions = torch.stack((positions, torch.arange(sum(lengths))))
    with torch.no_grad():
        together = model(packed, position_ids=positions, document_ids=document_ids)
        apart = torch.cat([model(d) for d in docs], dim=1)
        assert (together[0] - apart[0]).abs().max() < 1e-5
        assert (together[1] - model(second)[0]).abs().max() < 1e-5
        # Without the document ids the second document would see the first one's state.
        run_on = model(packed[:1], position_ids=positions[:1])
        assert (run_on[0, 40:77] - apart[0, 40:77]).abs().max() > 1e-3


def test_document_rows_round_trip() -> None:
    ids = torch.tensor([[0, 0, 1, 1, 1], [2, 2, 2, 2, 2]])
    rows = DocumentRows.of(ids)
    x = torch.arange(10.0).view(2, 5, 1)
    gathered = rows.gather(x)
    assert gathered.shape == (3, 5, 1)
    assert gathered[0, :, 0].tolist() == [0, 1, 0, 0, 0]
    assert gathered[1, :, 0].tolist() == [2, 3, 4, 0, 0]
    assert torch.equal(rows.scatter(gathered, x), x)
    assert DocumentRows.of(torch.zeros(2, 5, dtype=torch.long)) is None


class GrowingHybridCache:
    """The simplest cache for a hybrid model, every row as long: attention layers append their
    entries (`update`), linear-attention layers keep their conv window and state (`read`,
    `write`)."""

    valid = None  # every row as long: no padding

    def __init__(self) -> None:
        self.entries: dict[int, list[torch.Tensor]] = {}
        self.states: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def step(self, start: int, new: int) -> GrowingHybridCache:
        positions = torch.arange(start, start + new)
        self.mask = (torch.arange(start + new)[None, :] <= positions[:, None])[None, None]
        return self

    def layer(self, index: int) -> GrowingHybridCache:
        self.index = index
        return self

    def update(self, *new: torch.Tensor) -> list[torch.Tensor]:
        old = self.entries.get(self.index)
        both = list(new) if old is None else [torch.cat(p, dim=1) for p in zip(old, new)]
        self.entries[self.index] = both
        return both

    def read(self):
        return self.states.get(self.index, (None, None))

    def write(self, window: torch.Tensor, state: torch.Tensor) -> None:
        assert window.dtype == state.dtype == torch.float32
        self.states[self.index] = (window, state)


@pytest.mark.parametrize("interleaved", [False, True])
def test_cached_decoding_equals_one_forward(interleaved: bool) -> None:
    """A 70-token prompt through the chunked rule, then tokens one at a time through the
    recurrent rule with the carried conv windows and states (and the attention layer's KV
    cache): the hidden states of the whole sequence in one forward, to 1e-5."""
    config = hybrid_config()
    config.linear_attention.interleaved_projections = interleaved
    torch.manual_seed(0)
    model = _perturbed(build(config))
    tokens = torch.randint(0, 64, (2, 74), generator=torch.Generator().manual_seed(2))
    cache = GrowingHybridCache()
    with torch.no_grad():
        whole = model(tokens)
        steps = [model(tokens[:, :70], cache=cache.step(0, 70))]
        for p in range(70, 74):
            position = torch.full((2, 1), p)
            steps.append(model(tokens[:, p : p + 1], position, cache=cache.step(p, 1)))
    assert (torch.cat(steps, dim=1) - whole).abs().max() < 1e-5
    assert sorted(cache.states) == [0, 1, 3] and sorted(cache.entries) == [2]
    window, state = cache.states[0]
    assert window.shape == (2, 2 * 16 + 32, 3) and state.shape == (2, 4, 8, 8)


def test_num_parameters_matches_module() -> None:
    moe = MoEConfig(
        num_experts=4,
        top_k=2,
        ffn_hidden_size=16,
        num_shared_experts=1,
        shared_expert_ffn_hidden_size=24,
        shared_expert_gate=True,
    )
    for config in (hybrid_config(), hybrid_config(moe=moe)):
        with torch.device("meta"):
            model = Transformer(config)
        assert sum(p.numel() for p in model.parameters()) == num_parameters(config)


def test_bad_layer_types_are_refused() -> None:
    with pytest.raises(ValueError, match="layer_types has 2 entries for 4 layers"):
        hybrid_config(layer_types=["linear_attention", "full_attention"])
    with pytest.raises(ValueError, match="linear_attention is unset"):
        hybrid_config(linear_attention=None)


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_activation_recomputation_keeps_the_gradients(mode: str) -> None:
    """Recomputing the blocks' activations (the chunked rule's triangular solves included)
    gives the gradients of the plain run, packed documents and all."""
    from pipeline.core.model.block import ModelOptions

    config = hybrid_config()
    tokens = torch.randint(0, 64, (2, 80), generator=torch.Generator().manual_seed(3))
    document_ids = (torch.arange(80) >= 50).long().expand(2, -1)
    grads = []
    for recompute in ("none", mode):
        torch.manual_seed(0)
        with torch.device("meta"):
            model = Transformer(config, ModelOptions(activation_checkpointing=recompute))
        model.to_empty(device="cpu")
        model.init_weights()
        model(tokens, document_ids=document_ids).square().mean().backward()
        grads.append({n: p.grad for n, p in model.named_parameters()})
    for name, grad in grads[0].items():
        torch.testing.assert_close(grads[1][name], grad, rtol=1e-5, atol=1e-7, msg=name)


def test_flops_per_token_of_hybrid_layers() -> None:
    """The mixer term by layer kind: a hybrid config whose layers are all full attention counts
    as the plain model, the output gate adds its rows' matmul (6 FLOPs a weight a token), and a
    linear layer costs what its projections, conv and delta rule do, not seq_len."""
    from pipeline.core.model.flavors import flops_per_token

    full = ["full_attention"] * 4
    plain = hybrid_config(
        layer_types=None, norm_unit_offset=False, attention_output_gate=False, linear_attention=None
    )
    as_full = hybrid_config(layer_types=full, attention_output_gate=False)
    assert flops_per_token(as_full, 256) == pytest.approx(flops_per_token(plain, 256))
    gated = hybrid_config(layer_types=full)
    q_dim = 4 * 16
    extra = flops_per_token(gated, 256) - flops_per_token(as_full, 256)
    assert extra == pytest.approx(6 * 4 * 32 * q_dim)
    linear = hybrid_config(layer_types=["linear_attention"] * 4)
    # No term grows with the sequence in linear layers (the full layers' does).
    assert flops_per_token(linear, 4096) == pytest.approx(flops_per_token(linear, 256))
    assert flops_per_token(gated, 4096) > flops_per_token(gated, 256)
