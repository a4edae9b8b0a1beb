"""`pipe serve`'s start-up checks, which answer before any model loads: a port in use, a LoRA
adapter directory given as the model, tool options that do not go together."""

from __future__ import annotations

import json
import socket
import subprocess
import sys

from tests.builders import ROOT


def serve(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "pipeline", "serve", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_a_port_in_use_is_found_before_the_model_loads(tmp_path) -> None:
    empty = tmp_path / "not_a_model"  # loading it would fail with another message
    empty.mkdir()
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = serve(str(empty), "--port", str(port))
    assert result.returncode == 1
    assert result.stderr.strip() == f"Error: --host 127.0.0.1 --port {port}: address in use"


def test_an_adapter_directory_gets_a_hint(tmp_path) -> None:
    adapter = tmp_path / "my_adapter"
    adapter.mkdir()
    config = {"peft_type": "LORA", "base_model_name_or_path": "/models/base", "r": 8}
    (adapter / "adapter_config.json").write_text(json.dumps(config))
    result = serve(str(adapter))
    assert result.returncode == 1
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and f"pipe serve /models/base --lora-adapter {adapter}" in lines[0]


def test_auto_tool_choice_needs_a_parser(tmp_path) -> None:
    result = serve(str(tmp_path), "--enable-auto-tool-choice")
    assert result.returncode == 2 and "--enable-auto-tool-choice needs --tool-call-parser" in (
        result.stderr
    )


def test_connections_to_the_served_socket_send_small_writes_at_once() -> None:
    """Each accepted connection has Nagle's algorithm off (asyncio sets TCP_NODELAY only on a
    socket that names TCP as its protocol): with it on, a streamed reply's first token waited
    for the client's delayed ACK, about 40 ms."""
    import asyncio

    from pipeline.serve.http.startup import bind_socket

    async def accepted_nodelay() -> int:
        seen: asyncio.Future = asyncio.get_running_loop().create_future()

        def on_connect(_reader, writer) -> None:
            sock = writer.get_extra_info("socket")
            seen.set_result(sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
            writer.close()

        server = await asyncio.start_server(on_connect, sock=bind_socket("127.0.0.1", 0))
        port = server.sockets[0].getsockname()[1]
        _reader, writer = await asyncio.open_connection("127.0.0.1", port)
        value = await asyncio.wait_for(seen, 10)
        writer.close()
        server.close()
        return value

    assert asyncio.run(accepted_nodelay()) != 0
