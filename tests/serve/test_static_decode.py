"""The static-shape decode step (`pipeline.serve.engine.static_decode`), run eagerly on a CPU,
gives today's decoding token for token: every family, greedy and seeded sampling (top-k, top-p,
penalties, logit bias), log-probabilities, groups sharing a prompt, the prefix cache, prompt
log-probabilities, adapters by name (against peft), structured-output and tool requests. Its
step (a MoE family's too, its experts in grouped products) never synchronises with the host nor
takes a shape other than its bucket's, and its inputs keep their memory from step to step (what
a CUDA graph's replay needs; the capture itself is `test_cuda_graphs.py`'s, on a GPU)."""

from __future__ import annotations

import logging

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from pipeline.serve.engine.core import Engine
from pipeline.serve.engine.loading import open_generator
from pipeline.serve.engine.sampling import SamplingParams
from pipeline.serve.engine.static_decode import batch_buckets, capture_problem, width_blocks
from tests.serve.test_generation import FAMILIES, PROMPTS, _hf_family

pytest.importorskip("transformers")

SETTINGS = [
    SamplingParams(max_new_tokens=10, greedy=True),
    SamplingParams(max_new_tokens=12, temperature=1.3, top_k=20, seed=2, logprobs=3),
    SamplingParams(max_new_tokens=9, temperature=0.9, top_p=0.7, seed=3),
    SamplingParams(
        max_new_tokens=11,
        temperature=1.0,
        seed=4,
        repetition_penalty=1.3,
        frequency_penalty=0.5,
        logit_bias=((7, 5.0),),
        logprobs=0,
    ),
]


def _outputs(engine: Engine, requests) -> list:
    """Each request's tokens, and the log-probabilities of the events seen here (a `run` that
    steps the engine itself sees its own)."""
    found = {id(r): [] for r in requests}
    for event in engine.run():
        found[id(event.request)].append((event.logprobs, event.prompt_logprobs))
    return [(r.output, r.finish_reason, found[id(r)]) for r in requests]


def _same(static: list, eager: list) -> int:
    """Tokens equal; log-probabilities equal to float32 rounding (the padded step's products run
    over other shapes) with the same alternatives."""
    compared = 0
    for (tokens, reason, events), (theirs, their_reason, their_events) in zip(static, eager):
        assert tokens and (tokens, reason) == (theirs, their_reason)
        assert len(events) == len(their_events)
        for (a, pa), (b, pb) in zip(events, their_events):
            assert (pa is None) == (pb is None)
            for x, y in [(a, b), *zip(pa or (), pb or ())]:
                assert (x is None) == (y is None)
                if x is not None:
                    assert x.token_logprob == pytest.approx(y.token_logprob, abs=1e-4)
                    assert [i for i, _ in x.top] == [i for i, _ in y.top]
                    compared += 1
    return compared


def _both(model, run, **kwargs) -> tuple[Engine, int]:
    """`run(engine)` (queueing requests, returning them) on the static step and the eager one;
    checks the two gave the same; returns the static engine and how many log-probabilities
    were compared."""
    results = []
    for static in (True, False):
        engine = Engine(model, static_decode=static, **kwargs)
        assert (engine.decoder is not None) == static
        results.append((engine, _outputs(engine, run(engine))))
    (engine, mine), (_, theirs) = results
    return engine, _same(mine, theirs)


@pytest.fixture(scope="module", params=FAMILIES)
def family_model(request, tmp_path_factory):
    directory = tmp_path_factory.mktemp(request.param)
    _hf_family(request.param, directory)
    return open_generator(directory).model


def test_every_family_decodes_as_the_eager_step(family_model) -> None:
    """Four requests with their own settings on a batch of 3 (buckets 1, 2, 3): the fourth
    joins when the first leaves, rows are padded, widths grow with the rows."""

    def run(engine):
        return [engine.add(p, s) for p, s in zip(PROMPTS, SETTINGS)]

    engine, compared = _both(family_model, run, max_batch=3, block_size=4, prefill_chunk=5)
    assert compared >= 12 + 11  # every token of the two rows that ask
    buckets = {bucket for bucket, _ in engine.decoder.shapes}
    widths = {width for _, width in engine.decoder.shapes}
    assert buckets <= {1, 2, 3} and len(buckets) > 1
    assert widths <= {4, 8, 16, 32} and len(widths) > 1


def test_prompt_chunks_of_one_token_are_not_decode_rows(llama) -> None:
    """With `prefill_chunk=1` every prompt chunk is one new token, as a decode row is: the
    static step takes only the scheduler's decode rows, so no token is sampled mid-prompt."""

    def run(engine):
        return [engine.add(p, s) for p, s in zip(PROMPTS[:2], SETTINGS[:2])]

    _both(llama, run, max_batch=2, block_size=4, prefill_chunk=1)


def test_groups_prefix_cache_and_prompt_logprobs(llama) -> None:
    """Groups sharing a prompt (one runs its last prompt token as a decode row), a later prompt
    on the prefix cache's blocks, prompt log-probabilities: as the eager step, packed rows and
    all."""
    prompt = list(range(3, 22))
    seeded = [SamplingParams(max_new_tokens=8, temperature=1.1, seed=s) for s in range(3)]

    def run(engine):
        first = engine.add_group(prompt, seeded)
        first += engine.add_group(prompt[:9], [SETTINGS[0], SETTINGS[1]])
        list(engine.run())
        asking = SamplingParams(max_new_tokens=6, greedy=True, prompt_logprobs=2, logprobs=1)
        return first + engine.add_group(prompt + [40, 41], [asking, SETTINGS[2]])

    engine, compared = _both(llama, run, max_batch=8, block_size=4, prefill_chunk=8)
    assert engine.prompt_tokens_cached > 0 and compared > 21  # 21 prompt tokens


def test_adapters_by_name_give_peft_tokens(tiny_hf_dir, tmp_path) -> None:
    """Rows of one batch with two adapters and none, through the kept row -> slot tensor: the
    tokens of transformers + peft."""
    pytest.importorskip("peft")
    from pipeline.serve.engine.lora_slots import LoRASlots
    from pipeline.tokenizer.tokenizer import load_tokenizer
    from tests.serve.test_lora_slots import NEW_TOKENS, hf_greedy, peft_adapter

    prompts = load_tokenizer(tiny_hf_dir).encode_batch(["line 3: value", "import os"])
    a = peft_adapter(tiny_hf_dir, tmp_path / "a", 1, ["q_proj", "v_proj", "down_proj"], rank=4)
    b = peft_adapter(tiny_hf_dir, tmp_path / "b", 2, ["k_proj", "o_proj", "up_proj"], rank=8)
    expected = {"a": [hf_greedy(a, p) for p in prompts], "b": [hf_greedy(b, p) for p in prompts]}
    with a.disable_adapter():
        expected[None] = [hf_greedy(a, p) for p in prompts]
    gen = open_generator(tiny_hf_dir)
    engine = Engine(gen.model, max_batch=6, block_size=8, static_decode=True)
    engine.adapters = LoRASlots.install(gen.model, 2, 16)
    engine.adapters.register("a", str(tmp_path / "a"))
    engine.adapters.register("b", str(tmp_path / "b"))
    params = SamplingParams(max_new_tokens=NEW_TOKENS, greedy=True)
    requests = {
        (name, i): engine.add(p, params, name)
        for name in ("a", None, "b")
        for i, p in enumerate(prompts)
    }
    list(engine.run())
    for (name, i), request in requests.items():
        assert request.output == expected[name][i], (name, i)
    alone = engine.add(prompts[0], params)  # the base alone: a step without adapters
    list(engine.run())
    assert alone.output == expected[None][0]


def test_structured_output_and_tool_requests(tiny_hf_dir) -> None:
    """A tool call forced by `tool_choice` (its JSON schema), a choice and a regex beside plain
    seeded rows: the grammar masks act on the static step's logits as on the eager step's."""
    pytest.importorskip("llguidance")
    from pipeline.serve.engine.structured_output import GrammarBackend, StructuredOutput
    from pipeline.serve.http.tool_fields import tool_choice_json_schema

    gen = open_generator(tiny_hf_dir)
    tools = [
        {
            "type": "function",
            "function": {
                "name": "weather",
                "parameters": {
                    "type": "object",
                    "properties": {"city": {"type": "string", "maxLength": 6}},
                    "required": ["city"],
                    "additionalProperties": False,
                },
            },
        }
    ]
    outputs = [
        StructuredOutput.json_schema(tool_choice_json_schema(tools, "required")),
        StructuredOutput.choice(["red", "green", "blue"]),
        StructuredOutput("regex", "[a-z]{2,5}-[0-9]{2}"),
        None,
    ]
    prompts = gen.tokenizer.encode_batch(["line 3: value", "abc abc", "value=14", "x y"])

    def run(engine):
        engine.grammars = GrammarBackend.from_path(
            gen.tokenizer_path, gen.model.config.vocab_size, gen.eos_ids
        )
        return [
            engine.add(
                p,
                SamplingParams(
                    max_new_tokens=60, seed=i, structured_output=o, stop_token_ids=gen.eos_ids
                ),
            )
            for i, (p, o) in enumerate(zip(prompts, outputs))
        ]

    _both(gen.model, run, max_batch=4, block_size=16)


class NoHostSync(TorchDispatchMode):
    """Records the ops that wait on the device's values (a tensor read as a Python number or
    list, a shape that depends on values) and the first dimension of every op's tensor inputs.
    `Tensor.tolist` reads the values without dispatching an op, so it is watched by hand."""

    WAITS = ("_local_scalar_dense", "nonzero", "masked_select", "unique", "item")

    def __init__(self) -> None:
        super().__init__()
        self.waits: list[str] = []
        self.leading: set[int] = set()
        self._tolist = torch.Tensor.tolist

    def __enter__(self):
        plain, waits = self._tolist, self.waits

        def tolist(tensor: torch.Tensor):
            waits.append("tolist")
            return plain(tensor)

        torch.Tensor.tolist = tolist
        return super().__enter__()

    def __exit__(self, *exc):
        torch.Tensor.tolist = self._tolist
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.__name__
        if any(wait in name for wait in self.WAITS):
            self.waits.append(name)
        for arg in args:
            if isinstance(arg, torch.Tensor) and arg.dim() > 1:
                self.leading.add(arg.shape[0])
            if isinstance(arg, (list, tuple)) and any(
                isinstance(a, torch.Tensor) and a.dtype == torch.bool for a in arg
            ):
                self.waits.append(f"{name} with a boolean index")
        return func(*args, **(kwargs or {}))


def _watched_steps(model) -> tuple[Engine, list, dict]:
    """Three seeded requests leaving one by one on a static engine over `model`, every step
    run under `NoHostSync`: the engine, (read slots' shape, mode) per step, and the memory of
    each shape's inputs and output."""
    engine = Engine(model, max_batch=4, block_size=4, static_decode=True)
    decoder, seen, pointers = engine.decoder, [], {}
    plain_step = decoder._step

    def watched(inputs):
        mode = NoHostSync()
        with mode:
            out = plain_step(inputs)
        seen.append((inputs.read_slots.shape, mode))
        shape = tuple(inputs.read_slots.shape)
        pointers.setdefault(shape, set()).add(
            (inputs.tokens.data_ptr(), inputs.read_slots.data_ptr(), out.data_ptr())
        )
        return out

    decoder._step = watched
    for new, prompt in zip((4, 6, 8), PROMPTS):  # leaving one by one
        engine.add(prompt, SamplingParams(max_new_tokens=new, temperature=1.0, seed=new))
    list(engine.run())
    return engine, seen, pointers


def _assert_static(model, engine: Engine, seen: list, pointers: dict, rows_per_token: int) -> None:
    """No step waited on the device; every tensor's leading dimension is the bucket's rows
    (times `rows_per_token`: a MoE layer's (token, expert) assignments), their history's slots
    (the cache's gather), one (broadcast) or a weight's; inputs kept their memory."""
    assert len(seen) >= 6
    weights = {p.shape[0] for p in model.parameters()} | {engine.cache.pools[0][0].shape[0]}
    for (bucket, width), mode in seen:
        assert mode.waits == [], mode.waits
        rows = {bucket, bucket * width, bucket * rows_per_token, 1}
        assert mode.leading <= rows | weights, (bucket, mode.leading)
    assert all(len(each) == 1 for each in pointers.values()), pointers  # same memory each step
    assert {bucket for (bucket, _), _ in seen} == {1, 2, 4}  # 3 rows padded to 4, then fewer


def test_the_step_never_waits_on_the_device_and_keeps_its_buffers(llama) -> None:
    """Under a mode that sees every op: the static step reads no value back to the host and
    its tensors' leading dimension is the bucket (or the weights'); its inputs keep their
    memory from step to step. The same mode catches the eager step's mask check."""
    engine, seen, pointers = _watched_steps(llama)
    _assert_static(llama, engine, seen, pointers, rows_per_token=1)
    # the check can fail: the eager step asks the host whether every row is as long
    from pipeline.serve.engine.batching import plain_batch
    from pipeline.serve.engine.decode import forward_cached

    request = engine.add(PROMPTS[1], SamplingParams(max_new_tokens=2))
    engine.step()
    mode = NoHostSync()
    with mode:
        forward_cached(llama, engine.cache, plain_batch([(request, 1)], 0, torch.device("cpu")))
    assert "_local_scalar_dense.default" in mode.waits


def test_a_moe_step_never_waits_on_the_device(tmp_path) -> None:
    """Mixtral's static step, its experts in grouped products (`grouped_mm_serves`): no value
    read back to the host, so a CUDA graph can hold it; the loop over experts would ask."""
    from pipeline.core.model import moe

    _hf_family("mixtral", tmp_path)
    model = open_generator(tmp_path).model
    engine, seen, pointers = _watched_steps(model)
    _assert_static(model, engine, seen, pointers, rows_per_token=model.config.moe.top_k)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(moe, "grouped_mm_serves", lambda *a: False)
        engine, seen, _ = _watched_steps(model)
    assert all("tolist" in mode.waits for _, mode in seen)


def test_buckets_widths_and_the_default_switch(llama, caplog) -> None:
    assert batch_buckets(1) == [1] and batch_buckets(8) == [1, 2, 4, 8]
    assert batch_buckets(12) == [1, 2, 4, 8, 12]
    assert [width_blocks(n, 6) for n in (1, 2, 3, 5, 6)] == [1, 2, 4, 6, 6]
    assert Engine(llama).decoder is None  # default on a CPU: the eager, packed step
    with caplog.at_level(logging.WARNING):
        asked = Engine(llama, cuda_graphs=True)
    assert asked.decoder is None and "CUDA graphs off: the engine runs on cpu" in caplog.text
    static = Engine(llama, static_decode=True).decoder
    assert static is not None and not static.graphs
    assert capture_problem(llama, 1) is None
    assert "tensor-parallel" in capture_problem(llama, 2)


def test_models_that_cannot_be_captured_say_why() -> None:
    from pipeline.core.model.block import ModelOptions
    from pipeline.core.model.flavors import get_flavor
    from pipeline.core.model.transformer import Transformer

    # MoE: captured where the experts run as grouped products (float32 on a CPU, for the rule
    # itself; a GPU needs bf16), not when a capacity factor drops tokens
    model = Transformer(get_flavor("tiny_moe"))
    assert capture_problem(model, 1) is None
    assert "MoE layers ask the host" in capture_problem(model.half(), 1)
    dropping = get_flavor("tiny_moe")
    dropping.moe.capacity_factor = 1.25
    assert "drop tokens over a capacity" in capture_problem(Transformer(dropping), 1)
    recomputing = Transformer(get_flavor("tiny"), ModelOptions(activation_checkpointing="full"))
    assert "recompute activations" in capture_problem(recomputing, 1)
    assert capture_problem(Transformer(get_flavor("tiny")), 1) is None


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        ((), None),
        (("--no-cuda-graphs",), False),
        (("--enforce-eager",), False),
        (("--cuda-graphs",), True),
    ],
)
def test_the_switch_reaches_the_engines_of_generate_and_serve(
    flags, expected, tiny_hf_dir, monkeypatch
) -> None:
    """`pipe generate` and `pipe serve` hand `--cuda-graphs/--no-cuda-graphs` and vLLM's
    `--enforce-eager` to their engine (default None: on when the device is CUDA)."""
    import pipeline.serve.engine.core as core
    import pipeline.serve.http.server as server
    from tests.builders import run_pipe

    asked = []
    real = core.static_decoder

    def recording(*args, **kwargs):
        asked.append(kwargs["cuda_graphs"])
        return real(*args, **kwargs)

    monkeypatch.setattr(core, "static_decoder", recording)
    run_pipe("generate", tiny_hf_dir, "--prompt", "hi", "--max-new-tokens", "2", *flags)
    specs = []
    monkeypatch.setattr(server, "run_server", lambda spec, **_: specs.append(spec))
    run_pipe("serve", tiny_hf_dir, *flags)
    assert asked == [expected] and [spec.cuda_graphs for spec in specs] == [expected]


def test_enforce_eager_with_cuda_graphs_is_refused(tiny_hf_dir) -> None:
    from tests.builders import run_pipe

    for command in ("generate", "serve"):
        args = ["--prompt", "hi"] if command == "generate" else []
        result = run_pipe(
            command, tiny_hf_dir, *args, "--enforce-eager", "--cuda-graphs", expect_ok=False
        )
        assert result.exit_code == 2
        assert "--enforce-eager and --cuda-graphs ask for opposite things" in result.output
