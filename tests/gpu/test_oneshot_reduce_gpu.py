"""The one-shot all-reduce kernels on one CUDA device at Llama-3-8B's hidden size (4096), the
checks of tests/kernels/oneshot_reduce_checks.py: the "ranks" are buffers on that device, which
tests the arithmetic, the halves and the flags, not NVLink or processes meeting.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from tests.kernels.oneshot_reduce_checks import (check_add_rms_norm, check_copies_own_partial,
                                                 check_sum, check_synced)

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device"),
              pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                 reason="triton is not installed (the `gpu` extra)")]

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def test_sum():
    check_sum("cuda", rows=(1, 2, 3, 8, 31, 64, 67), hiddens=(4096, 8192, 1030))


@pytest.mark.parametrize("dtype", DTYPES)
def test_add_rms_norm(dtype):
    check_add_rms_norm("cuda", DTYPES[dtype], rows=(1, 7, 64), hidden=4096)


def test_synced():
    check_synced("cuda", rows=(64, 1, 33, 7), hidden=4096, num_programs=32)


def test_copies_own_partial():
    check_copies_own_partial("cuda", num_rows=33, hidden=4096)
