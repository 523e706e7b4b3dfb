"""The paged attention kernels (decode, prefill, KV write) under Triton's CPU interpreter, against
the plain-torch reference, and the CUDA attention path against the per-sequence CPU path.

The checks (tests/paged_attention_checks.py) run in one subprocess with TRITON_INTERPRET=1: the
variable must be set before triton is imported and the interpreter is patched there, so neither
leaks into the other test modules. Tiny shapes: 2 KV heads, head_dim 16, blocks of 4 tokens,
decode splits of 32 tokens in tiles of 16.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.paged_attention_checks import CHECKS

REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                reason="triton is not installed (the `gpu` extra): no kernels "
                                       "to interpret")


@pytest.fixture(scope="module")
def results() -> dict[str, dict]:
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "tests.paged_attention_checks"], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=600)
    if proc.returncode != 0 or not proc.stdout.strip():
        pytest.fail(f"the interpreter run failed (exit {proc.returncode}):\n"
                    f"{proc.stderr[-4000:]}", pytrace=False)
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("name", list(CHECKS))
def test_kernel_check(results, name):
    assert name in results, f"{name} did not run"
    outcome = results[name]["outcome"]
    assert outcome == "ok", f"{name} failed under the Triton interpreter:\n{outcome}"
