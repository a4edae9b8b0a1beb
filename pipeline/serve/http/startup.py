"""What `pipe serve` does around loading the model: the address taken before the model loads
(a port in use is a one-line error at once, not after minutes of loading), a hint when the
checkpoint given is a LoRA adapter directory, the start-up line once the server accepts
connections, and the optional access log."""

from __future__ import annotations

import errno
import json
import logging
import socket
import sys
from pathlib import Path

import click

STARTUP_PREFIX = "pipe serve: listening on"


def bind_socket(host: str, port: int) -> socket.socket:
    """A socket bound to `host`:`port` (port 0: a free one), for uvicorn to serve on; a one-line
    click error when the address is taken or cannot be bound."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # The protocol is named so that each accepted connection says TCP: asyncio turns Nagle's
    # algorithm off only on such sockets, and with it on, a reply's small writes wait for the
    # client's delayed ACK (about 40 ms before the first streamed token, measured).
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as error:
        sock.close()
        reason = "in use" if error.errno == errno.EADDRINUSE else (error.strerror or str(error))
        raise click.ClickException(f"--host {host} --port {port}: address {reason}") from None
    sock.set_inheritable(True)
    return sock


def address(sock: socket.socket) -> str:
    """The URL a bound socket serves at."""
    host, port = sock.getsockname()[:2]
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def startup_line(sock: socket.socket, model_name: str) -> str:
    """The line `pipe serve` prints once it accepts connections."""
    return f"{STARTUP_PREFIX} {address(sock)}, model {model_name}"


def adapter_hint(checkpoint: str) -> str | None:
    """A one-line hint when `checkpoint` is a peft LoRA adapter directory rather than a model:
    serve its base with `--lora-adapter` (None for anything else)."""
    path = Path(checkpoint)
    config = path / "adapter_config.json"
    if not config.is_file() or (path / "config.json").is_file():
        return None
    try:
        base = json.loads(config.read_text()).get("base_model_name_or_path")
    except (OSError, ValueError):
        base = None
    base_text = base if isinstance(base, str) and base else "BASE"
    return (
        f"{checkpoint} holds LoRA adapters, not a model: serve the base with them, "
        f"`pipe serve {base_text} --lora-adapter {checkpoint}`, or by name, "
        f"`pipe serve {base_text} --lora-modules NAME={checkpoint}`"
    )


def enable_access_log() -> None:
    """uvicorn's access log (one line per request: client, method, path, status) on stderr
    beside pipe's own lines (uvicorn writes it to stdout), while its other messages stay at
    warnings. Call after uvicorn configured its logging (`uvicorn.Config`)."""
    access = logging.getLogger("uvicorn.access")
    access.setLevel(logging.INFO)
    for handler in access.handlers:
        if isinstance(handler, logging.StreamHandler):
            handler.setStream(sys.stderr)


def announce(line: str) -> None:
    """Print the start-up line on stderr at once (a supervising process may be waiting for it)."""
    print(line, file=sys.stderr, flush=True)
