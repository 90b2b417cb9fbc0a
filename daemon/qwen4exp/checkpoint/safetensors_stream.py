"""A streaming safetensors writer: the header first (all shapes are known), then one tensor at a time.

`safetensors.torch.save_file` needs every tensor of a shard in memory (and copies each to bytes once more);
writing sequentially keeps peak memory at one tensor, which matters for the 40 GB bench checkpoint.
"""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path

import torch

_DTYPE_NAMES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.uint8: "U8",
}


def dtype_name(dtype: torch.dtype) -> str:
    if dtype not in _DTYPE_NAMES:
        raise ValueError(f"safetensors cannot store {dtype}; supported: {sorted(map(str, _DTYPE_NAMES))}")
    return _DTYPE_NAMES[dtype]


class SafetensorsStream:
    """Writes the tensors declared in `entries` ({name: (dtype, shape)}) in that order, one `write` at a time."""

    def __init__(self, path: Path, entries: dict[str, tuple[torch.dtype, tuple[int, ...]]]):
        self.path = path
        self._expected = list(entries.items())
        self._next = 0
        header: dict[str, object] = {"__metadata__": {"format": "pt"}}
        offset = 0
        for name, (dtype, shape) in self._expected:
            size = math.prod(shape) * dtype.itemsize
            header[name] = {"dtype": dtype_name(dtype), "shape": list(shape), "data_offsets": [offset, offset + size]}
            offset += size
        self.data_bytes = offset
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)  # readers expect the data to start 8-byte aligned
        self._file = open(path, "wb")
        self._file.write(struct.pack("<Q", len(raw)) + raw)

    def write(self, name: str, tensor: torch.Tensor) -> None:
        want_name, (dtype, shape) = self._expected[self._next]
        if name != want_name or tensor.dtype != dtype or tuple(tensor.shape) != tuple(shape):
            raise ValueError(
                f"{self.path}: expected {want_name} {dtype} {tuple(shape)}, "
                f"got {name} {tensor.dtype} {tuple(tensor.shape)}"
            )
        data = tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
        self._file.write(memoryview(data.numpy()))
        self._next += 1

    def close(self) -> None:
        self._file.close()
        if self._next != len(self._expected):
            missing = self._expected[self._next][0]
            raise ValueError(
                f"{self.path}: closed after {self._next} of {len(self._expected)} tensors ({missing} unwritten)"
            )

    def __enter__(self) -> "SafetensorsStream":
        return self

    def __exit__(self, *exc: object) -> None:
        if exc[0] is None:
            self.close()
        else:
            self._file.close()
