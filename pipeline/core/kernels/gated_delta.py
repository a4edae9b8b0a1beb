"""The gated delta rule (gated DeltaNet's linear attention) and its causal depthwise conv.

Per value head, a state S `[key_dim, value_dim]` runs over the tokens: at token t it decays by
exp(g_t) (g <= 0), then moves towards storing v_t under the key k_t by the delta rule, with
step size beta_t:

    S <- exp(g_t) S;   u_t = beta_t (v_t - S^T k_t);   S <- S + k_t u_t^T;   o_t = S^T q_t

q and k arrive L2-normalised; q is scaled by key_dim^-0.5 here. Two torch forms compute it: the
recurrent one above, token by token (decoding: one or a few tokens with a carried state), and
the chunked one, which solves each chunk of `chunk_size` tokens at once (training and prefill).
In a chunk with cumulative log decays G_i = g_1 + ... + g_i, the updates u satisfy a unit
lower-triangular system,

    u_i + beta_i sum_{j<i} exp(G_i - G_j) (k_i . k_j) u_j = beta_i (v_i - exp(G_i) S_0^T k_i),

and then o_i = exp(G_i) S_0^T q_i + sum_{j<=i} exp(G_i - G_j) (q_i . k_j) u_j and
S_end = exp(G_C) S_0 + sum_j exp(G_C - G_j) k_j u_j^T. Both compute in fp32 and return the
state in fp32. On a GPU the flash-linear-attention package's Triton kernels (`fla`) compute the
same (`backend="fla"`); the torch forms are the reference they are tested against.

Tensors are `[batch, tokens, heads, dim]` (q, k `key_dim`, v `value_dim`), g and beta
`[batch, tokens, heads]`, states `[batch, heads, key_dim, value_dim]`; q and k already have the
value heads' count (a key head repeated for the value heads it serves).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

GATED_DELTA_BACKENDS = ("torch", "fla")
CHUNK_SIZE = 64


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dimension (the eps as flash-linear-attention's)."""
    return x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + eps)


def _zero_state(q: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    batch, _, heads, key_dim = q.shape
    return q.new_zeros(batch, heads, key_dim, v.shape[-1], dtype=torch.float32)


def recurrent_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(outputs `[batch, tokens, heads, value_dim]` in v's dtype, final state in fp32), one
    token at a time (module docstring)."""
    out_dtype = v.dtype
    state = _zero_state(q, v) if initial_state is None else initial_state.float()
    scale = q.shape[-1] ** -0.5
    q, k, v, g, beta = (t.float().transpose(1, 2) for t in (q, k, v, g, beta))
    outputs = []
    for t in range(q.shape[2]):
        state = state * g[:, :, t, None, None].exp()
        remembered = torch.einsum("bhkv,bhk->bhv", state, k[:, :, t])
        update = (v[:, :, t] - remembered) * beta[:, :, t, None]
        state = state + k[:, :, t, :, None] * update[:, :, None, :]
        outputs.append(torch.einsum("bhkv,bhk->bhv", state, q[:, :, t] * scale))
    return torch.stack(outputs, dim=1).to(out_dtype), state


def chunk_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None = None,
    chunk_size: int = CHUNK_SIZE,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The same result as `recurrent_gated_delta_rule`, a chunk of tokens at a time (module
    docstring). Padding the tokens to whole chunks with beta = 0 and g = 0 leaves the state as
    it is, so the final state is that after the last real token."""
    out_dtype = v.dtype
    batch, tokens, heads, key_dim = q.shape
    state = _zero_state(q, v) if initial_state is None else initial_state.float()
    pad = (-tokens) % chunk_size
    # [batch, heads, chunks, chunk, dim] (and [batch, heads, chunks, chunk] for g and beta)
    q, k, v = (
        F.pad(t.float(), (0, 0, 0, 0, 0, pad))
        .transpose(1, 2)
        .reshape(batch, heads, -1, chunk_size, t.shape[-1])
        for t in (q, k, v)
    )
    g, beta = (
        F.pad(t.float(), (0, 0, 0, pad)).transpose(1, 2).reshape(batch, heads, -1, chunk_size)
        for t in (g, beta)
    )
    q = q * key_dim**-0.5
    decay = g.cumsum(-1)  # G_i
    causal = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=q.device).tril()
    # exp(G_i - G_j) for j <= i, zero above the diagonal (masked before exp: no inf * 0).
    pair = (decay[..., :, None] - decay[..., None, :]).masked_fill(~causal, float("-inf")).exp()
    strictly_lower = (k @ k.transpose(-1, -2)) * pair * beta[..., :, None]
    system = strictly_lower.tril(-1) + torch.eye(chunk_size, device=q.device)
    solve = lambda rhs: torch.linalg.solve_triangular(  # noqa: E731
        system, rhs, upper=False, unitriangular=True
    )
    # u = fresh - carried @ S_0 per chunk, before S_0 is known.
    fresh = solve(v * beta[..., None])
    carried = solve(k * (beta * decay.exp())[..., None])
    scores = (q @ k.transpose(-1, -2)) * pair
    q_decayed = q * decay.exp()[..., None]
    k_to_end = k * (decay[..., -1:] - decay).exp()[..., None]
    chunk_decay = decay[..., -1].exp()[..., None, None]
    outputs = []
    for c in range(q.shape[2]):
        update = fresh[:, :, c] - carried[:, :, c] @ state
        outputs.append(q_decayed[:, :, c] @ state + scores[:, :, c] @ update)
        state = state * chunk_decay[:, :, c] + k_to_end[:, :, c].transpose(-1, -2) @ update
    out = torch.stack(outputs, dim=2).reshape(batch, heads, -1, v.shape[-1])[:, :, :tokens]
    return out.transpose(1, 2).to(out_dtype), state


def fla_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The chunked rule by flash-linear-attention's Triton kernel (GPU only)."""
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fla_chunk
    except ImportError:
        raise ImportError(
            "the fla gated-delta backend needs flash-linear-attention: "
            "pip install flash-linear-attention"
        ) from None
    out, state = fla_chunk(
        q,
        k,
        v,
        g=g.float(),
        beta=beta,
        scale=q.shape[-1] ** -0.5,
        initial_state=None if initial_state is None else initial_state.float(),
        output_final_state=True,
    )
    return out.to(v.dtype), state.float()


def gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None = None,
    backend: str = "torch",
) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule by `backend`: "torch" (chunked, or recurrent for a decoding step
    of one or two tokens) or "fla" (Triton, CUDA tensors only)."""
    if backend not in GATED_DELTA_BACKENDS:
        raise ValueError(f"unknown gated delta backend {backend!r}: {GATED_DELTA_BACKENDS}")
    if backend == "fla":
        if not q.is_cuda:
            raise ValueError("the fla gated-delta backend runs on CUDA tensors; use torch")
        return fla_gated_delta_rule(q, k, v, g, beta, initial_state)
    if q.shape[1] <= 2:  # a decoding step: the recurrent form is exact and cheaper
        return recurrent_gated_delta_rule(q, k, v, g, beta, initial_state)
    return chunk_gated_delta_rule(q, k, v, g, beta, initial_state)


def causal_conv1d(
    x: torch.Tensor,
    weight: torch.Tensor,
    window: torch.Tensor | None = None,
    lengths: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """SiLU(depthwise causal conv) of x `[batch, tokens, channels]` with weight
    `[channels, 1, width]`, the `width - 1` inputs before the first token taken from `window`
    `[batch, channels, width - 1]` (zeros when None). Returns the outputs (x's dtype) and the
    new window: the last `width - 1` inputs, for the next call (of each row's first
    `lengths[row]` tokens when given: rows padded at their end)."""
    width = weight.shape[-1]
    x_t = x.transpose(1, 2)
    if window is None:
        window = x_t.new_zeros(x_t.shape[0], x_t.shape[1], width - 1)
    padded = torch.cat((window.to(x_t.dtype), x_t), dim=-1)
    out = F.conv1d(padded.to(weight.dtype), weight, groups=x_t.shape[1])
    if lengths is None:
        new_window = padded[:, :, -(width - 1) :]
    else:  # token t is padded[..., t + width - 1]: a row's last inputs end at its length
        index = lengths[:, None] + torch.arange(width - 1, device=x.device)
        new_window = padded.gather(2, index[:, None, :].expand(-1, padded.shape[1], -1))
    return F.silu(out).to(x.dtype).transpose(1, 2), new_window
