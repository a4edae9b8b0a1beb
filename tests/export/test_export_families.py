"""`pipe export --trtllm` of the 2026 families: GLM-4.5, MiniMax-M2 and Mistral 4 export as
Hugging Face checkpoints (the format TensorRT-LLM's PyTorch backend and vLLM read) that
transformers loads to the source's logits; the legacy rank-file format, which has none of their
pieces, refuses them in one line."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.builders import run_pipe

pytest.importorskip("transformers")


def _saved(name: str, directory: Path) -> Path:
    if name == "glm4_moe":
        from tests.convert.test_glm4_moe import _case, _hf_model

        hf = _hf_model(_case("glm45")[0])
    elif name == "mistral4":
        from tests.convert.test_mistral4 import _case, _hf_model

        hf = _hf_model(_case()[0])
    else:
        from tests.convert.test_minimax_m2 import _case, _hf_model

        hf = _hf_model(_case()[0])
    hf.save_pretrained(directory)
    return directory


@pytest.mark.parametrize(
    ("name", "refusal"),
    [
        ("glm4_moe", "has no Glm4MoeForCausalLM"),
        ("minimax_m2", "has no MiniMaxM2ForCausalLM"),
        ("mistral4", "has no latent attention"),
    ],
)
def test_hf_export_verifies_and_legacy_is_refused(tmp_path, name, refusal) -> None:
    source = _saved(name, tmp_path / "hf")
    result = run_pipe("export", source, "--trtllm", "--output", tmp_path / "out")
    assert "transformers loads it" in result.output
    result = run_pipe(
        "export",
        source,
        "--trtllm",
        "--trtllm-format",
        "legacy",
        "--output",
        tmp_path / "leg",
        expect_ok=False,
    )
    assert result.exit_code != 0
    assert "legacy TensorRT-LLM format" in result.output and refusal in result.output
    assert result.output.count("\n") == 1 and not (tmp_path / "leg").exists()
