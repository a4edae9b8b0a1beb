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
    out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=new,
        do_sample=False,
        pad_token_id=0,
    )
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
    result = run_pipe(
        "generate", tiny_hf_dir, "--prompt", PROMPT, "--prompt-file", prompt_file, *args
    )
    assert result.output.startswith(f"--- 0 ---\n{PROMPT}")
    assert "--- 1 ---\nHello, world!" in result.output
    assert (
        run_pipe(
            "generate", tiny_hf_dir, "--prompt", PROMPT, "--prompt-file", prompt_file, *args
        ).output
        == result.output
    )


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


def test_chat_answers_as_transformers_chat_template_and_generate(tiny_hf_dir, tmp_path) -> None:
    """`--chat --system`: the prompt transformers' `apply_chat_template(add_generation_prompt=
    True)` makes, greedy text equal to its `generate`'s, and the stop at an end-of-turn id that
    generation_config.json names (here the first id greedy decoding reaches after others)."""
    directory = tmp_path / "chat_model"
    shutil.copytree(tiny_hf_dir, directory)
    tokenizer = transformers.AutoTokenizer.from_pretrained(directory)
    model = transformers.AutoModelForCausalLM.from_pretrained(directory).eval()
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "def f(x):"},
    ]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt")
    ids = ids if isinstance(ids, torch.Tensor) else ids["input_ids"]

    def greedy(new: int, **kwargs) -> list[int]:
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=new,
            do_sample=False,
            pad_token_id=0,
            **kwargs,
        )
        return out[0, ids.shape[1] :].tolist()

    free = greedy(12, eos_token_id=None)
    stop_at = next(i for i in range(2, 12) if free[i] not in free[:i])
    end_of_turn = free[stop_at]
    (directory / "generation_config.json").write_text(f'{{"eos_token_id": [{end_of_turn}]}}')
    reply = greedy(12, eos_token_id=[end_of_turn])
    assert reply == free[: stop_at + 1]  # transformers stopped there too
    expected = tokenizer.decode(reply[:-1]) + "\n"
    args = ["--chat", "--system", "Be brief.", "--prompt", "def f(x):", "--max-new-tokens", 12]
    assert run_pipe("generate", directory, *args, "--greedy").output == expected


def test_chat_needs_a_template_and_system_needs_chat(tiny_hf_dir, tmp_path) -> None:
    plain = tmp_path / "plain"
    shutil.copytree(tiny_hf_dir, plain)
    config = plain / "tokenizer_config.json"
    config.write_text(config.read_text().replace('"chat_template"', '"unused_template"'))
    result = run_pipe("generate", plain, "--chat", "--prompt", "Hi", expect_ok=False)
    assert result.exit_code == 1
    assert (
        result.output.strip()
        == f"Error: --chat: the tokenizer of {plain} ({plain}) has no chat template"
    )
    result = run_pipe("generate", tiny_hf_dir, "--system", "x", "--prompt", "Hi", expect_ok=False)
    assert result.exit_code == 2 and "--system is for --chat" in result.output
