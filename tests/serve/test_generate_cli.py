"""`pipe generate`: the text transformers' greedy `generate` gives, streamed to the terminal, from
a Hugging Face directory and from a pipe checkpoint; bad input gets one line."""

from __future__ import annotations

import shutil
import sys

import pytest
import torch

from pipeline.tokenizer.tokenizer import load_tokenizer
from tests.builders import run_pipe

transformers = pytest.importorskip("transformers")

PROMPT = "line 3: value"


def _transformers_text(directory, new: int) -> str:
    tokenizer = load_tokenizer(directory)
    model = transformers.AutoModelForCausalLM.from_pretrained(directory).eval()
    ids = torch.tensor([tokenizer.encode_batch([PROMPT])[0]])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new,
                         do_sample=False, pad_token_id=0)  # fmt: skip
    return tokenizer.decode(out[0, ids.shape[1] :].tolist())


def test_generate_prints_transformers_greedy_text(tiny_hf_dir, tmp_path) -> None:
    continuation = _transformers_text(tiny_hf_dir, 10)
    assert len(continuation) >= 5  # ten tokens of text, not an early end
    expected = PROMPT + continuation + "\n"
    args = ["--prompt", PROMPT, "--max-new-tokens", 10, "--greedy"]
    assert run_pipe("generate", tiny_hf_dir, *args).output == expected
    run_pipe("convert", tiny_hf_dir, "--from", "hf", "--output", tmp_path / "ckpt")
    from_pipe = run_pipe("generate", tmp_path / "ckpt", *args, "--tokenizer", tiny_hf_dir)
    assert from_pipe.output == expected


def test_several_prompts_and_a_prompt_file(tiny_hf_dir, tmp_path) -> None:
    prompt_file = tmp_path / "prompt.txt"
    prompt_file.write_text("Hello, world!", encoding="utf-8")
    args = ["--max-new-tokens", 4, "--temperature", 0.9, "--top-k", 50, "--seed", 3]
    result = run_pipe("generate", tiny_hf_dir, "--prompt", PROMPT, "--prompt-file", prompt_file,
                      *args)  # fmt: skip
    assert result.output.startswith(f"--- 0 ---\n{PROMPT}")
    assert "--- 1 ---\nHello, world!" in result.output
    assert run_pipe("generate", tiny_hf_dir, "--prompt", PROMPT, "--prompt-file", prompt_file,
                    *args).output == result.output  # fmt: skip


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--top-p", "0"], "top_p must be in (0, 1]"),
        (["--temperature", "-1"], "temperature must be >= 0"),
        (["--max-new-tokens", "5000"], "exceeds the model's context of 2048 tokens"),
        ([], "give a --prompt or a --prompt-file"),
    ],
)
def test_bad_input_gets_one_line(tiny_hf_dir, args, message) -> None:
    prompt = [] if not args else ["--prompt", PROMPT]
    result = run_pipe("generate", tiny_hf_dir, *prompt, *args, expect_ok=False)
    assert result.exit_code != 0 and message in result.output
    assert "Traceback" not in result.output


def test_a_directory_without_a_model_or_tokenizer(tiny_hf_dir, tmp_path) -> None:
    result = run_pipe("generate", tmp_path, "--prompt", "x", expect_ok=False)
    assert result.exit_code == 1 and str(tmp_path) in result.output
    source = tmp_path / "hf"
    shutil.copytree(tiny_hf_dir, source)
    run_pipe("convert", source, "--from", "hf", "--output", tmp_path / "ckpt")
    # convert recorded the tokenizer the directory holds: no --tokenizer needed
    assert run_pipe("generate", tmp_path / "ckpt", "--prompt", "x").output.startswith("x")
    (source / "tokenizer.json").unlink()  # the recorded tokenizer is gone
    result = run_pipe("generate", tmp_path / "ckpt", "--prompt", "x", expect_ok=False)
    assert "pass --tokenizer DIR" in result.output and result.output.count("\n") == 1


def test_serve_without_its_extra_says_what_to_install(tiny_hf_dir, monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "uvicorn", None)
    result = run_pipe("serve", tiny_hf_dir, expect_ok=False)
    assert result.exit_code == 1 and "pip install 'pipe-llm[serve]'" in result.output


def test_bf16_on_a_cpu(tiny_hf_dir) -> None:
    args = ["--prompt", PROMPT, "--max-new-tokens", 6, "--greedy", "--dtype", "bf16"]
    out = run_pipe("generate", tiny_hf_dir, *args).output
    assert out.startswith(PROMPT) and len(out) > len(PROMPT) + 3
