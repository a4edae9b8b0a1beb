"""The training configuration: one dataclass per section, a docstring per field.

A run is described by `TrainConfig`, whose sections (`model`, `data`, `training`, `optimizer`,
`scheduler`, `checkpoint`, `parallel`, `fp8`, `logging`) map one to one onto the tables of a recipe
TOML file and onto the `section.key` names that `--set` accepts. Values are layered
defaults < recipe < `--set` < first-class CLI flags by `pipeline.train.config.loader`; this module
only holds the schema and its typed setter. A field with a fixed set of values is a `Literal`,
checked by the setter (`pipeline.train.config.fields`); the cross-field checks are in
`pipeline.train.config.checks` and the model overrides in `pipeline.train.config.model_overrides`.

The config reads no file. A run that takes its model from a checkpoint (`model.flavor =
"checkpoint"`) finds it in `recorded_model`, which the config loader reads once.

`None` means "not set" everywhere: every field that may be `None` defaults to `None`, so dropping
`None` values when writing TOML (which has no null) loses nothing on reload.
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from pipeline.core.model.config import ModelConfig
from pipeline.train.config.checks import config_problems, raise_problems
from pipeline.train.config.fields import ConfigError, coerce, field_types
from pipeline.train.config.model_overrides import apply_model_overrides, lookup_flavor

__all__ = [
    "CHECKPOINT_FLAVOR",
    "CheckpointSection",
    "ConfigError",
    "DataSection",
    "Fp8Section",
    "LoggingSection",
    "LoraSection",
    "ModelSection",
    "EvalSection",
    "OptimizerSection",
    "ParallelSection",
    "RecordedModel",
    "SchedulerSection",
    "TrainConfig",
    "TrainingSection",
]


# `model.flavor` of a run that trains the model its loaded checkpoint records.
CHECKPOINT_FLAVOR = "checkpoint"


@dataclass
class ModelSection:
    """Which model to train: a named flavor, plus optional overrides of its fields.

    Every override left at `None` keeps the flavor's value. Changing `hidden_size` or
    `num_attention_heads` re-derives `head_dim` (and `num_kv_heads` for multi-head flavors) unless
    those are overridden too.
    """

    flavor: str = "tiny"
    """Name of a model flavor in `pipeline.core.model.flavors` (e.g. llama3_8b, tiny_moe), or
    `checkpoint`: the model recorded by the checkpoint `checkpoint.load` resumes from."""
    vocab_size: int | None = None
    """Vocabulary size (rows of the embedding and output layers)."""
    hidden_size: int | None = None
    """Model width."""
    num_layers: int | None = None
    """Number of transformer blocks."""
    num_attention_heads: int | None = None
    """Number of query heads."""
    num_kv_heads: int | None = None
    """Number of key/value heads (grouped-query attention)."""
    head_dim: int | None = None
    """Width of one attention head."""
    ffn_hidden_size: int | None = None
    """Hidden width of the SwiGLU MLP."""
    norm_eps: float | None = None
    """RMSNorm epsilon."""
    rope_theta: float | None = None
    """RoPE base frequency."""
    max_position_embeddings: int | None = None
    """Longest sequence the position encoding is configured for."""
    tie_word_embeddings: bool | None = None
    """Share the input embedding with the output layer."""
    qkv_bias: bool | None = None
    """Add biases to the query/key/value projections (Qwen2)."""
    qk_norm: bool | None = None
    """Per-head RMSNorm on queries and keys before RoPE (Qwen3)."""
    partial_rotary_factor: float | None = None
    """Share of each q/k head RoPE rotates, the first dimensions (GLM-4.5: 0.5); 1: all."""
    qk_norm_scope: str | None = None
    """What each q/k norm spans: `head` (Qwen3) or `projection` (all heads at once, MiniMax-M2)."""
    query_scale_beta: float | None = None
    """Llama 4's / Mistral 4's long-context query scale (`llama_4_scaling_beta`); 0: off."""
    init_method_std: float | None = None
    """Standard deviation of the normal weight initialisation."""
    use_scaled_init: bool | None = None
    """Scale output-projection init by 1/sqrt(2 * num_layers) (Megatron)."""
    mtp_num_layers: int | None = None
    """Multi-token prediction modules (DeepSeek-V3's num_nextn_predict_layers); 0: none."""
    mtp_loss_scaling_factor: float | None = None
    """Weight of the multi-token prediction loss, shared by its modules."""
    num_experts: int | None = None
    """Experts per MoE layer; 0 turns a MoE flavor dense, >0 makes a dense flavor MoE."""
    moe_top_k: int | None = None
    """Experts each token is routed to."""
    moe_ffn_hidden_size: int | None = None
    """Hidden width of one expert's MLP."""
    moe_aux_loss_coeff: float | None = None
    """Weight of the load-balancing auxiliary loss."""
    moe_aux_loss_type: str | None = None
    """Balance loss per micro-batch (`micro_batch`) or per sequence (`sequence`, DeepSeek-V3)."""
    moe_z_loss_coeff: float | None = None
    """Weight of the router z-loss."""
    moe_capacity_factor: float | None = None
    """Expert capacity factor (tokens over capacity are dropped); unset keeps the flavor's."""
    moe_norm_topk_prob: bool | None = None
    """Renormalise the k chosen router probabilities to sum to 1 (Mixtral; Qwen3-MoE option)."""
    moe_layer_step: int | None = None
    """Layer i is MoE when (i + 1) is a multiple of this (HF `decoder_sparse_step`)."""
    moe_dense_layers: list[int] | None = None
    """Layers kept dense in a MoE model (HF `mlp_only_layers`), 0-based."""


@dataclass
class DataSection:
    """Where training tokens come from and how samples are cut from them."""

    blend: str | None = None
    """Megatron `--data-path` blend: "PREFIX" or "W1 PREFIX1 W2 PREFIX2 ...", split by `split`."""
    train_blend: str | None = None
    """Blend used only for training (Megatron `--train-data-path`); excludes `blend`."""
    valid_blend: str | None = None
    """Blend used only for validation (Megatron `--valid-data-path`)."""
    test_blend: str | None = None
    """Blend used only for testing (Megatron `--test-data-path`)."""
    split: str = "969,30,1"
    """Train/valid/test proportions of each dataset in `blend` (Megatron `--split`)."""
    seq_length: int = 2048
    """Tokens per training sample."""
    mock: bool = False
    """Train on synthetic tokens (Megatron `--mock-data`); excludes real blends."""
    tokenizer: str | None = None
    """Tokenizer directory or file, recorded in checkpoints and used to check the vocabulary."""
    num_workers: int = 2
    """DataLoader worker processes per rank."""
    add_extra_token_to_sequence: bool = True
    """Read seq_length + 1 tokens per sample so inputs and labels are both seq_length long."""
    reset_position_ids: bool = False
    """Restart position ids after each end-of-document token."""
    reset_attention_mask: bool = False
    """Stop attention across end-of-document tokens."""
    eod_mask_loss: bool = False
    """Exclude end-of-document tokens from the loss."""
    data_cache_path: str | None = None
    """Directory for the cached sample/shuffle indices (default: beside the data)."""
    kind: str = "gpt"
    """The training objective, one of `pipeline.train.objectives.OBJECTIVES` (`pipe train
    --objective NAME`). gpt: pre-training samples cut from the token stream. sft (`pipe train
    --sft`): chat datasets (`pipe preprocess --chat`, prefixes `*_messages_document` with their
    loss mask), whole conversations packed per sample, each attending only to itself, and the
    loss on assistant tokens only; the reset and EOD flags above do not apply. dpo (`pipe train
    --dpo`): preference pairs (`pipe preprocess --preference`, the output prefix), a sample
    being one pair, trained with the `[dpo]` loss. grpo (`pipe train --grpo`): prompts, their
    completions generated by the policy, trained with the `[grpo]` loss."""
    sft_truncate: bool = False
    """With kind = sft: cut a conversation longer than seq_length to its first seq_length
    tokens (default: drop it; either way the count is logged)."""


@dataclass
class TrainingSection:
    """Length of the run, batch geometry, numerics and device."""

    iters: int = 1000
    """Optimizer steps to train for."""
    micro_batch_size: int = 1
    """Samples per forward/backward pass on one data-parallel rank."""
    global_batch_size: int = 8
    """Samples per optimizer step over all data-parallel ranks (accumulation fills the rest)."""
    seed: int = 1234
    """Seed for weights, data order and dropout (Megatron's default)."""
    eval_interval: int = 1000
    """Validate every this many iterations (0: never)."""
    eval_iters: int = 100
    """Validation batches per evaluation."""
    skip_train: bool = False
    """Evaluate the loaded weights once and exit, without training or saving (Megatron's
    `--skip-train`): the figures of a checkpoint, a start to compare a run with."""
    sample_prompts: list[str] = field(default_factory=list)
    """Prompts the model continues (greedy) every `sample_interval` iterations, logged as text
    to metrics.jsonl, TensorBoard and W&B (needs the data's tokenizer)."""
    sample_interval: int = 0
    """Generate from `sample_prompts` every this many iterations (0: never)."""
    sample_tokens: int = 32
    """Tokens generated per sample prompt."""
    log_interval: int = 10
    """Log metrics every this many iterations."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """auto (CUDA when available), cpu or cuda."""
    dtype: Literal["bf16", "fp16", "fp32"] = "bf16"
    """Compute dtype: bf16 or fp16 (fp32 master weights and optimizer state; fp16 with loss
    scaling, Megatron's `--fp16`) or fp32."""
    loss_scale: float | None = None
    """fp16: a constant loss scale (Megatron's `--loss-scale`); unset: the dynamic scale below."""
    initial_loss_scale: float = 2.0**32
    """fp16, dynamic scale: where it starts (Megatron's `--initial-loss-scale`)."""
    min_loss_scale: float = 1.0
    """fp16, dynamic scale: the floor it never backs off below (`--min-loss-scale`)."""
    loss_scale_window: int = 1000
    """fp16, dynamic scale: finite steps in a row after which it doubles (`--loss-scale-window`)."""
    hysteresis: int = 2
    """fp16, dynamic scale: overflowing steps in a row before it halves (`--hysteresis`)."""
    activation_checkpointing: Literal["none", "full", "selective"] = "none"
    """Recompute activations in backward: none, full (every block) or selective."""
    compile: bool | None = None
    """torch.compile each transformer block; unset: on for CUDA runs, off on a CPU (false turns
    it off on a GPU too)."""
    attention_backend: Literal["auto", "sdpa", "flex", "flash_attn"] = "auto"
    """auto (this GPU's measured choice for the shape, else: flex with document masking on
    CUDA, flash-attn when installed, sdpa), sdpa, flex (CUDA) or flash_attn."""


@dataclass
class OptimizerSection:
    """Which optimizer, its hyper-parameters, and gradient clipping."""

    name: str = "adamw"
    """An optimizer of the registry (`pipeline.train.optimizers.OPTIMIZERS`): adamw, muon
    (Muon for the hidden matrices, AdamW for embeddings, output layer, norms, biases, router)."""
    lr: float = 3e-4
    """Peak learning rate (reached at the end of warmup)."""
    min_lr: float = 3e-5
    """Learning rate at the end of decay and after it."""
    weight_decay: float = 0.1
    """Decoupled weight decay, applied to >=2-D weights only."""
    beta1: float = 0.9
    """Adam beta1."""
    beta2: float = 0.95
    """Adam beta2."""
    eps: float = 1e-8
    """Adam epsilon."""
    clip_grad: float = 1.0
    """Clip the global gradient norm to this value (0: no clipping)."""
    muon_momentum: float = 0.95
    """Muon: momentum of its buffer (Megatron `--muon-momentum`, torch `momentum`)."""
    muon_use_nesterov: bool = True
    """Muon: Nesterov momentum (Megatron `--muon-use-nesterov`, torch `nesterov`; torch's
    default True, Megatron's False)."""
    muon_num_ns_steps: int = 5
    """Muon: Newton-Schulz iterations (Megatron `--muon-num-ns-steps`, torch `ns_steps`)."""
    muon_ns_coefficients: list[float] = field(default_factory=lambda: [3.4445, -4.7750, 2.0315])
    """Muon: the quintic Newton-Schulz coefficients a, b, c (torch `ns_coefficients`; Keller
    Jordan's by default)."""
    muon_ns_dtype: Literal["bf16", "fp32"] = "bf16"
    """Muon: the dtype Newton-Schulz computes in (bf16 as torch.optim.Muon; fp32 makes every
    parallel layout equal one device to fp32 rounding)."""
    muon_adjust_lr_fn: Literal["match_rms_adamw", "original"] = "match_rms_adamw"
    """Muon: the learning rate of an m x n matrix, torch's `adjust_lr_fn`: match_rms_adamw
    (Moonlight, lr * 0.2 * sqrt(max(m, n)): AdamW's lr and weight decay carry over) or
    original (Keller Jordan, lr * sqrt(max(1, m / n)))."""
    muon_tp_mode: Literal["duplicated", "distributed", "blockwise"] = "duplicated"
    """Muon under tensor parallelism (Megatron `--muon-tp-mode`): duplicated (gather each
    matrix, orthogonalise on every rank) or distributed (keep the shards, all-reduce the Gram
    matrices), both one device's update; blockwise orthogonalises each shard alone, which
    CHANGES the update (another optimizer than one device's Muon), for less communication."""
    state_dtype: Literal["fp32", "bf16"] = "fp32"
    """The optimizer's moments: fp32, or bf16 for half the state bytes (Megatron's
    `--use-precision-aware-optimizer --exp-avg-dtype bf16 --exp-avg-sq-dtype bf16`); weights
    stay fp32."""
    cpu_offload: bool = False
    """Keep the optimizer's state and step in host memory (Megatron's `--optimizer-cpu-offload`,
    torchao's CPUOffloadOptimizer): one-GPU runs only."""


@dataclass
class SchedulerSection:
    """Learning-rate schedule, following Megatron's `OptimizerParamScheduler`."""

    warmup_iters: int = 0
    """Iterations of linear warmup from `warmup_init_lr` to `optimizer.lr`."""
    warmup_init_lr: float = 0.0
    """Learning rate at step 0 (Megatron `--lr-warmup-init`)."""
    decay_style: Literal["cosine", "linear", "wsd", "constant"] = "cosine"
    """cosine, linear, wsd (warmup-stable-decay) or constant."""
    decay_iters: int | None = None
    """Step at which decay reaches `optimizer.min_lr` (unset: `training.iters`)."""
    wsd_decay_iters: int | None = None
    """For wsd: length of the final decay phase, which ends at `decay_iters`."""
    wsd_decay_style: Literal["linear", "cosine", "exponential", "minus_sqrt"] = "linear"
    """For wsd: shape of the final decay (linear, cosine, exponential, minus_sqrt)."""


@dataclass
class CheckpointSection:
    """Saving and loading checkpoints."""

    enable: bool = True
    """Save checkpoints (false: nothing is saved, not at the end, not on a stop signal; for
    benchmarks and smoke runs, as torchtitan's `checkpoint.enable` or Megatron without --save)."""
    save: str | None = None
    """Directory to save checkpoints to (unset: `<run_dir>/checkpoints`)."""
    load: str | None = None
    """Checkpoint directory to resume or start from, or a Hugging Face model directory to start
    from (its config.json gives the model unless a recipe names one; iteration 0)."""
    save_interval: int = 1000
    """Save every this many iterations (0: only at the end)."""
    keep_last: int = 0
    """Keep only the newest this many checkpoints (0: keep all)."""
    finetune: bool = False
    """Load weights only: reset iteration, optimizer, scheduler and data position."""
    async_save: bool = False
    """Write checkpoints in the background while training continues."""
    verify_checksums: bool = True
    """Check every checkpoint file read against the SHA-256 its checkpoint records."""
    save_hf: Literal["off", "final", "every"] = "off"
    """Also write a Hugging Face directory, `<save>/hf/iter_XXXXXXX`: at the end of the run
    (final) or with every checkpoint (every)."""
    save_hf_dtype: Literal["auto", "bfloat16", "float16", "float32"] = "auto"
    """dtype of the Hugging Face weights; auto: the dtype of the Hugging Face model the run
    started from, else bfloat16."""


@dataclass
class ParallelSection:
    """Parallel layout (degrees multiply to the world size; dp=-1 takes what is left)."""

    tp: int = 1
    """Tensor (and sequence) parallel degree."""
    pp: int = 1
    """Pipeline parallel degree."""
    cp: int = 1
    """Context parallel degree (splits the sequence)."""
    ep: int = 1
    """Expert parallel degree (MoE only)."""
    dp: int = -1
    """Data parallel (FSDP) degree; -1: world_size / (tp * pp * cp)."""
    sequence_parallel: bool = True
    """With tp > 1: shard norms and the residual stream on the sequence (Megatron's SP)."""
    pipeline_schedule: str = "1F1B"
    """With pp > 1: a torch.distributed.pipelining schedule: 1F1B, GPipe (one stage per rank),
    Interleaved1F1B, InterleavedZeroBubble, ZBVZeroBubble (two virtual stages per rank)."""
    first_stage_layers: int | None = None
    """Layers on the first pipeline stage (it also holds the embedding); unset: balanced."""
    last_stage_layers: int | None = None
    """Layers on the last pipeline stage (it also holds the output layer and the loss)."""
    dp_mode: str = "fsdp"
    """fsdp: FSDP2 sharding over dp * cp; replicate: DDP-style replication (dp only); zero1
    (or Megatron's `distributed_optimizer`): parameters whole on every rank, fp32 master
    weights, gradients and optimizer state sharded over dp * cp, one reduce-scatter and one
    all-gather a step."""
    reshard_after_forward: bool = True
    """FSDP: free gathered weights after forward (ZeRO-3); false keeps them to backward (ZeRO-2).
    zero1 keeps them whole between steps whatever this says."""


@dataclass
class Fp8Section:
    """FP8 training of the block linears (the output layer, routers and small GEMMs keep bf16)."""

    recipe: str | None = None
    """backend:scaling, one of torchao:tensorwise, torchao:rowwise, te:delayed, te:current
    (`--fp8 torchao|te` picks the backend's first); unset: no FP8."""
    linear_filter: Literal["auto", "all"] = "auto"
    """auto: small GEMMs stay bf16 by torchao's H100-measured size thresholds; all: convert every
    block linear whose dims are multiples of 16."""
    fsdp_float8_all_gather: bool = True
    """torchao:tensorwise under FSDP2: all-gather the weights in fp8 (half the bytes)."""
    emulate: bool = False
    """torchao only, on a CPU: real fp8 casts and scales with emulated matmuls, to learn or check
    FP8 training without a GPU. Slow: its speed says nothing about FP8 on a GPU."""


@dataclass
class LoraSection:
    """LoRA fine-tuning (`--lora`): the model is frozen and small adapters are trained; the
    run's checkpoints hold the adapters only, with the base's identity and checksum."""

    enabled: bool = False
    """Train LoRA adapters on a frozen base instead of the whole model."""
    rank: int = 16
    """Rank of each adapter (A is [rank, in], B is [out, rank])."""
    alpha: float = 32.0
    """The adapters' update is scaled by alpha / rank."""
    dropout: float = 0.0
    """Dropout on the adapters' input."""
    targets: list[str] = field(default_factory=lambda: ["all"])
    """Projections to adapt: q, k, v, o, gate, up, down, q_a, q_b, kv_a, kv_b (latent
    attention), expert_gate, expert_up, expert_down (MoE experts), or all."""
    base_dtype: Literal["fp32", "bf16"] | None = None
    """Storage dtype of the frozen base (bf16 halves its memory; adapters stay fp32); unset:
    fp32 like every other weight."""
    base: str | None = None
    """Pipe checkpoint holding the frozen base (a checkpoint directory or an iter_ directory);
    unset: `checkpoint.load` when it holds a full checkpoint or names a Hugging Face directory,
    or the base recorded by the adapter checkpoint it resumes."""


@dataclass
class LoggingSection:
    """Where the run writes its logs and metrics."""

    run_dir: str = "runs/default"
    """Run directory: config.toml, metrics.jsonl and, by default, checkpoints/."""
    tensorboard: bool = False
    """Also write TensorBoard event files (needs the `track` extra)."""
    wandb: bool = False
    """Also log to Weights & Biases (needs the `track` extra)."""
    wandb_project: str = "pipe"
    """W&B project name."""


@dataclass
class EvalSection:
    """lm-eval tasks scored on the training model during the run (`pipeline.train.report.
    lm_eval_scores`), logged as `lm_eval/<task>/<metric>` with split "valid"."""

    lm_eval_tasks: list[str] = field(default_factory=list)
    """lm-eval task names (empty: none); the scores equal `pipe eval` on the exported checkpoint."""
    lm_eval_interval: int = 0
    """Score the tasks every this many iterations (0: never)."""
    lm_eval_limit: float | None = None
    """Documents per task (below 1: that fraction of them; None: all)."""
    lm_eval_include_path: str | None = None
    """A folder of task YAMLs beside lm-eval's own (`pipe eval --include-path`)."""
    lm_eval_max_length: int | None = None
    """Tokens per scored sequence, longer contexts cut on the left (None: the model's
    `max_position_embeddings`, the context `pipe eval`'s engine reports)."""


@dataclass(frozen=True)
class RecordedModel:
    """The model config recorded by the checkpoint `checkpoint.load` resumes from, as the config
    loader read it (`pipeline.train.state.checkpoint_model.read_recorded_model`). `problem` says why
    `config` is missing (no model recorded, or one that does not parse); it is raised only when
    the run needs the checkpoint's model."""

    directory: Path
    config: ModelConfig | None = None
    problem: str | None = None
    hf: bool = False
    """The directory is a Hugging Face model (`pipe train --load HF_DIR`), not a checkpoint."""

    def model_config(self) -> ModelConfig:
        """The recorded model, or `ConfigError` saying why there is none."""
        if self.config is None:
            raise ConfigError(self.problem or f"checkpoint {self.directory} records no model")
        return self.config


@dataclass
class TrainConfig:
    """Everything a training run needs, section by section."""

    model: ModelSection = field(default_factory=ModelSection)
    data: DataSection = field(default_factory=DataSection)
    training: TrainingSection = field(default_factory=TrainingSection)
    optimizer: OptimizerSection = field(default_factory=OptimizerSection)
    scheduler: SchedulerSection = field(default_factory=SchedulerSection)
    checkpoint: CheckpointSection = field(default_factory=CheckpointSection)
    parallel: ParallelSection = field(default_factory=ParallelSection)
    fp8: Fp8Section = field(default_factory=Fp8Section)
    lora: LoraSection = field(default_factory=LoraSection)
    logging: LoggingSection = field(default_factory=LoggingSection)
    eval: EvalSection = field(default_factory=EvalSection)
    contributed: dict[str, Any] = field(default_factory=lambda: _contributed_sections())
    """The sections objectives contribute (`add_section`: `[dpo]`, `[grpo]`), by name, each
    read as an attribute like the others (`cfg.grpo`)."""
    recorded_model: RecordedModel | None = field(default=None, compare=False, repr=False)
    """Not a section: the model of the checkpoint `checkpoint.load` resumes from, read once by
    the config loader (None when it loads none); `model.flavor = "checkpoint"` builds it."""

    def __getattr__(self, name: str) -> Any:
        """A contributed section (`cfg.grpo`); AttributeError for anything else."""
        contributed = self.__dict__.get("contributed")
        if contributed is not None and name in contributed:
            return contributed[name]
        raise AttributeError(f"{type(self).__name__} has no section or attribute {name!r}")

    # ---- typed access -------------------------------------------------------------------------

    def set(self, dotted: str, value: Any, source: str = "config") -> None:
        """Set `section.key` to `value` after checking it against the field's type (a `Literal`:
        its values).

        `source` (a file name, "--set", "--lr") prefixes error messages so the user knows which
        input to fix. Ints are accepted for float fields; nothing else is converted.
        """
        section_name, _, key = dotted.partition(".")
        if section_name not in SECTIONS:
            raise ConfigError(
                f"{source}: unknown section {section_name!r} in {dotted!r}; "
                f"valid sections: {', '.join(SECTIONS)}"
            )
        section = getattr(self, section_name)
        hints = field_types(type(section))
        if key not in hints:
            raise ConfigError(
                f"{source}: unknown key {key!r} in section [{section_name}]; "
                f"valid keys: {', '.join(hints)}"
            )
        setattr(section, key, coerce(value, hints[key], f"{source}: {section_name}.{key}"))

    def update(self, tables: dict[str, Any], source: str) -> None:
        """Apply `{section: {key: value}}` (a parsed recipe or config.toml) over this config."""
        for section_name, values in tables.items():
            if not isinstance(values, dict):
                raise ConfigError(
                    f"{source}: {section_name!r} must be a table [{section_name}]; "
                    f"valid sections: {', '.join(SECTIONS)}"
                )
            for key, value in values.items():
                self.set(f"{section_name}.{key}", value, source)

    # ---- output -------------------------------------------------------------------------------

    def to_dict(self) -> dict[str, dict[str, Any]]:
        """`{section: {key: value}}` of every set field (`None` means unset and is left out)."""
        out: dict[str, dict[str, Any]] = {}
        for name in SECTIONS:
            section = getattr(self, name)
            out[name] = {
                f.name: copy.copy(getattr(section, f.name))
                for f in dataclasses.fields(section)
                if getattr(section, f.name) is not None
            }
        return out

    def to_toml(self) -> str:
        """The resolved config as TOML; `TrainConfig().update(tomllib.loads(...))` reproduces it."""
        from pipeline.train.config.toml_io import dumps

        return dumps(self.to_dict())

    # ---- derived values -----------------------------------------------------------------------

    @property
    def decay_iters(self) -> int:
        """The step at which the learning rate reaches `min_lr`."""
        if self.scheduler.decay_iters is None:
            return self.training.iters
        return self.scheduler.decay_iters

    def data_parallel_size(self, world_size: int | None = None) -> int:
        """`parallel.dp`, inferring -1 from `world_size` (1 when the world size is unknown)."""
        p = self.parallel
        if p.dp != -1:
            return p.dp
        if world_size is None:
            return 1
        return world_size // (p.tp * p.pp * p.cp)

    def model_config(self) -> ModelConfig:
        """The `ModelConfig` of `model.flavor` with this section's overrides applied (reads no
        file: the checkpoint flavor takes `recorded_model`)."""
        if self.model.flavor != CHECKPOINT_FLAVOR:
            return apply_model_overrides(lookup_flavor(self.model.flavor), self.model)
        if self.recorded_model is None:
            load = self.checkpoint.load
            where = f"{load} holds no checkpoint yet" if load else "no checkpoint.load is set"
            raise ConfigError(
                f"model.flavor = {CHECKPOINT_FLAVOR} takes the model from the loaded checkpoint, "
                f"but {where}; name a model flavor instead"
            )
        return apply_model_overrides(self.recorded_model.model_config(), self.model)

    # ---- checks -------------------------------------------------------------------------------

    def validate(self, world_size: int | None = None) -> TrainConfig:
        """Check the sections' cross-field consistency; raise one `ConfigError` listing every
        problem. A run's whole check, which adds what its objective and its optimizer refuse
        (their registries sit above the config), is `assembly.run_config.check_config`."""
        raise_problems(config_problems(self, world_size))
        return self


SECTIONS: dict[str, type] = {
    f.name: f.default_factory
    for f in dataclasses.fields(TrainConfig)
    if isinstance(f.default_factory, type)  # a section; not `contributed` nor `recorded_model`
}
"""Every section of `TrainConfig` by its name (`[training]`, ...): the config's own, in the order
of its fields, then those objectives contributed (`add_section`), in the order they came."""
_CONTRIBUTED: dict[str, type] = {}


def add_section(name: str, section: type) -> None:
    """Make `section` (a dataclass of config fields, all with defaults) the config's `[name]`,
    read as `cfg.name`: how an objective brings its own settings (`ObjectiveSpec.section`)
    without the config naming it. A name taken already is a programming error (ValueError)."""
    if name in SECTIONS or hasattr(TrainConfig, name):
        raise ValueError(f"config section [{name}] exists already")
    SECTIONS[name] = _CONTRIBUTED[name] = section


def _contributed_sections() -> dict[str, Any]:
    return {name: section() for name, section in _CONTRIBUTED.items()}
