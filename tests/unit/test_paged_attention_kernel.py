"""The paged attention kernels (decode, prefill, KV write) under Triton's CPU interpreter, against
the plain-torch reference, and the CUDA attention path against the per-sequence CPU path.

The checks (tests/paged_attention_checks.py) run in one subprocess with TRITON_INTERPRET=1: the
variable must be set before triton is imported and the interpreter is patched there, so neither
leaks into the other test modules. Tiny shapes: 2 KV heads, head_dim 16, blocks of 4 tokens,
decode splits of 32 tokens in tiles of 16.
"""

from __future__ import annotations

import importlib.util

import pytest

from tests.paged_attention_checks import CHECKS
from tests.triton_interpreter import interpret_in_subprocess

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                reason="triton is not installed (the `gpu` extra): no kernels "
                                       "to interpret")


@pytest.fixture(scope="module")
def results() -> dict:
    try:
        return interpret_in_subprocess("tests.paged_attention_checks")
    except AssertionError as exc:
        pytest.fail(str(exc), pytrace=False)


@pytest.mark.parametrize("name", list(CHECKS))
def test_kernel_check(results, name):
    assert name in results, f"{name} did not run"
    outcome = results[name]["outcome"]
    assert outcome == "ok", f"{name} failed under the Triton interpreter:\n{outcome}"
