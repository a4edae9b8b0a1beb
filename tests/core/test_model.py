"""The transformer against Hugging Face transformers (the numerics oracle), plus initialisation,
naming, document masking, MoE routing and the flavor arithmetic. CPU, fp32."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from pipeline.core.model.config import MLAConfig, ModelConfig, MoEConfig, RopeScaling
from pipeline.core.model.flavors import (
    FLAVORS,
    flops_per_token,
    get_flavor,
    num_parameters,
)
from pipeline.core.model.hf_names import from_hf_state_dict
from pipeline.core.model.moe import MoE, load_balancing_loss, router_z_loss
from pipeline.core.model.transformer import Transformer
from tests.builders import SEQ, VOCAB, hf_case, perturbed
from tests.builders import build_model as build

# ---------------------------------------------------------------------------------------------
# Parity with Hugging Face
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["llama_untied", "llama_tied", "mistral", "qwen2", "mixtral"])
def test_against_hf(name: str) -> None:
    """Same weights and tokens: logits and every gradient of the CE loss agree to 1e-4.

    HF weights are perturbed away from their init so norms are not all ones and Qwen2's biases
    not all zeros. For Mixtral the loss is the CE alone (our aux loss is off: HF adds its own,
    differently normalised, only when asked).
    """
    hf_cls, hf_config, config = hf_case(name)
    torch.manual_seed(0)
    hf_config._attn_implementation = "eager"
    hf = perturbed(hf_cls(hf_config).eval())
    model = build(config)
    model.load_state_dict(from_hf_state_dict(hf.state_dict()), strict=True)

    tokens = torch.randint(0, VOCAB, (2, SEQ))
    labels = torch.randint(0, VOCAB, (2, SEQ))
    hf_logits = hf(input_ids=tokens).logits
    logits = model.logits(tokens)
    assert (logits - hf_logits).abs().max() < 1e-4

    F.cross_entropy(hf_logits.flatten(0, 1), labels.flatten()).backward()
    F.cross_entropy(logits.flatten(0, 1), labels.flatten()).backward()
    hf_grads = from_hf_state_dict({n: p.grad for n, p in hf.named_parameters()})
    for pname, p in model.named_parameters():
        assert (p.grad - hf_grads[pname]).abs().max() < 1e-4, pname


# ---------------------------------------------------------------------------------------------
# Construction, initialisation and names
# ---------------------------------------------------------------------------------------------


def _small(**overrides) -> ModelConfig:
    fields = dict(
        vocab_size=512,
        hidden_size=128,
        num_layers=4,
        num_attention_heads=4,
        num_kv_heads=2,
        ffn_hidden_size=256,
    )
    return ModelConfig(**(fields | overrides))


def test_init_weights_stds() -> None:
    torch.manual_seed(0)
    config = _small(qkv_bias=True, init_method_std=0.02)
    model = build(config)
    out_std = 0.02 / math.sqrt(2 * config.num_layers)
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            assert torch.equal(p, torch.ones_like(p)), name
        elif name.endswith("bias"):
            assert torch.equal(p, torch.zeros_like(p)), name
        else:
            expected = out_std if name.endswith(("wo.weight", "w2.weight")) else 0.02
            assert p.mean().abs() < 3 * expected / math.sqrt(p.numel()), name
            assert abs(p.std().item() / expected - 1) < 0.05, name
    assert torch.isfinite(model.rope.inv_freq).all()
    assert "rope.inv_freq" not in model.state_dict()


def test_scaled_init_off_and_moe_experts() -> None:
    torch.manual_seed(0)
    model = build(_small(use_scaled_init=False, moe=MoEConfig(num_experts=4, top_k=2)))
    assert abs(model.layers["0"].attention.wo.weight.std().item() / 0.02 - 1) < 0.05
    model = build(_small(moe=MoEConfig(num_experts=4, top_k=2)))
    experts = model.layers["1"].moe.experts
    assert abs(experts.w2.std().item() / (0.02 / math.sqrt(8)) - 1) < 0.05
    assert abs(experts.w1.std().item() / 0.02 - 1) < 0.05


def test_tied_embeddings_share_one_parameter() -> None:
    config = _small(tie_word_embeddings=True)
    model = build(config)
    assert model.output.weight is model.tok_embeddings.weight
    assert sum(p.numel() for p in model.parameters()) == num_parameters(config)
    tokens = torch.randint(0, 512, (1, 8))
    model.logits(tokens).sum().backward()
    assert model.tok_embeddings.weight.grad is not None


def test_layers_keyed_by_global_index() -> None:
    model = build(_small())
    assert list(model.layers.keys()) == ["0", "1", "2", "3"]
    # A pipeline stage owning layers 2-3 keeps their names and takes hidden states as input.
    del model.layers["0"], model.layers["1"]
    model.tok_embeddings = None
    names = {n.split(".")[1] for n in model.state_dict() if n.startswith("layers.")}
    assert names == {"2", "3"}
    assert model(torch.randn(1, 8, 128)).shape == (1, 8, 128)


@pytest.mark.parametrize("moe", [None, MoEConfig(num_experts=4, top_k=2)])
def test_document_masking_equals_separate_documents(moe: MoEConfig | None) -> None:
    torch.manual_seed(0)
    model = build(_small(moe=moe, rope_scaling=RopeScaling(original_max_position_embeddings=8)))
    lengths = [5, 9, 2]
    docs = [torch.randint(0, 512, (1, n)) for n in lengths]
    packed = torch.cat(docs, dim=1)
    document_ids = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)])[None]
    position_ids = torch.cat([torch.arange(n) for n in lengths])[None]
    with torch.no_grad():
        together = model(packed, position_ids=position_ids, document_ids=document_ids)
        apart = torch.cat([model(d) for d in docs], dim=1)
    assert (together - apart).abs().max() < 1e-5


class _GrowingCache:
    """The simplest `KVCache` (`pipeline.core.model.kv_seam`) for one forward of `new` tokens
    after `start` cached ones, every row as long: each layer's entries in `store`, one tensor per
    kind, appended to."""

    def __init__(self, store: dict[int, list[torch.Tensor]], start: int, new: int) -> None:
        self.store = store
        positions = torch.arange(start, start + new)
        self.mask = (torch.arange(start + new)[None, :] <= positions[:, None])[None, None]

    def layer(self, index: int) -> _GrowingCache:
        self.index = index  # the model asks for each layer in turn
        return self

    def update(self, *new: torch.Tensor) -> list[torch.Tensor]:
        old = self.store.get(self.index)
        both = list(new) if old is None else [torch.cat(p, dim=1) for p in zip(old, new)]
        self.store[self.index] = both
        return both


@pytest.mark.parametrize("kind", ["gqa", "mla"])
def test_cached_decoding_equals_full_forward(kind: str) -> None:
    """The attention's cache seam: a prompt, then one token at a time through a cache, gives
    the hidden states of the whole sequence in one forward."""
    mla = MLAConfig(32, 24, 16, 8, 16) if kind == "mla" else None
    torch.manual_seed(0)
    model = build(_small(mla=mla, qk_norm=kind == "gqa"))
    tokens = torch.randint(0, 512, (2, 9))
    store: dict[int, list[torch.Tensor]] = {}
    with torch.no_grad():
        whole = model(tokens)
        steps = [model(tokens[:, :6], cache=_GrowingCache(store, 0, 6))]
        for p in range(6, 9):
            cache = _GrowingCache(store, p, 1)
            steps.append(model(tokens[:, p : p + 1], torch.full((2, 1), p), cache=cache))
    assert (torch.cat(steps, dim=1) - whole).abs().max() < 1e-5


def test_num_parameters_matches_module() -> None:
    for config in (_small(), _small(qkv_bias=True, head_dim=24), _small(moe=MoEConfig(4, 2))):
        with torch.device("meta"):
            model = Transformer(config)
        assert sum(p.numel() for p in model.parameters()) == num_parameters(config)


def test_flavors() -> None:
    for name in FLAVORS:
        assert isinstance(get_flavor(name), ModelConfig)
    assert abs(num_parameters(get_flavor("llama3_8b")) / 8.03e9 - 1) < 0.01
    assert abs(num_parameters(get_flavor("llama3_70b")) / 70.55e9 - 1) < 0.01
    assert abs(num_parameters(get_flavor("llama3_2_1b")) / 1.236e9 - 1) < 0.01
    assert abs(num_parameters(get_flavor("mixtral_8x7b")) / 46.70e9 - 1) < 0.01
    assert get_flavor("tiny_moe").moe.num_experts == 4
    with pytest.raises(ValueError, match="unknown model flavor"):
        get_flavor("gpt5")


def test_flops_per_token_by_hand() -> None:
    """Dense MHA: 6 FLOPs per matmul weight (excluding the embedding lookup), plus the causal
    attention matmuls QK^T and AV: 2 matmuls * 2 FLOPs * 3 passes * S * q_dim / 2."""
    config = _small(num_kv_heads=4)
    seq = 64
    matmul_params = num_parameters(config) - config.vocab_size * config.hidden_size
    matmul_params -= (2 * config.num_layers + 1) * config.hidden_size  # norms
    attention = config.num_layers * 12 * seq * config.hidden_size / 2
    assert flops_per_token(config, seq) == pytest.approx(6 * matmul_params + attention)


# ---------------------------------------------------------------------------------------------
# Mixture of experts
# ---------------------------------------------------------------------------------------------


def _moe(**overrides) -> MoE:
    torch.manual_seed(0)
    moe = MoE(32, 48, MoEConfig(**(dict(num_experts=4, top_k=2) | overrides)))
    moe.init_weights(std=0.3, out_std=0.3)
    return moe


def _naive_moe(moe: MoE, x: torch.Tensor) -> torch.Tensor:
    """Token by token: softmax, top-k, renormalise, weighted sum of expert outputs."""
    ex = moe.experts
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        probs = torch.softmax(moe.router(x[t]), dim=-1)
        weights, idx = probs.topk(moe.config.top_k)
        for w, e in zip(weights / weights.sum(), idx.tolist()):
            hidden = F.silu(ex.w1[e] @ x[t]) * (ex.w3[e] @ x[t])
            out[t] += w * (ex.w2[e] @ hidden)
    return out


def test_moe_dropless_equals_naive_loop() -> None:
    moe = _moe()
    x = torch.randn(2, 10, 32)
    with torch.no_grad():
        out = moe(x)
        expected = _naive_moe(moe, x.reshape(-1, 32)).reshape_as(x)
    assert (out - expected).abs().max() < 1e-5
    assert moe.tokens_per_expert.sum() == 20 * 2
    assert moe.num_dropped == 0


def test_moe_capacity_drops_overflow() -> None:
    moe = _moe(capacity_factor=0.5)
    x = torch.randn(40, 32)
    with torch.no_grad():
        out = moe(x)
    capacity = moe.capacity(40)
    assert capacity == 10
    counts = moe.tokens_per_expert
    assert moe.num_dropped == (counts - counts.clamp(max=capacity)).sum() > 0
    # Each expert keeps its earliest tokens: recompute with the dropped assignments zeroed.
    probs = torch.softmax(moe.router(x), dim=-1)
    weights, idx = probs.topk(2)
    weights = weights / weights.sum(-1, keepdim=True)
    seen = [0] * 4
    expected = torch.zeros_like(x)
    ex = moe.experts
    with torch.no_grad():
        for t in range(40):
            for w, e in zip(weights[t], idx[t].tolist()):
                seen[e] += 1
                if seen[e] <= capacity:
                    expected[t] += w * (ex.w2[e] @ (F.silu(ex.w1[e] @ x[t]) * (ex.w3[e] @ x[t])))
    assert (out - expected).abs().max() < 1e-5


def test_moe_aux_losses_by_hand() -> None:
    moe = _moe(aux_loss_coeff=0.1, z_loss_coeff=0.01)
    x = torch.randn(12, 32)
    moe(x)
    logits = moe.router(x)
    probs = torch.softmax(logits, dim=-1)
    idx = probs.topk(2).indices
    f = torch.tensor([(idx == e).sum().item() / (12 * 2) for e in range(4)])
    p = probs.mean(0)
    balance = 4 * sum(f[e] * p[e] for e in range(4))
    z = sum(torch.logsumexp(logits[t], 0) ** 2 for t in range(12)) / 12
    assert torch.allclose(load_balancing_loss(probs, idx), balance)
    assert torch.allclose(router_z_loss(logits), z)
    assert torch.allclose(moe.aux_loss, 0.1 * balance + 0.01 * z)
    moe.aux_loss.backward()
    assert moe.router.weight.grad.abs().sum() > 0


def test_sequence_wise_balance_loss_by_hand() -> None:
    """DeepSeek-V3's sequence-wise loss: per sequence, E/(K T) * counts . mean normalised
    sigmoid scores; averaged over the sequences (not the micro-batch formula)."""
    moe = _moe(
        score_function="sigmoid", aux_loss_coeff=0.1, aux_loss_type="sequence", expert_bias=True
    )
    with torch.no_grad():
        moe.expert_bias.copy_(torch.tensor([0.3, -0.2, 0.0, 0.1]))  # chooses, never weighs
    x = torch.randn(3, 7, 32)
    moe(x)
    per_sequence = []
    for seq in x:
        scores = torch.sigmoid(moe.router(seq))
        chosen = (scores + moe.expert_bias).topk(2).indices
        counts = torch.tensor([(chosen == e).sum().item() for e in range(4)], dtype=torch.float)
        normalised = scores / scores.sum(-1, keepdim=True)
        per_sequence.append((4 / (2 * 7) * counts * normalised.mean(0)).sum())
    expected = 0.1 * torch.stack(per_sequence).mean()
    torch.testing.assert_close(moe.aux_loss, expected)
    batch_wise = _moe(score_function="sigmoid", aux_loss_coeff=0.1, expert_bias=True)
    batch_wise.load_state_dict(moe.state_dict())
    batch_wise(x)
    assert not torch.allclose(batch_wise.aux_loss, expected)
    moe.aux_loss.backward()
    assert moe.router.weight.grad.abs().sum() > 0


def test_model_collects_moe_aux_loss() -> None:
    model = build(_small(moe=MoEConfig(num_experts=4, top_k=2, aux_loss_coeff=0.01)))
    assert build(_small()).moe_aux_loss() is None
    model(torch.randint(0, 512, (2, 8)))
    layers = model.moe_layers()
    assert list(layers) == ["0", "1", "2", "3"]
    expected = sum(m.aux_loss for m in layers.values())
    assert torch.allclose(model.moe_aux_loss(), expected)
    # A uniform router gives the minimum, coeff * 1, per layer; any router gives at least ~that.
    assert model.moe_aux_loss() >= 4 * 0.01 * 0.99
