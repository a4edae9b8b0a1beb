"""What a run will cost before it starts: parameters, FLOPs and memory per device (`--dry-run`).

Parameter and FLOP counts come from `pipeline.core.model.flavors`; this module adds the count of
parameters active per token (MoE), the split of parameters across the parallel layout, and a
memory model. The memory model is an estimate, stated so it can be checked:

* Training state per trainable parameter, whatever the compute dtype: fp32 weights (4), fp32
  gradients (4) and the optimizer's state, as many bytes as its registry entry declares
  (`pipeline.train.optimizers.state_bytes_per_param`; AdamW's two fp32 moments: 8, so 16 in
  all; Muon's the mean of 4 on the hidden matrices and 8 on the rest, counted on the model
  built on `meta`; half of it under `optimizer.state_dtype = "bf16"`, none under
  `optimizer.cpu_offload`, which keeps it in host memory: the report says how much there). A LoRA
  run's frozen base holds its weights only (in `lora.base_dtype`); its adapters hold all three.
  With bf16 the forward/backward runs on bf16 copies gathered one block at a time by FSDP; those
  transient copies are not counted.
* Split: non-expert parameters over tp * pp, expert parameters over ep * pp (experts are whole
  on each tp rank: an expert tensor-parallel size of 1); then all of it sharded by FSDP over
  dp * cp (for experts, dp * cp / ep), as torchtitan's meshes do. Pipeline stages are assumed
  equal in size. `parallel.dp_mode = "replicate"` shards nothing; `"zero1"` shards the fp32
  weights, their gradients and the optimizer's state as FSDP does, and holds beside them whole
  compute copies of the weights (in the compute dtype: 2 bytes for bf16/fp16, else 4) and whole
  fp32 gradients, in which a step's micro-batches accumulate.
* Activations per layer per token, in the compute dtype, from what backward keeps (no dropout,
  SDPA/flash attention so no seq x seq scores): the two norm inputs and outputs (4h), q, k, v and
  the attention output (2q + 2kv), and per routed expert its input copy plus gate, up and their
  product (h + 3f; dense: 3f). Tensor + sequence parallel divide all of it by tp, context parallel
  divides the tokens by cp. Logits add tokens * vocab / tp * (dtype + 4 bytes for the fp32 loss).
* With full activation checkpointing each layer keeps only its input (h), plus one layer's full
  activations while it is recomputed. 1F1B pipelining keeps min(pp, micro batches) micro batches
  in flight on the first stage, i.e. about one micro batch through all layers.

`--gpu NAME` compares the total that matches `training.activation_checkpointing` (selective:
the no-checkpointing total, an upper bound) with the GPU's memory as torch reports it
(`total_memory`), and warns above `FIT_FRACTION` of it: the estimate leaves out the CUDA
context, communication buffers and fragmentation, which take the rest.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from pipeline.core.model.config import ModelConfig
from pipeline.core.model.flavors import expert_parameters, flops_per_token, num_parameters
from pipeline.core.parallel.layout_rules import canonical_dp_mode
from pipeline.train.config.schema import TrainConfig
from pipeline.train.objectives import OBJECTIVES
from pipeline.train.optimizers import (
    optimizer_spec,
    skips_on_device,
    state_bytes_per_param,
    state_description,
)

__all__ = [
    "FIT_FRACTION",
    "GPU_MEMORY_GIB",
    "MemoryEstimate",
    "ParamCounts",
    "dry_run_report",
    "estimate_memory",
    "gpu_fit_line",
    "gpu_memory_gib",
    "parameter_counts",
    "training_bytes_per_param",
]

_GIB = 1024**3
_WEIGHT_BYTES = 4  # fp32 weights of a trainable parameter (the master copy under bf16)
_GRAD_BYTES = 4  # fp32 gradients; the optimizer adds its state (`training_bytes_per_param`)

GPU_MEMORY_GIB = {
    "h100": 79.1,  # H100 80 GB (SXM and PCIe)
    "h200": 139.8,
    "a100-80gb": 79.2,
    "a100-40gb": 39.4,
    "l40s": 44.4,
    "b200": 178.4,
    "rtx4090": 23.6,
}
"""Usable GiB per GPU, as `torch.cuda.get_device_properties(0).total_memory` reports it."""

FIT_FRACTION = 0.9
"""Share of a GPU's memory the estimate may use; the rest goes to what it leaves out."""


@dataclass(frozen=True)
class ParamCounts:
    """Parameter counts of a model."""

    total: int
    """Every parameter, all experts included, tied embeddings counted once."""
    active: int
    """Parameters a single token passes through (top-k experts only; equals total when dense)."""
    expert: int
    """Parameters inside experts (0 when dense)."""
    embedding: int
    """Input embedding plus untied output layer."""


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes per device; see the module docstring for the assumptions."""

    params_per_device: float
    """Parameters held by one device after the tp/pp/ep split and FSDP sharding."""
    state: float
    """Weights + gradients + optimizer state (`training_bytes_per_param` per trainable one)."""
    activations_none: float
    """Activations of one micro batch without activation checkpointing."""
    activations_full: float
    """Activations of one micro batch with full activation checkpointing."""
    held: float = 0.0
    """What the objective keeps beside the training state (`ObjectiveSpec.held_bytes`)."""
    held_what: str = ""
    host_state: float = 0.0
    """Host memory of `optimizer.cpu_offload`: the optimizer state and torchao's pinned fp32
    copies of the trained weights and gradients (0 without offload)."""
    optimizer_state: float = 0.0
    """The optimizer's state on the device (part of `state`): what ZeRO shards over dp * cp."""

    @property
    def total_none(self) -> float:
        return self.state + self.held + self.activations_none

    @property
    def total_full(self) -> float:
        return self.state + self.held + self.activations_full


def parameter_counts(model: ModelConfig) -> ParamCounts:
    """Total, active-per-token, expert and embedding parameter counts."""
    total = num_parameters(model)
    h = model.hidden_size
    embedding = model.vocab_size * h * (1 if model.tie_word_embeddings else 2)
    if model.moe is None:
        return ParamCounts(total=total, active=total, expert=0, embedding=embedding)
    per_expert = expert_parameters(model)
    moe_layers = model.num_moe_layers  # Qwen3-MoE may keep some layers dense
    expert = moe_layers * model.moe.num_experts * per_expert
    inactive = moe_layers * (model.moe.num_experts - model.moe.top_k) * per_expert
    return ParamCounts(total=total, active=total - inactive, expert=expert, embedding=embedding)


def lora_parameters(cfg: TrainConfig, model: ModelConfig) -> int:
    """The trainable adapter parameters of a LoRA run (the model built on `meta`, adapted)."""
    import torch

    from pipeline.core.model.lora import apply_lora
    from pipeline.core.model.transformer import Transformer
    from pipeline.train.state.lora_run import lora_spec

    with torch.device("meta"):
        adapted = apply_lora(Transformer(model), lora_spec(cfg))
    return sum(p.numel() for p in adapted.parameters() if p.requires_grad)


def training_bytes_per_param(cfg: TrainConfig, model: ModelConfig | None = None) -> float:
    """Bytes a trainable parameter of `model` (unset: `cfg`'s) holds on the device: its fp32
    weight and gradient and the state of the optimizer `optimizer.name` chooses (its registry
    entry says how much, in the config's `state_dtype`; Muon's is a mean over the parameters;
    none under `cpu_offload`)."""
    return _WEIGHT_BYTES + _GRAD_BYTES + state_bytes_per_param(cfg, model)


def estimate_memory(
    cfg: TrainConfig, model: ModelConfig, world_size: int | None = None
) -> MemoryEstimate:
    """Per-device memory of `cfg`'s layout for `model` (see the module docstring)."""
    p = cfg.parallel
    dp = cfg.data_parallel_size(world_size)
    counts = parameter_counts(model)
    dense = counts.total - counts.expert
    mode = canonical_dp_mode(p.dp_mode)
    whole_local = dense / (p.tp * p.pp) + counts.expert / (p.ep * p.pp)
    dense_local = dense / (p.tp * p.pp) / (dp * p.cp)
    expert_local = counts.expert / (p.ep * p.pp) / max(dp * p.cp / p.ep, 1)
    params_local = whole_local if mode == "replicate" else dense_local + expert_local

    act_bytes = 2 if cfg.training.dtype in ("bf16", "fp16") else 4
    h = model.hidden_size
    q = model.num_attention_heads * model.head_dim
    kv = model.num_kv_heads * model.head_dim
    mlp = 3 * model.ffn_hidden_size
    if model.moe is not None:  # the mean over layers, dense and MoE
        moe_mlp = model.moe.top_k * (h + 3 * model.expert_ffn_hidden_size) + model.moe.num_experts
        moe_share = model.num_moe_layers / model.num_layers
        mlp = moe_share * moe_mlp + (1 - moe_share) * mlp
    mixer = 2 * q + 2 * kv
    if model.linear_attention is not None:  # the mean over layers, full and linear attention
        mixer = _mean_mixer_activations(model, mixer)
    per_token_layer = (4 * h + mixer + mlp) / p.tp
    tokens = cfg.training.micro_batch_size * _sequences(cfg) * cfg.data.seq_length / p.cp
    layers_local = math.ceil(model.num_layers / p.pp)
    micro_batches = cfg.training.global_batch_size // (cfg.training.micro_batch_size * dp)
    in_flight = min(p.pp, max(micro_batches, 1))
    logits = tokens * model.vocab_size / p.tp * (act_bytes + 4)

    per_layer = per_token_layer * tokens * act_bytes
    none = layers_local * per_layer * in_flight + logits
    full = layers_local * (h / p.tp) * tokens * act_bytes * in_flight + per_layer + logits
    trained_bytes = training_bytes_per_param(cfg, model)
    trained, state = params_local, 0.0
    if cfg.lora.enabled:  # a frozen base: weights only; adapters get grads and optimizer state
        base_bytes = 2 if cfg.lora.base_dtype == "bf16" else 4
        trained = lora_parameters(cfg, model) * params_local / max(counts.total, 1)
        state = params_local * base_bytes
    if mode == "zero1":  # whole compute weights and fp32 gradients beside the shards
        trained_whole = trained * whole_local / max(params_local, 1e-30)
        state += whole_local * act_bytes + trained_whole * _GRAD_BYTES
    host = 0.0
    if cfg.optimizer.cpu_offload:
        host = trained * (
            _WEIGHT_BYTES + _GRAD_BYTES + state_bytes_per_param(cfg, model, resident=False)
        )
    held, held_what = _objective_held(cfg, model, dp)
    return MemoryEstimate(
        params_per_device=params_local,
        state=state + trained * trained_bytes,
        activations_none=none,
        activations_full=full,
        held=held,
        held_what=held_what,
        host_state=host,
        optimizer_state=trained * state_bytes_per_param(cfg, model),
    )


# The chunked delta rule's chunk (`pipeline.core.kernels.gated_delta.CHUNK_SIZE`; torch-free here).
DELTA_RULE_CHUNK = 64


def _mean_mixer_activations(model: ModelConfig, attention: float) -> float:
    """Per-token activations of the token mixer, averaged over the layers: `attention` for full
    attention; for gated DeltaNet its projections (q/k/v before and after the conv, z, b, a),
    its output, and the state kept at each chunk's end (one per 64 tokens, fp32 counted as
    two values) instead of keys and values."""
    s = model.linear_attention
    state = 2 * s.num_value_heads * s.key_head_dim * s.value_head_dim / DELTA_RULE_CHUNK
    linear = 2 * s.conv_dim + 2 * s.value_dim + 2 * s.num_value_heads + state
    kinds = [model.layer_type(i) for i in range(model.num_layers)]
    share = kinds.count("linear_attention") / len(kinds)
    return share * linear + (1 - share) * attention


def _objective_held(cfg: TrainConfig, model: ModelConfig, dp: int) -> tuple[float, str]:
    """(bytes, what) the run's objective keeps on a device beside the training state."""
    spec = OBJECTIVES.get(cfg.data.kind)
    if spec is None or spec.held_bytes is None:
        return 0.0, ""
    return spec.held_bytes(cfg, model, dp)


def gpu_memory_gib(name: str) -> float:
    """Usable GiB of the GPU called `name` (any case); ValueError naming the known GPUs."""
    try:
        return GPU_MEMORY_GIB[name.lower()]
    except KeyError:
        known = ", ".join(GPU_MEMORY_GIB)
        raise ValueError(f"unknown GPU {name!r}; known: {known}") from None


def gpu_fit_line(cfg: TrainConfig, mem: MemoryEstimate, gpu: str) -> str:
    """`fits on GPU ...` or `WARNING: ... will not fit on GPU ...; try ...` for the total that
    matches the run's activation checkpointing (selective counts as none: an upper bound)."""
    name = gpu.lower()
    available = gpu_memory_gib(name)
    mode = cfg.training.activation_checkpointing
    needed = (mem.total_full if mode == "full" else mem.total_none) / _GIB
    share = needed / available
    if share <= FIT_FRACTION:
        return (
            f"gpu          fits on {name}: {needed:.2f} GiB of {available:.2f} GiB "
            f"({share:.0%}, activation checkpointing {mode})"
        )
    return (
        f"gpu          WARNING: this layout will not fit on {name} ({needed:.2f} GiB needed, "
        f"{available:.2f} GiB available, activation checkpointing {mode}; the limit is "
        f"{FIT_FRACTION:.0%}); try {', '.join(_fit_suggestions(cfg, mem))}"
    )


def _fit_suggestions(cfg: TrainConfig, mem: MemoryEstimate) -> list[str]:
    """What would shrink the per-device total, most effective first for this run."""
    tips = []
    if cfg.training.activation_checkpointing != "full":
        tips.append(
            f"activation checkpointing full (--set training.activation_checkpointing=full: "
            f"{mem.total_full / _GIB:.2f} GiB)"
        )
    tips.append("more tensor/pipeline parallelism (--tp, --pp)")
    tips.append("more data-parallel devices (FSDP shards the training state over dp)")
    if cfg.training.micro_batch_size > 1:
        tips.append("a smaller micro batch (--micro-batch-size)")
    return tips


def _block(model: ModelConfig) -> str:
    """`, ALiBi, LayerNorm, gelu MLP` for a block other than Llama's (BLOOM, MPT), else ""."""
    parts = []
    if model.position_embedding != "rope":
        parts.append("ALiBi" if model.position_embedding == "alibi" else "no positions")
    if model.norm_type != "rmsnorm":
        parts.append("LayerNorm")
    if not model.gated_mlp or model.activation != "silu":
        parts.append(f"{model.activation}{'' if model.gated_mlp else ' plain'} MLP")
    return "".join(f", {part}" for part in parts)


def _attention_description(model: ModelConfig) -> str:
    """`32/8 kv, head_dim 128[, q/k/v bias][, q/k norm][, rope 64 of 128]`, or latent
    attention's ranks and head widths."""
    heads = model.num_attention_heads
    mla = model.mla
    if mla is None:
        bias = ", q/k/v bias" if model.qkv_bias else ""
        norm = ", q/k norm" if model.qk_norm else ""
        if model.qk_norm and model.qk_norm_scope == "projection":
            norm = ", q/k norm over the projection"
        partial = model.rope_dim < model.head_dim
        rope = f", rope {model.rope_dim} of {model.head_dim}" if partial else ""
        described = f"{bias}{norm}{rope}{_block(model)}"
        return f"{heads}/{model.num_kv_heads} kv, head_dim {model.head_dim}{described}"
    q = "q full rank" if mla.q_lora_rank is None else f"q rank {mla.q_lora_rank}"
    return (
        f"{heads} latent (kv rank {mla.kv_lora_rank}, {q}, qk {mla.qk_nope_head_dim}"
        f"+{mla.qk_rope_head_dim} rope, v {mla.v_head_dim})"
    )


def dry_run_report(
    cfg: TrainConfig, world_size: int | None = None, gpu: str | None = None
) -> list[str]:
    """Human-readable lines describing the resolved run and what it will cost; with `gpu`, a
    last line saying whether the per-device memory fits that GPU."""
    model = cfg.model_config()
    mem = estimate_memory(cfg, model, world_size)
    lines = [
        _model_line(cfg, model),
        _data_line(cfg),
        *_layout_lines(cfg, world_size),
        _optimizer_line(cfg, model),
        _numerics_line(cfg),
        *_parameter_lines(cfg, model),
        *_flop_lines(cfg, model),
        *_memory_lines(cfg, model, mem),
    ]
    if gpu is not None:
        lines.append(gpu_fit_line(cfg, mem, gpu))
    return lines


def _model_line(cfg: TrainConfig, model: ModelConfig) -> str:
    """`model ...`: the flavor's shape, its attention and, for a MoE, its experts."""
    moe = ""
    if model.moe is not None:
        moe = (
            f", MoE {model.moe.num_experts} experts top-{model.moe.top_k} (ffn "
            f"{model.expert_ffn_hidden_size}) in {model.num_moe_layers}/{model.num_layers} layers"
        )
    return (
        f"model        {cfg.model.flavor}: {model.num_layers} layers, hidden {model.hidden_size}, "
        f"heads {_attention_description(model)}{_attention_options(model)}, "
        f"ffn {model.ffn_hidden_size}, "
        f"vocab {model.vocab_size}{moe}"
    )


def _attention_options(model: ModelConfig) -> str:
    """Sliding windows, sinks, layers without RoPE and linear attention, when the model has
    them."""
    parts = []
    windowed = sum(model.attention_window(i) is not None for i in range(model.num_layers))
    if windowed:
        parts.append(f"window {model.sliding_window} in {windowed}/{model.num_layers} layers")
    if model.attention_sinks:
        parts.append("sinks")
    if model.no_rope_layers:
        parts.append(f"no RoPE in {len(model.no_rope_layers)} layers")
    s = model.linear_attention
    if s is not None:
        count = sum(model.layer_type(i) == "linear_attention" for i in range(model.num_layers))
        parts.append(
            f"linear attention in {count}/{model.num_layers} layers ({s.num_key_heads}/"
            f"{s.num_value_heads} heads of {s.key_head_dim}/{s.value_head_dim})"
        )
    return "".join(f", {p}" for p in parts)


def _data_line(cfg: TrainConfig) -> str:
    """`data ...`: where the tokens come from, and what the objective adds (SFT: how
    conversations are packed)."""
    d = cfg.data
    data = "mock (synthetic tokens)" if d.mock else (d.blend or d.train_blend or "-")
    spec = OBJECTIVES.get(d.kind)
    if spec is not None and spec.data_line is not None:
        data += spec.data_line(cfg)
    return f"data         {data}; seq {d.seq_length}, split {d.split}"


def _layout_lines(cfg: TrainConfig, world_size: int | None) -> list[str]:
    """`layout`, `batch` and `schedule`: the parallel degrees, how a global batch is made, and
    the iterations and learning rates."""
    t, p, o, s = cfg.training, cfg.parallel, cfg.optimizer, cfg.scheduler
    dp = cfg.data_parallel_size(world_size)
    dp_note = " (inferred)" if p.dp == -1 and world_size is not None else ""
    if p.dp == -1 and world_size is None:
        dp_note = " (dp=-1 with no world size: assuming 1)"
    accumulation = t.global_batch_size // (t.micro_batch_size * dp)
    tokens_per_step = _tokens_per_step(cfg)
    return [
        f"layout       tp {p.tp} pp {p.pp} cp {p.cp} ep {p.ep} dp {dp}{dp_note} "
        f"= {p.tp * p.pp * p.cp * dp} devices",
        f"batch        micro {t.micro_batch_size} x accumulation {accumulation} x dp {dp} "
        f"= global {t.global_batch_size} samples = {tokens_per_step:,} tokens/step",
        f"schedule     {t.iters:,} iters ({t.iters * tokens_per_step:,} tokens); lr {o.lr:g} "
        f"-> {o.min_lr:g}, warmup {s.warmup_iters}, {s.decay_style} until {cfg.decay_iters:,}",
    ]


def _optimizer_line(cfg: TrainConfig, model: ModelConfig) -> str:
    """`optimizer ...`: the registry entry `optimizer.name` chooses, its state bytes and where
    it skips a non-finite step."""
    spec = optimizer_spec(cfg.optimizer.name)
    where = "on the device" if skips_on_device(cfg) else "after a host check (one sync a step)"
    return (
        f"optimizer    {spec.name}: {state_description(cfg)}, "
        f"{state_bytes_per_param(cfg, model, resident=False):.3g} B/param of state; a non-finite "
        f"step is skipped {where}"
    )


def _numerics_line(cfg: TrainConfig) -> str:
    """`numerics ...`: dtype, device, activation checkpointing, compile and FP8."""
    t = cfg.training
    return (
        f"numerics     {t.dtype}{_loss_scale_note(cfg)} on {t.device}, activation checkpointing "
        f"{t.activation_checkpointing}, compile {'auto' if t.compile is None else t.compile}, "
        f"fp8 {cfg.fp8.recipe or 'off'}"
    )


def _loss_scale_note(cfg: TrainConfig) -> str:
    """fp16's loss scale, as `training` sets it (nothing for another dtype)."""
    t = cfg.training
    if t.dtype != "fp16":
        return ""
    if t.loss_scale is not None:
        return f" (loss scale {t.loss_scale:g})"
    return (
        f" (loss scale dynamic from {t.initial_loss_scale:g}, min {t.min_loss_scale:g}, "
        f"window {t.loss_scale_window}, hysteresis {t.hysteresis})"
    )


def _parameter_lines(cfg: TrainConfig, model: ModelConfig) -> list[str]:
    """`parameters ...`: the total, the active share of a MoE, LoRA's trainable adapters."""
    counts = parameter_counts(model)
    lines = [f"parameters   {counts.total:,} total ({_count(counts.total)})"]
    if model.moe is not None:
        lines.append(f"             {counts.active:,} active per token ({_count(counts.active)})")
    if cfg.lora.enabled:
        lo = cfg.lora
        trainable = lora_parameters(cfg, model)
        lines.append(
            f"LoRA         {trainable:,} trainable ({_count(trainable)}, "
            f"{100 * trainable / counts.total:.2f}% of the model): rank {lo.rank}, alpha "
            f"{lo.alpha:g}, targets {', '.join(lo.targets)}; base frozen in "
            f"{lo.base_dtype or 'fp32'}: no gradients, no optimizer state"
        )
    return lines


def _flop_lines(cfg: TrainConfig, model: ModelConfig) -> list[str]:
    """`FLOPs ...`: per token, per step and for the whole run."""
    fpt = flops_per_token(model, cfg.data.seq_length)
    per_step = fpt * _tokens_per_step(cfg)
    return [
        f"FLOPs        {_si(fpt)}FLOP/token (Megatron's num_floating_point_operations, "
        "causal attention, forward + backward)",
        f"             {_si(per_step)}FLOP/step, "
        f"{per_step * cfg.training.iters:.3g} FLOP for the run",
    ]


def _memory_lines(cfg: TrainConfig, model: ModelConfig, mem: MemoryEstimate) -> list[str]:
    """`memory/dev ...`: the training state (what it holds per parameter), activations and
    the totals with and without activation checkpointing."""
    name = cfg.optimizer.name
    state = state_bytes_per_param(cfg, model)
    per_param = f"{_WEIGHT_BYTES} + {_GRAD_BYTES} + {state:.3g} B/param"
    if cfg.lora.enabled:
        held = f"frozen weights + adapters' weights, grads, {name} state ({per_param}) "
    else:
        held = f"weights + grads + {name} state ({per_param}) "
    objective = [f"             {mem.held_what}: {mem.held / _GIB:.2f} GiB"] if mem.held else []
    host = []
    if cfg.optimizer.cpu_offload:
        offloaded = state_bytes_per_param(cfg, model, resident=False)
        host = [
            f"             host memory: {mem.host_state / _GIB:.2f} GiB pinned, the optimizer "
            f"state ({offloaded:.3g} B/param) and fp32 copies of weights and gradients "
            "(4 + 4); none of the state on the GPU"
        ]
    return [
        f"memory/dev   {_count(mem.params_per_device)} params -> {held}{mem.state / _GIB:.2f} GiB",
        *_data_parallel_mode_line(cfg, mem),
        *objective,
        *host,
        f"             activations per micro batch: {mem.activations_none / _GIB:.2f} GiB "
        f"without checkpointing, {mem.activations_full / _GIB:.2f} GiB with full",
        f"             total ~ {mem.total_none / _GIB:.2f} GiB (none) / "
        f"{mem.total_full / _GIB:.2f} GiB (full); excludes framework, buffers and "
        "fragmentation",
    ]


def _data_parallel_mode_line(cfg: TrainConfig, mem: MemoryEstimate) -> list[str]:
    """What `parallel.dp_mode` holds per device, unless it is FSDP's (every part sharded)."""
    mode = canonical_dp_mode(cfg.parallel.dp_mode)
    state = f"{mem.optimizer_state / _GIB:.2f} GiB of optimizer state"
    if mode == "zero1":
        return [
            f"             dp_mode zero1: {state} and the fp32 weights and grads sharded over "
            "dp * cp, plus whole compute weights and fp32 grads"
        ]
    if mode == "replicate":
        return [f"             dp_mode replicate: nothing sharded ({state})"]
    return []


def _tokens_per_step(cfg: TrainConfig) -> int:
    """Tokens in one global batch (every sequence of a sample: DPO's two sides, GRPO's
    completions)."""
    return cfg.training.global_batch_size * _sequences(cfg) * cfg.data.seq_length


def _sequences(cfg: TrainConfig) -> int:
    """The sequences one sample of the run's objective holds."""
    spec = OBJECTIVES.get(cfg.data.kind)
    return spec.sequences(cfg) if spec is not None else 1


def _si(value: float) -> str:
    """`8.03 B`, `2.84 M`, `51.5 G`: three significant digits and a decimal prefix."""
    for factor, prefix in ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "K")):
        if abs(value) >= factor:
            return f"{value / factor:.3g} {prefix}"
    return f"{value:.3g} "


def _count(value: float) -> str:
    """Parameter counts the way model cards write them: `8.03 B`, `2.84 M`."""
    for factor, suffix in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if abs(value) >= factor:
            return f"{value / factor:.2f} {suffix}"
    return f"{value:.0f}"
