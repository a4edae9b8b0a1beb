"""Model configuration: one dataclass covers Llama 3 / 3.1 / 3.2, Mistral, Qwen2, Qwen3,
mixtures of experts in every layer (Mixtral) or in some (Qwen3-MoE), and DeepSeek-V3's
multi-head latent attention (`MLAConfig`) with YaRN RoPE scaling (`YarnScaling`). Field names follow
Megatron's arguments (`hidden_size`, `num_query_groups` is `num_kv_heads` here), so recipes read
naturally to its users.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

NORM_TYPES = ("rmsnorm", "layernorm")
ACTIVATIONS = ("silu", "gelu", "gelu_pytorch_tanh", "gelu_new", "relu")
POSITION_EMBEDDINGS = ("rope", "alibi", "none")


@dataclass
class RopeScaling:
    """Llama 3.1-style RoPE frequency scaling (`rope_type: llama3` in Hugging Face configs)."""

    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass
class YarnScaling:
    """YaRN RoPE scaling (`rope_type: yarn`, DeepSeek-V3): frequencies blended between
    interpolated (divided by `factor`) and original along a ramp set by `beta_fast` /
    `beta_slow` rotations over `original_max_position_embeddings`; cos/sin are multiplied by
    mscale(factor, mscale) / mscale(factor, mscale_all_dim), and latent attention's softmax
    scale by mscale(factor, mscale_all_dim)^2, where mscale(s, m) = 0.1 * m * ln(s) + 1."""

    factor: float = 40.0
    original_max_position_embeddings: int = 4096
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 1.0
    mscale_all_dim: float = 1.0
    rope_type: str = "yarn"  # tells it from `RopeScaling` in saved config dicts
    # False: the ramp's bounds are not rounded outwards (gpt-oss's `truncate: false`).
    truncate: bool = True
    # Set: cos/sin are multiplied by this instead of the mscale ratio (HF `attention_factor`).
    attention_factor: float | None = None


@dataclass
class MLAConfig:
    """Multi-head latent attention (DeepSeek-V2/V3). Queries: hidden -> q_lora_rank -> RMSNorm ->
    heads * (qk_nope_head_dim + qk_rope_head_dim), or one projection when `q_lora_rank` is None
    (V2-Lite). Keys and values: hidden -> kv_lora_rank latent (RMSNorm, then up-projected to
    heads * (qk_nope_head_dim + v_head_dim)) plus one RoPE key of qk_rope_head_dim shared by all
    heads. `rope_interleave`: the RoPE dimensions are stored as neighbouring pairs (HF default)."""

    kv_lora_rank: int = 512
    q_lora_rank: int | None = 1536
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    rope_interleave: bool = True

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim


@dataclass
class MoEConfig:
    """Mixture of experts: a top-k router over experts, in every layer (Mixtral) or in the
    layers `layer_step` and `dense_layers` select (Qwen3-MoE, DeepSeek's first dense layers); the
    other layers keep the dense SwiGLU MLP of width `ModelConfig.ffn_hidden_size`.

    DeepSeekMoE adds shared experts, sigmoid scores, grouped top-k, a routed scaling factor and
    the auxiliary-loss-free balancing bias (`expert_bias`): added to the scores to choose
    experts (never to weigh them), and moved by `expert_bias_update_rate` after each optimizer
    step towards an even load (`pipeline.train.loop.expert_bias`)."""

    num_experts: int = 8
    top_k: int = 2
    ffn_hidden_size: int | None = None  # per expert; None: the dense ffn_hidden_size
    aux_loss_coeff: float = 0.01  # load-balancing loss (Switch/Megatron formulation)
    # Over what the balance loss counts: "micro_batch" (Switch/Megatron's aux_loss) or
    # "sequence" (DeepSeek-V3's sequence-wise loss, Megatron's seq_aux_loss: the same formula
    # per sequence, averaged over the sequences).
    aux_loss_type: str = "micro_batch"
    z_loss_coeff: float = 0.0  # router z-loss (ST-MoE)
    capacity_factor: float | None = None  # None: dropless; else tokens over capacity are dropped
    # Divide the k chosen probabilities by their sum (Mixtral; Qwen3-MoE's `norm_topk_prob`);
    # False weighs each expert by its plain softmax probability.
    norm_topk_prob: bool = True
    # Layer i is MoE when (i + 1) % layer_step == 0 (HF `decoder_sparse_step`) ...
    layer_step: int = 1
    # ... and it is not listed here (HF `mlp_only_layers`; DeepSeek's first dense layers).
    dense_layers: list[int] = field(default_factory=list)
    score_function: str = "softmax"  # or "sigmoid" (DeepSeek-V3)
    # Grouped top-k (DeepSeek's n_group / topk_group): experts come in `num_groups` groups, a
    # group scores the sum of its two best experts, and only the best `topk_groups` groups are
    # chosen from.
    num_groups: int = 1
    topk_groups: int = 1
    routed_scaling_factor: float = 1.0  # multiplies the routed experts' weights
    num_shared_experts: int = 0  # one SwiGLU of this many experts' width sees every token
    expert_bias: bool = False  # DeepSeek-V3's e_score_correction_bias
    expert_bias_update_rate: float = 1e-3
    # gpt-oss: the router has a bias, each expert's projections have biases (gate, up, down),
    # and the experts' activation is the clamped SwiGLU "swiglu_clamped":
    # (clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g), g = clamp(gate, max=limit).
    router_bias: bool = False
    expert_biases: bool = False
    activation: str = "swiglu"  # or "swiglu_clamped"
    swiglu_limit: float = 7.0
    swiglu_alpha: float = 1.702

    # The shared experts' width when it is not num_shared_experts * the experts' width
    # (Qwen3-Next / Qwen3.5-MoE's shared_expert_intermediate_size); None: that product.
    shared_expert_ffn_hidden_size: int | None = None
    # Weigh the shared experts' output per token by sigmoid(a linear of the input)
    # (Qwen3-Next / Qwen3.5-MoE's shared_expert_gate).
    shared_expert_gate: bool = False


@dataclass
class LinearAttentionConfig:
    """Gated DeltaNet linear attention (Qwen3-Next, Qwen3.5), the layers `layer_types` names
    "linear_attention". Queries and keys have `num_key_heads` heads of `key_head_dim`, values
    and the output gate `num_value_heads` of `value_head_dim` (a multiple of the key heads: each
    key head serves num_value_heads / num_key_heads value heads); a causal depthwise conv of
    width `conv_kernel_size` runs over the q, k, v channels. `interleaved_projections`: one
    q/k/v/z and one b/a projection whose rows are grouped by key head (Qwen3-Next's
    in_proj_qkvz / in_proj_ba); otherwise four projections (Qwen3.5's in_proj_qkv, _z, _b, _a).
    """

    num_key_heads: int = 16
    num_value_heads: int = 32
    key_head_dim: int = 128
    value_head_dim: int = 128
    conv_kernel_size: int = 4
    interleaved_projections: bool = False

    @property
    def key_dim(self) -> int:
        return self.num_key_heads * self.key_head_dim

    @property
    def value_dim(self) -> int:
        return self.num_value_heads * self.value_head_dim

    @property
    def conv_dim(self) -> int:
        """Channels of the conv: queries, keys and values side by side."""
        return 2 * self.key_dim + self.value_dim


# The per-layer attention kinds `ModelConfig.layer_types` may name (Hugging Face's spelling).
LAYER_TYPES = ("full_attention", "sliding_attention", "linear_attention")


@dataclass
class ModelConfig:
    """Shape and numerics of a decoder-only transformer."""

    vocab_size: int = 32000
    hidden_size: int = 4096
    num_layers: int = 32
    num_attention_heads: int = 32
    num_kv_heads: int | None = None  # None: multi-head attention (= num_attention_heads)
    head_dim: int | None = None  # None: hidden_size // num_attention_heads (Mistral sets it)
    ffn_hidden_size: int = 14336
    norm_eps: float = 1e-5
    rope_theta: float = 500000.0
    rope_scaling: RopeScaling | YarnScaling | None = None
    max_position_embeddings: int = 8192
    tie_word_embeddings: bool = False
    qkv_bias: bool = False  # Qwen2
    qk_norm: bool = False  # Qwen3: RMSNorm over head_dim on each q and k head, before RoPE
    # What each q/k norm spans: "head" (Qwen3's: each head over head_dim, one weight shared by
    # the heads) or "projection" (MiniMax-M2's: all heads' q, and all kv heads' k, normalised
    # together, with a weight per dimension of the projection).
    qk_norm_scope: str = "head"
    # RoPE rotates the first int(head_dim * factor) dimensions of each q/k head (rotate-half
    # pairing within them: GLM-4.5, MiniMax-M2); the rest pass through unrotated.
    partial_rotary_factor: float = 1.0
    # Llama 4's and Mistral 4's long-context query scale: queries at position p are multiplied
    # by 1 + beta * ln(1 + floor(p / original_max_position_embeddings)) (the RoPE scaling's
    # original context). 0: off.
    query_scale_beta: float = 0.0
    moe: MoEConfig | None = None
    mla: MLAConfig | None = None  # set: latent attention (head_dim, num_kv_heads unused)
    init_method_std: float = 0.02
    # Megatron's scaled init: output projections of each block use std / sqrt(2 * num_layers).
    use_scaled_init: bool = True
    # Multi-token prediction (DeepSeek-V3's num_nextn_predict_layers, Megatron's --mtp-num-layers):
    # modules predicting 2 .. D + 1 tokens ahead, trained with weight
    # mtp_loss_scaling_factor / D each (Megatron's --mtp-loss-scaling-factor). 0: none.
    mtp_num_layers: int = 0
    mtp_loss_scaling_factor: float = 0.1
    # Per-layer kind (Hugging Face's names): "full_attention", "sliding_attention" (each query
    # sees itself and the `sliding_window - 1` tokens before it) or "linear_attention" (gated
    # DeltaNet, `linear_attention`); None: all full attention.
    layer_types: list[str] | None = None
    sliding_window: int | None = None
    # One learned logit per head, an extra softmax column whose value is dropped (gpt-oss).
    attention_sinks: bool = False
    # Layers whose queries and keys get no RoPE (SmolLM3's `no_rope_layers` zeros).
    no_rope_layers: list[int] = field(default_factory=list)
    # Block shape beyond Llama's (BLOOM, MPT): the MLP's activation (Hugging Face `hidden_act`
    # names, `ACTIVATIONS`), gated (SwiGLU-style w2(act(w1 x) * w3 x)) or plain (w2(act(w1 x))),
    # with biases on its linears (`mlp_bias`); an o_proj bias; RMSNorm or LayerNorm (with a bias
    # when `norm_bias`), also after the embedding when `embedding_norm` (BLOOM's).
    attention_out_bias: bool = False
    activation: str = "silu"
    gated_mlp: bool = True
    mlp_bias: bool = False
    norm_type: str = "rmsnorm"
    norm_bias: bool = False
    embedding_norm: bool = False
    # Positions: "rope", "alibi" (linear biases on the attention scores, one slope a head:
    # `pipeline.core.model.alibi`; `alibi_bias_max` is the largest slope exponent, MPT's
    # `alibi_bias_max`, 8 in the ALiBi paper) or "none".
    position_embedding: str = "rope"
    alibi_bias_max: float = 8.0
    # MPT's clip_qkv: q, k and v are clamped to [-clip_qkv, clip_qkv] after their projections.
    clip_qkv: float | None = None
    # Every RMSNorm of the model scales by (1 + weight) (Qwen3-Next, Qwen3.5), weights stored
    # as Hugging Face stores them (zero-centred).
    norm_unit_offset: bool = False
    # Full attention multiplies its output by sigmoid(gate) before `wo`, the gate a second half
    # of each query head's rows in `wq` (Qwen3-Next, Qwen3.5).
    attention_output_gate: bool = False
    linear_attention: LinearAttentionConfig | None = None

    def __post_init__(self) -> None:
        if self.num_kv_heads is None:
            self.num_kv_heads = self.num_attention_heads
        if self.head_dim is None:
            if self.hidden_size % self.num_attention_heads:
                raise ValueError(
                    f"hidden_size {self.hidden_size} is not divisible by num_attention_heads "
                    f"{self.num_attention_heads}; set head_dim explicitly"
                )
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.num_attention_heads % self.num_kv_heads:
            raise ValueError(
                f"num_attention_heads {self.num_attention_heads} must be a multiple of "
                f"num_kv_heads {self.num_kv_heads}"
            )
        if self.qk_norm_scope not in ("head", "projection"):
            raise ValueError(f"qk_norm_scope {self.qk_norm_scope!r}: head or projection")
        if not 0.0 < self.partial_rotary_factor <= 1.0:
            raise ValueError(
                f"partial_rotary_factor {self.partial_rotary_factor} must be in (0, 1]"
            )
        if self.mla is None and self.rope_dim % 2:
            raise ValueError(
                f"partial_rotary_factor {self.partial_rotary_factor} rotates {self.rope_dim} of "
                f"head_dim {self.head_dim} dimensions; RoPE needs an even count"
            )
        if self.query_scale_beta and self.rope_scaling is None:
            raise ValueError(
                "query_scale_beta needs rope_scaling (its original_max_position_embeddings)"
            )
        if self.moe is not None:
            self._check_moe(self.moe)
        self._check_block_options()
        self._check_layer_types()

    def _check_layer_types(self) -> None:
        kinds = self.layer_types
        if kinds is not None:
            if len(kinds) != self.num_layers:
                raise ValueError(
                    f"layer_types has {len(kinds)} entries for {self.num_layers} layers"
                )
            unknown = sorted(set(kinds) - set(LAYER_TYPES))
            if unknown:
                raise ValueError(f"layer_types {unknown}: choose from {', '.join(LAYER_TYPES)}")
            if "sliding_attention" in kinds and not (self.sliding_window or 0) > 0:
                raise ValueError("sliding_attention layers need sliding_window >= 1")
            if "linear_attention" in kinds:
                self._check_linear_attention()
        outside = [i for i in self.no_rope_layers if not 0 <= i < self.num_layers]
        if outside:
            raise ValueError(f"no_rope_layers {outside} are not layers of {self.num_layers}")

    def _check_linear_attention(self) -> None:
        linear = self.linear_attention
        if linear is None:
            raise ValueError("layer_types names linear_attention but linear_attention is unset")
        if linear.num_value_heads % linear.num_key_heads:
            raise ValueError(
                f"linear_attention.num_value_heads {linear.num_value_heads} must be a "
                f"multiple of num_key_heads {linear.num_key_heads}"
            )

    def layer_type(self, layer: int) -> str:
        """The attention of layer `layer` (0-based): "full_attention" unless `layer_types`
        says otherwise."""
        if self.layer_types is None or layer >= len(self.layer_types):  # MTP modules: full
            return "full_attention"
        return self.layer_types[layer]

    def attention_window(self, layer: int) -> int | None:
        """The sliding window of layer `layer`, None for full attention."""
        return self.sliding_window if self.layer_type(layer) == "sliding_attention" else None

    def _check_block_options(self) -> None:
        if self.norm_type not in NORM_TYPES:
            raise ValueError(f"norm_type {self.norm_type!r}: one of {', '.join(NORM_TYPES)}")
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"activation {self.activation!r}: one of {', '.join(ACTIVATIONS)}")
        if self.position_embedding not in POSITION_EMBEDDINGS:
            raise ValueError(
                f"position_embedding {self.position_embedding!r}: one of "
                f"{', '.join(POSITION_EMBEDDINGS)}"
            )
        if self.position_embedding != "rope" and self.mla is not None:
            raise ValueError(
                f"position_embedding {self.position_embedding!r} with latent attention"
            )
        if self.clip_qkv is not None and self.clip_qkv <= 0:
            raise ValueError(f"clip_qkv must be positive, got {self.clip_qkv}")

    def _check_moe(self, moe: MoEConfig) -> None:
        if moe.top_k > moe.num_experts:
            raise ValueError(f"moe.top_k {moe.top_k} > moe.num_experts {moe.num_experts}")
        if moe.layer_step < 1:
            raise ValueError(f"moe.layer_step must be >= 1, got {moe.layer_step}")
        if moe.aux_loss_type not in ("micro_batch", "sequence"):
            raise ValueError(f"moe.aux_loss_type {moe.aux_loss_type!r}: micro_batch or sequence")
        if moe.score_function not in ("softmax", "sigmoid"):
            raise ValueError(f"moe.score_function {moe.score_function!r}: softmax or sigmoid")
        if moe.activation not in ("swiglu", "swiglu_clamped"):
            raise ValueError(f"moe.activation {moe.activation!r}: swiglu or swiglu_clamped")
        if moe.num_experts % moe.num_groups or not 1 <= moe.topk_groups <= moe.num_groups:
            raise ValueError(
                f"moe.num_groups {moe.num_groups} must divide num_experts {moe.num_experts} and "
                f"be at least moe.topk_groups {moe.topk_groups} (>= 1)"
            )
        outside = [i for i in moe.dense_layers if not 0 <= i < self.num_layers]
        if outside:
            raise ValueError(f"moe.dense_layers {outside} are not layers of {self.num_layers}")

    @property
    def attention_kind(self) -> str:
        """ "mla" (multi-head latent attention) or "gqa" (grouped-query attention)."""
        return "gqa" if self.mla is None else "mla"

    @property
    def rope_dim(self) -> int:
        """Dimensions of each head that RoPE rotates: the first int(head_dim *
        partial_rotary_factor); latent attention rotates only its decoupled part."""
        if self.mla is not None:
            return self.mla.qk_rope_head_dim
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def is_moe(self) -> bool:
        """Whether any layer is a mixture of experts (see `mlp_kind` for which)."""
        return self.moe is not None

    def mlp_kind(self, layer: int) -> str:
        """The MLP of layer `layer` (0-based): "moe" or "dense"."""
        moe = self.moe
        if moe is None or layer in moe.dense_layers or (layer + 1) % moe.layer_step:
            return "dense"
        return "moe"

    @property
    def num_moe_layers(self) -> int:
        return sum(self.mlp_kind(i) == "moe" for i in range(self.num_layers))

    @property
    def every_layer_moe(self) -> bool:
        """All layers are MoE (Mixtral's shape), so no dense MLP width is used."""
        return self.num_moe_layers == self.num_layers

    @property
    def expert_ffn_hidden_size(self) -> int:
        if self.moe is None or self.moe.ffn_hidden_size is None:
            return self.ffn_hidden_size
        return self.moe.ffn_hidden_size


def model_config_from_dict(values: dict[str, Any]) -> ModelConfig:
    """A `ModelConfig` from `dataclasses.asdict` output (as checkpoints record it)."""
    values = dict(values)
    if values.get("moe") is not None:
        values["moe"] = MoEConfig(**values["moe"])
    scaling = values.get("rope_scaling")
    if scaling is not None:
        kind = YarnScaling if scaling.get("rope_type") == "yarn" else RopeScaling
        values["rope_scaling"] = kind(**scaling)
    if values.get("mla") is not None:
        values["mla"] = MLAConfig(**values["mla"])
    if values.get("linear_attention") is not None:
        values["linear_attention"] = LinearAttentionConfig(**values["linear_attention"])
    return ModelConfig(**values)
