"""A GGUF file's metadata and tensor index, read in one pass over the header.

The gguf package's ``GGUFReader`` builds a numpy view (and a Python object) for every part of
every field: about 250,000 of them for a tokenizer of 49,152 tokens and 48,900 merges, 2.6 s of
SmolLM2's 6.5 s start-up on a 2-core CPU. This reader walks the same layout (GGUF v2/v3,
little-endian: header, key/value pairs, tensor infos, then the aligned data section) with
``struct`` over the header's bytes and maps the tensors' data lazily, as numpy views of the
memory-mapped file, shaped as ``GGUFReader`` shapes them (so ``gguf.quants.dequantize`` takes
them as they are): ``[..., rows, bytes per row]`` uint8 for block-quantized types, the element
type otherwise, dimensions slowest-first.
"""
from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

_MAGIC = b"GGUF"
_DEFAULT_ALIGNMENT = 32

# GGUF value types: struct format of the scalars; 8 = string, 9 = array.
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_NUMPY = {0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32, 6: np.float32,
          7: np.bool_, 10: np.uint64, 11: np.int64, 12: np.float64}
_STRING, _ARRAY = 8, 9
# Tensor types stored element by element (not in blocks): their numpy dtype.
_PLAIN = {GGMLQuantizationType.F32: np.float32, GGMLQuantizationType.F16: np.float16,
          GGMLQuantizationType.F64: np.float64, GGMLQuantizationType.I8: np.int8,
          GGMLQuantizationType.I16: np.int16, GGMLQuantizationType.I32: np.int32,
          GGMLQuantizationType.I64: np.int64}


class GGUFFormatError(ValueError):
    """The bytes are not a GGUF file this reader can read (the message says where and why)."""


@dataclass
class GGUFTensor:
    name: str
    tensor_type: GGMLQuantizationType
    #: Dimensions as the file lists them, fastest-first (ggml's ``ne``).
    shape: np.ndarray
    #: The tensor's bytes as a read-only numpy view of the mapped file (see the module docstring).
    data: np.ndarray


class _Cursor:
    def __init__(self, buf: memoryview) -> None:
        self.buf, self.pos = buf, 0

    def scalar(self, fmt: str) -> Any:
        size = struct.calcsize(fmt)
        if self.pos + size > len(self.buf):
            raise GGUFFormatError(f"the file ends at byte {len(self.buf)}, inside its header")
        (value,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += size
        return value

    def string(self) -> str:
        n = self.scalar("<Q")
        end = self.pos + n
        if end > len(self.buf):
            raise GGUFFormatError(f"a string of {n} bytes at byte {self.pos} runs past the end of the file")
        value = bytes(self.buf[self.pos:end]).decode("utf-8", errors="replace")
        self.pos = end
        return value

    def value(self, kind: int) -> Any:
        if kind in _SCALARS:
            return self.scalar(_SCALARS[kind])
        if kind == _STRING:
            return self.string()
        if kind != _ARRAY:
            raise GGUFFormatError(f"unknown GGUF value type {kind} at byte {self.pos}")
        item, count = self.scalar("<I"), self.scalar("<Q")
        if item in _NUMPY:
            dtype = np.dtype(_NUMPY[item])
            end = self.pos + count * dtype.itemsize
            if end > len(self.buf):
                raise GGUFFormatError(f"an array of {count} values at byte {self.pos} runs past the end of the file")
            values = np.frombuffer(self.buf, dtype=dtype, count=count, offset=self.pos).tolist()
            self.pos = end
            return values
        if item == _STRING:
            return [self.string() for _ in range(count)]
        return [self.value(item) for _ in range(count)]


def read(path: str) -> tuple[dict[str, Any], list[GGUFTensor]]:
    """(metadata: key -> Python value, the tensors in file order) of the GGUF file at ``path``;
    ``OSError`` if it cannot be opened, ``GGUFFormatError`` if it is not a readable GGUF."""
    with open(path, "rb") as f:
        try:
            mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except ValueError as exc:  # an empty file cannot be mapped
            raise GGUFFormatError(f"the file is empty ({exc})") from exc
    buf = memoryview(mapped)
    if bytes(buf[:4]) != _MAGIC:
        raise GGUFFormatError(f"bad magic {bytes(buf[:4])!r} (a GGUF file starts with {_MAGIC!r})")
    cur = _Cursor(buf)
    cur.pos = 4
    version = cur.scalar("<I")
    if version not in (2, 3):
        raise GGUFFormatError(f"GGUF version {version} is not supported (2 and 3 are; a big-endian file reads as "
                              "a huge version)")
    num_tensors, num_fields = cur.scalar("<Q"), cur.scalar("<Q")
    metadata: dict[str, Any] = {"GGUF.version": version, "GGUF.tensor_count": num_tensors,
                                "GGUF.kv_count": num_fields}
    for _ in range(num_fields):
        key = cur.string()
        metadata[key] = cur.value(cur.scalar("<I"))
    infos = []
    for _ in range(num_tensors):
        name = cur.string()
        dims = [cur.scalar("<Q") for _ in range(cur.scalar("<I"))]
        kind, offset = cur.scalar("<I"), cur.scalar("<Q")
        try:
            tensor_type = GGMLQuantizationType(kind)
        except ValueError as exc:
            raise GGUFFormatError(f"tensor {name!r} has unknown type {kind}") from exc
        infos.append((name, dims, tensor_type, offset))
    alignment = int(metadata.get("general.alignment", _DEFAULT_ALIGNMENT))
    if alignment <= 0 or alignment & (alignment - 1):
        raise GGUFFormatError(f"general.alignment {alignment} is not a power of two")
    start = -(-cur.pos // alignment) * alignment
    arr = np.frombuffer(mapped, dtype=np.uint8)
    tensors = []
    for name, dims, tensor_type, offset in infos:
        shape = list(reversed(dims)) or [1]
        count = int(np.prod(dims, dtype=np.int64)) if dims else 1
        if tensor_type in _PLAIN:
            dtype = np.dtype(_PLAIN[tensor_type])
            nbytes = count * dtype.itemsize
        else:
            block, size = GGML_QUANT_SIZES[tensor_type]
            if shape[-1] % block:
                raise GGUFFormatError(f"tensor {name!r}: rows of {shape[-1]} are not whole blocks of {block}")
            shape[-1] = shape[-1] // block * size
            dtype, nbytes = np.dtype(np.uint8), count // block * size
        begin = start + offset
        if begin + nbytes > len(arr):
            raise GGUFFormatError(f"tensor {name!r} ({nbytes} bytes at byte {begin}) runs past the end of the file "
                                  f"({len(arr)} bytes): truncated?")
        data = arr[begin:begin + nbytes].view(dtype).reshape(shape)
        tensors.append(GGUFTensor(name, tensor_type, np.array(dims, dtype=np.uint64), data))
    return metadata, tensors
