"""vLLM's weight-transfer routes on `pipe serve`: pause, resume, new weights, their version.

Names and bodies are vLLM's (its RLHF routes, which TRL's `VLLMClient`, open-instruct and
prime-rl call): `POST /pause?mode=abort|wait&clear_cache=true`, `POST /resume`, `GET /is_paused`,
`POST /start_weight_update`, `POST /update_weights {"update_info": {...}}`,
`POST /finish_weight_update {"weight_version": ...}`, `POST /update_weight_version
{"new_version": ...}`, `GET /weight_info`, `POST /reset_prefix_cache`, `GET /get_world_size`
and `POST /init_weight_transfer_engine`. `update_info` is vLLM's disk backend's (`{"path": DIR}`,
a pipe checkpoint or a Hugging Face directory) or its IPC backend's names, dtype_names and
shapes with, in place of CUDA IPC handles, a shared-memory segment and each tensor's byte offset
in it (`pipeline.serve.http.weight_client` writes them). There is no NCCL group: a trainer on
another machine pushes through a checkpoint path.
"""

# No `from __future__ import annotations`: FastAPI reads the endpoints' annotations as objects.
from typing import Any

from fastapi import FastAPI
from pydantic import BaseModel, ConfigDict, Field

from pipeline.serve.engine.messages import UpdateWeights
from pipeline.serve.http.openai_api import APIError
from pipeline.serve.http.weight_control import WeightControl


class UpdateInfo(BaseModel):
    """`update_info`: a `path`, or tensors in shared memory (names, dtype_names, shapes,
    offsets, one entry per tensor, and `shm_name`)."""

    model_config = ConfigDict(extra="forbid")

    path: str | None = None
    shm_name: str | None = None
    names: list[str] | None = None
    dtype_names: list[str] | None = None
    shapes: list[list[int]] | None = None
    offsets: list[int] | None = None

    def message(self) -> UpdateWeights:
        """The engine's message; `APIError` naming the field at fault."""
        if (self.path is None) == (self.shm_name is None):
            raise APIError("update_info: give either path or shm_name", param="update_info")
        if self.path is not None:
            return UpdateWeights(path=self.path)
        lists = {
            "names": self.names,
            "dtype_names": self.dtype_names,
            "shapes": self.shapes,
            "offsets": self.offsets,
        }
        for field, value in lists.items():
            if not value or len(value) != len(self.names or []):
                raise APIError(
                    f"update_info.{field}: one entry per tensor ({len(self.names or [])} names)",
                    param=f"update_info.{field}",
                )
        return UpdateWeights(
            shm_name=self.shm_name,
            names=tuple(self.names),
            dtype_names=tuple(self.dtype_names),
            shapes=tuple(tuple(s) for s in self.shapes),
            offsets=tuple(self.offsets),
        )


class UpdateWeightsBody(BaseModel):
    """POST /update_weights; `weight_version` (pipe's) names the new weights' version."""

    model_config = ConfigDict(extra="forbid")

    update_info: UpdateInfo
    weight_version: str | None = None


class FinishBody(BaseModel):
    """POST /finish_weight_update."""

    model_config = ConfigDict(extra="forbid")

    weight_version: str | None = None


class VersionBody(BaseModel):
    """POST /update_weight_version."""

    model_config = ConfigDict(extra="forbid")

    new_version: str = Field(min_length=1)


class InitBody(BaseModel):
    """POST /init_weight_transfer_engine."""

    init_info: dict[str, Any]


def add_weight_routes(app: FastAPI, weights: WeightControl) -> None:
    """Register the weight-transfer routes (module docstring) on `app`."""
    _add_pause_routes(app, weights)

    @app.post("/start_weight_update")
    async def start_weight_update():
        await weights.start_update()
        return {"message": "Weight update started"}

    @app.post("/update_weights")
    async def update_weights(body: UpdateWeightsBody):
        version = await weights.update(body.update_info.message(), body.weight_version)
        return {"message": "Weights updated", "weight_version": version}

    @app.post("/finish_weight_update")
    async def finish_weight_update(body: FinishBody | None = None):
        version = await weights.finish_update(body and body.weight_version)
        return {"message": "Weight update finished", "weight_version": version}

    @app.post("/update_weight_version")
    async def update_weight_version(body: VersionBody):
        weights.set_version(body.new_version)
        return {"success": True, "new_version": body.new_version}

    @app.get("/weight_info")
    async def weight_info():
        return {"weight_version": weights.version}

    @app.get("/get_world_size")
    async def get_world_size():
        return {"world_size": 1}

    @app.post("/init_weight_transfer_engine")
    async def init_weight_transfer_engine(body: InitBody):
        if "master_address" in body.init_info:
            raise APIError(
                "pipe serve has no NCCL weight group: push tensors through shared memory "
                "(pipeline.serve.http.weight_client) or a checkpoint path",
                param="init_info",
            )
        return {"message": "Weight transfer initialized"}


def _add_pause_routes(app: FastAPI, weights: WeightControl) -> None:
    @app.post("/pause")
    async def pause(
        mode: str = "abort", wait_for_inflight_requests: bool = False, clear_cache: bool = True
    ):
        await weights.pause("wait" if wait_for_inflight_requests else mode, clear_cache)
        return {"status": "paused"}

    @app.post("/resume")
    async def resume():
        weights.resume()
        return {"status": "resumed"}

    @app.get("/is_paused")
    async def is_paused():
        return {"is_paused": weights.paused}

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache():
        await weights.reset_prefix_cache()
        return {"success": True}
