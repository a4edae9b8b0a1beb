"""The decode step with static shapes, which a CUDA graph captures once and replays.

A decode step of a small model on a GPU is bound by kernel launches, not by the GPU: the first
H200 run measured 6.5 ms a step for a 56M model, hundreds of small kernels each launched from
Python. A CUDA graph records the kernels of one step once and replays them with one launch, but
only a step whose shapes, memory addresses and control flow never change, and which never waits
on the device (no host synchronisation, no Python branching on tensor values). So this step:

- pads the batch to a bucket (1, 2, 4, 8, ... up to the engine's `max_batch`, which is a bucket
  too); padded rows run token 0 at position 0, write the cache's scratch slot and read only it;
- reads each row's history through read slots of a fixed width: a power-of-two number of whole
  blocks, enough for the batch's longest row, at most the engine's `max_context` in whole blocks
  (one width only would make every step attend over the whole context; a few widths keep a
  short conversation's step short, as a paged attention kernel would, at one graph per width);
- builds its attention mask from the positions on the device (key j seen when j <= position),
  never asking the host whether every row is as long (`CachedBatch.mask`'s shortcut);
- reads the cache into fresh tensors rather than the cache's reused read buffer (a captured
  graph must not hold memory that eager prefill may free and reallocate);
- runs adapters (`pipeline.serve.engine.lora_slots`) as one gathered product over every row's
  slot, read from a row -> slot tensor that is kept and filled in place, never as Python groups.

Its inputs are tensors kept per shape and filled in place (`copy_`) before each step, so a graph
replays on the new values. The step ends at the logits (`model.output` of each row's hidden
state, in float32, copied into an output buffer kept per bucket): sampling, penalties, logit
biases, log-probabilities and structured-output masks (`pipeline.serve.engine.sampling.choose`,
`GrammarBackend.constrain`) run after it, eagerly, on its output's real rows, as vLLM samples
after its graph. They hold per-request Python state (generators, grammar matchers) and are a few
kernels per step, so capturing them would buy little and cost the per-request seeds. Prompt
chunks (prefill) stay eager.

The capture: `torch.cuda.CUDAGraph` by hand, one graph per (bucket, width, adapters or not),
captured the first time a step has that shape, after one warm-up run of the step on a side stream
(cuBLAS and attention kernels chosen and their workspaces allocated outside the capture), all
graphs in one memory pool (they never run at once). Chosen over `torch.compile(mode=
"reduce-overhead")` because the step is already static and needs no compiler: no recompiles, no
minutes of compile on a large model, no guards to fail on the cache's Python objects, and the
same code runs eagerly on a CPU (`Engine(static_decode=True)`), where the tests prove it gives
today's tokens.

Mixture-of-experts layers are captured where their experts run as grouped products
(`pipeline.core.model.moe.grouped_mm_serves`: bf16 on a GPU of compute capability 9.0 or newer),
which read each expert's number of tokens on the device; the loop over experts asks the host for
them, and a capacity factor drops tokens by a shape that depends on values.

What cannot be captured runs eagerly, the engine's ordinary decode step, for the reason
`capture_problem` names: such a mixture-of-experts layer, a tensor-parallel or sharded model, a
compiled one, and one whose layers recompute activations (a GRPO policy decoding on itself).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch.nn.utils.rnn import pad_sequence

from pipeline.core.model.moe import MoE, adapter_stacks, grouped_mm_serves
from pipeline.core.model.transformer import Transformer
from pipeline.serve.engine.decode import BatchSlots, CachedBatch, layer_windows
from pipeline.serve.engine.kv_cache import BlockKVCache

if TYPE_CHECKING:
    from pipeline.serve.engine.lora_slots import LoRASlots

log = logging.getLogger(__name__)


def batch_buckets(max_batch: int) -> list[int]:
    """The batch sizes a step is padded to: powers of two below `max_batch`, and `max_batch`."""
    buckets = [1]
    while buckets[-1] * 2 < max_batch:
        buckets.append(buckets[-1] * 2)
    return buckets + [max_batch] if max_batch > 1 else buckets


def width_blocks(needed: int, most: int) -> int:
    """The read slots' width in blocks for a batch whose longest row needs `needed` blocks: the
    next power of two, at most `most` (the engine's context in whole blocks)."""
    width = 1
    while width < needed:
        width *= 2
    return min(width, most)


def _padded(values: list[int], size: int, pad: int) -> torch.Tensor:
    """`values` as a long tensor of `size`, padded with `pad`."""
    return torch.tensor(values + [pad] * (size - len(values)), dtype=torch.long)


def _next_token(row: Any) -> int:
    """The token a decode row runs: its `computed`-th (without building prompt + output)."""
    at, prompt = row.computed, row.prompt
    return prompt[at] if at < len(prompt) else row.output[at - len(prompt)]


def capture_problem(model: Transformer, tp: int) -> str | None:
    """Why the decode step of `model` cannot be captured in a CUDA graph, or None if it can."""
    if tp > 1:
        return "tensor-parallel serving is not captured yet"
    moe = [module for module in model.modules() if isinstance(module, MoE)]
    if any(module.config.capacity_factor is not None for module in moe):
        return "its MoE layers drop tokens over a capacity (a shape that depends on values)"
    if moe and not _grouped_experts(moe[0]):
        return (
            "its MoE layers ask the host for each expert's token count (grouped products of "
            "experts need bf16 on a GPU of compute capability 9.0 or newer)"
        )
    if any(type(p).__name__ == "DTensor" for p in model.parameters()):
        return "its weights are sharded (DTensor)"
    if any(getattr(m, "_compiled_call_impl", None) is not None for m in model.modules()):
        return "its modules are compiled (torch.compile)"
    if any(getattr(m, "recompute", "none") != "none" for m in model.modules()):
        # torch.utils.checkpoint reads the device's random state at every call, even without
        # gradients
        return "its layers recompute activations (activation checkpointing)"
    return None


def _grouped_experts(moe: MoE) -> bool:
    """Whether `moe`'s experts (and their adapters, if any) run as grouped products in a decode
    step, where no gradient flows. One layer answers for all: a model's MoE layers share their
    config, dtype and device, and adapters are added to every layer alike."""
    stacks = [*moe.experts.gate_up_down(), *adapter_stacks(moe.experts.lora)]
    rows = torch.empty(0, device=stacks[0].device, dtype=stacks[0].dtype)
    with torch.no_grad():
        return grouped_mm_serves(rows, *stacks)


def static_decoder(
    model: Transformer,
    cache: BlockKVCache,
    *,
    max_batch: int,
    max_context: int,
    tp: int = 1,
    cuda_graphs: bool | None = None,
    static_decode: bool | None = None,
) -> StaticDecoder | None:
    """The engine's decoder for decode steps, or None for the eager, packed step.

    cuda_graphs: capture and replay (None: when the cache is on a CUDA device); asked for where
    it cannot be done, the step runs eagerly, said in one log line. static_decode: the static
    step even without graphs (None: when graphs are on), for tests on a CPU."""
    device = cache.pools[0][0].device
    graphs = device.type == "cuda" if cuda_graphs is None else cuda_graphs
    if graphs and device.type != "cuda":
        log.warning("CUDA graphs off: the engine runs on %s, not a CUDA device", device)
        graphs = False
    problem = capture_problem(model, tp) if graphs else None
    if problem is not None:
        log.warning("CUDA graphs off: %s; decoding runs eagerly", problem)
        graphs = False
    if not (graphs if static_decode is None else static_decode):
        return None
    return StaticDecoder(model, cache, max_batch=max_batch, max_context=max_context, graphs=graphs)


@dataclass
class StepInputs:
    """The tensors one (bucket, width) step reads: filled in place before every step."""

    tokens: torch.Tensor  # [bucket]
    positions: torch.Tensor  # [bucket]
    write_slots: torch.Tensor  # [bucket]
    read_slots: torch.Tensor  # [bucket, width]
    lora_rows: torch.Tensor  # [bucket]: each row's adapter slot (the zero slot: none)


class StaticDecoder:
    """Decode steps of static shapes over `model` and `cache` (module docstring); with `graphs`
    each shape is captured once in a CUDA graph and replayed."""

    def __init__(
        self,
        model: Transformer,
        cache: BlockKVCache,
        *,
        max_batch: int,
        max_context: int,
        graphs: bool = False,
    ) -> None:
        self.model, self.cache, self.graphs = model, cache, graphs
        self.device = cache.pools[0][0].device
        self.buckets = batch_buckets(max_batch)
        self.max_blocks = -(-max_context // cache.block_size)
        self._inputs: dict[tuple[int, int], StepInputs] = {}
        self._outputs: dict[int, torch.Tensor] = {}  # bucket -> logits [bucket, vocab], float
        self._graphs: dict[tuple[int, int, bool], torch.cuda.CUDAGraph] = {}
        self._pool: Any = None  # the graphs' shared memory pool

    @property
    def shapes(self) -> list[tuple[int, int]]:
        """The (bucket, width) shapes of the steps so far: the only shapes the step has seen."""
        return list(self._inputs)

    def bucket(self, rows: int) -> int:
        """The bucket a step of `rows` rows is padded to."""
        for size in self.buckets:
            if size >= rows:
                return size
        raise ValueError(f"{rows} decode rows: more than the engine's batch of {self.buckets[-1]}")

    def logits(self, rows: Sequence[Any], adapters: LoRASlots | None = None) -> torch.Tensor:
        """The float logits `[rows, vocab]` of one decode step of `rows` (the engine's requests,
        each with one token to run: `tokens[computed]`), their keys and values written to the
        cache. A view of a buffer that the next step overwrites."""
        needed = max(row.computed + 1 for row in rows)
        width = width_blocks(-(-needed // self.cache.block_size), self.max_blocks)
        shape = (self.bucket(len(rows)), width * self.cache.block_size)
        inputs = self._fill(shape, rows, adapters)
        adapted = adapters is not None and any(row.lora_slot is not None for row in rows)
        self._select(adapters, inputs, adapted)
        if not self.graphs:
            return self._step(inputs)[: len(rows)]
        graph = self._graphs.get((*shape, adapted))
        if graph is None:
            graph = self._graphs[(*shape, adapted)] = self._capture(inputs)
        graph.replay()
        return self._outputs[shape[0]][: len(rows)]

    def _fill(
        self, shape: tuple[int, int], rows: Sequence[Any], adapters: LoRASlots | None
    ) -> StepInputs:
        """The step's inputs for `shape`, filled with `rows` (padded rows: token 0 at position
        0, writing and reading the scratch slot only). Built on the host in a few calls over all
        rows, then copied in place: a loop of small tensor writes per row would cost more than
        a 1B model's step at batch 256."""
        bucket, width = shape
        count, scratch = len(rows), self.cache.scratch_slot
        at = [row.computed for row in rows]
        histories = [row.slots[: p + 1] for row, p in zip(rows, at)]
        read = torch.full((bucket, width), scratch, dtype=torch.long)
        padded = pad_sequence(histories, batch_first=True, padding_value=scratch)
        read[:count, : padded.shape[1]] = padded
        write = torch.full((bucket,), scratch, dtype=torch.long)
        write[:count] = padded[torch.arange(count), torch.tensor(at)]
        zero_slot = adapters.max_loras if adapters is not None else 0
        host = (
            _padded([_next_token(row) for row in rows], bucket, 0),
            _padded(at, bucket, 0),
            write,
            read,
            _padded(
                [zero_slot if r.lora_slot is None else r.lora_slot for r in rows], bucket, zero_slot
            ),
        )
        inputs = self._inputs.get(shape)
        if inputs is None:
            inputs = self._inputs[shape] = StepInputs(*(t.to(self.device) for t in host))
            return inputs
        kept = (
            inputs.tokens,
            inputs.positions,
            inputs.write_slots,
            inputs.read_slots,
            inputs.lora_rows,
        )
        for target, source in zip(kept, host):
            target.copy_(source)
        return inputs

    @staticmethod
    def _select(adapters: LoRASlots | None, inputs: StepInputs, adapted: bool) -> None:
        """Tell the adapters what the step's rows use: every row's slot from the kept tensor
        when a row runs an adapter, else no adapter at all (a graph of its own)."""
        if adapters is None:
            return
        if adapted:
            adapters.select_rows(inputs.lora_rows)
        else:
            adapters.select([None] * inputs.tokens.shape[0])

    def _step(self, inputs: StepInputs) -> torch.Tensor:
        """One decode step on `inputs`: no host synchronisation, no branch on tensor values.
        Returns the logits `[bucket, vocab]` (float) in the bucket's output buffer."""
        bucket, width = inputs.read_slots.shape
        positions = inputs.positions[:, None]
        keys = torch.arange(width, device=positions.device)
        mask = (keys[None, :] <= positions)[:, None, None, :]  # [bucket, 1, 1, width]
        batch = CachedBatch(
            inputs.tokens[:, None],
            positions,
            inputs.write_slots[:, None],
            inputs.read_slots,
            attend=mask,
        )
        slots = BatchSlots(self.cache, batch, True, layer_windows(self.model))
        hidden = self.model(batch.tokens, positions, cache=slots)
        logits = self.model.output(hidden[:, 0]).float()
        out = self._outputs.get(bucket)
        if out is None:
            out = self._outputs[bucket] = torch.empty_like(logits)
        return out.copy_(logits)

    def _capture(self, inputs: StepInputs) -> torch.cuda.CUDAGraph:
        """A CUDA graph of `_step` on `inputs` (whose values are this step's: the warm-up run
        writes the same keys and values the replay does)."""
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            self._step(inputs)  # kernels chosen, workspaces and the output buffer allocated
        torch.cuda.current_stream(self.device).wait_stream(side)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            self._step(inputs)
        return graph
