"""lorad's host-side launch sizes equal triton's own functions on every size the launches pass."""

from __future__ import annotations

import importlib.util

import pytest

from lorad.workers.kernels.launch_math import cdiv, next_power_of_2

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                reason="triton is not installed (the `gpu` extra)")


def test_cdiv_equals_triton():
    import triton
    for x in range(0, 5000, 7):
        for y in (1, 2, 3, 16, 64, 128, 512, 4096):
            assert cdiv(x, y) == triton.cdiv(x, y), (x, y)
    assert cdiv(128256, 4096) == 32 and cdiv(14336, 512) == 28


def test_next_power_of_2_equals_triton():
    import triton
    for n in list(range(1, 5000)) + [2**k + d for k in range(12, 20) for d in (-1, 0, 1)]:
        assert next_power_of_2(n) == triton.next_power_of_2(n), n
