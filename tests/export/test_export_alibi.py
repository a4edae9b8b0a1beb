"""`pipe export` of BLOOM and MPT: the Hugging Face checkpoint vLLM, SGLang and TensorRT-LLM's
PyTorch backend load (transformers loads it with the source's logits, its q/k/v fused again);
the legacy rank files and FP8, which know Llama's blocks only, refuse in one line."""

from __future__ import annotations

import pytest
import torch

from tests.builders import disk_tensors, run_pipe
from tests.convert.test_bloom_mpt import VOCAB, hf_alibi_model

transformers = pytest.importorskip("transformers")


@pytest.mark.parametrize("name", ["bloom", "mpt"])
def test_export_from_a_pipe_checkpoint_loads_in_transformers(name, tmp_path) -> None:
    hf = hf_alibi_model(name)
    hf.save_pretrained(tmp_path / "hf")
    run_pipe("convert", tmp_path / "hf", "--from", "hf", "-o", tmp_path / "ckpt", "-q")
    out = run_pipe("export", tmp_path / "ckpt", "--vllm", "-o", tmp_path / "vllm").output
    assert "transformers loads it" in out
    assert disk_tensors(tmp_path / "vllm").keys() == disk_tensors(tmp_path / "hf").keys()
    exported = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "vllm").eval()
    tokens = torch.randint(0, VOCAB, (2, 16))
    with torch.no_grad():
        torch.testing.assert_close(exported(tokens).logits, hf(tokens).logits, rtol=1e-4, atol=1e-4)


def test_legacy_and_fp8_refuse_in_one_line(tmp_path) -> None:
    hf_alibi_model("bloom").save_pretrained(tmp_path / "hf")
    legacy = run_pipe(
        "export",
        tmp_path / "hf",
        "--trtllm",
        "--trtllm-format",
        "legacy",
        "-o",
        tmp_path / "legacy",
        expect_ok=False,
    )
    assert legacy.exit_code != 0 and "legacy TensorRT-LLM format has no ALiBi" in legacy.output
    fp8 = run_pipe(
        "export", tmp_path / "hf", "--vllm", "--fp8", "-o", tmp_path / "fp8", expect_ok=False
    )
    assert fp8.exit_code != 0 and "FP8 export of BLOOM and MPT" in fp8.output
    assert "Traceback" not in legacy.output + fp8.output
    assert not (tmp_path / "legacy").exists() and not (tmp_path / "fp8").exists()
