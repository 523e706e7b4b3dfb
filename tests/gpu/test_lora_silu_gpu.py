"""gate/up's LoRA expand fused with silu * up (kernels/lora_expand_silu.py) on CUDA at the 8B
model's gate/up shape (hidden 4096, intermediate 14336, 64 adapters of ranks up to 16 and 32):
bit for bit what lora_expand adding into gate and up in place, then silu * up, gives, at 256, 512
and 2048 rows of several adapters and slot 0, with gate, up or both edited, strengths other than
1.0; bf16 tables and outputs as served, fp32 ones where an fp32 ulp of a delta shows.

The checks are tests/kernels/lora_silu_checks.py, the same the interpreter runs on tiny shapes.
What they rest on: the fused kernel computes each delta with the expand's own helpers at the
expand's tile (so the same sums and MMA shapes, neither fusing a multiply-add), which only a GPU
can confirm.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from tests.kernels.lora_silu_checks import (GPU_SHAPE,
                                            check_expand_silu_matches_expand_then_silu)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                       reason="triton is not installed"),
]


@pytest.mark.parametrize("num_rows", [256, 512, 2048])
def test_matches_expand_in_place_then_silu(num_rows: int) -> None:
    check_expand_silu_matches_expand_then_silu("cuda", GPU_SHAPE, (num_rows,), seed=num_rows)


def test_matches_with_few_programs_looping() -> None:
    """Each program loops over many (tile, block group) items, as a graph sized for any mixture
    would have it; an odd row count."""
    check_expand_silu_matches_expand_then_silu("cuda", GPU_SHAPE, (777,), num_programs=(7,))


def test_matches_with_fp32_tables_and_outputs() -> None:
    check_expand_silu_matches_expand_then_silu("cuda", GPU_SHAPE, (512,), dtype=torch.float32,
                                               seed=3)
