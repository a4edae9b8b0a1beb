"""A training process's side of `pipe serve`'s weight routes: push new weights without a restart.

    client = WeightClient("http://127.0.0.1:8000")
    client.push(model.named_parameters())      # tensors by name, through shared memory
    client.load("runs/grpo/iter_0000100")       # or a checkpoint / Hugging Face directory

`push` writes every tensor into one `multiprocessing.shared_memory` segment (so the server must
run on the same machine), posts their names, dtypes, shapes and byte offsets to /update_weights
and removes the segment once the server has copied them. The server pauses, lets the requests in
flight finish on the old weights, swaps and resumes (`pipeline.serve.http.weight_control`). Names
are those of pipe's `Transformer.state_dict()`; a push may name a subset. Only the standard library
and torch are used.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Iterable, Mapping

import torch

ALIGN = 64  # bytes: each tensor starts on a cache line


class WeightPushError(RuntimeError):
    """The server refused (its one-line message) or could not be reached."""


class WeightClient:
    """The weight routes of the `pipe serve` at `url` (module docstring)."""

    def __init__(self, url: str, timeout: float = 600.0) -> None:
        self.url = url.rstrip("/")
        self.timeout = timeout

    def push(
        self,
        named_tensors: Iterable[tuple[str, torch.Tensor]] | Mapping[str, torch.Tensor],
        weight_version: str | None = None,
    ) -> str:
        """Copy `named_tensors` into the served model through shared memory; returns the new
        weights' version (`weight_version`, else the server's count of updates).
        `WeightPushError` naming the tensor when one does not fit (the old weights serve on)."""
        from multiprocessing import shared_memory

        items = named_tensors.items() if isinstance(named_tensors, Mapping) else named_tensors
        tensors = [(name, tensor.detach().to("cpu").contiguous()) for name, tensor in items]
        if not tensors:
            raise WeightPushError("push: no tensors given")
        offsets, end = [], 0
        for _, tensor in tensors:
            offsets.append(end)
            end += -(-tensor.numel() * tensor.element_size() // ALIGN) * ALIGN
        segment = shared_memory.SharedMemory(create=True, size=max(end, 1))
        try:
            for (_, tensor), offset in zip(tensors, offsets):
                _write(segment.buf, offset, tensor)
            info = {
                "shm_name": segment.name,
                "names": [name for name, _ in tensors],
                "dtype_names": [str(t.dtype).removeprefix("torch.") for _, t in tensors],
                "shapes": [list(t.shape) for _, t in tensors],
                "offsets": offsets,
            }
            body = {"update_info": info, "weight_version": weight_version}
            answer = self._post("/update_weights", body)
        finally:
            segment.close()
            segment.unlink()
        return answer["weight_version"]

    def load(self, path: str, weight_version: str | None = None) -> str:
        """Load the pipe checkpoint or Hugging Face directory at `path` (as the server sees
        it) into the served model; returns the new weights' version."""
        body = {"update_info": {"path": str(path)}, "weight_version": weight_version}
        return self._post("/update_weights", body)["weight_version"]

    def pause(self, mode: str = "abort") -> None:
        """Stop taking requests; "abort" ends those running, "wait" lets them finish first."""
        self._post(f"/pause?mode={mode}", {})

    def resume(self) -> None:
        """Take requests again."""
        self._post("/resume", {})

    def is_paused(self) -> bool:
        return self._get("/is_paused")["is_paused"]

    def weight_version(self) -> str:
        """The served weights' version: "0" as started, then one per update."""
        return self._get("/weight_info")["weight_version"]

    def _get(self, path: str) -> dict:
        return self._call(urllib.request.Request(self.url + path))

    def _post(self, path: str, body: dict) -> dict:
        request = urllib.request.Request(
            self.url + path, json.dumps(body).encode(), {"Content-Type": "application/json"}
        )
        return self._call(request)

    def _call(self, request: urllib.request.Request) -> dict:
        try:
            with urllib.request.urlopen(request, timeout=self.timeout) as response:
                return json.loads(response.read())
        except urllib.error.HTTPError as error:
            raise WeightPushError(f"{request.full_url}: {server_message(error)}") from None
        except OSError as error:
            raise WeightPushError(f"{request.full_url}: {error}") from None


def _write(buffer: memoryview, offset: int, tensor: torch.Tensor) -> None:
    """`tensor`'s bytes into `buffer` at `offset`."""
    size = tensor.numel() * tensor.element_size()
    if size:
        target = torch.frombuffer(buffer, dtype=torch.uint8, count=size, offset=offset)
        target.copy_(tensor.reshape(-1).view(torch.uint8))
        del target  # the segment cannot close while a view of it lives


def server_message(error: urllib.error.HTTPError) -> str:
    """The server's one-line error message (OpenAI's error body), else the HTTP status."""
    try:
        return json.loads(error.read())["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return f"HTTP {error.code}"
