"""Tensor and sequence parallelism as a DTensor plan, and the vocabulary-parallel loss.

`apply_tensor_parallel` shards the model in place with `parallelize_module`:
q/k/v and the MLP's gate and up projections column-wise (each rank holds whole heads and a slice
of the MLP width), their output projections row-wise, the embedding and the output layer on the
vocabulary. Per-head q/k norms (Qwen3) act on head_dim, so their weights are replicated and
their gradients summed over tp. Latent attention (DeepSeek) splits its heads the same way
(`wq` or `wq_b`, `wkv_b` column-wise, `wo` row-wise) and replicates its down projections, their
norms and the shared RoPE key: the gradients reaching those from this rank's heads are summed
over tp where they enter the head-split projections (and at `rope_key`), so the replicated
weights get the full gradient on every rank. Gated DeltaNet (linear attention) splits its key
heads and the value heads each serves: its rows and conv channels are grouped by key head, so
every tensor of the layer splits in contiguous pieces. Attention itself runs on local tensors:
the model views q/k/v with -1 heads, so each rank attends over its own heads without knowing it
is sharded (and CPU SDPA, which has no DTensor rule, still works). ALiBi's slopes follow their
heads: each rank keeps the slopes of the heads it holds (`_SplitHeads`), and so do attention
sinks (gpt-oss, one logit per query head, a Shard(0) DTensor); an o_proj bias is added once,
after the row-wise sum. A plain (not gated) MLP has no w3; BLOOM's embedding norm is a
sequence-parallel norm like the others.

With sequence parallelism the residual stream between the attention and MLP sub-blocks is a
DTensor sharded on the sequence (dim 1): norms run on 1/tp of the tokens, each sub-block
all-gathers its input and reduce-scatters its output. The stream stays a DTensor rather than a
local shard because `Transformer.forward` derives default position ids from the hidden states'
sequence length, which must be the global one.

MoE blocks are not split: router, experts and shared experts are whole on every tp rank (an
expert tensor-parallel size of 1, as in Megatron). Without sequence parallelism every tp rank
computes the same MoE on the same tokens. With it, each tp rank routes (and, under expert
parallelism, dispatches) only its own share of the sequence, so the MoE's parameters get
gradients from that share only: `sum_moe_gradients` sums them over tp once after backward.
Expert parallelism is a separate step, applied before this one (the MoE it swaps in is the one
planned here).

The output layer's weight becomes a vocabulary-sharded DTensor, which the single-device chunked
loss cannot take; `tp_linear_cross_entropy` computes the same loss from the local vocabulary
shard. Vocabulary sizes are best padded to `padded_vocab_size(vocab, tp)` when the model is built
(uneven shards work, but waste the last rank's matmul and break tensor-core alignment).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    PrepareModuleInputOutput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)
from torch.distributed.tensor.parallel.style import ParallelStyle

from pipeline.core.kernels.cross_entropy import (
    DEFAULT_CHUNK_TOKENS,
    VocabShard,
    chunked_linear_cross_entropy,
    chunked_token_logprobs,
)


def padded_vocab_size(vocab_size: int, tp: int, multiple: int = 128) -> int:
    """The smallest multiple of `multiple * tp` >= `vocab_size` (Megatron's
    `make_vocab_size_divisible_by`): every tp rank then holds an equal, aligned vocabulary slice."""
    step = multiple * tp
    return -(-vocab_size // step) * step


def apply_tensor_parallel(
    model: nn.Module,
    tp_mesh: DeviceMesh,
    *,
    sequence_parallel: bool = True,
    loss_parallel: bool = False,
) -> nn.Module:
    """Shard `model` (a `Transformer` or a pipeline stage of one) over `tp_mesh`, in place.

    loss_parallel: `output(...)` (used by `Transformer.logits`) returns vocabulary-sharded
    DTensor logits for torch's `loss_parallel()` instead of gathering them. Training does not
    call `output`; it passes `output.weight` to `tp_linear_cross_entropy`.
    """
    if tp_mesh.size() == 1:
        return model
    stream = Shard(1) if sequence_parallel else Replicate()
    # SP keeps the stream a DTensor (see the module docstring); without SP it is a plain tensor.
    keep_dtensor = sequence_parallel

    top: dict[str, ParallelStyle] = {
        "tok_embeddings": _SettledRowwiseParallel(
            input_layouts=Replicate(), output_layouts=stream, use_local_output=not keep_dtensor
        ),
        "output": ColwiseParallel(
            input_layouts=stream,
            output_layouts=Shard(-1) if loss_parallel else Replicate(),
            use_local_output=not loss_parallel,
        ),
    }
    if sequence_parallel:
        top["norm"] = SequenceParallel()
        top["embedding_norm"] = SequenceParallel()
    top = {name: style for name, style in top.items() if getattr(model, name, None) is not None}
    parallelize_module(model, tp_mesh, top)

    for block in model.layers.values():
        parallelize_module(block, tp_mesh, _block_plan(block, sequence_parallel, keep_dtensor))
        _shard_sinks(block.attention, tp_mesh)

    tie = getattr(getattr(model, "config", None), "tie_word_embeddings", False)
    if tie and model.tok_embeddings is not None and model.output is not None:
        # Each style made its own DTensor parameter; both are Shard(0) on the vocabulary.
        model.output.weight = model.tok_embeddings.weight
    _place_adapters(model)
    _match_grad_layouts(model)
    return model


def _shard_sinks(attention: nn.Module, mesh: DeviceMesh) -> None:
    """Attention sinks (gpt-oss: one logit per query head) split with their heads: a Shard(0)
    DTensor whose local part is this rank's heads' (the attention runs on local tensors)."""
    sinks = getattr(attention, "sinks", None)
    if sinks is None or isinstance(sinks, DTensor):
        return
    full = torch.empty(sinks.shape, device="meta") if sinks.is_meta else sinks.detach()
    placed = distribute_tensor(full, mesh, [Shard(0)])
    attention.sinks = nn.Parameter(placed, requires_grad=sinks.requires_grad)


def _place_adapters(model: nn.Module) -> None:
    """Lay each LoRA adapter out as its base linear (`pipeline.core.model.lora`): a
    column-parallel base (weight Shard(0)) keeps A whole and splits B on its rows, a row-parallel
    one (Shard(1)) splits A on its columns and keeps B whole, so A x is complete (or a partial sum
    that the base's output reduction completes) exactly where the base's output is."""
    from pipeline.core.model.lora import LoRAAdapted

    for module in model.modules():
        if not isinstance(module, LoRAAdapted) or not isinstance(module.weight, DTensor):
            continue
        mesh = module.weight.device_mesh
        column = module.weight.placements == (Shard(0),)
        layouts = (
            {"lora_A": Replicate(), "lora_B": Shard(0)}
            if column
            else {"lora_A": Shard(1), "lora_B": Replicate()}
        )
        for name, placement in layouts.items():
            param = getattr(module, name)
            if isinstance(param, DTensor):
                full = (
                    torch.empty(param.shape, device="meta")
                    if param.is_meta
                    else (param.full_tensor())
                )
            else:
                full = param.detach()
            placed = distribute_tensor(full, mesh, [placement])
            module.register_parameter(name, nn.Parameter(placed, requires_grad=param.requires_grad))


def _match_grad_layouts(model: nn.Module) -> None:
    """Give each DTensor parameter's gradient the parameter's own layout after backward.

    Left alone, the sequence-parallel norm weights (Replicate) get Partial gradients, pending a
    sum over tp, and the embedding (Shard(0)) a full Replicate one. Optimizers and gradient
    clipping would then reduce them implicitly on every use, or hold a full-vocabulary gradient
    on each rank; reducing once here makes `param.grad` a plain shard of the true gradient.
    FSDP2 replaces the parameters (and so these hooks) and does the same redistribution itself.
    """

    def hook(param: torch.Tensor) -> None:
        if isinstance(param.grad, DTensor) and param.grad.placements != param.placements:
            param.grad = param.grad.redistribute(placements=param.placements)

    for param in model.parameters():
        if isinstance(param, DTensor) and param.requires_grad:  # frozen (LoRA's base): no grad
            param.register_post_accumulate_grad_hook(hook)


def _block_plan(
    block: nn.Module, sequence_parallel: bool, keep_dtensor: bool
) -> dict[str, ParallelStyle]:
    """The plan for one `TransformerBlock`: attention and the MLP (dense or MoE)."""
    stream = Shard(1) if sequence_parallel else Replicate()
    if block.attention.kind == "mla":
        plan = _latent_attention_plan(block, stream, keep_dtensor)
    elif block.attention.kind == "linear":
        plan = _linear_attention_plan(block, stream, keep_dtensor)
    else:
        plan = _attention_plan(block, stream, keep_dtensor)
    if sequence_parallel:
        plan["attention_norm"] = SequenceParallel()
        plan["ffn_norm"] = SequenceParallel()
    if block.is_moe:
        if sequence_parallel:
            plan["moe"] = _LocalTokens()
        return plan
    up = ["feed_forward.w1", "feed_forward.w3"] if block.feed_forward.gated else ["feed_forward.w1"]
    prepare = _styles(block, *up)[2]
    plan["feed_forward"] = prepare(input_layouts=(stream,), desired_input_layouts=(Replicate(),))
    for name in up:
        plan[name] = _styles(block, name)[0]()
    plan["feed_forward.w2"] = _styles(block, "feed_forward.w2")[1](
        output_layouts=stream, use_local_output=not keep_dtensor
    )
    return plan


def _latent_attention_plan(
    block: nn.Module, stream: Shard | Replicate, keep_dtensor: bool
) -> dict[str, ParallelStyle]:
    """Latent attention: heads split, down projections replicated (see the module docstring).
    The attention input is gathered to a local tensor; each head-split projection turns it (or
    the latent) into a replicated DTensor, whose backward sums the gradient over tp."""
    attention = block.attention
    q = "attention.wq" if attention.mla.q_lora_rank is None else "attention.wq_b"
    return {
        "attention": PrepareModuleInput(
            input_layouts=(stream, None, None),
            desired_input_layouts=(Replicate(), None, None),
            use_local_output=True,
        ),
        q: ColwiseParallel(),
        "attention.wkv_b": ColwiseParallel(),
        "attention.rope_key": _SumGradient(),
        "attention.wo": RowwiseParallel(output_layouts=stream, use_local_output=not keep_dtensor),
    }


def _attention_plan(
    block: nn.Module, stream: Shard | Replicate, keep_dtensor: bool
) -> dict[str, ParallelStyle]:
    """Grouped-query attention: q/k/v column-wise, wo row-wise."""
    plan: dict[str, ParallelStyle] = {
        name: _styles(block, name)[0]() for name in ("attention.wq", "attention.wk", "attention.wv")
    }
    plan["attention.wo"] = _styles(block, "attention.wo")[1](
        output_layouts=stream, use_local_output=not keep_dtensor
    )
    if block.attention.alibi is not None:
        plan["attention.alibi"] = _SplitHeads()
    if block.attention.qk_norm:
        # Per-head norms (Qwen3) see this rank's heads `[batch, seq, heads, head_dim]`: the
        # weight is replicated, the input wrapped as sharded on the heads, so the weight's
        # gradient (a partial sum over this rank's heads) is all-reduced over tp. Norms over
        # the whole projection (MiniMax-M2) see this rank's slice `[batch, seq, width / tp]`
        # wrapped the same way: the mean of squares over the sharded dimension is summed over
        # tp, and each rank scales by its slice of the replicated weight.
        for name in ("attention.q_norm", "attention.k_norm"):
            plan[name] = SequenceParallel(sequence_dim=2, use_local_output=True)
    # One DTensor input shared by q, k and v (and w1, w3), so backward reduces their input
    # gradients once; under SP this is also where the sequence is all-gathered (in fp8 when all
    # three are tensorwise fp8 linears: the cast happens before the gather).
    prepare = _styles(block, "attention.wq", "attention.wk", "attention.wv")[2]
    plan["attention"] = prepare(
        input_layouts=(stream, None, None), desired_input_layouts=(Replicate(), None, None)
    )
    return plan


class _SplitHeads(ParallelStyle):
    """ALiBi's slopes (`pipeline.core.model.alibi.AlibiSlopes`) cut to this rank's heads: the
    contiguous share that q's column split gives it."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        heads, tp = len(module.all_slopes), device_mesh.size()
        if heads % tp:
            raise ValueError(f"{heads} attention heads do not split over {tp} tensor ranks")
        share = heads // tp
        start = device_mesh.get_local_rank() * share
        module.set_heads(range(start, start + share))
        return module


def _linear_attention_plan(
    block: nn.Module, stream: Shard | Replicate, keep_dtensor: bool
) -> dict[str, ParallelStyle]:
    """Gated DeltaNet: each rank a run of key heads and the value heads they serve. The input
    projections column-wise (their rows, and the conv's channels, are grouped by key head, so a
    contiguous split is a split by heads), `wo` row-wise, the conv weight, A_log and dt_bias
    split on heads, the gated norm's weight (one for every head) replicated with its gradient
    summed (`pipeline.core.model.linear_attention.local`)."""
    attention = block.attention
    names = ("wqkvz", "wba") if attention.interleaved else ("wqkv", "wz", "wb", "wa")
    plan: dict[str, ParallelStyle] = {
        f"attention.{n}": _styles(block, f"attention.{n}")[0]() for n in names
    }
    plan["attention.wo"] = _styles(block, "attention.wo")[1](
        output_layouts=stream, use_local_output=not keep_dtensor
    )
    plan["attention.norm"] = _Placed({"weight": Replicate()})
    plan["attention"] = _Placed(
        {"conv_weight": Shard(0), "A_log": Shard(0), "dt_bias": Shard(0)},
        input_layouts=(stream, None, None),
        desired_input_layouts=(Replicate(), None, None),
    )
    return plan


class _Placed(PrepareModuleInput):
    """Lay a module's own parameters out as `placements` says (name -> placement) over tp; with
    input layouts, also prepare its input as `PrepareModuleInput` does (to a local tensor)."""

    def __init__(self, placements: dict, **input_layouts) -> None:
        super().__init__(**input_layouts, use_local_output=True)
        self.placements = placements
        self.prepares_input = bool(input_layouts)

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        for name, placement in self.placements.items():
            param = getattr(module, name)
            placed = distribute_tensor(param.data, device_mesh, [placement])
            module.register_parameter(name, nn.Parameter(placed, requires_grad=param.requires_grad))
        return super()._apply(module, device_mesh) if self.prepares_input else module


class _SumGradient(ParallelStyle):
    """Identity in forward; in backward the module's input gradient is summed over tp
    (Megatron's "copy to tensor-parallel region"): for a replicated tensor that each rank uses
    only for its own heads."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def sum_in_backward(_module: nn.Module, args: tuple) -> tuple:
            x = DTensor.from_local(args[0], device_mesh, [Replicate()], run_check=False)
            return (x.to_local(grad_placements=[Partial()]), *args[1:])

        module.register_forward_pre_hook(sum_in_backward)
        return module


def _styles(block: nn.Module, *names: str) -> tuple[type, type, type]:
    """(colwise, rowwise, prepare-input) style classes for the linears `names` of `block`:
    torchao's float8 styles when all of them are tensorwise float8 linears (FP8 training), else
    the plain DTensor ones. Float8 styles cast a linear's input to fp8 before the communication
    and its output gradient to fp8 before the backward one."""
    from pipeline.core.kernels.fp8_torchao import float8_tp_styles

    styles = float8_tp_styles(block.get_submodule(name) for name in names)
    return styles or (ColwiseParallel, RowwiseParallel, PrepareModuleInput)


class _SettledRowwiseParallel(RowwiseParallel):
    """`RowwiseParallel` whose output collective has completed when the module returns.

    torch's styles redistribute outputs with `async_op=True`: the result holds an
    `AsyncCollectiveTensor` (a pending collective), bare or inside a DTensor, that settles on
    first use. For the embedding, that first use is the first compiled block, and torch 2.13
    mishandles such inputs at a compiled region's boundary: a bare one is unwrapped before
    tracing without its `requires_grad`, so the embedding's gradient is dropped or its
    backward receives a plain tensor (pytorch/pytorch#191113, a regression of #179849); one
    inside a DTensor is traced as a nested subclass that the guards do not tell apart from a
    plain local tensor, so a later call fails (`no attribute 'elem'`; see #180614). Waiting
    here costs nothing: the next block needs the result at once.
    """

    @staticmethod
    def _prepare_output_fn(output_layouts, use_local_output, mod, outputs, device_mesh):
        if outputs.placements != output_layouts:
            outputs = outputs.redistribute(placements=output_layouts, async_op=False)
        return outputs.to_local() if use_local_output else outputs


class _LocalTokens(PrepareModuleInputOutput):
    """A whole (not split) MoE under sequence parallelism: it runs on this rank's sequence shard
    (the local tensor of its input) and its output is that shard of the stream. Its parameters
    then hold this shard's gradient only, so the module is marked (`tp_grad_group`) for
    `sum_moe_gradients`."""

    def __init__(self) -> None:
        super().__init__(
            input_layouts=(Shard(1),),
            desired_input_layouts=(Shard(1),),
            output_layouts=(Shard(1),),
            desired_output_layouts=(Shard(1),),
            use_local_input=True,
            use_local_output=False,
        )

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        module.tp_grad_group = device_mesh.get_group()
        return super()._apply(module, device_mesh)


@torch.no_grad()
def sum_moe_gradients(model: nn.Module) -> None:
    """Sum, over tp, the gradients of every MoE that routed only this rank's sequence shard
    (see `_LocalTokens`); call once after a step's backward (gradients of all micro-batches
    accumulated, after FSDP's reduction: each tp rank holds the same shard layout). One
    all-reduce per such layer; a no-op for other models."""
    layers = model.moe_layers() if hasattr(model, "moe_layers") else {}
    for moe in layers.values():
        group = getattr(moe, "tp_grad_group", None)
        grads = [p.grad for p in moe.parameters() if p.grad is not None]
        if group is None or not grads:
            continue
        local = [g.to_local() if isinstance(g, DTensor) else g for g in grads]
        flat = torch.cat([g.reshape(-1) for g in local])
        torch.distributed.all_reduce(flat, group=group)
        offset = 0
        for g in local:
            g.copy_(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()


# ---------------------------------------------------------------------------------------------
# Vocabulary-parallel cross-entropy
# ---------------------------------------------------------------------------------------------


def tp_linear_cross_entropy(
    hidden: torch.Tensor,
    output_weight: torch.Tensor,
    labels: torch.Tensor,
    loss_mask: torch.Tensor | None = None,
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`chunked_linear_cross_entropy` for a tensor-parallel model: `(loss_sum, num_tokens)`.

    output_weight: the output layer's weight, a DTensor sharded on the vocabulary (Shard(0));
    a plain tensor falls through to the single-device loss. hidden: the model's output, a
    DTensor sharded on the sequence (sequence parallelism) or a plain tensor replicated over tp.
    labels and loss_mask are the full (unsharded) batch, the same on every tp rank. The loss is
    the same on every tp rank; backward leaves each rank its shard of the weight gradient and
    the hidden gradient summed over the vocabulary shards (reduce-scattered back onto the
    sequence under sequence parallelism).
    """
    hidden, weight, shard = _vocab_parallel(hidden, output_weight)
    return chunked_linear_cross_entropy(hidden, weight, labels, loss_mask, chunk_tokens, shard)


def tp_token_logprobs(
    hidden: torch.Tensor,
    output_weight: torch.Tensor,
    labels: torch.Tensor,
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`chunked_token_logprobs` (each token's log-probability and entropy, no gradients) for a
    model whose output weight may be vocabulary-parallel, as `tp_linear_cross_entropy` takes
    it; the values are the same on every tp rank."""
    hidden, weight, shard = _vocab_parallel(hidden, output_weight)
    return chunked_token_logprobs(hidden, weight, labels, chunk_tokens, shard)


def _vocab_parallel(
    hidden: torch.Tensor, output_weight: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, VocabShard | None]:
    """(hidden states every rank holds whole, this rank's weight rows, their `VocabShard`) of a
    vocabulary-parallel output layer; a plain weight gives the full hidden states, the weight
    and None."""
    if not isinstance(output_weight, DTensor):
        whole = hidden.full_tensor() if isinstance(hidden, DTensor) else hidden
        return whole, output_weight, None
    mesh = output_weight.device_mesh
    if mesh.ndim != 1 or output_weight.placements != (Shard(0),):
        raise ValueError(
            f"output weight must be Shard(0) on a 1-D tp mesh, got {output_weight.placements} "
            f"on a {mesh.ndim}-D mesh"
        )
    # Every rank needs every token; the gradient each rank returns for them is a partial sum.
    if isinstance(hidden, DTensor):
        hidden = hidden.redistribute(mesh, (Replicate(),))
    else:
        hidden = DTensor.from_local(hidden, mesh, (Replicate(),), run_check=False)
    hidden = hidden.to_local(grad_placements=(Partial(),))

    weight = output_weight.to_local()
    vocab, tp = output_weight.shape[0], mesh.size()
    # DTensor's Shard follows torch.chunk: ceil(vocab / tp) rows per rank, the last ones fewer.
    vocab_start = min(mesh.get_local_rank() * -(-vocab // tp), vocab)

    return hidden, weight, VocabShard(vocab_start, mesh.get_group())
