"""Gated DeltaNet linear attention (Qwen3-Next, Qwen3.5): the block `layer_types` puts where it
says "linear_attention", in place of softmax attention.

From the normed input x: queries, keys and values (`wqkv`), an output gate z (`wz`), and per
value head a step size beta = sigmoid(b) (`wb`) and a log decay
g = -exp(A_log) * softplus(a + dt_bias) (`wa`); Qwen3-Next fuses them in `wqkvz` and `wba`,
rows grouped by key head. q, k and v go through a causal depthwise conv with SiLU
(`conv_weight`), q and k are L2-normalised per head, and the gated delta rule
(`pipeline.core.kernels.gated_delta`) turns them into one output per value head. A gated RMSNorm
(`norm`: rms-normalised output * weight * silu(z)) and `wo` finish. The conv's channels, and
the rows of `wqkv`, are grouped by key head (`grouped_channel_order`; the Hugging Face readers
and writers reorder them), so tensor parallelism splits every tensor of the layer into
contiguous runs of heads.

Instead of a growing KV cache the layer carries, per sequence, the conv's last `width - 1`
inputs and the rule's state `[value_heads, key_head_dim, value_head_dim]`. Packed documents
(`document_ids`) each start from zero: the tokens are regrouped one document a row, run, and put
back, so a packed batch computes what each document computes alone. With a `cache` (the
engine's state slots, `LayerStateCache`) each row is one sequence carrying its state on.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Partial

from pipeline.core.kernels.gated_delta import causal_conv1d, gated_delta_rule, l2_normalize
from pipeline.core.model.config import LinearAttentionConfig, ModelConfig
from pipeline.core.model.feed_forward import init_linear

LINEAR_ATTENTION_BACKENDS = ("auto", "torch", "fla")


def grouped_channel_order(shape: LinearAttentionConfig) -> torch.Tensor:
    """Where each of our conv channels (and `wqkv` rows) sits in Hugging Face's order.

    Hugging Face keeps the conv's channels (and Qwen3.5's in_proj_qkv rows) as all queries, all
    keys, all values. Ours are grouped by key head: key head h's query, its key, then the values
    of the value heads it serves, head after head, so that tensor parallelism splits every such
    tensor in contiguous pieces, each rank a run of key heads. `ours = theirs[order]`;
    `theirs = ours[order.argsort()]`."""
    per_key = shape.num_value_heads // shape.num_key_heads
    dk, values = shape.key_head_dim, per_key * shape.value_head_dim
    parts = []
    for h in range(shape.num_key_heads):
        parts += [
            torch.arange(h * dk, (h + 1) * dk),
            shape.key_dim + torch.arange(h * dk, (h + 1) * dk),
            2 * shape.key_dim + torch.arange(h * values, (h + 1) * values),
        ]
    return torch.cat(parts)


class LayerStateCache(Protocol):
    """One linear-attention layer's state slots for the rows of one batch.

    `valid` `[batch, new]`: which new tokens are real (rows shorter than the batch's longest
    are padded at their end), None when all are; the state is left as it is over padding."""

    valid: torch.Tensor | None

    def read(self) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """(conv window `[batch, conv_channels, width - 1]`, rule state `[batch, heads,
        key_dim, value_dim]`), both fp32; None for rows that start afresh (all rows)."""
        ...

    def write(self, window: torch.Tensor, state: torch.Tensor) -> None:
        """Keep the rows' windows and states after this batch's tokens."""
        ...


@dataclass(frozen=True)
class DocumentRows:
    """Where each document of a packed batch lies: `index[d, p]` is the flat position (in
    batch * tokens) of document d's p-th token, `valid[d, p]` whether there is one."""

    index: torch.Tensor
    valid: torch.Tensor

    @staticmethod
    def of(document_ids: torch.Tensor | None) -> DocumentRows | None:
        """The documents of `document_ids` `[batch, tokens]` (a new document where the id
        changes, and at each row's start); None when each row is one document."""
        if document_ids is None:
            return None
        batch, tokens = document_ids.shape
        starts = torch.ones_like(document_ids, dtype=torch.bool)
        starts[:, 1:] = document_ids[:, 1:] != document_ids[:, :-1]
        if int(starts.sum()) == batch:
            return None
        starts = starts.flatten()
        document = starts.cumsum(0) - 1
        first = torch.nonzero(starts).squeeze(1)
        position = torch.arange(batch * tokens, device=starts.device) - first[document]
        count = int(document[-1]) + 1
        longest = int(torch.bincount(document).max())
        index = torch.zeros(count, longest, dtype=torch.long, device=starts.device)
        valid = torch.zeros(count, longest, dtype=torch.bool, device=starts.device)
        index[document, position] = torch.arange(batch * tokens, device=starts.device)
        valid[document, position] = True
        return DocumentRows(index, valid)

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """`[batch, tokens, *rest]` -> `[documents, longest, *rest]`, zeros after each end."""
        rows = x.flatten(0, 1)[self.index]
        mask = self.valid.view(*self.valid.shape, *([1] * (x.dim() - 2)))
        return rows * mask.to(rows.dtype)

    def scatter(self, rows: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        """The inverse of `gather`: `[documents, longest, *rest]` -> `like`'s batch layout."""
        out = rows.new_zeros(like.shape[0] * like.shape[1], *rows.shape[2:])
        out[self.index[self.valid]] = rows[self.valid]
        return out.view(*like.shape[:2], *rows.shape[2:])


def local(param: torch.Tensor) -> torch.Tensor:
    """This rank's part of a parameter that tensor parallelism made a DTensor: a head-sharded
    one's local heads; a replicated one (the gated norm's weight, which every head uses) as is,
    its gradient marked partial so that it is summed over the ranks' heads. A plain tensor as
    it is."""
    if not isinstance(param, DTensor):
        return param
    if param.placements[0].is_replicate():
        return param.to_local(grad_placements=[Partial()])
    return param.to_local()


class GatedRMSNorm(nn.Module):
    """rms-normalised x * weight * silu(gate), per value head (fp32 inside, x's dtype out)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim))

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        out = local(self.weight) * x32.to(x.dtype)
        return (out * F.silu(gate.float())).to(x.dtype)

    def init_weights(self) -> None:
        nn.init.ones_(self.weight)


class GatedDeltaNet(nn.Module):
    """Gated DeltaNet linear attention (module docstring), `config.linear_attention`'s shape.

    `kind` is "linear" (code that treats attention families differently asks it). The same
    signature as `Attention`: (x, rope, document_ids, cache=); RoPE is not used."""

    kind = "linear"

    def __init__(self, config: ModelConfig, backend: str = "auto") -> None:
        super().__init__()
        shape = config.linear_attention
        if backend not in LINEAR_ATTENTION_BACKENDS:
            raise ValueError(
                f"unknown linear attention backend {backend!r}; choose one of "
                f"{', '.join(LINEAR_ATTENTION_BACKENDS)}"
            )
        self.shape = shape
        self.backend = backend
        h = config.hidden_size
        self.interleaved = shape.interleaved_projections
        if self.interleaved:
            self.wqkvz = nn.Linear(h, 2 * shape.key_dim + 2 * shape.value_dim, bias=False)
            self.wba = nn.Linear(h, 2 * shape.num_value_heads, bias=False)
        else:
            self.wqkv = nn.Linear(h, shape.conv_dim, bias=False)
            self.wz = nn.Linear(h, shape.value_dim, bias=False)
            self.wb = nn.Linear(h, shape.num_value_heads, bias=False)
            self.wa = nn.Linear(h, shape.num_value_heads, bias=False)
        self.conv_weight = nn.Parameter(torch.empty(shape.conv_dim, 1, shape.conv_kernel_size))
        self.A_log = nn.Parameter(torch.empty(shape.num_value_heads))
        self.dt_bias = nn.Parameter(torch.empty(shape.num_value_heads))
        self.norm = GatedRMSNorm(shape.value_head_dim, config.norm_eps)
        self.wo = nn.Linear(shape.value_dim, h, bias=False)

    def _project(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """(the conv's input, z, b, a), each `[batch, tokens, this rank's channels]`; the conv's
        channels grouped by key head (`grouped_channel_order`), z, b and a by value head."""
        if not self.interleaved:
            return self.wqkv(x), self.wz(x), self.wb(x), self.wa(x)
        batch, tokens, _ = x.shape
        s = self.shape
        per_key = s.num_value_heads // s.num_key_heads
        conv_width = 2 * s.key_head_dim + per_key * s.value_head_dim
        # Rows grouped by key head: [q, k, that head's values, that head's gates].
        qkvz = self.wqkvz(x).view(batch, tokens, -1, conv_width + per_key * s.value_head_dim)
        mixed, z = qkvz.split([conv_width, per_key * s.value_head_dim], dim=-1)
        b, a = self.wba(x).view(batch, tokens, -1, 2 * per_key).split([per_key, per_key], dim=-1)
        flat = (t.reshape(batch, tokens, -1) for t in (mixed, z, b, a))
        return tuple(flat)

    def _split_heads(self, mixed: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The conv's output `[rows, tokens, channels]` (grouped by key head) as q and k
        `[rows, tokens, key heads, key_head_dim]` and v `[rows, tokens, value heads,
        value_head_dim]`."""
        s = self.shape
        rows, tokens, _ = mixed.shape
        per_key = s.num_value_heads // s.num_key_heads
        widths = [s.key_head_dim, s.key_head_dim, per_key * s.value_head_dim]
        q, k, v = mixed.view(rows, tokens, -1, sum(widths)).split(widths, dim=-1)
        return q, k, v.reshape(rows, tokens, -1, s.value_head_dim)

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor] | None,
        document_ids: torch.Tensor | None,
        *,
        cache: LayerStateCache | None = None,
    ) -> torch.Tensor:
        s = self.shape
        batch, tokens, _ = x.shape
        mixed, z, b, a = self._project(x)
        beta = b.sigmoid()
        g = -local(self.A_log).float().exp() * F.softplus(a.float() + local(self.dt_bias))
        window = state = lengths = None
        documents = None
        if cache is not None:
            window, state = cache.read()
            if cache.valid is not None:  # padding neither decays nor writes the state
                beta, g = beta * cache.valid[..., None], g * cache.valid[..., None]
                lengths = cache.valid.sum(1)
        else:
            documents = DocumentRows.of(document_ids)
            if documents is not None:
                mixed, beta, g = (documents.gather(t) for t in (mixed, beta, g))
        mixed, window = causal_conv1d(mixed, local(self.conv_weight), window, lengths)
        q, k, v = self._split_heads(mixed)
        q, k = l2_normalize(q.float()), l2_normalize(k.float())
        per_key = s.num_value_heads // s.num_key_heads
        if per_key > 1:
            q, k = q.repeat_interleave(per_key, dim=2), k.repeat_interleave(per_key, dim=2)
        out, state = gated_delta_rule(q, k, v, g, beta, state, self._backend(x))
        if cache is not None:
            cache.write(window.float(), state)
        if documents is not None:
            out = documents.scatter(out, x)
        out = self.norm(out, z.view(batch, tokens, -1, s.value_head_dim))
        return self.wo(out.reshape(batch, tokens, -1))

    def _backend(self, x: torch.Tensor) -> str:
        if self.backend != "auto":
            return self.backend
        if not x.is_cuda:
            return "torch"
        try:
            import fla  # noqa: F401
        except ImportError:
            return "torch"
        return "fla"

    def init_weights(self, std: float, out_std: float) -> None:
        """Projections normal(std), `wo` normal(out_std); the conv as torch initialises a
        depthwise conv (uniform, bound 1/sqrt(width)); A = exp(A_log) uniform in [1, 16] and
        dt_bias one, as the published models start; the norm's weight one."""
        for name in ("wqkvz", "wba", "wqkv", "wz", "wb", "wa"):
            if hasattr(self, name):
                init_linear(getattr(self, name), std)
        init_linear(self.wo, out_std)
        bound = self.shape.conv_kernel_size**-0.5
        nn.init.uniform_(self.conv_weight, -bound, bound)
        with torch.no_grad():
            self.A_log.copy_(torch.empty_like(self.A_log).uniform_(1, 16).log())
        nn.init.ones_(self.dt_bias)
        self.norm.init_weights()

    def extra_repr(self) -> str:
        return f"backend={self.backend}, interleaved={self.interleaved}"
