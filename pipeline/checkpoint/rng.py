"""Random-number-generator state as plain JSON, so a resumed run draws the same numbers.

Covers torch's CPU generator, every CUDA device's generator (when CUDA is initialised), numpy's
global generator and Python's `random`. Byte states are base64 text; nothing is pickled.
"""

from __future__ import annotations

import base64
import random
from typing import Any


def _encode_bytes(tensor: Any) -> str:
    return base64.b64encode(tensor.cpu().numpy().tobytes()).decode("ascii")


def _decode_bytes(text: str) -> Any:
    import torch

    return torch.frombuffer(bytearray(base64.b64decode(text)), dtype=torch.uint8)


def capture_rng_state() -> dict[str, Any]:
    """The current RNG states of torch (CPU, CUDA), numpy and Python `random`, JSON-ready."""
    import numpy as np
    import torch

    version, internal, gauss = random.getstate()
    np_name, np_keys, np_pos, np_has_gauss, np_gauss = np.random.get_state(legacy=True)
    state: dict[str, Any] = {
        "torch_cpu": _encode_bytes(torch.get_rng_state()),
        "python": {"version": version, "state": list(internal), "gauss": gauss},
        "numpy": {
            "name": np_name,
            "keys": np.asarray(np_keys).tolist(),
            "pos": int(np_pos),
            "has_gauss": int(np_has_gauss),
            "cached_gaussian": float(np_gauss),
        },
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["torch_cuda"] = [_encode_bytes(s) for s in torch.cuda.get_rng_state_all()]
    return state


def restore_rng_state(state: dict[str, Any]) -> None:
    """Set the generators from `capture_rng_state()` output; absent entries are left alone."""
    import numpy as np
    import torch

    if "torch_cpu" in state:
        torch.set_rng_state(_decode_bytes(state["torch_cpu"]))
    if "python" in state:
        python = state["python"]
        random.setstate((python["version"], tuple(python["state"]), python["gauss"]))
    if "numpy" in state:
        numpy_state = state["numpy"]
        np.random.set_state(
            (
                numpy_state["name"],
                np.asarray(numpy_state["keys"], dtype=np.uint32),
                numpy_state["pos"],
                numpy_state["has_gauss"],
                numpy_state["cached_gaussian"],
            )
        )
    if "torch_cuda" in state and torch.cuda.is_available():
        cuda_states = [_decode_bytes(s) for s in state["torch_cuda"]]
        if len(cuda_states) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all(cuda_states)
        else:  # a different GPU count: restore the devices both runs have
            for index, cuda_state in enumerate(cuda_states[: torch.cuda.device_count()]):
                torch.cuda.set_rng_state(cuda_state, index)
