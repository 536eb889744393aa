"""A memory-mapped safetensors reader that knows every dtype a Qwen3.5 checkpoint uses.

Why not `safetensors.safe_open(framework="numpy")`: it cannot return FP8 tensors (numpy has no
float8 dtype; it fails on `np.float8_e4m3fn`). The format is an 8-byte little-endian header
length, a JSON header {name: {dtype, shape, data_offsets}} and the raw little-endian data, so
reading it is a `np.memmap` view per tensor with the `ml_dtypes` dtype: nothing is read until
a tensor is asked for, and only that tensor's bytes are.
"""

from __future__ import annotations

import json
import struct

import ml_dtypes
import numpy as np

DTYPES = {
    "F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
    "F8_E4M3": ml_dtypes.float8_e4m3fn, "F8_E5M2": ml_dtypes.float8_e5m2,
    "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8,
    "BOOL": np.bool_,
}
FP8_DTYPES = ("F8_E4M3",)


class SafetensorsError(ValueError):
    """A malformed safetensors file; the message names the file (and tensor)."""


class SafetensorsFile:
    """Tensor names, stored dtypes and shapes from the header; `get` maps one tensor."""

    def __init__(self, path: str):
        self.path = path
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) != 8:
                raise SafetensorsError(f"{path}: not a safetensors file (too short)")
            (n,) = struct.unpack("<Q", head)
            try:
                header = json.loads(f.read(n))
            except ValueError as e:
                raise SafetensorsError(f"{path}: unreadable safetensors header ({e})") from None
        header.pop("__metadata__", None)
        self._data_start = 8 + n
        self._header = header
        self._mm = None

    def keys(self) -> list[str]:
        return list(self._header)

    def dtype(self, name: str) -> str:
        return self._header[name]["dtype"]

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._header[name]["shape"])

    def get(self, name: str) -> np.ndarray:
        info = self._header[name]
        dt = DTYPES.get(info["dtype"])
        if dt is None:
            raise SafetensorsError(f"{self.path}: tensor '{name}' has unsupported dtype "
                                   f"{info['dtype']}")
        start, stop = info["data_offsets"]
        shape = tuple(info["shape"])
        count = int(np.prod(shape, dtype=np.int64))
        if stop - start != count * np.dtype(dt).itemsize:
            raise SafetensorsError(f"{self.path}: tensor '{name}' has {stop - start} bytes, its "
                                   f"shape {list(shape)} and dtype {info['dtype']} need "
                                   f"{count * np.dtype(dt).itemsize}")
        if self._mm is None:
            self._mm = np.memmap(self.path, dtype=np.uint8, mode="r")
        raw = self._mm[self._data_start + start:self._data_start + stop]
        return raw.view(dt).reshape(shape)

    def close(self) -> None:
        self._mm = None
