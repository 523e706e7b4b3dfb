"""The LoRA shrink/expand Triton kernels equal the plain-torch reference, under the interpreter.

The checks (tests/lora_kernel_checks.py) run once in a subprocess with TRITON_INTERPRET=1: the
setting is read when a kernel is decorated, so it must come before triton's first import, and it
must not reach other tests (or the processes they start). Each check is reported here as its own
test. Tiny shapes; about 20 s in all.
"""

from __future__ import annotations

import importlib.util

import pytest

from tests.lora_kernel_checks import CHECKS
from tests.triton_interpreter import interpret_in_subprocess

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                reason="triton is not installed (the test extra has it on Linux "
                                       "x86_64; pip install 'triton>=3.0')")


@pytest.fixture(scope="module")
def interpreted_results() -> dict:
    try:
        return interpret_in_subprocess("tests.lora_kernel_checks")
    except AssertionError as exc:
        pytest.fail(str(exc), pytrace=False)


@pytest.mark.parametrize("name", list(CHECKS))
def test_lora_kernel_interpreted(name: str, interpreted_results: dict) -> None:
    result = interpreted_results[name]
    if result["outcome"] != "ok":
        pytest.fail(f"{name} ({result['seconds']} s):\n{result['outcome']}", pytrace=False)
