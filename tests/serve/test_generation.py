"""Generation against transformers' `generate` (the oracle), for a tiny model of every family,
read from the Hugging Face directory and from a pipe checkpoint converted from it; the engine's
batching (mixed prompt lengths, chunked prefill, requests joining and leaving) against one
request at a time. CPU, fp32."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pipeline.core.model.greedy import greedy_without_cache
from pipeline.serve.engine.core import Engine
from pipeline.serve.engine.loading import LoadError, open_generator
from pipeline.serve.engine.request_checks import PromptTooLong
from pipeline.serve.engine.sampling import SamplingParams
from pipeline.serve.engine.scheduler import QueueFull
from tests.builders import run_pipe, save_hf

transformers = pytest.importorskip("transformers")

FAMILIES = ["llama", "mistral", "qwen2", "mixtral", "qwen3", "qwen3_moe", "deepseek_v3"]
PROMPTS = [[5, 17, 3], [40, 2, 71, 9, 9, 12, 60, 33, 1, 8, 77], [90], [11, 22, 33, 44, 55, 66]]
NEW = 12


def _hf_family(name: str, directory: Path):
    """A perturbed tiny HF model of family `name`, saved to `directory`."""
    if name in ("llama", "mistral", "qwen2", "mixtral"):
        return save_hf(name, directory)[1]
    if name.startswith("qwen3"):
        from tests.convert.test_qwen3 import _hf_model

        hf = _hf_model(name)
    else:
        from tests.convert.test_deepseek_v3 import _case
        from tests.convert.test_deepseek_v3 import _hf_model as deepseek

        hf = deepseek(_case("moe_q_lora_yarn")[0])
    hf.save_pretrained(directory)
    return hf


@pytest.fixture(scope="module", params=FAMILIES)
def family(request, tmp_path_factory):
    directory = tmp_path_factory.mktemp(request.param)
    hf = _hf_family(request.param, directory)
    return request.param, directory, hf


def _hf_greedy(hf, prompt: list[int], eos: frozenset[int]) -> list[int]:
    ids = torch.tensor([prompt])
    out = hf.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=NEW,
        do_sample=False,
        eos_token_id=sorted(eos) or None,
        pad_token_id=0,
    )
    return out[0, len(prompt) :].tolist()


def test_greedy_equals_transformers_with_and_without_cache(family) -> None:
    name, directory, hf = family
    gen = open_generator(directory)
    assert gen.eos_ids == frozenset({hf.config.eos_token_id} - {None})
    one = Engine(gen.model, max_batch=1, block_size=4, prefill_chunk=4)
    params = SamplingParams(max_new_tokens=NEW, greedy=True, stop_token_ids=gen.eos_ids)
    for prompt in PROMPTS:
        expected = _hf_greedy(hf, prompt, gen.eos_ids)
        assert one.generate([prompt], params)[0].output == expected, (name, prompt)
        assert greedy_without_cache(gen.model, prompt, NEW, gen.eos_ids) == expected


def test_batched_mixed_lengths_equal_one_by_one(family) -> None:
    _, directory, _ = family
    model = open_generator(directory).model
    params = SamplingParams(max_new_tokens=NEW, greedy=True)
    alone = [Engine(model, max_batch=1).generate([p], params)[0].output for p in PROMPTS]
    batched = Engine(model, max_batch=4, block_size=4, prefill_chunk=5).generate(PROMPTS, params)
    assert [r.output for r in batched] == alone
    assert all(len(out) == NEW for out in alone)


def test_from_a_pipe_checkpoint(tmp_path) -> None:
    hf_dir = tmp_path / "hf"
    hf = _hf_family("deepseek_v3", hf_dir)
    run_pipe("convert", hf_dir, "--from", "hf", "--output", tmp_path / "ckpt")
    gen = open_generator(tmp_path / "ckpt")
    params = SamplingParams(max_new_tokens=NEW, greedy=True, stop_token_ids=gen.eos_ids)
    out = Engine(gen.model).generate(PROMPTS, params)
    assert [r.output for r in out] == [_hf_greedy(hf, p, gen.eos_ids) for p in PROMPTS]


def test_generation_config_end_of_turn_ids_stop_as_in_transformers(tmp_path) -> None:
    """An instruct model's end-of-turn id lives in generation_config.json only (Llama 3's
    <|eot_id|>): pipe stops on it as transformers' `generate` does when it loads the directory."""
    import json

    _, hf = save_hf("llama", tmp_path)
    prompt = PROMPTS[1]
    free_run = _hf_greedy(hf, prompt, frozenset())
    end_of_turn = free_run[3]  # a token greedy decoding reaches, not config.json's eos
    assert end_of_turn != hf.config.eos_token_id
    path = tmp_path / "generation_config.json"
    generation = json.loads(path.read_text()) | {"eos_token_id": [end_of_turn]}
    path.write_text(json.dumps(generation))

    gen = open_generator(tmp_path)
    assert gen.eos_ids == frozenset({end_of_turn, hf.config.eos_token_id} - {None})
    params = SamplingParams(max_new_tokens=NEW, greedy=True, stop_token_ids=gen.eos_ids)
    ours = Engine(gen.model).generate([prompt], params)[0].output
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = theirs.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=NEW,
            do_sample=False,
            pad_token_id=0,
        )
    assert ours == out[0, len(prompt) :].tolist() == free_run[: free_run.index(end_of_turn) + 1]


def test_a_damaged_generation_config_is_named(tmp_path) -> None:
    save_hf("llama", tmp_path)
    (tmp_path / "generation_config.json").write_text('{"eos_token_id": "eot"}')
    with pytest.raises(LoadError, match="generation_config.json: eos_token_id must be an integer"):
        open_generator(tmp_path)


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    directory = tmp_path_factory.mktemp("llama")
    save_hf("llama", directory)
    return open_generator(directory).model


def test_requests_joining_and_leaving_equal_one_by_one(llama) -> None:
    """Requests added while others run, with their own lengths, seeds and sampling settings,
    give the tokens each gives alone: the seed's text does not depend on the batch."""
    settings = [
        SamplingParams(max_new_tokens=9, temperature=0.8, seed=1),
        SamplingParams(max_new_tokens=3, greedy=True),
        SamplingParams(max_new_tokens=14, temperature=1.3, top_k=20, seed=2),
        SamplingParams(max_new_tokens=6, temperature=1.0, top_p=0.7, seed=3),
    ]
    alone = [
        Engine(llama, max_batch=1).generate([p], s)[0].output for p, s in zip(PROMPTS, settings)
    ]
    engine = Engine(llama, max_batch=3, cache_blocks=12, block_size=4, prefill_chunk=4)
    requests = [engine.add(PROMPTS[0], settings[0])]
    steps = 0
    while engine.busy or len(requests) < len(PROMPTS):
        if steps in (2, 3, 7):  # join mid-flight
            requests.append(engine.add(PROMPTS[len(requests)], settings[len(requests)]))
        engine.step()
        steps += 1
        running, _ = engine.load
        assert running <= 3
    assert [r.output for r in requests] == alone
    assert [r.finish_reason for r in requests] == ["length"] * 4
    assert engine.cache.free_blocks == 12  # every block back once all have left


def test_same_seed_same_text_different_seed_differs(llama) -> None:
    def sampled(seed: int) -> list[int]:
        params = SamplingParams(max_new_tokens=16, temperature=1.5, seed=seed)
        return Engine(llama).generate([PROMPTS[1]], params)[0].output

    assert sampled(7) == sampled(7)
    assert sampled(7) != sampled(8)


def test_abort_frees_the_slot_and_blocks(llama) -> None:
    engine = Engine(llama, max_batch=1, cache_blocks=8, block_size=4)
    params = SamplingParams(max_new_tokens=20, greedy=True)
    first, second = engine.add(PROMPTS[0], params), engine.add(PROMPTS[2], params)
    engine.step()
    assert engine.load == (1, 1) and engine.cache.free_blocks < 8
    engine.abort(first)
    assert first.finish_reason == "abort"
    for _ in engine.run():
        pass
    assert len(second.output) == 20 and engine.cache.free_blocks == 8


def test_bounds_are_refused_clearly(llama) -> None:
    engine = Engine(llama, cache_blocks=4, block_size=4, max_waiting=2, max_context=40)
    with pytest.raises(PromptTooLong, match="context of 40"):
        engine.add(list(range(35)), SamplingParams(max_new_tokens=8))
    with pytest.raises(PromptTooLong, match="KV cache"):
        engine.add(list(range(10)), SamplingParams(max_new_tokens=8))
    short = SamplingParams(max_new_tokens=4)
    engine.add([1], short)
    engine.add([2], short)
    with pytest.raises(QueueFull):
        engine.add([3], short)


def test_stop_strings_and_eos_end_the_text() -> None:
    from pipeline.serve.engine.text import TextStream

    pieces = {1: "Hel", 2: "lo", 3: " wor", 4: "ld", 5: "!"}
    stream = TextStream(lambda ids: "".join(pieces[i] for i in ids), stop=["world"])
    released = [stream.push(t) for t in (1, 2, 3, 4)]
    assert "".join(released) == "Hello " and stream.stopped  # " wor" held until it was a stop
    stream = TextStream(lambda ids: "".join(pieces[i] for i in ids), stop=["xyz"])
    assert [stream.push(t) for t in (1, 2, 5)] == ["Hel", "lo", "!"] and not stream.stopped


def test_a_requests_text_ends_at_a_stop_string_or_where_the_engine_ends_it() -> None:
    """`RequestText`, the text path of `pipe generate` and `pipe serve` alike: a stop string
    ends the text before the engine knows (the caller must abort), a stop token adds no text,
    and the engine's end releases what was held back."""
    from pipeline.serve.engine.text import RequestText

    pieces = {1: "Hel", 2: "lo", 3: " wor", 4: "ld", 5: "!", 9: "<eos>"}

    def decode(ids, skip_special_tokens=False):
        return "".join(pieces[i] for i in ids)

    params = SamplingParams(stop=("world",), stop_token_ids=frozenset({9}))
    text = RequestText(decode, params, prompt=[])
    assert [text.add(t, None) for t in (1, 2, 3, 4)] == ["Hel", "lo", " ", ""]
    assert text.finish_reason == "stop" and text.stopped_by_text and text.text == "Hello "
    text = RequestText(decode, params, prompt=[])  # " wor" is held: it may begin "world"
    assert [text.add(1, None), text.add(3, None), text.add(9, "stop")] == ["Hel", " ", "wor"]
    assert text.finish_reason == "stop" and not text.stopped_by_text and text.text == "Hel wor"
    text = RequestText(decode, params, prompt=[])
    assert text.add(1, None) + text.add(3, "length") == "Hel wor"
    assert text.finish_reason == "length" and not text.stopped_by_text


def test_a_long_prompt_is_prefilled_in_chunks_without_stalling_others(llama) -> None:
    engine = Engine(llama, max_batch=2, block_size=4, prefill_chunk=4)
    params = SamplingParams(max_new_tokens=30, greedy=True)
    short = engine.add(PROMPTS[0], params)
    engine.step()  # the short prompt fits one chunk: it is decoding now
    long = engine.add(list(range(1, 41)), params)
    for step in range(10):  # 40 prompt tokens, 4 a step
        assert long.computed == 4 * step
        tokens = [event.request for event in engine.step()]
        assert short in tokens  # one token for the decoding request every step
    assert long.computed == 40 and len(long.output) == 1


def test_a_converted_checkpoint_keeps_its_tokenizer_and_end_of_turn_ids(
    tmp_path, tiny_hf_dir
) -> None:
    """`pipe convert --from hf` records the tokenizer beside the weights and the end-of-turn
    ids of generation_config.json, so the pipe checkpoint generates without `--tokenizer`."""
    import json
    import shutil

    hf_dir = tmp_path / "hf"
    shutil.copytree(tiny_hf_dir, hf_dir)
    (hf_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": [7, 9]}))
    run_pipe("convert", hf_dir, "--from", "hf", "--output", tmp_path / "ckpt")
    from_hf, converted = open_generator(hf_dir), open_generator(tmp_path / "ckpt")
    assert converted.tokenizer is not None and converted.chat_template is not None
    assert {7, 9} <= converted.eos_ids == from_hf.eos_ids
    assert converted.encode("hello there") == from_hf.encode("hello there")
    result = run_pipe("generate", tmp_path / "ckpt", "--prompt", "hi", "--max-new-tokens", "3")
    assert result.exit_code == 0, result.output

    (hf_dir / "tokenizer.json").write_text("{}")  # changed since: not trusted any more
    with pytest.warns(UserWarning, match="missing or changed"):
        assert open_generator(tmp_path / "ckpt").tokenizer is None


def test_a_template_with_bos_token_renders_it(tmp_path, tiny_hf_dir) -> None:
    """The special tokens reach the template (Llama 3's starts with `{{ bos_token }}`)."""
    import json
    import shutil

    from pipeline.serve.http.openai_api import ChatMessage, chat_prompt
    from pipeline.tokenizer.chat_template import ChatTemplateError

    shutil.copytree(tiny_hf_dir, tmp_path, dirs_exist_ok=True)
    config_path = tmp_path / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["chat_template"] = (
        "{{ bos_token }}{% for m in messages %}{% if m.role == 'system' %}"
        "{{ raise_exception('no system turns') }}{% endif %}{{ m.content }}{% endfor %}"
    )
    config_path.write_text(json.dumps(config))
    gen = open_generator(tmp_path)
    prompt = chat_prompt([ChatMessage(role="user", content="Hi")], gen.chat_template)
    assert prompt == f"{config['bos_token']}Hi"
    assert gen.encode(prompt)[0] == gen.tokenizer.encode_batch([config["bos_token"]])[0][0]
    with pytest.raises(ChatTemplateError, match="^no system turns$"):
        chat_prompt([ChatMessage(role="system", content="x")], gen.chat_template)


@pytest.fixture(scope="module")
def modelopt_fp8_dir(tiny_hf_dir, tmp_path_factory) -> Path:
    """The tiny model exported by pipe as ModelOpt FP8 (with an FP8 KV cache)."""
    import numpy as np

    from pipeline.data.indexed import IndexedDatasetWriter
    from pipeline.export.options import ExportOptions
    from pipeline.export.run import CalibrationSettings, run_export
    from pipeline.tokenizer.tokenizer import load_tokenizer
    from tests.builders import SAMPLE_TEXTS

    out = tmp_path_factory.mktemp("fp8") / "modelopt"
    prefix = out.parent / "calibration_text_document"
    with IndexedDatasetWriter(prefix, np.uint16) as writer:
        for ids in load_tokenizer(tiny_hf_dir).encode_batch(SAMPLE_TEXTS * 8):
            writer.add_document(np.array(ids, dtype=np.uint16), [len(ids)])
        writer.finalize()
    options = ExportOptions(dtype="bfloat16", fp8=True, fp8_kv_cache=True)
    calibration = CalibrationSettings(prefix, size=4, seq_len=32)
    run_export(tiny_hf_dir, out, options, calibration=calibration, verify="off", quiet=True)
    return out


def test_a_modelopt_fp8_export_generates_on_its_dequantized_weights(modelopt_fp8_dir) -> None:
    """pipe's own FP8 export loads for generation: each float8 weight times its scale, the
    activation and KV scales (an FP8 engine's business) left aside."""
    from pipeline.export.modelopt_reader import ModelOptCheckpoint, our_names
    from pipeline.weights.hf_config import config_from_hf
    from pipeline.weights.model import model_from_source
    from pipeline.weights.source import InMemorySource

    checkpoint = ModelOptCheckpoint(modelopt_fp8_dir)
    assert checkpoint.quantized and checkpoint.kv_cache  # the test covers FP8 weights and KV
    weights = our_names(checkpoint.dequantized())
    reference = model_from_source(InMemorySource(config_from_hf(checkpoint.config), weights))
    gen = open_generator(modelopt_fp8_dir)
    assert gen.tokenizer is not None
    loaded = gen.model.state_dict()
    for name, value in reference.state_dict().items():
        assert torch.equal(loaded[name], value), name
    params = SamplingParams(max_new_tokens=NEW, greedy=True)
    ours = [r.output for r in Engine(gen.model).generate(PROMPTS, params)]
    assert ours == [greedy_without_cache(reference, p, NEW) for p in PROMPTS]


@pytest.mark.parametrize(
    ("quantization", "named"),
    [
        ({"quant_method": "modelopt", "quant_algo": "NVFP4"}, "ModelOpt NVFP4"),
        ({"quant_method": "awq", "bits": 4}, "awq"),
        ({"quant_method": "fp8"}, "fp8 without a weight_block_size"),
    ],
)
def test_a_quantization_that_cannot_be_dequantized_is_refused(
    quantization, named, tiny_hf_dir, tmp_path
) -> None:
    import json
    import shutil

    shutil.copytree(tiny_hf_dir, tmp_path, dirs_exist_ok=True)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(
        json.dumps(config | {"quantization_config": quantization})
    )
    with pytest.raises(LoadError, match=f"weights quantized as {named}, which pipe cannot") as e:
        open_generator(tmp_path)
    assert "\n" not in str(e.value)


def test_a_block_fp8_export_generates_on_its_dequantized_weights(tmp_path) -> None:
    """DeepSeek-V3's block FP8 (what `pipe export --fp8` writes for it): each 128 x 128 block
    of a float8 weight times its scale, partial edge blocks included."""
    from pipeline.export.block_fp8_reader import BlockFP8Checkpoint
    from pipeline.export.options import ExportOptions
    from pipeline.export.run import run_export

    _hf_family("deepseek_v3", tmp_path / "hf")
    out = tmp_path / "block_fp8"
    options = ExportOptions(dtype="bfloat16", fp8=True)
    run_export(tmp_path / "hf", out, options, verify="off", quiet=True)
    reference = BlockFP8Checkpoint(out).model()
    gen = open_generator(out)
    loaded = gen.model.state_dict()
    for name, value in reference.state_dict().items():
        assert torch.equal(loaded[name], value), name
    params = SamplingParams(max_new_tokens=NEW, greedy=True)
    ours = [r.output for r in Engine(gen.model).generate(PROMPTS, params)]
    assert ours == [greedy_without_cache(reference, p, NEW) for p in PROMPTS]


@pytest.mark.parametrize("name", ["llama2", "llama3"])
def test_incremental_text_equals_decoding_the_whole_output(name) -> None:
    """Token by token, the released text adds up to the whole output decoded at once (byte
    pieces of one character, SentencePiece's leading spaces), and a stop string cuts it exactly
    where it first appears."""
    from pipeline.serve.engine.text import TextStream
    from pipeline.tokenizer.tokenizer import load_tokenizer
    from tests.builders import shared_file

    tokenizer = load_tokenizer(shared_file(f"tokenizers/{name}"))
    text = "Grüße, naïve 東京 café — 한국어 ✓ and   spaced  words\n\ttabs 🙂 end"
    ids = tokenizer.encode_batch([text])[0]
    whole = tokenizer.decode(ids)
    stream = TextStream(tokenizer.decode)
    pieces = [stream.push(token) for token in ids]
    assert all("\ufffd" not in piece for piece in pieces)
    assert "".join(pieces) + stream.finish() == whole
    stop = TextStream(tokenizer.decode, stop=["한국"])
    released = ""
    for token in ids:
        released += stop.push(token)
        if stop.stopped:
            break
    assert stop.stopped and released == whole[: whole.index("한국")]


@pytest.mark.parametrize("name", ["llama2", "llama3"])
def test_an_output_cut_inside_a_character_is_vllms_text_or_decodes_text(name) -> None:
    """Cut off inside a character (max_tokens), the text is vLLM's by default: the `tokenizers`
    library's DecodeStream, which vLLM's detokenizer steps, after the same prompt; with
    `keep_partial` it is `tokenizer.decode`'s, U+FFFD and all (lm-eval's `hf` model)."""
    from pipeline.serve.engine.text import TextStream
    from pipeline.tokenizer.tokenizer import load_tokenizer
    from tests.builders import served_text, shared_file

    directory = shared_file(f"tokenizers/{name}")
    tokenizer = load_tokenizer(directory)
    prompt, *output = tokenizer.encode_batch(["ask: ok 東京 🙂 Grüße 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 ꧁꧂"])[0]
    cuts = [c for c in range(1, len(output)) if tokenizer.decode(output[:c]).endswith("\ufffd")]
    assert len(cuts) > 3  # characters of several byte pieces
    # SentencePiece's byte fallback (llama2) decodes a run of byte pieces that is not whole
    # UTF-8 as one U+FFFD per piece, the whole characters before the cut included, which the
    # stream has released as text already: `keep_partial` is held to llama3's decode only.
    keeps = (False, True) if name == "llama3" else (False,)
    for cut in range(1, len(output) + 1):
        for keep in keeps:
            stream = TextStream(tokenizer.decode, context=[prompt], keep_partial=keep)
            text = "".join(stream.push(token) for token in output[:cut]) + stream.finish()
            whole = tokenizer.decode([prompt, *output[:cut]])[len(tokenizer.decode([prompt])) :]
            expected = whole if keep else served_text(directory, [prompt], output[:cut])
            assert text == expected, (cut, keep)


def test_a_prompts_last_token_runs_once(llama) -> None:
    """A one-token prompt, or a prompt's last token left alone by the chunking, runs once: in
    the decode rows, not again as prefill (which, for a request aborted mid-step, would find no
    token to run)."""
    params = SamplingParams(max_new_tokens=8, greedy=True)
    engine = Engine(llama, block_size=4, prefill_chunk=3)
    one, four = engine.add([90], params), engine.add([4, 3, 2, 1], params)
    assert [event.request for event in engine.step()] == [one]  # and 3 of four's 4 tokens
    assert [event.request for event in engine.step()] == [one, four]

    class AbortingMidStep(Engine):
        def _advance(self, rows):
            self.abort(rows[0][0])  # as a server thread may, while the step runs
            return super()._advance(rows)

    engine = AbortingMidStep(llama)
    request = engine.add([90], params)
    assert engine.step() == [] and request.finish_reason == "abort"


def test_the_output_text_continues_the_prompt() -> None:
    """Decoded after the prompt's last ids, the first token keeps what it adds to the text (a
    SentencePiece word's leading space): prompt text + output text is the whole text."""
    from pipeline.serve.engine.text import TextStream
    from pipeline.tokenizer.tokenizer import load_tokenizer
    from tests.builders import shared_file

    tokenizer = load_tokenizer(shared_file("tokenizers/llama2"))
    ids = tokenizer.encode_batch(["The quick brown fox jumps over the lazy dog, café 東京"])[0]
    for cut in range(1, len(ids)):
        prompt, output = ids[:cut], ids[cut:]
        stream = TextStream(tokenizer.decode, context=prompt)
        text = "".join(stream.push(token) for token in output) + stream.finish()
        whole, before = tokenizer.decode(ids), tokenizer.decode(prompt)
        if not before.endswith("\ufffd"):
            assert text == whole[len(before) :], cut
    assert TextStream(tokenizer.decode, context=ids[:3]).push(ids[3]).startswith(" ")
