"""Adapters by name on `pipe serve`'s HTTP side: vLLM's `--lora-modules`, the adapters as models
in /v1/models, and its routes that load and unload them while serving.

Each adapter is a model whose `parent` is the base model (as vLLM lists them); a request whose
`model` names it runs with it, one naming the base runs with none, and the two may share a batch
(`pipeline.serve.engine.lora_slots` in the engine process). `POST /v1/load_lora_adapter
{"lora_name", "lora_path"}` and `POST /v1/unload_lora_adapter {"lora_name"}` take vLLM's bodies and
answer with its texts and status codes; they are refused unless the server was started with
`--allow-runtime-lora-updating` (vLLM's environment variable VLLM_ALLOW_RUNTIME_LORA_UPDATING=True
is honoured too). Unloading takes the name away from new requests at once; requests already
admitted or queued with the adapter finish with it.
"""

# No `from __future__ import annotations`: FastAPI reads the endpoints' annotations as objects.
import asyncio
import json
import os
from dataclasses import dataclass, field

from fastapi import FastAPI
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel

from pipeline.serve.engine.messages import LoadLoRA, UnloadLoRA
from pipeline.serve.http.engine_client import EngineClient
from pipeline.serve.http.openai_api import APIError

RUNTIME_ENV = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"


def runtime_updating_allowed(flag: bool) -> bool:
    """Whether the load / unload routes work: pipe's flag, or vLLM's environment variable."""
    return flag or os.environ.get(RUNTIME_ENV, "").lower() in ("1", "true")


def parse_lora_module(text: str) -> tuple[str, str]:
    """(name, path) of one `--lora-modules` entry: `name=path` or vLLM's JSON form
    `{"name": ..., "path": ..., "base_model_name": ...}` (pipe serves one base model, which is
    every adapter's parent). ValueError naming the entry when it is neither."""
    if text.lstrip().startswith("{"):
        try:
            entry = json.loads(text)
            return str(entry["name"]), str(entry["path"])
        except (ValueError, KeyError, TypeError):
            raise ValueError(f'--lora-modules {text!r}: JSON needs "name" and "path"') from None
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise ValueError(f"--lora-modules {text!r}: use name=path or JSON")
    return name, path


class LoadLoRAAdapterBody(BaseModel):
    """POST /v1/load_lora_adapter (vLLM's `LoadLoRAAdapterRequest`)."""

    lora_name: str = ""
    lora_path: str = ""


class UnloadLoRAAdapterBody(BaseModel):
    """POST /v1/unload_lora_adapter (vLLM's `UnloadLoRAAdapterRequest`)."""

    lora_name: str = ""
    lora_int_id: int | None = None


@dataclass
class ServedAdapters:
    """The adapters a server answers to by name (module docstring): name -> path."""

    client: EngineClient
    paths: dict[str, str] = field(default_factory=dict)
    runtime_updates: bool = False
    _lock: asyncio.Lock = field(default_factory=asyncio.Lock)

    def __contains__(self, name: str) -> bool:
        return name in self.paths

    def cards(self, parent: str, created: int) -> list[dict]:
        """The adapters' entries in /v1/models."""
        return [
            {
                "id": name,
                "object": "model",
                "created": created,
                "owned_by": "pipe",
                "root": path,
                "parent": parent,
                "max_model_len": self.client.ready.max_context,
            }
            for name, path in self.paths.items()
        ]

    async def load(self, body: LoadLoRAAdapterBody) -> str:
        """Serve the adapter at `lora_path` as `lora_name` once the engine has read it."""
        self._check_allowed()
        if not body.lora_name or not body.lora_path:
            raise APIError("Both 'lora_name' and 'lora_path' must be provided.", param="lora_name")
        async with self._lock:
            if body.lora_name in self.paths:
                raise APIError(
                    f"The lora adapter '{body.lora_name}' has already been loaded.",
                    param="lora_name",
                )
            done = await self.client.control(LoadLoRA(body.lora_name, body.lora_path))
            if done.error is not None:
                status = 404 if "No such file" in done.error else 400
                raise APIError(done.error, status, "lora_path")
            self.paths[body.lora_name] = body.lora_path
        return f"Success: LoRA adapter '{body.lora_name}' added successfully."

    async def unload(self, body: UnloadLoRAAdapterBody) -> str:
        """Stop serving `lora_name` to new requests (those in flight finish with it)."""
        self._check_allowed()
        if not body.lora_name and body.lora_int_id is None:
            raise APIError(
                "either 'lora_name' and 'lora_int_id' needs to be provided.", param="lora_name"
            )
        async with self._lock:
            if body.lora_name not in self.paths:
                raise APIError(
                    f"The lora adapter '{body.lora_name}' cannot be found.", 404, "lora_name"
                )
            del self.paths[body.lora_name]  # new requests: 404 from now on
            done = await self.client.control(UnloadLoRA(body.lora_name))
            if done.error is not None:
                raise APIError(done.error, param="lora_name")
        return f"Success: LoRA adapter '{body.lora_name}' removed successfully."

    def _check_allowed(self) -> None:
        if not self.runtime_updates:
            raise APIError(
                "loading and unloading adapters while serving is off: start pipe serve with "
                f"--allow-runtime-lora-updating (or {RUNTIME_ENV}=True)",
                404,
            )


def add_lora_routes(app: FastAPI, adapters: ServedAdapters) -> None:
    """Register vLLM's adapter routes (module docstring) on `app`."""

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(body: LoadLoRAAdapterBody):
        return PlainTextResponse(await adapters.load(body))

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(body: UnloadLoRAAdapterBody):
        return PlainTextResponse(await adapters.unload(body))
