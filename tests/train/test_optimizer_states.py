"""Low-precision optimizer states and CPU offload (`optimizer.state_dtype`, `cpu_offload`):
AdamW's first bf16 step is torch's AdamW and Muon's is fp32 Muon's, the rounding is unbiased,
the state bytes halve as measured and as estimated (AdamW and Muon), a resume is exact,
training matches fp32 states within 1%, and the offload's refusals, estimate and (on a GPU)
its losses and checkpoints."""

from __future__ import annotations

import io

import pytest
import torch

from pipeline.train.assembly.run_config import resolve_config
from pipeline.train.config.schema import ConfigError
from pipeline.train.optimizers import build_optimizer, state_bytes_per_param
from pipeline.train.optimizers.adamw_bf16 import AdamWBF16, stochastic_round_bf16
from tests.builders import MICRO_MODEL, build_model, micro_model_config


def _state_bytes(optimizer: torch.optim.Optimizer) -> int:
    return sum(t.nbytes for s in optimizer.state.values() for k, t in s.items() if k != "step")


def _step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=generator).to(p)
    optimizer.step()


def test_the_first_bf16_step_is_torch_adamw_over_the_same_groups() -> None:
    """From zero moments the update is made from this step's fp32 moments: torch's AdamW to
    fp32 rounding; the groups (decay / no decay) are AdamW's."""
    cfg = resolve_config("tiny", [*MICRO_MODEL, "optimizer.state_dtype=bf16"])
    reference = resolve_config("tiny", MICRO_MODEL)
    model, twin = build_model(micro_model_config()), build_model(micro_model_config())
    twin.load_state_dict(model.state_dict())
    ours, torchs = build_optimizer(model, cfg), build_optimizer(twin, reference)
    assert type(ours) is AdamWBF16
    strip = [
        {
            k: v
            for k, v in g.items()
            if k
            not in (
                "params",
                "fused",
                "foreach",
                "capturable",
                "differentiable",
                "maximize",
                "amsgrad",
                "decoupled_weight_decay",
            )
        }
        for g in torchs.param_groups
    ]
    assert [{k: v for k, v in g.items() if k != "params"} for g in ours.param_groups] == strip
    _step(model, ours, 0)
    _step(twin, torchs, 0)
    for p, q in zip(model.parameters(), twin.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)
    assert {t.dtype for s in ours.state.values() for k, t in s.items() if k != "step"} == {
        torch.bfloat16
    }


def test_stochastic_rounding_is_unbiased_where_round_to_nearest_stalls() -> None:
    """An EMA step of 0.1% of v (beta2 = 0.999) is below half a bf16 ulp: round-to-nearest
    keeps v; stochastic rounding gives one of the two neighbours, v + 0.001 on average."""
    x = torch.full((200_000,), 1.001)
    assert torch.equal(x.bfloat16(), torch.ones_like(x, dtype=torch.bfloat16))
    rounded = stochastic_round_bf16(x, torch.Generator().manual_seed(0)).float()
    assert set(rounded.unique().tolist()) == {1.0, 1.0078125}
    assert rounded.mean().item() == pytest.approx(1.001, rel=1e-4)
    negative = stochastic_round_bf16(-x, torch.Generator().manual_seed(0)).float()
    assert torch.equal(negative, -rounded)


def test_the_first_bf16_muon_step_is_fp32_muons() -> None:
    """Muon's momentum and its AdamW moments start at zero, and the first update is made from
    this step's fp32 values: fp32 Muon's step (itself torch.optim.Muon's, test_muon.py)."""
    models, optimizers = [], []
    for dtype in ("fp32", "bf16"):
        cfg = resolve_config("tiny_muon", [*MICRO_MODEL, f"optimizer.state_dtype={dtype}"])
        torch.manual_seed(0)
        models.append(build_model(micro_model_config()))
        optimizers.append(build_optimizer(models[-1], cfg))
        _step(models[-1], optimizers[-1], 0)
    for p, q in zip(*(m.parameters() for m in models)):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)
    bf16 = optimizers[1].state.values()
    assert {t.dtype for s in bf16 for k, t in s.items() if k != "step"} == {torch.bfloat16}
    assert any("momentum_buffer" in s for s in bf16) and any("exp_avg" in s for s in bf16)


def _expected_state_bytes(name: str, model: torch.nn.Module) -> int:
    """fp32 state bytes by the optimizer's definition: AdamW 8 a parameter; Muon 4 (one
    momentum) on its hidden matrices, 8 on the rest."""
    from pipeline.train.optimizers.muon import is_hidden_matrix

    def per(n: str, p: torch.Tensor) -> int:
        return 4 if name == "muon" and is_hidden_matrix(n, p) else 8

    return sum(per(n, p) * p.numel() for n, p in model.named_parameters())


@pytest.mark.parametrize("recipe, big", [("tiny", "llama3_8b"), ("tiny_muon", "llama3_2_1b_muon")])
def test_bf16_states_halve_the_measured_and_the_estimated_bytes(recipe: str, big: str) -> None:
    """The sum of the states' bytes after one step on the model's parameters, and the
    dry-run's optimizer bytes per parameter, are half of fp32 states' (AdamW, Muon)."""
    from pipeline.train.report.estimates import dry_run_report, estimate_memory

    measured = {}
    for dtype in ("fp32", "bf16"):
        cfg = resolve_config(recipe, [*MICRO_MODEL, f"optimizer.state_dtype={dtype}"])
        model = build_model(micro_model_config())
        optimizer = build_optimizer(model, cfg)
        _step(model, optimizer, 0)
        measured[dtype] = _state_bytes(optimizer)
        params = sum(p.numel() for p in model.parameters())
        estimated = params * state_bytes_per_param(cfg, micro_model_config())
        assert measured[dtype] == pytest.approx(estimated, rel=1e-12)
    assert measured["fp32"] == _expected_state_bytes(cfg.optimizer.name, model)
    assert measured["bf16"] * 2 == measured["fp32"]
    fp32, bf16 = (
        resolve_config(big, [f"optimizer.state_dtype={d}"], world_size=8) for d in ("fp32", "bf16")
    )
    model = fp32.model_config()
    before, after = estimate_memory(fp32, model, 8), estimate_memory(bf16, model, 8)
    saved = before.params_per_device * state_bytes_per_param(fp32, model) / 2
    assert before.state - after.state == pytest.approx(saved)
    half = f"(4 + 4 + {state_bytes_per_param(fp32, model) / 2:.3g} B/param)"
    assert any(half in line for line in dry_run_report(bf16, world_size=8))


@pytest.mark.parametrize("recipe", ["tiny", "tiny_muon"])
def test_a_bf16_state_checkpoint_resumes_exactly(recipe: str) -> None:
    """State saved through DCP's state-dict helpers after 3 steps and loaded into a fresh
    model and optimizer: the states come back in bf16 and 2 more steps match bit for bit."""
    from pipeline.checkpoint import load_model_and_optimizer_state, model_and_optimizer_state

    cfg = resolve_config(recipe, [*MICRO_MODEL, "optimizer.state_dtype=bf16"])
    model = build_model(micro_model_config())
    optimizer = build_optimizer(model, cfg)
    for seed in range(3):
        _step(model, optimizer, seed)
    buffer = io.BytesIO()
    torch.save(model_and_optimizer_state(model, optimizer), buffer)
    buffer.seek(0)
    resumed = build_model(micro_model_config())
    resumed_optimizer = build_optimizer(resumed, cfg)
    load_model_and_optimizer_state(resumed, resumed_optimizer, torch.load(buffer))
    assert _state_bytes(resumed_optimizer) == _state_bytes(optimizer)
    for seed in (3, 4):
        _step(model, optimizer, seed)
        _step(resumed, resumed_optimizer, seed)
    for p, q in zip(model.parameters(), resumed.parameters()):
        assert torch.equal(p, q)


def _train(config, tokens: torch.Tensor, cfg, steps: int) -> list[float]:
    """`steps` steps of the registry's optimizer and schedule on 64-token windows."""
    import torch.nn.functional as F

    from pipeline.core.model.transformer import Transformer
    from pipeline.train.optimizers.lr_scheduler import build_scheduler

    torch.manual_seed(0)
    model = Transformer(config)
    model.init_weights()
    optimizer = build_optimizer(model, cfg)
    scheduler = build_scheduler(optimizer, cfg)
    generator = torch.Generator().manual_seed(0)
    losses = []
    for _ in range(steps):
        starts = torch.randint(0, len(tokens) - 65, (8,), generator=generator)
        batch = torch.stack([tokens[s : s + 65] for s in starts.tolist()])
        loss = F.cross_entropy(model.logits(batch[:, :-1]).flatten(0, 1), batch[:, 1:].flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.optimizer.clip_grad)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("recipe", ["tiny", "tiny_muon"])
def test_bf16_states_train_within_one_percent_of_fp32(recipe: str, corpus_texts, tmp_path) -> None:
    """The recipe's optimizer settings (AdamW, Muon) on the stdlib corpus with a micro model:
    the last 20 steps' mean loss with bf16 states is within 1% of fp32 states'. 100 steps keep
    the suite fast (figures in docs/train.md, "The trainer")."""
    from pipeline.export.calibration import calibration_sequences
    from tests.builders import FP8_VOCAB, tokenized_corpus

    prefix = tokenized_corpus(corpus_texts, tmp_path)
    tokens = calibration_sequences(prefix, 10**9, 1).flatten()
    config = micro_model_config(vocab_size=FP8_VOCAB)
    final = {}
    for dtype in ("fp32", "bf16"):
        cfg = resolve_config(recipe, ["training.iters=100", f"optimizer.state_dtype={dtype}"])
        losses = _train(config, tokens, cfg, 100)
        final[dtype] = sum(losses[-20:]) / 20
    assert final["fp32"] < 0.9 * losses[0]  # it learnt: 6.25 -> 5.5
    assert final["bf16"] == pytest.approx(final["fp32"], rel=0.01)


def test_cpu_offload_is_refused_where_it_cannot_run() -> None:
    """One line each: a CPU run, a layout of more than one device, a model on the CPU."""
    with pytest.raises(ConfigError) as error:
        resolve_config("tiny", ["optimizer.cpu_offload=true", "training.device=cpu"])
    assert "optimizer.cpu_offload needs a GPU" in str(error.value)
    with pytest.raises(ConfigError) as error:
        resolve_config(
            "tiny",
            ["optimizer.cpu_offload=true", "training.device=cuda", "parallel.dp=2"],
            world_size=2,
        )
    assert (
        "optimizer.cpu_offload is for one-GPU runs; this layout has tp 1 pp 1 cp 1 ep 1 "
        "dp 2" in str(error.value)
    )
    cfg = resolve_config(
        "tiny", [*MICRO_MODEL, "optimizer.cpu_offload=true", "training.device=cuda"]
    )
    with pytest.raises(ConfigError, match="needs the model on a GPU; its parameters are on cpu"):
        build_optimizer(build_model(micro_model_config()), cfg)


@pytest.mark.parametrize("dtype, host_bytes", [("fp32", 8), ("bf16", 4)])
def test_cpu_offload_leaves_no_optimizer_bytes_on_the_gpu(dtype: str, host_bytes: int) -> None:
    """The estimate: weights and gradients only on the device, the state in host memory."""
    from pipeline.train.report.estimates import dry_run_report, estimate_memory

    sets = [
        "training.device=cuda",
        f"optimizer.state_dtype={dtype}",
        "parallel.tp=1",
        "parallel.pp=1",
    ]
    plain = resolve_config("llama3_2_1b", sets, world_size=1)
    offloaded = resolve_config("llama3_2_1b", [*sets, "optimizer.cpu_offload=true"], world_size=1)
    model = plain.model_config()
    before, after = estimate_memory(plain, model, 1), estimate_memory(offloaded, model, 1)
    params = before.params_per_device
    assert state_bytes_per_param(offloaded) == 0
    assert before.state - after.state == pytest.approx(params * host_bytes)
    assert after.host_state == pytest.approx(params * (8 + host_bytes))
    report = dry_run_report(offloaded, world_size=1)
    assert any("(4 + 4 + 0 B/param)" in line for line in report)
    assert any("none of the state on the GPU" in line for line in report)


def _offload_run(device: str, dtype: str, offload: bool, steps: int, model=None, optimizer=None):
    """`steps` clipped, scheduled steps of the micro model on `device` (a fresh model unless
    given): the losses, the model and its optimizer."""
    from pipeline.train.optimizers.lr_scheduler import build_scheduler

    cfg = resolve_config(
        "tiny",
        [
            *MICRO_MODEL,
            "training.device=cuda",
            f"optimizer.state_dtype={dtype}",
            f"optimizer.cpu_offload={str(offload).lower()}",
        ],
    )
    if model is None:
        torch.manual_seed(0)
        model = build_model(micro_model_config()).to(device)
        optimizer = build_optimizer(model, cfg)
    scheduler = build_scheduler(optimizer, cfg)
    losses = []
    for step in range(steps):
        generator = torch.Generator().manual_seed(step)
        tokens = torch.randint(0, 128, (4, 17), generator=generator).to(device)
        loss = torch.nn.functional.cross_entropy(
            model.logits(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten()
        )
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses, model, optimizer


def _check_offload(device: str, dtype: str, tolerance: float) -> None:
    """Offloaded against not: the losses within `tolerance`, one host state per parameter
    (none kept by an on-device optimizer), and a checkpoint that resumes bit for bit."""
    from pipeline.checkpoint import load_model_and_optimizer_state, model_and_optimizer_state

    offloaded, model, optimizer = _offload_run(device, dtype, True, 5)
    on_device, _, _ = _offload_run(device, dtype, False, 5)
    assert offloaded == pytest.approx(on_device, rel=tolerance)
    assert optimizer.d_opt is None  # torchao kept nothing on the device
    devices = {t.device.type for s in optimizer.state.values() for t in s.values()}
    assert devices == {"cpu"} and len(optimizer.state) == len(list(model.parameters()))
    buffer = io.BytesIO()
    torch.save(model_and_optimizer_state(model, optimizer), buffer)
    buffer.seek(0)
    _, fresh, fresh_optimizer = _offload_run(device, dtype, True, 0)
    load_model_and_optimizer_state(fresh, fresh_optimizer, torch.load(buffer))
    resumed = _offload_run(device, dtype, True, 3, fresh, fresh_optimizer)[0]
    assert resumed == _offload_run(device, dtype, True, 3, model, optimizer)[0]


class _FakeStream:
    """Stands for a CUDA stream on a machine without one: every copy is already done."""

    def wait_stream(self, other: object) -> None: ...
    def synchronize(self) -> None: ...
    def record_event(self) -> _FakeStream:
        return self


@pytest.fixture
def fake_device_split(monkeypatch):
    """torchao's CPUOffloadOptimizer on a CPU-only machine: the "GPU" parameters are CPU
    tensors and the streams and pinned memory are stand-ins, so pipe's wrapper and torchao's
    host-side bookkeeping run as on a GPU (the transfers themselves are not exercised)."""
    import contextlib

    import torchao.optim.cpu_offload as torchao_offload

    import pipeline.train.optimizers.cpu_offload as offload

    empty_like = torch.empty_like
    monkeypatch.setattr(offload, "ACCELERATORS", {"cpu"})
    monkeypatch.setattr(torchao_offload, "get_available_devices", lambda: ["cpu", "cuda"])
    monkeypatch.setattr(torch.cuda, "Stream", _FakeStream)
    monkeypatch.setattr(torch.cuda, "current_stream", _FakeStream)
    monkeypatch.setattr(torch.cuda, "stream", lambda stream: contextlib.nullcontext())
    monkeypatch.setattr(torch, "empty_like", lambda t, pin_memory=False, **kw: empty_like(t, **kw))


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_cpu_offload_wrapper_steps_as_without_it(fake_device_split, dtype: str) -> None:
    """Through a fake device split on the CPU (`fake_device_split`): every state tensor is
    the host optimizers', none on an on-device optimizer; the clipped, scheduled steps give
    the losses of the same optimizer without offload (fp32: rel 1e-5; bf16 rounds with the
    same bits, so also); a checkpoint resumes bit for bit. What it proves: pipe's wrapper
    (gradients copied after clipping, the scheduler's groups, torch's state-dict format, the
    weights written back) and torchao's per-parameter stepping; not the CUDA streams, pinned
    memory or the GPU's bytes (the GPU test below)."""
    _check_offload("cpu", dtype, 1e-5)


def test_cpu_offload_copies_no_gradient_during_the_backward(fake_device_split) -> None:
    """torchao's per-parameter backward hooks are removed: two micro-batch backwards queue
    no copy and leave the host gradients untouched; only `step()` copies them (once)."""
    cfg = resolve_config(
        "tiny", [*MICRO_MODEL, "training.device=cuda", "optimizer.cpu_offload=true"]
    )
    torch.manual_seed(0)
    model = build_model(micro_model_config())
    optimizer = build_optimizer(model, cfg)
    for host in optimizer.param_d2h_map.values():
        host.grad.fill_(float("nan"))
    tokens = torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(0))
    for _ in range(2):
        model.logits(tokens).float().sum().backward()
    assert optimizer.queue == {}
    assert all(host.grad.isnan().all() for host in optimizer.param_d2h_map.values())
    optimizer.step()
    for p, host in optimizer.param_d2h_map.items():
        assert torch.equal(host.grad, p.grad)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_cpu_offload_steps_as_on_the_gpu_and_resumes(dtype: str) -> None:
    """On a GPU: every state tensor on the host, the same losses as without offload (fp32,
    clipped, scheduled: rel 1e-5; bf16: the CPU and the GPU draw other rounding bits), a
    checkpoint that resumes bit for bit."""
    _check_offload("cuda", dtype, 1e-5 if dtype == "fp32" else 1e-3)
