"""The header of a safetensors file, parsed and checked by hand: 8-byte little-endian length + JSON.

Parsing it here (not through `safetensors` or torch) gives a malformed file a precise message and
keeps `lorad.config` free of torch. This file checks the layout only; what the tensors mean is the
caller's business. It never reads tensor data.
"""

from __future__ import annotations

import json
import math
import os
import struct
from dataclasses import dataclass

from lorad.config.errors import ConfigError

MAX_HEADER_BYTES = 100_000_000  # the limit the safetensors library itself enforces

# Bytes per element of every whole-byte safetensors dtype (sub-byte F4/F6 are not served).
DTYPE_SIZES = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1, "F8_E8M0": 1,
    "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
    "I32": 4, "U32": 4, "F32": 4,
    "I64": 8, "U64": 8, "F64": 8, "C64": 8,
}


@dataclass(frozen=True)
class TensorEntry:
    """One tensor of the file: where its bytes are (absolute file offsets) and what they hold."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    start: int  # absolute offset of the first byte in the file
    end: int  # absolute offset one past the last byte

    @property
    def num_bytes(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class SafetensorsHeader:
    file_size: int
    data_start: int  # 8 + header length
    tensors: dict[str, TensorEntry]  # in the header's order
    metadata: dict[str, str]


def read_safetensors_header(path: str | os.PathLike, label: str) -> SafetensorsHeader:
    """Parse and check the header of `path`; errors are ConfigError prefixed with `label`."""
    try:
        with open(path, "rb") as f:
            return read_open_safetensors_header(f, label)
    except OSError as exc:
        raise ConfigError(f"{label}: cannot read: {exc.strerror or exc}") from None


def read_open_safetensors_header(f, label: str) -> SafetensorsHeader:
    """The same from a file open for binary reading at its start, left just past the header
    (where the data begins), for a caller that reads the data next. OSError is the caller's."""
    file_size = os.fstat(f.fileno()).st_size
    prefix = f.read(8)
    if len(prefix) < 8:
        raise ConfigError(f"{label}: the file is {file_size} bytes, too short for a "
                          "safetensors header (8-byte length + JSON)")
    (header_len,) = struct.unpack("<Q", prefix)
    if header_len > MAX_HEADER_BYTES:
        raise ConfigError(f"{label}: header length {header_len} is absurd "
                          f"(over {MAX_HEADER_BYTES} bytes); not a safetensors file?")
    if header_len > file_size - 8:
        raise ConfigError(f"{label}: header length {header_len} runs past the end of "
                          f"the file ({file_size} bytes)")
    raw = f.read(header_len)
    header = _parse_json(raw, label)
    data_start = 8 + header_len
    metadata = _check_metadata(header.pop("__metadata__", {}), label)
    tensors = {name: _entry(name, info, data_start, label) for name, info in header.items()}
    _check_layout(tensors, data_start, file_size, label)
    return SafetensorsHeader(file_size, data_start, tensors, metadata)


def _parse_json(raw: bytes, label: str) -> dict:
    def no_duplicates(pairs):
        keys = [k for k, _ in pairs]
        duplicates = sorted({k for k in keys if keys.count(k) > 1})
        if duplicates:
            raise ConfigError(f"{label}: header names {duplicates[0]!r} twice")
        return dict(pairs)

    try:
        header = json.loads(raw.decode("utf-8"), object_pairs_hook=no_duplicates,
                            parse_constant=_refuse_constant)
    except (UnicodeDecodeError, ValueError) as exc:
        if isinstance(exc, ConfigError):
            raise
        raise ConfigError(f"{label}: header is not valid JSON ({exc})") from None
    if not isinstance(header, dict):
        raise ConfigError(f"{label}: header is a JSON {type(header).__name__}, not an object")
    return header


def _refuse_constant(name: str):
    raise ValueError(f"{name} is not JSON")


def _check_metadata(metadata, label: str) -> dict[str, str]:
    if not isinstance(metadata, dict) or not all(
            isinstance(v, str) for v in metadata.values()):
        raise ConfigError(f"{label}: __metadata__ must be an object of strings")
    return metadata


def _entry(name: str, info, data_start: int, label: str) -> TensorEntry:
    where = f"{label}: tensor {name!r}"
    if not isinstance(info, dict):
        raise ConfigError(f"{where}: expected an object with dtype, shape and data_offsets")
    if set(info) != {"dtype", "shape", "data_offsets"}:
        raise ConfigError(f"{where}: expected exactly the fields dtype, shape and data_offsets, "
                          f"got {sorted(info)}")
    dtype, shape, offsets = info["dtype"], info["shape"], info["data_offsets"]
    if not isinstance(dtype, str) or dtype not in DTYPE_SIZES:
        raise ConfigError(f"{where}: dtype {dtype!r} is not a safetensors dtype lorad reads "
                          f"({', '.join(DTYPE_SIZES)})")
    if not isinstance(shape, list) or not all(_is_count(d) for d in shape):
        raise ConfigError(f"{where}: shape must be a list of non-negative integers, "
                          f"got {shape!r}")
    if (not isinstance(offsets, list) or len(offsets) != 2
            or not all(_is_count(o) for o in offsets) or offsets[0] > offsets[1]):
        raise ConfigError(f"{where}: data_offsets must be [begin, end] with "
                          f"0 <= begin <= end, got {offsets!r}")
    needed = math.prod(shape) * DTYPE_SIZES[dtype]
    if offsets[1] - offsets[0] != needed:
        raise ConfigError(f"{where}: data_offsets {offsets} span {offsets[1] - offsets[0]} "
                          f"bytes, but {dtype} {shape} needs {needed}")
    return TensorEntry(name, dtype, tuple(shape), data_start + offsets[0],
                       data_start + offsets[1])


def _is_count(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _check_layout(tensors: dict[str, TensorEntry], data_start: int, file_size: int,
                  label: str) -> None:
    """Tensors must tile the data section exactly, as the safetensors library requires."""
    position, previous = data_start, None
    for entry in sorted(tensors.values(), key=lambda e: (e.start, e.end)):
        if entry.end > file_size:
            raise ConfigError(f"{label}: tensor {entry.name!r} runs past the end of the file "
                              f"(data_offsets end at byte {entry.end}, file is {file_size})")
        if entry.start < position:
            raise ConfigError(f"{label}: tensor {entry.name!r} overlaps tensor {previous!r} "
                              "(data_offsets)")
        if entry.start > position:
            raise ConfigError(f"{label}: {entry.start - position} bytes before tensor "
                              f"{entry.name!r} belong to no tensor (data_offsets)")
        position, previous = entry.end, entry.name
    if position != file_size:
        raise ConfigError(f"{label}: {file_size - position} bytes after the last tensor belong "
                          "to no tensor (truncated header or trailing data)")
