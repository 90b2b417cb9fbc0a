"""A GGUF file's header read in one pass: its metadata values and its tensors' names, shapes, types and data views.

gguf-py's GGUFReader makes a numpy view for every element of every metadata array, which for Qwen's 248320 tokens
and their merges took 6.7 s an open on a 2-core machine (10.7 s under load), and a daemon opens the file several
times (check, tokenizer, model config, load). Here the values are decoded as they are read (strings with one
`struct` call each, numbers as whole arrays) and the tensors' data are views of one memory map per file, laid out as
gguf-py lays them out, so gguf-py's dequantizers take them as they are. Little-endian files, version 2 and 3 (what
llama.cpp writes).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import quant_shape_to_byte_shape

_MAGIC = 0x46554747                       # "GGUF" read as a little-endian uint32
_DEFAULT_ALIGNMENT = 32
# Metadata value types: their struct code and size (8 is a string, 9 an array).
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9
# Tensor types whose data gguf-py presents as typed values rather than bytes.
_TYPED = {GGMLQuantizationType.F32: np.float32, GGMLQuantizationType.F16: np.float16,
          GGMLQuantizationType.F64: np.float64, GGMLQuantizationType.I8: np.int8, GGMLQuantizationType.I16: np.int16,
          GGMLQuantizationType.I32: np.int32, GGMLQuantizationType.I64: np.int64}


class GGUFFormatError(ValueError):
    """The file is not a GGUF this reader takes (the message says where it stopped)."""


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: np.ndarray                     # GGUF's order: the fastest axis first
    tensor_type: GGMLQuantizationType
    n_bytes: int
    data: np.ndarray                      # a view of the file: typed values, or bytes [..., row bytes] for blocks


class _Cursor:
    def __init__(self, buffer: np.ndarray, path: Path):
        self.view, self.offset, self.path = memoryview(buffer), 0, path

    def unpack(self, code: str):
        try:
            values = struct.unpack_from("<" + code, self.view, self.offset)
        except struct.error:
            raise GGUFFormatError(f"{self.path}: the header ends early, at byte {self.offset}") from None
        self.offset += struct.calcsize("<" + code)
        return values[0] if len(values) == 1 else values

    def string(self) -> str:
        length = self.unpack("Q")
        end = self.offset + length
        if end > len(self.view):
            raise GGUFFormatError(f"{self.path}: a string at byte {self.offset} runs past the end of the file")
        text = bytes(self.view[self.offset:end]).decode("utf-8", errors="replace")
        self.offset = end
        return text

    def value(self, kind: int) -> Any:
        if kind == _STRING:
            return self.string()
        if kind == _ARRAY:
            item, count = self.unpack("I"), self.unpack("Q")
            if item == _STRING:
                return [self.string() for _ in range(count)]
            if item not in _SCALARS:
                return [self.value(item) for _ in range(count)]     # arrays of arrays: rare, small
            dtype = np.dtype("<" + _SCALARS[item])
            end = self.offset + count * dtype.itemsize
            if end > len(self.view):
                raise GGUFFormatError(f"{self.path}: an array at byte {self.offset} runs past the end of the file")
            values = np.frombuffer(self.view, dtype=dtype, count=count, offset=self.offset).tolist()
            self.offset = end
            return values
        if kind not in _SCALARS:
            raise GGUFFormatError(f"{self.path}: unknown metadata value type {kind} at byte {self.offset}")
        return self.unpack(_SCALARS[kind])


def read_gguf(path: str | Path) -> tuple[dict[str, Any], list[TensorInfo]]:
    """(metadata key -> value: numbers, strings, lists of them; the tensors in file order)."""
    path = Path(path)
    buffer = np.memmap(path, mode="r")
    cursor = _Cursor(buffer, path)
    if cursor.unpack("I") != _MAGIC:
        raise GGUFFormatError(f"{path}: no GGUF magic at its start")
    version = cursor.unpack("I")
    if version not in (2, 3):
        raise GGUFFormatError(f"{path}: GGUF version {version} (a big-endian file, or a version this reader does not "
                              f"know: it reads little-endian versions 2 and 3)")
    tensor_count, kv_count = cursor.unpack("Q"), cursor.unpack("Q")
    fields: dict[str, Any] = {}
    for _ in range(kv_count):
        key = cursor.string()
        fields[key] = cursor.value(cursor.unpack("I"))
    infos = []
    for _ in range(tensor_count):
        name = cursor.string()
        dims = [cursor.unpack("Q") for _ in range(cursor.unpack("I"))]
        infos.append((name, dims, cursor.unpack("I"), cursor.unpack("Q")))
    alignment = fields.get("general.alignment", _DEFAULT_ALIGNMENT)
    if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
        raise GGUFFormatError(f"{path}: general.alignment is {alignment!r}, not a power of two")
    start = -(-cursor.offset // alignment) * alignment
    return fields, [_tensor(buffer, path, start, *info) for info in infos]


def _tensor(buffer: np.ndarray, path: Path, start: int, name: str, dims: list[int], kind: int,
            offset: int) -> TensorInfo:
    try:
        tensor_type = GGMLQuantizationType(kind)
    except ValueError:
        raise GGUFFormatError(f"{path}: tensor {name} has the unknown type {kind}") from None
    block, block_bytes = GGML_QUANT_SIZES[tensor_type]
    count = int(np.prod(dims, dtype=np.int64)) if dims else 1
    n_bytes = count * block_bytes // block
    begin = start + offset
    if begin + n_bytes > len(buffer):
        raise GGUFFormatError(f"{path}: tensor {name}'s data ({n_bytes} bytes at {begin}) runs past the end of the "
                              f"file ({len(buffer)} bytes): a truncated download?")
    shape = tuple(reversed(dims))
    if tensor_type in _TYPED:
        data = buffer[begin:begin + n_bytes].view(_TYPED[tensor_type]).reshape(shape)
    else:
        data = buffer[begin:begin + n_bytes].reshape(quant_shape_to_byte_shape(shape, tensor_type))
    return TensorInfo(name, np.array(dims, dtype=np.uint64), tensor_type, n_bytes, data)
