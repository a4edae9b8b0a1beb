"""`pipe serve` on the loopback address, in its own process: the OpenAI endpoints, a bounded
load test (64 concurrent streaming clients), 4xx answers, disconnects and SIGTERM."""

from __future__ import annotations

import http.client
import json
import os
import random
import signal
import socket
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.builders import ROOT, free_port

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
psutil = pytest.importorskip("psutil")


# `python -m pipeline ARGS` in a process forked from the tests' fork server (tests/forked.py),
# which has already imported torch and the front end's modules: seconds less per start.
PIPE_MAIN = """
from pipeline.cli import main
main()
"""


class Server:
    """A `pipe serve` process and a tiny client for it."""

    def __init__(self, model_dir: Path, log: Path, *extra: str) -> None:
        from tests.forked import run_forked

        self.port = free_port()
        self.log = log
        args = ["serve", str(model_dir), "--port", str(self.port), *extra]
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        # stderr to a file: a pipe nobody reads would block the server once full
        log.write_text("")
        self.process = run_forked(PIPE_MAIN, *args, cwd=Path.cwd(), env=env, stderr=log)
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            assert self.process.poll() is None, self.stderr()
            try:
                if self.get("/health")[0] == 200:
                    return
            except OSError:
                time.sleep(0.2)
        raise AssertionError("the server did not start in 90 s")

    def stderr(self) -> str:
        return self.log.read_text()[-3000:]

    def connection(self) -> http.client.HTTPConnection:
        return http.client.HTTPConnection("127.0.0.1", self.port, timeout=60)

    def get(self, path: str) -> tuple[int, dict]:
        conn = self.connection()
        conn.request("GET", path)
        response = conn.getresponse()
        return response.status, json.loads(response.read())

    def post(self, path: str, body: dict | str) -> tuple[int, dict, dict]:
        conn = self.connection()
        data = body if isinstance(body, str) else json.dumps(body)
        conn.request("POST", path, data, {"Content-Type": "application/json"})
        response = conn.getresponse()
        return response.status, dict(response.getheaders()), json.loads(response.read())

    def stream(self, path: str, body: dict) -> tuple[int, list]:
        """Status and the parsed server-sent events (the last one "[DONE]")."""
        conn = self.connection()
        conn.request(
            "POST", path, json.dumps({**body, "stream": True}), {"Content-Type": "application/json"}
        )
        response = conn.getresponse()
        if response.status != 200:
            headers = {k.lower(): v for k, v in response.getheaders()}
            return response.status, [json.loads(response.read()), headers]
        events = []
        for line in response:
            if line.startswith(b"data: "):
                payload = line[6:].strip().decode()
                events.append(payload if payload == "[DONE]" else json.loads(payload))
        return 200, events

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            self.process.wait(30)
        self.process.discard_output()


@pytest.fixture(scope="module")
def server(tiny_hf_dir, tmp_path_factory):
    log = tmp_path_factory.mktemp("server") / "stderr.txt"
    server = Server(
        tiny_hf_dir, log, "--max-batch", "8", "--max-waiting", "16", "--block-size", "8"
    )
    yield server
    server.stop()


def test_models_health_and_a_completion(server, tiny_hf_dir) -> None:
    assert server.get("/health")[1]["status"] == "ok"
    assert server.get("/v1/models")[1]["data"][0]["id"] == str(tiny_hf_dir)  # the path given
    body = {"prompt": "line 3: value", "max_tokens": 8, "temperature": 0}
    status, _, whole = server.post("/v1/completions", body)
    assert status == 200 and whole["choices"][0]["finish_reason"] == "length"
    assert whole["usage"]["completion_tokens"] == 8
    status, events = server.stream("/v1/completions", body)
    assert events[-1] == "[DONE]"
    text = "".join(e["choices"][0]["text"] for e in events[:-1])
    assert text == whole["choices"][0]["text"]  # streamed and whole answers agree
    seeded = {"prompt": "x", "max_tokens": 12, "temperature": 1.0, "seed": 5}
    assert (
        server.post("/v1/completions", seeded)[2]["choices"]
        == server.post("/v1/completions", seeded)[2]["choices"]
    )


def test_chat_uses_the_tokenizer_template(server, tiny_hf_dir) -> None:
    from pipeline.serve.http.openai_api import chat_prompt
    from pipeline.tokenizer.tokenizer import load_tokenizer
    from tests.serve.conftest import CHAT_TEMPLATE

    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    body = {"messages": messages, "max_tokens": 4, "temperature": 0}
    status, _, answer = server.post("/v1/chat/completions", body)
    assert status == 200 and answer["object"] == "chat.completion"
    assert answer["choices"][0]["message"]["role"] == "assistant"
    prompt = chat_prompt(messages, CHAT_TEMPLATE)
    assert prompt == "<|system|>Be brief.\n<|user|>Hi\n<|assistant|>"
    tokenizer = load_tokenizer(tiny_hf_dir)
    assert answer["usage"]["prompt_tokens"] == len(tokenizer.encode_batch([prompt])[0])
    status, events = server.stream("/v1/chat/completions", body)
    assert events[0]["object"] == "chat.completion.chunk" and events[-1] == "[DONE]"


@pytest.mark.parametrize(
    ("path", "body", "message"),
    [
        ("/v1/completions", '{"prompt": "x", ', "JSON decode error"),
        ("/v1/completions", {"prompt": "x", "temperature": -1}, "temperature"),
        ("/v1/completions", {"prompt": "x", "top_p": 1.5}, "top_p"),
        ("/v1/completions", {"prompt": "x", "max_tokens": 0}, "max_tokens"),
        (
            "/v1/completions",
            {"prompt": "word " * 1500, "max_tokens": 8},
            "maximum context length is 2048",
        ),
        ("/v1/completions", {"max_tokens": 8}, "prompt: Field required"),
        ("/v1/chat/completions", {"messages": []}, "messages"),
        ("/v1/chat/completions", {"messages": [{"role": "bot", "content": "x"}]}, "role"),
    ],
)
def test_bad_requests_get_400_with_a_message(server, path, body, message) -> None:
    status, _, answer = server.post(path, body)
    assert status == 400 and message in answer["error"]["message"], answer


def test_load_every_request_answered_or_refused(server) -> None:
    """64 concurrent streaming clients, 320 requests in two rounds: each gets a whole stream or a
    503 with Retry-After, none is lost or answered twice, and the server's memory stays flat."""
    process = psutil.Process(server.process.pid)

    def one(index: int) -> tuple[int, str | None, int]:
        rng = random.Random(index)
        body = {
            "prompt": f"line {index}: value",
            "max_tokens": rng.randint(1, 24),
            "temperature": 0.8,
            "seed": index,
        }
        status, events = server.stream("/v1/completions", body)
        if status == 503:
            assert events[1]["retry-after"] == "1" and "waiting" in events[0]["error"]["message"]
            return status, None, 0
        assert status == 200 and events[-1] == "[DONE]", events[-1:]
        ids = {e["id"] for e in events[:-1]}
        assert len(ids) == 1 and events[-2]["choices"][0]["finish_reason"] is not None
        return status, ids.pop(), body["max_tokens"]

    def round_of(start: int) -> list:
        with ThreadPoolExecutor(64) as pool:
            return list(pool.map(one, range(start, start + 160), timeout=120))

    deadline = time.monotonic() + 120
    first = round_of(0)
    rss_after_first = process.memory_info().rss
    second = round_of(1000)
    grew = process.memory_info().rss - rss_after_first
    assert time.monotonic() < deadline
    results = first + second
    answered = [r for r in results if r[0] == 200]
    assert len(results) == 320 and all(r[0] in (200, 503) for r in results)
    assert len({ident for _, ident, _ in answered}) == len(answered)  # none answered twice
    assert len(answered) >= 8 * 2  # the batch was busy, not refusing everything
    assert len(answered) < len(results), "64 clients over 24 places: some must be refused"
    assert grew < 40 * 2**20, f"server memory grew by {grew / 2**20:.1f} MB in round two"
    health = server.get("/health")[1]
    assert health["running"] == 0 and health["waiting"] == 0


def _wait_for(predicate, seconds: float = 20) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return False


def test_a_disconnected_client_frees_its_slot(server) -> None:
    # Requests of earlier tests on this server may still be finishing on a loaded machine.
    idle = _wait_for(lambda: server.get("/health")[1]["running"] == 0, seconds=60)
    assert idle, server.get("/health")
    aborted = server.get("/health")[1]["finished"].get("abort", 0)
    for stream in (True, False):
        body = json.dumps({"prompt": "x", "max_tokens": 2000, "temperature": 0, "stream": stream})
        with socket.create_connection(("127.0.0.1", server.port)) as sock:
            sock.sendall(
                b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                + f"Content-Length: {len(body)}\r\n\r\n{body}".encode()
            )
            running = _wait_for(lambda: server.get("/health")[1]["running"] == 1)
            assert running, (server.get("/health"), server.stderr())
        aborted += 1
        assert _wait_for(lambda n=aborted: server.get("/health")[1]["finished"].get("abort") == n)
        assert server.get("/health")[1]["running"] == 0


def test_sigterm_drains_then_exits(tiny_hf_dir, tmp_path) -> None:
    server = Server(tiny_hf_dir, tmp_path / "stderr.txt")
    try:
        body = {"prompt": "x", "max_tokens": 300, "temperature": 0}
        whole = server.post("/v1/completions", body)[2]["choices"][0]["text"]
        conn = server.connection()
        body["stream"] = True
        conn.request(
            "POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"}
        )
        response = conn.getresponse()
        first = response.readline()
        assert first.startswith(b"data: ")
        server.process.send_signal(signal.SIGTERM)
        rest = response.read().decode()
        assert rest.rstrip().endswith("data: [DONE]")
        chunks = [json.loads(line[6:]) for line in rest.splitlines() if line.startswith("data: {")]
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"
        streamed = json.loads(first[6:])["choices"][0]["text"]
        streamed += "".join(chunk["choices"][0]["text"] for chunk in chunks)
        assert streamed == whole  # every token arrived, none cut by the shutdown
        # uvicorn ends by re-raising the signal once drained (0 on older versions)
        assert server.process.wait(30) in (0, -signal.SIGTERM)
    finally:
        server.stop()


def test_an_engine_that_dies_is_reported_not_hidden(tiny_hf_dir, tmp_path) -> None:
    """The engine process killed: /health answers 503 (a load balancer stops sending), and a
    request gets an error body instead of hanging."""
    server = Server(tiny_hf_dir, tmp_path / "stderr.txt")
    try:
        children = psutil.Process(server.process.pid).children()
        (engine,) = [c for c in children if "spawn_main" in " ".join(c.cmdline())]
        engine.kill()
        assert _wait_for(lambda: server.get("/health")[0] == 503), server.get("/health")
        assert server.get("/health")[1]["status"] == "failed"
        status, _, answer = server.post("/v1/completions", {"prompt": "x", "max_tokens": 4})
        assert status >= 500 and "engine" in answer["error"]["message"]
    finally:
        server.stop()
