"""Gated DeltaNet linear attention (Qwen3-Next, Qwen3.5): the block `layer_types` puts where it
says "linear_attention", in place of softmax attention.

From the normed input x: queries, keys and values (`wqkv`, or Qwen3-Next's head-grouped
`wqkvz`), an output gate z (`wz`), and per value head a step size beta = sigmoid(b) (`wb`) and a
log decay g = -exp(A_log) * softplus(a + dt_bias) (`wa`). q, k and v go through a causal
depthwise conv with SiLU (`conv_weight`), q and k are L2-normalised per head, and the gated
delta rule (`pipeline.core.kernels.gated_delta`) turns them into one output per value head. A
gated RMSNorm (`norm`: rms-normalised output * weight * silu(z)) and `wo` finish.

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

from pipeline.core.kernels.gated_delta import causal_conv1d, gated_delta_rule, l2_normalize
from pipeline.core.model.config import ModelConfig
from pipeline.core.model.feed_forward import init_linear

LINEAR_ATTENTION_BACKENDS = ("auto", "torch", "fla")


class LayerStateCache(Protocol):
    """One linear-attention layer's state slots for the rows of one batch."""

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


class GatedRMSNorm(nn.Module):
    """rms-normalised x * weight * silu(gate), per value head (fp32 inside, x's dtype out)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim))

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        out = self.weight * x32.to(x.dtype)
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
        """(q, k, v, z, b, a), each `[batch, tokens, this rank's channels]`."""
        s = self.shape
        if not self.interleaved:
            q, k, v = self.wqkv(x).split(self._qkv_widths(), dim=-1)
            return q, k, v, self.wz(x), self.wb(x), self.wa(x)
        batch, tokens, _ = x.shape
        per_key = s.num_value_heads // s.num_key_heads
        # Rows grouped by key head: [q, k, that head's values, that head's gates].
        qkvz = self.wqkvz(x).view(
            batch, tokens, -1, 2 * s.key_head_dim + 2 * per_key * s.value_head_dim
        )
        widths = [
            s.key_head_dim,
            s.key_head_dim,
            per_key * s.value_head_dim,
            per_key * s.value_head_dim,
        ]
        q, k, v, z = (t.reshape(batch, tokens, -1) for t in qkvz.split(widths, dim=-1))
        b, a = self.wba(x).view(batch, tokens, -1, 2 * per_key).split([per_key, per_key], dim=-1)
        return q, k, v, z, b.reshape(batch, tokens, -1), a.reshape(batch, tokens, -1)

    def _qkv_widths(self) -> list[int]:
        """This rank's q, k, v widths: the conv channels' sections (tensor parallelism splits
        each section, so the weight's rows are a third key, a third key, value parts)."""
        s = self.shape
        heads_here = self.A_log.shape[0]  # value heads on this rank
        key_heads = heads_here * s.num_key_heads // s.num_value_heads
        key = key_heads * s.key_head_dim
        return [key, key, heads_here * s.value_head_dim]

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
        q, k, v, z, b, a = self._project(x)
        mixed = torch.cat((q, k, v), dim=-1)
        beta = b.sigmoid()
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)
        window = state = None
        documents = None
        if cache is not None:
            window, state = cache.read()
        else:
            documents = DocumentRows.of(document_ids)
            if documents is not None:
                mixed, beta, g = (documents.gather(t) for t in (mixed, beta, g))
        rows, length = mixed.shape[:2]
        mixed, window = causal_conv1d(mixed, self.conv_weight, window)
        q, k, v = mixed.split(self._qkv_widths(), dim=-1)
        q = l2_normalize(q.float().view(rows, length, -1, s.key_head_dim))
        k = l2_normalize(k.float().view(rows, length, -1, s.key_head_dim))
        v = v.reshape(rows, length, -1, s.value_head_dim)
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
