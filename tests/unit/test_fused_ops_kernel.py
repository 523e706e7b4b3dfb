"""The fused elementwise kernels (residual add + RMSNorm, rotary + KV write, silu * up) under
Triton's CPU interpreter, against the torch path they replace.

The checks (tests/fused_ops_checks.py) run in one subprocess with TRITON_INTERPRET=1, so the
interpreter's setting and patches stay out of the other tests; each is reported as its own test.
Tiny shapes, a few seconds in all.
"""

from __future__ import annotations

import importlib.util

import pytest

from tests.fused_ops_checks import CHECKS
from tests.triton_interpreter import interpret_in_subprocess

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                reason="triton is not installed (the test extra has it on Linux "
                                       "x86_64)")


@pytest.fixture(scope="module")
def results() -> dict[str, dict]:
    try:
        return interpret_in_subprocess("tests.fused_ops_checks")
    except AssertionError as exc:
        pytest.fail(str(exc), pytrace=False)


@pytest.mark.parametrize("name", list(CHECKS))
def test_fused_kernel_interpreted(results, name):
    assert name in results, f"{name} did not run"
    outcome = results[name]["outcome"]
    assert outcome == "ok", f"{name} failed under the Triton interpreter:\n{outcome}"
