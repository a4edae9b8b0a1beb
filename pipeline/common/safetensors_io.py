"""Writing the safetensors format by hand, one tensor at a time: the dtype codes, the header,
and a tensor's raw bytes. Converters and exporters stream tensors into a file whose header is
written first, which the safetensors library (whole dicts in memory) cannot do.

Format: an 8-byte little-endian header length, the JSON header (padded with spaces to a multiple
of 8 bytes, as the safetensors library pads it), then the tensors back to back.
"""

from __future__ import annotations

import json
import math
import sys
from typing import IO

import torch

SAFETENSORS_DTYPES: dict[torch.dtype, str] = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}


def write_safetensors_header(
    f: IO[bytes], entries: list[tuple[str, torch.dtype, tuple[int, ...]]]
) -> int:
    """Write the header for tensors laid out back to back in `entries` order (name, dtype,
    shape); returns the size in bytes of the data that must follow."""
    header: dict = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, dtype, shape in entries:
        end = offset + math.prod(shape) * dtype.itemsize
        header[name] = {
            "dtype": SAFETENSORS_DTYPES[dtype],
            "shape": list(shape),
            "data_offsets": [offset, end],
        }
        offset = end
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    f.write(len(raw).to_bytes(8, "little"))
    f.write(raw)
    return offset


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """The raw little-endian bytes of a tensor (bf16 and fp8 included, which numpy lacks)."""
    flat = t.contiguous().reshape(-1)
    return memoryview(flat.view(torch.uint8).numpy())


def require_little_endian() -> None:
    """Refuse to write on a big-endian host: `tensor_bytes` gives native byte order, and
    safetensors data is little-endian."""
    if sys.byteorder != "little":
        raise RuntimeError("safetensors data is little-endian; this host is big-endian")
