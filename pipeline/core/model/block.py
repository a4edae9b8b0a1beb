"""The pieces of a decoder block, shared by the model (`transformer.py`) and its multi-token
prediction modules (`mtp.py`): what a run chooses about the model (`ModelOptions`), RMSNorm, the
attention of each kind (grouped-query `Attention`, DeepSeek's `LatentAttention`) and the
pre-norm residual `TransformerBlock` with its dense or MoE MLP.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from pipeline.core.kernels.attention import attention
from pipeline.core.model.config import ModelConfig
from pipeline.core.model.feed_forward import FeedForward, init_linear
from pipeline.core.model.kv_seam import LayerKVCache
from pipeline.core.model.linear_attention import GatedDeltaNet
from pipeline.core.model.moe import MoE
from pipeline.core.model.recompute import RECOMPUTE_MODES, recompute
from pipeline.core.model.rope import apply_rope, deinterleave
from pipeline.core.model.rope_scaling import yarn_softmax_factor


@dataclass(frozen=True)
class ModelOptions:
    """What a run chooses about a model beyond its shape (`ModelConfig`), fixed at construction.

    attention_backend: the attention kernel ("sdpa", "flex" or "flash_attn"; see
    `pipeline.core.kernels.attention`). activation_checkpointing: recompute each block's
    activations in backward ("none", "full" or "selective"). moe_aux_loss_scale: each MoE layer
    attaches the gradient of `scale * aux_loss` to its output (None: the caller adds the aux loss
    itself). moe_micro_batch_group: the process group one micro-batch's tokens are split over
    (context parallelism, and tp under sequence parallelism), so router statistics are those of
    the whole micro-batch.
    """

    attention_backend: str = "sdpa"
    # The gated delta rule's kernel in linear-attention layers ("auto": flash-linear-attention's
    # Triton kernels on a GPU where installed, else torch; "torch"; "fla").
    linear_attention_backend: str = "auto"
    activation_checkpointing: str = "none"
    moe_aux_loss_scale: float | None = None
    moe_micro_batch_group: Any = None

    def __post_init__(self) -> None:
        if self.activation_checkpointing not in RECOMPUTE_MODES:
            raise ValueError(
                f"unknown activation checkpointing mode {self.activation_checkpointing!r}; "
                f"choose one of {', '.join(RECOMPUTE_MODES)}"
            )


class RMSNorm(nn.Module):
    """x / rms(x) * weight, computed in fp32 and cast back (as Hugging Face Llama does).

    `unit_offset` (Qwen3-Next, Qwen3.5): the scale is 1 + weight, the weight stored
    zero-centred and the product taken in fp32 before the cast, as those models compute it (a
    weight rewritten to 1 + w would lose bits in bf16)."""

    def __init__(self, dim: int, eps: float, unit_offset: bool = False) -> None:
        super().__init__()
        self.eps = eps
        self.unit_offset = unit_offset
        self.weight = nn.Parameter(torch.empty(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.unit_offset:
            return (x32 * (1.0 + self.weight.float())).to(x.dtype)
        return self.weight * x32.to(x.dtype)

    def init_weights(self) -> None:
        if self.unit_offset:
            nn.init.zeros_(self.weight)
        else:
            nn.init.ones_(self.weight)


def model_norm(config: ModelConfig, dim: int | None = None) -> RMSNorm:
    """The model's RMSNorm over `dim` (default: hidden_size), with its eps and scale kind."""
    return RMSNorm(dim or config.hidden_size, config.norm_eps, config.norm_unit_offset)


# ---------------------------------------------------------------------------------------------
# Blocks
# ---------------------------------------------------------------------------------------------


class AttentionKernel(nn.Module):
    """softmax(q k^T / sqrt(d)) v, causal, within documents: the single-device kernel `backend`.

    A module (without parameters) so that a parallel layout swaps it in the open: context
    parallelism puts its own kernel at `Attention.kernel` (`pipeline.core.parallel.
    context_parallel`). `over_cache` attends new tokens' queries over a KV cache's keys."""

    def __init__(self, backend: str = "sdpa") -> None:
        super().__init__()
        self.backend = backend

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, document_ids: torch.Tensor | None
    ) -> torch.Tensor:
        return attention(q, k, v, causal=True, document_ids=document_ids, backend=self.backend)

    def over_cache(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None
    ) -> torch.Tensor:
        """Queries of new tokens over every cached key and value, under the cache's `mask`
        (None: each query sees every key)."""
        return attention(q, k, v, causal=False, mask=mask, backend=self.backend)

    def extra_repr(self) -> str:
        return f"backend={self.backend}"


class Attention(nn.Module):
    """Multi-head attention with grouped-query kv heads, RoPE, optional q/k/v bias (Qwen2) and
    optional per-head q/k RMSNorm before RoPE (Qwen3: `q_norm`, `k_norm` over head_dim, one
    weight shared by all heads, so tensor parallelism replicates them) and an optional sigmoid
    output gate (Qwen3-Next, Qwen3.5: `wq` gives each head's query and gate side by side).

    `kind` names the attention family for code that treats families differently (tensor
    parallel plans, converters); "gqa" is this one. With a `cache` (`pipeline.core.model.
    kv_seam`) it caches each token's key (after RoPE) and value and attends over the cached ones.
    """

    kind = "gqa"

    def __init__(self, config: ModelConfig, backend: str = "sdpa") -> None:
        super().__init__()
        self.head_dim = config.head_dim
        self.qk_norm = config.qk_norm
        q_dim = config.num_attention_heads * config.head_dim
        kv_dim = config.num_kv_heads * config.head_dim
        # With an output gate, each query head's rows are [query, gate] (Hugging Face's layout).
        self.output_gate = config.attention_output_gate
        q_rows = 2 * q_dim if self.output_gate else q_dim
        self.wq = nn.Linear(config.hidden_size, q_rows, bias=config.qkv_bias)
        self.wk = nn.Linear(config.hidden_size, kv_dim, bias=config.qkv_bias)
        self.wv = nn.Linear(config.hidden_size, kv_dim, bias=config.qkv_bias)
        self.wo = nn.Linear(q_dim, config.hidden_size, bias=False)
        if self.qk_norm:
            self.q_norm = model_norm(config, config.head_dim)
            self.k_norm = model_norm(config, config.head_dim)
        self.kernel = AttentionKernel(backend)

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        document_ids: torch.Tensor | None,
        *,
        cache: LayerKVCache | None = None,
    ) -> torch.Tensor:
        batch, seq, _ = x.shape
        # -1 heads: under tensor parallelism each rank holds a slice of the heads.
        q = self.wq(x)
        gate = None
        if self.output_gate:
            q, gate = q.view(batch, seq, -1, 2 * self.head_dim).chunk(2, dim=-1)
        q = q.reshape(batch, seq, -1, self.head_dim)
        k = self.wk(x).view(batch, seq, -1, self.head_dim)
        v = self.wv(x).view(batch, seq, -1, self.head_dim).transpose(1, 2)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q.transpose(1, 2), *rope), apply_rope(k.transpose(1, 2), *rope)
        if cache is None:
            out = self.kernel(q, k, v, document_ids)
        else:  # the cache holds [batch, tokens, kv_heads, head_dim]
            k, v = (t.transpose(1, 2) for t in cache.update(k.transpose(1, 2), v.transpose(1, 2)))
            out = self.kernel.over_cache(q, k, v, cache.mask)
        out = out.transpose(1, 2).reshape(batch, seq, -1)
        if gate is not None:
            out = out * torch.sigmoid(gate.reshape(batch, seq, -1))
        return self.wo(out)

    def init_weights(self, std: float, out_std: float) -> None:
        for linear in (self.wq, self.wk, self.wv):
            init_linear(linear, std)
        init_linear(self.wo, out_std)
        if self.qk_norm:
            self.q_norm.init_weights()
            self.k_norm.init_weights()


# DeepSeek's reference code and transformers give the latent norms the default eps, whatever
# the model's norm_eps.
_LATENT_NORM_EPS = 1e-6


class LatentAttention(nn.Module):
    """Multi-head latent attention (DeepSeek-V2/V3; `config.mla`, see `MLAConfig`).

    Queries: `wq` (when q_lora_rank is None) or `wq_a` -> `q_a_norm` -> `wq_b`. Keys/values:
    `wkv_a` gives the kv_lora_rank latent and one RoPE key shared by all heads; the latent goes
    through `kv_a_norm` and `wkv_b` to each head's non-RoPE key part and value. Per head, the key is
    [non-RoPE part, shared RoPE key]. Tensor parallelism splits heads (`wq`/`wq_b`, `wkv_b`,
    `wo`) and replicates the down projections. The softmax scale is 1/sqrt(qk_head_dim) times
    YaRN's mscale^2, applied to q so any attention kernel (and context parallelism's) serves.
    With a `cache` (`pipeline.core.model.kv_seam`) it caches each token's normalised latent and
    RoPE key, and recomputes the heads' keys and values from the cached ones."""

    kind = "mla"

    def __init__(self, config: ModelConfig, backend: str = "sdpa") -> None:
        super().__init__()
        mla = config.mla
        self.mla = mla
        h, heads = config.hidden_size, config.num_attention_heads
        if mla.q_lora_rank is None:
            self.wq = nn.Linear(h, heads * mla.qk_head_dim, bias=False)
        else:
            self.wq_a = nn.Linear(h, mla.q_lora_rank, bias=False)
            self.q_a_norm = RMSNorm(mla.q_lora_rank, _LATENT_NORM_EPS)
            self.wq_b = nn.Linear(mla.q_lora_rank, heads * mla.qk_head_dim, bias=False)
        self.wkv_a = nn.Linear(h, mla.kv_lora_rank + mla.qk_rope_head_dim, bias=False)
        self.kv_a_norm = RMSNorm(mla.kv_lora_rank, _LATENT_NORM_EPS)
        self.wkv_b = nn.Linear(
            mla.kv_lora_rank, heads * (mla.qk_nope_head_dim + mla.v_head_dim), bias=False
        )
        self.wo = nn.Linear(heads * mla.v_head_dim, h, bias=False)
        # A hook point: every head uses the one RoPE key, so under tensor parallelism (heads
        # split) its gradient is summed over the ranks here.
        self.rope_key = nn.Identity()
        self.q_scale = yarn_softmax_factor(config.rope_scaling)
        self.kernel = AttentionKernel(backend)

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        document_ids: torch.Tensor | None,
        *,
        cache: LayerKVCache | None = None,
    ) -> torch.Tensor:
        mla = self.mla
        batch, seq, _ = x.shape
        q = self.wq(x) if mla.q_lora_rank is None else self.wq_b(self.q_a_norm(self.wq_a(x)))
        q = q.view(batch, seq, -1, mla.qk_head_dim).transpose(1, 2)  # -1: this rank's heads
        q_nope, q_rope = q.split([mla.qk_nope_head_dim, mla.qk_rope_head_dim], dim=-1)
        latent, k_rope = self.wkv_a(x).split([mla.kv_lora_rank, mla.qk_rope_head_dim], dim=-1)
        latent = self.kv_a_norm(latent)
        k_rope = self.rope_key(k_rope.unsqueeze(1))  # [batch, 1, seq, rope]: one for all heads
        if mla.rope_interleave:
            q_rope, k_rope = deinterleave(q_rope), deinterleave(k_rope)
        q = torch.cat((q_nope, apply_rope(q_rope, *rope)), dim=-1)
        k_rope = apply_rope(k_rope, *rope)
        if cache is not None:  # from here on, the keys of every token so far
            latent, k_rope = cache.update(latent, k_rope[:, 0])
            k_rope = k_rope.unsqueeze(1)
        kv = self.wkv_b(latent)
        kv = kv.view(batch, latent.shape[1], -1, mla.qk_nope_head_dim + mla.v_head_dim)
        k_nope, v = kv.transpose(1, 2).split([mla.qk_nope_head_dim, mla.v_head_dim], dim=-1)
        k = torch.cat((k_nope, k_rope.expand(-1, k_nope.shape[1], -1, -1)), dim=-1)
        if self.q_scale != 1.0:
            q = q * self.q_scale
        if cache is None:
            out = self.kernel(q, k, v, document_ids)
        else:
            out = self.kernel.over_cache(q, k, v, cache.mask)
        return self.wo(out.transpose(1, 2).reshape(batch, seq, -1))

    def init_weights(self, std: float, out_std: float) -> None:
        if self.mla.q_lora_rank is None:
            init_linear(self.wq, std)
        else:
            init_linear(self.wq_a, std)
            self.q_a_norm.init_weights()
            init_linear(self.wq_b, std)
        init_linear(self.wkv_a, std)
        self.kv_a_norm.init_weights()
        init_linear(self.wkv_b, std)
        init_linear(self.wo, out_std)


class TransformerBlock(nn.Module):
    """Pre-norm residual block: x + attention(norm(x)), then + mlp(norm(x)).

    The block says what it is: `attention.kind` ("gqa": `Attention`; "mla": `LatentAttention`,
    chosen by `config.attention_kind`; "linear": `GatedDeltaNet`, where `config.layer_type`
    says "linear_attention"), and `mlp_kind` ("moe": `moe`, a `MoE`;
    "dense": `feed_forward`, a dense SwiGLU), chosen per layer by `config.mlp_kind(layer)`;
    `mlp` is whichever it has. With `options.activation_checkpointing` the block recomputes
    its activations in backward (`pipeline.core.model.recompute`)."""

    def __init__(
        self, config: ModelConfig, options: ModelOptions | None = None, layer: int = 0
    ) -> None:
        super().__init__()
        options = options or ModelOptions()
        self.mlp_kind = config.mlp_kind(layer)
        self.recompute = options.activation_checkpointing
        self.attention_norm = model_norm(config)
        if config.layer_type(layer) == "linear_attention":
            self.attention = GatedDeltaNet(config, options.linear_attention_backend)
        else:
            attention_cls = LatentAttention if config.attention_kind == "mla" else Attention
            self.attention = attention_cls(config, options.attention_backend)
        self.ffn_norm = model_norm(config)
        if self.mlp_kind == "dense":
            self.feed_forward = FeedForward(config.hidden_size, config.ffn_hidden_size)
        else:
            self.moe = MoE(
                config.hidden_size,
                config.expert_ffn_hidden_size,
                config.moe,
                aux_loss_scale=options.moe_aux_loss_scale,
                micro_batch_group=options.moe_micro_batch_group,
            )

    @property
    def is_moe(self) -> bool:
        return self.mlp_kind == "moe"

    @property
    def mlp(self) -> nn.Module:
        return self.moe if self.is_moe else self.feed_forward

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        document_ids: torch.Tensor | None,
        cache: LayerKVCache | None = None,
    ) -> torch.Tensor:
        return recompute(self.recompute, self._forward, x, rope, document_ids, cache)

    def _forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        document_ids: torch.Tensor | None,
        cache: LayerKVCache | None,
    ) -> torch.Tensor:
        # `cache` by keyword: tensor-parallel plans prepare the positional inputs only.
        x = x + self.attention(self.attention_norm(x), rope, document_ids, cache=cache)
        return x + self.mlp(self.ffn_norm(x))

    def init_weights(self, std: float, out_std: float) -> None:
        self.attention_norm.init_weights()
        self.ffn_norm.init_weights()
        self.attention.init_weights(std, out_std)
        self.mlp.init_weights(std, out_std)
