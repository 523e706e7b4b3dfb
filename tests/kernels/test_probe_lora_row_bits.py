"""benchmarks/probe_lora_row_bits.py, the GPU diagnostic of which rows' LoRA bits move with the batch,
runs here on the CPU under triton's interpreter at a tiny shape, where every row keeps its bits."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                reason="triton is not installed (the `gpu` extra)")


def probe(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    return subprocess.run([sys.executable, "-m", "benchmarks.probe_lora_row_bits", *args],
                          capture_output=True, text=True, timeout=300, env=env, cwd=REPO)


def test_every_row_keeps_its_bits_under_the_interpreter():
    done = probe("--shape", "pair", "--rows", "24")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "the same batch twice gives the same bits: True" in done.stdout
    edited = [line for line in done.stdout.splitlines() if line.startswith("rows with other")]
    assert len(edited) == 1 and edited[0].split(": ")[1].startswith("0 of "), done.stdout
    assert int(edited[0].split(" of ")[1]) > 10, done.stdout  # most of the 24 rows have adapters


def test_names_an_unknown_shape():
    done = probe("--shape", "nope")
    assert done.returncode == 2
    assert "no shape 'nope'; one of qkv, pair, one, long_k" in done.stderr
