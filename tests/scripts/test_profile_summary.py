"""`scripts/bench/profile_summary.py`: kernels sorted into categories by name, the idle share
from the union of kernel intervals, host syncs counted, and a real profile of a CPU step."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts" / "bench"))
from profile_summary import Kernel, busy_us, category, profile_steps, summarise  # noqa: E402


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64", "gemm"),
        ("nvjet_tst_256x128_64x4_2x1_v_bz_coopA_TNT", "gemm"),
        ("cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16", "attention"),
        ("triton_tem_fused_flex_attention_backward_0", "attention"),
        ("fmha_cutlassF_bf16_aligned_64x128_rf_sm80", "attention"),
        ("triton_red_fused__log_softmax_backward_data_0", "loss"),
        ("void at::native::(anonymous namespace)::multi_tensor_apply_kernel<...>", "optimizer"),
        ("ncclDevKernel_ReduceScatter_Sum_bf16_RING_LL", "communication"),
        ("triton_poi_fused_add_mul_silu_3", "other"),
    ],
)
def test_kernels_fall_into_their_categories(name: str, expected: str) -> None:
    assert category(name) == expected


def test_shares_idle_and_syncs() -> None:
    kernels = [
        Kernel("sm90_xmma_gemm", 0, 40),
        Kernel("flash_fwd_kernel", 30, 50),  # overlaps the GEMM (another stream): counted once
        Kernel("triton_poi_fused_add_0", 70, 80),
    ]
    assert busy_us(kernels) == 60
    host = ["cudaStreamSynchronize", "aten::_local_scalar_dense", "aten::mm", "cudaLaunchKernel"]
    summary = summarise(kernels, host, wall_us=100.0, steps=2)
    shares = summary["shares"]
    assert shares["gemm"] == pytest.approx(0.4) and shares["attention"] == pytest.approx(0.2)
    assert shares["other"] == pytest.approx(0.1) and shares["idle"] == pytest.approx(0.4)
    assert summary["host_syncs_per_step"] == 1.0
    assert [k["name"] for k in summary["top_kernels"]] == [
        "sm90_xmma_gemm",
        "flash_fwd_kernel",
        "triton_poi_fused_add_0",
    ]


def test_a_cpu_training_step_is_profiled() -> None:
    """A real forward, backward and optimizer step: GEMMs, the loss and the optimizer show."""
    import torch

    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 32))
    optimizer = torch.optim.AdamW(model.parameters(), foreach=True)
    x, y = torch.randn(128, 64), torch.randint(0, 32, (128,))

    def step() -> None:
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()

    summary = profile_steps(step, lambda: None, steps=3, cuda=False)
    shares = summary["shares"]
    assert shares["gemm"] > 0 and shares["loss"] > 0 and shares["optimizer"] > 0
    assert sum(shares.values()) == pytest.approx(1.0, abs=0.35)  # nested operators may overlap
    assert summary["steps"] == 3 and summary["wall_ms_per_step"] > 0
