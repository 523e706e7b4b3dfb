"""The fused elementwise kernels on CUDA at Llama-3-8B's sizes (hidden 4096, intermediate 14336,
32 query / 8 KV heads of 128, q/k/v LoRA tables of rank 16): against the torch path, with
poisoned outputs, a row alone equal to the row in a batch. The checks are
tests/kernels/fused_ops_checks.py's, which the CPU interpreter runs on tiny shapes.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from tests.kernels.fused_ops_checks import (check_add_rms_norm, check_lora_deltas_added,
                                    check_rotary_write_kv, check_silu_and_mul)

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device"),
              pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                 reason="triton is not installed (the `gpu` extra)")]

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


@pytest.mark.parametrize("dtype", DTYPES)
def test_add_rms_norm(dtype):
    check_add_rms_norm("cuda", DTYPES[dtype], hidden=4096, num_rows=67)


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul(dtype):
    check_silu_and_mul("cuda", DTYPES[dtype], n=14336, num_rows=33)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_write_kv(dtype):
    check_rotary_write_kv("cuda", DTYPES[dtype], num_q_heads=32, num_kv_heads=8, head_dim=128,
                          block_size=16)


@pytest.mark.parametrize("dtype", DTYPES)
def test_lora_deltas_added(dtype):
    check_lora_deltas_added("cuda", DTYPES[dtype], hidden=4096, n=14336, num_q_heads=32,
                            num_kv_heads=8, head_dim=128)
