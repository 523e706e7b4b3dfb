"""The LoRA shrink/expand Triton kernels equal the plain-torch reference, under the interpreter.

The checks (tests/lora_kernel_checks.py) run once in a subprocess with TRITON_INTERPRET=1: the
setting is read when a kernel is decorated, so it must come before triton's first import, and it
must not reach other tests (or the processes they start). Each check is reported here as its own
test. Tiny shapes; about 20 s in all.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.lora_kernel_checks import CHECKS

REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                reason="triton is not installed (the test extra has it on Linux "
                                       "x86_64; pip install 'triton>=3.0')")


@pytest.fixture(scope="module")
def interpreted_results() -> dict:
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, "-m", "tests.lora_kernel_checks"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)
    if proc.returncode != 0 or not proc.stdout.strip():
        pytest.fail(f"the interpreted checks did not run (exit {proc.returncode}):\n"
                    f"{proc.stderr[-4000:]}", pytrace=False)
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("name", list(CHECKS))
def test_lora_kernel_interpreted(name: str, interpreted_results: dict) -> None:
    result = interpreted_results[name]
    if result["outcome"] != "ok":
        pytest.fail(f"{name} ({result['seconds']} s):\n{result['outcome']}", pytrace=False)
