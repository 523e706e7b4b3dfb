"""Break a copy of a good PEFT adapter folder in one place: its config, its tensors, its raw bytes.

For the adapter validation tests; the folders themselves come from tests/tiny_adapters.py.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

WEIGHTS = "adapter_model.safetensors"
CONFIG = "adapter_config.json"
DELETE = object()  # edit_config(folder, key=DELETE) removes the key


def edit_config(folder: Path, **changes) -> None:
    """Rewrite adapter_config.json with keys changed (NaN and Infinity written as Python does)."""
    path = folder / CONFIG
    raw = json.loads(path.read_text())
    for key, value in changes.items():
        if value is DELETE:
            raw.pop(key, None)
        else:
            raw[key] = value
    path.write_text(json.dumps(raw, indent=2))


def edit_tensors(folder: Path, change) -> None:
    """change(dict of name -> numpy array) in place, then save the weights file again."""
    from safetensors.numpy import load_file, save_file

    tensors = load_file(folder / WEIGHTS)
    change(tensors)
    save_file(tensors, folder / WEIGHTS, metadata={"format": "pt"})


def raw_parts(folder: Path) -> tuple[dict, bytes]:
    """The weights file's header (a dict) and the bytes after it."""
    data = (folder / WEIGHTS).read_bytes()
    (length,) = struct.unpack("<Q", data[:8])
    return json.loads(data[8:8 + length]), data[8 + length:]


def write_raw(folder: Path, header, body: bytes, header_bytes: bytes | None = None) -> None:
    """Write a weights file from a header (any JSON, or exact bytes) and a body, unchecked."""
    text = json.dumps(header).encode() if header_bytes is None else header_bytes
    (folder / WEIGHTS).write_bytes(struct.pack("<Q", len(text)) + text + body)
