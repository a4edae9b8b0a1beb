"""Context parallelism: load-balanced sharding, exact all-gather attention (forward and backward)
and a whole model under cp=2 against the single-process reference."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from pipeline.core.kernels.attention import attention
from pipeline.core.model.transformer import Transformer
from pipeline.core.parallel.context_parallel import (
    apply_context_parallel,
    context_parallel_attention,
    cp_position_ids,
    shard_sequence,
    unshard_sequence,
)
from tests.builders import micro_model_config
from tests.distributed import run_distributed

TOL = 1e-5


# ---------------------------------------------------------------------------------------------
# Unit: sharding and positions
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("cp_size", [1, 2, 3, 4])
def test_shard_unshard_round_trip(cp_size: int) -> None:
    x = torch.randn(2, 24, 5)
    shards = [shard_sequence(x, r, cp_size) for r in range(cp_size)]
    assert all(s.shape == (2, 24 // cp_size, 5) for s in shards)
    torch.testing.assert_close(unshard_sequence(shards, cp_size), x, rtol=0, atol=0)
    # dim other than 1
    y = torch.randn(3, 4, 24)
    ys = [shard_sequence(y, r, cp_size, dim=2) for r in range(cp_size)]
    torch.testing.assert_close(unshard_sequence(ys, cp_size, dim=2), y, rtol=0, atol=0)


def test_position_ids_are_load_balanced_chunks() -> None:
    # 8 tokens, cp 2: chunks of 2; rank 0 holds chunks 0 and 3, rank 1 chunks 1 and 2.
    assert cp_position_ids(8, 0, 2).tolist() == [0, 1, 6, 7]
    assert cp_position_ids(8, 1, 2).tolist() == [2, 3, 4, 5]
    all_pos = torch.cat([cp_position_ids(24, r, 3) for r in range(3)])
    assert sorted(all_pos.tolist()) == list(range(24))
    tokens = torch.arange(100, 124)[None]
    for r in range(3):
        assert (shard_sequence(tokens, r, 3) - 100).squeeze(0).tolist() == (
            cp_position_ids(24, r, 3).tolist()
        )


def test_bad_sizes_raise() -> None:
    with pytest.raises(ValueError, match="divisible"):
        shard_sequence(torch.zeros(1, 10), 0, 3)
    with pytest.raises(ValueError, match="outside"):
        shard_sequence(torch.zeros(1, 8), 2, 2)


# ---------------------------------------------------------------------------------------------
# Attention: cp=2 equals full attention, forward and backward
# ---------------------------------------------------------------------------------------------


def _gather_unshard(x: torch.Tensor, world: int, dim: int) -> torch.Tensor:
    parts = [torch.empty_like(x) for _ in range(world)]
    dist.all_gather(parts, x.contiguous())
    return unshard_sequence(parts, world, dim=dim)


def _attention_check(rank: int, world: int, tmp: Path, causal: bool, with_docs: bool) -> None:
    torch.manual_seed(0)
    b, hq, hkv, s, d = 2, 4, 2, 16, 8
    q = torch.randn(b, hq, s, d, requires_grad=True)
    k = torch.randn(b, hkv, s, d, requires_grad=True)
    v = torch.randn(b, hkv, s, d, requires_grad=True)
    grad_out = torch.randn(b, hq, s, d)
    docs = torch.tensor([[0] * 5 + [1] * 7 + [2] * 4, [0] * 16]) if with_docs else None

    ref = attention(q, k, v, causal=causal, document_ids=docs)
    ref.backward(grad_out)

    lq, lk, lv = (
        shard_sequence(t.detach(), rank, world, dim=2).requires_grad_() for t in (q, k, v)
    )
    local_docs = shard_sequence(docs, rank, world) if docs is not None else None
    out = context_parallel_attention(
        lq, lk, lv, None, rank, world, causal=causal, document_ids=local_docs
    )
    out.backward(shard_sequence(grad_out, rank, world, dim=2))

    torch.testing.assert_close(_gather_unshard(out.detach(), world, 2), ref, rtol=0, atol=TOL)
    for local, full in ((lq, q), (lk, k), (lv, v)):
        got = _gather_unshard(local.grad, world, 2)
        torch.testing.assert_close(got, full.grad, rtol=0, atol=TOL)


@pytest.mark.dist
@pytest.mark.parametrize(
    ("causal", "with_docs"), [(True, False), (False, False), (True, True)], ids=str
)
def test_cp_attention_matches_full(tmp_path: Path, causal: bool, with_docs: bool) -> None:
    run_distributed(_attention_check, 2, tmp_path, causal, with_docs)


# ---------------------------------------------------------------------------------------------
# Whole model: cp=2 loss and gradients equal the single-process reference
# ---------------------------------------------------------------------------------------------


def _tiny_model() -> Transformer:
    cfg = micro_model_config(rope_theta=1e4)
    torch.manual_seed(0)
    model = Transformer(cfg)
    model.init_weights()
    return model


def _token_loss_sum(model: Transformer, tokens, labels, position_ids=None) -> torch.Tensor:
    logits = model.logits(tokens, position_ids)
    return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum")


def _model_check(rank: int, world: int, tmp: Path) -> None:
    batch, seq = 2, 16
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 128, (batch, seq + 1), generator=gen)
    inputs, labels = tokens[:, :-1], tokens[:, 1:]
    n_tokens = labels.numel()

    ref_model = _tiny_model()
    ref_loss = _token_loss_sum(ref_model, inputs, labels) / n_tokens
    ref_loss.backward()

    model = apply_context_parallel(_tiny_model(), None, rank, world)
    pos = cp_position_ids(seq, rank, world).expand(batch, -1)
    local_loss = (
        _token_loss_sum(
            model,
            shard_sequence(inputs, rank, world),
            shard_sequence(labels, rank, world),
            pos,
        )
        / n_tokens  # normalise by the global token count, so the cp sum is the mean
    )
    local_loss.backward()

    loss = local_loss.detach().clone()
    dist.all_reduce(loss)
    torch.testing.assert_close(loss, ref_loss.detach(), rtol=0, atol=TOL)
    ref_grads = dict(ref_model.named_parameters())
    for name, p in model.named_parameters():
        grad = p.grad.clone()
        dist.all_reduce(grad)
        torch.testing.assert_close(grad, ref_grads[name].grad, rtol=0, atol=TOL, msg=name)


@pytest.mark.dist
def test_cp_model_matches_single_process(tmp_path: Path) -> None:
    run_distributed(_model_check, 2, tmp_path)
