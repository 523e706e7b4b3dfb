"""An adapter's identity key: one sha256 over what it computes, read from its factor bytes.

Two adapters get the same key exactly when they have the same modules, the same factor bytes
(dtype and shape included) and the same final scales, whatever their names, folders or file
layout; prefix caches and spilled KV are shared only under one key. Reading the bytes here also
refuses factors holding NaN or infinity. Version 1 of the layout below; change it, change the tag.
"""

from __future__ import annotations

import hashlib
import json
import mmap
from pathlib import Path

from lorad.config.errors import ConfigError
from lorad.config.lora_module import LoraModule
from lorad.config.safetensors_header import TensorEntry

KEY_TAG = b"lorad-adapter-key/1\n"
# Exponent bits of each float dtype lorad serves: all ones means infinity or NaN.
_EXPONENT_MASKS = {"F32": ("<u4", 0x7F800000), "F16": ("<u2", 0x7C00), "BF16": ("<u2", 0x7F80)}


def identity_key(modules: tuple[LoraModule, ...], tensors: dict[str, TensorEntry],
                 weights_file: Path, label: str) -> str:
    """sha256 hex over, per module in `modules`' order (canonical: layer, then projection):
    a JSON line [layer, module, rank, scale as float.hex(), A dtype, A shape, B dtype, B shape],
    then A's bytes and B's bytes as stored (little-endian)."""
    digest = hashlib.sha256(KEY_TAG)
    digest.update(f"{len(modules)}\n".encode())
    try:
        with open(weights_file, "rb") as f, _map(f) as data:
            for m in modules:
                a, b = tensors[m.a_tensor], tensors[m.b_tensor]
                line = [m.layer, m.module, m.rank, float(m.scale).hex(),
                        a.dtype, list(a.shape), b.dtype, list(b.shape)]
                digest.update(json.dumps(line, separators=(",", ":")).encode() + b"\n")
                for entry in (a, b):
                    with memoryview(data)[entry.start:entry.end] as view:
                        finite = _all_finite(view, entry.dtype)
                        digest.update(view)
                    if not finite:
                        raise ConfigError(f"{label}: tensor {entry.name!r} holds NaN or "
                                          "infinite values")
    except OSError as exc:
        raise ConfigError(f"{label}: cannot read: {exc.strerror or exc}") from None
    return digest.hexdigest()


def _map(f):
    # mmap refuses empty files; a file with no tensor data cannot reach here (the header check
    # requires at least the 8-byte prefix), but an empty mapping would still be an error.
    return mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)


def _all_finite(view: memoryview, dtype: str) -> bool:
    import numpy as np  # only here: the rest of lorad.config needs no numpy

    # The array borrows the mapping; it must be gone before the mapping closes, so no exception
    # may leave here while it lives.
    kind, mask = _EXPONENT_MASKS[dtype]
    bits = np.frombuffer(view, dtype=kind)
    return not bool(np.any((bits & mask) == mask))
