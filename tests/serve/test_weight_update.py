"""New weights without a restart: a real `pipe serve` takes a second model's weights through
shared memory (`WeightClient.push`) or from disk, and then answers as that model does
(transformers' prompt logprobs, `pipe generate`'s greedy text), in the same process; a bad push
is refused in one line with the old weights serving on; pause aborts or refuses with Retry-After;
requests during a push are answered by the old weights or the new, never both."""

from __future__ import annotations

import shutil
import threading
from pathlib import Path

import pytest
import torch

from tests.builders import perturbed

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
psutil = pytest.importorskip("psutil")

from tests.serve.test_server import Server, _wait_for  # noqa: E402

PROBES = ["line 3: value", "the quick brown fox", "x = 12"]


@pytest.fixture(scope="module")
def second_hf_dir(tiny_hf_dir, tmp_path_factory) -> Path:
    """`tiny_hf_dir`'s model with other weights (same tokenizer): the training process's."""
    transformers = pytest.importorskip("transformers")
    directory = tmp_path_factory.mktemp("second_hf")
    torch.manual_seed(1)
    model = perturbed(transformers.LlamaForCausalLM.from_pretrained(tiny_hf_dir))
    model.save_pretrained(directory)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny_hf_dir / name, directory / name)
    return directory


@pytest.fixture(scope="module")
def server(tiny_hf_dir, tmp_path_factory):
    log = tmp_path_factory.mktemp("weights") / "stderr.txt"
    server = Server(tiny_hf_dir, log, "--max-batch", "8", "--block-size", "8")
    yield server
    server.stop()


@pytest.fixture
def client(server, tiny_hf_dir):
    """A weight client of `server`; the server is back on `tiny_hf_dir`'s weights after."""
    from pipeline.serve.http.weight_client import WeightClient

    client = WeightClient(f"http://127.0.0.1:{server.port}")
    yield client
    client.resume()
    client.load(str(tiny_hf_dir))


def _prompt_ids(hf_dir: Path) -> list[list[int]]:
    from pipeline.tokenizer.tokenizer import load_tokenizer

    return load_tokenizer(hf_dir).encode_batch(PROBES)


def _params(hf_dir: Path):
    """The (name, tensor) pairs of `hf_dir`'s model as pipe names them (a training process's)."""
    from pipeline.serve.engine.loading import open_generator

    return open_generator(hf_dir, dtype=torch.float32).model.state_dict().items()


def _hf_logprobs(hf_dir: Path, ids: list[int]) -> list[float]:
    """transformers' log-probability of each prompt token after the first (fp32)."""
    import transformers

    model = transformers.LlamaForCausalLM.from_pretrained(hf_dir, torch_dtype=torch.float32)
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].float()
    chosen = logits[:-1].log_softmax(-1).gather(1, torch.tensor(ids[1:])[:, None])
    return chosen[:, 0].tolist()


def _answer(server, ids: list[int]) -> tuple[int, dict, dict]:
    body = {"prompt": ids, "max_tokens": 8, "temperature": 0, "echo": True, "logprobs": 0}
    return server.post("/v1/completions", body)


def _served_logprobs(server, ids: list[int]) -> list[float]:
    status, _, answer = _answer(server, ids)
    assert status == 200, answer
    return answer["choices"][0]["logprobs"]["token_logprobs"][1 : len(ids)]


def _engine_pids(server) -> tuple[int, ...]:
    return (server.process.pid,) + tuple(
        child.pid for child in psutil.Process(server.process.pid).children()
    )


def test_a_push_serves_the_pushing_model_in_the_same_process(server, client, second_hf_dir):
    from pipeline.serve.engine.core import Engine
    from pipeline.serve.engine.loading import open_generator
    from pipeline.serve.engine.sampling import SamplingParams

    pids = _engine_pids(server)
    before = server.get("/v1/models")[1]["data"][0]["weight_version"]
    fingerprint = _answer(server, [5, 6])[2]["system_fingerprint"]
    trained = open_generator(second_hf_dir, dtype=torch.float32)
    assert client.push(trained.model.named_parameters()) == "1" != before
    for ids in _prompt_ids(second_hf_dir):
        expected = _hf_logprobs(second_hf_dir, ids)
        assert _served_logprobs(server, ids) == pytest.approx(expected, abs=1e-5)
    greedy = SamplingParams(max_new_tokens=8, greedy=True)
    engine = Engine(trained.model, max_batch=len(PROBES))
    outputs = engine.generate([trained.encode(prompt) for prompt in PROBES], greedy)
    for prompt, output in zip(PROBES, outputs):
        body = {"prompt": prompt, "max_tokens": 8, "temperature": 0, "return_token_ids": True}
        assert server.post("/v1/completions", body)[2]["choices"][0]["token_ids"] == output.output
    assert _engine_pids(server) == pids
    assert server.get("/weight_info")[1] == {"weight_version": "1"}
    assert server.get("/v1/models")[1]["data"][0]["weight_version"] == "1"
    assert _answer(server, [5, 6])[2]["system_fingerprint"] != fingerprint


def test_a_bad_push_is_refused_in_one_line_and_the_old_weights_serve(server, client, tiny_hf_dir):
    from pipeline.serve.http.weight_client import WeightPushError

    ids = _prompt_ids(tiny_hf_dir)[0]
    version = server.get("/weight_info")[1]
    served = _served_logprobs(server, ids)
    assert served == pytest.approx(_hf_logprobs(tiny_hf_dir, ids), abs=1e-5)
    good = dict(_params(tiny_hf_dir))
    name = next(iter(good))
    bad_shape = {**good, name: torch.zeros(3, 3)}
    for tensors, words in (
        (bad_shape, [name, "shape [3, 3]"]),
        ({"layers.9.nope": torch.zeros(2)}, ["layers.9.nope", "no such"]),
    ):
        with pytest.raises(WeightPushError) as refused:
            client.push(tensors)
        message = str(refused.value)
        assert "\n" not in message and all(word in message for word in words), message
    assert _served_logprobs(server, ids) == served
    assert server.get("/weight_info")[1] == version


def test_load_from_disk_and_pause_abort_refuse_resume(server, client, tiny_hf_dir, second_hf_dir):
    ids = _prompt_ids(tiny_hf_dir)[1]
    assert client.load(str(second_hf_dir), weight_version="step-7") == "step-7"
    expected = _hf_logprobs(second_hf_dir, ids)
    assert _served_logprobs(server, ids) == pytest.approx(expected, abs=1e-5)
    long = {"prompt": "x", "max_tokens": 1900, "temperature": 0, "ignore_eos": True}
    answers = []
    thread = threading.Thread(target=lambda: answers.append(server.post("/v1/completions", long)))
    thread.start()
    assert _wait_for(lambda: server.get("/health")[1]["running"] == 1), server.stderr()
    assert server.post("/pause?mode=abort", {})[2] == {"status": "paused"}
    thread.join(30)
    assert answers[0][2]["choices"][0]["finish_reason"] == "abort"
    assert server.get("/is_paused")[1] == {"is_paused": True}
    status, headers, refused = server.post("/v1/completions", {"prompt": "x", "max_tokens": 2})
    assert status == 503 and _retry_after(headers) == "1", refused
    assert server.post("/pause?mode=keep", {})[0] == 400
    assert server.post("/resume", {})[2] == {"status": "resumed"}
    assert server.post("/v1/completions", {"prompt": "x", "max_tokens": 2})[0] == 200


def test_a_session_of_pushes_takes_one_version(server, client, second_hf_dir):
    """TRL's `weight_update()`: start, several pushes, finish with the version's name."""
    assert server.post("/start_weight_update", {})[0] == 200
    assert server.post("/start_weight_update", {})[0] == 409
    for name, tensor in _params(second_hf_dir):
        client.push({name: tensor})
    assert server.get("/is_paused")[1] == {"is_paused": True}
    status, _, done = server.post("/finish_weight_update", {"weight_version": "step-9"})
    assert status == 200 and done["weight_version"] == "step-9", done
    assert server.get("/is_paused")[1] == {"is_paused": False}
    ids = _prompt_ids(second_hf_dir)[2]
    expected = _hf_logprobs(second_hf_dir, ids)
    assert _served_logprobs(server, ids) == pytest.approx(expected, abs=1e-5)
    assert server.post("/finish_weight_update", {})[0] == 400


def test_requests_during_a_push_are_never_mixed(server, client, tiny_hf_dir, second_hf_dir):
    ids = _prompt_ids(tiny_hf_dir)[0]
    old = _answer(server, ids)[2]
    trained = dict(_params(second_hf_dir))
    seen, stop = [], threading.Event()

    def hammer() -> None:
        while not stop.is_set():
            seen.append(_answer(server, ids))

    threads = [threading.Thread(target=hammer) for _ in range(4)]
    for thread in threads:
        thread.start()
    assert _wait_for(lambda: len(seen) >= 4)
    client.push(trained)
    stop.set()
    for thread in threads:
        thread.join(30)
    new = _answer(server, ids)[2]
    assert _choice(new)[1] != pytest.approx(_choice(old)[1], abs=1e-3)
    by_weights = {answer["system_fingerprint"]: _choice(answer) for answer in (old, new)}
    for status, headers, answer in seen:
        if status == 503:
            assert _retry_after(headers) == "1"
        else:  # batched with others: equal up to the float sums' order
            text, logprobs = by_weights[answer["system_fingerprint"]]
            assert _choice(answer) == (text, pytest.approx(logprobs, abs=1e-5)), answer


def _retry_after(headers: dict) -> str:
    return {key.lower(): value for key, value in headers.items()}["retry-after"]


def _choice(answer: dict) -> tuple[str, list[float]]:
    choice = answer["choices"][0]
    return choice["text"], choice["logprobs"]["token_logprobs"][1:]


def _hf_greedy_logprobs(hf_dir: Path, prompt: list[int], count: int) -> list[float]:
    """transformers' log-probabilities of its own `count` greedy tokens after `prompt` (fp32)."""
    import transformers

    model = transformers.LlamaForCausalLM.from_pretrained(hf_dir, torch_dtype=torch.float32)
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]),
            max_new_tokens=count,
            do_sample=False,
            output_scores=True,
            return_dict_in_generate=True,
        )
    chosen = out.sequences[0, len(prompt) :]
    return [score[0].log_softmax(-1)[token].item() for score, token in zip(out.scores, chosen)]


def _generate(server, ids: list[int]) -> tuple[list[float], int]:
    """A greedy completion of `ids` (no prompt logprobs, so the prefix cache serves it): its
    tokens' logprobs and the prompt tokens read from the cache."""
    body = {"prompt": ids, "max_tokens": 4, "temperature": 0, "logprobs": 0}
    status, _, answer = server.post("/v1/completions", body)
    assert status == 200, answer
    cached = answer["usage"]["prompt_tokens_details"]["cached_tokens"]
    return answer["choices"][0]["logprobs"]["token_logprobs"], cached


def test_a_prompt_cached_before_a_push_is_recomputed_after_it(
    server, client, tiny_hf_dir, second_hf_dir
):
    ids = [token for probe in _prompt_ids(tiny_hf_dir) for token in probe] * 4  # several blocks
    _generate(server, ids)
    old, cached = _generate(server, ids)
    assert cached >= 8, "the second request reads the first one's blocks"
    client.push(dict(_params(second_hf_dir)))
    new, cached = _generate(server, ids)
    assert cached == 0, "the push dropped the old weights' blocks"
    assert new == pytest.approx(_hf_greedy_logprobs(second_hf_dir, ids, 4), abs=1e-5)
    assert new != pytest.approx(old, abs=1e-3)
    assert _generate(server, ids)[1] >= 8, "the new weights' blocks are cached again"


def test_load_a_pipe_checkpoint_from_disk(server, client, second_hf_dir, tmp_path):
    """/update_weights with a pipe checkpoint's path (`pipe convert`'s output), not only a
    Hugging Face directory."""
    from tests.builders import run_pipe

    checkpoint = tmp_path / "ckpt"
    run_pipe("convert", second_hf_dir, "--from", "hf", "--output", checkpoint)
    assert client.load(str(checkpoint), weight_version="pipe-ckpt") == "pipe-ckpt"
    for ids in _prompt_ids(second_hf_dir):
        expected = _hf_logprobs(second_hf_dir, ids)
        assert _served_logprobs(server, ids) == pytest.approx(expected, abs=1e-5)
