"""Bring-up checks for a CUDA GPU: each piece of pipe's GPU path against its CPU reference.

All are marked `gpu` and skip without CUDA (`scripts/gpu/run.sh` runs them first on the GPU
machine). Tolerances are those of bf16 against fp32 where bf16 is involved.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.builders import build_model, micro_model_config

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def test_model_loss_and_gradients_on_cuda_match_the_cpu():
    """One forward + backward of the micro model: fp32 on CUDA equals fp32 on the CPU, and bf16
    autocast on CUDA stays within bf16's error."""
    from pipeline.core.kernels.cross_entropy import chunked_linear_cross_entropy

    torch.manual_seed(0)
    model = build_model(micro_model_config())
    tokens = torch.randint(0, 128, (2, 64))
    labels = torch.randint(0, 128, (2, 64))

    def loss_and_grads(device: str, autocast: bool) -> tuple[float, torch.Tensor]:
        copy = build_model(micro_model_config()).to(device)
        copy.load_state_dict(model.state_dict())
        with torch.autocast(device, torch.bfloat16, enabled=autocast):
            hidden = copy(tokens.to(device))
            loss_sum, count = chunked_linear_cross_entropy(
                hidden, copy.output.weight, labels.to(device)
            )
        loss = loss_sum / count
        loss.backward()
        return loss.item(), copy.layers["0"].attention.wq.weight.grad.float().cpu()

    cpu_loss, cpu_grad = loss_and_grads("cpu", autocast=False)
    cuda_loss, cuda_grad = loss_and_grads("cuda", autocast=False)
    bf16_loss, bf16_grad = loss_and_grads("cuda", autocast=True)
    assert cuda_loss == pytest.approx(cpu_loss, rel=1e-5)
    torch.testing.assert_close(cuda_grad, cpu_grad, rtol=1e-4, atol=1e-6)
    assert bf16_loss == pytest.approx(cpu_loss, rel=2e-2)
    torch.testing.assert_close(bf16_grad, cpu_grad, rtol=5e-2, atol=5e-3)


def test_fused_loss_at_a_128k_vocabulary_matches_cross_entropy():
    """The chunked linear cross-entropy at Llama 3's vocabulary (128,256) in bf16 against the
    full-logit fp32 loss."""
    from pipeline.core.kernels.cross_entropy import chunked_linear_cross_entropy

    torch.manual_seed(0)
    hidden = torch.randn(2048, 512, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    weight = torch.randn(128256, 512, device="cuda", dtype=torch.bfloat16) * 0.02
    weight.requires_grad_()
    labels = torch.randint(0, 128256, (2048,), device="cuda")
    loss_sum, count = chunked_linear_cross_entropy(hidden, weight, labels)
    reference = torch.nn.functional.cross_entropy(
        hidden.float() @ weight.float().T, labels, reduction="sum"
    )
    assert int(count) == 2048
    assert loss_sum.item() == pytest.approx(reference.item(), rel=1e-2)


def test_the_compiled_loss_equals_the_eager_one(monkeypatch: pytest.MonkeyPatch):
    """The chunk scoring compiled on the GPU (one reduction and one gradient pass) gives the
    loss and gradients of the same function eager, bf16 at a 128k vocabulary, two chunks."""
    from pipeline.core.kernels import cross_entropy

    torch.manual_seed(0)
    hidden = torch.randn(4096, 512, device="cuda", dtype=torch.bfloat16)
    weight = torch.randn(128256, 512, device="cuda", dtype=torch.bfloat16) * 0.02
    labels = torch.randint(0, 128256, (4096,), device="cuda")
    mask = (torch.rand(4096, device="cuda") > 0.1).float()
    results = []
    for scorer in (cross_entropy.CompiledScorer(devices=()), cross_entropy.CompiledScorer()):
        monkeypatch.setattr(cross_entropy, "_score_full_vocab_fast", scorer)
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        loss_sum, _ = cross_entropy.chunked_linear_cross_entropy(h, w, labels, mask, 2048)
        loss_sum.backward()
        results.append((loss_sum.detach(), h.grad.float(), w.grad.float()))
    assert scorer.compiled is not None and not scorer.failed
    (eager_loss, *eager_grads), (loss, *grads) = results
    torch.testing.assert_close(loss, eager_loss, rtol=1e-5, atol=0)
    for got, expected in zip(grads, eager_grads):
        torch.testing.assert_close(got, expected, rtol=2e-2, atol=1e-4)


def serving_engine_checks(device: str) -> None:
    """pipe's engine (what `pipe serve` and GRPO's rollouts run) on `device`: fp32 greedy groups
    equal decoding without a cache there; in bf16 (as serve and GRPO's rollouts hold a model on
    a GPU) a group prefills its prompt once and the same seeds draw the same completions."""
    from pipeline.core.model.greedy import greedy_without_cache
    from pipeline.serve.engine.core import Engine
    from pipeline.serve.engine.sampling import SamplingParams

    torch.manual_seed(0)
    model = build_model(micro_model_config()).to(device).eval()
    prompts = [[5, 17, 3], [40, 2, 71, 9, 11, 22, 33, 44, 55, 66, 77, 88, 99, 1, 2, 3, 4, 5]]
    greedy = [SamplingParams(max_new_tokens=8, greedy=True)] * 3
    with torch.no_grad():
        groups = Engine(model, max_batch=6, cache_blocks=32).generate_groups(prompts, [greedy] * 2)
        for prompt, group in zip(prompts, groups):
            assert [r.output for r in group] == [greedy_without_cache(model, prompt, 8)] * 3
        model.to(torch.bfloat16)
        model.rope.init_weights(torch.device(device))  # rotary frequencies stay fp32
        sampled = [[SamplingParams(max_new_tokens=12, seed=seed) for seed in (1, 2, 3, 4)]] * 2
        runs = []
        for _ in range(2):
            engine = Engine(model, max_batch=8, cache_blocks=32)
            groups = engine.generate_groups(prompts, sampled)
            runs.append([[r.output for r in group] for group in groups])
            # a group's leader runs the prompt, each sibling only its last token
            assert engine.prompt_tokens_computed == sum(len(p) - 1 + 4 for p in prompts)
    assert runs[0] == runs[1] and all(len(out) == 12 for group in runs[0] for out in group)
    assert len({tuple(out) for out in runs[0][1]}) > 1  # the seeds draw different completions


def test_the_serving_engine_on_cuda():
    serving_engine_checks("cuda")


def test_document_masked_attention_on_cuda_matches_the_cpu():
    """pipe's attention with document ids (the sdpa backend's boolean mask) on CUDA in bf16
    against the same on the CPU in fp32."""
    from pipeline.core.kernels.attention import attention

    torch.manual_seed(0)
    q = torch.randn(1, 8, 512, 64)
    k = torch.randn(1, 2, 512, 64)
    v = torch.randn(1, 2, 512, 64)
    docs = torch.repeat_interleave(torch.arange(4), torch.tensor([100, 200, 12, 200]))[None]
    reference = attention(q, k, v, document_ids=docs)
    on_gpu = attention(
        *(t.cuda().bfloat16() for t in (q, k, v)), document_ids=docs.cuda(), backend="sdpa"
    )
    torch.testing.assert_close(on_gpu.float().cpu(), reference, atol=3e-2, rtol=3e-2)


def test_nccl_process_group_all_reduces(tmp_path: Path):
    """A one-process NCCL group initialises and all-reduces on the GPU (what every multi-GPU
    layout stands on)."""
    import torch.distributed as dist

    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("nccl", store=store, rank=0, world_size=1)
    try:
        value = torch.full((4,), 3.0, device="cuda")
        dist.all_reduce(value)
        torch.cuda.synchronize()
        assert value.tolist() == [3.0] * 4
    finally:
        dist.destroy_process_group()


@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
    reason="FP8 GEMMs need compute capability 8.9 or later",
)
@pytest.mark.parametrize(
    "recipe", ["torchao:tensorwise", "torchao:rowwise", "torchao:rowwise_with_gw_hp"]
)
def test_torchao_fp8_linears_track_bf16_on_the_gpu(recipe: str):
    """A model with every aligned linear in real FP8 (no emulation) gives a loss within FP8's
    error of the same model in bf16."""
    pytest.importorskip("torchao")
    from pipeline.core.kernels.cross_entropy import chunked_linear_cross_entropy
    from pipeline.core.kernels.fp8 import build_fp8

    config = micro_model_config(hidden_size=256, ffn_hidden_size=512, vocab_size=256)
    torch.manual_seed(0)
    reference = build_model(config).cuda()
    fp8 = build_fp8(recipe, torch.device("cuda"), linear_filter="all")
    converted = fp8.convert(build_model(config)).cuda()
    converted.load_state_dict(reference.state_dict())
    tokens = torch.randint(0, 256, (4, 128), device="cuda")

    def loss(model: torch.nn.Module) -> float:
        with torch.autocast("cuda", torch.bfloat16):
            loss_sum, count = chunked_linear_cross_entropy(
                model(tokens), model.output.weight, tokens.roll(-1, dims=1)
            )
        return (loss_sum / count).item()

    assert "linears in fp8" in fp8.describe()
    assert loss(converted) == pytest.approx(loss(reference), rel=5e-2)
