"""pipe's C kernel for one query per row on a CPU (`pipeline.core.kernels.cpu_decode_attention`)
and the build of native code behind it (`pipeline.common.native_library`).

The oracle is attention written out in float64 (repeated key heads, masked softmax, the sink as
one more column); SDPA agrees with it to the same tolerance. Bit-for-bit claims (layouts, the
batch around a row) compare the kernel with itself."""

from __future__ import annotations

import contextlib
import logging
from pathlib import Path
from unittest import mock

import pytest
import torch
import torch.nn.functional as F

from pipeline.common import native_library
from pipeline.core.kernels import cpu_decode_attention
from pipeline.core.kernels.attention import attention, masked_sdpa
from pipeline.core.kernels.cpu_decode_attention import decode_attention, serves


@pytest.fixture(autouse=True)
def _fresh_build(tmp_path, monkeypatch):
    """Each test builds into its own cache (the build is ~0.2 s) and sees its own environment."""
    monkeypatch.setenv("PIPE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("PIPE_NATIVE_KERNELS", raising=False)
    native_library.load.cache_clear()
    yield
    native_library.load.cache_clear()


@contextlib.contextmanager
def torch_threads(count: int):
    """torch computing on `count` threads inside the block (the kernel serves one thread only)."""
    before = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def reference(q, k, v, mask, sinks):
    """softmax(q k^T / sqrt(d)) v in float64, key heads repeated for their query heads."""
    rows, heads, _, dim = q.shape
    group = heads // k.shape[1]
    k, v = (t.double().repeat_interleave(group, 1) for t in (k, v))
    scores = (q.double() @ k.transpose(-1, -2)) * dim**-0.5
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    if sinks is not None:
        sink = sinks.double().view(1, heads, 1, 1).expand(rows, heads, 1, 1)
        scores = torch.cat((scores, sink), dim=-1)
    return scores.softmax(-1)[..., : k.shape[2]] @ v


def random_inputs(rows, heads, kv_heads, qk_dim, v_dim, length, seed=0):
    generator = torch.Generator().manual_seed(seed)
    q = torch.randn(rows, heads, 1, qk_dim, generator=generator)
    k = torch.randn(rows, kv_heads, length, qk_dim, generator=generator) * 2
    v = torch.randn(rows, kv_heads, length, v_dim, generator=generator)
    mask = torch.rand(rows, 1, 1, length, generator=generator) < 0.7
    mask[..., -1] = True  # a decoding row always sees its own new key
    sinks = torch.randn(heads, generator=generator)
    return q, k, v, mask, sinks


SHAPES = [  # heads, kv_heads, qk_dim, v_dim
    (8, 4, 64, 64),  # the serving benchmark's model: groups of two
    (8, 8, 80, 80),  # no grouping; a head size of five vectors
    (12, 2, 128, 64),  # groups of six; values narrower than keys (latent attention's shape)
    (4, 1, 3, 5),  # heads smaller than one vector: all of it the scalar tail
]


@pytest.mark.parametrize("heads,kv_heads,qk_dim,v_dim", SHAPES)
@pytest.mark.parametrize("length", [1, 15, 16, 17, 130])
def test_kernel_equals_attention_in_float64(heads, kv_heads, qk_dim, v_dim, length):
    q, k, v, mask, sinks = random_inputs(5, heads, kv_heads, qk_dim, v_dim, length)
    for m in (mask, None):
        for s in (None, sinks):
            out = decode_attention(q, k, v, m, s)
            assert out.shape == (5, heads, 1, v_dim) and out.dtype == torch.float32
            torch.testing.assert_close(out.double(), reference(q, k, v, m, s), rtol=0, atol=1e-5)
            if qk_dim == v_dim:  # SDPA's own answer is within the same bound
                torch.testing.assert_close(out, masked_sdpa(q, k, v, m, s), rtol=0, atol=1e-5)


def test_a_row_that_sees_no_key_gets_zeros_as_from_sdpa():
    """A padded row of a static decode batch has no visible key: zeros, as SDPA gives, not NaN."""
    q, k, v, mask, sinks = random_inputs(3, 8, 4, 64, 64, 20)
    mask[1] = False
    for s in (None, sinks):
        out = decode_attention(q, k, v, mask, s)
        assert torch.equal(out[1], torch.zeros_like(out[1]))
        torch.testing.assert_close(out, masked_sdpa(q, k, v, mask, s), rtol=0, atol=1e-5)


def test_every_layout_gives_the_same_bits():
    """Keys kept position by position, head by head, or gathered contiguous: the same bits."""
    q, k, v, mask, _ = random_inputs(4, 8, 4, 64, 64, 40)
    capacity = 64
    by_position = [torch.zeros(4, capacity, 4, 64) for _ in "kv"]
    by_head = [torch.zeros(4, 4, capacity, 64) for _ in "kv"]
    for buffer, t in zip(by_position, (k, v)):
        buffer[:, :40] = t.transpose(1, 2)
    for buffer, t in zip(by_head, (k, v)):
        buffer[:, :, :40] = t
    views = {
        "contiguous": (k, v),
        "by position": tuple(b[:, :40].transpose(1, 2) for b in by_position),
        "by head": tuple(b[:, :, :40] for b in by_head),
    }
    outs = {name: decode_attention(q, *kv, mask) for name, kv in views.items()}
    assert not views["by position"][0].is_contiguous()
    for name, out in outs.items():
        assert torch.equal(out, outs["contiguous"]), name


def test_a_row_does_not_depend_on_the_batch_around_it():
    """A row alone over its own length, and the same row among others padded to a longer
    history (NaN and infinities past its length, hidden by the mask, as a freed row's stale or
    never-written entries may be): the same bits."""
    q, k, v, _, _ = random_inputs(6, 8, 4, 64, 64, 90, seed=1)
    lengths = [90, 33, 61, 7, 90, 48]
    mask = torch.arange(90)[None, :] < torch.tensor(lengths)[:, None]
    hidden = ~mask[:, None, :, None].expand_as(k)
    k = k.masked_fill(hidden, float("nan"))
    v = v.masked_fill(hidden, float("inf"))
    batch = decode_attention(q, k, v, mask[:, None, None, :])
    assert batch.isfinite().all()
    for row, length in enumerate(lengths):
        alone = decode_attention(
            q[row : row + 1], k[row : row + 1, :, :length], v[row : row + 1, :, :length], None
        )
        assert torch.equal(batch[row], alone[0]), row


def test_attention_sends_one_query_per_row_to_the_kernel():
    """`attention` over a cache (causal=False, a mask) with one float32 query per row on a CPU
    on one thread goes to the kernel; anything else stays with SDPA."""
    q, k, v, mask, sinks = random_inputs(3, 8, 4, 64, 64, 20)
    with (
        mock.patch.object(
            cpu_decode_attention, "decode_attention", wraps=decode_attention
        ) as kernel,
        torch_threads(1),
    ):
        attention(q, k, v, causal=False, mask=mask)
        attention(q, k, v, causal=False, mask=mask, sinks=sinks)
        attention(q, k, v, causal=False, mask=mask, backend="flex")
        assert kernel.call_count == 3
        attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), causal=False, mask=mask)
        two = torch.cat((q, q), dim=2)
        attention(two, k, v, causal=False, mask=mask.expand(3, 1, 2, 20))
        attention(q, k, v, causal=True)
        slopes = torch.linspace(0.1, 0.8, 8)
        attention(q, k, v, causal=False, mask=mask, alibi_slopes=slopes)
        with torch_threads(2):  # SDPA spreads over the threads; the kernel would not
            attention(q, k, v, causal=False, mask=mask)
        attention(q.requires_grad_(), k, v, causal=False, mask=mask).sum().backward()
        assert kernel.call_count == 3
    assert q.grad is not None


def test_options_off_and_without_a_compiler_torch_attends(monkeypatch, caplog):
    """`PIPE_NATIVE_KERNELS=0`: no build is tried. No compiler: one warning, then SDPA. Either
    way `attention` still answers, with SDPA's bits (all on one thread, where the kernel would
    otherwise serve: SDPA's bits for one query differ between one thread and two)."""
    q, k, v, mask, _ = random_inputs(3, 8, 4, 64, 64, 20)
    options = dict(causal=False, document_ids=None, alibi_slopes=None, window=None)
    with torch_threads(1):
        sdpa = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)

        monkeypatch.setenv("PIPE_NATIVE_KERNELS", "0")
        with mock.patch.object(native_library, "compiler") as find:
            assert not serves(q, k, v, mask, **options)
            find.assert_not_called()
        assert torch.equal(attention(q, k, v, causal=False, mask=mask), sdpa)

        monkeypatch.delenv("PIPE_NATIVE_KERNELS")
        native_library.load.cache_clear()
        with (
            mock.patch.object(native_library, "compiler", return_value=None),
            caplog.at_level(logging.WARNING, logger=native_library.__name__),
        ):
            assert not serves(q, k, v, mask, **options)
            assert not serves(q, k, v, mask, **options)
            assert torch.equal(attention(q, k, v, causal=False, mask=mask), sdpa)
        native_library.load.cache_clear()
        assert serves(q, k, v, mask, **options)  # with the compiler again: the kernel's
        assert not torch.equal(attention(q, k, v, causal=False, mask=mask), sdpa)
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 1 and "no C compiler found" in warnings[0], warnings
    assert "cpu_decode_attention.c" in warnings[0]


def test_build_is_kept_keyed_and_never_half_written(tmp_path, monkeypatch, caplog):
    """The library lands in pipe's cache under a name keyed by its source; a second process
    loads it without compiling; an edited source builds another; a failing compiler leaves a
    warning naming it, no library and no temporary file."""
    source = Path(cpu_decode_attention.SOURCE)
    assert native_library.load(source) is not None
    built = sorted((tmp_path / "cache" / "native").iterdir())
    assert len(built) == 1 and built[0].name.startswith("cpu_decode_attention-")
    assert built[0].suffix == ".so"

    native_library.load.cache_clear()
    with mock.patch.object(native_library.subprocess, "run", side_effect=AssertionError):
        assert native_library.load(source) is not None  # from the cache: nothing compiled

    edited = tmp_path / "cpu_decode_attention.c"
    edited.write_text(source.read_text() + "\n/* edited */\n")
    assert native_library.load(edited) is not None
    assert len(list((tmp_path / "cache" / "native").iterdir())) == 2

    broken = tmp_path / "broken.c"
    broken.write_text("this is not C\n")
    monkeypatch.setenv("CC", "cc")
    with caplog.at_level(logging.WARNING, logger=native_library.__name__):
        assert native_library.load(broken) is None
    assert "broken.c was not built (cc -O3" in caplog.text
    assert caplog.text.count("\n") == 1  # one line
    names = [p.name for p in (tmp_path / "cache" / "native").iterdir()]
    assert not any(name.startswith("broken") or ".tmp-" in name for name in names), names
