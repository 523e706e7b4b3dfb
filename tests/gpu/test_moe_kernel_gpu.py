"""The fused MoE kernel on CUDA at Qwen1.5-MoE-A2.7B's expert shapes (hidden 2048, 60 experts
of intermediate 1408, top 4; and one rank's 704 of them at --parallel 2): against the torch
path with poisoned buffers, a row alone equal to the row in a batch, the expert tiles; the
block's glue kernels (route, tile tables, epilogue, the block's kernel path) bit for bit against
the torch ops they replace. The checks are tests/kernels/moe_kernel_checks.py's and
moe_glue_checks.py's, which the CPU interpreter runs on tiny shapes.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from tests.kernels.moe_glue_checks import (check_block, check_epilogue, check_epilogue_add_norm,
                                           check_route, check_route_picks, check_tile_cover,
                                           check_tiles_kernel)
from tests.kernels.moe_kernel_checks import (check_expert_tiles, check_fused_moe,
                                             check_padding_rows, check_rows_alone)

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device"),
              pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                 reason="triton is not installed (the `gpu` extra)")]

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
SHAPE = dict(hidden=2048, num_experts=60, top_k=4)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("inter", [1408, 704])
@pytest.mark.parametrize("num_rows", [1, 33, 256])
def test_fused_moe(dtype, inter, num_rows):
    check_fused_moe("cuda", DTYPES[dtype], num_rows=num_rows, inter=inter, **SHAPE)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rows_alone(dtype):
    check_rows_alone("cuda", DTYPES[dtype], num_rows=24, inter=1408, hidden=2048,
                     num_experts=4, top_k=2)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_real", [1, 5])
def test_padding_rows(dtype, num_real):
    check_padding_rows("cuda", DTYPES[dtype], num_real=num_real, inter=1408, hidden=2048,
                       num_experts=60, top_k=4)


def test_expert_tiles():
    check_expert_tiles("cuda", num_rows=257, num_experts=60, top_k=4)


# The block's glue kernels (kernels/moe_glue.py, the one-program tile tables): bit for bit
# against the torch ops they replace, at the Qwen1.5-MoE-A2.7B shape (tests/kernels/
# moe_glue_checks.py's checks).

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("norm", [False, True])
@pytest.mark.parametrize("num_rows", [1, 7, 33, 64, 256])
def test_route(dtype, norm, num_rows):
    check_route("cuda", DTYPES[dtype], num_rows, norm, num_experts=60, top_k=4)


def test_route_ties():
    check_route_picks("cuda")


@pytest.mark.parametrize("num_rows", [1, 8, 33, 64, 128])
def test_tiles_kernel(num_rows):
    check_tiles_kernel("cuda", num_rows, num_experts=60, top_k=4)


def test_tile_cover():
    """The tables of tile_bound's tiles place every pair, at the bound's extremes."""
    check_tile_cover("cuda")


@pytest.mark.parametrize("num_rows,block_p", [(1, 16), (8, 32), (16, 64), (9, 64)])
def test_tiles_kernel_small_block(num_rows, block_p):
    """The small steps' pair block (MoeConfig.small_step_rows)."""
    check_tiles_kernel("cuda", num_rows, num_experts=60, top_k=4, block_p=block_p)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_rows", [1, 8, 300])
def test_epilogue(dtype, num_rows):
    check_epilogue("cuda", DTYPES[dtype], num_rows=num_rows, hidden=2048, top_k=4)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_rows", [1, 8, 300])
def test_epilogue_add_norm(dtype, num_rows):
    """The epilogue in the next residual add + norm's launch (MoeConfig.fold_epilogue)."""
    check_epilogue_add_norm("cuda", DTYPES[dtype], num_rows=num_rows, hidden=2048, top_k=4)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_rows", [1, 8, 16, 33, 200])
def test_block(dtype, num_rows):
    check_block("cuda", DTYPES[dtype], num_rows, hidden=2048, num_experts=60, top_k=4,
                inter=1408, shared_inter=5632)


@pytest.mark.parametrize("num_rows", [1, 16])
def test_block_with_pdl(num_rows):
    """The block's kernels launched with PDL (MoeConfig.pdl): the same bits."""
    check_block("cuda", torch.bfloat16, num_rows, hidden=2048, num_experts=60, top_k=4,
                inter=1408, shared_inter=5632, pdl=True)
