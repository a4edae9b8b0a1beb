"""`pipe generate BASE --lora-adapter DIR`: adapters saved by peft itself, run beside the base
weights, give the text transformers + peft generate greedily."""

from __future__ import annotations

import pytest
import torch

from pipeline.tokenizer.tokenizer import load_tokenizer
from tests.builders import run_pipe

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

PROMPT = "line 3: value"


def test_generate_with_peft_adapters_equals_transformers_and_peft(tiny_hf_dir, tmp_path) -> None:
    base = transformers.AutoModelForCausalLM.from_pretrained(tiny_hf_dir).eval()
    config = peft.LoraConfig(r=4, lora_alpha=16, target_modules=["q_proj", "v_proj", "down_proj"])
    model = peft.get_peft_model(base, config)
    with torch.no_grad():  # peft starts B at zero: move it so the adapters change the text
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(std=0.5, generator=torch.Generator().manual_seed(len(name)))
    model.save_pretrained(tmp_path / "adapter")

    tokenizer = load_tokenizer(tiny_hf_dir)
    ids = torch.tensor([tokenizer.encode_batch([PROMPT])[0]])
    with torch.no_grad():
        out = model.eval().generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=10,
            do_sample=False,
            pad_token_id=0,
        )
        with model.disable_adapter():
            plain = model.generate(
                input_ids=ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=10,
                do_sample=False,
                pad_token_id=0,
            )
    expected = PROMPT + tokenizer.decode(out[0, ids.shape[1] :].tolist()) + "\n"
    assert not torch.equal(out, plain)  # the adapters matter

    args = ["--prompt", PROMPT, "--max-new-tokens", 10, "--greedy"]
    result = run_pipe("generate", tiny_hf_dir, *args, "--lora-adapter", tmp_path / "adapter")
    assert result.output == expected


def test_serve_engine_takes_the_adapter_and_refuses_a_wrong_one_in_one_line(tiny_hf_dir) -> None:
    """`pipe serve --lora-adapter`: the engine process opens the adapter; one that is not
    LoRA adapters is refused in one line naming it."""
    from pipeline.serve.engine.loading import LoadError
    from pipeline.serve.engine.process import EngineSpec
    from pipeline.serve.http.engine_client import EngineClient

    spec = EngineSpec(
        checkpoint=str(tiny_hf_dir),
        tokenizer=None,
        device="cpu",
        dtype=None,
        kv_cache_bytes=2**20,
        block_size=8,
        max_batch=2,
        prefill_chunk=64,
        threads=1,
        lora_adapter=str(tiny_hf_dir),
    )
    client = EngineClient(spec, max_waiting=1)
    with pytest.raises(LoadError, match=str(tiny_hf_dir)):
        client.start()
    assert not client.process.is_alive()
