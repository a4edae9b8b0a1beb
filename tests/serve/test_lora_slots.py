"""Adapters by name in the engine (`pipeline.serve.engine.lora_slots`): rows of one batch, each
with its own peft adapter or none, give transformers + peft's greedy tokens; with one slot for two
adapters they take turns (evicted and brought back) and still do; the gathered and the grouped
batched products agree; adapters that do not fit are refused in one line naming the path."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pipeline.serve.engine.loading import open_generator
from pipeline.serve.engine.lora_slots import LoRASlotError, LoRASlots, gathered_lora, grouped_lora
from pipeline.serve.engine.process import build_engine
from pipeline.serve.engine.sampling import SamplingParams
from pipeline.tokenizer.tokenizer import load_tokenizer

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")

PROMPTS = ["line 3: value", "def f(x):", "import os"]
NEW_TOKENS = 8


def peft_adapter(hf_dir: Path, output: Path, seed: int, targets: list[str], rank: int = 4):
    """A peft LoRA on the model at `hf_dir` with random (nonzero) B, saved to `output`; returns
    the peft model."""
    base = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    config = peft.LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=targets)
    model = peft.get_peft_model(base.eval(), config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.normal_(std=0.3 if "lora_B" in name else 0.2, generator=generator)
    model.save_pretrained(output)
    return model.eval()


def hf_greedy(model, ids: list[int]) -> list[int]:
    tensor = torch.tensor([ids])
    with torch.no_grad():
        out = model.generate(
            input_ids=tensor,
            attention_mask=torch.ones_like(tensor),
            max_new_tokens=NEW_TOKENS,
            do_sample=False,
            pad_token_id=0,
        )
    return out[0, len(ids) :].tolist()


@pytest.fixture(scope="module")
def adapters(tiny_hf_dir, tmp_path_factory):
    """Two different peft adapters (other targets, other ranks) and their expected greedy
    tokens per prompt, with the base's."""
    root = tmp_path_factory.mktemp("adapters")
    tokenizer = load_tokenizer(tiny_hf_dir)
    prompts = [tokenizer.encode_batch([p])[0] for p in PROMPTS]
    a = peft_adapter(tiny_hf_dir, root / "a", 1, ["q_proj", "v_proj", "down_proj"], rank=4)
    b = peft_adapter(tiny_hf_dir, root / "b", 2, ["k_proj", "o_proj", "gate_proj", "up_proj"], 8)
    expected = {"a": [hf_greedy(a, p) for p in prompts], "b": [hf_greedy(b, p) for p in prompts]}
    with a.disable_adapter():
        expected[None] = [hf_greedy(a, p) for p in prompts]
    assert expected["a"] != expected[None] and expected["b"] != expected[None]
    return {"a": root / "a", "b": root / "b"}, prompts, expected


def engine_with(hf_dir: Path, paths: dict, max_loras: int, max_batch: int = 8):
    from pipeline.serve.engine.cpu_linear import prepack_linears

    gen = open_generator(hf_dir)
    prepack_linears(gen.model)
    engine = build_engine(gen, kv_cache_bytes=2**20, block_size=8, max_batch=max_batch)
    engine.adapters = LoRASlots.install(gen.model, max_loras, 16)
    for name, path in paths.items():
        engine.adapters.register(name, str(path))
    return engine


@pytest.mark.parametrize("method", ["grouped", "gather"])
def test_one_batch_of_mixed_adapters_gives_peft_tokens(tiny_hf_dir, adapters, method) -> None:
    paths, prompts, expected = adapters
    engine = engine_with(tiny_hf_dir, paths, max_loras=2)
    engine.adapters.method = method
    params = SamplingParams(max_new_tokens=NEW_TOKENS, greedy=True)
    requests = {}
    for name in ("a", None, "b"):  # all queued together: one batch of three adapters' rows
        for i, prompt in enumerate(prompts):
            requests[name, i] = engine.add(prompt, params, name)
    list(engine.run())
    for (name, i), request in requests.items():
        assert request.output == expected[name][i], (name, i)
    assert sorted(engine.adapters.resident) == ["a", "b"]


def test_one_slot_for_two_adapters_takes_turns(tiny_hf_dir, adapters) -> None:
    """max_loras 1: b's requests wait while a's run, a is evicted for b, and back."""
    paths, prompts, expected = adapters
    engine = engine_with(tiny_hf_dir, paths, max_loras=1)
    params = SamplingParams(max_new_tokens=NEW_TOKENS, greedy=True)
    order = ["a", "b", None, "a", "b"]
    requests = [engine.add(prompts[0], params, name) for name in order]
    list(engine.run())
    assert [r.output for r in requests] == [expected[name][0] for name in order]
    assert engine.adapters.resident == ["b"]


def test_unregistered_adapters_finish_what_they_hold(tiny_hf_dir, adapters) -> None:
    """A request queued before its adapter is unregistered still runs with it; a new one is
    refused; an unknown name is refused."""
    paths, prompts, expected = adapters
    engine = engine_with(tiny_hf_dir, paths, max_loras=1)
    params = SamplingParams(max_new_tokens=NEW_TOKENS, greedy=True)
    first, second = engine.add(prompts[1], params, "a"), engine.add(prompts[1], params, "b")
    engine.adapters.unregister("b")
    with pytest.raises(LoRASlotError, match="'b' cannot be found"):
        engine.add(prompts[1], params, "b")
    list(engine.run())
    assert (first.output, second.output) == (expected["a"][1], expected["b"][1])


def test_gather_and_grouped_agree() -> None:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(5, 3, 16, generator=generator)
    a, b = torch.randn(4, 6, 16, generator=generator), torch.randn(4, 12, 6, generator=generator)
    a[3], b[3] = 0, 0  # the zero slot
    rows = torch.tensor([0, 3, 2, 0, 1])
    gathered = gathered_lora(x, a, b, rows)
    groups = {0: torch.tensor([0, 3]), 1: torch.tensor([4]), 2: torch.tensor([2])}
    grouped = grouped_lora(x, a, b, groups)
    torch.testing.assert_close(gathered, grouped)
    torch.testing.assert_close(grouped[1], torch.zeros(3, 12))
    torch.testing.assert_close(grouped[4], x[4] @ a[1].T @ b[1].T)


def test_adapters_that_do_not_fit_are_refused(tiny_hf_dir, adapters, tmp_path) -> None:
    paths, _, _ = adapters
    gen = open_generator(tiny_hf_dir)
    slots = LoRASlots.install(gen.model, 1, 4)
    with pytest.raises(LoRASlotError, match=r"rank 8 is greater than max_lora_rank 4"):
        slots.register("b", str(paths["b"]))
    with pytest.raises(LoRASlotError, match=str(tmp_path)):
        slots.register("c", str(tmp_path))
    slots.register("a", str(paths["a"]))
    with pytest.raises(LoRASlotError, match="'a' has already been loaded"):
        slots.register("a", str(paths["a"]))


def test_lora_modules_take_vllms_forms() -> None:
    """`--lora-modules a=X b=Y` (several after one flag, as vLLM's), repeated, and vLLM's JSON
    form; a bad entry or a repeated name is one line naming it."""
    import click
    from click.testing import CliRunner

    from pipeline.serve.http.lora_options import adapter_settings, lora_options

    @click.command()
    @click.argument("checkpoint")
    @lora_options
    def command(checkpoint: str, **options) -> None:
        fields, runtime = adapter_settings(options)
        click.echo(repr((checkpoint, fields["lora_modules"], fields["max_loras"], runtime)))

    json_form = '{"name": "c", "path": "/z", "base_model_name": "m"}'
    args = [
        "base",
        "--lora-modules",
        "a=/x",
        "b=/y",
        "--max-loras",
        "2",
        "--lora-modules",
        json_form,
    ]
    result = CliRunner().invoke(command, args, env={"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "0"})
    assert result.output.strip() == repr(
        ("base", (("a", "/x"), ("b", "/y"), ("c", "/z")), 2, False)
    )
    assert "('base', (), 0, False)" in CliRunner().invoke(command, ["base"]).output
    enabled = CliRunner().invoke(command, ["base", "--allow-runtime-lora-updating"])
    assert "('base', (), 1, True)" in enabled.output
    for bad, message in (
        (["a"], "'a': use name=path or JSON"),
        (["a=/x", "a=/y"], "names 'a' twice"),
        (['{"name": "a"}'], 'JSON needs "name" and "path"'),
    ):
        result = CliRunner().invoke(command, ["base", "--lora-modules", *bad])
        assert result.exit_code == 2 and message in result.output, result.output


def test_an_adapters_generated_blocks_are_its_own(tiny_hf_dir, adapters) -> None:
    """A prompt shorter than a block: the blocks its generated tokens fill chain from the
    adapter too, so the base given those very tokens computes them itself."""
    paths, _, _ = adapters
    engine = engine_with(tiny_hf_dir, paths, max_loras=2)  # blocks of 8 tokens
    short = engine.add([5, 9, 2], SamplingParams(max_new_tokens=16, greedy=True), "a")
    list(engine.run())
    base_prompt = short.prompt + short.output
    params = SamplingParams(max_new_tokens=NEW_TOKENS, greedy=True)
    base = engine.add(base_prompt, params)
    list(engine.run())
    fresh = engine_with(tiny_hf_dir, paths, max_loras=2)
    alone = fresh.add(base_prompt, params)
    list(fresh.run())
    assert base.cached_tokens == 0 and base.output == alone.output


def test_the_prefix_cache_never_crosses_adapters(tiny_hf_dir, adapters) -> None:
    """A prompt's cached blocks serve the same adapter again, never another adapter or the
    base: each run equals a fresh engine's, and only the repeat reads the cache."""
    paths, prompts, _ = adapters
    long_prompt = [t for p in prompts for t in p] * 4  # several full blocks
    params = SamplingParams(max_new_tokens=NEW_TOKENS, greedy=True)
    engine = engine_with(tiny_hf_dir, paths, max_loras=2)
    order = ["a", None, "b", "a"]
    served = []
    for name in order:  # one after another: each finds the earlier ones' blocks cached
        served.append(engine.add(long_prompt, params, name))
        list(engine.run())
    for name, request in zip(order, served):
        fresh = engine_with(tiny_hf_dir, paths, max_loras=2)
        alone = fresh.add(long_prompt, params, name)
        list(fresh.run())
        assert request.output == alone.output, name
    assert len({tuple(r.output) for r in served[:3]}) == 3  # the adapters do differ here
    assert [r.cached_tokens for r in served[:3]] == [0, 0, 0] and served[3].cached_tokens > 0
