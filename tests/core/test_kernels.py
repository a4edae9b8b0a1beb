"""Kernels against plain torch references: attention (GQA, document masks) and the chunked
linear cross-entropy (value and gradients). CPU, fp32."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from pipeline.core.kernels import cross_entropy
from pipeline.core.kernels.attention import attention, document_causal_mask
from pipeline.core.kernels.cross_entropy import chunked_linear_cross_entropy


def _reference_attention(q, k, v, mask):
    """softmax(q k^T / sqrt(d) + mask) v with kv heads repeated for each query group."""
    groups = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(groups, dim=1)
    v = v.repeat_interleave(groups, dim=1)
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    scores = scores.masked_fill(~mask, float("-inf"))
    return torch.softmax(scores, dim=-1) @ v


@pytest.mark.parametrize("kv_heads", [4, 2, 1])
def test_attention_causal_gqa(kv_heads: int) -> None:
    torch.manual_seed(0)
    q = torch.randn(2, 4, 7, 8)
    k, v = torch.randn(2, kv_heads, 7, 8), torch.randn(2, kv_heads, 7, 8)
    causal = torch.ones(7, 7, dtype=torch.bool).tril()
    expected = _reference_attention(q, k, v, causal)
    assert torch.allclose(attention(q, k, v), expected, atol=1e-5)


def test_attention_document_mask() -> None:
    torch.manual_seed(0)
    q, k, v = torch.randn(2, 4, 6, 8), torch.randn(2, 2, 6, 8), torch.randn(2, 2, 6, 8)
    document_ids = torch.tensor([[0, 0, 1, 1, 1, 2], [5, 5, 5, 5, 5, 5]])
    mask = document_causal_mask(document_ids)
    assert mask.shape == (2, 1, 6, 6)
    assert not mask[0, 0, 2, 1] and mask[0, 0, 4, 2] and not mask[0, 0, 2, 4]
    expected = _reference_attention(q, k, v, mask)
    out = attention(q, k, v, document_ids=document_ids)
    assert torch.allclose(out, expected, atol=1e-5)
    # One document per row is plain causal attention.
    assert torch.allclose(out[1], attention(q, k, v)[1], atol=1e-6)


def test_attention_errors() -> None:
    q, k = torch.randn(1, 3, 4, 8), torch.randn(1, 2, 4, 8)
    with pytest.raises(ValueError, match="multiple"):
        attention(q, k, k)
    with pytest.raises(ValueError, match="unknown attention backend"):
        attention(k, k, k, backend="nope")


@pytest.mark.parametrize("chunk_tokens", [1, 5, 64])
def test_chunked_cross_entropy_matches_full(chunk_tokens: int) -> None:
    torch.manual_seed(0)
    hidden = torch.randn(3, 7, 16, requires_grad=True)
    weight = torch.randn(50, 16, requires_grad=True)
    labels = torch.randint(0, 50, (3, 7))
    loss_mask = (torch.rand(3, 7) > 0.3).float()
    labels[loss_mask == 0] = -100  # masked positions may hold any label

    loss, count = chunked_linear_cross_entropy(hidden, weight, labels, loss_mask, chunk_tokens)
    (2.0 * loss).backward()
    got = hidden.grad.clone(), weight.grad.clone()
    hidden.grad, weight.grad = None, None

    logits = hidden @ weight.t()
    ce = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="none")
    ref = (ce * loss_mask.flatten()).sum()
    (2.0 * ref).backward()

    assert count == loss_mask.sum()
    assert torch.allclose(loss, ref, atol=1e-5)
    assert torch.allclose(got[0], hidden.grad, atol=1e-5)
    assert torch.allclose(got[1], weight.grad, atol=1e-5)


def test_chunked_cross_entropy_without_mask_or_grad() -> None:
    torch.manual_seed(0)
    hidden, weight = torch.randn(10, 8), torch.randn(20, 8)
    labels = torch.randint(0, 20, (10,))
    loss, count = chunked_linear_cross_entropy(hidden, weight, labels, chunk_tokens=3)
    ref = F.cross_entropy(hidden @ weight.t(), labels, reduction="sum")
    assert count == 10 and torch.allclose(loss, ref, atol=1e-5)
    assert not loss.requires_grad
    weight.requires_grad_(True)
    with torch.no_grad():
        assert torch.allclose(
            chunked_linear_cross_entropy(hidden, weight, labels)[0], ref, atol=1e-5
        )
    # Gradient for the weight only (e.g. frozen inputs).
    chunked_linear_cross_entropy(hidden, weight, labels, chunk_tokens=4)[0].backward()
    weight_grad = weight.grad.clone()
    weight.grad = None
    F.cross_entropy(hidden @ weight.t(), labels, reduction="sum").backward()
    assert torch.allclose(weight_grad, weight.grad, atol=1e-5)


def test_chunked_cross_entropy_bf16() -> None:
    """bf16 inputs: logits are scored in fp32 per chunk, gradients come back in bf16 and agree
    with the fp32 reference to bf16 precision."""
    torch.manual_seed(0)
    hidden32, weight32 = torch.randn(12, 16), torch.randn(40, 16) * 0.3
    labels = torch.randint(0, 40, (12,))
    hidden = hidden32.bfloat16().requires_grad_(True)
    weight = weight32.bfloat16().requires_grad_(True)
    loss, _ = chunked_linear_cross_entropy(hidden, weight, labels, chunk_tokens=5)
    loss.backward()
    assert loss.dtype == torch.float32
    assert hidden.grad.dtype == weight.grad.dtype == torch.bfloat16
    hidden32.requires_grad_(True)
    weight32.requires_grad_(True)
    ref = F.cross_entropy(hidden32 @ weight32.t(), labels, reduction="sum")
    ref.backward()
    assert torch.allclose(loss, ref, rtol=2e-2)
    assert torch.allclose(hidden.grad.float(), hidden32.grad, atol=5e-2)
    assert torch.allclose(weight.grad.float(), weight32.grad, atol=5e-2)


def test_the_full_vocab_scorer_is_one_graph_and_falls_back_to_eager(monkeypatch, caplog):
    """The chunk scoring compiled on a GPU: captured whole (fullgraph; traced here with the
    eager backend, as inductor's CPU compile would cost the suite seconds) and equal to
    cross-entropy and its logit gradient; a compiler failure leaves a warning and eager."""
    torch.manual_seed(0)
    logits = torch.randn(6, 50, requires_grad=True)
    y, m = torch.randint(0, 50, (6,)), torch.tensor([1.0, 0, 2, 1, 1, 0.5])
    reference = (F.cross_entropy(logits, y, reduction="none") * m).sum()
    reference.backward()
    compile_ = torch.compile
    monkeypatch.setattr(torch, "compile", lambda f, **kw: compile_(f, backend="eager", **kw))
    scorer = cross_entropy.CompiledScorer(devices=("cpu",))
    loss, grad = scorer(logits.detach(), y, m)
    assert scorer.compiled is not None and not scorer.failed
    torch.testing.assert_close(loss, reference.detach(), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(grad, logits.grad, rtol=1e-6, atol=1e-6)

    def broken(*args):
        raise RuntimeError("no compiler here\nmore lines")

    monkeypatch.setattr(torch, "compile", lambda f, **kw: broken)
    scorer = cross_entropy.CompiledScorer(devices=("cpu",))
    with caplog.at_level("WARNING"):
        torch.testing.assert_close(scorer(logits.detach(), y, m)[1], grad, rtol=1e-6, atol=1e-6)
    assert scorer.failed and "compiling it failed (no compiler here)" in caplog.text


def test_resolve_backend_auto_and_explicit():
    from pipeline.core.kernels.attention import resolve_backend

    cpu = torch.device("cpu")
    assert resolve_backend("auto", device=cpu, document_masking=False) == "sdpa"
    assert resolve_backend("flash_attn", device=cpu, document_masking=False) == "flash_attn"
    with pytest.raises(ValueError, match="unknown attention backend 'xformers'"):
        resolve_backend("xformers", device=cpu, document_masking=False)


@pytest.mark.gpu
def test_flash_attn_backend_matches_sdpa():
    pytest.importorskip("flash_attn")
    from pipeline.core.kernels.attention import attention

    torch.manual_seed(0)
    q = torch.randn(2, 8, 128, 64, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(2, 2, 128, 64, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(2, 2, 128, 64, device="cuda", dtype=torch.bfloat16)
    reference = attention(q, k, v, backend="sdpa").float()
    flash = attention(q, k, v, backend="flash_attn").float()
    torch.testing.assert_close(flash, reference, atol=2e-2, rtol=2e-2)


def test_flash_attn_backend_refuses_document_masking():
    from pipeline.core.kernels.attention import attention

    q = torch.randn(1, 2, 4, 8)
    with pytest.raises((ValueError, ImportError), match="flash"):
        attention(q, q, q, document_ids=torch.zeros(1, 4, dtype=torch.long), backend="flash_attn")


def test_fp8_hook_refuses_clearly_and_is_a_no_op_without_a_recipe():
    from pipeline.core.kernels.fp8 import build_fp8

    cpu = torch.device("cpu")
    assert build_fp8(None, cpu) is None
    with pytest.raises(ValueError, match="unknown backend 'fp16'"):
        build_fp8("fp16", cpu)
    with pytest.raises(ValueError, match="FP8 training needs a CUDA GPU; this run is on cpu"):
        build_fp8("torchao:tensorwise", cpu)
