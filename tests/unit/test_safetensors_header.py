"""The hand-written safetensors header parser: files the safetensors library writes parse to the
same tensors; malformed files are refused with a message that says what is wrong, never a
traceback. Needs no torch and no model.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

from lorad.config.adapters import AdapterArg, load_adapter
from lorad.config.errors import ConfigError
from lorad.config.safetensors_header import read_safetensors_header
from tests.adapter_folders import write_raw

A = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
B = "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"


def good_header() -> dict:
    return {"__metadata__": {"format": "pt"},
            A: {"dtype": "F32", "shape": [2, 4], "data_offsets": [0, 32]},
            B: {"dtype": "F32", "shape": [4, 2], "data_offsets": [32, 64]}}


def parse(path: Path):
    return read_safetensors_header(path, "adapter_model.safetensors")


def refused(path: Path, *needles: str) -> str:
    with pytest.raises(ConfigError) as exc:
        parse(path)
    message = str(exc.value)
    assert message.startswith("adapter_model.safetensors: ") and "\n" not in message
    for needle in needles:
        assert needle in message, (needle, message)
    return message


def test_library_written_file_parses(tmp_path):
    tensors = {A: np.arange(8, dtype=np.float32).reshape(2, 4),
               B: np.ones((4, 2), dtype=np.float16)}
    save_file(tensors, tmp_path / "adapter_model.safetensors", metadata={"format": "pt"})
    header = parse(tmp_path / "adapter_model.safetensors")
    assert header.metadata == {"format": "pt"} and set(header.tensors) == {A, B}
    a = header.tensors[A]
    assert (a.dtype, a.shape, a.num_bytes) == ("F32", (2, 4), 32)
    raw = (tmp_path / "adapter_model.safetensors").read_bytes()
    assert np.frombuffer(raw[a.start:a.end], np.float32).tolist() == list(range(8))


@pytest.mark.parametrize("mutate,needles", [
    (lambda h: h[A].update(dtype="F99"), (repr(A), "dtype 'F99'")),
    (lambda h: h[A].update(dtype=7), ("dtype 7",)),
    (lambda h: h[A].update(shape=[2, -4]), ("shape must be a list of non-negative integers",)),
    (lambda h: h[A].update(shape="2x4"), ("shape",)),
    (lambda h: h[A].update(data_offsets=[0]), ("data_offsets must be [begin, end]",)),
    (lambda h: h[A].update(data_offsets=[32, 0]), ("data_offsets must be [begin, end]",)),
    (lambda h: h[A].update(data_offsets=[0, 16]), ("span 16 bytes", "needs 32")),
    (lambda h: h[B].update(data_offsets=[16, 48]), (repr(B), "overlaps", repr(A))),
    (lambda h: h[A].update(shape=[2, 3], data_offsets=[0, 24]),
     ("8 bytes before tensor", "belong to no")),
    (lambda h: h[B].update(data_offsets=[64, 96]), ("runs past the end of the file",)),
    (lambda h: h[A].pop("data_offsets"), ("exactly the fields dtype, shape and data_offsets",)),
    (lambda h: h[A].update(extra=1), ("exactly the fields",)),
    (lambda h: h.update({A: [1, 2]}), ("expected an object",)),
    (lambda h: h.update(__metadata__={"format": 1}),
     ("__metadata__ must be an object of strings",)),
])
def test_malformed_entries(tmp_path, mutate, needles):
    header = good_header()
    mutate(header)
    write_raw(tmp_path, header, bytes(64))
    refused(tmp_path / "adapter_model.safetensors", *needles)


def test_trailing_bytes_after_the_last_tensor(tmp_path):
    write_raw(tmp_path, good_header(), bytes(80))
    refused(tmp_path / "adapter_model.safetensors", "16 bytes after the last tensor")


@pytest.mark.parametrize("content,needles", [
    (b"", ("the file is 0 bytes, too short",)),
    (b"\x05\x00\x00", ("the file is 3 bytes, too short",)),
    (struct.pack("<Q", 1 << 40) + b"{}", ("header length 1099511627776 is absurd",)),
    (struct.pack("<Q", 500) + b"{}",
     ("header length 500 runs past the end of the file (10 bytes)",)),
    (struct.pack("<Q", 4) + b"{abc", ("header is not valid JSON",)),
    (struct.pack("<Q", 2) + b"\xff\xfe", ("header is not valid JSON",)),
    (struct.pack("<Q", 6) + b"[1, 2]", ("header is a JSON list, not an object",)),
    (struct.pack("<Q", 3) + b"NaN", ("header is not valid JSON",)),
])
def test_malformed_prefix_and_json(tmp_path, content, needles):
    (tmp_path / "adapter_model.safetensors").write_bytes(content)
    refused(tmp_path / "adapter_model.safetensors", *needles)


def test_duplicate_tensor_names(tmp_path):
    text = json.dumps(good_header())[:-1] + ", " + json.dumps({A: good_header()[A]})[1:]
    write_raw(tmp_path, None, bytes(64), header_bytes=text.encode())
    refused(tmp_path / "adapter_model.safetensors", f"header names {A!r} twice")


def test_truncated_file_through_load_adapter(tmp_path):
    """The adapter-level message: flag, then file, then what is wrong."""
    (tmp_path / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": 2, "lora_alpha": 2, "target_modules": ["q_proj"]}))
    write_raw(tmp_path, good_header(), bytes(40))
    with pytest.raises(ConfigError) as exc:
        load_adapter(AdapterArg("sql", str(tmp_path)), 1, None)
    assert str(exc.value) == (
        f"--adapter sql={tmp_path}: adapter_model.safetensors: tensor {B!r} runs past the end "
        f"of the file (data_offsets end at byte {8 + len(json.dumps(good_header())) + 64}, "
        f"file is {8 + len(json.dumps(good_header())) + 40})")
