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
from torch.distributed.tensor import DTensor

from pipeline.core.kernels.attention import attention
from pipeline.core.model.alibi import AlibiSlopes
from pipeline.core.model.config import ModelConfig
from pipeline.core.model.feed_forward import FeedForward, init_linear
from pipeline.core.model.kv_seam import LayerKVCache, attend
from pipeline.core.model.linear_attention import GatedDeltaNet
from pipeline.core.model.moe import MoE
from pipeline.core.model.norms import LayerNorm
from pipeline.core.model.recompute import RECOMPUTE_MODES, recompute
from pipeline.core.model.rope import apply_rope, deinterleave, query_scale
from pipeline.core.model.rope_scaling import yarn_softmax_factor
from pipeline.core.model.shared_input import project


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


def build_norm(config: ModelConfig, dim: int | None = None) -> RMSNorm | LayerNorm:
    """The model's norm over `dim` features (default: hidden_size): RMSNorm, with its scale
    kind (`config.norm_unit_offset`), or LayerNorm (`config.norm_type`)."""
    dim = dim or config.hidden_size
    if config.norm_type == "layernorm":
        return LayerNorm(dim, config.norm_eps, bias=config.norm_bias)
    return RMSNorm(dim, config.norm_eps, config.norm_unit_offset)


# ---------------------------------------------------------------------------------------------
# Blocks
# ---------------------------------------------------------------------------------------------


class AttentionKernel(nn.Module):
    """softmax(q k^T / sqrt(d)) v, causal, within documents: the single-device kernel `backend`.

    A module (without parameters) so that a parallel layout swaps it in the open: context
    parallelism puts its own kernel at `Attention.kernel` (`pipeline.core.parallel.
    context_parallel`), keeping its `window`. `over_cache` attends new tokens' queries over a
    KV cache's keys. `window`: a sliding-window layer's window (None: full attention); `sinks`:
    the layer's per-head sink logits, when it has them."""

    def __init__(self, backend: str = "sdpa", window: int | None = None) -> None:
        super().__init__()
        self.backend = backend
        self.window = window

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        document_ids: torch.Tensor | None,
        alibi_slopes: torch.Tensor | None = None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """`alibi_slopes`: ALiBi's slope of each head (`pipeline.core.model.alibi`), `sinks`:
        the heads' sink logits, each given only by layers that have them, so a kernel without
        them serves the others."""
        return attention(
            q,
            k,
            v,
            causal=True,
            document_ids=document_ids,
            backend=self.backend,
            alibi_slopes=alibi_slopes,
            window=self.window,
            sinks=sinks,
        )

    def over_cache(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        mask: torch.Tensor | None,
        alibi_slopes: torch.Tensor | None = None,
        positions: tuple[torch.Tensor, torch.Tensor] | None = None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Queries of new tokens over every cached key and value, under the cache's `mask`
        (None: each query sees every key; the cache's mask holds a sliding window); ALiBi's
        bias at the cache's `positions`."""
        return attention(
            q,
            k,
            v,
            causal=False,
            mask=mask,
            backend=self.backend,
            alibi_slopes=alibi_slopes,
            positions=positions,
            sinks=sinks,
        )

    def extra_repr(self) -> str:
        window = "" if self.window is None else f", window={self.window}"
        return f"backend={self.backend}{window}"


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of `t` when tensor parallelism made it a DTensor (sinks split with
    their heads), else `t`."""
    return t.to_local() if isinstance(t, DTensor) else t


class Attention(nn.Module):
    """Multi-head attention with grouped-query kv heads, RoPE (over the first `rope_dim`
    dimensions of each head), optional q/k/v bias (Qwen2, GLM-4.5), optional q/k RMSNorm
    before RoPE: per head (Qwen3: `q_norm`, `k_norm` over head_dim, one weight shared by all
    heads, so tensor parallelism replicates them) or over the whole projection (MiniMax-M2:
    `qk_norm_scope` "projection", one weight per dimension of q and of k; tensor parallelism
    replicates them too and normalises over the gathered sum of squares), and an optional
    sigmoid output gate (Qwen3-Next, Qwen3.5: `wq` gives each head's query and gate side by
    side).

    `kind` names the attention family for code that treats families differently (tensor
    parallel plans, converters); "gqa" is this one. With a `cache` (`pipeline.core.model.
    kv_seam`) it caches each token's key (after RoPE) and value and attends over the cached ones.

    Positions come from RoPE, or from ALiBi's biases (`config.position_embedding`; `alibi`
    holds the heads' slopes, which the kernel turns into biases), or from nothing ("none").
    BLOOM and MPT add an o_proj bias (`config.attention_out_bias`) and MPT clamps q, k and v
    (`config.clip_qkv`). Per layer (`layer`, its global index): a sliding window
    (`config.attention_window`), no RoPE (`config.no_rope_layers`, SmolLM3); gpt-oss adds
    attention sinks (`sinks`, one logit per query head; tensor parallelism splits them with
    their heads).
    """

    kind = "gqa"

    def __init__(self, config: ModelConfig, backend: str = "sdpa", layer: int = 0) -> None:
        super().__init__()
        self.head_dim = config.head_dim
        self.qk_norm = config.qk_norm
        self.qk_norm_scope = config.qk_norm_scope
        q_dim = config.num_attention_heads * config.head_dim
        kv_dim = config.num_kv_heads * config.head_dim
        # With an output gate, each query head's rows are [query, gate] (Hugging Face's layout).
        self.output_gate = config.attention_output_gate
        q_rows = 2 * q_dim if self.output_gate else q_dim
        self.wq = nn.Linear(config.hidden_size, q_rows, bias=config.qkv_bias)
        self.wk = nn.Linear(config.hidden_size, kv_dim, bias=config.qkv_bias)
        self.wv = nn.Linear(config.hidden_size, kv_dim, bias=config.qkv_bias)
        self.wo = nn.Linear(q_dim, config.hidden_size, bias=config.attention_out_bias)
        if self.qk_norm:
            whole = self.qk_norm_scope == "projection"
            self.q_norm = build_norm(config, q_dim if whole else config.head_dim)
            self.k_norm = build_norm(config, kv_dim if whole else config.head_dim)
        self.sinks = (
            nn.Parameter(torch.empty(config.num_attention_heads))
            if config.attention_sinks
            else None
        )
        self.use_rope = config.position_embedding == "rope" and layer not in config.no_rope_layers
        self.alibi = (
            AlibiSlopes(config.num_attention_heads, config.alibi_bias_max)
            if config.position_embedding == "alibi"
            else None
        )
        self.clip_qkv = config.clip_qkv
        self.kernel = AttentionKernel(backend, config.attention_window(layer))

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        document_ids: torch.Tensor | None,
        *,
        cache: LayerKVCache | None = None,
    ) -> torch.Tensor:
        batch, seq, _ = x.shape
        q, k, v = project(x, self.wq, self.wk, self.wv)
        gate = None
        if self.output_gate:  # each query head's rows are [query, gate]
            q, gate = q.view(batch, seq, -1, 2 * self.head_dim).chunk(2, dim=-1)
            q = q.reshape(batch, seq, -1)
        if self.clip_qkv is not None:
            q, k, v = (t.clamp(-self.clip_qkv, self.clip_qkv) for t in (q, k, v))
        if self.qk_norm and self.qk_norm_scope == "projection":
            q, k = self.q_norm(q), self.k_norm(k)
        # -1 heads: under tensor parallelism each rank holds a slice of the heads.
        q = q.view(batch, seq, -1, self.head_dim)
        k = k.view(batch, seq, -1, self.head_dim)
        v = v.view(batch, seq, -1, self.head_dim).transpose(1, 2)
        if self.qk_norm and self.qk_norm_scope == "head":
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        if self.use_rope:
            cos_sin = rope[:2]
            q = query_scale(apply_rope(q, *cos_sin), rope)
            k = apply_rope(k, *cos_sin)
        # Passed only when the layer has them, so kernels without ALiBi or sinks serve the others.
        extra = {} if self.alibi is None else {"alibi_slopes": self.alibi(q.device)}
        if self.sinks is not None:
            extra["sinks"] = local_tensor(self.sinks)
        if cache is None:
            out = self.kernel(q, k, v, document_ids, **extra)
        else:
            out = attend(cache, self.kernel.over_cache, q, k, v, **extra)
        out = out.transpose(1, 2).reshape(batch, seq, -1)
        if gate is not None:
            out = out * torch.sigmoid(gate.reshape(batch, seq, -1))
        return self.wo(out)

    def init_weights(self, std: float, out_std: float) -> None:
        for linear in (self.wq, self.wk, self.wv):
            init_linear(linear, std)
        init_linear(self.wo, out_std)
        if self.sinks is not None:
            nn.init.normal_(self.sinks, mean=0.0, std=std)
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
        q = query_scale(torch.cat((q_nope, apply_rope(q_rope, *rope[:2])), dim=-1), rope)
        k_rope = apply_rope(k_rope, *rope[:2])
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
        self.attention_norm = build_norm(config, config.hidden_size)
        if config.layer_type(layer) == "linear_attention":
            self.attention = GatedDeltaNet(config, options.linear_attention_backend)
        elif config.attention_kind == "mla":
            self.attention = LatentAttention(config, options.attention_backend)
        else:
            self.attention = Attention(config, options.attention_backend, layer)
        self.ffn_norm = build_norm(config, config.hidden_size)
        if self.mlp_kind == "dense":
            self.feed_forward = FeedForward(
                config.hidden_size,
                config.ffn_hidden_size,
                activation=config.activation,
                gated=config.gated_mlp,
                bias=config.mlp_bias,
            )
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
        rope: tuple[torch.Tensor, torch.Tensor] | None,
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
